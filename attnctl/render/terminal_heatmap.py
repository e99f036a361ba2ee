"""``run --view heatmap``: each head's attention matrix as cells, for when numbers are too many.

In colour, a line holds two query rows: ``▀`` with the upper row's colour as foreground and
the lower row's as background. Without colour (``NO_COLOR``, piped output) each cell is one
shade character of :data:`SHADE_CHARS`, one line per query row; so is a terminal of 16
colours, whose blues are too few to tell weights apart. A key takes one to
:data:`MAX_CELL_WIDTH` cells (few keys: wider). Columns are keys; when the
keys outnumber the columns, each column is the maximum of a bucket of keys (and the view
says so). Only the rows computed are drawn (long inputs compute some rows only).

The shade is the weight on a fixed scale, 0 to 1, while a map has at most
:data:`FIXED_SCALE_KEYS` keys (the HTML report's limit too). Above it the weights are about
1/L and would all look alike: each row is then shaded on its own scale, the weight ÷ the
row's largest, and the map says so under it.

What is drawn is a :class:`Panel`: one head's matrix for one text, whatever computed it
(one block of ``run``, the final sequence of ``--generate``, an encoder–decoder's three
attentions). :func:`panel_lines` draws one full size, with token labels; :func:`tiles`
draws a block's heads side by side, one cell a key (``--layer all``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.cells import cell_len
from rich.color import Color
from rich.console import Group, RenderableType
from rich.style import Style
from rich.text import Text

from attnctl.render.terminal_run import _run_opening
from attnctl.render.text import token_label
from attnctl.report.commands import RunReport, TextWindow, text_windows
from attnctl.trace import Token, Trace

UPPER_HALF = "▀"
SHADE_CHARS = " ░▒▓█"  # weight 0 (a masked key or padding), then darker to lighter as it grows
KEY_LABEL_CELLS = 6  # longest key token label on top before it is shortened
QUERY_LABEL_CELLS = 8  # longest query token label at the left
MAX_CELL_WIDTH = 3  # cells a key takes when few keys leave room
_LOW, _HIGH = (24, 24, 32), (40, 110, 235)  # the weight tables' shades: dark 0, blue 1
_STEPS = 32
LEGEND_WEIGHTS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0)
PROMPT_MARK, GENERATED_MARK = "└prompt", "└generated"  # over the keys of --generate
FIXED_SCALE_KEYS = 128  # more keys than this: each row shaded relative to its largest weight
VISIBLE_SPACE = "␣"


def weight_color(weight: float) -> Color:
    """Dark for 0, bright blue for 1 (sqrt, so small weights still show), in 32 steps."""
    step = round(max(0.0, min(1.0, weight)) ** 0.5 * (_STEPS - 1))
    t = step / (_STEPS - 1)
    red, green, blue = (int(a + (b - a) * t) for a, b in zip(_LOW, _HIGH, strict=True))
    return Color.from_rgb(red, green, blue)


def shade_char(weight: float) -> str:
    """' ' for exactly 0, else ░▒▓█ by the square root of the weight (any weight > 0 shows)."""
    if weight <= 0:
        return SHADE_CHARS[0]
    level = round(min(1.0, weight) ** 0.5 * (len(SHADE_CHARS) - 1))
    return SHADE_CHARS[max(1, level)]


def _shade_bounds() -> list[float]:
    """The weight from which each shade character above ░ starts."""
    steps = len(SHADE_CHARS) - 1
    return [((level - 0.5) / steps) ** 2 for level in range(2, steps + 1)]


def shortened(text: str, cells: int) -> str:
    """``text`` cut to at most ``cells`` terminal cells (a CJK character takes two), with …"""
    if cell_len(text) <= cells:
        return text
    out = ""
    for char in text:
        if cell_len(out + char) > cells - 1:
            break
        out += char
    return out + "…"


def cell_label(token: Token) -> str:
    """A token's label in the heatmap: as the tables show it, and a space at either end
    shown as ␣ (a leading space would read as a gap, and shift the label off its column)."""
    label = token_label(token)
    core = label.strip(" ")
    if not core:
        return label
    start = label.index(core)
    end = start + len(core)
    return VISIBLE_SPACE * start + core + VISIBLE_SPACE * (len(label) - end)


def key_buckets(keys: int, columns: int) -> list[tuple[int, int]]:
    """Split keys 0..keys-1 into at most ``columns`` contiguous buckets [start, end)."""
    count = min(keys, max(1, columns))
    return [(keys * c // count, keys * (c + 1) // count) for c in range(count)]


def _placed(labels: list[tuple[int, str]], offset: int, width: int) -> str:
    """Labels at their columns from the left, each where it fits after the previous and a gap."""
    return _placed_where(labels, offset, width)[0]


def _placed_where(labels: list[tuple[int, str]], offset: int, width: int) -> tuple[str, list[int]]:
    """:func:`_placed`'s line, and the indices in ``labels`` of the labels it holds."""
    line, position, placed = "", 0, []
    for n, (column, label) in enumerate(labels):
        start = offset + column
        if line and start < position + 1:
            continue
        if start < position or start + cell_len(label) > width:
            continue
        line += " " * (start - position) + label
        position = start + cell_len(label)
        placed.append(n)
    return line, placed


