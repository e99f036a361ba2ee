"""Sliding-window attention for the built-in layer, and every combination of issue 11's
new attention options through ``check``."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from covering_arrays import covering_subset
from json_contract import only_length

import attnctl.nn.positions
from attnctl.model.config import build_config
from attnctl.nn.check import run_check
from attnctl.nn.layer import AttentionLayer
from tests.test_attention_math import CPU, SDPA_REFERENCE, reference_attention
from tests.test_variants import assert_plan_matches

# ---------------------------------------------------------------- sliding window


@pytest.mark.parametrize("length,window", [(1, 1), (6, 1), (9, 4), (9, 9), (5, 12)])
def test_the_window_mask_is_transformers_sliding_window(length, window):
    from transformers.masking_utils import sliding_window_causal_mask_function

    from attnctl.nn.positions import visible_keys

    visible = sliding_window_causal_mask_function(window)
    index = [torch.tensor(n) for n in range(length)]
    expected = torch.tensor([[bool(visible(0, 0, i, j)) for j in index] for i in index])
    assert torch.equal(visible_keys(length, window), expected)


@pytest.mark.parametrize("impl", ["math", "sdpa"])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("window", [1, 3, 20])
def test_window_matches_the_formula(impl, kv_heads, window):
    config = build_config(
        d_model=32, heads=4, kv_heads=kv_heads, window=window, mask="causal", impl=impl
    )
    torch.manual_seed(0)
    layer = AttentionLayer(config, 30).eval()
    ids = torch.randint(0, 30, (2, 11))
    with torch.no_grad():
        ours = layer(ids, window=([0, 2], [0, 5, 10]))
        output, weights = reference_attention(layer, ids)
    assert (ours.attention_output.double() - output).abs().max() <= 1e-5
    assert (ours.window.double() - weights[:, [0, 2]][:, :, [0, 5, 10]]).abs().max() <= 1e-6
    if impl == "math":
        assert (ours.weights.double() - weights).abs().max() <= 1e-6
    seen = (weights[0, 0] > 0).sum(-1)  # keys each query sees: min(i + 1, window)
    assert seen.tolist() == [min(i + 1, window) for i in range(11)]


@pytest.mark.parametrize(
    "impl,pos,kv_heads",
    [("math", "none", 4), ("sdpa", "none", 4), ("math", "rope", 2), ("sdpa", "rope", 2),
     ("math", "alibi", 4)],
)  # fmt: skip
def test_window_plan_equals_trace_and_measurement(impl, pos, kv_heads):
    config = build_config(
        d_model=32, heads=4, kv_heads=kv_heads, pos=pos, window=4, mask="causal", impl=impl,
        device="cpu",
    )  # fmt: skip
    plan = assert_plan_matches(config)
    assert "sliding window 4: query i sees keys i - 4 < j <= i" in plan.stage("mask").what
    if impl == "sdpa":
        assert "mask" in plan.stage("weighted_values").reads
    from attnctl.model.describe import seeded_model

    assert seeded_model(config, 20).blocks[0].attention.window == 4


def test_window_in_the_cli_and_check(invoke):
    args = ("--mask", "causal", "--window", "2")
    data = json.loads(invoke("check", *args, "--seq-len", "6", *CPU, "--json").stdout)
    assert data["ok"] and data["skipped"] == []
    assert {c["b"] for c in data["comparisons"]} == {"sdpa", "nn.MultiheadAttention"}
    run = json.loads(invoke("run", "Are you OK now?", *args, *CPU, "--json").stdout)
    weights = torch.tensor(run["attention"])[0, 0]  # (L, L)
    assert ((weights > 0).sum(-1) == torch.tensor([1] + [2] * (weights.shape[0] - 1))).all()
    shapes = invoke("shapes", *args, "--impl", "sdpa", columns=200).stdout
    assert "sliding window 2" in shapes and "SDPA's attn_mask" in shapes


def test_a_layer_without_its_window_is_caught(monkeypatch):
    config = build_config(d_model=16, heads=4, mask="causal", window=2, device="cpu")
    assert run_check(config, 2, 6, 30).ok
    monkeypatch.setattr(
        attnctl.nn.positions, "visible_keys", lambda n, w, device=None: torch.ones(
            n, n, dtype=torch.bool, device=device).tril_()
    )  # fmt: skip
    result = run_check(config, 2, 6, 30)
    wrong = {c.a for c in result.comparisons if c.b == "nn.MultiheadAttention" and not c.ok}
    assert wrong == {"math", "sdpa"}


@pytest.mark.parametrize(
    "args,message",
    [(["shapes", "--window", "4"], "it needs --mask causal"),
     (["shapes", "--window", "-1", "--mask", "causal"], "window must be 0 (none) or a positive")],
)  # fmt: skip
def test_window_misuse_exits_2(invoke, args, message):
    result = invoke(*args)
    assert result.exit_code == 2 and message in result.stderr and result.stdout == ""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("impl", ["math", "sdpa"])
def test_window_training_is_measured_as_estimated(invoke, impl, dtype):
    """The math path masks the scores with the windowed mask; SDPA gets it as attn_mask."""
    args = ("memory", "--train", "--window", "4", "--mask", "causal", "--seq-len", "24")
    result = invoke(*args, "--batch", "2", "--impl", impl, "--dtype", dtype, "--measure", *CPU,
                    "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    data = only_length(json.loads(result.stdout))
    assert data["measured_what"] == "training step"
    assert data["measured_peak_bytes"] == data["training_bytes"]


# ------------------------------------- every combination of the new options, in check

SMALL = {"d_model": 16, "heads": 4, "device": "cpu"}
NEW_OPTIONS = [
    dict(head_dim=head_dim, query_scale=query_scale, softcap=softcap, qk_norm=qk_norm,
         window=window)
    for head_dim, query_scale, softcap, qk_norm, window in itertools.product(
        (0, 6), (0.0, 0.3), (0.0, 2.0), ("none", "head", "all"), (0, 2)
    )
]  # fmt: skip


def new_variants() -> list[dict]:
    """Every combination of the new options, with each position (self-attention) and
    without a window in cross-attention; kv-heads, norms and the mask vary along."""
    variants = []
    for n, new in enumerate(NEW_OPTIONS):
        for pos in ("none", "rope", "alibi"):
            mask = "causal" if new["window"] or n % 2 else "none"
            base = dict(
                pos=pos, mask=mask, kv_heads=(4, 2, 1)[n % 3], norm=("post", "pre", "none")[n % 3],
                norm_type=("layer", "rms")[n // 3 % 2],
            )  # fmt: skip
            variants.append({**base, **new})
        if not new["window"]:
            variants.append({**new, "pos": "learned", "kv_heads": 2, "cross": True})
    return variants


NEW_VARIANTS = new_variants()


def test_the_new_variants_are_all_accepted():
    from attnctl.model.config import LayerConfig, validate

    assert len(NEW_VARIANTS) == 48 * 3 + 24
    for options in NEW_VARIANTS:
        validate(LayerConfig(**SMALL, **options))


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# every three options' values together at least once: 37 of the 168
NEW_COVERING = covering_subset(NEW_VARIANTS, strength=3)


@pytest.mark.parametrize("options", NEW_COVERING, ids=lambda o: "-".join(map(str, o.values())))
def test_check_passes_for_every_new_variant(options, one_thread):
    config = build_config(**SMALL, **options)
    result = run_check(config, batch=2, seq_len=5, vocab_size=30)
    assert result.ok and result.gradcheck, result.comparisons
    plain = (
        config.pos != "rope" and not config.head_dim and not config.query_scale
        and not config.softcap and config.qk_norm == "none"
    )  # fmt: skip
    oracle = "nn.MultiheadAttention" if plain else SDPA_REFERENCE
    pairs = {(c.a, c.b, c.what) for c in result.comparisons}
    expected = {("math", oracle, "output"), ("math", oracle, "weights"),
                ("math", oracle, "layer output")}  # fmt: skip
    if not config.softcap:
        expected |= {("math", "sdpa", "output"), ("sdpa", oracle, "output")}
    assert pairs == expected
    cannot = "sdpa: F.scaled_dot_product_attention cannot soft-cap the scores"
    assert result.skipped == ([cannot] if config.softcap else [])
