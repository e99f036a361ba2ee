"""One start of the gloo ranks per world size for every distributed test module.

Starting ranks costs seconds (each process imports torch, joins the group and warms its
first ops up: about 3 s for 2 ranks, 5 s for 4 on 2 cores), so the modules do not start
their own: each declares what it runs as a *batch* (``@rank_batch(2, 4)`` on a function
of the world size and the tiny checkpoints that returns a :class:`Batch`), and the
session's :class:`RankPool` runs every selected module's batches of one world size in
one ``run_ranks`` the first time any of them is asked for. A batch's ``finish`` gets the
replies with its own tasks' results only, so what a module checks is what it would get
from a start of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import tiny_models

from attnctl.parallel.launch import RankReply, run_ranks


class Batch(NamedTuple):
    """The tasks a module runs on one world of ranks, how long they may take at most,
    and what it makes of its replies (each with this batch's results, in order)."""

    tasks: list[dict[str, Any]]
    timeout: float
    finish: Callable[[list[RankReply]], Any]


Builder = Callable[[int, "TinyModels"], Batch]
_BUILDERS: list[tuple[Builder, tuple[int, ...]]] = []


def rank_batch(*worlds: int) -> Callable[[Builder], Builder]:
    """Declare ``builder(world, tiny) -> Batch`` as run on each of ``worlds`` ranks."""

    def declare(builder: Builder) -> Builder:
        _BUILDERS.append((builder, worlds))
        return builder

    return declare


class TinyModels:
    """The tiny checkpoints of ``tests/tiny_models.py``, each written and loaded once a
    session (a ModelDescription), and their run settings as a layer config."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._loaded: dict[str, Any] = {}

    def __getitem__(self, family: str):
        if family not in self._loaded:
            from attnctl.app.calls import load_model

            path = tiny_models.write(family, self._folder / family)
            self._loaded[family] = load_model(str(path))
        return self._loaded[family]

    def layer(self, family: str, impl: str = "math", **settings: Any):
        from attnctl.app.calls import model_layer

        return model_layer(self[family], {"device": "cpu", "impl": impl, **settings})


class RankPool:
    """Runs the declared batches of the ``modules`` selected this session, one start of
    the ranks per world size, on first demand; keeps each batch's result (or the error
    that ended the start, raised for each batch of it)."""

    def __init__(self, modules: set[str], tiny: TinyModels) -> None:
        self._modules = modules
        self.tiny = tiny
        self._results: dict[tuple[Builder, int], Any] = {}
        self._failed: dict[int, BaseException] = {}

    def get(self, builder: Builder, world: int) -> Any:
        """``builder``'s result on ``world`` ranks (every batch of that world run first)."""
        key = (builder, world)
        if key not in self._results and world not in self._failed:
            self._run(world, required=builder)
        if world in self._failed:
            raise self._failed[world]
        return self._results[key]

    def _run(self, world: int, required: Builder) -> None:
        builders = [b for b, worlds in _BUILDERS if world in worlds
                    and (b.__module__ in self._modules or b is required)
                    and (b, world) not in self._results]  # fmt: skip
        batches = [builder(world, self.tiny) for builder in builders]
        tasks = [task for batch in batches for task in batch.tasks]
        try:
            replies = run_ranks(world, tasks, "cpu", sum(b.timeout for b in batches))
        except BaseException as error:
            self._failed[world] = error
            raise
        first = 0
        for builder, batch in zip(builders, batches, strict=True):
            last = first + len(batch.tasks)
            own = [dataclasses.replace(r, results=r.results[first:last]) for r in replies]
            self._results[builder, world] = batch.finish(own)
            first = last


def split_batch(cases: list, timeout: float) -> Batch:
    """``measure_splits(cases)`` as a batch: its result is (cases, each case's ranks'
    measurements)."""
    from attnctl.parallel.distributed import prepare_splits

    prepared = prepare_splits(cases, timeout=timeout)
    return Batch(prepared.tasks, prepared.timeout,
                 lambda replies: (cases, prepared.finish(replies)))  # fmt: skip
