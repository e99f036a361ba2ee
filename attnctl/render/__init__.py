"""Rich renderables and JSON documents from plans, traces and memory estimates.

Nothing here computes attention or prints: functions take data and return
renderables (or dicts) that ``cli`` prints. Every piece of user text goes through
:func:`printable` and into a ``Text`` object, so ``[red]`` stays literal and control
characters show as escapes.

- ``text``: printable user text, labels, one-line summaries
- ``tables``: :class:`FittingTable` and the tables every view shares
- ``terminal_run``, ``terminal_heads``: ``run`` (one block, or every block)
- ``terminal_memory``: ``shapes`` and ``memory``
- ``terminal_check``: ``check``
- ``terminal_generation``: ``run --generate``, and ``run`` on an encoder–decoder
- ``json``: the ``--json`` documents
"""

from attnctl.render.json import (
    blocks_json,
    check_json,
    generation_json,
    memory_json,
    run_json,
    shapes_json,
    translation_json,
)
from attnctl.render.terminal_check import check_view
from attnctl.render.terminal_generation import generation_view, translation_view
from attnctl.render.terminal_memory import memory_view, shapes_view
from attnctl.render.terminal_run import blocks_view, run_view
from attnctl.render.text import difference_bound, printable, shape_text, weight_text

__all__ = [
    "blocks_json",
    "blocks_view",
    "check_json",
    "check_view",
    "difference_bound",
    "generation_json",
    "generation_view",
    "memory_json",
    "memory_view",
    "printable",
    "run_json",
    "run_view",
    "shape_text",
    "shapes_json",
    "shapes_view",
    "translation_json",
    "translation_view",
    "weight_text",
]
