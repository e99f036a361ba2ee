"""Data parallelism on a rank: the copies' data groups (:class:`Copies`), the gradients'
mean, and ZeRO 1-3 (the optimizer step over a rank's pieces, each gradient reduced onto
its owner as it arrives, the weights gathered a unit at a time)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from attnctl.parallel.rank_place import (
    RankPlace,
)


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

    from attnctl.model.layout import zero_ranges

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

        from attnctl.model.layout import zero_ranges

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

        from attnctl.memory.measure import storage_resized

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
        from attnctl.memory.measure import storage_resized

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
