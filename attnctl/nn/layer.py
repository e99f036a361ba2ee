"""The seeded layer's weights in torch, and what every run needs: dtypes, devices, recording.

:class:`AttentionLayer` creates the tutorials' weights in their order (embedding, then
W_q, W_k, W_v, W_o) so that ``torch.manual_seed(seed)`` before it reproduces seed 000.
It computes nothing itself: its forward runs its one-block description
(:func:`attnctl.model.describe.seeded_model`) through ``nn/model.py``, the path a checkpoint
takes too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from attnctl.errors import AttnctlError
from attnctl.model.config import LayerConfig, resolve_impl
from attnctl.model.describe import seeded_model
from attnctl.nn import Record, no_record
from attnctl.nn.embeddings import embed as embed_vectors
from attnctl.nn.model import forward
from attnctl.trace import Stage

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Recorder:
    """Collects a :class:`Stage` per recorded tensor, without keeping the tensor alive.

    A tensor that shares the memory of an earlier recorded one still alive (the split
    heads) is marked ``view_of`` that stage: it costs no new bytes. Storages are held by
    weak reference, so a freed block that the allocator hands out again is no "view".
    With ``keep`` (``run --save``), a CPU copy of each tensor is kept in ``tensors``,
    by stage name.
    """

    def __init__(self, keep: bool = False) -> None:
        self.stages: list[Stage] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self._keep = keep
        self._storages: list[tuple[str, StorageWeakRef]] = []

    def __call__(self, name: str, tensor: torch.Tensor, dims: str) -> None:
        storage = StorageWeakRef(tensor.untyped_storage())
        view_of = next(
            (n for n, ref in self._storages if not ref.expired() and ref.cdata == storage.cdata),
            None,
        )
        self.stages.append(
            Stage(
                name=name,
                dims=tuple(dims.split()),
                shape=tuple(tensor.shape),
                dtype=dtype_name(tensor.dtype),
                bytes=tensor.numel() * tensor.element_size(),
                device=str(tensor.device),
                view_of=view_of,
            )
        )
        if view_of is None:
            self._storages.append((name, storage))
        if self._keep:  # a copy: the run's own tensor is freed as before
            self.tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()


@dataclass
class LayerOutput:
    output: torch.Tensor  # (B, L, D): after residual + norm when norm == "post"
    attention_output: torch.Tensor  # (B, L, D): W_o(concat), before any residual (kept: returned)
    weights: torch.Tensor | None  # (B, H, L, L) for impl "math" with keep_weights; else None
    window: torch.Tensor | None = None  # (B, h, r, Lk): the shown weights, when asked for


# The seeded layer's parameters under the names every model's weights take in nn/model.py
SEEDED_NAMES = {
    "embedding.weight": "embedding.weight",
    "positions.weight": "positions.weight",
    "W_q.weight": "blocks.0.attention.W_q.weight",
    "W_q.bias": "blocks.0.attention.W_q.bias",
    "W_k.weight": "blocks.0.attention.W_k.weight",
    "W_k.bias": "blocks.0.attention.W_k.bias",
    "W_v.weight": "blocks.0.attention.W_v.weight",
    "W_v.bias": "blocks.0.attention.W_v.bias",
    "W_o.weight": "blocks.0.attention.W_o.weight",
    "W_o.bias": "blocks.0.attention.W_o.bias",
    "norm.weight": "blocks.0.attention.norm.weight",
    "norm.bias": "blocks.0.attention.norm.bias",
    "q_norm.weight": "blocks.0.attention.q_norm.weight",
    "q_norm.bias": "blocks.0.attention.q_norm.bias",
    "k_norm.weight": "blocks.0.attention.k_norm.weight",
    "k_norm.bias": "blocks.0.attention.k_norm.bias",
}


def _norm_module(config: LayerConfig, width: int) -> nn.Module:
    """A LayerNorm or RMSNorm over ``width`` (no random numbers drawn: weights 1, bias 0)."""
    if config.norm_type == "layer":
        return nn.LayerNorm(width, eps=config.norm_eps)
    return nn.RMSNorm(width, eps=config.norm_eps)


class AttentionLayer(nn.Module):
    """Embedding, positions, multi-head attention with explicit W_q, W_k, W_v, W_o, norm.

    Parameters are created in the tutorial's order (embedding, then W_q, W_k, W_v, W_o)
    so that ``torch.manual_seed(seed)`` before construction reproduces seed 000.
    """

    def __init__(self, config: LayerConfig, vocab_size: int) -> None:
        super().__init__()
        self.config = config = resolve_impl(config)  # a layer on its own builds every weight
        self.description = seeded_model(config, vocab_size)
        d_model = config.d_model
        self.embedding = nn.Embedding(vocab_size, d_model)
        q_width = config.q_width  # H·d_k: d_model unless head_dim says otherwise
        self.W_q = nn.Linear(d_model, q_width, bias=config.bias)
        kv_width = config.kv_heads * config.d_k  # narrower than d_model under GQA
        self.W_k = nn.Linear(d_model, kv_width, bias=config.bias)
        self.W_v = nn.Linear(d_model, kv_width, bias=config.bias)
        self.W_o = nn.Linear(q_width, d_model, bias=config.bias and config.output_bias)
        if config.pos == "learned":  # created after W_o so earlier weights keep their values
            self.positions = nn.Embedding(config.max_positions, d_model)
        self.norm = None
        if config.norm != "none":
            self.norm = _norm_module(config, d_model)
        self.q_norm = self.k_norm = None
        if config.qk_norm != "none":  # over each head's d_k, or over all heads at once
            per_head = config.qk_norm == "head"
            self.q_norm = _norm_module(config, config.d_k if per_head else q_width)
            self.k_norm = _norm_module(config, config.d_k if per_head else kv_width)

    def weights(self) -> dict[str, torch.Tensor]:
        """The parameters as the model path names them ("blocks.0.attention.W_q.weight")."""
        return {SEEDED_NAMES[name]: p for name, p in self.named_parameters()}

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Looked-up vectors (B, L, D) plus the positions added to them: the layer's input."""
        return embed_vectors(self.description.embeddings, self.weights(), [x], name=None)

    def forward(
        self,
        token_ids: torch.Tensor | None,
        record: Record = no_record,
        keep_weights: bool = True,
        embeddings: torch.Tensor | None = None,
        padding: torch.Tensor | None = None,
        context_ids: torch.Tensor | None = None,
        window: tuple[list[int], list[int]] | None = None,
    ) -> LayerOutput:
        """Run the layer on token ids, or on ``embeddings`` (B, L, D) given instead of the
        lookup (float64 inputs for gradcheck); arguments as in :func:`nn.model.forward`."""
        description = self.description
        if (context_ids is not None) != self.config.cross:  # a context makes it cross-attention
            cross = dataclasses.replace(self.config, cross=context_ids is not None)
            description = seeded_model(cross, self.description.vocab_size)
        result = forward(
            description,
            self.weights(),
            token_ids,
            record=record,
            embeddings=embeddings,
            padding=padding,
            context_ids=context_ids,
            shown=(0,) if window is not None else (),
            window=window,
            keep_weights=keep_weights,
            training=self.training,
        )
        shown = result.windows.get(0)
        return LayerOutput(result.output, result.attention_output, result.weights, shown)


def resolve_device(spec: str) -> torch.device:
    """auto = cuda, else mps, else cpu; a device that is not there is a usage error."""
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    mps = getattr(torch.backends, "mps", None)
    mps_ok = bool(mps and mps.is_available())
    if spec == "auto":
        return torch.device("cuda" if cuda_count else "mps" if mps_ok else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "mps":
        if not mps_ok:
            raise AttnctlError("device mps is not available on this machine")
        return torch.device("mps")
    index = int(spec.partition(":")[2] or 0)
    if index >= cuda_count:
        have = f"{cuda_count} CUDA device(s)" if cuda_count else "no CUDA device"
        raise AttnctlError(f"device {spec} is not available: torch sees {have}")
    return torch.device(spec)
