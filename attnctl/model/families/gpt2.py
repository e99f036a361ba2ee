"""GPT-2 (GPT2Model, GPT2LMHeadModel).

Learned positions are added to the token embeddings; each block is pre-norm:
``x + attention(LN(x))``, then ``x + FFN(LN(x))``. Conv1D stores every weight as
(in, out), the transpose of nn.Linear's, and c_attn holds W_q, W_k and W_v side by side.
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
    output_head,
    stored_dtype,
)

MODEL_TYPES = {"gpt2": "GPT-2"}
KIND = "GPT-2"
EMBEDDING_KEY = "wte.weight"
BLOCK_PATTERN = re.compile(r"(?:^|\.)h\.(\d+)\.")
DEFAULTS = {"vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024}


def describe(source: Source) -> ModelDescription:
    fields = source.fields

    def size(*keys: str) -> int:
        return fields.integer(*keys, default=DEFAULTS.get(keys[-1]))

    fields.refuse_if(
        "scale_attn_by_inverse_layer_idx",
        fields.boolean("scale_attn_by_inverse_layer_idx", default=False),
        "attnctl scales every block's scores by 1/sqrt(d_k) alone",
    )
    fields.refuse_if(
        "scale_attn_weights",
        not fields.boolean("scale_attn_weights", default=True),
        "attnctl always scales the scores by 1/sqrt(d_k)",
    )
    fields.refuse_if(
        "add_cross_attention",
        fields.boolean("add_cross_attention", default=False),
        "attnctl runs no cross-attention sublayer in a checkpoint's blocks",
    )
    # transformers' attribute_map: hidden_size, num_attention_heads, ... win over n_*
    layers_key = fields.raw("num_hidden_layers", "n_layer")[0]
    hidden = size("hidden_size", "n_embd")
    heads = size("num_attention_heads", "n_head")
    layers = size("num_hidden_layers", "n_layer")
    vocab = size("vocab_size")
    inner = fields.integer("n_inner", default=4 * hidden)
    max_positions = size("max_position_embeddings", "n_positions")
    eps = fields.number("layer_norm_epsilon", default=1e-5)
    activation = check_activation(
        source,
        "activation_function",
        fields.string("activation_function", default="gelu_new"),
    )
    upcast = fields.boolean("reorder_and_upcast_attn", default=False)
    mask = decoder_mask(source)
    prefix = find_prefix(source, EMBEDDING_KEY, vocab, hidden)
    check_block_count(source, BLOCK_PATTERN, prefix, layers, layers_key)

    config = attention_config(
        source,
        stored_dtype(source, prefix, EMBEDDING_KEY),
        d_model=hidden,
        heads=heads,
        kv_heads=heads,
        pos="none",  # learned positions are added to the embeddings, before block 0
        max_positions=max_positions,
        mask=mask,
        norm="pre",
        norm_type="layer",
        norm_eps=eps,
    )
    feed_forward = FeedForward(
        inner=inner, activation=activation, placement="pre", norm_type="layer", norm_eps=eps
    )
    embeddings = Embeddings(
        vocab_size=vocab,
        d_model=hidden,
        positions="learned",
        max_positions=max_positions,
        trained_by=source.name,
    )
    return description(
        source,
        prefix,
        EMBEDDING_KEY,
        embeddings,
        (Block((Attention(config), feed_forward)),) * layers,
        _table(hidden, inner, vocab, max_positions, layers),
        head=output_head(
            source,
            prefix,
            hidden,
            vocab,
            "ln_f",
            Norm("layer", eps),
            tied_default=True,
            norm_bias=True,
        ),
        max_positions=max_positions,
        intermediate=inner,
        activation=activation,
        upcast_scores=upcast,
    )


def _table(d: int, i: int, v: int, max_positions: int, layers: int) -> tuple[TensorEntry, ...]:
    """Every tensor the blocks read: checkpoint key, shape, and its name in the layout."""
    table = [
        TensorEntry("wte.weight", (v, d), -1, ("embedding.weight",)),
        TensorEntry("wpe.weight", (max_positions, d), -1, ("positions.weight",)),
    ]
    for n in range(layers):
        block, ours = f"h.{n}.", f"blocks.{n}."
        for theirs, mine in (("ln_1", "attention.norm"), ("ln_2", "feed_forward.norm")):
            table.append(TensorEntry(f"{block}{theirs}.weight", (d,), n, (f"{ours}{mine}.weight",)))
            table.append(TensorEntry(f"{block}{theirs}.bias", (d,), n, (f"{ours}{mine}.bias",)))
        qkv = tuple(f"{ours}attention.{w}" for w in ("W_q", "W_k", "W_v"))
        table += [
            # Conv1D keeps (in, out); c_attn's output columns are Q, K, V side by side
            TensorEntry(
                f"{block}attn.c_attn.weight",
                (d, 3 * d),
                n,
                tuple(f"{w}.weight" for w in qkv),
                transposed=True,
                split=(d, d, d),
            ),
            TensorEntry(
                f"{block}attn.c_attn.bias",
                (3 * d,),
                n,
                tuple(f"{w}.bias" for w in qkv),
                split=(d, d, d),
            ),
        ]
        for theirs, mine, inp, out in (
            ("attn.c_proj", "attention.W_o", d, d),
            ("mlp.c_fc", "feed_forward.up", d, i),
            ("mlp.c_proj", "feed_forward.down", i, d),
        ):
            table.append(
                TensorEntry(
                    f"{block}{theirs}.weight", (inp, out), n, (f"{ours}{mine}.weight",), True
                )
            )
            table.append(TensorEntry(f"{block}{theirs}.bias", (out,), n, (f"{ours}{mine}.bias",)))
    return tuple(table)
