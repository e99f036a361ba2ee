"""The plan for a GPU (issue 26): ``memory ARGS --gpu h200 --torch 2.11 --json`` against
what an H200 with torch 2.11 measured for ``memory ARGS --measure --device cuda``.

The cases are ``tests/data/cuda_h200_torch2.11.jsonl`` (``scripts/cuda_cases.py`` writes
it from the recordings in ``benchmarks/results/``): inference to the byte, per stage
where measured per stage; training within 1 % (to the byte where the replay is exact);
encoder–decoders' peaks and caches. The mechanisms are ``attnctl/model/gpu.py``'s rules
and ``attnctl/stages/cuda.py``'s lines; the refusals and the one CUDA figure of --fit,
--budget and the pre-flight are tested below them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import attnctl.model.device as devices
from attnctl.cli import app
from attnctl.model.gpu import (
    CONTEXT_BYTES,
    LATE_CONTEXT_BYTES,
    PROFILES,
    CudaTarget,
    named_target,
    rounded,
    sdpa_choice,
    torch_rules,
    with_margin,
)

ROOT = Path(__file__).resolve().parent.parent
CASES = [
    json.loads(line)
    for line in (ROOT / "tests" / "data" / "cuda_h200_torch2.11.jsonl").read_text().splitlines()
]
runner = CliRunner()

# Recordings the plan is not held to the byte on, and why:
# c55-c58: stacks (--layers N) measured before 792a26b, when --measure held one block's
#   weights; the estimate counts every layer's (equal to measurement on the CPU since).
STALE = {"c55", "c56", "c57", "c58"}
UNSPLIT = 2**20  # the caching allocator's kSmallSize
# training steps not to the byte: c24 (GQA, cuDNN) one 512-byte block short; c30 (RoPE)
# 737,280 B and c79 (Llama) 2 x 782,336 B short: cached blocks handed out whole
TRAINING_GAPS = {"c24", "c30", "c79"}
# c76: Llama in float32: the allocator handed out a cached block (freed while the weights
#   loaded) whole, 782,336 B more than asked, held from the embeddings on (0.24 %, over
#   issue 26's 0.1 %). Which blocks loading leaves cached is not modelled: a known gap,
#   held here to less than one unsplit block above the plan.
UNSPLIT_GAP = {"c76"}


def _memory(args: list[str], *more: str) -> dict:
    result = runner.invoke(app, ["memory", *args, *more])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """The tiny checkpoints the recordings used (the same configs and draw)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.cuda_memory import make_checkpoints

    folder = tmp_path_factory.mktemp("checkpoints")
    made = make_checkpoints(str(folder))
    assert not made["errors"], made["errors"]
    return folder


def _args(case: dict, checkpoints: Path | None) -> list[str]:
    return [a.replace("CKPT", str(checkpoints)) for a in case["args"]]


def _planned(case: dict, checkpoints: Path | None) -> dict:
    return _memory(_args(case, checkpoints), "--gpu", "h200", "--torch", "2.11", "--json")


def _uses_checkpoint(case: dict) -> bool:
    return any(a.startswith("CKPT/") for a in case["args"])


INFERENCE = [c for c in CASES if "stages" in c and c["id"] not in STALE]
TRAINING = [c for c in CASES if "--train" in c["args"]]
SEQ2SEQ = [c for c in CASES if "seq2seq" in c]


@pytest.mark.parametrize("case", INFERENCE, ids=[c["id"] for c in INFERENCE])
def test_a_forward_pass_is_planned_as_the_h200_measured_it(case, request):
    folder = request.getfixturevalue("checkpoints") if _uses_checkpoint(case) else None
    result = _planned(case, folder)["results"][0]
    measured = case["peak_bytes"]
    if case["id"] in UNSPLIT_GAP:
        assert 0 < measured - result["peak_bytes"] < UNSPLIT
        return
    assert result["peak_bytes"] == measured
    planned = {s["name"]: s["live_bytes"] for s in result["stages"]}
    recorded = {name: got for name, got in case["stages"] if got is not None}
    assert recorded.keys() <= planned.keys()
    # a stage's figure may read up to one block more than planned: the allocator hands a
    # cached block out whole when splitting it would leave under 1 MiB (kSmallSize), and
    # which block is cached depends on the process's history (c44's positions, c78's)
    for name, got in recorded.items():
        assert 0 <= got - planned[name] < UNSPLIT, (name, got, planned[name])


