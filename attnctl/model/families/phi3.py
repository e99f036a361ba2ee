"""Phi-3 (Phi3ForCausalLM: Phi-3-mini, Phi-3-medium, Phi-4-mini).

A Llama-style pre-norm decoder whose projections are fused: ``qkv_proj`` holds W_q, W_k
and W_v one after another (H·d_k, Hkv·d_k and Hkv·d_k rows), ``gate_up_proj`` the gate
then the up projection (I rows each). No biases. ``sliding_window``, when set, applies to
every block.
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
    output_head,
    rope_values,
    stored_dtype,
)

MODEL_TYPES = {"phi3": "Phi-3"}
KIND = "Phi-3"
EMBEDDING_KEY = "embed_tokens.weight"
BLOCK_PATTERN = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# transformers' Phi3Config defaults: a missing key is this
DEFAULTS = {"vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
            "num_hidden_layers": 32, "num_attention_heads": 32,
            "max_position_embeddings": 4096}  # fmt: skip


def describe(source: Source) -> ModelDescription:
    fields = source.fields

    def size(key: str) -> int:
        return fields.integer(key, default=DEFAULTS[key])

    hidden, heads = size("hidden_size"), size("num_attention_heads")
    kv_heads = fields.integer("num_key_value_heads", default=heads)
    head_dim = fields.integer("head_dim", default=hidden // heads)  # Phi-3 reads an extra key
    layers, vocab = size("num_hidden_layers"), size("vocab_size")
    inner, max_positions = size("intermediate_size"), size("max_position_embeddings")
    eps = fields.number("rms_norm_eps", default=1e-5)
    activation = check_activation(source, "hidden_act", fields.string("hidden_act", default="silu"))
    rope = rope_values(source, head_dim, max_positions, "phi3")
    window = 0
    if source.config.get("sliding_window") is not None:  # every block slides
        window = fields.integer("sliding_window", default=None)
    mask = decoder_mask(source, (window,))
    prefix = find_prefix(source, EMBEDDING_KEY, vocab, hidden)
    check_block_count(source, BLOCK_PATTERN, prefix, layers, "num_hidden_layers")

    config = attention_config(
        source,
        stored_dtype(source, prefix, EMBEDDING_KEY),
        d_model=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim if head_dim * heads != hidden else 0,
        bias=False,
        pos="rope",
        **rope,
        max_positions=max_positions,
        mask=mask,
        norm="pre",
        norm_type="rms",
        norm_eps=eps,
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
    block = Block((Attention(dataclasses.replace(config, window=window)), feed_forward))
    return description(
        source,
        prefix,
        EMBEDDING_KEY,
        Embeddings(vocab_size=vocab, d_model=hidden, trained_by=source.name),
        (block,) * layers,
        _table(hidden, inner, vocab, head_dim, heads, kv_heads, layers),
        head=output_head(
            source, prefix, hidden, vocab, "norm", Norm("rms", eps), tied_default=False
        ),
        max_positions=max_positions,
        intermediate=inner,
        activation=activation,
    )


def _table(
    d: int, i: int, v: int, d_k: int, heads: int, kv_heads: int, layers: int
) -> tuple[TensorEntry, ...]:
    """Every tensor the blocks read: checkpoint key, shape, and its name in the layout."""
    q, kv = heads * d_k, kv_heads * d_k
    table = [TensorEntry("embed_tokens.weight", (v, d), -1, ("embedding.weight",))]
    for n in range(layers):
        block, ours = f"layers.{n}.", f"blocks.{n}."
        table += [
            TensorEntry(
                f"{block}input_layernorm.weight", (d,), n, (f"{ours}attention.norm.weight",)
            ),
            TensorEntry(
                f"{block}self_attn.qkv_proj.weight",
                (q + 2 * kv, d),
                n,
                tuple(f"{ours}attention.{w}.weight" for w in ("W_q", "W_k", "W_v")),
                split=(q, kv, kv),
            ),
            TensorEntry(
                f"{block}self_attn.o_proj.weight", (d, q), n, (f"{ours}attention.W_o.weight",)
            ),
            TensorEntry(
                f"{block}post_attention_layernorm.weight",
                (d,),
                n,
                (f"{ours}feed_forward.norm.weight",),
            ),
            TensorEntry(
                f"{block}mlp.gate_up_proj.weight",
                (2 * i, d),
                n,
                (f"{ours}feed_forward.gate.weight", f"{ours}feed_forward.up.weight"),
                split=(i, i),
            ),
            TensorEntry(
                f"{block}mlp.down_proj.weight", (d, i), n, (f"{ours}feed_forward.down.weight",)
            ),
        ]
    return tuple(table)
