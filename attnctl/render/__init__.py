"""Rich renderables and JSON documents from plans, traces and memory estimates.

Nothing here computes attention or prints: functions take data and return
renderables (or dicts) that ``cli`` prints. Every piece of user text goes through
:func:`printable` and into a ``Text`` object, so ``[red]`` stays literal and control
characters show as escapes.

- ``text``: printable user text, labels, one-line summaries
- ``tables``: :class:`FittingTable` and the tables every view shares
- ``terminal_run``, ``terminal_heads``: ``run`` (one block, or every block)
- ``terminal_heatmap``: ``run --view heatmap``
- ``terminal_memory``: ``shapes`` and ``memory``
- ``terminal_check``: ``check``
- ``terminal_generation``: ``run --generate``, and ``run`` on an encoder–decoder
- ``json``: the ``--json`` documents
- ``svg``: ``--svg FILE``, the terminal view recorded and saved as an SVG
- ``html``: ``run --html FILE``, the run's JSON document as one self-contained page (its
  script and style sheet in ``html_assets/``); imported only when a page is written
"""

import importlib
from typing import Any

# each name's module, imported when the name is first used (PEP 562): `attnctl --help`
# then loads none of the views
_MODULES = {
    "blocks_json": "json",
    "check_json": "json",
    "generation_json": "json",
    "memory_json": "json",
    "run_json": "json",
    "shapes_json": "json",
    "translation_json": "json",
    "check_view": "terminal_check",
    "generation_view": "terminal_generation",
    "translation_view": "terminal_generation",
    "memory_view": "terminal_memory",
    "shapes_view": "terminal_memory",
    "blocks_view": "terminal_run",
    "heatmap_view": "terminal_heatmap",
    "run_view": "terminal_run",
    "difference_bound": "text",
    "printable": "text",
    "shape_text": "text",
    "weight_text": "text",
}


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)


__all__ = [
    "blocks_json",
    "blocks_view",
    "check_json",
    "check_view",
    "difference_bound",
    "generation_json",
    "generation_view",
    "heatmap_view",
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
