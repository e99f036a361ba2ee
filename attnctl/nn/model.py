"""A model description run in torch: the embeddings, then each block's sublayers in order.

One path for the seeded layer (a one-block model) and for checkpoints. Each sublayer is
handed its input as ``[x]`` and takes it out, so nothing here keeps a tensor alive that
the sublayer is done with: the run holds what the plan (``plan.py``) says it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from attnctl.errors import AttnctlError
from attnctl.model.describe import Attention, ModelDescription
from attnctl.nn import Record, no_record
from attnctl.nn.attention import AttentionResult, KVCache, attention
from attnctl.nn.collectives import TensorGroup, vocab_parallel_lookup
from attnctl.nn.embeddings import embed, embed_context
from attnctl.nn.feed_forward import feed_forward


@dataclass
class ModelOutput:
    output: torch.Tensor  # (B, L, D): the last block run's output
    attention_output: torch.Tensor | None  # (B, L, D): W_o's, when attention is the last sublayer
    weights: torch.Tensor | None  # (B, H, L, Lk): the last attention's, when kept (math path)
    windows: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> (B, h, r, Lk)
    # (block, sublayer name) -> (B, h, r, Lk) of every attention of the shown blocks, and
    # the position of the first of those Lk keys (a sliding cache drops the oldest)
    shown: dict[tuple[int, str], tuple[torch.Tensor, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Run:
    """What every block of one :func:`forward` call reads besides its input (as there)."""

    weights: dict[str, torch.Tensor]
    records: Mapping[int, Record]
    padding: torch.Tensor | None
    context_padding: torch.Tensor | None
    shown: Sequence[int]
    window: tuple[list[int], list[int]] | None
    keep_weights: bool
    training: bool
    cache: list[torch.Tensor] | None
    caches: list[dict[str, KVCache]] | None
    offset: int
    group: TensorGroup | None
    gather: Callable[[int, torch.Tensor | None], None] | None


def sublayer_weights(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors of one sublayer ("blocks.3.attention.") by their short names."""
    return {name.removeprefix(prefix): t for name, t in weights.items() if name.startswith(prefix)}


def sublayer_prefix(block: int, sublayer: object) -> str:
    kind = sublayer.name if isinstance(sublayer, Attention) else "feed_forward"
    return f"blocks.{block}.{kind}."


def stage_prefix(sublayer: Attention, record: Record) -> Record:
    """A decoder block's cross-attention records its stages as cross_q, cross_weights, …"""
    if sublayer.name == "attention":
        return record
    prefix = sublayer.name.removesuffix("attention")  # "cross_"
    return lambda name, tensor, dims: record(prefix + name, tensor, dims)


