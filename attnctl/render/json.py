"""JSON documents (``--json``) from plans, traces and memory estimates."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnctl.memory import MemoryEstimate
from attnctl.plan import Plan
from attnctl.report import LengthReport, MemoryCommandReport, RunReport

if TYPE_CHECKING:  # measure.py and check.py import torch; render only reads their results
    from attnctl.check import CheckResult


# ---------------------------------------------------------------- JSON

if TYPE_CHECKING:  # generation's reports: their module loads with their use case
    from attnctl.report_generation import GenerationReport, TranslationReport, TranslationView


def memory_dict(estimate: MemoryEstimate) -> dict[str, int | str]:
    return {
        "parameters": estimate.parameters,
        "parameters_bytes": estimate.parameter_bytes,
        "activation_bytes": estimate.activation_bytes,
        "attention_matrix_bytes": estimate.attention_matrix_bytes,
        "scores_bytes": estimate.scores_bytes,
        "weights_bytes": estimate.weights_bytes,
        "peak_activation_bytes": estimate.peak_activation_bytes,
        "peak_bytes": estimate.peak_bytes,
        "peak_stage": estimate.peak_stage,
    }


def model_dict(plan: Plan) -> dict[str, Any] | None:
    model = plan.model
    if model is None:
        return None
    return {
        "path": str(model.path),
        "model_type": model.model_type,
        "family": model.family,
        "layers": model.layers,
        "hidden": model.hidden,
        "heads": model.heads,
        "kv_heads": model.kv_heads,
        "intermediate": model.intermediate,
        "activation": model.activation,
        "vocab_size": model.vocab_size,
        "max_positions": model.max_positions,
        "dtype": model.dtype,
    }


def blocks_json(report: RunReport) -> dict[str, Any]:
    """``run --model --layer all``: each block's head statistics and weights."""
    first, plan, estimate = report.trace, report.plan, report.estimate
    return {
        "model": model_dict(plan),
        "config": plan.config.to_dict(),
        "tokenizer": first.tokenizer,
        "vocab_size": first.vocab_size,
        "device": first.device,
        "tokens": [[t.to_dict() for t in row] for row in first.tokens],
        "impl": first.impl,
        "attention_heads": first.attention_heads,
        "attention_rows": first.attention_rows,
        "layers": [
            {
                "layer": trace.layer,
                "head_stats": [s.to_dict() for s in stats],
                "attention": trace.attention_lists(),
            }
            for trace, stats in zip(report.traces, report.head_stats, strict=True)
        ],
        "memory": memory_dict(estimate),
    }


def run_json(report: RunReport) -> dict[str, Any]:
    """``run``: one block's tokens, stages, head statistics and weights."""
    trace, plan, estimate = report.trace, report.plan, report.estimate
    return {
        "model": model_dict(plan),
        "layer": trace.layer,
        "config": plan.config.to_dict(),
        "tokenizer": trace.tokenizer,
        "vocab_size": trace.vocab_size,
        "device": trace.device,
        "tokens": [[t.to_dict() for t in row] for row in trace.tokens],
        "stages": [s.to_dict() for s in trace.stages],
        "impl": trace.impl,
        "head_stats": [s.to_dict() for s in report.head_stats[0]],
        "attention": trace.attention_lists(),
        "attention_heads": trace.attention_heads,
        "attention_rows": trace.attention_rows,
        "context_tokens": None
        if trace.context_tokens is None
        else [[t.to_dict() for t in row] for row in trace.context_tokens],
        "memory": memory_dict(estimate),
    }


def shapes_json(plan: Plan) -> dict[str, Any]:
    return {
        "model": model_dict(plan),
        "config": plan.config.to_dict(),
        "seq_len": plan.seq_len,
        "batch": plan.batch,
        "sizes": plan.sizes,
        "stages": [s.to_dict() for s in plan.stages],
    }


def memory_json(command: MemoryCommandReport) -> dict[str, Any]:
    """One length: its document. Several: their documents under ``results``."""
    reports, fits, budget = command.lengths, command.fits, command.budget_bytes
    documents = [_length_json(report) for report in reports]
    extra: dict[str, Any] = {}
    if fits is not None:
        extra = {
            "budget_bytes": budget,
            "max_seq_len": {impl: found["max_seq_len"] for impl, found in fits.items()},
            "max_batch": {impl: found["max_batch"] for impl, found in fits.items()},
        }
    if len(documents) == 1:
        return {**documents[0], **extra}
    first = reports[0].plan
    return {
        "model": model_dict(first),
        "config": first.config.to_dict(),
        "batch": first.batch,
        "layers": reports[0].estimate.layers,
        "seq_lens": [r.plan.seq_len for r in reports],
        "results": documents,
        **extra,
    }


