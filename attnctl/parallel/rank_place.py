"""Where a rank stands: its place in the TP group, the CP ring and the data group
(:class:`RankPlace`, :func:`rank_places`), the layer and the whole model it cuts its share
from, and its share of the weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _config(values: dict[str, Any]):
    from attnctl.model.config import LayerConfig

    return LayerConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def _full_model(config, vocab_size: int, model_dir: str | None):
    """The whole model's description, as the single device runs it."""
    from attnctl.model.describe import seeded_model

    if model_dir is None:
        return seeded_model(config, vocab_size)
    from attnctl.model.families import read_model

    return read_model(model_dir).with_run(config)


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