def _key_label_lines(
    columns: list[int], positions: list[str], names: list[str], width: int
) -> tuple[str, str]:
    """The key positions over the cells, then their tokens: a token is shown only under a
    position shown (where it fits), each label's first character over its key's column."""
    position_line, shown = _placed_where(list(zip(columns, positions, strict=True)), 0, width)
    name_line = _placed([(columns[n], names[n]) for n in shown], 0, width)
    return position_line, name_line


def _ranges_text(ranges: list[tuple[int, int]]) -> str:
    return ", ".join(f"{a}–{b}" if a != b else str(a) for a, b in ranges)


# ---------------------------------------------------------------- what is drawn


@dataclass(frozen=True)
class Panel:
    """One head's weights for one text, as a heatmap draws them."""

    title: str
    queries: list[Token]  # the query tokens, by position
    keys: list[Token]  # the key tokens, by position (padding after ``key_count``)
    key_count: int  # the keys drawn: the text's own, without padding
    rows: Sequence[Sequence[float]]  # each computed row's weights over the keys
    computed: list[tuple[int, int]]  # (index in ``rows``, query position), in order
    corner: str = "key"  # what the columns are: "key", "context", "source", "target"
    generated_from: int | None = None  # --generate: the first generated position


def trace_panel(
    trace: Trace,
    window: TextWindow,
    head: int,
    *,
    corner: str | None = None,
    generated_from: int | None = None,
) -> Panel:
    """Head ``head`` of one text (``window``) of ``trace``, titled "head N" (and "· text B"
    in a batch), its columns by default "key" (self-attention) or "context"."""
    batch_row = window.batch_row
    tokens = trace.tokens[batch_row]
    keys = tokens if trace.context_tokens is None else trace.context_tokens[batch_row]
    title = f"head {head}" + (f" · text {batch_row}" if len(trace.tokens) > 1 else "")
    if corner is None:
        corner = "key" if trace.context_tokens is None else "context"
    return Panel(
        title=title,
        queries=tokens,
        keys=keys,
        key_count=window.keys,
        rows=trace.attention[batch_row][trace.attention_heads.index(head)],
        computed=window.computed,
        corner=corner,
        generated_from=generated_from,
    )


