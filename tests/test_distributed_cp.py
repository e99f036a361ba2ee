"""``memory --measure --cp C`` (and ``--tp T --cp C [--sp]``) run for real: T · C gloo
processes on the CPU (issue 14).

Rank ``cp_rank · T + tp_rank``: a TP group per context-parallel rank, a ring per TP
rank. Each rank's block 0 (with the embeddings) under ring attention equals its own plan
(``parallel.plan.rank_plan(..., cp_rank=...)``) to the byte; under the causal mask the
CP ranks differ (rank r scores r + 1 chunks), and so do their entries.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from rank_pool import Batch, rank_batch, split_batch

from attnctl.errors import AttnctlError
from attnctl.model.config import LayerConfig
from attnctl.model.layout import Layout

TIMEOUT = 120  # seconds a start of the ranks may take at most, here
# attention dominates the peak (64 tokens, 4 heads of 16): the causal ranks differ
SMALL = ("memory", "-L", "64", "--d-model", "64", "--heads", "4", "--kv-heads", "2",
         "--pos", "rope", "--mask", "causal", "--norm", "pre")  # fmt: skip
RING = LayerConfig(d_model=32, heads=4, kv_heads=2, norm="pre", pos="rope", mask="causal",
                   impl="math", device="cpu")  # fmt: skip


def _measured(invoke, *options: str) -> tuple[list[dict], dict]:
    result = invoke(*SMALL, *options, "--measure", "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    (device,) = document["per_device"]
    return document["measured_per_rank"], device


def test_memory_measure_cp_runs_each_ring_rank_to_the_byte(invoke):
    ranks, device = _measured(invoke, "--cp", "2")
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["peak_bytes"] == r["measured_peak_bytes"] for r in ranks)  # to the byte
    assert all(r["collective_buffer_bytes"] > 0 for r in ranks)  # isend / irecv, bounded
    # the causal ring: rank 1 scores both chunks, rank 0 its own only
    assert ranks[1]["measured_peak_bytes"] > ranks[0]["measured_peak_bytes"]
    # the per-device table holds the busiest rank (with its KV cache)
    busiest = max(r["peak_bytes"] for r in ranks)
    assert busiest == device["peak_bytes"] - device["kv_cache_bytes"]


def test_memory_measure_tp_cp_sp_runs_four_ranks_to_the_byte(invoke):
    ranks, device = _measured(invoke, "--tp", "2", "--cp", "2", "--sp")
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert all(r["peak_bytes"] == r["measured_peak_bytes"] for r in ranks)
    peaks = [r["measured_peak_bytes"] for r in ranks]
    # rank = cp_rank · T + tp_rank: the two TP ranks of a CP rank alike, CP rank 1 busier
    assert peaks[0] == peaks[1] < peaks[2] == peaks[3]
    assert all(r["collective_buffer_bytes"] > 0 for r in ranks)  # all_gather's, named
    assert max(r["peak_bytes"] for r in ranks) == device["peak_bytes"] - device["kv_cache_bytes"]


@rank_batch(4)
def tp_cp_batch(world: int, tiny) -> Batch:
    layer = tiny.layer("llama")
    cases = [
        (RING, 16, 2, 50, Layout(tp=2, cp=2), None),
        (layer, 8, 1, tiny["llama"].vocab_size, Layout(tp=2, cp=2, sp=True), tiny["llama"]),
    ]
    return split_batch(cases, TIMEOUT)


def test_tp_cp_ranks_measure_every_stage_of_their_plan(rank_pool):
    """--tp 2 --cp 2 without SP, and a checkpoint's, in one start of the 4 ranks."""
    cases, results = rank_pool.get(tp_cp_batch, 4)
    for case, ranks in zip(cases, results, strict=True):
        assert [r.rank for r in ranks] == [0, 1, 2, 3]
        for rank in ranks:
            where = f"{case[4].summary()} rank {rank.rank}"
            assert rank.measured_parameter_bytes == rank.parameter_bytes, where
            assert rank.measured_peak_bytes == rank.peak_bytes, where
            assert rank.measured_stage_peak_bytes == rank.stage_peak_bytes, where
            assert "ring isend/irecv" in rank.collective_buffers, where
        # CP rank 1 (ranks 2, 3) runs two ring steps, CP rank 0 one
        steps = [sum(n.startswith("ring") and n.endswith(".scores") for n in r.stage_names)
                 for r in ranks]  # fmt: skip
        assert steps[0] == steps[1] < steps[2] == steps[3], steps


@pytest.mark.parametrize(
    "options,message",
    [
        (["--cp", "3"], "--cp 3 does not divide the length 64"),
        (["--cp", "2", "--window", "8"], "--cp with a sliding window is not modelled yet"),
        (["--cp", "2", "--impl", "sdpa"], "--cp with --impl sdpa is not modelled"),
        (["--tp", "8", "--cp", "16", "--heads", "8"], "--measure would start 128 processes"),
    ],
)
def test_bad_cp_splits_are_refused_before_any_process(invoke, monkeypatch, options, message):
    def no_process(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    result = invoke(*SMALL, *options, "--measure")
    assert result.exit_code == 2, result.output
    assert len(result.stderr.splitlines()) == 1 and message in result.stderr, result.stderr
    assert result.stdout == ""


def test_all_tp_cp_ranks_memory_is_checked_before_any_process(monkeypatch):
    import attnctl.memory.resources
    from attnctl.parallel.distributed import PROCESS_OVERHEAD_BYTES, measure_split

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("started"))
    free = attnctl.memory.resources.Available(3 * PROCESS_OVERHEAD_BYTES, "MemAvailable")
    monkeypatch.setattr(attnctl.memory.resources, "available_memory", lambda device: free)
    with pytest.raises(AttnctlError, match=r"is more than the 960\.00 MiB free") as refused:
        measure_split(RING, 16, 1, 50, Layout(tp=2, cp=2))  # 4 processes of 320 MiB each
    assert refused.value.exit_code == 1
    free = attnctl.memory.resources.Available(5 * PROCESS_OVERHEAD_BYTES, "MemAvailable")
    with pytest.raises(AttnctlError, match=r"is more than the 1\.56 GiB free"):
        measure_split(RING, 16, 1, 50, Layout(cp=8))  # 8 processes
