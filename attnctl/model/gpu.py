"""What CUDA allocates around a plan's tensors, by GPU and torch version: torch-free.

A CUDA plan (``stages``) asks this module four things: how big cuBLAS's and cuBLASLt's
workspaces are, which SDPA kernel torch picks for a call and why, what that kernel
allocates beside its output, and how the caching allocator rounds a block. The answers
follow torch's own rules (``aten/src/ATen/cuda/CublasHandlePool.cpp``,
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``,
``c10/cuda/CUDACachingAllocator.cpp``) for the torch versions in :data:`TORCH_RULES`,
and were checked to the byte on an NVIDIA H200 with torch 2.11 (``docs/memory.md``, "On
a GPU"; the recordings in ``benchmarks/results/``).

A :class:`CudaTarget` is the GPU a plan is for: a named profile (``--gpu h200``), or the
GPU this machine has (read from the CUDA driver by ``model/device.py``), with the rules
of a torch version (``--torch 2.11``, default the installed one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from attnctl.errors import AttnctlError

MiB = 2**20
BLOCK = 512  # the caching allocator's smallest block: every allocation is rounded up to it


def rounded(nbytes: int) -> int:
    """The bytes the CUDA caching allocator charges for a request of ``nbytes``."""
    return 0 if nbytes <= 0 else -(-nbytes // BLOCK) * BLOCK


@dataclass(frozen=True)
class GpuProfile:
    """A GPU as a plan needs it: the memory torch sees and its compute capability."""

    name: str  # as --gpu names it
    label: str  # as nvidia-smi names it
    total_bytes: int  # torch.cuda.mem_get_info()'s total: what the driver leaves to CUDA
    capability: tuple[int, int]
    measured: bool = False  # its total and context were measured (else: derived)

    @property
    def sm(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"


# The driver keeps some of a GPU's memory for itself: on the H200, nvidia-smi's 143,771
# MiB total (150,754,820,096 B) less 644,939,776 B is mem_get_info's total. The other
# profiles are nvidia-smi's totals less that same reserve (derived, not measured).
_DRIVER_RESERVE = 644_939_776


def _profile(name: str, label: str, smi_mib: int, capability: tuple[int, int]) -> GpuProfile:
    return GpuProfile(name, label, smi_mib * MiB - _DRIVER_RESERVE, capability)


PROFILES: dict[str, GpuProfile] = {
    "h200": GpuProfile("h200", "NVIDIA H200", 150_109_880_320, (9, 0), measured=True),
    "h100": _profile("h100", "NVIDIA H100 80GB HBM3", 81_559, (9, 0)),
    "a100-80gb": _profile("a100-80gb", "NVIDIA A100-SXM4-80GB", 81_920, (8, 0)),
    "a100-40gb": _profile("a100-40gb", "NVIDIA A100-SXM4-40GB", 40_960, (8, 0)),
    "l4": _profile("l4", "NVIDIA L4", 23_034, (8, 9)),
    "rtx-4090": _profile("rtx-4090", "NVIDIA GeForce RTX 4090", 24_564, (8, 9)),
}

# What a process holds on the GPU outside torch's allocator once its kernels are loaded
# (the CUDA context, cuBLAS's and cuDNN's modules): measured on the H200 with torch 2.11
# and CUDA 13 (free memory before the first CUDA call less free memory after the first
# matrix products and cuDNN call); assumed the same on the other profiles.
CONTEXT_BYTES = 726_466_560
# the caching allocator's fragmentation: reserved - allocated at the peak. The H200
# recordings show 0.9 MB to 563 MB (the latter at a 1.1 GB peak of large, short-lived
# matrices); a fit keeps this share of the estimate free, and at least FRAGMENTATION_FLOOR
FRAGMENTATION_PERCENT = 10
FRAGMENTATION_FLOOR = 64 * MiB
# of CONTEXT_BYTES, what loads after the first CUDA call (cuBLAS's and cuDNN's kernels,
# on their first use): the H200's free bytes right after torch's first CUDA call were
# 552,402,944 below its total
LATE_CONTEXT_BYTES = CONTEXT_BYTES - 552_402_944


def fragmentation_margin(nbytes: int) -> int:
    """What a fit keeps free beside an estimate for the caching allocator's
    fragmentation (reserved - allocated): FRAGMENTATION_PERCENT of it, at least
    FRAGMENTATION_FLOOR."""
    return max(FRAGMENTATION_FLOOR, -(-nbytes * FRAGMENTATION_PERCENT // 100))


def with_margin(nbytes: int) -> int:
    """An estimate as a CUDA fit and pre-flight count it: with the fragmentation margin."""
    return nbytes + fragmentation_margin(nbytes)


def budget_text() -> str:
    """How a CUDA budget is counted, for the output."""
    return (
        f"each estimate + {FRAGMENTATION_PERCENT} % (at least {FRAGMENTATION_FLOOR // MiB} "
        "MiB) for the caching allocator's fragmentation, within the memory left beside the "
        "CUDA context"
    )


@dataclass(frozen=True)
class TorchRules:
    """The CUDA memory rules of one torch minor version."""

    version: tuple[int, int]
    cudnn: int  # the cuDNN its CUDA wheels ship (torch.backends.cudnn.version())
    cudnn_first_on_hopper: bool  # SDPA tries cuDNN before flash on sm_90 (cuDNN >= 9.15)
    efficient_gqa: bool  # the memory-efficient kernel takes enable_gqa
    cudnn_gqa: bool  # the cuDNN kernel takes enable_gqa

    @property
    def name(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"


VERIFIED_TORCH = ((2, 11),)  # the torch versions the profiles' measurements were made with

TORCH_RULES: dict[tuple[int, int], TorchRules] = {
    (2, 11): TorchRules((2, 11), 91900, True, False, True),
}


@dataclass(frozen=True)
class CudaTarget:
    """The GPU a CUDA plan is for and the torch whose rules it follows."""

    gpu: GpuProfile
    torch: TorchRules
    named: bool  # planned for a named profile (--gpu), not measured on this machine's
    note: str = ""  # how the rules were chosen when the installed torch has none of its own

    def cublas_workspace_bytes(self) -> int:
        """cuBLAS's workspace, one per handle (a thread's stream), from the caching
        allocator: ":4096:8" (32 MiB) on sm_90, else "4096:2:16:8" (2·4 MiB + 8·16 KiB)."""
        if self.gpu.capability[0] >= 9:
            return 4096 * 1024 * 8
        return 4096 * 1024 * 2 + 16 * 1024 * 8

    def cublaslt_workspace_bytes(self) -> int:
        """cuBLASLt's workspace (CUBLASLT_WORKSPACE_SIZE, 1 MiB), taken by the first
        matrix product with a bias epilogue (F.linear with a bias)."""
        return 1024 * 1024

    @property
    def verified(self) -> bool:
        """Whether these figures were checked to the byte on this GPU with this torch."""
        return self.gpu.measured and self.torch.version in VERIFIED_TORCH

    def verification(self) -> str:
        if self.verified:
            return "figures checked to the byte on an H200 with torch 2.11"
        return "derived from the rules (checked on hardware: H200, torch 2.11)"

    def summary(self) -> str:
        """The assumptions in words, for the output."""
        where = "profile" if self.named else "this machine's GPU"
        text = (
            f"{self.gpu.label} ({self.gpu.sm}, {where}), torch {self.torch.name} rules, "
            f"cuDNN {_cudnn_name(self.torch.cudnn)}"
        )
        return text + (f"; {self.note}" if self.note else "")


def _cudnn_name(version: int) -> str:
    return f"{version // 10000}.{version // 100 % 100}"


@dataclass(frozen=True)
class SdpaChoice:
    """The kernel torch's SDPA dispatch picks for one call, and why."""

    kernel: str  # cudnn, flash, efficient or math
    reason: str  # why the kernels before it in torch's order were passed over
    fallback: bool = False  # math although a fused kernel was asked for (--impl sdpa)

    @property
    def label(self) -> str:
        name = {"cudnn": "cuDNN", "flash": "flash", "efficient": "memory-efficient",
                "math": "math"}[self.kernel]  # fmt: skip
        return f"{name} (a fallback)" if self.fallback else name