@pytest.mark.parametrize("case", TRAINING, ids=[c["id"] for c in TRAINING])
def test_a_training_step_is_planned_within_one_percent(case, request):
    folder = request.getfixturevalue("checkpoints") if _uses_checkpoint(case) else None
    planned = _planned(case, folder)["results"][0]["training"]["peak_bytes"]
    measured = case["peak_bytes"]
    assert abs(planned - measured) <= measured / 100, (planned, measured)
    if case["id"] in TRAINING_GAPS:  # less than two unsplit blocks short of it
        assert 0 < measured - planned < 2 * UNSPLIT
    else:
        assert planned == measured


@pytest.mark.parametrize("case", SEQ2SEQ, ids=[c["id"] for c in SEQ2SEQ])
def test_an_encoder_decoder_is_planned_as_measured(case, checkpoints):
    document = _planned(case, checkpoints)
    for key, measured in case["seq2seq"].items():
        assert abs(document[key] - measured) <= max(65536, measured // 1000), key


def test_every_recording_is_a_case_and_most_are_to_the_byte(checkpoints):
    exact = 0
    for case in INFERENCE:
        folder = checkpoints if _uses_checkpoint(case) else None
        exact += _planned(case, folder)["results"][0]["peak_bytes"] == case["peak_bytes"]
    assert len(CASES) == 142 and exact == len(INFERENCE) - len(UNSPLIT_GAP)


# ---------------------------------------------------------------- the mechanisms


def _target(gpu: str = "h200", torch: str = "2.11") -> CudaTarget:
    return named_target(gpu, torch, None)


def test_the_allocator_rounds_to_512_bytes():
    assert [rounded(n) for n in (0, 1, 512, 513, 2048 * 4)] == [0, 512, 512, 1024, 8192]


def test_the_cublas_workspace_follows_the_compute_capability():
    assert _target("h200").cublas_workspace_bytes() == 32 * 2**20
    assert _target("a100-80gb").cublas_workspace_bytes() == 8_519_680


@pytest.mark.parametrize(
    ("dtype", "grouped", "masked", "gpu", "kernel"),
    [
        ("bfloat16", False, False, "h200", "cudnn"),  # cuDNN first on sm_90 in 2.11
        ("bfloat16", True, False, "h200", "cudnn"),  # it takes enable_gqa
        ("float32", False, False, "h200", "efficient"),  # cuDNN and flash take no float32
        ("float32", True, False, "h200", "math"),  # efficient takes no enable_gqa: fallback
        ("bfloat16", False, False, "a100-80gb", "flash"),  # cuDNN is not first below sm_90
        ("bfloat16", False, True, "a100-80gb", "efficient"),  # flash takes no attn_mask
    ],
)
def test_the_sdpa_kernel_follows_torchs_order(dtype, grouped, masked, gpu, kernel):
    choice = sdpa_choice(_target(gpu), dtype, 64, grouped, masked)
    assert choice.kernel == kernel and choice.fallback == (kernel == "math")


def test_a_fallback_to_math_is_a_warning_with_its_cost():
    args = ["--kv-heads", "2", "--impl", "sdpa", "--dtype", "float32", "--seq-len", "2048"]
    cuda = _memory(args, "--gpu", "h200", "--json")["results"][0]["cuda"]
    assert [k["kernel"] for k in cuda["sdpa"]] == ["math"] and cuda["sdpa"][0]["fallback"]
    assert "enable_gqa" in cuda["sdpa"][0]["reason"]
    (line,) = [line for line in cuda["device_lines"] if line["fallback"]]
    assert line["bytes"] > 2 * 8 * 2048 * 2048 * 4  # the scores and weights at least
    assert len(cuda["warnings"]) == 1 and "falls back to the math kernel" in cuda["warnings"][0]
    text = runner.invoke(app, ["memory", *args, "--gpu", "h200"]).output
    assert "SDPA     math (a fallback), float32, sm_90" in text and "warning  SDPA falls" in text


@pytest.mark.parametrize("command", ["memory", "shapes", "run"])
def test_every_command_names_the_gpu_and_the_kernel(command):
    args = ["--impl", "sdpa", "--dtype", "bfloat16", "--gpu", "h200", "--torch", "2.11"]
    if command == "run":
        args = ["Are you OK?", *args]
    result = runner.invoke(app, [command, *args])
    assert result.exit_code == 0, result.output
    assert "NVIDIA H200 (sm_90, profile), torch 2.11 rules, cuDNN 9.19" in result.output
    assert "cuDNN, bfloat16, sm_90" in result.output
    document = json.loads(runner.invoke(app, [command, *args, "--json"]).stdout)
    cuda = document["cuda"] if command != "memory" else document["results"][0]["cuda"]
    assert cuda["gpu"] == "h200" and cuda["verified"] and cuda["torch_rules"] == "2.11"


def test_run_with_a_planned_gpu_runs_here_and_prints_the_gpus_memory():
    args = ["Are you OK?", "--impl", "sdpa", "--dtype", "bfloat16", "--json"]
    here = json.loads(runner.invoke(app, ["run", *args]).stdout)
    planned = json.loads(runner.invoke(app, ["run", *args, "--gpu", "h200"]).stdout)
    assert planned["device"] == here["device"] == "cpu"
    assert planned["attention"] == here["attention"]
    workspaces = 32 * 2**20 + 2**20
    assert planned["memory"]["peak_bytes"] > here["memory"]["peak_bytes"] + workspaces


def test_the_cpu_figures_are_unchanged_by_the_cuda_rules():
    args = ["--impl", "sdpa", "--dtype", "bfloat16", "--seq-len", "2048", "--json"]
    cpu = _memory(args)["results"][0]
    planned = _memory(args, "--gpu", "h200")["results"][0]
    assert cpu["cuda"] is None and planned["cuda"] is not None
    # the CPU plan has none of the GPU's lines, and the stages' own bytes are the same
    assert [s["bytes"] for s in cpu["stages"]] == [s["bytes"] for s in planned["stages"]]
    assert planned["peak_bytes"] - cpu["peak_bytes"] >= 32 * 2**20 + 2**20


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu", "h900"], "unknown GPU 'h900'; profiles: h200, h100, a100-80gb"),
        (["--gpu", "h200", "--torch", "2.9"], "no CUDA memory rules for torch 2.9; known: 2.11"),
        (["--gpu", "h200", "--torch", "two"], "cannot read torch version 'two'"),
        (["--gpu", "h200", "--device", "cpu"], "does not go with --device cpu"),
        (["--gpu", "h200", "--measure"], "--measure measures this machine's device"),
        (["--torch", "2.11"], "--torch 2.11 chooses CUDA memory rules"),
    ],
)
def test_a_bad_gpu_option_is_one_line_and_exit_2(args, message):
    result = runner.invoke(app, ["memory", "--seq-len", "64", *args])
    assert result.exit_code == 2 and result.stdout == ""
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_run_with_a_planned_gpu_refuses_what_it_cannot_plan():
    result = runner.invoke(app, ["run", "Are you OK?", "--gpu", "h200", "--generate", "2"])
    assert result.exit_code == 2 and result.stdout == ""
    assert "run --gpu plans one forward pass's memory; not with --generate" in result.stderr


