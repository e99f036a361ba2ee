"""``check``: the implementations compared and gradcheck."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Group
from rich.text import Text

from attnctl.render.tables import header, titled_table
from attnctl.render.text import config_line, difference_bound, sizes_line
from attnctl.stages.plan import Plan

if TYPE_CHECKING:  # measure.py and check.py import torch; render only reads their results
    from attnctl.nn.check import CheckResult


def check_view(result: CheckResult, plan: Plan) -> Group:
    table = titled_table("implementations compared (same weights)")
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
                ("layer", config_line(plan.config, plan)),
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
