"""``memory`` with a split (--tp, --sp, --cp, --pp, --dp, --zero, --micro-batch,
--recompute): what one device of each pipeline stage holds.

Every check of the options and of the options against the model runs first (one line,
exit 2); then, per pipeline stage, on one of its tensor-parallel ranks (they are alike):

- weights: each weight's share on the rank (``parallel.plan.rank_weights``);
- training with Adam: gradients in the dtype, two float32 moments, float32 master
  weights under mixed precision; ZeRO 1 shards the moments and masters over the D·C
  data-parallel ranks (context-parallel ranks hold the same weights, so they share the
  shards, as Megatron's distributed optimizer does), ZeRO 2 the gradients too, ZeRO 3
  the weights too: each rank ⌈n / (D·C)⌉ values of a flat buffer padded to a multiple
  of D·C, plus the largest unit's parameters (a block's, or the embeddings') gathered;
- activations of one micro-batch: in inference the busiest block's peak (the rank's
  plan, ``parallel.plan.rank_plan``); in training what each block saves for the
  backward (``replay.step.saved_activations``, the step's replay on the rank's plan) times
  the stage's blocks times the micro-batches in flight under 1F1B, less what
  ``--recompute`` recomputes;
- the KV cache (inference): the stage's blocks, each rank's kv-heads, L / C positions.

In inference the per-device peak is their sum. In training it is the busiest phase of
the step (``training_phases``): the single-device replay (``replay.step.replay_step``) of
the rank's plan over the stage's blocks, with the replay's own masters, gradients and
optimizer state replaced by the layout's, plus the other micro-batches in flight, the
gradients already accumulated, ZeRO 3's gathered block. Nothing here prints;
:mod:`attnctl.render` shows it.
"""

from __future__ import annotations

import dataclasses
import itertools

from attnctl.memory.estimate import (
    largest_fitting,
    live_bytes_per_stage,
    longest_input,
)
from attnctl.model.config import DTYPE_BYTES, FP32, LayerConfig
from attnctl.model.describe import ModelDescription
from attnctl.model.layout import (
    LARGEST_SPLIT,
    Layout,
    in_flight,
    stage_kind,
    zero_distinct_ranks,
    zero_pieces,
)
from attnctl.parallel.plan import SHARED_FIRST, WeightShare, rank_plan, rank_weights
from attnctl.parallel.split_report import (
    ParallelFit,
    RankOptimizer,
    StageMemory,
    split_notes,
)
from attnctl.replay.stages import EMBEDDING_STAGES, INPUTS
from attnctl.replay.step import SavedActivations, StepReplay, adam_temporaries
from attnctl.stages.plan import Plan

ADAM_MOMENTS = 2  # float32 values per trained value
TIED_HEAD = "lm_head (tied"  # rank_weights' name of the last stage's copy of the embedding


# ---------------------------------------------------------------- checks


def block_windows(description: ModelDescription, blocks: int) -> tuple[int, ...]:
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
        """ZeRO 3's gathered units of the stage's step, as ``replay.step.replay_step`` takes
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
        from attnctl.replay.step import saved_activations

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
        (``replay.step.replay_step``)."""
        from attnctl.replay.step import replay_step

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
        """What the per-device table leaves unsaid (:func:`split_report.split_notes`)."""
        return split_notes(self, stages, micro_batches)


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
