"""A pretrained model's blocks in torch: the family's embeddings, attention and feed-forward.

Each block's attention is attnctl's own :class:`AttentionLayer` (with the block's weights
and the family's norm placement), so ``run --model`` records the same stages as ``run``;
the embeddings and the feed-forward around it are written out here as each family
defines them. Weights come from safetensors files only, loaded for the blocks that run.
Only the blocks up to the one shown run; the language-model head never does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors import safe_open

from attnctl.config import LayerConfig
from attnctl.errors import AttnctlError
from attnctl.layer import TORCH_DTYPES, AttentionLayer, _no_record, attention_window
from attnctl.model import EMBEDDING_KEYS, ModelSpec, block_of

Record = Callable[[str, torch.Tensor, str], None]


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # the exact, erf-based one (BERT)
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's tanh approximation
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,  # transformers' other name for SiLU
}


@dataclass
class FeedForward:
    """One block's feed-forward weights, as nn.Linear holds them: (out, in)."""

    norm_weight: torch.Tensor
    norm_bias: torch.Tensor | None
    up: torch.Tensor  # (I, D)
    up_bias: torch.Tensor | None
    down: torch.Tensor  # (D, I)
    down_bias: torch.Tensor | None
    gate: torch.Tensor | None = None  # (I, D), Llama's SwiGLU
    gate_bias: torch.Tensor | None = None


