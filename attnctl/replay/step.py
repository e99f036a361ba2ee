"""Memory of one training step (forward, backward, Adam), replayed without torch.

Inference frees a tensor after its last use; training keeps what autograd saves for
the backward pass, then allocates gradients in the order the autograd engine runs.
The replay walks the plan's stages (``replay/stages.py``: what each stage's forward
allocates and saves, and what its backward allocates) through a model of the engine
(``replay/autograd.py``), so its peak is the peak of the real step, not a sum of
guesses. A ``--layers N`` stack is the plan's block N times over one shared embedding.

The step is: forward, ``loss = output.sum()``, ``loss.backward()``, ``Adam.step()``
(foreach=False). In float32 Adam updates the parameters directly. In float16 and
bfloat16 it is mixed precision: float32 master weights live beside the model for the
whole run, their float32 gradients are made from the model's just before the step,
and Adam's two moments are float32.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from attnctl.errors import AttnctlError
from attnctl.model.config import DTYPE_BYTES, FP32
from attnctl.model.describe import Attention, FeedForward
from attnctl.model.gpu import rounded
from attnctl.replay import (  # noqa: F401  (they register the attention's, the collectives' entries)
    attention,
    collectives,
)
from attnctl.replay.autograd import Replay
from attnctl.replay.ring import is_ring_stage, ring_output, ring_stage
from attnctl.replay.stages import EMBEDDING_STAGES, ENTRIES, INPUTS, Walk, weight_views
from attnctl.stages.plan import Plan, build_plan
from attnctl.trace import Stage

PHASES = ("forward", "backward", "optimizer step")
SHARED = ("embedding.", "positions.")  # one copy for the whole stack
# the replay walks every layer up to this many; a taller stack's phase peaks are carried
# on along the straight line the last two make (every further block adds the same bytes)
EXACT_LAYERS = 64


@dataclass(frozen=True)
class TrainingEstimate:
    parameter_bytes: int  # the model's weights in its dtype (stack)
    gradient_bytes: int  # their gradients, same dtype (stack)
    master_bytes: int  # float32 master weights (mixed precision only)
    optimizer_bytes: int  # Adam's two float32 moments
    saved_bytes: int  # what the forward leaves for the backward when it ends
    peak_bytes: int  # parameters + the most alive at once during the whole step
    peak_phase: str  # "forward", "backward" or "optimizer step"
    layers: int = 1
    # the most alive besides the parameters in each phase: forward, backward, optimizer step
    phase_peak_bytes: tuple[int, ...] = ()
    # the backward's peak up to each parameter's gradient, in the order they arrive
    gradient_window_bytes: tuple[int, ...] = ()
    # the forward's peak up to the end of each of the first block's stages (and inputs,
    # embeddings), as ``measure_training`` records them
    stage_window_bytes: tuple[int, ...] = ()


def parameter_sizes(plan: Plan, layers: int) -> list[int]:
    """Every trained parameter's element count in the step's order: the shared ones,
    then each layer's; a checkpoint's in its table's order, which holds the weights its
    blocks read (``measure_training`` hands Adam the same order)."""
    if plan.model is not None:
        return [_product(entry.shape) for entry in plan.model.source.table]
    shared = [p.count for p in plan.parameters if p.name.startswith(SHARED)]
    own = [p.count for p in plan.parameters if not p.name.startswith(SHARED)]
    return shared + own * layers


def estimate_training(plan: Plan, layers: int = 1) -> TrainingEstimate:
    """The memory of one training step of the plan's model: the seeded layer as a stack
    of ``layers``, or every block of a checkpoint (``layers`` is then its own)."""
    config = plan.config
    if config.impl not in ("math", "sdpa"):
        raise AttnctlError(f"cannot replay training for impl {config.impl!r}")
    if plan.model is not None:
        layers = plan.model.layers  # a checkpoint trains every one of its blocks
    if layers < 1:
        raise AttnctlError(f"layers must be a positive integer, got {layers}")
    refuse_unreplayable(plan, layers)
    if any(choice.fallback for choice in plan.sdpa_kernels):
        # SDPA falls back to its math kernel on this GPU: under autograd it keeps what
        # the math path keeps (K, V repeated, the scores, the weights; measured equal)
        plan = _as_math(plan)
    e = DTYPE_BYTES[config.dtype]
    mixed = config.dtype != "float32"
    count = sum(parameter_sizes(plan, layers))
    replayed = _replay_stack(plan, layers)
    peaks, saved = replayed.phase_peaks, replayed.saved
    if plan.cuda is not None:
        extras = cuda_phase_bytes(plan, len(parameter_sizes(plan, layers)))
        peaks = tuple(p + extra for p, extra in zip(peaks, extras, strict=True))
    windows, stage_windows = replayed.gradient_windows, replayed.stage_windows
    peak = max(peaks)
    model_bytes = count * e if plan.model is None else plan.parameter_bytes  # all it loads
    step = count * FP32
    return TrainingEstimate(
        parameter_bytes=model_bytes,
        gradient_bytes=count * e,
        master_bytes=step if mixed else 0,
        optimizer_bytes=2 * step,
        saved_bytes=saved,
        peak_bytes=model_bytes + peak,
        peak_phase=PHASES[peaks.index(peak)],
        layers=layers,
        phase_peak_bytes=peaks,
        gradient_window_bytes=windows,
        stage_window_bytes=stage_windows,
    )


def _as_math(plan: Plan) -> Plan:
    """The same plan on the math path."""
    return build_plan(
        dataclasses.replace(plan.config, impl="math"), plan.seq_len, plan.batch,
        plan.vocab_size, plan.config.device, context_len=plan.sizes.get("Lc"),
        model=plan.model, layer_index=plan.layer_index,
    )  # fmt: skip


def cuda_phase_bytes(plan: Plan, trained: int) -> tuple[int, int, int]:
    """What a training step allocates on CUDA beside the replay's tensors, by phase
    (forward, backward, optimizer step), as measured on the H200 with torch 2.11.

    The forward makes cuBLAS's workspace (and cuBLASLt's with a biased projection), the
    backward runs on autograd's thread, whose cuBLAS handle makes a second one; both are
    kept to the step. The backward also holds what its kernels keep: the math path one
    more B·H·L·Lk matrix (softmax's backward beside the scores' gradient), the fused
    kernels float32 gradients of the output and their statistics (the memory-efficient
    kernel's logsumexp and its gradient's; cuDNN's, with its buffers), and the loss and
    its gradient each in a 512-byte block. In the optimizer step the loss is still held
    (in its block), while Adam's step count of each of the ``trained`` tensors is a CPU
    tensor (torch.optim.Adam keeps it there unless fused or capturable)."""
    target, config, sizes = plan.cuda, plan.config, plan.sizes
    if target is None:
        return 0, 0, 0
    workspaces = {line.name: line.bytes for line in plan.device_lines}
    first = workspaces.get("cublas_workspace", 0) + workspaces.get("cublaslt_workspace", 0)
    again = target.cublas_workspace_bytes() if "cublas_workspace" in workspaces else 0
    element = DTYPE_BYTES[config.dtype]
    batch, heads, length = sizes["B"], sizes["H"], sizes["L"]
    keys = sizes.get("Lc", length)
    backward = 2 * (512 - element)  # the loss and its gradient
    matrix = batch * heads * length * keys
    if config.impl == "math" and not config.dropout:
        backward += rounded(matrix * element)
    elif config.impl == "math":  # CUDA's dropout keeps a bool mask, not the CPU's wider
        # one (fitted on one recording: dropout 0.1, float32, L 512)
        backward -= rounded(matrix)
    elif config.impl == "sdpa":
        output_gradient = rounded(batch * length * sizes["D"] * FP32)
        statistics = rounded(batch * heads * length * FP32)
        kernels = [c.kernel for c in plan.sdpa_kernels]
        if "cudnn" in kernels:
            backward += output_gradient + statistics + 3 * 512
            if config.kv_heads != config.heads:  # K and V gradients per query head
                backward += 2 * rounded(batch * heads * length * config.d_k * element)
        else:
            backward += output_gradient + 2 * statistics
    optimizer_step = first + again + (512 - element) - trained * FP32
    return first, first + again + backward, optimizer_step


def _replay_stack(
    plan: Plan, layers: int, shard: int | None = None, units: tuple[int, ...] | None = None
) -> Replayed:
    """The replay of ``layers`` blocks: its own up to EXACT_LAYERS, carried on along a
    straight line above (without the windows and the saved bytes by stage)."""
    if layers <= EXACT_LAYERS:
        return _replay(plan, layers, shard, units)
    before = _replay(plan, EXACT_LAYERS - 1, shard, units)
    last = _replay(plan, EXACT_LAYERS, shard, units)
    more = layers - EXACT_LAYERS
    peaks = tuple(
        b + more * (b - a) for a, b in zip(before.phase_peaks, last.phase_peaks, strict=True)
    )
    saved = last.saved + more * (last.saved - before.saved)
    gradients = last.gradient_bytes + more * (last.gradient_bytes - before.gradient_bytes)
    return Replayed(peaks, saved, (), (), {}, gradients)


@dataclass(frozen=True)
class StepReplay:
    """A step of the plan's block ``layers`` times over its embeddings, as
    :func:`estimate_training` replays it, with the state the replay itself counts (so
    that a split can put its own in its place)."""

    phase_peak_bytes: tuple[int, ...]  # besides the parameters: forward, backward, step
    saved_bytes: int
    master_bytes: int  # float32 masters, alive the whole step (mixed precision)
    # of the optimizer step's peak, the state (``optimizer_state``): the rest is what the
    # replay holds besides (the inputs, and what the backward leaves)
    optimizer_step_state_bytes: int
    # the backward's peak besides the parameters up to each trained tensor's gradient, in
    # the order they come (() for a stack taller than EXACT_LAYERS, carried on)
    gradient_window_bytes: tuple[int, ...] = ()


def replay_step(
    plan: Plan, layers: int, shard: int | None = None, units: tuple[int, ...] | None = None
) -> StepReplay:
    """The replay of ``layers`` of the plan's block (a rank's plan too), whatever the
    plan's own depth: a pipeline stage's blocks. ``shard`` (ZeRO 2 and 3): each
    parameter's gradient is freed as soon as it is made, reduce-scattered into a shard
    of ``shard`` bytes the first one's hook makes; the shard is the optimizer step's
    gradients (in its state). ``units`` (ZeRO 3): the bytes of the weights gathered for
    the embeddings' unit, then for each block (the last standing for any after it):
    each gathered while its forward runs and again from its first node in the backward
    to its last gradient (``rank_zero.ShardedWeights``)."""
    if plan.config.impl not in ("math", "sdpa"):
        raise AttnctlError(f"cannot replay training for impl {plan.config.impl!r}")
    refuse_unreplayable(plan, layers)
    replayed = _replay_stack(plan, layers, shard, units)
    sizes = parameter_sizes(plan, layers)
    masters, state = optimizer_state(sizes, plan.config.dtype)
    # the gradients the replay's backward made (or the shard it made), not the sizes' (a
    # checkpoint's sizes are its whole table, whatever ``layers``)
    made = replayed.gradient_bytes if shard is None else shard
    state += made - sum(sizes) * DTYPE_BYTES[plan.config.dtype]
    return StepReplay(
        replayed.phase_peaks, replayed.saved, masters, state, replayed.gradient_windows
    )


def optimizer_state(sizes: list[int], dtype: str) -> tuple[int, int]:
    """(masters, the state alive at the optimizer step's peak) for trained tensors of
    ``sizes`` values in ``dtype``, as ``_replay`` allocates them: the gradients, the
    masters and their float32 gradients, the moments and step counts, and the largest
    sqrt(v) + denom beside the previous tensor's denom."""
    count = sum(sizes)
    mixed, element = dtype != "float32", DTYPE_BYTES[dtype]
    masters = count * FP32 if mixed else 0
    temporaries = adam_temporaries(sizes)
    moments = 2 * count * FP32 + len(sizes) * FP32
    state = count * element + 2 * masters + moments + temporaries  # masters, their gradients
    return masters, state


def adam_temporaries(sizes: list[int]) -> int:
    """Adam's sqrt(v) and denom of a tensor beside the previous tensor's denom, at most."""
    fp32 = [n * FP32 for n in sizes]
    return max((2 * s + p for s, p in zip(fp32, [0, *fp32], strict=False)), default=0)


@dataclass(frozen=True)
class SavedActivations:
    """What one forward leaves for the backward, by part: the embeddings' (with the
    inputs' views the lookups keep), each block's, the loss. A block's count holds its
    input, which its first norm or projection keeps (made by the block before, or the
    embeddings); ``block_by_stage`` splits it by the stage (as the plan names it) whose
    forward made each tensor."""

    embedding_bytes: int
    block_bytes: int
    loss_bytes: int
    block_by_stage: dict[str, int]

    def total(self, blocks: int) -> int:
        """A stack of ``blocks`` blocks after the embeddings, as ``estimate_training``."""
        return self.embedding_bytes + blocks * self.block_bytes + self.loss_bytes


def saved_activations(plan: Plan) -> SavedActivations:
    """The saved bytes of the plan's embeddings and of one of its blocks (block 0's,
    standing for every block as the step's replay does): two replays, of one block and
    of two, differ by one block exactly."""
    if plan.config.impl not in ("math", "sdpa"):
        raise AttnctlError(f"cannot replay training for impl {plan.config.impl!r}")
    refuse_unreplayable(plan, 1)
    one, two = _replay(plan, 1), _replay(plan, 2)
    block = two.saved - one.saved
    names = two.saved_by_stage.keys() | one.saved_by_stage.keys()
    by_stage = {
        name: two.saved_by_stage.get(name, 0) - one.saved_by_stage.get(name, 0)
        for name in names
        if name != "loss"
    }
    by_stage = {name: n for name, n in by_stage.items() if n}
    loss = one.saved_by_stage["loss"]
    return SavedActivations(one.saved - block - loss, block, loss, by_stage)


def refuse_unreplayable(plan: Plan, layers: int) -> None:
    """What the replay does not model, refused by name before it runs."""
    config = plan.config
    description = plan.description
    if plan.model is None and description is not None and layers > 1:
        windows = set(description.stack_windows(layers))
        if len(windows) > 1:  # the replay repeats layer 0; these layers differ
            pattern = description.stack.window_pattern if description.stack else ""
            raise AttnctlError(
                f"memory --train does not model --sliding {pattern} yet, a stack of "
                "sliding and full layers (inference does)"
            )
    feed_forward = next(
        (s for s in plan.description.blocks[0].sublayers if isinstance(s, FeedForward)), None
    )
    if feed_forward is not None and feed_forward.gated and feed_forward.activation == "relu":
        raise AttnctlError(
            "memory --train does not model a gated relu feed-forward: the in-place "
            "act *= up overwrites the output relu's backward needs (inference is exact)"
        )
    windows = [
        s.config.window
        for block in plan.description.blocks
        for s in block.sublayers
        if isinstance(s, Attention)
    ]
    if config.impl == "sdpa" and not windows[0] and any(windows):
        raise AttnctlError(
            "memory --train does not model --impl sdpa with a sliding-window block after "
            "one without a window yet (--impl math does)"
        )
    for stage in plan.stages:
        ring = plan.context_parallel > 1 and (is_ring_stage(stage.name) or
                                              stage.name == "weighted_values")  # fmt: skip
        if stage.name not in ENTRIES and stage.name not in INPUTS and not ring:
            raise AttnctlError(
                f"memory --train does not replay the stage {stage.name!r} yet "
                "(memory without --train models it)"
            )


class Replayed(NamedTuple):
    phase_peaks: tuple[int, ...]  # the most alive (besides the parameters) in each phase
    saved: int  # what the forward leaves for the backward
    gradient_windows: tuple[int, ...]  # the backward's peak up to each parameter's gradient
    stage_windows: tuple[int, ...]  # the forward's peak up to the end of each recorded stage
    # of ``saved``, by the stage (as the plan names it) whose forward made it; "loss"
    saved_by_stage: dict[str, int]
    # the parameters' gradients the backward made (alive through the optimizer step)
    gradient_bytes: int = 0


def _replay(
    plan: Plan, layers: int, shard: int | None = None, units: tuple[int, ...] | None = None
) -> Replayed:
    """The step replayed, a layer at a time (``shard``, ``units``: ``replay_step``'s)."""
    config = plan.config
    e = DTYPE_BYTES[config.dtype]
    mixed = config.dtype != "float32"
    sizes = parameter_sizes(plan, layers)
    count = sum(sizes)

    r = Replay(gradient_shard_bytes=shard)
    if units is not None:
        r.unit_bytes = {-1: units[0]}
        r.unit_bytes.update({n: units[min(n + 1, len(units) - 1)] for n in range(layers)})
    if mixed:  # float32 master weights exist for the whole run
        r.new(count * FP32)
    stages = _stack(plan, layers)
    walk = Walk(r, plan, config, stages={s.name: s for _, _, s in stages})
    weight_views(walk)  # made when the weights are loaded, before the forward
    last_use = _python_lifetimes([s for _, _, s in stages], plan, layers)
    for _, base, stage in stages:
        if base in INPUTS:  # made before the model runs, held throughout
            walk.tensors[stage.name] = r.new(stage.bytes)
    inputs = {walk.tensors[name].storage for name in INPUTS if name in walk.tensors}
    stage_windows: list[int] = []
    for index, (block, base, stage) in enumerate(stages):
        if base in INPUTS:
            r.close_window(stage_windows)
            continue
        walk.block, walk.base = block, base
        r.origin = base
        if r.unit_bytes is not None:  # ZeRO 3: the forward gathers the stage's unit
            r.enter_unit(block if stage.name.startswith("blocks.") else -1)
        ins = [walk.tensors[name] for name in stage.reads]
        walk.tensors[stage.name] = _entry(plan, base)(walk, stage, ins)
        for owner in last_use.get(index, ()):
            r.drop(walk.tensors[owner].storage)
        for step in walk.then:
            step()
        if block == 0:
            r.close_window(stage_windows)  # block 0's stages are recorded as they end
        for step in walk.later:
            step()
        walk.then.clear()
        walk.later.clear()
    output = walk.tensors[stages[-1][2].name]
    r.enter_unit(None)  # ZeRO 3: the last unit freed before the loss
    r.origin = "loss"
    loss = r.new(e)  # output.sum()
    r.node(loss, (output,), (), (("pass", 0),))
    kept = {s for node in r.nodes for s in node.saved if s in r.live} - inputs
    saved = loss.nbytes + sum(r.live[s] for s in kept)
    by_stage: dict[str, int] = {"loss": loss.nbytes}
    for storage in kept:
        origin = r.origins[storage]
        by_stage[origin] = by_stage.get(origin, 0) + r.live[storage]
    for owner in last_use.get(len(stages), ()):  # `del result`: the returned tensors
        r.drop(walk.tensors[owner].storage)

    r.start("backward")
    r.backward(loss, r.new(e))  # the engine's ones_like(loss) seed

    gradients = sum(r.live[storage] for storage in r.param_grads.values())
    r.start("optimizer step")
    if mixed:  # float32 gradients for the masters, made from the model's
        r.new(count * FP32)
    r.new(2 * count * FP32 + len(sizes) * FP32)  # Adam's moments and step counts, made first
    # per tensor, Adam makes sqrt(v) and the quotient `denom`; the previous tensor's
    # denom is freed only when the new one is assigned
    fp32 = [n * FP32 for n in sizes]
    r.read(max(2 * s + p for s, p in zip(fp32, [0, *fp32], strict=False)))
    return Replayed(
        tuple(r.phase_peaks[p] for p in PHASES),
        saved,
        tuple(r.gradient_windows),
        tuple(stage_windows),
        by_stage,
        gradients,
    )


def _entry(plan: Plan, base: str):
    """The replay's entry for the plan's stage ``base``: ring attention's under ``--cp``."""
    if plan.context_parallel > 1:
        if base == "weighted_values":
            return ring_output
        if is_ring_stage(base):
            return ring_stage
    return ENTRIES[base]


def _product(shape: tuple[int, ...]) -> int:
    total = 1
    for n in shape:
        total *= n
    return total


def _stack(plan: Plan, layers: int) -> list[tuple[int, str, Stage]]:
    """(block, stage name in the plan, the stage named for the walk): the embeddings
    once, then the plan's block ``layers`` times, each reading the one before."""
    shared = [s for s in plan.stages if s.name in INPUTS or s.name in EMBEDDING_STAGES]
    block = [s for s in plan.stages if s not in shared]
    text = [s.name for s in shared if s.name not in INPUTS and not s.name.startswith("context")]
    walked: list[tuple[int, str, Stage]] = [(0, s.name, s) for s in shared]
    names = {s.name for s in shared}
    for n in range(layers):
        previous = text[-1] if n == 0 else f"blocks.{n - 1}.{block[-1].name}"

        def rename(name: str, n: int = n, previous: str = previous) -> str:
            if name == text[-1]:
                return previous
            return name if name in names else f"blocks.{n}.{name}"

        for s in block:
            renamed = dataclasses.replace(
                s,
                name=rename(s.name),
                reads=tuple(rename(r) for r in s.reads),
                view_of=rename(s.view_of) if s.view_of else None,
            )
            walked.append((n, s.name, renamed))
    return walked


def _python_lifetimes(stages: list[Stage], plan: Plan, layers: int) -> dict[int, list[str]]:
    """Stage index -> the storages whose Python reference ends after it (as the plan's
    liveness says); index len(stages): the model's returned tensors, dropped with
    `del result` once the loss is computed."""
    owner: dict[str, str] = {}
    index = {}
    for i, stage in enumerate(stages):
        owner[stage.name] = owner[stage.view_of] if stage.view_of else stage.name
        index[stage.name] = i
    last = {owner[s.name]: index[s.name] for s in stages if s.name not in INPUTS}
    for i, stage in enumerate(stages):
        for read in stage.reads:
            if read in owner and read not in INPUTS:
                last[owner[read]] = max(last[owner[read]], i)
    final = len(stages) - 1
    returned = {owner[stages[-1].name]}  # the model's output, and what it returns with it
    for held, until in plan.held_until.items():  # the attention's output, till it returns
        if held in INPUTS:
            continue
        for n in range(layers):
            name, end = f"blocks.{n}.{held}", index[f"blocks.{n}.{until}"]
            last[owner[name]] = max(last[owner[name]], end)
            if end == final:
                returned.add(owner[name])
    ends: dict[int, list[str]] = {}
    for name, end in last.items():
        ends.setdefault(len(stages) if name in returned else end, []).append(name)
    assert all(end <= final for end in last.values())
    return ends
