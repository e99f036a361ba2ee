"""Tiny random encoder–decoder checkpoints (Marian, BART, T5 v1, T5 v1.1) and decoder-only
causal LMs (GPT-2, Llama, Mistral, Qwen2), written by `transformers` itself, for generation.

Each folder is what ``save_pretrained(safe_serialization=True)`` writes (config.json,
model.safetensors, generation_config.json) plus a tokenizer.json trained here on
scripts/corpus with the family's special tokens and post-processing, as the real ones have:

- Marian (opus-mt): a Metaspace BPE; ids ``</s>`` 0, ``<unk>`` 1, …, ``<pad>`` last;
  a text gets ``</s>`` appended; pad = decoder_start_token_id = the last id; shared
  embeddings (encoder, decoder, head); generation_config.json has ``bad_words_ids
  [[pad]]`` as every opus-mt model on the hub does (MARIAN_BAD_WORDS=False to leave it out).
- BART: a byte-level BPE; ids ``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3, ``<mask>``
  last; a text becomes ``<s> … </s>``; decoder_start_token_id 2 (``</s>``), as bart-base.
- T5 (v1, "t5") and T5 v1.1 / flan ("t5v11"): a Metaspace BPE; ids ``<pad>`` 0, ``</s>`` 1,
  ``<unk>`` 2; a text gets ``</s>`` appended; decoder_start_token_id 0 (pad).
  "t5": feed_forward_proj "relu", the head tied to ``shared`` (logits scaled by
  d_model**-0.5). "t5v11": "gated-gelu", a separate ``lm_head.weight`` in the file and
  config.json ``tie_word_embeddings: false`` without ``scale_decoder_outputs`` — what a
  flan-t5 download has (transformers 5 ties T5 heads whenever it can; see write()).
  "t5v11" has 3 encoder blocks and 2 decoder blocks (num_layers 3, num_decoder_layers 2;
  the other way round, transformers 5.24's generate() fails: its cache is sized by num_layers).

Chinese is split into single characters before the BPE (猫吃鱼 → 猫 吃 鱼), so every test text
is several tokens in every family.

The weights are our own seeded draw, in the order of the sorted parameter names (so they do
not depend on how transformers initialises): std 0.3 for matrices as tests/tiny_models.py
(T5's query matrices 0.3 / sqrt(d_kv): T5 has no 1/sqrt(d) in its attention and folds it into
q, as its own initialisation does), norm scales 1 ± 0.1, every bias 0.1 — LayerNorm biases
too (tiny_models draws them near 1: in a post-LN model that constant swamps the tokens and
greedy decoding repeats one token whatever the source). Marian's and BART's
``final_logits_bias`` (a buffer) is drawn as a bias, so that a head without it is wrong.
The seeds (SEEDS) are chosen so that greedy generation with max_new_tokens=8 is not
degenerate: from "Are you OK?" at least 4 tokens before any end-of-sequence token, at least
2 distinct, for every family (tests/test_seq2seq_fixtures.py checks it); e.g. Marian
[77, 633, 633, 633, 702, 633, 702, </s>], BART [767, 767, 931, 908, 908, 767, 767, </s>].

    write("marian", folder)                 # config.json, model.safetensors, ... tokenizer.json
    write_causal("llama", folder)           # LlamaForCausalLM, tests/tiny_models.py's tokenizer
    write_sentencepiece_only("t5", folder)  # no tokenizer.json: a placeholder spiece.model
    python tests/tiny_seq2seq.py DIR        # writes DIR/marian, DIR/bart, ... one folder each
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import tiny_models  # tests/ is on sys.path: pytest's rootdir mode, or run as a script

SEQ2SEQ_FAMILIES = ("marian", "bart", "t5", "t5v11")
CAUSAL_FAMILIES = ("gpt2", "llama", "mistral", "qwen2")
TEST_TEXTS = ("Are you OK?", "猫吃鱼", "the cat eats the fish")
# a text whose greedy generation ends early (EOS at step 5 of 8, then pad; it also generates the
# pad id 0 as an ordinary token at step 3): for padding after EOS in a batch
EARLY_EOS_TEXT = {"t5v11": "我吃了米饭，还有一条鱼。"}
# seeds of the weight draw that make "Are you OK?" generate a non-degenerate sequence
SEEDS = {"marian": 28, "bart": 29, "t5": 4, "t5v11": 4}
MARIAN_BAD_WORDS = True  # opus-mt's generation_config.json forbids <pad>
BART_VOCAB = 1000  # enough merges that each Chinese character of the corpus is one token
SPM_VOCAB = 1000  # Marian and T5: characters and a few hundred merges
# Chinese, Japanese kana, Korean: each character its own pre-token
CJK = r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]"

# the tiny sizes: D 32, H 4 (d 8), 2 + 2 layers, ffn 48
SIZES = {
    "marian": {
        "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
        "decoder_attention_heads": 4, "encoder_ffn_dim": 48, "decoder_ffn_dim": 48,
        "max_position_embeddings": 64, "scale_embedding": True, "activation_function": "swish",
        "share_encoder_decoder_embeddings": True, "tie_word_embeddings": True,
    },  # opus-mt: scale_embedding true, swish, shared embeddings
    "bart": {
        "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
        "decoder_attention_heads": 4, "encoder_ffn_dim": 48, "decoder_ffn_dim": 48,
        "max_position_embeddings": 64, "activation_function": "gelu", "scale_embedding": False,
    },
    "t5": {
        "d_model": 32, "d_kv": 8, "num_heads": 4, "d_ff": 48, "num_layers": 2,
        "num_decoder_layers": 2, "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 20, "feed_forward_proj": "relu",
        "tie_word_embeddings": True, "layer_norm_epsilon": 1e-6,
    },  # 8 buckets, max distance 20: the test texts reach the logarithmic buckets
    "t5v11": {
        "d_model": 32, "d_kv": 8, "num_heads": 4, "d_ff": 48, "num_layers": 3,
        "num_decoder_layers": 2, "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 20, "feed_forward_proj": "gated-gelu",
        "tie_word_embeddings": False, "layer_norm_epsilon": 1e-6,
    },
}  # fmt: skip


def build_tokenizer(family: str):
    """The family's tokenizer.json, trained on scripts/corpus, with its special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing

    split_cjk = pre_tokenizers.Split(Regex(CJK), behavior="isolated")
    if family == "bart":  # GPT-2's byte-level BPE, as bart-base; <mask> added last
        special = ["<s>", "<pad>", "</s>", "<unk>"]
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [split_cjk, pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=BART_VOCAB,
            special_tokens=special,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    else:  # sentencepiece-like: Metaspace ("▁" marks a word's start)
        special = ["</s>", "<unk>"] if family == "marian" else ["<pad>", "</s>", "<unk>"]
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=False))
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split_cjk, pre_tokenizers.Metaspace()])
        tokenizer.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(
            vocab_size=SPM_VOCAB, special_tokens=special, show_progress=False
        )
    tokenizer.train_from_iterator(tiny_models._corpus(), trainer)
    if family == "bart":
        tokenizer.add_special_tokens(["<mask>"])  # the last id, as in bart-base
        bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
        tokenizer.post_processor = TemplateProcessing(
            single="<s> $A </s>",
            pair="<s> $A </s> </s> $B </s>",
            special_tokens=[("<s>", bos), ("</s>", eos)],
        )
        return tokenizer
    if family == "marian":
        tokenizer.add_special_tokens(["<pad>"])  # the last id, as in opus-mt (58100)
    eos = tokenizer.token_to_id("</s>")
    tokenizer.post_processor = TemplateProcessing(
        single="$A </s>", pair="$A $B </s>", special_tokens=[("</s>", eos)]
    )
    return tokenizer


