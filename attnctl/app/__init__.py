"""The use cases: one function per command, between the Typer layer and the computation.

Each takes a request (the options as parsed, nothing more) and returns a report of plain
data that ``render`` draws; nothing here prints or exits. torch is imported only by
``run``, ``check`` and ``memory --measure``, inside them.

- ``requests``: the requests, :class:`Hooks` (spinners and warnings), ``check``'s report
- ``use_cases``: ``run_use_case``, ``shapes_use_case``, ``memory_use_case``,
  ``check_use_case`` and ``resolve_layer``
- ``generation``: ``run --generate`` (decoder-only) and ``run`` on an encoder–decoder
- ``inputs``: texts and contexts from arguments, files and stdin; --layer; --seq-len lists
- ``calls``: every call into the computation, one function each
"""

from attnctl.app.inputs import MAX_TEXT_BYTES
from attnctl.app.requests import (
    CheckReport,
    CheckRequest,
    Hooks,
    LayerRequest,
    MemoryRequest,
    RunRequest,
    ShapesRequest,
)
from attnctl.app.use_cases import (
    check_use_case,
    memory_use_case,
    resolve_layer,
    run_use_case,
    shapes_use_case,
)

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
