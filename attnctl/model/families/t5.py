"""T5 encoder–decoders: T5 v1 (ReLU) and v1.1 / flan-t5 (gated GELU).

No positions are added to the embeddings: block 0's self-attention of each stack holds a
table of learned biases by bucketed distance (bidirectional in the encoder, causal in the
decoder); it computes the (H, L, Lk) bias once and every later block of its stack adds
the same one. The scores are not divided by √d (``q·kᵀ + bias``). Every block is
pre-norm with T5's RMS-only LayerNorm; each stack ends with one (``final_layer_norm``).
Cross-attention has no position bias. Nothing has a bias.

The head: ``lm_head.weight`` where the file holds one (v1.1), else the shared token
table; the decoder's output times D^-0.5 first when ``scale_decoder_outputs`` (or,
without that key, ``tie_word_embeddings`` not false) says so, as transformers 5 reads it.
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
    Norm,
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

MODEL_TYPES = {"t5": "T5"}
KIND = "T5 encoder–decoders"
EMBEDDING_KEY = "shared.weight"
ENCODER_BLOCK = re.compile(r"(?:^|\.)encoder\.block\.(\d+)\.")
DECODER_BLOCK = re.compile(r"(?:^|\.)decoder\.block\.(\d+)\.")
# T5Config's defaults: a missing key is this
DEFAULTS = {"vocab_size": 32128, "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6,
            "num_heads": 8, "relative_attention_num_buckets": 32,
            "relative_attention_max_distance": 128}  # fmt: skip
PROJECTIONS = ("q", "k", "v", "o")


def describe(source: Source) -> ModelDescription:
    fields = source.fields

    def size(key: str) -> int:
        return fields.integer(key, default=DEFAULTS[key])

    hidden, vocab, head_dim, inner = size("d_model"), size("vocab_size"), size("d_kv"), size("d_ff")
    heads, encoder_layers = size("num_heads"), size("num_layers")
    decoder_layers = encoder_layers
    if source.config.get("num_decoder_layers") is not None:
        decoder_layers = fields.integer("num_decoder_layers", default=encoder_layers)
    buckets = size("relative_attention_num_buckets")
    distance = size("relative_attention_max_distance")
    fields.refuse_if(
        "relative_attention_num_buckets", buckets < 4, "must be at least 4 (two exact buckets)"
    )
    fields.refuse_if(
        "relative_attention_max_distance",
        distance * 2 <= buckets,
        "must be above half the buckets: farther distances share buckets on a log scale",
    )
    eps = fields.number("layer_norm_epsilon", default=1e-6)
    gated, activation = _feed_forward_kind(source)
    prefix = find_prefix(source, EMBEDDING_KEY, vocab, hidden)
    check_block_count(source, ENCODER_BLOCK, prefix, encoder_layers, "num_layers")
    check_block_count(source, DECODER_BLOCK, prefix, decoder_layers, "num_decoder_layers")
    dtype = stored_dtype(source, prefix, EMBEDDING_KEY)
    separate_head = "lm_head.weight" in source.tensors
    if "scale_decoder_outputs" in source.config:
        scaled = fields.boolean("scale_decoder_outputs", default=True)
    else:
        scaled = source.config.get("tie_word_embeddings", True) is not False

    def attention(mask: str, pos: str = "relative", cross: bool = False) -> LayerConfig:
        return attention_config(
            source,
            dtype,
            d_model=hidden,
            heads=heads,
            kv_heads=heads,
            head_dim=head_dim if head_dim * heads != hidden else 0,
            bias=False,
            output_bias=False,
            pos=pos,
            mask=mask,
            norm="pre",
            norm_type="rms",
            norm_eps=eps,
            query_scale=1.0,  # T5 does not scale the scores
            relative_buckets=buckets,
            relative_distance=distance,
            cross=cross,
        )

    feed_forward = FeedForward(
        inner=inner,
        activation=activation,
        gated=gated,
        bias=False,
        placement="pre",
        norm_type="rms",
        norm_eps=eps,
    )
    encoder_attention, decoder_attention = attention("none"), attention("causal")
    cross = Attention(
        attention("none", pos="none", cross=True), CROSS_ATTENTION, name="cross_attention"
    )

    def encoder_block(n: int) -> Block:
        return Block((Attention(encoder_attention, computes_bias=n == 0), feed_forward))

    def decoder_block(n: int) -> Block:
        return Block((Attention(decoder_attention, computes_bias=n == 0), cross, feed_forward))

    embeddings = Embeddings(vocab_size=vocab, d_model=hidden, trained_by=source.name)
    norm = Norm("rms", eps)
    head_table = ()
    if separate_head:
        head_table = (
            TensorEntry(
                "lm_head.weight", (vocab, hidden), -1, ("decoder.lm_head.weight",), absolute=True
            ),
        )
    rules = decoder_generation(source, vocab=vocab)
    table = _table(
        hidden, heads * head_dim, inner, vocab, heads, buckets, encoder_layers, decoder_layers,
        gated,
    )  # fmt: skip
    return encoder_decoder(
        source,
        prefix,
        dtype,
        table,
        head_table,
        Stack(embeddings, tuple(encoder_block(n) for n in range(encoder_layers)), norm),
        Stack(embeddings, tuple(decoder_block(n) for n in range(decoder_layers)), norm),
        LMHead(tied=not separate_head, scale=hidden**-0.5 if scaled else 0.0),
        rules,
        max_positions=0,  # relative positions: no limit
        intermediate=inner,
        activation=("gated " if gated else "") + activation,
        decoder_layers=decoder_layers,
    )


def _feed_forward_kind(source: Source) -> tuple[bool, str]:
    """(gated, activation) as T5Config derives them from ``feed_forward_proj`` ("relu",
    "gated-gelu", ...; gated-gelu's is the tanh GELU), unless ``is_gated_act`` and
    ``dense_act_fn`` are in config.json: transformers then reads those."""
    fields = source.fields
    proj = fields.string("feed_forward_proj", default="relu")
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise fields.error("feed_forward_proj", "must be ACT or gated-ACT (e.g. relu, gated-gelu)")
    gated = len(parts) == 2
    activation = "gelu_new" if proj == "gated-gelu" else parts[-1]
    if "is_gated_act" in source.config:
        gated = fields.boolean("is_gated_act", default=gated)
    if "dense_act_fn" in source.config:
        activation = fields.string("dense_act_fn", default=activation)
        key = "dense_act_fn"
    else:
        key = "feed_forward_proj"
    return gated, check_activation(source, key, activation)


def _table(
    d: int,
    inner_width: int,
    ffn: int,
    v: int,
    heads: int,
    buckets: int,
    encoder_layers: int,
    decoder_layers: int,
    gated: bool,
) -> tuple[TensorEntry, ...]:
    """Every tensor the two stacks read (the decoder's under ``decoder.`` in the layout)."""
    table = [
        TensorEntry(EMBEDDING_KEY, (v, d), -1, ("embedding.weight", "decoder.embedding.weight")),
        TensorEntry("encoder.final_layer_norm.weight", (d,), -1, ("final_norm.weight",)),
        TensorEntry("decoder.final_layer_norm.weight", (d,), -1, ("decoder.final_norm.weight",)),
    ]
    for stack, ours, layers in (("encoder", "", encoder_layers), ("decoder", "decoder.",
                                                                   decoder_layers)):  # fmt: skip
        sublayers = [("SelfAttention", "attention")]
        if stack == "decoder":
            sublayers.append(("EncDecAttention", "cross_attention"))
        for n in range(layers):
            theirs, mine = f"{stack}.block.{n}.layer.", f"{ours}blocks.{n}."
            for index, (attention, sublayer) in enumerate(sublayers):
                key, target = f"{theirs}{index}.{attention}", f"{mine}{sublayer}"
                for proj, out, inp in (("q", inner_width, d), ("k", inner_width, d),
                                       ("v", inner_width, d), ("o", d, inner_width)):  # fmt: skip
                    table.append(
                        TensorEntry(f"{key}.{proj}.weight", (out, inp), n,
                                    (f"{target}.W_{proj}.weight",))
                    )  # fmt: skip
                table.append(
                    TensorEntry(f"{theirs}{index}.layer_norm.weight", (d,), n,
                                (f"{target}.norm.weight",))
                )  # fmt: skip
                if n == 0 and sublayer == "attention":
                    table.append(
                        TensorEntry(f"{key}.relative_attention_bias.weight", (buckets, heads), n,
                                    (f"{target}.relative_bias.weight",))
                    )  # fmt: skip
            index = len(sublayers)
            dense, target = f"{theirs}{index}.DenseReluDense", f"{mine}feed_forward"
            ins = (("wi_0", "gate"), ("wi_1", "up")) if gated else (("wi", "up"),)
            for theirs_proj, ours_proj in ins:
                table.append(
                    TensorEntry(f"{dense}.{theirs_proj}.weight", (ffn, d), n,
                                (f"{target}.{ours_proj}.weight",))
                )  # fmt: skip
            table.append(TensorEntry(f"{dense}.wo.weight", (d, ffn), n, (f"{target}.down.weight",)))
            table.append(
                TensorEntry(f"{theirs}{index}.layer_norm.weight", (d,), n,
                            (f"{target}.norm.weight",))
            )  # fmt: skip
    return tuple(table)
