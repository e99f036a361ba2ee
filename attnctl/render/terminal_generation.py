"""``run --generate``: the prompt, one row per step with its KV cache, the final weights."""

from __future__ import annotations

from rich.cells import cell_len
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from attnctl.memory.estimate import format_bytes
from attnctl.render.tables import header, size_grid, stage_table, titled_table
from attnctl.render.terminal_heads import heads_map
from attnctl.render.terminal_heatmap import (
    block_tiles,
    legend,
    matrix_panels,
    panel_lines,
    trace_heatmaps,
    trace_key_counts,
)
from attnctl.render.terminal_run import _shade, token_table, weight_tables
from attnctl.render.text import (
    model_lines,
    printable,
    shape_text,
    shown_text,
    sizes_line,
    token_label_text,
    weight_text,
)
from attnctl.report.commands import text_windows
from attnctl.report.generation import (
    GenerationReport,
    GenerationStep,
    TranslationReport,
    TranslationView,
    WindowNote,
)

STEP_KEYS = 3  # strongest keys listed per step, where the width has room for them


def _ranges(numbers: list[int]) -> str:
    """0, 1, 2, 5 -> "0–2, 5"."""
    parts, start = [], None
    for n, number in enumerate(numbers):
        if start is None:
            start = number
        if n + 1 == len(numbers) or numbers[n + 1] != number + 1:
            parts.append(str(start) if start == number else f"{start}–{number}")
            start = None
    return ", ".join(parts)


def _heads_text(heads: list[int]) -> str:
    return ("head " if len(heads) == 1 else "heads ") + _ranges(sorted(heads))


def window_line(note: WindowNote) -> str:
    blocks = ("block " if len(note.blocks) == 1 else "blocks ") + _ranges(note.blocks)
    verb = "slides" if len(note.blocks) == 1 else "slide"
    if not note.dropped:
        return f"{blocks} {verb} over {note.window} keys: nothing fell out of the window"
    dropped = "position 0" if note.dropped == 1 else f"positions 0–{note.dropped - 1}"
    since = "" if note.first_step is None else f", the first at step {note.first_step}"
    return f"{blocks} {verb} over {note.window} keys: {dropped} dropped by the end{since}"


def _cache_cell(report: GenerationReport, step: GenerationStep) -> str:
    """The shown block's (B, Hkv, T, d_k); --layer all: one shape per kind of block."""
    if not report.every_block:
        return shape_text(step.cache_shapes[report.cache_block]["attention"])
    shapes = list(dict.fromkeys(tuple(s["attention"]) for s in step.cache_shapes))
    return "\n".join(shape_text(shape) for shape in shapes)


def _key_entries(tokens: list, top_keys: list[tuple[int, float]]) -> list[str]:
    """A step's strongest keys as "position token weight", strongest first."""
    return [f"{key} {token_label_text(tokens[key].text, 8)} {w:.2f}" for key, w in top_keys]


def _fitting_keys(
    headings: list[str], rows: list[list[str]], entries: list[list[str]], width: int, last: str
) -> int:
    """How many of each row's strongest keys (up to STEP_KEYS) the last column holds on one
    line beside the other columns (at least one, which may wrap). A width too narrow for
    the other columns and the longest word stacks the table: each row's keys get a line
    of their own, and all STEP_KEYS are listed."""
    widths = [
        max(cell_len(line) for cell in (heading, *column) for line in cell.split("\n"))
        for heading, column in zip(headings, zip(*rows, strict=True), strict=True)
    ]
    # rich's padding between the columns, and the box's (blank) edge on either side
    room = width - sum(widths) - 2 * len(widths) - 2
    words = [w for row in entries for e in row for w in e.split()] + last.split()
    longest_word = max(cell_len(w) for w in words)  # ``last``: the keys column's heading
    if room < longest_word:  # FittingTable stacks the rows
        return STEP_KEYS
    for count in range(STEP_KEYS, 1, -1):
        if all(cell_len(" · ".join(row[:count])) <= room for row in entries):
            return count
    return 1


