"""The plan of the embeddings: token ids -> vectors, plus positions where they are added.

The torch twin is ``attnctl/nn/embeddings.py``.
"""

from __future__ import annotations

from attnctl.errors import AttnctlError
from attnctl.model.describe import Embeddings
from attnctl.stages import PlanBuilder
from attnctl.stages.collectives import reduce_partial


def plan_embeddings(plan: PlanBuilder, embeddings: Embeddings, length: int) -> str:
    """The text's embeddings (B, L, D); returns the last stage's name."""
    check_positions(embeddings, length)
    lookup = (
        "token embedding lookup"
        if embeddings.trained_by
        else ("embedding lookup: one D-vector per token")
    )
    if plan.tensor_parallel > 1:  # vocab parallel: each rank holds ⌈V/T⌉ rows
        plan.add(
            "vocab_mask",
            "B L",
            ("token_ids",),
            dtype="bool",
            what="the ids outside this rank's rows of the vocabulary",
            # id < first, then | id >= first + rows: that comparison's bools beside it
            scratch=plan.pieces(plan.nbytes("B L", "bool")),
        )
        plan.add(
            "local_ids",
            "B L",
            ("token_ids", "vocab_mask"),
            dtype="int64",
            what="ids minus this rank's first row; those outside set to 0",
        )
        x = plan.add(
            "embeddings",
            "B L D",
            ("local_ids", "vocab_mask"),
            what=f"{lookup} in this rank's rows; outside ids' vectors zeroed in place",
        )
        x = reduce_partial(plan, x, "embedding_")  # each token's vector is on one rank
        if plan.sequence_parallel:
            length //= plan.tensor_parallel  # this rank's tokens from here on
    else:
        x = plan.add("embeddings", "B L D", ("token_ids",), what=lookup)
    if embeddings.scale:  # Gemma: × √D rounded to the dtype; Marian, BART: not rounded
        rounded = " in the dtype" if embeddings.scale_rounded else ""
        x = plan.add(
            "scaled_embeddings", plan.hidden, (x,), what=f"× {embeddings.scale:g} (√D){rounded}"
        )
    rows = "L/T D" if plan.sequence_parallel else "L D"  # the position rows this rank adds
    if embeddings.positions == "sinusoidal":
        positions = plan.add(
            "positions",
            rows,
            what="sinusoidal position table",
            scratch=_sinusoidal_scratch(plan, embeddings.d_model, length),
        )
    elif embeddings.positions == "sinusoidal_halves":  # Marian
        positions = plan.add(
            "positions",
            rows,
            what="sinusoidal table: sin in the first D/2 columns, cos in the rest",
            scratch=_halves_scratch(plan, length),
        )
    elif embeddings.positions == "learned":  # the int64 position ids live during the lookup
        offset = embeddings.position_offset
        positions = plan.add(
            "positions",
            rows,
            what="learned position table rows"
            + (f" {offset}… (position p reads row p + {offset})" if offset else ""),
            scratch=plan.pieces(8 * length),
        )
    else:  # none here: RoPE turns Q and K in every block, ALiBi biases the scores
        return x
    if embeddings.segment:
        what = "embeddings + segment 0's embedding + positions"
    else:
        what = "embeddings + positions"
    x = plan.add("x", plan.hidden, (x, positions), what=what)
    if embeddings.norm == "layer":
        x = plan.add("embedding_norm", plan.hidden, (x,), what="LayerNorm over D")
    return x


def plan_context_embeddings(plan: PlanBuilder, embeddings: Embeddings, length: int) -> str:
    """The context's embeddings (B, Lc, D), embedded as the text is: the keys and values
    of a cross-attention."""
    check_positions(embeddings, length)
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
            scratch=_sinusoidal_scratch(plan, embeddings.d_model, length),
        )
    elif embeddings.positions == "learned":
        positions = plan.add(
            "context_positions",
            "Lc D",
            what="learned position table rows",
            scratch=plan.pieces(8 * length),
        )
    else:
        return x
    return plan.add("context_x", "B Lc D", (x, positions), what="embeddings + positions")


def _sinusoidal_scratch(plan: PlanBuilder, d_model: int, length: int) -> int:
    """float32 scratch while the table is built: positions (L), frequencies (⌈D/2⌉),
    angles (L·⌈D/2⌉) and sin(angles) (L·⌈D/2⌉) before it is written into the table."""
    half = (d_model + 1) // 2
    return plan.pieces(4 * length, 4 * half, 4 * length * half, 4 * length * half)


def _halves_scratch(plan: PlanBuilder, length: int) -> int:
    """What ``nn/positions.sinusoidal_halves`` holds beyond its (L, D) table: the int64
    positions (L) throughout; on the CPU the float64 exponents and frequencies (⌈D/2⌉),
    positions (L), angles (L·⌈D/2⌉) and each of sin and cos (L·⌈D/2⌉) while it is
    rounded into the float32 table (L·D), which a narrower dtype then copies. Built on
    the CPU, a table for a GPU holds only the positions and the table there."""
    ids = 8 * length
    if plan.device.startswith("cuda"):
        return plan.pieces(ids)
    d_model = plan.sizes["D"]
    half = (d_model + 1) // 2
    table32 = 4 * length * d_model
    table = plan.nbytes("L D")
    moments = [
        16 * half,  # exponents and frequencies
        8 * half + 8 * length + 8 * length * half,  # frequencies, positions, angles
        16 * length * half + table32,  # angles, sin (or cos), the float32 table
    ]
    if table != table32:  # .to() the run's dtype: a copy beside the float32 table
        moments.append(table32 + table)
    return ids + max(moments) - table


def check_positions(embeddings: Embeddings, length: int) -> None:
    """A learned (or Marian's) position table must hold every one of ``length`` positions."""
    limited = embeddings.positions in ("learned", "sinusoidal_halves")
    if not limited or length <= embeddings.max_positions:
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
