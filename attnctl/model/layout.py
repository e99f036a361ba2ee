"""How a model is split over devices, as data: the layout, its checks, each rank's share.

No torch here. ``memory --tp/--sp/--cp/--pp/--dp/--zero`` reads a :class:`Layout`; every
check that can refuse it runs before anything is planned or any process starts, and
says which number does not divide which. The names follow Megatron-LM:

- tensor parallel (``tp`` = T): each attention's heads and each feed-forward's inner
  columns are split over T ranks (W_q, W_k, W_v and W_up/W_gate by rows, "column
  parallel"; W_o and W_down by columns, "row parallel", whose partial outputs are
  summed by an all-reduce). The token embedding and an LM head are split by vocabulary
  rows. With fewer kv-heads than ranks each kv-head is replicated T / Hkv times.
- sequence parallel (``sp``, with T > 1): the norms, residuals and dropouts between the
  sublayers hold L / T tokens; an all-gather before each sublayer and a reduce-scatter
  after it replace the all-reduce.
- context parallel (``cp`` = C): every rank holds L / C tokens throughout, and attention
  passes the K and V blocks around a ring.
- pipeline parallel (``pp`` = P): the blocks are cut into P consecutive stages.
- data parallel (``dp`` = D) with ZeRO stage 0-3: copies of the model on different
  batches, sharding the optimizer state (1), the gradients too (2), the weights too (3).
"""

from __future__ import annotations

import bisect
import itertools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from attnctl.errors import AttnctlError

if TYPE_CHECKING:
    from attnctl.model.config import LayerConfig

RECOMPUTE = ("none", "selective", "full")
# a split no cluster reaches: every count is checked against it before any arithmetic
LARGEST_SPLIT = 1 << 20
# ranks ``memory --measure`` / ``run --tp`` start on this machine at most
MOST_PROCESSES = 64


@dataclass(frozen=True)
class Layout:
    """One parallel layout. ``micro_batch`` None: the whole ``--batch`` is one micro-batch."""

    tp: int = 1
    sp: bool = False
    cp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0
    micro_batch: int | None = None
    recompute: str = "none"
    # the blocks of each pipeline stage, when not the even split (Llama 3: one fewer on the
    # first and last stages); () = stage_blocks' split
    pp_blocks: tuple[int, ...] = ()

    @property
    def is_split(self) -> bool:
        """Anything other than one device running the whole model."""
        return self != Layout()

    @property
    def ranks(self) -> int:
        """Devices in all: T · C · P · D."""
        return self.tp * self.cp * self.pp * self.dp

    @property
    def model_ranks(self) -> int:
        """Processes one copy of one pipeline stage runs on: T · C."""
        return self.tp * self.cp

    def stage_ranges(self, blocks: int) -> tuple[range, ...]:
        """The blocks of each pipeline stage: ``pp_blocks`` when given, else even."""
        return stage_blocks(blocks, self.pp, self.pp_blocks)

    def summary(self) -> str:
        """'TP 2 + SP · CP 2 · PP 4 · DP 8 (ZeRO 1)': only what is split."""
        parts = []
        if self.tp > 1:
            parts.append(f"TP {self.tp}" + (" + SP" if self.sp else ""))
        if self.cp > 1:
            parts.append(f"CP {self.cp}")
        if self.pp > 1:
            parts.append(f"PP {self.pp}")
        if self.dp > 1:
            parts.append(f"DP {self.dp}" + (f" (ZeRO {self.zero})" if self.zero else ""))
        return " · ".join(parts) or "one device"


