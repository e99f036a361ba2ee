"""The new families' fixtures are what they claim, and the specifications hold.

The tiny checkpoints (tests/tiny_models.py) load in transformers with the properties they
are written to have (head_dim != hidden/heads, q/k norms, sliding layers shorter than the
text, soft-capping that bites, longrope that changes the weights, tied and untied heads,
half-precision weights); the header-only folders sum to the published parameter counts.
``spec_attentions`` is each family written from /work/notes/families/*.md, in float64,
straight from the safetensors: it equals transformers' eager attention on every layer, so the
specifications say what transformers does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import hf_reference
import pytest
import tiny_models
import torch
from safetensors import safe_open
from safetensors.torch import load_file

TOLERANCE = 1e-5
TEXTS = [tiny_models.LONG_TEXT, "Are you OK?"]  # a batch with padding
# padded by fewer tokens than the window: no query sees no key (transformers in float64
# turns such a row into NaN, its mask's float64 minimum being -inf in the float32 softmax)
SPEC_TEXTS = [tiny_models.LONG_TEXT, tiny_models.LONG_TEXT.removesuffix(" sun.")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Each new family as written by default, and its variants, one folder each."""
    root = tmp_path_factory.mktemp("new-families")
    written = {f: tiny_models.write(f, root / f) for f in tiny_models.RECENT_FAMILIES}
    for family, options in tiny_models.OPTIONS.items():
        for name, keys in options.items():
            written[f"{family}-{name}"] = tiny_models.write(family, root / name / family, **keys)
    return written


def config_of(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def stored(folder: Path) -> dict[str, tuple[str, list[int]]]:
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        return {k: (str(handle.get_slice(k).get_dtype()), handle.get_slice(k).get_shape())
                for k in handle.keys()}  # noqa: SIM118  # fmt: skip


# ---------------------------------------------------------------- the specifications, in code


def expected_tensors(family: str, c: dict) -> dict[str, list[int]]:
    """The checkpoint's tensor table from the spec: key -> shape, in config values."""
    D, V, inner = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    H, Hkv = c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or D // H
    table = {"model.embed_tokens.weight": [V, D], "model.norm.weight": [D]}
    if not c["tie_word_embeddings"]:
        table["lm_head.weight"] = [V, D]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer = {"self_attn.o_proj.weight": [D, H * d], "mlp.down_proj.weight": [D, inner]}
        if family == "phi3":
            layer["self_attn.qkv_proj.weight"] = [(H + 2 * Hkv) * d, D]
            layer["mlp.gate_up_proj.weight"] = [2 * inner, D]
        else:
            layer["self_attn.q_proj.weight"] = [H * d, D]
            layer["self_attn.k_proj.weight"] = [Hkv * d, D]
            layer["self_attn.v_proj.weight"] = [Hkv * d, D]
            layer["mlp.gate_proj.weight"] = [inner, D]
            layer["mlp.up_proj.weight"] = [inner, D]
        if c.get("attention_bias"):
            biases = {"q": H * d, "k": Hkv * d, "v": Hkv * d, "o": D}
            layer.update({f"self_attn.{n}_proj.bias": [size] for n, size in biases.items()})
        norms = {
            "qwen3": ["input_layernorm", "post_attention_layernorm"],
            "phi3": ["input_layernorm", "post_attention_layernorm"],
            "llama": ["input_layernorm", "post_attention_layernorm"],
            "olmo2": ["post_attention_layernorm", "post_feedforward_layernorm"],
        }.get(family, ["input_layernorm", "post_attention_layernorm",
                       "pre_feedforward_layernorm", "post_feedforward_layernorm"])  # fmt: skip
        layer.update({f"{n}.weight": [D] for n in norms})
        if family in ("qwen3", "gemma3"):  # per head, over head_dim
            layer.update({"self_attn.q_norm.weight": [d], "self_attn.k_norm.weight": [d]})
        if family == "olmo2":  # across all heads, before the split
            layer.update({"self_attn.q_norm.weight": [H * d], "self_attn.k_norm.weight": [Hkv * d]})
        table.update({p + k: shape for k, shape in layer.items()})
    return table


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return normed * ((1 + weight) if gemma else weight)  # Gemma scales by (1 + weight)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rope_tables(rope: dict, c: dict, d: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: (L, d) for positions 0 … L-1 (inverse frequencies in float32, as transformers)."""
    exponent = torch.arange(0, d, 2, dtype=torch.float32) / d
    inv_freq = 1.0 / (rope["rope_theta"] ** exponent)
    scale = 1.0
    if rope["rope_type"] == "linear":
        inv_freq = inv_freq / rope["factor"]
    elif rope["rope_type"] == "longrope":  # the batch's length picks the factors
        original = c["original_max_position_embeddings"]
        factors = rope["long_factor"] if length > original else rope["short_factor"]
        inv_freq = 1.0 / (torch.tensor(factors) * rope["rope_theta"] ** exponent)
        factor = c["max_position_embeddings"] / original
        scale = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    else:
        assert rope["rope_type"] == "default", rope
    # the tables in float32, as transformers computes them (float64 ones differ by ~1e-5
    # under longrope's scale): then widened
    angles = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)  # (L, d)
    return (angles.cos() * scale).double(), (angles.sin() * scale).double()


