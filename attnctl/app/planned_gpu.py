"""What a GPU plan asks of the use cases: ``run --gpu NAME`` (which runs here and prints
the plan for that GPU), and the one CUDA figure ``--fit``, ``--budget`` and the
pre-flights count (the estimate with its margin, within what the context leaves)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from attnctl.app.calls import kv_cache_of
from attnctl.app.requests import LayerRequest, MemoryRequest, RunRequest
from attnctl.errors import AttnctlError
from attnctl.memory.estimate import format_bytes, parse_size
from attnctl.model.config import LayerConfig
from attnctl.model.describe import ModelDescription
from attnctl.model.device import cuda_target, resolve
from attnctl.model.gpu import CONTEXT_BYTES, with_margin
from attnctl.model.layout import Layout
from attnctl.stages.plan import Plan


def refuse_planned_gpu(request: RunRequest, layout: Layout, model: ModelDescription | None) -> None:
    """``run --gpu NAME`` runs here and prints the plan's memory for that GPU: one block
    of a decoder-only model or the seeded layer, not a generation or a split."""
    for given, what in (
        (request.generate is not None, "--generate (plan it with memory --generate --gpu)"),
        (model is not None and model.is_encoder_decoder, "an encoder–decoder's translation"),
        (layout.is_split, "a split (plan it with memory --tp ... --gpu)"),
    ):
        if given:
            raise AttnctlError(f"run --gpu plans one forward pass's memory; not with {what}")


def on_this_machine(request: LayerRequest, layer: LayerConfig) -> LayerConfig:
    """``--gpu NAME``: the layer on this machine's device (``--device`` resolved), on
    which ``run`` computes; the plan it prints is for the named GPU."""
    if not layer.gpu:
        return layer
    spec = request.options.get("device") or "auto"
    return dataclasses.replace(layer, device=str(resolve(spec)), gpu="", torch_rules="")


def measure_need(plan: Plan, train: bool, peak_of: Callable[[Plan], int], kv_layers: int) -> int:
    """What ``--measure`` holds at its peak: the step's peak, or a forward pass's and the
    K and V it keeps (its second pass, through every block, keeps the cache)."""
    need = peak_of(plan)
    if not train:
        key_len = plan.sizes.get("Lc", plan.seq_len)
        need += sum(g.bytes for g in kv_cache_of(plan, key_len, kv_layers))
    return need


def cuda_need(train: bool, peak_of: Callable[[Plan], int], kv_layers: int, plan: Plan) -> int:
    """A CUDA fit's figure for a plan: what --measure's pre-flight asks, with the margin."""
    return with_margin(measure_need(plan, train, peak_of, kv_layers))


def budget_bytes(request: MemoryRequest, layer: LayerConfig) -> int | None:
    """The budget what fits is sought in: --budget SIZE, or (--fit) the device's free
    memory; None without either. On CUDA, what the process context leaves: --fit, the
    free bytes less the context still to load (a named --gpu: its memory less all of
    it); --budget SIZE, the size less the context."""
    budget_bytes = None
    cuda = layer.device.startswith("cuda")
    if request.fit_device and layer.gpu:
        budget_bytes = cuda_target(layer.device, layer.gpu, layer.torch_rules).gpu.total_bytes
        budget_bytes -= CONTEXT_BYTES
    elif request.fit_device:
        from attnctl.memory.resources import device_free_bytes

        budget_bytes = device_free_bytes(layer.device)
    if request.budget is not None:
        budget_bytes = parse_size(request.budget)
        if cuda:
            budget_bytes -= CONTEXT_BYTES
            if budget_bytes <= 0:
                raise AttnctlError(
                    f"--budget {request.budget} leaves nothing beside the CUDA context "
                    f"({format_bytes(CONTEXT_BYTES)})"
                )
    return budget_bytes
