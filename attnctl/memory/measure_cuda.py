"""``--measure`` on CUDA: the caching allocator's peaks, stage by stage or phase by
phase, its reserved peak, and what the process holds outside it (the CUDA context)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from attnctl.memory.measurement import Measurement


def measure_cuda(
    forward: Callable[[Callable], None],
    given: list[torch.Tensor],
    parameter_bytes: int,
    device: torch.device,
) -> Measurement:
    stage_peaks: list[int] = []
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device) - sum(t.untyped_storage().nbytes() for t in given)
    torch.cuda.reset_peak_memory_stats(device)

    reserved: list[int] = []

    def record(name: str, tensor: torch.Tensor, dims: str) -> None:
        torch.cuda.synchronize(device)
        stage_peaks.append(torch.cuda.max_memory_allocated(device) - base)
        reserved.append(torch.cuda.max_memory_reserved(device))
        torch.cuda.reset_peak_memory_stats(device)

    with torch.inference_mode():
        forward(record)
        torch.cuda.synchronize(device)
    peak = max(stage_peaks)
    return Measurement(
        str(device), parameter_bytes, peak, tuple(stage_peaks), "torch.cuda.max_memory_allocated",
        reserved_peak_bytes=max(reserved), context_bytes=cuda_context_bytes(device),
    )  # fmt: skip


def cuda_context_bytes(device: torch.device) -> int | None:
    """What this process holds on the GPU outside torch's caching allocator: the free
    bytes before its first CUDA call (``resources.note_free_before_cuda``) less those
    free now, less what the allocator reserves."""
    from attnctl.memory.resources import FREE_BEFORE_CUDA

    before = FREE_BEFORE_CUDA.get(device.index if device.index is not None else 0)
    if before is None:
        return None
    free_now = torch.cuda.mem_get_info(device)[0]
    return before - free_now - torch.cuda.memory_reserved(device)


def measure_step_cuda(
    run: Callable[[Callable], Any],
    step: Callable[..., None],
    given: list[torch.Tensor],
    device: torch.device,
    peaks: tuple[list[int], list[int]],
) -> str:
    """measure_step on CUDA: each phase's peak of the allocator, above what was allocated
    before it other than the ``given`` inputs, and its reserved peak, into ``peaks``'
    two lists; the method's name back."""
    phases, reserved = peaks
    from attnctl.nn import no_record

    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device) - sum(t.untyped_storage().nbytes() for t in given)
    torch.cuda.reset_peak_memory_stats(device)

    def phase_ends() -> None:
        torch.cuda.synchronize(device)
        phases.append(torch.cuda.max_memory_allocated(device) - base)
        reserved.append(torch.cuda.max_memory_reserved(device))
        torch.cuda.reset_peak_memory_stats(device)

    step(lambda: run(no_record), phase_ends=phase_ends)
    return "max_memory_allocated"
