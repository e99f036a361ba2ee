"""A pretrained model folder read without torch: config.json and the safetensors headers.

A Hugging Face style folder holds ``config.json``, ``model.safetensors`` (or shards listed
in ``model.safetensors.index.json``) and ``tokenizer.json``. This module reads the config
and each safetensors header (8 bytes of length, then JSON naming every tensor's dtype and
shape), checks that the tensors a family needs are there with the shapes the config
implies, and describes the model as a :class:`ModelSpec`. ``shapes`` and ``memory`` need
nothing more, so they answer without loading a single weight. ``pretrained.py`` loads the
weights with ``safetensors`` when ``run`` needs them. A pickled ``.bin`` is never opened.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnctl.config import LayerConfig, read_json_object, regular_file, validate
from attnctl.errors import AttnctlError

# config.json's model_type -> (the family whose code runs it, its name)
MODEL_TYPES = {
    "bert": ("bert", "BERT"),
    "gpt2": ("gpt2", "GPT-2"),
    "llama": ("llama", "Llama"),
    "mistral": ("llama", "Mistral"),  # a Llama with a sliding window
    "qwen2": ("llama", "Qwen2"),  # a Llama with biases in W_q, W_k, W_v
}
SUPPORTED = "bert (BERT encoders), gpt2 (GPT-2), llama, mistral and qwen2 (Llama-style decoders)"
SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# Bytes per value of every dtype a safetensors header may name (attnctl runs the first three)
SAFETENSORS_ITEM_BYTES = {
    "F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "U64": 8, "I32": 4, "U32": 4,
    "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "swish")
MAX_HEADER = 100 * 2**20  # a safetensors header longer than this is not one

# Buffers some checkpoints store beside the weights: GPT-2's causal mask, old Llamas'
# RoPE frequencies. attnctl computes them; they are no parameters.
BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")

# Where each family keeps its token embedding: the key also reveals a prefix such as
# "bert." (BertForMaskedLM), "transformer." (GPT2LMHeadModel) or "model." (LlamaForCausalLM).
EMBEDDING_KEYS = {
    "bert": "embeddings.word_embeddings.weight",
    "gpt2": "wte.weight",
    "llama": "embed_tokens.weight",
}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors' name: F32, F16, BF16, I8, ...
    shape: tuple[int, ...]
    file: str  # the .safetensors file that holds it
    stored_as: str  # its key in that file (older BERTs say LayerNorm.gamma for .weight)

    @property
    def count(self) -> int:
        total = 1
        for n in self.shape:
            total *= n
        return total


@dataclass(frozen=True)
class ModelSpec:
    """What attnctl needs to know about a model, from its config and tensor headers."""

    path: Path
    model_type: str  # config.json's: bert, gpt2, llama, mistral
    family: str  # the code that runs it: "bert", "gpt2" or "llama"
    hidden: int  # D
    heads: int  # H
    kv_heads: int  # Hkv (= H except in grouped-query Llamas)
    layers: int
    vocab_size: int
    intermediate: int  # the feed-forward width I
    max_positions: int
    norm_eps: float
    # RoPE's base and scaling as LayerConfig names them (rope_theta, rope_type, ...)
    rope: dict[str, Any] = field(compare=False, hash=False)  # empty without RoPE
    activation: str  # of the feed-forward
    bias: bool  # in the attention projections
    output_bias: bool  # with bias: in W_o too (Qwen2: no)
    mlp_bias: bool
    type_vocab_size: int  # BERT's segment embeddings; 0 elsewhere
    causal: bool  # a causal mask in every block (decoders; BERT with is_decoder)
    upcast_scores: bool  # GPT-2's reorder_and_upcast_attn: scores in float32
    # each block's sliding window (Mistral, Qwen2): keys at most this far back; 0 = none
    layer_windows: tuple[int, ...]
    dtype: str  # the checkpoint's dtype (of its token embedding)
    prefix: str  # "bert.", "transformer.", "model." or ""
    tensors: dict[str, TensorInfo] = field(compare=False, hash=False, repr=False)

    @property
    def name(self) -> str:
        return MODEL_TYPES[self.model_type][1]

    @property
    def d_k(self) -> int:
        return self.hidden // self.heads

    def weights(self) -> dict[str, TensorInfo]:
        """The checkpoint's float tensors that are weights (not buffers such as masks)."""
        return {
            key: info
            for key, info in self.tensors.items()
            if info.dtype in SAFETENSORS_DTYPES and not key.endswith(BUFFERS)
        }

    def weight(self, name: str) -> str:
        """The checkpoint's key for a tensor named as the family names it (prefix added)."""
        return self.prefix + name

    def window_limit(self, blocks: int | None = None) -> int:
        """The longest input whose blocks 0..blocks-1 attend as full causal attention does:
        their smallest sliding window (0: no block has one)."""
        windows = [w for w in self.layer_windows[:blocks] if w]
        return min(windows, default=0)

    def check_run_length(self, seq_len: int, blocks: int) -> None:
        """Running blocks 0..blocks-1 over seq_len tokens gives the model's own weights.

        attnctl computes full causal attention; a block with a sliding window attends the
        same way up to its window, so a longer input is refused (shapes and memory, whose
        numbers a window does not change, answer for any length).
        """
        limit = self.window_limit(blocks)
        if limit and seq_len > limit:
            block = next(n for n, w in enumerate(self.layer_windows) if w == limit)
            raise AttnctlError(
                f"{seq_len} tokens are more than {self.name}'s sliding window of {limit} "
                f"(block {block}); attnctl shows full causal attention, up to that length"
            )

    def summary(self) -> str:
        kv = f" (kv {self.kv_heads})" if self.kv_heads != self.heads else ""
        return (
            f"{self.name} · {self.layers} layers · D {self.hidden} · heads {self.heads}{kv} · "
            f"FFN {self.intermediate} {self.activation} · vocab {self.vocab_size:,} · {self.dtype}"
        )

    def layer_config(self, **overrides: Any) -> LayerConfig:
        """The attention layer of every block, as attnctl's layer describes it.

        Positions: BERT and GPT-2 add learned ones to the embeddings before the first
        block, so their blocks see none; Llama rotates Q and K in every block (RoPE).
        ``overrides``: dtype, device, impl, tokenizer (the rest is the model's).
        """
        decoder = self.family != "bert"  # pre-norm; BERT is post-norm even with is_decoder
        values: dict[str, Any] = {
            "tokenizer": str(self.path / "tokenizer.json"),
            "d_model": self.hidden,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "bias": self.bias,
            "output_bias": self.output_bias,
            "pos": "rope" if self.family == "llama" else "none",
            "max_positions": self.max_positions,
            "mask": "causal" if self.causal else "none",
            "norm": "pre" if decoder else "post",
            "norm_type": "rms" if self.family == "llama" else "layer",
            "norm_eps": self.norm_eps,
            **self.rope,
            "dtype": self.dtype,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        if self.upcast_scores and values["dtype"] != "float32":
            raise AttnctlError(
                f"reorder_and_upcast_attn computes the scores in float32; attnctl honours it "
                f"in float32 only, not {values['dtype']}: add --dtype float32"
            )
        return validate(LayerConfig(**values))

    def loaded_values(self, blocks: int) -> int:
        """How many values ``run --layer N`` loads for blocks 0..N (``blocks`` = N + 1)."""
        total = 0
        for name, shape in self.expected_shapes().items():
            if block_of(name) < blocks:
                count = 1
                for n in shape:
                    count *= n
                total += count
        return total

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the blocks up to the last one read, with the shape config.json implies."""
        d, i, v = self.hidden, self.intermediate, self.vocab_size
        kv = self.kv_heads * self.d_k
        shapes: dict[str, tuple[int, ...]] = {}
        if self.family == "bert":
            shapes |= {
                "embeddings.word_embeddings.weight": (v, d),
                "embeddings.position_embeddings.weight": (self.max_positions, d),
                "embeddings.token_type_embeddings.weight": (self.type_vocab_size, d),
                "embeddings.LayerNorm.weight": (d,),
                "embeddings.LayerNorm.bias": (d,),
            }
            for n in range(self.layers):
                block = f"encoder.layer.{n}."
                for name, out, inp in (
                    ("attention.self.query", d, d),
                    ("attention.self.key", d, d),
                    ("attention.self.value", d, d),
                    ("attention.output.dense", d, d),
                    ("intermediate.dense", i, d),
                    ("output.dense", d, i),
                ):
                    shapes[f"{block}{name}.weight"] = (out, inp)
                    shapes[f"{block}{name}.bias"] = (out,)
                for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
                    shapes[f"{block}{norm}.weight"] = (d,)
                    shapes[f"{block}{norm}.bias"] = (d,)
        elif self.family == "gpt2":
            shapes |= {"wte.weight": (v, d), "wpe.weight": (self.max_positions, d)}
            for n in range(self.layers):
                block = f"h.{n}."
                for norm in ("ln_1", "ln_2"):
                    shapes[f"{block}{norm}.weight"] = (d,)
                    shapes[f"{block}{norm}.bias"] = (d,)
                # Conv1D stores its weight as (in, out), the transpose of nn.Linear's
                for name, inp, out in (
                    ("attn.c_attn", d, 3 * d),
                    ("attn.c_proj", d, d),
                    ("mlp.c_fc", d, i),
                    ("mlp.c_proj", i, d),
                ):
                    shapes[f"{block}{name}.weight"] = (inp, out)
                    shapes[f"{block}{name}.bias"] = (out,)
        else:
            shapes["embed_tokens.weight"] = (v, d)
            for n in range(self.layers):
                block = f"layers.{n}."
                shapes[f"{block}input_layernorm.weight"] = (d,)
                shapes[f"{block}post_attention_layernorm.weight"] = (d,)
                for name, out, inp, bias in (
                    ("self_attn.q_proj", d, d, self.bias),
                    ("self_attn.k_proj", kv, d, self.bias),
                    ("self_attn.v_proj", kv, d, self.bias),
                    ("self_attn.o_proj", d, d, self.bias and self.output_bias),
                    ("mlp.gate_proj", i, d, self.mlp_bias),
                    ("mlp.up_proj", i, d, self.mlp_bias),
                    ("mlp.down_proj", d, i, self.mlp_bias),
                ):
                    shapes[f"{block}{name}.weight"] = (out, inp)
                    if bias:
                        shapes[f"{block}{name}.bias"] = (out,)
        return shapes


def block_of(name: str) -> int:
    """The block a family-named tensor belongs to (-1: the embeddings and other shared ones)."""
    match = re.search(r"\.(\d+)\.", name)
    return int(match.group(1)) if match else -1


def read_model(directory: str | Path) -> ModelSpec:
    """Read and check a model folder; every problem is an AttnctlError (exit 2)."""
    path = Path(directory).expanduser()
    if not path.is_dir():
        if path.exists():
            raise AttnctlError(f"--model needs a folder, and {directory} is not one")
        raise AttnctlError(f"model folder not found: {directory}")
    config = _read_config(path)
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        found = f"model_type {_brief(model_type)}" if model_type is not None else "no model_type"
        raise AttnctlError(f"{path / 'config.json'} has {found}; attnctl supports {SUPPORTED}")
    tensors = read_tensor_headers(path)
    spec = _spec_from_config(path, model_type, config, tensors)
    _check_tensors(spec)
    return spec


def _read_config(path: Path) -> dict[str, Any]:
    config_path = path / "config.json"
    if not config_path.exists():
        raise AttnctlError(f"no config.json in {path}: attnctl reads Hugging Face style folders")
    return read_json_object(config_path, "model config")


def _brief(value: Any, limit: int = 60) -> str:
    """A value from a file as it reads there, cut short: an error line stays one line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def read_tensor_headers(path: Path) -> dict[str, TensorInfo]:
    """Every tensor's dtype and shape, from model.safetensors or the shards an index names."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.exists():
        files = [single.name]
    elif index.exists():
        files = _shard_files(path, index)
    else:
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(
            p.name for p in path.glob("*.pt*")
        )
        if pickles:
            raise AttnctlError(
                f"{path} has {pickles[0]} but no model.safetensors; attnctl never unpickles "
                "weights (a pickle can run code): convert them with save_pretrained("
                "safe_serialization=True)"
            )
        raise AttnctlError(f"no model.safetensors in {path}")
    tensors: dict[str, TensorInfo] = {}
    for name in files:
        for key, info in _read_header(path / name).items():
            tensors[_modern_name(key)] = TensorInfo(info[0], info[1], name, key)
    return tensors


def _shard_files(path: Path, index: Path) -> list[str]:
    """The shard files an index's weight_map names: plain file names in the model folder."""
    weight_map = read_json_object(index, "shard index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise AttnctlError(f"malformed shard index {index}: no weight_map")
    files = set()
    for key, file in weight_map.items():
        if not isinstance(file, str):
            raise AttnctlError(
                f"malformed shard index {index}: weight_map[{key!r}] must be a file name, "
                f"got {_brief(file)}"
            )
        if file in ("", ".", "..") or Path(file).name != file or "\\" in file:
            raise AttnctlError(
                f"malformed shard index {index}: weight_map[{key!r}] = {_brief(file)} is not "
                f"a file in {path}"
            )
        files.add(file)
    return sorted(files)


def _modern_name(key: str) -> str:
    """Checkpoints converted from TensorFlow call LayerNorm's weight gamma, its bias beta."""
    for old, new in ((".gamma", ".weight"), (".beta", ".bias")):
        if key.endswith(old) and "LayerNorm" in key:
            return key.removesuffix(old) + new
    return key


def _read_header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A safetensors header: 8 bytes little-endian length, then JSON {name: {dtype, shape,
    data_offsets}}; every entry is checked against the file's real size."""
    if file.exists():  # else: "missing weights file", below
        regular_file(file, "weights file")
    try:
        with file.open("rb") as handle:
            file_size = os.fstat(handle.fileno()).st_size
            size = int.from_bytes(handle.read(8), "little")
            if file_size < 8 or not 2 <= size <= min(MAX_HEADER, file_size - 8):
                raise AttnctlError(
                    f"malformed safetensors file {file}: header length {size} does not fit a "
                    f"file of {file_size} bytes"
                )
            raw = handle.read(size)
    except FileNotFoundError:
        raise AttnctlError(f"missing weights file {file}") from None
    except OSError as error:
        raise AttnctlError(f"cannot read {file}: {error.strerror or error}") from None
    try:
        header = json.loads(raw, object_pairs_hook=_without_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        reason = "nested too deeply" if isinstance(error, RecursionError) else error
        raise AttnctlError(f"malformed safetensors file {file}: {reason}") from None
    if not isinstance(header, dict):
        raise AttnctlError(f"malformed safetensors file {file}: the header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise AttnctlError(
            f"malformed safetensors file {file}: __metadata__ must map names to strings"
        )
    data_size = file_size - 8 - size
    entries = {key: _header_entry(file, key, entry, data_size) for key, entry in header.items()}
    # no two tensors may share bytes (empty ones take none)
    spans = sorted((entry["data_offsets"][0], entry["data_offsets"][1], key)
                   for key, entry in header.items())  # fmt: skip
    reached, last = 0, None
    for begin, end, key in spans:
        if begin < reached:
            raise AttnctlError(
                f"malformed safetensors file {file}: tensors {last!r} and {key!r} overlap"
            )
        if end > reached:
            reached, last = end, key
    return entries


def _without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are all different (json.loads would keep the last)."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"the key {_brief(key)} appears twice")
        seen.add(key)
    return dict(pairs)


def _header_entry(file: Path, key: str, entry: Any, data_size: int) -> tuple[str, tuple[int, ...]]:
    """One tensor's dtype and shape, once its offsets are proven to hold exactly its bytes."""

    def bad(text: str) -> AttnctlError:
        return AttnctlError(f"malformed safetensors file {file}: tensor {key!r} {text}")

    if not isinstance(entry, dict):
        raise bad(f"is {_brief(entry)}, not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad(f"has dtype {_brief(dtype)}, not a name such as F32")
    if dtype not in SAFETENSORS_ITEM_BYTES:
        raise bad(f"has unknown dtype {_brief(dtype)}")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise bad(f"has shape {_brief(shape)}, not a list of sizes >= 0")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(n) is int for n in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_size
    ):
        raise bad(
            f"has data_offsets {_brief(offsets)}, not [begin, end] within its {data_size} bytes"
        )
    count = 1
    for n in shape:
        count *= n
    if offsets[1] - offsets[0] != count * SAFETENSORS_ITEM_BYTES[dtype]:
        raise bad(
            f"has shape {_shape(tuple(shape))} of {dtype} but {offsets[1] - offsets[0]} bytes"
        )
    return dtype, tuple(shape)


class _Fields:
    """config.json's values, each checked by type and range as it is read (one line each)."""

    def __init__(self, file: Path, config: dict[str, Any]) -> None:
        self.file, self.config = file, config

    def error(self, key: str, text: str) -> AttnctlError:
        return AttnctlError(f"{self.file}: {key} {text}")

    def raw(self, *keys: str) -> tuple[str, Any]:
        """The first key that is set (not null) and its value; (keys[0], None) if none is."""
        for key in keys:
            if self.config.get(key) is not None:
                return key, self.config[key]
        return keys[0], None

    def integer(self, *keys: str, default: int | None, minimum: int = 1) -> int:
        key, value = self.raw(*keys)
        if value is None:
            if default is None:
                raise AttnctlError(f"{self.file} has no {key}")
            return default
        if type(value) is not int or value < minimum:  # bool is an int in Python: not here
            raise self.error(key, f"must be an integer >= {minimum}, got {_brief(value)}")
        return value

    def number(self, *keys: str, default: float, above: float = 0.0) -> float:
        key, value = self.raw(*keys)
        if value is None:
            return default
        return self.check_number(key, value, above)

    def check_number(self, key: str, value: Any, above: float = 0.0) -> float:
        if type(value) not in (int, float) or not math.isfinite(value) or not value > above:
            raise self.error(key, f"must be a finite number above {above:g}, got {_brief(value)}")
        return float(value)

    def boolean(self, *keys: str, default: bool) -> bool:
        key, value = self.raw(*keys)
        if value is None:
            return default
        if type(value) is not bool:
            raise self.error(key, f"must be true or false, got {_brief(value)}")
        return value

    def string(self, *keys: str, default: str) -> str:
        key, value = self.raw(*keys)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, got {_brief(value)}")
        return value

    def refuse_if(self, key: str, refused: bool, why: str) -> None:
        if refused:
            raise self.error(key, f"is {_brief(self.config.get(key))}: {why}")


# The default of every size as transformers' config class has it (a missing key is this).
DEFAULTS = {
    "bert": {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12,
             "num_attention_heads": 12, "intermediate_size": 3072,
             "max_position_embeddings": 512},
    "gpt2": {"vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
             "n_positions": 1024},
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
              "num_attention_heads": 32, "intermediate_size": 11008,
              "max_position_embeddings": 2048},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                "max_position_embeddings": 4096 * 32, "sliding_window": 4096},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 22016,
              "max_position_embeddings": 32768, "sliding_window": 4096,
              "max_window_layers": 28},
}  # fmt: skip

