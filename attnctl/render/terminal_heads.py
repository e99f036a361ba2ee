"""Head statistics on screen: the overview table, every block, the heads map."""

from __future__ import annotations

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from attnctl.render.tables import titled_table
from attnctl.render.text import token_label_text
from attnctl.stats import PATTERNS, HeadStats


def heads_overview(stats: list[HeadStats], batched: bool, title: str = "") -> Table:
    """The heads in one table, in the order given (the most clear-cut first)."""
    table = titled_table(title or "heads at a glance (most clear-cut first)")
    layered = len({s.layer for s in stats}) > 1
    headings = ["text"] if batched else []
    headings += ["layer"] if layered else []
    headings += ["head", "kind", "entropy", "top key", "prev", "first", "diag", "same", "induct"]
    for name in headings:
        table.add_column(
            name, no_wrap=True, justify="left" if name in ("kind", "top key") else "right"
        )

    for s in stats:
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
                strength = s.strength
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
