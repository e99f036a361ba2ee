"""Tiny random checkpoints of each supported family, written by `transformers` itself.

Each folder is what ``save_pretrained`` writes (config.json, model.safetensors) plus a
tokenizer.json trained here with the family's special tokens and post-processing:
BERT wraps a text in [CLS] … [SEP], Llama and Mistral start it with <s>, GPT-2 and Qwen2
add nothing.
The weights are our own seeded draw, by parameter name (so they do not change with how
transformers initialises), and far wider than the families' (std 0.3, not 0.02): the heads
are far from uniform, and a wrong reshape, scale or rotation cannot hide under 1e-5.

The newer families (RECENT_FAMILIES: Qwen3, Gemma 2, Gemma 3 text, Phi-3, OLMo 2) are written as
their *ForCausalLM class (keys "model.…", and "lm_head.weight" when untied), each by default
with what sets it apart (head_dim != hidden/heads, q/k norms, soft-capping, sliding layers
shorter than the test texts, GQA); OPTIONS[family] holds named variants to pass to ``write``
(``write("phi3", d, **OPTIONS["phi3"]["longrope"])``), ``dtype=`` writes float16/bfloat16.
Gemma's tokenizer starts a text with <bos> (ids: <pad> 0, <eos> 1, <bos> 2), Phi-3's with
<s>; Qwen3's and OLMo 2's add nothing. Gemma's norm weights are drawn around 0, as its
RMSNorm scales by (1 + weight). The specifications they are checked against
(tests/test_hf_fixtures.py) were written to /work/notes/families/*.md.

    python tests/tiny_models.py DIR     # writes DIR/bert, DIR/gpt2, ... one folder a family
"""

from __future__ import annotations

import sys
from pathlib import Path

CORPUS = Path(__file__).resolve().parent.parent / "scripts" / "corpus"
# what the model tests walk (Gemma 2 has its own tests: its soft-cap rules out SDPA)
FAMILIES = ("bert", "gpt2", "llama", "mistral", "qwen2", "phi3", "qwen3", "olmo2", "gemma3")
SLIDING_WINDOW = 48  # the tiny Mistral's: longer than the tests' texts
# the families of issue 11, written by their causal-LM class (NEW_CONFIGS below)
RECENT_FAMILIES = ("qwen3", "gemma2", "gemma3", "phi3", "olmo2")

SHORT_WINDOW = 6  # the new families' sliding layers: shorter than the tests' texts
LONG_TEXT = "Are you OK? 猫吃鱼, the cat eats the fish. The dog sleeps in the sun."


def _corpus() -> list[str]:
    lines = []
    for path in sorted(CORPUS.glob("*.txt")):
        lines += [line for line in path.read_text(encoding="utf-8").splitlines() if line]
    return lines


def _wordpiece_vocab() -> dict[str, int]:
    """Special tokens, every character alone and as a continuation, the 200 commonest words."""
    import re
    from collections import Counter

    text = " ".join(_corpus()).lower()
    chars = sorted({c for c in text if not c.isspace()})
    words = Counter(re.findall(r"[a-z]+", text))
    common = sorted(words, key=lambda w: (-words[w], w))[:200]
    pieces = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{c}" for c in chars)]
    pieces += [w for w in common if w not in pieces]
    return {piece: i for i, piece in enumerate(pieces)}


def build_tokenizer(family: str):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing

    if family == "bert":  # WordPiece's trainer numbers pieces in no fixed order: list them
        tokenizer = Tokenizer(models.WordPiece(_wordpiece_vocab(), unk_token="[UNK]"))
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tokenizer.decoder = decoders.WordPiece()
        cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
        tokenizer.post_processor = TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
        )
        return tokenizer
    if family in ("gpt2", "qwen2", "qwen3", "olmo2"):  # byte-level BPE, no special tokens added
        special = ["<|endoftext|>"]
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=special,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
    elif family in ("gemma2", "gemma3"):  # Gemma's ids: <pad> 0, <eos> 1, <bos> 2, <unk> 3
        special = ["<pad>", "<eos>", "<bos>", "<unk>"]
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=False))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special)
    else:
        special = ["<unk>", "<s>", "</s>"]
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=False))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special)
    tokenizer.train_from_iterator(_corpus(), trainer)
    if family in ("llama", "mistral"):  # they begin with <s>
        bos = tokenizer.token_to_id("<s>")
        tokenizer.post_processor = TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
        )
    elif family == "phi3":  # Phi-3's tokenizer is Llama's: <s> first
        bos = tokenizer.token_to_id("<s>")
        tokenizer.post_processor = TemplateProcessing(
            single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
        )
    elif family in ("gemma2", "gemma3"):  # Gemma begins with <bos>
        bos = tokenizer.token_to_id("<bos>")
        tokenizer.post_processor = TemplateProcessing(
            single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos)]
        )
    return tokenizer


