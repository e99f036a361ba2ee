"""attnctl check: agreement between implementations, and that it fails when they differ."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from covering_arrays import covering_subset

import attnctl.nn.attention
import attnctl.nn.check
import attnctl.nn.layer
import attnctl.nn.positions
from attnctl.errors import AttnctlError
from attnctl.model.config import (
    MASKS,
    NORM_TYPES,
    NORMS,
    POSITIONS,
    LayerConfig,
    build_config,
    validate,
)
from attnctl.nn.check import run_check
from attnctl.nn.layer import AttentionLayer

CPU = ("--device", "cpu")
MHA = "nn.MultiheadAttention"


def pairs_with(oracle: str) -> set[tuple[str, str, str]]:
    """Every comparison check makes: math with sdpa, and both with the oracle."""
    return {
        ("math", "sdpa", "output"),
        ("math", oracle, "output"),
        ("math", oracle, "weights"),
        ("sdpa", oracle, "output"),
        ("math", oracle, "layer output"),
    }


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
    original = attnctl.nn.check.reference_mha

    def skewed(layer):
        mha = original(layer)
        with torch.no_grad():
            mha.out_proj.weight.mul_(1.01)
        return mha

    monkeypatch.setattr(attnctl.nn.check, "reference_mha", skewed)
    result = invoke("check", *CPU)
    assert result.exit_code == 1
    assert "FAIL" in result.stdout and "MISMATCH" in result.stdout
    data = json.loads(invoke("check", *CPU, "--json").stdout)
    failed = [c for c in data["comparisons"] if not c["ok"]]
    assert {(c["a"], c["b"], c["what"]) for c in failed} == {
        ("math", "nn.MultiheadAttention", "output"),
        ("sdpa", "nn.MultiheadAttention", "output"),
        ("math", "nn.MultiheadAttention", "layer output"),
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
    "preset,oracle",
    [("cross-attention", MHA), ("decoder", MHA), ("modern-decoder", "SDPA reference")],
)
def test_check_runs_every_preset(invoke, preset, oracle):
    data = json.loads(invoke("check", "--config", preset, *CPU, "--json").stdout)
    assert data["ok"] and data["gradcheck"]
    assert {(c["a"], c["b"], c["what"]) for c in data["comparisons"]} == pairs_with(oracle)
    assert data["skipped"] == []  # GQA, RoPE: compared, not skipped


# ------------------------------------------------- every variant check accepts, and its oracle
SMALL = {"d_model": 16, "heads": 4, "device": "cpu"}  # d_k 4: even, for RoPE


def accepted_variants() -> list[dict]:
    """pos × mask × norm × norm_type × kv_heads (H, 1, H/2) × cross, where validate accepts."""
    accepted = []
    for pos, mask, norm, norm_type, kv_heads, cross in itertools.product(
        POSITIONS, MASKS, NORMS, NORM_TYPES, (4, 1, 2), (False, True)
    ):
        options = dict(pos=pos, mask=mask, norm=norm, norm_type=norm_type, kv_heads=kv_heads)
        try:
            validate(LayerConfig(**SMALL, **options, cross=cross))
        except AttnctlError:  # cross-attention has no causal mask, no rope and no alibi
            assert cross and (mask == "causal" or pos in ("rope", "alibi"))
            continue
        accepted.append({**options, "cross": cross})
    return accepted


VARIANTS = accepted_variants()


def test_the_product_is_what_validate_accepts():
    # self-attention: 5 pos × 2 masks × 3 norms × 2 norm types × 3 kv-head counts; cross:
    # 3 pos (no rope, no alibi) × no mask × 3 × 2 × 3
    assert len(VARIANTS) == 5 * 2 * 3 * 2 * 3 + 3 * 1 * 3 * 2 * 3 == 234


@pytest.fixture
def one_thread():
    """Tiny tensors: one thread is faster than waiting on a second on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# every three options' values together at least once: 50 of the 234 (check's gradcheck
# makes each a tenth of a second; the product itself is validated above)
COVERING = covering_subset(VARIANTS, strength=3)


