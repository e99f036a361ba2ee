"""What every family module does with a checkpoint folder: find the prefix, check the
embedding's shape and the block count against the headers, build the description.

A family module reads its config.json keys (with :class:`~attnctl.checkpoint.Fields`,
which checks each by type and range) and calls these in the order it needs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnctl.checkpoint import SAFETENSORS_DTYPES, Fields, TensorEntry, TensorInfo, _shape
from attnctl.config import LayerConfig
from attnctl.describe import Block, Checkpoint, Embeddings, ModelDescription
from attnctl.errors import AttnctlError

ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "swish")


@dataclass(frozen=True)
class Source:
    """A checkpoint folder as a family module receives it."""

    path: Path
    model_type: str
    name: str  # as people say it: "Mistral"
    family: str  # the module's name
    fields: Fields  # config.json
    tensors: dict[str, TensorInfo]  # every tensor's header

    @property
    def config(self) -> dict[str, Any]:
        return self.fields.config


def check_activation(source: Source, key: str, activation: str) -> str:
    if activation not in ACTIVATIONS:
        raise source.fields.error(
            key, f"is {activation!r}; attnctl knows " + ", ".join(ACTIVATIONS)
        )
    return activation


def decoder_mask(source: Source, windows: tuple[int, ...] = ()) -> str:
    """ "causal", or "none" where config.json says ``is_causal: false``: transformers' mask
    functions read that key for every decoder family and then let each token see all."""
    fields = source.fields
    if fields.boolean("is_causal", default=True):
        return "causal"
    fields.refuse_if(
        "is_causal",
        any(windows),
        "with a sliding window: attnctl runs sliding windows causally only",
    )
    return "none"


def find_prefix(source: Source, embedding_key: str, vocab_size: int, hidden: int) -> str:
    """The prefix of every key ("bert.", "transformer.", "model." or ""), from where the
    token embedding is, once its shape is the config's."""
    embedding = next((k for k in source.tensors if k.endswith(embedding_key)), None)
    if embedding is None:
        raise AttnctlError(
            f"the weights in {source.path} have no {embedding_key}: not a {source.name} checkpoint"
        )
    # the numbers that size loops and plans, against the real tensors before anything uses them
    stored = source.tensors[embedding].shape
    if stored != (vocab_size, hidden):
        raise AttnctlError(
            f"{embedding} has shape {_shape(stored)} but config.json implies "
            f"{_shape((vocab_size, hidden))}"
        )
    return embedding.removesuffix(embedding_key)


def check_block_count(
    source: Source, pattern: re.Pattern[str], prefix: str, layers: int, layers_key: str
) -> None:
    """config.json's layer count is at most the blocks the headers hold (before any loop)."""
    present = {
        int(m.group(1)) for k in source.tensors if k.startswith(prefix) and (m := pattern.search(k))
    }
    if layers > len(present):
        raise source.fields.error(
            layers_key, f"is {layers} but the weights hold {len(present)} blocks"
        )


def stored_dtype(source: Source, prefix: str, embedding_key: str) -> str:
    return SAFETENSORS_DTYPES.get(source.tensors[prefix + embedding_key].dtype) or "float32"


def description(
    source: Source,
    prefix: str,
    embedding_key: str,
    embeddings: Embeddings,
    blocks: tuple[Block, ...],
    table: tuple[TensorEntry, ...],
    **facts: Any,
) -> ModelDescription:
    """The model, with where it came from; ``facts``: what the reports say of it
    (max_positions, intermediate, activation, ...)."""
    checkpoint = Checkpoint(
        path=source.path,
        model_type=source.model_type,
        name=source.name,
        family=source.family,
        prefix=prefix,
        dtype=stored_dtype(source, prefix, embedding_key),
        tensors=source.tensors,
        table=table,
        facts=facts,
    )
    return ModelDescription(embeddings, blocks, checkpoint)


def attention_config(source: Source, dtype: str, **values: Any) -> LayerConfig:
    """A block's attention as a LayerConfig (the run's dtype and kernel come later)."""
    return LayerConfig(tokenizer=str(source.path / "tokenizer.json"), dtype=dtype, **values)
