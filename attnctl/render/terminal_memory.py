"""``shapes`` and ``memory``: stage shapes, one length in detail, a sweep, what fits."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from attnctl.memory.estimate import MemoryEstimate, format_bytes
from attnctl.model.config import DTYPE_BYTES, DTYPES
from attnctl.render.tables import header, size_grid, stage_table, titled_table
from attnctl.render.terminal_cuda import device_lines_view, seq2seq_cuda_rows
from attnctl.render.text import config_line, cuda_rows, model_lines, shape_text, sizes_line
from attnctl.report.commands import (
    LengthReport,
    MemoryCommandReport,
    Seq2SeqDtypeRow,
    Seq2SeqMeasured,
    Seq2SeqMemoryReport,
    Seq2SeqShapes,
)
from attnctl.stages.plan import Plan

if TYPE_CHECKING:  # measure.py and check.py import torch; render only reads their results
    from attnctl.memory.measurement import Measurement as Measured
    from attnctl.replay.step import TrainingEstimate


# ---------------------------------------------------------------- shapes and memory


def shapes_view(plan: Plan, width: int) -> Group:
    config = plan.config
    return Group(
        header(
            "attnctl shapes",
            [
                *model_lines(plan),
                ("layer", config_line(config, plan)),
                ("dtype", f"{config.dtype} · device {config.device}"),
                *cuda_rows(plan),
                ("sizes", sizes_line(plan)),
            ],
        ),
        Text(""),
        stage_table(plan.stages, width, plan, show_device=False),
        *device_lines_view(plan),
    )


def seq2seq_dims_lines(encoder: Plan, decoder: Plan) -> list[tuple[str, str]]:
    """What L and Lc are in an encoder–decoder's two stage tables."""
    source, target = encoder.seq_len, decoder.seq_len
    return [
        ("encoder", f"block {encoder.layer_index} · L = the source, {source} tokens"),
        (
            "decoder",
            f"block {decoder.layer_index} · L = the target, {target} tokens · Lc = the "
            f"source, {source} tokens (the encoder output, cross-attention's K and V)",
        ),
    ]


def seq2seq_shapes_view(shapes: Seq2SeqShapes, width: int) -> Group:
    """``shapes`` of an encoder–decoder: its encoder block's stages, then its decoder's."""
    encoder, decoder = shapes.encoder, shapes.decoder
    config = encoder.config
    return Group(
        header(
            "attnctl shapes",
            [
                *model_lines(encoder),
                ("layer", config_line(config, encoder)),
                ("dtype", f"{config.dtype} · device {config.device}"),
                *seq2seq_cuda_rows(encoder, decoder),
                *seq2seq_dims_lines(encoder, decoder),
            ],
        ),
        Text(""),
        Text(f"encoder block {encoder.layer_index}   {sizes_line(encoder)}", style="bold"),
        stage_table(encoder.stages, width, encoder, show_device=False),
        Text(""),
        Text(f"decoder block {decoder.layer_index}   {sizes_line(decoder)}", style="bold"),
        stage_table(decoder.stages, width, decoder, show_device=False),
    )


def seq2seq_memory_view(report: Seq2SeqMemoryReport, width: int) -> Group:
    """``memory`` of an encoder–decoder: weights, each block's peak, both caches, per dtype."""
    encoder, decoder, row = report.encoder_plan, report.decoder_plan, report.row
    config = encoder.config
    measured = report.measured
    parts: list[RenderableType] = [
        header(
            "attnctl memory",
            [
                *model_lines(encoder),
                ("layer", config_line(config, encoder)),
                ("dtype", config.dtype),
                *seq2seq_cuda_rows(encoder, decoder),
                *seq2seq_dims_lines(encoder, decoder),
            ],
        ),
        Text(""),
        _seq2seq_grid(report),
    ]
    if measured is not None:
        parts += [Text(""), _seq2seq_measured(row, measured)]
    for plan, estimate, title, stage_peaks in (
        (encoder, row.encoder, "encoder block", measured.encoder if measured else None),
        (decoder, row.decoder, "decoder block", measured.decoder if measured else None),
    ):
        parts += [Text(""), _seq2seq_stage_table(plan, estimate, title, stage_peaks)]
        parts += device_lines_view(plan)
    parts += [Text(""), _seq2seq_variants(report, config.impl)]
    return Group(*parts)


