"""A checkpoint folder read without torch: config.json fields and safetensors headers.

A Hugging Face style folder holds ``config.json``, ``model.safetensors`` (or shards listed
in ``model.safetensors.index.json``) and ``tokenizer.json``. This module reads each
safetensors header (8 bytes of length, then JSON naming every tensor's dtype and shape),
checks every entry against the file, and checks a family's tensor table (key, shape) against
what the headers hold. ``shapes`` and ``memory`` need nothing more, so they answer without
loading a single weight; :func:`load` reads the weights with ``safetensors`` when ``run``
needs them. A pickled ``.bin`` is never opened.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnctl.errors import AttnctlError
from attnctl.model.config import read_json_object, regular_file

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


class Fields:
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


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a family's table: its checkpoint key (without the prefix), the shape
    config.json implies, and where it goes in the model's own layout (``nn/model.py``).

    ``targets``: the layout's names; several split the tensor along dim 0 (after the
    transpose) into ``split`` rows each (GPT-2's fused c_attn is W_q, W_k, W_v).
    ``transposed``: stored as (in, out), the transpose of nn.Linear's (GPT-2's Conv1D).
    ``offset``: a norm whose checkpoint stores its scale minus one (Gemma: ``1 + weight``)
    gets it added in place once loaded, in the run's dtype.
    """

    key: str
    shape: tuple[int, ...]
    block: int  # -1: shared by every block (the embeddings)
    targets: tuple[str, ...]
    transposed: bool = False
    split: tuple[int, ...] = ()
    offset: float = 0.0  # added once loaded: Gemma's norms scale by (1 + weight)
    absolute: bool = False  # its key is not under the prefix (a causal LM's lm_head.weight)

    def stored_key(self, prefix: str) -> str:
        """Its key in the checkpoint's files."""
        return self.key if self.absolute else prefix + self.key


def check_tensors(
    path: Path,
    name: str,
    prefix: str,
    tensors: dict[str, TensorInfo],
    table: tuple[TensorEntry, ...],
) -> None:
    """Every tensor the table names is there, in a float dtype, with the configured shape."""
    for entry in table:
        key = entry.stored_key(prefix)
        info = tensors.get(key)
        if info is None:
            raise AttnctlError(
                f"the weights in {path} have no {key}, which a {name} with this config.json needs"
            )
        if info.dtype not in SAFETENSORS_DTYPES:
            raise AttnctlError(
                f"{key} is stored as {info.dtype}; attnctl reads "
                + ", ".join(f"{k} ({v})" for k, v in SAFETENSORS_DTYPES.items())
                + " weights (quantized checkpoints are not supported)"
            )
        if info.shape != entry.shape:
            raise AttnctlError(
                f"{key} has shape {_shape(info.shape)} but config.json implies "
                f"{_shape(entry.shape)}"
            )


def stored_weights(tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """The checkpoint's float tensors that are weights (not buffers such as masks)."""
    return {
        key: info
        for key, info in tensors.items()
        if info.dtype in SAFETENSORS_DTYPES and not key.endswith(BUFFERS)
    }


def load(
    path: Path,
    prefix: str,
    tensors: dict[str, TensorInfo],
    table: tuple[TensorEntry, ...],
    blocks: int | None,
    device: Any,
    dtype: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read the table's tensors of blocks 0..blocks-1 (None: every weight in the files).

    Returns (as stored, by checkpoint key; by the layout's names, as views of those), so
    the bytes held are exactly the checkpoint's in the run's dtype.
    """
    from safetensors import safe_open

    entries = [e for e in table if blocks is None or e.block < blocks]
    keys = list(dict.fromkeys(e.stored_key(prefix) for e in entries))
    if blocks is None:  # the whole model: what memory counts, read or not
        keys += [k for k in stored_weights(tensors) if k not in set(keys)]
    by_file: dict[str, list[str]] = {}
    for key in keys:
        by_file.setdefault(tensors[key].file, []).append(key)
    stored: dict[str, Any] = {}
    for file, file_keys in by_file.items():
        try:
            with safe_open(str(path / file), framework="pt", device="cpu") as handle:
                for key in file_keys:
                    tensor = handle.get_tensor(tensors[key].stored_as)
                    stored[key] = tensor.to(device=device, dtype=dtype)
        except Exception as error:  # safetensors raises its own error types
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise AttnctlError(f"cannot read {path / file}: {reason}") from error
    return stored, named_views(stored, prefix, entries)


def named_views(
    stored: dict[str, Any], prefix: str, entries: list[TensorEntry] | tuple[TensorEntry, ...]
) -> dict[str, Any]:
    """The stored tensors by the layout's names: transposed and split views of them."""
    named: dict[str, Any] = {}
    for entry in entries:
        tensor = stored[entry.stored_key(prefix)]
        if entry.offset:
            tensor.add_(entry.offset)  # our own copy, read from the file
        if entry.transposed:
            tensor = tensor.t()  # (out, in), as nn.Linear holds it: a view
        if len(entry.targets) == 1 or not entry.split:  # one name, or names of one tensor
            for target in entry.targets:
                named[target] = tensor
        else:  # views, one per target
            for target, part in zip(entry.targets, tensor.split(list(entry.split)), strict=True):
                named[target] = part
    return named


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"
