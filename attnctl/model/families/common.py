"""What every family module does with a checkpoint folder: find the prefix, check the
embedding's shape and the block count against the headers, build the description.

A family module reads its config.json keys (with :class:`~attnctl.model.checkpoint.Fields`,
which checks each by type and range) and calls these in the order it needs.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnctl.errors import AttnctlError
from attnctl.model.checkpoint import SAFETENSORS_DTYPES, Fields, TensorEntry, TensorInfo, _shape
from attnctl.model.config import LayerConfig
from attnctl.model.describe import (
    Block,
    Checkpoint,
    Embeddings,
    Generation,
    LMHead,
    ModelDescription,
    Norm,
)

ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "swish")


@dataclass(frozen=True)
class Source:
    """A checkpoint folder as a family module receives it."""

    path: Path
    model_type: str
    name: str  # as people say it: "Mistral"
    family: str  # the module's name
    fields: Fields  # config.json
    tensors: dict[str, TensorInfo]  # every tensor's header

    @property
    def config(self) -> dict[str, Any]:
        return self.fields.config


def check_activation(source: Source, key: str, activation: str) -> str:
    if activation not in ACTIVATIONS:
        raise source.fields.error(
            key, f"is {activation!r}; attnctl knows " + ", ".join(ACTIVATIONS)
        )
    return activation


def decoder_mask(source: Source, windows: tuple[int, ...] = ()) -> str:
    """ "causal", or "none" where config.json says ``is_causal: false``: transformers' mask
    functions read that key for every decoder family and then let each token see all."""
    fields = source.fields
    if fields.boolean("is_causal", default=True):
        return "causal"
    fields.refuse_if(
        "is_causal",
        any(windows),
        "with a sliding window: attnctl runs sliding windows causally only",
    )
    return "none"


def find_prefix(source: Source, embedding_key: str, vocab_size: int, hidden: int) -> str:
    """The prefix of every key ("bert.", "transformer.", "model." or ""), from where the
    token embedding is, once its shape is the config's."""
    embedding = next((k for k in source.tensors if k.endswith(embedding_key)), None)
    if embedding is None:
        raise AttnctlError(
            f"the weights in {source.path} have no {embedding_key}: not a {source.name} checkpoint"
        )
    # the numbers that size loops and plans, against the real tensors before anything uses them
    stored = source.tensors[embedding].shape
    if stored != (vocab_size, hidden):
        raise AttnctlError(
            f"{embedding} has shape {_shape(stored)} but config.json implies "
            f"{_shape((vocab_size, hidden))}"
        )
    return embedding.removesuffix(embedding_key)


def check_block_count(
    source: Source, pattern: re.Pattern[str], prefix: str, layers: int, layers_key: str
) -> None:
    """config.json's layer count is at most the blocks the headers hold (before any loop)."""
    present = {
        int(m.group(1)) for k in source.tensors if k.startswith(prefix) and (m := pattern.search(k))
    }
    if layers > len(present):
        raise source.fields.error(
            layers_key, f"is {layers} but the weights hold {len(present)} blocks"
        )


def stored_dtype(source: Source, prefix: str, embedding_key: str) -> str:
    return SAFETENSORS_DTYPES.get(source.tensors[prefix + embedding_key].dtype) or "float32"


def description(
    source: Source,
    prefix: str,
    embedding_key: str,
    embeddings: Embeddings,
    blocks: tuple[Block, ...],
    table: tuple[TensorEntry, ...],
    head: OutputHead | None = None,
    **facts: Any,
) -> ModelDescription:
    """The model, with where it came from; ``facts``: what the reports say of it
    (max_positions, intermediate, activation, ...); ``head``: a decoder's final norm and
    LM head (:func:`output_head`)."""
    checkpoint = Checkpoint(
        path=source.path,
        model_type=source.model_type,
        name=source.name,
        family=source.family,
        prefix=prefix,
        dtype=stored_dtype(source, prefix, embedding_key),
        tensors=source.tensors,
        table=table,
        facts=facts,
        head_table=() if head is None else head.table,
    )
    if head is None:
        return ModelDescription(embeddings, blocks, checkpoint)
    return ModelDescription(
        embeddings,
        blocks,
        checkpoint,
        final_norm=head.norm,
        head=head.head,
        generation=generation(source, vocab=embeddings.vocab_size),
    )


