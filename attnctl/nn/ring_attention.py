"""Ring attention in torch: one context-parallel rank's queries against every rank's K, V.

Under context parallelism (``--cp C``, ``attnctl/model/layout.py``) rank r holds the r-th of C
consecutive chunks of L / C tokens throughout the layer. Its attention sublayer projects
its own chunk's Q, K and V (rotated at the chunk's own positions) as on one device; then
:func:`attend` runs C steps: at step s the rank holds the K and V chunk of rank
(r - s) mod C, scores its queries against it with an online softmax (a running max and
sum per query row, float32, and a float32 accumulator of the weighted values), and
meanwhile sends the chunk it holds to rank r + 1 and receives rank r - 1's into a buffer
of the same size (``torch.distributed`` point-to-point: ``batch_isend_irecv``). Under the
causal mask the chunks after the rank's own are skipped (never computed, only passed on),
and the diagonal one, its own, is masked as one device masks it.

The plan of these stages is ``attnctl/stages/ring_attention.py``; the stages keep their
names there and here (``ring0.scores``: step 0's scores). ``nn/attention.py`` calls
:func:`attend` when a rank runs under :func:`running`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from attnctl.model.config import LayerConfig
from attnctl.nn import Record, positions
from attnctl.nn.scores import scale_scores
from attnctl.stages.ring_attention import check_ring, last_step, receives, sends


@dataclass(frozen=True)
class Ring:
    """The context-parallel ring a rank runs in: its place, the ring's size, the whole
    sequence's length (L; the rank holds L / C tokens from position rank · L / C)."""

    rank: int
    size: int
    length: int
    group: Any = None  # a torch.distributed ProcessGroup; None: the default (world) group

    @property
    def chunk(self) -> int:
        return self.length // self.size

    @property
    def offset(self) -> int:
        """The position of the rank's first token."""
        return self.rank * self.chunk

    def peer(self, rank_in_ring: int) -> int:
        """The global rank of the ring's ``rank_in_ring`` (mod C)."""
        rank_in_ring %= self.size
        if self.group is None:
            return rank_in_ring
        return dist.get_global_rank(self.group, rank_in_ring)


_RING: ContextVar[Ring | None] = ContextVar("attnctl_ring", default=None)


@contextmanager
def running(ring: Ring) -> Iterator[None]:
    """Every attention sublayer run inside is this rank's share of ring attention."""
    token = _RING.set(ring)
    try:
        yield
    finally:
        _RING.reset(token)


def current() -> Ring | None:
    """The ring this process runs in, or None (one device, or no context parallelism)."""
    return _RING.get()