# ---------------------------------------------------------------- one figure for fits


def _fits(args: list[str]) -> dict:
    return _memory(args, "--gpu", "h200", "--fit", "--json")


@pytest.mark.parametrize(
    "args", [["--impl", "math", "--dtype", "float32"], ["--impl", "sdpa", "--dtype", "bfloat16"]]
)
def test_fit_for_a_named_gpu_counts_the_context_and_the_margin(args):
    document = _fits(args)
    budget = document["budget_bytes"]
    assert budget == PROFILES["h200"].total_bytes - CONTEXT_BYTES
    impl = args[1]
    longest = document["max_seq_len"][impl]

    def need(length: int) -> int:
        result = _memory([*args, "--seq-len", str(length), "--gpu", "h200", "--json"])
        entry = result["results"][0]
        return with_margin(entry["peak_bytes"] + entry["kv_cache_bytes"])

    assert need(longest) <= budget < need(longest + 1)
    assert need(int(longest * 1.05)) > budget


def test_the_preflight_counts_what_fit_counts(monkeypatch):
    """On a CUDA machine (torch's CUDA calls faked) with the H200's free memory, --measure
    at fit's answer passes the pre-flight and 1.05x it is refused with exit 1."""
    import torch

    from attnctl.memory import resources

    args = ["--impl", "math", "--dtype", "float32"]
    longest = _fits(args)["max_seq_len"]["math"]
    free = PROFILES["h200"].total_bytes - (CONTEXT_BYTES - LATE_CONTEXT_BYTES)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, free))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    device = torch.device("cuda")
    for length, fits in ((longest, True), (int(longest * 1.05), False)):
        entry = _memory([*args, "--seq-len", str(length), "--gpu", "h200", "--json"])
        need = entry["results"][0]["peak_bytes"] + entry["results"][0]["kv_cache_bytes"]
        if fits:
            resources.preflight(need, device)
        else:
            with pytest.raises(resources.AttnctlError) as refused:
                resources.preflight(need, device)
            assert refused.value.exit_code == 1 and "allocator's margin" in str(refused.value)


