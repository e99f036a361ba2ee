"""``memory`` over a split (--tp, --sp, --cp, --pp, --dp, --zero): the request checked, the
split estimated (:class:`attnctl.parallel.split.Split`) and, under ``--measure``, the ranks
started (:mod:`attnctl.parallel.distributed`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from attnctl.app.inputs import parse_lengths
from attnctl.app.requests import Hooks, MemoryRequest
from attnctl.errors import AttnctlError
from attnctl.memory.estimate import longest_input, parse_size
from attnctl.model.config import LARGEST_SIZE, LayerConfig
from attnctl.model.describe import ModelDescription
from attnctl.model.layout import Layout, check_batch, check_layout
from attnctl.parallel.plan import check_split
from attnctl.parallel.split import Split, block_windows
from attnctl.parallel.split_report import ParallelReport
from attnctl.report.commands import MemoryCommandReport
from attnctl.stages.plan import seeded_model
from attnctl.text.tokenize import vocab_size


def check_request(request: MemoryRequest, layer: LayerConfig, model: ModelDescription | None):
    """Every refusal of a split's request, before any planning: (length, micro-batches
    per step, the model's description)."""
    layout = request.layout
    check_layout(layout, train=request.train, measure=request.measure)
    if request.generate is not None:
        raise AttnctlError("--generate with a split is not modelled yet: leave out one of them")
    if request.context_len is not None:
        raise AttnctlError("a split of cross-attention (--context-len) is not modelled yet")
    if request.budget is not None and request.fit_device:
        raise AttnctlError("give --budget SIZE or --fit, not both")
    if request.budget is not None:
        parse_size(request.budget)  # read before anything is planned
    if request.train and request.kv_cache is not None:
        raise AttnctlError("--kv-cache is inference's: a training step keeps no KV cache")
    if model is not None and request.layers != 1:
        raise AttnctlError("--layers does not apply to --model (a whole model's memory)")
    lengths = parse_lengths(request.seq_len) if request.seq_len is not None else None
    if lengths is not None and len(lengths) > 1:
        raise AttnctlError(
            f"a split's per-device memory is for one --seq-len: give one length, not {len(lengths)}"
        )
    length = lengths[0] if lengths else min(2048, longest_input(layer, model) or 2048)
    micro_batches = check_batch(layout, request.batch)
    if request.measure and request.train and micro_batches > 1:  # the ranks run one
        raise AttnctlError(
            f"--measure --train runs a step of one micro-batch; --micro-batch "
            f"{layout.micro_batch} of --batch {request.batch} accumulates {micro_batches}, "
            "estimated only: leave out --micro-batch (or make it --batch) to measure"
        )
    description = _description(layer, model, length)
    check_split(layout, description, [length], request.layers)
    if request.kv_cache is not None and request.kv_cache < 0:
        raise AttnctlError(f"--kv-cache must be a number of tokens >= 0, got {request.kv_cache}")
    if request.kv_cache is not None and request.kv_cache >= LARGEST_SIZE:
        raise AttnctlError(
            f"--kv-cache must be below 2^63 (torch's largest size), got {request.kv_cache}"
        )
    return length, micro_batches, description


def _description(
    layer: LayerConfig, model: ModelDescription | None, length: int
) -> ModelDescription:
    if model is not None:
        return model.with_run(layer)
    return seeded_model(layer, vocab_size(layer.tokenizer, length))


# ---------------------------------------------------------------- the use case


def parallel_memory_use_case(
    request: MemoryRequest,
    layer: LayerConfig,
    model: ModelDescription | None,
    single_device: Callable[[MemoryRequest], MemoryCommandReport],
    hooks: Hooks,
) -> MemoryCommandReport:
    """The whole model on one device (as without the split: ``single_device``), and
    beside it every pipeline stage's device."""
    length, micro_batches, description = check_request(request, layer, model)
    layout = request.layout
    whole = single_device(
        dataclasses.replace(
            request, layout=Layout(), seq_len=str(length), budget=None, fit_device=False
        )
    )
    split = Split(layer, model, description, layout, request.train, request.layers)
    micro = layout.micro_batch or request.batch
    kv_tokens = request.kv_cache if request.kv_cache is not None else length
    with hooks.progress(f"planning {layout.summary()}"):
        stages = split.per_device(length, micro, micro_batches, kv_tokens, request.batch)
    budget = None
    if request.fit_device:
        from attnctl.memory.resources import device_free_bytes

        budget = device_free_bytes(layer.device)
    elif request.budget is not None:
        budget = parse_size(request.budget)
    fit = None
    if budget is not None:
        fit = split.fit(budget, length, micro, micro_batches, request.kv_cache, request.batch)
    measured = None
    if request.measure:
        from attnctl.parallel.distributed import measure_split

        processes = layout.ranks  # T · C, or D (each run alone)
        what = "a training step" if request.train else "a forward pass"
        with hooks.progress(f"measuring {what} on {processes} gloo processes"):
            ranks = measure_split(
                layer, length, micro, description.vocab_size, layout, model,
                force=request.force, train=request.train, layers=request.layers,
            )  # fmt: skip
        measured = [
            {
                "rank": rank.rank,
                "peak_bytes": rank.peak_bytes,
                "measured_peak_bytes": rank.measured_peak_bytes,
                "collective_buffer_bytes": rank.collective_buffer_bytes,
            }
            for rank in ranks
        ]
        if request.train:  # each phase's too: forward, backward, optimizer step
            for entry, rank in zip(measured, ranks, strict=True):
                weights, got = rank.parameter_bytes, rank.measured_parameter_bytes
                entry["phase_peak_bytes"] = [weights + b for b in rank.stage_peak_bytes]
                entry["measured_phase_peak_bytes"] = [
                    got + b for b in rank.measured_stage_peak_bytes
                ]
    config = description.config
    report = ParallelReport(
        layout=dataclasses.replace(layout, micro_batch=micro),
        what="the layer" if model is None else model.name,
        seq_len=length,
        batch=request.batch,
        micro_batch=micro,
        micro_batches=micro_batches,
        blocks=split.block_count,
        heads=config.heads,
        kv_heads=config.kv_heads,
        dtype=layer.dtype,
        train=request.train,
        kv_cache_tokens=0 if request.train else kv_tokens,
        stages=stages,
        notes=split.notes(stages, micro_batches),
        fit=fit,
        measured_per_rank=measured,
        windows=block_windows(description, split.block_count),
    )
    return dataclasses.replace(whole, parallel=report)
