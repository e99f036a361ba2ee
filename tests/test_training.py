"""The training-step model (training.py) against a measured step, and --train / --dropout."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from attnctl.config import build_config
from attnctl.layer import AttentionLayer
from attnctl.measure import measure_training
from attnctl.plan import build_plan
from attnctl.training import estimate_training

GRID = [
    options
    for options in (
        dict(impl=impl, dtype=dtype, mask=mask, norm=norm, pos=pos, bias=bias, dropout=dropout)
        for impl, dtype, mask, norm, pos, bias, dropout in itertools.product(
            ["math", "sdpa"],
            ["float32", "bfloat16"],
            ["none", "causal"],
            ["post", "none"],
            ["sinusoidal", "none"],
            [True, False],
            [0.0, 0.1],
        )
    )
    if not (options["dropout"] and options["impl"] == "sdpa")
]


@pytest.mark.parametrize("batch,seq_len", [(1, 24), (2, 40)])
def test_training_estimate_matches_a_measured_step(batch, seq_len):
    for options in GRID:
        config = build_config(d_model=40, heads=5, device="cpu", **options)
        plan = build_plan(config, seq_len, batch, vocab_size=7)
        predicted = estimate_training(plan)
        measured = measure_training(config, plan)
        assert measured.peak_bytes == pytest.approx(predicted.peak_bytes, rel=0.02), options


@pytest.mark.parametrize("impl", ["math", "sdpa"])
def test_training_estimate_at_a_real_size(impl):
    config = build_config(impl=impl, device="cpu", mask="causal")
    plan = build_plan(config, 512, 1, vocab_size=2214)
    predicted = estimate_training(plan)
    assert measure_training(config, plan).peak_bytes == pytest.approx(
        predicted.peak_bytes, rel=0.02
    )


def test_training_breakdown():
    plan = build_plan(build_config(), 128, 1, vocab_size=100)
    full = estimate_training(plan)
    count = plan.parameter_count
    assert full.parameter_bytes == full.gradient_bytes == 4 * count
    assert full.optimizer_bytes == 8 * count and full.master_bytes == 0
    half = estimate_training(build_plan(build_config(dtype="bfloat16"), 128, 1, vocab_size=100))
    assert half.parameter_bytes == half.gradient_bytes == 2 * count
    assert half.master_bytes == 4 * count and half.optimizer_bytes == 8 * count
    long = estimate_training(build_plan(build_config(), 2048, 1, vocab_size=100))
    matrix = 8 * 2048 * 2048 * 4
    assert long.peak_phase == "backward"
    assert long.peak_bytes > 3 * matrix  # weights, their gradient and the scores' gradient


def test_dropout_zeroes_weights_in_training_only():
    config = build_config(d_model=32, heads=4, dropout=0.5)
    torch.manual_seed(0)
    layer = AttentionLayer(config, 10)
    ids = torch.randint(0, 10, (1, 12))
    torch.manual_seed(1)
    a = layer(ids).output
    torch.manual_seed(1)
    b = layer(ids).output
    assert torch.equal(a, b)  # seeded: the same mask twice
    with torch.no_grad():
        trained = layer(ids).output
        evaluated = layer.eval()(ids).output
    assert not torch.allclose(trained, evaluated)
    assert torch.equal(evaluated, layer(ids).output)


def test_memory_train_cli(invoke):
    result = invoke("memory", "--seq-len", "128", "--train", "--measure", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "training peak" in result.stdout and "Adam moments" in result.stdout
    data = json.loads(
        invoke("memory", "--seq-len", "128", "--train", "--measure", "--device", "cpu",
               "--json").stdout
    )  # fmt: skip
    assert data["measured_what"] == "training step"
    assert data["measured_peak_bytes"] == pytest.approx(data["training_bytes"], rel=0.02)
    assert data["training"]["optimizer_bytes"] == 8 * data["parameters"]
    bf16 = json.loads(
        invoke("memory", "--seq-len", "128", "--train", "--dtype", "bfloat16", "--json").stdout
    )
    assert bf16["training"]["master_bytes"] == 4 * bf16["parameters"]
    assert "training_bytes" not in json.loads(invoke("memory", "--json").stdout)


def test_budget_with_train_solves_the_training_peak(invoke):
    data = json.loads(
        invoke("memory", "--seq-len", "256", "--train", "--budget", "1GiB", "--json").stdout
    )
    for impl in ("math", "sdpa"):
        config = build_config(impl=impl)

        def peak(length, config=config):
            return estimate_training(build_plan(config, length, 1, 2214)).peak_bytes

        longest = data["max_seq_len"][impl]
        assert peak(longest) <= 2**30 < peak(longest + 1)


@pytest.mark.parametrize(
    "args,message",
    [
        (["run", "hi", "--dropout", "0.1"], "No such option: --dropout"),  # not offered
        (["shapes", "--dropout", "0.1"], "No such option: --dropout"),
        (["memory", "--dropout", "0.1"], "dropout acts only in training; add --train"),
        (["memory", "--train", "--dropout", "1.5"], "dropout must be at least 0 and below 1"),
        (["memory", "--train", "--dropout", "0.1", "--impl", "sdpa"], "use --impl math"),
    ],
)
def test_dropout_misuse_is_a_usage_error(invoke, args, message):
    result = invoke(*args)
    assert result.exit_code == 2 and message in result.stderr


def test_dropout_is_a_stage_of_the_training_plan(invoke):
    out = invoke("memory", "--seq-len", "64", "--train", "--dropout", "0.1").stdout
    assert " dropout " in out and "n/a" in out  # sdpa cannot model dropout: no column value
    data = json.loads(
        invoke("memory", "--seq-len", "64", "--train", "--dropout", "0.1", "--json").stdout
    )
    names = [s["name"] for s in data["stages"]]
    assert names.index("weights") + 1 == names.index("dropout")
    assert set(data["by_impl"]) == {"math"}


def test_dropout_matches_torch_dropout_on_the_weights():
    """With the same RNG state, the layer equals the textbook computation using F.dropout
    on the softmax weights; kept weights are scaled by 1/(1-p), the rest are 0."""
    import math

    import torch.nn.functional as F

    from attnctl.nn.positions import sinusoidal_positions

    p = 0.3
    config = build_config(d_model=32, heads=4, dropout=p, norm="none")
    torch.manual_seed(0)
    layer = AttentionLayer(config, 30)  # training mode: dropout acts
    ids = torch.randint(0, 30, (2, 6))
    with torch.no_grad():
        torch.manual_seed(7)
        ours = layer(ids).attention_output
        x = layer.embedding(ids) + sinusoidal_positions(6, 32)
        q, k, v = (w(x).view(2, 6, 4, 8).transpose(1, 2) for w in (layer.W_q, layer.W_k, layer.W_v))
        weights = (q @ k.transpose(-2, -1) / math.sqrt(8)).softmax(-1)
        torch.manual_seed(7)  # the layer draws nothing else before its dropout
        dropped = F.dropout(weights, p)
        expected = layer.W_o((dropped @ v).transpose(1, 2).reshape(2, 6, 32))
    assert (ours - expected).abs().max() <= 1e-6
    kept = dropped != 0
    assert torch.allclose(dropped[kept], weights[kept] / (1 - p))
    assert 0 < kept.float().mean() < 1
