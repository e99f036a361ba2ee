"""``memory --measure --train --dp D --zero 0|1|2|3``: D data-parallel copies run on
torch.distributed (gloo), each on token ids of its own, their gradients averaged (an
all_reduce; under ZeRO 2 each reduced onto its pieces' owners as it arrives, then freed),
Adam on every tensor (ZeRO 0) or on the rank's pieces of Megatron's flat buffer,
broadcast to the others after (ZeRO 1 and 2) or kept sharded, each unit's weights
gathered while it is read (ZeRO 3). Each rank's training step is held to its
own estimate (``Split.per_device(..., rank)``: under ZeRO 1 its pieces) phase by phase,
to the byte; its gradients to one device's of the whole batch (the copies' token ids
together, the loss / D); its weights after the step to one device's Adam step.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from rank_pool import Batch, rank_batch, split_batch
from split_cases import (
    assert_steps_to_the_byte,
    held_gradients,
    seeded_weights,
    whole_batch_gradients,
)

from attnctl.model.config import LayerConfig, resolve_impl, validate
from attnctl.model.describe import seeded_model
from attnctl.model.layout import Layout, zero_pieces
from attnctl.parallel.distributed import SplitCase, measure_task

TIMEOUT = 300  # seconds a start of the ranks may take at most, here
LENGTH, BATCH, VOCAB = 8, 2, 50


def _layer(dtype: str) -> LayerConfig:
    """d_model 36: neither the matrices' 1,296 values, the biases' 36 nor the 50 vocabulary
    rows' 1,800 cut into 4 pieces along the tensors' own ends."""
    values = dict(d_model=36, heads=4, norm="pre", pos="learned", impl="math", device="cpu")
    return resolve_impl(validate(LayerConfig(**values, dtype=dtype)))


def _checkpoint(model, dtype: str) -> LayerConfig:
    from attnctl.app.calls import model_layer

    return model_layer(model, {"device": "cpu", "impl": "math", "dtype": dtype})


def _cases(dp: int, llama) -> list[SplitCase]:
    cases = []
    for dtype in ("float32", "bfloat16"):
        for zero in (0, 1, 2, 3):
            layout = Layout(dp=dp, zero=zero)
            cases.append(SplitCase(_layer(dtype), LENGTH, BATCH, VOCAB, layout, None, True, 2))
            config = _checkpoint(llama, dtype)
            cases.append(SplitCase(config, LENGTH, BATCH, llama.vocab_size, layout, llama, True))
    return cases


@rank_batch(2, 4)
def measured_batch(dp: int, tiny) -> Batch:
    return split_batch(_cases(dp, tiny["llama"]), TIMEOUT)


@pytest.fixture(scope="module", params=[2, 4], ids=["dp2", "dp4"])
def measured(request, rank_pool):
    cases, results = rank_pool.get(measured_batch, request.param)
    return request.param, cases, results


def test_every_rank_steps_as_its_own_estimate_to_the_byte(measured):
    dp, cases, results = measured
    for case, ranks in zip(cases, results, strict=True):
        assert_steps_to_the_byte(case, ranks, dp)
        for rank in ranks:
            assert rank.collective_buffer_bytes > 0 and "reduce" in rank.collective_buffers


def test_zero_ranks_differ_as_their_pieces_and_the_table_is_the_busiest(measured):
    """Under ZeRO 1 and 2 the ranks hold different pieces (so different bytes, all measured);
    the per-device table is the busiest of them. Without ZeRO every copy is alike."""
    from attnctl.parallel.split import Split

    dp, cases, results = measured
    for case, ranks in zip(cases, results, strict=True):
        steps = {rank.measured_stage_peak_bytes[2] for rank in ranks}
        description = seeded_model(case.config, VOCAB) if case.model is None else (
            case.model.with_run(case.config))  # fmt: skip
        split = Split(case.config, case.model, description, case.layout, True, case.layers)
        (device,) = split.per_device(case.seq_len, case.batch, 1, 0, case.batch)
        assert device.peak_bytes == max(rank.measured_peak_bytes for rank in ranks)
        if case.layout.zero == 0:
            assert len(steps) == 1
            continue
        assert len(steps) > 1, case  # the pieces' counts and sizes differ by rank
        sizes = split.trained_sizes(0)
        for rank in ranks:
            pieces = zero_pieces(sizes, dp, rank.rank)
            assert split.rank_optimizer(0, rank.rank).values == sum(pieces)


# ---------------------------------------------------------------- the oracles


def _oracle_cases(dp: int, llama) -> list[SplitCase]:
    cases = []
    every = (("float32", 0), ("float32", 1), ("bfloat16", 1), ("float32", 2), ("bfloat16", 2),
             ("float32", 3), ("bfloat16", 3))  # fmt: skip
    for dtype, zero in every if dp == 2 else every[1::2]:  # 4 ranks on 2 cores: fewer
        layout = Layout(dp=dp, zero=zero)
        cases.append(SplitCase(_layer(dtype), LENGTH, BATCH, VOCAB, layout, None, True, 2))
    for zero in (1, 2, 3) if dp == 2 else (3,):
        layout = Layout(dp=dp, zero=zero)
        cases.append(
            SplitCase(_checkpoint(llama, "float32"), LENGTH, BATCH, llama.vocab_size, layout,
                      llama, True)
        )  # fmt: skip
    return cases


@rank_batch(2, 4)
def oracle_batch(dp: int, tiny) -> Batch:
    """The oracle's cases, each rank's gradients and weights after the step sent back."""
    cases = _oracle_cases(dp, tiny["llama"])
    tasks = [{**measure_task(case), "gradients": True, "parameters": True} for case in cases]
    return Batch(tasks, TIMEOUT, lambda replies: (cases, replies))


@pytest.mark.parametrize("dp", [2, 4])
def test_the_mean_gradients_and_the_step_are_one_devices(dp, rank_pool):
    """(a) every rank's gradients after the mean (under ZeRO 2 the ranks' pieces put
    together) are one device's of the whole batch
    (float32: within 1e-4 of the largest gradient); (b) every rank's weights after the
    step are one device's Adam step on those mean gradients (within 1e-6 of the largest
    weight): the pieces and their broadcasts put every value back where it belongs."""
    from attnctl.memory.measure import adam_step

    cases, replies = rank_pool.get(oracle_batch, dp)
    for index, case in enumerate(cases):
        full = seeded_model(case.config, VOCAB) if case.model is None else (
            case.model.with_run(case.config))  # fmt: skip
        where = f"{case.layout.summary()} {case.config.dtype} case {index}"
        results = [reply.results[index] for reply in replies]
        mean = held_gradients(case.layout.zero, results, seeded_weights(case, full))
        if case.config.dtype == "float32":  # (a): half precision rounds another batch
            expected = whole_batch_gradients(case, full)
            scale = 1e-4 * max(float(g.abs().max()) for g in expected.values())
            assert set(mean) == set(expected), where
            for name, gradient in mean.items():
                torch.testing.assert_close(gradient, expected[name].float(), rtol=0,
                                           atol=scale, msg=f"{where} {name}")  # fmt: skip
        weights = seeded_weights(case, full)  # (b): one device's step on the mean gradients
        trained = [weights[name] for name in mean]
        for name, tensor in zip(mean, trained, strict=True):
            tensor.grad = mean[name].to(tensor.dtype)
        adam_step(trained, case.config.dtype != "float32")()
        scale = 1e-6 * max(float(w.abs().max()) for w in weights.values())
        for reply in replies:
            got = reply.results[index]["parameters"]
            assert set(got) == set(weights), where
            for name, value in got.items():
                said = f"{where} rank {reply.rank} {name}"
                torch.testing.assert_close(torch.tensor(value), weights[name].float(), rtol=0,
                                           atol=scale, msg=said)  # fmt: skip


# ---------------------------------------------------------------- the command


ARGS = ("memory", "-L", "8", "--d-model", "36", "--heads", "4", "--norm", "pre", "--train",
        "--layers", "2", "--dtype", "bfloat16", "--dp", "2", "--zero", "1")  # fmt: skip


def test_memory_measure_dp_zero_prints_each_rank(invoke, ranks_once):
    result = invoke(*ARGS, "--measure", "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    ranks = document["measured_per_rank"]
    (device,) = document["per_device"]
    assert [rank["rank"] for rank in ranks] == [0, 1]
    for rank in ranks:
        assert rank["peak_bytes"] == rank["measured_peak_bytes"]
        assert rank["phase_peak_bytes"] == rank["measured_phase_peak_bytes"]
    assert device["peak_bytes"] == max(rank["peak_bytes"] for rank in ranks)
    assert ranks[0]["phase_peak_bytes"] != ranks[1]["phase_peak_bytes"]  # their own pieces
    text = invoke(*ARGS, "--measure", columns=100)
    assert text.exit_code == 0, text.output
    assert "a training step of 2 blocks" in text.stdout and "rank 1:" in text.stdout
    assert len(ranks_once) == 1  # one start of the ranks: the text is the JSON's measurement


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (("--dp", "65"), "--measure would start 65 processes"),
    ],
)
def test_measure_dp_refusals_start_no_process(invoke, monkeypatch, extra, words):
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("started"))
    args = [*ARGS[:-4], "--dp", "2", "--zero", "1", *extra]
    result = invoke(*args, "--measure")
    assert result.exit_code == 2, result.output
    assert words in result.stderr and result.stdout == ""


def test_measure_dp_without_train_is_refused(invoke, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("started"))
    result = invoke("memory", "-L", "8", "--d-model", "36", "--heads", "4", "--dp", "2",
                    "--measure")  # fmt: skip
    assert result.exit_code == 2 and result.stdout == ""
    assert "--measure with --dp runs a training step" in result.stderr