# The new families' tiny configurations: each shows what sets the family apart. Token ids
# match build_tokenizer's (Phi-3's default pad id 32000 would not fit a 400-token vocabulary).
NEW_CONFIGS: dict[str, tuple[str, dict]] = {
    "qwen3": (
        "Qwen3ForCausalLM",
        {
            "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "intermediate_size": 48, "max_position_embeddings": 128,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
            "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0,
        },  # head_dim 16, not 32 / 4; q/k RMSNorm per head
    ),
    "gemma2": (
        "Gemma2ForCausalLM",
        {
            "hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 128,
            "query_pre_attn_scalar": 24, "attn_logit_softcapping": 4.0,
            "final_logit_softcapping": 5.0, "sliding_window": SHORT_WINDOW,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
            "tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": 1,
            "bos_token_id": 2,
        },  # layers 0, 2 slide (Gemma 2 alternates), scale 24**-0.5, caps that bite
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        {
            "hidden_size": 48, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 128,
            "query_pre_attn_scalar": 20, "sliding_window": SHORT_WINDOW,
            "sliding_window_pattern": 3,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
            },
            "tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": 1,
            "bos_token_id": 2,
        },  # layers 0, 1 slide with base 10, layer 2 global with linear scaling; q/k norms
    ),
    "phi3": (
        "Phi3ForCausalLM",
        {
            "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 48, "max_position_embeddings": 128,
            "original_max_position_embeddings": 128,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
            "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1,
            "eos_token_id": 2,
        },  # fused qkv_proj (GQA: 4·8 + 2·8 + 2·8 rows) and gate_up_proj
    ),
    "olmo2": (
        "Olmo2ForCausalLM",
        {
            "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 48, "max_position_embeddings": 128,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
            "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 0,
            "eos_token_id": 0,
        },  # q/k RMSNorm over all heads (32 and 16 wide); norms after each sublayer
    ),
}  # fmt: skip

# Named variants of the new families, passed on to write() / build_model() as keys.
OPTIONS: dict[str, dict[str, dict]] = {
    "qwen3": {
        # layers >= max_window_layers slide: layer 0 full, layers 1 and 2 sliding
        "sliding": {"use_sliding_window": True, "sliding_window": SHORT_WINDOW,
                    "max_window_layers": 1},
        "untied": {"tie_word_embeddings": False},
        "bias": {"attention_bias": True},
    },
    "gemma2": {
        "untied": {"tie_word_embeddings": False},
        "no_softcap": {"attn_logit_softcapping": None, "final_logit_softcapping": None},
        "pattern": {"layer_types": ["full_attention", "sliding_attention", "sliding_attention"]},
    },
    "gemma3": {
        "untied": {"tie_word_embeddings": False},
        "plain_rope": {"rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
        }},
    },
    "phi3": {
        # head_dim 8: 4 factors each; inputs longer than 16 positions take long_factor
        "longrope": {
            "max_position_embeddings": 128, "original_max_position_embeddings": 16,
            "rope_parameters": {
                "rope_type": "longrope", "rope_theta": 1000.0,
                "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [1.0, 2.5, 6.0, 12.0],
            },
        },
        "sliding": {"sliding_window": SHORT_WINDOW},
        "tied": {"tie_word_embeddings": True},
    },
    "olmo2": {
        "tied": {"tie_word_embeddings": True},
    },
}  # fmt: skip


def _build_new_family(family: str, vocab_size: int, layers: int, config: dict):
    """The causal-LM model of a new family, its config built with the keys (so that what
    the config derives from them, such as layer_types, follows)."""
    import transformers

    class_name, values = NEW_CONFIGS[family]
    values = {**values, "vocab_size": vocab_size, "num_hidden_layers": layers, **config}
    model_type = "gemma3_text" if family == "gemma3" else family
    cfg = transformers.AutoConfig.for_model(model_type, **values)
    return getattr(transformers, class_name)._from_config(cfg, attn_implementation="eager")