def _length_json(report: LengthReport) -> dict[str, Any]:
    plan, estimate, measured = report.plan, report.estimate, report.measured
    stages = []
    for i, (stage, live) in enumerate(zip(plan.stages, estimate.live_bytes, strict=True)):
        entry = {**stage.to_dict(), "live_bytes": live, "scratch_bytes": stage.scratch}
        if measured is not None and measured.stage_peak_bytes:
            entry["measured_live_bytes"] = measured.stage_peak_bytes[i]
        stages.append(entry)
    variants = report.variants
    document: dict[str, Any] = {
        "model": model_dict(plan),
        "config": plan.config.to_dict(),
        "seq_len": plan.seq_len,
        "batch": plan.batch,
        "layers": estimate.layers,
        **memory_dict(estimate),
        "kv_cache_tokens": report.kv_cache_tokens,
        "kv_cache_bytes": report.kv_cache_bytes,
        "kv_cache": [
            {
                "window": group.window or None,
                "layers": group.layers,
                "tokens": group.tokens,
                "kv_heads": group.kv_heads,
                "head_dim": group.head_dim,
                "bytes": group.bytes,
            }
            for group in report.kv_cache
        ],
        "measured_kv_cache_bytes": report.measured_kv_cache_bytes,
        "by_dtype": {dtype: memory_dict(row[plan.config.impl]) for dtype, row in variants.items()},
        "by_impl": {impl: memory_dict(est) for impl, est in variants[plan.config.dtype].items()},
        "stages": stages,
    }
    if report.training is not None:
        training = report.training
        document["training_bytes"] = training.peak_bytes
        document["training"] = {
            "parameters_bytes": training.parameter_bytes,
            "gradient_bytes": training.gradient_bytes,
            "master_bytes": training.master_bytes,
            "optimizer_bytes": training.optimizer_bytes,
            "saved_bytes": training.saved_bytes,
            "peak_bytes": training.peak_bytes,
            "peak_phase": training.peak_phase,
        }
    if measured is not None:
        document["measured_peak_bytes"] = measured.peak_bytes
        document["measured_what"] = "training step" if report.training else "forward pass"
        document["measured_device"] = measured.device
        document["measured_by"] = measured.method
    return document


def check_json(result: CheckResult, plan: Plan) -> dict[str, Any]:
    return {
        "config": plan.config.to_dict(),
        "seq_len": plan.seq_len,
        "batch": plan.batch,
        "device": result.device,
        "comparisons": [
            {
                "a": c.a,
                "b": c.b,
                "what": c.what,
                "max_abs_diff": c.max_abs_diff,
                "tolerance": c.tolerance,
                "ok": c.ok,
            }
            for c in result.comparisons
        ],
        "skipped": result.skipped,
        "gradcheck": result.gradcheck,
        "gradcheck_note": result.gradcheck_note,
        "ok": result.ok,
    }


def generation_json(report: GenerationReport) -> dict[str, Any]:
    """``run --generate``: the run document's keys for the final sequence (prompt +
    generated), and the steps. ``attention`` (B, heads, rows, Lk) holds every row of the
    final sequence as its step computed it; with --layer all, ``layers`` holds each
    block's."""
    trace, plan = report.trace, report.plan
    document: dict[str, Any] = {
        "model": model_dict(plan),
        "layer": None if report.every_block else report.blocks[0],
        "config": plan.config.to_dict(),
        "tokenizer": trace.tokenizer,
        "vocab_size": trace.vocab_size,
        "device": trace.device,
        "tokens": [[t.to_dict() for t in row] for row in trace.tokens],
        "stages": [s.to_dict() for s in plan.stages],  # the prefill's, as planned
        "impl": trace.impl,
        "head_stats": [s.to_dict() for s in report.head_stats[0]],
        "attention": None if report.every_block else trace.attention_lists(),
        "attention_heads": trace.attention_heads,
        "attention_rows": trace.attention_rows,
        "context_tokens": None,
        "memory": memory_dict(report.estimate),
        "prompt_tokens": [[t.to_dict() for t in row] for row in report.prompt_tokens],
        "generated_ids": report.generated_ids,
        "generated_tokens": [[t.text for t in row] for row in report.generated_tokens],
        "generated_text": report.generated_texts,
        "stop": report.stop,
        "kv_cache_layer": report.cache_block,
        "steps": [
            {
                "step": step.step,
                "token": step.tokens,
                "text": step.texts,
                "position": step.position,
                "finished": step.finished,
                "kv_cache_shape": list(step.cache_shapes[report.cache_block]["attention"]),
                "kv_cache_shapes": [list(s["attention"]) for s in step.cache_shapes],
                "kv_cache_bytes": step.estimated_bytes,
                "measured_kv_cache_bytes": step.measured_bytes,
                "dropped": step.dropped,
                "top_keys": [[list(pair) for pair in row] for row in step.top_keys],
            }
            for step in report.steps
        ],
        "kv_cache_bytes": report.final_estimated_bytes,
        "measured_kv_cache_bytes": report.final_measured_bytes,
        "kv_cache": [
            {
                "window": group.window or None,
                "layers": group.layers,
                "tokens": group.tokens,
                "kv_heads": group.kv_heads,
                "head_dim": group.head_dim,
                "bytes": group.bytes,
            }
            for group in report.kv_groups
        ],
    }
    if report.every_block:
        document["layers"] = [
            {
                "layer": t.layer,
                "head_stats": [s.to_dict() for s in stats],
                "attention": t.attention_lists(),
            }
            for t, stats in zip(report.traces, report.head_stats, strict=True)
        ]
    return document


