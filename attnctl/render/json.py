"""JSON documents (``--json``) from plans, traces and memory estimates.

Every document starts with ``schema_version``, ``command`` and ``kind``, and has one set
of keys per command and kind whatever the options (a key an option does not fill is
null); docs/schema/COMMAND.schema.json describes each, docs/json.md the versioning rule.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnctl.memory.estimate import KVCacheGroup, MemoryEstimate
from attnctl.render.json_cuda import cuda_dict
from attnctl.report.commands import LengthReport, MemoryCommandReport, RunReport, Seq2SeqDtypeRow
from attnctl.stages.plan import Plan

if TYPE_CHECKING:  # measure.py and check.py import torch; render only reads their results
    from attnctl.nn.check import CheckResult
    from attnctl.parallel.split_report import ParallelReport


# ---------------------------------------------------------------- JSON

# bumped when a document changes in a way that can break a reader of the previous version
# (a key removed or renamed, a type, unit or meaning changed); docs/json.md has the rule
SCHEMA_VERSION = 1
# each command's JSON Schema: inside an installed wheel, or docs/schema in a source checkout
_PACKAGE_DIR = Path(__file__).resolve().parent.parent
SCHEMA_DIRS = (_PACKAGE_DIR / "schema", _PACKAGE_DIR.parent / "docs" / "schema")
LAYER = "layer"  # the seeded layer, or the block(s) of a model with one stack
ENCODER_DECODER = "encoder-decoder"  # a model with an encoder and a decoder

# run's document of kind "layer", in its order: one block (seeded layer, --context,
# --model --layer N), every block (--layer all: "layers") or a generation (--generate)
RUN_KEYS = (
    "model",
    "layer",
    "config",
    "tokenizer",
    "vocab_size",
    "device",
    "tokens",
    "stages",
    "impl",
    "head_stats",
    "attention",
    "attention_heads",
    "attention_rows",
    "context_tokens",
    "memory",
    "layers",
    # --generate; null without it
    "prompt_tokens",
    "generated_ids",
    "generated_tokens",
    "generated_text",
    "stop",
    "kv_cache_layer",
    "steps",
    "kv_cache_bytes",
    "measured_kv_cache_bytes",
    "kv_cache",
    "cuda",  # a CUDA plan's GPU, kernels and lines; null on another device
)

if TYPE_CHECKING:  # generation's reports: their module loads with their use case
    from attnctl.report.generation import GenerationReport, TranslationReport, TranslationView


# the keys of a training device's phase_peak_bytes, in the order of replay.step.PHASES
PHASE_KEYS = ("forward", "backward", "optimizer_step")


def schema_file(command: str) -> Path:
    """The JSON Schema of ``command``'s document (run, shapes, memory, check)."""
    name = f"{command}.schema.json"
    for folder in SCHEMA_DIRS:
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"no {name} in {' or '.join(str(d) for d in SCHEMA_DIRS)}")


def versioned(command: str, kind: str, fields: dict[str, Any]) -> dict[str, Any]:
    """A document: its version, command and kind first, then its fields."""
    return {"schema_version": SCHEMA_VERSION, "command": command, "kind": kind, **fields}


def _layer_run(fields: dict[str, Any]) -> dict[str, Any]:
    """run's document of kind "layer": every key of :data:`RUN_KEYS` in its order, those
    ``fields`` does not give null."""
    unknown = fields.keys() - set(RUN_KEYS)
    if unknown:  # a key of one form only would break the one shape
        raise ValueError(f"not keys of run's document: {sorted(unknown)}")
    return versioned("run", LAYER, {key: fields.get(key) for key in RUN_KEYS})


def cache_groups(groups: list[KVCacheGroup]) -> list[dict[str, Any]]:
    """A KV cache by kind of block: its window (null: full attention) and its bytes."""
    return [
        {
            "window": group.window or None,
            "layers": group.layers,
            "tokens": group.tokens,
            "kv_heads": group.kv_heads,
            "head_dim": group.head_dim,
            "bytes": group.bytes,
        }
        for group in groups
    ]


