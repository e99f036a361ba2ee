"""Running a tensor- and context-parallel split for real: T · C processes on this machine.

The parent side of ``attnctl/parallel/rank.py``. Everything is checked before any process
starts (``parallel.check_layout``, ``parallel.plan.check_split``, the memory of all the
ranks together); then :func:`run_ranks` picks a free TCP port on 127.0.0.1, starts T
``python -m attnctl.parallel.rank`` processes, each in a session (process group) of its own,
hands each its work as JSON on stdin and waits for one JSON document from each. On a
failure, a timeout, Ctrl-C or exit it kills every rank's process group, so no rank
outlives attnctl; a rank's error comes back as one line naming the rank.

:func:`measure_split` is ``memory --measure --tp T [--sp] [--cp C]``: each rank's block 0
under ``measure.LiveStorages`` beside its plan (``parallel.plan.rank_plan`` of its CP
rank). Rank r is CP rank r // T and TP rank r % T (``rank_place.rank_places`` makes the groups:
a TP group per CP rank, a ring per TP rank). With ``--train --dp D --zero 0|1|2|3`` (T = C =
1) the world is the D data-parallel copies, each held to its own estimate (under ZeRO its
pieces of the optimizer's flat buffer: ``training_estimates``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from attnctl.errors import AttnctlError
from attnctl.model.config import DTYPE_BYTES, LayerConfig
from attnctl.model.describe import ModelDescription
from attnctl.model.layout import MOST_PROCESSES, Layout, check_layout
from attnctl.parallel.launch import (
    DEFAULT_TIMEOUT_SECONDS,
    START_SECONDS,
    RankReply,
    run_ranks,
)
from attnctl.stages.plan import Plan

# What one rank costs beyond its tensors: the interpreter with torch and attnctl
# imported and a gloo group joined. Measured (benchmarks/distributed.py): a rank's peak
# resident memory (VmHWM) is 319 MiB on the CPU with torch 2.13 when its tensors are
# under 9 MiB (torch's import alone: 219 MiB); rounded up.
PROCESS_OVERHEAD_BYTES = 320 * 2**20
# the ring attention stages that send or receive a K, V chunk (``stages/ring_attention.py``)
RING_TRANSFERS = ("recv_k", "recv_v", "sent_k", "sent_v")
# what gloo allocates inside them: it sends from and receives into the tensors' own memory
# (contiguous K, V chunks and the receive buffers the plan has), so what it adds does not
# grow with the chunk; bounded by COLLECTIVE_FIXED_BYTES, as an all_reduce's
RING_TRANSFER_BUFFERS = (
    "none that grows with the chunk (sent from and received into its own memory)"
)


@dataclass(frozen=True)
class RankMeasurement:
    """One rank of ``memory --measure --tp T --cp C``: its plan's figures beside the
    measured."""

    rank: int
    peak_bytes: int  # estimated: the rank's weights + its plan's activation peak
    measured_peak_bytes: int  # the rank's tensors + the activations LiveStorages saw
    parameter_bytes: int  # estimated (rank_weights), equal to the measured on CPU
    measured_parameter_bytes: int
    stage_names: tuple[str, ...]
    stage_peak_bytes: tuple[int, ...]  # estimated, per stage of rank_plan
    measured_stage_peak_bytes: tuple[int, ...]
    method: str
    # what the backend allocates inside the collectives, not seen by LiveStorages:
    # bounded by the plan (the largest of them, as they run one after another)
    collective_buffer_bytes: int
    collective_buffers: str  # in words
    # the rank process's seconds: to import torch and attnctl, to join the group, to work
    timings: dict[str, float] = field(default_factory=dict)
    # a training step's backward peak besides the weights up to each gradient, in the
    # order they come: estimated and measured (not in the JSON: the tests hold them equal)
    gradient_window_bytes: tuple[int, ...] = ()
    measured_gradient_window_bytes: tuple[int, ...] = ()
    # the whole process's peak resident memory (Linux VmHWM): its tensors, torch itself
    # and the whole weights it loaded before cutting its share; PROCESS_OVERHEAD_BYTES
    # is what a tiny layer's rank holds here
    resident_peak_bytes: int | None = None

    @property
    def equal(self) -> bool:
        return self.peak_bytes == self.measured_peak_bytes


# ---------------------------------------------------------------- checks


def check_split_run(
    layout: Layout,
    config: LayerConfig,
    model: ModelDescription | None,
    lengths: list[int],
    vocab_size: int,
    train: bool = False,
) -> ModelDescription:
    """Every check of a split this machine will run, before any process starts; returns
    the whole model's description (the seeded layer's too). ``train``: a training step
    (``memory --measure --train``), which runs the --tp split of the seeded layer."""
    from attnctl.model.describe import seeded_model
    from attnctl.parallel.plan import check_split

    check_layout(layout, train=train)
    if layout.pp > 1 or (layout.dp > 1 and not train):
        raise AttnctlError(
            "attnctl runs the --tp and --cp split on this machine, and --dp with --train; "
            "--pp and --dp besides are estimated only: leave them out to run it"
        )
    processes = layout.ranks  # T · C, or D
    if processes < 2:
        raise AttnctlError("a split runs over --tp 2, --cp 2 or --dp 2 or more processes")
    if processes > MOST_PROCESSES:
        raise AttnctlError(
            f"{_options(layout)} would start {processes} processes; attnctl starts at most "
            f"{MOST_PROCESSES} on one machine"
        )
    description = seeded_model(config, vocab_size) if model is None else model.with_run(config)
    check_split(layout, description, lengths)
    cores = os.cpu_count() or 1
    if processes > cores * 8:
        raise AttnctlError(
            f"{_options(layout)} would start {processes} processes on this machine's {cores} "
            f"CPU cores; attnctl starts at most {cores * 8} (8 a core)"
        )
    return description


def _options(layout: Layout) -> str:
    """The options that set the processes' count: ``--tp 2 --cp 2``."""
    said = [f"--{name} {value}" for name, value in (("tp", layout.tp), ("cp", layout.cp),
            ("dp", layout.dp)) if value > 1]  # fmt: skip
    return " ".join(said) or "--tp 1"


