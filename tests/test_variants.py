"""The attention variants of issue 5, each against an independent reference written here."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from json_contract import only_length

from attnctl.memory.estimate import allowed_impls, estimate, kv_cache_bytes, variant_table
from attnctl.memory.measure import measure_forward
from attnctl.model.config import build_config
from attnctl.nn.layer import AttentionLayer, Recorder
from attnctl.nn.positions import causal_mask, sinusoidal_positions
from attnctl.stages.plan import build_plan

CPU = ("--device", "cpu")


def assert_plan_matches(config, batch=2, seq_len=9, long=256, padded=False, context=None, **inputs):
    """The layer's recorded stages equal the plan's, and at a longer length the estimate
    equals the measured bytes, stage by stage."""
    torch.manual_seed(0)
    layer = AttentionLayer(config, 20).eval()
    record = Recorder()
    if context is not None:
        inputs["context_ids"] = torch.randint(0, 20, (batch, context))
    with torch.inference_mode():
        layer(torch.randint(0, 20, (batch, seq_len)), record, **inputs)
    plan = build_plan(config, seq_len, batch, 20, device="cpu", padded=padded, context_len=context)
    assert [s.to_dict() for s in record.stages] == [s.to_dict() for s in plan.stages]
    big = build_plan(
        config, long, batch, 20, padded=padded, context_len=None if context is None else 300
    )
    assert list(measure_forward(big).stage_peak_bytes) == list(estimate(big).live_bytes)
    return plan


def gqa_reference(layer: AttentionLayer, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention by the formula: query head h reads K/V head h // (H / Hkv)."""
    config = layer.config
    b, length = ids.shape
    h, hkv, d_k = config.heads, config.kv_heads, config.d_k
    x = layer.embedding(ids) + sinusoidal_positions(length, config.d_model)
    q = layer.W_q(x).view(b, length, h, d_k)
    k = layer.W_k(x).view(b, length, hkv, d_k)
    v = layer.W_v(x).view(b, length, hkv, d_k)
    weights = torch.empty(b, h, length, length)
    heads_out = []
    for head in range(h):
        kv = head // (h // hkv)
        scores = q[:, :, head] @ k[:, :, kv].transpose(1, 2) / math.sqrt(d_k)  # (B, L, L)
        if config.mask == "causal":
            scores = scores.masked_fill(~causal_mask(length), float("-inf"))
        weights[:, head] = scores.softmax(-1)
        heads_out.append(weights[:, head] @ v[:, :, kv])  # (B, L, d_k)
    return layer.W_o(torch.cat(heads_out, dim=-1)), weights


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_grouped_query_attention_matches_the_formula(kv_heads, mask):
    config = build_config(d_model=32, heads=4, kv_heads=kv_heads, mask=mask, norm="none")
    torch.manual_seed(0)
    layer = AttentionLayer(config, 30).eval()
    ids = torch.randint(0, 30, (2, 7))
    with torch.no_grad():
        ours = layer(ids)
        expected_out, expected_weights = gqa_reference(layer, ids)
        sdpa = AttentionLayer(build_config(**{**config.to_dict(), "impl": "sdpa"}), 30)
        sdpa.load_state_dict(layer.state_dict())
        sdpa_out = sdpa.eval()(ids).attention_output
    assert (ours.weights - expected_weights).abs().max() <= 1e-6
    assert (ours.attention_output - expected_out).abs().max() <= 1e-5
    assert (sdpa_out - expected_out).abs().max() <= 1e-5
    assert layer.W_k.weight.shape == (kv_heads * 8, 32)


@pytest.mark.parametrize("impl", ["math", "sdpa"])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_gqa_plan_equals_trace_and_measurement(impl, kv_heads):
    config = build_config(d_model=64, heads=4, kv_heads=kv_heads, impl=impl, device="cpu")
    plan = assert_plan_matches(config)
    names = [s.name for s in plan.stages]
    assert ("k_repeated" in names) == (impl == "math")
    assert plan.stage("k_heads").dims == ("B", "Hkv", "L", "d_k")


