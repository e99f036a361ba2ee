"""The plan (what shapes/memory predict) against the trace (what the torch run records)."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch

from attnctl.memory.estimate import estimate, format_bytes, live_bytes_per_stage
from attnctl.model.config import build_config
from attnctl.nn.layer import AttentionLayer, Recorder
from attnctl.nn.runner import run_text
from attnctl.stages.plan import build_plan


def comparable(stage):
    return (stage.name, stage.dims, stage.shape, stage.dtype, stage.bytes, stage.view_of)


GRID = list(
    itertools.product(
        [(8, 2), (64, 8), (12, 4), (16, 1)],  # (d_model, heads)
        ["sinusoidal", "none"],
        ["none", "causal"],
        ["post", "none"],
        ["math", "sdpa"],
        ["float32", "float16", "bfloat16"],
    )
)


@pytest.mark.parametrize("batch,seq_len", [(1, 1), (2, 5)])
def test_plan_equals_trace_over_a_grid(batch, seq_len):
    for (d_model, heads), pos, mask, norm, impl, dtype in GRID:
        config = build_config(
            d_model=d_model, heads=heads, pos=pos, mask=mask, norm=norm, impl=impl, dtype=dtype
        )
        torch.manual_seed(0)
        layer = AttentionLayer(config, 20).to(getattr(torch, dtype))
        record = Recorder()
        with torch.inference_mode():
            layer(torch.randint(0, 20, (batch, seq_len)), record)
        plan = build_plan(config, seq_len, batch, vocab_size=20, device="cpu")
        assert [comparable(s) for s in record.stages] == [comparable(s) for s in plan.stages], (
            config
        )
        assert {s.device for s in record.stages} == {"cpu"}


def test_run_records_what_the_plan_predicts_for_a_sentence():
    config = build_config("are-you-ok", device="cpu", mask="causal")
    trace = run_text("Are you OK?", config)
    plan = build_plan(config, 4, 1, trace.vocab_size, device="cpu")
    assert [s.to_dict() for s in trace.stages] == [s.to_dict() for s in plan.stages]


def test_stage_names_cover_every_step_of_the_textbook_layer():
    plan = build_plan(build_config(mask="causal"), 4)
    assert [s.name for s in plan.stages] == [
        "token_ids", "embeddings", "positions", "x", "q", "k", "v",
        "q_heads", "k_heads", "v_heads", "scores", "mask", "weights",
        "weighted_values", "concat", "output_projection", "residual", "norm",
    ]  # fmt: skip
    assert plan.stage("q_heads").dims == ("B", "H", "L", "d_k")
    assert plan.stage("scores").shape == (1, 8, 4, 4)


def test_attention_matrix_bytes_follow_seed_002_formula():
    # batch * heads * seq_len * seq_len * 4 bytes: 128 MiB at L=2048, 8 heads, float32
    result = estimate(build_plan(build_config(), 2048, 1, 100))
    assert result.attention_matrix_bytes == 1 * 8 * 2048 * 2048 * 4 == 128 * 2**20
    assert result.scores_bytes == result.weights_bytes == result.attention_matrix_bytes
    half = estimate(build_plan(build_config(dtype="bfloat16"), 2048, 3, 100))
    assert half.attention_matrix_bytes == 3 * 8 * 2048 * 2048 * 2
    sdpa = estimate(build_plan(build_config(impl="sdpa"), 2048, 1, 100))
    assert sdpa.scores_bytes == sdpa.weights_bytes == 0


def test_peak_follows_liveness_by_hand():
    # L=2048, D=512, H=8, float32: B·L·D = 4 MiB, B·H·L·L = 128 MiB.
    plan = build_plan(build_config(mask="causal"), 2048, 1, 100)
    mib = 2**20
    live = dict(zip([s.name for s in plan.stages], live_bytes_per_stage(plan), strict=True))
    ids = 2048 * 8  # int64 ids, held throughout
    assert live["x"] == ids + 3 * 4 * mib  # embeddings, positions, x
    assert live["q"] == ids + 2 * 4 * mib  # embeddings and positions freed
    assert live["v_heads"] == ids + 4 * 4 * mib  # x, q, k, v (views add nothing)
    assert live["weights"] == ids + 2 * 4 * mib + 2 * 128 * mib  # x, v, scores, weights
    assert live["weighted_values"] == ids + 3 * 4 * mib + 128 * mib  # scores freed
    result = estimate(plan)
    assert result.peak_stage == "weights"
    assert result.peak_bytes == result.parameter_bytes + live["weights"]
    assert result.parameters == 100 * 512 + 4 * (512 * 512 + 512) + 2 * 512


def test_format_bytes_is_1024_based():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(128 * 2**20) == "128.00 MiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"


@pytest.mark.parametrize(
    "args", [["--help"], ["shapes"], ["memory", "--seq-len", "4096"], ["shapes", "--json"]]
)
def test_commands_without_a_sentence_never_import_torch(args):
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from attnctl.cli import app\n"
        f"result = CliRunner().invoke(app, {args!r})\n"
        "assert result.exit_code == 0, result.output\n"
        "heavy = sorted(m for m in ('torch', 'tokenizers', 'numpy') if m in sys.modules)\n"
        "print(','.join(heavy) or 'none')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "none"
