"""Llama-style decoders: Llama, Mistral (a sliding window) and Qwen2 (biased W_q, W_k, W_v).

No positions before the blocks: RoPE turns Q and K in every block. Each block is
pre-norm with RMSNorm: ``x + attention(RMS(x))``, then ``x + SwiGLU(RMS(x))``, where
``SwiGLU(h) = down(silu(gate(h)) * up(h))``. K and V may have fewer heads (GQA).
"""

from __future__ import annotations

import dataclasses
import re

from attnctl.model.checkpoint import Fields, TensorEntry
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

MODEL_TYPES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
KIND = "Llama-style decoders"
EMBEDDING_KEY = "embed_tokens.weight"
BLOCK_PATTERN = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# The default of every size as transformers' config class has it (a missing key is this).
DEFAULTS = {
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
LAYER_TYPES = ("full_attention", "sliding_attention")  # Qwen2's layer_types


def describe(source: Source) -> ModelDescription:
    fields, model_type = source.fields, source.model_type
    defaults = DEFAULTS[model_type]

    def size(key: str) -> int:
        return fields.integer(key, default=defaults.get(key))

    hidden, heads = size("hidden_size"), size("num_attention_heads")
    head_dim = fields.integer("head_dim", default=hidden // heads)  # transformers reads it
    llama = model_type == "llama"  # Mistral and Qwen2 fix their biases in code
    kv_heads = fields.integer(
        "num_key_value_heads", default=defaults.get("num_key_value_heads", heads)
    )
    layers, vocab = size("num_hidden_layers"), size("vocab_size")
    inner, max_positions = size("intermediate_size"), size("max_position_embeddings")
    eps = fields.number("rms_norm_eps", default=1e-6)
    activation = fields.string("hidden_act", default="silu")
    bias = fields.boolean("attention_bias", default=False) if llama else model_type == "qwen2"
    output_bias = model_type != "qwen2"  # Qwen2 biases W_q, W_k and W_v only
    mlp_bias = llama and fields.boolean("mlp_bias", default=False)
    rope = rope_values(source, head_dim, max_positions)
    check_activation(source, "hidden_act", activation)
    prefix = find_prefix(source, EMBEDDING_KEY, vocab, hidden)
    check_block_count(source, BLOCK_PATTERN, prefix, layers, "num_hidden_layers")
    windows = _layer_windows(fields, model_type, layers)
    mask = decoder_mask(source, windows)

    config = attention_config(
        source,
        stored_dtype(source, prefix, EMBEDDING_KEY),
        d_model=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim if head_dim * heads != hidden else 0,
        bias=bias,
        output_bias=output_bias,
        pos="rope",
        max_positions=max_positions,
        mask=mask,
        norm="pre",
        norm_type="rms",
        norm_eps=eps,
        **rope,
    )
    feed_forward = FeedForward(
        inner=inner,
        activation=activation,
        gated=True,
        bias=mlp_bias,
        placement="pre",
        norm_type="rms",
        norm_eps=eps,
    )
    blocks = tuple(
        Block((Attention(dataclasses.replace(config, window=w)), feed_forward)) for w in windows
    )
    embeddings = Embeddings(vocab_size=vocab, d_model=hidden, trained_by=source.name)
    return description(
        source,
        prefix,
        EMBEDDING_KEY,
        embeddings,
        blocks,
        _table(
            hidden, inner, vocab, heads, kv_heads, head_dim, layers, bias, output_bias, mlp_bias
        ),
        head=output_head(
            source, prefix, hidden, vocab, "norm", Norm("rms", eps), tied_default=False
        ),
        max_positions=max_positions,
        intermediate=inner,
        activation=activation,
    )


def _table(
    d: int,
    i: int,
    v: int,
    heads: int,
    kv_heads: int,
    d_k: int,
    layers: int,
    bias: bool,
    output_bias: bool,
    mlp_bias: bool,
) -> tuple[TensorEntry, ...]:
    """Every tensor the blocks read: checkpoint key, shape, and its name in the layout."""
    table = [TensorEntry("embed_tokens.weight", (v, d), -1, ("embedding.weight",))]
    for n in range(layers):
        table += [
            norm_entry(n, "input_layernorm", "attention.norm", d),
            norm_entry(n, "post_attention_layernorm", "feed_forward.norm", d),
            *projection_table(n, d, heads, kv_heads, d_k, bias, output_bias, i, mlp_bias),
        ]
    return tuple(table)


def _layer_windows(fields: Fields, model_type: str, layers: int) -> tuple[int, ...]:
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