def _seq2seq_grid(report: Seq2SeqMemoryReport) -> Table:
    """The weights, each block's peak, both caches and the peak, with how each is made."""
    encoder, row = report.encoder_plan, report.row
    element = DTYPE_BYTES[encoder.config.dtype]
    b = encoder.batch
    grid = size_grid()
    grid.add_row(
        "weights",
        format_bytes(row.parameter_bytes),
        f"{encoder.parameter_count:,} stored values (encoder, decoder, embeddings, head)",
    )
    grid.add_row(
        "encoder activations",
        format_bytes(row.encoder.peak_activation_bytes),
        f"the peak of one encoder block over S = {report.src_len} (at {row.encoder.peak_stage})",
    )
    grid.add_row(
        "decoder activations",
        format_bytes(row.decoder.peak_activation_bytes),
        f"the peak of one decoder block over T = {report.tgt_len}, cross-attention over "
        f"S = {report.src_len} (at {row.decoder.peak_stage})",
    )
    made_once = "made once from the encoder output, S"
    for name, groups, n, what in (
        ("KV cache", report.kv_cache, report.tgt_len, "self-attention K and V, T"),
        ("cross K/V", report.cross_kv_cache, report.src_len, made_once),
    ):
        total = sum(g.bytes for g in groups)
        shapes = " + ".join(
            f"2·{b}·{g.tokens}·{g.kv_heads}·{g.head_dim}·{element} bytes·{g.layers} blocks"
            for g in groups
        )
        grid.add_row(name, format_bytes(total), f"{what} = {n} positions per block: {shapes}")
    grid.add_row(
        "peak",
        format_bytes(row.peak_bytes),
        "weights + the larger of the encoder's peak and the decoder's with both caches",
    )
    return grid


def _seq2seq_measured(row: Seq2SeqDtypeRow, measured: Seq2SeqMeasured) -> Table:
    """--measure: each part as measured, and the estimate's difference from it."""
    compared = size_grid(f"measured on {measured.encoder.device} by {measured.encoder.method}")
    for name, estimated, got in (
        ("weights", row.parameter_bytes, measured.encoder.parameter_bytes),
        ("encoder activations", row.encoder.peak_activation_bytes,
         measured.encoder.peak_activation_bytes),
        ("decoder activations", row.decoder.peak_activation_bytes,
         measured.decoder.peak_activation_bytes),
        ("KV cache", row.kv_cache_bytes, measured.kv_cache_bytes),
        ("cross K/V", row.cross_kv_cache_bytes, measured.cross_kv_cache_bytes),
    ):  # fmt: skip
        compared.add_row(
            name, format_bytes(got), f"estimate {_percent(estimated, got)} vs measured"
        )
    return compared


def _seq2seq_stage_table(
    plan: Plan, estimate: MemoryEstimate, title: str, stage_peaks: Measured | None
) -> Table:
    """One block's activations, stage by stage (with --measure: each stage's measured peak)."""
    table = titled_table(f"{title} {plan.layer_index} activations   {sizes_line(plan)}")
    headings = ["#", "stage", "shape", "bytes", "alive during"]
    headings += ["measured", "diff"] if stage_peaks is not None else []
    for name in headings:
        table.add_column(name, justify="left" if name == "stage" else "right", no_wrap=True)
    table.add_column("", no_wrap=True)
    for i, stage in enumerate(plan.stages):
        size = f"view of {stage.view_of}" if stage.view_of else format_bytes(stage.bytes)
        alive = estimate.live_bytes[i]
        cells = [str(i), stage.name, shape_text(stage.shape), size, format_bytes(alive)]
        if stage_peaks is not None:
            got = stage_peaks.stage_peak_bytes[i]
            cells += [format_bytes(got), _percent(alive, got)]
        table.add_row(*cells, "◀ peak" if stage.name == estimate.peak_stage else "")
    return table


