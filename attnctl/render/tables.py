"""Tables that never cut a value, and the tables every view shares (stages, headers)."""

from __future__ import annotations

from collections.abc import Iterator

from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from attnctl.memory.estimate import format_bytes
from attnctl.render.text import WIDE, shape_text
from attnctl.stages.plan import Plan
from attnctl.trace import Stage


class FittingTable(Table):
    """A table that never cuts a value: too narrow for it, it stacks its rows instead.

    Columns marked ``no_wrap`` keep their full width; the others wrap at spaces, down to
    their longest word (give a table at most one such column: rich shrinks several
    unevenly). When even that does not fit, each row becomes its label (the first cell,
    or ``#`` and the next) followed by one ``heading  value`` line per cell, every value
    whole; one too long for a line goes under its heading and wraps at its spaces.
    """

    def needed_width(self, console: Console, options: ConsoleOptions) -> int:
        """The narrowest width that shows every cell without cutting or breaking a word."""
        wide = options.update_width(UNBOUNDED)
        natural_width = super().__rich_measure__(console, wide).maximum
        slack = 0
        for column in self.columns:
            if column.no_wrap or column.width is not None:
                continue
            cells = [*([column.header] if self.show_header else []), *column.cells]
            measured = [Measurement.get(console, wide, cell) for cell in cells]
            if measured:
                narrowest = max([m.minimum for m in measured] + [column.min_width or 0])
                slack += max(0, max(m.maximum for m in measured) - narrowest)
        return natural_width - slack

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        natural = super().__rich_measure__(console, options.update_width(UNBOUNDED)).maximum
        needed = self.needed_width(console, options)
        return Measurement(min(needed, options.max_width), min(natural, options.max_width))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if self.needed_width(console, options) <= options.max_width:
            yield from super().__rich_console__(console, options)
        else:
            yield from self._stacked(options.max_width)

    def _stacked(self, width: int) -> Iterator[RenderableType]:
        if self.title:
            yield _cell_text(self.title, style=self.title_style or "table.title")
        headings = [_cell_text(c.header).plain.replace("\n", " ") for c in self.columns]
        if not self.show_header:
            headings = [""] * len(headings)
        labels = 2 if headings[:1] == ["#"] else 1
        columns = [list(column.cells) for column in self.columns]
        for row in range(self.row_count):
            cells = [_cell_text(column[row]) for column in columns]
            label = Text(" ").join(cell for cell in cells[:labels] if cell.plain.strip())
            if labels == 1 and headings[0] and label.plain.isdigit():  # "head 3", not "3"
                label = Text(f"{headings[0]} ") + label
            label.stylize("bold")
            yield label
            pairs = zip(headings[labels:], cells[labels:], strict=True)
            shown = [(heading, cell) for heading, cell in pairs if cell.plain.strip()]
            key_width = max((cell_len(h) for h, _ in shown), default=0)
            for heading, value in shown:
                value_width = max(cell_len(line) for line in value.plain.split("\n"))
                prefixes = (
                    [f"  {heading.ljust(key_width)}  ", f"  {heading}  "] if heading else ["  "]
                )
                prefix = next((p for p in prefixes if len(p) + value_width <= width), None)
                if "\n" not in value.plain and prefix is not None:
                    yield Text(prefix) + value
                    continue
                if heading:
                    yield Text(f"  {heading}")
                longest_word = max(cell_len(word) for word in value.plain.split())
                fits = [i for i in (4, 2) if i + value_width <= width]  # on one line
                fits += [i for i in (2,) if i + longest_word <= width]  # wrapped at spaces
                indent = (fits or [0])[0]
                yield Padding(value, (0, 0, 0, indent))
        if self.caption:
            yield _cell_text(self.caption, style=self.caption_style or "table.caption")


UNBOUNDED = 10**6  # a width to measure what a table needs when nothing limits it


