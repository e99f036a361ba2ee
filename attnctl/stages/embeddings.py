"""The plan of the embeddings: token ids -> vectors, plus positions where they are added.

The torch twin is ``attnctl/nn/embeddings.py``.
"""

from __future__ import annotations

from attnctl.describe import Embeddings
from attnctl.errors import AttnctlError
from attnctl.stages import PlanBuilder


def plan_embeddings(plan: PlanBuilder, embeddings: Embeddings, length: int) -> str:
    """The text's embeddings (B, L, D); returns the last stage's name."""
    _check_length(embeddings, length)
    lookup = (
        "token embedding lookup"
        if embeddings.trained_by
        else ("embedding lookup: one D-vector per token")
    )
    x = plan.add("embeddings", "B L D", ("token_ids",), what=lookup)
    if embeddings.scale:  # Gemma: × √D, rounded to the dtype
        x = plan.add(
            "scaled_embeddings", "B L D", (x,), what=f"× {embeddings.scale:g} (√D) in the dtype"
        )
    if embeddings.positions == "sinusoidal":
        positions = plan.add(
            "positions",
            "L D",
            what="sinusoidal position table",
            scratch=_sinusoidal_scratch(embeddings.d_model, length),
        )
    elif embeddings.positions == "learned":  # the int64 position ids live during the lookup
        positions = plan.add(
            "positions", "L D", what="learned position table rows", scratch=8 * length
        )
    else:  # none here: RoPE turns Q and K in every block, ALiBi biases the scores
        return x
    if embeddings.segment:
        what = "embeddings + segment 0's embedding + positions"
    else:
        what = "embeddings + positions"
    x = plan.add("x", "B L D", (x, positions), what=what)
    if embeddings.norm == "layer":
        x = plan.add("embedding_norm", "B L D", (x,), what="LayerNorm over D")
    return x


def plan_context_embeddings(plan: PlanBuilder, embeddings: Embeddings, length: int) -> str:
    """The context's embeddings (B, Lc, D), embedded as the text is: the keys and values
    of a cross-attention."""
    _check_length(embeddings, length)
    x = plan.add(
        "context_embeddings",
        "B Lc D",
        ("context_ids",),
        what="embedding lookup: one D-vector per token",
    )
    if embeddings.positions == "sinusoidal":
        positions = plan.add(
            "context_positions",
            "Lc D",
            what="sinusoidal position table",
            scratch=_sinusoidal_scratch(embeddings.d_model, length),
        )
    elif embeddings.positions == "learned":
        positions = plan.add(
            "context_positions", "Lc D", what="learned position table rows", scratch=8 * length
        )
    else:
        return x
    return plan.add("context_x", "B Lc D", (x, positions), what="embeddings + positions")


def _sinusoidal_scratch(d_model: int, length: int) -> int:
    """float32 scratch while the table is built: positions (L), frequencies (⌈D/2⌉),
    angles (L·⌈D/2⌉) and sin(angles) (L·⌈D/2⌉) before it is written into the table."""
    half = (d_model + 1) // 2
    return 4 * (length + half + 2 * length * half)


def _check_length(embeddings: Embeddings, length: int) -> None:
    if embeddings.positions != "learned" or length <= embeddings.max_positions:
        return
    if embeddings.trained_by:
        raise AttnctlError(
            f"{length} tokens are more than the {embeddings.max_positions} positions "
            f"{embeddings.trained_by} was trained with"
        )
    raise AttnctlError(
        f"length {length} is longer than the {embeddings.max_positions} learned positions; "
        "raise max_positions or use --pos rope|sinusoidal"
    )