@pytest.mark.parametrize("options", COVERING, ids=lambda o: "-".join(map(str, o.values())))
def test_check_passes_for_every_accepted_variant(options, one_thread):
    result = run_check(build_config(**SMALL, **options), batch=2, seq_len=5, vocab_size=30)
    assert result.ok and result.gradcheck and result.skipped == []
    assert all(c.ok for c in result.comparisons), result.comparisons
    oracle = "SDPA reference" if options["pos"] == "rope" else MHA
    assert {(c.a, c.b, c.what) for c in result.comparisons} == pairs_with(oracle)


@pytest.mark.parametrize(
    "options",
    [["--pos", "alibi"], ["--pos", "alibi", "--mask", "causal", "--kv-heads", "2"],
     ["--pos", "rope", "--kv-heads", "1", "--norm", "pre", "--norm-type", "rms"],
     ["--config", "cross-attention", "--pos", "learned", "--kv-heads", "2", "--norm", "none"]],
)  # fmt: skip
def test_check_cli_compares_alibi_rope_and_gqa(invoke, options):
    args = ("check", *options, "--d-model", "16", "--heads", "4", "--seq-len", "5", *CPU)
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert "all agree" in result.stdout and "not compared" not in result.stdout
    data = json.loads(invoke(*args, "--json").stdout)
    assert data["ok"] and data["skipped"] == []
    oracle = "SDPA reference" if "rope" in options else MHA
    assert {(c["a"], c["b"], c["what"]) for c in data["comparisons"]} == pairs_with(oracle)


def test_alibi_check_fails_on_the_old_sdpa_path(monkeypatch):
    """SDPA without the bias (what the layer did before) is caught by math vs sdpa."""
    monkeypatch.setattr(attnctl.nn.attention, "_alibi_attn_mask", lambda *args: args[3])
    result = run_check(build_config(**SMALL, pos="alibi"), 2, 5, 30)
    failed = {(c.a, c.b, c.what) for c in result.comparisons if not c.ok}
    assert failed == {("math", "sdpa", "output"), ("sdpa", MHA, "output")}
    assert not result.ok


def wrong_slopes(heads, seq_len, device=None, dtype=None):
    return 2 * ORIGINAL_ALIBI(heads, seq_len, device, dtype)  # twice the slope


def wrong_rotation(x, cos, sin):
    return ORIGINAL_ROTATE(x, cos, -sin)  # turned the other way


def tiled_repeat(tensor, repeats, dim):
    """[0, 1] -> [0, 1, 0, 1] where repeat_interleave gives [0, 0, 1, 1]."""
    return tensor.repeat(*(repeats if d == dim else 1 for d in range(tensor.dim())))


def wrong_causal_mask(seq_len, device=None):
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril_(1)  # one late key


ORIGINAL_ALIBI, ORIGINAL_ROTATE = attnctl.nn.positions.alibi_bias, attnctl.nn.positions.rotate