def step_table(report: GenerationReport, batch_row: int, width: int) -> Table:
    """One row per step: the token chosen, where it goes, the cache its row read, bytes,
    and that row's strongest keys (as many as fit the width, up to STEP_KEYS)."""
    batched = len(report.texts) > 1
    title = f"steps · block {report.cache_block}"
    table = titled_table(title + (f" · text {batch_row}" if batched else ""))
    sliding = any(step.dropped[report.cache_block] for step in report.steps)
    headings = ["step", "pos", "token", "KV cache", "bytes", "measured"]
    headings += ["dropped"] if sliding else []
    for name in headings:
        right = name in ("step", "pos", "bytes", "measured", "dropped")
        table.add_column(name, no_wrap=True, justify="right" if right else "left")
    table.add_column("strongest keys")
    rows, entries = [], []
    for step in report.steps:
        token_id = step.tokens[batch_row]
        label = token_label_text(step.texts[batch_row], 12)
        ended = step.step > 0 and report.steps[step.step - 1].finished[batch_row]
        cells = [
            str(step.step),
            str(step.position),
            f"{label} ({token_id})" + (" ·" if ended else ""),
            _cache_cell(report, step),
            format_bytes(step.estimated_bytes),
            "same"
            if step.measured_bytes == step.estimated_bytes
            else format_bytes(step.measured_bytes),
        ]
        if sliding:
            dropped = step.dropped[report.cache_block]
            cells.append("—" if not dropped else f"0–{dropped - 1}")
        rows.append(cells)
        entries.append(_key_entries(report.trace.tokens[batch_row], step.top_keys[batch_row]))
    count = _fitting_keys(headings, rows, entries, width, "strongest keys")
    for cells, keys in zip(rows, entries, strict=True):
        table.add_row(*[Text(cell) for cell in cells], Text(" · ".join(keys[:count])))
    averaged = _heads_text(report.averaged_heads)
    shape = "(B, Hkv, T, d_k) per kind of block" if report.every_block else "(B, Hkv, T, d_k)"
    table.caption = (
        f"pos: where the token goes; KV cache: {shape} after the row at pos - 1 read it; "
        "bytes: estimated, every block's K and V; measured: the cache's tensors; strongest "
        f"keys: that row over the cache, mean of {averaged} (position token weight)"
        + (
            "; ·: the text had ended, a pad token"
            if any(s.finished[batch_row] for s in report.steps[:-1])
            else ""
        )
    )
    table.caption_justify = "left"
    return table


def kv_table(report: GenerationReport) -> Table:
    grid = size_grid("KV cache at the end")
    for group in report.kv_groups:
        kind = f"window {group.window}" if group.window else "full"
        blocks = f"{group.layers} block" + ("s" if group.layers > 1 else "")
        grid.add_row(
            f"{kind} · {blocks}",
            format_bytes(group.bytes),
            f"{group.tokens} positions · (B, Hkv, T, d_k) = "
            f"{shape_text((report.plan.batch, group.kv_heads, group.tokens, group.head_dim))} "
            "each, K and V",
        )
    measured = report.final_measured_bytes
    grid.add_row(
        "every block",
        format_bytes(report.final_estimated_bytes),
        "estimated; measured "
        + ("the same" if measured == report.final_estimated_bytes else format_bytes(measured)),
    )
    return grid


