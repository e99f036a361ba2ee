"""The training replay's entries for ring attention (``--cp C --train``).

Under autograd ring attention is one node (``nn/ring_attention.RingAttention``): its
forward runs the ring as inference does (``stages/ring_attention.py``'s stages, no node of
their own) and keeps Q, the K and V chunks it sends (one block of memory each), the output
and each row's log-sum-exp (B, H, L/C, float32). What training changes in the forward:
the function's inputs (Q, K, V) and the chunks it keeps are held until it returns, the
last step's running max until the log-sum-exp is made from it, just before the division.
Its backward is :func:`backward_steps`, the allocations of ``_ring_backward`` in order.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnctl.model.config import DTYPE_BYTES, FP32
from attnctl.replay.autograd import Tensor
from attnctl.replay.stages import Walk
from attnctl.stages.ring_attention import last_step, receives
from attnctl.trace import Stage


def is_ring_stage(name: str) -> bool:
    """Whether a plan's stage is one of the ring's (``ring_k``, ``ring3.scores``, …)."""
    return name.startswith("ring")


def ring_stage(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    """One of the ring's stages in the function's forward (no node): an in-place op on the
    tensor it is a view of, or a new tensor (with the plan's scratch alive while it is
    made); the tensors training holds longer held here."""
    r = walk.replay
    base, held = walk.base, walk.ring_held
    if base in ("ring_k", "ring_v"):
        held.append(ins[0].storage)  # the function's K, V: held by its caller
        r.hold(ins[0].storage)
    if base == "ring0.scores":
        held.append(ins[0].storage)  # its Q
        r.hold(ins[0].storage)
        walk.ring["q"] = ins[0]
    if base == "ring_attended":  # the division, in place: the log-sum-exp made first
        _log_sum_exp(walk)
    transient = stage.scratch
    if base.endswith(".scores") and walk.sizes["B"] > 1 and _permuted(walk):
        # matmul folds (B, H) of the permuted Q only with one sequence: else it copies Q
        sizes = walk.sizes
        transient += sizes["B"] * sizes["H"] * sizes["L"] * sizes["d_k"] * walk.e
    if stage.view_of:
        r.read()
        out = r.view(walk.tensors[stage.view_of])
    else:
        out = r.new(stage.bytes, transient=transient)
    if base in ("ring_k", "ring_v"):  # the chunks the function keeps
        walk.ring[base] = out
        held.append(out.storage)
        r.hold(out.storage)
        walk.ring[base + "_input"] = ins[0]
    rank, ranks = walk.plan.context_rank, walk.plan.context_parallel
    last = last_step(ranks, rank, walk.config.mask == "causal")
    if base == f"ring{last}.probabilities":  # the running max, kept for the log-sum-exp
        walk.ring["max"] = ins[1]
        r.hold(ins[1].storage)
    return out


def _permuted(walk: Walk) -> bool:
    """Whether Q (B, H, L/C, d_k), made on the heads' view of (B, L/C, H, d_k), and the
    gradient that reaches the ring's output are not one block of memory: with more than
    one head and one token."""
    return walk.sizes["H"] > 1 and walk.sizes["L"] > 1


def _log_sum_exp(walk: Walk) -> None:
    r = walk.replay
    sizes = walk.sizes
    rows = sizes["B"] * sizes["H"] * sizes["L"] * FP32
    walk.ring["lse"] = r.new(rows)  # sum.log(), then + max in place
    walk.ring_held.append(walk.ring["lse"].storage)
    r.drop(walk.ring.pop("max").storage)


def ring_output(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    """``weighted_values`` under ``--cp``: the function's output (the division in place in
    float32, else the cast to the dtype), and its node."""
    r = walk.replay
    narrow = walk.config.dtype != "float32"
    if not narrow:
        _log_sum_exp(walk)
    if stage.view_of:
        r.read()
        out = r.view(walk.tensors[stage.view_of])
    else:
        out = r.new(stage.bytes)
    ring = walk.ring
    inputs = (ring["q"], ring["ring_k_input"], ring["ring_v_input"])
    saved = (ring["q"], ring["ring_k"], ring["ring_v"], out, ring["lse"])
    r.node(out, inputs, saved, backward_steps(walk))
    for storage in walk.ring_held:  # the function returns: what it held is let go
        r.drop(storage)
    walk.ring_held.clear()
    walk.ring.clear()
    return out


class _Allocations:
    """A backward's allocations in order: ``("temp", key, bytes)``, ``("free", key)``, and
    the gradients' steps (``autograd.Node.steps``)."""

    def __init__(self) -> None:
        self.steps: list[tuple] = []

    def temp(self, key: str, nbytes: int) -> None:
        self.steps.append(("temp", key, nbytes))

    def free(self, *keys: str) -> None:
        self.steps.extend(("free", key) for key in keys)


