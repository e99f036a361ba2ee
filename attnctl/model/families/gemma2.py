"""Gemma 2 (Gemma2ForCausalLM).

The token embeddings are scaled by √D; every block wraps each sublayer in two RMSNorms
(``x + Norm'(f(Norm(x)))``), each scaling by ``1 + weight``. The attention's heads have
their own width (``head_dim``), its scores are scaled by ``query_pre_attn_scalar^-½``
and soft-capped (``cap·tanh(s/cap)``), and the even blocks slide over a window.
"""

from __future__ import annotations

import dataclasses
import re

from attnctl.model.checkpoint import TensorEntry
from attnctl.model.describe import Attention, Block, Embeddings, FeedForward, ModelDescription
from attnctl.model.families.common import (
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
    rope_values,
    stored_dtype,
)

MODEL_TYPES = {"gemma2": "Gemma 2"}
KIND = "Gemma 2"
EMBEDDING_KEY = "embed_tokens.weight"
BLOCK_PATTERN = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# transformers' Gemma2Config defaults: a missing key is this
DEFAULTS = {"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
            "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
            "head_dim": 256, "max_position_embeddings": 8192}  # fmt: skip


def describe(source: Source) -> ModelDescription:
    fields = source.fields

    def size(key: str) -> int:
        return fields.integer(key, default=DEFAULTS[key])

    hidden, heads, kv_heads = (
        size("hidden_size"),
        size("num_attention_heads"),
        size("num_key_value_heads"),
    )
    head_dim, layers, vocab = size("head_dim"), size("num_hidden_layers"), size("vocab_size")
    inner, max_positions = size("intermediate_size"), size("max_position_embeddings")
    eps = fields.number("rms_norm_eps", default=1e-6)
    # Gemma 2 reads hidden_activation; a hidden_act beside it is never read
    activation = check_activation(
        source,
        "hidden_activation",
        fields.string("hidden_activation", default="gelu_pytorch_tanh"),
    )
    bias = fields.boolean("attention_bias", default=False)
    scalar = fields.number("query_pre_attn_scalar", default=256.0)
    softcap = 0.0  # null: off
    if source.config.get("attn_logit_softcapping", 50.0) is not None:
        softcap = fields.number("attn_logit_softcapping", default=50.0)
    fields.refuse_if(
        "use_bidirectional_attention",
        fields.boolean("use_bidirectional_attention", default=False),
        "transformers' implementations disagree on it; attnctl runs Gemma 2 causally",
    )
    windows = _layer_windows(source, layers)
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
        query_scale=scalar**-0.5,
        softcap=softcap,
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
        output_norm=True,
    )
    blocks = tuple(
        Block(
            (Attention(dataclasses.replace(config, window=window), output_norm=True), feed_forward)
        )
        for window in windows
    )
    embeddings = Embeddings(
        vocab_size=vocab, d_model=hidden, scale=hidden**0.5, trained_by=source.name
    )
    return description(
        source,
        prefix,
        EMBEDDING_KEY,
        embeddings,
        blocks,
        _table(hidden, inner, vocab, head_dim, heads, kv_heads, layers, bias),
        head=gemma_head(source, prefix, hidden, vocab, eps, softcap_default=30.0),
        max_positions=max_positions,
        intermediate=inner,
        activation=activation,
    )


def _layer_windows(source: Source, layers: int) -> tuple[int, ...]:
    """Each block's window: layer_types, or else every even block slides (Gemma2Config)."""
    kinds = checked_layer_types(source, layers) or [
        "sliding_attention" if (n + 1) % 2 else "full_attention" for n in range(layers)
    ]
    return gemma_windows(source, kinds)


def _table(
    d: int, i: int, v: int, d_k: int, heads: int, kv_heads: int, layers: int, bias: bool
) -> tuple[TensorEntry, ...]:
    """Every tensor the blocks read: checkpoint key, shape, and its name in the layout. The
    norms store their scale minus one: ``offset=1`` makes it ``1 + weight``."""
    q, kv = heads * d_k, kv_heads * d_k
    table = [TensorEntry("embed_tokens.weight", (v, d), -1, ("embedding.weight",))]
    for n in range(layers):
        block, ours = f"layers.{n}.", f"blocks.{n}."
        for theirs, mine in (
            ("input_layernorm", "attention.norm"),
            ("post_attention_layernorm", "attention.post_norm"),
            ("pre_feedforward_layernorm", "feed_forward.norm"),
            ("post_feedforward_layernorm", "feed_forward.post_norm"),
        ):
            table.append(
                TensorEntry(
                    f"{block}{theirs}.weight", (d,), n, (f"{ours}{mine}.weight",), offset=1.0
                )
            )
        for theirs, mine, out, inp, has_bias in (
            ("self_attn.q_proj", "attention.W_q", q, d, bias),
            ("self_attn.k_proj", "attention.W_k", kv, d, bias),
            ("self_attn.v_proj", "attention.W_v", kv, d, bias),
            ("self_attn.o_proj", "attention.W_o", d, q, bias),
            ("mlp.gate_proj", "feed_forward.gate", i, d, False),
            ("mlp.up_proj", "feed_forward.up", i, d, False),
            ("mlp.down_proj", "feed_forward.down", d, i, False),
        ):
            table.append(
                TensorEntry(f"{block}{theirs}.weight", (out, inp), n, (f"{ours}{mine}.weight",))
            )
            if has_bias:
                table.append(
                    TensorEntry(f"{block}{theirs}.bias", (out,), n, (f"{ours}{mine}.bias",))
                )
    return tuple(table)