def build_model(family: str, vocab_size: int, layers: int = 3, dtype: str = "float32", **config):
    """A random model of the family with eager attention (which returns the weights)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if family in RECENT_FAMILIES:  # written by their causal-LM class, as the hub has them
        return _draw(_build_new_family(family, vocab_size, layers, config), family, dtype)
    common = {"vocab_size": vocab_size}
    if family == "bert":
        cfg = transformers.BertConfig(
            hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
            intermediate_size=48, max_position_embeddings=64, **common,
        )  # fmt: skip
        model_class = transformers.BertModel
    elif family == "gpt2":
        cfg = transformers.GPT2Config(
            n_embd=32, n_layer=layers, n_head=4, n_positions=64, bos_token_id=0,
            eos_token_id=0, **common,
        )  # fmt: skip
        model_class = transformers.GPT2Model
    elif family == "llama":
        cfg = transformers.LlamaConfig(
            hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64, **common,
        )  # fmt: skip
        model_class = transformers.LlamaModel
    elif family == "mistral":
        cfg = transformers.MistralConfig(
            hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=1, intermediate_size=40, max_position_embeddings=64,
            sliding_window=SLIDING_WINDOW, rope_theta=1000.0, **common,
        )  # fmt: skip
        model_class = transformers.MistralModel
    else:
        cfg = transformers.Qwen2Config(
            hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64, **common,
        )  # fmt: skip
        model_class = transformers.Qwen2Model
    for key, value in config.items():
        setattr(cfg, key, value)
    model = model_class._from_config(cfg, attn_implementation="eager")
    return _draw(model, family, dtype)


def _draw(model, family: str, dtype: str = "float32"):
    """Our own draw, by name: the weights do not depend on how transformers initialises."""
    import torch

    generator = torch.Generator().manual_seed(0)
    # Gemma's RMSNorm scales by (1 + weight): its weights are drawn around 0, not 1
    unit = 0.0 if family in ("gemma2", "gemma3") else 1.0
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            noise = torch.randn(parameter.shape, generator=generator)
            if parameter.dim() > 1:
                parameter.copy_(noise * 0.3)
            elif "norm" in name.lower() or name.startswith("ln") or ".ln_" in name:
                parameter.copy_(unit + noise * 0.1)  # a norm's scale (and its bias, near 1)
            else:
                parameter.copy_(noise * 0.1)  # a bias
    if dtype != "float32":  # drawn in float32, stored rounded to the dtype
        model = model.to(getattr(torch, dtype))
    return model.eval()


def write(family: str, directory: Path, dtype: str = "float32", **config) -> Path:
    """Write a tiny checkpoint folder: config.json, model.safetensors, tokenizer.json.

    ``dtype`` ("float32", "float16", "bfloat16") is the stored weights' dtype; ``config``
    sets config keys (for the new families, before the config derives its other keys).
    """
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(family)
    tokenizer.save(str(directory / "tokenizer.json"))
    model = build_model(family, tokenizer.get_vocab_size(), dtype=dtype, **config)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def rewrite_config(directory: Path, remove: tuple[str, ...] = (), **values) -> Path:
    """Edit a written config.json: drop keys (e.g. Gemma 3's layer_types, to leave only
    sliding_window_pattern as older hub configs do) and set others."""
    import json

    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key in remove:
        config.pop(key, None)
    config.update(values)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return directory


if __name__ == "__main__":
    root = Path(sys.argv[1] if sys.argv[1:] else "tiny-models")
    for name in FAMILIES:
        print(write(name, root / name))


# Full-size configurations, for shapes and memory only (they never load a weight).
FULL_SIZE = {
    "gpt2-small": ("GPT2Model", {"model_type": "gpt2"}),  # the defaults are GPT-2 small
    "bert-base": ("BertModel", {"model_type": "bert"}),  # the defaults are bert-base
    "llama-2-7b": (
        "LlamaForCausalLM",
        {
            "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
            "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        },
    ),
    "llama-3.2-1b": (
        "LlamaForCausalLM",
        {
            "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
            "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True, "head_dim": 64,
            "rope_parameters": {
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
    # meta-llama/Meta-Llama-3-70B and meta-llama/Llama-3.1-405B: their config.json values
    "llama-3-70b": (  # 70,553,706,496 parameters, untied
        "LlamaForCausalLM",
        {
            "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
            "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
            "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        },
    ),
    "llama-3.1-405b": (  # 405,853,388,800 parameters, untied
        "LlamaForCausalLM",
        {
            "model_type": "llama", "hidden_size": 16384, "intermediate_size": 53248,
            "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
            "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
            "rope_parameters": {
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
    "mistral-7b": (  # 7,241,732,096 parameters; every block slides over 4096 keys
        "MistralForCausalLM",
        {
            "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 32000, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
            "sliding_window": 4096,
        },
    ),
    "qwen2.5-0.5b": (
        "Qwen2ForCausalLM",
        {
            "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
            "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
            "vocab_size": 151936, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    ),
    # the five below: their config.json values (see /work/notes/families/*.md)
    "qwen3-0.6b": (  # 596,049,920 parameters, the head tied to the embedding
        "Qwen3ForCausalLM",
        {
            "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
            "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": 28,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
    ),
    "gemma-2-2b": (  # 2,614,341,888, tied; layers 0, 2, ... 24 slide over 4096 tokens
        "Gemma2ForCausalLM",
        {
            "model_type": "gemma2", "hidden_size": 2304, "intermediate_size": 9216,
            "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
            "head_dim": 256, "vocab_size": 256000, "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
            "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
            "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "gemma-3-1b": (  # 999,885,952, tied; layers 5, 11, 17, 23 global, the rest slide (512)
        "Gemma3ForCausalLM",
        {
            "model_type": "gemma3_text", "hidden_size": 1152, "intermediate_size": 6912,
            "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 256, "vocab_size": 262144, "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 512,
            "sliding_window_pattern": 6, "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0, "rope_scaling": None,
            "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
        },
    ),
    "phi-3-mini-4k": (  # 3,821,079,552, untied
        "Phi3ForCausalLM",
        {
            "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
            "vocab_size": 32064, "max_position_embeddings": 4096,
            "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "sliding_window": 2047, "tie_word_embeddings": False, "pad_token_id": 32000,
            "bos_token_id": 1, "eos_token_id": 32000,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "olmo-2-1b": (  # OLMo-2-0425-1B: 1,484,916,736, untied
        "Olmo2ForCausalLM",
        {
            "model_type": "olmo2", "hidden_size": 2048, "intermediate_size": 8192,
            "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
            "vocab_size": 100352, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "pad_token_id": 100277, "eos_token_id": 100257,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        },
    ),
}  # fmt: skip

# the published parameter counts of FULL_SIZE's new-family and large Llama models (a tied head
# counted once)
PUBLISHED_PARAMETERS = {
    "qwen3-0.6b": 596_049_920,
    "gemma-2-2b": 2_614_341_888,
    "gemma-3-1b": 999_885_952,
    "phi-3-mini-4k": 3_821_079_552,
    "olmo-2-1b": 1_484_916_736,
    "llama-3-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
}


def write_header_only(name: str, directory: Path, dtype: str = "float16") -> Path:
    """config.json and a model.safetensors with a header and no data (a sparse file), from
    transformers.

    transformers builds the model on the meta device (no memory), so the tensor names and
    shapes are its own; ``shapes`` and ``memory`` read nothing but these two files.
    """
    import json
    import os

    import torch
    import transformers

    class_name, values = FULL_SIZE[name]
    values = dict(values)
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        model = getattr(transformers, class_name)(config)
    directory.mkdir(parents=True, exist_ok=True)
    config.dtype = dtype
    config.save_pretrained(directory)
    code = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}[dtype]
    size = torch.finfo(getattr(torch, dtype)).bits // 8
    header, offset = {}, 0
    for key, tensor in model.named_parameters():  # a tied head once, as save_pretrained does
        if tensor.is_floating_point():
            end = offset + tensor.numel() * size
            header[key] = {
                "dtype": code,
                "shape": list(tensor.shape),
                "data_offsets": [offset, end],
            }
            offset = end
    raw = json.dumps(header).encode()
    path = directory / "model.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)
    # the data's length without the data: a sparse file, its bytes read as zeros and
    # stored nowhere, so the header's offsets fit the file as a real checkpoint's do
    os.truncate(path, 8 + len(raw) + offset)
    return directory
