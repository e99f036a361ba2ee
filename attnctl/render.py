"""Rich renderables and JSON documents from plans, traces and memory estimates.

Nothing here computes attention or prints: functions take data and return
renderables (or dicts) that ``cli`` prints. Every piece of user text goes through
:func:`printable` and into a ``Text`` object, so ``[red]`` stays literal and control
characters show as escapes.
"""

from __future__ import annotations

import heapq
import unicodedata
from typing import TYPE_CHECKING, Any

from rich import box
from rich.color import Color
from rich.columns import Columns
from rich.console import Group, RenderableType
from rich.style import Style
from rich.table import Table
from rich.text import Text

from attnctl.config import DTYPE_BYTES, LayerConfig
from attnctl.memory import MemoryEstimate, dtype_table, format_bytes, kv_cache_bytes
from attnctl.plan import MASK_CONVENTION, Plan
from attnctl.trace import Stage, Token, Trace
from attnctl.window import hidden_ranges

if TYPE_CHECKING:  # measure.py imports torch; render only reads its result
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


def token_label(token: Token, width: int | None = None) -> str:
    label = printable(token.text)
    if label.strip() == "":
        label = label.replace(" ", "␣") or "∅"
    if width is not None and len(label) > width:
        label = label[: width - 1] + "…"
    return label


def shape_text(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def config_line(config: LayerConfig) -> str:
    return (
        f"d_model {config.d_model} · heads {config.heads} (d_k {config.d_k}) · "
        f"pos {config.pos} · mask {config.mask} · norm {config.norm} · "
        f"impl {config.impl} · bias {'on' if config.bias else 'off'}"
    )


def sizes_line(plan: Plan) -> str:
    return "  ".join(f"{k}={v}" for k, v in plan.sizes.items())


def _table(title: str) -> Table:
    return Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
        title=title,
        title_justify="left",
    )


# ---------------------------------------------------------------- stage tables


def stage_table(stages: list[Stage], width: int, plan: Plan, show_device: bool = True) -> Table:
    """One row per stage: name, named dims, shape, dtype, (device), bytes, (what)."""
    table = _table("stages")
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("stage", no_wrap=True)
    table.add_column("dims", no_wrap=True)
    table.add_column("shape", no_wrap=True)
    table.add_column("dtype", no_wrap=True)
    if show_device:
        table.add_column("device", no_wrap=True)
    table.add_column("bytes", justify="right", no_wrap=True)
    explain = width >= WIDE
    if explain:
        table.add_column("what", overflow="ellipsis", no_wrap=True)
    what = {s.name: s.what for s in plan.stages}
    for i, stage in enumerate(stages):
        size = f"view of {stage.view_of}" if stage.view_of else format_bytes(stage.bytes)
        row = [str(i), stage.name, " ".join(stage.dims), shape_text(stage.shape), stage.dtype]
        if show_device:
            row.append(stage.device)
        row.append(size)
        if explain:
            row.append(what.get(stage.name, ""))
        table.add_row(*row)
    return table


# ---------------------------------------------------------------- run


def header(title: str, rows: list[tuple[str, str]]) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    for key, value in rows:
        grid.add_row(key, Text(value))
    grid.title = title
    grid.title_justify = "left"
    grid.title_style = "bold"
    return grid


def token_table(tokens: list[Token], rows: list[int]) -> Table:
    """The tokens of the query rows computed (all of them for short inputs)."""
    table = _table("tokens")
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
        table.add_row(
            str(i), str(token.id), Text(token_label(token)), f"{token.start}:{token.end}", note
        )
    if previous < len(tokens) - 1:
        table.add_row("⋮", "", "", "", f"tokens {previous + 1}–{len(tokens) - 1} not listed")
    return table


def weight_text(weight: float, digits: int) -> str:
    """Fixed decimals, unless that would print a non-zero weight as 0.00 (then 3.1e-04)."""
    if weight == 0 or weight >= 0.5 * 10**-digits:
        return f"{weight:.{digits}f}"
    return f"{weight:.1e}"


def _shade(weight: float) -> Style:
    """Dark for 0, bright blue for 1 (sqrt, so small weights still show)."""
    t = max(0.0, min(1.0, weight)) ** 0.5
    low, high = (24, 24, 32), (40, 110, 235)
    rgb = tuple(int(a + (b - a) * t) for a, b in zip(low, high, strict=True))
    return Style(bgcolor=Color.from_rgb(*rgb), color="white")