# Where each family's blocks keep their tensors: "<prefix>h.3.attn..." is block 3.
BLOCK_PATTERNS = {
    "bert": re.compile(r"(?:^|\.)encoder\.layer\.(\d+)\."),
    "gpt2": re.compile(r"(?:^|\.)h\.(\d+)\."),
    "llama": re.compile(r"(?:^|\.)layers\.(\d+)\."),
}
LAYER_TYPES = ("full_attention", "sliding_attention")  # Qwen2's layer_types


def _spec_from_config(
    path: Path, model_type: str, config: dict[str, Any], tensors: dict[str, TensorInfo]
) -> ModelSpec:
    family, name = MODEL_TYPES[model_type]
    fields = _Fields(path / "config.json", config)
    defaults = DEFAULTS[model_type]

    def size(*keys: str, minimum: int = 1) -> int:
        return fields.integer(*keys, default=defaults.get(keys[-1]), minimum=minimum)

    # what most families share; each sets the rest from its own config.json keys
    values: dict[str, Any] = {
        "rope": {},
        "bias": True,
        "output_bias": True,
        "mlp_bias": True,
        "type_vocab_size": 0,
        "causal": family != "bert",
        "upcast_scores": False,
    }
    if family == "bert":
        fields.refuse_if(
            "position_embedding_type",
            fields.string("position_embedding_type", default="absolute") != "absolute",
            "attnctl supports BERT with absolute position embeddings only",
        )
        fields.refuse_if(
            "add_cross_attention",
            fields.boolean("add_cross_attention", default=False),
            "attnctl runs no cross-attention sublayer in a checkpoint's blocks",
        )
        layers_key = "num_hidden_layers"
        heads = size("num_attention_heads")
        values |= {
            "hidden": size("hidden_size"),
            "heads": heads,
            "kv_heads": heads,
            "layers": size(layers_key),
            "vocab_size": size("vocab_size"),
            "intermediate": size("intermediate_size"),
            "max_positions": size("max_position_embeddings"),
            "norm_eps": fields.number("layer_norm_eps", default=1e-12),
            "activation": fields.string("hidden_act", default="gelu"),
            "type_vocab_size": fields.integer("type_vocab_size", default=2),
            "causal": fields.boolean("is_decoder", default=False),  # transformers masks causally
        }
    elif family == "gpt2":
        fields.refuse_if(
            "scale_attn_by_inverse_layer_idx",
            fields.boolean("scale_attn_by_inverse_layer_idx", default=False),
            "attnctl scales every block's scores by 1/sqrt(d_k) alone",
        )
        fields.refuse_if(
            "scale_attn_weights",
            not fields.boolean("scale_attn_weights", default=True),
            "attnctl always scales the scores by 1/sqrt(d_k)",
        )
        fields.refuse_if(
            "add_cross_attention",
            fields.boolean("add_cross_attention", default=False),
            "attnctl runs no cross-attention sublayer in a checkpoint's blocks",
        )
        # transformers' attribute_map: hidden_size, num_attention_heads, ... win over n_*
        layers_key = fields.raw("num_hidden_layers", "n_layer")[0]
        hidden = size("hidden_size", "n_embd")
        heads = size("num_attention_heads", "n_head")
        values |= {
            "hidden": hidden,
            "heads": heads,
            "kv_heads": heads,
            "layers": size("num_hidden_layers", "n_layer"),
            "vocab_size": size("vocab_size"),
            "intermediate": fields.integer("n_inner", default=4 * hidden),
            "max_positions": size("max_position_embeddings", "n_positions"),
            "norm_eps": fields.number("layer_norm_epsilon", default=1e-5),
            "activation": fields.string("activation_function", default="gelu_new"),
            "upcast_scores": fields.boolean("reorder_and_upcast_attn", default=False),
        }
    else:
        layers_key = "num_hidden_layers"
        hidden, heads = size("hidden_size"), size("num_attention_heads")
        if fields.raw("head_dim")[1] is not None:  # unset: hidden_size / heads, as here
            head_dim = fields.integer("head_dim", default=None)
            fields.refuse_if(
                "head_dim",
                head_dim * heads != hidden,
                f"× {heads} heads is not hidden_size {hidden}; attnctl needs head_dim = "
                "hidden_size / num_attention_heads",
            )
        llama = model_type == "llama"  # Mistral and Qwen2 fix their biases in code
        values |= {
            "hidden": hidden,
            "heads": heads,
            "kv_heads": fields.integer(
                "num_key_value_heads", default=defaults.get("num_key_value_heads", heads)
            ),
            "layers": size(layers_key),
            "vocab_size": size("vocab_size"),
            "intermediate": size("intermediate_size"),
            "max_positions": size("max_position_embeddings"),
            "norm_eps": fields.number("rms_norm_eps", default=1e-6),
            "activation": fields.string("hidden_act", default="silu"),
            "bias": fields.boolean("attention_bias", default=False)
            if llama
            else model_type == "qwen2",
            "output_bias": model_type != "qwen2",  # Qwen2 biases W_q, W_k and W_v only
            "mlp_bias": llama and fields.boolean("mlp_bias", default=False),
        }
        values["rope"] = _rope(fields, values["max_positions"])
    if values["activation"] not in ACTIVATIONS:
        key = {"gpt2": "activation_function"}.get(family, "hidden_act")
        raise fields.error(
            key, f"is {_brief(values['activation'])}; attnctl knows " + ", ".join(ACTIVATIONS)
        )
    suffix = EMBEDDING_KEYS[family]
    embedding = next((k for k in tensors if k.endswith(suffix)), None)
    if embedding is None:
        raise AttnctlError(f"the weights in {path} have no {suffix}: not a {name} checkpoint")
    prefix = embedding.removesuffix(suffix)
    # the numbers that size loops and plans, against the real tensors before anything uses them
    stored = tensors[embedding].shape
    if stored != (values["vocab_size"], values["hidden"]):
        raise AttnctlError(
            f"{embedding} has shape {_shape(stored)} but config.json implies "
            f"{_shape((values['vocab_size'], values['hidden']))}"
        )
    pattern = BLOCK_PATTERNS[family]
    present = {
        int(m.group(1)) for k in tensors if k.startswith(prefix) and (m := pattern.search(k))
    }
    if values["layers"] > len(present):
        raise fields.error(
            layers_key, f"is {values['layers']} but the weights hold {len(present)} blocks"
        )
    windows = _layer_windows(fields, model_type, values["layers"])
    dtype = SAFETENSORS_DTYPES.get(tensors[embedding].dtype)
    spec = ModelSpec(
        path=path,
        model_type=model_type,
        family=family,
        dtype=dtype or "float32",
        prefix=prefix,
        layer_windows=windows,
        tensors=tensors,
        **values,
    )
    try:  # in float32: the run's dtype (--dtype) is checked when the run asks for it
        spec.layer_config(dtype="float32")
    except AttnctlError as error:
        raise AttnctlError(f"{path / 'config.json'}: {error.message}") from None
    return spec


