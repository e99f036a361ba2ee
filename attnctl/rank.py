"""One rank of a tensor- and context-parallel split: ``python -m attnctl.rank`` (started
by ``attnctl/distributed.py``, never by hand).

It reads its work as one JSON document on stdin (``{"rank", "world", "port",
"tasks": [...]}``), joins the group with ``torch.distributed.init_process_group``
over TCP on 127.0.0.1 (gloo on the CPU, NCCL on CUDA), runs each task in turn on its
share of the same weights the single device would use, and writes ONE JSON document on
stdout: ``{"rank", "results": [...], "start_seconds"}`` or ``{"rank", "error"}``. Each
task is ``measure`` (block 0 under ``measure.LiveStorages``, as ``memory --measure``;
a task's ``tp`` and ``cp`` place the rank in its TP group and CP ring, :func:`rank_places`)
or ``run`` (blocks 0..N over given token ids, the output and the shown weights back).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

STARTED = time.perf_counter()

# a test's way to make a rank fail, crash or hang: "error:RANK", "crash:RANK", "hang"
FAULT_VARIABLE = "ATTNCTL_TEST_RANK_FAULT"


def _die_with_parent(parent: int) -> None:
    """Linux: a signal when the parent dies, so no rank outlives attnctl even when it is
    killed outright (SIGKILL leaves it no time to kill the ranks itself)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # it died before the prctl: go now
        os._exit(1)


def _config(values: dict[str, Any]):
    from attnctl.config import LayerConfig

    return LayerConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def _full_model(config, vocab_size: int, model_dir: str | None):
    """The whole model's description, as the single device runs it."""
    from attnctl.describe import seeded_model

    if model_dir is None:
        return seeded_model(config, vocab_size)
    from attnctl.app.calls import load_model

    return load_model(model_dir).with_run(config)


def _rank_weights(full, config, device, group, blocks: int | None):
    """This rank's share of the single device's weights: the seeded layer under its seed
    (or the checkpoint's tensors) loaded whole, cut, and the whole freed."""
    from attnctl.nn.collectives import shard_weights
    from attnctl.nn.weights import model_weights

    whole = model_weights(full, config, device, blocks=blocks, head=full.checkpoint is not None)
    shard = shard_weights(whole.named, full, group, full.vocab_size)
    if blocks is None:  # what no block reads (BERT's pooler): held whole, as on one device
        read = {t.untyped_storage().data_ptr() for t in whole.named.values()}
        unread = [t for t in whole.stored if t.untyped_storage().data_ptr() not in read]
        shard.update({f"unread.{n}": tensor for n, tensor in enumerate(unread)})
    del whole
    return shard


@dataclass(frozen=True)
class RankPlace:
    """Where a rank sits in a world of T · C · D processes, rank = (dp_rank · C + cp_rank)
    · T + tp_rank: its tensor-parallel group (the T ranks of its CP rank and copy; None
    when T = 1), its context-parallel ring (the C ranks of its TP rank; None when C = 1)
    and the group of the D · C ranks at its TP place in every copy and CP rank
    (``data_group``: what ZeRO shards over, as Megatron-LM shards over its data- and
    context-parallel ranks; None: the world, when T = 1)."""

    rank: int
    tp: int
    cp: int
    group: Any = None  # nn.collectives.TensorGroup
    ring: Any = None  # nn.ring_attention.Ring
    dp: int = 1
    data_group: Any = None  # a torch.distributed group of the D · C ranks at this TP place
    tensor_groups: tuple[tuple[int, ...], ...] = ()  # every TP group's ranks, in order

    @property
    def cp_rank(self) -> int:
        return self.rank // self.tp % self.cp

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp * self.cp)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def state_rank(self) -> int:
        """Its index among the D · C ranks of its data group: dp_rank · C + cp_rank."""
        return self.rank // self.tp

    def data_peer(self, index: int) -> int:
        """The world rank of the data group's rank ``index`` (of D · C)."""
        return index * self.tp + self.tp_rank


