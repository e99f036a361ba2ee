"""The use cases: one function per command, between the Typer layer and the computation.

Each takes a request (the options as parsed, nothing more) and returns a report of plain
data that ``render`` draws; nothing here prints or exits. torch is imported only by
``run``, ``check`` and ``memory --measure``, inside them.

- ``requests``: the requests, :class:`Hooks` (spinners and warnings), ``check``'s report
- ``use_cases``: ``run_use_case``, ``shapes_use_case``, ``memory_use_case``,
  ``check_use_case`` and ``resolve_layer``
- ``generation``: ``run --generate`` (decoder-only); ``translation``: ``run`` on an
  encoder–decoder
- ``inputs``: texts and contexts from arguments, files and stdin; --layer; --seq-len lists
- ``calls``: every call into the computation, one function each
"""

import importlib
from typing import Any

# each name's module, imported when the name is first used (PEP 562): `attnctl --help`
# then loads the requests alone, none of the use cases
_MODULES = {
    "MAX_TEXT_BYTES": "inputs",
    "CheckReport": "requests",
    "CheckRequest": "requests",
    "Hooks": "requests",
    "LayerRequest": "requests",
    "MemoryRequest": "requests",
    "RunRequest": "requests",
    "ShapesRequest": "requests",
    "check_use_case": "use_cases",
    "memory_use_case": "use_cases",
    "resolve_layer": "use_cases",
    "run_use_case": "use_cases",
    "shapes_use_case": "use_cases",
}


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULES[name]}"), name)


__all__ = [
    "MAX_TEXT_BYTES",
    "CheckReport",
    "CheckRequest",
    "Hooks",
    "LayerRequest",
    "MemoryRequest",
    "RunRequest",
    "ShapesRequest",
    "check_use_case",
    "memory_use_case",
    "resolve_layer",
    "run_use_case",
    "shapes_use_case",
]
