"""BERT encoders (BertModel, BertForMaskedLM, sentence-transformers' MiniLM, ...).

Learned positions and segment 0's embedding are added to the token embeddings, then a
LayerNorm; each block is post-norm: ``Norm(x + attention(x))``, then
``Norm(x + FFN(x))``. ``is_decoder`` makes the attention causal, as in transformers.
"""

from __future__ import annotations

import re

from attnctl.model.checkpoint import TensorEntry
from attnctl.model.describe import Attention, Block, Embeddings, FeedForward, ModelDescription
from attnctl.model.families.common import (
    Source,
    attention_config,
    check_activation,
    check_block_count,
    description,
    find_prefix,
    stored_dtype,
)

MODEL_TYPES = {"bert": "BERT"}
KIND = "BERT encoders"
EMBEDDING_KEY = "embeddings.word_embeddings.weight"
BLOCK_PATTERN = re.compile(r"(?:^|\.)encoder\.layer\.(\d+)\.")
# transformers' BertConfig defaults: a missing key is this
DEFAULTS = {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12,
            "num_attention_heads": 12, "intermediate_size": 3072,
            "max_position_embeddings": 512}  # fmt: skip


def describe(source: Source) -> ModelDescription:
    fields = source.fields

    def size(key: str) -> int:
        return fields.integer(key, default=DEFAULTS[key])

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
    heads = size("num_attention_heads")
    hidden, layers, vocab = size("hidden_size"), size("num_hidden_layers"), size("vocab_size")
    inner, max_positions = size("intermediate_size"), size("max_position_embeddings")
    eps = fields.number("layer_norm_eps", default=1e-12)
    activation = check_activation(source, "hidden_act", fields.string("hidden_act", default="gelu"))
    segments = fields.integer("type_vocab_size", default=2)
    causal = fields.boolean("is_decoder", default=False)  # transformers masks causally
    prefix = find_prefix(source, EMBEDDING_KEY, vocab, hidden)
    check_block_count(source, BLOCK_PATTERN, prefix, layers, "num_hidden_layers")

    config = attention_config(
        source,
        stored_dtype(source, prefix, EMBEDDING_KEY),
        d_model=hidden,
        heads=heads,
        kv_heads=heads,
        pos="none",  # learned positions are added to the embeddings, before block 0
        max_positions=max_positions,
        mask="causal" if causal else "none",
        norm="post",  # BERT is post-norm, even with is_decoder
        norm_type="layer",
        norm_eps=eps,
    )
    feed_forward = FeedForward(
        inner=inner, activation=activation, placement="post", norm_type="layer", norm_eps=eps
    )
    block = Block((Attention(config), feed_forward))
    embeddings = Embeddings(
        vocab_size=vocab,
        d_model=hidden,
        positions="learned",
        max_positions=max_positions,
        segment=True,
        norm="layer",
        norm_eps=eps,
        trained_by=source.name,
    )
    return description(
        source,
        prefix,
        EMBEDDING_KEY,
        embeddings,
        (block,) * layers,
        _table(hidden, inner, vocab, max_positions, segments, layers),
        max_positions=max_positions,
        intermediate=inner,
        activation=activation,
    )


def _table(
    d: int, i: int, v: int, max_positions: int, segments: int, layers: int
) -> tuple[TensorEntry, ...]:
    """Every tensor the blocks read: checkpoint key, shape, and its name in the layout."""
    table = [
        TensorEntry("embeddings.word_embeddings.weight", (v, d), -1, ("embedding.weight",)),
        TensorEntry(
            "embeddings.position_embeddings.weight", (max_positions, d), -1, ("positions.weight",)
        ),
        TensorEntry(
            "embeddings.token_type_embeddings.weight", (segments, d), -1, ("segment.weight",)
        ),
        TensorEntry("embeddings.LayerNorm.weight", (d,), -1, ("embedding_norm.weight",)),
        TensorEntry("embeddings.LayerNorm.bias", (d,), -1, ("embedding_norm.bias",)),
    ]
    for n in range(layers):
        block, ours = f"encoder.layer.{n}.", f"blocks.{n}."
        for theirs, mine, out, inp in (
            ("attention.self.query", "attention.W_q", d, d),
            ("attention.self.key", "attention.W_k", d, d),
            ("attention.self.value", "attention.W_v", d, d),
            ("attention.output.dense", "attention.W_o", d, d),
            ("intermediate.dense", "feed_forward.up", i, d),
            ("output.dense", "feed_forward.down", d, i),
        ):
            table.append(
                TensorEntry(f"{block}{theirs}.weight", (out, inp), n, (f"{ours}{mine}.weight",))
            )
            table.append(TensorEntry(f"{block}{theirs}.bias", (out,), n, (f"{ours}{mine}.bias",)))
        for theirs, mine in (
            ("attention.output.LayerNorm", "attention.norm"),
            ("output.LayerNorm", "feed_forward.norm"),
        ):
            table.append(TensorEntry(f"{block}{theirs}.weight", (d,), n, (f"{ours}{mine}.weight",)))
            table.append(TensorEntry(f"{block}{theirs}.bias", (d,), n, (f"{ours}{mine}.bias",)))
    return tuple(table)