def generation_view(
    report: GenerationReport, width: int, heatmap: bool = False, color: bool = False
) -> Group:
    """``run --generate``: prompt, steps, window notes, final weights, summary; with
    ``heatmap`` (``--view heatmap``), the final weights as cells (half blocks in ``color``)."""
    plan, trace = report.plan, report.trace
    lines = [
        ("text" if len(report.texts) == 1 else f"text {n}", shown_text(text))
        for n, text in enumerate(report.texts)
    ]
    shown = None if report.every_block else report.blocks[0]
    rules = "greedy (the arg-max token), KV cache"
    parts: list[RenderableType] = [
        header(
            "attnctl run --generate",
            [
                *lines,
                ("tokenizer", f"{trace.tokenizer} (vocab {trace.vocab_size})"),
                *model_lines(plan, shown),
                ("generate", f"up to {report.requested} tokens · {rules}"),
                ("device", f"{trace.device} · dtype {plan.config.dtype}"),
            ],
        ),
        Text(""),
    ]
    batched = len(report.texts) > 1
    for b, row in enumerate(report.prompt_tokens):
        title = f"prompt · text {b}" if batched else "prompt"
        parts.append(token_table(row, list(range(len(row))), title))
    for b in range(len(report.texts)):
        parts.append(step_table(report, b, width))
    parts += [Text(window_line(note), style="dim") for note in report.window_notes]
    parts.append(Text(""))
    final = len(report.prompt_tokens[0]) + report.generated_count
    if heatmap:
        parts += generation_heatmaps(report, width, color)
    elif report.every_block:
        by_layer = [s.first_text for s in report.block_summaries]
        which = "the final sequence" + (", text 0" if batched else "")
        parts += heads_map(by_layer, trace.attention_heads, width, which)
    else:
        parts.append(
            Text(
                f"attention weights of the final sequence ({final} tokens), block "
                f"{report.blocks[0]}: each row as its step computed it, columns = keys, "
                "* = row maximum",
                style="bold",
            )
        )
        tables, notes = [], []
        for window in report.windows:
            more, more_notes, _ = weight_tables(
                trace, window, list(report.heads), width, report.digits
            )
            tables += more
            notes += [note for note in more_notes if note not in notes]
        parts.append(Group(*tables))  # one under another: a final sequence is long
        parts += [Text(note, style="dim") for note in notes]
        if report.heads_not_shown is not None:
            first, last = report.heads_not_shown
            parts.append(Text(f"heads {first}–{last} not shown; pick them with --head N", "dim"))
    parts.append(Text(""))
    parts.append(kv_table(report))
    parts.append(Text(""))
    parts.append(summary(report))
    return Group(*parts)


def _span(start: int, end: int) -> str:
    """Positions start … end - 1: "0–6", or "7" alone."""
    return str(start) if end - start == 1 else f"{start}–{end - 1}"


def generation_heatmaps(report: GenerationReport, width: int, color: bool) -> list[RenderableType]:
    """The final sequence's weights as heatmaps (``--layer all``: each block's heads side by
    side), the prompt's rows and keys told apart from the generated ones."""
    prompt = len(report.prompt_tokens[0])
    final = prompt + report.generated_count
    where = "every block" if report.every_block else f"block {report.blocks[0]}"
    parts: list[RenderableType] = [
        Text(
            f"attention heatmaps of the final sequence ({final} tokens), {where}: each row as "
            f"its step computed it; rows = queries, columns = keys; prompt {_span(0, prompt)}, "
            f"generated {_span(prompt, final)}",
            style="bold",
        )
    ]
    starts = [len(row) for row in report.prompt_tokens]
    if report.every_block:
        drawn, notes = block_tiles(report.traces, report.heads, width, color, generated_from=starts)
    else:
        drawn, notes = trace_heatmaps(
            report.trace, report.heads, width, color, generated_from=starts
        )
    key_counts = trace_key_counts(report.traces if report.every_block else [report.trace])
    parts += [*drawn, legend(color, width, key_counts), *(Text(n, style="dim") for n in notes)]
    if report.heads_not_shown is not None:
        first, last = report.heads_not_shown
        parts.append(Text(f"heads {first}–{last} not shown; pick them with --head N", "dim"))
    return parts


def stop_words(stop: str, requested: int) -> str:
    if stop == "eos":
        return "every text ended with an end-of-sequence token"
    if stop == "forced_eos":
        return (
            f"the limit of {requested} (--generate): the generation config forces the "
            "last token to the end token (forced_eos_token_id)"
        )
    return f"the limit of {requested} (--generate)"


def summary(report: GenerationReport) -> Table:
    grid = header("generated", [])
    count = report.generated_count
    why = stop_words(report.stop, report.requested)
    grid.add_row("tokens", Text(f"{count} · stopped by {why}"))
    for b, text in enumerate(report.generated_texts):
        label = "text" if len(report.texts) == 1 else f"text {b}"
        grid.add_row(label, Text(shown_text(text)))
    return grid