def forward(
    model: ModelDescription,
    weights: dict[str, torch.Tensor],
    token_ids: torch.Tensor | None,
    *,
    last: int = 0,
    record: Record = no_record,
    recorded: int | None = 0,
    records: Mapping[int, Record] | None = None,
    embeddings: torch.Tensor | None = None,
    padding: torch.Tensor | None = None,
    context_ids: torch.Tensor | None = None,
    shown: Sequence[int] = (),
    window: tuple[list[int], list[int]] | None = None,
    keep_weights: bool = False,
    training: bool = False,
    cache: list[torch.Tensor] | None = None,
    context: torch.Tensor | None = None,
    context_padding: torch.Tensor | None = None,
    caches: list[dict[str, KVCache]] | None = None,
    offset: int = 0,
    group: TensorGroup | None = None,
    gather: Callable[[int, torch.Tensor | None], None] | None = None,
) -> ModelOutput:
    """Run blocks 0..last on token ids (B, L), or on ``embeddings`` (B, L, D) given
    instead of the lookup (positions are still added).

    ``recorded``: the block whose stages go to ``record`` (the inputs and embeddings are
    recorded with it; None records nothing). ``records``, instead of those two: each
    block's own record (``run --save`` of several blocks), block n's stages to
    ``records[n]``, the inputs and embeddings to the first one's. ``shown``: the blocks
    whose attention weights for ``window`` (heads, rows) are returned. ``padding`` (B, Lk)
    bool, True = a real key.
    ``context_ids`` (B, Lc): the keys and values of cross-attention sublayers.
    ``cache``: every block's K and V heads are appended, as a decoder's KV cache keeps them.

    Decoding (an encoder–decoder's decoder, or generation): ``context`` (B, Lc, D) is the
    encoder output cross-attention reads, ``context_padding`` (B, Lc) its real tokens;
    ``caches`` holds each block's KV caches by sublayer name, which this step reads and
    extends; ``offset`` is the position of the first token of ``token_ids``.

    ``group``: one rank of a tensor-parallel split (``nn/collectives.py``): ``model`` is
    its cut description (``parallel.plan.rank_description``) and ``weights`` its share
    (``collectives.shard_weights``); the embedding is looked up in its vocabulary rows.
    Under sequence parallelism the output holds this rank's L / T tokens.

    ``gather`` (ZeRO 3, ``rank_zero.ShardedWeights``): called as ``gather(-1, None)`` before the
    embeddings, ``gather(n, hidden)`` before block n with its input, and ``gather(last +
    1, output)`` after the last block, so that a rank can gather the weights about to be
    read and free those read before.
    """
    if gather is not None:
        gather(-1, None)
    if records is None:
        records = {} if recorded is None else {recorded: record}
    recording = records[min(records)] if records else no_record
    _record_inputs(recording, token_ids, context_ids, context, padding, context_padding)
    looked_up = [embeddings]  # given, or None (looked up): taken out by the embeddings
    del embeddings
    hidden = _embedded(model, weights, token_ids, looked_up, recording, offset, group)
    # (B, L, D); under SP (B, L/T, D)
    contexts: list[torch.Tensor] = []  # held here while a later block still reads it
    if context_ids is not None:
        contexts.append(embed_context(model.embeddings, weights, context_ids, recording))
    elif context is not None:
        contexts.append(context)
        del context
    run = _Run(
        weights, records, padding, context_padding, shown, window, keep_weights, training,
        cache, caches, offset, group, gather,
    )  # fmt: skip
    owned = [hidden]  # the blocks take it: freed when the first sublayer is done with it
    del hidden
    return _blocks(model, run, owned, contexts, last)


def _record_inputs(
    recording: Record,
    token_ids: torch.Tensor | None,
    context_ids: torch.Tensor | None,
    context: torch.Tensor | None,
    padding: torch.Tensor | None,
    context_padding: torch.Tensor | None,
) -> None:
    """The model's inputs, made before it runs, to the first recorded block's record."""
    if token_ids is not None:
        recording("token_ids", token_ids, "B L")
    if context_ids is not None:
        recording("context_ids", context_ids, "B Lc")
    if context is not None:  # a decoder's: the encoder output, made before it runs
        recording("encoder_output", context, "B Lc D")
    if padding is not None:
        recording("padding_mask", padding, "B Lc" if context_ids is not None else "B L")
    elif context_padding is not None:  # the source's real tokens, the cross-attention keys
        recording("padding_mask", context_padding, "B Lc")


def _embedded(
    model: ModelDescription,
    weights: dict[str, torch.Tensor],
    token_ids: torch.Tensor | None,
    looked_up: list[torch.Tensor | None],
    recording: Record,
    offset: int,
    group: TensorGroup | None,
) -> torch.Tensor:
    """The embeddings (B, L, D) of ``looked_up = [e]``, taken out: e, or when None the
    token ids' rows of the table (under tensor parallelism summed over the ranks)."""
    embeddings = looked_up.pop()
    name: str | None = "embeddings"
    if embeddings is None and group is not None:  # vocab parallel, summed over the ranks
        table = weights["embedding.weight"]  # this rank's ⌈V/T⌉ rows
        embeddings = vocab_parallel_lookup(group, token_ids, table, recording)
        name = None  # recorded with the collective's stages
    elif embeddings is None:
        embeddings = F.embedding(token_ids, weights["embedding.weight"])  # (B, L, D)
    looked_up.append(embeddings)
    del embeddings
    return embed(
        model.embeddings, weights, looked_up, recording, name, offset=offset, group=group
    )  # (B, L, D); under SP (B, L/T, D)