def matrix_panels(
    tokens: list[list[Token]],
    key_tokens: list[list[Token]],
    attention: list,
    all_heads: list[int],
    heads: Sequence[int],
    corner: str,
) -> list[Panel]:
    """Per text, then per head of ``heads``: a full matrix (B, h, Lq, Lk) whose heads are
    ``all_heads`` (every row computed), with each text's own tokens, padding left out."""
    panels = []
    batched = len(tokens) > 1
    for batch_row, (queries, keys) in enumerate(zip(tokens, key_tokens, strict=True)):
        own_queries = sum(not t.pad for t in queries)
        for head in heads:
            panels.append(
                Panel(
                    title=f"head {head}" + (f" · text {batch_row}" if batched else ""),
                    queries=queries,
                    keys=keys,
                    key_count=sum(not t.pad for t in keys),
                    rows=attention[batch_row][all_heads.index(head)],
                    computed=[(r, r) for r in range(own_queries)],
                    corner=corner,
                )
            )
    return panels


# ---------------------------------------------------------------- the lines


def _line_rows(panel: Panel, color: bool) -> list[list[int]]:
    """The query positions each line draws: two in colour, one without; a line never joins
    rows across a gap in the rows computed, nor a prompt row with a generated one."""
    per_line = 2 if color else 1
    runs: list[list[int]] = []
    for _, row in panel.computed:
        joins = runs and row == runs[-1][-1] + 1 and row != panel.generated_from
        if joins:
            runs[-1].append(row)
        else:
            runs.append([row])
    return [run[i : i + per_line] for run in runs for i in range(0, len(run), per_line)]