@dataclass(frozen=True)
class _Counts:
    """The element counts of the backward's tensors, of one rank's chunk (L = L/C)."""

    q: int  # (B, H, L, d_k): Q, the output, their gradients
    kv: int  # (B, Hkv, L, d_k): a K or V chunk
    scores: int  # (B, H, L, L)
    rows: int  # (B, H, L): one per query row
    length: int  # L

    @staticmethod
    def of(sizes: dict[str, int], grouped: bool) -> _Counts:
        batch, heads, length, width = sizes["B"], sizes["H"], sizes["L"], sizes["d_k"]
        kv_heads = sizes["Hkv"] if grouped else heads
        return _Counts(
            q=batch * heads * length * width,
            kv=batch * kv_heads * length * width,
            scores=batch * heads * length * length,
            rows=batch * heads * length,
            length=length,
        )


def backward_steps(walk: Walk) -> tuple[tuple, ...]:
    """``nn/ring_attention._ring_backward``'s allocations, in its order."""
    config = walk.config
    e = DTYPE_BYTES[config.dtype]
    narrow = e != FP32
    ranks, rank = walk.plan.context_parallel, walk.plan.context_rank
    causal = config.mask == "causal"
    grouped = config.kv_heads != config.heads
    counts = _Counts.of(walk.sizes, grouped)
    alloc = _Allocations()
    # the heads' view of (B, L/C, H, d_k) (Q, and the gradient from the concat) is one
    # block of memory only with one head or one token
    copied = narrow or _permuted(walk)
    _backward_inputs(alloc, counts, narrow, copied)
    home = causal and rank != ranks - 1
    if home:  # its own accumulators' receive buffers, from rank C - 1
        alloc.temp("home_k", counts.kv * FP32)
        alloc.temp("home_v", counts.kv * FP32)
    held = {"k": None, "v": None, "dk": "acc0.dk", "dv": "acc0.dv"}  # None: the saved chunk
    alloc.temp("acc0.dk", counts.kv * FP32)
    alloc.temp("acc0.dv", counts.kv * FP32)
    kept: list[str] = []  # rank C - 1 under the causal mask: its own accumulators
    last = last_step(ranks, rank, causal)
    for step in range(last + 1):
        at = f"s{step}."
        _chunk_gradients(alloc, counts, at, narrow, grouped, causal and step == 0)
        receiving = receives(ranks, rank, step, causal)
        if causal and rank == ranks - 1 and step == 0:
            kept = [held["dk"], held["dv"]]
        if receiving:
            arriving = {name: f"{at}arriving.{name}" for name in held}
            alloc.temp(arriving["k"], counts.kv * e)
            alloc.temp(arriving["v"], counts.kv * e)
            alloc.temp(arriving["dk"], counts.kv * FP32)
            alloc.temp(arriving["dv"], counts.kv * FP32)
            alloc.free(*(key for key in held.values() if key is not None and key not in kept))
            held = arriving
    if not causal:  # the accumulators home: ours received into new buffers
        alloc.temp("mine.dk", counts.kv * FP32)
        alloc.temp("mine.dv", counts.kv * FP32)
        totals = ["mine.dk", "mine.dv"]
    elif home:
        totals = ["home_k", "home_v"]
    else:
        totals = kept
    alloc.free(*(key for key in held.values() if key is not None and key not in totals))
    _gradients(alloc, counts, e, totals)
    alloc.free(*(["queries", "g"] if copied else []), "delta")
    return tuple(alloc.steps)