def _seq2seq_variants(report: Seq2SeqMemoryReport, configured: str) -> Table:
    """Weights, peaks and caches by dtype (the ``configured`` implementation's figures, or
    the first's where it has none), and the peak by implementation."""
    variants = titled_table("by dtype and implementation")
    impls = list(next(iter(report.variants.values())))
    columns = ["dtype", "weights", "encoder", "decoder", "KV cache", "cross K/V"]
    columns += [f"peak ({impl})" for impl in impls]
    for name in columns:
        variants.add_column(name, justify="left" if name == "dtype" else "right", no_wrap=True)
    for dtype in DTYPES:
        rows: dict[str, Seq2SeqDtypeRow] = report.variants[dtype]
        shown = rows.get(configured) or next(iter(rows.values()))
        variants.add_row(
            dtype,
            format_bytes(shown.parameter_bytes),
            format_bytes(shown.encoder.peak_activation_bytes),
            format_bytes(shown.decoder.peak_activation_bytes),
            format_bytes(shown.kv_cache_bytes),
            format_bytes(shown.cross_kv_cache_bytes),
            *(format_bytes(rows[impl].peak_bytes) for impl in impls),
        )
    return variants


def memory_view(command: MemoryCommandReport, width: int) -> Group:
    """One length in detail, or several side by side with a bar chart; then what fits."""
    reports, fits, budget = command.lengths, command.fits, command.budget_bytes
    first = reports[0]
    config = first.plan.config
    stack = f" · {first.estimate.layers} layers" if first.estimate.layers > 1 else ""
    lengths = ", ".join(str(r.plan.seq_len) for r in reports)
    parts: list[RenderableType] = [
        header(
            "attnctl memory",
            [
                *model_lines(first.plan),
                ("layer", config_line(config, first.plan) + stack),
                ("dtype", config.dtype),
                *cuda_rows(first.plan),
                ("sizes", sizes_line(first.plan) if len(reports) == 1 else f"L = {lengths}"),
            ],
        ),
        Text(""),
    ]
    if len(reports) == 1:
        parts += _one_length(first)
    else:
        parts += _sweep(reports, width)
    if fits is not None and budget is not None:
        parts += [Text(""), _fit_table(fits, budget, first, command.longest_input)]
    return Group(*parts)


def _one_length(report: LengthReport) -> list[RenderableType]:
    """One length in detail: its parameters, its activations stage by stage, the summary,
    the training step (--train) and the figures by dtype and implementation."""
    plan, estimate, measured = report.plan, report.estimate, report.measured
    # a forward measurement has a peak per stage; a training step's is compared below
    per_stage = measured if measured is not None and report.training is None else None
    params = _parameters_table(plan, estimate)
    stages = _stages_table(plan, estimate, per_stage)
    summary = _summary_grid(report)
    variants = _length_variants(report.variants)
    training = report.training
    parts: list[RenderableType] = [params, stages, *device_lines_view(plan), summary]
    if training is not None:
        parts += [Text(""), _training_grid(training, measured)]
    return [*parts, Text(""), variants]


def _parameters_table(plan: Plan, estimate: MemoryEstimate) -> Table:
    """Each parameter's shape, count and bytes, and their total."""
    element = DTYPE_BYTES[plan.config.dtype]
    params = titled_table("parameters")
    for name, justify in (("name", "left"), ("shape", "left"), ("count", "right")):
        params.add_column(name, justify=justify, no_wrap=True)
    params.add_column("bytes", justify="right", no_wrap=True)
    for p in plan.parameters:
        shape = shape_text(p.shape) + (f" × {p.copies}" if p.copies > 1 else "")
        params.add_row(p.name, shape, f"{p.count:,}", format_bytes(p.count * element))
    if estimate.layers > 1:
        params.add_row(f"× {estimate.layers} layers", "embedding shared", "", "")
    params.add_row("total", "", f"{estimate.parameters:,}", format_bytes(estimate.parameter_bytes))
    return params