@dataclass(frozen=True)
class Stack:
    """One stack of an encoder–decoder: its embeddings, blocks and final norm."""

    embeddings: Embeddings
    blocks: tuple[Block, ...]
    final_norm: Norm | None = None


def encoder_decoder(
    source: Source,
    prefix: str,
    dtype: str,
    table: tuple[TensorEntry, ...],
    head_table: tuple[TensorEntry, ...],
    encoder: Stack,
    decoder: Stack,
    head: LMHead,
    rules: Generation,
    **facts: Any,
) -> ModelDescription:
    """An encoder–decoder: the encoder's description, its ``decoder`` the decoder's (its
    weights named ``decoder.…``), both of one checkpoint and its tables."""
    checkpoint = Checkpoint(
        path=source.path,
        model_type=source.model_type,
        name=source.name,
        family=source.family,
        prefix=prefix,
        dtype=dtype,
        tensors=source.tensors,
        table=table,
        facts=facts,
        head_table=head_table,
    )
    second = ModelDescription(
        decoder.embeddings,
        decoder.blocks,
        checkpoint,
        final_norm=decoder.final_norm,
        head=head,
        generation=rules,
    )
    return ModelDescription(
        encoder.embeddings,
        encoder.blocks,
        checkpoint,
        final_norm=encoder.final_norm,
        decoder=second,
        generation=rules,
    )


def gemma_head(
    source: Source, prefix: str, hidden: int, vocab: int, eps: float, softcap_default: float
) -> OutputHead:
    """Gemma's final norm (RMS, scaling by 1 + weight) and its tied head, whose logits
    ``final_logit_softcapping`` caps (null: no cap)."""
    softcap = 0.0
    default = softcap_default or None
    if source.config.get("final_logit_softcapping", default) is not None:
        softcap = source.fields.number("final_logit_softcapping", default=softcap_default)
    return output_head(
        source, prefix, hidden, vocab, "norm", Norm("rms", eps), tied_default=True,
        offset=1.0, softcap=softcap,
    )  # fmt: skip


@dataclass(frozen=True)
class OutputHead:
    """A decoder's final norm and LM head, with the tensors they read."""

    norm: Norm | None
    head: LMHead | None  # None: the folder holds no head (a base model saved alone)
    table: tuple[TensorEntry, ...]


def output_head(
    source: Source,
    prefix: str,
    hidden: int,
    vocab: int,
    norm_key: str,
    norm: Norm,
    *,
    tied_default: bool,
    norm_bias: bool = False,
    offset: float = 0.0,
    softcap: float = 0.0,
) -> OutputHead:
    """The final norm (``<prefix><norm_key>.weight``) and the LM head: the token embedding
    when config.json ties them (``tie_word_embeddings``, default as the family's config
    class), else ``lm_head.weight`` beside the prefixed keys, where the folder has it."""
    table = [
        TensorEntry(f"{norm_key}.weight", (hidden,), -1, ("final_norm.weight",), offset=offset)
    ]
    if norm_bias:
        table.append(TensorEntry(f"{norm_key}.bias", (hidden,), -1, ("final_norm.bias",)))
    tied = source.fields.boolean("tie_word_embeddings", default=tied_default)
    head: LMHead | None = LMHead(tied=True, softcap=softcap)
    if not tied:
        head = None
        if "lm_head.weight" in source.tensors:
            head = LMHead(tied=False, softcap=softcap)
            table.append(
                TensorEntry(
                    "lm_head.weight", (vocab, hidden), -1, ("lm_head.weight",), absolute=True
                )
            )
    return OutputHead(norm, head, tuple(table))


GENERATION_FILE = "generation_config.json"
# generation_config keys that change greedy decoding and that attnctl does not apply
REFUSED_GENERATION = {
    "encoder_no_repeat_ngram_size": 0,
    "sequence_bias": None,
    "exponential_decay_length_penalty": None,
    "forced_decoder_ids": None,
    "guidance_scale": None,
    "watermarking_config": None,
}


