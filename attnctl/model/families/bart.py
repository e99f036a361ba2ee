"""BART-style encoder–decoders: BART and MarianMT (opus-mt).

Both are post-norm: each sublayer is ``LayerNorm(x + f(x))``. An encoder block is
self-attention then the feed-forward; a decoder block is causal self-attention, then
cross-attention whose keys and values come from the encoder's output, then the
feed-forward. Neither stack ends with a norm. The LM head is the decoder's token
embedding plus ``final_logits_bias``.

- BART: learned positions whose table starts two rows late (position p reads row p + 2),
  a LayerNorm of the embeddings (``layernorm_embedding``), one token table for both
  stacks and the head.
- Marian: sinusoidal positions that are not stored (sin in the first D/2 columns, cos in
  the second), the embeddings times √D (``scale_embedding``), the decoder starting from
  ``decoder_start_token_id`` (its pad token).
"""

from __future__ import annotations

import re

from attnctl.model.checkpoint import TensorEntry
from attnctl.model.config import LayerConfig
from attnctl.model.describe import (
    CROSS_ATTENTION,
    Attention,
    Block,
    Embeddings,
    FeedForward,
    LMHead,
    ModelDescription,
)
from attnctl.model.families.common import (
    Source,
    Stack,
    attention_config,
    check_activation,
    check_block_count,
    decoder_generation,
    encoder_decoder,
    find_prefix,
    stored_dtype,
)

MODEL_TYPES = {"bart": "BART", "marian": "MarianMT"}
KIND = "BART-style encoder–decoders"
EMBEDDING_KEY = "shared.weight"
ENCODER_BLOCK = re.compile(r"(?:^|\.)encoder\.layers\.(\d+)\.")
DECODER_BLOCK = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.")
# transformers' config classes' defaults: a missing key is this
DEFAULTS = {
    "bart": {"vocab_size": 50265, "d_model": 1024, "encoder_layers": 12, "decoder_layers": 12,
             "encoder_attention_heads": 16, "decoder_attention_heads": 16,
             "encoder_ffn_dim": 4096, "decoder_ffn_dim": 4096, "max_position_embeddings": 1024,
             "activation_function": "gelu", "scale_embedding": False,
             "decoder_start_token_id": 2},
    "marian": {"vocab_size": 58101, "d_model": 1024, "encoder_layers": 12, "decoder_layers": 12,
               "encoder_attention_heads": 16, "decoder_attention_heads": 16,
               "encoder_ffn_dim": 4096, "decoder_ffn_dim": 4096, "max_position_embeddings": 1024,
               "activation_function": "gelu", "scale_embedding": False,
               "decoder_start_token_id": 58100},
}  # fmt: skip
# keys older configs carry that transformers ignores: accepted only with the value that
# says what the math is anyway (any other would be silently ignored there: refused here)
FIXED = {
    "bart": {"normalize_before": False, "add_final_layer_norm": False,
             "layernorm_embedding": True, "normalize_embedding": True},
    "marian": {"normalize_before": False, "add_final_layer_norm": False,
               "normalize_embedding": False, "static_position_embeddings": True,
               "add_bias_logits": False},
}  # fmt: skip
EPS = 1e-5  # every LayerNorm's (nn.LayerNorm's default)


