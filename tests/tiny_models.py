"""Tiny random checkpoints of each supported family, written by `transformers` itself.

Each folder is what ``save_pretrained`` writes (config.json, model.safetensors) plus a
tokenizer.json trained here with the family's special tokens and post-processing:
BERT wraps a text in [CLS] … [SEP], Llama and Mistral start it with <s>, GPT-2 and Qwen2
add nothing.
The weights are our own seeded draw, by parameter name (so they do not change with how
transformers initialises), and far wider than the families' (std 0.3, not 0.02): the heads
are far from uniform, and a wrong reshape, scale or rotation cannot hide under 1e-5.

    python tests/tiny_models.py DIR     # writes DIR/bert, DIR/gpt2, ... one folder a family
"""

from __future__ import annotations

import sys
from pathlib import Path

CORPUS = Path(__file__).resolve().parent.parent / "scripts" / "corpus"
FAMILIES = ("bert", "gpt2", "llama", "mistral", "qwen2")
SLIDING_WINDOW = 48  # the tiny Mistral's: longer than the tests' texts


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
    if family in ("gpt2", "qwen2"):  # byte-level BPE, no special tokens added
        special = ["<|endoftext|>"]
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=special,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
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
    return tokenizer


def build_model(family: str, vocab_size: int, layers: int = 3, **config):
    """A random model of the family with eager attention (which returns the weights)."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
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
    # our own draw, by name: the weights do not depend on how transformers initialises
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            noise = torch.randn(parameter.shape, generator=generator)
            if parameter.dim() > 1:
                parameter.copy_(noise * 0.3)
            elif "norm" in name.lower() or name.startswith("ln") or ".ln_" in name:
                parameter.copy_(1 + noise * 0.1)  # a norm's scale (and its bias, near 1)
            else:
                parameter.copy_(noise * 0.1)  # a bias
    return model.eval()


def write(family: str, directory: Path, **config) -> Path:
    """Write a tiny checkpoint folder: config.json, model.safetensors, tokenizer.json."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(family)
    tokenizer.save(str(directory / "tokenizer.json"))
    model = build_model(family, tokenizer.get_vocab_size(), **config)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-models")
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
}  # fmt: skip


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