def _layer_windows(fields: _Fields, model_type: str, layers: int) -> tuple[int, ...]:
    """Each block's sliding window (0: none), as transformers decides it for the family.

    Mistral: every block has ``sliding_window`` (null: none). Qwen2: none without
    ``use_sliding_window``; with it, ``layer_types`` names each block's kind, and without
    that list the blocks from ``max_window_layers`` on slide.
    """
    if model_type not in ("mistral", "qwen2"):
        return (0,) * layers
    if model_type == "qwen2" and not fields.boolean("use_sliding_window", default=False):
        window = 0  # transformers sets sliding_window to None
    elif "sliding_window" in fields.config and fields.config["sliding_window"] is None:
        window = 0  # sliding_window: null turns the window off
    else:
        window = fields.integer("sliding_window", default=DEFAULTS[model_type]["sliding_window"])
    if model_type == "mistral":  # transformers' Mistral reads no layer_types
        return (window,) * layers
    kinds = fields.config.get("layer_types")
    if kinds is None and not window:  # transformers reads max_window_layers only with one
        return (0,) * layers
    if kinds is None:
        first = fields.integer("max_window_layers", default=28, minimum=0)
        return tuple(window if n >= first else 0 for n in range(layers))
    if not isinstance(kinds, list) or not all(kind in LAYER_TYPES for kind in kinds):
        raise fields.error("layer_types", "must be a list of " + " or ".join(LAYER_TYPES))
    if len(kinds) != layers:
        raise fields.error("layer_types", f"names {len(kinds)} blocks, not {layers}")
    if "sliding_attention" in kinds and not window:
        raise fields.error(
            "layer_types",
            "names sliding_attention blocks but no window is on (use_sliding_window and "
            "sliding_window): transformers cannot build that model",
        )
    return tuple(window if kind == "sliding_attention" else 0 for kind in kinds)