def describe(source: Source) -> ModelDescription:
    fields, model_type = source.fields, source.model_type
    defaults = DEFAULTS[model_type]
    marian = model_type == "marian"

    def size(key: str) -> int:
        return fields.integer(key, default=defaults[key])

    for key, value in FIXED[model_type].items():
        if key in source.config:
            fields.refuse_if(
                key,
                fields.boolean(key, default=value) != value,
                f"transformers' {source.name} ignores it: its math is always {key} {value}",
            )
    hidden, vocab = size("d_model"), size("vocab_size")
    encoder_layers, decoder_layers = size("encoder_layers"), size("decoder_layers")
    encoder_heads = size("encoder_attention_heads")
    decoder_heads = size("decoder_attention_heads")
    encoder_inner, decoder_inner = size("encoder_ffn_dim"), size("decoder_ffn_dim")
    max_positions = size("max_position_embeddings")
    activation = check_activation(
        source,
        "activation_function",
        fields.string("activation_function", default=defaults["activation_function"]),
    )
    scale = hidden**0.5 if fields.boolean("scale_embedding", default=False) else 0.0
    shared = not marian or fields.boolean("share_encoder_decoder_embeddings", default=True)
    decoder_vocab = vocab
    if marian and not shared and source.config.get("decoder_vocab_size") is not None:
        decoder_vocab = fields.integer("decoder_vocab_size", default=vocab)
    tied = fields.boolean("tie_word_embeddings", default=True)
    if marian and hidden % 2:
        raise fields.error("d_model", "is odd: Marian's sinusoidal table needs an even width")
    encoder_key = EMBEDDING_KEY if shared else "encoder.embed_tokens.weight"
    prefix = find_prefix(source, encoder_key, vocab, hidden)
    check_block_count(source, ENCODER_BLOCK, prefix, encoder_layers, "encoder_layers")
    check_block_count(source, DECODER_BLOCK, prefix, decoder_layers, "decoder_layers")
    dtype = stored_dtype(source, prefix, encoder_key)

    def attention(heads: int, mask: str, cross: bool = False) -> LayerConfig:
        return attention_config(
            source,
            dtype,
            d_model=hidden,
            heads=heads,
            kv_heads=heads,
            pos="none",  # positions are added to the embeddings, before block 0
            max_positions=max_positions,
            mask=mask,
            norm="post",
            norm_type="layer",
            norm_eps=EPS,
            cross=cross,
        )

    def feed_forward(inner: int) -> FeedForward:
        return FeedForward(
            inner=inner, activation=activation, placement="post", norm_type="layer", norm_eps=EPS
        )

    def embeddings(rows: int) -> Embeddings:
        return Embeddings(
            vocab_size=rows,
            d_model=hidden,
            positions="sinusoidal_halves" if marian else "learned",
            max_positions=max_positions,
            position_offset=0 if marian else 2,
            norm="none" if marian else "layer",
            norm_eps=EPS,
            scale=scale,
            scale_rounded=False,  # times the Python float √D
            trained_by=source.name,
        )

    encoder_block = Block(
        (Attention(attention(encoder_heads, "none")), feed_forward(encoder_inner))
    )
    decoder_block = Block(
        (
            Attention(attention(decoder_heads, "causal")),
            Attention(
                attention(decoder_heads, "none", cross=True),
                CROSS_ATTENTION,
                name="cross_attention",
            ),
            feed_forward(decoder_inner),
        )
    )
    table = _table(
        hidden, encoder_inner, decoder_inner, vocab, decoder_vocab, max_positions,
        encoder_layers, decoder_layers, marian, shared,
    )  # fmt: skip
    bias = TensorEntry(
        "final_logits_bias", (1, decoder_vocab), -1, ("decoder.lm_head.bias",), absolute=True
    )
    head_table = [bias]
    if not tied:
        head_table.append(
            TensorEntry(
                "lm_head.weight", (decoder_vocab, hidden), -1, ("decoder.lm_head.weight",),
                absolute=True,
            )
        )  # fmt: skip
    rules = decoder_generation(
        source, start_default=defaults["decoder_start_token_id"], vocab=decoder_vocab
    )
    return encoder_decoder(
        source,
        prefix,
        dtype,
        table,
        tuple(head_table),
        Stack(embeddings(vocab), (encoder_block,) * encoder_layers),
        Stack(embeddings(decoder_vocab), (decoder_block,) * decoder_layers),
        LMHead(tied=tied, bias=True),
        rules,
        max_positions=max_positions,
        intermediate=encoder_inner,
        activation=activation,
        decoder_layers=decoder_layers,
    )