def _config(family: str, tokenizer, overrides: dict):
    import transformers

    values = {**SIZES[family], "vocab_size": tokenizer.get_vocab_size()}
    if family == "marian":
        pad = tokenizer.token_to_id("<pad>")
        eos = tokenizer.token_to_id("</s>")
        values.update(
            pad_token_id=pad, decoder_start_token_id=pad, eos_token_id=eos,
            forced_eos_token_id=eos, bos_token_id=None,
        )  # fmt: skip
        values.update(overrides)
        return transformers.MarianConfig(**values)
    if family == "bart":
        values.update(
            bos_token_id=tokenizer.token_to_id("<s>"), pad_token_id=tokenizer.token_to_id("<pad>"),
            eos_token_id=tokenizer.token_to_id("</s>"),
            decoder_start_token_id=tokenizer.token_to_id("</s>"),
            forced_eos_token_id=tokenizer.token_to_id("</s>"),
        )  # fmt: skip
        values.update(overrides)
        return transformers.BartConfig(**values)
    values.update(
        pad_token_id=tokenizer.token_to_id("<pad>"), eos_token_id=tokenizer.token_to_id("</s>"),
        decoder_start_token_id=tokenizer.token_to_id("<pad>"),
    )  # fmt: skip
    values.update(overrides)
    return transformers.T5Config(**values)