def _stages_table(plan: Plan, estimate: MemoryEstimate, per_stage: Measured | None) -> Table:
    """The activations stage by stage: shapes and bytes, or (a forward pass measured) the
    estimate beside each stage's measured peak."""
    when = " (one layer at a time)" if estimate.layers > 1 else ""
    if plan.model is not None:
        when = " (the embeddings, then one block at a time: each block's are alike)"
    stages = titled_table("activations" + when)
    # with a measurement, compare it with the estimate instead of repeating shapes
    headings = ["#", "stage"]
    headings += ["shape", "bytes", "alive during"] if per_stage is None else ["estimated"]
    headings += ["measured", "diff"] if per_stage is not None else []
    for name in headings:
        stages.add_column(name, justify="left" if name == "stage" else "right", no_wrap=True)
    stages.add_column("", no_wrap=True)  # "◀ peak" beside its stage, the numbers aligned
    for i, stage in enumerate(plan.stages):
        alive = format_bytes(estimate.live_bytes[i])
        if per_stage is None:
            size = f"view of {stage.view_of}" if stage.view_of else format_bytes(stage.bytes)
            row = [str(i), stage.name, shape_text(stage.shape), size, alive]
        else:
            got = per_stage.stage_peak_bytes[i]
            row = [str(i), stage.name, alive, format_bytes(got)]
            row.append(_percent(estimate.live_bytes[i], got))
        stages.add_row(*row, "◀ peak" if stage.name == estimate.peak_stage else "")
    return stages


def _summary_grid(report: LengthReport) -> Table:
    """The attention matrix, the activations, the peak and the KV cache, with how each is
    figured, and what was measured beside them."""
    plan, estimate = report.plan, report.estimate
    sizes, element = plan.sizes, DTYPE_BYTES[plan.config.dtype]
    summary = size_grid()
    b, h, length = sizes["B"], sizes["H"], sizes["L"]
    keys, key_dim = (sizes["Lc"], "Lc") if "Lc" in sizes else (length, "L")
    summary.add_row(
        "one attention matrix",
        format_bytes(estimate.attention_matrix_bytes),
        f"B·H·L·{key_dim}·{element} = {b}·{h}·{length}·{keys}·{element} bytes",
    )
    summary.add_row("scores", format_bytes(estimate.scores_bytes), _built(estimate.scores_bytes))
    summary.add_row("weights", format_bytes(estimate.weights_bytes), _built(estimate.weights_bytes))
    summary.add_row(
        "activations", format_bytes(estimate.activation_bytes), "every allocating stage, summed"
    )
    summary.add_row(
        "peak",
        format_bytes(estimate.peak_bytes),
        f"parameters + activations{' + the GPU lines' if plan.device_lines else ''} alive "
        f"at once (at {estimate.peak_stage})",
    )
    _kv_cache_rows(summary, report)
    if report.generated_kv_cache is not None:
        _generated_cache_rows(summary, report)
    _measured_rows(summary, report)
    return summary


def _kv_cache_rows(summary: Table, report: LengthReport) -> None:
    """The KV cache of N tokens: one row where every block is alike, else one for each
    kind of block (sliding blocks keep min(N, W) positions)."""
    sizes, element = report.plan.sizes, DTYPE_BYTES[report.plan.config.dtype]
    b, h = sizes["B"], sizes["H"]
    kv_name = "Hkv" if sizes["Hkv"] != h else "H"
    n = report.kv_cache_tokens
    if len(report.kv_cache) == 1 and not report.kv_cache[0].window:  # every block alike
        group = report.kv_cache[0]
        stack = f"·{group.layers} layers" if group.layers > 1 else ""
        summary.add_row(
            "KV cache",
            format_bytes(report.kv_cache_bytes),
            f"K and V for N = {n} tokens: 2·B·N·{kv_name}·d_k·{element}{stack} = "
            f"2·{b}·{n}·{group.kv_heads}·{group.head_dim}·{element} bytes{stack}",
        )
    else:  # sliding blocks keep min(N, W) positions
        summary.add_row(
            "KV cache",
            format_bytes(report.kv_cache_bytes),
            f"K and V for N = {n} tokens, summed over the kinds of block below",
        )
        for group in report.kv_cache:
            kind = f"window {group.window}" if group.window else "full attention"
            kept = f"min(N, {group.window})" if group.window else "N"
            summary.add_row(
                f"  {kind}",
                format_bytes(group.bytes),
                f"{group.layers} layers · {kept} = {group.tokens} positions: "
                f"2·{b}·{group.tokens}·{group.kv_heads}·{group.head_dim}·{element} "
                f"bytes·{group.layers}",
            )


