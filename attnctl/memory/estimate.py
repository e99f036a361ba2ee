"""Memory arithmetic over a plan: parameters, activations, attention matrices, peak.

The peak follows liveness: a tensor's memory is held from the stage that creates it
until the last stage that reads it (or a view of it) has been computed. Views
(split heads) add no bytes. Standard library only.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass

from attnctl.errors import AttnctlError
from attnctl.model.config import DTYPE_BYTES, DTYPES, LayerConfig, validate
from attnctl.model.describe import CROSS_ATTENTION, ModelDescription
from attnctl.model.gpu import rounded
from attnctl.stages.plan import Plan, build_plan

IMPLEMENTATIONS = ("math", "sdpa")  # what "auto" chooses between


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int  # for the whole stack: the embedding once, every layer's weights
    parameter_bytes: int
    activation_bytes: int  # every stage that allocates, summed (nothing freed)
    attention_matrix_bytes: int  # one B·H·L·L matrix in the layer's dtype
    scores_bytes: int  # 0 when the implementation never builds them (sdpa)
    weights_bytes: int
    live_bytes: tuple[int, ...]  # per stage: activation bytes alive while it is computed
    peak_activation_bytes: int
    peak_stage: str
    layers: int = 1  # layers in the stack; activations are one layer's (they run in turn)

    @property
    def peak_bytes(self) -> int:
        """Parameters plus the most activation memory alive at any one moment."""
        return self.parameter_bytes + self.peak_activation_bytes


def _storage_of(plan: Plan) -> dict[str, str]:
    """Map each stage to the stage that owns its memory (itself unless it is a view)."""
    owner: dict[str, str] = {}
    for stage in plan.stages:
        owner[stage.name] = owner[stage.view_of] if stage.view_of else stage.name
    return owner


def live_bytes_per_stage(plan: Plan) -> list[int]:
    owner = _storage_of(plan)
    index = {s.name: i for i, s in enumerate(plan.stages)}
    last = len(plan.stages) - 1
    last_use = {s.name: index[s.name] for s in plan.stages if s.allocates}
    for i, stage in enumerate(plan.stages):
        for read in stage.reads:
            last_use[owner[read]] = max(last_use[owner[read]], i)
    for held, until in plan.held_until.items():  # kept alive by the caller
        last_use[owner[held]] = max(last_use[owner[held]], index[until])
    last_use[owner[plan.stages[-1].name]] = last  # the output, returned
    for given in plan.given:  # alive from the start
        if given in index:
            index[given] = 0
    nbytes = {s.name: s.bytes for s in plan.stages}
    if plan.cuda is not None:  # the caching allocator's 512-byte blocks (not the inputs':
        # a measurement counts what was allocated after them)
        nbytes = {name: n if name in plan.given else rounded(n) for name, n in nbytes.items()}
    live = [
        stage.scratch
        + sum(nbytes[name] for name, end in last_use.items() if index[name] <= i <= end)
        for i, stage in enumerate(plan.stages)
    ]
    for line in plan.device_lines:  # what CUDA allocates beside the stages' tensors
        first = index[line.first]
        until = last if line.last is None else index[line.last]
        for i in range(first, until + 1):
            live[i] += line.bytes
    return live


def estimate(plan: Plan, layers: int = 1) -> MemoryEstimate:
    """Memory of one forward pass; with ``layers`` > 1, of a stack of such layers.

    A stack shares one embedding (tokens and learned positions, as the training step's
    and a split's weights do) and repeats the rest of the weights; in inference its
    layers run one after another and each frees its activations before the next starts,
    so the activation peak is one layer's.
    """
    if layers < 1:
        raise AttnctlError(f"layers must be a positive integer, got {layers}")
    by_name = {s.name: s for s in plan.stages}
    sizes = plan.sizes
    keys = sizes.get("Lc", sizes["L"])  # a context's length in cross-attention
    matrix_elems = sizes["B"] * sizes["H"] * sizes["L"] * keys
    live = live_bytes_per_stage(plan)
    peak = max(live)
    # the token embedding and a learned position table: once for the whole stack
    shared = sum(
        p.count for p in plan.parameters if p.name.startswith(("embedding.", "positions."))
    )
    parameters = shared + layers * (plan.parameter_count - shared)
    return MemoryEstimate(
        layers=layers,
        parameters=parameters,
        parameter_bytes=parameters * DTYPE_BYTES[plan.config.dtype],
        activation_bytes=sum(s.bytes for s in plan.stages if s.allocates),
        attention_matrix_bytes=matrix_elems * DTYPE_BYTES[plan.config.dtype],
        scores_bytes=by_name["scores"].bytes if "scores" in by_name else 0,
        weights_bytes=by_name["weights"].bytes if "weights" in by_name else 0,
        live_bytes=tuple(live),
        peak_activation_bytes=peak,
        peak_stage=plan.stages[live.index(peak)].name,
    )


@dataclass(frozen=True)
class KVCacheGroup:
    """The K/V cache of the blocks that share one kind of attention."""

    window: int  # their sliding window (0: full attention, every token kept)
    layers: int
    tokens: int  # the positions each keeps: min(N, window), or N
    kv_heads: int  # Hkv
    head_dim: int  # d_k
    bytes: int  # of all of them together


def kv_cache_groups(plan: Plan, tokens: int | None = None, layers: int = 1) -> list[KVCacheGroup]:
    """K and V for ``tokens`` positions (default: the keys' length), by kind of block.

    2 · B · n · Hkv · d_k elements per block in the dtype, where a block with a sliding
    window of W keeps n = min(N, W) positions (nothing older is ever read again) and any
    other keeps all N. Hkv and d_k are each block's own. A checkpoint's blocks are its
    description's; the seeded layer counts ``layers`` copies of itself.
    """
    count = plan.seq_len if tokens is None else tokens
    element = DTYPE_BYTES[plan.config.dtype]
    description = plan.description
    if description is None or plan.model is None:  # a stack of the seeded layer
        attentions = [plan.config] * layers
        windows = list(description.stack_windows(layers)) if description else [0] * layers
    else:
        attentions = [block.attention.config for block in description.blocks]
        windows = [block.attention.window for block in description.blocks]
    groups: dict[tuple[int, int, int], list[int]] = {}  # (window, Hkv, d_k) -> layers
    for config, window in zip(attentions, windows, strict=True):
        groups.setdefault((window, config.kv_heads, config.d_k), []).append(1)
    batch = plan.sizes["B"]
    result = []
    for (window, kv_heads, head_dim), members in groups.items():
        kept = min(count, window) if window else count
        per_layer = 2 * batch * kept * kv_heads * head_dim * element
        result.append(
            KVCacheGroup(window, len(members), kept, kv_heads, head_dim, per_layer * len(members))
        )
    return result


def cross_kv_cache_groups(plan: Plan, tokens: int | None = None) -> list[KVCacheGroup]:
    """The cross-attention K and V of a decoder plan's blocks: made once from the encoder
    output, ``tokens`` positions (default the source's, Lc) in every block, by (Hkv, d_k).

    2 · B · S · Hkv · d_k elements per block in the dtype. Blocks without cross-attention
    (a decoder-only model) keep none: an empty list.
    """
    description = plan.description
    if description is None:
        return []
    count = plan.sizes.get("Lc", 0) if tokens is None else tokens
    element = DTYPE_BYTES[plan.config.dtype]
    groups: dict[tuple[int, int], int] = {}  # (Hkv, d_k) -> blocks
    for block in description.blocks:
        for sublayer in block.sublayers:
            if getattr(sublayer, "kind", "") == CROSS_ATTENTION:
                shape = (sublayer.config.kv_heads, sublayer.config.d_k)
                groups[shape] = groups.get(shape, 0) + 1
    batch = plan.sizes["B"]
    return [
        KVCacheGroup(0, layers, count, kv_heads, head_dim,
                     2 * batch * count * kv_heads * head_dim * element * layers)
        for (kv_heads, head_dim), layers in groups.items()
    ]  # fmt: skip


def kv_cache_bytes(plan: Plan, tokens: int | None = None, layers: int = 1) -> int:
    """K and V for ``tokens`` positions, every KV head and block: what a decoder keeps so it
    does not recompute the keys and values of earlier tokens (see :func:`kv_cache_groups`)."""
    return sum(group.bytes for group in kv_cache_groups(plan, tokens, layers))


def largest_fitting(peak_of: Callable[[int], int], budget: int, limit: int = 2**40) -> int:
    """The largest n in 1..limit with peak_of(n) <= budget (0 if none); peak_of must not
    decrease. Nothing above ``limit`` is ever asked of peak_of."""

    def fits(n: int) -> bool:
        return n <= limit and peak_of(n) <= budget

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:  # invariant: low fits, high does not
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def longest_input(config: LayerConfig, model: ModelDescription | None = None) -> int | None:
    """The most tokens a layer (or model) can take: its learned positions; None: no limit."""
    if model is not None:
        return model.longest_input()
    return config.max_positions if config.pos == "learned" else None


def fit(
    sizer: Callable[..., Plan],
    seq_len: int,
    batch: int,
    budget: int,
    peak_of: Callable[[Plan], int] | None = None,
    longest: int | None = None,
) -> dict[str, int]:
    """Exactly solved from the model: the longest sequence at ``batch`` and the largest
    batch at ``seq_len`` whose peak (``peak_of``, default one forward) fits ``budget``.

    ``longest``: the layer's own limit (learned positions): no length past it is tried.
    """
    peak_of = peak_of or (lambda plan: estimate(plan).peak_bytes)

    def peak(length: int, rows: int) -> int:
        return peak_of(sizer(length, rows))

    return {
        "max_seq_len": largest_fitting(lambda n: peak(n, batch), budget, longest or 2**40),
        "max_batch": largest_fitting(lambda n: peak(seq_len, n), budget),
    }


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(text: str) -> int:
    """'16GiB', '512 MiB', '1.5GB', '1000' -> bytes (KiB/MiB/GiB are 1024-based)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise AttnctlError(f"cannot read size {text!r}; write it like 16GiB, 512MiB or 2GB")
    from fractions import Fraction  # only a size read needs it

    size = int(Fraction(match.group(1)) * _UNITS[unit])  # exact, however many digits
    if size <= 0:
        raise AttnctlError(f"size must be positive, got {text!r}")
    if size > 2**64:
        raise AttnctlError(f"size {text!r} is more than 2^64 bytes, which no device addresses")
    return size


def allowed_impls(config: LayerConfig) -> tuple[str, ...]:
    """The implementations ``validate`` accepts for this configuration, of math and sdpa.

    math always; sdpa unless the configuration rules it out (dropout, which is modelled on
    the math path only; alibi, whose float bias CPU SDPA turns into weights out of sight).
    """
    allowed = []
    for impl in IMPLEMENTATIONS:
        try:
            validate(dataclasses.replace(config, impl=impl))
        except AttnctlError:
            continue
        allowed.append(impl)
    return tuple(allowed)


def variant_table(plan: Plan, layers: int = 1) -> dict[str, dict[str, MemoryEstimate]]:
    """The same plan's estimate in every dtype and implementation: [dtype][impl].

    An implementation the configuration rules out (sdpa with dropout or alibi) is left out:
    the same :func:`allowed_impls` as ``memory --budget`` fits.
    """
    table: dict[str, dict[str, MemoryEstimate]] = {}
    impls = allowed_impls(plan.config)
    for dtype in DTYPES:
        table[dtype] = {}
        for impl in impls:
            config = dataclasses.replace(plan.config, dtype=dtype, impl=impl)
            other = build_plan(
                config,
                plan.seq_len,
                plan.batch,
                plan.vocab_size,
                plan.config.device,
                context_len=plan.sizes.get("Lc"),
                model=plan.model,
                layer_index=plan.layer_index,
            )
            table[dtype][impl] = estimate(other, layers)
    return table


def format_bytes(n: int) -> str:
    """1024-based sizes: 512 B, 1.50 KiB, 10.04 MiB, 2.00 GiB; past 1024 EiB 1.2e+06 EiB."""
    if n < 1024:
        return f"{n} B"
    units = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    for power, unit in enumerate(units, start=1):
        if n < 1024 ** (power + 1) or unit == units[-1]:
            value = n / 1024**power  # exact integers divided once: no overflow on the way
            return f"{value:.2f} {unit}" if value < 1024 else f"{value:.2g} {unit}"
    raise AssertionError("unreachable")