def rank_places(rank: int, world: int, tasks: list[dict[str, Any]]) -> list[RankPlace]:
    """Each task's place of this rank, its process groups made (``dist.new_group``, which
    every rank calls for every group, in the same order; made once per split)."""
    import torch.distributed as dist

    from attnctl.nn.collectives import TensorGroup
    from attnctl.nn.ring_attention import Ring

    made: dict[tuple[int, int, int], tuple[Any, Any, Any, tuple]] = {}
    places = []
    for task in tasks:
        tp, cp, dp = int(task.get("tp", world)), int(task.get("cp", 1)), int(task.get("dp", 1))
        if tp * cp * dp != world:
            raise ValueError(f"--tp {tp} --cp {cp} --dp {dp} is not a world of {world} ranks")
        if (tp, cp, dp) not in made:
            # rank = (d · C + c) · T + t: a TP group each (d, c), a ring each (d, t), a
            # data group each t; None: the default group (the world)
            ranks_of = [tuple(range(first, first + tp)) for first in range(0, world, tp)]
            tensor_group = ring_group = data_group = None
            if tp > 1 and world > tp:
                tensor_groups = [dist.new_group(list(r)) for r in ranks_of]
                tensor_group = tensor_groups[rank // tp]
            if cp > 1 and world > cp:
                rings = {(d, t): dist.new_group([(d * cp + c) * tp + t for c in range(cp)])
                         for d in range(dp) for t in range(tp)}  # fmt: skip
                ring_group = rings[rank // (tp * cp), rank % tp]
            if tp > 1 and world > tp:
                data_groups = [dist.new_group(list(range(t, world, tp))) for t in range(tp)]
                data_group = data_groups[rank % tp]
            made[tp, cp, dp] = (tensor_group, ring_group, data_group, tuple(ranks_of))
        tensor_group, ring_group, data_group, ranks_of = made[tp, cp, dp]
        cp_rank, tp_rank = rank // tp % cp, rank % tp
        group = None
        if tp > 1:
            group = TensorGroup(tp_rank, tp, bool(task["sp"]), process_group=tensor_group)
        ring = None
        if cp > 1:
            ring = Ring(cp_rank, cp, int(task["seq_len"]), group=ring_group)
        places.append(RankPlace(rank, tp, cp, group, ring, dp, data_group, ranks_of))
    return places


def _stages(stages) -> list[dict[str, Any]]:
    return [stage.to_dict() for stage in stages]


def measure_task(task: dict[str, Any], place: RankPlace, device) -> dict[str, Any]:
    """Block 0 with the embeddings under LiveStorages, as ``measure.measure_forward``:
    the rank's heads (its TP group's share) of its chunk of the sequence (its CP ring's
    share, attended by ring attention)."""
    import contextlib

    import torch

    from attnctl.layer import Recorder
    from attnctl.measure import _measure
    from attnctl.nn.collectives import TensorGroup
    from attnctl.nn.model import forward
    from attnctl.nn.ring_attention import running
    from attnctl.parallel import Layout
    from attnctl.plan_parallel import rank_plan

    config = _config(task["config"])
    group, ring = place.group, place.ring
    layout = Layout(tp=place.tp, sp=bool(task["sp"]), cp=place.cp)
    model_dir = task.get("model_dir")
    full = _full_model(config, task["vocab_size"], model_dir)
    model = None if model_dir is None else full
    plan = rank_plan(
        config, task["seq_len"], task["batch"], task["vocab_size"], layout, model,
        cp_rank=place.cp_rank,
    )  # fmt: skip
    torch.manual_seed(config.seed)  # the seeded layer's weights, then the token ids drawn
    shard = _rank_weights(full, config, device, group or TensorGroup(0, 1), None)
    drawn = torch.randint(0, full.vocab_size, (plan.batch, task["seq_len"]), device=device)
    chunk = task["seq_len"] // place.cp  # this rank's tokens: (B, L/C), its own storage
    token_ids = drawn[:, place.cp_rank * chunk : (place.cp_rank + 1) * chunk].clone()
    del drawn
    offset = 0 if ring is None else ring.offset
    recorder = Recorder()

    def run(record) -> None:
        def both(name: str, tensor: torch.Tensor, dims: str) -> None:
            recorder(name, tensor, dims)
            record(name, tensor, dims)

        with running(ring) if ring is not None else contextlib.nullcontext():
            forward(plan.description, shard, token_ids, record=both, last=0, recorded=0,
                    group=group, offset=offset)  # fmt: skip

    stored = list(shard.values())
    parameter_bytes = sum(t.numel() * t.element_size() for t in stored)
    measured = _measure(run, stored, [token_ids], parameter_bytes, device)
    return {
        "rank": place.rank,
        "parameter_bytes": measured.parameter_bytes,
        "peak_activation_bytes": measured.peak_activation_bytes,
        "stage_peak_bytes": list(measured.stage_peak_bytes),
        "method": measured.method,
        "device": measured.device,
        "stages": _stages(recorder.stages),
    }


def train_task(task: dict[str, Any], place: RankPlace, device) -> dict[str, Any]:
    """One training step of ``layers`` blocks (block 0's weights copied, as
    ``measure.measure_training`` stacks the seeded layer) on this rank's shard, under
    ``measure.measure_step``: forward, ``loss = output.sum()``, backward through the
    collectives' autograd (``nn/collectives.py``), the replicated weights' gradients
    summed over the ranks that hold a part of them (:func:`sum_replicated_gradients`),
    then Adam on this rank's tensors.

    A data-parallel copy (``dp`` D > 1; its T ranks alike) draws token ids of its own
    (seed + its copy's index), averages every gradient over its data group after the
    backward (:func:`mean_gradients`) and steps Adam on every tensor (``zero`` 0) or on
    its pieces of the flat buffer, handing them to the others after (``zero`` 1, :func:`zero_step`;
    ``zero`` 2 reduce-scatters each gradient as it arrives, :class:`GradientShard`), or
    holds only its pieces of the weights too, each unit gathered while it is read
    (``zero`` 3, :class:`ShardedWeights`).
    ``gradients``: also hand back every tensor's gradient (a test's oracle: the single
    device's, cut the same way); ``parameters``: every tensor after the step."""
    import torch

    from attnctl.describe import ModelDescription
    from attnctl.measure import measure_step
    from attnctl.nn.collectives import TensorGroup
    from attnctl.nn.model import forward
    from attnctl.nn.ring_attention import running
    from attnctl.parallel import Layout
    from attnctl.plan_parallel import rank_plan

    config = _config(task["config"])
    group, ring = place.group, place.ring
    layout = Layout(tp=place.tp, sp=bool(task["sp"]), cp=place.cp, dp=place.dp)
    model_dir = task.get("model_dir")
    full = _full_model(config, task["vocab_size"], model_dir)
    model = None if model_dir is None else full
    plan = rank_plan(config, task["seq_len"], task["batch"], task["vocab_size"], layout, model,
                     cp_rank=place.cp_rank)  # fmt: skip
    torch.manual_seed(config.seed)  # the seeded layer's weights, then the token ids drawn
    shard = _rank_weights(full, config, device, group or TensorGroup(0, 1), None)
    drawn = None  # a data-parallel copy's own batch: seed + its rank
    if place.dp > 1:
        drawn = torch.Generator(device=device).manual_seed(config.seed + place.dp_rank)
    token_ids = torch.randint(0, full.vocab_size, (plan.batch, task["seq_len"]), device=device,
                              generator=drawn)  # fmt: skip
    if ring is not None:  # this rank's chunk of the sequence: (B, L/C), its own storage
        chunk = task["seq_len"] // place.cp
        token_ids = token_ids[:, place.cp_rank * chunk : (place.cp_rank + 1) * chunk].clone()
    shard = {k: v.detach() for k, v in shard.items()}  # leaves: Adam's parameters
    if model is None:
        layers = int(task["layers"])
        block = {k: v for k, v in shard.items() if k.startswith("blocks.0.")}
        named = {k: v.requires_grad_() for k, v in shard.items() if not k.startswith("blocks.")}
        for n in range(layers):  # block n's weights: block 0's values in tensors of their own
            for key, value in block.items():
                tensor = value if n == 0 else value.detach().clone()
                named[key.replace("blocks.0.", f"blocks.{n}.", 1)] = tensor.requires_grad_()
        parameters = list(named.values())  # the shared ones first, then each block's
        stack = ModelDescription(plan.description.embeddings, plan.description.blocks * layers)
    else:  # every block; the weights its table maps trained, in its order (a head is not),
        # each a tensor of its own (a fused tensor's parts too: the rank plan's table)
        layers, named, stack = full.layers, shard, plan.description
        table = plan.model.source.table
        parameters = [shard[e.targets[0]].requires_grad_() for e in table]
    held = named if model is None else shard  # the stack's copies; a checkpoint's all
    mixed = config.dtype != "float32"
    zero = int(task.get("zero", 0))
    copies = Copies.of(place) if place.dp > 1 or zero else None  # ZeRO shards over D · C
    partials = replicated_partials(named, full, group, place.tensor_groups)
    name_of = {id(tensor): name for name, tensor in named.items()}
    trained = [name_of[id(parameter)] for parameter in parameters]  # Adam's order
    sharded = None  # ZeRO 3: the rank's shard of every trained tensor, the rest gathered
    if copies is not None and zero == 3:
        partial = partial_sums(partials, trained)
        sharded = ShardedWeights(named, trained, copies, mixed, partial)
        untrained = [t for name, t in held.items() if name not in set(trained)]
        held = {"shard": sharded.shard, **{f"whole.{n}": t for n, t in enumerate(untrained)}}
        named, parameters = sharded.named, sharded.leaves
        del shard
    parameter_bytes = sum(t.numel() * t.element_size() for t in held.values())

    def run(record):
        if ring is None:
            return forward(stack, named, token_ids, last=layers - 1, record=record, group=group,
                           training=True, gather=sharded)  # fmt: skip
        with running(ring):
            return forward(stack, named, token_ids, last=layers - 1, record=record, group=group,
                           training=True, offset=ring.offset, gather=sharded)  # fmt: skip

    summed = sum_replicated_gradients(named, partials)
    if ring is not None and copies is None:  # every weight is on every CP rank: its
        summed = _then(summed, sum_over_ring(parameters, ring))  # gradient is a part
    step = None
    shards: list[Any] = []  # ZeRO 2, 3: the rank's gradient pieces, once the step has made them
    measured_held = None
    if copies is not None:
        # ZeRO 2, 3: each gradient summed over TP (partial_sums), then reduced, as it arrives
        summed = None if zero >= 2 else _then(summed, mean_gradients(parameters, copies))
        if sharded is not None:
            step = lambda: sharded.step(shards)  # noqa: E731
            measured_held = [sharded.shard]  # the leaves are counted while gathered
        elif zero:
            partial = partial_sums(partials, trained) if zero >= 2 else None
            step = lambda: zero_step(parameters, mixed, copies,  # noqa: E731
                                     shards if zero >= 2 else None, partial)  # fmt: skip
    measured = measure_step(run, parameters, [token_ids], parameter_bytes, mixed, device, summed,
                            step, measured_held)  # fmt: skip
    result = {
        "rank": place.rank,
        "parameter_bytes": measured.parameter_bytes,
        "peak_activation_bytes": measured.peak_activation_bytes,
        "phase_peak_bytes": list(measured.phase_peak_bytes),
        "gradient_window_bytes": list(measured.gradient_window_bytes),
        "method": measured.method,
        "device": measured.device,
    }
    if copies is not None:
        result.update(dp=place.dp, dp_rank=place.dp_rank, zero=zero)
    if task.get("gradients") and zero >= 2:  # the pieces this rank holds: (first, values)
        name_of = {id(tensor): name for name, tensor in named.items()}  # ZeRO 3's leaves
        result["gradient_pieces"] = [
            [name_of[id(parameters[index])], first, piece.float().cpu().tolist()]
            for index, first, piece in shards
        ]
    elif task.get("gradients"):
        result["gradients"] = {
            k: v.grad.float().cpu().tolist() for k, v in named.items() if v.grad is not None
        }
    if task.get("parameters"):
        if sharded is not None:  # every unit gathered again, after the measurement
            sharded.gather_all()
        result["parameters"] = {k: v.detach().float().cpu().tolist() for k, v in named.items()}
    return result


def sum_over_ring(parameters: list[Any], ring):
    """What runs after the backward under context parallelism: every gradient summed in
    place over the CP ring (each rank's is its L / C tokens' part), as Megatron-LM sums
    them over its data- and context-parallel ranks."""
    import torch.distributed as dist

    def summed() -> None:
        for parameter in parameters:
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad, group=ring.group)

    return summed


def _then(first, second):
    """``first`` then ``second`` (either None: the other)."""
    if first is None or second is None:
        return first or second

    def both() -> None:
        first()
        second()

    return both


@dataclass(frozen=True)
class Copies:
    """The ranks a gradient is summed over and ZeRO shards over, as one of them sees
    them: the D · C ranks at its TP place in every data-parallel copy and CP rank (as
    Megatron-LM's distributed optimizer shards over data- and context-parallel ranks):
    how many, which is its own, their process group (None: the world) and each one's
    world rank (a piece's owner is one of them; a collective names it by its world rank).
    ``divisor``: D, what the sum is divided by (a CP rank's gradient is a part of its
    copy's: summed, not averaged)."""

    size: int
    rank: int
    group: Any
    peers: tuple[int, ...]
    divisor: int

    @classmethod
    def of(cls, place: RankPlace) -> Copies:
        size = place.dp * place.cp
        peers = tuple(place.data_peer(index) for index in range(size))
        return cls(size, place.state_rank, place.data_group, peers, place.dp)

    def peer(self, index: int) -> int:
        return self.peers[index]


def mean_gradients(parameters: list[Any], copies: Copies):
    """What runs between a data-parallel copy's backward and its optimizer step: every
    gradient all-reduced in place over ``copies`` (the copies and, under --cp, their CP
    ranks' parts) and divided by the copies in place (the mean, as Megatron-LM and DDP
    take it)."""
    import torch.distributed as dist

    def mean() -> None:
        for parameter in parameters:
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad, group=copies.group)
                parameter.grad.div_(copies.divisor)

    return mean