def _generated_cache_rows(summary: Table, report: LengthReport) -> None:
    """memory --generate N: the cache after N more tokens, by kind of block, and (with
    --measure) as really generating them kept it."""
    plan = report.plan
    tokens = plan.seq_len + (report.generate or 0)
    kinds = " · ".join(
        f"{g.layers} blocks "
        + (f"window {g.window}: {g.tokens} positions" if g.window else f"{g.tokens} positions")
        for g in report.generated_kv_cache
    )
    summary.add_row(
        f"KV cache after {report.generate} more",
        format_bytes(report.generated_kv_cache_bytes or 0),
        f"the prompt's {plan.seq_len} + {report.generate} generated = {tokens} tokens: {kinds}",
    )
    if report.measured_generated_kv_cache_bytes is not None:
        got = report.measured_generated_kv_cache_bytes
        summary.add_row(
            "  measured",
            format_bytes(got),
            f"the K and V every block kept after generating {report.generate} tokens; "
            f"estimate {_percent(report.generated_kv_cache_bytes or 0, got)} vs measured",
        )


def _measured_rows(summary: Table, report: LengthReport) -> None:
    """--measure: a forward pass's measured peak (a training step's is in its own grid)
    and the K and V a real run kept, each beside the estimate."""
    measured, estimate = report.measured, report.estimate
    if measured is not None and report.training is None:
        summary.add_row(
            "measured peak",
            format_bytes(measured.peak_bytes),
            f"on {measured.device} by {measured.method}; estimate "
            f"{_percent(estimate.peak_bytes, measured.peak_bytes)} vs measured",
        )
    if measured is not None and measured.reserved_peak_bytes is not None:
        summary.add_row(
            "reserved peak",
            format_bytes(measured.reserved_peak_bytes),
            "torch.cuda.max_memory_reserved: what the caching allocator held from the GPU "
            "(the allocated peak counts only the blocks in use)",
        )
    if measured is not None and measured.context_bytes is not None:
        summary.add_row(
            "CUDA context",
            format_bytes(measured.context_bytes),
            "held outside torch's allocator: the free bytes before the first CUDA call "
            "less those after, less the reserved",
        )
    if report.measured_kv_cache_bytes is not None:
        summary.add_row(
            "measured KV cache",
            format_bytes(report.measured_kv_cache_bytes),
            f"the K and V heads every block kept in a real run; estimate "
            f"{_percent(report.kv_cache_bytes, report.measured_kv_cache_bytes)} vs measured",
        )


def _length_variants(table: dict[str, dict[str, MemoryEstimate]]) -> Table:
    """Parameters, the attention matrix and the peak (math, sdpa) by dtype."""
    variants = titled_table("by dtype and implementation")
    columns = ("dtype", "parameters", "attention matrix", "peak (math)", "peak (sdpa)")
    for name in columns:
        variants.add_column(name, justify="left" if name == "dtype" else "right", no_wrap=True)
    for dtype in DTYPES:
        on_math, sdpa = table[dtype]["math"], table[dtype].get("sdpa")
        variants.add_row(
            dtype,
            format_bytes(on_math.parameter_bytes),
            format_bytes(on_math.attention_matrix_bytes),
            format_bytes(on_math.peak_bytes),
            format_bytes(sdpa.peak_bytes) if sdpa else "n/a",
        )
    return variants


def _training_grid(training: TrainingEstimate, measured: Measured | None) -> Table:
    grid = size_grid("training step (forward, loss.backward(), Adam.step())")
    grid.add_row("parameters", format_bytes(training.parameter_bytes), "the model's dtype")
    grid.add_row("gradients", format_bytes(training.gradient_bytes), "one per parameter")
    if training.master_bytes:
        grid.add_row(
            "master weights", format_bytes(training.master_bytes), "float32 (mixed precision)"
        )
    grid.add_row(
        "Adam moments", format_bytes(training.optimizer_bytes), "two float32 per parameter"
    )
    grid.add_row(
        "saved for backward",
        format_bytes(training.saved_bytes),
        "what the forward leaves for the backward",
    )
    grid.add_row(
        "training peak",
        format_bytes(training.peak_bytes),
        f"everything alive at once, during the {training.peak_phase}",
    )
    if measured is not None:
        grid.add_row(
            "measured peak",
            format_bytes(measured.peak_bytes),
            f"on {measured.device} by {measured.method}; estimate "
            f"{_percent(training.peak_bytes, measured.peak_bytes)} vs measured",
        )
    return grid


