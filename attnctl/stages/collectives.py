"""The plan of the collectives a tensor-parallel rank runs between its sublayers.

One place for every collective stage (``attnctl/parallel.py`` says how the model is
split; the torch twin is ``attnctl/nn/collectives.py``). A sublayer's column-parallel
projections (W_q, W_k, W_v; W_up, W_gate) read the whole sequence; its row-parallel one
(W_o; W_down) leaves each rank a partial sum over its heads or inner columns:

- tensor parallel alone: ``all_reduce`` adds the partial sums in place (no new bytes);
- with sequence parallel: ``all_gather`` first makes the whole (B, L, D) input from every
  rank's L / T tokens, and ``reduce_scatter`` then adds the partial sums and keeps each
  rank's L / T tokens of them, a new (B, L/T, D).

Names: the attention's are ``all_reduce``, ``all_gather``, ``reduce_scatter``; the
feed-forward's ``ffn_all_reduce``, …; the embedding's ``embedding_all_reduce``, ….
"""

from __future__ import annotations

from attnctl.stages import PlanBuilder

# What gloo allocates inside a collective, beyond what it returns (measured on the CPU
# as the rise of the process's peak resident memory over one collective of 32 MiB, 2 and
# 4 ranks; docs/parallel.md): all_gather flattens its output into a buffer of its own,
# then copies it into the (B, L, D) views; reduce_scatter flattens its (B, L, D) input
# likewise; all_reduce reduces in place with a few small buffers (under 2 MiB at 32 MiB,
# not growing with the tensor). Bounded here by the whole (B, L, D) per collective.
COLLECTIVE_BUFFERS = {
    "all_gather": "one flat (B, L, D) copy of the gathered output",
    "reduce_scatter": "one flat (B, L, D) copy of the partial sums",
    "all_reduce": "none that grows with the tensor (a few small buffers)",
}


def gather_sequence(plan: PlanBuilder, h: str, prefix: str = "") -> str:
    """What a sublayer's column-parallel projections read: ``h`` itself, or under sequence
    parallelism the all-gathered whole sequence (B, L, D)."""
    if not plan.sequence_parallel:
        return h
    return plan.add(
        prefix + "all_gather",
        "B L D",
        (h,),
        what=f"all_gather over the {plan.tensor_parallel} TP ranks: every rank's L/T tokens",
    )


def reduce_partial(plan: PlanBuilder, partial: str, prefix: str = "") -> str:
    """The sum of the T ranks' partial outputs of a row-parallel projection: added in
    place (all_reduce), or under sequence parallelism each rank's L / T tokens of it."""
    ranks = plan.tensor_parallel
    if ranks == 1:
        return partial
    if plan.sequence_parallel:
        return plan.add(
            prefix + "reduce_scatter",
            "B L/T D",
            (partial,),
            what=f"reduce_scatter: the {ranks} ranks' partial sums added, this rank's L/T tokens",
        )
    return plan.add(
        prefix + "all_reduce",
        "B L D",
        (partial,),
        view_of=partial,
        what=f"all_reduce in place: the {ranks} ranks' partial sums added",
    )


def reduced_name(plan: PlanBuilder, partial: str, prefix: str = "") -> str:
    """The stage that holds a row-parallel projection's result once summed (``partial``
    itself on one device or under all_reduce, which adds in place)."""
    if plan.tensor_parallel > 1 and plan.sequence_parallel:
        return plan.resolve(prefix + "reduce_scatter")
    return partial
