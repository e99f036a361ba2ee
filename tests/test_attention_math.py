"""Issue 11's attention math as options of the built-in layer: head_dim, query scale,
soft-capping and q/k norms (sliding windows and RoPE scaling have their own files). Each
against a reference written here in float64, one head at a time, plus plan == trace ==
measured bytes and ``check``."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch
from json_contract import only_length

import attnctl.nn.attention
import attnctl.nn.positions
import attnctl.nn.scores
from attnctl.memory.estimate import estimate
from attnctl.memory.measure import measure_forward
from attnctl.model.config import build_config
from attnctl.nn.check import run_check
from attnctl.nn.layer import TORCH_DTYPES, AttentionLayer, Recorder
from attnctl.nn.positions import sinusoidal_positions
from attnctl.stages.plan import build_plan
from tests.test_variants import assert_plan_matches

CPU = ("--device", "cpu")
SDPA_REFERENCE = "SDPA reference"


def reference_attention(layer: AttentionLayer, ids: torch.Tensor, padding=None):
    """Attention by its formula, in float64, one query head at a time: (output, weights).

    Query head h reads K/V head h // (H / Hkv); the scores are q·k scaled by query_scale
    (else 1/√d_k), soft-capped (cap·tanh(s/cap)), then masked: causal, and ``padding``
    (B, L), True = a real key. Sinusoidal positions only (what these tests use).
    """
    config = layer.config
    b, length = ids.shape
    h, hkv, d_k = config.heads, config.kv_heads, config.d_k
    x = layer.embedding(ids).double() + sinusoidal_positions(length, config.d_model).double()

    def project(linear, width):  # (B, L, width) -> (B, L, heads, d_k)
        out = x @ linear.weight.double().T
        if linear.bias is not None:
            out = out + linear.bias.double()
        return out.view(b, length, width, d_k)

    q, k, v = project(layer.W_q, h), project(layer.W_k, hkv), project(layer.W_v, hkv)
    if config.qk_norm != "none":  # (B, L, heads, d_k): over d_k, or over heads·d_k
        over = (-1,) if config.qk_norm == "head" else (-2, -1)
        q, k = (
            qk_norm_reference(config, q, layer.q_norm, over),
            qk_norm_reference(config, k, layer.k_norm, over),
        )
    scale = config.query_scale or 1 / math.sqrt(d_k)
    weights = torch.empty(b, h, length, length, dtype=torch.float64)
    heads_out = []
    for head in range(h):
        kv = head // (h // hkv)
        scores = q[:, :, head] @ k[:, :, kv].transpose(1, 2) * scale  # (B, L, L)
        if config.softcap:
            scores = config.softcap * torch.tanh(scores / config.softcap)
        for i in range(length):
            for j in range(length):
                if config.mask == "causal" and j > i:
                    scores[:, i, j] = -math.inf
                if config.window and j <= i - config.window:
                    scores[:, i, j] = -math.inf
                if padding is not None:
                    scores[~padding[:, j], i, j] = -math.inf
        weights[:, head] = scores.softmax(-1)
        heads_out.append(weights[:, head] @ v[:, :, kv])  # (B, L, d_k)
    concat = torch.cat(heads_out, dim=-1)  # (B, L, H·d_k)
    output = concat @ layer.W_o.weight.double().T
    if layer.W_o.bias is not None:
        output = output + layer.W_o.bias.double()
    return output, weights


def qk_norm_reference(config, t: torch.Tensor, norm, over: tuple[int, ...]) -> torch.Tensor:
    """LayerNorm or RMSNorm of t (B, L, heads, d_k) over the dims ``over``, float64."""
    shape = t.shape[over[0] :]
    weight = norm.weight.double().view(shape)
    if config.norm_type == "rms":
        return t / torch.sqrt(t.pow(2).mean(over, keepdim=True) + config.norm_eps) * weight
    centred = t - t.mean(over, keepdim=True)
    variance = centred.pow(2).mean(over, keepdim=True)
    return centred / torch.sqrt(variance + config.norm_eps) * weight + norm.bias.double().view(
        shape
    )


def assert_plan_matches_in_dtype(config, batch=2, seq_len=9, long=256):
    """As test_variants' assert_plan_matches, with the layer in the config's dtype."""
    torch.manual_seed(0)
    layer = AttentionLayer(config, 20).to(TORCH_DTYPES[config.dtype]).eval()
    record = Recorder()
    with torch.inference_mode():
        layer(torch.randint(0, 20, (batch, seq_len)), record)
    plan = build_plan(config, seq_len, batch, 20, device="cpu")
    assert [s.to_dict() for s in record.stages] == [s.to_dict() for s in plan.stages]
    big = build_plan(config, long, batch, 20)
    assert list(measure_forward(big).stage_peak_bytes) == list(estimate(big).live_bytes)
    return plan


def assert_matches_reference(config, length=7):
    torch.manual_seed(0)
    layer = AttentionLayer(config, 30).eval()
    ids = torch.randint(0, 30, (2, length))
    with torch.no_grad():
        ours = layer(ids)
        output, weights = reference_attention(layer, ids)
    assert (ours.weights.double() - weights).abs().max() <= 1e-6
    assert (ours.attention_output.double() - output).abs().max() <= 1e-5
    return layer


# ---------------------------------------------------------------- head_dim


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_head_dim_matches_the_formula(kv_heads, mask):
    config = build_config(d_model=24, heads=4, head_dim=10, kv_heads=kv_heads, mask=mask)
    layer = assert_matches_reference(config)
    assert layer.W_q.weight.shape == (40, 24) and layer.W_o.weight.shape == (24, 40)
    assert layer.W_k.weight.shape == layer.W_v.weight.shape == (kv_heads * 10, 24)


@pytest.mark.parametrize("impl", ["math", "sdpa"])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("pos", ["sinusoidal", "rope"])
def test_head_dim_plan_equals_trace_and_measurement(impl, kv_heads, pos):
    config = build_config(
        d_model=48, heads=4, head_dim=16, kv_heads=kv_heads, impl=impl, pos=pos, device="cpu"
    )
    plan = assert_plan_matches(config)
    assert plan.sizes["D_q"] == 64 and plan.sizes["d_k"] == 16
    assert plan.stage("q").dims == ("B", "L", "D_q") and plan.stage("q").shape == (2, 9, 64)
    assert plan.stage("concat").dims == ("B", "L", "D_q")
    assert plan.stage("output_projection").shape == (2, 9, 48)
    kv = plan.stage("k").dims[-1]
    assert kv == ("D_q" if kv_heads == 4 else "D_kv")
    shapes = {p.name: p.shape for p in plan.parameters}
    assert shapes["W_q.weight"] == (64, 48) and shapes["W_o.weight"] == (48, 64)
    assert shapes["W_o.bias"] == (48,) and shapes["W_k.weight"] == (kv_heads * 16, 48)
    torch.manual_seed(0)
    layer = AttentionLayer(config, 20)
    assert plan.parameter_count == sum(p.numel() for p in layer.parameters())


def test_head_dim_equal_to_d_over_h_changes_nothing():
    plain = build_config(d_model=32, heads=4, device="cpu")
    explicit = build_config(d_model=32, heads=4, head_dim=8, device="cpu")
    assert explicit.d_k == plain.d_k == 8
    assert [s.to_dict() for s in assert_plan_matches(explicit).stages] == [
        s.to_dict() for s in assert_plan_matches(plain).stages
    ]


def test_head_dim_in_the_cli(invoke):
    args = ("--d-model", "32", "--heads", "4", "--head-dim", "12")
    shapes = invoke("shapes", *args).stdout
    assert "D_q=48" in shapes and "B L D_q" in shapes
    vocab = json.loads(invoke("shapes", *args, "--json").stdout)["sizes"]["V"]
    memory = only_length(json.loads(invoke("memory", *args, "--seq-len", "8", "--json").stdout))
    # the embedding; W_q, W_k, W_v: (48, 32) + 48 each; W_o: (32, 48) + 32; the LayerNorm
    assert memory["parameters"] == vocab * 32 + 3 * (48 * 32 + 48) + 32 * 48 + 32 + 2 * 32
    check = json.loads(invoke("check", *args, *CPU, "--json").stdout)
    assert check["ok"] and check["skipped"] == []
    assert {c["b"] for c in check["comparisons"]} == {"sdpa", SDPA_REFERENCE}
    run = json.loads(invoke("run", "Are you OK?", *args, *CPU, "--json").stdout)
    stages = {s["name"]: s for s in run["stages"]}
    assert stages["concat"]["shape"] == [1, 4, 48] and stages["q_heads"]["shape"] == [1, 4, 4, 12]


def test_heads_need_not_divide_d_model_with_a_head_dim(invoke):
    assert invoke("shapes", "--heads", "3").exit_code == 2
    result = invoke("shapes", "--heads", "3", "--head-dim", "64")
    assert result.exit_code == 0 and "D_q=192" in result.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--head-dim", "-1"], "head_dim must be 0 (= d_model/heads) or a positive integer"),
        (["--head-dim", str(2**63)], "head_dim must be 0 (= d_model/heads) or a positive integer"),
        (["--head-dim", str(2**62), "--heads", "4"], "heads·head_dim must be below 2^63"),
        (["--head-dim", "7", "--pos", "rope"], "d_k=7 must be even"),
    ],
)
def test_head_dim_misuse_exits_2(invoke, args, message):
    result = invoke("shapes", *args)
    assert result.exit_code == 2 and message in result.stderr and result.stdout == ""


@pytest.mark.parametrize("impl", ["math", "sdpa"])
def test_head_dim_training_is_measured_as_estimated(invoke, impl):
    args = ("memory", "--train", "--head-dim", "32", "--seq-len", "24", "--batch", "2")
    result = invoke(*args, "--impl", impl, "--measure", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    data = only_length(json.loads(result.stdout))
    assert data["measured_what"] == "training step"
    assert data["measured_peak_bytes"] == data["training_bytes"]


def test_a_layer_scaling_by_d_over_h_is_caught_with_a_head_dim(monkeypatch):
    """√(D/H) where √d_k belongs: only the math path divides by it, the oracle sees it."""
    config = build_config(d_model=16, heads=4, head_dim=8, device="cpu")
    assert run_check(config, 2, 5, 30).ok
    wrong = types.SimpleNamespace(sqrt=lambda n: math.sqrt(16 / 4))
    monkeypatch.setattr(attnctl.nn.scores, "math", wrong)
    result = run_check(config, 2, 5, 30)
    failed = {(c.a, c.b) for c in result.comparisons if not c.ok}
    assert ("math", SDPA_REFERENCE) in failed and ("sdpa", SDPA_REFERENCE) not in failed


# ---------------------------------------------------------------- query scale


@pytest.mark.parametrize("impl", ["math", "sdpa"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_query_scale_matches_the_formula(impl, kv_heads):
    config = build_config(
        d_model=32, heads=4, kv_heads=kv_heads, query_scale=0.0625, mask="causal", impl=impl
    )
    torch.manual_seed(0)
    layer = AttentionLayer(config, 30).eval()
    ids = torch.randint(0, 30, (2, 7))
    with torch.no_grad():
        ours = layer(ids, window=([0, 3], [0, 6]))
        output, weights = reference_attention(layer, ids)
    assert (ours.attention_output.double() - output).abs().max() <= 1e-5
    assert (ours.window.double() - weights[:, [0, 3]][:, :, [0, 6]]).abs().max() <= 1e-6
    if impl == "math":
        assert (ours.weights.double() - weights).abs().max() <= 1e-6
    # not what 1/√d_k gives: the option acts
    plain = reference_attention(
        AttentionLayer(build_config(d_model=32, heads=4, kv_heads=kv_heads, mask="causal"), 30),
        ids,
    )[1]
    assert (plain - weights).abs().max() > 1e-2


@pytest.mark.parametrize("impl", ["math", "sdpa"])
def test_query_scale_plan_equals_trace_and_measurement(impl):
    config = build_config(d_model=32, heads=4, query_scale=0.25, impl=impl, device="cpu")
    plan = assert_plan_matches(config)
    if impl == "math":
        assert plan.stage("scores").what.startswith("Q · Kᵀ · 0.25")
    else:
        assert "(scale 0.25)" in plan.stage("weighted_values").what


def test_query_scale_in_check_and_its_break(monkeypatch, invoke):
    data = json.loads(invoke("check", "--query-scale", "0.3", *CPU, "--json").stdout)
    assert data["ok"] and {c["b"] for c in data["comparisons"]} == {"sdpa", SDPA_REFERENCE}
    config = build_config(d_model=16, heads=4, query_scale=0.3, device="cpu")
    monkeypatch.setattr(
        attnctl.nn.attention, "scale_scores", lambda config, s: s.div_(math.sqrt(config.d_k))
    )
    result = run_check(config, 2, 5, 30)
    failed = {(c.a, c.b) for c in result.comparisons if not c.ok}
    assert failed == {("math", "sdpa"), ("math", SDPA_REFERENCE)}


@pytest.mark.parametrize(
    "value,message",
    [("-0.5", "query_scale must be positive (0 = 1/√d_k), got -0.5"),
     ("nan", "query_scale must be a finite number")],
)  # fmt: skip
def test_query_scale_misuse_exits_2(invoke, value, message):
    result = invoke("shapes", "--query-scale", value)
    assert result.exit_code == 2 and message in result.stderr and result.stdout == ""


def test_query_scale_training_is_measured():
    from attnctl.memory.measure import measure_training
    from attnctl.replay.step import estimate_training
    from attnctl.stages.plan import build_plan

    for impl in ("math", "sdpa"):
        config = build_config(d_model=40, heads=5, query_scale=0.1, impl=impl, device="cpu")
        plan = build_plan(config, 24, 2, vocab_size=7)
        measured = measure_training(config, plan).peak_bytes
        assert measured == pytest.approx(estimate_training(plan).peak_bytes, rel=0.02)


# ---------------------------------------------------------------- soft-capping


@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("kv_heads", [4, 1])
def test_softcap_matches_the_formula(mask, kv_heads):
    config = build_config(d_model=32, heads=4, kv_heads=kv_heads, softcap=0.5, mask=mask)
    torch.manual_seed(0)
    layer = AttentionLayer(config, 30).eval()
    ids = torch.randint(0, 30, (2, 7))
    padding = None if mask == "causal" else torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    with torch.no_grad():
        ours = layer(ids, padding=padding)
        output, weights = reference_attention(layer, ids, padding)
    assert (ours.weights.double() - weights).abs().max() <= 1e-6
    assert (ours.attention_output.double() - output).abs().max() <= 1e-5
    if padding is not None:  # capped before the padding: padded keys keep weight 0
        assert ours.weights[1, :, :, 4:].abs().max() == 0
    # a cap of 0.5 flattens these scores: the weights are not the uncapped ones
    plain = AttentionLayer(build_config(**{**config.to_dict(), "softcap": 0.0}), 30).eval()
    plain.load_state_dict(layer.state_dict())
    with torch.no_grad():
        assert (plain(ids, padding=padding).weights - ours.weights).abs().max() > 1e-2


@pytest.mark.parametrize("padded,mask", [(False, "none"), (True, "none"), (False, "causal")])
def test_softcap_plan_equals_trace_and_measurement(padded, mask):
    config = build_config(d_model=32, heads=4, softcap=20.0, mask=mask, device="cpu")
    inputs = {}
    if padded:
        inputs["padding"] = torch.ones(2, 9, dtype=torch.bool)
    plan = assert_plan_matches(config, padded=padded, **inputs)
    names = [s.name for s in plan.stages]
    assert names.index("softcap") == names.index("scores") + 1
    assert plan.stage("softcap").view_of == "scores"
    assert plan.stage("softcap").what.startswith("20·tanh(scores/20)")


def test_softcap_picks_the_math_path_and_refuses_sdpa(invoke):
    from attnctl.model.config import resolve_impl

    config = build_config(softcap=30.0)
    assert resolve_impl(config, shows_every_weight=False).impl == "math"
    result = invoke("shapes", "--softcap", "30", "--impl", "sdpa")
    assert result.exit_code == 2 and "F.scaled_dot_product_attention cannot apply it" in (
        result.stderr
    )
    long = json.loads(invoke("run", "Are you OK? " * 30, "--softcap", "30", *CPU, "--json").stdout)
    assert long["impl"] == "math"
    assert "softcap" in [s["name"] for s in long["stages"]]


def test_softcap_in_check_and_its_break(monkeypatch, invoke):
    result = invoke("check", "--softcap", "2", "--mask", "causal", *CPU)
    assert result.exit_code == 0 and "all agree" in result.stdout
    assert "not compared: sdpa: F.scaled_dot_product_attention cannot soft-cap" in result.stdout
    data = json.loads(invoke("check", "--softcap", "2", *CPU, "--json").stdout)
    assert {(c["a"], c["b"], c["what"]) for c in data["comparisons"]} == {
        ("math", SDPA_REFERENCE, "output"),
        ("math", SDPA_REFERENCE, "weights"),
        ("math", SDPA_REFERENCE, "layer output"),
    }
    assert len(data["skipped"]) == 1
    config = build_config(d_model=16, heads=4, softcap=0.5, device="cpu")
    monkeypatch.setattr(attnctl.nn.attention, "soft_cap", lambda scores, cap: scores)
    result = run_check(config, 2, 5, 30)
    assert not result.ok
    assert {c.what for c in result.comparisons if not c.ok} >= {"output", "weights"}


@pytest.mark.parametrize(
    "args,message",
    [(["shapes", "--softcap", "-1"], "softcap must be positive (0 = off), got -1.0"),
     (["shapes", "--softcap", "inf"], "softcap must be a finite number")],
)  # fmt: skip
def test_softcap_misuse_exits_2(invoke, args, message):
    result = invoke(*args)
    assert result.exit_code == 2 and message in result.stderr and result.stdout == ""


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_softcap_training_is_measured_as_estimated(invoke, dtype):
    args = ("memory", "--train", "--softcap", "5", "--impl", "math", "--seq-len", "24")
    result = invoke(*args, "--batch", "2", "--dtype", dtype, "--measure", *CPU, "--json")
    assert result.exit_code == 0, result.output
    data = only_length(json.loads(result.stdout))
    assert data["measured_what"] == "training step"
    assert data["measured_peak_bytes"] == data["training_bytes"]


# ---------------------------------------------------------------- q/k norms


def varied(layer: AttentionLayer) -> AttentionLayer:
    """The q/k norms' weights and biases away from 1 and 0, so the reference sees them."""
    torch.manual_seed(1)
    with torch.no_grad():
        for norm in (layer.q_norm, layer.k_norm):
            for parameter in norm.parameters():
                parameter.add_(torch.randn(parameter.shape) * 0.5)
    return layer