def weight_tables(
    trace: Trace, heads: list[int], width: int, digits: int = 2, batch_row: int = 0
) -> tuple[list[Table], list[str]]:
    """One table per head: rows = query tokens, columns = key tokens, row maximum marked *.

    When the keys do not fit the width, each row lists its strongest keys instead.
    """
    tokens = trace.tokens[batch_row]
    count = len(tokens)
    rows = trace.attention_rows
    cell = digits + 3  # "0.28*"
    label_width = min(LABEL_WIDTH, max(len(token_label(tokens[r])) for r in rows))
    label_width += len(str(rows[-1])) + 1
    fit = max(1, (width - label_width - 2) // (cell + 1))
    notes = []
    gaps = hidden_ranges(rows, count)
    if gaps:
        hidden = ", ".join(f"{a}–{b}" if a != b else str(a) for a, b in gaps)
        notes.append(f"query rows {hidden} not computed; choose rows with --rows A:B or last:N")
    top_k = None
    if count > fit:
        top_width = len(str(count - 1)) + 1 + 6 + 1 + max(digits + 2, 7)  # "1523 token 3.1e-04"
        top_k = max(1, (width - label_width - 2) // (top_width + 1))
        notes.append(
            f"{count} keys do not fit {width} columns: each row shows its {top_k} strongest "
            "keys as 'position token weight'"
        )

    def label(i: int) -> str:
        return f"{i} {token_label(tokens[i], LABEL_WIDTH)}"

    tables = []
    for head in heads:
        matrix = trace.attention[batch_row][trace.attention_heads.index(head)]
        table = _table(f"head {head}")
        table.add_column(Text("query \\ key"), no_wrap=True)
        if top_k is None:
            for key in range(count):
                header_text = f"{key}\n{token_label(tokens[key], cell)}"
                table.add_column(Text(header_text), justify="right", no_wrap=True, min_width=cell)
        else:
            for rank in range(top_k):
                table.add_column(f"top {rank + 1}", no_wrap=True)
        for row_index, query in enumerate(rows):
            weights = matrix[row_index]
            cells: list[RenderableType] = [Text(label(query))]
            if top_k is None:
                best = max(range(count), key=weights.__getitem__)
                for key in range(count):
                    mark = "*" if key == best else " "
                    text = f"{weight_text(weights[key], digits)}{mark}"
                    cells.append(Text(text, style=_shade(weights[key])))
            else:
                for key in heapq.nlargest(top_k, range(count), key=weights.__getitem__):
                    text = (
                        f"{key} {token_label(tokens[key], 6)} {weight_text(weights[key], digits)}"
                    )
                    cells.append(Text(text, style=_shade(weights[key])))
            table.add_row(*cells)
        tables.append(table)
    return tables, notes


def memory_footer(estimate: MemoryEstimate) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.title = "memory"
    grid.title_justify = "left"
    grid.title_style = "bold"
    grid.add_column(no_wrap=True)
    grid.add_column(justify="right", no_wrap=True)
    grid.add_column()
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


def run_view(
    text: str,
    trace: Trace,
    plan: Plan,
    estimate: MemoryEstimate,
    heads: list[int],
    width: int,
    digits: int = 2,
) -> Group:
    config = plan.config
    shown_text = printable(text)
    if len(shown_text) > MAX_TEXT:
        shown_text = f"{shown_text[:MAX_TEXT]}… ({len(text):,} characters in all)"
    how = "every weight built" if trace.impl == "math" else "weights only for the rows shown"
    parts: list[RenderableType] = [
        header(
            "attnctl run",
            [
                ("text", shown_text),
                ("tokenizer", f"{trace.tokenizer} (vocab {trace.vocab_size})"),
                ("layer", config_line(config)),
                ("device", f"{trace.device} · dtype {config.dtype} · seed {config.seed}"),
                ("attention", f"{trace.impl} ({how})"),
            ],
        ),
        Text(""),
        token_table(trace.tokens[0], trace.attention_rows),
        stage_table(trace.stages, width, plan),
    ]
    if config.mask == "causal":
        parts.append(Text(f"mask: {MASK_CONVENTION}", style="dim"))
    tables, notes = weight_tables(trace, heads, width, digits)
    parts.append(
        Text(
            "attention weights: rows = queries, columns = keys, each row sums to 1, "
            "* = row maximum",
            style="bold",
        )
    )
    parts.append(Columns(tables, padding=(0, 3)))
    parts.extend(Text(note, style="dim") for note in notes)
    parts.append(Text(""))
    parts.append(memory_footer(estimate))
    return Group(*parts)


# ---------------------------------------------------------------- shapes and memory


def shapes_view(plan: Plan, width: int) -> Group:
    config = plan.config
    return Group(
        header(
            "attnctl shapes",
            [
                ("layer", config_line(config)),
                ("dtype", f"{config.dtype} · device {config.device}"),
                ("sizes", sizes_line(plan)),
            ],
        ),
        Text(""),
        stage_table(plan.stages, width, plan, show_device=False),
    )


def memory_view(
    plan: Plan,
    estimate: MemoryEstimate,
    width: int,
    cache_tokens: int,
    measured: Measured | None = None,
) -> Group:
    config = plan.config
    sizes = plan.sizes
    params = _table("parameters")
    for name, justify in (("name", "left"), ("shape", "left"), ("count", "right")):
        params.add_column(name, justify=justify, no_wrap=True)
    params.add_column("bytes", justify="right", no_wrap=True)
    element = DTYPE_BYTES[config.dtype]
    for p in plan.parameters:
        params.add_row(p.name, shape_text(p.shape), f"{p.count:,}", format_bytes(p.count * element))
    params.add_row("total", "", f"{estimate.parameters:,}", format_bytes(estimate.parameter_bytes))

    stages = _table("activations")
    # with a measurement, compare it with the estimate instead of repeating shapes
    headings = ["#", "stage"]
    headings += ["shape", "bytes", "alive during"] if measured is None else ["estimated"]
    headings += ["measured", "diff"] if measured is not None else []
    for name in headings:
        stages.add_column(name, justify="left" if name == "stage" else "right", no_wrap=True)
    for i, stage in enumerate(plan.stages):
        alive = format_bytes(estimate.live_bytes[i])
        if stage.name == estimate.peak_stage:
            alive += " ◀ peak"
        if measured is None:
            size = f"view of {stage.view_of}" if stage.view_of else format_bytes(stage.bytes)
            row = [str(i), stage.name, shape_text(stage.shape), size, alive]
        else:
            got = measured.stage_peak_bytes[i]
            row = [
                str(i),
                stage.name,
                alive,
                format_bytes(got),
                _percent(estimate.live_bytes[i], got),
            ]
        stages.add_row(*row)

    summary = Table.grid(padding=(0, 2))
    summary.add_column(no_wrap=True)
    summary.add_column(justify="right", no_wrap=True)
    summary.add_column()
    elem = DTYPE_BYTES[config.dtype]
    summary.add_row(
        "one attention matrix",
        format_bytes(estimate.attention_matrix_bytes),
        f"B·H·L·L·{elem} = {sizes['B']}·{sizes['H']}·{sizes['L']}·{sizes['L']}·{elem} bytes",
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
    summary.add_row(
        "KV cache",
        format_bytes(kv_cache_bytes(plan, cache_tokens)),
        f"K and V for {cache_tokens} tokens: 2·B·N·H·d_k·{elem} = "
        f"2·{sizes['B']}·{cache_tokens}·{sizes['H']}·{sizes['d_k']}·{elem} bytes",
    )
    if measured is not None:
        summary.add_row(
            "measured peak",
            format_bytes(measured.peak_bytes),
            f"on {measured.device} by {measured.method}; estimate "
            f"{_percent(estimate.peak_bytes, measured.peak_bytes)} vs measured",
        )

    dtypes = _table("by dtype")
    for name in ("dtype", "parameters", "activations", "attention matrix", "peak"):
        dtypes.add_column(name, justify="left" if name == "dtype" else "right", no_wrap=True)
    for dtype, other in dtype_table(plan):
        dtypes.add_row(
            dtype,
            format_bytes(other.parameter_bytes),
            format_bytes(other.activation_bytes),
            format_bytes(other.attention_matrix_bytes),
            format_bytes(other.peak_bytes),
        )
    return Group(
        header(
            "attnctl memory",
            [
                ("layer", config_line(config)),
                ("dtype", config.dtype),
                ("sizes", sizes_line(plan)),
            ],
        ),
        Text(""),
        params,
        stages,
        summary,
        Text(""),
        dtypes,
    )


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


def run_json(trace: Trace, plan: Plan, estimate: MemoryEstimate) -> dict[str, Any]:
    return {
        "config": plan.config.to_dict(),
        "tokenizer": trace.tokenizer,
        "vocab_size": trace.vocab_size,
        "device": trace.device,
        "tokens": [[t.to_dict() for t in row] for row in trace.tokens],
        "stages": [s.to_dict() for s in trace.stages],
        "impl": trace.impl,
        "attention": trace.attention,
        "attention_heads": trace.attention_heads,
        "attention_rows": trace.attention_rows,
        "memory": memory_dict(estimate),
    }


def shapes_json(plan: Plan) -> dict[str, Any]:
    return {
        "config": plan.config.to_dict(),
        "seq_len": plan.seq_len,
        "batch": plan.batch,
        "sizes": plan.sizes,
        "stages": [s.to_dict() for s in plan.stages],
    }


def memory_json(
    plan: Plan, estimate: MemoryEstimate, cache_tokens: int, measured: Measured | None = None
) -> dict[str, Any]:
    stages = []
    for i, (stage, live) in enumerate(zip(plan.stages, estimate.live_bytes, strict=True)):
        entry = {**stage.to_dict(), "live_bytes": live, "scratch_bytes": stage.scratch}
        if measured is not None:
            entry["measured_live_bytes"] = measured.stage_peak_bytes[i]
        stages.append(entry)
    document: dict[str, Any] = {
        "config": plan.config.to_dict(),
        "seq_len": plan.seq_len,
        "batch": plan.batch,
        **memory_dict(estimate),
        "kv_cache_tokens": cache_tokens,
        "kv_cache_bytes": kv_cache_bytes(plan, cache_tokens),
        "by_dtype": {dtype: memory_dict(other) for dtype, other in dtype_table(plan)},
        "stages": stages,
    }
    if measured is not None:
        document["measured_peak_bytes"] = measured.peak_bytes
        document["measured_device"] = measured.device
        document["measured_by"] = measured.method
    return document
