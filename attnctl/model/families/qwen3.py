"""Qwen3 dense decoders (Qwen3ForCausalLM: Qwen3-0.6B … 32B).

A Llama-style pre-norm decoder whose heads have their own width (``head_dim``, 128 when
the key is absent, not hidden/heads) and whose q and k are RMS-normalised per head, over
d_k, before RoPE. Qwen's sliding-window keys decide which blocks slide.
"""

from __future__ import annotations

import dataclasses
import re

from attnctl.model.checkpoint import TensorEntry
from attnctl.model.describe import Attention, Block, Embeddings, FeedForward, ModelDescription, Norm
from attnctl.model.families.common import (
    Source,
    attention_config,
    check_activation,
    check_block_count,
    decoder_mask,
    description,
    find_prefix,
    norm_entry,
    output_head,
    projection_table,
    qwen_layer_windows,
    rope_values,
    stored_dtype,
)

MODEL_TYPES = {"qwen3": "Qwen3"}
KIND = "Qwen3"
EMBEDDING_KEY = "embed_tokens.weight"
BLOCK_PATTERN = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# transformers' Qwen3Config defaults: a missing key is this
DEFAULTS = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
            "num_hidden_layers": 32, "num_attention_heads": 32, "head_dim": 128,
            "max_position_embeddings": 32768}  # fmt: skip


def describe(source: Source) -> ModelDescription:
    fields = source.fields

    def size(key: str) -> int:
        return fields.integer(key, default=DEFAULTS[key])

    hidden, heads, head_dim = size("hidden_size"), size("num_attention_heads"), size("head_dim")
    kv_heads = fields.integer("num_key_value_heads", default=heads)
    layers, vocab = size("num_hidden_layers"), size("vocab_size")
    inner, max_positions = size("intermediate_size"), size("max_position_embeddings")
    eps = fields.number("rms_norm_eps", default=1e-6)
    activation = check_activation(source, "hidden_act", fields.string("hidden_act", default="silu"))
    bias = fields.boolean("attention_bias", default=False)  # q, k, v and o
    windows = qwen_layer_windows(source, layers)
    mask = decoder_mask(source, windows)
    rope = rope_values(source, head_dim, max_positions)
    prefix = find_prefix(source, EMBEDDING_KEY, vocab, hidden)
    check_block_count(source, BLOCK_PATTERN, prefix, layers, "num_hidden_layers")

    config = attention_config(
        source,
        stored_dtype(source, prefix, EMBEDDING_KEY),
        d_model=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        bias=bias,
        pos="rope",
        max_positions=max_positions,
        mask=mask,
        norm="pre",
        norm_type="rms",
        norm_eps=eps,
        qk_norm="head",
        **rope,
    )
    feed_forward = FeedForward(
        inner=inner,
        activation=activation,
        gated=True,
        bias=False,
        placement="pre",
        norm_type="rms",
        norm_eps=eps,
    )
    blocks = tuple(
        Block((Attention(dataclasses.replace(config, window=w)), feed_forward)) for w in windows
    )
    table: list[TensorEntry] = [
        TensorEntry("embed_tokens.weight", (vocab, hidden), -1, ("embedding.weight",))
    ]
    for n in range(layers):
        table += [
            norm_entry(n, "input_layernorm", "attention.norm", hidden),
            norm_entry(n, "self_attn.q_norm", "attention.q_norm", head_dim),
            norm_entry(n, "self_attn.k_norm", "attention.k_norm", head_dim),
            norm_entry(n, "post_attention_layernorm", "feed_forward.norm", hidden),
            *projection_table(n, hidden, heads, kv_heads, head_dim, bias, bias, inner),
        ]
    return description(
        source,
        prefix,
        EMBEDDING_KEY,
        Embeddings(vocab_size=vocab, d_model=hidden, trained_by=source.name),
        blocks,
        tuple(table),
        head=output_head(
            source, prefix, hidden, vocab, "norm", Norm("rms", eps), tied_default=False
        ),
        max_positions=max_positions,
        intermediate=inner,
        activation=activation,
    )