@pytest.mark.parametrize(
    "target,broken,options,caught",
    [
        # a wrong bias in both of the layer's paths: only the oracle can see it
        (attnctl.nn.positions, ("alibi_bias", wrong_slopes), {"pos": "alibi"}, {"math", "sdpa"}),
        (attnctl.nn.positions, ("alibi_bias", wrong_slopes), {"pos": "alibi", "mask": "causal"},
         {"math", "sdpa"}),
        (attnctl.nn.positions, ("rotate", wrong_rotation), {"pos": "rope", "kv_heads": 2},
         {"math", "sdpa"}),
        (attnctl.nn.positions, ("scaled_frequency", lambda f, config: f),
         {"pos": "rope", "rope_type": "linear", "rope_factor": 4.0}, {"math", "sdpa"}),
        # the math path's own grouping and causal mask: SDPA does its own
        (torch.Tensor, ("repeat_interleave", tiled_repeat), {"kv_heads": 2}, {"math"}),
        (torch.Tensor, ("repeat_interleave", tiled_repeat), {"kv_heads": 2, "pos": "rope"},
         {"math"}),
        (attnctl.nn.positions, ("causal_mask", wrong_causal_mask), {"mask": "causal"}, {"math"}),
        (attnctl.nn.positions, ("causal_mask", wrong_causal_mask),
         {"mask": "causal", "pos": "rope"}, {"math"}),
        # a norm that does not normalise: after attention, only the layer output shows it;
        # before (pre-norm), the attention of both paths too
        (attnctl.nn.attention, ("norm", lambda config, x, w, b: x * w), {"norm_type": "rms"},
         {"math"}),
        (attnctl.nn.attention, ("norm", lambda config, x, w, b: x * w),
         {"norm_type": "rms", "norm": "pre", "pos": "rope"}, {"math", "sdpa"}),
        (attnctl.nn.attention, ("norm", lambda config, x, w, b: x * w + b), {}, {"math"}),
    ],
)  # fmt: skip
def test_a_broken_variant_in_the_layer_is_caught(monkeypatch, target, broken, options, caught):
    config = build_config(**SMALL, **options)
    assert run_check(config, 2, 5, 30).ok  # before the break
    monkeypatch.setattr(target, *broken)
    result = run_check(config, 2, 5, 30)
    assert not result.ok
    oracle = "SDPA reference" if config.pos == "rope" else MHA
    wrong = {c.a for c in result.comparisons if c.b == oracle and not c.ok}
    assert wrong == caught, result.comparisons


def test_the_sdpa_reference_is_not_the_layer(monkeypatch):
    """It computes its own angles, turns and head mapping: the layer's are never called."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the reference used the layer's own code")

    config = build_config(**SMALL, pos="rope", kv_heads=2, mask="causal")
    torch.manual_seed(0)
    layer = AttentionLayer(config, 30).eval()
    x = torch.randn(2, 5, 16)
    for name in ("rotate", "rotary_angles", "scaled_frequency", "alibi_bias", "causal_mask"):
        monkeypatch.setattr(attnctl.nn.positions, name, forbidden)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", forbidden)
    with torch.no_grad():
        reference = attnctl.nn.check.sdpa_reference_attention(layer, x, x)
    assert reference.output.shape == (2, 5, 16) and reference.weights.shape == (2, 4, 5, 5)


def test_gradcheck_covers_alibi(monkeypatch):
    config = build_config(**SMALL, pos="alibi", mask="causal", kv_heads=2)
    added = []
    original = attnctl.nn.positions.alibi_bias
    monkeypatch.setattr(
        attnctl.nn.positions, "alibi_bias", lambda *args: added.append(args[-1]) or original(*args)
    )
    threads = torch.get_num_threads()
    passed, note = attnctl.nn.check._gradcheck(config, 30)
    assert passed and "float64" in note
    assert torch.get_num_threads() == threads  # gradcheck's one thread, given back
    assert added and set(added) == {torch.float64}  # the float64 copy adds the bias


def test_a_wrong_backward_fails_gradcheck_with_alibi(monkeypatch):
    class DoubledBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, scores):
            return scores.clone()

        @staticmethod
        def backward(ctx, grad):
            return 2 * grad

    config = build_config(**SMALL, pos="alibi")
    monkeypatch.setattr(torch, "softmax", lambda s, dim: DoubledBackward.apply(s).softmax(dim))
    result = run_check(config, 2, 5, 30)
    assert not result.gradcheck and not result.ok


def test_the_layer_output_tolerance_scales_with_its_values(monkeypatch):
    """A residual stream reaches several units, where a bfloat16 step exceeds 5e-2."""
    expected = []
    original = attnctl.nn.check.reference_layer_output

    def recorded(*args):
        expected.append(original(*args))
        return expected[-1]

    monkeypatch.setattr(attnctl.nn.check, "reference_layer_output", recorded)
    result = run_check(build_config(**SMALL, dtype="bfloat16", norm="pre"), 2, 5, 30)
    largest = expected[0].abs().max().item()
    assert largest > 1  # x + attention: the embeddings alone are N(0, 1)
    tolerances = {c.what: c.tolerance for c in result.comparisons}
    assert tolerances == {"output": 5e-2, "weights": 5e-2, "layer output": 5e-2 * largest}
