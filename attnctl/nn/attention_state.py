"""One attention sublayer call in torch, as its steps (``nn/attention.py``) pass it on: what
the call was given (:class:`Call`, with its sizes, :class:`Dims`), the tensors in flight
between the steps (:class:`Live`), and what it returns (:class:`AttentionResult`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnctl.model.config import LayerConfig
from attnctl.model.describe import Attention
from attnctl.nn import Record
from attnctl.nn.collectives import TensorGroup
from attnctl.nn.kv_cache import KVCache
from attnctl.nn.ring_attention import Ring


@dataclass
class AttentionResult:
    output: torch.Tensor  # (B, L, D): after the residual (and the norm when norm == "post")
    attention_output: torch.Tensor  # (B, L, D): W_o(concat), before any residual
    weights: torch.Tensor | None  # (B, H, L, Lk): the math path's, when kept
    window: torch.Tensor | None = None  # (B, h, r, Lk): the weights shown, when asked for
    key_start: int = 0  # the position of the first key the weights cover (a sliding cache)


@dataclass(frozen=True)
class Dims:
    """A sublayer's lengths, and the dims its stages are recorded with."""

    batch: int
    seq_len: int  # the queries': the whole sequence's under sequence parallelism
    key_len: int
    key_len_dim: str  # the keys' length: "L", or "Lc" in cross-attention
    hidden: str  # "B L D", or a sequence-parallel rank's
    q_width: str  # H·d_k: "D", or "D_q" when head_dim is not D / H
    grouped: bool  # grouped-query (GQA) or multi-query attention: Hkv < H
    kv_dims: str  # K and V before the split: "B Lk D_kv", ...
    kv_split: str  # K and V heads: "B Hkv Lk d_k", ...


def dims_of(
    config: LayerConfig,
    x: torch.Tensor,
    group: TensorGroup | None,
    cross: bool,
    context: torch.Tensor | None,
    past: KVCache | None,
) -> Dims:
    """The sizes of x (B, L, D) and of the keys: ``past``'s (K, V reused), else the context's."""
    batch, seq_len = x.shape[:2]
    hidden = "B L D"
    if group is not None:  # under sequence parallelism x holds L / T of the tokens
        seq_len, hidden = group.full_length(seq_len), group.hidden
    key_len = past.length if past is not None else context.shape[1] if cross else seq_len
    key_len_dim = "Lc" if cross else "L"
    q_width = "D" if config.q_width == config.d_model else "D_q"  # D_q: head_dim is not D / H
    grouped = config.kv_heads != config.heads
    kv_width = "D_kv" if grouped else q_width
    kv_dims = f"B {key_len_dim} {kv_width}"
    kv_split = f"B {'Hkv' if grouped else 'H'} {key_len_dim} d_k"
    return Dims(batch, seq_len, key_len, key_len_dim, hidden, q_width, grouped, kv_dims, kv_split)


@dataclass(frozen=True)
class Call:
    """What one ``nn/attention.attention`` call was given besides its tensors, and its sizes."""

    sublayer: Attention
    weights: dict[str, torch.Tensor]
    record: Record
    padding: torch.Tensor | None
    keep_weights: bool
    window: tuple[list[int], list[int]] | None
    training: bool
    offset: int
    position_bias: list[torch.Tensor] | None
    past: KVCache | None
    group: TensorGroup | None
    ring: Ring | None
    dims: Dims


@dataclass
class Live:
    """The tensors a sublayer holds between its steps. A step done with one sets it to None,
    which frees it right there (as ``del`` would in one long function)."""

    x: torch.Tensor | None  # (B, L, D): read again by the residual
    context: torch.Tensor | None  # (B, Lc, D): cross-attention's keys and values come from it
    h: torch.Tensor | None = None  # what W_q, W_k, W_v read: x, or Norm(x), gathered
    shard: torch.Tensor | None = None  # what they keep for a training step under SP
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