def attend(config: LayerConfig, held: list[torch.Tensor], ring: Ring, record: Record):
    """``held = [q, k, v]``, Q heads (B, H, L/C, d_k) and this rank's K, V heads
    (B, Hkv, L/C, d_k), taken out: the attended values (B, H, L/C, d_k) in the dtype,
    equal to one device's softmax(Q·Kᵀ)·V over the whole sequence's keys. When autograd
    records (a training step) it runs as :class:`RingAttention`, whose backward is a
    ring of its own."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in held):
        q, k, v = held
        held.clear()
        return RingAttention.apply(q, k, v, config, ring, record)
    return _attend(config, held, ring, record)  # takes them out: each freed when done


def _attend(
    config: LayerConfig,
    held: list[torch.Tensor],
    ring: Ring,
    record: Record,
    kept: list[torch.Tensor] | None = None,
):
    """:func:`attend`'s forward. ``kept`` (a training step's): gets the K and V chunks
    sent (one block of memory each) and each query row's log-sum-exp (B, H, L/C) in
    float32, what the backward needs besides Q and the output."""
    q, k, v = held
    held.clear()
    dtype = q.dtype
    grouped = config.kv_heads != config.heads
    chunk = f"B {'Hkv' if grouped else 'H'} L/C d_k"
    causal = config.mask == "causal"
    check_ring(config)  # what the planner refuses, refused here too
    k = k.contiguous()  # (B, Hkv, L/C, d_k): what is sent is one block of memory
    record("ring_k", k, chunk)
    v = v.contiguous()  # (B, Hkv, L/C, d_k)
    record("ring_v", v, chunk)
    if kept is not None:
        kept += [k, v]
    ranks, rank = ring.size, ring.rank
    last = last_step(ranks, rank, causal)
    queries = [q]  # taken out by the last step, the last to score them
    del q
    state: dict[str, torch.Tensor] = {}  # the running max and sum, the accumulator
    for step in range(last + 1):  # each scores the chunk it holds
        name = f"ring{step}."
        receiving = receives(ranks, rank, step, causal)
        sending = sends(ranks, rank, step, causal)
        operations = []
        if sending:  # the chunk held, to the next rank
            after = ring.peer(rank + 1)
            operations += [
                dist.P2POp(dist.isend, k, after, ring.group, tag=0),
                dist.P2POp(dist.isend, v, after, ring.group, tag=1),
            ]
        if receiving:  # the one before's chunk, held at the next step
            k_next, v_next = _receive_buffers(name, k, v, chunk, record)
            before = ring.peer(rank - 1)
            operations += [
                dist.P2POp(dist.irecv, k_next, before, ring.group, tag=0),
                dist.P2POp(dist.irecv, v_next, before, ring.group, tag=1),
            ]
        works = dist.batch_isend_irecv(operations) if operations else []
        operations.clear()  # (the works hold the tensors while they travel)
        chunks = [k, v]
        if not sending:  # the step takes the chunk out: freed once it is done with it
            k = v = None
        diagonal = step == 0  # the rank's own chunk: the causal mask within it
        _step(config, name, queries, step == last, chunks, state, causal and diagonal, record,
              keep_max=kept is not None)  # fmt: skip
        while works:  # each work holds its tensor: dropped once waited on
            works.pop(0).wait()
        if sending:  # sent: freed
            record(name + "sent_k", k, chunk)
            k = None
            record(name + "sent_v", v, chunk)
            v = None
        if receiving:
            record(name + "received_k", k_next, chunk)
            k = k_next
            del k_next
            record(name + "received_v", v_next, chunk)
            v = v_next
            del v_next
    del k, v
    return _divided(state, kept, dtype, record)


def _receive_buffers(
    name: str, k: torch.Tensor, v: torch.Tensor, chunk: str, record: Record
) -> tuple[torch.Tensor, torch.Tensor]:
    """The buffers a step receives the next step's K and V chunks into, each like the one
    held (B, Hkv, L/C, d_k)."""
    k_next = torch.empty_like(k)  # (B, Hkv, L/C, d_k)
    record(name + "recv_k", k_next, chunk)
    v_next = torch.empty_like(v)  # (B, Hkv, L/C, d_k)
    record(name + "recv_v", v_next, chunk)
    return k_next, v_next


def _divided(
    state: dict[str, torch.Tensor],
    kept: list[torch.Tensor] | None,
    dtype: torch.dtype,
    record: Record,
) -> torch.Tensor:
    """The accumulator divided by the running sum, ``state`` emptied: the attended values
    (B, H, L/C, d_k) in ``dtype``. ``kept`` (a training step's) gets each row's
    log-sum-exp first."""
    if kept is not None:  # log(sum) + max: each row's log-sum-exp, (B, H, L/C) float32
        kept.append(state["sum"].log().add_(state.pop("max")))
        record("ring_lse", kept[-1], "B H L/C")
    accumulated = state.pop("output")  # (B, H, L/C, d_k), float32
    attended = accumulated.div_(state.pop("sum").unsqueeze(-1))  # (B, H, L/C, d_k), in place
    del accumulated
    state.clear()  # the running max
    if dtype != torch.float32:
        record("ring_attended", attended, "B H L/C d_k")
        attended = attended.to(dtype)  # (B, H, L/C, d_k)
    return attended


def _step(
    config: LayerConfig,
    name: str,
    queries: list[torch.Tensor],
    last: bool,
    chunks: list[torch.Tensor],
    state: dict[str, torch.Tensor],
    masked: bool,
    record: Record,
    keep_max: bool = False,
) -> None:
    """One ring step's online softmax: the local queries' scores against the K, V chunk
    held now, folded into ``state`` (``max``, ``sum``: (B, H, L/C); ``output``:
    (B, H, L/C, d_k), all float32). ``last``: the queries are taken out after it."""

    q = queries.pop() if last else queries[0]
    k, v = chunks  # (B, Hkv, L/C, d_k) each
    chunks.clear()
    dtype = q.dtype
    first = not state
    if config.kv_heads != config.heads:  # each K/V head serves `groups` query heads
        k = k.repeat_interleave(config.groups, dim=1)  # (B, H, L/C, d_k)
        record(name + "k_repeated", k, "B H L/C d_k")
    scores = scale_scores(config, torch.matmul(q, k.transpose(-2, -1)))  # (B, H, L/C, L/C)
    del q, k
    record(name + "scores", scores, "B H L/C L/C")
    if masked:  # the diagonal chunk: query i sees keys j <= i of the same chunk
        allowed = positions.visible_keys(scores.shape[-1], 0, scores.device)  # (L/C, L/C)
        scores.masked_fill_(allowed.logical_not(), float("-inf"))
        record(name + "mask", allowed, "L/C L/C")  # recorded once applied
        del allowed
    if dtype != torch.float32:  # the softmax in float32, as torch.softmax computes it
        scores = scores.float()  # (B, H, L/C, L/C)
        record(name + "scores_float32", scores, "B H L/C L/C")
    block_max = scores.amax(dim=-1)  # (B, H, L/C)
    record(name + "block_max", block_max, "B H L/C")
    correction = None
    if first:
        state["max"] = block_max
    else:
        row_max = torch.maximum(state["max"], block_max)  # (B, H, L/C)
        del block_max
        record(name + "max", row_max, "B H L/C")
        correction = state["max"].sub_(row_max).exp_()  # (B, H, L/C): exp(old - new max)
        record(name + "correction", correction, "B H L/C")
        state["max"] = row_max
        del row_max
    if first:
        del block_max  # (kept as the running max)
    probabilities = scores.sub_(state["max"].unsqueeze(-1)).exp_()  # (B, H, L/C, L/C)
    del scores
    if last and not keep_max:  # no later step reads the running max
        del state["max"]
    record(name + "probabilities", probabilities, "B H L/C L/C")
    block_sum = probabilities.sum(dim=-1)  # (B, H, L/C)
    if first:
        state["sum"] = block_sum
    else:
        record(name + "block_sum", block_sum, "B H L/C")
        state["sum"].mul_(correction).add_(block_sum)  # (B, H, L/C), in place
    del block_sum
    record(name + "sum", state["sum"], "B H L/C")
    if dtype != torch.float32:
        probabilities = probabilities.to(dtype)  # (B, H, L/C, L/C)
        record(name + "weights", probabilities, "B H L/C L/C")
    if config.kv_heads != config.heads:
        v = v.repeat_interleave(config.groups, dim=1)  # (B, H, L/C, d_k)
        record(name + "v_repeated", v, "B H L/C d_k")
    partial = torch.matmul(probabilities, v)  # (B, H, L/C, d_k), in the dtype
    del probabilities, v
    record(name + "partial", partial, "B H L/C d_k")
    if first:
        state["output"] = partial if dtype == torch.float32 else partial.float()
    else:
        state["output"].mul_(correction.unsqueeze(-1)).add_(partial)  # in place
    del partial, correction
    record(name + "output", state["output"], "B H L/C d_k")


class RingAttention(torch.autograd.Function):
    """Ring attention under autograd. The forward is :func:`attend`'s, keeping Q, this
    rank's K and V chunks, the output and each query row's log-sum-exp. The backward is
    a ring of its own: D = rowsum(dO ∘ O) (B, H, L/C); then, chunk by chunk in the
    forward's order, the probabilities recomputed from the scores and the log-sum-exp,
    dQ summed here (float32) and each chunk's dK, dV summed (float32) into accumulators
    that travel with the chunk from rank to rank (``batch_isend_irecv``: the chunk and
    its accumulators to the next rank, the one before's received), so that every rank
    scoring a chunk adds its share. Each accumulator then goes home: without the causal
    mask the last rank to score chunk j is j - 1, which sends it on to j; under it the
    last is rank C - 1, which sends each finished one straight to its owner (posted
    when it is done; the owner's receive is posted when the backward starts)."""

    @staticmethod
    def forward(ctx, q, k, v, config, ring, record):  # type: ignore[override]
        kept: list[torch.Tensor] = []  # K, V (one block each), the log-sum-exp
        attended = _attend(config, [q, k, v], ring, record, kept)
        ctx.config, ctx.ring = config, ring
        ctx.save_for_backward(q, kept[0], kept[1], attended, kept[2])
        return attended

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.config, ctx.ring, q, k, v, out, lse, grad)
        return dq, dk, dv, None, None, None


def _wait(works: list) -> None:
    """Wait on each work and let it go (a work holds its tensor: none outlives its wait)."""
    while works:
        works.pop(0).wait()


def _dense_float32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32 as one block of memory: itself when it is, else one copy."""
    if tensor.dtype == torch.float32 and tensor.is_contiguous():
        return tensor
    dense = torch.empty(tensor.shape, dtype=torch.float32, device=tensor.device)
    return dense.copy_(tensor)


def _ring_backward(config, ring: Ring, q, k, v, out, lse, grad):
    """:class:`RingAttention`'s backward: (dQ, dK, dV) of this rank, in the dtype."""

    dtype, fp32 = q.dtype, torch.float32
    ranks, rank = ring.size, ring.rank
    causal = config.mask == "causal"
    last = last_step(ranks, rank, causal)
    # in float32 and one block of memory each (the heads' view of (B, L/C, H, d_k) is not,
    # and matmul would copy it for every product): a copy only when either is needed
    g = _dense_float32(grad)  # (B, H, L/C, d_k)
    delta = (g * out.to(fp32)).sum(dim=-1)  # (B, H, L/C): rowsum(dO ∘ O)
    queries = _dense_float32(q)  # (B, H, L/C, d_k)
    dq = torch.zeros_like(queries)  # (B, H, L/C, d_k), float32
    home = None  # under the causal mask: this rank's own accumulators, from rank C - 1
    if causal and rank != ranks - 1:
        home = [torch.empty(k.shape, dtype=fp32, device=k.device) for _ in range(2)]
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.irecv, home[0], ring.peer(ranks - 1), ring.group, tag=2),
            dist.P2POp(dist.irecv, home[1], ring.peer(ranks - 1), ring.group, tag=3),
        ])  # fmt: skip
    held = [k, v, torch.zeros(k.shape, dtype=fp32, device=k.device),
            torch.zeros(v.shape, dtype=fp32, device=v.device)]  # fmt: skip
    own = None  # rank C - 1 under the causal mask: its own chunk's, done at step 0
    for step in range(last + 1):
        chunk_k, chunk_v, chunk_dk, chunk_dv = held
        masked = causal and step == 0  # the diagonal chunk
        _chunk_gradients(config, queries, g, delta, lse, held, dq, masked)
        sending, receiving = sends(ranks, rank, step, causal), receives(ranks, rank, step, causal)
        operations, arriving = [], []
        if sending:  # the chunk and its accumulators, to the next rank
            operations += [dist.P2POp(dist.isend, t, ring.peer(rank + 1), ring.group, tag=n)
                           for n, t in enumerate(held)]  # fmt: skip
        if receiving:
            arriving = [torch.empty_like(t) for t in held]
            operations += [dist.P2POp(dist.irecv, t, ring.peer(rank - 1), ring.group, tag=n)
                           for n, t in enumerate(arriving)]  # fmt: skip
        if causal and rank == ranks - 1 and step == 0:
            own = (chunk_dk, chunk_dv)
        elif causal and rank == ranks - 1:  # chunk rank - step's, finished: home
            owner = ring.peer(rank - step)
            operations += [
                dist.P2POp(dist.isend, chunk_dk, owner, ring.group, tag=2),
                dist.P2POp(dist.isend, chunk_dv, owner, ring.group, tag=3),
            ]
        _wait(dist.batch_isend_irecv(operations) if operations else [])
        operations.clear()
        del chunk_k, chunk_v, chunk_dk, chunk_dv
        held = arriving if receiving else held
    if not causal:  # chunk rank + 1's accumulators are done: home, and ours from rank - 1
        dk_total, dv_total = _swap_home(ring, held)
    elif home is not None:
        _wait(works)
        dk_total, dv_total = home
    else:  # rank C - 1: its own chunk's, scored by itself alone at step 0
        dk_total, dv_total = own
    del held, own
    return dq.to(dtype), dk_total.to(dtype), dv_total.to(dtype)


