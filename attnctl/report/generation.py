"""What ``run --generate`` shows, computed before it is drawn: plain data, no torch.

The use case (``app/generation.py``) builds a :class:`GenerationReport` from what greedy
decoding computed (``app/calls.generate_tokens``); ``render`` only reads it.

A step is one chosen token: step 0 reads the whole prompt (the prefill) and its last
query row chooses the token at position L (the prompt's length); step k feeds the token
chosen at step k-1, whose query row, over every key the cache holds, chooses the next.
The cache a step shows is the one that row read: the prompt and the tokens fed so far,
less what fell out of a sliding window.

An encoder–decoder's run is a :class:`TranslationReport`: the same steps (of its decoder,
from the start token), and a :class:`TranslationView`: the source tokens, the target
tokens (start token + generated), its three attentions, and the alignment of each
generated token with the source token its cross-attention weighs most.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from attnctl.memory.estimate import KVCacheGroup, MemoryEstimate
from attnctl.report.commands import (
    BlockSummary,
    Seq2SeqDtypeRow,
    TextWindow,
    block_summary,
    text_windows,
)
from attnctl.stages.plan import Plan
from attnctl.stats import HeadStats, head_stats
from attnctl.trace import KeptStages, Token, Trace

TOP_KEYS_KEPT = 8  # strongest keys of each step's query row the report keeps


@dataclass(frozen=True)
class GenerationStep:
    """One chosen token of every text, and the cache the row that chose it read."""

    step: int  # 0: chosen by the prompt's last row (the prefill)
    tokens: list[int]  # (B,) the ids chosen (a finished text's pad)
    texts: list[str]  # (B,) their text as the tokenizer decodes it in place
    position: int  # the position the chosen tokens take (L + step)
    finished: list[bool]  # (B,) the text has ended: this token, or an earlier, ends it
    cache_shapes: list[dict[str, tuple[int, ...]]]  # per block: sublayer -> (B, Hkv, T, d_k)
    estimated_bytes: int  # the K and V every block keeps, by memory.kv_cache_bytes
    measured_bytes: int  # the bytes of the cache's tensors, measured during the run
    dropped: list[int]  # per block: the oldest positions fallen out of its sliding window
    # per text: the shown block's query row (at position - 1) averaged over the heads,
    # its strongest keys, strongest first, as (key position, weight); only keys with weight
    top_keys: list[list[tuple[int, float]]]
    keys: int  # keys the shown block's row read (the cache's length T)

    @property
    def query_position(self) -> int:
        return self.position - 1


@dataclass(frozen=True)
class GenerationRun:
    """What the computation hands back (``app/calls.generate_tokens``), torch-free."""

    generated: list[list[int]]  # (B, N)
    steps: list[GenerationStep]  # texts empty: the use case decodes them
    # per shown block, the final sequence's weights as a Trace holds them (B, h, T, T):
    # (attention, top_keys, sums) from runner.shown_weights
    attention: dict[int, tuple[list, list, object]]
    final_cache_shapes: list[dict[str, tuple[int, ...]]]
    final_measured_bytes: int
    device: str
    # run --save: the prefill's stages, block by block (prefill.block.N.)
    kept_stages: list[KeptStages] = field(default_factory=list)


@dataclass(frozen=True)
class WindowNote:
    """The blocks that slide over one window, and what fell out of it."""

    window: int
    blocks: list[int]
    dropped: int  # positions 0 … dropped-1 are out of it after the last token
    first_step: int | None  # the first step whose row no longer read position 0


@dataclass(frozen=True)
class GenerationReport:
    """Everything ``run --generate`` shows for a decoder-only model."""

    texts: list[str]
    plan: Plan  # the prefill's plan (the prompt through the shown block)
    estimate: MemoryEstimate  # its memory
    prompt_tokens: list[list[Token]]  # (B, L)
    generated_ids: list[list[int]]  # (B, N)
    generated_tokens: list[list[Token]]  # (B, N): their text, spans in the generated text
    generated_texts: list[str]  # (B,) the generated ids decoded at once
    steps: list[GenerationStep]
    traces: list[Trace]  # per shown block: the final sequence (prompt + generated)
    blocks: list[int]  # the blocks shown (--layer N: one; --layer all: every one)
    cache_block: int  # the block whose cache shape and query row the steps show
    heads: Sequence[int]  # heads whose weight tables show
    averaged_heads: list[int]  # the heads each step's query row is averaged over
    digits: int
    every_block: bool
    head_stats: list[list[HeadStats]]  # per trace
    windows: list[TextWindow]  # per text, of the first trace
    block_summaries: list[BlockSummary]  # --layer all: per trace
    stop: str  # "eos": every text ended; "limit": N tokens were generated
    requested: int  # N
    final_cache_shapes: list[dict[str, tuple[int, ...]]]
    final_estimated_bytes: int
    final_measured_bytes: int
    kv_groups: list[KVCacheGroup]  # the final cache by kind of block
    window_notes: list[WindowNote]
    heads_not_shown: tuple[int, int] | None = None
    # run --save: the prefill's stages, block by block (prefill.block.N.)
    kept_stages: list[KeptStages] = field(default_factory=list)

    @property
    def trace(self) -> Trace:
        return self.traces[0]

    @property
    def generated_count(self) -> int:
        return len(self.steps)


def window_notes(
    windows: Sequence[int], steps: list[GenerationStep], final_length: int
) -> list[WindowNote]:
    """Per sliding window (``windows``: each block's, 0 = full), the blocks with it and
    the positions it lost by the end (``final_length``: the tokens the cache was fed)."""
    grouped: dict[int, list[int]] = {}
    for block, window in enumerate(windows):
        if window:
            grouped.setdefault(window, []).append(block)
    notes = []
    for window, blocks in sorted(grouped.items()):
        first = next((s.step for s in steps if s.dropped[blocks[0]] > 0), None)
        notes.append(WindowNote(window, blocks, max(0, final_length - window), first))
    return notes


def stop_reason(
    generated: list[list[int]],
    eos_ids: Sequence[int],
    requested: int = 0,
    forced_eos: int | None = None,
) -> str:
    """ "eos" when every text chose an end-of-sequence token; "forced_eos" when the limit
    was reached and the generation config forced the last token to one (Marian, BART:
    forced_eos_token_id); else "limit"."""
    if not eos_ids:
        return "limit"
    ends = [next((i for i, t in enumerate(row) if t in eos_ids), None) for row in generated]
    if any(end is None for end in ends):
        return "limit"
    forced = forced_eos is not None and any(end == requested - 1 for end in ends)
    return "forced_eos" if forced else "eos"


def generation_report(
    *,
    texts: list[str],
    plan: Plan,
    estimate: MemoryEstimate,
    prompt_tokens: list[list[Token]],
    generated_tokens: list[list[Token]],
    generated_texts: list[str],
    run: GenerationRun,
    steps: list[GenerationStep],
    traces: list[Trace],
    blocks: list[int],
    cache_block: int,
    heads: Sequence[int],
    averaged_heads: list[int],
    digits: int,
    every_block: bool,
    eos_ids: Sequence[int],
    requested: int,
    final_estimated_bytes: int,
    kv_groups: list[KVCacheGroup],
    windows: Sequence[int],
    heads_not_shown: tuple[int, int] | None = None,
    forced_eos: int | None = None,
) -> GenerationReport:
    stats = [head_stats(trace) for trace in traces]
    summaries = (
        [block_summary(trace, s) for trace, s in zip(traces, stats, strict=True)]
        if every_block
        else []
    )
    final_length = len(prompt_tokens[0]) + len(steps)
    return GenerationReport(
        texts=texts,
        plan=plan,
        estimate=estimate,
        prompt_tokens=prompt_tokens,
        generated_ids=run.generated,
        generated_tokens=generated_tokens,
        generated_texts=generated_texts,
        steps=steps,
        traces=traces,
        blocks=blocks,
        cache_block=cache_block,
        heads=heads,
        averaged_heads=averaged_heads,
        digits=digits,
        every_block=every_block,
        head_stats=stats,
        windows=text_windows(traces[0]),
        block_summaries=summaries,
        stop=stop_reason(run.generated, eos_ids, requested, forced_eos),
        requested=requested,
        final_cache_shapes=run.final_cache_shapes,
        final_estimated_bytes=final_estimated_bytes,
        final_measured_bytes=run.final_measured_bytes,
        kept_stages=run.kept_stages,
        kv_groups=kv_groups,
        window_notes=window_notes(windows, steps, final_length),
        heads_not_shown=heads_not_shown,
    )


# ---------------------------------------------------------------- encoder–decoders


@dataclass(frozen=True)
class AlignedToken:
    """One generated token and the source token weighed most by the cross-attention row
    that chose it (the row of the token before it)."""

    target_position: int  # in the target (0: the start token)
    target_id: int
    source_position: int
    weight: float  # that source token's weight (averaged over the heads chosen)


@dataclass(frozen=True)
class TranslationView:
    """An encoder–decoder's three attentions of the chosen blocks over the whole target,
    each row as its step computed it, and the alignment view. Laid out as ``--json``
    gives them: (B, h, Ls, Ls), (B, h, Lt, Lt) and (B, h, Lt, Ls) nested lists."""

    source_tokens: list[list[Token]]  # (B, Ls), padding marked
    target_tokens: list[list[Token]]  # (B, Lt): the start token, then the generated
    encoder_block: int
    decoder_block: int
    heads: list[int]  # the heads the attentions hold, in their order
    encoder_attention: list  # (B, h, Ls, Ls)
    decoder_attention: list  # (B, h, Lt, Lt)
    cross_attention: list  # (B, h, Lt, Ls)
    averaged_heads: list[int]  # the heads the alignment averages (--head N: that one)
    # per text: (Lt, Ls) the cross-attention averaged over ``averaged_heads``
    alignment_matrix: list[list[list[float]]] = field(default_factory=list)
    alignment: list[list[AlignedToken]] = field(default_factory=list)  # per text


@dataclass(frozen=True)
class TranslationRun:
    """What an encoder–decoder's greedy run hands back (``app/calls.translate_tokens``)."""

    generated: list[list[int]]  # (B, N) after the start token
    steps: list[GenerationStep]  # top_keys: each row's strongest source tokens
    encoder_attention: list  # (B, h, Ls, Ls) of the encoder block shown
    decoder_attention: list  # (B, h, Lt, Lt) of the decoder block shown
    cross_attention: list  # (B, h, Lt, Ls)
    cross_window: tuple[list, list, object]  # the same as a Trace holds it (shown_weights)
    final_cache_shapes: list[dict[str, tuple[int, ...]]]
    final_measured_bytes: int
    device: str
    # --layer all: "encoder", "decoder", "cross" -> block -> weights as a Trace holds them
    block_windows: dict[str, dict[int, tuple[list, list, object]]] = field(default_factory=dict)
    # run --save: the encoder's stages and a teacher-forced decoder pass's, block by block
    kept_stages: list[KeptStages] = field(default_factory=list)


@dataclass(frozen=True)
class TranslationReport:
    """Everything ``run`` shows for an encoder–decoder: the source, the steps of its
    decoder, the three attentions of the blocks chosen and the alignment."""

    texts: list[str]
    model: Any  # the ModelDescription
    dtype: str
    tokenizer: str
    vocab_size: int
    device: str
    steps: list[GenerationStep]
    view: TranslationView
    cross_trace: Trace  # the cross-attention as a Trace: target rows × source keys
    generated_texts: list[str]  # (B,) the generated ids (after the start token) decoded
    heads: Sequence[int]  # heads whose cross-attention tables show
    digits: int
    stop: str
    requested: int
    final_cache_shapes: list[dict[str, tuple[int, ...]]]
    final_estimated_bytes: int
    final_measured_bytes: int
    heads_not_shown: tuple[int, int] | None = None
    # the stages of the encoder block over the source and of the decoder block over the
    # whole target at once (the steps compute its rows one at a time)
    encoder_plan: Plan | None = None
    decoder_plan: Plan | None = None
    # the memory of the run's lengths, as memory --src-len S --tgt-len T gives it
    memory: Seq2SeqDtypeRow | None = None
    # --layer all: "encoder", "decoder", "cross" -> one Trace per block, and its statistics
    block_traces: dict[str, list[Trace]] = field(default_factory=dict)
    block_stats: dict[str, list[list[HeadStats]]] = field(default_factory=dict)
    # "encoder", "decoder", "cross" -> the statistics of the blocks shown
    shown_stats: dict[str, list[HeadStats]] = field(default_factory=dict)
    # run --save: the encoder's stages and a teacher-forced decoder pass's, block by block
    kept_stages: list[KeptStages] = field(default_factory=list)

    @property
    def every_block(self) -> bool:
        return bool(self.block_traces)

    @property
    def generated_ids(self) -> list[list[int]]:
        return [[t.id for t in row[1:]] for row in self.view.target_tokens]

    @property
    def generated_count(self) -> int:
        return len(self.steps)


def alignment_of(
    cross_attention: list,
    heads: list[int],
    averaged_heads: list[int],
    target_ids: list[list[int]],
    source_lengths: list[int],
    eos_ids: Sequence[int] = (),
) -> tuple[list[list[list[float]]], list[list[AlignedToken]]]:
    """Per text: the cross-attention (h, Lt, Ls) averaged over ``averaged_heads`` (which
    ``heads`` lists the order of), and for each generated token the source token (among
    the text's own ``source_lengths``, no padding) weighed most by the row that chose it:
    target token r (r >= 1; 0 is the start token) was chosen by row r - 1. A text's
    alignment ends at its end-of-sequence token (``eos_ids``): the pads after it chose
    nothing."""
    indices = [heads.index(h) for h in averaged_heads]
    matrices, alignments = [], []
    for batch_row, per_head in enumerate(cross_attention):
        length = source_lengths[batch_row]
        rows = len(per_head[indices[0]])
        matrix = [
            [sum(per_head[i][r][s] for i in indices) / len(indices) for s in range(length)]
            for r in range(rows)
        ]  # (Lt, Ls)
        aligned = []
        for r in range(1, len(target_ids[batch_row])):
            chooser = matrix[r - 1]  # the row of the token before: it chose token r
            best = max(range(length), key=chooser.__getitem__)
            aligned.append(AlignedToken(r, target_ids[batch_row][r], best, chooser[best]))
            if target_ids[batch_row][r] in eos_ids:
                break
        matrices.append(matrix)
        alignments.append(aligned)
    return matrices, alignments
