"""Which report goes to which view: the one place the outputs are chosen.

Every report a use case returns has a kind (:func:`kind_of`). :data:`FORMATS` maps each
output format to the function that draws each kind: ``json`` (the document ``--json``
prints, which ``--save`` and ``--html`` write too), ``terminal`` (rich, at the console's
width) and ``heatmap`` (``run --view heatmap``). A new output format is its renderer and
one entry here. The renderers are imported when a view is drawn, not before: ``shapes``
never loads the HTML page's module, ``--help`` none of them.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

import typer
from rich.console import Console, RenderableType

from attnctl.app.requests import Hooks
from attnctl.errors import USAGE, AttnctlError

JSON_WRITE_CHARS = 1 << 16  # --json is written in pieces of about this many characters


def _renderer(
    path: str, *, spread: Callable[[Any], tuple] | None = None, sized: bool = True
) -> Callable[..., Any]:
    """The function at ``render.module:name``, imported at its first call; ``spread`` turns
    the report into the arguments it takes (``check_view(result, plan)``); a view that is
    not ``sized`` takes no width."""
    module, _, name = path.partition(":")

    def draw(report: Any, *rest: Any) -> Any:
        function = getattr(importlib.import_module(f"attnctl.render.{module}"), name)
        arguments = spread(report) if spread is not None else (report,)
        return function(*arguments, *(rest if sized else ()))

    return draw


def _check_parts(report: Any) -> tuple:
    return (report.result, report.plan)


def _heatmap_of(path: str) -> Callable[[Any, int, bool], RenderableType]:
    """A generation or translation view drawn as a heatmap: ``view(report, width, True,
    colour)``."""
    view = _renderer(path)
    return lambda report, width, colour: view(report, width, True, colour)


# format -> kind of report -> the function that draws it
FORMATS: dict[str, dict[str, Callable[..., Any]]] = {
    "json": {
        "run": _renderer("json:run_json"),
        "blocks": _renderer("json:blocks_json"),
        "generation": _renderer("json:generation_json"),
        "translation": _renderer("json:translation_json"),
        "shapes": _renderer("json_memory:shapes_document"),
        "seq2seq shapes": _renderer("json_memory:shapes_document"),
        "memory": _renderer("json_memory:memory_document"),
        "split memory": _renderer("json_memory:memory_document"),
        "seq2seq memory": _renderer("json_memory:memory_document"),
        "check": _renderer("json:check_json", spread=_check_parts),
    },
    "terminal": {  # (report, width)
        "run": _renderer("terminal_run:run_view"),
        "blocks": _renderer("terminal_run:blocks_view"),
        "generation": _renderer("terminal_generation:generation_view"),
        "translation": _renderer("terminal_generation:translation_view"),
        "shapes": _renderer("terminal_memory:shapes_view"),
        "seq2seq shapes": _renderer("terminal_memory:seq2seq_shapes_view"),
        "memory": _renderer("terminal_memory:memory_view"),
        "split memory": _renderer("terminal_parallel:parallel_view"),
        "seq2seq memory": _renderer("terminal_memory:seq2seq_memory_view"),
        "check": _renderer("terminal_check:check_view", spread=_check_parts, sized=False),
    },
    "heatmap": {  # (report, width, colour)
        "run": _renderer("terminal_heatmap:heatmap_view"),
        "blocks": _renderer("terminal_heatmap:heatmap_view"),
        "generation": _heatmap_of("terminal_generation:generation_view"),
        "translation": _heatmap_of("terminal_generation:translation_view"),
    },
}


def kind_of(report: Any) -> str:
    """The kind of a use case's report, the key of :data:`FORMATS`' tables."""
    name = type(report).__name__
    if name == "RunReport":
        return "blocks" if report.every_block else "run"
    if name == "MemoryCommandReport":
        return "split memory" if report.parallel is not None else "memory"
    kinds = {
        "GenerationReport": "generation",
        "TranslationReport": "translation",
        "Plan": "shapes",
        "Seq2SeqShapes": "seq2seq shapes",
        "Seq2SeqMemoryReport": "seq2seq memory",
        "CheckReport": "check",
    }
    return kinds[name]


def document(report: Any) -> dict[str, Any]:
    """The JSON document of a report: what --json prints and --save and --html write."""
    return FORMATS["json"][kind_of(report)](report)


def show(report: Any, command: str, *, as_json: bool = False, heatmap: bool = False) -> None:
    """Print ``report`` as its command's output: its JSON document, its heatmap, or its
    terminal view (and, for ``run``, which heads were left out)."""
    kind = kind_of(report)
    if as_json:
        if heatmap:
            raise AttnctlError(
                "--view heatmap is not available with --json: it draws the weights in the "
                "terminal (--json carries every weight)",
                exit_code=USAGE,
            )
        print_json(document(report), command)
        return
    console = terminal()
    if heatmap:
        draw = FORMATS["heatmap"][kind]
        shown_on = print_heatmap(console, lambda width, colour: draw(report, width, colour))
    else:
        console.print(FORMATS["terminal"][kind](report, console.width))
        shown_on = [console]
    hidden = getattr(report, "heads_not_shown", None) if kind in ("run", "blocks") else None
    if hidden is not None and not (kind == "blocks" and not heatmap):
        first, last = hidden
        for shown in shown_on:
            shown.print(f"heads {first}–{last} not shown; pick them with --head N", style="dim")


def terminal() -> Console:
    """The console a command prints on (recording for --svg when it was given)."""
    from attnctl.render.svg import recorded

    # COLUMNS, NO_COLOR and "not a terminal" are honoured by rich itself
    return recorded(Console(highlight=False, emoji=False))


def print_json(document: dict[str, Any], command: str) -> None:
    """The document on stdout, written as it is encoded: a long run's attention is tens of
    MB of text, which one string (and its lines, trimmed when piped) would hold several
    times over. ``command`` names the command whose document it is (the tests check each
    against its schema)."""
    encoder = json.JSONEncoder(ensure_ascii=False, indent=2)
    pending: list[str] = []
    size = 0
    for chunk in encoder.iterencode(document):
        pending.append(chunk)
        size += len(chunk)
        if size >= JSON_WRITE_CHARS:
            sys.stdout.write("".join(pending))
            pending, size = [], 0
    sys.stdout.write("".join(pending) + "\n")
    sys.stdout.flush()


def coloured(console: Console) -> bool:
    """Whether the heatmap draws coloured half blocks on ``console``: with 256 colours or
    more; with 16 (whose few blues cannot tell weights apart), none or ``NO_COLOR``, its
    shade characters."""
    return console.color_system in ("256", "truecolor") and not console.no_color


def print_heatmap(console: Console, view: Callable[[int, bool], RenderableType]) -> list[Console]:
    """Print ``view(width, colour)`` on ``console`` as it can show it; with --svg, draw it
    again in colour into the recording (the picture's colours do not depend on stdout).
    The consoles printed on, for what follows the view."""
    from attnctl.render.svg import colour_recording

    console.print(view(console.width, coloured(console)))
    picture = colour_recording(console)
    if picture is None:
        return [console]
    picture.print(view(console.width, True))
    return [console, picture]


@contextlib.contextmanager
def progress(description: str, console: Console | None = None) -> Iterator[None]:
    """A spinner with elapsed time on stderr while work runs; nothing unless it is a terminal."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as spinner:
        spinner.add_task(description, total=None)
        yield


def hooks() -> Hooks:
    """Spinners and warnings on stderr for the use cases, which never print."""
    return Hooks(progress=progress, warn=lambda message: typer.echo(message, err=True))
