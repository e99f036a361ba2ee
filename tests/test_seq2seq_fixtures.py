"""The encoder–decoder and causal generation fixtures are what the specifications say.

tests/tiny_seq2seq.py writes tiny Marian, BART, T5 v1 and T5 v1.1 folders (and GPT-2, Llama,
Mistral, Qwen2 as causal LMs); tests/hf_seq2seq.py is transformers' greedy generation on them.
These tests hold the fixtures to /work/notes/families/{marian,bart,t5}.md: the tensor tables
(keys, shapes, which tied keys are absent), generation_config.json, the tokenizers' special
tokens, the logits processors on by default, and the oracle itself: every step's attention rows
equal one teacher-forced forward's, a batch gives each text's ids alone, and greedy generation
from "Are you OK?" is not degenerate.
"""

from __future__ import annotations

import json
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