def _table(
    d: int,
    encoder_inner: int,
    decoder_inner: int,
    v: int,
    decoder_v: int,
    max_positions: int,
    encoder_layers: int,
    decoder_layers: int,
    marian: bool,
    shared: bool,
) -> tuple[TensorEntry, ...]:
    """Every tensor the two stacks read: checkpoint key, shape, and its name in the layout
    (the decoder's under ``decoder.``)."""
    if shared:  # one table: the encoder's, the decoder's and (tied) the head's
        names = ("embedding.weight", "decoder.embedding.weight")
        table = [TensorEntry("shared.weight", (v, d), -1, names)]
    else:
        table = [
            TensorEntry("encoder.embed_tokens.weight", (v, d), -1, ("embedding.weight",)),
            TensorEntry(
                "decoder.embed_tokens.weight", (decoder_v, d), -1, ("decoder.embedding.weight",)
            ),
        ]
    for stack, ours in (("encoder", ""), ("decoder", "decoder.")):
        if not marian:  # BART: learned positions (2 rows more) and a norm of the embeddings
            table += [
                TensorEntry(
                    f"{stack}.embed_positions.weight", (max_positions + 2, d), -1,
                    (f"{ours}positions.weight",),
                ),
                TensorEntry(f"{stack}.layernorm_embedding.weight", (d,), -1,
                            (f"{ours}embedding_norm.weight",)),
                TensorEntry(f"{stack}.layernorm_embedding.bias", (d,), -1,
                            (f"{ours}embedding_norm.bias",)),
            ]  # fmt: skip
    for n in range(encoder_layers):
        table += _block("encoder", "", n, d, encoder_inner, ("self_attn",))
    for n in range(decoder_layers):
        table += _block("decoder", "decoder.", n, d, decoder_inner, ("self_attn", "encoder_attn"))
    return tuple(table)


def _block(
    stack: str, ours: str, n: int, d: int, inner: int, attentions: tuple[str, ...]
) -> list[TensorEntry]:
    theirs, mine = f"{stack}.layers.{n}.", f"{ours}blocks.{n}."
    names = {"self_attn": "attention", "encoder_attn": "cross_attention"}
    table = []
    for attention in attentions:
        sublayer = names[attention]
        for proj, ours_proj in (("q_proj", "W_q"), ("k_proj", "W_k"), ("v_proj", "W_v"),
                                ("out_proj", "W_o")):  # fmt: skip
            key, target = f"{theirs}{attention}.{proj}", f"{mine}{sublayer}.{ours_proj}"
            table.append(TensorEntry(f"{key}.weight", (d, d), n, (f"{target}.weight",)))
            table.append(TensorEntry(f"{key}.bias", (d,), n, (f"{target}.bias",)))
        norm = f"{theirs}{attention}_layer_norm"
        table.append(TensorEntry(f"{norm}.weight", (d,), n, (f"{mine}{sublayer}.norm.weight",)))
        table.append(TensorEntry(f"{norm}.bias", (d,), n, (f"{mine}{sublayer}.norm.bias",)))
    for proj, ours_proj, out, inp in (("fc1", "up", inner, d), ("fc2", "down", d, inner)):
        target = f"{mine}feed_forward.{ours_proj}"
        table.append(TensorEntry(f"{theirs}{proj}.weight", (out, inp), n, (f"{target}.weight",)))
        table.append(TensorEntry(f"{theirs}{proj}.bias", (out,), n, (f"{target}.bias",)))
    norm = f"{theirs}final_layer_norm"
    table.append(TensorEntry(f"{norm}.weight", (d,), n, (f"{mine}feed_forward.norm.weight",)))
    table.append(TensorEntry(f"{norm}.bias", (d,), n, (f"{mine}feed_forward.norm.bias",)))
    return table