def check_devices(device: Any, tp: int) -> None:
    """On CUDA each rank takes a GPU of its own (NCCL): there must be T of them."""
    if getattr(device, "type", "cpu") != "cuda":
        return
    import torch

    count = torch.cuda.device_count()
    if count < tp:
        raise AttnctlError(
            f"--tp {tp} on CUDA runs one rank a GPU; torch sees {count}: use --device cpu "
            "(gloo) or a smaller --tp"
        )


def split_timeout(plan: Plan, device: Any, blocks: int = 1) -> float:
    """How long to wait for the ranks: DEFAULT_TIMEOUT_SECONDS, or for a long run the
    start plus 20 times one device's whole forward pass at the speed measured here
    (each rank does 1 / T of it, on 1 / T of the cores)."""
    from attnctl.memory.resources import estimated_seconds

    seconds = estimated_seconds(plan, device, blocks)
    if seconds is None:
        return DEFAULT_TIMEOUT_SECONDS
    return max(DEFAULT_TIMEOUT_SECONDS, START_SECONDS + 20 * seconds)


def preflight_split(
    rank_peaks: list[int], whole_weight_bytes: int, device: Any, force: bool = False
) -> int:
    """All the ranks' memory together, before they start: each rank's peak, the whole
    weights each loads before cutting its share, and PROCESS_OVERHEAD_BYTES each.
    Returns the bytes asked for; refuses (exit 1) when they are not free."""
    need = sum(rank_peaks) + len(rank_peaks) * (whole_weight_bytes + PROCESS_OVERHEAD_BYTES)
    if not force:
        from attnctl.memory.resources import preflight

        preflight(need, device)
    return need