def zero_step(
    parameters: list[Any], mixed: bool, copies: Copies, shards: list | None = None,
    partial: Callable[[int, Any], None] | None = None,
):  # fmt: skip
    """ZeRO 1's optimizer step on data-parallel rank ``copies.rank``, as Megatron-LM's
    distributed optimizer: Adam (foreach=False) on this rank's pieces of the flat buffer
    (``parallel.zero_ranges``). In float32 they are views of the parameters' flat pieces,
    their gradients views of the gradients' pieces; under mixed precision float32 master
    pieces made now (alive the whole step), their gradients made from the gradients'
    pieces just before the step, copied back into the parameters' pieces after it. Then
    every rank's pieces go to the others: each piece broadcast from its owner into the
    same piece of everybody's parameter (no temporaries). Returns the step.

    ``shards`` (a list, ZeRO 2): the gradients are reduce-scattered as they arrive
    (:class:`GradientShard`, ``partial`` before each) and the step's gradients are views
    of the rank's shard; ``shards`` gets (tensor index, first value, view) of each of the
    rank's pieces."""
    import torch
    import torch.distributed as dist

    from attnctl.parallel import zero_ranges

    sizes = [parameter.numel() for parameter in parameters]
    flat = [parameter.detach().view(-1) for parameter in parameters]  # views: no storage
    owned = [zero_ranges(sizes, copies.size, owner) for owner in range(copies.size)]
    pieces = [flat[index][first:end] for index, first, end in owned[copies.rank]]
    masters = [piece.float() for piece in pieces] if mixed else pieces
    optimizer = torch.optim.Adam(masters, foreach=False) if masters else None
    shard = None
    if shards is not None:
        shard = GradientShard(parameters, owned, copies, partial=partial)

    def step() -> None:
        for (index, first, end), master in zip(owned[copies.rank], masters, strict=True):
            if shard is None:
                gradient = parameters[index].grad.view(-1)[first:end]
            else:
                gradient = shard.pieces[index]
                shards.append((index, first, gradient))
            master.grad = gradient.float() if mixed else gradient
        if optimizer is not None:
            optimizer.step()
        if mixed:
            with torch.no_grad():
                for piece, master in zip(pieces, masters, strict=True):
                    piece.copy_(master)
        for owner, ranges in enumerate(owned):
            for index, first, end in ranges:
                dist.broadcast(flat[index][first:end], src=copies.peer(owner),
                               group=copies.group)  # fmt: skip

    return step


