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
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnctl.config import LayerConfig, read_json_object, validate
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
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu")
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
    sliding_window: int  # Mistral: keys at most this far back; 0 = none
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
        decoder = self.family != "bert"
        values: dict[str, Any] = {
            "tokenizer": str(self.path / "tokenizer.json"),
            "d_model": self.hidden,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "bias": self.bias,
            "output_bias": self.output_bias,
            "pos": "rope" if self.family == "llama" else "none",
            "max_positions": self.max_positions,
            "mask": "causal" if decoder else "none",
            "norm": "pre" if decoder else "post",
            "norm_type": "rms" if self.family == "llama" else "layer",
            "norm_eps": self.norm_eps,
            **self.rope,
            "dtype": self.dtype,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
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
        raise AttnctlError(f"model folder not found: {directory}")
    config = _read_config(path)
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        found = f"model_type {model_type!r}" if model_type else "no model_type"
        raise AttnctlError(f"{path / 'config.json'} has {found}; attnctl supports {SUPPORTED}")
    tensors = read_tensor_headers(path)
    spec = _spec_from_config(path, model_type, config, tensors)
    _check_tensors(spec)
    return spec


def _read_config(path: Path) -> dict[str, Any]:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise AttnctlError(f"no config.json in {path}: attnctl reads Hugging Face style folders")
    return read_json_object(config_path, "model config")


def read_tensor_headers(path: Path) -> dict[str, TensorInfo]:
    """Every tensor's dtype and shape, from model.safetensors or the shards an index names."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        files = [single.name]
    elif index.is_file():
        weight_map = read_json_object(index, "shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise AttnctlError(f"malformed shard index {index}: no weight_map")
        files = sorted(set(map(str, weight_map.values())))
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


def _modern_name(key: str) -> str:
    """Checkpoints converted from TensorFlow call LayerNorm's weight gamma, its bias beta."""
    for old, new in ((".gamma", ".weight"), (".beta", ".bias")):
        if key.endswith(old) and "LayerNorm" in key:
            return key.removesuffix(old) + new
    return key


def _read_header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A safetensors header: 8 bytes little-endian length, then JSON {name: {dtype, shape}}."""
    try:
        with file.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if not 2 <= size <= MAX_HEADER:
                raise ValueError(f"header length {size} is not plausible")
            header = json.loads(handle.read(size))
        header.pop("__metadata__", None)
        return {k: (v["dtype"], tuple(int(n) for n in v["shape"])) for k, v in header.items()}
    except FileNotFoundError:
        raise AttnctlError(f"missing weights file {file}") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise AttnctlError(f"malformed safetensors file {file}: {error}") from error


def _spec_from_config(
    path: Path, model_type: str, config: dict[str, Any], tensors: dict[str, TensorInfo]
) -> ModelSpec:
    family, name = MODEL_TYPES[model_type]

    def get(*keys: str, default: Any = None, kind: type = int) -> Any:
        for key in keys:
            if config.get(key) is not None:
                value = config[key]
                if kind is float and type(value) is int:
                    value = float(value)
                if type(value) is not kind:
                    raise AttnctlError(
                        f"{path / 'config.json'}: {key} must be {kind.__name__}, got {value!r}"
                    )
                return value
        if default is None:
            raise AttnctlError(f"{path / 'config.json'} has no {keys[0]}")
        return default

    # what most families share; each sets the rest from its own config.json keys
    values: dict[str, Any] = {
        "rope": {},
        "bias": True,
        "output_bias": True,
        "mlp_bias": True,
        "type_vocab_size": 0,
        "sliding_window": 0,
    }
    if family == "bert":
        if get("position_embedding_type", default="absolute", kind=str) != "absolute":
            raise AttnctlError("attnctl supports BERT with absolute position embeddings only")
        heads = get("num_attention_heads")
        values |= {
            "hidden": get("hidden_size"),
            "heads": heads,
            "kv_heads": heads,
            "layers": get("num_hidden_layers"),
            "vocab_size": get("vocab_size"),
            "intermediate": get("intermediate_size"),
            "max_positions": get("max_position_embeddings"),
            "norm_eps": get("layer_norm_eps", default=1e-12, kind=float),
            "activation": get("hidden_act", default="gelu", kind=str),
            "type_vocab_size": get("type_vocab_size", default=2),
        }
    elif family == "gpt2":
        if get("scale_attn_by_inverse_layer_idx", default=False, kind=bool):
            raise AttnctlError("attnctl does not support scale_attn_by_inverse_layer_idx")
        if not get("scale_attn_weights", default=True, kind=bool):
            raise AttnctlError("attnctl supports GPT-2 with scale_attn_weights only")
        hidden, heads = get("n_embd"), get("n_head")
        values |= {
            "hidden": hidden,
            "heads": heads,
            "kv_heads": heads,
            "layers": get("n_layer"),
            "vocab_size": get("vocab_size"),
            "intermediate": get("n_inner", default=4 * hidden),
            "max_positions": get("n_positions"),
            "norm_eps": get("layer_norm_epsilon", default=1e-5, kind=float),
            "activation": get("activation_function", default="gelu_new", kind=str),
        }
    else:
        hidden, heads = get("hidden_size"), get("num_attention_heads")
        qwen = model_type == "qwen2"
        # Mistral's window is always on; Qwen2's only with use_sliding_window
        windowed = model_type == "mistral" or (
            qwen and get("use_sliding_window", default=False, kind=bool)
        )
        head_dim = config.get("head_dim")
        if head_dim is not None and head_dim * heads != hidden:
            raise AttnctlError(
                f"head_dim {head_dim} × {heads} heads is not hidden_size {hidden}; attnctl "
                "needs head_dim = hidden_size / num_attention_heads"
            )
        values |= {
            "hidden": hidden,
            "heads": heads,
            "kv_heads": get("num_key_value_heads", default=heads),
            "layers": get("num_hidden_layers"),
            "vocab_size": get("vocab_size"),
            "intermediate": get("intermediate_size"),
            "max_positions": get("max_position_embeddings", default=2048),
            "norm_eps": get("rms_norm_eps", default=1e-6, kind=float),
            "rope": _rope(path, config),
            "activation": get("hidden_act", default="silu", kind=str),
            "bias": qwen or get("attention_bias", default=False, kind=bool),
            "output_bias": not qwen,  # Qwen2 biases W_q, W_k and W_v only
            "mlp_bias": get("mlp_bias", default=False, kind=bool),
            "sliding_window": get("sliding_window", default=0) if windowed else 0,
        }
    for key in ("hidden", "heads", "kv_heads", "layers", "vocab_size", "intermediate"):
        if values[key] <= 0:
            raise AttnctlError(f"{path / 'config.json'}: {key} must be positive")
    if values["activation"] not in ACTIVATIONS:
        raise AttnctlError(
            f"unsupported activation {values['activation']!r}; attnctl knows "
            + ", ".join(ACTIVATIONS)
        )
    suffix = EMBEDDING_KEYS[family]
    embedding = next((k for k in tensors if k.endswith(suffix)), None)
    if embedding is None:
        raise AttnctlError(f"the weights in {path} have no {suffix}: not a {name} checkpoint")
    dtype = SAFETENSORS_DTYPES.get(tensors[embedding].dtype)
    spec = ModelSpec(
        path=path,
        model_type=model_type,
        family=family,
        dtype=dtype or "float32",
        prefix=embedding.removesuffix(suffix),
        tensors=tensors,
        **values,
    )
    try:
        spec.layer_config()
    except AttnctlError as error:
        raise AttnctlError(f"{path / 'config.json'}: {error.message}") from None
    return spec


def _rope(path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """RoPE's base and scaling from rope_parameters (transformers 5) or rope_theta and
    rope_scaling (earlier), as LayerConfig's rope_* values."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    try:
        values: dict[str, Any] = {
            "rope_theta": float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        }
        if rope_type == "linear":
            values |= {"rope_type": "linear", "rope_factor": float(rope["factor"])}
        elif rope_type == "llama3":
            values |= {
                "rope_type": "llama3",
                "rope_factor": float(rope["factor"]),
                "rope_low_freq_factor": float(rope.get("low_freq_factor", 1.0)),
                "rope_high_freq_factor": float(rope.get("high_freq_factor", 4.0)),
                "rope_original_max_positions": int(rope["original_max_position_embeddings"]),
            }
        elif rope_type != "default":
            raise AttnctlError(
                f"attnctl supports RoPE unscaled or with linear or llama3 scaling, not "
                f"rope_type {rope_type!r}"
            )
    except (KeyError, TypeError, ValueError) as error:
        raise AttnctlError(f"{path / 'config.json'}: malformed RoPE settings ({error})") from None
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
