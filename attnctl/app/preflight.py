"""The one check before a command allocates: the memory it will use, then the time it
will take, on the device it runs on."""

from __future__ import annotations

from attnctl.app.calls import device_of
from attnctl.app.requests import Hooks
from attnctl.stages.plan import Plan


def kept_stage_bytes(block_plans: list[Plan]) -> int:
    """The bytes of the CPU copies ``run --save`` keeps of the stages recorded by one pass
    through these consecutive blocks' plans: each whole for the first; the inputs and
    embeddings, recorded with the first block only, left out of the others (their stages
    start at ``hidden``, the block's input)."""
    total = 0
    for index, block_plan in enumerate(block_plans):
        stages = block_plan.stages
        if index > 0:
            names = [stage.name for stage in stages]
            stages = stages[names.index("hidden") :]
        total += sum(stage.bytes for stage in stages)
    return total


def preflight(
    plan: Plan, need_bytes: int, force: bool, hooks: Hooks, blocks: int = 1, passes: int = 1
) -> None:
    """The one check before a command allocates: memory (skipped with --force), then time.

    A run estimated to take over LONG_RUN_SECONDS (its FLOPs at the rates measured on the
    device just now; ``passes`` forward passes of ``blocks`` blocks) is announced through
    ``hooks.warn`` first; one forced past the memory it may use is not timed (it fails, or
    the swap decides).
    """
    from attnctl.memory.resources import import_torch

    import_torch()  # the first command to need it: with the collector paused
    from attnctl.memory.resources import (
        LONG_RUN_SECONDS,
        available_memory,
        duration_text,
        estimated_seconds,
    )
    from attnctl.memory.resources import preflight as check_memory

    device = device_of(plan.config.device)
    if not force:
        check_memory(need_bytes, device)
    else:
        available = available_memory(device)
        if available is not None and need_bytes > available.bytes:
            return
    seconds = estimated_seconds(plan, device, blocks)
    if seconds is not None and seconds * passes > LONG_RUN_SECONDS:
        hooks.warn(
            f"attnctl: this will take about {duration_text(seconds * passes)} on {device} "
            "(its operations at the speed measured here just now)"
        )
