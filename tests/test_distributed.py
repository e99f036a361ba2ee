"""The split run for real: 2 and 4 gloo processes on the CPU (issue 14).

Each rank's stages equal its plan (``parallel.plan.rank_plan``) and its live bytes equal
the plan's to the byte; ``run --tp`` gives one device's output and weights. The ranks
of each size are started once a session for every module's batches (``rank_pool.py``:
each process imports torch once) and run every task in turn.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rank_pool import Batch, rank_batch, split_batch
from split_cases import covering

from attnctl.errors import AttnctlError
from attnctl.model.config import LayerConfig, resolve_impl, validate
from attnctl.model.layout import Layout, rank_heads
from attnctl.parallel.plan import rank_plan

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 120  # seconds a start of the ranks may take at most, here
LINUX = sys.platform.startswith("linux")

GQA = LayerConfig(d_model=64, heads=8, kv_heads=2, norm="pre", pos="rope", mask="causal",
                  device="cpu")  # fmt: skip
LEARNED = LayerConfig(d_model=32, heads=4, pos="learned", device="cpu")  # post-norm, MHA
SDPA = LayerConfig(d_model=32, heads=4, kv_heads=1, norm="pre", pos="rope", mask="causal",
                   impl="sdpa", dtype="bfloat16", device="cpu")  # fmt: skip


def _key(stage):
    return (stage.name, tuple(stage.dims), tuple(stage.shape), stage.dtype, stage.bytes,
            stage.view_of)  # fmt: skip


@pytest.fixture(scope="module")
def llama(tiny):
    return tiny["llama"], tiny.layer("llama")


def _models(tiny):
    """(llama, its layer), (GPT-2: fused, transposed W_q/W_k/W_v (Conv1D), learned
    positions, biases everywhere, its layer)."""
    return (tiny["llama"], tiny.layer("llama")), (tiny["gpt2"], tiny.layer("gpt2"))


def _sweep(tp: int) -> list:
    """Small layers over norm, positions, mask, kernel and the options that change the
    stages (per-head q/k norm, head_dim, a window, a soft cap, bfloat16 without biases,
    one kv-head), with and without SP: a covering set of the grid (split_cases.covering)."""
    variants = [{}, {"qk_norm": "head", "norm_type": "rms"}, {"head_dim": 12}, {"window": 3},
                {"softcap": 5.0, "impl": "math"}, {"dtype": "bfloat16", "bias": False},
                {"kv_heads": 1}]  # fmt: skip
    # every two options' values together once on 2 ranks; each value once on 4 (2 cores)
    chosen = covering(variants, strength=2 if tp == 2 else 1)
    return [(config, 8, 2, 50, Layout(tp=tp, sp=sp), None) for config, sp in chosen]


def _cases(tp: int, llama, gpt2):
    model, layer = llama
    fused, fused_layer = gpt2
    return [
        *_sweep(tp),
        (GQA, 16, 2, 100, Layout(tp=tp), None),
        (GQA, 16, 2, 100, Layout(tp=tp, sp=True), None),
        (LEARNED, 8, 1, 50, Layout(tp=tp, sp=True), None),
        (SDPA, 8, 2, 50, Layout(tp=tp), None),
        (layer, 8, 2, model.vocab_size, Layout(tp=tp, sp=True), model),
        (fused_layer, 8, 1, fused.vocab_size, Layout(tp=tp, sp=True), fused),
    ]


@rank_batch(2, 4)
def measured_batch(tp: int, tiny) -> Batch:
    return split_batch(_cases(tp, *_models(tiny)), TIMEOUT)


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def measured(request, rank_pool):
    return rank_pool.get(measured_batch, request.param)


def test_every_rank_measures_its_plan_to_the_byte(measured):
    cases, results = measured
    for case, ranks in zip(cases, results, strict=True):
        config, layout = case[0], case[4]
        assert [r.rank for r in ranks] == list(range(layout.tp))
        for rank in ranks:
            where = f"{layout.summary()} {config.impl} rank {rank.rank}"
            assert rank.measured_parameter_bytes == rank.parameter_bytes, where
            assert rank.measured_peak_bytes == rank.peak_bytes, where
            assert rank.measured_stage_peak_bytes == rank.stage_peak_bytes, where
            if layout.sp:  # gloo's own buffers, named and bounded
                assert rank.collective_buffer_bytes > 0 and "all_gather" in rank.collective_buffers


def test_the_split_holds_less_than_one_device(measured):
    from attnctl.memory.measure import measure_forward
    from attnctl.stages.plan import build_plan

    cases, results = measured
    first = len(_sweep(len(results[0])))  # the named cases after the sweep
    cases, results = cases[first:], results[first:]
    config, seq_len, batch, vocab, _layout, _ = cases[0]
    one = measure_forward(build_plan(resolve_impl(validate(config)), seq_len, batch, vocab))
    for rank in results[0]:
        assert rank.measured_parameter_bytes < one.parameter_bytes
        assert rank.measured_peak_bytes < one.peak_bytes


def test_rank_stages_are_the_plan_with_its_collectives(measured):
    cases, results = measured
    first = len(_sweep(len(results[0])))  # the named cases after the sweep
    cases, results = cases[first:], results[first:]
    config, seq_len, batch, vocab, layout, model = cases[1]  # TP + SP
    plan = rank_plan(resolve_impl(validate(config)), seq_len, batch, vocab, layout, model)
    names = [s.name for s in plan.stages]
    for collective in ("embedding_reduce_scatter", "all_gather", "reduce_scatter"):
        assert collective in names
    assert len(results[1][0].stage_names) == len(plan.stages)


# ---------------------------------------------------------------- run --tp


def _single_device(config, model, token_ids, block, heads, rows):
    """One device's output and shown weights, by nn/model.py directly."""
    from attnctl.model.describe import seeded_model
    from attnctl.nn.model import forward
    from attnctl.nn.weights import model_weights

    description = seeded_model(config, 50) if model is None else model.with_run(config)
    weights = model_weights(description, config, torch.device("cpu"), blocks=block + 1)
    with torch.inference_mode():
        result = forward(description, weights.named, token_ids, last=block, shown=[block],
                         window=(heads, rows))  # fmt: skip
    return result.output, result.windows[block]