BAR_PARTS = (  # what a stacked bar is made of: (name, character, colour)
    ("parameters", "█", "cyan"),
    ("attention matrices", "▓", "red"),
    ("other activations", "▒", "yellow"),
    ("KV cache", "░", "green"),
)


def _sweep(reports: list[LengthReport], width: int) -> list[RenderableType]:
    table = titled_table("by sequence length")
    train = reports[0].training is not None
    generate = reports[0].generate
    measured_generate = reports[0].measured_generated_kv_cache_bytes is not None
    headings = ["L", "parameters", "attention matrices", "peak", "KV cache"]
    headings += ["training"] if train else []
    headings += [f"KV cache after {generate} more"] if generate is not None else []
    headings += ["measured"] if measured_generate else []
    for name in headings:
        table.add_column(name, justify="right", no_wrap=True)
    for report in reports:
        params, _, _, cache = report.bar_parts
        row = [
            str(report.plan.seq_len),
            format_bytes(params),
            format_bytes(report.estimate.scores_bytes + report.estimate.weights_bytes),
            format_bytes(report.estimate.peak_bytes),
            format_bytes(cache),
        ]
        if train:
            row.append(format_bytes(report.training.peak_bytes))
        if generate is not None:
            row.append(format_bytes(report.generated_kv_cache_bytes or 0))
        if measured_generate:
            row.append(format_bytes(report.measured_generated_kv_cache_bytes or 0))
        table.add_row(*row)
    totals = [sum(r.bar_parts) for r in reports]
    label_width = max(len(str(r.plan.seq_len)) for r in reports) + 2
    total_width = len(" 1023.99 MiB")
    bar_width = width - (label_width + 2) - total_width - 1
    # too narrow for label, bar and total on one line: the bar goes under its label
    beneath = bar_width < 10
    if beneath:
        bar_width = max(len(BAR_PARTS), width - 2)  # every part keeps at least one mark
    chart = Text()
    for report, total in zip(reports, totals, strict=True):
        label = f"L={report.plan.seq_len}"
        chart.append(
            f"{label} {format_bytes(total)}\n  " if beneath else label.ljust(label_width + 2)
        )
        for (_, char, colour), part in zip(BAR_PARTS, report.bar_parts, strict=True):
            # a part is at least one mark: room for those kept aside, so no bar is too long
            cells = max(1, int((bar_width - len(BAR_PARTS)) * part / max(totals)))
            chart.append(char * (cells if part else 0), style=colour)
        chart.append("\n" if beneath else f" {format_bytes(total)}\n")
    items = [f"{char} {name}" for name, char, _ in BAR_PARTS]
    legend = "  ".join(items)
    if len(legend) > width:  # one item a line, so no mark is parted from its name
        legend = "\n".join(items)
    return [
        table,
        Text(
            "peak + KV cache, to the scale of the largest (a part is at least one mark)",
            style="bold",
        ),
        chart,
        Text(legend, style="dim"),
    ]


def _fit_table(
    fits: dict[str, dict[str, int]], budget: int, first: LengthReport, longest: int | None
) -> Table:
    what = "a training step" if first.training is not None else "one forward pass"
    table = titled_table(f"{what} fits in {format_bytes(budget)}")
    plan = first.plan
    table.add_column("impl", no_wrap=True)
    table.add_column(f"longest L at B={plan.batch}", justify="right", no_wrap=True)
    table.add_column(f"largest B at L={plan.seq_len}", justify="right", no_wrap=True)
    for impl, found in fits.items():
        table.add_row(impl, f"{found['max_seq_len']:,}", f"{found['max_batch']:,}")
    captions = []
    if longest and any(found["max_seq_len"] == longest for found in fits.values()):
        captions.append(f"L stops at the {longest:,} learned positions")
    if plan.cuda is not None:
        from attnctl.model.gpu import budget_text

        captions.append(f"on {plan.cuda.gpu.label}: {budget_text()}")
    if captions:
        table.caption = "\n".join(captions)
        table.caption_justify = "left"
    return table


def _percent(estimated: int, measured: int) -> str:
    return f"{(estimated - measured) / measured * 100:+.2f}%" if measured else "n/a"


def _built(nbytes: int) -> str:
    return "B·H·L·L" if nbytes else "never built (--impl sdpa keeps O(B·H·L) extra)"