@pytest.mark.parametrize("qk_norm", ["head", "all"])
@pytest.mark.parametrize("norm_type", ["rms", "layer"])
@pytest.mark.parametrize("kv_heads,impl", [(4, "math"), (2, "math"), (2, "sdpa")])
def test_qk_norm_matches_the_formula(qk_norm, norm_type, kv_heads, impl):
    config = build_config(
        d_model=24, heads=4, head_dim=8, kv_heads=kv_heads, qk_norm=qk_norm,
        norm_type=norm_type, impl=impl, mask="causal",
    )  # fmt: skip
    torch.manual_seed(0)
    layer = varied(AttentionLayer(config, 30).eval())
    per_head = qk_norm == "head"
    assert layer.q_norm.weight.shape == ((8,) if per_head else (32,))
    assert layer.k_norm.weight.shape == ((8,) if per_head else (kv_heads * 8,))
    ids = torch.randint(0, 30, (2, 7))
    with torch.no_grad():
        ours = layer(ids, window=([1], [2, 6]))
        output, weights = reference_attention(layer, ids)
    assert (ours.attention_output.double() - output).abs().max() <= 1e-5
    assert (ours.window.double() - weights[:, [1]][:, :, [2, 6]]).abs().max() <= 1e-6
    # per head and across heads are different norms: the reference tells them apart
    other = build_config(**{**config.to_dict(), "qk_norm": "all" if per_head else "head"})
    with torch.no_grad():
        assert (reference_attention(AttentionLayer(other, 30), ids)[0] - output).abs().max() > 1e-3