def _rope(fields: _Fields, max_positions: int) -> dict[str, Any]:
    """RoPE's base and scaling as transformers reads them, as LayerConfig's rope_* values.

    transformers takes ``rope_scaling`` whole when it is set (``rope_parameters`` is then
    unread), else ``rope_parameters``; the dict's rope_theta wins over the top-level one.
    """
    config = fields.config
    for key in ("rope_scaling", "rope_parameters"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise fields.error(key, f"must be an object, got {_brief(config[key])}")
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope: dict[str, Any] = config.get(key) or {}
    nested = [k for k, v in rope.items() if isinstance(v, dict)]
    if nested:
        raise fields.error(f"{key}.{nested[0]}", "is a per-layer RoPE; attnctl reads one RoPE")

    def number(name: str, above: float = 0.0, default: float | None = None) -> float:
        if rope.get(name) is None:
            if default is None:
                raise fields.error(key, f"with rope_type {rope_type!r} needs {name}")
            return default
        return fields.check_number(f"{key}.{name}", rope[name], above)

    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if not isinstance(rope_type, str):
        raise fields.error(f"{key}.rope_type", f"must be a string, got {_brief(rope_type)}")
    top_theta = fields.number("rope_theta", default=10000.0, above=1.0)
    values: dict[str, Any] = {"rope_theta": number("rope_theta", 1.0, top_theta)}
    if rope_type == "default":  # transformers' default RoPE reads nothing else
        return values
    if rope_type not in ("linear", "llama3"):
        raise fields.error(
            f"{key}.rope_type",
            f"is {rope_type!r}; attnctl supports RoPE unscaled or with linear or llama3 scaling",
        )
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is not None and partial != 1.0:
        raise fields.error(
            "partial_rotary_factor", f"is {_brief(partial)}: attnctl rotates every dim of a head"
        )
    values |= {"rope_type": rope_type, "rope_factor": number("factor")}
    if rope_type == "llama3":
        # transformers: a top-level original_max_position_embeddings wins, then the dict's,
        # then max_position_embeddings
        if config.get("original_max_position_embeddings") is not None:
            original_key = "original_max_position_embeddings"
            original = config[original_key]
        elif rope.get("original_max_position_embeddings") is not None:
            original_key = f"{key}.original_max_position_embeddings"
            original = rope["original_max_position_embeddings"]
        else:
            original_key, original = "max_position_embeddings", max_positions
        if type(original) is not int or original < 1:
            raise fields.error(original_key, f"must be an integer >= 1, got {_brief(original)}")
        values |= {
            "rope_low_freq_factor": number("low_freq_factor"),
            "rope_high_freq_factor": number("high_freq_factor"),
            "rope_original_max_positions": original,
        }
        if not values["rope_low_freq_factor"] < values["rope_high_freq_factor"]:
            raise fields.error(key, "needs low_freq_factor below high_freq_factor")
    return values


def _check_tensors(spec: ModelSpec) -> None:
    """Every tensor the blocks read is there, in a float dtype, with the configured shape."""
    for name, shape in spec.expected_shapes().items():
        key = spec.weight(name)
        info = spec.tensors.get(key)
        if info is None:
            raise AttnctlError(
                f"the weights in {spec.path} have no {key}, which a {spec.name} with this "
                "config.json needs"
            )
        if info.dtype not in SAFETENSORS_DTYPES:
            raise AttnctlError(
                f"{key} is stored as {info.dtype}; attnctl reads "
                + ", ".join(f"{k} ({v})" for k, v in SAFETENSORS_DTYPES.items())
                + " weights (quantized checkpoints are not supported)"
            )
        if info.shape != shape:
            raise AttnctlError(
                f"{key} has shape {_shape(info.shape)} but config.json implies {_shape(shape)}"
            )


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"