def translation_dict(view: TranslationView) -> dict[str, Any]:
    """An encoder–decoder's keys: its tokens, three attentions and the alignment."""
    return {
        "source_tokens": [[t.to_dict() for t in row] for row in view.source_tokens],
        "target_tokens": [[t.to_dict() for t in row] for row in view.target_tokens],
        "encoder_layer": view.encoder_block,
        "decoder_layer": view.decoder_block,
        "attention_heads": view.heads,
        "encoder_attention": view.encoder_attention,
        "decoder_attention": view.decoder_attention,
        "cross_attention": view.cross_attention,
        "alignment_heads": view.averaged_heads,
        "alignment": [
            [
                {
                    "target_position": a.target_position,
                    "target_id": a.target_id,
                    "source_position": a.source_position,
                    "weight": a.weight,
                }
                for a in row
            ]
            for row in view.alignment
        ],
    }


def translation_json(report: TranslationReport) -> dict[str, Any]:
    """An encoder–decoder's run: its tokens, steps, the three attentions of the blocks
    chosen over the whole target as the steps computed it, and the alignment."""
    model = report.model
    return {
        "model": {
            "path": str(model.path),
            "model_type": model.model_type,
            "family": model.family,
            "encoder_layers": model.layers,
            "decoder_layers": model.decoder.layers,
            "hidden": model.hidden,
            "heads": model.heads,
            "vocab_size": model.vocab_size,
            "dtype": model.dtype,
        },
        "config": model.config.to_dict(),  # the encoder's attention
        "decoder_config": model.decoder.config.to_dict(),  # the decoder's self-attention
        "tokenizer": report.tokenizer,
        "device": report.device,
        "dtype": report.dtype,
        "impl": "math",
        "encoder_stages": None
        if report.encoder_plan is None
        else [s.to_dict() for s in report.encoder_plan.stages],
        "decoder_stages": None
        if report.decoder_plan is None
        else [s.to_dict() for s in report.decoder_plan.stages],  # the whole target at once
        **translation_dict(report.view),
        # as run gives them for any model: the text's tokens and the encoder block's weights
        "tokens": [[t.to_dict() for t in row] for row in report.view.source_tokens],
        "attention": report.view.encoder_attention,
        "attention_rows": list(range(len(report.view.source_tokens[0]))),
        "generated_ids": report.generated_ids,
        "generated_tokens": [[t.text for t in row[1:]] for row in report.view.target_tokens],
        "generated_text": report.generated_texts,
        "stop": report.stop,
        "steps": [
            {
                "step": step.step,
                "token": step.tokens,
                "text": step.texts,
                "position": step.position,
                "finished": step.finished,
                "kv_cache_shape": list(step.cache_shapes[report.view.decoder_block]["attention"]),
                "cross_kv_cache_shape": list(
                    step.cache_shapes[report.view.decoder_block]["cross_attention"]
                ),
                "kv_cache_bytes": step.estimated_bytes,
                "measured_kv_cache_bytes": step.measured_bytes,
                "top_sources": [[list(pair) for pair in row] for row in step.top_keys],
            }
            for step in report.steps
        ],
        "kv_cache_bytes": report.final_estimated_bytes,
        "measured_kv_cache_bytes": report.final_measured_bytes,
        # --layer all: "encoder", "decoder", "cross" -> one {layer, head_stats, attention}
        # per block; else null
        "layers": {
            kind: [
                {
                    "layer": trace.layer,
                    "head_stats": [s.to_dict() for s in stats],
                    "attention": trace.attention_lists(),
                }
                for trace, stats in zip(traces, report.block_stats[kind], strict=True)
            ]
            for kind, traces in report.block_traces.items()
        }
        if report.every_block
        else None,
    }
