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

import ctypes
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from attnctl.errors import AttnctlError

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
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        text = Path(next(iter(spec.submodule_search_locations)), "version.py").read_text("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    found: dict[str, str | None] = {}
    for name in ("cuda", "hip"):
        match = re.search(rf"^{name}\s*(?::[^=]*)?=\s*(None|'[^']*'|\"[^\"]*\")\s*$", text, re.M)
        if match is None:
            return None
        value = match.group(1)
        found[name] = None if value == "None" else value.strip("'\"")
    return found


def cuda_device_count() -> int | None:
    """The GPUs the CUDA driver shows this process (0 without a driver); None when the
    driver cannot be asked here (an unknown platform)."""
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
