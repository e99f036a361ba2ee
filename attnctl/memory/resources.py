"""What a run may use and how long it will take, asked before anything large is allocated.

Every command that allocates (``run``, ``check``, ``memory --measure``) goes through
:func:`preflight`: the estimated peak against the memory this process may really use,
which is the least of

- ``MemAvailable`` in /proc/meminfo (the machine),
- each cgroup's limit minus its usage, from this process's cgroup up to the root
  (v2 ``memory.max``/``memory.current``, v1 ``memory.limit_in_bytes``/``usage_in_bytes``;
  reclaimable page cache counts as free),
- ``RLIMIT_AS`` minus the address space in use, ``RLIMIT_DATA`` minus the data segment
  (``ulimit -v``, ``ulimit -d``),

or what the CUDA driver reports free on a GPU. Time: :func:`forward_flops` counts a
forward pass's multiply-adds from the plan, :func:`measured_rates` times a matrix product
and an SDPA call on the device, and :func:`estimated_seconds` divides the two.

Standard library at import; torch only inside the functions that touch a device.
"""

from __future__ import annotations

import gc
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnctl.errors import RUNTIME, AttnctlError
from attnctl.memory.estimate import format_bytes
from attnctl.stages.plan import Plan

LONG_RUN_SECONDS = 30.0  # a run estimated to take longer says so first
# Faster than any device attnctl runs on (FLOP/s): a run that would be quicker than
# LONG_RUN_SECONDS even at this speed is not timed at all
CEILING_PER_CPU_CORE = 50e9
CEILING_GPU = 2e15


@dataclass(frozen=True)
class Available:
    """Bytes this process may still allocate, and the limit that says so."""

    bytes: int
    source: str  # "MemAvailable", "cgroup memory.max", "RLIMIT_AS", ...


def _read_int(path: Path) -> int | None:
    """An integer file such as memory.current; None if absent, unreadable or "max"."""
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def _stat_value(path: Path, key: str) -> int:
    """One ``key value`` line of memory.stat (0 when it is not there)."""
    try:
        for line in path.read_text(encoding="ascii").splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except (OSError, UnicodeDecodeError):
        pass
    return 0


def _meminfo(proc: Path) -> Available | None:
    try:
        for line in (proc / "meminfo").read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return Available(int(line.split()[1]) * 1024, "MemAvailable")
    except (OSError, UnicodeDecodeError, ValueError, IndexError):
        pass
    return None


# (file with the limit, file with the usage, memory.stat key of reclaimable cache, name)
_CGROUP_FILES = {
    2: ("memory.max", "memory.current", "inactive_file", "cgroup memory.max"),
    1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file",
        "cgroup memory.limit_in_bytes"),
}  # fmt: skip


def _cgroup_dirs(proc: Path, root: Path) -> list[tuple[int, Path]]:
    """(version, folder) of this process's memory cgroup and every parent up to the root."""
    try:
        lines = (proc / "self" / "cgroup").read_text(encoding="ascii").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    found = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "" and (root / "cgroup.controllers").is_file():
            version, mount = 2, root
        elif "memory" in controllers.split(","):
            version, mount = 1, root / "memory"
        else:
            continue
        folder = mount / path.strip("/")
        if not folder.is_dir():  # a namespaced view: the mount is this cgroup itself
            folder = mount
        while True:
            found.append((version, folder))
            if folder == mount or mount not in folder.parents:
                break
            folder = folder.parent
    return found


def _cgroups(proc: Path, root: Path) -> list[Available]:
    limits = []
    for version, folder in _cgroup_dirs(proc, root):
        limit_file, usage_file, cache_key, name = _CGROUP_FILES[version]
        limit = _read_int(folder / limit_file)
        if limit is None or limit >= 2**62:  # "max", or v1's "no limit" (about 2^63)
            continue
        usage = _read_int(folder / usage_file) or 0
        reclaimable = _stat_value(folder / "memory.stat", cache_key)
        limits.append(Available(max(0, limit - usage + min(reclaimable, usage)), name))
    return limits