def generation(
    source: Source, start_default: int | None = None, vocab: int | None = None
) -> Generation:
    """How greedy decoding starts, stops and pads (:func:`_generation`). A problem with
    those keys is kept, not raised: it stops generation only, never a plain run.

    ``start_default``: an encoder–decoder's decoder_start_token_id when config.json has
    none (its config class's); without one its bos_token_id, as transformers falls back.
    """
    try:
        rules = _generation(source, start_default, vocab)
    except AttnctlError as error:
        return Generation(problem=error.message)
    return rules


def decoder_generation(
    source: Source, start_default: int | None = None, vocab: int | None = None
) -> Generation:
    """An encoder–decoder's rules: its decoder must have a first token to start from."""
    rules = generation(source, start_default, vocab)
    if rules.start_id is None and not rules.problem:
        return dataclasses.replace(
            rules,
            problem=f"{source.path / 'config.json'} has no decoder_start_token_id (nor "
            "bos_token_id): the decoder has no token to start from",
        )
    return rules


def _generation(source: Source, start_default: int | None, vocab: int | None) -> Generation:
    """How greedy decoding starts, stops and pads: generation_config.json's keys where
    the folder has one, else config.json's (as transformers reads them); keys that would
    change the tokens and that attnctl does not apply are refused by name."""
    values, fields = _generation_values(source, start_default)
    for key, neutral in REFUSED_GENERATION.items():
        if key in values and values[key] not in (neutral, None, [], 0):
            raise fields.error(key, "changes greedy decoding and attnctl does not apply it")
    keys = _GenerationKeys(values, fields, vocab)
    eos_list = keys.eos_ids()
    banned = keys.banned_ids()
    penalty = keys.repetition_penalty()
    return Generation(
        repetition_penalty=penalty,
        no_repeat_ngram=keys.count("no_repeat_ngram_size"),
        min_length=keys.count("min_length"),
        min_new_tokens=keys.count("min_new_tokens"),
        suppressed_ids=keys.token_list("suppress_tokens"),
        begin_suppressed_ids=keys.token_list("begin_suppress_tokens"),
        eos_ids=tuple(eos_list),
        pad_id=keys.token("pad_token_id"),
        start_id=keys.token("decoder_start_token_id")
        if values.get("decoder_start_token_id") is not None
        else keys.token("bos_token_id"),
        banned_ids=tuple(banned),
        forced_bos_id=keys.token("forced_bos_token_id"),
        forced_eos_id=keys.token("forced_eos_token_id"),
    )


def _generation_values(source: Source, start_default: int | None) -> tuple[dict[str, Any], Fields]:
    """The generation keys and where they come from: generation_config.json where the
    folder has one (with config.json's decoder_start_token_id where it has none), else
    config.json; ``start_default`` where neither names a decoder start token."""
    path = source.path / GENERATION_FILE
    values: dict[str, Any] = source.config  # transformers reads one or the other
    fields = source.fields
    if path.is_file():
        from attnctl.model.config import read_json_object

        values = read_json_object(path, "generation config")
        fields = Fields(path, values)
        if values.get("decoder_start_token_id") is None:  # the model's config has it
            start = source.config.get("decoder_start_token_id")
            values = {**values, "decoder_start_token_id": start}
    if start_default is not None and values.get("decoder_start_token_id") is None:
        values = {**values, "decoder_start_token_id": start_default}
    return values, fields