def test_gqa_shrinks_the_kv_cache_and_the_weights(invoke):
    full = only_length(json.loads(invoke("memory", "--seq-len", "1024", "--json").stdout))
    mqa = json.loads(invoke("memory", "--seq-len", "1024", "--kv-heads", "1", "--json").stdout)
    mqa = only_length(mqa)
    assert mqa["kv_cache_bytes"] * 8 == full["kv_cache_bytes"] == 2 * 1024 * 512 * 4
    saved = 2 * (512 * 512 + 512) - 2 * (64 * 512 + 64)  # W_k and W_v shrink to 64 rows
    assert full["parameters"] - mqa["parameters"] == saved
    plan = build_plan(build_config(kv_heads=2), 100, 1, 10)
    assert kv_cache_bytes(plan) == 2 * 100 * 2 * 64 * 4


def test_gqa_in_the_cli(invoke):
    data = json.loads(invoke("run", "Are you OK?", "--kv-heads", "2", *CPU, "--json").stdout)
    stages = {s["name"]: s for s in data["stages"]}
    assert stages["k_heads"]["shape"] == [1, 2, 4, 64] and stages["k_repeated"]["shape"] == [
        1,
        8,
        4,
        64,
    ]
    assert torch.tensor(data["attention"]).shape == (1, 8, 4, 4)  # weights per query head
    shapes = invoke("shapes", "--kv-heads", "2").stdout
    assert "B Hkv L d_k" in shapes and "Hkv=2" in shapes
    check = json.loads(invoke("check", "--kv-heads", "2", *CPU, "--json").stdout)
    assert check["ok"] and check["skipped"] == []  # compared with nn.MultiheadAttention
    compared = {(c["a"], c["b"], c["what"]) for c in check["comparisons"]}
    assert ("math", "nn.MultiheadAttention", "weights") in compared


