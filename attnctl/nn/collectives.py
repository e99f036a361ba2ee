"""The collectives a tensor-parallel rank runs between its sublayers, in torch.

The torch twin of ``attnctl/stages/collectives.py``: the same stage names, recorded as
they run on ``torch.distributed`` (gloo on the CPU, NCCL on CUDA). A :class:`TensorGroup`
is passed down the model (``nn/model.py``); ``None`` everywhere is one device, whose
code path is unchanged.

What each allocates where :class:`attnctl.memory.measure.LiveStorages` sees it is what the
plan says: ``all_reduce`` adds in place (no new bytes), ``all_gather`` writes one new
(B, L, D), ``reduce_scatter`` one new (B, L/T, D). What the backend allocates inside a
collective, on its own threads, is not seen there: ``COLLECTIVE_BUFFERS``
(``stages/collectives.py``) names it.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from attnctl.model.layout import rank_heads, vocab_rows
from attnctl.nn import Record, no_record
from attnctl.stages.collectives import COLLECTIVE_BUFFERS  # noqa: F401 (what gloo adds)


@dataclass(frozen=True)
class TensorGroup:
    """One rank's place in a tensor-parallel group of ``size`` ranks: which heads,
    kv-heads, feed-forward columns and vocabulary rows it holds, and under sequence
    parallelism which L / T tokens."""

    rank: int
    size: int
    sequence_parallel: bool = False
    process_group: Any = None  # a torch.distributed group; None: the default one

    @property
    def hidden(self) -> str:
        """The dims of the tensors between sublayers, as the plan names them."""
        return "B L/T D" if self.sequence_parallel else "B L D"

    def full_length(self, local: int) -> int:
        """The whole sequence's length from the tokens between the sublayers."""
        return local * self.size if self.sequence_parallel else local

    def first_token(self, length: int) -> int:
        """The position of this rank's first token between the sublayers (SP), of a
        sequence of ``length`` tokens (0 without SP: every rank holds all)."""
        return self.rank * (length // self.size) if self.sequence_parallel else 0


def gather_sequence(
    group: TensorGroup | None, h: torch.Tensor, record: Record = no_record, prefix: str = ""
) -> torch.Tensor:
    """What the column-parallel projections read: ``h`` itself, or under sequence
    parallelism the whole (B, L, D) gathered from every rank's (B, L/T, D).

    Under autograd (a training step) the backward sums over the ranks what they read:
    the gradient of the gathered sequence reduce-scattered to this rank's tokens (SP),
    or ``h``'s gradient all-reduced in place (Megatron's "copy to the tensor-parallel
    region": each rank's projections read all of ``h`` for its own heads and columns)."""
    if group is None or group.size == 1:
        return h
    tracked = torch.is_grad_enabled() and h.requires_grad
    if not group.sequence_parallel:
        return _CopyToRanks.apply(h, group) if tracked else h
    gathered = _GatherSequence.apply(h, group) if tracked else _gather(group, h)
    record(prefix + "all_gather", gathered, "B L D")
    return gathered


def reduce_partial(
    group: TensorGroup | None,
    partial: torch.Tensor,
    record: Record = no_record,
    prefix: str = "",
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The sum over the ranks of a row-parallel projection's partial output (B, L, D):
    added in place (all_reduce), or under sequence parallelism this rank's L / T tokens
    of it, a new (B, L/T, D) (reduce_scatter); then ``bias`` (the projection's, which
    every rank holds) added in place, as Megatron's RowParallelLinear adds it after the
    sum. One device: ``partial`` itself (its linear added the bias).

    Under autograd the all_reduce's gradient is the incoming one as it is (each rank's
    partial sum counts once), the reduce_scatter's the incoming one all-gathered."""
    if group is None or group.size == 1:
        return partial
    if not group.sequence_parallel:
        _sum_in_place(group, partial)  # autograd does not see it: its gradient is 1
        if bias is not None:
            partial += bias  # (B, L, D) += (D,), in place
        record(prefix + "all_reduce", partial, "B L D")
        return partial
    tracked = torch.is_grad_enabled() and partial.requires_grad
    mine = _ScatterSequence.apply(partial, group) if tracked else _scatter(group, partial)
    if bias is not None:
        mine += bias  # (B, L/T, D) += (D,), in place
    record(prefix + "reduce_scatter", mine, "B L/T D")
    return mine


def _sum_in_place(group: TensorGroup, tensor: torch.Tensor) -> None:
    """all_reduce: ``tensor`` becomes the sum over the group's ranks, in place."""
    import torch.distributed as dist

    summed = tensor.view(tensor.shape)  # an alias of its own: see _released
    dist.all_reduce(summed, group=group.process_group)
    handed = [summed]
    del summed
    _released(handed)


def _gather(group: TensorGroup, h: torch.Tensor) -> torch.Tensor:
    """all_gather along the sequence: a new (B, L, D) from every rank's (B, L/T, D)."""
    import torch.distributed as dist

    batch, local, width = h.shape
    gathered = torch.empty(batch, local * group.size, width, dtype=h.dtype, device=h.device)
    # (B, L, D): each rank's tokens written into its slice of the sequence, in place
    slices = [gathered[:, r * local : (r + 1) * local] for r in range(group.size)]
    sent = h.contiguous().view(h.shape)  # an alias of its own: see _released
    dist.all_gather(slices, sent, group=group.process_group)
    handed = [sent, *slices]
    del sent, slices  # the backend's references alone left: see _released
    _released(handed)
    return gathered


def _scatter(group: TensorGroup, partial: torch.Tensor) -> torch.Tensor:
    """reduce_scatter along the sequence: a new (B, L/T, D), this rank's tokens of the
    sum over the ranks of their (B, L, D)."""
    import torch.distributed as dist

    batch, length, width = partial.shape
    local = length // group.size
    mine = torch.empty(batch, local, width, dtype=partial.dtype, device=partial.device)
    # (B, L/T, D); the partial sums' slices along the sequence, one per rank
    slices = [partial[:, r * local : (r + 1) * local] for r in range(group.size)]
    received = mine.view(mine.shape)  # an alias of its own: see _released
    dist.reduce_scatter(received, slices, group=group.process_group)
    handed = [received, *slices]
    del received, slices
    _released(handed)
    return mine


def kept_shard(group: TensorGroup | None, h: torch.Tensor) -> torch.Tensor | None:
    """What the column-parallel projections keep for the backward instead of the whole
    sequence gathered from ``h`` (this rank's L / T tokens): ``h`` under sequence
    parallelism in a training step, else None (nothing is held beyond the plan's)."""
    sequence_parallel = group is not None and group.sequence_parallel
    return h if sequence_parallel and torch.is_grad_enabled() and h.requires_grad else None


def column_projection(
    group: TensorGroup | None,
    h: torch.Tensor,
    shard: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """A column-parallel projection of what :func:`gather_sequence` handed it, ``h``:
    ``F.linear(h, weight, bias)``. Under sequence parallelism in a training step, as
    Megatron-LM's: autograd keeps this rank's L / T tokens (``shard``, what was gathered)
    rather than the whole ``h``, and the backward gathers them again for the weight's
    gradient, so the gathered (B, L, D) lives only while the projections read it.
    ``shard``: :func:`kept_shard`'s (None: the plain linear)."""
    if shard is None:
        return torch.nn.functional.linear(h, weight, bias)
    return _SequenceParallelLinear.apply(h, shard.detach(), weight, bias, group)


class _SequenceParallelLinear(torch.autograd.Function):
    """h · Wᵀ + b, keeping the L / T tokens h was gathered from; the backward makes, in
    this order: h's gradient (B, L, D), the gathered tokens again (B, L, D), W's gradient,
    b's, then lets the gathered go."""

    @staticmethod
    def forward(
        ctx: Any,
        h: torch.Tensor,
        shard: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        group: TensorGroup,
    ) -> torch.Tensor:
        ctx.save_for_backward(shard, weight)
        ctx.group, ctx.biased = group, bias is not None
        return torch.nn.functional.linear(h, weight, bias)  # (B, L, out)

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[Any, ...]:
        shard, weight = ctx.saved_tensors
        width = gradient.shape[-1]
        flat = gradient.reshape(-1, width)  # (B·L, out): a copy when it is strided
        to_input = flat.mm(weight).view(*gradient.shape[:-1], weight.shape[1])  # (B, L, D)
        gathered = _gather(ctx.group, shard)  # (B, L, D) again
        to_weight = flat.t().mm(gathered.view(-1, gathered.shape[-1]))  # (out, D)
        to_bias = flat.sum(0) if ctx.biased else None  # (out,)
        del gathered, flat
        return to_input, None, to_weight, to_bias, None


class _CopyToRanks(torch.autograd.Function):
    """Megatron's f: the input as it is; its gradient summed over the ranks, in place."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, group: TensorGroup) -> torch.Tensor:
        ctx.group = group
        return h.view_as(h)  # (B, L, D), the same storage

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, None]:
        _sum_in_place(ctx.group, gradient)
        return gradient, None


class _GatherSequence(torch.autograd.Function):
    """all_gather along the sequence; its gradient reduce-scattered back (SP)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, group: TensorGroup) -> torch.Tensor:
        ctx.group = group
        return _gather(group, h)  # (B, L, D)

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _scatter(ctx.group, gradient), None  # (B, L/T, D)


class _ScatterSequence(torch.autograd.Function):
    """reduce_scatter along the sequence; its gradient all-gathered back (SP)."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: TensorGroup) -> torch.Tensor:
        ctx.group = group
        return _scatter(group, partial)  # (B, L/T, D)

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather(ctx.group, gradient), None  # (B, L, D)


def _released(sent: list[torch.Tensor], seconds: float = 60.0) -> None:
    """Wait until the backend lets go of the tensors it was handed (its own aliases of
    ours) and of their hold on the memory, taking them out of ``sent``.

    gloo's worker thread holds the collective's work, and with it those tensors, a
    moment after the collective returns: until then a tensor the plan frees at this
    stage (the norm before an all_gather, the partial sums of a reduce_scatter) would
    still hold its memory, sometimes, on some ranks. Two things are waited for. torch
    keeps a tensor's Python object alive while C++ still holds it, so a weak reference
    dies when the backend drops the tensor; but the worker lets go of the tensor's Python
    object before the tensor's storage, so a storage can outlive the weak reference by a
    moment (measured: once in 12,000 all_reduces of 4 ranks on 2 cores). So each storage's
    count of holders is waited for too, down to what it was less the handed tensors.
    That takes microseconds; ``seconds`` is long, so a machine busy with other work (a
    test suite beside it) still waits it out rather than measuring a tensor the backend
    has not let go of yet.
    """
    on_cpu = all(t.device.type == "cpu" for t in sent)
    refs = [weakref.ref(t) for t in sent]
    handed: dict[int, tuple[StorageWeakRef, int]] = {}  # storage: (its ref, tensors on it)
    for storage in [StorageWeakRef(t.untyped_storage()) for t in sent]:
        _, count = handed.get(storage.cdata, (storage, 0))
        handed[storage.cdata] = (storage, count + 1)
    held = [(ref, _holders(ref) - count) for ref, count in handed.values()]
    sent.clear()  # no name here holds a handed tensor from now on
    if not on_cpu:  # NCCL keeps its work until its watchdog sees it done: not waited for
        return
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and (
        any(ref() is not None for ref in refs)
        or any(_holders(storage) > left for storage, left in held)
    ):
        time.sleep(0.0001)


def _holders(storage: StorageWeakRef) -> int:
    """How many hold the storage (tensors on it, each once): 0 once it is freed."""
    return 0 if storage.expired() else torch._C._storage_Use_Count(storage.cdata)


def vocab_parallel_lookup(
    group: TensorGroup,
    token_ids: torch.Tensor,
    table: torch.Tensor,
    record: Record = no_record,
) -> torch.Tensor:
    """The token embedding split by vocabulary rows: each rank looks up the ids in its
    rows (the others' vectors zeroed), and the sum over the ranks is every token's
    vector, (B, L, D); under sequence parallelism this rank's (B, L/T, D) of it."""
    rows = table.shape[0]  # ⌈V / T⌉
    first = group.rank * rows
    outside = token_ids.lt(first)  # (B, L) bool: True = not this rank's row
    outside.logical_or_(token_ids.ge(first + rows))
    record("vocab_mask", outside, "B L")
    local_ids = token_ids.sub(first).masked_fill_(outside, 0)  # (B, L) int64
    record("local_ids", local_ids, "B L")
    vectors = torch.nn.functional.embedding(local_ids, table)  # (B, L, D)
    del local_ids
    vectors.masked_fill_(outside.unsqueeze(-1), 0.0)  # in place
    del outside
    record("embeddings", vectors, "B L D")
    return reduce_partial(group, vectors, record, "embedding_")


# ---------------------------------------------------------------- each rank's weights


def shard_weights(
    named: dict[str, torch.Tensor],
    description: Any,
    group: TensorGroup,
    vocab_size: int,
) -> dict[str, torch.Tensor]:
    """This rank's share of every weight, cut from the whole model's ``named`` weights
    (the single device's, by the layout's names): its own contiguous tensors, so the
    whole ones can be freed. ``description``: the whole model (its blocks' configs say
    which rows are whose). The rules are ``model.layout.share``'s."""
    from attnctl.model.layout import share

    cut: dict[str, torch.Tensor] = {}
    size, rank = group.size, group.rank
    for name, tensor in named.items():
        config = _config_of(description, name)
        share(name, tuple(tensor.shape), config, size)  # refuses what it cannot split
        kind = _kind(name)
        if kind == "heads":
            queries, _ = rank_heads(config.heads, config.kv_heads, size, rank)
            part = tensor[queries.start * config.d_k : queries.stop * config.d_k]
        elif kind == "kv_heads":
            _, kv = rank_heads(config.heads, config.kv_heads, size, rank)
            part = tensor[kv.start * config.d_k : kv.stop * config.d_k]
        elif kind == "out_heads":
            queries, _ = rank_heads(config.heads, config.kv_heads, size, rank)
            part = tensor[:, queries.start * config.d_k : queries.stop * config.d_k]
        elif kind == "rows":
            per = tensor.shape[0] // size
            part = tensor[rank * per : (rank + 1) * per]
        elif kind == "columns":
            per = tensor.shape[1] // size
            part = tensor[:, rank * per : (rank + 1) * per]
        elif kind == "vocab":
            rows = vocab_rows(tensor.shape[0], size)
            part = torch.zeros(rows, *tensor.shape[1:], dtype=tensor.dtype, device=tensor.device)
            mine = tensor[rank * rows : (rank + 1) * rows]  # the last rank's: fewer, padded
            part[: mine.shape[0]] = mine
        else:
            part = tensor
        cut[name] = part.clone(memory_format=torch.contiguous_format)
    return cut


def _kind(name: str) -> str:
    import re

    for pattern, kind in (
        (r"W_q\.(weight|bias)$", "heads"),
        (r"W_[kv]\.(weight|bias)$", "kv_heads"),
        (r"W_o\.weight$", "out_heads"),
        (r"(up|gate)\.(weight|bias)$", "rows"),
        (r"down\.weight$", "columns"),
        (r"(embedding|lm_head)\.weight$", "vocab"),
    ):
        if re.search(pattern, name):
            return kind
    return "replicated"


def _config_of(description: Any, name: str) -> Any:
    """The attention config of the block weight ``name`` belongs to (the first block's
    for the shared weights)."""
    import re

    found = re.match(r"blocks\.(\d+)\.", name)
    block = int(found.group(1)) if found else 0
    blocks = description.blocks
    return blocks[min(block, len(blocks) - 1)].attention.config


def output_bias(group: TensorGroup | None, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias a row-parallel projection's linear adds: its own on one device; none
    under tensor parallelism, where :func:`reduce_partial` adds it after the sum."""
    if group is None or group.size == 1:
        return bias
    return None
