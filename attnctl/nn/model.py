"""A model description run in torch: the embeddings, then each block's sublayers in order.

One path for the seeded layer (a one-block model) and for checkpoints. Each sublayer is
handed its input as ``[x]`` and takes it out, so nothing here keeps a tensor alive that
the sublayer is done with: the run holds what the plan (``plan.py``) says it holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from attnctl.describe import Attention, ModelDescription
from attnctl.nn import Record, no_record
from attnctl.nn.attention import attention
from attnctl.nn.embeddings import embed, embed_context
from attnctl.nn.feed_forward import feed_forward


@dataclass
class ModelOutput:
    output: torch.Tensor  # (B, L, D): the last block run's output
    attention_output: torch.Tensor | None  # (B, L, D): W_o's, when attention is the last sublayer
    weights: torch.Tensor | None  # (B, H, L, Lk): the last attention's, when kept (math path)
    windows: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> (B, h, r, Lk)


def sublayer_weights(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of one sublayer ("blocks.3.attention.") by their short names."""
    return {name.removeprefix(prefix): t for name, t in weights.items() if name.startswith(prefix)}


def sublayer_prefix(block: int, sublayer: object) -> str:
    kind = "attention" if isinstance(sublayer, Attention) else "feed_forward"
    return f"blocks.{block}.{kind}."


def forward(
    model: ModelDescription,
    weights: dict[str, torch.Tensor],
    token_ids: torch.Tensor | None,
    *,
    last: int = 0,
    record: Record = no_record,
    recorded: int | None = 0,
    embeddings: torch.Tensor | None = None,
    padding: torch.Tensor | None = None,
    context_ids: torch.Tensor | None = None,
    shown: Sequence[int] = (),
    window: tuple[list[int], list[int]] | None = None,
    keep_weights: bool = False,
    training: bool = False,
    cache: list[torch.Tensor] | None = None,
) -> ModelOutput:
    """Run blocks 0..last on token ids (B, L), or on ``embeddings`` (B, L, D) given
    instead of the lookup (positions are still added).

    ``recorded``: the block whose stages go to ``record`` (the inputs and embeddings are
    recorded with it; None records nothing). ``shown``: the blocks whose attention weights
    for ``window`` (heads, rows) are returned. ``padding`` (B, Lk) bool, True = a real key.
    ``context_ids`` (B, Lc): the keys and values of cross-attention sublayers.
    ``cache``: every block's K and V heads are appended, as a decoder's KV cache keeps them.
    """
    recording = record if recorded is not None else no_record
    if token_ids is not None:
        recording("token_ids", token_ids, "B L")
    if context_ids is not None:
        recording("context_ids", context_ids, "B Lc")
    if padding is not None:
        recording("padding_mask", padding, "B Lc" if context_ids is not None else "B L")
    if embeddings is None:
        embeddings = F.embedding(token_ids, weights["embedding.weight"])  # (B, L, D)
    looked_up = [embeddings]
    del embeddings
    hidden = embed(model.embeddings, weights, looked_up, recording)  # (B, L, D)
    context: list[torch.Tensor] = []  # held here while a later block still reads it
    if context_ids is not None:
        context.append(embed_context(model.embeddings, weights, context_ids, recording))
    cross_left = sum(
        s.kind == "cross_attention" for b in model.blocks[: last + 1] for s in b.sublayers
    )
    result = None
    windows: dict[int, torch.Tensor] = {}
    for n in range(last + 1):
        block_record = record if n == recorded else no_record
        if n > 0:
            block_record("hidden", hidden, "B L D")
        for sublayer in model.blocks[n].sublayers:
            own = sublayer_weights(weights, sublayer_prefix(n, sublayer))
            owned = [hidden]  # the sublayer takes its input: freed when it is done with it
            del hidden
            result = None
            if isinstance(sublayer, Attention):
                keys = None
                if sublayer.kind == "cross_attention":
                    cross_left -= 1  # the last reader takes the context: freed after it
                    keys = context if cross_left == 0 else list(context)
                result = attention(
                    sublayer,
                    own,
                    owned,
                    context=keys,
                    padding=padding,
                    record=block_record,
                    keep_weights=keep_weights,
                    window=window if n in shown else None,
                    training=training,
                    cache=cache,
                )
                if result.window is not None:
                    windows[n] = result.window
                hidden = result.output
            else:
                hidden = feed_forward(sublayer, own, owned, block_record)
    if result is None:
        return ModelOutput(hidden, None, None, windows)
    return ModelOutput(hidden, result.attention_output, result.weights, windows)
