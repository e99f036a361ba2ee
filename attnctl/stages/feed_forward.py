"""The plan of a feed-forward sublayer, with its norm and residual.

The torch twin is ``attnctl/nn/feed_forward.py``.
"""

from __future__ import annotations

from attnctl.describe import NORM_NAMES, FeedForward
from attnctl.stages import PlanBuilder

ACTIVATION_NAMES = {"gelu_new": "gelu (tanh)", "gelu_pytorch_tanh": "gelu (tanh)"}


def plan_feed_forward(plan: PlanBuilder, sublayer: FeedForward, x: str) -> str:
    """Stages of the feed-forward reading ``x``; returns the last stage's name."""
    act = ACTIVATION_NAMES.get(sublayer.activation, sublayer.activation)
    norm = NORM_NAMES[sublayer.norm_type]
    h = x
    if sublayer.placement == "pre":  # the feed-forward reads Norm(x)
        h = plan.add("ffn_norm", "B L D", (x,), what=f"{norm} over D, before the FFN")
    if sublayer.gated:  # SwiGLU: down(silu(gate(h)) * up(h))
        plan.add("ffn_gate", "B L I", (h,), what="h · W_gate")
        plan.add("ffn_act", "B L I", ("ffn_gate",), what=act)
        plan.add("ffn_up", "B L I", (h,), what="h · W_up")
        inner = plan.add(
            "ffn_product", "B L I", ("ffn_act", "ffn_up"), view_of="ffn_act", what="act *= up"
        )
    else:
        plan.add("ffn_up", "B L I", (h,), what="h · W_in + b: D -> I")
        inner = plan.add("ffn_act", "B L I", ("ffn_up",), what=act)
    out = plan.add("ffn_down", "B L D", (inner,), what="· W_out: I -> D")
    if sublayer.output_norm:  # Gemma, OLMo 2: the FFN's output normalised first
        out = plan.add("ffn_post_norm", "B L D", (out,), what=f"{norm} over D of the FFN output")
    plan.add(
        "ffn_residual",
        "B L D",
        (out, x),
        view_of=out,
        what="+= the FFN's input (in place)",
    )
    if sublayer.placement == "post":
        plan.add("ffn_norm", "B L D", ("ffn_residual",), what=f"{norm} over D (post-norm)")
    return plan.last
