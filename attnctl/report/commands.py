"""What each view shows, computed before it is drawn: plain data, no torch, no printing.

The use cases (``app``) build these from plans, traces and estimates; ``render`` only
reads them. Head statistics, the windows of query rows each text's tables show, the
variant table (every dtype and implementation), the split of each bar of a sweep and
what fits a budget are all worked out here, once, for the terminal and for ``--json``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnctl.memory.estimate import KVCacheGroup, MemoryEstimate, longest_input, variant_table
from attnctl.stages.plan import Plan
from attnctl.stats import HeadStats, head_stats
from attnctl.trace import Trace
from attnctl.window import hidden_ranges

if TYPE_CHECKING:  # a split's report
    from attnctl.parallel.split_report import ParallelReport

CLEAREST_SHOWN = 10  # heads in "the most clear-cut heads" of run --layer all


# ---------------------------------------------------------------- run


@dataclass(frozen=True)
class TextWindow:
    """Which of one text's query rows its weight tables show, and which they leave out."""

    batch_row: int
    queries: int  # the text's own tokens (padding follows them)
    keys: int  # its keys without padding (the context's in cross-attention)
    computed: list[tuple[int, int]]  # (index in trace.attention_rows, query row) of its rows
    hidden: list[tuple[int, int]]  # ranges of its query rows not computed


@dataclass(frozen=True)
class BlockSummary:
    """One block of ``run --model --layer all``: its heads by kind."""

    layer: int
    mean_entropy_fraction: float  # over every head and text
    kinds: dict[str, int]  # kind -> heads, sorted by kind
    clearest: HeadStats
    first_text: list[HeadStats]  # text 0's heads in the trace's order, for the heads map


@dataclass(frozen=True)
class RunReport:
    """Everything ``run`` shows: the input, the plan, the traces and what they mean."""

    texts: list[str]
    contexts: list[str]
    plan: Plan
    estimate: MemoryEstimate
    traces: list[Trace]  # one per block run (one without --layer all)
    heads: Sequence[int]  # the heads whose weight tables show
    digits: int  # decimals in the weight tables
    every_block: bool  # --layer all: a summary of every block
    head_stats: list[list[HeadStats]]  # per trace, in the order the trace holds them
    ranked: list[HeadStats]  # the overview's heads, the most clear-cut first
    windows: list[TextWindow]  # per text, of the first trace
    blocks: list[BlockSummary]  # --layer all: one per trace, else empty
    heads_not_shown: tuple[int, int] | None  # the range of heads left out by default
    split: Any = None  # run --tp: a distributed.SplitRun (heads per rank, rank 0's plan)

    @property
    def trace(self) -> Trace:
        return self.traces[0]


def text_windows(trace: Trace) -> list[TextWindow]:
    """Per text: its own query rows among those computed, and the ranges left out."""
    windows = []
    for batch_row, tokens in enumerate(trace.tokens):
        keys = tokens if trace.context_tokens is None else trace.context_tokens[batch_row]
        queries = sum(not t.pad for t in tokens)
        computed = [(i, r) for i, r in enumerate(trace.attention_rows) if r < queries]
        hidden = hidden_ranges([r for _, r in computed], queries) if computed else []
        windows.append(
            TextWindow(batch_row, queries, sum(not t.pad for t in keys), computed, hidden)
        )
    return windows


def block_summary(trace: Trace, stats: list[HeadStats]) -> BlockSummary:
    kinds: dict[str, int] = {}
    for s in stats:
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    entropy = sum(s.entropy_fraction for s in stats) / len(stats)
    best = max(stats, key=lambda s: s.strength)
    first_text = [s for s in stats if s.batch_row == 0]
    return BlockSummary(trace.layer, entropy, dict(sorted(kinds.items())), best, first_text)


def run_report(
    texts: list[str],
    contexts: list[str],
    plan: Plan,
    estimate: MemoryEstimate,
    traces: list[Trace],
    heads: Sequence[int],
    digits: int,
    every_block: bool,
    heads_not_shown: tuple[int, int] | None = None,
) -> RunReport:
    stats = [head_stats(trace) for trace in traces]
    by_strength = sorted(  # stable: among equals, the order the trace holds them
        (s for block in stats for s in block), key=lambda s: s.strength, reverse=True
    )
    ranked = by_strength[:CLEAREST_SHOWN] if every_block else by_strength
    blocks = (
        [block_summary(trace, s) for trace, s in zip(traces, stats, strict=True)]
        if every_block
        else []
    )
    return RunReport(
        texts=texts,
        contexts=contexts,
        plan=plan,
        estimate=estimate,
        traces=traces,
        heads=heads,
        digits=digits,
        every_block=every_block,
        head_stats=stats,
        ranked=ranked,
        windows=text_windows(traces[0]),
        blocks=blocks,
        heads_not_shown=heads_not_shown,
    )


# ---------------------------------------------------------------- memory


