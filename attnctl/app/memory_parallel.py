"""``memory`` with a split (--tp, --sp, --cp, --pp, --dp, --zero, --micro-batch,
--recompute): what one device of each pipeline stage holds.

Every check of the options and of the options against the model runs first (one line,
exit 2); then, per pipeline stage, on one of its tensor-parallel ranks (they are alike):

- weights: each weight's share on the rank (``plan_parallel.rank_weights``);
- training with Adam: gradients in the dtype, two float32 moments, float32 master
  weights under mixed precision; ZeRO 1 shards the moments and masters over the D·C
  data-parallel ranks (context-parallel ranks hold the same weights, so they share the
  shards, as Megatron's distributed optimizer does), ZeRO 2 the gradients too, ZeRO 3
  the weights too: each rank ⌈n / (D·C)⌉ values of a flat buffer padded to a multiple
  of D·C, plus the largest unit's parameters (a block's, or the embeddings') gathered;
- activations of one micro-batch: in inference the busiest block's peak (the rank's
  plan, ``plan_parallel.rank_plan``); in training what each block saves for the
  backward (``training.saved_activations``, the step's replay on the rank's plan) times
  the stage's blocks times the micro-batches in flight under 1F1B, less what
  ``--recompute`` recomputes;
- the KV cache (inference): the stage's blocks, each rank's kv-heads, L / C positions.

In inference the per-device peak is their sum. In training it is the busiest phase of
the step (``training_phases``): the single-device replay (``training.replay_step``) of
the rank's plan over the stage's blocks, with the replay's own masters, gradients and
optimizer state replaced by the layout's, plus the other micro-batches in flight, the
gradients already accumulated, ZeRO 3's gathered block. Nothing here prints;
:mod:`attnctl.render` shows it.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from attnctl.app.inputs import parse_lengths
from attnctl.app.requests import Hooks, MemoryRequest
from attnctl.config import DTYPE_BYTES, LARGEST_SIZE, LayerConfig
from attnctl.describe import ModelDescription
from attnctl.errors import AttnctlError
from attnctl.memory import (
    format_bytes,
    largest_fitting,
    live_bytes_per_stage,
    longest_input,
    parse_size,
)
from attnctl.parallel import (
    LARGEST_SPLIT,
    Layout,
    check_batch,
    check_layout,
    in_flight,
    kv_replicas,
    stage_kind,
    zero_distinct_ranks,
    zero_pieces,
)
from attnctl.plan import Plan, seeded_model
from attnctl.plan_parallel import SHARED_FIRST, WeightShare, check_split, rank_plan, rank_weights
from attnctl.report import MemoryCommandReport
from attnctl.tokenize import vocab_size
from attnctl.training import PHASES, SavedActivations, StepReplay, adam_temporaries
from attnctl.training_stages import EMBEDDING_STAGES, INPUTS

FP32 = 4
ADAM_MOMENTS = 2  # float32 values per trained value
TIED_HEAD = "lm_head (tied"  # rank_weights' name of the last stage's copy of the embedding


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
    sqrt(v) + denom beside the previous denom (``training.adam_temporaries``)."""

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


# ---------------------------------------------------------------- checks


def check_request(request: MemoryRequest, layer: LayerConfig, model: ModelDescription | None):
    """Every refusal of a split's request, before any planning: (length, micro-batches
    per step, the model's description)."""
    layout = request.layout
    check_layout(layout, train=request.train, measure=request.measure)
    if request.generate is not None:
        raise AttnctlError("--generate with a split is not modelled yet: leave out one of them")
    if request.context_len is not None:
        raise AttnctlError("a split of cross-attention (--context-len) is not modelled yet")
    if request.budget is not None and request.fit_device:
        raise AttnctlError("give --budget SIZE or --fit, not both")
    if request.budget is not None:
        parse_size(request.budget)  # read before anything is planned
    if request.train and request.kv_cache is not None:
        raise AttnctlError("--kv-cache is inference's: a training step keeps no KV cache")
    if model is not None and request.layers != 1:
        raise AttnctlError("--layers does not apply to --model (a whole model's memory)")
    lengths = parse_lengths(request.seq_len) if request.seq_len is not None else None
    if lengths is not None and len(lengths) > 1:
        raise AttnctlError(
            f"a split's per-device memory is for one --seq-len: give one length, not {len(lengths)}"
        )
    length = lengths[0] if lengths else min(2048, longest_input(layer, model) or 2048)
    micro_batches = check_batch(layout, request.batch)
    if request.measure and request.train and micro_batches > 1:  # the ranks run one
        raise AttnctlError(
            f"--measure --train runs a step of one micro-batch; --micro-batch "
            f"{layout.micro_batch} of --batch {request.batch} accumulates {micro_batches}, "
            "estimated only: leave out --micro-batch (or make it --batch) to measure"
        )
    description = _description(layer, model, length)
    check_split(layout, description, [length], request.layers)
    if request.kv_cache is not None and request.kv_cache < 0:
        raise AttnctlError(f"--kv-cache must be a number of tokens >= 0, got {request.kv_cache}")
    if request.kv_cache is not None and request.kv_cache >= LARGEST_SIZE:
        raise AttnctlError(
            f"--kv-cache must be below 2^63 (torch's largest size), got {request.kv_cache}"
        )
    return length, micro_batches, description


