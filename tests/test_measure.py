"""The memory estimate against measured bytes (issue 4: within 2 %; on CPU it is exact)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from attnctl.config import build_config
from attnctl.measure import LiveStorages, measure_forward
from attnctl.memory import estimate
from attnctl.plan import build_plan


def test_live_storages_counts_allocations_and_frees():
    tracker = LiveStorages()
    with tracker:
        a = torch.empty(1000)  # 4000 bytes
        b = a.view(10, 100)  # a view: no new storage
        c = torch.ones(500, dtype=torch.float64)  # 4000 bytes
        assert tracker.current == 8000
        del a, b, c
        d = torch.zeros(10, dtype=torch.int8)  # the frees are seen at the next op
        assert tracker.current == 10
    assert tracker.peak == 8000
    del d


GRID = list(
    itertools.product(
        [(1, 8), (2, 64)],  # (batch, seq_len)
        ["math", "sdpa"],
        ["float32", "bfloat16"],
        [dict(), dict(mask="causal", norm="none", pos="none"), dict(heads=1, d_model=32)],
    )
)


@pytest.mark.parametrize(
    "shape,impl,dtype,options", GRID, ids=[f"{s}-{i}-{d}-{len(o)}" for s, i, d, o in GRID]
)
def test_estimate_matches_measurement_stage_by_stage(shape, impl, dtype, options):
    batch, seq_len = shape
    config = build_config(impl=impl, dtype=dtype, device="cpu", **{"d_model": 64, **options})
    plan = build_plan(config, seq_len, batch, vocab_size=50)
    predicted = estimate(plan)
    measured = measure_forward(config, plan)
    assert measured.parameter_bytes == predicted.parameter_bytes
    assert measured.peak_bytes == pytest.approx(predicted.peak_bytes, rel=0.02)
    for stage, want, got in zip(
        plan.stages, predicted.live_bytes, measured.stage_peak_bytes, strict=True
    ):
        assert got == pytest.approx(want, rel=0.02), stage.name


def test_measurement_sees_the_attention_matrices():
    config = build_config(device="cpu")
    plan = build_plan(config, 1024, 1, vocab_size=50)
    measured = measure_forward(config, plan)
    matrices = 2 * 8 * 1024 * 1024 * 4  # scores and weights alive together
    assert measured.peak_activation_bytes > matrices
    sdpa = measure_forward(build_config(device="cpu", impl="sdpa"), plan)
    assert sdpa.peak_activation_bytes < matrices / 4


def test_memory_measure_cli(invoke):
    result = invoke("memory", "--seq-len", "64", "--measure", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["measured_peak_bytes"] == pytest.approx(data["peak_bytes"], rel=0.02)
    assert data["measured_device"] == "cpu"
    assert all("measured_live_bytes" in s for s in data["stages"])
    out = invoke("memory", "--seq-len", "64", "--measure", "--device", "cpu").stdout
    assert "measured peak" in out and "+0.00%" in out
    assert max(len(line) for line in out.splitlines()) <= 80


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kv_cache_bytes_equal_real_keys_and_values(dtype):
    from attnctl.layer import TORCH_DTYPES, AttentionLayer
    from attnctl.memory import kv_cache_bytes

    config = build_config(d_model=64, heads=4, dtype=dtype)
    plan = build_plan(config, 10, 3, vocab_size=50)
    layer = AttentionLayer(config, 50).to(TORCH_DTYPES[dtype])
    with torch.no_grad():
        x = layer.embedding(torch.randint(0, 50, (3, 37)))  # a cache of 37 tokens
        keys, values = layer.W_k(x), layer.W_v(x)
    real = sum(t.numel() * t.element_size() for t in (keys, values))
    assert kv_cache_bytes(plan, 37) == real
    assert kv_cache_bytes(plan) == real * 10 // 37


def test_memory_kv_cache_option(invoke):
    result = invoke("memory", "--seq-len", "2048", "--kv-cache", "8192", "--json")
    data = json.loads(result.stdout)
    assert data["kv_cache_tokens"] == 8192
    assert data["kv_cache_bytes"] == 2 * 8192 * 512 * 4
    default = json.loads(invoke("memory", "--seq-len", "100", "--json").stdout)
    assert default["kv_cache_bytes"] == 2 * 100 * 512 * 4
    bad = invoke("memory", "--kv-cache", "-1")
    assert bad.exit_code == 2 and "kv-cache must be" in bad.stderr