def _backward_inputs(alloc: _Allocations, counts: _Counts, narrow: bool, copied: bool) -> None:
    """The backward's start: the incoming gradient (and Q) in float32 and one block when
    they are not, D = rowsum(dO ∘ O), and dQ's float32 accumulator."""
    if copied:
        alloc.temp("g", counts.q * FP32)  # the incoming gradient, float32, one block
    if narrow:
        alloc.temp("o", counts.q * FP32)  # the output in float32
    alloc.temp("product", counts.q * FP32)  # dO ∘ O
    if narrow:
        alloc.free("o")
    alloc.temp("delta", counts.rows * FP32)
    alloc.free("product")
    if copied:
        alloc.temp("queries", counts.q * FP32)
    alloc.temp("dq", counts.q * FP32)


def _chunk_gradients(
    alloc: _Allocations, counts: _Counts, at: str, narrow: bool, grouped: bool, masked: bool
) -> None:
    """One step's gradients from the chunk held (its keys ``at`` + …): the probabilities
    recomputed (``masked``: the diagonal chunk), dV, dS, dQ's share and dK, each added
    into its accumulator."""
    if narrow:
        alloc.temp(at + "kf", counts.kv * FP32)
        alloc.temp(at + "vf", counts.kv * FP32)
    keys = values = None  # the temporaries holding the float32 (repeated) K and V
    if narrow:
        keys, values = at + "kf", at + "vf"
    if grouped:
        alloc.temp(at + "kr", counts.q * FP32)
        if narrow:
            alloc.free(at + "kf")
        alloc.temp(at + "vr", counts.q * FP32)
        if narrow:
            alloc.free(at + "vf")
        keys, values = at + "kr", at + "vr"
    alloc.temp(at + "scores", counts.scores * FP32)
    if masked:
        alloc.temp(at + "allowed", counts.length * counts.length)  # the (L/C, L/C) bool causal mask
        alloc.temp(at + "not", counts.length * counts.length)  # its negation, for masked_fill_
        alloc.free(at + "not", at + "allowed")
    alloc.temp(at + "dv", counts.q * FP32)  # Pᵀ · dO
    alloc.temp(at + "ds", counts.scores * FP32)  # dO · Vᵀ
    if values:
        alloc.free(values)
    alloc.free(at + "scores")  # the probabilities
    alloc.temp(at + "t", counts.q * FP32)  # dS · K, added into dQ
    alloc.free(at + "t")
    if keys:
        alloc.free(keys)
    alloc.temp(at + "dk", counts.q * FP32)  # dSᵀ · Q
    alloc.free(at + "ds")
    d_keys, d_values = at + "dk", at + "dv"
    if grouped:  # summed over the query heads each K/V head served
        alloc.temp(at + "dk_sum", counts.kv * FP32)
        alloc.free(at + "dk")
        alloc.temp(at + "dv_sum", counts.kv * FP32)
        alloc.free(at + "dv")
        d_keys, d_values = at + "dk_sum", at + "dv_sum"
    alloc.free(d_keys, d_values)  # added into the accumulators


def _gradients(alloc: _Allocations, counts: _Counts, e: int, totals: list[str]) -> None:
    """dQ, dK, dV to Q, K, V: in the dtype, then every float32 one freed (float32: the
    accumulators themselves)."""
    if e != FP32:  # the gradients in the dtype, then every float32 one freed
        alloc.steps.append(("grad", 0, counts.q * e))
        alloc.steps.append(("grad", 1, counts.kv * e))
        alloc.steps.append(("grad", 2, counts.kv * e))
        alloc.free("dq", *totals)
    else:
        alloc.steps.extend([("give", 0, "dq"), ("give", 1, totals[0]), ("give", 2, totals[1])])
