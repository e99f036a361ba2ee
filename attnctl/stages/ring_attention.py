"""The plan of ring attention: one context-parallel rank's attention over every rank's K, V.

Under ``--cp C`` each rank holds L / C consecutive tokens (its chunk, dim ``L/C``) in every
stage; its Q, K and V are its own chunk's, rotated at the chunk's own positions (rank r's
start at r · L / C). Its queries then meet every chunk's keys in C steps around a ring:
at step s the rank holds rank (r - s) mod C's K and V chunk and

- (except at the last step) allocates a receive buffer for each of K and V (``recv_k``,
  ``recv_v``), sends the chunk it holds to rank r + 1 and receives rank r - 1's: two K
  and two V chunks are alive at once, the one held and the one arriving;
- scores its L/C queries against that chunk, (B, H, L/C, L/C), and folds them into an
  online softmax: a running max and sum per query row (B, H, L/C) and an accumulator of
  the weighted values (B, H, L/C, d_k), all float32, rescaled by exp(old - new max)
  whenever the max grows;
- under the causal mask, the rank's own chunk (step 0) is masked as one device masks it,
  and the chunks of the ranks after it (steps r + 1 … C - 1) are skipped, only passed on
  (so rank C - 1 scores every chunk, rank 0 only its own: the last rank is the busiest).

At the end the accumulator divided by the sum is the attended values (B, H, L/C, d_k),
what one device's softmax(Q·Kᵀ)·V gives for these queries. The torch twin is
``attnctl/nn/ring_attention.py``; ``stages/attention.py`` calls this for ``--cp`` > 1.
"""

from __future__ import annotations

from attnctl.errors import AttnctlError
from attnctl.model.config import LayerConfig
from attnctl.stages import PlanBuilder


def scores_step(ranks: int, rank: int, step: int, causal: bool) -> bool:
    """Whether rank ``rank`` scores the chunk it holds at ``step`` (that of rank
    (rank - step) mod C): always, but under the causal mask not the later ranks' chunks."""
    return not causal or (rank - step) % ranks <= rank


def last_step(ranks: int, rank: int, causal: bool) -> int:
    """The rank's last step: C - 1, or under the causal mask ``rank`` (steps 0 … rank
    score chunks rank … 0; the later chunks are never needed here)."""
    return rank if causal else ranks - 1


def receives(ranks: int, rank: int, step: int, causal: bool) -> bool:
    """Whether the rank receives at ``step`` the chunk it holds at the next one: when it
    scores it. (Under the causal mask chunk j is needed by ranks j … C - 1 only, which it
    reaches first: a chunk a rank does not score, no rank after it scores either.)"""
    return step < ranks - 1 and scores_step(ranks, rank, step + 1, causal)


def sends(ranks: int, rank: int, step: int, causal: bool) -> bool:
    """Whether the rank sends the chunk it holds at ``step`` on: when the next receives it."""
    return receives(ranks, (rank + 1) % ranks, step, causal)


def plan_ring_attention(
    plan: PlanBuilder, config: LayerConfig, q: str, k: str, v: str, scale: str
) -> str:
    """The ring's stages from Q heads ``q`` (B, H, L/C, d_k) and this rank's K, V heads
    ``k``, ``v`` (B, Hkv, L/C, d_k); returns ``weighted_values`` (B, H, L/C, d_k)."""
    ranks, rank = plan.context_parallel, plan.context_rank
    grouped = config.kv_heads != config.heads
    chunk = f"B {'Hkv' if grouped else 'H'} L/C d_k"
    causal = config.mask == "causal"
    current_k, current_v = _chunks_to_send(plan, k, v, "Hkv" if grouped else "H", chunk)
    state: dict[str, str] = {}  # the running max and sum, the accumulator: their last stages
    for step in range(last_step(ranks, rank, causal) + 1):  # each scores a chunk
        name = f"ring{step}."
        source = (rank - step) % ranks  # whose K and V this step holds
        receiving = receives(ranks, rank, step, causal)
        arriving = (source - 1) % ranks  # whose chunk the next step holds
        if receiving:
            receive_k, receive_v = _receive_buffers(plan, name, chunk, arriving)
        masked = causal and step == 0  # the rank's own chunk: the causal mask within it
        _step(plan, config, name, q, (current_k, current_v), state, source, scale, masked)
        # the sends and receives waited on
        if sends(ranks, rank, step, causal):  # alive until sent, then freed
            _sent(plan, name, chunk, (current_k, current_v), source)
        if receiving:
            current_k, current_v = _received(plan, name, chunk, (receive_k, receive_v), arriving)
    return _divided(plan, state)


