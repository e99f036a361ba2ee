"""``run --view heatmap``: each head's attention matrix as cells, for when numbers are too many.

In colour, a line holds two query rows: ``▀`` with the upper row's colour as foreground and
the lower row's as background. Without colour (``NO_COLOR``, piped output) each cell is one
shade character of :data:`SHADE_CHARS`, one line per query row. A key takes one to
:data:`MAX_CELL_WIDTH` cells (few keys: wider). Columns are keys; when the
keys outnumber the columns, each column is the maximum of a bucket of keys (and the view
says so). Only the rows computed are drawn (long inputs compute some rows only).
"""

from __future__ import annotations

from rich.cells import cell_len
from rich.color import Color
from rich.console import Group, RenderableType
from rich.style import Style
from rich.text import Text

from attnctl.render.terminal_run import _run_opening
from attnctl.render.text import token_label
from attnctl.report import RunReport, TextWindow
from attnctl.trace import Token, Trace

UPPER_HALF = "▀"
SHADE_CHARS = " ░▒▓█"  # weight 0 (a masked key or padding), then darker to lighter as it grows
KEY_LABEL_CELLS = 6  # longest key token label on top before it is shortened
QUERY_LABEL_CELLS = 8  # longest query token label at the left
MAX_CELL_WIDTH = 3  # cells a key takes when few keys leave room
_LOW, _HIGH = (24, 24, 32), (40, 110, 235)  # the weight tables' shades: dark 0, blue 1
_STEPS = 32
LEGEND_WEIGHTS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0)


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