@pytest.mark.parametrize("qk_norm", ["head", "all"])
@pytest.mark.parametrize(
    "impl,kv_heads,pos",
    [("math", 2, "rope"), ("sdpa", 2, "rope"), ("math", 4, "none"), ("sdpa", 4, "none")],
)
@pytest.mark.parametrize(
    "norm_type,dtype", [("rms", "float32"), ("layer", "float32"), ("rms", "bfloat16")]
)
def test_qk_norm_plan_equals_trace_and_measurement(qk_norm, impl, kv_heads, pos, norm_type, dtype):
    config = build_config(
        d_model=32, heads=4, kv_heads=kv_heads, qk_norm=qk_norm, norm_type=norm_type,
        impl=impl, pos=pos, dtype=dtype, device="cpu",
    )  # fmt: skip
    plan = assert_plan_matches_in_dtype(config)
    names = [s.name for s in plan.stages]
    assert plan.stage("q_heads").view_of == "q_norm" and plan.stage("k_heads").view_of == "k_norm"
    if qk_norm == "all":
        assert names[names.index("q") + 1] == "q_norm" and names[names.index("k") + 1] == "k_norm"
    else:
        assert plan.stage("q_norm").dims == ("B", "L", "H", "d_k")
    torch.manual_seed(0)
    layer = AttentionLayer(config, 20)
    shapes = {name: tuple(p.shape) for name, p in layer.named_parameters()}
    assert {p.name: p.shape for p in plan.parameters} == shapes