# ---------------------------------------------------------------- encoder–decoders


def alignment_view(view: TranslationView, width: int, digits: int = 2) -> list[RenderableType]:
    """Per text: each generated token and the source token the row that chose it weighs
    most, then the shaded target × source matrix (rows: the generated tokens; columns:
    the source tokens; * = the row's strongest); too many sources for the width: each
    row lists its strongest sources instead."""
    heads = _heads_text(view.averaged_heads)
    parts: list[RenderableType] = []
    batched = len(view.source_tokens) > 1
    for batch_row, aligned in enumerate(view.alignment):
        sources = [t for t in view.source_tokens[batch_row] if not t.pad]
        targets = view.target_tokens[batch_row]
        matrix = view.alignment_matrix[batch_row]
        title = f"alignment · block {view.decoder_block} · mean of {heads}"
        table = titled_table(title + (f" · text {batch_row}" if batched else ""))
        table.add_column(Text("target \\ source"), no_wrap=True)
        cell = digits + 3
        label_width = max(len(token_label_text(t.text)) for t in targets) + 4
        fits = (width - label_width - 2) // (cell + 1) >= len(sources)
        if fits:
            for n, source in enumerate(sources):
                heading = f"{n}\n{token_label_text(source.text, cell)}"
                table.add_column(Text(heading), justify="right", no_wrap=True, min_width=cell)
        else:
            table.add_column("strongest sources")
        for entry in aligned:
            target = targets[entry.target_position]
            row = matrix[entry.target_position - 1]  # the row that chose it
            cells: list[RenderableType] = [
                Text(f"{entry.target_position} {token_label_text(target.text)}")
            ]
            if fits:
                for n in range(len(sources)):
                    mark = "*" if n == entry.source_position else " "
                    cells.append(Text(f"{weight_text(row[n], digits)}{mark}", style=_shade(row[n])))
            else:
                ranked = sorted(range(len(sources)), key=row.__getitem__, reverse=True)[:3]
                cells.append(
                    Text(
                        " · ".join(
                            f"{n} {token_label_text(sources[n].text, 8)} "
                            f"{weight_text(row[n], digits)}"
                            for n in ranked
                        )
                    )
                )
            table.add_row(*cells)
        pairs = "  ".join(
            f"{token_label_text(targets[a.target_position].text)} → "
            f"{token_label_text(sources[a.source_position].text)}"
            for a in aligned
        )
        parts += [table, Text(pairs), Text("")]
    return parts


def translation_step_table(report: TranslationReport, batch_row: int, width: int) -> Table:
    """One row per decoder step: the token, where it goes, the decoder block's self- and
    cross-attention caches, the bytes, and the source tokens its cross-attention row
    weighs most (as many as fit the width, up to STEP_KEYS)."""
    view = report.view
    block = view.decoder_block
    batched = len(report.texts) > 1
    title = f"steps · decoder block {block}" + (f" · text {batch_row}" if batched else "")
    table = titled_table(title)
    headings = ["step", "pos", "token", "self KV", "cross KV", "bytes", "measured"]
    for name in headings:
        right = name in ("step", "pos", "bytes", "measured")
        table.add_column(name, no_wrap=True, justify="right" if right else "left")
    table.add_column("strongest sources")
    rows, entries = [], []
    for step in report.steps:
        label = token_label_text(step.texts[batch_row], 12)
        ended = step.step > 0 and report.steps[step.step - 1].finished[batch_row]
        shapes = step.cache_shapes[block]
        rows.append(
            [
                str(step.step),
                str(step.position),
                f"{label} ({step.tokens[batch_row]})" + (" ·" if ended else ""),
                shape_text(shapes["attention"]),
                shape_text(shapes["cross_attention"]),
                format_bytes(step.estimated_bytes),
                "same"
                if step.measured_bytes == step.estimated_bytes
                else format_bytes(step.measured_bytes),
            ]
        )
        entries.append(_key_entries(view.source_tokens[batch_row], step.top_keys[batch_row]))
    count = _fitting_keys(headings, rows, entries, width, "strongest sources")
    for cells, keys in zip(rows, entries, strict=True):
        table.add_row(*[Text(cell) for cell in cells], Text(" · ".join(keys[:count])))
    table.caption = (
        "pos: where the token goes; self KV: the decoder's cache (B, Hkv, T, d_k) after the "
        "row at pos - 1 read it; cross KV: K and V of the encoder output, made once; bytes: "
        "every decoder block's, estimated; measured: the caches' tensors; strongest sources: "
        f"that row's cross-attention, mean of {_heads_text(view.averaged_heads)}"
    )
    table.caption_justify = "left"
    return table