class GradientShard:
    """ZeRO 2's gradients on rank ``copies.rank`` of the D · C it shards over,
    reduce-scattered as they arrive, as DeepSpeed's stage 2 does with a bucket of one
    tensor: when the first gradient is made, a buffer of S values (⌈n / (D · C)⌉, the
    gradients' dtype, alive from then on) holds the rank's pieces end to end (``pieces``:
    tensor index -> its view); each parameter's post-accumulate hook reduces (sums) every
    piece of its gradient onto the piece's owner in place, the owner copies its piece into
    the buffer and divides it by D (the copies' mean), then the whole gradient is freed.
    ``partial(index, gradient)``, first in the hook: a tensor-parallel rank's sum of a
    replicated weight's part over the ranks that hold it (in place; the same order on
    every rank)."""

    def __init__(
        self, parameters: list[Any], owned: list[list[tuple[int, int, int]]], copies: Copies,
        gone: Callable[[int], None] | None = None,
        partial: Callable[[int, Any], None] | None = None,
    ) -> None:  # fmt: skip
        self.parameters, self.owned, self.copies = parameters, owned, copies
        self.rank = copies.rank
        self.gone = gone  # told each tensor's index once its gradient is freed (ZeRO 3)
        self.partial = partial
        self.owners: dict[int, list[tuple[int, int, int]]] = {}  # tensor -> (owner, first, end)
        for owner, ranges in enumerate(owned):
            for index, first, end in ranges:
                self.owners.setdefault(index, []).append((owner, first, end))
        self.pieces: dict[int, Any] = {}
        self.buffer = None
        for index, parameter in enumerate(parameters):
            parameter.register_post_accumulate_grad_hook(self._arrived(index))

    def _make_buffer(self, like) -> None:
        import torch

        size = -(-sum(p.numel() for p in self.parameters) // self.copies.size)
        self.buffer = torch.empty(size, dtype=like.dtype, device=like.device)  # (S,)
        offset = 0
        for index, first, end in self.owned[self.rank]:  # the pieces, then the padding
            self.pieces[index] = self.buffer[offset : offset + end - first]
            offset += end - first

    def _arrived(self, index: int):
        import torch
        import torch.distributed as dist

        from attnctl.nn.collectives import _released

        def hook(parameter) -> None:
            gradient = parameter.grad.view(-1)  # (n,)
            if self.buffer is None:
                self._make_buffer(gradient)
            if self.partial is not None:
                self.partial(index, parameter.grad)
            copies = self.copies
            with torch.no_grad():
                for owner, first, end in self.owners.get(index, ()):
                    piece = gradient[first:end]  # an alias of its own, handed to gloo
                    dist.reduce(piece, dst=copies.peer(owner), group=copies.group)
                    if owner == self.rank:
                        self.pieces[index].copy_(piece).div_(copies.divisor)
                    handed = [piece]
                    del piece
                    _released(handed)  # gloo lets go of it a moment after the reduce
            parameter.grad = gradient = None  # freed before the next op
            if self.gone is not None:
                self.gone(index)

        return hook


class ShardedWeights:
    """ZeRO 3 on rank ``copies.rank`` of the D · C it shards over, as FSDP with one unit a
    block and one for the trained weights outside the blocks (unit -1: the embeddings'):
    the rank holds ``shard``, S = ⌈n / (D · C)⌉ values in the weights' dtype, its pieces of
    the ``trained`` tensors end to end (``parallel.zero_ranges``); the rest of ``named``
    (an untrained head) stays whole. ``partial``: :class:`GradientShard`'s.

    Autograd sees ``leaves``: each trained tensor whole, its storage freed (resized to no
    bytes) while its unit is not gathered. ``nn.model.forward`` calls the object before
    each unit (its ``gather``): the unit read before is freed, a hook put on its output
    gathers it again when the backward reaches it, and the next is gathered: its storages
    grown back and every piece broadcast from its owner (through an alias of the storage,
    so that the leaf's version, which autograd checks, does not change). The gradients
    go as ZeRO 2's (:class:`GradientShard`); a unit is freed once its last has gone.
    ``measure.storage_resized`` tells the measurement of each resize."""

    def __init__(
        self, named: dict[str, Any], trained: list[str], copies: Copies, mixed: bool,
        partial: Callable[[int, Any], None] | None = None,
    ) -> None:  # fmt: skip
        import torch

        from attnctl.parallel import zero_ranges

        self.copies, self.rank, self.mixed, self.partial = copies, copies.rank, mixed, partial
        rank, size = copies.rank, copies.size
        tensors = [named[name] for name in trained]
        sizes = [t.numel() for t in tensors]
        self.owned = [zero_ranges(sizes, size, owner) for owner in range(size)]
        self.owners: dict[int, list[tuple[int, int, int]]] = {}  # tensor -> (owner, first, end)
        for owner, ranges in enumerate(self.owned):
            for index, first, end in ranges:
                self.owners.setdefault(index, []).append((owner, first, end))
        like = tensors[0]
        self.shard = torch.empty(-(-sum(sizes) // size), dtype=like.dtype, device=like.device)
        self.pieces: list[Any] = []  # views of the shard (S,): the rank's pieces, then padding
        self.mine: dict[int, Any] = {}  # tensor index -> the rank's piece of it
        offset = 0
        with torch.no_grad():
            for index, first, end in self.owned[rank]:
                piece = self.shard[offset : offset + end - first]
                piece.copy_(tensors[index].detach().reshape(-1)[first:end])
                self.pieces.append(piece)
                self.mine[index] = piece
                offset += end - first
        self.leaves: list[Any] = []
        self.aliases: list[Any] = []  # (n,) on each leaf's storage, a version of its own
        for tensor in tensors:
            leaf = torch.empty_like(tensor).requires_grad_()
            alias = torch.empty(0, dtype=leaf.dtype, device=leaf.device)
            alias.set_(leaf.untyped_storage(), 0, (leaf.numel(),))
            leaf.untyped_storage().resize_(0)
            self.leaves.append(leaf)
            self.aliases.append(alias)
        kept = set(trained)
        self.named = {name: tensor for name, tensor in named.items() if name not in kept}
        self.named.update(zip(trained, self.leaves, strict=True))
        self.unit_of = [_unit(name) for name in trained]
        self.units: dict[int, list[int]] = {}
        for index, unit in enumerate(self.unit_of):
            self.units.setdefault(unit, []).append(index)
        self.gathered: set[int] = set()
        self.waiting: dict[int, int] = {}  # unit -> gradients still to go (the backward)
        self.forward_unit: int | None = None

    def __call__(self, unit: int, hidden) -> None:
        """``nn.model.forward``'s ``gather``: before ``unit`` (-1, then each block, then
        one past the last), with its input ``hidden``, the previous unit's output."""
        previous, self.forward_unit = self.forward_unit, unit
        if previous is not None:
            self._free(previous)
            if hidden is not None and hidden.requires_grad:  # its backward starts there
                hidden.register_hook(lambda gradient, unit=previous: self._gather(unit))
        self._gather(unit)

    def _gather(self, unit: int) -> None:
        import torch
        import torch.distributed as dist

        from attnctl.measure import storage_resized

        if unit in self.gathered or unit not in self.units:
            return
        self.gathered.add(unit)
        self.waiting[unit] = len(self.units[unit])
        for index in self.units[unit]:
            leaf = self.leaves[index]
            leaf.untyped_storage().resize_(leaf.numel() * leaf.element_size())
            storage_resized(leaf)
        with torch.no_grad():
            for index in self.units[unit]:
                alias = self.aliases[index]
                for owner, first, end in self.owners.get(index, ()):
                    if owner == self.rank:
                        alias[first:end].copy_(self.mine[index])
                    dist.broadcast(alias[first:end], src=self.copies.peer(owner),
                                   group=self.copies.group)  # fmt: skip

    def _free(self, unit: int) -> None:
        from attnctl.measure import storage_resized

        if unit not in self.gathered:
            return
        self.gathered.discard(unit)
        for index in self.units[unit]:
            self.leaves[index].untyped_storage().resize_(0)
            storage_resized(self.leaves[index])

    def gone(self, index: int) -> None:
        """Tensor ``index``'s gradient has gone to its owners: its unit is freed after the
        last of them."""
        unit = self.unit_of[index]
        self.waiting[unit] = self.waiting.get(unit, 1) - 1
        if self.waiting[unit] == 0:
            self._free(unit)

    def gather_all(self) -> None:
        for unit in self.units:
            self._gather(unit)

    def step(self, shards: list):
        """The optimizer step, made before the forward: Adam (foreach=False) on the rank's
        pieces of the shard (under mixed precision on float32 master pieces made now,
        copied back after), their gradients the rank's pieces of :class:`GradientShard`,
        whose hooks go on the leaves now; nothing is broadcast (the next forward gathers).
        ``shards`` gets (tensor index, first value, gradient piece)."""
        import torch

        masters = [piece.float() for piece in self.pieces] if self.mixed else self.pieces
        optimizer = torch.optim.Adam(masters, foreach=False) if masters else None
        gradients = GradientShard(self.leaves, self.owned, self.copies, self.gone, self.partial)

        def step() -> None:
            for (index, first, _), master in zip(self.owned[self.rank], masters, strict=True):
                gradient = gradients.pieces[index]
                shards.append((index, first, gradient))
                master.grad = gradient.float() if self.mixed else gradient
            if optimizer is not None:
                optimizer.step()
            if self.mixed:
                with torch.no_grad():
                    for piece, master in zip(self.pieces, masters, strict=True):
                        piece.copy_(master)

        return step


def _unit(name: str) -> int:
    """ZeRO 3's unit of a weight: its block, or -1 (outside the blocks)."""
    if name.startswith("blocks."):
        return int(name.split(".", 2)[1])
    return -1


def replicated_partials(
    named: dict[str, Any], full, group, tensor_groups: tuple[tuple[int, ...], ...] = ()
) -> dict[str, Any]:
    """The replicated weights whose gradient on a tensor-parallel rank is a part (its
    rank's heads' or tokens' share), each with the group over which it is summed, as
    Megatron-LM sums them. A per-head norm (``qk_norm head``) serves this rank's heads
    only; a kv-head replicated on T / Hkv ranks (T > Hkv) serves each of them its own
    query heads; under sequence parallelism every other replicated weight (the norms, the
    biases added after a sum, the positions) sees this rank's L / T tokens. Under TP
    alone the others see every token: their gradients are whole.

    ``tensor_groups``: every TP group's world ranks (several with --dp or --cp; () : the
    world is the one group), for the kv-heads' groups, which every rank makes for every
    TP group in the same order."""
    import torch.distributed as dist

    from attnctl.nn.collectives import _kind

    if group is None or group.size == 1:
        return {}
    config = full.blocks[0].attention.config
    sharing = None  # the kv-heads' groups of ranks, when T > Hkv
    if group.size > config.kv_heads:
        copies = group.size // config.kv_heads
        mine = None
        for ranks in tensor_groups or (tuple(range(group.size)),):
            made = [dist.new_group(list(ranks[j * copies : (j + 1) * copies]))
                    for j in range(config.kv_heads)]  # fmt: skip
            if dist.get_rank() in ranks:
                mine = made[group.rank // copies]
        sharing = dataclasses.replace(group, process_group=mine)

    def partial(name: str) -> Any:
        """The group over which ``name``'s gradient is a part, or None (whole)."""
        kind = _kind(name)
        if kind == "kv_heads":  # its rank's query heads' part of a copied kv-head's
            return sharing
        if kind != "replicated":
            return None
        if ".q_norm." in name or ".k_norm." in name:  # its rank's heads' part, whatever T
            return group
        return group if group.sequence_parallel else None

    found = {name: partial(name) for name in named}
    return {name: over for name, over in found.items() if over is not None}


def sum_replicated_gradients(named: dict[str, Any], partials: dict[str, Any]):
    """What runs between the backward and the optimizer step: each gradient of
    :func:`replicated_partials` summed in place over its group (None: there are none)."""
    from attnctl.nn.collectives import _sum_in_place

    if not partials:
        return None
    plan = [(named[name], over) for name, over in partials.items()]

    def summed() -> None:
        for tensor, over in plan:
            if tensor.grad is not None:
                _sum_in_place(over, tensor.grad)

    return summed


def partial_sums(partials: dict[str, Any], names: list[str]):
    """:class:`GradientShard`'s ``partial`` for the tensors ``names`` (its indices): each
    of :func:`replicated_partials` summed in place over its group as its gradient arrives
    (under ZeRO 2 and 3 the gradient is gone to its owner right after)."""
    from attnctl.nn.collectives import _sum_in_place

    over = [partials.get(name) for name in names]
    if not any(g is not None for g in over):
        return None

    def partial(index: int, gradient: Any) -> None:
        if over[index] is not None:
            _sum_in_place(over[index], gradient)

    return partial


def run_task(task: dict[str, Any], group, device) -> dict[str, Any]:
    """Blocks 0..``last`` over the given token ids: this rank's output (its L / T tokens
    under SP), its stages of block ``last`` and the weights of its shown heads."""
    import torch

    from attnctl.layer import Recorder
    from attnctl.nn.model import forward
    from attnctl.parallel import Layout, rank_heads
    from attnctl.plan_parallel import rank_plan

    config = _config(task["config"])
    layout = Layout(tp=group.size, sp=group.sequence_parallel)
    model_dir = task.get("model_dir")
    last = task["last"]
    token_ids = torch.tensor(task["token_ids"], device=device)  # (B, L)
    full = _full_model(config, task["vocab_size"], model_dir)
    model = None if model_dir is None else full
    batch, seq_len = token_ids.shape
    plan = rank_plan(config, seq_len, batch, task["vocab_size"], layout, model, layer_index=last)
    shard = _rank_weights(full, config, device, group, last + 1)
    attention = full.blocks[last].attention.config
    mine, _ = rank_heads(attention.heads, attention.kv_heads, group.size, group.rank)
    shown = [h for h in task["heads"] if h in mine]
    local = [h - mine.start for h in shown] or [0]  # a window of one head at least
    padding = task.get("padding")
    if padding is not None:
        padding = torch.tensor(padding, dtype=torch.bool, device=device)  # (B, Lk)
    recorder = Recorder()
    with torch.inference_mode():
        result = forward(
            plan.description, shard, token_ids, last=last, records={last: recorder},
            padding=padding, shown=[last], window=(local, task["rows"]), group=group,
        )  # fmt: skip
    weights = result.windows[last][:, : len(shown)]  # (B, h, r, Lk)
    return {
        "rank": group.rank,
        "heads": shown,
        "weights": weights.float().cpu().tolist(),
        "output": result.output.float().cpu().tolist(),  # (B, L or L/T, D)
        "stages": _stages(recorder.stages),
    }


def buffers_task(task: dict[str, Any], group, device) -> dict[str, Any]:
    """What the backend allocates inside each collective of ``nn/collectives.py``, beyond
    the tensors it is given: the rise of this process's peak resident memory (VmHWM,
    reset first; Linux) over one collective of a float32 (B, L, D) of ``mebibytes``,
    and over one ring attention step's isend / irecv of it (``send_recv``), with every
    tensor it is handed already in memory."""
    import torch
    import torch.distributed as dist

    from attnctl.nn.collectives import TensorGroup, gather_sequence, reduce_partial

    width, batch = 64, 2
    length = task["mebibytes"] * 2**20 // 4 // batch // width
    length -= length % group.size
    split = TensorGroup(group.rank, group.size, sequence_parallel=True)
    whole = TensorGroup(group.rank, group.size)
    partial = torch.ones(batch, length, width, device=device)  # (B, L, D)
    mine = torch.ones(batch, length // group.size, width, device=device)  # (B, L/T, D)
    incoming = torch.zeros_like(partial)  # (B, L, D): ring attention's receive buffer
    risen = {}
    for name, collective in (
        ("all_gather", lambda: gather_sequence(split, mine)),
        ("reduce_scatter", lambda: reduce_partial(split, partial)),
        ("all_reduce", lambda: reduce_partial(whole, partial)),
        ("reduce", lambda: _in_place(dist.reduce, partial, dst=0)),  # ZeRO 2's gradients
        ("broadcast", lambda: _in_place(dist.broadcast, partial, src=0)),  # ZeRO's pieces
        ("send_recv", lambda: _ring_pass(group, partial, incoming)),
    ):
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # the peak resident memory starts again from here
        before = _resident_peak()
        returned = collective()
        after = _resident_peak()
        handed = returned is partial or returned is incoming
        made = 0 if handed else returned.numel() * returned.element_size()
        risen[name] = after - before - made  # what it returned is not the backend's own
        del returned
    return {"rank": group.rank, "bytes": batch * length * width * 4, "buffers": risen}


def _in_place(collective, tensor, **where):
    """``collective(tensor, ...)``, which works in place: returns ``tensor``."""
    collective(tensor, **where)
    return tensor


def _ring_pass(group, sent, received):
    """One step of ring attention's transfers: ``sent`` to the next rank, the one
    before's into ``received`` (``batch_isend_irecv``, as ``nn/ring_attention.attend``);
    returns ``received``, which was already in memory."""
    import torch.distributed as dist

    after, before = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, sent, after), dist.P2POp(dist.irecv, received, before)]
    )
    for work in works:
        work.wait()
    return received


def _resident_peak() -> int | None:
    """This process's peak resident memory (Linux's VmHWM), or None elsewhere."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _fault(rank: int) -> None:
    """A test's fault, before a task runs (FAULT_VARIABLE; unset: nothing)."""
    fault = os.environ.get(FAULT_VARIABLE, "")
    kind, _, which = fault.partition(":")
    if not fault or (which and int(which) != rank):
        return
    if kind == "hang":
        time.sleep(3600)
    if kind == "error":
        from attnctl.errors import AttnctlError

        raise AttnctlError("a failure asked for by " + FAULT_VARIABLE)
    if kind == "crash":
        os._exit(3)  # no JSON at all: the parent says how it ended


TASKS = {"measure": measure_task, "run": run_task, "buffers": buffers_task}
PLACED = {"measure": measure_task, "train": train_task}  # given the rank's place


def main() -> int:
    document = json.loads(sys.stdin.read())
    rank, world = document["rank"], document["world"]
    _die_with_parent(document["parent"])
    try:
        import torch
        import torch.distributed as dist

        from attnctl.layer import resolve_device
        from attnctl.nn.collectives import TensorGroup

        imported = time.perf_counter()
        threads = document.get("threads")
        if threads:
            torch.set_num_threads(threads)
        device = resolve_device(document["device"])
        backend = "gloo"
        if device.type == "cuda":  # one GPU a rank
            backend, device = "nccl", torch.device("cuda", rank)
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{document['port']}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=document["timeout"]),
        )
        joined = time.perf_counter()
        results = []
        places = rank_places(rank, world, document["tasks"])
        for task, place in zip(document["tasks"], places, strict=True):
            _fault(rank)
            if task["kind"] in PLACED:
                results.append(PLACED[task["kind"]](task, place, device))
            else:  # a --tp split over the whole world
                group = place.group or TensorGroup(rank, world, bool(task["sp"]))
                results.append(TASKS[task["kind"]](task, group, device))
        dist.barrier()  # every rank done with every collective before any leaves
        reply = {
            "rank": rank,
            "results": results,
            "import_seconds": imported - STARTED,
            "join_seconds": joined - imported,
            "work_seconds": time.perf_counter() - joined,
            "resident_peak_bytes": _resident_peak(),
        }
    except Exception as error:  # one line for the parent, whatever it was
        from attnctl.errors import AttnctlError

        text = error.message if isinstance(error, AttnctlError) else f"{type(error).__name__}: "
        if not isinstance(error, AttnctlError):
            text += (str(error).strip().splitlines() or [""])[0]
        reply = {"rank": rank, "error": text}
    sys.stdout.write(json.dumps(reply))
    sys.stdout.flush()
    # out at once: the group's threads are not torn down (gloo's teardown may abort
    # while a peer is gone), and the parent kills what is left of the ranks anyway
    os._exit(0 if "error" not in reply else 1)


if __name__ == "__main__":
    main()