def test_qk_norm_in_check_and_its_break(monkeypatch, invoke):
    for qk_norm in ("head", "all"):
        data = json.loads(invoke("check", "--qk-norm", qk_norm, *CPU, "--json").stdout)
        assert data["ok"] and data["skipped"] == []
        assert {c["b"] for c in data["comparisons"]} == {"sdpa", SDPA_REFERENCE}
    config = build_config(d_model=16, heads=4, qk_norm="head", norm="none", device="cpu")
    assert run_check(config, 2, 5, 30).ok
    # a q/k norm that ignores its weight: check's varied weights show it in both paths
    monkeypatch.setattr(
        attnctl.nn.attention, "norm", lambda config, x, w, b: torch.nn.functional.layer_norm(
            x, (x.shape[-1],), None, None, config.norm_eps)
    )  # fmt: skip
    result = run_check(config, 2, 5, 30)
    wrong = {c.a for c in result.comparisons if c.b == SDPA_REFERENCE and not c.ok}
    assert wrong == {"math", "sdpa"}


@pytest.mark.parametrize(
    "args,message",
    [(["shapes", "--qk-norm", "both"], "'both' is not one of"),
    ],
)  # fmt: skip
def test_qk_norm_misuse_exits_2(invoke, args, message):
    result = invoke(*args)
    assert result.exit_code == 2 and message in result.stderr and result.stdout == ""


