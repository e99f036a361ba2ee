"""Rich renderables and JSON documents from plans, traces and memory estimates.

Nothing here computes attention or prints: functions take data and return
renderables (or dicts) that ``cli`` prints. Every piece of user text goes through
:func:`printable` and into a ``Text`` object, so ``[red]`` stays literal and control
characters show as escapes.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from rich import box
from rich.cells import cell_len
from rich.color import Color
from rich.columns import Columns
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.padding import Padding
from rich.style import Style
from rich.table import Table
from rich.text import Text

from attnctl.config import DTYPE_BYTES, DTYPES, LayerConfig
from attnctl.memory import (
    MemoryEstimate,
    MemoryReport,
    format_bytes,
    longest_input,
    variant_table,
)
from attnctl.plan import MASK_CONVENTION, Plan
from attnctl.stats import PATTERNS, HeadStats, head_stats
from attnctl.trace import Stage, Token, Trace
from attnctl.training import TrainingEstimate
from attnctl.window import hidden_ranges

if TYPE_CHECKING:  # measure.py and check.py import torch; render only reads their results
    from attnctl.check import CheckResult
    from attnctl.measure import Measurement as Measured

LABEL_WIDTH = 10  # longest token label in weight tables before it is shortened
MAX_TEXT = 200  # characters of the input shown in the header
WIDE = 120  # from this width on, stage tables add a column explaining each stage


# ---------------------------------------------------------------- text helpers


def printable(text: str) -> str:
    """User text made safe to show: control and format characters become escapes."""
    out = []
    for char in text:
        if unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp"):
            out.append(char.encode("unicode_escape").decode("ascii"))
        else:
            out.append(char)
    return "".join(out)


def token_label_text(text: str, width: int = LABEL_WIDTH) -> str:
    label = printable(text)
    if label.strip() == "":
        label = label.replace(" ", "␣") or "∅"
    return label if len(label) <= width else label[: width - 1] + "…"


def token_label(token: Token, width: int | None = None) -> str:
    return token_label_text(token.text, width or 10**6)


def shape_text(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def config_line(config: LayerConfig) -> str:
    kv = f", kv {config.kv_heads}" if config.kv_heads != config.heads else ""
    return (
        f"d_model {config.d_model} · heads {config.heads} (d_k {config.d_k}{kv}) · "
        f"pos {config.pos} · mask {config.mask} · norm {config.norm}"
        f"{' (rms)' if config.norm_type == 'rms' and config.norm != 'none' else ''} · "
        f"impl {config.impl} · bias {_bias_text(config)}"
    )


def _bias_text(config: LayerConfig) -> str:
    if not config.bias:
        return "off"
    return "on" if config.output_bias else "on (not W_o)"


def sizes_line(plan: Plan) -> str:
    grouped = plan.sizes["Hkv"] != plan.sizes["H"]  # K/V widths only matter under GQA
    shown = {k: v for k, v in plan.sizes.items() if grouped or k not in ("Hkv", "D_kv")}
    return "  ".join(f"{k}={v}" for k, v in shown.items())


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


def _table(title: str) -> Table:
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
    table = _table("stages")
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


# ---------------------------------------------------------------- run


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


def token_table(tokens: list[Token], rows: list[int], title: str = "tokens") -> Table:
    """The tokens of the query rows computed (all of them for short inputs), padding marked."""
    table = _table(title)
    table.add_column("pos", justify="right", no_wrap=True)
    table.add_column("id", justify="right", no_wrap=True)
    table.add_column("token", no_wrap=True)
    table.add_column("chars", no_wrap=True)
    table.add_column("note")
    previous = -1
    for i in rows:
        if i > previous + 1:
            table.add_row("⋮", "", "", "", f"tokens {previous + 1}–{i - 1} not listed")
        previous = i
        token = tokens[i]
        note = f"piece {token.piece}/{token.pieces} of one character" if token.pieces > 1 else ""
        chars = f"{token.start}:{token.end}"
        if token.pad:
            note, chars = "padding: weight 0 as a key", "—"
        table.add_row(str(i), str(token.id), Text(token_label(token)), chars, note)
    if previous < len(tokens) - 1:
        table.add_row("⋮", "", "", "", f"tokens {previous + 1}–{len(tokens) - 1} not listed")
    return table


def weight_text(weight: float, digits: int) -> str:
    """Fixed decimals, unless that would print a non-zero weight as 0.00 (then 3.1e-04)."""
    if weight == 0 or weight >= 0.5 * 10**-digits:
        return f"{weight:.{digits}f}"
    return f"{weight:.1e}"


def _shade(weight: float) -> Style:
    """Dark for 0, bright blue for 1 (sqrt, so small weights still show), in 32 steps."""
    return _SHADES[round(max(0.0, min(1.0, weight)) ** 0.5 * (len(_SHADES) - 1))]


def _shades(steps: int = 32) -> list[Style]:
    low, high = (24, 24, 32), (40, 110, 235)
    styles = []
    for step in range(steps):
        t = step / (steps - 1)
        rgb = tuple(int(a + (b - a) * t) for a, b in zip(low, high, strict=True))
        styles.append(Style(bgcolor=Color.from_rgb(*rgb), color="white"))
    return styles


_SHADES = _shades()


def weight_tables(
    trace: Trace, heads: list[int], width: int, digits: int = 2, batch_row: int = 0
) -> tuple[list[Table], list[str], bool]:
    """One table per head: rows = query tokens, columns = key tokens, row maximum marked *.

    When the keys do not fit the width, each row lists its strongest keys instead (the
    returned flag says so: those tables are as wide as the terminal).
    """
    tokens = trace.tokens[batch_row]  # the queries
    keys = tokens if trace.context_tokens is None else trace.context_tokens[batch_row]
    queries = sum(not t.pad for t in tokens)  # this text's own tokens; padding follows them
    count = sum(not t.pad for t in keys)
    computed = [(i, r) for i, r in enumerate(trace.attention_rows) if r < queries]
    if not computed:
        note = f"text {batch_row}: none of its {queries} tokens is among the rows computed"
        return [], [note], False
    rows = [r for _, r in computed]
    cell = digits + 3  # "0.28*"
    label_width = min(LABEL_WIDTH, max(len(token_label(tokens[r])) for r in rows))
    label_width += len(str(rows[-1])) + 1
    fit = max(1, (width - label_width - 2) // (cell + 1))
    notes = []
    gaps = hidden_ranges(rows, queries)
    if gaps:
        hidden = ", ".join(f"{a}–{b}" if a != b else str(a) for a, b in gaps)
        notes.append(f"query rows {hidden} not computed; choose rows with --rows A:B or last:N")
    top_k = None
    if count > fit:
        top_width = len(str(count - 1)) + 1 + 6 + 1 + max(digits + 2, 7)  # "1523 token 3.1e-04"
        # (keys are the context's tokens in cross-attention)
        top_k = min(
            len(trace.top_keys[0][0][0]), max(1, (width - label_width - 2) // (top_width + 1))
        )
        notes.append(
            f"{count} keys do not fit {width} columns: each row shows its {top_k} strongest "
            "keys as 'position token weight'"
        )

    def label(i: int) -> str:
        return f"{i} {token_label(tokens[i], LABEL_WIDTH)}"

    tables = []
    for head in heads:
        head_index = trace.attention_heads.index(head)
        matrix = trace.attention[batch_row][head_index]
        batch_label = f" · text {batch_row}" if len(trace.tokens) > 1 else ""
        table = _table(f"head {head}{batch_label}")
        corner = "query \\ key" if trace.context_tokens is None else "query \\ context"
        table.add_column(Text(corner), no_wrap=True)
        if top_k is None:
            for key in range(count):
                header_text = f"{key}\n{token_label(keys[key], cell)}"
                table.add_column(Text(header_text), justify="right", no_wrap=True, min_width=cell)
        else:
            for rank in range(top_k):
                table.add_column(f"top {rank + 1}", no_wrap=True)
        for row_index, query in computed:
            weights = matrix[row_index]
            cells: list[RenderableType] = [Text(label(query))]
            if top_k is None:
                best = max(range(count), key=weights.__getitem__)
                for key in range(count):
                    mark = "*" if key == best else " "
                    text = f"{weight_text(weights[key], digits)}{mark}"
                    cells.append(Text(text, style=_shade(weights[key])))
            else:
                ranked = trace.top_keys[batch_row][head_index][row_index]
                # no padding, and no key a mask gave exactly 0 (a causal row's later keys)
                strongest = [key for key in ranked if key < count and weights[key] > 0][:top_k]
                for key in strongest:
                    text = f"{key} {token_label(keys[key], 6)} {weight_text(weights[key], digits)}"
                    cells.append(Text(text, style=_shade(weights[key])))
            table.add_row(*cells)
        tables.append(table)
    return tables, notes, top_k is not None


def _size_grid(title: str = "") -> Table:
    """Rows of three cells: what, how many bytes, why."""
    grid = FittingTable.grid(padding=(0, 2))
    if title:
        grid.title, grid.title_justify, grid.title_style = title, "left", "bold"
    grid.add_column(no_wrap=True)
    grid.add_column(justify="right", no_wrap=True)
    grid.add_column()
    return grid


def memory_footer(estimate: MemoryEstimate) -> Table:
    grid = _size_grid("memory")
    grid.add_row(
        "parameters",
        format_bytes(estimate.parameter_bytes),
        f"{estimate.parameters:,} values",
    )
    grid.add_row(
        "activations",
        format_bytes(estimate.activation_bytes),
        "every stage that allocates, summed",
    )
    matrices = estimate.scores_bytes + estimate.weights_bytes
    grid.add_row(
        "attention matrices",
        format_bytes(matrices),
        f"scores {format_bytes(estimate.scores_bytes)} + weights "
        f"{format_bytes(estimate.weights_bytes)} (B·H·L·L each)"
        if matrices
        else "none: sdpa builds no B·H·L·L matrix",
    )
    grid.add_row(
        "peak",
        format_bytes(estimate.peak_bytes),
        f"parameters + activations alive at once (largest at {estimate.peak_stage})",
    )
    return grid


def _run_opening(
    texts: list[str],
    trace: Trace,
    plan: Plan,
    contexts: list[str] | None = None,
    block: int | None = None,
) -> list[RenderableType]:
    """The header (texts, tokenizer, model and block, layer, device) and the token tables."""
    config = plan.config
    lines = []
    for label, items in (("text", texts), ("context", contexts or [])):
        if len(set(items)) == 1 and label == "context":
            items = items[:1]  # one context serves every text
        for number, item in enumerate(items):
            lines.append((label if len(items) == 1 else f"{label} {number}", _shown_text(item)))
    how = "every weight built" if trace.impl == "math" else "weights only for the rows shown"
    seed = f" · seed {config.seed}" if plan.model is None else ""  # a model's weights are its own
    batched = len(texts) > 1
    tables = [
        token_table(row, trace.attention_rows, f"tokens · text {b}" if batched else "tokens")
        for b, row in enumerate(trace.tokens)
    ]
    for b, row in enumerate(trace.context_tokens or []):
        tables.append(
            token_table(row, list(range(len(row))), f"context · text {b}" if batched else "context")
        )
    return [
        header(
            "attnctl run",
            [
                *lines,
                ("tokenizer", f"{trace.tokenizer} (vocab {trace.vocab_size})"),
                *model_lines(plan, block),
                ("layer", config_line(config)),
                ("device", f"{trace.device} · dtype {config.dtype}{seed}"),
                ("attention", f"{trace.impl} ({how})"),
            ],
        ),
        Text(""),
        *tables,
    ]


def run_view(
    texts: list[str],
    trace: Trace,
    plan: Plan,
    estimate: MemoryEstimate,
    heads: list[int],
    width: int,
    digits: int = 2,
    contexts: list[str] | None = None,
) -> Group:
    config = plan.config
    parts: list[RenderableType] = [
        *_run_opening(texts, trace, plan, contexts, trace.layer),
        stage_table(trace.stages, width, plan),
    ]
    if config.mask == "causal":
        parts.append(Text(f"mask: {MASK_CONVENTION}", style="dim"))
    key_rows = trace.context_tokens or trace.tokens
    if any(t.pad for row in key_rows for t in row):
        if "padding_mask" in {s.name for s in trace.stages}:
            parts.append(
                Text(
                    f"padding_mask: {MASK_CONVENTION}; nn.MultiheadAttention's key_padding_mask "
                    "is its negation (True = padding). Padded keys get weight 0.",
                    style="dim",
                )
            )
        else:
            parts.append(
                Text(
                    "padding needs no mask here: with padding on the right, the causal mask "
                    "never lets a real token see it.",
                    style="dim",
                )
            )
    tables, notes, ranked = [], [], False
    for batch_row in range(len(trace.tokens)):
        row_tables, row_notes, row_ranked = weight_tables(trace, heads, width, digits, batch_row)
        ranked = ranked or row_ranked
        tables += row_tables
        notes += [note for note in row_notes if note not in notes]
    parts.append(
        Text(
            "attention weights: rows = queries, columns = keys, each row sums to 1, "
            "* = row maximum",
            style="bold",
        )
    )
    # side by side when they fit; top-k tables span the width, so Columns would only cost time
    parts.append(Group(*tables) if ranked else Columns(tables, padding=(0, 3)))
    parts.extend(Text(note, style="dim") for note in notes)
    parts.append(Text(""))
    parts.append(heads_overview(head_stats(trace), len(texts) > 1))
    parts.append(Text(""))
    parts.append(memory_footer(estimate))
    return Group(*parts)


def model_lines(plan: Plan, layer: int | None = None) -> list[tuple[str, str]]:
    """Header lines naming a pretrained model (none for attnctl's own layer)."""
    model = plan.model
    if model is None:
        return []
    where = f" · block {layer}" if layer is not None else ""
    return [("model", f"{printable(str(model.path))}{where}"), ("config", model.summary())]


def _strength(s: HeadStats) -> float:
    return max((getattr(s, p) or 0.0) for p in PATTERNS)


def heads_overview(
    stats: list[HeadStats], batched: bool, limit: int | None = None, title: str = ""
) -> Table:
    """Every computed head in one table (or the ``limit`` first), the most clear-cut first."""
    table = _table(title or "heads at a glance (most clear-cut first)")
    layered = len({s.layer for s in stats}) > 1
    headings = ["text"] if batched else []
    headings += ["layer"] if layered else []
    headings += ["head", "kind", "entropy", "top key", "prev", "first", "diag", "same", "induct"]
    for name in headings:
        table.add_column(
            name, no_wrap=True, justify="left" if name in ("kind", "top key") else "right"
        )

    for s in sorted(stats, key=_strength, reverse=True)[:limit]:
        cells = [str(s.batch_row)] if batched else []
        cells += [str(s.layer)] if layered else []
        cells += [
            str(s.head),
            s.kind,
            f"{s.entropy_fraction:.0%}",
            Text(f"{s.top_key} {token_label_text(s.top_key_text)}"),
            *(("—" if getattr(s, p) is None else f"{getattr(s, p):.2f}") for p in PATTERNS),
        ]
        table.add_row(*cells)
    table.caption = (
        "entropy: of the most possible (100% = uniform); prev = i-1, first = key 0, "
        "diag = itself, same = earlier copies, induct = the token after an earlier copy"
    )
    table.caption_justify = "left"
    return table


def blocks_view(
    texts: list[str], traces: list[Trace], plan: Plan, estimate: MemoryEstimate, width: int
) -> Group:
    """``run --model --layer all``: every block's heads summarised, then the clearest heads."""
    first = traces[0]
    batched = len(texts) > 1
    parts = _run_opening(texts, first, plan)
    table = _table("every block (heads by kind)")
    for name in ("layer", "entropy", "kinds", "clearest head"):
        table.add_column(name, no_wrap=True, justify="right" if name == "entropy" else "left")
    every: list[HeadStats] = []
    by_layer: list[list[HeadStats]] = []
    for trace in traces:
        stats = head_stats(trace)
        every += stats
        by_layer.append([s for s in stats if s.batch_row == 0])
        kinds: dict[str, int] = {}
        for s in stats:
            kinds[s.kind] = kinds.get(s.kind, 0) + 1
        best = max(stats, key=_strength)
        entropy = sum(s.entropy_fraction for s in stats) / len(stats)
        table.add_row(
            str(trace.layer),
            f"{entropy:.0%}",
            " · ".join(f"{kind} {count}" for kind, count in sorted(kinds.items())),
            f"head {best.head}: {best.kind} {_strength(best):.2f}",
        )
    table.caption = "entropy: mean over heads, of the most possible (100% = uniform)"
    table.caption_justify = "left"
    clearest = heads_overview(every, batched, limit=10, title="the 10 most clear-cut heads")
    hint = f"weights and stages of one block: --layer N (0–{len(traces) - 1})"
    head_map = heads_map(by_layer, first.attention_heads, width, "text 0" if batched else "")
    parts += [table, Text(""), *head_map, Text(""), clearest, Text(hint, style="dim"), Text("")]
    parts.append(memory_footer(estimate))
    return Group(*parts)


KIND_MARKS = {"previous": "P", "first": "F", "diagonal": "D", "same_token": "S",
              "induction": "I", "mixed": "·", "diffuse": "~"}  # fmt: skip
CLEAR = 0.7  # a pattern holding this much weight: the mark is bold


def heads_map(
    by_layer: list[list[HeadStats]], heads: list[int], width: int, which: str = ""
) -> list[RenderableType]:
    """One mark per head and block, its kind: the whole model at a glance.

    Too many heads for the width: one character a head, numbered every fifth; still too
    many: the heads are shown in slices that fit, one after the other.
    """
    cell = len(str(max(heads))) + 1
    label = len(str(len(by_layer) - 1)) + 7  # "layer 11 "
    compact = label + cell * len(heads) > width
    if compact:  # one character a head, numbered every fifth
        cell = 1
    per_slice = max(1, (width - label) // cell)
    lines = Text()
    for first in range(0, len(heads), per_slice):
        shown = range(first, min(first + per_slice, len(heads)))  # positions of the heads
        ruler = [" "] * (cell * len(shown))
        for position in shown:
            number = str(heads[position])
            start = (position - first) * cell
            end = start + len(number)
            free = end <= len(ruler) and all(c == " " for c in ruler[max(0, start - 1) : end + 1])
            if (not compact or heads[position] % 5 == 0) and free:
                ruler[start:end] = number
        if first:
            lines.append("\n")
        lines.append("head".rjust(label - 1) + " " + "".join(ruler).rstrip() + "\n")
        for layer, stats in enumerate(by_layer):
            lines.append(f"layer {layer:>{label - 7}} ")
            for position in shown:
                s = stats[position]
                strength = _strength(s)
                style = "bold" if strength >= CLEAR else "" if s.kind in PATTERNS else "dim"
                mark = KIND_MARKS[s.kind]
                lines.append(mark if position == shown[-1] else mark.ljust(cell), style=style)
            lines.append("\n")
    lines.rstrip()
    title = "heads by block" + (f" ({which})" if which else "")
    legend = "  ".join(f"{mark} {kind.replace('_', ' ')}" for kind, mark in KIND_MARKS.items())
    return [
        Text(title, style="bold"),
        lines,
        Text(f"{legend}; bold: the pattern holds {CLEAR:.0%} of the weight", style="dim"),
    ]


def _shown_text(text: str) -> str:
    shown = printable(text)
    if len(shown) > MAX_TEXT:
        shown = f"{shown[:MAX_TEXT]}… ({len(text):,} characters in all)"
    return shown


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


def memory_view(
    reports: list[MemoryReport],
    width: int,
    fits: dict[str, dict[str, int]] | None = None,
    budget: int | None = None,
) -> Group:
    """One length in detail, or several side by side with a bar chart; then what fits."""
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
        parts += [Text(""), _fit_table(fits, budget, first)]
    return Group(*parts)


def _one_length(report: MemoryReport) -> list[RenderableType]:
    plan, estimate, measured = report.plan, report.estimate, report.measured
    # a forward measurement has a peak per stage; a training step's is compared below
    per_stage = measured if measured is not None and report.training is None else None
    config, sizes = plan.config, plan.sizes
    element = DTYPE_BYTES[config.dtype]
    params = _table("parameters")
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
    stages = _table("activations" + when)
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

    summary = _size_grid()
    b, h, length, d_k = sizes["B"], sizes["H"], sizes["L"], sizes["d_k"]
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
    layers = plan.model.layers if plan.model is not None else estimate.layers
    stack = f"·{layers} layers" if layers > 1 else ""
    kv_heads, kv_name = sizes["Hkv"], "Hkv" if sizes["Hkv"] != h else "H"
    summary.add_row(
        "KV cache",
        format_bytes(report.kv_cache_bytes),
        f"K and V for N = {report.kv_cache_tokens} tokens: 2·B·N·{kv_name}·d_k·{element}{stack} = "
        f"2·{b}·{report.kv_cache_tokens}·{kv_heads}·{d_k}·{element} bytes{stack}",
    )
    training = report.training
    if measured is not None and training is None:
        summary.add_row(
            "measured peak",
            format_bytes(measured.peak_bytes),
            f"on {measured.device} by {measured.method}; estimate "
            f"{_percent(estimate.peak_bytes, measured.peak_bytes)} vs measured",
        )

    variants = _table("by dtype and implementation")
    columns = ("dtype", "parameters", "attention matrix", "peak (math)", "peak (sdpa)")
    for name in columns:
        variants.add_column(name, justify="left" if name == "dtype" else "right", no_wrap=True)
    table = variant_table(plan, estimate.layers)
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
    grid = _size_grid("training step (forward, loss.backward(), Adam.step())")
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
        "what one layer keeps when its forward ends",
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


def bar_parts(report: MemoryReport) -> list[int]:
    """The peak split into parameters, B·H·L·L matrices, other activations; then KV cache."""
    estimate = report.estimate
    matrices = min(estimate.scores_bytes + estimate.weights_bytes, estimate.peak_activation_bytes)
    other = estimate.peak_activation_bytes - matrices
    return [estimate.parameter_bytes, matrices, other, report.kv_cache_bytes]


def _sweep(reports: list[MemoryReport], width: int) -> list[RenderableType]:
    table = _table("by sequence length")
    train = reports[0].training is not None
    headings = ["L", "parameters", "attention matrices", "peak", "KV cache"]
    for name in headings + (["training"] if train else []):
        table.add_column(name, justify="right", no_wrap=True)
    for report in reports:
        params, _, _, cache = bar_parts(report)
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
    totals = [sum(bar_parts(r)) for r in reports]
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
        for (_, char, colour), part in zip(BAR_PARTS, bar_parts(report), strict=True):
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


def _fit_table(fits: dict[str, dict[str, int]], budget: int, first: MemoryReport) -> Table:
    what = "a training step" if first.training is not None else "one forward pass"
    table = _table(f"{what} fits in {format_bytes(budget)}")
    plan = first.plan
    table.add_column("impl", no_wrap=True)
    table.add_column(f"longest L at B={plan.batch}", justify="right", no_wrap=True)
    table.add_column(f"largest B at L={plan.seq_len}", justify="right", no_wrap=True)
    for impl, found in fits.items():
        table.add_row(impl, f"{found['max_seq_len']:,}", f"{found['max_batch']:,}")
    longest = longest_input(plan.config, plan.model)
    if longest and any(found["max_seq_len"] == longest for found in fits.values()):
        table.caption = f"L stops at the {longest:,} learned positions"
        table.caption_justify = "left"
    return table


def _percent(estimated: int, measured: int) -> str:
    return f"{(estimated - measured) / measured * 100:+.2f}%" if measured else "n/a"


def _built(nbytes: int) -> str:
    return "B·H·L·L" if nbytes else "never built (--impl sdpa keeps O(B·H·L) extra)"


# ---------------------------------------------------------------- JSON


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


def blocks_json(traces: list[Trace], plan: Plan, estimate: MemoryEstimate) -> dict[str, Any]:
    """``run --model --layer all``: each block's head statistics and weights."""
    first = traces[0]
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
                "head_stats": [s.to_dict() for s in head_stats(trace)],
                "attention": trace.attention_lists(),
            }
            for trace in traces
        ],
        "memory": memory_dict(estimate),
    }