def _query_label(panel: Panel, rows: list[int]) -> str:
    positions = "/".join(str(r) for r in rows)
    names = "/".join(
        shortened(cell_label(panel.queries[r]), QUERY_LABEL_CELLS // len(rows)) for r in rows
    )
    return f"{positions} {names}"


def _label_cells(panel: Panel, lines_rows: list[list[int]], width: int) -> int:
    """The query labels' column: the longest label, at most a third of the width."""
    position_cells = len(str(panel.computed[-1][1]))
    longest = max(cell_len(_query_label(panel, rows)) for rows in lines_rows)
    return min(longest, max(position_cells * 2 + 2, width // 3))


def _between(panel: Panel, previous: list[int], rows: list[int], width: int) -> Text | None:
    """The line between two lines of cells: rows left out, or where the generated start."""
    if rows[0] != previous[-1] + 1:
        gap = (previous[-1] + 1, rows[0] - 1)
        return Text(
            shortened(f"⋮ query rows {_ranges_text([gap])} not computed", width), style="dim"
        )
    if rows[0] == panel.generated_from:
        last = panel.computed[-1][1]
        span = f"rows {rows[0]}–{last}" if last > rows[0] else f"row {rows[0]}"
        text = f"╌ generated: {span}, each as its step computed it"
        return Text(shortened(text, width), style="dim")
    return None


def relative_scale(panel: Panel) -> bool:
    """Whether ``panel`` shades each row relative to its largest weight (many keys)."""
    return panel.key_count > FIXED_SCALE_KEYS


def _row_scales(panel: Panel, index_of: dict[int, int], rows: list[int]) -> list[float]:
    """What each row's weights are multiplied by before shading: 1, or 1 ÷ the row's largest
    weight over its keys (on many keys; a row of zeros stays zeros)."""
    if not relative_scale(panel):
        return [1.0] * len(rows)
    largest = [max(panel.rows[index_of[row]][: panel.key_count]) for row in rows]
    return [1.0 / value if value > 0 else 1.0 for value in largest]


def _cells(
    panel: Panel,
    index_of: dict[int, int],
    rows: list[int],
    buckets: list[tuple[int, int]],
    cell: int,
    color: bool,
) -> Text:
    """One line of cells: a bucket's maximum weight per column, ``cell`` characters each
    (on many keys, relative to its row's largest weight)."""
    scales = _row_scales(panel, index_of, rows)

    def weight(n: int, bucket: tuple[int, int]) -> float:
        start, end = bucket
        weights = panel.rows[index_of[rows[n]]]
        return max(weights[start:end]) * scales[n]  # a slice: C speed for 8k keys

    line = Text(no_wrap=True)
    for bucket in buckets:
        upper = weight(0, bucket)
        if not color:
            line.append(shade_char(upper) * cell)
            continue
        lower = weight(1, bucket) if len(rows) > 1 else None
        style = Style(
            color=weight_color(upper), bgcolor=None if lower is None else weight_color(lower)
        )
        line.append(UPPER_HALF * cell, style=style)
    return line


def _scale_note(key_count: int) -> Text:
    return Text(
        f"{key_count} keys: each row on its own scale, shade = weight ÷ the row's largest",
        style="dim",
    )


def _pooled_note(key_count: int, buckets: list[tuple[int, int]]) -> Text:
    sizes = sorted({end - start for start, end in buckets})
    size = "–".join(str(s) for s in sizes) if len(sizes) > 1 else str(sizes[0])
    return Text(
        f"{key_count} keys in {len(buckets)} columns: each column is the max of "
        f"{size} keys (labelled by its first key)",
        style="dim",
    )


def _generated_marks(
    panel: Panel, buckets: list[tuple[int, int]], cell: int, room: int
) -> str | None:
    """Over the keys of --generate: where the prompt's keys and the generated ones start."""
    start = panel.generated_from
    if start is None or start >= panel.key_count:
        return None
    column = next(c for c, (_, end) in enumerate(buckets) if end > start) * cell
    marks = [(column, GENERATED_MARK)]
    if column >= cell_len(PROMPT_MARK) + 1:
        marks.insert(0, (0, PROMPT_MARK))
    line = _placed(marks, 0, room)
    return line or _placed([(column, GENERATED_MARK[:2])], 0, room) or None


def panel_lines(panel: Panel, width: int, color: bool) -> list[RenderableType]:
    """One head's matrix for one text: title, key labels, rows of cells, pooling note."""
    computed = panel.computed
    lines_rows = _line_rows(panel, color)
    label_cells = _label_cells(panel, lines_rows, width)
    columns = max(1, width - label_cells - 2)  # "label│cells"
    buckets = key_buckets(panel.key_count, columns)
    # few keys: each as wide as it can be, up to 3 cells (a CJK label and a gap)
    cell = max(1, min(MAX_CELL_WIDTH, columns // len(buckets)))
    offset = label_cells + 1
    room = width - offset

    positions, names = _key_label_lines(
        [c * cell for c in range(len(buckets))],
        [str(start) for start, _ in buckets],
        [shortened(cell_label(panel.keys[start]), KEY_LABEL_CELLS) for start, _ in buckets],
        room,
    )
    corner_label = shortened(panel.corner, label_cells).rjust(label_cells) + " "
    head_lines = [
        Text(corner_label + positions, style="dim"),
        Text(" " * offset + names),
    ]
    marks = _generated_marks(panel, buckets, cell, room)
    if marks is not None:
        head_lines.append(Text(" " * offset + marks, style="dim"))

    index_of = dict((r, i) for i, r in computed)
    body: list[Text] = []
    for n, rows in enumerate(lines_rows):
        between = _between(panel, lines_rows[n - 1], rows, width) if n else None
        if between is not None:
            body.append(between)
        label = shortened(_query_label(panel, rows), label_cells)
        line = Text(" " * (label_cells - cell_len(label)) + label + "│", no_wrap=True)
        line.append_text(_cells(panel, index_of, rows, buckets, cell, color))
        body.append(line)
    notes = [_pooled_note(panel.key_count, buckets)] if len(buckets) < panel.key_count else []
    if relative_scale(panel):
        notes.append(_scale_note(panel.key_count))
    return [Text(panel.title, style="bold"), *head_lines, *body, *notes, Text("")]


def _tile_head_label(head: int, cells: int) -> str:
    """The longest of "head N", "hN" and "N" that fits over a head of ``cells`` columns."""
    for label in (f"head {head}", f"h{head}", str(head)):
        if cell_len(label) <= cells:
            return label
    return ""


def tiles(
    title: str, panels: list[Panel], heads: Sequence[int], width: int, color: bool
) -> list[RenderableType]:
    """One block's heads side by side, one cell a key, the query labels at the left:
    ``panels`` (one per head of ``heads``) share their text, rows and keys. Heads that do
    not fit one line go on the next; keys too many for the width are pooled."""
    first = panels[0]
    lines_rows = _line_rows(first, color)
    label_cells = _label_cells(first, lines_rows, width)
    room = max(2, width - label_cells - 1)  # "label│" then "cells│" per head
    tile = max(1, min(first.key_count, room - 1))
    buckets = key_buckets(first.key_count, tile)
    per_line = max(1, room // (tile + 1))
    index_of = dict((r, i) for i, r in first.computed)
    parts: list[RenderableType] = [Text(shortened(title, width), style="bold")]
    for start in range(0, len(panels), per_line):
        shown = list(zip(heads[start : start + per_line], panels[start : start + per_line],
                         strict=True))  # fmt: skip
        labels = [(n * (tile + 1), _tile_head_label(h, tile)) for n, (h, _) in enumerate(shown)]
        header = " " * (label_cells + 1) + _placed(labels, 0, width - label_cells - 1)
        parts.append(Text(header.rstrip(), style="dim"))
        for n, rows in enumerate(lines_rows):
            between = _between(first, lines_rows[n - 1], rows, width) if n else None
            if between is not None:
                parts.append(between)
            label = shortened(_query_label(first, rows), label_cells)
            line = Text(" " * (label_cells - cell_len(label)) + label + "│", no_wrap=True)
            for _, panel in shown:
                line.append_text(_cells(panel, index_of, rows, buckets, 1, color))
                line.append("│")
            parts.append(line)
    if len(buckets) < first.key_count:
        parts.append(_pooled_note(first.key_count, buckets))
    if relative_scale(first):
        parts.append(_scale_note(first.key_count))
    parts.append(Text(""))
    return parts


def _scale_text(key_counts: Sequence[int]) -> str:
    """What the legend's shades measure, by the key counts of the maps drawn."""
    relative = [count > FIXED_SCALE_KEYS for count in key_counts]
    if relative and all(relative):
        return "weight ÷ the row's largest, each row on its own scale"
    if any(relative):
        return f"weight; in maps of more than {FIXED_SCALE_KEYS} keys, weight ÷ the row's largest"
    return "weight"


def legend(color: bool, width: int, key_counts: Sequence[int] = ()) -> Text:
    """Colour (or shade character) → weight; on maps of more than :data:`FIXED_SCALE_KEYS`
    keys (``key_counts``: of the maps drawn), → weight ÷ its row's largest."""
    scale = _scale_text(key_counts)
    if not color:
        bounds = _shade_bounds()
        parts = [f"'{SHADE_CHARS[0]}' 0", f"{SHADE_CHARS[1]} <{bounds[0]:.2f}"]
        for level in range(2, len(SHADE_CHARS)):
            upper = bounds[level - 1] if level - 1 < len(bounds) else None
            low = f"{bounds[level - 2]:.2f}"
            span = f"{low}–{upper:.2f}" if upper is not None else f"≥{low}"
            parts.append(f"{SHADE_CHARS[level]} {span}")
        return Text("legend: " + " · ".join(parts) + f" ({scale}; one line a query row)")
    text = Text("legend: ")
    for weight in LEGEND_WEIGHTS:
        text.append("██", style=Style(color=weight_color(weight)))
        text.append(f" {weight:g}  ")
    text.append(f"({scale}, square-root scale; ▀: upper half the upper row, lower half the next)")
    return text


def trace_key_counts(traces: Sequence[Trace]) -> list[int]:
    """The keys of each map drawn from ``traces`` (one per text with rows computed)."""
    return [window.keys for trace in traces for window in text_windows(trace) if window.computed]


# ---------------------------------------------------------------- the views


def _not_computed(window: TextWindow) -> str:
    return (
        f"text {window.batch_row}: none of its {window.queries} tokens is among the rows computed"
    )


def _hidden_note(window: TextWindow) -> str:
    return (
        f"query rows {_ranges_text(window.hidden)} not computed; choose rows with "
        "--rows A:B or last:N"
    )


def trace_heatmaps(
    trace: Trace,
    heads: Sequence[int],
    width: int,
    color: bool,
    *,
    corner: str | None = None,
    generated_from: list[int] | None = None,
) -> tuple[list[RenderableType], list[str]]:
    """Every text's shown heads of one trace, full size; and the notes on rows left out."""
    parts: list[RenderableType] = []
    notes: list[str] = []
    for window in text_windows(trace):
        if not window.computed:
            notes.append(_not_computed(window))
            continue
        if window.hidden and _hidden_note(window) not in notes:
            notes.append(_hidden_note(window))
        start = None if generated_from is None else generated_from[window.batch_row]
        for head in heads:
            panel = trace_panel(trace, window, head, corner=corner, generated_from=start)
            parts.extend(panel_lines(panel, width, color))
    return parts, notes


def block_tiles(
    traces: list[Trace],
    heads: Sequence[int],
    width: int,
    color: bool,
    *,
    titled: str = "block {layer}",
    corner: str | None = None,
    generated_from: list[int] | None = None,
) -> tuple[list[RenderableType], list[str]]:
    """``--layer all``: per block (one trace each) and text, its heads side by side, under
    ``titled`` (``{layer}``: the block's number)."""
    parts: list[RenderableType] = []
    notes: list[str] = []
    for trace in traces:
        for window in text_windows(trace):
            if not window.computed:
                if _not_computed(window) not in notes:
                    notes.append(_not_computed(window))
                continue
            if window.hidden and _hidden_note(window) not in notes:
                notes.append(_hidden_note(window))
            start = None if generated_from is None else generated_from[window.batch_row]
            panels = [
                trace_panel(trace, window, h, corner=corner, generated_from=start) for h in heads
            ]
            title = titled.format(layer=trace.layer) + (
                f" · text {window.batch_row}" if len(trace.tokens) > 1 else ""
            )
            parts.extend(tiles(title, panels, heads, width, color))
    return parts, notes


def heatmap_view(report: RunReport, width: int, color: bool) -> Group:
    """``run --view heatmap``: the header, then each shown head's matrix per text; with
    ``--layer all``, each block's heads side by side."""
    trace = report.trace
    shown_block = None if report.every_block else trace.layer
    parts: list[RenderableType] = list(
        _run_opening(report.texts, trace, report.plan, report.contexts, shown_block)[:2]
    )
    columns = "keys" if trace.context_tokens is None else "context tokens"
    if report.every_block:
        parts.append(
            Text(
                f"attention heatmaps of every block: rows = queries, columns = {columns} in "
                "the rows' order, one cell a key; a block's heads side by side",
                style="bold",
            )
        )
        drawn, notes = block_tiles(report.traces, report.heads, width, color)
    else:
        parts.append(Text(f"attention heatmaps: rows = queries, columns = {columns}", style="bold"))
        drawn, notes = trace_heatmaps(trace, report.heads, width, color)
    parts.extend(drawn)
    traces = report.traces if report.every_block else [trace]
    parts.append(legend(color, width, trace_key_counts(traces)))
    parts.extend(Text(note, style="dim") for note in notes)
    if report.every_block:
        hint = f"one block's heads at full size: --layer N (0–{len(report.traces) - 1})"
        parts.append(Text(hint, style="dim"))
    return Group(*parts)