def _chunks_to_send(
    plan: PlanBuilder, k: str, v: str, kv_heads: str, chunk: str
) -> tuple[str, str]:
    """This rank's K and V chunks as what is sent, one block of memory each. Returns their
    stages."""
    # what is sent must be one block of memory: the split heads (rotated or not) keep the
    # (B, L/C, Hkv, d_k) order of the projection, (B, Hkv, L/C, d_k) only with one head or
    # one token
    in_order = plan.sizes[kv_heads] == 1 or plan.sizes["L/C"] == 1
    copied = "contiguous(): a copy, to be sent"
    held = "already one block: no copy"
    current_k = plan.add(
        "ring_k", chunk, (k,), view_of=None if not in_order else k,
        what=f"this rank's K chunk; {held if in_order else copied}",
    )  # fmt: skip
    current_v = plan.add(
        "ring_v", chunk, (v,), view_of=None if not in_order else v,
        what=f"this rank's V chunk; {held if in_order else copied}",
    )  # fmt: skip
    return current_k, current_v


def _receive_buffers(plan: PlanBuilder, name: str, chunk: str, arriving: int) -> tuple[str, str]:
    """The buffers a step receives the next step's K and V chunks into (rank ``arriving``'s,
    from the rank before). Returns their stages."""
    before = (plan.context_rank - 1) % plan.context_parallel
    receive_k = plan.add(
        name + "recv_k", chunk,
        what=f"receive buffer: rank {arriving}'s K chunk, from rank {before} (irecv); "
        "with the one held, two K chunks alive",
    )  # fmt: skip
    receive_v = plan.add(
        name + "recv_v",
        chunk,
        what=f"receive buffer: rank {arriving}'s V chunk; two V chunks alive",
    )
    return receive_k, receive_v


def _step(
    plan: PlanBuilder,
    config: LayerConfig,
    name: str,
    q: str,
    chunks: tuple[str, str],
    state: dict[str, str],
    source: int,
    scale: str,
    masked: bool,
) -> None:
    """One ring step's online softmax: the queries' scores against rank ``source``'s K, V
    ``chunks``, folded into ``state`` (the last stages of ``max``, ``sum``: (B, H, L/C),
    and ``output``: (B, H, L/C, d_k), all float32). ``masked``: the diagonal chunk."""
    keys, values = chunks
    narrow = plan.dtype != "float32"
    grouped = config.kv_heads != config.heads
    scores = _chunk_scores(plan, config, name, q, keys, source, scale, masked)
    correction = _running_max(plan, name, scores, state)
    probabilities = plan.add(
        name + "probabilities", "B H L/C L/C", (scores, state["max"]), view_of=scores,
        dtype="float32", what="exp(scores - running max), in place",
    )  # fmt: skip
    _running_sum(plan, name, probabilities, correction, state)
    weights = probabilities
    if narrow:
        weights = plan.add(
            name + "weights", "B H L/C L/C", (probabilities,),
            what=f"the unnormalised weights in {plan.dtype}",
        )  # fmt: skip
    if grouped:
        values = plan.add(
            name + "v_repeated", "B H L/C d_k", (values,),
            what=f"repeat_interleave({config.groups}, dim=1): one copy per query head",
        )  # fmt: skip
    partial = plan.add(name + "partial", "B H L/C d_k", (weights, values), what="weights · V")
    if "output" not in state:
        state["output"] = plan.add(
            name + "output", "B H L/C d_k", (partial,), dtype="float32",
            view_of=None if narrow else partial,
            what="the accumulator" + (", in float32" if narrow else ""),
        )  # fmt: skip
    else:
        state["output"] = plan.add(
            name + "output", "B H L/C d_k", (state["output"], correction, partial),
            view_of=state["output"], dtype="float32",
            what="accumulator · correction + this chunk's, in place",
        )  # fmt: skip


def _chunk_scores(
    plan: PlanBuilder,
    config: LayerConfig,
    name: str,
    q: str,
    keys: str,
    source: int,
    scale: str,
    masked: bool,
) -> str:
    """The queries' scores against rank ``source``'s keys (the diagonal chunk ``masked``),
    in float32 for the online softmax. Returns the last stage that writes them."""
    if config.kv_heads != config.heads:
        keys = plan.add(
            name + "k_repeated", "B H L/C d_k", (keys,),
            what=f"repeat_interleave({config.groups}, dim=1): one copy per query head",
        )  # fmt: skip
    start = source * plan.sizes["L/C"]
    scores = plan.add(
        name + "scores", "B H L/C L/C", (q, keys),
        what=f"Q · Kᵀ {scale} against rank {source}'s keys (positions {start}…)",
    )  # fmt: skip
    if masked:
        plan.add(
            name + "mask", "L/C L/C", (scores,), dtype="bool",
            what="causal within the rank's own chunk, blocked scores set to -inf in "
            "place; later chunks skipped",
            scratch=plan.nbytes("L/C L/C", "bool"),  # its negation, for masked_fill_
        )  # fmt: skip
    if plan.dtype != "float32":
        scores = plan.add(
            name + "scores_float32", "B H L/C L/C", (scores,), dtype="float32",
            what="the scores in float32, for the online softmax",
        )  # fmt: skip
    return scores


