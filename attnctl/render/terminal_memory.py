"""``shapes`` and ``memory``: stage shapes, one length in detail, a sweep, what fits."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from attnctl.config import DTYPE_BYTES, DTYPES
from attnctl.memory import format_bytes
from attnctl.plan import Plan
from attnctl.render.tables import header, size_grid, stage_table, titled_table
from attnctl.render.text import config_line, model_lines, shape_text, sizes_line
from attnctl.report import LengthReport, MemoryCommandReport
from attnctl.training import TrainingEstimate

if TYPE_CHECKING:  # measure.py and check.py import torch; render only reads their results
    from attnctl.measure import Measurement as Measured


# ---------------------------------------------------------------- shapes and memory


def shapes_view(plan: Plan, width: int) -> Group:
    config = plan.config
    return Group(
        header(
            "attnctl shapes",
            [
                *model_lines(plan),
                ("layer", config_line(config)),
                ("dtype", f"{config.dtype} · device {config.device}"),
                ("sizes", sizes_line(plan)),
            ],
        ),
        Text(""),
        stage_table(plan.stages, width, plan, show_device=False),
    )


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
                ("layer", config_line(config) + stack),
                ("dtype", config.dtype),
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
    plan, estimate, measured = report.plan, report.estimate, report.measured
    # a forward measurement has a peak per stage; a training step's is compared below
    per_stage = measured if measured is not None and report.training is None else None
    config, sizes = plan.config, plan.sizes
    element = DTYPE_BYTES[config.dtype]
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
        f"parameters + activations alive at once (at {estimate.peak_stage})",
    )
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
    training = report.training
    if measured is not None and training is None:
        summary.add_row(
            "measured peak",
            format_bytes(measured.peak_bytes),
            f"on {measured.device} by {measured.method}; estimate "
            f"{_percent(estimate.peak_bytes, measured.peak_bytes)} vs measured",
        )
    if report.measured_kv_cache_bytes is not None:
        summary.add_row(
            "measured KV cache",
            format_bytes(report.measured_kv_cache_bytes),
            f"the K and V heads every block kept in a real run; estimate "
            f"{_percent(report.kv_cache_bytes, report.measured_kv_cache_bytes)} vs measured",
        )

    variants = titled_table("by dtype and implementation")
    columns = ("dtype", "parameters", "attention matrix", "peak (math)", "peak (sdpa)")
    for name in columns:
        variants.add_column(name, justify="left" if name == "dtype" else "right", no_wrap=True)
    table = report.variants
    for dtype in DTYPES:
        on_math, sdpa = table[dtype]["math"], table[dtype].get("sdpa")
        variants.add_row(
            dtype,
            format_bytes(on_math.parameter_bytes),
            format_bytes(on_math.attention_matrix_bytes),
            format_bytes(on_math.peak_bytes),
            format_bytes(sdpa.peak_bytes) if sdpa else "n/a",
        )
    parts: list[RenderableType] = [params, stages, summary]
    if training is not None:
        parts += [Text(""), _training_grid(training, measured)]
    return [*parts, Text(""), variants]


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
    headings = ["L", "parameters", "attention matrices", "peak", "KV cache"]
    for name in headings + (["training"] if train else []):
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
    if longest and any(found["max_seq_len"] == longest for found in fits.values()):
        table.caption = f"L stops at the {longest:,} learned positions"
        table.caption_justify = "left"
    return table


def _percent(estimated: int, measured: int) -> str:
    return f"{(estimated - measured) / measured * 100:+.2f}%" if measured else "n/a"


def _built(nbytes: int) -> str:
    return "B·H·L·L" if nbytes else "never built (--impl sdpa keeps O(B·H·L) extra)"