def test_a_budget_on_cuda_leaves_the_context_out():
    document = _memory(["--gpu", "h100", "--budget", "40GiB", "--json"])
    assert document["budget_bytes"] == 40 * 2**30 - CONTEXT_BYTES
    refused = runner.invoke(app, ["memory", "--gpu", "h100", "--budget", "100MiB"])
    assert refused.exit_code == 2 and "leaves nothing beside the CUDA context" in refused.stderr


def test_the_torch_rules_default_to_the_installed_torchs_nearest(monkeypatch):
    monkeypatch.setattr(devices, "torch_version", lambda: "2.13.0+cpu")
    devices._cuda_target.cache_clear()
    try:
        target = devices.cuda_target("cuda", "h200")
        assert target.torch == torch_rules("2.11") and "2.13 installed" in target.note
    finally:
        devices._cuda_target.cache_clear()


# ---------------------------------------------------------------- --measure on CUDA


def test_the_context_is_the_free_bytes_lost_outside_the_allocator(monkeypatch):
    """What the process holds beside torch's allocator: NVML's free bytes before the
    first CUDA call less mem_get_info's after, less the allocator's reservation."""
    import torch

    from attnctl.memory import resources
    from attnctl.memory.measure_cuda import cuda_context_bytes

    monkeypatch.setitem(resources.FREE_BEFORE_CUDA, 0, 150_000_000_000)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (149_000_000_000, 0))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 300_000_000)
    assert cuda_context_bytes(torch.device("cuda")) == 700_000_000
    monkeypatch.setitem(resources.FREE_BEFORE_CUDA, 0, None)  # NVML could not tell
    assert cuda_context_bytes(torch.device("cuda")) is None


def test_a_cuda_measurement_shows_the_reserved_peak_and_the_context():
    from rich.console import Console

    from attnctl.app.requests import LayerRequest, MemoryRequest
    from attnctl.app.use_cases import memory_use_case
    from attnctl.memory.measurement import Measurement
    from attnctl.render.tables import size_grid
    from attnctl.render.terminal_memory import _measured_rows
    from attnctl.report.commands import length_report

    report = memory_use_case(MemoryRequest(LayerRequest({"gpu": "h200"}), seq_len="64"))
    first = report.lengths[0]
    measured = Measurement("cuda:0", first.estimate.parameter_bytes, 1, (1,), "m", (),
                           reserved_peak_bytes=2 * 2**20, context_bytes=700 * 2**20)  # fmt: skip
    shown = length_report(first.plan, first.estimate, first.kv_cache_tokens, first.kv_cache,
                          measured)  # fmt: skip
    grid = size_grid()
    _measured_rows(grid, shown)
    console = Console(width=100, record=True)
    console.print(grid)
    text = console.export_text()
    assert "reserved peak" in text and "2.00 MiB" in text
    assert "CUDA context" in text and "700.00 MiB" in text


def test_this_machines_gpu_is_verified_only_when_it_is_a_measured_profile(monkeypatch):
    from dataclasses import replace

    h200, l4 = PROFILES["h200"], PROFILES["l4"]
    for found, verified in ((replace(h200, name="cuda:0", measured=False), True),
                            (replace(l4, name="cuda:0"), False)):  # fmt: skip
        monkeypatch.setattr(devices, "this_machines_gpu", lambda index, found=found: found)
        devices._cuda_target.cache_clear()
        try:
            target = devices.cuda_target("cuda", "", "2.11")
            assert not target.named and target.verified == verified
            assert ("this machine's GPU" in target.summary()) and target.gpu.name == "cuda:0"
        finally:
            devices._cuda_target.cache_clear()