class PretrainedModel:
    """A checkpoint's embeddings and blocks, ready to run one block after another.

    ``blocks``: load the first that many blocks (what ``run --layer N`` needs); None loads
    every tensor of the checkpoint, the whole model whose memory ``memory`` estimates.
    Tensors are held as loaded (transposes and splits are views of them), so the memory
    they take is exactly the checkpoint's in the run's dtype.
    """

    def __init__(
        self, spec: ModelSpec, config: LayerConfig, device: torch.device, blocks: int | None
    ) -> None:
        self.spec, self.config, self.device = spec, config, device
        self.dtype = TORCH_DTYPES[config.dtype]
        self.activation = ACTIVATIONS[spec.activation]
        self.tensors = self._load(blocks)
        if blocks is not None:  # a run shows weights: it needs real ones, not a header's zeros
            embedding = self.tensors[spec.prefix + EMBEDDING_KEYS[spec.family]]
            if not embedding.any():
                raise AttnctlError(
                    f"the token embedding in {spec.path} is all zeros: a header-only "
                    "checkpoint? run needs the trained weights (shapes and memory read only "
                    "the headers)"
                )
        count = spec.layers if blocks is None else blocks
        self.blocks = [
            (self.attention_layer(n), self.feed_forward_weights(n)) for n in range(count)
        ]

    # ------------------------------------------------------------ weights

    def _load(self, blocks: int | None) -> dict[str, torch.Tensor]:
        spec = self.spec
        if blocks is None:
            keys = list(spec.weights())
        else:
            keys = [spec.weight(name) for name in spec.expected_shapes() if block_of(name) < blocks]
        by_file: dict[str, list[str]] = {}
        for key in keys:
            by_file.setdefault(spec.tensors[key].file, []).append(key)
        tensors = {}
        for file, file_keys in by_file.items():
            try:
                with safe_open(str(spec.path / file), framework="pt", device="cpu") as handle:
                    for key in file_keys:
                        stored = handle.get_tensor(spec.tensors[key].stored_as)
                        tensors[key] = stored.to(device=self.device, dtype=self.dtype)
            except Exception as error:  # safetensors raises its own error types
                reason = str(error).splitlines()[0] if str(error) else type(error).__name__
                raise AttnctlError(f"cannot read {spec.path / file}: {reason}") from error
        return tensors

    @property
    def parameter_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def tensor(self, name: str) -> torch.Tensor:
        """A loaded tensor by the family's name for it (the checkpoint's prefix added)."""
        return self.tensors[self.spec.weight(name)]

    def _optional(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(self.spec.weight(name))

    def attention_layer(self, n: int) -> AttentionLayer:
        """Block n's attention: W_q, W_k, W_v, W_o and the norm, in attnctl's layer."""
        spec, state = self.spec, {}
        if spec.family == "bert":
            base = f"encoder.layer.{n}.attention."
            names = {
                "W_q": base + "self.query",
                "W_k": base + "self.key",
                "W_v": base + "self.value",
                "W_o": base + "output.dense",
                "norm": base + "output.LayerNorm",
            }
            for ours, theirs in names.items():
                state[f"{ours}.weight"] = self.tensor(f"{theirs}.weight")
                state[f"{ours}.bias"] = self.tensor(f"{theirs}.bias")
        elif spec.family == "gpt2":
            base = f"h.{n}."
            d = spec.hidden
            # Conv1D keeps (in, out); c_attn's output columns are Q, K, V side by side
            fused = self.tensor(base + "attn.c_attn.weight").t()  # (3D, D), a view
            fused_bias = self.tensor(base + "attn.c_attn.bias")  # (3D,)
            for i, ours in enumerate(("W_q", "W_k", "W_v")):
                state[f"{ours}.weight"] = fused[i * d : (i + 1) * d]  # (D, D), a view
                state[f"{ours}.bias"] = fused_bias[i * d : (i + 1) * d]  # (D,), a view
            state["W_o.weight"] = self.tensor(base + "attn.c_proj.weight").t()  # (D, D)
            state["W_o.bias"] = self.tensor(base + "attn.c_proj.bias")
            state["norm.weight"] = self.tensor(base + "ln_1.weight")
            state["norm.bias"] = self.tensor(base + "ln_1.bias")
        else:
            base = f"layers.{n}."
            for ours, theirs in (("W_q", "q"), ("W_k", "k"), ("W_v", "v"), ("W_o", "o")):
                state[f"{ours}.weight"] = self.tensor(f"{base}self_attn.{theirs}_proj.weight")
                if spec.bias and (ours != "W_o" or spec.output_bias):
                    state[f"{ours}.bias"] = self.tensor(f"{base}self_attn.{theirs}_proj.bias")
            state["norm.weight"] = self.tensor(base + "input_layernorm.weight")
        with torch.device("meta"):  # no random init: every weight used comes from the file
            layer = AttentionLayer(self.config, vocab_size=1)
        layer.load_state_dict(state, strict=False, assign=True)  # the unused embedding stays meta
        return layer.eval()

    def feed_forward_weights(self, n: int) -> FeedForward:
        spec = self.spec
        if spec.family == "bert":
            base = f"encoder.layer.{n}."
            return FeedForward(
                norm_weight=self.tensor(base + "output.LayerNorm.weight"),
                norm_bias=self.tensor(base + "output.LayerNorm.bias"),
                up=self.tensor(base + "intermediate.dense.weight"),
                up_bias=self.tensor(base + "intermediate.dense.bias"),
                down=self.tensor(base + "output.dense.weight"),
                down_bias=self.tensor(base + "output.dense.bias"),
            )
        if spec.family == "gpt2":
            base = f"h.{n}."
            return FeedForward(
                norm_weight=self.tensor(base + "ln_2.weight"),
                norm_bias=self.tensor(base + "ln_2.bias"),
                up=self.tensor(base + "mlp.c_fc.weight").t(),  # (I, D), a view
                up_bias=self.tensor(base + "mlp.c_fc.bias"),
                down=self.tensor(base + "mlp.c_proj.weight").t(),  # (D, I), a view
                down_bias=self.tensor(base + "mlp.c_proj.bias"),
            )
        base = f"layers.{n}.mlp."
        return FeedForward(
            norm_weight=self.tensor(f"layers.{n}.post_attention_layernorm.weight"),
            norm_bias=None,
            up=self.tensor(base + "up_proj.weight"),
            up_bias=self._optional(base + "up_proj.bias"),
            down=self.tensor(base + "down_proj.weight"),
            down_bias=self._optional(base + "down_proj.bias"),
            gate=self.tensor(base + "gate_proj.weight"),
            gate_bias=self._optional(base + "gate_proj.bias"),
        )

    # ------------------------------------------------------------ forward

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        if self.spec.family == "llama":
            return F.rms_norm(x, (x.shape[-1],), weight, self.spec.norm_eps)
        return F.layer_norm(x, (x.shape[-1],), weight, bias, self.spec.norm_eps)

    def embed(self, token_ids: torch.Tensor, record: Record = _no_record) -> torch.Tensor:
        """The family's embeddings: what its first block reads, (B, L, D)."""
        spec = self.spec
        seq_len = token_ids.shape[1]
        name = {"bert": "embeddings.word_embeddings", "gpt2": "wte", "llama": "embed_tokens"}
        x = F.embedding(token_ids, self.tensor(name[spec.family] + ".weight"))  # (B, L, D)
        record("embeddings", x, "B L D")
        if spec.family == "llama":  # no positions here: RoPE turns Q and K in every block
            return x
        table = "embeddings.position_embeddings.weight" if spec.family == "bert" else "wpe.weight"
        positions = F.embedding(torch.arange(seq_len, device=self.device), self.tensor(table))
        record("positions", positions, "L D")  # (L, D)
        if spec.family == "bert":  # one text: every token in segment 0, added before positions
            segment = self.tensor("embeddings.token_type_embeddings.weight")[0]  # (D,)
            x = x + segment  # (B, L, D)
            x += positions
        else:
            x = x + positions  # (B, L, D)
        del positions
        record("x", x, "B L D")
        if spec.family == "bert":
            weight = self.tensor("embeddings.LayerNorm.weight")
            x = F.layer_norm(
                x, (spec.hidden,), weight, self.tensor("embeddings.LayerNorm.bias"), spec.norm_eps
            )  # (B, L, D)
            record("embedding_norm", x, "B L D")
        return x

    def feed_forward(self, n: int, x: torch.Tensor, record: Record = _no_record) -> torch.Tensor:
        """Block n's feed-forward on its attention output x (B, L, D), residual and norm."""
        w = self.blocks[n][1]
        h = x
        if self.spec.family != "bert":  # pre-norm
            h = self._norm(x, w.norm_weight, w.norm_bias)  # (B, L, D)
            record("ffn_norm", h, "B L D")
        if w.gate is not None:  # SwiGLU: down(silu(gate(h)) * up(h))
            gate = F.linear(h, w.gate, w.gate_bias)  # (B, L, I)
            record("ffn_gate", gate, "B L I")
            inner = self.activation(gate)  # (B, L, I)
            del gate
            record("ffn_act", inner, "B L I")
            up = F.linear(h, w.up, w.up_bias)  # (B, L, I)
            del h
            record("ffn_up", up, "B L I")
            inner *= up
            del up
            record("ffn_product", inner, "B L I")
        else:
            up = F.linear(h, w.up, w.up_bias)  # (B, L, I)
            del h
            record("ffn_up", up, "B L I")
            inner = self.activation(up)  # (B, L, I)
            del up
            record("ffn_act", inner, "B L I")
        out = F.linear(inner, w.down, w.down_bias)  # (B, L, D)
        del inner
        record("ffn_down", out, "B L D")
        out += x  # the residual, in place
        record("ffn_residual", out, "B L D")
        if self.spec.family == "bert":  # post-norm
            out = self._norm(out, w.norm_weight, w.norm_bias)  # (B, L, D)
            record("ffn_norm", out, "B L D")
        return out

    def run(
        self,
        token_ids: torch.Tensor,
        last: int,
        record: Record = _no_record,
        recorded: int | None = None,
        padding: torch.Tensor | None = None,
        window: Callable[[int, AttentionLayer, torch.Tensor, torch.Tensor | None], None]
        | None = None,
    ) -> torch.Tensor:
        """Run blocks 0..last; returns block ``last``'s output (B, L, D).

        ``recorded``: the block whose stages go to ``record`` (the embeddings are recorded
        with it). ``window(n, layer, block_input, weights)`` is called right after each
        block's attention, while its input and full weights (math path) are still alive.
        """
        if recorded is not None:
            record("token_ids", token_ids, "B L")
            if padding is not None:
                record("padding_mask", padding, "B L")
        hidden = self.embed(token_ids, record if recorded is not None else _no_record)
        for n in range(last + 1):
            block_record = record if n == recorded else _no_record
            layer = self.blocks[n][0]
            result = layer.forward(
                None,
                block_record,
                keep_weights=window is not None,
                embeddings=hidden,
                padding=padding,
                input_name="hidden" if n > 0 else None,
            )
            if window is not None:
                window(n, layer, hidden, result.weights)
            hidden = result.output
            del result
            hidden = self.feed_forward(n, hidden, block_record)
        return hidden


def weights_window(
    layer: AttentionLayer,
    block_input: torch.Tensor,
    weights: torch.Tensor | None,
    heads: list[int],
    rows: list[int],
    padding: torch.Tensor | None,
) -> torch.Tensor:
    """The weights shown: sliced from the math path's, or computed for those rows alone."""
    if weights is not None:
        return weights[:, heads][:, :, rows]  # (B, h, r, L)
    return attention_window(layer, None, heads, rows, padding, embeddings=block_input)