def _description(
    layer: LayerConfig, model: ModelDescription | None, length: int
) -> ModelDescription:
    if model is not None:
        return model.with_run(layer)
    return seeded_model(layer, vocab_size(layer.tokenizer, length))


# ---------------------------------------------------------------- the use case


def parallel_memory_use_case(
    request: MemoryRequest,
    layer: LayerConfig,
    model: ModelDescription | None,
    single_device: Callable[[MemoryRequest], MemoryCommandReport],
    hooks: Hooks,
) -> MemoryCommandReport:
    """The whole model on one device (as without the split: ``single_device``), and
    beside it every pipeline stage's device."""
    length, micro_batches, description = check_request(request, layer, model)
    layout = request.layout
    whole = single_device(
        dataclasses.replace(
            request, layout=Layout(), seq_len=str(length), budget=None, fit_device=False
        )
    )
    split = Split(layer, model, description, layout, request.train, request.layers)
    micro = layout.micro_batch or request.batch
    kv_tokens = request.kv_cache if request.kv_cache is not None else length
    with hooks.progress(f"planning {layout.summary()}"):
        stages = split.per_device(length, micro, micro_batches, kv_tokens, request.batch)
    budget = None
    if request.fit_device:
        from attnctl.app.use_cases import _device_free_bytes

        budget = _device_free_bytes(layer.device)
    elif request.budget is not None:
        budget = parse_size(request.budget)
    fit = None
    if budget is not None:
        fit = split.fit(budget, length, micro, micro_batches, request.kv_cache, request.batch)
    measured = None
    if request.measure:
        from attnctl.distributed import measure_split

        processes = layout.ranks  # T · C, or D (each run alone)
        what = "a training step" if request.train else "a forward pass"
        with hooks.progress(f"measuring {what} on {processes} gloo processes"):
            ranks = measure_split(
                layer, length, micro, description.vocab_size, layout, model,
                force=request.force, train=request.train, layers=request.layers,
            )  # fmt: skip
        measured = [
            {
                "rank": rank.rank,
                "peak_bytes": rank.peak_bytes,
                "measured_peak_bytes": rank.measured_peak_bytes,
                "collective_buffer_bytes": rank.collective_buffer_bytes,
            }
            for rank in ranks
        ]
        if request.train:  # each phase's too: forward, backward, optimizer step
            for entry, rank in zip(measured, ranks, strict=True):
                weights, got = rank.parameter_bytes, rank.measured_parameter_bytes
                entry["phase_peak_bytes"] = [weights + b for b in rank.stage_peak_bytes]
                entry["measured_phase_peak_bytes"] = [
                    got + b for b in rank.measured_stage_peak_bytes
                ]
    config = description.config
    report = ParallelReport(
        layout=dataclasses.replace(layout, micro_batch=micro),
        what="the layer" if model is None else model.name,
        seq_len=length,
        batch=request.batch,
        micro_batch=micro,
        micro_batches=micro_batches,
        blocks=split.block_count,
        heads=config.heads,
        kv_heads=config.kv_heads,
        dtype=layer.dtype,
        train=request.train,
        kv_cache_tokens=0 if request.train else kv_tokens,
        stages=stages,
        notes=split.notes(stages, micro_batches),
        fit=fit,
        measured_per_rank=measured,
        windows=_windows(description, split.block_count),
    )
    return dataclasses.replace(whole, parallel=report)


