"""Gemma 3 text models (Gemma3ForCausalLM, model_type gemma3_text: Gemma-3-1B and the text
blocks of the larger ones).

As Gemma 2 (√D embeddings, four ``1 + weight`` RMSNorms a block, ``head_dim``,
``query_pre_attn_scalar``), but no soft-capping: q and k are RMS-normalised per head before
RoPE instead. Blocks slide except every ``sliding_window_pattern``-th, and each kind of
block has its own RoPE (a local base for the sliding ones, scaling for the global ones).
"""

from __future__ import annotations

import dataclasses
import re

from attnctl.model.checkpoint import TensorEntry
from attnctl.model.describe import Attention, Block, Embeddings, FeedForward, ModelDescription
from attnctl.model.families.common import (
    LAYER_TYPES,
    Source,
    attention_config,
    check_activation,
    check_block_count,
    checked_layer_types,
    decoder_mask,
    description,
    find_prefix,
    gemma_head,
    gemma_windows,
    norm_entry,
    rope_values,
    stored_dtype,
)
from attnctl.model.families.gemma2 import _table as gemma2_table

MODEL_TYPES = {"gemma3_text": "Gemma 3"}
KIND = "Gemma 3 text"
EMBEDDING_KEY = "embed_tokens.weight"
BLOCK_PATTERN = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# transformers' Gemma3TextConfig defaults: a missing key is this
DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
            "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
            "head_dim": 256, "max_position_embeddings": 131072}  # fmt: skip


def describe(source: Source) -> ModelDescription:
    fields = source.fields

    def size(key: str) -> int:
        return fields.integer(key, default=DEFAULTS[key])

    hidden, heads = size("hidden_size"), size("num_attention_heads")
    kv_heads, head_dim = size("num_key_value_heads"), size("head_dim")
    layers, vocab = size("num_hidden_layers"), size("vocab_size")
    inner, max_positions = size("intermediate_size"), size("max_position_embeddings")
    eps = fields.number("rms_norm_eps", default=1e-6)
    activation = check_activation(
        source,
        "hidden_activation",
        fields.string("hidden_activation", default="gelu_pytorch_tanh"),
    )
    bias = fields.boolean("attention_bias", default=False)
    scalar = fields.number("query_pre_attn_scalar", default=256.0)
    fields.refuse_if(
        "attn_logit_softcapping",
        source.config.get("attn_logit_softcapping") is not None,
        "transformers' Gemma 3 never applies it, so no value of it can be shown honestly",
    )
    fields.refuse_if(
        "use_bidirectional_attention",
        fields.boolean("use_bidirectional_attention", default=False),
        "attnctl runs Gemma 3 causally",
    )
    kinds = checked_layer_types(source, layers)
    if kinds is None:  # every sliding_window_pattern-th block (6th) is global
        pattern = fields.integer("sliding_window_pattern", default=6)
        kinds = [
            "sliding_attention" if (n + 1) % pattern else "full_attention" for n in range(layers)
        ]
    windows = gemma_windows(source, kinds)
    window = max(windows)  # the sliding blocks' (0 when none slides)
    mask = decoder_mask(source, windows)
    prefix = find_prefix(source, EMBEDDING_KEY, vocab, hidden)
    check_block_count(source, BLOCK_PATTERN, prefix, layers, "num_hidden_layers")

    dtype = stored_dtype(source, prefix, EMBEDDING_KEY)
    attention = {}  # one attention a kind of block: each has its own RoPE
    for kind in LAYER_TYPES:
        rope = rope_values(source, head_dim, max_positions, "gemma3", layer_type=kind)
        config = attention_config(
            source,
            dtype,
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
            query_scale=scalar**-0.5,
            **rope,
        )
        if kind == "sliding_attention":
            config = dataclasses.replace(config, window=window)
        attention[kind] = Attention(config, output_norm=True)
    feed_forward = FeedForward(
        inner=inner,
        activation=activation,
        gated=True,
        bias=False,
        placement="pre",
        norm_type="rms",
        norm_eps=eps,
        output_norm=True,
    )
    blocks = tuple(Block((attention[kind], feed_forward)) for kind in kinds)
    table: list[TensorEntry] = list(
        gemma2_table(hidden, inner, vocab, head_dim, heads, kv_heads, layers, bias)
    )
    for n in range(layers):  # and each block's q/k norms, (1 + weight) too
        table += [
            norm_entry(n, "self_attn.q_norm", "attention.q_norm", head_dim, offset=1.0),
            norm_entry(n, "self_attn.k_norm", "attention.k_norm", head_dim, offset=1.0),
        ]
    embeddings = Embeddings(
        vocab_size=vocab, d_model=hidden, scale=hidden**0.5, trained_by=source.name
    )
    return description(
        source,
        prefix,
        EMBEDDING_KEY,
        embeddings,
        blocks,
        tuple(table),
        head=gemma_head(source, prefix, hidden, vocab, eps, softcap_default=0.0),
        max_positions=max_positions,
        intermediate=inner,
        activation=activation,
    )
