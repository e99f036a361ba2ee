"""What autograd keeps and allocates at a tensor-parallel rank's collective stages.

The stages are ``stages/collectives.py``'s (and the vocab-parallel embedding's). As
Megatron-LM's autograd functions do it:

- ``all_reduce`` (tensor parallel alone) adds the ranks' partial sums in place; its
  backward hands the gradient on as it is (each rank's partial sum had gradient 1);
- ``all_gather`` (sequence parallel, before a column-parallel projection) makes the whole
  (B, L, D) from each rank's L / T tokens; its backward reduce-scatters the gradient
  into a new (B, L/T, D);
- ``reduce_scatter`` (after a row-parallel projection) makes this rank's (B, L/T, D) of
  the summed partial sums; its backward all-gathers the gradient into a new (B, L, D).

None of them keeps a tensor for the backward. The vocab-parallel embedding's mask of
the ids outside this rank's rows is kept by the ``masked_fill_`` that zeroes their
vectors (see ``replay.stages._lookup``).

Under tensor parallelism alone the column-parallel projections read their input through
Megatron's f (``replay.stages.Walk.column_input``): its gradient is all-reduced in place.
A row-parallel projection's bias is added in place after the sum, by every rank.

These entries are held to the measured timeline of ``memory --measure --train --tp T``
(``rank_training.train_task``: the step of each rank's shard on torch.distributed, the collectives'
autograd of ``nn/collectives.py``) by tests/test_distributed_training.py, to the byte.
"""

from __future__ import annotations

from attnctl.replay.autograd import Tensor
from attnctl.replay.stages import Walk, entry
from attnctl.trace import Stage


@entry("vocab_mask", "local_ids")
def _ids(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    """Integer and boolean tensors made from the ids: no gradient flows through them."""
    return walk.replay.new(stage.bytes)


@entry("all_reduce", "ffn_all_reduce", "embedding_all_reduce")
def _all_reduce(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    r = walk.replay
    (partial,) = ins
    r.read()  # the collective runs on the bytes alive now
    return add_bias(walk, r.node(r.view(partial), (partial,), (), (("pass", 0),)))


def add_bias(walk: Walk, summed: Tensor) -> Tensor:
    """``summed += bias`` in place, when the projection before the sum had one
    (``walk.bias_after_sum``): its node hands the gradient on and makes the bias's, the
    incoming gradient summed to (D,)."""
    if walk.bias_after_sum is None:
        return summed
    name, view, nbytes = walk.bias_after_sum
    walk.bias_after_sum = None
    r = walk.replay
    to_bias = ("grad", 1, nbytes) if view is not None else ("param", name, nbytes)
    return r.node(r.view(summed), (summed, view), (), (("pass", 0), to_bias))


@entry("all_gather", "ffn_all_gather")
def _all_gather(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    """The gathered sequence; the code keeps the rank's tokens (``kept_shard``) until the
    sublayer's last column-parallel projection has saved them (``replay.stages.
    _sequence_parallel_linear`` lets go of them)."""
    r = walk.replay
    (shard,) = ins
    r.hold(shard.storage)
    return r.node(r.new(stage.bytes), (shard,), (), (("grad", 0, shard.nbytes),))


@entry("reduce_scatter", "ffn_reduce_scatter", "embedding_reduce_scatter")
def _reduce_scatter(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    r = walk.replay
    (partial,) = ins
    mine = r.node(r.new(stage.bytes), (partial,), (), (("grad", 0, partial.nbytes),))
    return add_bias(walk, mine)