@dataclass(frozen=True)
class _GenerationKeys:
    """The generation keys, each read checked by type (an error names the key in
    ``fields``' file) and its token ids against the vocabulary (None: unknown)."""

    values: dict[str, Any]
    fields: Fields
    vocab: int | None

    def in_vocabulary(self, key: str, ids: list[int]) -> None:
        """Every id of ``key`` below the vocabulary's size (where it is known)."""
        vocab = self.vocab
        outside = [i for i in ids if vocab is not None and i >= vocab]
        if outside:
            raise self.fields.error(
                key, f"names token {outside[0]}, outside the vocabulary of {vocab}"
            )

    def token(self, key: str) -> int | None:
        """One token id; None where the key is absent or null."""
        value = self.values.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fields.error(key, "must be a token id (an integer at least 0)")
        self.in_vocabulary(key, [value])
        return value

    def count(self, key: str) -> int:
        """An integer at least 0; 0 where the key is absent or null."""
        value = self.values.get(key)
        if value is None:
            return 0
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fields.error(key, "must be an integer at least 0")
        return value

    def token_list(self, key: str) -> tuple[int, ...]:
        """A list of token ids; () where the key is absent or null."""
        value = self.values.get(key)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
        ):
            raise self.fields.error(key, "must be a list of token ids")
        self.in_vocabulary(key, value)
        return tuple(value)

    def eos_ids(self) -> list[int]:
        """eos_token_id: one token id or a list of them."""
        eos = self.values.get("eos_token_id")
        eos_list = eos if isinstance(eos, list) else [] if eos is None else [eos]
        if not all(isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos_list):
            raise self.fields.error("eos_token_id", "must be a token id or a list of them")
        self.in_vocabulary("eos_token_id", eos_list)
        return eos_list

    def banned_ids(self) -> list[int]:
        """bad_words_ids: single tokens only, as a list of [id] lists."""
        banned: list[int] = []
        bad_words = self.values.get("bad_words_ids")
        if bad_words is not None:
            if not isinstance(bad_words, list) or not all(
                isinstance(w, list)
                and len(w) == 1
                and isinstance(w[0], int)
                and not isinstance(w[0], bool)
                and w[0] >= 0
                for w in bad_words
            ):
                raise self.fields.error(
                    "bad_words_ids", "attnctl bans single tokens only: a list of [id] lists"
                )
            banned = [w[0] for w in bad_words]
            self.in_vocabulary("bad_words_ids", banned)
        return banned

    def repetition_penalty(self) -> float:
        """repetition_penalty: a number above 0; 1.0 (none) where absent or null."""
        penalty = self.values.get("repetition_penalty")
        if penalty is None:
            penalty = 1.0
        if isinstance(penalty, bool) or not isinstance(penalty, int | float) or not penalty > 0:
            raise self.fields.error("repetition_penalty", "must be a number above 0")
        return float(penalty)


def attention_config(source: Source, dtype: str, **values: Any) -> LayerConfig:
    """A block's attention as a LayerConfig (the run's dtype and kernel come later)."""
    return LayerConfig(tokenizer=str(source.path / "tokenizer.json"), dtype=dtype, **values)


def rope_values(
    source: Source,
    head_dim: int,
    max_positions: int,
    convention: str = "standard",
    layer_type: str | None = None,
) -> dict[str, Any]:
    """RoPE read as the family's transformers config reads it (``attnctl.model.rope``: every type
    transformers has), as the LayerConfig values the attention runs with."""
    from attnctl.model.rope import rope_from_config

    rope = rope_from_config(
        source.config,
        str(source.path / "config.json"),
        head_dim=head_dim,
        max_positions=max_positions,
        convention=convention,  # type: ignore[arg-type]
        layer_type=layer_type,
    )
    source.fields.refuse_if(
        "partial_rotary_factor",
        rope.partial_rotary_factor != 1.0,
        "attnctl rotates every dim of a head",
    )
    values: dict[str, Any] = {"rope_theta": rope.theta, "rope_type": rope.rope_type}
    if rope.rope_type == "default":
        return values
    # dynamic NTK grows the base past max_position_embeddings; the others scale from the
    # original length: LayerConfig keeps either as rope_original_max_positions
    trained = rope.max_positions if rope.rope_type == "dynamic" else rope.original_max_positions
    values["rope_factor"] = rope.factor
    if trained:  # linear reads no length
        values["rope_original_max_positions"] = trained
    if rope.rope_type == "llama3":
        values |= {
            "rope_low_freq_factor": rope.low_freq_factor,
            "rope_high_freq_factor": rope.high_freq_factor,
        }
    if rope.rope_type == "yarn":
        values |= {
            "rope_beta_fast": rope.beta_fast,
            "rope_beta_slow": rope.beta_slow,
            "rope_mscale": rope.mscale or 0.0,
            "rope_mscale_all_dim": rope.mscale_all_dim or 0.0,
            "rope_truncate": rope.truncate,
        }
    if rope.rope_type in ("yarn", "longrope"):
        values["rope_attention_factor"] = rope.attention_factor or 0.0
    if rope.rope_type == "longrope":
        values |= {"rope_short_factor": rope.short_factor, "rope_long_factor": rope.long_factor}
    return values


LAYER_TYPES = ("full_attention", "sliding_attention")