def _status_bytes(proc: Path, key: str) -> int | None:
    """VmSize, VmData... of /proc/self/status, in bytes."""
    try:
        for line in (proc / "self" / "status").read_text(encoding="ascii").splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    except (OSError, UnicodeDecodeError, ValueError, IndexError):
        pass
    return None


def _rlimits(proc: Path) -> list[Available]:
    limits = []
    for name, which, used in (("RLIMIT_AS", "RLIMIT_AS", "VmSize"),
                              ("RLIMIT_DATA", "RLIMIT_DATA", "VmData")):  # fmt: skip
        kind = getattr(resource, which, None)
        if kind is None:
            continue
        soft, _ = resource.getrlimit(kind)
        if soft == resource.RLIM_INFINITY or soft < 0:
            continue
        in_use = _status_bytes(proc, used) or 0
        limits.append(Available(max(0, soft - in_use), name))
    return limits


def cpu_available(
    proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> Available | None:
    """The least of what the machine, the cgroups and the resource limits leave (None: unknown)."""
    candidates = [_meminfo(proc), *_cgroups(proc, cgroup_root), *_rlimits(proc)]
    known = [c for c in candidates if c is not None]
    if not any(c.source == "MemAvailable" for c in known):
        try:
            pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            known.append(Available(pages, "free pages"))
        except (ValueError, OSError, AttributeError):
            pass
    return min(known, key=lambda c: c.bytes, default=None)


def available_memory(device: Any) -> Available | None:
    """What may still be allocated on a torch device (None where attnctl cannot tell)."""
    if device.type == "cuda":
        import torch

        from attnctl.model.gpu import LATE_CONTEXT_BYTES

        note_free_before_cuda(device)
        free = torch.cuda.mem_get_info(device)[0]
        # what the allocator holds but no tensor uses can be handed out again; the
        # kernels cuBLAS and cuDNN load on first use are still to come
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return Available(
            max(0, free + cached - LATE_CONTEXT_BYTES),
            "free on the GPU, less the CUDA context still to load",
        )
    if device.type != "cpu":
        return None
    return cpu_available()


FREE_BEFORE_CUDA: dict[int, int | None] = {}  # device index -> free bytes before CUDA's first call


def note_free_before_cuda(device: Any) -> None:
    """Keep the GPU's free bytes before this process's first CUDA call (once per device),
    so that a measurement can say what the CUDA context took."""
    import torch

    from attnctl.model.device import free_before_cuda

    index = device.index if device.index is not None else 0
    if index not in FREE_BEFORE_CUDA and not torch.cuda.is_initialized():
        FREE_BEFORE_CUDA[index] = free_before_cuda(index)


def preflight(need_bytes: int, device: Any) -> None:
    """Refuse before allocating when the estimate exceeds what may be used (``--force``
    skips). On CUDA the figure is ``--fit``'s: the estimate with the allocator's margin,
    within the free bytes less the CUDA context still to load."""
    available = available_memory(device)
    what = "estimated peak"
    if device.type == "cuda":
        from attnctl.model.gpu import with_margin

        need_bytes, what = with_margin(need_bytes), "estimated peak with the allocator's margin"
    if available is not None and need_bytes > available.bytes:
        where = "free" if available.source == "MemAvailable" else f"left by {available.source}"
        if device.type == "cuda":
            where = "free (less the CUDA context still to load)"
        raise AttnctlError(
            f"the {what} of {format_bytes(need_bytes)} is more than the "
            f"{format_bytes(available.bytes)} {where} on {device}; use --force to try anyway",
            exit_code=RUNTIME,
        )


# ---------------------------------------------------------------- time


def forward_flops(plan: Plan, blocks: int = 1) -> tuple[int, int]:
    """(matrix-product FLOPs, attention FLOPs) of one forward pass through ``blocks`` blocks.

    A product of (n, a) and (a, b) costs 2·n·a·b: the projections and feed-forward are
    2 · B·L · (their weights), scores and weighted values 2 · 2·B·H·L·Lk·d_k.
    """
    sizes = plan.sizes
    if plan.model is None:
        per_block = [p for p in plan.parameters if p.name.startswith("W_")]
    else:  # a block's tensors are named with "*" in place of its number
        per_block = [p for p in plan.parameters if "*" in p.name]
    matrices = sum(math.prod(p.shape) for p in per_block if len(p.shape) == 2)
    tokens = sizes["B"] * sizes["L"]
    keys = sizes.get("Lc", sizes["L"])
    attention = 4 * sizes["B"] * sizes["H"] * sizes["L"] * keys * sizes["d_k"]
    return 2 * tokens * matrices * blocks, attention * blocks


def measured_rates(device: Any, dtype: Any, seconds: float = 0.02) -> tuple[float, float]:
    """FLOP/s of a matrix product and of SDPA in ``dtype`` on ``device``, timed now.

    Each is timed at growing sizes until one call takes ``seconds``: small calls are
    dominated by their overhead and would make long runs look slower than they are.
    """
    import torch
    import torch.nn.functional as F

    def matmul(side: int) -> tuple[Any, int]:
        a = torch.randn(side, side, device=device).to(dtype)  # (n, n)
        return (lambda: a @ a), 2 * side**3

    def sdpa(length: int) -> tuple[Any, int]:
        q = torch.randn(1, 8, length, 64, device=device).to(dtype)  # (B, H, L, d_k)
        return (lambda: F.scaled_dot_product_attention(q, q, q)), 4 * 8 * length * length * 64

    def fastest_call(step: Any) -> float:
        """The quickest of two calls (a busy machine slows some), after a warm-up."""
        step()
        best = math.inf
        for _ in range(2):
            start = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        return best

    def rate(make: Any, size: int, largest: int) -> float:
        """At growing sizes until one call takes ``seconds``: small calls are mostly overhead."""
        while True:
            step, flops = make(size)
            elapsed = fastest_call(step)
            if elapsed >= seconds or size >= largest:
                return flops / max(elapsed, 1e-9)
            size *= 2

    with torch.inference_mode():
        return rate(matmul, 512, 8192), rate(sdpa, 512, 16384)


def estimated_seconds(plan: Plan, device: Any, blocks: int = 1) -> float | None:
    """How long a forward pass of ``plan`` should take on ``device``; None when it would
    be quicker than LONG_RUN_SECONDS even at the CEILING speeds (nothing is timed then)."""
    matrices, attention = forward_flops(plan, blocks)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ceiling = CEILING_GPU if device.type != "cpu" else CEILING_PER_CPU_CORE * (cores or 1)
    if (matrices + attention) / ceiling < LONG_RUN_SECONDS:
        return None
    from attnctl.nn.layer import TORCH_DTYPES

    matmul_rate, sdpa_rate = measured_rates(device, TORCH_DTYPES[plan.config.dtype])
    attention_rate = sdpa_rate if plan.config.impl == "sdpa" else matmul_rate
    return matrices / matmul_rate + attention / attention_rate


def duration_text(seconds: float) -> str:
    """42 s, 3.5 min, 2.1 h, 12 days, over a year."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds < 365 * 86400:
        return f"{seconds / 86400:.0f} days"
    return "over a year"


def import_torch() -> None:
    """Import torch with the garbage collector paused, then keep it out of its sight.

    torch's import makes about 10^6 objects that live as long as the process; each full
    collection during and after it rescanned all of them (0.08 s of a run). Paused during
    the import and frozen after it (gc.freeze), they are never scanned; what the run itself
    allocates is collected as usual.
    """
    if "torch" in sys.modules:
        return
    gc.disable()
    try:
        import torch  # noqa: F401
    finally:
        gc.enable()
    gc.freeze()


def device_free_bytes(device_spec: str) -> int:
    """The bytes free on the device a run would use (``--fit``'s budget)."""
    from attnctl.nn.layer import resolve_device

    device = resolve_device(device_spec)
    available = available_memory(device)
    if available is None:
        raise AttnctlError(f"cannot tell how much memory {device} has free; use --budget SIZE")
    return available.bytes