@pytest.mark.parametrize(
    "args,message",
    [
        (["shapes", "--kv-heads", "3"], "kv-heads=3 does not divide heads=8; kv-head counts"),
        (["shapes", "--kv-heads", "-1"], "kv_heads must be at least 1, got -1"),
        (["shapes", "--kv-heads", "0"], "kv_heads must be at least 1, got 0"),
    ],
)
def test_gqa_misuse_exits_2(invoke, args, message):
    result = invoke(*args)
    assert result.exit_code == 2 and message in result.stderr


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) · w."""
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("norm_type", ["layer", "rms"])
def test_norms_match_their_formulas(norm, norm_type):
    config = build_config(d_model=32, heads=4, norm=norm, norm_type=norm_type)
    torch.manual_seed(0)
    layer = AttentionLayer(config, 30).eval()
    bare = AttentionLayer(build_config(d_model=32, heads=4, norm="none"), 30).eval()
    bare.load_state_dict(layer.state_dict(), strict=False)  # same embedding and projections
    ids = torch.randint(0, 30, (2, 6))

    def normalise(t):
        if norm_type == "rms":
            return rms_norm_reference(t, layer.norm.weight, layer.config.norm_eps)
        return F.layer_norm(t, (32,), layer.norm.weight, layer.norm.bias)

    with torch.no_grad():
        x = layer.embedding(ids) + sinusoidal_positions(6, 32)
        ours = layer(ids).output
        if norm == "post":  # Norm(x + attention(x))
            expected = normalise(x + bare(ids).attention_output)
        else:  # x + attention(Norm(x))
            expected = x + bare(None, embeddings=normalise(x) - sinusoidal_positions(6, 32)).output
    assert (ours - expected).abs().max() <= 1e-5
    names = [name for name, _ in layer.named_parameters() if name.startswith("norm.")]
    assert names == (["norm.weight", "norm.bias"] if norm_type == "layer" else ["norm.weight"])


def test_pre_norm_stage_order(invoke):
    stages = [
        s["name"] for s in json.loads(invoke("shapes", "--norm", "pre", "--json").stdout)["stages"]
    ]
    assert stages.index("norm") < stages.index("q") and stages[-1] == "residual"
    post = [s["name"] for s in json.loads(invoke("shapes", "--json").stdout)["stages"]]
    assert post[-2:] == ["residual", "norm"]
    out = invoke("run", "Are you OK?", "--norm", "pre", "--norm-type", "rms", *CPU, columns=200)
    assert "norm pre (rms)" in out.stdout and "RMSNorm over D, before attention" in out.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["shapes", "--norm-type", "batch"], "'batch' is not one of"),
    ],
)
def test_norm_misuse_exits_2(invoke, args, message):
    result = invoke(*args)
    assert result.exit_code == 2 and message in result.stderr


# ---------------------------------------------------------------- positions


def attention_weights_reference(layer, ids, rotate_qk=None, bias=None, padding=None):
    """softmax(Q·Kᵀ/√d_k + bias) per head, Q and K optionally rotated: (B, H, L, L).

    Query head h reads K head h // (H / Hkv); a causal mask and ``padding`` (B, L), True =
    a real key, set blocked keys to -inf.
    """
    config = layer.config
    b, length = ids.shape
    x = layer.embedding(ids)
    if config.pos == "learned":
        x = x + layer.positions.weight[:length]
    q = layer.W_q(x).view(b, length, config.heads, config.d_k).transpose(1, 2)
    k = layer.W_k(x).view(b, length, config.kv_heads, config.d_k).transpose(1, 2)
    if rotate_qk is not None:
        q, k = rotate_qk(q), rotate_qk(k)
    k = k[:, [h // config.groups for h in range(config.heads)]]  # (B, H, L, d_k)
    scores = q @ k.transpose(-2, -1) / math.sqrt(config.d_k)
    if bias is not None:
        scores = scores + bias
    if config.mask == "causal":
        scores = scores.masked_fill(~causal_mask(length), float("-inf"))
    if padding is not None:
        scores = scores.masked_fill(~padding[:, None, None, :], float("-inf"))
    return scores.softmax(-1)


def rope_by_pairs(t: torch.Tensor) -> torch.Tensor:
    """Turn each pair (i, i + d/2) at position p by p·10000^(-2i/d), one pair at a time."""
    out = t.clone()
    d = t.shape[-1]
    half = d // 2
    for p in range(t.shape[-2]):
        for i in range(half):
            theta = p * 10000 ** (-2 * i / d)
            a, b = t[..., p, i], t[..., p, i + half]
            out[..., p, i] = a * math.cos(theta) - b * math.sin(theta)
            out[..., p, i + half] = b * math.cos(theta) + a * math.sin(theta)
    return out


def alibi_reference(heads: int, length: int) -> torch.Tensor:
    bias = torch.empty(heads, length, length)
    for h in range(heads):
        slope = 2 ** (-8 * (h + 1) / heads)
        for i in range(length):
            for j in range(length):
                bias[h, i, j] = -slope * abs(i - j)
    return bias


@pytest.mark.parametrize(
    "pos,reference",
    [
        ("learned", lambda layer, ids: attention_weights_reference(layer, ids)),
        ("rope", lambda layer, ids: attention_weights_reference(layer, ids, rope_by_pairs)),
        ("alibi", lambda layer, ids: attention_weights_reference(
            layer, ids, bias=alibi_reference(layer.config.heads, ids.shape[1]))),
    ],
)  # fmt: skip
def test_positions_match_their_formulas(pos, reference):
    config = build_config(d_model=32, heads=4, pos=pos, norm="none", max_positions=16)
    torch.manual_seed(0)
    layer = AttentionLayer(config, 30).eval()
    ids = torch.randint(0, 30, (2, 7))
    with torch.no_grad():
        assert (layer(ids).weights - reference(layer, ids)).abs().max() <= 1e-5


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_position_window_and_sdpa_agree_with_math(invoke, pos, tmp_path):
    path = tmp_path / "long.txt"
    path.write_text(" ".join(f"w{i}" for i in range(30)))
    common = ("--file", str(path), "--pos", pos, "--d-model", "32", "--heads", "4", *CPU)
    window = json.loads(invoke("run", *common, "--rows", "last:3", "--json").stdout)
    full = json.loads(invoke("run", *common, "--rows", "all", "--json").stdout)
    assert (window["impl"], full["impl"]) == ("sdpa", "math")
    rows = window["attention_rows"]
    expected = torch.tensor(full["attention"])[:, :, rows]
    assert (torch.tensor(window["attention"]) - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("padded", [False, True])
def test_alibi_on_the_sdpa_path_equals_the_formula(mask, kv_heads, padded):
    """The layer's SDPA path (users get math; check compares the two) adds the same bias."""
    config = build_config(d_model=32, heads=4, kv_heads=kv_heads, pos="alibi", mask=mask)
    torch.manual_seed(0)
    layers = {impl: AttentionLayer(dataclasses.replace(config, impl=impl), 30).eval()
              for impl in ("math", "sdpa")}  # fmt: skip
    layers["sdpa"].load_state_dict(layers["math"].state_dict())
    ids = torch.randint(0, 30, (2, 7))
    padding = torch.ones(2, 7, dtype=torch.bool)
    padding[1, 4:] = False  # the second text has 4 real tokens
    inputs = {"padding": padding} if padded else {}
    with torch.no_grad():
        math_run = layers["math"](ids, **inputs)
        sdpa_run = layers["sdpa"](ids, **inputs)
        weights = attention_weights_reference(
            layers["math"], ids, bias=alibi_reference(4, 7), padding=inputs.get("padding")
        )
        x = layers["math"].embed(layers["math"].embedding(ids))
        v = layers["math"].W_v(x).view(2, 7, kv_heads, 8).transpose(1, 2)
        v = v.repeat_interleave(4 // kv_heads, dim=1)  # (B, H, L, d_k)
        expected = layers["math"].W_o((weights @ v).transpose(1, 2).reshape(2, 7, 32))
    assert (math_run.weights - weights).abs().max() <= 1e-6
    assert (sdpa_run.attention_output - expected).abs().max() <= 1e-5
    assert (sdpa_run.attention_output - math_run.attention_output).abs().max() <= 1e-5
    record = Recorder()
    with torch.no_grad():
        layers["sdpa"](ids, record, **inputs)
    names = [s.name for s in record.stages]
    assert "alibi" in names and "scores" not in names and "weights" not in names


def test_attention_window_adds_alibi_for_the_rows_shown():
    """SDPA's shown weights, computed beside the fused kernel, are the math path's slice."""
    config = build_config(d_model=32, heads=4, pos="alibi", mask="causal")
    layers = {}
    for impl in ("math", "sdpa"):
        torch.manual_seed(0)
        layers[impl] = AttentionLayer(dataclasses.replace(config, impl=impl), 30).eval()
    ids = torch.randint(0, 30, (2, 9))
    with torch.no_grad():
        full = layers["math"](ids).weights  # (B, H, L, L)
        window = layers["sdpa"](ids, window=([3, 1], [8, 2, 5])).window
    assert (window - full[:, [3, 1]][:, :, [8, 2, 5]]).abs().max() <= 1e-6


@pytest.mark.parametrize(  # alibi with sdpa is a usage error, tested below
    "pos,impl",
    [
        ("learned", "math"),
        ("learned", "sdpa"),
        ("rope", "math"),
        ("rope", "sdpa"),
        ("alibi", "math"),
    ],
)
def test_positions_plan_trace_and_measurement(pos, impl):
    config = build_config(d_model=64, heads=4, kv_heads=2, pos=pos, impl=impl, device="cpu")
    plan = assert_plan_matches(config, long=200)
    where = {"learned": "positions", "rope": "q_rotated", "alibi": "alibi"}[pos]
    assert where in [s.name for s in plan.stages]


@pytest.mark.parametrize("rope_type", ["linear", "llama3"])
@pytest.mark.parametrize("seq_len", [1, 9])
def test_scaled_rope_plan_trace_and_measurement(rope_type, seq_len):
    """The scaled frequencies are computed within the rope_angles stage: the same bytes."""
    config = build_config(
        d_model=64, heads=4, pos="rope", device="cpu", rope_type=rope_type, rope_factor=8.0,
        rope_original_max_positions=16,
    )  # fmt: skip
    assert_plan_matches(config, seq_len=seq_len, long=seq_len)


def test_llama3_scaling_keeps_fast_stretches_slow_and_blends_between():
    from attnctl.nn.positions import scaled_frequency

    config = build_config(
        pos="rope", rope_type="llama3", rope_factor=8.0, rope_original_max_positions=8192
    )
    fast, slow = 2 * math.pi / 100, 2 * math.pi / 10000  # wavelengths 100 and 10000
    assert scaled_frequency(fast, config) == fast  # < 8192 / 4: kept
    assert scaled_frequency(slow, config) == pytest.approx(slow / 8)  # > 8192 / 1: ÷ factor
    middle = 2 * math.pi / 4096  # between: smooth = (8192 / 4096 - 1) / 3 = 1/3
    assert scaled_frequency(middle, config) == pytest.approx(middle * (2 / 3 / 8 + 1 / 3))


@pytest.mark.parametrize("how", [["--budget", "16GiB"], ["--budget", "16GiB", "--impl", "math"],
                                 ["--fit", "--device", "cpu"]])  # fmt: skip
def test_alibi_memory_budget_fits_the_math_path_only(invoke, monkeypatch, how):
    import attnctl.memory.resources

    free = attnctl.memory.resources.Available(16 * 2**30, "MemAvailable")
    monkeypatch.setattr(attnctl.memory.resources, "available_memory", lambda device: free)
    args = ("memory", "--pos", "alibi", *how)
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    fit_table = result.stdout.split("fits in 16.00 GiB")[1].split()
    assert "math" in fit_table and "sdpa" not in fit_table
    data = json.loads(invoke(*args, "--json").stdout)
    assert data["budget_bytes"] == 16 * 2**30
    assert set(data["max_seq_len"]) == set(data["max_batch"]) == {"math"}  # sdpa: refused
    config = build_config(pos="alibi", impl="math")

    def peak(length, rows):
        return estimate(build_plan(config, length, rows, 2214)).peak_bytes

    longest, largest = data["max_seq_len"]["math"], data["max_batch"]["math"]
    assert peak(longest, 1) <= 16 * 2**30 < peak(longest + 1, 1)
    assert peak(2048, largest) <= 16 * 2**30 < peak(2048, largest + 1)


@pytest.mark.parametrize(
    "options,impls",
    [({}, ("math", "sdpa")), ({"pos": "alibi"}, ("math",)), ({"dropout": 0.1}, ("math",)),
     ({"pos": "alibi", "kv_heads": 2, "mask": "causal"}, ("math",)),
     ({"pos": "rope", "kv_heads": 2}, ("math", "sdpa"))],
)  # fmt: skip
def test_variant_table_has_the_implementations_the_configuration_allows(options, impls):
    config = build_config(d_model=64, heads=4, **options)
    assert allowed_impls(config) == impls
    plan = build_plan(config, 32, 2, 50)
    table = variant_table(plan)
    assert list(table) == ["float32", "float16", "bfloat16"]
    assert all(tuple(row) == impls for row in table.values())
    for dtype, row in table.items():
        for impl, found in row.items():
            other = build_plan(dataclasses.replace(config, dtype=dtype, impl=impl), 32, 2, 50)
            assert found == estimate(other)


def test_alibi_memory_table_shows_the_math_path_only(invoke):
    data = json.loads(invoke("memory", "--pos", "alibi", "--seq-len", "64", "--json").stdout)
    assert data["config"]["impl"] == "math"
    result = invoke("memory", "--pos", "alibi", "--seq-len", "64")
    assert result.exit_code == 0 and "alibi" in result.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["shapes", "--pos", "rope", "--d-model", "24", "--heads", "8"], "d_k=3 must be even"),
        (["shapes", "--pos", "alibi", "--impl", "sdpa"], "use --impl math"),
        (["shapes", "--pos", "learned", "--seq-len", "4096"], "longer than the 2048 learned"),
    ],
)
def test_position_misuse_exits_2(invoke, args, message):
    result = invoke(*args)
    assert result.exit_code == 2 and message in result.stderr