def _draw(model, seed: int) -> None:
    """Our own draw, by sorted parameter name; Marian's sinusoidal tables (not stored) kept."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    # T5 has no 1/sqrt(d) in its attention: like its own initialisation, the query matrices
    # carry it (std 0.3 / sqrt(d_kv)), or the scores are so large that float32 noise shows
    query_scale = {"q": model.config.d_kv**-0.5} if model.config.model_type == "t5" else {}
    with torch.no_grad():
        tensors = dict(model.named_parameters())
        tensors.update(
            (name, buffer) for name, buffer in model.named_buffers() if "final_logits_bias" in name
        )
        for name, tensor in sorted(tensors.items()):
            if "embed_positions" in name and model.config.model_type == "marian":
                continue  # computed at load, never saved
            noise = torch.randn(tensor.shape, generator=generator)
            if tensor.dim() > 1 and "final_logits_bias" not in name:
                tensor.copy_(noise * 0.3 * query_scale.get(name.rsplit(".", 2)[-2], 1.0))
            elif "norm" in name.lower() and not name.endswith(".bias"):
                tensor.copy_(1.0 + noise * 0.1)  # a norm's scale
            else:
                tensor.copy_(noise * 0.1)  # a bias (LayerNorm's, final_logits_bias too)


def build_model(family: str, tokenizer=None, seed: int | None = None, **config):
    """The random model (eager attention, eval mode) of a seq2seq family."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    tokenizer = tokenizer or build_tokenizer(family)
    cfg = _config(family, tokenizer, config)
    model_class = {
        "marian": transformers.MarianMTModel,
        "bart": transformers.BartForConditionalGeneration,
    }.get(family, transformers.T5ForConditionalGeneration)
    model = model_class._from_config(cfg, attn_implementation="eager")
    if family.startswith("t5") and config.get("tie_word_embeddings", SIZES[family].get(
        "tie_word_embeddings"
    )) is False:  # fmt: skip
        # transformers 5 ties T5's head to `shared` whatever the config says: untie it, as a
        # flan-t5 checkpoint (its own lm_head.weight) loads
        model.lm_head.weight = torch.nn.Parameter(model.shared.weight.detach().clone())
    _draw(model, SEEDS.get(family, 0) if seed is None else seed)
    return model.eval()