def _windows(description: ModelDescription, blocks: int) -> tuple[int, ...]:
    """The distinct sliding windows of the blocks (a seeded stack's by its pattern)."""
    if description.checkpoint is None:
        every = description.stack_windows(min(blocks, 64))  # the pattern repeats
    else:
        every = description.layer_windows
    return tuple(sorted({window for window in every if window}))


class Split:
    """One model under one layout: the parts that do not depend on the length or the
    micro-batch (weights, training state) once, the rest per call."""

    def __init__(
        self,
        layer: LayerConfig,
        model: ModelDescription | None,
        description: ModelDescription,
        layout: Layout,
        train: bool,
        layers: int,
        cp_rank: int | None = None,
    ) -> None:
        self.layer, self.model, self.description = layer, model, description
        self.layout, self.train = layout, train
        # the context-parallel rank the plans are of (None: the busiest; in training under
        # the causal mask the busier of C - 2 and C - 1, each a split of its own)
        self.cp_rank = cp_rank
        self._ring_ranks: dict[int, Split] = {}
        self.layers = layers  # the seeded layer's stack
        self.block_count = model.layers if model is not None else layers
        self.ranges = layout.stage_ranges(self.block_count)
        self.element = DTYPE_BYTES[layer.dtype]
        self.shares = [
            rank_weights(description, layout, stage, layers) for stage in range(layout.pp)
        ]
        self.block_values = self._block_values() if layout.zero == 3 else []
        self._plans: dict[tuple[int, int, int], Plan] = {}  # kept between calls (--budget)
        self._peaks: dict[tuple[int, int, int, bool], int] = {}
        self._saved: dict[tuple[int, int], tuple[SavedActivations, int]] = {}
        self._steps: dict[tuple, StepReplay] = {}  # (length, micro, blocks, shard, units)
        self._optimizers: dict[int, list[RankOptimizer]] = {}  # per stage: its rank kinds
        self._ends: dict[int, list[int]] = {}  # per stage: the trained sizes' running sums
        self._sizes: dict[int, list[int]] = {}  # per stage: trained_sizes

    # ------------------------------------------------------------ weights and state

    @property
    def state_ranks(self) -> int:
        """The ranks ZeRO shards over: the data-parallel copies, and the context-parallel
        ranks of each (they hold the same weights)."""
        return self.layout.dp * self.layout.cp

    def weight_values(self, stage: int) -> int:
        return sum(share.values * share.copies for share in self.shares[stage])

    def trained_values(self, stage: int) -> int:
        """The values the training step updates: every weight the plan reads, which is
        all of them but an LM head and the final norm (the step's loss is the last
        block's output summed, as the single-device estimate's)."""
        return sum(share.values * share.copies for share in self._trained(stage))

    def _trained(self, stage: int) -> list[WeightShare]:
        """The stage's weights the step updates: not a head, nor one no block reads."""
        head = set()
        if self.model is not None:
            head = {entry.key for entry in self.model.source.head_table}
        return [
            share
            for share in self.shares[stage]
            if share.read and share.name not in head and not share.name.startswith(TIED_HEAD)
        ]

    def _block_values(self) -> list[int]:
        """Each block's values on one tensor-parallel rank (ZeRO 3's gathered copy): a
        checkpoint's by ``rank_weights`` with one block a stage, less what is not a
        block's; the seeded stack's blocks are alike (one entry)."""
        if self.model is None:
            shares = self.shares[0]
            return [sum(s.values for s in shares if not s.name.startswith(SHARED_FIRST))]
        one_each = dataclasses.replace(self.layout, pp=self.block_count)
        source = self.model.source
        shared = {e.key for e in source.table + source.head_table if e.block < 0}
        values = []
        for block in range(self.block_count):
            shares = rank_weights(self.description, one_each, block, self.layers)
            values.append(sum(s.values * s.copies for s in shares if not _shared(s, shared)))
        return values

    def unit_bytes(self, stage: int) -> tuple[int, ...]:
        """ZeRO 3's gathered units of the stage's step, as ``training.replay_step`` takes
        them: the trained weights outside the blocks (the embeddings', on the first
        stage), then each block's."""
        trained, e = self._trained(stage), self.element
        if self.model is None:
            shared = sum(s.values for s in trained if s.name.startswith(SHARED_FIRST))
            return (shared * e, self.block_values[0] * e)
        source = self.model.source
        keys = {entry.key for entry in source.table + source.head_table if entry.block < 0}
        shared = sum(s.values * s.copies for s in trained if _shared(s, keys))
        return (shared * e, *(self.block_values[b] * e for b in self.ranges[stage]))

    def rank_optimizer(self, stage: int, rank: int = 0) -> RankOptimizer:
        """What Adam holds on data-parallel rank ``rank`` (of D·C) of the stage: every
        trained tensor, or under ZeRO its pieces of the flat buffer (``zero_pieces``)."""
        sizes = self.trained_sizes(stage)
        if self.layout.zero:
            if stage not in self._ends:  # the running sums, once: a rank costs its pieces
                self._ends[stage] = list(itertools.accumulate(sizes))
            sizes = zero_pieces(sizes, self.state_ranks, rank, self._ends[stage])
        return RankOptimizer(rank, sum(sizes), len(sizes), adam_temporaries(sizes))

    def rank_optimizers(self, stage: int) -> list[RankOptimizer]:
        """One rank of every kind of the stage's (``zero_distinct_ranks``: their pieces are
        every rank's there is, found without a loop over D); kept per stage."""
        if stage not in self._optimizers:
            ranks = [0]
            if self.train and self.layout.zero:
                ranks = zero_distinct_ranks(self.trained_sizes(stage), self.state_ranks)
            kinds: dict[tuple[int, int, int], RankOptimizer] = {}  # the lowest rank of each
            for rank in ranks:
                held = self.rank_optimizer(stage, rank)
                kinds.setdefault((held.values, held.tensors, held.temporaries), held)
            self._optimizers[stage] = list(kinds.values())
        return self._optimizers[stage]

    def state(
        self, stage: int, optimizer_of: RankOptimizer | None = None
    ) -> tuple[int, int, int, int, int]:
        """(weights, gradients, optimizer, masters, gathered) bytes of one device: of the
        data-parallel rank ``optimizer_of`` says (None: rank 0, which holds S values)."""
        e, ranks, zero = self.element, self.state_ranks, self.layout.zero
        weights = self.weight_values(stage) * e
        if not self.train:
            return weights, 0, 0, 0, 0
        trained = self.trained_values(stage)
        shard = -(-trained // ranks) if zero else trained  # ⌈n / (D·C)⌉ of a padded buffer
        if optimizer_of is None:
            optimizer_of = self.rank_optimizer(stage, 0)
        mixed = self.layer.dtype != "float32"
        held = optimizer_of.values  # the rank's pieces' values (all of them without ZeRO)
        masters = held * FP32 if mixed else 0
        optimizer = held * ADAM_MOMENTS * FP32 + masters
        gradients = (shard if zero >= 2 else trained) * e
        gathered = 0
        if zero == 3:  # the untrained head stays whole; the trained values are sharded
            weights = (self.weight_values(stage) - trained + shard) * e
            gathered = max(self.unit_bytes(stage))  # the largest unit: a block's, or the
        return weights, gradients, optimizer, masters, gathered  # embeddings' (replayed)

    # ------------------------------------------------------------ activations

    def plan(self, length: int, micro: int, block: int = 0) -> Plan:
        """The rank's plan of ``block`` (a checkpoint's; the seeded layer's one), kept."""
        key = (length, micro, block)
        if key not in self._plans:
            vocab = self.description.vocab_size
            if self.model is None:
                plan = rank_plan(self.layer, length, micro, vocab, self.layout,
                                 cp_rank=self.cp_rank)  # fmt: skip
            else:
                plan = rank_plan(
                    self.layer, length, micro, vocab, self.layout, model=self.model,
                    layer_index=block, cp_rank=self.cp_rank,
                )  # fmt: skip
            self._plans[key] = plan
        return self._plans[key]

    def _distinct_blocks(self, stage: int) -> list[int]:
        """The stage's blocks that differ from each other (a checkpoint's sliding and
        full blocks); the seeded stack's are planned from its one block."""
        if self.model is None:
            return [0]
        first: dict[object, int] = {}
        for block in self.ranges[stage]:
            first.setdefault(self.description.blocks[block], block)
        return list(first.values())

    def inference_activations(self, length: int, micro: int, stage: int) -> int:
        """The busiest of the stage's blocks: the first stage's block 0 with the
        embeddings, any other block from its input on (it receives the hidden state, not
        the token ids)."""
        peaks = []
        for block in self._distinct_blocks(stage):
            key = (length, micro, block, stage == 0 and block == 0)
            if key not in self._peaks:
                plan = self.plan(length, micro, block)
                live = live_bytes_per_stage(plan)
                if key[-1]:
                    self._peaks[key] = max(live)
                else:
                    ids = sum(s.bytes for s in plan.stages if s.name == "token_ids")
                    self._peaks[key] = max(live[_block_start(plan) :]) - ids
            peaks.append(self._peaks[key])
        return max(peaks)

    def saved(self, length: int, micro: int) -> tuple[SavedActivations, int]:
        """One micro-batch's saved bytes by part, and a block's over every (query, key)
        pair among them (what selective recompute recomputes)."""
        from attnctl.training import saved_activations

        key = (length, micro)
        if key not in self._saved:
            plan = self.plan(length, micro)
            saved = saved_activations(plan)
            self._saved[key] = saved, attention_matrix_bytes(plan, saved.block_by_stage)
        return self._saved[key]

    def training_activations(self, length: int, micro: int, micro_batches: int, stage: int):
        """(bytes, micro-batches in flight): what the stage's blocks save for the
        backward, for each micro-batch in flight, as ``--recompute`` leaves it."""
        per_micro, working, _ = self.recompute_parts(length, micro, stage)
        held = in_flight(stage, self.layout.pp, micro_batches)
        return held * per_micro + working, held

    def recompute_parts(self, length: int, micro: int, stage: int) -> tuple[int, int, int]:
        """(what one micro-batch saves on the stage, what one block recomputes during its
        backward, what ``--recompute`` keeps from being saved over the stage's blocks)."""
        saved, matrices = self.saved(length, micro)
        blocks = len(self.ranges[stage])
        pp = self.layout.pp
        recompute = self.layout.recompute
        per_block, working = saved.block_bytes, 0
        if recompute == "selective":  # the B·H·L·L tensors, recomputed in the backward
            per_block, working = saved.block_bytes - matrices, matrices
        elif recompute == "full":  # each block's input; one block's whole in its backward
            per_block = self.block_input_bytes(length, micro)
            working = saved.block_bytes - per_block  # its saved set holds that input already
        per_micro = blocks * per_block
        if stage == 0:
            per_micro += saved.embedding_bytes
        if stage == pp - 1:
            per_micro += saved.loss_bytes
        return per_micro, working, blocks * (saved.block_bytes - per_block)

    def step_replay(
        self,
        length: int,
        micro: int,
        blocks: int,
        shard: int | None = None,
        units: tuple[int, ...] | None = None,
    ) -> StepReplay:
        """The single-device step of ``blocks`` of the rank's block over its embeddings,
        kept by (length, micro-batch, blocks, shard, units) between calls (--budget).
        ``shard``: the bytes of ZeRO 2's and 3's gradient shard, which each gradient is
        reduce-scattered into as it arrives; ``units``: ZeRO 3's gathered weights
        (``training.replay_step``)."""
        from attnctl.training import replay_step

        key = (length, micro, blocks, shard, units)
        if key not in self._steps:
            self._steps[key] = replay_step(self.plan(length, micro), blocks, shard, units)
        return self._steps[key]

    def trained_sizes(self, stage: int) -> list[int]:
        """The values of each tensor the stage's step updates on one rank, in the
        replay's order (the seeded stack: the shared ones, then each block's); kept."""
        if stage not in self._sizes:
            self._sizes[stage] = self._trained_sizes(stage)
        return self._sizes[stage]

    def _trained_sizes(self, stage: int) -> list[int]:
        trained = self._trained(stage)
        if self.model is not None:
            return [share.values * share.copies for share in trained]
        shared = [s.values for s in trained if s.name.startswith(SHARED_FIRST)]
        own = [s.values for s in trained if not s.name.startswith(SHARED_FIRST)]
        return shared + own * len(self.ranges[stage])

    def training_phases(
        self,
        length: int,
        micro: int,
        micro_batches: int,
        stage: int,
        state: tuple[int, int, int, int, int],
        optimizer_of: RankOptimizer | None = None,
    ) -> tuple[int, int, int]:
        """The device's bytes at the busiest point of the forward, the backward and the
        optimizer step of one micro-batch on this stage.

        The replay of the rank's plan over the stage's blocks gives each phase's peak
        besides the parameters; its own masters (all phases) and optimizer-step state
        (gradients, masters' float32 gradients, moments, step counts, Adam's largest
        temporaries) are taken out and the layout's put in (those of the data-parallel
        rank ``optimizer_of``, rank 0 when None: under ZeRO its pieces'). Beside the
        forward and the backward: the other micro-batches in flight (their saved
        activations), the gradients accumulated from earlier micro-batches when there are
        more in the step than in flight; ``--recompute`` takes out what it does not save
        and adds one block's recomputation to the backward. Under ZeRO 2 and 3 the replay
        frees each gradient as it arrives (its hook reduce-scatters it into the rank's
        shard, made by the first one's); under ZeRO 3 it gathers each unit's weights (the
        embeddings', each block's) while they are read (``unit_bytes``).
        """
        weights, gradients, optimizer, masters, _gathered = state  # gathered: replayed
        blocks = len(self.ranges[stage])
        held = in_flight(stage, self.layout.pp, micro_batches)
        accumulated = gradients if micro_batches > held else 0
        shard = None  # ZeRO 2, 3: what the gradients are reduce-scattered into, made by the
        if self.layout.zero >= 2:  # first one, or held already (accumulated) from then on
            shard = 0 if accumulated else gradients
        units = self.unit_bytes(stage) if self.layout.zero == 3 else None  # gathered
        replay = self.step_replay(length, micro, blocks, shard, units)
        forward, backward, step = replay.phase_peak_bytes
        per_micro, working, not_saved = self.recompute_parts(length, micro, stage)
        around = weights + masters + accumulated + (held - 1) * per_micro
        forward_peak = around + forward - replay.master_bytes - not_saved
        backward_peak = around + backward - replay.master_bytes - not_saved + working
        rest = step - replay.optimizer_step_state_bytes  # the inputs, what the backward left
        if optimizer_of is None:
            optimizer_of = self.rank_optimizer(stage, 0)
        moments = optimizer - masters
        steps = optimizer_of.tensors * FP32  # Adam's step count of each tensor (piece)
        step_state = gradients + 2 * masters + moments + steps + optimizer_of.temporaries
        step_peak = weights + step_state + rest
        return forward_peak, backward_peak, step_peak

    def gradient_windows(
        self, length: int, micro: int, stage: int, state: tuple[int, int, int, int, int]
    ) -> tuple[int, ...]:
        """The device's bytes at the backward's busiest point up to each trained tensor's
        gradient, in the order they come, of a step of one micro-batch without
        ``--recompute`` (what ``memory --measure --train`` runs): the windows of the
        replay :meth:`training_phases` makes, its masters put in the layout's place."""
        weights, gradients, _optimizer, masters, _gathered = state
        shard = gradients if self.layout.zero >= 2 else None
        units = self.unit_bytes(stage) if self.layout.zero == 3 else None
        replay = self.step_replay(length, micro, len(self.ranges[stage]), shard, units)
        around = weights + masters - replay.master_bytes
        return tuple(around + window for window in replay.gradient_window_bytes)

    def block_input_bytes(self, length: int, micro: int) -> int:
        tokens = length // self.layout.cp
        if self.layout.sp:
            tokens //= self.layout.tp
        return micro * tokens * self.description.config.d_model * self.element

    def kv_cache_bytes(self, tokens: int, batch: int, stage: int) -> int:
        """2 · B · n · Hkv_rank · d_k per block of the stage: n = ⌈min(N, W) / C⌉ (each
        context-parallel rank keeps its share of the positions), Hkv_rank = Hkv / T
        (one, replicated, when T > Hkv)."""
        total = 0
        for config, window, blocks in self._attentions(stage):
            kept = min(tokens, window) if window else tokens
            kept = -(-kept // self.layout.cp)
            heads = max(config.kv_heads // self.layout.tp, 1)
            total += 2 * batch * kept * heads * config.d_k * self.element * blocks
        return total

    def _attentions(self, stage: int) -> list[tuple[LayerConfig, int, int]]:
        """(attention, window, how many blocks) of the stage's blocks: a checkpoint's
        one by one; the seeded stack's by its --sliding pattern, counted whole cycles at
        a time (never a loop over the stack's height)."""
        owned = self.ranges[stage]
        if self.model is not None:
            return [
                (b.attention.config, b.attention.window, 1)
                for b in (self.description.blocks[n] for n in owned)
            ]
        config = self.description.stack or self.description.config
        pattern = config.window_pattern
        if not pattern:
            return [(config, config.window, len(owned))]
        sliding = 0
        for offset, letter in enumerate(pattern):  # blocks n in owned with n % k == offset
            if letter == "s":
                first = owned.start + (offset - owned.start) % len(pattern)
                if first < owned.stop:
                    sliding += (owned.stop - 1 - first) // len(pattern) + 1
        return [(config, config.window, sliding), (config, 0, len(owned) - sliding)]

    # ------------------------------------------------------------ per device

    def per_device(
        self,
        length: int,
        micro: int,
        micro_batches: int,
        kv_tokens: int,
        batch: int,
        rank: int | None = None,
    ) -> tuple[StageMemory, ...]:
        """Each stage's device: its busiest data-parallel rank (under ZeRO the ranks'
        pieces differ), or data-parallel rank ``rank`` (of D·C) when given. Training
        under ``--cp`` with the causal mask: the busier context-parallel rank of C - 2
        and C - 1 (the last runs the most ring steps, the one before it holds its own
        gradients' receive buffers the whole backward)."""
        cp = self.layout.cp
        if self.train and cp > 1 and self.cp_rank is None and self.layer.mask == "causal":
            every = [
                self.ring_rank(r).per_device(length, micro, micro_batches, kv_tokens, batch, rank)
                for r in (cp - 2, cp - 1)
            ]
            busier = zip(*every, strict=True)
            return tuple(max(rows, key=lambda row: row.peak_bytes) for rows in busier)
        rows = []
        for stage, blocks in enumerate(self.ranges):
            phases: tuple[int, ...] = ()
            if self.train:
                activations, held = self.training_activations(length, micro, micro_batches, stage)
                kv = 0
                if rank is None:
                    kinds = self.rank_optimizers(stage)
                else:
                    kinds = [self.rank_optimizer(stage, rank)]
                states = [self.state(stage, kind) for kind in kinds]
                every = [self.training_phases(length, micro, micro_batches, stage, state, kind)
                         for state, kind in zip(states, kinds, strict=True)]  # fmt: skip
                busiest = max(range(len(every)), key=lambda n: max(every[n]))  # the first
                phases = every[busiest]
                weights, gradients, optimizer, masters, gathered = states[busiest]
            else:
                weights, gradients, optimizer, masters, gathered = self.state(stage)
                activations, held = self.inference_activations(length, micro, stage), 1
                kv = self.kv_cache_bytes(kv_tokens, batch, stage)
            rows.append(
                StageMemory(
                    stage=stage,
                    kind=stage_kind(stage, self.layout.pp),
                    blocks=(blocks[0], blocks[-1]),
                    weights_bytes=weights,
                    gradients_bytes=gradients,
                    optimizer_bytes=optimizer,
                    master_bytes=masters,
                    gathered_bytes=gathered,
                    activations_bytes=activations,
                    kv_cache_bytes=kv,
                    in_flight=held,
                    phase_peak_bytes=phases,
                    vocab_rows=any(s.rule.startswith("vocab") for s in self.shares[stage]),
                )
            )
        return tuple(rows)

    def ring_rank(self, cp_rank: int) -> Split:
        """The same split, its plans of context-parallel rank ``cp_rank``; kept."""
        if cp_rank not in self._ring_ranks:
            self._ring_ranks[cp_rank] = Split(
                self.layer, self.model, self.description, self.layout, self.train,
                self.layers, cp_rank,
            )  # fmt: skip
        return self._ring_ranks[cp_rank]

    def worst_peak(
        self, length: int, micro: int, micro_batches: int, kv_tokens: int, batch: int
    ) -> int:
        rows = self.per_device(length, micro, micro_batches, kv_tokens, batch)
        return max(row.peak_bytes for row in rows)

    def fit(
        self,
        budget: int,
        length: int,
        micro: int,
        micro_batches: int,
        kv_cache: int | None,
        batch: int,
    ) -> ParallelFit:
        """The longest length (a multiple of what the split divides it by) at ``micro``,
        and the largest micro-batch at ``length`` (as many of them a step), whose worst
        device fits ``budget``. The KV cache follows the length unless --kv-cache says."""
        unit = self.layout.cp * (self.layout.tp if self.layout.sp else 1)
        longest = longest_input(self.layer, self.model)
        limit = (longest // unit) if longest is not None else 2**40 // unit

        def peak_at_length(multiple: int) -> int:
            tokens = multiple * unit
            kv = kv_cache if kv_cache is not None else tokens
            return self.worst_peak(tokens, micro, micro_batches, kv, batch)

        def peak_at_micro(size: int) -> int:
            kv = kv_cache if kv_cache is not None else length
            return self.worst_peak(length, size, micro_batches, kv, size * micro_batches)

        most = largest_fitting(peak_at_length, budget, max(limit, 1))
        return ParallelFit(
            budget_bytes=budget,
            max_seq_len=most * unit if most <= limit else 0,
            max_micro_batch=largest_fitting(peak_at_micro, budget, LARGEST_SPLIT),
        )

    # ------------------------------------------------------------ what is said

    def notes(self, stages: tuple[StageMemory, ...], micro_batches: int) -> tuple[str, ...]:
        layout, config = self.layout, self.description.config
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
            causal = self.layer.mask == "causal"
            which = "the busiest of them"
            if causal and self.train:
                which = (f"the busier of ranks {layout.cp - 2} and {layout.cp - 1} (the last "
                         "runs the most ring steps; the one before holds its gradients' "
                         "receive buffers through the backward)")  # fmt: skip
            elif not causal:
                which = "every rank alike (no mask: each runs every ring step)"
            said.append(
                f"--cp {layout.cp}: each rank holds L / {layout.cp} of the tokens; the table "
                f"is {which}"
                + ("; ring attention's backward is its own ring (dK, dV travel with their "
                   "chunk), replayed as it runs" if self.train else "")
            )  # fmt: skip
        counts = {len(r) for r in self.ranges}
        if len(counts) > 1:
            spread = _stage_runs([len(r) for r in self.ranges])
            said.append(
                f"uneven split of {self.block_count} blocks over {layout.pp} stages ({spread})"
            )
        if self.train:
            mixed = self.layer.dtype != "float32"
            said.append(
                "Adam: two float32 moments (8 bytes a value)"
                + (
                    ", float32 master weights (4 bytes a value)"
                    if mixed
                    else "; float32: no masters"
                )
                + f", gradients in {self.layer.dtype}"
            )
            if layout.zero:
                sharded = {1: "moments and masters", 2: "moments, masters and gradients",
                           3: "moments, masters, gradients and weights"}[layout.zero]  # fmt: skip
                said.append(
                    f"ZeRO {layout.zero} shards the {sharded} over {self.state_ranks} ranks "
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
            if self.model is not None and self.model.source.head_table:
                said.append(
                    "as the single-device step, the loss is the last block's output: an LM "
                    "head's gradients and logits are not counted"
                )
        else:
            said.append(
                "inference: the busiest block's activations of one micro-batch; the KV "
                "cache of the stage's blocks for every sequence"
            )
        if layout.pp > 1 and self.description.head is not None and self.description.head.tied:
            said.append("the tied LM head: the last stage holds a copy of the embedding")
        return tuple(said)


def steady_peak(stages: tuple[StageMemory, ...]) -> int:
    """The busiest device's peak from the second step on, when Adam's moments (its
    optimizer bytes less the masters) are held through the forward and the backward."""
    peaks = []
    for row in stages:
        forward, backward, step = row.phase_peak_bytes
        moments = row.optimizer_bytes - row.master_bytes
        peaks.append(max(forward + moments, backward + moments, step))
    return max(peaks)


def _shared(share: WeightShare, shared_keys: set[str]) -> bool:
    """Whether a weight is not a block's (embeddings, final norm, head)."""
    return (
        share.name in shared_keys
        or share.name.startswith(TIED_HEAD)
        or (not shared_keys and share.name.startswith(SHARED_FIRST))
    )


def _block_start(plan: Plan) -> int:
    """The index of a plan's first stage of its block (after the inputs and embeddings)."""
    for index, stage in enumerate(plan.stages):
        if stage.name not in INPUTS and stage.name not in EMBEDDING_STAGES:
            return index
    return len(plan.stages) - 1


def attention_matrix_bytes(plan: Plan, saved_by_stage: dict[str, int]) -> int:
    """Of one block's saved bytes, those of the stages over every (query, key) pair:
    the scores, weights, masks and dropout (dims with L twice), what selective recompute
    does not keep."""
    square = {s.name for s in plan.stages if sum(d == "L" for d in s.dims) >= 2}
    return sum(n for name, n in saved_by_stage.items() if name in square)


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
