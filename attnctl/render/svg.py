"""``--svg FILE``: the terminal view, as it was printed, saved as a self-contained SVG.

The command's console records what it prints (the terminal output is unchanged); after
the command, :func:`write_svg` exports the recording with our own template: no web font,
no URL, no clip path referenced by ``url(…)`` (the only ``http`` in the file is the SVG
namespace, which nothing fetches). The same input gives the same bytes: a fixed id prefix,
no time stamp. The file is written atomically (a temporary file in the same folder, then
renamed), so a failure leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING

from attnctl.output_files import OutputFile, checked_output, write_atomically

if TYPE_CHECKING:
    from rich.console import Console

PICTURE_HEIGHT = 25  # lines of the colour recording's page: nothing we print reads it
ID_PREFIX = "attnctl"  # fixed: rich's default is a hash; one name keeps the file predictable

# rich's placeholders; no @font-face, no {lines} (rich's per-line clip paths) and no outer
# clip path: the text is laid out cell by cell (textLength) and needs no clipping
SVG_TEMPLATE = """\
<svg class="attnctl-terminal" viewBox="0 0 {width} {height}" xmlns="http://www.w3.org/2000/svg">
    <style>
    .{unique_id}-matrix {{
        font-family: "DejaVu Sans Mono", Menlo, Consolas, "Liberation Mono", monospace;
        font-size: {char_height}px;
        line-height: {line_height}px;
        font-variant-east-asian: full-width;
    }}
    .{unique_id}-title {{
        font-size: 18px;
        font-weight: bold;
        font-family: sans-serif;
    }}
    {styles}
    </style>
    {chrome}
    <g transform="translate({terminal_x}, {terminal_y})">
    {backgrounds}
    <g class="{unique_id}-matrix">
    {matrix}
    </g>
    </g>
</svg>
"""

_LINE_CLIP = re.compile(rf' clip-path="url\(#{ID_PREFIX}-line-\d+\)"')

# the consoles the running command created, while --svg is given (None: not recording)
_recording: ContextVar[list[Console] | None] = ContextVar("svg_recording", default=None)


def check_svg_path(given: str) -> OutputFile:
    """The file --svg names, refused (exit 2) before the run if it cannot be written."""
    return checked_output(given, "--svg")


@contextlib.contextmanager
def recording() -> Iterator[list[Console]]:
    """While it lasts, :func:`recorded` makes each console record; yields those consoles."""
    consoles: list[Console] = []
    token = _recording.set(consoles)
    try:
        yield consoles
    finally:
        _recording.reset(token)


def recorded(console: Console) -> Console:
    """``console``, recording what it prints when --svg was given (else unchanged)."""
    consoles = _recording.get()
    if consoles is not None:
        console.record = True
        consoles.append(console)
    return console


def colour_recording(console: Console) -> Console | None:
    """When --svg is given: a console that prints nowhere and records in full colour at
    ``console``'s width, in ``console``'s place in the recording (``console`` prints on
    without recording); else None. A heatmap is drawn into it in colour, so its picture has
    its colours whether stdout is a terminal, a pipe or ``NO_COLOR``, and the same input
    gives the same file."""
    consoles = _recording.get()
    if consoles is None:
        return None
    import io

    from rich.console import Console

    if console in consoles:
        consoles.remove(console)
        console.record = False
    picture = Console(
        file=io.StringIO(),
        width=console.width,
        height=PICTURE_HEIGHT,  # with the width: no terminal size read (TERM=dumb: 80 wide)
        color_system="truecolor",
        force_terminal=True,
        no_color=False,
        highlight=False,
        emoji=False,
        record=True,
    )
    consoles.append(picture)
    return picture


def svg_text(console: Console, title: str) -> str:
    """What ``console`` recorded, as an SVG document (at the console's width)."""
    svg = console.export_svg(
        title=title, code_format=SVG_TEMPLATE, unique_id=ID_PREFIX, clear=False
    )
    return _LINE_CLIP.sub("", svg)


def write_svg(consoles: list[Console], output: OutputFile, title: str) -> None:
    """Write what the command printed to ``output`` atomically (exit 1 on an I/O failure)."""
    if not consoles:  # every command prints through one console; none: an empty picture
        from rich.console import Console

        consoles = [Console(record=True)]
    write_atomically(output, svg_text(consoles[-1], title))
