"""What ``--measure`` read: a forward pass's or a training step's peaks (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measurement:
    device: str
    parameter_bytes: int
    peak_activation_bytes: int
    stage_peak_bytes: tuple[int, ...]  # activation bytes alive at the busiest moment of each stage
    method: str  # how it was measured, for the report
    # a training step's peak in each phase: forward, backward, optimizer step
    phase_peak_bytes: tuple[int, ...] = ()
    # CPU, training: the backward's peak up to each parameter's gradient, in their order
    gradient_window_bytes: tuple[int, ...] = ()
    # CPU, training: the forward's peak within each of the first block's stages (what
    # autograd keeps included, so not the forward pass's stage_peak_bytes)
    stage_window_bytes: tuple[int, ...] = ()
    kv_cache_bytes: int | None = None  # K and V every block kept, from a run of all of them
    # on CUDA: the allocator's reserved peak (max_memory_reserved), and what the process
    # holds outside it (the CUDA context: free before its first CUDA call less free now,
    # less what the allocator reserves; None where NVML could not tell)
    reserved_peak_bytes: int | None = None
    context_bytes: int | None = None

    @property
    def peak_bytes(self) -> int:
        return self.parameter_bytes + self.peak_activation_bytes
