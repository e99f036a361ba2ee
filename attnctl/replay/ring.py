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


def backward_steps(walk: Walk) -> tuple[tuple, ...]:
    """``nn/ring_attention._ring_backward``'s allocations, in its order."""
    config, sizes = walk.config, walk.sizes
    e = DTYPE_BYTES[config.dtype]
    narrow = e != FP32
    ranks, rank = walk.plan.context_parallel, walk.plan.context_rank
    causal = config.mask == "causal"
    grouped = config.kv_heads != config.heads
    batch, heads, length, width = sizes["B"], sizes["H"], sizes["L"], sizes["d_k"]
    kv_heads = sizes["Hkv"] if grouped else heads
    q_values = batch * heads * length * width
    kv_values = batch * kv_heads * length * width
    score_values = batch * heads * length * length
    rows = batch * heads * length
    steps: list[tuple] = []

    def temp(key: str, nbytes: int) -> None:
        steps.append(("temp", key, nbytes))

    def free(*keys: str) -> None:
        steps.extend(("free", key) for key in keys)

    # the heads' view of (B, L/C, H, d_k) (Q, and the gradient from the concat) is one
    # block of memory only with one head or one token
    copied = narrow or _permuted(walk)
    if copied:
        temp("g", q_values * FP32)  # the incoming gradient, float32, one block
    if narrow:
        temp("o", q_values * FP32)  # the output in float32
    temp("product", q_values * FP32)  # dO ∘ O
    if narrow:
        free("o")
    temp("delta", rows * FP32)
    free("product")
    if copied:
        temp("queries", q_values * FP32)
    temp("dq", q_values * FP32)
    home = causal and rank != ranks - 1
    if home:  # its own accumulators' receive buffers, from rank C - 1
        temp("home_k", kv_values * FP32)
        temp("home_v", kv_values * FP32)
    held = {"k": None, "v": None, "dk": "acc0.dk", "dv": "acc0.dv"}  # None: the saved chunk
    temp("acc0.dk", kv_values * FP32)
    temp("acc0.dv", kv_values * FP32)
    kept: list[str] = []  # rank C - 1 under the causal mask: its own accumulators
    last = last_step(ranks, rank, causal)
    for step in range(last + 1):
        at = f"s{step}."
        if narrow:
            temp(at + "kf", kv_values * FP32)
            temp(at + "vf", kv_values * FP32)
        keys = values = None  # the temporaries holding the float32 (repeated) K and V
        if narrow:
            keys, values = at + "kf", at + "vf"
        if grouped:
            temp(at + "kr", q_values * FP32)
            if narrow:
                free(at + "kf")
            temp(at + "vr", q_values * FP32)
            if narrow:
                free(at + "vf")
            keys, values = at + "kr", at + "vr"
        temp(at + "scores", score_values * FP32)
        if causal and step == 0:
            temp(at + "allowed", length * length)  # the (L/C, L/C) bool causal mask
            temp(at + "not", length * length)  # its negation, for masked_fill_
            free(at + "not", at + "allowed")
        temp(at + "dv", q_values * FP32)  # Pᵀ · dO
        temp(at + "ds", score_values * FP32)  # dO · Vᵀ
        if values:
            free(values)
        free(at + "scores")  # the probabilities
        temp(at + "t", q_values * FP32)  # dS · K, added into dQ
        free(at + "t")
        if keys:
            free(keys)
        temp(at + "dk", q_values * FP32)  # dSᵀ · Q
        free(at + "ds")
        d_keys, d_values = at + "dk", at + "dv"
        if grouped:  # summed over the query heads each K/V head served
            temp(at + "dk_sum", kv_values * FP32)
            free(at + "dk")
            temp(at + "dv_sum", kv_values * FP32)
            free(at + "dv")
            d_keys, d_values = at + "dk_sum", at + "dv_sum"
        free(d_keys, d_values)  # added into the accumulators
        receiving = receives(ranks, rank, step, causal)
        if causal and rank == ranks - 1 and step == 0:
            kept = [held["dk"], held["dv"]]
        if receiving:
            arriving = {name: f"{at}arriving.{name}" for name in held}
            temp(arriving["k"], kv_values * e)
            temp(arriving["v"], kv_values * e)
            temp(arriving["dk"], kv_values * FP32)
            temp(arriving["dv"], kv_values * FP32)
            free(*(key for key in held.values() if key is not None and key not in kept))
            held = arriving
    if not causal:  # the accumulators home: ours received into new buffers
        temp("mine.dk", kv_values * FP32)
        temp("mine.dv", kv_values * FP32)
        totals = ["mine.dk", "mine.dv"]
    elif home:
        totals = ["home_k", "home_v"]
    else:
        totals = kept
    free(*(key for key in held.values() if key is not None and key not in totals))
    grads: list[tuple] = []
    if narrow:  # the gradients in the dtype, then every float32 one freed
        steps.append(("grad", 0, q_values * e))
        steps.append(("grad", 1, kv_values * e))
        steps.append(("grad", 2, kv_values * e))
        free("dq", *totals)
    else:
        grads = [("give", 0, "dq"), ("give", 1, totals[0]), ("give", 2, totals[1])]
    steps.extend(grads)
    free(*(["queries", "g"] if copied else []), "delta")
    return tuple(steps)
