"""OLMo 2 (Olmo2ForCausalLM: OLMo-2-1B … 32B).

No norm before a sublayer: each block is ``x + Norm(attention(x))``, then
``x + Norm(SwiGLU(x))``. q and k are RMS-normalised across all heads at once (over H·d_k
and Hkv·d_k) before they are split into heads.
"""

from __future__ import annotations

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
    rope_values,
    stored_dtype,
)

MODEL_TYPES = {"olmo2": "OLMo 2"}
KIND = "OLMo 2"
EMBEDDING_KEY = "embed_tokens.weight"
BLOCK_PATTERN = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# transformers' Olmo2Config defaults: a missing key is this
DEFAULTS = {"vocab_size": 50304, "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32,
            "max_position_embeddings": 2048}  # fmt: skip


def describe(source: Source) -> ModelDescription:
    fields = source.fields

    def size(key: str) -> int:
        return fields.integer(key, default=DEFAULTS[key])

    hidden, heads = size("hidden_size"), size("num_attention_heads")
    kv_heads = fields.integer("num_key_value_heads", default=heads)
    head_dim = fields.integer("head_dim", default=hidden // heads)  # an extra key is read
    layers, vocab = size("num_hidden_layers"), size("vocab_size")
    inner, max_positions = size("intermediate_size"), size("max_position_embeddings")
    eps = fields.number("rms_norm_eps", default=1e-5)
    activation = check_activation(source, "hidden_act", fields.string("hidden_act", default="silu"))
    bias = fields.boolean("attention_bias", default=False)  # q, k, v and o
    mask = decoder_mask(source)
    rope = rope_values(source, head_dim, max_positions)
    prefix = find_prefix(source, EMBEDDING_KEY, vocab, hidden)
    check_block_count(source, BLOCK_PATTERN, prefix, layers, "num_hidden_layers")

    config = attention_config(
        source,
        stored_dtype(source, prefix, EMBEDDING_KEY),
        d_model=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim if head_dim * heads != hidden else 0,
        bias=bias,
        pos="rope",
        max_positions=max_positions,
        mask=mask,
        norm="none",  # no norm before the sublayer; its output is normalised (output_norm)
        norm_type="rms",
        norm_eps=eps,
        qk_norm="all",
        **rope,
    )
    feed_forward = FeedForward(
        inner=inner,
        activation=activation,
        gated=True,
        bias=False,
        placement="none",
        norm_type="rms",
        norm_eps=eps,
        output_norm=True,
    )
    block = Block((Attention(config, output_norm=True), feed_forward))
    table: list[TensorEntry] = [
        TensorEntry("embed_tokens.weight", (vocab, hidden), -1, ("embedding.weight",))
    ]
    for n in range(layers):
        table += [
            norm_entry(n, "self_attn.q_norm", "attention.q_norm", heads * head_dim),
            norm_entry(n, "self_attn.k_norm", "attention.k_norm", kv_heads * head_dim),
            norm_entry(n, "post_attention_layernorm", "attention.post_norm", hidden),
            norm_entry(n, "post_feedforward_layernorm", "feed_forward.post_norm", hidden),
            *projection_table(n, hidden, heads, kv_heads, head_dim, bias, bias, inner),
        ]
    return description(
        source,
        prefix,
        EMBEDDING_KEY,
        Embeddings(vocab_size=vocab, d_model=hidden, trained_by=source.name),
        (block,) * layers,
        tuple(table),
        head=output_head(
            source, prefix, hidden, vocab, "norm", Norm("rms", eps), tied_default=False
        ),
        max_positions=max_positions,
        intermediate=inner,
        activation=activation,
    )