# ---------------------------------------------------------------- batches with padding

PAIR = ("Are you OK?", "Fine, thanks, and you?")  # 4 and 8 tokens


@pytest.mark.parametrize("impl", ["math", "sdpa"])
def test_each_text_of_a_batch_equals_running_it_alone(invoke, impl):
    common = ("--d-model", "64", "--impl", impl, "--rows", "all", *CPU)
    batch = json.loads(invoke("run", *PAIR, *common, "--json").stdout)
    assert [len(row) for row in batch["tokens"]] == [8, 8]
    assert [t["pad"] for t in batch["tokens"][0]] == [False] * 4 + [True] * 4
    weights = torch.tensor(batch["attention"])  # (2, 8, 8, 8)
    assert weights.shape == (2, 8, 8, 8)
    assert torch.all(weights[0, :, :4, 4:] == 0)  # padded keys: exactly 0
    for row, text in enumerate(PAIR):
        alone = torch.tensor(json.loads(invoke("run", text, *common, "--json").stdout)["attention"])
        n = alone.shape[-1]
        assert (weights[row, :, :n, :n] - alone[0]).abs().max() <= 1e-6
    stages = {s["name"]: s for s in batch["stages"]}
    assert stages["padding_mask"]["shape"] == [2, 8] and stages["padding_mask"]["dtype"] == "bool"
    assert stages["scores" if impl == "math" else "weighted_values"]["shape"][0] == 2


