"""A model as data: embeddings, then blocks, each an ordered tuple of sublayers. No torch.

Everything attnctl computes walks one of these. ``plan.py`` walks it for ``shapes`` and
``memory`` (which stages, which shapes, which bytes); ``nn/model.py`` walks the same
description in torch for ``run``, ``check`` and ``--measure``. The seeded layer of the
tutorials is a one-block model (:func:`seeded_model`); a checkpoint's family module
turns its config.json into the same thing (``families/``).

A sublayer says where its norm and its residual sit:

- ``pre``: ``x + f(Norm(x))`` (GPT-2, Llama);
- ``post``: ``Norm(x + f(x))`` (the original Transformer, BERT);
- ``none``: ``f(x)``, no residual (the tutorials' bare attention layer).

``output_norm`` adds a norm of the sublayer's output before the residual: with ``pre``
that is ``x + Norm'(f(Norm(x)))`` (Gemma's four norms a block), with ``none``
``x + Norm'(f(x))`` (OLMo 2).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnctl.errors import AttnctlError
from attnctl.model.config import LayerConfig, validate

SELF_ATTENTION, CROSS_ATTENTION, FEED_FORWARD = "self_attention", "cross_attention", "feed_forward"
NORM_NAMES = {"layer": "LayerNorm", "rms": "RMSNorm"}


@dataclass(frozen=True)
class Parameter:
    """A learnable tensor as the memory report lists it."""

    name: str
    shape: tuple[int, ...]
    copies: int = 1  # one per block for a model's "layers.*.…" tensors

    @property
    def count(self) -> int:
        total = 1
        for n in self.shape:
            total *= n
        return total * self.copies


@dataclass(frozen=True)
class Embeddings:
    """Token ids -> vectors (B, L, D), and what is added to them before the first block."""

    vocab_size: int
    d_model: int
    # added to the embeddings: "learned", "sinusoidal" (sin and cos interleaved),
    # "sinusoidal_halves" (sin in the first D/2, cos in the second: Marian) or "none"
    positions: str = "none"
    max_positions: int = 0  # rows of a learned table, or the most positions (Marian)
    position_offset: int = 0  # position p reads row p + offset of the table (BART: 2)
    segment: bool = False  # BERT: segment 0's embedding is added too
    norm: str = "none"  # "layer": a LayerNorm over D after the sum (BERT)
    norm_eps: float = 1e-12
    scale: float = 0.0  # the vectors are multiplied by this (Gemma, Marian: √D)
    scale_rounded: bool = True  # the factor rounded to the dtype first (Gemma; not Marian, BART)
    # whose trained positions these are: a longer input is then refused in those words
    trained_by: str = ""

    @property
    def limited_by(self) -> str:
        """What limits the input's length, in words: "learned positions", ..."""
        if self.positions == "sinusoidal_halves":
            return "rows of its sinusoidal position table"
        return f"{self.positions} positions"


@dataclass(frozen=True)
class Attention:
    """A self- or cross-attention sublayer: its math is a :class:`LayerConfig`.

    ``config`` holds the sizes (D, H, Hkv, d_k), the projections' biases, positions
    (rope, alibi), the mask, the norm and its placement, and the run's dtype and kernel.
    """

    config: LayerConfig
    kind: str = SELF_ATTENTION  # or CROSS_ATTENTION: keys and values from a context
    output_norm: bool = False  # a norm of W_o's output before the residual (Gemma, OLMo 2)
    # its weights' and stages' names in the layout: "attention", or "cross_attention" for a
    # decoder block's second one (blocks.N.cross_attention.W_q.weight, stage cross_q)
    name: str = "attention"
    # T5's relative position bias (config.pos "relative"): True where this sublayer holds
    # the bucket table (block 0) and computes the (H, L, Lk) bias every later block reuses
    computes_bias: bool = False

    @property
    def placement(self) -> str:
        return self.config.norm

    @property
    def window(self) -> int:
        """Its sliding window: query i sees keys i - W < j <= i (0: none)."""
        return self.config.window

    @property
    def residual(self) -> bool:
        return self.config.norm != "none" or self.output_norm


@dataclass(frozen=True)
class FeedForward:
    """A feed-forward sublayer: ``down(act(up(h)))``, or gated: ``down(act(gate(h)) * up(h))``."""

    inner: int  # I
    activation: str  # config.json's name: gelu, gelu_new, silu, ...
    gated: bool = False  # SwiGLU (Llama)
    bias: bool = True
    placement: str = "pre"  # of its norm: "pre", "post" or "none"
    norm_type: str = "layer"
    norm_eps: float = 1e-5
    output_norm: bool = False  # a norm of W_down's output before the residual (Gemma, OLMo 2)

    @property
    def kind(self) -> str:
        return FEED_FORWARD

    @property
    def residual(self) -> bool:
        return True


Sublayer = Attention | FeedForward


@dataclass(frozen=True)
class Norm:
    """A norm over D after the last block (``final_norm.weight``, ``.bias``)."""

    type: str  # "layer" or "rms"
    eps: float