def spec_attentions(family: str, folder: Path, ids: torch.Tensor, mask: torch.Tensor):
    """Every layer's attention weights (B, H, L, L), from the spec, in float64."""
    c = config_of(folder)
    w = {k: v.double() for k, v in load_file(str(folder / "model.safetensors")).items()}
    D, H, Hkv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or D // H
    eps, gemma = c["rms_norm_eps"], family in ("gemma2", "gemma3")
    B, L = ids.shape
    x = w["model.embed_tokens.weight"][ids]  # (B, L, D)
    if gemma:  # sqrt(hidden) as a float32 tensor, cast to the weights' dtype (float32 here)
        x = x * torch.tensor(D**0.5, dtype=torch.float32).double()
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    visible = (j <= i)[None] & mask.bool()[:, None, :]  # (B, L, L): causal, no padding keys
    layer_types = c.get("layer_types") or ["full_attention"] * c["num_hidden_layers"]
    if family == "phi3" and c.get("sliding_window"):
        layer_types = ["sliding_attention"] * c["num_hidden_layers"]
    rope = c["rope_parameters"]
    act = {"silu": torch.nn.functional.silu,
           "gelu_pytorch_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}[
        c.get("hidden_activation") or c.get("hidden_act")]  # fmt: skip
    scale = c["query_pre_attn_scalar"] ** -0.5 if gemma else d**-0.5
    weights = []
    for layer, kind in enumerate(layer_types):
        p = f"model.layers.{layer}."

        def norm(t: torch.Tensor, name: str, p: str = p) -> torch.Tensor:
            return _rms_norm(t, w[p + name + ".weight"], eps, gemma)

        h = x if family == "olmo2" else norm(x, "input_layernorm")
        if family == "phi3":  # fused rows: H·d queries, then Hkv·d keys, then Hkv·d values
            q, k, v = (h @ w[p + "self_attn.qkv_proj.weight"].T).split(
                [H * d, Hkv * d, Hkv * d], -1
            )
        else:
            q, k, v = (h @ w[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
            if c.get("attention_bias"):
                q, k, v = (
                    t + w[p + f"self_attn.{n}_proj.bias"]
                    for t, n in zip((q, k, v), "qkv", strict=True)
                )
        if family == "olmo2":  # over all heads at once, before the split
            q, k = norm(q, "self_attn.q_norm"), norm(k, "self_attn.k_norm")
        q = q.view(B, L, H, d).transpose(1, 2)  # (B, H, L, d)
        k = k.view(B, L, Hkv, d).transpose(1, 2)  # (B, Hkv, L, d)
        v = v.view(B, L, Hkv, d).transpose(1, 2)
        if family in ("qwen3", "gemma3"):  # per head, over head_dim, before RoPE
            q, k = norm(q, "self_attn.q_norm"), norm(k, "self_attn.k_norm")
        cos, sin = _rope_tables(rope[kind] if family == "gemma3" else rope, c, d, L)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k, v = (t.repeat_interleave(H // Hkv, dim=1) for t in (k, v))  # head h reads h // group
        scores = q @ k.transpose(-1, -2) * scale  # (B, H, L, L)
        cap = c.get("attn_logit_softcapping") if family == "gemma2" else None
        if cap:
            scores = cap * torch.tanh(scores / cap)
        allowed = visible
        if kind == "sliding_attention":  # key j seen from query i iff i - W < j <= i
            allowed = allowed & (j > i - c["sliding_window"])[None]
        scores = scores.masked_fill(~allowed[:, None], -torch.inf)
        # a padded query past the window sees no key: 0 here (transformers: 1/L over all)
        attention = scores.softmax(-1).nan_to_num(0.0)
        weights.append(attention)
        out = (attention @ v).transpose(1, 2).reshape(B, L, H * d) @ w[
            p + "self_attn.o_proj.weight"
        ].T
        if c.get("attention_bias"):
            out = out + w[p + "self_attn.o_proj.bias"]
        if family in ("gemma2", "gemma3", "olmo2"):
            out = norm(out, "post_attention_layernorm")
        x = x + out
        if family in ("qwen3", "phi3"):
            h = norm(x, "post_attention_layernorm")
        elif gemma:
            h = norm(x, "pre_feedforward_layernorm")
        else:
            h = x
        if family == "phi3":  # the first half of gate_up_proj's rows is the gate
            gate, up = (h @ w[p + "mlp.gate_up_proj.weight"].T).chunk(2, dim=-1)
        else:
            gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        out = (act(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        if gemma or family == "olmo2":
            out = norm(out, "post_feedforward_layernorm")
        x = x + out
    return weights


# ---------------------------------------------------------------- the tests


SPEC_CASES = [
    *tiny_models.RECENT_FAMILIES, "qwen3-sliding", "qwen3-bias", "gemma2-pattern",
    "gemma2-no_softcap", "gemma3-plain_rope", "phi3-longrope", "phi3-sliding",
]  # fmt: skip


@pytest.mark.parametrize("case", SPEC_CASES)
def test_the_specification_equals_transformers_eager_attention(folders, case):
    family = case.split("-")[0]
    ids, mask = hf_reference.encode(folders[case], SPEC_TEXTS)
    assert 0 < (1 - mask[1]).sum() < tiny_models.SHORT_WINDOW
    # float64 transformers (softmax still float32): the margin is not float32's noise
    expected = hf_reference.eager_attentions(folders[case], ids, mask, dtype="float64")
    got = spec_attentions(family, folders[case], ids, mask)
    assert len(got) == len(expected) == 3
    for mine, theirs in zip(got, expected, strict=True):
        real = mask.bool()[:, None, :, None]  # padded query rows are transformers' own business
        difference = (mine - theirs.double()).abs().masked_fill(~real, 0)
        assert difference.max() <= TOLERANCE


@pytest.mark.parametrize("family", tiny_models.RECENT_FAMILIES)
def test_each_folder_holds_the_tensors_of_the_spec_table(folders, family):
    for case in [c for c in folders if c.split("-")[0] == family]:
        table = {k: shape for k, (_, shape) in stored(folders[case]).items()}
        assert table == expected_tensors(family, config_of(folders[case])), case


def test_head_dim_differs_from_hidden_over_heads_and_q_k_norms_are_stored(folders):
    for family in ("qwen3", "gemma2", "gemma3"):
        c = config_of(folders[family])
        assert c["head_dim"] != c["hidden_size"] // c["num_attention_heads"], family
    tensors = stored(folders["olmo2"])
    assert tensors["model.layers.0.self_attn.q_norm.weight"][1] == [32]  # H·d_k
    assert tensors["model.layers.0.self_attn.k_norm.weight"][1] == [16]  # Hkv·d_k
    assert stored(folders["qwen3"])["model.layers.0.self_attn.q_norm.weight"][1] == [16]
    assert stored(folders["gemma3"])["model.layers.0.self_attn.k_norm.weight"][1] == [16]
    assert config_of(folders["gemma2"])["query_pre_attn_scalar"] ** -0.5 != 16**-0.5


def test_sliding_layers_follow_each_familys_pattern_and_the_text_outruns_the_window(folders):
    length = hf_reference.encode(folders["gemma2"], [tiny_models.LONG_TEXT])[0].shape[1]
    patterns = {
        "gemma2": ["sliding_attention", "full_attention", "sliding_attention"],  # alternating
        "gemma3": ["sliding_attention", "sliding_attention", "full_attention"],  # pattern 3
        "qwen3-sliding": ["full_attention", "sliding_attention", "sliding_attention"],
        "qwen3": ["full_attention"] * 3,
    }
    for case, layer_types in patterns.items():
        c = config_of(folders[case])
        assert c["layer_types"] == layer_types, case
        ids, _ = hf_reference.encode(folders[case], [tiny_models.LONG_TEXT])
        assert ids.shape[1] > 2 * tiny_models.SHORT_WINDOW
        assert c["sliding_window"] == (tiny_models.SHORT_WINDOW if case != "qwen3" else None)
        for kind, weights in zip(
            layer_types, hf_reference.eager_attentions(folders[case], ids), strict=True
        ):
            last = weights[0, :, -1, : ids.shape[1] - tiny_models.SHORT_WINDOW]  # out of reach
            assert (last.abs().max() == 0) == (kind == "sliding_attention"), (case, kind)
    assert config_of(folders["phi3-sliding"])["sliding_window"] == tiny_models.SHORT_WINDOW
    assert length < config_of(folders["gemma2"])["max_position_embeddings"]


def test_gemma2_soft_capping_bites_and_the_final_cap_bounds_the_logits(folders):
    ids, mask = hf_reference.encode(folders["gemma2"], TEXTS)
    capped = hf_reference.run_reference(folders["gemma2"], ids, mask)
    plain = hf_reference.run_reference(folders["gemma2-no_softcap"], ids, mask)
    difference = max(
        (a - b).abs().max() for a, b in zip(capped.attentions, plain.attentions, strict=True)
    )
    assert difference > 0.1
    assert capped.logits.abs().max() < 5.0 < plain.logits.abs().max()
    assert len(capped.hidden_states) == 4  # the embeddings, blocks 0 and 1, the final norm
    embeddings = load_file(str(folders["gemma2"] / "model.safetensors"))[
        "model.embed_tokens.weight"
    ]
    assert torch.equal(capped.hidden_states[0], embeddings[ids] * torch.tensor(48**0.5))


def test_phi3_longrope_takes_the_long_factors_past_the_original_length(folders):
    c = config_of(folders["phi3-longrope"])
    rope = c["rope_parameters"]
    assert rope["rope_type"] == "longrope" and len(rope["long_factor"]) == 4
    ids, _ = hf_reference.encode(folders["phi3-longrope"], [tiny_models.LONG_TEXT])
    assert ids.shape[1] > c["original_max_position_embeddings"]
    longrope = hf_reference.eager_attentions(folders["phi3-longrope"], ids)
    plain = hf_reference.eager_attentions(folders["phi3"], ids)
    assert max((a - b).abs().max() for a, b in zip(longrope, plain, strict=True)) > 0.1


def test_tied_heads_are_not_stored_and_untied_ones_are(folders):
    for case, tied in [("qwen3", True), ("qwen3-untied", False), ("gemma2", True),
                       ("gemma2-untied", False), ("gemma3", True), ("gemma3-untied", False),
                       ("phi3", False), ("phi3-tied", True), ("olmo2", False),
                       ("olmo2-tied", True)]:  # fmt: skip
        assert config_of(folders[case])["tie_word_embeddings"] is tied, case
        assert ("lm_head.weight" in stored(folders[case])) is not tied, case


@pytest.mark.parametrize(("dtype", "code"), [("float16", "F16"), ("bfloat16", "BF16")])
def test_half_precision_checkpoints_store_their_dtype_and_run_in_it(tmp_path, dtype, code):
    folder = tiny_models.write("gemma3", tmp_path / dtype, dtype=dtype)
    assert config_of(folder)["dtype"] == dtype
    assert {kind for kind, _ in stored(folder).values()} == {code}
    ids, mask = hf_reference.encode(folder, SPEC_TEXTS)
    exact = spec_attentions("gemma3", folder, ids, mask)  # the same weights, in float64
    real = mask.bool()[:, None, :, None]

    def largest_difference(weights: list[torch.Tensor]) -> float:
        return max(
            (a.double() - b).abs().masked_fill(~real, 0).max().item()
            for a, b in zip(weights, exact, strict=True)
        )

    in_its_dtype = hf_reference.eager_attentions(folder, ids, mask)  # "auto": the stored dtype
    assert {w.dtype for w in in_its_dtype} == {getattr(torch, dtype)}
    assert 1e-4 < largest_difference(in_its_dtype) < 0.1  # half rounding, not another model
    # the stored weights widen exactly: transformers in float32 is the oracle to 1e-5
    widened = hf_reference.eager_attentions(folder, ids, mask, dtype="float32")
    assert largest_difference(widened) <= TOLERANCE


def test_gemma3_without_layer_types_derives_them_from_sliding_window_pattern(tmp_path):
    folder = tiny_models.write("gemma3", tmp_path / "g")
    tiny_models.rewrite_config(folder, remove=("layer_types", "_sliding_window_pattern"))
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    assert config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]


@pytest.mark.parametrize("name", sorted(tiny_models.PUBLISHED_PARAMETERS))
def test_header_only_folders_sum_to_the_published_parameter_counts(tmp_path, name):
    folder = tiny_models.write_header_only(name, tmp_path / name)
    raw = (folder / "model.safetensors").open("rb").read(8)
    with (folder / "model.safetensors").open("rb") as handle:
        handle.seek(8)
        header = json.loads(handle.read(int.from_bytes(raw, "little")))
    header.pop("__metadata__", None)
    total = sum(math.prod(entry["shape"]) for entry in header.values())
    assert total == tiny_models.PUBLISHED_PARAMETERS[name]
    c = config_of(folder)
    family = {"gemma3_text": "gemma3"}.get(c["model_type"], c["model_type"])
    assert {k: e["shape"] for k, e in header.items()} == expected_tensors(family, c)


@pytest.mark.parametrize(("name", "layers"), [("llama-3-70b", 80), ("llama-3.1-405b", 126)])
def test_memory_reads_the_header_only_llama_3_folders(invoke, tmp_path, name, layers):
    # 405B: an 811 GB sparse file, its data stored nowhere; memory reads the header alone
    folder = tiny_models.write_header_only(name, tmp_path / name, dtype="bfloat16")
    result = invoke("memory", "--model", str(folder), "--seq-len", "8192", "--json")
    assert result.exit_code == 0, result.output
    (entry,) = json.loads(result.stdout)["results"]
    published = tiny_models.PUBLISHED_PARAMETERS[name]
    assert entry["parameters"] == published
    assert entry["parameters_bytes"] == 2 * published  # bfloat16
    # K and V, 8 kv-heads of 128, 8192 tokens, 2 bytes, every layer
    assert entry["kv_cache_bytes"] == 2 * 8192 * 8 * 128 * 2 * layers


def test_the_405b_folder_keeps_llama_3_1_rope_scaling(tmp_path):
    rope = config_of(tiny_models.write_header_only("llama-3.1-405b", tmp_path / "l"))
    assert rope["rope_parameters"] == {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    }  # fmt: skip
    assert rope["max_position_embeddings"] == 131072 and not rope["tie_word_embeddings"]


def test_the_published_configurations_slide_where_the_models_do(tmp_path):
    gemma3 = config_of(tiny_models.write_header_only("gemma-3-1b", tmp_path / "g3"))
    full = [i for i, kind in enumerate(gemma3["layer_types"]) if kind == "full_attention"]
    assert full == [5, 11, 17, 23] and gemma3["sliding_window"] == 512
    assert gemma3["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    assert gemma3["rope_parameters"]["full_attention"]["rope_theta"] == 1000000.0
    gemma2 = config_of(tiny_models.write_header_only("gemma-2-2b", tmp_path / "g2"))
    assert gemma2["layer_types"][:2] == ["sliding_attention", "full_attention"]
    qwen3 = config_of(tiny_models.write_header_only("qwen3-0.6b", tmp_path / "q3"))
    assert set(qwen3["layer_types"]) == {"full_attention"} and qwen3["head_dim"] == 128


def test_the_reference_of_a_padded_row_equals_the_row_alone(folders):
    folder = folders["gemma2"]
    ids, mask = hf_reference.encode(folder, TEXTS)
    batch = hf_reference.eager_attentions(folder, ids, mask)
    alone_ids, _ = hf_reference.encode(folder, TEXTS[1:])
    alone = hf_reference.eager_attentions(folder, alone_ids)
    n = alone_ids.shape[1]
    assert n < ids.shape[1]
    for padded, single in zip(batch, alone, strict=True):
        assert (padded[1, :, :n, :n] - single[0]).abs().max() <= TOLERANCE
        assert padded[1, :, :n, n:].abs().max() == 0  # padding keys get no weight