def test_padding_agrees_with_nn_multihead_attention_under_its_own_convention():
    from attnctl.nn.check import reference_mha

    config = build_config(d_model=32, heads=4, norm="none", pos="none")
    torch.manual_seed(0)
    layer = AttentionLayer(config, 30).eval()
    ids = torch.randint(0, 30, (2, 6))
    keep = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])  # SDPA: True = may attend
    with torch.no_grad():
        ours = layer(ids, padding=keep)
        x = layer.embedding(ids)
        out, weights = reference_mha(layer)(
            x, x, x, key_padding_mask=~keep, need_weights=True, average_attn_weights=False
        )  # nn.MultiheadAttention: True = padding
    assert (ours.weights - weights).abs().max() <= 1e-6
    assert (ours.attention_output - out).abs().max() <= 1e-5
    assert torch.all(ours.weights[1, :, :, 4:] == 0)


def test_causal_batches_need_no_padding_mask(invoke):
    result = invoke("run", *PAIR, "--mask", "causal", "--d-model", "64", *CPU)
    assert "padding needs no mask here" in result.stdout
    data = json.loads(
        invoke("run", *PAIR, "--mask", "causal", "--d-model", "64", *CPU, "--json").stdout
    )
    assert "padding_mask" not in {s["name"] for s in data["stages"]}
    weights = torch.tensor(data["attention"])
    assert torch.all(weights[0, :, :4, 4:] == 0)  # real tokens never see the padding