# ---------------------------------------------------------------- memory --measure --tp


def _config_values(config: LayerConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def measure_task(case: SplitCase) -> dict[str, Any]:
    """The JSON one rank is given to measure its block 0's forward pass, or its training
    step (checked by the caller)."""
    layout = case.layout
    task = {
        **_task("train" if case.train else "measure", case.config, case.model,
                case.vocab_size, layout),
        "seq_len": case.seq_len,
        "batch": case.batch,
        "tp": layout.tp,
        "cp": layout.cp,
    }  # fmt: skip
    if case.train:
        task["layers"] = case.layers
    if layout.dp > 1 or layout.zero:  # data-parallel copies; ZeRO 0 to 3 (over D · C)
        task.update(dp=layout.dp, zero=layout.zero)
    return task


def _task(
    kind: str,
    config: LayerConfig,
    model: ModelDescription | None,
    vocab_size: int,
    layout: Layout,
) -> dict[str, Any]:
    """What every rank's task says: its kind, the layer, the model's folder, the split."""
    return {
        "kind": kind,
        "config": _config_values(config),
        "model_dir": None if model is None else str(model.source.path),
        "vocab_size": vocab_size,
        "sp": layout.sp,
    }


def estimated_ranks(
    config: LayerConfig,
    seq_len: int,
    batch: int,
    vocab_size: int,
    layout: Layout,
    model: ModelDescription | None = None,
    block: int = 0,
    cp_rank: int = 0,
) -> tuple[Plan, Any, int]:
    """The plan of block ``block`` of the ranks of context-parallel rank ``cp_rank``, its
    estimate and its weights' bytes (the T ranks of one CP rank are alike; under the
    causal mask the CP ranks differ)."""
    from attnctl.memory.estimate import estimate
    from attnctl.parallel.plan import rank_plan, rank_weights

    plan = rank_plan(config, seq_len, batch, vocab_size, layout, model, block, cp_rank=cp_rank)
    predicted = estimate(plan)
    if model is None:
        parameter_bytes = predicted.parameter_bytes
    else:
        element = DTYPE_BYTES[plan.config.dtype]
        whole = model.with_run(config)
        parameter_bytes = sum(s.values * s.copies for s in rank_weights(whole, layout)) * element
    return plan, predicted, parameter_bytes


def collective_bound(plan: Plan, tp: int) -> int:
    """The most gloo allocates inside one of the plan's collectives (they run one at a
    time, and each frees its buffers before it returns): the whole (B, L, D) for an
    all_gather, (T - 1) / T of it for a reduce_scatter, nothing that grows with the
    tensor for an all_reduce, each with COLLECTIVE_FIXED_BYTES beside it
    (``stages/collectives.COLLECTIVE_BUFFERS``)."""
    from attnctl.stages.collectives import COLLECTIVE_FIXED_BYTES

    whole = plan.sizes["B"] * plan.sizes["L"] * plan.sizes["D"] * DTYPE_BYTES[plan.config.dtype]
    names = [stage.name for stage in plan.stages]
    if any(name.endswith("all_gather") for name in names):
        return whole + COLLECTIVE_FIXED_BYTES
    if any(name.endswith("reduce_scatter") for name in names):
        return whole * (tp - 1) // tp + COLLECTIVE_FIXED_BYTES
    if any(name.endswith("all_reduce") for name in names):
        return COLLECTIVE_FIXED_BYTES
    if any(_ring_transfer(name) for name in names):
        return COLLECTIVE_FIXED_BYTES  # gloo's isend / irecv: the tensors' own memory
    return 0


def measure_split(
    config: LayerConfig,
    seq_len: int,
    batch: int,
    vocab_size: int,
    layout: Layout,
    model: ModelDescription | None = None,
    timeout: float | None = None,
    force: bool = False,
    train: bool = False,
    layers: int = 1,
) -> list[RankMeasurement]:
    """``memory --measure --tp T [--sp] [--cp C]``: each rank's forward of block 0
    (embeddings and block 0, as ``measure.measure_forward`` on one device; under --cp its
    chunk of L / C tokens, attended by ring attention) run in T · C processes, rank
    cp_rank · T + tp_rank, each under ``measure.LiveStorages``, beside its plan.
    ``config``: the seeded layer, or with ``model`` a checkpoint's run settings (dtype,
    device, impl). Checked, pre-flighted, then run; on the CPU equal to the byte per rank.
    ``timeout`` None: ``split_timeout`` of one device's plan. ``train``: rather one
    training step of ``layers`` blocks on each TP rank (``rank_training.train_task``), beside the
    per-device step of ``memory --train --tp T``, phase by phase."""
    case = SplitCase(config, seq_len, batch, vocab_size, layout, model, train, layers)
    return measure_splits([case], timeout, force)[0]


class SplitCase(NamedTuple):
    """One measurement of a split: the layer (or a checkpoint's run settings with
    ``model``), the sequences, the layout; ``train``: a training step of ``layers``
    blocks rather than block 0's forward pass."""

    config: LayerConfig
    seq_len: int
    batch: int
    vocab_size: int
    layout: Layout
    model: ModelDescription | None = None
    train: bool = False
    layers: int = 1


def measure_splits(
    cases: list[SplitCase] | list[tuple],
    timeout: float | None = None,
    force: bool = False,
) -> list[list[RankMeasurement]]:
    """Several :func:`measure_split` of one count of processes (T · C) in one start of the
    ranks (each process imports torch once): the tests and the benchmark share them so."""
    if not cases:
        return []
    prepared = prepare_splits(cases, timeout, force)
    return prepared.finish(run_ranks(prepared.world, prepared.tasks, prepared.device,
                                     prepared.timeout))  # fmt: skip


@dataclass(frozen=True)
class PreparedSplits:
    """:func:`measure_splits` before the ranks start: the world, each case's task (in
    order), the device and the time they may take; ``finish`` turns the ranks' replies
    (each with these tasks' results, in order) into each case's measurements."""

    world: int
    tasks: list[dict[str, Any]]
    device: str
    timeout: float
    estimates: list[list[RankEstimate]]  # [case][rank]
    layouts: list[Layout]

    def finish(self, replies: list[RankReply]) -> list[list[RankMeasurement]]:
        return [
            [
                _rank_measurement(reply.results[index], self.estimates[index][reply.rank],
                                  reply, layout.tp)
                for reply in replies
            ]
            for index, layout in enumerate(self.layouts)
        ]  # fmt: skip


def prepare_splits(
    cases: list[SplitCase] | list[tuple],
    timeout: float | None = None,
    force: bool = False,
) -> PreparedSplits:
    """Every check of :func:`measure_splits` (before any process starts), each rank's
    estimate and each case's task."""
    cases = [SplitCase(*case) for case in cases]
    worlds = {case.layout.ranks for case in cases}
    if len(worlds) != 1:
        raise AttnctlError(
            "one start of the ranks runs one count of processes (--tp × --cp × --dp)"
        )
    world = worlds.pop()
    from attnctl.model.config import resolve_impl, validate

    prepared, tasks = [], []  # prepared[case][rank]: that rank's plan, estimate, weights
    peaks, whole = [0] * world, 0
    device = "cpu"
    for case in cases:
        layout, model = case.layout, case.model
        check_layout(layout, train=case.train, measure=True)  # --measure's own refusals first
        config = resolve_impl(validate(case.config))
        vocab = model.vocab_size if model is not None else case.vocab_size
        description = check_split_run(layout, config, model, [case.seq_len], vocab, case.train)
        case = case._replace(config=config, vocab_size=vocab)
        if case.train:  # the TP ranks are alike; the data-parallel ones differ under ZeRO
            ranks = training_estimates(case, description, world)
        else:
            by_cp_rank = [forward_estimate(case, cp_rank) for cp_rank in range(layout.cp)]
            ranks = [by_cp_rank[rank // layout.tp] for rank in range(world)]  # cp_rank · T + tp
        peaks = [max(p, estimate.peak_bytes) for p, estimate in zip(peaks, ranks, strict=True)]
        whole = max(whole, whole_weight_bytes(description, config))
        device = config.device
        prepared.append(ranks)
        tasks.append(measure_task(case))
    from attnctl.nn.layer import resolve_device

    resolved = resolve_device(device)
    check_devices(resolved, world)
    preflight_split(peaks, whole, resolved, force)
    if timeout is None:  # the cases one after another
        from attnctl.stages.plan import build_plan

        timeout = sum(
            split_timeout(
                build_plan(resolve_impl(validate(c.config)), c.seq_len, c.batch, c.vocab_size,
                           model=c.model),
                resolved,
                blocks=3 * c.layers if c.train else 1,  # a backward takes about twice
            )
            for c in cases
        )  # fmt: skip
    layouts = [case.layout for case in cases]
    return PreparedSplits(world, tasks, str(resolved), timeout, prepared, layouts)


@dataclass(frozen=True)
class RankEstimate:
    """What one rank's measurement is held to: its plan, its weights' bytes, and the
    peaks besides them (of each stage of a forward pass, or of each phase of a
    training step) of which ``peak_bytes`` (with the weights) is the largest."""

    plan: Plan
    parameter_bytes: int
    stage_names: tuple[str, ...]
    stage_peak_bytes: tuple[int, ...]
    # a training step's backward peak besides the weights up to each gradient
    gradient_window_bytes: tuple[int, ...] = ()

    @property
    def peak_bytes(self) -> int:
        return self.parameter_bytes + max(self.stage_peak_bytes)


def forward_estimate(case: SplitCase, cp_rank: int = 0) -> RankEstimate:
    """Block 0's forward pass (with the embeddings) on a rank of CP rank ``cp_rank``."""
    plan, predicted, parameter_bytes = estimated_ranks(
        case.config, case.seq_len, case.batch, case.vocab_size, case.layout, case.model,
        cp_rank=cp_rank,
    )  # fmt: skip
    names = tuple(stage.name for stage in plan.stages)
    return RankEstimate(plan, parameter_bytes, names, tuple(predicted.live_bytes))


def training_estimates(
    case: SplitCase, description: ModelDescription, world: int
) -> list[RankEstimate]:
    """A training step on each of the ``world`` ranks, as ``memory --train --tp T`` or
    ``--dp D --zero Z`` gives it: the split's per-device phases
    (``parallel.split.Split``) of the rank (its data-parallel rank's under ZeRO: its
    own pieces), less the rank's weights. The split is made once (one replay)."""
    from attnctl.parallel.plan import rank_plan
    from attnctl.parallel.split import Split  # the one place a split's step is made
    from attnctl.replay.step import PHASES

    layout = case.layout
    split = Split(case.config, case.model, description, layout, True, case.layers)
    estimates = []
    for rank in range(world):
        dp_rank, cp_rank = rank // layout.model_ranks, (rank // layout.tp) % layout.cp
        if estimates and not layout.zero and layout.cp == 1:  # every rank alike
            estimates.append(estimates[0])
            continue
        plan = rank_plan(case.config, case.seq_len, case.batch, case.vocab_size, layout,
                         case.model, cp_rank=cp_rank)  # fmt: skip
        ranked = split.ring_rank(cp_rank) if layout.cp > 1 else split  # its chunk's plans
        state_rank = dp_rank * layout.cp + cp_rank  # its index among the D · C ZeRO shards
        (device,) = ranked.per_device(case.seq_len, case.batch, 1, 0, case.batch, state_rank)
        phases = tuple(peak - device.weights_bytes for peak in device.phase_peak_bytes)
        state = ranked.state(0, ranked.rank_optimizer(0, state_rank))
        windows = ranked.gradient_windows(case.seq_len, case.batch, 0, state)
        windows = tuple(window - device.weights_bytes for window in windows)
        estimates.append(RankEstimate(plan, device.weights_bytes, PHASES, phases, windows))
    return estimates


def whole_weight_bytes(description: ModelDescription, config: LayerConfig) -> int:
    """The bytes of the whole model's weights, which every rank loads before cutting."""
    from attnctl.stages.plan import layer_parameters, model_parameters

    if description.checkpoint is None:
        parameters = layer_parameters(description.config, description.vocab_size)
    else:
        parameters = model_parameters(description)
    return sum(p.count for p in parameters) * DTYPE_BYTES[config.dtype]


def _rank_measurement(
    result: dict[str, Any], estimate: RankEstimate, reply: RankReply, tp: int
) -> RankMeasurement:
    measured_parameters = result["parameter_bytes"]
    plan = estimate.plan
    training = "phase_peak_bytes" in result
    measured = result["phase_peak_bytes"] if training else result["stage_peak_bytes"]
    what = "a training step" if training else "a forward pass"
    buffers, words = collective_bound(plan, tp), "; ".join(_buffer_words(plan))
    if training and "dp" in result:  # the gradients' all_reduce or reduce, the broadcasts
        from attnctl.stages.collectives import COLLECTIVE_BUFFERS, COLLECTIVE_FIXED_BYTES

        buffers = max(buffers, COLLECTIVE_FIXED_BYTES)
        which = DATA_PARALLEL_COLLECTIVES[int(result.get("zero", 0))]
        words = "; ".join(w for w in (words, f"{which}: {COLLECTIVE_BUFFERS['all_reduce']}") if w)
    return RankMeasurement(
        rank=result["rank"],
        peak_bytes=estimate.peak_bytes,
        measured_peak_bytes=measured_parameters + result["peak_activation_bytes"],
        parameter_bytes=estimate.parameter_bytes,
        measured_parameter_bytes=measured_parameters,
        stage_names=estimate.stage_names,
        stage_peak_bytes=estimate.stage_peak_bytes,
        measured_stage_peak_bytes=tuple(measured),
        method=f"{result['method']} per rank over {what} (gloo's buffers inside a "
        "collective not seen)",
        collective_buffer_bytes=buffers,
        collective_buffers=words,
        timings=reply.timings,
        resident_peak_bytes=reply.resident_peak_bytes,
        gradient_window_bytes=estimate.gradient_window_bytes,
        measured_gradient_window_bytes=tuple(result.get("gradient_window_bytes", ())),
    )


# What a data-parallel copy's step hands to gloo, by ZeRO stage (none that grows, as an
# all_reduce: ``rank.buffers_task`` measures the reduce and the broadcast too).
DATA_PARALLEL_COLLECTIVES = {
    0: "the gradients' all_reduce",
    1: "the gradients' all_reduce, ZeRO 1's broadcasts of the pieces",
    2: "each gradient's reduce onto its pieces' owners, ZeRO 2's broadcasts of the pieces",
    3: "each gradient's reduce onto its pieces' owners, ZeRO 3's broadcasts gathering a "
    "unit's weights",
}


def _buffer_words(plan: Plan) -> Iterator[str]:
    from attnctl.stages.collectives import COLLECTIVE_BUFFERS

    kinds = {name for name in COLLECTIVE_BUFFERS if any(
        s.name.endswith(name) for s in plan.stages)}  # fmt: skip
    for kind in sorted(kinds):
        yield f"{kind}: {COLLECTIVE_BUFFERS[kind]}"
    if any(_ring_transfer(s.name) for s in plan.stages):
        yield f"ring isend/irecv: {RING_TRANSFER_BUFFERS}"


def _ring_transfer(name: str) -> bool:
    """Whether a stage is ring attention's send or receive of a K or V chunk."""
    return "ring" in name and name.endswith(RING_TRANSFERS)


# ---------------------------------------------------------------- run --tp
