"""The device a command runs on (or plans for), resolved once, without importing torch.

``--device auto`` means what torch would pick: CUDA when the installed torch is a CUDA
build and the driver sees a GPU, else Apple's MPS, else the CPU. The use cases resolve it
once, at their boundary (``app/use_cases.resolve_layer``); past that point a layer's
``device`` is always a concrete device (``cpu``, ``cuda``, ``cuda:N``, ``mps``) and
``auto`` travels no further, so ``shapes`` and ``memory`` plan for the device ``run``
would use. Resolving reads torch's ``version.py`` and asks the CUDA driver for its device
count (the driver honours ``CUDA_VISIBLE_DEVICES``, as torch does); only where neither
can tell (a ROCm build, macOS on Apple silicon, an unreadable install) is torch imported.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from attnctl.errors import AttnctlError

if TYPE_CHECKING:  # loaded when a plan is for CUDA (``shapes`` on the CPU never needs it)
    import ctypes

    from attnctl.model.gpu import CudaTarget, GpuProfile

DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


@dataclass(frozen=True)
class Device:
    """A concrete device: ``kind`` is cpu, cuda or mps; ``index`` a CUDA device's number
    when one was named (``cuda:1``), else None (torch's current device)."""

    kind: str
    index: int | None = None

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @classmethod
    def parse(cls, spec: str) -> Device:
        """A concrete device's spec (not ``auto``) as a Device."""
        if not DEVICE_PATTERN.match(spec) or spec == "auto":
            raise AttnctlError(f"unknown device {spec!r}; use auto, cpu, cuda, cuda:N or mps")
        kind, _, index = spec.partition(":")
        return cls(kind, int(index) if index else None)


def resolve(spec: str) -> Device:
    """``spec`` as the device it names; ``auto`` as the device torch would pick."""
    return Device.parse(spec) if spec != "auto" else automatic()


def planned_device(spec: str, gpu: str = "", torch_rules: str = "") -> str:
    """The concrete device a layer runs on or plans for: ``--device`` resolved, CUDA for
    a named ``--gpu`` (which plans for that GPU from any machine). Checks the GPU's name
    and the torch rules named, and that they go with the device."""
    from attnctl.model.gpu import gpu_profile, rules_for

    if gpu:
        gpu_profile(gpu)  # one line listing the profiles when unknown
        rules_for(torch_rules, None)  # one line naming the rules known
        if spec == "auto":
            return "cuda"
        if not Device.parse(spec).is_cuda:
            raise AttnctlError(f"--gpu {gpu} plans for a GPU; it does not go with --device {spec}")
        return spec
    device = resolve(spec)
    if torch_rules:
        rules_for(torch_rules, None)
        if not device.is_cuda:
            raise AttnctlError(
                f"--torch {torch_rules} chooses CUDA memory rules; the plan is for "
                f"{device}: name a GPU with --gpu, or --device cuda on a machine with one"
            )
    return str(device)


def cuda_target(device: str, gpu: str = "", torch_rules: str = "") -> CudaTarget | None:
    """What a plan on ``device`` knows of CUDA: None off CUDA; the named profile
    (``gpu``), or the GPU this machine has, under the rules of ``torch_rules`` (default
    the installed torch's)."""
    if not device.startswith("cuda"):
        return None
    return _cuda_target(device, gpu.strip().lower(), torch_rules)


@functools.lru_cache(maxsize=16)
def _cuda_target(device: str, gpu: str, torch_rules: str) -> CudaTarget:
    from attnctl.model.gpu import PROFILES, CudaTarget, named_target, rules_for

    installed = torch_version()
    if gpu:
        return named_target(gpu, torch_rules, installed)
    profile = this_machines_gpu(Device.parse(device).index or 0)
    if profile is None:
        raise AttnctlError(
            f"device {device} is not available: no CUDA GPU on this machine (to plan for "
            "one, name it with --gpu: h200, h100, a100-80gb, a100-40gb, l4, rtx-4090)"
        )
    # a GPU of a measured profile (the same name and compute capability) is as verified
    measured = any(p.measured and (p.label, p.capability) == (profile.label, profile.capability)
                   for p in PROFILES.values())  # fmt: skip
    rules, note = rules_for(torch_rules, installed)
    profile = dataclasses.replace(profile, measured=measured)
    return CudaTarget(profile, rules, named=False, note=note)


def torch_version() -> str | None:
    """The installed torch's version (``torch/version.py``'s ``__version__``), read
    without importing torch; None when it cannot be read."""
    text = _torch_version_file()
    match = re.search(r"^__version__\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text or "", re.M)
    return match.group(1) if match else None


def this_machines_gpu(index: int) -> GpuProfile | None:
    """CUDA device ``index`` as the driver describes it (name, memory, compute
    capability), or None without a driver or such a device."""
    import ctypes

    from attnctl.model.gpu import GpuProfile

    driver = _driver()
    if driver is None or driver.cuInit(0) != 0:
        return None
    handle = ctypes.c_int(0)
    if driver.cuDeviceGet(ctypes.byref(handle), index) != 0:
        return None
    major, minor, total = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_size_t(0)
    name = ctypes.create_string_buffer(256)
    # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, _MINOR
    driver.cuDeviceGetAttribute(ctypes.byref(major), 75, handle)
    driver.cuDeviceGetAttribute(ctypes.byref(minor), 76, handle)
    driver.cuDeviceGetName(name, len(name), handle)
    driver.cuDeviceTotalMem_v2(ctypes.byref(total), handle)
    label = name.value.decode("utf-8", "replace") or f"CUDA device {index}"
    return GpuProfile(f"cuda:{index}", label, total.value, (major.value, minor.value))


def free_before_cuda(index: int) -> int | None:
    """Free bytes on CUDA device ``index`` as NVML sees them, which makes no CUDA context:
    called before torch's first CUDA call, the process's context is what it then takes.
    None without NVML or the device. NVML numbers GPUs apart from CUDA_VISIBLE_DEVICES,
    so the device is found by its PCI bus id, which the driver gives without a context."""
    import ctypes

    driver = _driver()
    nvml = _library(("libnvidia-ml.so.1", "libnvidia-ml.so", "nvml.dll"))
    if driver is None or nvml is None or driver.cuInit(0) != 0 or nvml.nvmlInit_v2() != 0:
        return None
    handle, bus = ctypes.c_int(0), ctypes.create_string_buffer(32)
    if driver.cuDeviceGet(ctypes.byref(handle), index) != 0:
        return None
    if driver.cuDeviceGetPCIBusId(bus, len(bus), handle) != 0:
        return None
    device = ctypes.c_void_p()
    if nvml.nvmlDeviceGetHandleByPciBusId_v2(bus, ctypes.byref(device)) != 0:
        return None
    memory = (ctypes.c_ulonglong * 3)()  # nvmlMemory_t: total, free, used
    if nvml.nvmlDeviceGetMemoryInfo(device, ctypes.byref(memory)) != 0:
        return None
    return int(memory[1])


def _driver() -> ctypes.CDLL | None:
    if sys.platform.startswith("linux"):
        names = ("libcuda.so.1", "libcuda.so")
    elif sys.platform == "win32":
        names = ("nvcuda.dll",)
    else:
        return None
    return _library(names)


def _library(names: tuple[str, ...]) -> ctypes.CDLL | None:
    import ctypes

    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def automatic() -> Device:
    """The device ``auto`` picks on this machine (see the module's note)."""
    build = torch_build()
    if build is None or build.get("hip") or sys.platform == "darwin":
        return _asked_of_torch()
    if build.get("cuda"):
        count = cuda_device_count()
        if count is None:
            return _asked_of_torch()
        if count:
            return Device("cuda")
    return Device("cpu")


def torch_build() -> dict[str, str | None] | None:
    """The ``cuda`` and ``hip`` versions the installed torch was built with (None for a
    CPU build's), read from ``torch/version.py`` without importing torch; None when it
    cannot be read."""
    text = _torch_version_file()
    if text is None:
        return None
    found: dict[str, str | None] = {}
    for name in ("cuda", "hip"):
        match = re.search(rf"^{name}\s*(?::[^=]*)?=\s*(None|'[^']*'|\"[^\"]*\")\s*$", text, re.M)
        if match is None:
            return None
        value = match.group(1)
        found[name] = None if value == "None" else value.strip("'\"")
    return found


def _torch_version_file() -> str | None:
    """The text of the installed torch's ``version.py``, or None."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        return Path(next(iter(spec.submodule_search_locations)), "version.py").read_text("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def cuda_device_count() -> int | None:
    """The GPUs the CUDA driver shows this process (0 without a driver); None when the
    driver cannot be asked here (an unknown platform)."""
    import ctypes

    if sys.platform.startswith("linux"):
        names = ("libcuda.so.1", "libcuda.so")
    elif sys.platform == "win32":
        names = ("nvcuda.dll",)
    else:
        return None
    for name in names:
        try:
            driver = ctypes.CDLL(name)
        except OSError:
            continue
        if driver.cuInit(0) != 0:  # CUDA_ERROR_NO_DEVICE and the like: torch sees none
            return 0
        count = ctypes.c_int(0)
        if driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
        return count.value
    return 0  # no driver: torch.cuda.is_available() is False


def _asked_of_torch() -> Device:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count():
        return Device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return Device("mps")
    return Device("cpu")
