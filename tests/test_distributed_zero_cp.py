"""ZeRO beside context parallelism: ``memory --measure --train --cp C [--dp D] [--tp T]
--zero 0|1|2|3``. The optimizer state (and under ZeRO 2 and 3 the gradients, under ZeRO
3 the weights) is sharded over the D · C ranks at a TP place (rank = (dp_rank · C +
cp_rank) · T + tp_rank), as Megatron-LM's distributed optimizer shards over its data-
and context-parallel ranks: a gradient is summed over them (a CP rank's is its chunk's
part) and divided by D. Each rank is held phase by phase to its own estimate (its index
dp_rank · C + cp_rank among the shards, its ring rank's chunk), to the byte; each TP
place's gradients (the group's pieces put together under ZeRO 2 and 3) to its share of
one device's gradients of the whole batch and sequence; its weights after the step to
one device's Adam step on them.
"""

from __future__ import annotations

import torch
from rank_pool import Batch, rank_batch, split_batch
from split_cases import (
    assert_stepped_as_one_device,
    assert_steps_to_the_byte,
    held_gradients,
    measured_document,
    one_device_gradients,
    seeded_weights,
    whole_batch_gradients,
)

from attnctl.model.config import LayerConfig, resolve_impl, validate
from attnctl.model.describe import seeded_model
from attnctl.model.layout import Layout
from attnctl.parallel.distributed import SplitCase, measure_task

TIMEOUT = 300  # seconds a start of the ranks may take at most, here
LENGTH, BATCH, VOCAB = 8, 2, 50


def _layer(dtype: str = "float32") -> LayerConfig:
    values = dict(d_model=32, heads=4, kv_heads=2, norm="pre", pos="rope", mask="causal",
                  norm_type="rms", impl="math", device="cpu")  # fmt: skip
    return resolve_impl(validate(LayerConfig(**values, dtype=dtype)))


def _case(layout: Layout, dtype: str = "float32", model=None, tiny=None) -> SplitCase:
    if model is None:
        return SplitCase(_layer(dtype), LENGTH, BATCH, VOCAB, layout, None, True, 2)
    config = tiny.layer(model, dtype=dtype)
    return SplitCase(config, LENGTH, BATCH, tiny[model].vocab_size, layout, tiny[model], True)


def _measured_cases(world: int, tiny) -> list[SplitCase]:
    if world == 2:
        return [
            _case(Layout(cp=2, zero=1)),
            _case(Layout(cp=2, zero=2), "bfloat16"),
            _case(Layout(cp=2, zero=3)),
            _case(Layout(cp=2, zero=3), model="llama", tiny=tiny),
        ]
    return [
        *(_case(Layout(cp=2, dp=2, zero=zero)) for zero in (0, 1, 2, 3)),
        _case(Layout(cp=4, zero=2), "bfloat16"),
        _case(Layout(tp=2, sp=True, cp=2, zero=3)),
        _case(Layout(cp=2, dp=2, zero=1), model="llama", tiny=tiny),
    ]


@rank_batch(2, 4)
def measured_batch(world: int, tiny) -> Batch:
    return split_batch(_measured_cases(world, tiny), TIMEOUT)


def test_every_rank_steps_as_its_own_estimate_to_the_byte(rank_pool):
    for world in (2, 4):
        cases, results = rank_pool.get(measured_batch, world)
        for case, ranks in zip(cases, results, strict=True):
            assert_steps_to_the_byte(case, ranks, world)
            # the shards differ: not every rank holds the same step
            steps = {rank.measured_stage_peak_bytes[2] for rank in ranks}
            assert len(steps) > 1 or case.layout.zero == 0, case.layout.summary()


# ---------------------------------------------------------------- the oracle


def _oracle_cases(world: int, tiny) -> list[SplitCase]:
    if world == 2:
        return [_case(Layout(cp=2, zero=zero)) for zero in (1, 2, 3)]
    return [
        _case(Layout(cp=2, dp=2, zero=0)),
        _case(Layout(cp=2, dp=2, zero=2)),
        _case(Layout(tp=2, sp=True, cp=2, zero=3)),
        _case(Layout(cp=2, dp=2, zero=3), model="llama", tiny=tiny),
    ]


@rank_batch(2, 4)
def oracle_batch(world: int, tiny) -> Batch:
    cases = _oracle_cases(world, tiny)
    tasks = [{**measure_task(case), "gradients": True, "parameters": True} for case in cases]
    return Batch(tasks, TIMEOUT, lambda replies: (cases, replies))


def test_the_gradients_and_the_step_are_one_devices(rank_pool):
    """(a) each TP place's gradients after the sum over its D · C ranks (their pieces put
    together under ZeRO 2 and 3) are its share of one device's of the whole batch and
    sequence, divided by D (within 1e-4 of the largest); (b) every rank's weights after
    the step are one device's Adam step on them (within 1e-6 of the largest weight)."""
    from attnctl.nn.collectives import TensorGroup, shard_weights

    for world in (2, 4):
        cases, replies = rank_pool.get(oracle_batch, world)
        for index, case in enumerate(cases):
            tp = case.layout.tp
            full = seeded_model(case.config, VOCAB) if case.model is None else (
                case.model.with_run(case.config))  # fmt: skip
            where = f"{case.layout.summary()} case {index}"
            # one copy (D = 1) draws its ids as one device does, D copies each its own
            batch = whole_batch_gradients if case.layout.dp > 1 else one_device_gradients
            expected = batch(case, full)
            scale = 1e-4 * max(float(g.abs().max()) for g in expected.values())
            for tp_rank in range(tp):
                group = TensorGroup(tp_rank, tp)
                mine, cut = seeded_weights(case, full), expected
                if tp > 1:
                    mine = shard_weights(mine, full, group, full.vocab_size)
                    cut = shard_weights(expected, full, group, full.vocab_size)
                results = [r.results[index] for r in replies if r.rank % tp == tp_rank]
                got = held_gradients(case.layout.zero, results, mine)
                assert set(got) == set(cut), f"{where} TP rank {tp_rank}"
                for name, gradient in got.items():
                    torch.testing.assert_close(gradient, cut[name].float(), rtol=0,
                                               atol=scale, msg=f"{where} {name}")  # fmt: skip
                assert_stepped_as_one_device(mine, got, results, case.config.dtype, where)


def test_memory_measure_cp_dp_zero_prints_each_rank(invoke):
    ranks, _ = measured_document(invoke, "memory", "-L", "16", "--d-model", "32", "--heads",
                                 "4", "--pos", "rope", "--mask", "causal", "--norm", "pre",
                                 "--train", "--cp", "2", "--dp", "2", "--zero", "1")  # fmt: skip
    assert [rank["rank"] for rank in ranks] == [0, 1, 2, 3]