def _chunk_gradients(
    config: LayerConfig,
    queries: torch.Tensor,
    g: torch.Tensor,
    delta: torch.Tensor,
    lse: torch.Tensor,
    held: list[torch.Tensor],
    dq: torch.Tensor,
    masked: bool,
) -> None:
    """One backward step on the chunk ``held = [k, v, dk, dv]`` (K, V (B, Hkv, L/C, d_k) and
    their float32 accumulators): the probabilities recomputed from the scores and the
    log-sum-exp (``masked``: the diagonal chunk), dQ's share added into ``dq``, dK and dV
    into the accumulators. ``queries``, ``g`` (dO): float32 (B, H, L/C, d_k); ``delta``:
    rowsum(dO ∘ O) (B, H, L/C)."""
    fp32 = torch.float32
    grouped = config.kv_heads != config.heads
    chunk_k, chunk_v, chunk_dk, chunk_dv = held
    keys, values = chunk_k.to(fp32), chunk_v.to(fp32)  # (B, Hkv, L/C, d_k)
    if grouped:  # each K/V head serves `groups` query heads
        keys = keys.repeat_interleave(config.groups, dim=1)  # (B, H, L/C, d_k)
        values = values.repeat_interleave(config.groups, dim=1)  # (B, H, L/C, d_k)
    scores = scale_scores(config, torch.matmul(queries, keys.transpose(-2, -1)))
    # (B, H, L/C, L/C)
    if masked:  # the diagonal chunk
        allowed = positions.visible_keys(scores.shape[-1], 0, scores.device)
        scores.masked_fill_(allowed.logical_not(), float("-inf"))
        del allowed
    probabilities = scores.sub_(lse.unsqueeze(-1)).exp_()  # (B, H, L/C, L/C)
    del scores
    d_values = torch.matmul(probabilities.transpose(-2, -1), g)  # (B, H, L/C, d_k)
    d_scores = torch.matmul(g, values.transpose(-2, -1))  # (B, H, L/C, L/C)
    del values
    d_scores.sub_(delta.unsqueeze(-1)).mul_(probabilities)  # P ∘ (dP - D)
    del probabilities
    scale_scores(config, d_scores)  # the scores' factor, on their gradient
    dq.add_(torch.matmul(d_scores, keys))  # (B, H, L/C, d_k)
    del keys
    d_keys = torch.matmul(d_scores.transpose(-2, -1), queries)  # (B, H, L/C, d_k)
    del d_scores
    if grouped:  # a K/V head's gradient: the sum over the query heads it served
        batch, _, length, width = d_keys.shape
        d_keys = d_keys.view(batch, config.kv_heads, config.groups, length, width).sum(2)
        d_values = d_values.view(batch, config.kv_heads, config.groups, length,
                                 width).sum(2)  # fmt: skip
    chunk_dk.add_(d_keys)  # (B, Hkv, L/C, d_k)
    chunk_dv.add_(d_values)
    del d_keys, d_values


def _swap_home(ring: Ring, held: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Without the causal mask: the accumulators of ``held = [k, v, dk, dv]`` (chunk
    rank + 1's, done) sent home, and this rank's received from rank - 1 into new
    buffers. Returns (dK, dV), float32."""
    rank = ring.rank
    mine = [torch.empty_like(held[2]), torch.empty_like(held[3])]
    _wait(dist.batch_isend_irecv([
        dist.P2POp(dist.isend, held[2], ring.peer(rank + 1), ring.group, tag=2),
        dist.P2POp(dist.isend, held[3], ring.peer(rank + 1), ring.group, tag=3),
        dist.P2POp(dist.irecv, mine[0], ring.peer(rank - 1), ring.group, tag=2),
        dist.P2POp(dist.irecv, mine[1], ring.peer(rank - 1), ring.group, tag=3),
    ]))  # fmt: skip
    dk_total, dv_total = mine
    return dk_total, dv_total
