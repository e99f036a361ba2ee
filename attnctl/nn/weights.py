"""A model's weights in torch, by the layout's names (``blocks.3.attention.W_q.weight``).

The seeded layer draws its weights from ``torch.manual_seed(config.seed)``, the same on
every machine (drawn in float32 on the CPU, then moved); a checkpoint's come from its
safetensors files through its family's tensor table, for the blocks that run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from attnctl.errors import AttnctlError
from attnctl.model.checkpoint import load, named_views
from attnctl.model.config import LayerConfig
from attnctl.model.describe import ModelDescription
from attnctl.nn.layer import TORCH_DTYPES, AttentionLayer


@dataclass
class Weights:
    named: dict[str, torch.Tensor]  # by the layout's names: what nn/model.py reads
    stored: list[torch.Tensor]  # as held in memory (named ones may be views of these)
    trained: list[torch.Tensor] = field(default_factory=list)  # the stored ones a run reads

    @property
    def parameter_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.stored)


def seeded_layer(config: LayerConfig, vocab_size: int, device: torch.device) -> AttentionLayer:
    """The seeded layer's module: float32 on CPU under the seed, then the run's dtype."""
    torch.manual_seed(config.seed)
    layer = AttentionLayer(config, vocab_size)  # float32 on CPU: same weights anywhere
    return layer.to(device=device, dtype=TORCH_DTYPES[config.dtype])


def model_weights(
    model: ModelDescription,
    config: LayerConfig,
    device: torch.device,
    blocks: int | None,
    head: bool = False,
) -> Weights:
    """The weights of blocks 0..blocks-1 (None: every weight of the checkpoint, the whole
    model whose memory ``memory`` estimates), in ``config``'s dtype; ``head``: and the
    final norm and LM head, which generation reads."""
    if model.checkpoint is None:
        layer = seeded_layer(config, model.vocab_size, device).eval()
        return Weights(layer.weights(), list(layer.parameters()))
    source = model.checkpoint
    stored, named = load(
        source.path,
        source.prefix,
        source.tensors,
        source.table + (source.head_table if head else ()),
        blocks,
        device,
        TORCH_DTYPES[config.dtype],
    )
    if blocks is not None and not named["embedding.weight"].any():
        # a run shows weights: it needs real ones, not a header-only folder's zeros
        raise AttnctlError(
            f"the token embedding in {source.path} is all zeros: a header-only "
            "checkpoint? run needs the trained weights (shapes and memory read only "
            "the headers)"
        )
    return Weights(named, list(stored.values()))


def stacked(weights: Weights, layers: int) -> Weights:
    """The seeded layer's weights as a stack of ``layers`` blocks over its one embedding:
    block 0's tensors cloned for blocks 1 .. layers - 1 (what a stack's forward holds)."""
    block = {k: v for k, v in weights.named.items() if k.startswith("blocks.0.")}
    named, stored = dict(weights.named), list(weights.stored)
    for n in range(1, layers):
        for key, value in block.items():
            copy = value.detach().clone()
            named[key.replace("blocks.0.", f"blocks.{n}.", 1)] = copy
            stored.append(copy)
    return Weights(named, stored)


def trainable_weights(model: ModelDescription, config: LayerConfig, device: torch.device):
    """A checkpoint's every weight, those its blocks read requiring gradients: made so
    before the layout's views of them, which autograd then follows back to them."""
    source = model.source
    stored, _ = load(
        source.path,
        source.prefix,
        source.tensors,
        source.table,
        None,
        device,
        TORCH_DTYPES[config.dtype],
    )
    # Gemma's norms weigh by (1 + w): the offset added before autograd tracks the tensor
    # (an in-place add on a leaf that requires grad is refused), then trained as it is
    table = tuple(dataclasses.replace(e, offset=0) for e in source.table)
    offsets = {e.stored_key(source.prefix): e.offset for e in source.table if e.offset}
    for key, offset in offsets.items():
        stored[key].add_(offset)
    trained = list(dict.fromkeys(stored[e.stored_key(source.prefix)] for e in table))
    for tensor in trained:
        tensor.requires_grad_()
    named = named_views(stored, source.prefix, table)
    return Weights(named, list(stored.values()), trained)