def translation_view(
    report: TranslationReport, width: int, heatmap: bool = False, color: bool = False
) -> Group:
    """An encoder–decoder: the source, each decoder step, the alignment, the per-head
    cross-attention tables (target × source; --layer all: the heads maps of the three
    kinds of attention in every block), the summary. With ``heatmap`` (``--view
    heatmap``): the three attentions as cells instead of the tables and heads maps."""
    view, model = report.view, report.model
    lines = [
        ("text" if len(report.texts) == 1 else f"text {n}", shown_text(text))
        for n, text in enumerate(report.texts)
    ]
    blocks = f" · encoder block {view.encoder_block} · decoder block {view.decoder_block}"
    if report.every_block:
        blocks = f" · every block (steps and alignment: decoder block {view.decoder_block})"
    parts: list[RenderableType] = [
        header(
            "attnctl run (encoder–decoder)",
            [
                *lines,
                ("tokenizer", f"{report.tokenizer} (vocab {report.vocab_size})"),
                ("model", f"{printable(str(model.path))}{blocks}"),
                ("config", model.summary()),
                ("generate", f"up to {report.requested} tokens · greedy, KV cache"),
                ("device", f"{report.device} · dtype {report.dtype}"),
            ],
        ),
        Text(""),
    ]
    batched = len(report.texts) > 1
    for b, row in enumerate(view.source_tokens):
        parts.append(
            token_table(row, list(range(len(row))), f"source · text {b}" if batched else "source")
        )
    parts += _stage_tables(report, width)
    for b in range(len(report.texts)):
        parts.append(translation_step_table(report, b, width))
    parts.append(Text(""))
    parts += alignment_view(view, width, report.digits)
    if heatmap:
        parts += translation_heatmaps(report, width, color)
    elif report.every_block:
        parts += _heads_maps(report, width)
    else:
        parts += _cross_tables(report, width)
    parts.append(Text(""))
    parts.append(_translation_summary(report))
    return Group(*parts)


def _stage_tables(report: TranslationReport, width: int) -> list[RenderableType]:
    """The encoder block's stages over the source, then the decoder block's over the whole
    target at once (its cross-attention: queries from the target, keys and values from the
    encoder output, Lq ≠ Lk), as ``shapes`` plans them."""
    parts: list[RenderableType] = []
    for what, plan in (("encoder", report.encoder_plan), ("decoder", report.decoder_plan)):
        if plan is None:
            continue
        parts.append(Text(f"{what} block {plan.layer_index}   {sizes_line(plan)}", style="bold"))
        if what == "decoder":
            parts.append(
                Text(
                    "over the whole target at once (Lc: the source); the steps compute its "
                    "rows one at a time",
                    style="dim",
                )
            )
        parts += [stage_table(plan.stages, width, plan), Text("")]
    return parts


KIND_NAMES = {"encoder": "encoder self-attention", "decoder": "decoder self-attention",
              "cross": "cross-attention"}  # fmt: skip


def _heads_maps(report: TranslationReport, width: int) -> list[RenderableType]:
    """--layer all: one heads map per kind of attention, a row per block (text 0's heads)."""
    batched = len(report.texts) > 1
    parts: list[RenderableType] = []
    for kind, per_block in report.block_stats.items():
        by_layer = [[s for s in stats if s.batch_row == 0] for stats in per_block]
        label = KIND_NAMES[kind] + (", text 0" if batched else "")
        parts += heads_map(by_layer, report.view.heads, width, label)
        parts.append(Text(""))
    parts.append(Text("weights of one block: --layer N (decoder), --encoder-layer N", "dim"))
    return parts