def _blocks(traces: list, stats: list) -> list[dict[str, Any]]:
    """--layer all: each block's head statistics and weights."""
    return [
        {
            "layer": trace.layer,
            "head_stats": [s.to_dict() for s in block_stats],
            "attention": trace.attention_lists(),
        }
        for trace, block_stats in zip(traces, stats, strict=True)
    ]


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


def seq2seq_memory_dict(row: Seq2SeqDtypeRow) -> dict[str, int]:
    """An encoder–decoder's memory at one source and target length (memory's figures)."""
    return {
        "parameters_bytes": row.parameter_bytes,
        "encoder_peak_activation_bytes": row.encoder.peak_activation_bytes,
        "decoder_peak_activation_bytes": row.decoder.peak_activation_bytes,
        "kv_cache_bytes": row.kv_cache_bytes,
        "cross_kv_cache_bytes": row.cross_kv_cache_bytes,
        "peak_bytes": row.peak_bytes,
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
        "positions": model_positions(model),
        "dtype": model.dtype,
    }


def model_positions(model: Any) -> str:
    """The positions a checkpoint uses, as it describes them: those added to its embeddings
    (learned, sinusoidal, sinusoidal_halves), else its attention's (rope, alibi, relative)."""
    added = model.embeddings.positions
    return added if added != "none" else model.config.pos


def blocks_json(report: RunReport) -> dict[str, Any]:
    """``run --model --layer all``: each block's head statistics and weights under
    ``layers``; ``stages`` block 0's as planned (every block of one kind has its table);
    the one-block keys (``layer``, ``head_stats``, ``attention``) are null."""
    first, plan, estimate = report.trace, report.plan, report.estimate
    return _layer_run(
        {
            "model": model_dict(plan),
            "config": plan.config.to_dict(),
            "tokenizer": first.tokenizer,
            "vocab_size": first.vocab_size,
            "device": first.device,
            "tokens": [[t.to_dict() for t in row] for row in first.tokens],
            "stages": [s.to_dict() for s in plan.stages],  # block 0's, as planned
            "impl": first.impl,
            "attention_heads": first.attention_heads,
            "attention_rows": first.attention_rows,
            "context_tokens": _context_tokens(first),
            "layers": _blocks(report.traces, report.head_stats),
            "memory": memory_dict(estimate),
            "cuda": cuda_dict(plan),
        }
    )


def _context_tokens(trace: Any) -> list | None:
    if trace.context_tokens is None:
        return None
    return [[t.to_dict() for t in row] for row in trace.context_tokens]


def run_json(report: RunReport) -> dict[str, Any]:
    """``run``: one block's tokens, stages, head statistics and weights."""
    trace, plan, estimate = report.trace, report.plan, report.estimate
    return _layer_run(
        {
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
            "context_tokens": _context_tokens(trace),
            "memory": memory_dict(estimate),
            "cuda": cuda_dict(plan),
        }
    )


def shapes_json(plan: Plan) -> dict[str, Any]:
    return versioned(
        "shapes",
        LAYER,
        {
            "model": model_dict(plan),
            "config": plan.config.to_dict(),
            "seq_len": plan.seq_len,
            "batch": plan.batch,
            "sizes": plan.sizes,
            "stages": [s.to_dict() for s in plan.stages],
            "cuda": cuda_dict(plan),
        },
    )


def memory_json(command: MemoryCommandReport) -> dict[str, Any]:
    """``memory``: what every length shares, then one document per length under
    ``results`` (one length too), then what fits the budget (null without one)."""
    reports, fits = command.lengths, command.fits
    first = reports[0].plan
    return versioned(
        "memory",
        LAYER,
        {
            "model": model_dict(first),
            "config": first.config.to_dict(),
            "batch": first.batch,
            "layers": reports[0].estimate.layers,
            "seq_lens": [r.plan.seq_len for r in reports],
            "results": [_length_json(report) for report in reports],
            "budget_bytes": None if fits is None else command.budget_bytes,
            "max_seq_len": None
            if fits is None
            else {impl: found["max_seq_len"] for impl, found in fits.items()},
            "max_batch": None
            if fits is None
            else {impl: found["max_batch"] for impl, found in fits.items()},
            **parallel_fields(command.parallel),
        },
    )