def sdpa_choice(
    target: CudaTarget,
    dtype: str,
    head_dim: int,
    grouped: bool,
    masked: bool,
    dropout: float = 0.0,
) -> SdpaChoice:
    """The kernel ``F.scaled_dot_product_attention`` runs for dense (B, H, L, d_k)
    inputs of ``dtype`` on the target: ``grouped`` with enable_gqa (fewer K/V heads),
    ``masked`` with a boolean or float attn_mask (is_causal is not a mask)."""
    rules = target.torch
    capability = target.gpu.capability
    half = dtype in ("float16", "bfloat16")
    refusals: list[str] = []

    def flash() -> str | None:
        if not half:
            return f"flash takes no {dtype}"
        if masked:
            return "flash takes no attn_mask"
        if head_dim > 256 or head_dim % 8:
            return f"flash takes no head dim {head_dim}"
        if capability < (8, 0):
            return f"flash needs sm_80 or later ({target.gpu.sm})"
        return None

    def cudnn() -> str | None:
        if not half:
            return f"cuDNN takes no {dtype}"
        if head_dim > 256 or head_dim % 8:
            return f"cuDNN takes no head dim {head_dim}"
        if grouped and not rules.cudnn_gqa:
            return "cuDNN takes no enable_gqa"
        if capability < (9, 0):
            return f"cuDNN attention is not first below sm_90 ({target.gpu.sm})"
        return None

    def efficient() -> str | None:
        if grouped and not rules.efficient_gqa:
            return f"the memory-efficient kernel takes no enable_gqa in torch {rules.name}"
        if capability < (5, 0):
            return "the memory-efficient kernel needs sm_50"
        return None

    order = [("flash", flash), ("efficient", efficient)]
    if rules.cudnn_first_on_hopper and capability >= (9, 0):
        order.insert(0, ("cudnn", cudnn))
    for kernel, refused in order:
        why = refused()
        if why is None:
            return SdpaChoice(kernel, "; ".join(refusals))
        refusals.append(why)
    return SdpaChoice("math", "; ".join(refusals), fallback=True)