def _blocks(
    model: ModelDescription,
    run: _Run,
    held: list[torch.Tensor],
    contexts: list[torch.Tensor],
    last: int,
) -> ModelOutput:
    """Blocks 0..last on ``held = [hidden]`` (taken out), cross-attention reading
    ``contexts = [c]`` (taken out by the last that reads it)."""
    hidden = held.pop()
    gather = run.gather
    position_bias: list[torch.Tensor] = []  # T5: block 0's relative bias, read by the others
    cross_left = sum(
        s.kind == "cross_attention" for b in model.blocks[: last + 1] for s in b.sublayers
    )
    result = None
    windows: dict[int, torch.Tensor] = {}
    shown_weights: dict[tuple[int, str], tuple[torch.Tensor, int]] = {}
    for n in range(last + 1):
        if gather is not None:
            gather(n, hidden)
        block_record = run.records.get(n, no_record)
        if n > 0:
            block_record("hidden", hidden, "B L D" if run.group is None else run.group.hidden)
        for sublayer in model.blocks[n].sublayers:
            own = sublayer_weights(run.weights, sublayer_prefix(n, sublayer))
            owned = [hidden]  # the sublayer takes its input: freed when it is done with it
            del hidden
            result = None
            if isinstance(sublayer, Attention):
                keys = None
                cross = sublayer.kind == "cross_attention"
                if cross:
                    cross_left -= 1  # the last reader takes the context: freed after it
                    keys = contexts if cross_left == 0 else list(contexts)
                result = _attention(run, n, sublayer, own, owned, keys, block_record, position_bias)
                if result.window is not None:
                    windows.setdefault(n, result.window)  # the block's first attention
                    shown_weights[n, sublayer.name] = (result.window, result.key_start)
                hidden = result.output
            else:
                hidden = feed_forward(sublayer, own, owned, block_record, run.group)
    if gather is not None:
        gather(last + 1, hidden)
    if result is None:
        return ModelOutput(hidden, None, None, windows, shown_weights)
    return ModelOutput(hidden, result.attention_output, result.weights, windows, shown_weights)


def _attention(
    run: _Run,
    n: int,
    sublayer: Attention,
    own: dict[str, torch.Tensor],
    owned: list[torch.Tensor],
    keys: list[torch.Tensor] | None,
    block_record: Record,
    position_bias: list[torch.Tensor],
) -> AttentionResult:
    """Block ``n``'s attention sublayer on ``owned = [hidden]`` (taken out), with the run's
    padding, windows shown, caches and split."""
    cross = sublayer.kind == "cross_attention"
    padding = run.padding
    if cross and run.context_padding is not None:
        padding = run.context_padding
    past = None if run.caches is None else run.caches[n].setdefault(sublayer.name, KVCache())
    return attention(
        sublayer,
        own,
        owned,
        context=keys,
        padding=padding,
        record=stage_prefix(sublayer, block_record),
        keep_weights=run.keep_weights,
        window=run.window if n in run.shown else None,
        training=run.training,
        cache=run.cache,
        past=past,
        offset=run.offset,
        position_bias=position_bias,
        group=run.group,
    )


def final_norm(model: ModelDescription, weights: dict[str, torch.Tensor], hidden: torch.Tensor):
    """The stack's norm after its last block (B, L, D), where it has one."""
    norm = model.final_norm
    if norm is None:
        return hidden
    weight, bias = weights["final_norm.weight"], weights.get("final_norm.bias")
    if norm.type == "rms":
        return F.rms_norm(hidden, (hidden.shape[-1],), weight, norm.eps)
    return F.layer_norm(hidden, (hidden.shape[-1],), weight, bias, norm.eps)


def logits(
    model: ModelDescription, weights: dict[str, torch.Tensor], hidden: torch.Tensor
) -> torch.Tensor:
    """(B, L, D) final-normed hidden states -> (B, L, V) logits through the LM head."""
    head = model.head
    if head is None:
        raise AttnctlError("this model has no LM head: it cannot generate")
    if head.scale:  # T5 with tied embeddings: the hidden states times D^-0.5 first
        hidden = hidden * head.scale
    matrix = weights["embedding.weight"] if head.tied else weights["lm_head.weight"]  # (V, D)
    bias = weights.get("lm_head.bias")  # (V,), or Marian's and BART's (1, V)
    scores = F.linear(hidden, matrix, None if bias is None else bias.reshape(-1))  # (B, L, V)
    if head.softcap:  # Gemma 2: cap·tanh(logits/cap)
        scores = torch.tanh(scores / head.softcap) * head.softcap
    return scores