def parallel_fields(report: ParallelReport | None) -> dict[str, Any]:
    """A split's keys (null without one, so every document has them): the layout, one
    entry per pipeline stage's device, what fits a budget on every device, and each rank
    measured on torch.distributed (``memory --measure``)."""
    if report is None:
        return dict.fromkeys(("layout", "per_device", "per_device_fit", "measured_per_rank"))
    layout, fit = report.layout, report.fit
    return {
        "layout": {
            "tp": layout.tp,
            "sp": layout.sp,
            "cp": layout.cp,
            "pp": layout.pp,
            "dp": layout.dp,
            "zero": layout.zero,
            "micro_batch": report.micro_batch,
            "recompute": layout.recompute,
            "devices": layout.ranks,
            "micro_batches": report.micro_batches,
            "kv_replicas": report.kv_replicas,
        },
        "per_device": [
            {
                "stage": row.stage,
                "kind": row.kind,
                "blocks": list(row.blocks),
                "weights_bytes": row.weights_bytes,
                "gradients_bytes": row.gradients_bytes,
                "optimizer_bytes": row.optimizer_bytes,
                "master_bytes": row.master_bytes,
                "gathered_bytes": row.gathered_bytes,
                "activations_bytes": row.activations_bytes,
                "kv_cache_bytes": row.kv_cache_bytes,
                "peak_bytes": row.peak_bytes,
                "peak_phase": row.peak_phase,
                "phase_peak_bytes": dict(zip(PHASE_KEYS, row.phase_peak_bytes, strict=True))
                if row.phase_peak_bytes
                else None,
                "micro_batches_in_flight": row.in_flight,
            }
            for row in report.stages
        ],
        "per_device_fit": None
        if fit is None
        else {
            "budget_bytes": fit.budget_bytes,
            "max_seq_len": fit.max_seq_len,
            "max_micro_batch": fit.max_micro_batch,
        },
        "measured_per_rank": None
        if report.measured_per_rank is None
        else [_measured_rank(entry) for entry in report.measured_per_rank],
    }


def _length_json(report: LengthReport) -> dict[str, Any]:
    """One length: every key whatever the options (--train, --measure, --generate fill
    theirs, else null)."""
    plan, estimate, measured = report.plan, report.estimate, report.measured
    measured_stages = measured.stage_peak_bytes if measured is not None else None
    stages = []
    for i, (stage, live) in enumerate(zip(plan.stages, estimate.live_bytes, strict=True)):
        entry = {**stage.to_dict(), "live_bytes": live, "scratch_bytes": stage.scratch}
        entry["measured_live_bytes"] = measured_stages[i] if measured_stages else None
        stages.append(entry)
    variants, training = report.variants, report.training
    return {
        "model": model_dict(plan),
        "config": plan.config.to_dict(),
        "seq_len": plan.seq_len,
        "batch": plan.batch,
        "layers": estimate.layers,
        **memory_dict(estimate),
        "kv_cache_tokens": report.kv_cache_tokens,
        "kv_cache_bytes": report.kv_cache_bytes,
        "kv_cache": cache_groups(report.kv_cache),
        "measured_kv_cache_bytes": report.measured_kv_cache_bytes,
        "by_dtype": {dtype: memory_dict(row[plan.config.impl]) for dtype, row in variants.items()},
        "by_impl": {impl: memory_dict(est) for impl, est in variants[plan.config.dtype].items()},
        "stages": stages,
        "training_bytes": None if training is None else training.peak_bytes,
        "training": None
        if training is None
        else {
            "parameters_bytes": training.parameter_bytes,
            "gradient_bytes": training.gradient_bytes,
            "master_bytes": training.master_bytes,
            "optimizer_bytes": training.optimizer_bytes,
            "saved_bytes": training.saved_bytes,
            "peak_bytes": training.peak_bytes,
            "peak_phase": training.peak_phase,
        },
        "measured_peak_bytes": None if measured is None else measured.peak_bytes,
        "measured_what": None
        if measured is None
        else ("training step" if training else "forward pass"),
        "measured_device": None if measured is None else measured.device,
        "measured_by": None if measured is None else measured.method,
        "measured_reserved_bytes": getattr(measured, "reserved_peak_bytes", None),
        "measured_context_bytes": getattr(measured, "context_bytes", None),
        "kv_cache_after_generate": None
        if report.generate is None
        else {
            "generate": report.generate,
            "tokens": plan.seq_len + report.generate,
            "bytes": report.generated_kv_cache_bytes,
            "kv_cache": cache_groups(report.generated_kv_cache or []),
            "measured_bytes": report.measured_generated_kv_cache_bytes,
        },
        "cuda": cuda_dict(plan),
    }