def test_batch_output_shows_each_texts_own_tables(invoke):
    out = invoke("run", *PAIR, "--head", "0", "--d-model", "64", *CPU, columns=200).stdout
    assert "tokens · text 0" in out and "tokens · text 1" in out
    assert "head 0 · text 0" in out and "head 0 · text 1" in out
    assert out.count("padding: weight 0 as a key") == 4
    assert "key_padding_mask is its negation (True = padding)" in out
    text0 = out.split("head 0 · text 0")[1].split("head 0 · text 1")[0]
    assert "<pad>" not in text0  # tables show each text's own tokens only


def test_char_tokenizer_shares_one_vocabulary_across_a_batch():
    from attnctl.text.tokenize import encode_batch

    batch = encode_batch(["猫吃鱼", "鱼吃"], "char")
    assert [[t.id for t in row] for row in batch.rows] == [[0, 1, 2], [2, 1]]
    assert batch.pad_id == 3 and batch.vocab_size == 4  # padding gets the next id
    assert [t.pad for t in batch.padded_rows()[1]] == [False, False, True]


def test_batches_plan_equals_trace_and_measurement():
    config = build_config(d_model=64, heads=4, kv_heads=2, device="cpu")
    keep = torch.ones(3, 9, dtype=torch.bool)
    keep[2, 5:] = False
    assert_plan_matches(config, batch=3, padded=True, padding=keep)


