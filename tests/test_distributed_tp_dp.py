"""``memory --measure --train --tp T [--sp] --dp D --zero 0|1|2|3``: D data-parallel
copies of a T-way tensor-parallel split, T · D gloo processes (rank = dp_rank · T +
tp_rank), each copy on token ids of its own. A rank's gradients are summed over its TP
group where they are a part (the replicated weights under SP, a kv-head copied on
T / Hkv ranks), averaged over the ranks at its place in every copy (its data group),
its optimizer state sharded over that group as ZeRO shards it. Each rank is held phase
by phase to its own estimate (``Split.per_device(..., dp_rank)``) to the byte; its
gradients (under ZeRO 2 and 3 its data group's pieces put together) to its TP share of
one device's gradients of the whole batch, its weights after the step to its share of
one device's Adam step. (With --cp too: test_distributed_zero_cp.py.)
"""

from __future__ import annotations

import torch
from rank_pool import Batch, rank_batch, split_batch
from split_cases import (
    assert_stepped_as_one_device,
    assert_steps_to_the_byte,
    held_gradients,
    measured_document,
    seeded_weights,
    whole_batch_gradients,
)

from attnctl.model.config import LayerConfig, resolve_impl, validate
from attnctl.model.describe import seeded_model
from attnctl.model.layout import Layout
from attnctl.parallel.distributed import SplitCase, measure_task

TIMEOUT = 300  # seconds a start of the ranks may take at most, here
LENGTH, BATCH, VOCAB, TP, DP = 8, 2, 50, 2, 2


def _layer(dtype: str = "float32", **values) -> LayerConfig:
    settings = dict(d_model=36, heads=4, norm="pre", pos="learned", impl="math", device="cpu")
    return resolve_impl(validate(LayerConfig(**{**settings, **values}, dtype=dtype)))


GROUPED = dict(d_model=40, kv_heads=1, pos="rope", mask="causal", norm_type="rms")  # T > Hkv


def _case(config: LayerConfig, zero: int, sp: bool, model=None) -> SplitCase:
    layout = Layout(tp=TP, sp=sp, dp=DP, zero=zero)
    if model is None:
        return SplitCase(config, LENGTH, BATCH, VOCAB, layout, None, True, 2)
    return SplitCase(config, LENGTH, BATCH, model.vocab_size, layout, model, True)


def _measured_cases(tiny) -> list[SplitCase]:
    llama = tiny["llama"]
    return [
        *(_case(_layer(), zero, True) for zero in (0, 1, 2, 3)),
        _case(_layer("bfloat16"), 2, False),
        _case(_layer(**GROUPED), 1, True),
        _case(_layer(**GROUPED), 3, False),
        *(_case(tiny.layer("llama"), zero, True, llama) for zero in (1, 3)),
        # fused and transposed tensors, held apart on a rank (parallel.plan.held_apart)
        _case(tiny.layer("gpt2"), 2, False, tiny["gpt2"]),
        _case(tiny.layer("phi3"), 3, True, tiny["phi3"]),
    ]


@rank_batch(TP * DP)
def measured_batch(world: int, tiny) -> Batch:
    return split_batch(_measured_cases(tiny), TIMEOUT)


def test_every_rank_steps_as_its_own_estimate_to_the_byte(rank_pool):
    cases, results = rank_pool.get(measured_batch, TP * DP)
    for case, ranks in zip(cases, results, strict=True):
        assert_steps_to_the_byte(case, ranks, TP * DP)
        if case.layout.zero:  # the copies hold different pieces; a copy's TP ranks alike
            steps = [rank.measured_stage_peak_bytes[2] for rank in ranks]
            assert steps[0] == steps[1] and steps[2] == steps[3], (case, steps)


# ---------------------------------------------------------------- the oracle


def _oracle_cases(tiny) -> list[SplitCase]:
    return [
        _case(_layer(), 0, True),
        _case(_layer(), 2, True),
        _case(_layer(), 3, False),
        _case(_layer(**GROUPED), 1, True),
        _case(tiny.layer("llama"), 3, True, tiny["llama"]),
        _case(tiny.layer("gpt2"), 3, False, tiny["gpt2"]),
    ]


@rank_batch(TP * DP)
def oracle_batch(world: int, tiny) -> Batch:
    """The oracle's cases, each rank's gradients and weights after the step sent back."""
    cases = _oracle_cases(tiny)
    tasks = [{**measure_task(case), "gradients": True, "parameters": True} for case in cases]
    return Batch(tasks, TIMEOUT, lambda replies: (cases, replies))


def test_the_gradients_and_the_step_are_one_devices_cut_the_same_way(rank_pool):
    """(a) each TP rank's mean gradients (its data group's, put together under ZeRO 2 and
    3) are its share of one device's of the whole batch (within 1e-4 of the largest);
    (b) every rank's weights after the step are its share of one device's Adam step on
    those gradients (within 1e-6 of the largest weight)."""
    from attnctl.nn.collectives import TensorGroup, shard_weights

    cases, replies = rank_pool.get(oracle_batch, TP * DP)
    for index, case in enumerate(cases):
        full = seeded_model(case.config, VOCAB) if case.model is None else (
            case.model.with_run(case.config))  # fmt: skip
        where = f"{case.layout.summary()} case {index}"
        expected = whole_batch_gradients(case, full)
        weights = seeded_weights(case, full)
        scale = 1e-4 * max(float(g.abs().max()) for g in expected.values())
        for tp_rank in range(TP):
            group = TensorGroup(tp_rank, TP)
            mine = shard_weights(weights, full, group, full.vocab_size)
            results = [r.results[index] for r in replies if r.rank % TP == tp_rank]
            got = held_gradients(case.layout.zero, results, mine)
            cut = shard_weights(expected, full, group, full.vocab_size)
            assert set(got) == set(cut), f"{where} TP rank {tp_rank}"
            for name, gradient in got.items():
                torch.testing.assert_close(gradient, cut[name].float(), rtol=0, atol=scale,
                                           msg=f"{where} TP rank {tp_rank} {name}")  # fmt: skip
            assert_stepped_as_one_device(mine, got, results, case.config.dtype, where)  # (b)


# ---------------------------------------------------------------- the command


ARGS = ("memory", "-L", "8", "--d-model", "36", "--heads", "4", "--norm", "pre", "--train",
        "--layers", "2", "--tp", "2", "--sp", "--dp", "2", "--zero", "2")  # fmt: skip


def test_memory_measure_tp_dp_prints_each_rank(invoke):
    ranks, _ = measured_document(invoke, *ARGS)
    assert [rank["rank"] for rank in ranks] == [0, 1, 2, 3]
