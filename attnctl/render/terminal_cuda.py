"""What a CUDA plan adds to the terminal views: its GPU's header rows, its device lines."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import RenderableType
from rich.text import Text

from attnctl.memory.estimate import format_bytes
from attnctl.render.tables import titled_table
from attnctl.render.text import cuda_rows

if TYPE_CHECKING:
    from attnctl.stages.plan import Plan


def seq2seq_cuda_rows(encoder: Plan, decoder: Plan) -> list[tuple[str, str]]:
    """The GPU once, then each block's SDPA kernel and warnings."""
    rows = cuda_rows(encoder)
    seen = set(rows)
    return rows + [row for row in cuda_rows(decoder) if row not in seen]


def device_lines_view(plan: Plan) -> list[RenderableType]:
    """What CUDA allocates beside the stages' tensors: one row per line of the plan."""
    if not plan.device_lines:
        return []
    table = titled_table("on the GPU, beside the tensors")
    for name, justify in (("line", "left"), ("bytes", "right"), ("alive", "left")):
        table.add_column(name, justify=justify, no_wrap=True)
    table.add_column("what")
    for line in plan.device_lines:
        alive = line.first if line.last == line.first else f"{line.first} on"
        table.add_row(line.name, format_bytes(line.bytes), alive, line.what)
    return [Text(""), table]
