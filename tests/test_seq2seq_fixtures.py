"""The encoder–decoder and causal generation fixtures are what the specifications say.

tests/tiny_seq2seq.py writes tiny Marian, BART, T5 v1 and T5 v1.1 folders (and GPT-2, Llama,
Mistral, Qwen2 as causal LMs); tests/hf_seq2seq.py is transformers' greedy generation on them.
These tests hold the fixtures to /work/notes/families/{marian,bart,t5}.md: the tensor tables
(keys, shapes, which tied keys are absent), generation_config.json, the tokenizers' special
tokens, the logits processors on by default, and the oracle itself: every step's attention rows
equal one teacher-forced forward's, a batch gives each text's ids alone, and greedy generation
from "Are you OK?" is not degenerate. ``spec_forward`` is the three families written from
those notes, in float64, straight from the safetensors file: it equals transformers'
teacher-forced forward (every attention of every block, and the logits), so the notes say
what transformers does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import hf_seq2seq
import pytest
import tiny_seq2seq
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

STEPS = 8
TEXTS = list(tiny_seq2seq.TEST_TEXTS)  # a batch of three lengths: padding in every batch
# float64: transformers' Marian, BART and T5 eager attention has no float32 softmax, so the
# steps and the full forward agree to rounding of float64
STEP_TOLERANCE = 1e-6
# GPT-2 / Llama-like eager attention computes its softmax in float32 even in a float64 model
CAUSAL_STEP_TOLERANCE = 5e-6


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("seq2seq")
    written = {f: tiny_seq2seq.write(f, root / f) for f in tiny_seq2seq.SEQ2SEQ_FAMILIES}
    written.update(
        {f: tiny_seq2seq.write_causal(f, root / f) for f in tiny_seq2seq.CAUSAL_FAMILIES}
    )
    return written


@pytest.fixture(scope="module")
def references(folders) -> dict[tuple[str, str], hf_seq2seq.Seq2SeqReference]:
    """(family, dtype) → transformers' generation on the three texts as one batch."""
    cache: dict = {}

    def get(family: str, dtype: str = "float64"):
        if (family, dtype) not in cache:
            cache[family, dtype] = hf_seq2seq.generate_seq2seq(
                folders[family], TEXTS, STEPS, dtype=dtype
            )
        return cache[family, dtype]

    return get