def _running_max(plan: PlanBuilder, name: str, scores: str, state: dict[str, str]) -> str | None:
    """This chunk's largest score per query row, folded into the running max
    (``state["max"]``). Returns the correction exp(old max - new max), None at the first
    step."""
    block_max = plan.add(
        name + "block_max", "B H L/C", (scores,), dtype="float32",
        what="each query row's largest score in this chunk",
    )  # fmt: skip
    if "max" not in state:
        state["max"] = block_max
        return None
    row_max = state["max"]
    new_max = plan.add(
        name + "max", "B H L/C", (row_max, block_max), dtype="float32",
        what="the running max: max(old, this chunk's)",
    )  # fmt: skip
    correction = plan.add(
        name + "correction", "B H L/C", (row_max, new_max), view_of=row_max,
        dtype="float32", what="exp(old max - new max), in place on the old max",
    )  # fmt: skip
    state["max"] = new_max
    return correction


def _running_sum(
    plan: PlanBuilder,
    name: str,
    probabilities: str,
    correction: str | None,
    state: dict[str, str],
) -> None:
    """This chunk's sum of exp per query row, folded into the running sum
    (``state["sum"]``), the old one times the ``correction``."""
    if "sum" not in state:
        state["sum"] = plan.add(
            name + "sum", "B H L/C", (probabilities,), dtype="float32",
            what="the running sum of exp over the keys so far",
        )  # fmt: skip
        return
    block_sum = plan.add(
        name + "block_sum", "B H L/C", (probabilities,), dtype="float32",
        what="this chunk's sum of exp",
    )  # fmt: skip
    state["sum"] = plan.add(
        name + "sum", "B H L/C", (state["sum"], correction, block_sum), view_of=state["sum"],
        dtype="float32", what="sum · correction + this chunk's, in place",
    )  # fmt: skip


def _sent(plan: PlanBuilder, name: str, chunk: str, chunks: tuple[str, str], source: int) -> None:
    """Rank ``source``'s K and V ``chunks``, sent on to the next rank: alive until sent."""
    after = (plan.context_rank + 1) % plan.context_parallel
    current_k, current_v = chunks
    plan.add(
        name + "sent_k", chunk, (current_k,), view_of=current_k,
        what=f"rank {source}'s K chunk, sent to rank {after} (isend) meanwhile",
    )  # fmt: skip
    plan.add(
        name + "sent_v", chunk, (current_v,), view_of=current_v,
        what=f"rank {source}'s V chunk, sent to rank {after}",
    )  # fmt: skip


def _received(
    plan: PlanBuilder, name: str, chunk: str, buffers: tuple[str, str], arriving: int
) -> tuple[str, str]:
    """Rank ``arriving``'s K and V chunks, arrived in the receive ``buffers``: what the next
    step holds. Returns their stages."""
    receive_k, receive_v = buffers
    current_k = plan.add(
        name + "received_k", chunk, (receive_k,), view_of=receive_k,
        what=f"rank {arriving}'s K chunk, arrived",
    )  # fmt: skip
    current_v = plan.add(
        name + "received_v", chunk, (receive_v,), view_of=receive_v,
        what=f"rank {arriving}'s V chunk, arrived",
    )  # fmt: skip
    return current_k, current_v


def _divided(plan: PlanBuilder, state: dict[str, str]) -> str:
    """The accumulator divided by the running sum: the attended values, in the dtype.
    Returns ``weighted_values``."""
    output, row_sum = state["output"], state["sum"]
    divided = "accumulator / running sum, in place: softmax(Q·Kᵀ)·V over all L keys"
    if plan.dtype == "float32":
        return plan.add(
            "weighted_values", "B H L/C d_k", (output, row_sum), view_of=output,
            dtype="float32", what=divided,
        )  # fmt: skip
    output = plan.add(
        "ring_attended", "B H L/C d_k", (output, row_sum), view_of=output, dtype="float32",
        what=divided,
    )  # fmt: skip
    return plan.add(
        "weighted_values", "B H L/C d_k", (output,), what=f"the attended values in {plan.dtype}"
    )


RING_KERNEL = (
    "--cp with --impl sdpa is not modelled: ring attention runs the math path's online "
    "softmax, chunk by chunk"
)


def check_ring(config: LayerConfig, padded: bool = False) -> None:
    """What ring attention (``--cp``) does not model, refused by name: the one list the
    planner (``parallel/plan.check_split``) and the torch code (``nn/ring_attention``) read."""
    refused = [
        (config.impl == "sdpa", RING_KERNEL),
        (bool(config.window), "--cp with a sliding window is not modelled yet: ring "
         "attention masks only the causal diagonal chunk"),
        (config.pos == "alibi", "--cp with ALiBi is not modelled yet: each chunk's bias "
         "would depend on the distance between the chunks"),
        (config.pos == "relative", "--cp with T5's relative position bias is not "
         "modelled yet"),
        (bool(config.softcap), "--cp with soft-capped scores is not modelled yet"),
        (bool(config.dropout), "--cp with attention dropout is not modelled yet"),
        (padded, "--cp with padded keys is not modelled yet: ring attention masks no "
         "padding"),
    ]  # fmt: skip
    for refuse, message in refused:
        if refuse:
            raise AttnctlError(message)