@rank_batch(2, 4)
def split_runs_batch(tp: int, tiny) -> Batch:
    """Each case's rank results from ``tp`` ranks."""
    from attnctl.parallel.run_split import run_task

    (model, layer), (fused, fused_layer) = _models(tiny)
    generator = torch.Generator().manual_seed(1)
    seeded = resolve_impl(validate(dataclasses.replace(GQA, impl="math")))
    cases = [
        (seeded, None, 0, Layout(tp=tp)),
        (seeded, None, 0, Layout(tp=tp, sp=True)),
        (layer, model, 2, Layout(tp=tp)),  # the last of its 3 blocks
        (layer, model, 1, Layout(tp=tp, sp=True)),
        (fused_layer, fused, 2, Layout(tp=tp, sp=True)),
    ]
    tasks, inputs = [], []
    for config, mdl, block, layout in cases:
        vocab = 50 if mdl is None else mdl.vocab_size
        token_ids = torch.randint(0, vocab, (2, 8), generator=generator)
        heads = list(range(config.heads if mdl is None else 4))
        rows = list(range(8))
        tasks.append(run_task(config, token_ids.tolist(), vocab, layout, mdl, block, heads,
                              rows, None))  # fmt: skip
        inputs.append((token_ids, heads, rows))
    if LINUX:  # gloo's own buffers, last (the probe reads and resets VmHWM)
        tasks.append({"kind": "buffers", "sp": True, "mebibytes": 16})
    return Batch(tasks, TIMEOUT, lambda replies: (cases, inputs, replies))


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def split_runs(request, rank_pool):
    return rank_pool.get(split_runs_batch, request.param)


@pytest.mark.skipif(not LINUX, reason="the probe reads the peak resident memory in /proc")
def test_gloos_own_buffers_are_within_their_bound(split_runs):
    """What gloo allocates inside a collective (no rank's count sees it) is what
    ``collective_bound`` bounds: the whole (B, L, D) for an all_gather, (T - 1) / T of it
    for a reduce_scatter, nothing that grows for an all_reduce, a reduce, a broadcast or
    for ring attention's isend / irecv (``--cp``), a few MiB beside each."""
    from attnctl.stages.collectives import COLLECTIVE_FIXED_BYTES

    _, _, replies = split_runs
    tp = len(replies)
    for reply in replies:
        probe = reply.results[-1]
        whole, found = probe["bytes"], probe["buffers"]
        assert 0.9 * whole <= found["all_gather"] <= whole + COLLECTIVE_FIXED_BYTES
        share = whole * (tp - 1) // tp
        assert 0.9 * share <= found["reduce_scatter"] <= share + COLLECTIVE_FIXED_BYTES
        assert found["all_reduce"] <= COLLECTIVE_FIXED_BYTES
        assert found["reduce"] <= COLLECTIVE_FIXED_BYTES  # ZeRO 2's, onto a piece's owner
        assert found["broadcast"] <= COLLECTIVE_FIXED_BYTES  # ZeRO's pieces to the others
        assert found["send_recv"] <= COLLECTIVE_FIXED_BYTES  # ring attention's isend / irecv