def check_layout(layout: Layout, *, train: bool, measure: bool = False) -> None:
    """The checks of the options alone (no model): each refusal names its option."""
    for option, value in (
        ("--tp", layout.tp),
        ("--cp", layout.cp),
        ("--pp", layout.pp),
        ("--dp", layout.dp),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise AttnctlError(f"{option} must be a positive integer, got {value}")
        if value > LARGEST_SPLIT:
            raise AttnctlError(f"{option} {value} is more than {LARGEST_SPLIT:,} devices")
    if layout.ranks > LARGEST_SPLIT:
        raise AttnctlError(
            f"{layout.summary()} is {layout.ranks:,} devices, more than {LARGEST_SPLIT:,}"
        )
    if layout.zero not in (0, 1, 2, 3):
        raise AttnctlError(f"--zero must be 0, 1, 2 or 3, got {layout.zero}")
    if layout.zero and layout.dp * layout.cp == 1:  # Megatron shards over DP·CP ranks
        raise AttnctlError(
            f"--zero {layout.zero} shards over the data-parallel copies: give --dp 2 or more"
            " (or --cp 2 or more: it shards over their ranks too)"
        )
    if layout.zero and not train:
        raise AttnctlError(
            f"--zero {layout.zero} shards training state (optimizer, gradients): add --train"
        )
    if layout.sp and layout.tp == 1:
        raise AttnctlError("--sp splits the sequence over the --tp ranks: give --tp 2 or more")
    if layout.recompute not in RECOMPUTE:
        raise AttnctlError(
            f"--recompute must be one of {', '.join(RECOMPUTE)}, got {layout.recompute!r}"
        )
    if layout.recompute != "none" and not train:
        raise AttnctlError(
            f"--recompute {layout.recompute} trades a training step's saved activations: "
            "add --train"
        )
    if layout.micro_batch is not None:
        if layout.micro_batch < 1:
            raise AttnctlError(
                f"--micro-batch must be a positive integer, got {layout.micro_batch}"
            )
        if layout.micro_batch > LARGEST_SPLIT:
            raise AttnctlError(
                f"--micro-batch {layout.micro_batch} is more than {LARGEST_SPLIT:,} sequences"
            )
    if measure:
        if layout.recompute != "none":  # the ranks and one device keep every activation
            raise AttnctlError(
                f"--measure runs a training step that keeps its activations; --recompute "
                f"{layout.recompute} is estimated only: leave it out to measure"
            )
        if layout.ranks < 2:  # --micro-batch alone: one device, which --measure takes whole
            raise AttnctlError(
                "--measure of one device runs the whole --batch: leave out --micro-batch "
                "(or split it: --tp, --cp or --dp 2 or more)"
            )
        if layout.pp > 1:
            raise AttnctlError(
                "--measure runs the --tp, --cp and --dp split on this machine; --pp is "
                "estimated only: leave it out to measure"
            )
        if layout.dp > 1 and not train:
            raise AttnctlError(
                "--measure with --dp runs a training step (each copy's forward pass is one "
                "device's): add --train"
            )
        if layout.ranks > MOST_PROCESSES:
            raise AttnctlError(
                f"--measure would start {layout.ranks} processes (--tp × --cp × --dp); "
                f"attnctl starts at most {MOST_PROCESSES} on one machine"
            )


def check_batch(layout: Layout, batch: int) -> int:
    """Micro-batches per step: ``batch`` (per data-parallel copy) / ``micro_batch``."""
    micro = layout.micro_batch or batch
    if batch % micro:
        raise AttnctlError(
            f"--micro-batch {micro} does not divide --batch {batch} (the sequences each "
            "data-parallel copy takes a step)"
        )
    return batch // micro


def check_heads(layout: Layout, heads: int, kv_heads: int, where: str = "") -> None:
    """T must divide the heads, and divide the kv-heads or be a multiple of them."""
    tp = layout.tp
    at = f" {where}" if where else ""
    if heads % tp:
        raise AttnctlError(
            f"--tp {tp} does not divide the {heads} attention heads{at}: each rank holds H / T"
        )
    if kv_heads % tp and tp % kv_heads:
        raise AttnctlError(
            f"--tp {tp} and the {kv_heads} kv-heads{at}: T must divide them, or be a "
            "multiple of them (each kv-head then replicated on T / Hkv ranks)"
        )


def check_inner(layout: Layout, inner: int, where: str = "") -> None:
    if inner % layout.tp:
        at = f" {where}" if where else ""
        raise AttnctlError(
            f"--tp {layout.tp} does not divide the feed-forward's {inner} inner columns{at}"
        )


def check_length(layout: Layout, length: int) -> None:
    """CP cuts the sequence into C chunks; SP into T."""
    if length % layout.cp:
        raise AttnctlError(
            f"--cp {layout.cp} does not divide the length {length}: each rank holds L / C tokens"
        )
    if layout.sp and (length // layout.cp) % layout.tp:
        rank_len = length // layout.cp
        what = f"the length {length}" if layout.cp == 1 else f"the {rank_len} tokens a CP rank has"
        raise AttnctlError(
            f"--sp with --tp {layout.tp} does not divide {what}: the norms and residuals "
            "hold L / T tokens"
        )


def parse_stage_sizes(text: str) -> tuple[int, ...]:
    """'7,8x14,7' -> (7, 8, …, 8, 7): each stage's blocks, ``NxK`` for K stages of N."""
    sizes: list[int] = []
    for part in text.split(","):
        count, by, times = part.strip().partition("x")
        if not count.isdigit() or (by and not times.isdigit()):
            raise AttnctlError(
                f"cannot read --pp-blocks {text!r}: write each stage's blocks, e.g. 7,8x14,7"
            )
        repeat = int(times) if times else 1
        if len(sizes) + repeat > LARGEST_SPLIT:
            raise AttnctlError(f"--pp-blocks {text!r} is more than {LARGEST_SPLIT:,} stages")
        if int(count) < 1 or repeat < 1:
            raise AttnctlError(f"--pp-blocks {text!r}: every stage needs one block at least")
        sizes.extend([int(count)] * repeat)
    return tuple(sizes)


def check_blocks(layout: Layout, blocks: int) -> None:
    if layout.pp_blocks:
        given = layout.pp_blocks
        if len(given) != layout.pp:
            raise AttnctlError(
                f"--pp-blocks gives {len(given)} stages and --pp {layout.pp}: give one of them, "
                "or the same count"
            )
        if sum(given) != blocks:
            noun = "block" if blocks == 1 else "blocks"
            raise AttnctlError(
                f"--pp-blocks adds up to {sum(given)} blocks; the model has {blocks} {noun}"
            )
        return
    if layout.pp > blocks:
        noun = "block" if blocks == 1 else "blocks"
        raise AttnctlError(
            f"--pp {layout.pp} is more pipeline stages than the {blocks} {noun}: "
            "each stage needs one at least"
        )


def kv_replicas(kv_heads: int, tp: int) -> int:
    """How many ranks hold each kv-head: 1, or T / Hkv when there are fewer than T."""
    return tp // kv_heads if tp > kv_heads else 1


def rank_heads(heads: int, kv_heads: int, tp: int, rank: int) -> tuple[range, range]:
    """The query heads and the kv-heads tensor-parallel rank ``rank`` computes.

    Query heads are cut into T consecutive runs; a rank's kv-heads are those its query
    heads read (GQA groups stay on one rank), so when T > Hkv a kv-head's group spans
    T / Hkv ranks and each of them holds a copy.
    """
    per_rank = heads // tp
    queries = range(rank * per_rank, (rank + 1) * per_rank)
    if tp > kv_heads:
        kv = rank // (tp // kv_heads)
        return queries, range(kv, kv + 1)
    kv_per_rank = kv_heads // tp
    return queries, range(rank * kv_per_rank, (rank + 1) * kv_per_rank)


def vocab_rows(vocab: int, tp: int) -> int:
    """Rows of a vocab-parallel embedding (or head) on each rank: ⌈V / T⌉, the vocabulary
    padded to a multiple of T (the pad rows are never looked up). Megatron pads further, to
    a multiple of 128·T by default (``make_vocab_size_divisible_by``): at most 127·T rows
    more than this."""
    return -(-vocab // tp)


def stage_blocks(blocks: int, pp: int, sizes: tuple[int, ...] = ()) -> tuple[range, ...]:
    """The blocks of each pipeline stage: consecutive, the first ``blocks % pp`` stages
    one block more than the others (Megatron's even split when P divides the blocks), or
    ``sizes`` blocks each (checked by :func:`check_blocks`)."""
    if sizes:
        ends = tuple(itertools.accumulate(sizes))
        return tuple(range(end - size, end) for end, size in zip(ends, sizes, strict=True))
    base, extra = divmod(blocks, pp)
    ranges, start = [], 0
    for stage in range(pp):
        count = base + (stage < extra)
        ranges.append(range(start, start + count))
        start += count
    return tuple(ranges)


def in_flight(stage: int, pp: int, micro_batches: int) -> int:
    """Micro-batches whose activations pipeline stage ``stage`` holds at once under 1F1B:
    the first stage P of them (warm-up), the last one, each at most the step's count."""
    return min(pp - stage, micro_batches)


def zero_ranges(
    sizes: list[int], ranks: int, rank: int, ends: list[int] | None = None
) -> list[tuple[int, int, int]]:
    """The pieces ZeRO 1's distributed optimizer gives data-parallel rank ``rank`` of
    ``ranks``, as Megatron-LM lays them out: the trained tensors (of ``sizes`` values, in
    order) end to end in one flat range padded to a multiple of the ranks, rank r owning
    [r·S, (r+1)·S), S = ⌈n / ranks⌉. Each piece is (tensor index, first value, end) within
    that tensor, for every tensor that overlaps the rank's range, in tensor order (none
    for a rank wholly in the padding). ``ends``: the tensors' running sums of ``sizes``
    (made when None; a caller asking for many ranks makes them once): the rank's first
    tensor is found by bisection, so a call costs its pieces, never a loop over the ranks.
    """
    if ranks < 1 or not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} of {ranks} ranks")
    if ends is None:
        ends = list(itertools.accumulate(sizes))
    total = ends[-1] if ends else 0
    shard = -(-total // ranks)
    first, end = rank * shard, min((rank + 1) * shard, total)
    pieces = []
    index = bisect.bisect_right(ends, first)  # the first tensor ending after ``first``
    while index < len(sizes) and ends[index] - sizes[index] < end:
        start = ends[index] - sizes[index]
        low, high = max(first, start), min(end, ends[index])
        if low < high:
            pieces.append((index, low - start, high - start))
        index += 1
    return pieces


def zero_pieces(
    sizes: list[int], ranks: int, rank: int, ends: list[int] | None = None
) -> list[int]:
    """The sizes of rank ``rank``'s pieces (:func:`zero_ranges`), in tensor order: its
    Adam parameters under ZeRO 1."""
    return [end - first for _, first, end in zero_ranges(sizes, ranks, rank, ends)]


def zero_distinct_ranks(sizes: list[int], ranks: int) -> list[int]:
    """Ranks whose pieces (:func:`zero_pieces`) are every kind there is, without a loop
    over the ranks: those whose range holds a tensor's first value or the end of the
    values, the first wholly in the padding, and one inside a single tensor (its one
    piece of S values, as every other such rank's). Any rank's pieces equal one of
    theirs, so the busiest of them is the busiest rank."""
    total = sum(sizes)
    shard = max(-(-total // ranks), 1)
    starts = list(itertools.accumulate([0, *sizes[:-1]])) if sizes else [0]
    chosen = {min(start // shard, ranks - 1) for start in starts}
    chosen.add(min(total // shard, ranks - 1))  # the end: a part of a piece, or padding
    chosen.add(min(-(-total // shard), ranks - 1))  # the first rank after the values
    for rank in range(len(chosen) + 1):  # a rank none of them is, inside one tensor
        if rank not in chosen and (rank + 1) * shard <= total:
            chosen.add(rank)
            break
    return sorted(chosen)


def stage_kind(stage: int, pp: int) -> str:
    """'first', 'middle' or 'last' (one stage: 'all')."""
    if pp == 1:
        return "all"
    if stage == 0:
        return "first"
    return "last" if stage == pp - 1 else "middle"


_SHARD = [  # (pattern of the name's end, rule): the first that matches decides
    (r"W_q\.(weight|bias)$", "heads"),
    (r"W_[kv]\.(weight|bias)$", "kv_heads"),
    (r"W_o\.weight$", "columns"),
    (r"(up|gate)\.(weight|bias)$", "rows"),
    (r"down\.weight$", "columns"),
    (r"(embedding|lm_head)\.weight$", "vocab"),
    (
        r"(W_o\.bias|down\.bias|norm\.(weight|bias)|post_norm\.(weight|bias)|[qk]_norm\.weight"
        r"|[qk]_norm\.bias|positions\.weight|segment\.weight)$",
        "replicated",
    ),
]


def share(name: str, shape: tuple[int, ...], config: LayerConfig, tp: int) -> tuple[int, str]:
    """(values on one tensor-parallel rank, the rule) of weight ``name`` of ``shape``."""
    values = 1
    for n in shape:
        values *= n
    rule = next((rule for pattern, rule in _SHARD if re.search(pattern, name)), None)
    if rule is None:
        raise AttnctlError(f"attnctl does not know how to split the weight {name!r} over --tp")
    if tp == 1 or rule == "replicated":
        return values, "replicated" if tp > 1 else "whole"
    if rule == "heads":
        return values // tp, "rows / T (heads)"
    if rule == "kv_heads":
        local = max(config.kv_heads // tp, 1)
        replicas = kv_replicas(config.kv_heads, tp)
        text = "rows / T (kv-heads)" if replicas == 1 else f"one kv-head, on {replicas} ranks"
        return values // config.kv_heads * local, text
    if rule == "rows":
        return values // tp, "rows / T"
    if rule == "columns":
        return values // tp, "columns / T"
    rows = vocab_rows(shape[0], tp)
    return rows * (values // shape[0]), "vocab rows ⌈V/T⌉"