# ---------------------------------------------------------------- cross-attention


@pytest.mark.parametrize("norm", ["post", "pre", "none"])
def test_cross_attention_equals_nn_multihead_attention(norm):
    from attnctl.nn.check import reference_mha

    config = build_config(d_model=32, heads=4, norm=norm)
    torch.manual_seed(0)
    layer = AttentionLayer(config, 30).eval()
    ids, context = torch.randint(0, 30, (2, 5)), torch.randint(0, 30, (2, 7))
    with torch.no_grad():
        ours = layer(ids, context_ids=context)
        x = layer.embedding(ids) + sinusoidal_positions(5, 32)
        c = layer.embedding(context) + sinusoidal_positions(7, 32)
        query = layer.norm(x) if norm == "pre" else x  # the norm is the query stream's
        out, weights = reference_mha(layer)(
            query, c, c, need_weights=True, average_attn_weights=False
        )
    assert ours.weights.shape == (2, 4, 5, 7)
    assert (ours.weights - weights).abs().max() <= 1e-6
    assert (ours.attention_output - out).abs().max() <= 1e-5


def test_cross_attention_in_the_cli(invoke):
    args = ("run", "Are you OK?", "--context", "我很好，谢谢", "--d-model", "64", *CPU)
    data = json.loads(invoke(*args, "--json").stdout)
    assert torch.tensor(data["attention"]).shape == (1, 8, 4, 4)
    assert [t["text"] for t in data["context_tokens"][0]] == ["我", "很好", "，", "谢谢"]
    stages = {s["name"]: s for s in data["stages"]}
    assert stages["k"]["dims"] == ["B", "Lc", "D"] and stages["scores"]["dims"][-1] == "Lc"
    assert "context_x" in stages
    out = invoke(*args, columns=120).stdout
    assert "query \\ context" in out and "context    我很好，谢谢" in out
    shapes = json.loads(invoke("shapes", "--context-len", "32", "--json").stdout)
    scores = next(s for s in shapes["stages"] if s["name"] == "scores")
    assert scores["shape"] == [1, 8, 16, 32]
    memory = only_length(
        json.loads(invoke("memory", "--seq-len", "64", "--context-len", "1000", "--json").stdout)
    )
    assert memory["kv_cache_tokens"] == 1000  # the cache holds the context's keys and values
    assert memory["attention_matrix_bytes"] == 8 * 64 * 1000 * 4


def test_padded_contexts_equal_running_each_alone(invoke):
    common = ("--d-model", "64", *CPU, "--json")
    both = json.loads(
        invoke("run", "Are you OK?", "Fine, thanks, and you?", "--context", "我很好",
               "--context", "谢谢你，我也很好", *common).stdout
    )  # fmt: skip
    weights = torch.tensor(both["attention"])
    short = len([t for t in both["context_tokens"][0] if not t["pad"]])
    assert torch.all(weights[0, :, :, short:] == 0)
    alone = torch.tensor(
        json.loads(invoke("run", "Are you OK?", "--context", "我很好", *common).stdout)["attention"]
    )
    assert (weights[0, :, :4, :short] - alone[0]).abs().max() <= 1e-6