def parse_torch_version(text: str) -> tuple[int, int]:
    """'2.11', '2.11.0', '2.11.0+cu130' -> (2, 11)."""
    match = re.fullmatch(r"\s*(\d+)\.(\d+)(\.\d+)?([+.a-z0-9]*)\s*", text or "")
    if not match:
        raise AttnctlError(f"cannot read torch version {text!r}; write it like 2.11")
    return int(match.group(1)), int(match.group(2))


def torch_rules(version: str) -> TorchRules:
    """The rules of torch ``version``, or one line naming those attnctl knows."""
    key = parse_torch_version(version)
    if key not in TORCH_RULES:
        known = ", ".join(rules.name for rules in TORCH_RULES.values())
        raise AttnctlError(f"no CUDA memory rules for torch {key[0]}.{key[1]}; known: {known}")
    return TORCH_RULES[key]


def gpu_profile(name: str) -> GpuProfile:
    """The profile named ``name``, or one line listing them."""
    profile = PROFILES.get(name.strip().lower())
    if profile is None:
        raise AttnctlError(f"unknown GPU {name!r}; profiles: {', '.join(PROFILES)}")
    return profile


def rules_for(torch: str, installed: str | None) -> tuple[TorchRules, str]:
    """The rules of ``--torch`` (one line if attnctl has none), or by default of the
    installed torch: when it has none of its own, the newest known at or below it (the
    oldest when it is older than all), with a note saying so."""
    if torch:
        return torch_rules(torch), ""
    if installed is None:
        newest = max(TORCH_RULES.values(), key=lambda rules: rules.version)
        return newest, f"torch not found here: the rules of {newest.name} assumed"
    version = parse_torch_version(installed)
    if version in TORCH_RULES:
        return TORCH_RULES[version], ""
    below = [v for v in TORCH_RULES if v <= version]
    chosen = TORCH_RULES[max(below) if below else min(TORCH_RULES)]
    return chosen, f"torch {version[0]}.{version[1]} installed: the rules of {chosen.name} assumed"


def named_target(gpu: str, torch: str, installed: str | None) -> CudaTarget:
    """The target of ``--gpu NAME [--torch X.Y]``."""
    rules, note = rules_for(torch, installed)
    return CudaTarget(gpu_profile(gpu), rules, named=True, note=note)