def _add_tensors(path: Path, extra: dict) -> None:
    """Rewrite a safetensors file with more tensors (keeping the metadata save_pretrained wrote)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    tensors.update({key: value.detach().clone().contiguous() for key, value in extra.items()})
    save_file(tensors, str(path), metadata=metadata)


def write(
    family: str, directory: Path, dtype: str = "float32", seed: int | None = None, **config
) -> Path:
    """Write a tiny seq2seq folder: config.json, model.safetensors, generation_config.json,
    tokenizer.json. ``config`` overrides config keys; ``dtype`` the stored weights' dtype.

    For "t5v11" (untied), save_pretrained alone would write no lm_head.weight and a config with
    ``tie_word_embeddings: true, scale_decoder_outputs: false`` (transformers 5's own form);
    this writes instead what the hub's v1.1 checkpoints hold: lm_head.weight in the file and
    config.json ``tie_word_embeddings: false`` with no ``scale_decoder_outputs``. transformers
    loads that with the head untied (both tensors present and different) and unscaled.
    """
    import torch

    if family not in SEQ2SEQ_FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of {SEQ2SEQ_FAMILIES}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(family)
    tokenizer.save(str(directory / "tokenizer.json"))
    model = build_model(family, tokenizer, seed, **config)
    if family == "marian" and MARIAN_BAD_WORDS:
        model.generation_config.bad_words_ids = [[model.config.pad_token_id]]
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    untied_t5 = family.startswith("t5") and model.lm_head.weight is not model.shared.weight
    model.save_pretrained(directory, safe_serialization=True)
    if untied_t5:
        from safetensors import safe_open

        with safe_open(str(directory / "model.safetensors"), "pt") as handle:
            stored = set(handle.keys())
        if "lm_head.weight" not in stored:
            _add_tensors(directory / "model.safetensors", {"lm_head.weight": model.lm_head.weight})
        tiny_models.rewrite_config(
            directory, remove=("scale_decoder_outputs",), tie_word_embeddings=False
        )
    return directory


def write_causal(family: str, directory: Path, dtype: str = "float32", **config) -> Path:
    """A decoder-only family of tests/tiny_models.py (gpt2, llama, mistral, qwen2) written as its
    *ForCausalLM class (keys "transformer.…" / "model.…", lm_head.weight when untied), with
    tiny_models' tokenizer, sizes and draw, and the generation_config.json save_pretrained
    writes."""
    import transformers

    if family not in CAUSAL_FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of {CAUSAL_FAMILIES}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_models.build_tokenizer(family)
    tokenizer.save(str(directory / "tokenizer.json"))
    base = tiny_models.build_model(family, tokenizer.get_vocab_size(), **config)
    class_name = {
        "gpt2": "GPT2LMHeadModel",
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
    }[family]
    model = getattr(transformers, class_name)._from_config(base.config, attn_implementation="eager")
    model = tiny_models._draw(model, family, dtype)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def write_sentencepiece_only(family: str, directory: Path) -> Path:
    """A folder like a hub download that has no tokenizer.json: config.json, model.safetensors
    (as write()), generation_config.json, and placeholder sentencepiece files — Marian's
    source.spm, target.spm and vocab.json, T5's spiece.model. They are not real sentencepiece
    models: attnctl must say how to make tokenizer.json, never read them."""
    directory = Path(directory)
    write(family, directory)
    (directory / "tokenizer.json").unlink()
    placeholder = b"placeholder: not a sentencepiece model\n"
    if family == "marian":
        (directory / "source.spm").write_bytes(placeholder)
        (directory / "target.spm").write_bytes(placeholder)
        vocab = build_tokenizer("marian").get_vocab()
        (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=1))
        (directory / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "MarianTokenizer", "model_max_length": 64}) + "\n"
        )
    elif family.startswith("t5"):
        (directory / "spiece.model").write_bytes(placeholder)
        (directory / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "T5Tokenizer", "model_max_length": 512}) + "\n"
        )
    else:
        raise ValueError(f"{family!r} has no sentencepiece files (marian, t5, t5v11)")
    return directory


if __name__ == "__main__":
    root = Path(sys.argv[1] if sys.argv[1:] else "tiny-seq2seq")
    for name in SEQ2SEQ_FAMILIES:
        print(write(name, root / name))
    for name in CAUSAL_FAMILIES:
        print(write_causal(name, root / name))