def test_cross_attention_window_equals_math(invoke, tmp_path):
    path = tmp_path / "long.txt"
    path.write_text(" ".join(f"w{i}" for i in range(30)))
    common = ("--file", str(path), "--context", "我很好，谢谢", "--d-model", "32", *CPU, "--json")
    window = json.loads(invoke("run", *common, "--rows", "last:3").stdout)
    full = json.loads(invoke("run", *common, "--rows", "all").stdout)
    assert (window["impl"], full["impl"]) == ("sdpa", "math")
    expected = torch.tensor(full["attention"])[:, :, window["attention_rows"]]
    assert (torch.tensor(window["attention"]) - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("impl", ["math", "sdpa"])
def test_cross_attention_plan_trace_and_measurement(impl):
    config = build_config(d_model=64, heads=4, kv_heads=2, impl=impl, device="cpu")
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[1, 4:] = False
    assert_plan_matches(config, long=128, padded=True, context=6, padding=keep)


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["run", "hi", "--context", "yo", "--mask", "causal"],
            "cross-attention has no causal mask",
        ),
        (
            ["run", "hi", "--context", "yo", "--pos", "rope"],
            "relates positions within one sequence",
        ),
        (["shapes", "--context-len", "8", "--pos", "alibi"], "relates positions within one"),
        (["run", "a", "b", "c", "--context", "x", "--context", "y"], "2 contexts for 3 texts"),
        (["run", "hi", "--context", "x", "--context-file", "f.txt"], "not both"),
        (["shapes", "--context-len", "0"], "context-len must be a positive integer"),
    ],
)
def test_cross_attention_misuse_exits_2(invoke, args, message):
    result = invoke(*args)
    assert result.exit_code == 2 and message in result.stderr


def test_cross_attention_preset(invoke):
    shapes = json.loads(invoke("shapes", "--config", "cross-attention", "--json").stdout)
    assert shapes["config"]["cross"] is True
    assert next(s for s in shapes["stages"] if s["name"] == "k")["dims"] == ["B", "Lc", "D"]
    run = invoke("run", "Are you OK?", "--config", "cross-attention", "--context", "我很好", *CPU)
    assert run.exit_code == 0 and "query \\ context" in run.stdout
    missing = invoke("run", "Are you OK?", "--config", "cross-attention", *CPU)
    assert missing.exit_code == 2 and "give --context TEXT" in missing.stderr


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("norm_type", ["layer", "rms"])
@pytest.mark.parametrize("impl", ["math", "sdpa"])
def test_norms_plan_trace_and_measurement(norm, norm_type, impl):
    config = build_config(
        d_model=64, heads=4, norm=norm, norm_type=norm_type, impl=impl, device="cpu"
    )
    assert_plan_matches(config)


def test_output_bias_off_biases_q_k_v_only(invoke, tmp_path):
    """Qwen2's layout: biases in W_q, W_k, W_v and none in W_o (preset key output_bias)."""
    config = build_config(d_model=32, heads=4, device="cpu", output_bias=False)
    plan = assert_plan_matches(config)
    names = [p.name for p in plan.parameters]
    assert {"W_q.bias", "W_k.bias", "W_v.bias"} <= set(names) and "W_o.bias" not in names
    preset = tmp_path / "qkv-bias.toml"
    preset.write_text("d_model = 32\nheads = 4\noutput_bias = false\n")
    result = invoke("check", "--config", str(preset), *CPU)
    assert result.exit_code == 0, result.output  # math == sdpa == nn.MultiheadAttention
    shapes = invoke("shapes", "--config", str(preset), columns=200)
    assert "bias on (not W_o)" in shapes.stdout
    trained = invoke(
        "memory", "--config", str(preset), "--seq-len", "16", "--train", "--measure", *CPU,
        "--json",
    )  # fmt: skip
    assert trained.exit_code == 0, trained.output  # memory --train models it: to the byte
    data = only_length(json.loads(trained.stdout))
    assert data["measured_peak_bytes"] == data["training_bytes"]