def check_json(result: CheckResult, plan: Plan) -> dict[str, Any]:
    return versioned(
        "check",
        LAYER,
        {
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
        },
    )


def _step_fields(step: Any) -> dict[str, Any]:
    """What every decoding step's entry starts with, decoder-only or encoder–decoder."""
    return {
        "step": step.step,
        "token": step.tokens,
        "text": step.texts,
        "position": step.position,
        "finished": step.finished,
    }


def generation_json(report: GenerationReport) -> dict[str, Any]:
    """``run --generate``: the run document's keys for the final sequence (prompt +
    generated), and the steps. ``attention`` (B, heads, rows, Lk) holds every row of the
    final sequence as its step computed it; with --layer all, ``layers`` holds each
    block's."""
    trace, plan = report.trace, report.plan
    return _layer_run(
        {
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
            "layers": _blocks(report.traces, report.head_stats) if report.every_block else None,
            "prompt_tokens": [[t.to_dict() for t in row] for row in report.prompt_tokens],
            "generated_ids": report.generated_ids,
            "generated_tokens": [[t.text for t in row] for row in report.generated_tokens],
            "generated_text": report.generated_texts,
            "stop": report.stop,
            "kv_cache_layer": report.cache_block,
            "steps": [
                {
                    **_step_fields(step),
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
            "kv_cache": cache_groups(report.kv_groups),
        }
    )


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
    fields = {
        "model": {
            "path": str(model.path),
            "model_type": model.model_type,
            "family": model.family,
            "encoder_layers": model.layers,
            "decoder_layers": model.decoder.layers,
            "hidden": model.hidden,
            "heads": model.heads,
            "vocab_size": model.vocab_size,
            "positions": model_positions(model),
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
                **_step_fields(step),
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
        # memory --src-len S --tgt-len T's figures for the run's source and target lengths
        "memory": None
        if report.memory is None
        else {
            "parameters": report.memory.encoder.parameters,  # every weight, as parameters_bytes
            **seq2seq_memory_dict(report.memory),
        },
        # the statistics of the blocks shown (see head_stats), one list per attention
        **{
            f"{kind}_head_stats": [s.to_dict() for s in report.shown_stats.get(kind, [])]
            for kind in ("encoder", "decoder", "cross")
        },
        # --layer all: "encoder", "decoder", "cross" -> one {layer, head_stats, attention}
        # per block; else null
        "layers": {
            kind: _blocks(traces, report.block_stats[kind])
            for kind, traces in report.block_traces.items()
        }
        if report.every_block
        else None,
    }
    return versioned("run", ENCODER_DECODER, fields)


def _measured_rank(entry: dict[str, Any]) -> dict[str, Any]:
    """One rank of ``memory --measure`` of a split; a training step's phases by name
    (null for a forward pass)."""
    keys = ("rank", "peak_bytes", "measured_peak_bytes", "collective_buffer_bytes")
    document = {key: entry[key] for key in keys}
    for key in ("phase_peak_bytes", "measured_phase_peak_bytes"):
        phases = entry.get(key)
        document[key] = dict(zip(PHASE_KEYS, phases, strict=True)) if phases else None
    return document
