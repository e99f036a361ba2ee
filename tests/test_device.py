"""One device, resolved once (``attnctl/model/device.py``): ``--device auto`` is decided at
the use cases' boundary, without torch, and every command then plans and runs for it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import tiny_seq2seq

import attnctl.model.device as devices
from attnctl.errors import AttnctlError
from attnctl.model.device import Device, resolve


def test_a_concrete_device_is_taken_as_given():
    assert resolve("cpu") == Device("cpu") and str(resolve("cpu")) == "cpu"
    assert resolve("cuda") == Device("cuda") and resolve("cuda").is_cuda
    assert str(resolve("cuda:3")) == "cuda:3" and resolve("cuda:3").index == 3
    assert str(resolve("mps")) == "mps"
    with pytest.raises(AttnctlError, match="unknown device 'gpu'"):
        resolve("gpu")


def test_auto_follows_torch_without_importing_it():
    """On this machine auto is what torch picks, and deciding it loads no torch."""
    code = (
        "import sys; from attnctl.model.device import resolve; d = resolve('auto'); "
        "print(d, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    import torch

    picked = "cuda" if torch.cuda.is_available() else "cpu"
    if sys.platform == "darwin":  # asked of torch there: MPS needs it
        picked = "mps" if torch.backends.mps.is_available() else picked
        assert out.stdout.split()[0] == picked
    else:
        assert out.stdout.split() == [picked, "False"]


def test_the_build_is_read_from_torchs_version_file():
    import torch

    build = devices.torch_build()
    assert build == {"cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None)}


@pytest.fixture
def cuda_machine(monkeypatch):
    """This machine as a CUDA build of torch with one GPU (an H200, as the driver would
    describe it) would make it (to auto)."""
    from attnctl.model.gpu import PROFILES

    monkeypatch.setattr(devices, "torch_build", lambda: {"cuda": "13.0", "hip": None})
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 1)
    monkeypatch.setattr(devices, "this_machines_gpu", lambda index: PROFILES["h200"])
    devices._cuda_target.cache_clear()
    yield
    devices._cuda_target.cache_clear()


@pytest.fixture(scope="module")
def marian(tmp_path_factory):
    return str(tiny_seq2seq.write("marian", tmp_path_factory.mktemp("marian") / "marian"))


def _json(invoke, *args):
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("command", ["shapes", "memory"])
@pytest.mark.parametrize("model", [False, True], ids=["seeded", "marian"])
def test_auto_on_a_cuda_machine_plans_for_cuda(cuda_machine, invoke, marian, command, model):
    """shapes and memory of the seeded layer and of a Marian model take the CUDA branch
    under auto, as run does: their documents equal those of --device cuda."""
    extra = ("--model", marian) if model else ()
    automatic = _json(invoke, command, *extra)
    named = _json(invoke, command, *extra, "--device", "cuda")
    assert automatic == named
    assert automatic["config"]["device"] == "cuda"
    documents = automatic.get("results", [automatic])
    devices_seen = {s["device"] for d in documents for s in d.get("stages", [])}
    assert devices_seen <= {"cuda"}


@pytest.mark.parametrize(
    "args,model",
    [
        (("run", "hi"), False),
        (("run", "hi"), True),
        (("check",), False),  # check compares the seeded layer's implementations only
        (("memory", "--measure", "-L", "8"), False),
        (("memory", "--measure", "--src-len", "6", "--tgt-len", "4"), True),
    ],
    ids=["run", "run-marian", "check", "measure", "measure-marian"],
)
def test_auto_on_a_cuda_machine_runs_on_cuda(cuda_machine, invoke, marian, args, model):
    """run, check and memory --measure reach torch with the device auto resolved to:
    CUDA, which torch (a CPU build here) then reports missing, as for --device cuda."""
    extra = ("--model", marian) if model else ()
    automatic = invoke(*args, *extra)
    named = invoke(*args, *extra, "--device", "cuda")
    assert automatic.exit_code == named.exit_code == 2
    assert automatic.output == named.output
    assert "device cuda is not available" in automatic.output


def test_auto_on_a_machine_without_a_gpu_is_the_cpu(monkeypatch, invoke):
    monkeypatch.setattr(devices, "torch_build", lambda: {"cuda": "13.0", "hip": None})
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 0)
    assert _json(invoke, "shapes")["config"]["device"] == "cpu"
    monkeypatch.setattr(devices, "torch_build", lambda: {"cuda": None, "hip": None})
    assert _json(invoke, "memory", "-L", "8")["config"]["device"] == "cpu"
