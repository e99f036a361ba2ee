"""The plan of the collectives a tensor-parallel rank runs between its sublayers.

One place for every collective stage (``attnctl/model/layout.py`` says how the model is
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

# What gloo allocates inside a collective, on its own threads, beyond the tensors it is
# given (``run_split.collective_buffers``: the rise of a rank's peak resident memory
# over one collective of a float32 (B, L, D) of 32 and 128 MiB, 2 and 4 ranks, torch
# 2.13 on the CPU; docs/memory.md, "Measured on torch.distributed"): all_gather gathers
# into a flat buffer of the whole (B, L, D), then copies it into the output's views; the
# reduce_scatter of views flattens the (T - 1) / T of the partial sums the other ranks
# keep; all_reduce adds in place. Each beside a few MiB that do not grow with the tensor
# (at most 4.3 MiB measured), bounded by COLLECTIVE_FIXED_BYTES.
COLLECTIVE_BUFFERS = {
    "all_gather": "a flat buffer of the whole (B, L, D)",
    "reduce_scatter": "a flat copy of the (T - 1) / T of the (B, L, D) sent to the others",
    "all_reduce": "none that grows with the tensor",
}
COLLECTIVE_FIXED_BYTES = 8 * 2**20


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


def reduce_partial(plan: PlanBuilder, partial: str, prefix: str = "", bias: bool = False) -> str:
    """The sum of the T ranks' partial outputs of a row-parallel projection: added in
    place (all_reduce), or under sequence parallelism each rank's L / T tokens of it;
    then the projection's ``bias`` (every rank holds it) added in place."""
    ranks = plan.tensor_parallel
    if ranks == 1:
        return partial
    then = ", then + b in place" if bias else ""
    if plan.sequence_parallel:
        return plan.add(
            prefix + "reduce_scatter",
            "B L/T D",
            (partial,),
            what=f"reduce_scatter: the {ranks} ranks' partial sums added, this rank's L/T tokens"
            + then,
        )
    return plan.add(
        prefix + "all_reduce",
        "B L D",
        (partial,),
        view_of=partial,
        what=f"all_reduce in place: the {ranks} ranks' partial sums added" + then,
    )


def reduced_name(plan: PlanBuilder, partial: str, prefix: str = "") -> str:
    """The stage that holds a row-parallel projection's result once summed (``partial``
    itself on one device or under all_reduce, which adds in place)."""
    if plan.tensor_parallel > 1 and plan.sequence_parallel:
        return plan.resolve(prefix + "reduce_scatter")
    return partial