def checked_layer_types(source: Source, layers: int) -> list[str] | None:
    """config.json's ``layer_types`` (None when absent), one known kind per block."""
    fields, kinds = source.fields, source.config.get("layer_types")
    if kinds is None:
        return None
    if not isinstance(kinds, list) or not all(kind in LAYER_TYPES for kind in kinds):
        raise fields.error("layer_types", "must be a list of " + " or ".join(LAYER_TYPES))
    if len(kinds) != layers:
        raise fields.error("layer_types", f"names {len(kinds)} blocks, not {layers}")
    return kinds


def gemma_windows(source: Source, kinds: list[str]) -> tuple[int, ...]:
    """Each block's window for Gemma's kinds: ``sliding_window`` (4096 when absent) on the
    sliding ones; a null one with sliding blocks is refused, as transformers raises."""
    fields, window = source.fields, 0
    if "sliding_attention" in kinds:
        if "sliding_window" in source.config and source.config["sliding_window"] is None:
            raise fields.error(
                "sliding_window", "is null, but sliding blocks need one (transformers raises)"
            )
        window = fields.integer("sliding_window", default=4096)
    return tuple(window if kind == "sliding_attention" else 0 for kind in kinds)


def qwen_layer_windows(
    source: Source, layers: int, *, default_window: int = 4096, default_first: int = 28
) -> tuple[int, ...]:
    """Each block's window as Qwen's configs decide it: none without ``use_sliding_window``;
    else ``layer_types`` names each block's kind, and without it the blocks from
    ``max_window_layers`` on slide."""
    fields, config = source.fields, source.config
    if not fields.boolean("use_sliding_window", default=False):
        window = 0  # transformers sets sliding_window to None
    elif "sliding_window" in config and config["sliding_window"] is None:
        window = 0
    else:
        window = fields.integer("sliding_window", default=default_window)
    kinds = checked_layer_types(source, layers)
    if kinds is None:
        if not window:
            return (0,) * layers
        first = fields.integer("max_window_layers", default=default_first, minimum=0)
        return tuple(window if n >= first else 0 for n in range(layers))
    if "sliding_attention" in kinds and not window:
        raise fields.error(
            "layer_types",
            "names sliding_attention blocks but no window is on (use_sliding_window and "
            "sliding_window): transformers cannot build that model",
        )
    return tuple(window if kind == "sliding_attention" else 0 for kind in kinds)


def projection_table(
    block: int,
    d: int,
    heads: int,
    kv_heads: int,
    d_k: int,
    bias: bool,
    output_bias: bool,
    inner: int,
    mlp_bias: bool = False,
) -> list[TensorEntry]:
    """A Llama-style block's q/k/v/o and gate/up/down projections (``model.layers.N.``)."""
    theirs_block, ours = f"layers.{block}.", f"blocks.{block}."
    q, kv = heads * d_k, kv_heads * d_k
    table = []
    for theirs, mine, out, inp, has_bias in (
        ("self_attn.q_proj", "attention.W_q", q, d, bias),
        ("self_attn.k_proj", "attention.W_k", kv, d, bias),
        ("self_attn.v_proj", "attention.W_v", kv, d, bias),
        ("self_attn.o_proj", "attention.W_o", d, q, bias and output_bias),
        ("mlp.gate_proj", "feed_forward.gate", inner, d, mlp_bias),
        ("mlp.up_proj", "feed_forward.up", inner, d, mlp_bias),
        ("mlp.down_proj", "feed_forward.down", d, inner, mlp_bias),
    ):
        key = f"{theirs_block}{theirs}"
        table.append(TensorEntry(f"{key}.weight", (out, inp), block, (f"{ours}{mine}.weight",)))
        if has_bias:
            table.append(TensorEntry(f"{key}.bias", (out,), block, (f"{ours}{mine}.bias",)))
    return table


def norm_entry(block: int, theirs: str, mine: str, width: int, offset: float = 0.0) -> TensorEntry:
    """One norm's weight of block N: ``layers.N.<theirs>.weight`` -> ``blocks.N.<mine>``."""
    return TensorEntry(
        f"layers.{block}.{theirs}.weight", (width,), block, (f"blocks.{block}.{mine}.weight",),
        offset=offset,
    )  # fmt: skip
