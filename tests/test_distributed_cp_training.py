"""``memory --measure --train --cp C [--tp T] [--sp]``: a training step under context
parallelism on torch.distributed (gloo), ring attention's own backward
(``nn/ring_attention.RingAttention``) and every gradient summed over the ring. Each rank
is held phase by phase to its estimate (``memory --train --cp C``: its chunk's replay,
``replay/ring.py``), to the byte; its gradients to one device's of the whole sequence,
cut as the tensor-parallel ranks cut them.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from rank_pool import Batch, rank_batch, split_batch
from split_cases import assert_steps_to_the_byte, one_device_gradients, small_layers

from attnctl.model.config import LayerConfig, resolve_impl, validate
from attnctl.model.describe import seeded_model
from attnctl.model.layout import Layout
from attnctl.parallel.distributed import SplitCase, measure_task

TIMEOUT = 300  # seconds a start of the ranks may take at most, here
LENGTH = 8


def _checkpoint(model) -> LayerConfig:
    from attnctl.app.calls import model_layer

    return model_layer(model, {"device": "cpu", "impl": "math"})


def _ring_layers() -> list[LayerConfig]:
    """The small layers ring attention runs (the math path, no window, no soft cap),
    with grouped K/V and half precision among them."""
    variants = [{}, {"kv_heads": 2, "norm_type": "rms"}, {"dtype": "bfloat16"}]
    return [c for c in small_layers(variants) if c.impl == "math" and c.pos != "alibi"]


def _cases(world: int, llama, gpt2=None) -> list[SplitCase]:
    four = [Layout(cp=4), Layout(tp=2, cp=2), Layout(tp=2, cp=2, sp=True)]
    layouts = {2: [Layout(cp=2)], 4: four}[world]
    layers = _ring_layers()[:: 7 if world == 2 else 17]  # 4 ranks on 2 cores: fewer
    cases = [SplitCase(c, LENGTH, 2, 50, layout, None, True, 2)
             for c in layers for layout in layouts]  # fmt: skip
    for layout in layouts:
        cases.append(SplitCase(_checkpoint(llama), LENGTH, 2, llama.vocab_size, layout, llama,
                               True))  # fmt: skip
    if gpt2 is not None:  # its fused, transposed c_attn: held apart on a rank
        cases.append(SplitCase(_checkpoint(gpt2), LENGTH, 2, gpt2.vocab_size, layouts[0], gpt2,
                               True))  # fmt: skip
    return cases


@rank_batch(2, 4)
def measured_batch(world: int, tiny) -> Batch:
    return split_batch(_cases(world, tiny["llama"], tiny["gpt2"] if world == 2 else None), TIMEOUT)


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def measured(request, rank_pool):
    cases, results = rank_pool.get(measured_batch, request.param)
    return request.param, cases, results


def test_every_rank_steps_as_its_estimate_to_the_byte(measured):
    world, cases, results = measured
    assert len(cases) >= 4
    for case, ranks in zip(cases, results, strict=True):
        assert_steps_to_the_byte(case, ranks, world)


def test_the_table_is_the_busiest_ring_rank(measured):
    """``memory --train --cp C``'s per-device row is its busiest rank's, measured."""
    from attnctl.parallel.split import Split

    _, cases, results = measured
    for case, ranks in zip(cases, results, strict=True):
        description = seeded_model(case.config, 50) if case.model is None else (
            case.model.with_run(case.config))  # fmt: skip
        split = Split(case.config, case.model, description, case.layout, True, case.layers)
        (device,) = split.per_device(case.seq_len, case.batch, 1, 0, case.batch)
        assert device.peak_bytes == max(rank.measured_peak_bytes for rank in ranks)


# the layouts of the gradient oracle, by world (4 ring ranks: test_ring_backward.py)
GRADIENT_LAYOUTS = {2: Layout(cp=2), 4: Layout(tp=2, cp=2, sp=True)}


@rank_batch(2, 4)
def gradients_batch(world: int, tiny) -> Batch:
    """A layer and a checkpoint under GRADIENT_LAYOUTS[world], each rank's gradients sent
    back."""
    llama, layout = tiny["llama"], GRADIENT_LAYOUTS[world]
    values = dict(d_model=32, heads=4, kv_heads=2, norm="pre", pos="rope", mask="causal",
                  norm_type="rms", impl="math", device="cpu")  # fmt: skip
    config = resolve_impl(validate(LayerConfig(**values)))
    cases = [
        SplitCase(config, LENGTH, 2, 50, layout, None, True, 2),
        SplitCase(_checkpoint(llama), LENGTH, 2, llama.vocab_size, layout, llama, True),
    ]
    wholes = [seeded_model(config, 50), llama.with_run(cases[1].config)]
    tasks = [{**measure_task(case), "gradients": True} for case in cases]
    return Batch(tasks, TIMEOUT, lambda replies: (cases, wholes, replies))


@pytest.mark.parametrize("world", [2, 4], ids=["cp2", "tp2-cp2-sp"])
def test_every_gradient_summed_over_the_ring_is_one_devices(world, rank_pool):
    """After the ring's sum each rank holds one device's gradient of the whole sequence
    (its TP share of it): ring attention's backward, the chunks' positions."""
    from attnctl.nn.collectives import TensorGroup, shard_weights

    layout = GRADIENT_LAYOUTS[world]
    cases, wholes, replies = rank_pool.get(gradients_batch, world)
    for index, (case, full) in enumerate(zip(cases, wholes, strict=True)):
        expected = one_device_gradients(case, full)
        scale = 1e-4 * max(float(g.abs().max()) for g in expected.values())
        for reply in replies:
            got = reply.results[index]["gradients"]
            tp_rank = reply.rank % layout.tp
            cut = expected
            if layout.tp > 1:
                cut = shard_weights(expected, full, TensorGroup(tp_rank, layout.tp),
                                    full.vocab_size)  # fmt: skip
            assert set(got) == set(cut), f"case {index} rank {reply.rank}"
            for name, gradient in got.items():
                torch.testing.assert_close(torch.tensor(gradient), cut[name].float(), rtol=0,
                                           atol=scale, msg=f"case {index} rank {reply.rank} "
                                           f"{name}")  # fmt: skip


def test_memory_measure_train_cp_prints_each_rank(invoke):
    args = ("memory", "-L", "16", "--d-model", "32", "--heads", "4", "--pos", "rope",
            "--mask", "causal", "--norm", "pre", "--cp", "2", "--train",
            "--layers", "2")  # fmt: skip
    result = invoke(*args, "--measure", "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    (device,) = document["per_device"]
    ranks = document["measured_per_rank"]
    assert [rank["rank"] for rank in ranks] == [0, 1]
    for rank in ranks:
        assert rank["peak_bytes"] == rank["measured_peak_bytes"]
        assert rank["phase_peak_bytes"] == rank["measured_phase_peak_bytes"]
    assert device["peak_bytes"] == max(rank["peak_bytes"] for rank in ranks)
    assert ranks[0]["phase_peak_bytes"] != ranks[1]["phase_peak_bytes"]  # the causal ring


def test_what_ring_attention_does_not_train_is_refused_before_any_process(invoke, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("started"))
    result = invoke("memory", "-L", "16", "--d-model", "32", "--heads", "4", "--cp", "2",
                    "--train", "--impl", "sdpa", "--measure")  # fmt: skip
    assert result.exit_code == 2 and result.stdout == ""
    assert "--cp with --impl sdpa is not modelled" in result.stderr
