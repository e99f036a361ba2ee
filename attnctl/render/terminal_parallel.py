"""``memory`` of a split: a table per device kind (first, middle, last pipeline stage),
what fits a budget, and (when a report carries it) measured beside estimated per rank.

Every number stays whole: the tables are :class:`FittingTable` grids, whose
explanations wrap and whose rows stack on a terminal too narrow for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from attnctl.memory.estimate import format_bytes
from attnctl.render.tables import header, size_grid, titled_table
from attnctl.render.text import config_line, model_lines

if TYPE_CHECKING:  # the report's types; render only reads them
    from attnctl.parallel.split_report import ParallelReport, StageMemory
    from attnctl.report.commands import MemoryCommandReport

KINDS = ("all", "first", "middle", "last")


def parallel_view(command: MemoryCommandReport, width: int) -> Group:
    report = command.parallel
    assert report is not None
    whole = command.lengths[0]
    plan = whole.plan
    layout = report.layout
    step = (
        f"a training step, {report.micro_batches} micro-batch"
        + ("es" if report.micro_batches > 1 else "")
        + f" of {report.micro_batch}"
        if report.train
        else f"inference, micro-batch {report.micro_batch}"
    )
    single = whole.training.peak_bytes if whole.training is not None else whole.estimate.peak_bytes
    if not report.train:
        single += whole.kv_cache_bytes
    rows = [
        *model_lines(plan),
        ("layer", config_line(plan.config, plan)),
        ("split", f"{layout.summary()} = {layout.ranks:,} device{'s' * (layout.ranks != 1)}"),
        (
            "sizes",
            f"L = {report.seq_len}, B = {report.batch} per copy, {report.blocks} block"
            + ("s" if report.blocks > 1 else ""),
        ),
        ("step", step),
        ("dtype", report.dtype),
        ("one device", f"{format_bytes(single)} peak for the whole model (no split)"),
    ]
    parts: list[RenderableType] = [header("attnctl memory per device", rows), Text("")]
    for row, title in shown_stages(report):
        parts += [_stage_grid(report, row, title), Text("")]
    for note in report.notes:
        parts.append(Text(f"· {note}", style="dim"))
    if report.fit is not None:
        parts += [Text(""), _fit_table(report)]
    if report.measured_per_rank is not None:
        parts += [Text(""), _measured_table(report.measured_per_rank, report)]
    return Group(*parts)


def shown_stages(report: ParallelReport) -> list[tuple[StageMemory, str]]:
    """One stage per kind: the first, the busiest middle one (named), the last."""
    shown = []
    for kind in KINDS:
        rows = [row for row in report.stages if row.kind == kind]
        if not rows:
            continue
        row = max(rows, key=lambda r: r.peak_bytes)
        blocks = f"blocks {row.blocks[0]}–{row.blocks[1]}"
        if row.blocks[0] == row.blocks[1]:
            blocks = f"block {row.blocks[0]}"
        if kind == "all":
            title = f"every device ({blocks})"
        elif kind == "middle" and len(rows) > 1:
            stages = f"{rows[0].stage}–{rows[-1].stage}"
            title = f"middle stages {stages}: the busiest, stage {row.stage} ({blocks})"
        else:
            title = f"{kind} stage, stage {row.stage} ({blocks})"
        shown.append((row, title))
    return shown


def _stage_grid(report: ParallelReport, row: StageMemory, title: str) -> Table:
    layout = report.layout
    grid = size_grid(title)
    grid.add_row("weights", format_bytes(row.weights_bytes), _weights_why(report, row))
    if report.train:
        zero = layout.zero
        grid.add_row(
            "gradients",
            format_bytes(row.gradients_bytes),
            f"{report.dtype}" + (f", a 1/{layout.dp * layout.cp} shard" if zero >= 2 else ""),
        )
        masters = (
            f", {format_bytes(row.master_bytes)} of it float32 masters" if row.master_bytes else ""
        )
        grid.add_row(
            "optimizer",
            format_bytes(row.optimizer_bytes),
            "Adam's two float32 moments" + masters + (", a shard" if zero else ""),
        )
        if row.gathered_bytes:
            grid.add_row(
                "gathered",
                format_bytes(row.gathered_bytes),
                "ZeRO 3: the largest unit's (a block's, or the embeddings')",
            )
        grid.add_row(
            "activations",
            format_bytes(row.activations_bytes),
            f"saved for the backward, {row.in_flight} micro-batch"
            + ("es" if row.in_flight > 1 else "")
            + " in flight"
            + ("" if layout.recompute == "none" else f", {layout.recompute} recompute"),
        )
    else:
        grid.add_row(
            "activations",
            format_bytes(row.activations_bytes),
            "the busiest block's peak, one micro-batch",
        )
        grid.add_row(
            "KV cache",
            format_bytes(row.kv_cache_bytes),
            f"{report.kv_cache_tokens:,} tokens"
            + (f" over {layout.cp} CP ranks" if layout.cp > 1 else "")
            + ", this rank's kv-heads"
            + (
                f"; a sliding-window block keeps the last {_or(report.windows)}"
                if report.windows
                else ""
            ),
        )
    if row.phase_peak_bytes:
        forward, backward, step = (format_bytes(n) for n in row.phase_peak_bytes)
        why = (
            f"the {row.peak_phase}'s busiest point (forward {forward}, backward {backward}, "
            f"optimizer step {step})"
        )
    else:
        why = "all of the above at once"
    grid.add_row("peak", format_bytes(row.peak_bytes), why, style="bold")
    return grid


def _weights_why(report: ParallelReport, row: StageMemory) -> str:
    layout = report.layout
    parts = []
    if layout.tp > 1:
        parts.append(f"heads and columns / {layout.tp}")
        if row.vocab_rows:
            parts[-1] += f", vocab rows / {layout.tp}"
    if layout.pp > 1:
        parts.append("the stage's blocks")
    if layout.zero == 3:
        parts.append(f"a 1/{layout.dp * layout.cp} shard")
    return ", ".join(parts) or report.dtype


def _fit_table(report: ParallelReport) -> RenderableType:
    """Two labelled rows (a label per answer, so a narrow terminal wraps the labels and
    keeps each number beside its own), under a title as wide as the terminal (a table's
    own would wrap at the table's width)."""
    fit = report.fit
    assert fit is not None
    what = "a training step" if report.train else "inference"
    budget = format_bytes(fit.budget_bytes)
    if fit.max_seq_len == 0 and fit.max_micro_batch == 0:
        title = f"{what} does not fit in {budget} on every device, even at L=1 and micro-batch 1"
    else:
        title = f"{what} fits in {budget} on every device"
    table = titled_table("")
    table.add_column("", ratio=1)
    table.add_column("", justify="right", no_wrap=True)
    table.show_header = False
    table.add_row(f"longest L at micro-batch {report.micro_batch}", f"{fit.max_seq_len:,}")
    table.add_row(f"largest micro-batch at L={report.seq_len}", f"{fit.max_micro_batch:,}")
    return Group(Text(title, style="italic"), table)


def _measured_table(measured: list[dict[str, Any]], report: ParallelReport) -> Table:
    """One row a rank; with both --tp and --cp its place too (rank = CP rank · T + TP rank);
    of a training step, each phase's measured peak too."""
    layout = report.layout
    table = titled_table("measured on torch.distributed, per rank")
    table.add_column("rank", justify="right", no_wrap=True)
    both = layout.tp > 1 and layout.cp > 1
    if both:
        table.add_column("place", no_wrap=True)
    table.add_column("estimated peak", justify="right", no_wrap=True)
    table.add_column("measured peak", justify="right", no_wrap=True)
    table.add_column("difference", justify="right", no_wrap=True)
    table.add_column("in collectives", justify="right", no_wrap=True)
    for entry in measured:
        estimated, got = entry["peak_bytes"], entry["measured_peak_bytes"]
        place = [f"CP {entry['rank'] // layout.tp} · TP {entry['rank'] % layout.tp}"] * both
        table.add_row(
            str(entry["rank"]),
            *place,
            format_bytes(estimated),
            format_bytes(got),
            f"{estimated - got:+,} B",
            "≤ " + format_bytes(entry["collective_buffer_bytes"]),
        )
    table.caption_justify = "left"
    unseen = (
        "what the backend allocates inside a collective is not seen by the measurement, "
        "and at most the last column"
    )
    if not report.train:
        table.caption = (
            "a forward pass of block 0 with the embeddings, one micro-batch: the rank's "
            f"weights and activations (no KV cache); {unseen}"
        )
        return table
    phases = [
        ", ".join(
            f"{phase} {format_bytes(b)}"
            for phase, b in zip(PHASE_NAMES, entry["measured_phase_peak_bytes"], strict=True)
        )
        for entry in measured
    ]
    if len(set(phases)) == 1:
        measured_phases = f"every rank: {phases[0]}"
    else:
        measured_phases = "; ".join(f"rank {n}: {p}" for n, p in enumerate(phases))
    blocks = f"{report.blocks} block" + "s" * (report.blocks != 1)
    table.caption = (
        f"a training step of {blocks}, one micro-batch (forward, loss.backward(), Adam), "
        "its collectives' gradients on torch.distributed too: the rank's weights, "
        f"gradients, Adam's state and activations at the busiest phase; {unseen}. "
        f"Measured, {measured_phases}"
    )
    return table


PHASE_NAMES = ("forward", "backward", "optimizer step")


def _or(numbers: tuple[int, ...]) -> str:
    """(4096,) -> '4,096'; (512, 4096) -> '512 or 4,096'."""
    texts = [f"{n:,}" for n in numbers]
    return texts[0] if len(texts) == 1 else ", ".join(texts[:-1]) + " or " + texts[-1]
