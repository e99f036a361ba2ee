"""A split's report, as data the renderers read: each pipeline stage's memory on one
device (:class:`StageMemory`), the optimizer's pieces on a rank, the longest input that
fits, and the notes that say what the table leaves unsaid (:func:`split_notes`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attnctl.memory.estimate import (
    format_bytes,
)
from attnctl.model.layout import (
    Layout,
    kv_replicas,
)
from attnctl.replay.step import PHASES


@dataclass(frozen=True)
class StageMemory:
    """One device of pipeline stage ``stage`` (any of its tensor-parallel ranks)."""

    stage: int
    kind: str  # "first", "middle", "last"; "all" without pipeline parallelism
    blocks: tuple[int, int]  # the first and the last block it holds
    weights_bytes: int  # its share of the weights (under ZeRO 3 its shard of them)
    gradients_bytes: int  # in the dtype (under ZeRO 2 and 3 its shard)
    optimizer_bytes: int  # Adam's moments and the master weights (ZeRO 1+: a shard)
    master_bytes: int  # of optimizer_bytes, the float32 masters (mixed precision)
    gathered_bytes: int  # ZeRO 3: the largest unit's (a block's, the embeddings') gathered
    activations_bytes: int
    kv_cache_bytes: int
    in_flight: int  # micro-batches whose activations it holds at once
    # training: the device's bytes at the busiest point of each phase (forward,
    # backward, optimizer step), whose largest is the peak; () in inference
    phase_peak_bytes: tuple[int, ...] = ()
    # whether it holds vocabulary rows (the token embedding's, an LM head's): a middle
    # pipeline stage holds none
    vocab_rows: bool = False

    @property
    def peak_phase(self) -> str | None:
        if not self.phase_peak_bytes:
            return None
        return PHASES[self.phase_peak_bytes.index(self.peak_bytes)]

    @property
    def held_bytes(self) -> int:
        """The parts above added up (what a sum of them would say)."""
        return (
            self.weights_bytes
            + self.gradients_bytes
            + self.optimizer_bytes
            + self.gathered_bytes
            + self.activations_bytes
            + self.kv_cache_bytes
        )

    @property
    def peak_bytes(self) -> int:
        """Training: the busiest phase (the optimizer state exists only in the step, the
        activations only before it, a backward's transients on top); inference: the sum."""
        if self.phase_peak_bytes:
            return max(self.phase_peak_bytes)
        return self.held_bytes


@dataclass(frozen=True)
class RankOptimizer:
    """What Adam holds on one data-parallel rank: the values of its tensors (ZeRO: its
    pieces of the flat buffer), how many tensors (a 4-byte step count each), its largest
    sqrt(v) + denom beside the previous denom (``replay.step.adam_temporaries``)."""

    rank: int
    values: int
    tensors: int
    temporaries: int


@dataclass(frozen=True)
class ParallelFit:
    """What fits ``budget_bytes`` on every device (the worst stage decides)."""

    budget_bytes: int
    max_seq_len: int  # at the micro-batch asked for (0: none fits)
    max_micro_batch: int  # at the length asked for, as many micro-batches per step


@dataclass(frozen=True)
class ParallelReport:
    """``memory`` of a split: a row of :class:`StageMemory` per pipeline stage."""

    layout: Layout
    what: str  # "the layer" or the model's name
    seq_len: int
    batch: int  # sequences each data-parallel copy takes a step
    micro_batch: int
    micro_batches: int  # per step: batch / micro_batch
    blocks: int
    heads: int
    kv_heads: int
    dtype: str
    train: bool
    kv_cache_tokens: int
    stages: tuple[StageMemory, ...]
    notes: tuple[str, ...]
    fit: ParallelFit | None = None
    # measured on torch.distributed (memory --measure): [{rank, peak_bytes,
    # measured_peak_bytes, collective_buffer_bytes}, ...], of a training step with
    # phase_peak_bytes and measured_phase_peak_bytes too; None: not measured
    measured_per_rank: list[dict[str, int]] | None = None
    windows: tuple[int, ...] = ()  # the blocks' sliding windows (their K/V keep W tokens)

    @property
    def kv_replicas(self) -> int:
        return kv_replicas(self.kv_heads, self.layout.tp)


def steady_peak(stages: tuple[StageMemory, ...]) -> int:
    """The busiest device's peak from the second step on, when Adam's moments (its
    optimizer bytes less the masters) are held through the forward and the backward."""
    peaks = []
    for row in stages:
        forward, backward, step = row.phase_peak_bytes
        moments = row.optimizer_bytes - row.master_bytes
        peaks.append(max(forward + moments, backward + moments, step))
    return max(peaks)


def _stage_runs(sizes: list[int]) -> str:
    """[8, 8, 8, 7, 7] -> 'stages 0–2: 8 blocks each, stages 3–4: 7 each'."""
    runs: list[tuple[int, int, int]] = []  # (first stage, last stage, blocks)
    for stage, size in enumerate(sizes):
        if runs and runs[-1][2] == size:
            runs[-1] = (runs[-1][0], stage, size)
        else:
            runs.append((stage, stage, size))
    parts = []
    for n, (first, last, size) in enumerate(runs):
        where = f"stage {first}" if first == last else f"stages {first}–{last}"
        noun = "block" if size == 1 else "blocks"
        each = "" if first == last else " each"
        parts.append(f"{where}: {size} {noun}{each}" if n == 0 else f"{where}: {size}{each}")
    return ", ".join(parts)


def split_notes(split: Any, stages: tuple[StageMemory, ...], micro_batches: int) -> tuple[str, ...]:
    """What the per-device table leaves unsaid: how the ranks of a stage compare, what
    the pipeline holds in flight, which ZeRO stage shards what. ``split``: the
    :class:`attnctl.parallel.split.Split` (which imports this module, so not named here)."""
    said = _placement_notes(split)
    if split.train:
        said += _training_notes(split, stages, micro_batches)
    else:
        said.append(
            "inference: the busiest block's activations of one micro-batch; the KV "
            "cache of the stage's blocks for every sequence"
        )
    layout = split.layout
    if layout.pp > 1 and split.description.head is not None and split.description.head.tied:
        said.append("the tied LM head: the last stage holds a copy of the embedding")
    return tuple(said)


def _placement_notes(split: Any) -> list[str]:
    """How the tensor-, context- and pipeline-parallel ranks of a stage compare."""
    layout, config = split.layout, split.description.config
    said = []
    if layout.tp > 1:
        said.append(
            f"each of a stage's {layout.tp} tensor-parallel ranks holds the same bytes: "
            "the table is one of them"
        )
        replicas = kv_replicas(config.kv_heads, layout.tp)
        if replicas > 1:
            said.append(
                f"--tp {layout.tp} is more than the {config.kv_heads} "
                f"kv-head{'s' * (config.kv_heads != 1)}: each "
                f"kv-head (W_k, W_v and its K, V) is replicated on {replicas} ranks"
            )
    if layout.cp > 1:
        causal = split.layer.mask == "causal"
        which = "the busiest of them"
        if causal and split.train:
            which = (f"the busier of ranks {layout.cp - 2} and {layout.cp - 1} (the last "
                     "runs the most ring steps; the one before holds its gradients' "
                     "receive buffers through the backward)")  # fmt: skip
        elif not causal:
            which = "every rank alike (no mask: each runs every ring step)"
        said.append(
            f"--cp {layout.cp}: each rank holds L / {layout.cp} of the tokens; the table "
            f"is {which}"
            + ("; ring attention's backward is its own ring (dK, dV travel with their "
               "chunk), replayed as it runs" if split.train else "")
        )  # fmt: skip
    counts = {len(r) for r in split.ranges}
    if len(counts) > 1:
        spread = _stage_runs([len(r) for r in split.ranges])
        said.append(
            f"uneven split of {split.block_count} blocks over {layout.pp} stages ({spread})"
        )
    return said


def _training_notes(split: Any, stages: tuple[StageMemory, ...], micro_batches: int) -> list[str]:
    """What a training step's table counts: Adam, ZeRO, the phases, 1F1B, recompute."""
    layout = split.layout
    said = []
    mixed = split.layer.dtype != "float32"
    said.append(
        "Adam: two float32 moments (8 bytes a value)"
        + (", float32 master weights (4 bytes a value)" if mixed else "; float32: no masters")
        + f", gradients in {split.layer.dtype}"
    )
    if layout.zero:
        sharded = {1: "moments and masters", 2: "moments, masters and gradients",
                   3: "moments, masters, gradients and weights"}[layout.zero]  # fmt: skip
        said.append(
            f"ZeRO {layout.zero} shards the {sharded} over {split.state_ranks} ranks "
            f"(--dp {layout.dp}"
            + (f" × --cp {layout.cp}" if layout.cp > 1 else "")
            + "): ⌈n / ranks⌉ values each (a flat buffer padded to a multiple of the "
            "ranks); Adam steps a rank's pieces of it (each tensor's part in its range): "
            "the table is the busiest rank's"
        )
    said.append(
        "peak: the busiest phase of one step, replayed as on one device (memory "
        "--train) on the rank's plan over the stage's blocks, the backward's "
        "transients with it, and the layout's gradients, optimizer state and masters "
        "in place of one device's"
    )
    if stages:
        said.append(
            "the first step, as on one device: Adam's moments are made by its "
            "optimizer step; from the second step on they are held through the "
            f"forward and backward too (then {format_bytes(steady_peak(stages))} on "
            "the busiest device)"
        )
    if layout.zero >= 2:
        said.append(
            f"ZeRO {layout.zero}: each gradient is reduce-scattered as it arrives "
            "(a bucket of one tensor) and freed; the rank's shard of them (⌈n / "
            "ranks⌉ values) is held the whole step. A bigger bucket holds up to its "
            "size of whole gradients more"
        )
    if layout.zero == 3:
        said.append(
            "ZeRO 3 gathers a unit's weights (the embeddings', each block's) while "
            "its forward runs, and again from its backward's first node to its "
            "last gradient, one unit at a time (gathered: the largest)"
        )
    if layout.pp > 1:
        said.append(
            "1F1B: stage p holds the activations of min(P − p, micro-batches) "
            "micro-batches at once; every stage's step is replayed with the first "
            "stage's embeddings and the loss (a later stage holds a little less)"
        )
    if any(row.in_flight < micro_batches for row in stages):
        said.append(
            "more micro-batches a step than in flight: the gradients accumulated "
            "so far are held beside each later forward and backward, whose own "
            "arriving gradients are counted again (an overcount of at most the "
            "stage's gradients)"
        )
    if layout.recompute == "selective":
        said.append(
            "selective recompute: no B·H·L·L tensor is saved; one block's are "
            "recomputed during its backward (counted once, beside the replay's "
            "peak, not replayed)"
        )
    elif layout.recompute == "full":
        said.append(
            "full recompute: each block saves its input only; one block's "
            "activations are recomputed during its backward (counted once, beside "
            "the replay's peak, not replayed)"
        )
    if split.model is not None and split.model.source.head_table:
        said.append(
            "as the single-device step, the loss is the last block's output: an LM "
            "head's gradients and logits are not counted"
        )
    return said