@dataclass(frozen=True)
class LMHead:
    """The last hidden states (B, L, D) -> logits (B, L, V), after the stack's final norm.

    ``tied``: the token embedding is the head; else ``lm_head.weight`` (V, D).
    """

    tied: bool
    bias: bool = False  # lm_head.bias (V,): Marian's and BART's final_logits_bias
    scale: float = 0.0  # hidden times this first (T5 with tied embeddings: D^-0.5)
    softcap: float = 0.0  # cap·tanh(logits/cap) (Gemma 2's final_logit_softcapping)


@dataclass(frozen=True)
class Generation:
    """How greedy decoding starts, ends and pads, and what it forbids (from config.json
    and generation_config.json), as transformers' generate(do_sample=False) applies it."""

    eos_ids: tuple[int, ...] = ()  # any of these ends a sequence
    pad_id: int | None = None  # what a finished sequence appends (None: eos_ids[0])
    start_id: int | None = None  # an encoder–decoder's decoder_start_token_id
    banned_ids: tuple[int, ...] = ()  # never generated (bad_words_ids of one token)
    forced_bos_id: int | None = None  # the first generated token (BART)
    forced_eos_id: int | None = None  # the last token, when the limit is reached
    repetition_penalty: float = 1.0  # a seen token's logit /p (or ·p below 0)
    no_repeat_ngram: int = 0  # no n-gram twice
    min_length: int = 0  # no end-of-sequence before this many tokens (prompt included)
    min_new_tokens: int = 0  # nor before this many new ones
    suppressed_ids: tuple[int, ...] = ()  # suppress_tokens: never generated
    begin_suppressed_ids: tuple[int, ...] = ()  # not as the first new token
    # a key that would change the tokens and is not applied, or is malformed: generation
    # is refused with this line (a plain run is not)
    problem: str = ""


@dataclass(frozen=True)
class Block:
    sublayers: tuple[Sublayer, ...]

    @property
    def attention(self) -> Attention:
        """The block's (first) self-attention: the one ``run`` shows."""
        return next(s for s in self.sublayers if isinstance(s, Attention))


@dataclass(frozen=True)
class Checkpoint:
    """Where a checkpoint's description came from: its folder and tensor headers."""

    path: Path
    model_type: str  # config.json's
    name: str  # as people say it: "GPT-2", "Mistral"
    family: str  # the module that reads it: "bert", "gpt2", "llama"
    prefix: str  # "bert.", "transformer.", "model." or ""
    dtype: str  # the stored dtype of its token embedding
    tensors: dict[str, Any] = field(compare=False, hash=False, repr=False)  # key -> TensorInfo
    # the family's table: (checkpoint key without prefix, shape, block or -1 for shared)
    table: tuple[tuple[str, tuple[int, ...], int], ...] = field(compare=False, repr=False)
    facts: dict[str, Any] = field(compare=False, hash=False, default_factory=dict)
    # the final norm's and LM head's tensors, which only generation reads (block: -1)
    head_table: tuple[Any, ...] = field(compare=False, repr=False, default=())