# (what, rows and columns, the columns' corner label) of each kind of attention
HEATMAP_KINDS = {
    "encoder": ("rows and columns = source tokens", "source"),
    "decoder": ("rows and columns = target tokens (the start token first)", "target"),
    "cross": ("rows = target tokens (the start token first), columns = source tokens", "source"),
}


def translation_heatmaps(
    report: TranslationReport, width: int, color: bool
) -> list[RenderableType]:
    """The encoder's self-attention, the decoder's and the cross-attention as heatmaps,
    each labelled with its own tokens (--layer all: every block's heads side by side)."""
    view = report.view
    parts: list[RenderableType] = []
    notes: list[str] = []
    key_counts: list[int] = []  # of the maps drawn, for the legend's scale
    matrices = {
        "encoder": (view.source_tokens, view.source_tokens, view.encoder_attention),
        "decoder": (view.target_tokens, view.target_tokens, view.decoder_attention),
        "cross": (view.target_tokens, view.source_tokens, view.cross_attention),
    }
    for kind, (what, corner) in HEATMAP_KINDS.items():
        if report.every_block:
            parts.append(Text(f"{KIND_NAMES[kind]} heatmaps of every block: {what}", "bold"))
            stack = "encoder" if kind == "encoder" else "decoder"
            drawn, more = block_tiles(
                report.block_traces[kind],
                report.heads,
                width,
                color,
                titled=f"{stack} block {{layer}}",
                corner=corner,
            )
            parts += drawn
            notes += [note for note in more if note not in notes]
            key_counts += trace_key_counts(report.block_traces[kind])
            continue
        block = view.encoder_block if kind == "encoder" else view.decoder_block
        stack = "encoder" if kind == "encoder" else "decoder"
        parts.append(Text(f"{KIND_NAMES[kind]} heatmaps, {stack} block {block}: {what}", "bold"))
        queries, keys, attention = matrices[kind]
        for panel in matrix_panels(queries, keys, attention, view.heads, report.heads, corner):
            parts += panel_lines(panel, width, color)
            key_counts.append(panel.key_count)
    parts.append(legend(color, width, key_counts))
    parts += [Text(note, style="dim") for note in notes]
    if report.heads_not_shown is not None:
        first, last = report.heads_not_shown
        parts.append(Text(f"heads {first}–{last} not shown; pick them with --head N", "dim"))
    return parts


def _cross_tables(report: TranslationReport, width: int) -> list[RenderableType]:
    """The per-head cross-attention tables of the decoder block: target × source."""
    parts: list[RenderableType] = [
        Text(
            f"cross-attention weights, decoder block {report.view.decoder_block}: rows = "
            "target tokens (the start token first), columns = source tokens, * = row maximum",
            style="bold",
        )
    ]
    tables, notes = [], []
    for window in text_windows(report.cross_trace):
        more, more_notes, _ = weight_tables(
            report.cross_trace, window, list(report.heads), width, report.digits
        )
        tables += more
        notes += [note for note in more_notes if note not in notes]
    parts.append(Group(*tables))
    parts += [Text(note, style="dim") for note in notes]
    if report.heads_not_shown is not None:
        first, last = report.heads_not_shown
        parts.append(Text(f"heads {first}–{last} not shown; pick them with --head N", "dim"))
    return parts


def _translation_summary(report: TranslationReport) -> Table:
    grid = header("generated", [])
    why = stop_words(report.stop, report.requested)
    grid.add_row("tokens", Text(f"{report.generated_count} · stopped by {why}"))
    measured = report.final_measured_bytes
    same = measured == report.final_estimated_bytes
    grid.add_row(
        "KV cache",
        Text(
            f"{format_bytes(report.final_estimated_bytes)} estimated, measured "
            + ("the same" if same else format_bytes(measured))
        ),
    )
    for b, text in enumerate(report.generated_texts):
        label = "text" if len(report.texts) == 1 else f"text {b}"
        grid.add_row(label, Text(shown_text(text)))
    return grid
