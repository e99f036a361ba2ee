"""A rank's training step (``memory --measure --train`` of a split): forward, backward
through the collectives, the partial gradients summed over the ranks that share a
weight, the ring's gradients, the data copies' mean and Adam."""

from __future__ import annotations

import dataclasses
from typing import Any

from attnctl.parallel.rank_place import (
    RankPlace,
    _config,
    _full_model,
    _rank_weights,
)
from attnctl.parallel.rank_zero import Copies, ShardedWeights, mean_gradients, zero_step


def train_task(task: dict[str, Any], place: RankPlace, device) -> dict[str, Any]:
    """One training step of ``layers`` blocks (block 0's weights copied, as
    ``measure.measure_training`` stacks the seeded layer) on this rank's shard, under
    ``measure.measure_step``: forward, ``loss = output.sum()``, backward through the
    collectives' autograd (``nn/collectives.py``), the replicated weights' gradients
    summed over the ranks that hold a part of them (:func:`sum_replicated_gradients`),
    then Adam on this rank's tensors.

    A data-parallel copy (``dp`` D > 1) draws token ids of its own and averages every
    gradient over its data group (:func:`mean_gradients`); ZeRO 1 steps Adam on its pieces
    (:func:`zero_step`), 2 reduces each gradient as it arrives (:class:`GradientShard`),
    3 holds only its pieces of the weights, gathered while read (:class:`ShardedWeights`).
    ``gradients``, ``parameters``: also hand back every gradient (a test's oracle: the
    single device's, cut the same way), every tensor after the step (:func:`_train_result`)."""
    import torch

    from attnctl.memory.measure import measure_step
    from attnctl.model.layout import Layout
    from attnctl.nn.collectives import TensorGroup
    from attnctl.nn.model import forward
    from attnctl.nn.ring_attention import running
    from attnctl.parallel.plan import rank_plan

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
    token_ids = _drawn_tokens(task, place, config.seed, full.vocab_size, plan.batch, device)
    shard = {k: v.detach() for k, v in shard.items()}  # leaves: Adam's parameters
    if model is None:
        layers = int(task["layers"])
        named, parameters, stack = _stacked_layer(shard, plan, layers)
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
    shards: list[Any] = []  # ZeRO 2, 3: the rank's gradient pieces, once the step has made them
    summed, step, measured_held = _data_parallel_step(
        summed, copies, zero, sharded, shards, parameters, mixed, partials, trained
    )
    measured = measure_step(run, parameters, [token_ids], parameter_bytes, mixed, device, summed,
                            step, measured_held)  # fmt: skip
    return _train_result(task, place, measured, copies, zero, named, parameters, shards, sharded)


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


def _drawn_tokens(task: dict[str, Any], place: RankPlace, seed: int, vocab: int, batch: int,
                  device) -> Any:  # fmt: skip
    """The token ids this rank trains on: a data-parallel copy draws its own batch (seed +
    its copy's index); a context-parallel rank keeps its chunk, (B, L/C), in its own storage."""
    import torch

    drawn = None
    if place.dp > 1:
        drawn = torch.Generator(device=device).manual_seed(seed + place.dp_rank)
    token_ids = torch.randint(0, vocab, (batch, task["seq_len"]), device=device,
                              generator=drawn)  # fmt: skip
    if place.ring is not None:
        chunk = task["seq_len"] // place.cp
        token_ids = token_ids[:, place.cp_rank * chunk : (place.cp_rank + 1) * chunk].clone()
    return token_ids  # (B, L) or (B, L/C)


def _stacked_layer(shard: dict[str, Any], plan: Any, layers: int):
    """The seeded layer stacked ``layers`` high, as one device stacks it: (named weights,
    Adam's parameters in order, the stack's description). Block n's weights are block 0's
    values in tensors of their own; the shared ones come first."""
    from attnctl.model.describe import ModelDescription

    block = {k: v for k, v in shard.items() if k.startswith("blocks.0.")}
    named = {k: v.requires_grad_() for k, v in shard.items() if not k.startswith("blocks.")}
    for n in range(layers):
        for key, value in block.items():
            tensor = value if n == 0 else value.detach().clone()
            named[key.replace("blocks.0.", f"blocks.{n}.", 1)] = tensor.requires_grad_()
    parameters = list(named.values())
    stack = ModelDescription(plan.description.embeddings, plan.description.blocks * layers)
    return named, parameters, stack


def _train_result(task: dict[str, Any], place: RankPlace, measured: Any, copies: Any, zero: int,
                  named: dict[str, Any], parameters: list[Any], shards: list[Any],
                  sharded: Any) -> dict[str, Any]:  # fmt: skip
    """What the rank sends back after its measured step: its figures, and the gradients
    or parameters a test asked for."""
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


def _data_parallel_step(
    summed,
    copies,
    zero: int,
    sharded,
    shards: list[Any],
    parameters: list[Any],
    mixed: bool,
    partials,
    trained: list[str],
):
    """(what runs after the backward, the optimizer step, what the measurement holds) for
    a data-parallel copy: ZeRO 0/1 average the gradients after the backward; ZeRO 2, 3 sum
    each over TP (partial_sums) and reduce it as it arrives; without copies, unchanged."""
    if copies is None:
        return summed, None, None
    step = measured_held = None
    summed = None if zero >= 2 else _then(summed, mean_gradients(parameters, copies))
    if sharded is not None:
        step = lambda: sharded.step(shards)  # noqa: E731
        measured_held = [sharded.shard]  # the leaves are counted while gathered
    elif zero:
        partial = partial_sums(partials, trained) if zero >= 2 else None
        step = lambda: zero_step(parameters, mixed, copies,  # noqa: E731
                                 shards if zero >= 2 else None, partial)  # fmt: skip
    return summed, step, measured_held
