"""``--json`` of ``shapes`` and ``memory`` on encoder–decoders, and ``memory --generate``.

The decoder-only documents are ``render/json.py``'s; this adds what an encoder–decoder
and generation bring.
"""

from __future__ import annotations

from typing import Any

from attnctl.render.json import (
    ENCODER_DECODER,
    cache_groups,
    memory_dict,
    memory_json,
    model_dict,
    seq2seq_memory_dict,
    shapes_json,
    versioned,
)
from attnctl.render.json_cuda import cuda_dict
from attnctl.report.commands import (
    MemoryCommandReport,
    Seq2SeqDtypeRow,
    Seq2SeqMemoryReport,
    Seq2SeqShapes,
)
from attnctl.stages.plan import Plan


def shapes_document(shapes: Plan | Seq2SeqShapes) -> dict[str, Any]:
    """``shapes --json``: one plan's, or an encoder–decoder's two blocks."""
    if isinstance(shapes, Plan):
        return shapes_json(shapes)
    encoder, decoder = shapes.encoder, shapes.decoder
    fields = {
        "model": _model(encoder),
        "config": encoder.config.to_dict(),
        "src_len": encoder.seq_len,
        "tgt_len": decoder.seq_len,
        "batch": encoder.batch,
        "dims": {
            "L": "encoder: the source's length; decoder: the target's",
            "Lc": "the source's length (the encoder output)",
        },
        "encoder": _block(encoder),
        "decoder": _block(decoder),
    }
    return versioned("shapes", ENCODER_DECODER, fields)


def _model(encoder: Plan) -> dict[str, Any] | None:
    """render/json's model, its ``layers`` the encoder's, with the decoder's blocks."""
    document = model_dict(encoder)
    if document is not None and encoder.model is not None and encoder.model.decoder:
        document["decoder_layers"] = encoder.model.decoder.layers
    return document


def _block(plan: Plan) -> dict[str, Any]:
    return {
        "layer": plan.layer_index,
        "seq_len": plan.seq_len,
        "sizes": plan.sizes,
        "stages": [s.to_dict() for s in plan.stages],
        "cuda": cuda_dict(plan),
    }


def memory_document(report: MemoryCommandReport | Seq2SeqMemoryReport) -> dict[str, Any]:
    """``memory --json``: an encoder–decoder's document, or render/json.py's (the cache
    after ``--generate N`` under each length's ``kv_cache_after_generate``)."""
    if isinstance(report, Seq2SeqMemoryReport):
        return seq2seq_memory_json(report)
    return memory_json(report)


def _row(row: Seq2SeqDtypeRow) -> dict[str, int]:
    return seq2seq_memory_dict(row)


def seq2seq_memory_json(report: Seq2SeqMemoryReport) -> dict[str, Any]:
    encoder, decoder, row, measured = (
        report.encoder_plan, report.decoder_plan, report.row, report.measured
    )  # fmt: skip
    blocks = {}
    for name, plan, estimate, got in (
        ("encoder", encoder, row.encoder, measured.encoder if measured else None),
        ("decoder", decoder, row.decoder, measured.decoder if measured else None),
    ):
        stages = []
        for i, (stage, live) in enumerate(zip(plan.stages, estimate.live_bytes, strict=True)):
            entry = {**stage.to_dict(), "live_bytes": live, "scratch_bytes": stage.scratch}
            entry["measured_live_bytes"] = None if got is None else got.stage_peak_bytes[i]
            stages.append(entry)
        blocks[name] = {
            "layer": plan.layer_index,
            "seq_len": plan.seq_len,
            "sizes": plan.sizes,
            **memory_dict(estimate),
            "stages": stages,
            "cuda": cuda_dict(plan),
        }
    fields: dict[str, Any] = {
        "model": _model(encoder),
        "config": encoder.config.to_dict(),
        "batch": encoder.batch,
        "src_len": report.src_len,
        "tgt_len": report.tgt_len,
        "parameters": encoder.parameter_count,
        **_row(row),
        "kv_cache_tokens": report.tgt_len,
        "kv_cache": cache_groups(report.kv_cache),
        "cross_kv_cache_tokens": report.src_len,
        "cross_kv_cache": cache_groups(report.cross_kv_cache),
        "by_dtype": {
            dtype: _row(rows.get(encoder.config.impl) or next(iter(rows.values())))
            for dtype, rows in report.variants.items()
        },
        "by_impl": {impl: _row(r) for impl, r in report.variants[encoder.config.dtype].items()},
        **blocks,
        "measured": None
        if measured is None
        else {
            "parameters_bytes": measured.encoder.parameter_bytes,
            "encoder_peak_activation_bytes": measured.encoder.peak_activation_bytes,
            "decoder_peak_activation_bytes": measured.decoder.peak_activation_bytes,
            "kv_cache_bytes": measured.kv_cache_bytes,
            "cross_kv_cache_bytes": measured.cross_kv_cache_bytes,
            "device": measured.encoder.device,
            "by": measured.encoder.method,
        },
    }
    return versioned("memory", ENCODER_DECODER, fields)