def test_split_run_equals_one_device(split_runs):
    cases, inputs, replies = split_runs
    for index, ((config, model, block, layout), (token_ids, heads, rows)) in enumerate(
        zip(cases, inputs, strict=True)
    ):
        output, window = _single_device(config, model, token_ids, block, heads, rows)
        results = [reply.results[index] for reply in replies]
        pieces = [torch.tensor(r["output"]) for r in results]
        if layout.sp:  # each rank its L / T tokens
            assert all(p.shape[1] == 8 // layout.tp for p in pieces)
            split_output = torch.cat(pieces, dim=1)
        else:  # every rank the whole, equal
            split_output = pieces[0]
            for piece in pieces[1:]:
                torch.testing.assert_close(piece, split_output, rtol=0, atol=1e-5)
        # 1e-5 of the output's scale: a checkpoint's grows to ~25 over its blocks, where
        # float32 sums taken in another order differ by a few 1e-6 of it
        scale = max(1.0, output.abs().max().item())
        torch.testing.assert_close(split_output, output, rtol=0, atol=1e-5 * scale)
        attention = model.with_run(config).blocks[block].attention.config if model else config
        for rank, result in enumerate(results):
            mine, _kv = rank_heads(attention.heads, attention.kv_heads, layout.tp, rank)
            assert result["heads"] == list(mine)
            got = torch.tensor(result["weights"])  # (B, h, r, Lk)
            torch.testing.assert_close(got, window[:, list(mine)], rtol=0, atol=1e-5)


def test_split_run_records_the_rank_plan(split_runs):
    from attnctl.parallel.plan import _renamed
    from attnctl.trace import Stage

    cases, inputs, replies = split_runs
    for index, (config, model, block, layout) in enumerate(cases):
        token_ids = inputs[index][0]
        vocab = 50 if model is None else model.vocab_size
        plan = rank_plan(config, 8, token_ids.shape[0], vocab, layout, model, block)
        recorded = [Stage(**{**s, "dims": tuple(s["dims"]), "shape": tuple(s["shape"])})
                    for s in replies[0].results[index]["stages"]]  # fmt: skip
        full = model.config if model is not None else config
        renamed = _renamed(dataclasses.replace(plan, stages=recorded), full, layout.tp).stages
        assert [_key(s) for s in renamed] == [_key(s) for s in plan.stages], layout.summary()


def test_run_tp_json_has_one_devices_attention(invoke):
    args = ("run", "the cat sat on the mat", "--d-model", "64", "--heads", "4", "--mask",
            "causal", "--device", "cpu", "--json")  # fmt: skip
    one = invoke(*args)
    split = invoke(*args, "--tp", "2", "--sp")
    assert one.exit_code == 0 and split.exit_code == 0, split.output
    a, b = json.loads(one.stdout), json.loads(split.stdout)
    assert a.keys() == b.keys()
    assert a["attention_heads"] == b["attention_heads"] == [0, 1, 2, 3]
    torch.testing.assert_close(torch.tensor(b["attention"]), torch.tensor(a["attention"]),
                               rtol=0, atol=1e-5)  # fmt: skip
    names = [s["name"] for s in b["stages"]]
    assert "all_gather" in names and "reduce_scatter" in names
    assert b["config"] == a["config"]


def test_memory_measure_of_a_split_prints_each_rank_beside_its_estimate(invoke, ranks_once):
    args = ("memory", "-L", "32", "--d-model", "64", "--heads", "4", "--kv-heads", "2",
            "--pos", "rope", "--mask", "causal", "--norm", "pre", "--tp", "2", "--sp")  # fmt: skip
    result = invoke(*args, "--measure", "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    ranks = document["measured_per_rank"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["peak_bytes"] == r["measured_peak_bytes"] for r in ranks)  # to the byte
    assert all(r["collective_buffer_bytes"] > 0 for r in ranks)  # named and bounded
    # the rank's forward is what the per-device table holds, less the KV cache
    (device,) = document["per_device"]
    assert ranks[0]["peak_bytes"] == device["peak_bytes"] - device["kv_cache_bytes"]
    text = invoke(*args, "--measure", columns=100)
    assert text.exit_code == 0 and "measured on torch.distributed, per rank" in text.stdout
    assert len(ranks_once) == 1  # one start of the ranks: the text is the JSON's measurement


def test_run_tp_shows_heads_per_rank(invoke, llama):
    model, _ = llama
    result = invoke("run", "the cat sat", "--model", str(model.source.path), "--tp", "4",
                    "--layer", "1", "--device", "cpu", columns=120)  # fmt: skip
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "TP 4 over 4 processes (gloo)" in out
    assert "rank 0: heads 0 (kv-head 0)" in out and "rank 3: heads 3 (kv-head 1)" in out
    assert "all_reduce" in out and "ffn_all_reduce" in out
    # its memory footer is the whole model's on one device, and says so
    assert "memory of one device (unsplit; each rank's: attnctl memory --tp 4)" in out


# ---------------------------------------------------------------- failures


@pytest.mark.parametrize(
    "fault,line",
    [
        ("error:1", "rank 1: a failure asked for by ATTNCTL_TEST_RANK_FAULT"),
        ("crash:1", "rank 1 exited with status 3 without a result"),
    ],
)
def test_a_failing_rank_is_one_line(invoke, monkeypatch, fault, line):
    monkeypatch.setenv("ATTNCTL_TEST_RANK_FAULT", fault)
    result = invoke("run", "a b c d", "--d-model", "32", "--heads", "4", "--tp", "2",
                    "--device", "cpu")  # fmt: skip
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == [f"attnctl: error: {line}"]


def _children(parent: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent:
                found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process table in /proc")
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill"])
def test_no_rank_outlives_attnctl(how):
    env = {**os.environ, "ATTNCTL_TEST_RANK_FAULT": "hang", "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen(
        [sys.executable, "-c", "from attnctl.cli import main; main()", "run", "a b c d",
         "--d-model", "32", "--heads", "4", "--tp", "2", "--device", "cpu"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        ranks: set[int] = set()
        while len(ranks) < 2 and time.monotonic() < deadline and parent.poll() is None:
            ranks = _children(parent.pid)
            time.sleep(0.05)
        assert len(ranks) == 2, parent.stderr.read() if parent.poll() is not None else ranks
        parent.send_signal(how)
        _, err = parent.communicate(timeout=30)
    finally:
        if parent.poll() is None:
            parent.kill()
    if how == signal.SIGINT:  # it kills the ranks itself, then Ctrl-C's own status
        assert parent.returncode == 130
        assert "Traceback" not in err.decode()
    else:  # no time to: each rank asked the kernel for SIGKILL when its parent dies
        assert parent.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in ranks)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--heads", "8", "--tp", "3"], "--tp 3 does not divide the 8 attention heads"),
        (["--heads", "6", "--kv-heads", "3", "--tp", "2"], "--tp 2 and the 3 kv-heads"),
        (["--sp"], "--sp splits the sequence over the --tp ranks"),
        (["--tp", "65"], "attnctl starts at most 64 on one machine"),
        (["--tp", "2", "--generate", "2"], "run --tp does not run --generate"),
        (["--tp", "2", "--sp"], "does not divide the length 5"),
    ],
)
def test_bad_splits_are_refused_before_any_process(invoke, monkeypatch, args, message):
    def no_process(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    result = invoke("run", "abcde", "--d-model", "48", "--tokenizer", "char", *args)
    assert result.exit_code == 2, result.output
    assert len(result.stderr.splitlines()) == 1 and message in result.stderr, result.stderr
    assert result.stdout == ""


def test_measure_split_refuses_before_any_process(monkeypatch):
    from attnctl.parallel.distributed import measure_split

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("started"))
    with pytest.raises(AttnctlError, match="--tp 3 does not divide the 8 attention heads"):
        measure_split(GQA, 16, 1, 100, Layout(tp=3))
    with pytest.raises(AttnctlError, match="--sp with --tp 2 does not divide the length 15"):
        measure_split(GQA, 15, 1, 100, Layout(tp=2, sp=True))
    with pytest.raises(AttnctlError, match="--pp is estimated only"):
        measure_split(GQA, 16, 1, 100, Layout(tp=2, pp=2))


def test_the_ranks_memory_together_is_checked_before_any_process(monkeypatch):
    import attnctl.memory.resources
    from attnctl.parallel.distributed import PROCESS_OVERHEAD_BYTES, measure_split

    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("started"))
    free = attnctl.memory.resources.Available(3 * PROCESS_OVERHEAD_BYTES, "MemAvailable")
    monkeypatch.setattr(attnctl.memory.resources, "available_memory", lambda device: free)
    with pytest.raises(AttnctlError, match=r"is more than the 960\.00 MiB free") as refused:
        measure_split(GQA, 16, 1, 100, Layout(tp=4))  # 4 processes of 320 MiB each
    assert refused.value.exit_code == 1
