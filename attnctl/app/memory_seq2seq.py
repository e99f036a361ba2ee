"""``shapes`` and ``memory`` on an encoder–decoder (``--src-len S --tgt-len T``), and the
length options' checks for every model.

An encoder–decoder is planned as two blocks: an encoder block over the source (L = S)
and a decoder block over the target (L = T) whose cross-attention reads the encoder
output (Lc = S). Its memory is the checkpoint's weights, each block's activation peak,
the decoder's self-attention KV cache (T positions per block) and the cross-attention's
K and V (S positions per block, made once from the encoder output).
"""

from __future__ import annotations

import dataclasses

from attnctl.app.calls import device_errors_of
from attnctl.app.requests import Hooks, MemoryRequest
from attnctl.errors import AttnctlError
from attnctl.memory.estimate import allowed_impls, cross_kv_cache_groups, estimate, kv_cache_groups
from attnctl.model.config import DTYPES, LARGEST_SIZE, LayerConfig
from attnctl.model.describe import ModelDescription
from attnctl.report.commands import (
    Seq2SeqDtypeRow,
    Seq2SeqMeasured,
    Seq2SeqMemoryReport,
    Seq2SeqShapes,
)
from attnctl.stages.plan import build_seq2seq_plans

SHAPES_LENGTH = 16  # shapes' default source and target lengths, as its --seq-len
MEMORY_LENGTH = 2048  # memory's, fewer for a model with fewer positions


def check_length_options(
    model: ModelDescription | None,
    seq_len: object,
    src_len: int | None,
    tgt_len: int | None,
) -> None:
    """--src-len and --tgt-len go with an encoder–decoder, --seq-len with any other."""
    if model is None or not model.is_encoder_decoder:
        if src_len is not None or tgt_len is not None:
            option = "--src-len" if src_len is not None else "--tgt-len"
            what = "the seeded layer" if model is None else f"{model.name} (decoder-only)"
            raise AttnctlError(
                f"{option} is an encoder–decoder's (--model DIR of Marian, BART or T5); "
                f"{what} takes --seq-len"
            )
        return
    if seq_len is not None:
        raise AttnctlError(
            f"{model.name} is an encoder–decoder: give --src-len and --tgt-len, not --seq-len"
        )
    for option, value in (("--src-len", src_len), ("--tgt-len", tgt_len)):
        if value is None:
            continue
        if value <= 0:
            raise AttnctlError(f"{option} must be a positive integer, got {value}")
        if value >= LARGEST_SIZE:
            raise AttnctlError(f"{option} must be below 2^63 (torch's largest size), got {value}")
        longest = model.longest_input()
        if longest is not None and value > longest:
            raise AttnctlError(
                f"--{option} {value} is more than the {longest} positions {model.name} "
                "was trained with"
            )


def default_length(model: ModelDescription, default: int) -> int:
    longest = model.longest_input()
    return default if longest is None else min(default, longest)


def seq2seq_shapes(
    layer: LayerConfig,
    model: ModelDescription,
    src_len: int | None,
    tgt_len: int | None,
    batch: int,
) -> Seq2SeqShapes:
    """``shapes --model DIR``: encoder block 0 and decoder block 0."""
    source = src_len or default_length(model, SHAPES_LENGTH)
    target = tgt_len or default_length(model, SHAPES_LENGTH)
    encoder, decoder = build_seq2seq_plans(model, layer, source, target, batch, device=layer.device)
    return Seq2SeqShapes(encoder, decoder)


def _row(
    layer: LayerConfig, model: ModelDescription, source: int, target: int, batch: int
) -> tuple[Seq2SeqDtypeRow, list, list, tuple]:
    plans = build_seq2seq_plans(model, layer, source, target, batch, device=layer.device)
    encoder_plan, decoder_plan = plans
    self_groups = kv_cache_groups(decoder_plan, target)
    cross_groups = cross_kv_cache_groups(decoder_plan, source)
    row = Seq2SeqDtypeRow(
        parameter_bytes=encoder_plan.parameter_bytes,  # every weight of the checkpoint
        encoder=estimate(encoder_plan),
        decoder=estimate(decoder_plan),
        kv_cache_bytes=sum(g.bytes for g in self_groups),
        cross_kv_cache_bytes=sum(g.bytes for g in cross_groups),
    )
    return row, self_groups, cross_groups, plans


def seq2seq_memory(
    request: MemoryRequest, layer: LayerConfig, model: ModelDescription, hooks: Hooks
) -> Seq2SeqMemoryReport:
    """``memory --model DIR`` on an encoder–decoder (``--measure``: each part measured)."""
    refused = {
        "--layers": request.layers != 1,
        "--context-len": request.context_len is not None,
        "--kv-cache": request.kv_cache is not None,
        "--generate": request.generate is not None,
        "--budget": request.budget is not None,
        "--fit": request.fit_device,
        "--train": request.train,
    }
    why = {
        "--kv-cache": "its self-attention cache holds --tgt-len positions",
        "--generate": "its target is --tgt-len tokens",
        "--train": "attnctl models no encoder–decoder training step",
        "--budget": "attnctl fits no encoder–decoder to a budget",
        "--fit": "attnctl fits no encoder–decoder to a budget",
    }
    for option, given in refused.items():
        if given:
            reason = why.get(option, "it does not apply to a whole model")
            raise AttnctlError(f"{option} does not apply to {model.name} here: {reason}")
    source = request.src_len or default_length(model, MEMORY_LENGTH)
    target = request.tgt_len or default_length(model, MEMORY_LENGTH)
    batch = request.batch
    row, self_groups, cross_groups, plans = _row(layer, model, source, target, batch)
    encoder_plan, decoder_plan = plans
    variants: dict[str, dict[str, Seq2SeqDtypeRow]] = {}
    for dtype in DTYPES:
        variants[dtype] = {}
        for impl in allowed_impls(layer):
            variant = dataclasses.replace(layer, dtype=dtype, impl=impl)
            variants[dtype][impl] = _row(variant, model, source, target, batch)[0]
    measured = None
    if request.measure:
        from attnctl.app.preflight import preflight

        need = row.peak_bytes + row.encoder.peak_activation_bytes  # measured one after another
        blocks = 2 + model.decoder.layers  # block 0 of each, then the decoder keeping K, V
        preflight(decoder_plan, need, request.force, hooks, blocks=blocks)
        with hooks.progress(f"measuring a {source}-token source and a {target}-token target"):
            measured = _measure(encoder_plan, decoder_plan)
    return Seq2SeqMemoryReport(
        encoder_plan=encoder_plan,
        decoder_plan=decoder_plan,
        row=row,
        kv_cache=self_groups,
        cross_kv_cache=cross_groups,
        variants=variants,
        measured=measured,
    )


def _measure(encoder_plan, decoder_plan) -> Seq2SeqMeasured:
    from attnctl.memory.measure import measure_forward, measure_seq2seq_caches

    with device_errors_of(encoder_plan.config.device):
        encoder = measure_forward(encoder_plan)
        decoder = measure_forward(decoder_plan)
        kv_cache, cross = measure_seq2seq_caches(decoder_plan)
    return Seq2SeqMeasured(encoder, decoder, kv_cache, cross)