@dataclass(frozen=True)
class ModelDescription:
    """Embeddings, then blocks; ``checkpoint`` is None for the seeded layer.

    A decoder-only checkpoint also has its ``final_norm`` and ``head`` (for generation);
    an encoder–decoder is its encoder (embeddings, blocks, final_norm) with its
    ``decoder``, whose weights are named ``decoder.…`` in the layout.
    """

    embeddings: Embeddings
    blocks: tuple[Block, ...]
    checkpoint: Checkpoint | None = None
    stack: LayerConfig | None = None  # the seeded layer as given: a stack of it (--layers)
    final_norm: Norm | None = None  # after the last block (T5's encoder; decoders)
    head: LMHead | None = None  # None: no LM head (BERT, a base model saved without one)
    decoder: ModelDescription | None = None  # an encoder–decoder's decoder stack
    generation: Generation | None = None

    @property
    def is_encoder_decoder(self) -> bool:
        return self.decoder is not None

    def stack_windows(self, layers: int) -> tuple[int, ...]:
        """The window of each layer of a stack of the seeded layer (0: full attention)."""
        config = self.stack or self.config
        pattern = config.window_pattern
        return tuple(
            config.window if not pattern or pattern[n % len(pattern)] == "s" else 0
            for n in range(layers)
        )

    @property
    def config(self) -> LayerConfig:
        """Block 0's attention math (every block of a model shares it, windows aside)."""
        return self.blocks[0].attention.config

    @property
    def layers(self) -> int:
        return len(self.blocks)

    @property
    def vocab_size(self) -> int:
        return self.embeddings.vocab_size

    def longest_input(self) -> int | None:
        """The most tokens it takes: its learned positions (Marian: its sinusoidal table's
        rows); None: no limit."""
        if self.embeddings.positions in ("learned", "sinusoidal_halves"):
            return self.embeddings.max_positions
        return None

    # ------------------------------------------------- what is said of a checkpoint

    @property
    def source(self) -> Checkpoint:
        if self.checkpoint is None:
            raise AttnctlError("the seeded layer has no checkpoint")
        return self.checkpoint

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def path(self) -> Path:
        return self.source.path

    @property
    def model_type(self) -> str:
        return self.source.model_type

    @property
    def family(self) -> str:
        return self.source.family

    @property
    def dtype(self) -> str:
        return self.source.dtype

    @property
    def hidden(self) -> int:
        return self.embeddings.d_model

    @property
    def heads(self) -> int:
        return self.config.heads

    @property
    def kv_heads(self) -> int:
        return self.config.kv_heads

    @property
    def intermediate(self) -> int:
        return self.source.facts["intermediate"]

    @property
    def activation(self) -> str:
        return self.source.facts["activation"]

    @property
    def max_positions(self) -> int:
        return self.source.facts["max_positions"]

    @property
    def layer_windows(self) -> tuple[int, ...]:
        return tuple(block.attention.window for block in self.blocks)

    def summary(self) -> str:
        kv = f" (kv {self.kv_heads})" if self.kv_heads != self.heads else ""
        attention = self.blocks[0].attention
        norms = ""  # the layer line's "norm" says where the norm before a sublayer sits
        if attention.output_norm:
            where = "before and after" if attention.placement == "pre" else "after"
            norms = f" · norms {where} each sublayer"
        layers = f"{self.layers} layer{'s' * (self.layers != 1)}"
        if self.decoder is not None:
            layers = f"{self.layers} + {self.decoder.layers} layers (encoder + decoder)"
        return (
            f"{self.name} · {layers} · D {self.hidden} · heads {self.heads}{kv} · "
            f"FFN {self.intermediate} {self.activation} · vocab {self.vocab_size:,} · "
            f"{self.dtype}{norms}"
        )

    def weights(self) -> dict[str, Any]:
        """The checkpoint's float tensors that are weights (not buffers such as masks)."""
        from attnctl.model.checkpoint import stored_weights

        return stored_weights(self.source.tensors)

    def loaded_values(self, blocks: int) -> int:
        """How many values ``run --layer N`` loads for blocks 0..N (``blocks`` = N + 1)."""
        total = 0
        for entry in self.source.table:
            if entry.block < blocks:
                count = 1
                for n in entry.shape:
                    count *= n
                total += count
        return total

    def layer_config(self, **overrides: Any) -> LayerConfig:
        """The attention layer of every block with ``overrides`` (dtype, device, impl,
        tokenizer; None leaves a value as the model has it)."""
        config = dataclasses.replace(
            self.config, **{k: v for k, v in overrides.items() if v is not None}
        )
        if self.source.facts.get("upcast_scores") and config.dtype != "float32":
            raise AttnctlError(
                f"reorder_and_upcast_attn computes the scores in float32; attnctl honours it "
                f"in float32 only, not {config.dtype}: add --dtype float32"
            )
        return validate(config)

    def with_run(self, config: LayerConfig) -> ModelDescription:
        """The same model run as ``config`` says: its dtype, kernel, device and tokenizer.

        For the seeded layer ``config`` is the whole layer; a checkpoint keeps its math.
        """
        if self.checkpoint is None:
            return seeded_model(config, self.vocab_size)
        run = {
            k: getattr(config, k)
            for k in ("dtype", "impl", "device", "tokenizer", "seed", "gpu", "torch_rules")
        }
        blocks = tuple(
            Block(
                tuple(
                    dataclasses.replace(s, config=dataclasses.replace(s.config, **run))
                    if isinstance(s, Attention)
                    else s
                    for s in block.sublayers
                )
            )
            for block in self.blocks
        )
        decoder = None if self.decoder is None else self.decoder.with_run(config)
        return dataclasses.replace(self, blocks=blocks, decoder=decoder)


def seeded_model(config: LayerConfig, vocab_size: int) -> ModelDescription:
    """The tutorials' layer as a one-block model: embeddings (+ positions), one attention.

    With ``config.cross`` its attention is cross-attention over a context embedded the
    same way (the decoder's second attention, with the context as the encoder output).
    """
    if config.pos == "relative":
        raise AttnctlError(
            "pos relative is T5's bias from a checkpoint's bucket table; the seeded layer has "
            "none: use sinusoidal, learned, rope, alibi or none"
        )
    added = config.pos if config.pos in ("learned", "sinusoidal") else "none"
    embeddings = Embeddings(
        vocab_size=vocab_size,
        d_model=config.d_model,
        positions=added,
        max_positions=config.max_positions,
    )
    kind = CROSS_ATTENTION if config.cross else SELF_ATTENTION
    given = config
    if config.window_pattern and config.window_pattern[0] == "f":  # layer 0 sees every key
        config = dataclasses.replace(config, window=0, window_pattern="")
    attention = Attention(config, kind)
    return ModelDescription(embeddings, (Block((attention,)),), stack=given)