def _cell_text(cell: RenderableType, style: str = "") -> Text:
    """A table cell as Text: strings are our own markup, Text (user text) stays as it is."""
    text = cell.copy() if isinstance(cell, Text) else Text.from_markup(str(cell), emoji=False)
    if style:
        text.stylize(style)
    return text


def titled_table(title: str) -> Table:
    return FittingTable(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
        title=title,
        title_justify="left",
    )


# ---------------------------------------------------------------- stage tables


def stage_table(stages: list[Stage], width: int, plan: Plan, show_device: bool = True) -> Table:
    """One row per stage: name, named dims, shape, dtype, (device), bytes, (what).

    Every value stays whole. Where the width asks for it, "view of weighted_values" wraps
    at its space, and a device shared by every stage moves from its column into the
    caption; a terminal narrower still gets the rows stacked (see :class:`FittingTable`).
    Wide terminals add "what", a line on each stage, wrapped.
    """
    what = {s.name: s.what for s in plan.stages}
    sizes = [f"view of {s.view_of}" if s.view_of else format_bytes(s.bytes) for s in stages]
    devices = {stage.device for stage in stages}

    def layout(device: bool) -> tuple[list[str], list[list[str]]]:
        headings = ["#", "stage", "dims", "shape", "dtype", *(["device"] if device else [])]
        rows = []
        for i, (stage, size) in enumerate(zip(stages, sizes, strict=True)):
            row = [str(i), stage.name, " ".join(stage.dims), shape_text(stage.shape)]
            rows.append([*row, stage.dtype, *([stage.device] if device else []), size])
        return [*headings, "bytes"], rows

    def natural(headings: list[str], rows: list[list[str]], wrapped: bool = False) -> int:
        widths = [max([len(h)] + [len(row[n]) for row in rows]) for n, h in enumerate(headings)]
        if wrapped:  # the bytes column as narrow as its longest size or word of a view
            widths[-1] = max([len("bytes")] + [len(w) for size in sizes for w in size.split()])
            widths[-1] = max([widths[-1]] + [len(size) for size in sizes if "view" not in size])
        return sum(widths) + 2 * len(widths)  # and rich's spaces between and around columns

    headings, rows = layout(show_device)
    shared_device = show_device and len(devices) == 1 and natural(headings, rows, True) > width
    if shared_device:  # stated once below the table instead of on every row
        headings, rows = layout(False)
    longest_what = max((len(word) for s in plan.stages for word in s.what.split()), default=0)
    explain = width >= WIDE and natural(headings, rows) + longest_what + 2 <= width
    table = titled_table("stages")
    for name in headings[:-1]:
        table.add_column(name, justify="right" if name == "#" else "left", no_wrap=True)
    # one column wraps (rich shrinks several unevenly): "what" when shown, else bytes,
    # never narrower than a size such as "1023.99 MiB"
    size_width = max([len(size) for size in sizes if "view" not in size], default=0)
    table.add_column("bytes", justify="right", no_wrap=explain, min_width=size_width)
    if explain:
        table.add_column("what")
    for stage, row in zip(stages, rows, strict=True):
        table.add_row(*row, *([what.get(stage.name, "")] if explain else []))
    if shared_device:
        table.caption = f"every stage on {next(iter(devices))}"
        table.caption_justify = "left"
    return table


def header(title: str, rows: list[tuple[str, str]]) -> Table:
    grid = FittingTable.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    for key, value in rows:
        grid.add_row(key, Text(value))
    grid.title = title
    grid.title_justify = "left"
    grid.title_style = "bold"
    return grid


def size_grid(title: str = "") -> Table:
    """Rows of three cells: what, how many bytes, why."""
    grid = FittingTable.grid(padding=(0, 2))
    if title:
        grid.title, grid.title_justify, grid.title_style = title, "left", "bold"
    grid.add_column(no_wrap=True)
    grid.add_column(justify="right", no_wrap=True)
    grid.add_column()
    return grid