def config_of(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def stored(folder: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118


def expected_tensors(family: str, config: dict) -> dict[str, tuple[int, ...]]:
    """The checkpoint tables of marian.md, bart.md and t5.md, from config.json."""
    tensors: dict[str, tuple[int, ...]] = {}
    if family in ("marian", "bart"):
        D, V = config["d_model"], config["vocab_size"]
        tensors["final_logits_bias"] = (1, V)
        tensors["model.shared.weight"] = (V, D)
        for side in ("encoder", "decoder"):
            F = config[f"{side}_ffn_dim"]
            if family == "bart":
                tensors[f"model.{side}.embed_positions.weight"] = (
                    config["max_position_embeddings"] + 2,
                    D,
                )
                tensors[f"model.{side}.layernorm_embedding.weight"] = (D,)
                tensors[f"model.{side}.layernorm_embedding.bias"] = (D,)
            attentions = ["self_attn"] + (["encoder_attn"] if side == "decoder" else [])
            for i in range(config[f"{side}_layers"]):
                prefix = f"model.{side}.layers.{i}"
                for attention in attentions:
                    for projection in ("q_proj", "k_proj", "v_proj", "out_proj"):
                        tensors[f"{prefix}.{attention}.{projection}.weight"] = (D, D)
                        tensors[f"{prefix}.{attention}.{projection}.bias"] = (D,)
                    tensors[f"{prefix}.{attention}_layer_norm.weight"] = (D,)
                    tensors[f"{prefix}.{attention}_layer_norm.bias"] = (D,)
                tensors[f"{prefix}.fc1.weight"] = (F, D)
                tensors[f"{prefix}.fc1.bias"] = (F,)
                tensors[f"{prefix}.fc2.weight"] = (D, F)
                tensors[f"{prefix}.fc2.bias"] = (D,)
                tensors[f"{prefix}.final_layer_norm.weight"] = (D,)
                tensors[f"{prefix}.final_layer_norm.bias"] = (D,)
        return tensors
    D, V, H, d, F = (config[k] for k in ("d_model", "vocab_size", "num_heads", "d_kv", "d_ff"))
    gated = config["feed_forward_proj"].startswith("gated-")
    tensors["shared.weight"] = (V, D)
    if config.get("tie_word_embeddings") is False:
        tensors["lm_head.weight"] = (V, D)
    layers = {"encoder": config["num_layers"], "decoder": config["num_decoder_layers"]}
    for side, count in layers.items():
        tensors[f"{side}.final_layer_norm.weight"] = (D,)
        tensors[f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = (
            config["relative_attention_num_buckets"],
            H,
        )
        names = ["SelfAttention"] + (["EncDecAttention"] if side == "decoder" else [])
        for i in range(count):
            for j, name in enumerate(names):
                prefix = f"{side}.block.{i}.layer.{j}"
                for projection in ("q", "k", "v"):
                    tensors[f"{prefix}.{name}.{projection}.weight"] = (H * d, D)
                tensors[f"{prefix}.{name}.o.weight"] = (D, H * d)
                tensors[f"{prefix}.layer_norm.weight"] = (D,)
            prefix = f"{side}.block.{i}.layer.{len(names)}"
            for wi in ("wi_0", "wi_1") if gated else ("wi",):
                tensors[f"{prefix}.DenseReluDense.{wi}.weight"] = (F, D)
            tensors[f"{prefix}.DenseReluDense.wo.weight"] = (D, F)
            tensors[f"{prefix}.layer_norm.weight"] = (D,)
    return tensors


@pytest.mark.parametrize("family", tiny_seq2seq.SEQ2SEQ_FAMILIES)
def test_checkpoint_tensors_are_the_specified_table(folders, family):
    folder = folders[family]
    assert stored(folder) == expected_tensors(family, config_of(folder))
    assert {p.name for p in folder.iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    }


def test_tied_and_untied_keys(folders):
    for family in ("marian", "bart"):
        keys = stored(folders[family])
        for absent in ("lm_head.weight", "model.encoder.embed_tokens.weight"):
            assert absent not in keys, (family, absent)
        assert "model.decoder.embed_tokens.weight" not in keys
    assert not [k for k in stored(folders["marian"]) if "embed_positions" in k]
    t5, t5v11 = stored(folders["t5"]), stored(folders["t5v11"])
    assert "lm_head.weight" not in t5 and "lm_head.weight" in t5v11
    for keys in (t5, t5v11):
        assert not [k for k in keys if "embed_tokens" in k]
        assert not [k for k in keys if "EncDecAttention.relative_attention_bias" in k]
        assert len([k for k in keys if "relative_attention_bias" in k]) == 2  # block 0 each


def test_t5_heads_and_scaling_as_transformers_loads_them(folders):
    v1, v11 = config_of(folders["t5"]), config_of(folders["t5v11"])
    assert v1["scale_decoder_outputs"] is True and v1["tie_word_embeddings"] is True
    assert v11["tie_word_embeddings"] is False and "scale_decoder_outputs" not in v11
    assert (v1["feed_forward_proj"], v11["feed_forward_proj"]) == ("relu", "gated-gelu")
    assert v11["num_decoder_layers"] != v11["num_layers"]
    model = hf_seq2seq.load_seq2seq(folders["t5v11"])
    assert model.config.scale_decoder_outputs is False
    assert not torch.equal(model.lm_head.weight, model.shared.weight)
    with safe_open(str(folders["t5v11"] / "model.safetensors"), "pt") as handle:
        assert torch.equal(model.lm_head.weight, handle.get_tensor("lm_head.weight"))
    model = hf_seq2seq.load_seq2seq(folders["t5"])
    assert model.config.scale_decoder_outputs is True
    assert model.lm_head.weight.data_ptr() == model.shared.weight.data_ptr()


def test_generation_config_and_special_ids(folders):
    def generation(family):
        values = json.loads((folders[family] / "generation_config.json").read_text())
        values.pop("transformers_version")
        return values

    common = {"_from_model_config": True, "output_attentions": False,
              "output_hidden_states": False, "use_cache": True}  # fmt: skip
    vocabulary = Tokenizer.from_file(str(folders["marian"] / "tokenizer.json")).get_vocab()
    pad = vocabulary["<pad>"]
    assert pad == len(vocabulary) - 1 == config_of(folders["marian"])["vocab_size"] - 1
    assert generation("marian") == {
        **common, "decoder_start_token_id": pad, "pad_token_id": pad, "eos_token_id": 0,
        "forced_eos_token_id": 0, "bad_words_ids": [[pad]],
    }  # fmt: skip
    assert generation("bart") == {
        **common, "bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2,
        "decoder_start_token_id": 2, "forced_eos_token_id": 2,
    }  # fmt: skip
    for family in ("t5", "t5v11"):
        assert generation(family) == {
            **common, "decoder_start_token_id": 0, "pad_token_id": 0, "eos_token_id": 1,
        }  # fmt: skip
    marian = config_of(folders["marian"])
    assert marian["scale_embedding"] is True and marian["share_encoder_decoder_embeddings"]
    assert marian["activation_function"] == "swish"


@pytest.mark.parametrize("family", tiny_seq2seq.SEQ2SEQ_FAMILIES)
def test_tokenizer_adds_the_end_token_and_splits_chinese_by_character(folders, family):
    tokenizer = Tokenizer.from_file(str(folders[family] / "tokenizer.json"))
    for text in TEXTS:
        tokens = tokenizer.encode(text).tokens
        assert tokens[-1] == "</s>"
        assert (tokens[0] == "<s>") == (family == "bart")
        assert len(tokens) >= 4, tokens
    words = [t for t in tokenizer.encode("猫吃鱼").tokens if t not in ("<s>", "</s>", "▁")]
    assert len(words) == 3, words
    assert tokenizer.encode("猫吃鱼").ids.count(tokenizer.token_to_id("<unk>")) == 0


@pytest.mark.parametrize("family", tiny_seq2seq.SEQ2SEQ_FAMILIES)
def test_every_step_equals_the_teacher_forced_forward(references, family):
    reference = references(family)
    teacher = reference.teacher_forced
    steps = reference.generated.shape[1] - 1
    assert len(reference.decoder_attentions) == len(reference.cross_attentions) == steps
    for step in range(steps):
        for block in reference.decoder_attentions[step]:
            assert block.shape[2:] == (1, step + 1)
    for block, weights in enumerate(teacher.decoder_attentions):
        rows = hf_seq2seq.step_rows(reference.decoder_attentions, block)  # (B, H, S, S)
        assert (rows - weights[:, :, :steps, :steps]).abs().max() <= STEP_TOLERANCE
        cross = hf_seq2seq.step_rows(reference.cross_attentions, block)  # (B, H, S, Ls)
        assert (cross - teacher.cross_attentions[block][:, :, :steps]).abs().max() <= (
            STEP_TOLERANCE
        )
    for ours, theirs in zip(reference.encoder_attentions, teacher.encoder_attentions, strict=True):
        assert (ours - theirs).abs().max() <= STEP_TOLERANCE
    for step in range(steps):
        assert (reference.step_logits[step] - teacher.logits[:, step]).abs().max() <= 1e-5
    # the padded source keys get no weight, in the encoder and in cross-attention
    padding = reference.source_mask == 0  # (B, Ls)
    assert padding.any()
    for weights in [*teacher.encoder_attentions, *teacher.cross_attentions]:  # (B, H, Lq, Ls)
        assert weights[padding[:, None, None, :].expand_as(weights)].abs().max() == 0
    blocks = config_of_blocks(family)
    assert len(teacher.encoder_attentions) == blocks[0]
    assert len(teacher.decoder_attentions) == len(teacher.cross_attentions) == blocks[1]


def config_of_blocks(family: str) -> tuple[int, int]:
    sizes = tiny_seq2seq.SIZES[family]
    if family.startswith("t5"):
        return sizes["num_layers"], sizes["num_decoder_layers"]
    return sizes["encoder_layers"], sizes["decoder_layers"]


@pytest.mark.parametrize("family", tiny_seq2seq.SEQ2SEQ_FAMILIES)
def test_greedy_generation_is_not_degenerate_and_float32_agrees(references, family):
    reference = references(family)
    eos = {"marian": 0, "bart": 2}.get(family, 1)
    first = reference.generated[0, 1:].tolist()  # "Are you OK?"
    body = first[: first.index(eos)] if eos in first else first
    assert len(body) >= 4 and len(set(body)) >= 2, first
    assert torch.equal(references(family, "float32").generated, reference.generated)


@pytest.mark.parametrize("family", tiny_seq2seq.SEQ2SEQ_FAMILIES)
def test_a_batch_gives_each_text_its_ids_alone(folders, references, family):
    batch = references(family).generated
    for row, text in enumerate(TEXTS):
        alone = hf_seq2seq.generate_seq2seq(folders[family], [text], STEPS, dtype="float64")
        assert batch[row, : alone.generated.shape[1]].tolist() == alone.generated[0].tolist()
        length = int(alone.source_mask.sum())
        assert torch.equal(alone.source_ids[0], references(family).source_ids[row, :length])


def test_a_row_that_ends_early_is_padded_and_the_others_go_on(folders):
    folder = folders["t5v11"]
    early = tiny_seq2seq.EARLY_EOS_TEXT["t5v11"]
    batch = hf_seq2seq.generate_seq2seq(folder, [early, TEXTS[0]], STEPS, dtype="float64")
    alone = hf_seq2seq.generate_seq2seq(folder, [early], STEPS, dtype="float64").generated[0]
    eos, pad = 1, 0
    ended = alone.tolist().index(eos)
    assert ended < STEPS and alone.shape[0] == ended + 1  # alone it stops at its EOS
    assert batch.generated.shape == (2, STEPS + 1)  # the other row goes on
    assert batch.generated[0, : ended + 1].tolist() == alone.tolist()
    assert (batch.generated[0, ended + 1 :] == pad).all()
    assert eos not in batch.generated[1].tolist()
    # the steps after the EOS fed pad to the finished row: still the teacher-forced rows
    steps = batch.generated.shape[1] - 1
    for block, weights in enumerate(batch.teacher_forced.decoder_attentions):
        rows = hf_seq2seq.step_rows(batch.decoder_attentions, block)
        assert (rows - weights[:, :, :steps, :steps]).abs().max() <= STEP_TOLERANCE


def test_default_logits_processors(references, folders):
    """Marian: pad never generated (bad_words_ids), the last step forced to EOS; BART: the last
    step forced to EOS; T5: nothing forced."""
    marian = references("marian")
    pad = config_of(folders["marian"])["pad_token_id"]
    for scores in marian.step_scores:
        assert torch.isneginf(scores[:, pad]).all()
    assert not torch.isneginf(marian.step_logits[0][:, pad]).any()
    for family, eos in (("marian", 0), ("bart", 2)):
        reference = references(family)
        assert reference.generated.shape[1] == STEPS + 1
        last = reference.step_scores[-1]
        assert (reference.generated[:, -1] == eos).all()
        assert torch.isneginf(last[:, [i for i in range(last.shape[1]) if i != eos]]).all()
        assert (reference.generated[:, 1:-1] != eos).all()  # it was forced, not chosen
    for family in ("t5", "t5v11"):
        reference = references(family)
        for logits, scores in zip(reference.step_logits, reference.step_scores, strict=True):
            assert torch.equal(logits, scores)
        assert reference.generated.shape[1] == STEPS + 1


def test_marian_positions_are_the_specified_sinusoid(folders):
    model = hf_seq2seq.load_seq2seq(folders["marian"])
    table = model.model.encoder.embed_positions.weight  # (P, D)
    P, D = table.shape
    position = torch.arange(P, dtype=torch.float64)[:, None]
    frequency = 10000.0 ** (-2 * torch.arange(D // 2, dtype=torch.float64) / D)
    expected = torch.cat([torch.sin(position * frequency), torch.cos(position * frequency)], -1)
    assert (table.double() - expected).abs().max() <= 1e-6
    assert torch.equal(table, model.model.decoder.embed_positions.weight)


@pytest.mark.parametrize("family", tiny_seq2seq.CAUSAL_FAMILIES)
def test_causal_fixture_and_its_steps(folders, family):
    folder = folders[family]
    keys = stored(folder)
    config = config_of(folder)
    prefix = "transformer." if family == "gpt2" else "model."
    assert all(k.startswith(prefix) or k == "lm_head.weight" for k in keys)
    assert ("lm_head.weight" in keys) == (not config.get("tie_word_embeddings", True))
    assert config["architectures"][0].endswith(("ForCausalLM", "LMHeadModel"))
    assert (folder / "generation_config.json").exists()
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    prompt = torch.tensor([tokenizer.encode("Are you OK?").ids])
    reference = hf_seq2seq.generate_causal(folder, prompt, STEPS, dtype="float64")
    length = prompt.shape[1]
    assert torch.equal(reference.generated[:, :length], prompt)
    assert len(reference.attentions) == reference.generated.shape[1] - length
    assert reference.attentions[0][0].shape[2:] == (length, length)
    for step, blocks in enumerate(reference.attentions[1:], start=1):
        assert blocks[0].shape[2:] == (1, length + step)
    rows = reference.generated.shape[1] - 1
    for block, weights in enumerate(reference.teacher_forced.decoder_attentions):
        steps = hf_seq2seq.step_rows(reference.attentions, block)  # (B, H, rows, rows)
        assert steps.shape[2] == rows
        assert (steps - weights[:, :, :rows, :rows]).abs().max() <= CAUSAL_STEP_TOLERANCE
    float32 = hf_seq2seq.generate_causal(folder, prompt, STEPS)
    assert torch.equal(float32.generated, reference.generated)


@pytest.mark.parametrize("family", ["marian", "t5"])
def test_sentencepiece_only_folder_has_no_tokenizer_json(tmp_path, family):
    folder = tiny_seq2seq.write_sentencepiece_only(family, tmp_path / family)
    names = {p.name for p in folder.iterdir()}
    assert "tokenizer.json" not in names
    assert {"config.json", "model.safetensors"} <= names
    spm = {"source.spm", "target.spm", "vocab.json"} if family == "marian" else {"spiece.model"}
    assert spm <= names
    assert stored(folder) == expected_tensors(family, config_of(folder))


# ---- the specifications as code: marian.md, bart.md, t5.md in float64, from the file alone ----


def _sinusoid(positions: int, width: int) -> torch.Tensor:
    """Marian's table: sin in the first half, cos in the second, frequencies 10000^(-2i/D)."""
    position = torch.arange(positions, dtype=torch.float64)[:, None]
    frequency = 10000.0 ** (-2 * torch.arange(width // 2, dtype=torch.float64) / width)
    table = torch.cat([torch.sin(position * frequency), torch.cos(position * frequency)], -1)
    return table.float().double()  # computed in float64, kept as float32 (marian.md)


def _t5_bucket(relative: torch.Tensor, bidirectional: bool, buckets: int, distance: int):
    bucket = torch.zeros_like(relative)
    if bidirectional:
        buckets //= 2
        bucket += (relative > 0).long() * buckets
        n = relative.abs()
    else:
        n = -torch.clamp(relative, max=0)
    exact = buckets // 2
    large = (
        exact
        + (torch.log(n.float() / exact) / math.log(distance / exact) * (buckets - exact)).long()
    )  # float32, truncated toward zero, as t5.md says
    large = torch.clamp(large, max=buckets - 1)
    return bucket + torch.where(n < exact, n, large)


def _attend(q, k, v, additive, heads, scale):
    """(B, Lq, H·d), (B, Lk, H·d) ×2 → output (B, Lq, H·d), weights (B, H, Lq, Lk)."""
    B, Lq, width = q.shape
    d = width // heads
    q = q.view(B, Lq, heads, d).transpose(1, 2)  # (B, H, Lq, d)
    k = k.view(B, -1, heads, d).transpose(1, 2)  # (B, H, Lk, d)
    v = v.view(B, -1, heads, d).transpose(1, 2)
    weights = torch.softmax(q @ k.transpose(-1, -2) * scale + additive, dim=-1)
    return (weights @ v).transpose(1, 2).reshape(B, Lq, width), weights


def spec_forward(folder: Path, source_ids, source_mask, target_ids):
    """Encoder and decoder attentions per block and logits, written from the notes."""
    import torch.nn.functional as functional
    from safetensors.torch import load_file

    config = config_of(folder)
    w = {k: t.double() for k, t in load_file(str(folder / "model.safetensors")).items()}
    B, Ls = source_ids.shape
    Lt = target_ids.shape[1]
    source_additive = torch.zeros(B, 1, 1, Ls, dtype=torch.float64)
    source_additive[source_mask[:, None, None, :] == 0] = -math.inf
    causal = torch.full((Lt, Lt), -math.inf, dtype=torch.float64).triu(1)  # (Lt, Lt)
    encoder_weights, decoder_weights, cross_weights = [], [], []
    if config["model_type"] in ("marian", "bart"):
        D = config["d_model"]
        scale = math.sqrt(D) if config["scale_embedding"] else 1.0
        act = {"swish": functional.silu, "gelu": functional.gelu}[config["activation_function"]]

        def linear(x, name):
            return x @ w[f"{name}.weight"].T + w[f"{name}.bias"]

        def norm(x, name):
            return functional.layer_norm(x, (D,), w[f"{name}.weight"], w[f"{name}.bias"], 1e-5)

        def embed(ids, side):
            x = w["model.shared.weight"][ids] * scale
            if config["model_type"] == "marian":  # not stored: sinusoid, no offset
                return x + _sinusoid(config["max_position_embeddings"], D)[: ids.shape[1]]
            x = x + w[f"model.{side}.embed_positions.weight"][torch.arange(ids.shape[1]) + 2]
            return norm(x, f"model.{side}.layernorm_embedding")

        def attention(x, kv, name, additive, heads, sink):
            out, weights = _attend(
                linear(x, f"{name}.q_proj"), linear(kv, f"{name}.k_proj"),
                linear(kv, f"{name}.v_proj"), additive, heads, (D // heads) ** -0.5,
            )  # fmt: skip
            sink.append(weights)
            return linear(out, f"{name}.out_proj")

        h = embed(source_ids, "encoder")
        for i in range(config["encoder_layers"]):  # post-LN
            p = f"model.encoder.layers.{i}"
            heads = config["encoder_attention_heads"]
            h = norm(h + attention(h, h, f"{p}.self_attn", source_additive, heads,
                                   encoder_weights), f"{p}.self_attn_layer_norm")  # fmt: skip
            h = norm(h + linear(act(linear(h, f"{p}.fc1")), f"{p}.fc2"), f"{p}.final_layer_norm")
        encoded = h
        h = embed(target_ids, "decoder")
        for i in range(config["decoder_layers"]):
            p = f"model.decoder.layers.{i}"
            heads = config["decoder_attention_heads"]
            h = norm(h + attention(h, h, f"{p}.self_attn", causal, heads, decoder_weights),
                     f"{p}.self_attn_layer_norm")  # fmt: skip
            h = norm(h + attention(h, encoded, f"{p}.encoder_attn", source_additive, heads,
                                   cross_weights), f"{p}.encoder_attn_layer_norm")  # fmt: skip
            h = norm(h + linear(act(linear(h, f"{p}.fc1")), f"{p}.fc2"), f"{p}.final_layer_norm")
        logits = h @ w["model.shared.weight"].T + w["final_logits_bias"]
        return encoder_weights, decoder_weights, cross_weights, logits
    # T5
    H, eps = config["num_heads"], config["layer_norm_epsilon"]
    gated = config.get("is_gated_act", config["feed_forward_proj"].startswith("gated-"))
    name = config.get("dense_act_fn", config["feed_forward_proj"].split("-")[-1])
    act = {"relu": functional.relu, "gelu_new": lambda x: functional.gelu(x, approximate="tanh")}[
        "gelu_new" if config["feed_forward_proj"] == "gated-gelu" else name
    ]

    def rms(x, key):  # the mean square in float32, whatever the model's dtype (t5.md)
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return w[key] * (x * torch.rsqrt(variance + eps))

    def position_bias(side, queries, keys, bidirectional):
        relative = torch.arange(keys)[None, :] - torch.arange(queries)[:, None]  # key − query
        bucket = _t5_bucket(relative, bidirectional, config["relative_attention_num_buckets"],
                            config["relative_attention_max_distance"])  # fmt: skip
        table = w[f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
        return table[bucket].permute(2, 0, 1)[None]  # (1, H, Lq, Lk)

    def attention(x, kv, name, additive, sink):
        out, weights = _attend(x @ w[f"{name}.q.weight"].T, kv @ w[f"{name}.k.weight"].T,
                               kv @ w[f"{name}.v.weight"].T, additive, H, 1.0)  # fmt: skip
        sink.append(weights)
        return out @ w[f"{name}.o.weight"].T

    def feed_forward(x, p):
        if gated:
            inner = act(x @ w[f"{p}.wi_0.weight"].T) * (x @ w[f"{p}.wi_1.weight"].T)
        else:
            inner = act(x @ w[f"{p}.wi.weight"].T)
        return inner @ w[f"{p}.wo.weight"].T

    encoder_bias = position_bias("encoder", Ls, Ls, True) + source_additive
    h = w["shared.weight"][source_ids]
    for i in range(config["num_layers"]):  # pre-LN, block 0's bias reused by every block
        p = f"encoder.block.{i}.layer"
        h = h + attention(rms(h, f"{p}.0.layer_norm.weight"), rms(h, f"{p}.0.layer_norm.weight"),
                          f"{p}.0.SelfAttention", encoder_bias, encoder_weights)  # fmt: skip
        h = h + feed_forward(rms(h, f"{p}.1.layer_norm.weight"), f"{p}.1.DenseReluDense")
    encoded = rms(h, "encoder.final_layer_norm.weight")
    decoder_bias = position_bias("decoder", Lt, Lt, False) + causal
    h = w["shared.weight"][target_ids]
    for i in range(config["num_decoder_layers"]):
        p = f"decoder.block.{i}.layer"
        normed = rms(h, f"{p}.0.layer_norm.weight")
        h = h + attention(normed, normed, f"{p}.0.SelfAttention", decoder_bias, decoder_weights)
        h = h + attention(  # cross-attention: no position bias
            rms(h, f"{p}.1.layer_norm.weight"),
            encoded,
            f"{p}.1.EncDecAttention",
            source_additive,
            cross_weights,
        )
        h = h + feed_forward(rms(h, f"{p}.2.layer_norm.weight"), f"{p}.2.DenseReluDense")
    h = rms(h, "decoder.final_layer_norm.weight")
    scaled = config.get(
        "scale_decoder_outputs", config.get("tie_word_embeddings", True) is not False
    )
    if scaled:
        h = h * config["d_model"] ** -0.5
    head = w.get("lm_head.weight", w["shared.weight"])
    return encoder_weights, decoder_weights, cross_weights, h @ head.T


@pytest.mark.parametrize("family", tiny_seq2seq.SEQ2SEQ_FAMILIES)
def test_the_specifications_compute_what_transformers_computes(folders, references, family):
    reference = references(family)
    teacher = reference.teacher_forced
    encoder, decoder, cross, logits = spec_forward(
        folders[family], reference.source_ids, reference.source_mask, reference.generated
    )
    for ours, theirs in [
        *zip(encoder, teacher.encoder_attentions, strict=True),
        *zip(decoder, teacher.decoder_attentions, strict=True),
        *zip(cross, teacher.cross_attentions, strict=True),
    ]:
        assert (ours - theirs).abs().max() <= 1e-10
    assert (logits - teacher.logits).abs().max() <= 1e-9
