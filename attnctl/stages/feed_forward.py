"""The plan of a feed-forward sublayer, with its norm and residual.

The torch twin is ``attnctl/nn/feed_forward.py``.
"""

from __future__ import annotations

from attnctl.model.describe import NORM_NAMES, FeedForward
from attnctl.stages import PlanBuilder
from attnctl.stages.collectives import gather_sequence, reduce_partial

ACTIVATION_NAMES = {"gelu_new": "gelu (tanh)", "gelu_pytorch_tanh": "gelu (tanh)"}


def plan_feed_forward(plan: PlanBuilder, sublayer: FeedForward, x: str) -> str:
    """Stages of the feed-forward reading ``x``; returns the last stage's name."""
    act = ACTIVATION_NAMES.get(sublayer.activation, sublayer.activation)
    norm = NORM_NAMES[sublayer.norm_type]
    h = x
    if sublayer.placement == "pre":  # the feed-forward reads Norm(x)
        h = plan.add("ffn_norm", plan.hidden, (x,), what=f"{norm} over D, before the FFN")
    h = gather_sequence(plan, h, "ffn_")  # sequence parallel: the whole sequence
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
    partial = " (this rank's I/T columns: a partial sum)" if plan.tensor_parallel > 1 else ""
    out = plan.add("ffn_down", "B L D", (inner,), what="· W_out: I -> D" + partial)
    out = reduce_partial(plan, out, "ffn_", sublayer.bias)  # tensor parallel: the ranks' sum
    if sublayer.output_norm:  # Gemma, OLMo 2: the FFN's output normalised first
        out = plan.add(
            "ffn_post_norm", plan.hidden, (out,), what=f"{norm} over D of the FFN output"
        )
    plan.add(
        "ffn_residual",
        plan.hidden,
        (out, x),
        view_of=out,
        what="+= the FFN's input (in place)",
    )
    if sublayer.placement == "post":
        plan.add("ffn_norm", plan.hidden, ("ffn_residual",), what=f"{norm} over D (post-norm)")
    return plan.last
