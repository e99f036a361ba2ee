"""``run``: the header, token tables, weight tables and memory footer of one block."""

from __future__ import annotations

from typing import Any

from rich.color import Color
from rich.columns import Columns
from rich.console import Group, RenderableType
from rich.style import Style
from rich.table import Table
from rich.text import Text

from attnctl.memory.estimate import MemoryEstimate, format_bytes
from attnctl.render.tables import header, size_grid, stage_table, titled_table
from attnctl.render.terminal_heads import heads_map, heads_overview
from attnctl.render.text import (
    LABEL_WIDTH,
    config_line,
    cuda_rows,
    model_lines,
    shown_text,
    token_label,
    weight_text,
)
from attnctl.report.commands import CLEAREST_SHOWN, RunReport, TextWindow
from attnctl.stages.plan import MASK_CONVENTION, Plan
from attnctl.trace import Token, Trace


def token_table(tokens: list[Token], rows: list[int], title: str = "tokens") -> Table:
    """The tokens of the query rows computed (all of them for short inputs), padding marked."""
    table = titled_table(title)
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
    trace: Trace, window: TextWindow, heads: list[int], width: int, digits: int = 2
) -> tuple[list[Table], list[str], bool]:
    """One table per head: rows = query tokens, columns = key tokens, row maximum marked *.

    When the keys do not fit the width, each row lists its strongest keys instead (the
    returned flag says so: those tables are as wide as the terminal).
    """
    batch_row, queries, count, computed = (
        window.batch_row,
        window.queries,
        window.keys,
        window.computed,
    )
    tokens = trace.tokens[batch_row]  # the queries
    keys = tokens if trace.context_tokens is None else trace.context_tokens[batch_row]
    if not computed:
        note = f"text {batch_row}: none of its {queries} tokens is among the rows computed"
        return [], [note], False
    rows = [r for _, r in computed]
    cell = digits + 3  # "0.28*"
    label_width = min(LABEL_WIDTH, max(len(token_label(tokens[r])) for r in rows))
    label_width += len(str(rows[-1])) + 1
    fit = max(1, (width - label_width - 2) // (cell + 1))
    notes = []
    if window.hidden:
        hidden = ", ".join(f"{a}–{b}" if a != b else str(a) for a, b in window.hidden)
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
        table = titled_table(f"head {head}{batch_label}")
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


def memory_footer(estimate: MemoryEstimate, split: Any = None, plan: Plan | None = None) -> Table:
    """One device's memory; under ``run --tp`` the whole layer's, titled so (a rank's is
    ``memory --tp``'s); a CUDA plan's with its GPU lines, titled with its GPU."""
    cuda = None if plan is None else plan.cuda
    title = (
        "memory"
        if split is None
        else (f"memory of one device (unsplit; each rank's: attnctl memory --tp {split.layout.tp})")
    )
    if cuda is not None:
        title += f" on {'a planned ' if cuda.named else ''}{cuda.gpu.label} ({cuda.gpu.sm})"
    grid = size_grid(title)
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
        f"parameters + activations{' + the GPU lines' if cuda is not None else ''} alive at "
        f"once (largest at {estimate.peak_stage})",
    )
    for line in () if plan is None else plan.device_lines:
        grid.add_row(f"  {line.name}", format_bytes(line.bytes), line.what)
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
            lines.append((label if len(items) == 1 else f"{label} {number}", shown_text(item)))
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
                ("layer", config_line(config, plan)),
                ("device", f"{trace.device} · dtype {config.dtype}{seed}"),
                ("attention", f"{trace.impl} ({how})"),
                *_planned_rows(plan),
            ],
        ),
        Text(""),
        *tables,
    ]


def _planned_rows(plan: Plan) -> list[tuple[str, str]]:
    """The CUDA plan's rows; for a named --gpu, marked as planned (the run is here)."""
    named = plan.cuda is not None and plan.cuda.named
    return [("planned " + key if named else key, text) for key, text in cuda_rows(plan)]


def run_view(report: RunReport, width: int) -> Group:
    """``run``: one block's stages, weight tables, heads overview and memory."""
    texts, trace, plan = report.texts, report.trace, report.plan
    heads, digits, contexts = report.heads, report.digits, report.contexts
    config = plan.config
    split = report.split
    parts: list[RenderableType] = [
        *_run_opening(texts, trace, plan, contexts, trace.layer),
        *split_lines(split),
        stage_table(trace.stages, width, plan if split is None else split.plan),
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
    for window in report.windows:
        row_tables, row_notes, row_ranked = weight_tables(trace, window, heads, width, digits)
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
    parts.append(heads_overview(report.ranked, len(texts) > 1))
    parts.append(Text(""))
    parts.append(memory_footer(report.estimate, report.split, report.plan))
    return Group(*parts)


def split_lines(split: Any) -> list[RenderableType]:
    """``run --tp``: which heads live on which rank, and whose stages the table shows."""
    if split is None:
        return []
    ranks = []
    for rank, (queries, kv) in enumerate(split.heads):
        kv_text = f"kv-head {kv.start}" if len(kv) == 1 else f"kv-heads {_span(kv)}"
        ranks.append(f"rank {rank}: heads {_span(queries)} ({kv_text})")
    backend = "NCCL" if trace_device(split).startswith("cuda") else "gloo"
    return [
        Text(
            f"{split.layout.summary()} over {split.layout.tp} processes ({backend}): "
            + "; ".join(ranks),
            style="bold",
        ),
        Text("the stages below are rank 0's, with its collectives", style="dim"),
        Text(""),
    ]


def trace_device(split: Any) -> str:
    return split.traces[0].device


def _span(heads: range) -> str:
    return str(heads.start) if len(heads) == 1 else f"{heads.start}–{heads.stop - 1}"


def blocks_view(report: RunReport, width: int) -> Group:
    """``run --model --layer all``: every block's heads summarised, then the clearest heads."""
    first = report.trace
    batched = len(report.texts) > 1
    parts = _run_opening(report.texts, first, report.plan)
    table = titled_table("every block (heads by kind)")
    for name in ("layer", "entropy", "kinds", "clearest head"):
        table.add_column(name, no_wrap=True, justify="right" if name == "entropy" else "left")
    for block in report.blocks:
        best = block.clearest
        table.add_row(
            str(block.layer),
            f"{block.mean_entropy_fraction:.0%}",
            " · ".join(f"{kind} {count}" for kind, count in block.kinds.items()),
            f"head {best.head}: {best.kind} {best.strength:.2f}",
        )
    table.caption = "entropy: mean over heads, of the most possible (100% = uniform)"
    table.caption_justify = "left"
    title = f"the {CLEAREST_SHOWN} most clear-cut heads"
    clearest = heads_overview(report.ranked, batched, title=title)
    hint = f"weights and stages of one block: --layer N (0–{len(report.traces) - 1})"
    by_layer = [block.first_text for block in report.blocks]
    head_map = heads_map(by_layer, first.attention_heads, width, "text 0" if batched else "")
    parts += [table, Text(""), *head_map, Text(""), clearest, Text(hint, style="dim"), Text("")]
    parts.append(memory_footer(report.estimate, plan=report.plan))
    return Group(*parts)