@dataclass(frozen=True)
class LengthReport:
    """Everything ``memory`` says about one sequence length."""

    plan: Plan
    estimate: MemoryEstimate
    kv_cache_tokens: int
    kv_cache_bytes: int
    kv_cache: list[KVCacheGroup]  # by kind of block (full, each window)
    variants: dict[str, dict[str, MemoryEstimate]]  # dtype -> impl -> estimate
    bar_parts: list[int]  # parameters, B·H·L·L matrices, other activations, KV cache
    measured: Any = None  # a measure.Measurement when --measure ran (training step if --train)
    training: Any = None  # a training.TrainingEstimate when --train
    # the K and V the measured run kept (--measure, when N is the run's own key length)
    measured_kv_cache_bytes: int | None = None
    # memory --generate N: the cache after N more tokens (N = generate, prompt = L)
    generate: int | None = None
    generated_kv_cache: list[KVCacheGroup] | None = None
    measured_generated_kv_cache_bytes: int | None = None  # by really generating (--measure)

    @property
    def generated_kv_cache_bytes(self) -> int | None:
        if self.generated_kv_cache is None:
            return None
        return sum(group.bytes for group in self.generated_kv_cache)


@dataclass(frozen=True)
class MemoryCommandReport:
    """``memory``: one report per length, and what fits a budget when one was given."""

    lengths: list[LengthReport]
    fits: dict[str, dict[str, int]] | None = None  # impl -> max_seq_len, max_batch
    budget_bytes: int | None = None
    longest_input: int | None = None  # learned positions that end the search for L
    # a split (--tp, --pp, ...): every pipeline stage's device (app/memory_parallel.py)
    parallel: ParallelReport | None = None


def bar_parts(estimate: MemoryEstimate, kv_cache: int) -> list[int]:
    """The peak split into parameters, B·H·L·L matrices, other activations; then KV cache."""
    matrices = min(estimate.scores_bytes + estimate.weights_bytes, estimate.peak_activation_bytes)
    other = estimate.peak_activation_bytes - matrices
    return [estimate.parameter_bytes, matrices, other, kv_cache]


def length_report(
    plan: Plan,
    estimate: MemoryEstimate,
    kv_cache_tokens: int,
    kv_cache: list[KVCacheGroup],
    measured: Any = None,
    training: Any = None,
) -> LengthReport:
    kv_cache_bytes = sum(group.bytes for group in kv_cache)
    measured_kv = None
    key_len = plan.sizes.get("Lc", plan.seq_len)
    measured_kv_run = getattr(measured, "kv_cache_bytes", None)
    alike = plan.model is not None or len(kv_cache) == 1  # a seeded stack of one kind
    if measured_kv_run is not None and kv_cache_tokens == key_len and alike:
        copies = 1 if plan.model is not None else kv_cache[0].layers  # a seeded stack
        measured_kv = measured_kv_run * copies
    return LengthReport(
        plan=plan,
        estimate=estimate,
        kv_cache_tokens=kv_cache_tokens,
        kv_cache_bytes=kv_cache_bytes,
        kv_cache=kv_cache,
        variants=variant_table(plan, estimate.layers),
        bar_parts=bar_parts(estimate, kv_cache_bytes),
        measured=measured,
        training=training,
        measured_kv_cache_bytes=measured_kv,
    )


def memory_command_report(
    lengths: list[LengthReport],
    fits: dict[str, dict[str, int]] | None = None,
    budget_bytes: int | None = None,
) -> MemoryCommandReport:
    plan = lengths[0].plan
    return MemoryCommandReport(lengths, fits, budget_bytes, longest_input(plan.config, plan.model))


# ---------------------------------------------------------------- encoder–decoders


@dataclass(frozen=True)
class Seq2SeqShapes:
    """``shapes`` of an encoder–decoder: an encoder block over the source (L = its
    length) and a decoder block over the target (L = its length, Lc = the source's)."""

    encoder: Plan
    decoder: Plan


@dataclass(frozen=True)
class Seq2SeqDtypeRow:
    """One dtype (and kernel) of ``memory`` on an encoder–decoder."""

    parameter_bytes: int
    encoder: MemoryEstimate
    decoder: MemoryEstimate
    kv_cache_bytes: int  # the decoder's self-attention K and V, T positions per block
    cross_kv_cache_bytes: int  # the cross-attention's K and V, S positions per block

    @property
    def peak_bytes(self) -> int:
        """The weights, and the larger of the encoder's peak and the decoder's with both
        caches (the encoder runs first; the caches exist while the decoder runs)."""
        return self.parameter_bytes + max(
            self.encoder.peak_activation_bytes,
            self.decoder.peak_activation_bytes + self.kv_cache_bytes + self.cross_kv_cache_bytes,
        )


@dataclass(frozen=True)
class Seq2SeqMeasured:
    """``memory --measure`` on an encoder–decoder: each part measured on its own."""

    encoder: Any  # measure.Measurement of encoder block 0
    decoder: Any  # measure.Measurement of decoder block 0 (cross-attention over the source)
    kv_cache_bytes: int  # the storages the decoder's self-attention caches held
    cross_kv_cache_bytes: int


@dataclass(frozen=True)
class Seq2SeqMemoryReport:
    """``memory --model DIR --src-len S --tgt-len T`` on an encoder–decoder."""

    encoder_plan: Plan
    decoder_plan: Plan
    row: Seq2SeqDtypeRow  # the run's dtype and kernel
    kv_cache: list[KVCacheGroup]  # the decoder's self-attention, by kind of block
    cross_kv_cache: list[KVCacheGroup]  # the cross-attention's, made once per block
    variants: dict[str, dict[str, Seq2SeqDtypeRow]]  # dtype -> impl -> row
    measured: Seq2SeqMeasured | None = None

    @property
    def src_len(self) -> int:
        return self.encoder_plan.seq_len

    @property
    def tgt_len(self) -> int:
        return self.decoder_plan.seq_len
