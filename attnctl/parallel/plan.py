"""One rank's plan and weights when a model is split over devices. No torch.

A tensor-parallel rank runs the same blocks with H / T heads, Hkv / T kv-heads (one,
replicated, when T > Hkv) and I / T feed-forward columns: :func:`rank_description`
cuts the description so, and :func:`rank_plan` walks it with the collectives between
the sublayers (``stages/collectives.py``). The stages' dims are renamed to say what is
divided (``B H/T L L``), and the sizes keep both names.

:func:`rank_weights` gives each weight's share on a rank of one pipeline stage, by the
layout's names (``blocks.3.attention.W_q.weight``), with the rule that cut it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from attnctl.errors import AttnctlError
from attnctl.memory.estimate import live_bytes_per_stage
from attnctl.model.checkpoint import TensorEntry
from attnctl.model.config import LayerConfig
from attnctl.model.describe import (
    CROSS_ATTENTION,
    Attention,
    Block,
    Checkpoint,
    FeedForward,
    ModelDescription,
    seeded_model,
)
from attnctl.model.layout import (
    Layout,
    check_blocks,
    check_heads,
    check_inner,
    check_length,
    share,
    vocab_rows,
)
from attnctl.stages.embeddings import check_positions
from attnctl.stages.plan import Plan, build_plan, layer_parameters
from attnctl.stages.ring_attention import RING_KERNEL, check_ring

SHARED_FIRST = ("embedding.", "positions.", "segment.", "embedding_norm.")  # first stage's
SHARED_LAST = ("final_norm.", "lm_head.")  # the last stage's
# ring attention is planned step by step (C steps, each its stages): the ranks it plans for
MOST_RING_RANKS = 256


def check_split(
    layout: Layout,
    description: ModelDescription,
    lengths: list[int],
    layers: int = 1,
    padded: bool = False,
) -> None:
    """Every check of the layout against the model and the lengths, before any planning:
    what does not divide, and what attnctl does not model split (refused by name).
    ``layers``: the seeded layer's stack (a checkpoint has its own blocks); ``padded``:
    padded keys are masked (``--pad``). A training step is checked the same way: ring
    attention trains (``nn/ring_attention.RingAttention``)."""
    if description.is_encoder_decoder:
        raise AttnctlError(
            "a split of an encoder–decoder (--tp, --sp, --cp, --pp, --dp) is not modelled "
            "yet: attnctl splits decoder-only models and the seeded layer"
        )
    if layout.cp > MOST_RING_RANKS:
        raise AttnctlError(
            f"--cp {layout.cp} is more than the {MOST_RING_RANKS} ranks attnctl plans ring "
            "attention for (each of the C steps is planned)"
        )
    blocks = description.blocks
    for index, block in enumerate(blocks):
        where = f"of block {index}" if len(blocks) > 1 else ""
        for sublayer in block.sublayers:
            if isinstance(sublayer, Attention):
                config = sublayer.config
                check_heads(layout, config.heads, config.kv_heads, where)
                if sublayer.kind == CROSS_ATTENTION:
                    raise AttnctlError(
                        "a split of cross-attention (--context-len) is not modelled yet"
                    )
                if layout.tp > 1 and config.pos == "alibi":
                    raise AttnctlError(
                        "--tp with ALiBi is not modelled yet: each rank's slopes depend on "
                        "its heads' places among all H"
                    )
                if layout.tp > 1 and config.qk_norm == "all":
                    raise AttnctlError(
                        "--tp with a q/k norm over every head at once (OLMo 2) is not "
                        "modelled yet: its mean square would need a sum across the ranks"
                    )
                if layout.tp > 1 and config.dropout:
                    raise AttnctlError("--tp with attention dropout is not modelled yet")
                if layout.cp > 1:
                    check_ring(config, padded)
            elif isinstance(sublayer, FeedForward):
                check_inner(layout, sublayer.inner, where)
    for length in lengths:
        check_length(layout, length)
    check_blocks(layout, len(blocks) if description.checkpoint is not None else layers)


def rank_config(config: LayerConfig, tp: int) -> LayerConfig:
    """One tensor-parallel rank's attention: H / T heads of the same width d_k, and
    Hkv / T kv-heads (one when T > Hkv: each kv-head replicated T / Hkv times)."""
    if tp == 1:
        return config
    return dataclasses.replace(
        config,
        heads=config.heads // tp,
        kv_heads=max(config.kv_heads // tp, 1),
        head_dim=config.d_k,
    )


def rank_description(description: ModelDescription, tp: int) -> ModelDescription:
    """The model one tensor-parallel rank runs: every attention cut to its heads, every
    feed-forward to I / T columns (the embeddings' rows are in :func:`rank_weights`)."""
    if tp == 1:
        return description
    blocks = tuple(
        Block(
            tuple(
                dataclasses.replace(s, config=rank_config(s.config, tp))
                if isinstance(s, Attention)
                else dataclasses.replace(s, inner=s.inner // tp)
                for s in block.sublayers
            )
        )
        for block in description.blocks
    )
    stack = None if description.stack is None else rank_config(description.stack, tp)
    return dataclasses.replace(description, blocks=blocks, stack=stack)


def holds_apart(layout: Layout) -> bool:
    """Whether a device of ``layout`` holds each of a checkpoint's weights as a tensor of
    its own, by the layout's names: every rank of a split does (``shard_weights`` cuts
    and clones each one, a fused tensor's parts and a transposed one alike); one device
    (``--micro-batch`` or ``--recompute`` alone) holds them as the checkpoint stores them."""
    return layout.ranks > 1


def held_apart(source: Checkpoint) -> Checkpoint:
    """``source`` with its table as a rank holds it: a fused tensor's parts (GPT-2's
    c_attn, Phi-3's qkv_proj) and a transposed one (GPT-2's Conv1D) each an entry of
    its own, by the layout's name, in nn.Linear's (out, in) layout. Their shapes are the
    whole model's (the rank's cut is :func:`rank_weights`'); no view is left, so a
    training step's replay has no view of a stored tensor to follow back."""
    table: list[TensorEntry] = []
    for entry in source.table:
        shape = entry.shape[::-1] if entry.transposed else entry.shape  # (out, in)
        if len(entry.targets) > 1 and entry.split:  # its parts, along dim 0
            table += [
                TensorEntry(target, (rows, *shape[1:]), entry.block, (target,))
                for target, rows in zip(entry.targets, entry.split, strict=True)
            ]
        elif entry.transposed:
            table.append(dataclasses.replace(entry, shape=shape, transposed=False))
        else:
            table.append(entry)
    return dataclasses.replace(source, table=tuple(table))


def rank_plan(
    config: LayerConfig,
    seq_len: int,
    batch: int,
    vocab_size: int,
    layout: Layout,
    model: ModelDescription | None = None,
    layer_index: int = 0,
    device: str = "",
    cp_rank: int | None = None,
) -> Plan:
    """The stages one rank computes for block ``layer_index`` (with the embeddings when it
    is block 0, else from the block before's output) of ``batch`` sequences of
    ``seq_len`` tokens, under ``layout``'s tensor (and sequence) and context parallelism.

    ``config``: the seeded layer, or a checkpoint's run settings (as :func:`build_plan`).
    The caller has run :func:`check_split`. Under context parallelism the rank holds
    L / C tokens (``seq_len``, ``sizes["L"]`` are its chunk's; dims named ``L/C``) and
    its attention is ring attention (``stages/ring_attention.py``); ``cp_rank``: which
    chunk, by default the busiest rank's (the one whose peak is the largest).
    """
    tp, cp = layout.tp, layout.cp
    if cp_rank is None and cp == 1:
        cp_rank = 0
    if cp_rank is None:
        # without a mask every rank runs the same steps; under the causal mask rank r runs
        # r + 1 of them, sending and receiving alike, but the last never sends: the
        # busiest is C - 2 or C - 1
        plans = [
            rank_plan(config, seq_len, batch, vocab_size, layout, model, layer_index, device, r)
            for r in (cp - 2, cp - 1)
        ]
        return max(plans, key=lambda plan: max(live_bytes_per_stage(plan)))
    if not 0 <= cp_rank < cp:
        raise AttnctlError(f"context-parallel rank {cp_rank} is not one of the {cp} ranks")
    chunk = seq_len // cp  # check_split: C divides the length
    if cp > 1:  # the positions are the whole sequence's: a learned table must hold them
        description = model if model is not None else seeded_model(config, vocab_size)
        check_positions(description.embeddings, seq_len)
    ring = dict(context_parallel=cp, context_rank=cp_rank)
    if model is not None:
        local = rank_description(model.with_run(config), tp)
        if holds_apart(layout):
            local = dataclasses.replace(local, checkpoint=held_apart(local.source))
        plan = build_plan(
            config, chunk, batch, vocab_size, device, model=local, layer_index=layer_index,
            tensor_parallel=tp, sequence_parallel=layout.sp, **ring,
        )  # fmt: skip
        parameters = plan.parameters  # the model's tensors, cut per rank by rank_weights
    else:
        local_config = rank_config(config, tp)
        plan = build_plan(
            local_config, chunk, batch, vocab_size, device,
            tensor_parallel=tp, sequence_parallel=layout.sp, **ring,
        )  # fmt: skip
        parameters = layer_parameters(local_config, vocab_rows(vocab_size, tp))
    if cp > 1 and plan.config.impl != "math":
        raise AttnctlError(RING_KERNEL)
    full = model.config if model is not None else config
    return _renamed(dataclasses.replace(plan, parameters=parameters), full, tp, cp)


def _renamed(plan: Plan, full: LayerConfig, tp: int, cp: int = 1) -> Plan:
    """The plan's stages with their dims named as divided: H -> H/T, I -> I/T, L -> L/C,
    ..."""
    if tp == 1 and cp == 1:
        return plan
    replicated = tp > full.kv_heads
    names = {}
    if tp > 1:
        names = {
            "H": "H/T",
            "Hkv": "1" if replicated else "Hkv/T",
            "D_q": "D_q/T" if full.q_width != full.d_model else "D/T",
            "D_kv": "d_k" if replicated else "D_kv/T",
            "I": "I/T",
        }
    if cp > 1:  # sizes["L"] stays the rank's chunk, as sizes["H"] its heads
        names.update({"L": "L/C", "L/T": "L/(C·T)"})
    sizes = dict(plan.sizes)
    for old, new in names.items():
        if old in sizes:
            sizes[new] = sizes[old]
    sizes["1"] = 1
    stages = [
        dataclasses.replace(stage, dims=tuple(names.get(d, d) for d in stage.dims))
        for stage in plan.stages
    ]
    return dataclasses.replace(plan, stages=stages, sizes=sizes)


@dataclass(frozen=True)
class WeightShare:
    """One weight on one rank: the layout's name, its whole shape and its rank's values."""

    name: str
    shape: tuple[int, ...]
    values: int  # on this rank
    rule: str  # how it is cut: "rows / T", "columns / T", "vocab rows ⌈V/T⌉", "replicated", ...
    copies: int = 1  # a seeded stack's per-layer weights: one per layer
    read: bool = True  # False: stored, but no block reads it (BERT's pooler): not trained


def rank_weights(
    description: ModelDescription,
    layout: Layout,
    stage: int = 0,
    layers: int = 1,
) -> list[WeightShare]:
    """Every weight pipeline stage ``stage`` holds on one of its tensor-parallel ranks.

    A checkpoint's blocks are its own; the seeded layer is a stack of ``layers`` (its
    embeddings once). The first stage holds the embeddings; the last the final norm and
    the LM head, or with tied embeddings (P > 1) a copy of the token embedding as its
    head, as Megatron keeps one.
    """
    pp, tp = layout.pp, layout.tp
    if description.checkpoint is None:
        return _seeded_weights(description, layout, stage, layers)
    owned = layout.stage_ranges(description.layers)[stage]
    source = description.source
    shares = []
    last = stage == pp - 1
    table = held_apart(source).table if holds_apart(layout) else source.table
    for entry in table + source.head_table:
        if entry.block >= 0 and entry.block not in owned:
            continue
        key = entry.targets[0]
        if entry.block < 0:
            first_only = key.startswith(SHARED_FIRST)
            if first_only and stage != 0:
                continue
            if key.startswith(SHARED_LAST) and not last:
                continue
        config = description.blocks[max(entry.block, 0)].attention.config
        if len(entry.targets) > 1 and entry.split:  # a fused tensor: each part its own rule
            rest = 1
            for n in entry.shape[1:] if not entry.transposed else entry.shape[:1]:
                rest *= n
            values, rules = 0, []
            for target, rows in zip(entry.targets, entry.split, strict=True):
                part, rule = share(target, (rows, rest), config, tp)
                values += part
                rules.append(rule)
            rule = " + ".join(dict.fromkeys(rules))
        else:
            shape = entry.shape[::-1] if entry.transposed else entry.shape  # (out, in)
            values, rule = share(key, shape, config, tp)
        shares.append(WeightShare(entry.key, entry.shape, values, rule))
    if last:  # stored and read by no block (BERT's pooler): held whole, by the last stage
        read = {entry.stored_key(source.prefix) for entry in source.table + source.head_table}
        for key, info in description.weights().items():
            if key not in read:
                values = 1
                for n in info.shape:
                    values *= n
                shares.append(WeightShare(key, tuple(info.shape), values, "replicated", read=False))
    head = description.head
    if pp > 1 and last and head is not None and head.tied:
        embedding = next(e for e in source.table if e.targets[0] == "embedding.weight")
        values, rule = share("embedding.weight", embedding.shape, description.config, tp)
        shares.append(WeightShare("lm_head (tied: the embedding's copy)", embedding.shape,
                                  values, rule))  # fmt: skip
    return shares


def _seeded_weights(
    description: ModelDescription, layout: Layout, stage: int, layers: int
) -> list[WeightShare]:
    config = description.stack or description.config
    owned = layout.stage_ranges(layers)[stage]
    shares = []
    for parameter in layer_parameters(config, description.vocab_size):
        shared = parameter.name.startswith(SHARED_FIRST)
        if shared and stage != 0:
            continue
        values, rule = share(parameter.name, parameter.shape, config, layout.tp)
        copies = 1 if shared else len(owned)
        shares.append(WeightShare(parameter.name, parameter.shape, values, rule, copies))
    return shares