def key_buckets(keys: int, columns: int) -> list[tuple[int, int]]:
    """Split keys 0..keys-1 into at most ``columns`` contiguous buckets [start, end)."""
    count = min(keys, max(1, columns))
    return [(keys * c // count, keys * (c + 1) // count) for c in range(count)]


def _runs(rows: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """The computed rows as runs of consecutive query positions."""
    runs: list[list[tuple[int, int]]] = []
    for index, row in rows:
        if runs and row == runs[-1][-1][1] + 1:
            runs[-1].append((index, row))
        else:
            runs.append([(index, row)])
    return runs


def _placed(labels: list[tuple[int, str]], offset: int, width: int) -> str:
    """Labels at their columns from the left, each where it fits after the previous and a gap."""
    line, position = "", 0
    for column, label in labels:
        start = offset + column
        if line and start < position + 1:
            continue
        if start < position or start + cell_len(label) > width:
            continue
        line += " " * (start - position) + label
        position = start + cell_len(label)
    return line


def _ranges_text(ranges: list[tuple[int, int]]) -> str:
    return ", ".join(f"{a}–{b}" if a != b else str(a) for a, b in ranges)


def head_heatmap(
    trace: Trace, window: TextWindow, head: int, width: int, color: bool
) -> list[RenderableType]:
    """One head's matrix for one text: title, key labels, rows of cells, pooling note."""
    batch_row, computed = window.batch_row, window.computed
    tokens = trace.tokens[batch_row]
    keys: list[Token] = tokens if trace.context_tokens is None else trace.context_tokens[batch_row]
    head_index = trace.attention_heads.index(head)
    matrix = trace.attention[batch_row][head_index]
    batched = len(trace.tokens) > 1
    title = Text(f"head {head}" + (f" · text {batch_row}" if batched else ""), style="bold")
    runs = _runs(computed)
    position_cells = len(str(computed[-1][1]))

    def query_label(rows: list[int]) -> str:
        positions = "/".join(str(r) for r in rows)
        names = "/".join(shortened(token_label(tokens[r]), QUERY_LABEL_CELLS // len(rows))
                         for r in rows)  # fmt: skip
        return f"{positions} {names}"

    lines_rows = [
        [r for _, r in run[i : i + (2 if color else 1)]]
        for run in runs
        for i in range(0, len(run), 2 if color else 1)
    ]
    label_cells = max(cell_len(query_label(rows)) for rows in lines_rows)
    label_cells = min(label_cells, max(position_cells * 2 + 2, width // 3))
    columns = max(1, width - label_cells - 2)  # "label│cells"
    buckets = key_buckets(window.keys, columns)
    pooled = len(buckets) < window.keys
    # few keys: each as wide as it can be, up to 3 cells (a CJK label and a gap)
    cell = max(1, min(MAX_CELL_WIDTH, columns // len(buckets)))
    offset = label_cells + 1

    key_positions = [(c * cell, str(start)) for c, (start, _) in enumerate(buckets)]
    key_names = [
        (c * cell, shortened(token_label(keys[start]), KEY_LABEL_CELLS))
        for c, (start, _) in enumerate(buckets)
    ]
    corner = "key" if trace.context_tokens is None else "context"
    corner_label = shortened(corner, label_cells).rjust(label_cells) + " "
    head_lines = [
        Text(corner_label + _placed(key_positions, 0, width - offset), style="dim"),
        Text(" " * offset + _placed(key_names, 0, width - offset)),
    ]

    def cell_weight(row_index: int, bucket: tuple[int, int]) -> float:
        start, end = bucket
        return max(matrix[row_index][start:end])  # an array slice: C speed for 8k keys

    index_of = dict((r, i) for i, r in computed)
    body: list[Text] = []
    for n, rows in enumerate(lines_rows):
        if n and rows[0] != lines_rows[n - 1][-1] + 1:
            gap = (lines_rows[n - 1][-1] + 1, rows[0] - 1)
            body.append(Text(f"⋮ query rows {_ranges_text([gap])} not computed", style="dim"))
        label = shortened(query_label(rows), label_cells)
        line = Text(" " * (label_cells - cell_len(label)) + label + "│", no_wrap=True)
        for bucket in buckets:
            upper = cell_weight(index_of[rows[0]], bucket)
            if not color:
                line.append(shade_char(upper) * cell)
                continue
            lower = cell_weight(index_of[rows[1]], bucket) if len(rows) > 1 else None
            style = Style(
                color=weight_color(upper),
                bgcolor=None if lower is None else weight_color(lower),
            )
            line.append(UPPER_HALF * cell, style=style)
        body.append(line)
    notes = []
    if pooled:
        sizes = sorted({end - start for start, end in buckets})
        size = "–".join(str(s) for s in sizes) if len(sizes) > 1 else str(sizes[0])
        notes.append(
            Text(
                f"{window.keys} keys in {len(buckets)} columns: each column is the max of "
                f"{size} keys (labelled by its first key)",
                style="dim",
            )
        )
    return [title, *head_lines, *body, *notes, Text("")]


def legend(color: bool, width: int) -> Text:
    """Colour (or shade character) → weight."""
    if not color:
        bounds = _shade_bounds()
        parts = [f"'{SHADE_CHARS[0]}' 0", f"{SHADE_CHARS[1]} <{bounds[0]:.2f}"]
        for level in range(2, len(SHADE_CHARS)):
            upper = bounds[level - 1] if level - 1 < len(bounds) else None
            low = f"{bounds[level - 2]:.2f}"
            span = f"{low}–{upper:.2f}" if upper is not None else f"≥{low}"
            parts.append(f"{SHADE_CHARS[level]} {span}")
        return Text("legend: " + " · ".join(parts) + " (weight; one line a query row)")
    text = Text("legend: ")
    for weight in LEGEND_WEIGHTS:
        text.append("██", style=Style(color=weight_color(weight)))
        text.append(f" {weight:g}  ")
    text.append("(weight, square-root scale; ▀: upper half the upper row, lower half the next)")
    return text


def heatmap_view(report: RunReport, width: int, color: bool) -> Group:
    """``run --view heatmap``: the header, then each shown head's matrix per text."""
    trace = report.trace
    parts: list[RenderableType] = list(
        _run_opening(report.texts, trace, report.plan, report.contexts, trace.layer)[:2]
    )
    parts.append(
        Text(
            "attention heatmaps: rows = queries, columns = "
            + ("keys" if trace.context_tokens is None else "context tokens"),
            style="bold",
        )
    )
    notes: list[str] = []
    for window in report.windows:
        if not window.computed:
            notes.append(
                f"text {window.batch_row}: none of its {window.queries} tokens is among the "
                "rows computed"
            )
            continue
        if window.hidden:
            note = (
                f"query rows {_ranges_text(window.hidden)} not computed; choose rows with "
                "--rows A:B or last:N"
            )
            if note not in notes:
                notes.append(note)
        for head in report.heads:
            parts.extend(head_heatmap(trace, window, head, width, color))
    parts.append(legend(color, width))
    parts.extend(Text(note, style="dim") for note in notes)
    return Group(*parts)