def run_json(trace: Trace, plan: Plan, estimate: MemoryEstimate) -> dict[str, Any]:
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
        "head_stats": [s.to_dict() for s in head_stats(trace)],
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


def memory_json(
    reports: list[MemoryReport],
    fits: dict[str, dict[str, int]] | None = None,
    budget: int | None = None,
) -> dict[str, Any]:
    """One length: its document. Several: their documents under ``results``."""
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


def _length_json(report: MemoryReport) -> dict[str, Any]:
    plan, estimate, measured = report.plan, report.estimate, report.measured
    stages = []
    for i, (stage, live) in enumerate(zip(plan.stages, estimate.live_bytes, strict=True)):
        entry = {**stage.to_dict(), "live_bytes": live, "scratch_bytes": stage.scratch}
        if measured is not None and measured.stage_peak_bytes:
            entry["measured_live_bytes"] = measured.stage_peak_bytes[i]
        stages.append(entry)
    variants = variant_table(plan, estimate.layers)
    document: dict[str, Any] = {
        "model": model_dict(plan),
        "config": plan.config.to_dict(),
        "seq_len": plan.seq_len,
        "batch": plan.batch,
        "layers": estimate.layers,
        **memory_dict(estimate),
        "kv_cache_tokens": report.kv_cache_tokens,
        "kv_cache_bytes": report.kv_cache_bytes,
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


def difference_bound(difference: float) -> str:
    """A difference as the next power of ten above it (``< 1e-06``); 0 stays ``0``.

    Float noise differs between CPUs (AVX2 and AVX-512 round differently), so the exact
    value is not shown on screen (it is in --json): the bound holds on any machine.
    """
    if difference == 0:
        return "0"
    if not math.isfinite(difference):
        return str(difference)  # nan or inf: nothing to bound
    exponent = math.floor(math.log10(difference)) + 1
    while 10.0**exponent <= difference:  # log10 may round either way at a power of ten
        exponent += 1
    while 10.0 ** (exponent - 1) > difference:
        exponent -= 1
    return f"< 1e{exponent:+03d}"


def check_view(result: CheckResult, plan: Plan) -> Group:
    table = _table("implementations compared (same weights)")
    for name in ("a", "b", "what", "max |a - b|", "tolerance", ""):
        table.add_column(name, no_wrap=True, justify="right" if "|" in name else "left")
    for c in result.comparisons:
        verdict = Text("ok", style="green") if c.ok else Text("FAIL", style="bold red")
        bound = difference_bound(c.max_abs_diff)
        table.add_row(c.a, c.b, c.what, bound, f"{c.tolerance:.0e}", verdict)
    verdict = "ok" if result.gradcheck else "FAIL"
    return Group(
        header(
            "attnctl check",
            [
                ("layer", config_line(plan.config)),
                ("input", f"random token ids {sizes_line(plan)} on {result.device}, "
                          f"{plan.config.dtype}"),
            ],
        ),
        Text(""),
        table,
        Text("max |a - b| is rounded up to a power of ten; the exact values are in --json",
             style="dim"),
        *(Text(f"not compared: {reason}", style="dim") for reason in result.skipped),
        Text(f"gradcheck: {verdict} ({result.gradcheck_note})"),
        Text("all agree" if result.ok else "MISMATCH: see the rows marked FAIL", style="bold"),
    )  # fmt: skip


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