@pytest.mark.parametrize("qk_norm", ["head", "all"])
@pytest.mark.parametrize("impl", ["math", "sdpa"])
def test_qk_norm_training_is_measured_as_estimated(invoke, impl, qk_norm):
    args = ("memory", "--train", "--qk-norm", qk_norm, "--norm-type", "rms", "--seq-len", "24")
    result = invoke(*args, "--batch", "2", "--impl", impl, "--measure", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    data = only_length(json.loads(result.stdout))
    assert data["measured_what"] == "training step"
    assert data["measured_peak_bytes"] == data["training_bytes"]


# ---------------------------------------------------------------- preset keys


def test_the_new_preset_keys_equal_the_flags(tmp_path, invoke):
    path = tmp_path / "gemma-ish.toml"
    path.write_text(
        "d_model = 32\nheads = 4\nhead_dim = 12\nquery_scale = 0.25\nsoftcap = 30\n"
        'qk_norm = "head"\nnorm_type = "rms"\nmask = "causal"\nwindow = 3\npos = "rope"\n'
    )
    flags = ("--d-model", "32", "--heads", "4", "--head-dim", "12", "--query-scale", "0.25",
             "--softcap", "30", "--qk-norm", "head", "--norm-type", "rms", "--mask", "causal",
             "--window", "3", "--pos", "rope")  # fmt: skip
    from_preset = json.loads(invoke("shapes", "-c", str(path), "--json").stdout)
    from_flags = json.loads(invoke("shapes", *flags, "--json").stdout)
    assert from_preset == from_flags
    config = from_preset["config"]
    assert (config["head_dim"], config["query_scale"], config["softcap"]) == (12, 0.25, 30.0)
    assert (config["qk_norm"], config["window"]) == ("head", 3)
    names = [s["name"] for s in from_preset["stages"]]
    assert {"q_norm", "k_norm", "softcap", "mask"} <= set(names)


@pytest.mark.parametrize(
    "line,message",
    [("head_dim = 1.5", "head_dim must be int, got float 1.5"),
     ("window = true", "window must be int, got bool True"),
     ("qk_norm = 1", "qk_norm must be str, got int 1"),
     ("qk_norm = 'rms'", "qk_norm must be one of none, head, all; got 'rms'"),
     ("softcap = 'off'", "softcap must be float, got str 'off'"),
     ("query_scale = -1", "query_scale must be positive (0 = 1/√d_k), got -1.0")],
)  # fmt: skip
def test_bad_new_preset_keys_are_named(tmp_path, invoke, line, message):
    path = tmp_path / "bad.toml"
    path.write_text(line + "\n")
    result = invoke("shapes", "-c", str(path))
    assert result.exit_code == 2 and message in result.stderr and result.stdout == ""


def test_the_layer_line_names_the_new_math(invoke):
    args = ("--softcap", "30", "--window", "4", "--mask", "causal", "--qk-norm", "head")
    out = invoke("shapes", *args, "--query-scale", "0.5", columns=200).stdout
    assert "· window 4 · qk-norm head · query scale 0.5 · softcap 30" in out
    assert "window" not in invoke("shapes", columns=200).stdout.splitlines()[1]
