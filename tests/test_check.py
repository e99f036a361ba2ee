"""attnctl check: agreement between implementations, and that it fails when they differ."""

from __future__ import annotations

import json

import pytest
import torch

import attnctl.check

CPU = ("--device", "cpu")


@pytest.mark.parametrize(
    "options",
    [[], ["--mask", "causal", "--no-bias", "--pos", "none", "--norm", "none"],
     ["--dtype", "bfloat16"], ["--dtype", "float16", "--heads", "4", "--d-model", "64"]],
)  # fmt: skip
def test_implementations_agree(invoke, options):
    result = invoke("check", *options, *CPU)
    assert result.exit_code == 0, result.output
    assert "all agree" in result.stdout and "gradcheck: ok" in result.stdout
    data = json.loads(invoke("check", *options, *CPU, "--json").stdout)
    pairs = {(c["a"], c["b"], c["what"]) for c in data["comparisons"]}
    assert ("math", "sdpa", "output") in pairs
    assert ("math", "nn.MultiheadAttention", "weights") in pairs
    assert all(c["max_abs_diff"] <= c["tolerance"] for c in data["comparisons"])
    assert data["gradcheck"] is True and data["ok"] is True


def test_a_wrong_reference_makes_check_fail(invoke, monkeypatch):
    original = attnctl.check.reference_mha

    def skewed(layer):
        mha = original(layer)
        with torch.no_grad():
            mha.out_proj.weight.mul_(1.01)
        return mha

    monkeypatch.setattr(attnctl.check, "reference_mha", skewed)
    result = invoke("check", *CPU)
    assert result.exit_code == 1
    assert "FAIL" in result.stdout and "MISMATCH" in result.stdout
    data = json.loads(invoke("check", *CPU, "--json").stdout)
    failed = [c for c in data["comparisons"] if not c["ok"]]
    assert {(c["a"], c["b"], c["what"]) for c in failed} == {
        ("math", "nn.MultiheadAttention", "output"),
        ("sdpa", "nn.MultiheadAttention", "output"),
    }


def test_a_wrong_backward_makes_gradcheck_fail(invoke, monkeypatch):
    class WrongSoftmax(torch.autograd.Function):
        @staticmethod
        def forward(ctx, scores, dim):
            out = scores.softmax(dim)
            ctx.save_for_backward(out)
            return out

        @staticmethod
        def backward(ctx, grad):
            (out,) = ctx.saved_tensors
            return 2 * out * (grad - (grad * out).sum(-1, keepdim=True)), None  # 2x too big

    monkeypatch.setattr(torch, "softmax", lambda scores, dim: WrongSoftmax.apply(scores, dim))
    result = invoke("check", *CPU, "--json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["gradcheck"] is False and data["ok"] is False


def test_check_rejects_bad_input(invoke):
    assert invoke("check", "--heads", "7").exit_code == 2
    assert invoke("check", "--seq-len", "0").exit_code == 2
    assert "No such option: --dropout" in invoke("check", "--dropout", "0.1").stderr


@pytest.mark.parametrize(
    "preset,compared_with_torch",
    [("cross-attention", True), ("decoder", True), ("modern-decoder", False)],
)
def test_check_runs_every_preset(invoke, preset, compared_with_torch):
    data = json.loads(invoke("check", "--config", preset, *CPU, "--json").stdout)
    assert data["ok"] and data["gradcheck"]
    torch_pairs = [c for c in data["comparisons"] if c["b"] == "nn.MultiheadAttention"]
    assert bool(torch_pairs) == compared_with_torch
    assert bool(data["skipped"]) != compared_with_torch
