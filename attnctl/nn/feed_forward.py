"""A feed-forward sublayer in torch, with its norm and residual.

The plan of these stages is ``attnctl/stages/feed_forward.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from attnctl.model.describe import FeedForward
from attnctl.nn import Record, no_record
from attnctl.nn.collectives import (
    TensorGroup,
    column_projection,
    gather_sequence,
    kept_shard,
    output_bias,
    reduce_partial,
)

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # the exact, erf-based one (BERT)
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's tanh approximation
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,  # transformers' other name for SiLU
}


def _norm(
    sublayer: FeedForward, x: torch.Tensor, weights: dict[str, torch.Tensor], name: str = "norm"
) -> torch.Tensor:
    weight = weights[f"{name}.weight"]
    if sublayer.norm_type == "rms":
        return F.rms_norm(x, (x.shape[-1],), weight, sublayer.norm_eps)
    bias = weights.get(f"{name}.bias")
    return F.layer_norm(x, (x.shape[-1],), weight, bias, sublayer.norm_eps)


def feed_forward(
    sublayer: FeedForward,
    weights: dict[str, torch.Tensor],
    owned: list[torch.Tensor],
    record: Record = no_record,
    group: TensorGroup | None = None,
) -> torch.Tensor:
    """The feed-forward on ``owned = [x]`` (B, L, D), which it takes out; (B, L, D).

    ``weights``: its tensors by short name (``up.weight``, ``norm.weight``, ...).
    ``group``: one tensor-parallel rank: its I / T columns of W_up and W_gate and rows of
    W_down, whose partial sums are added over the ranks (``nn/collectives.py``).
    """
    x = owned.pop()
    hidden = "B L D" if group is None else group.hidden  # (B, L/T, D) under SP
    activation = ACTIVATIONS[sublayer.activation]
    h = x
    if sublayer.placement == "pre":
        h = _norm(sublayer, x, weights)  # (B, L, D)
        record("ffn_norm", h, hidden)
    shard = kept_shard(group, h)  # what W_gate, W_up keep for a training step under SP
    h = gather_sequence(group, h, record, "ffn_")  # sequence parallel: the whole sequence
    if sublayer.gated:  # SwiGLU: down(silu(gate(h)) * up(h))
        gate = column_projection(group, h, shard, weights["gate.weight"], weights.get("gate.bias"))
        # (B, L, I)
        record("ffn_gate", gate, "B L I")
        inner = activation(gate)  # (B, L, I)
        del gate
        record("ffn_act", inner, "B L I")
        up = column_projection(group, h, shard, weights["up.weight"], weights.get("up.bias"))
        del h, shard  # (B, L, I) above
        record("ffn_up", up, "B L I")
        inner *= up
        del up
        record("ffn_product", inner, "B L I")
    else:
        up = column_projection(group, h, shard, weights["up.weight"], weights.get("up.bias"))
        del h, shard  # (B, L, I) above
        record("ffn_up", up, "B L I")
        inner = activation(up)  # (B, L, I)
        del up
        record("ffn_act", inner, "B L I")
    bias = weights.get("down.bias")  # under tensor parallelism: added after the sum
    out = F.linear(inner, weights["down.weight"], output_bias(group, bias))  # (B, L, D)
    del inner
    record("ffn_down", out, "B L D")
    out = reduce_partial(group, out, record, "ffn_", bias)  # tensor parallel: the ranks' sum
    if sublayer.output_norm:  # Gemma, OLMo 2: the FFN's output normalised first
        out = _norm(sublayer, out, weights, "post_norm")  # (B, L, D)
        record("ffn_post_norm", out, hidden)
    out += x  # the residual, in place
    del x
    record("ffn_residual", out, hidden)
    if sublayer.placement == "post":
        out = _norm(sublayer, out, weights)  # (B, L, D)
        record("ffn_norm", out, hidden)
    return out
