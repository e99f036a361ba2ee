"""The Typer application: errors, the terminal's conventions, --version and --debug.

Errors end here: a click usage error or an :class:`AttnctlError` becomes one line on
stderr and its exit code (2 for usage, 1 for run-time failures); ``--debug`` adds the
traceback. Each command parses its options, calls one use case (``app``) and renders its
report (``render``); torch and tokenizers are imported only by the use cases that run.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Iterable, Iterator
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from attnctl import __version__
from attnctl.errors import RUNTIME, USAGE, AttnctlError
from attnctl.literal import printable

# The use cases and views are imported by the command that runs (`attnctl --help` loads
# none of them: its start-up is a benchmark's target).

# Newer Typer vendors click; its BadParameter's bases name the ClickException it raises.
ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
_state = {"debug": False}


class _OneLineErrors(TyperGroup):
    """Turn every usage error and AttnctlError into one line on stderr."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        try:
            with _terminal_conventions():
                return self._guarded_main(*args, standalone_mode=standalone_mode, **kwargs)
        except BrokenPipeError:  # the reader left (`| head`): stop quietly, as click does
            _silence_stdout()
            sys.exit(RUNTIME)

    def _guarded_main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            result = super().main(*args, standalone_mode=False, **kwargs)
        except ClickException as error:
            if type(error).__name__ == "NoArgsIsHelpError":  # `attnctl` alone: the help
                typer.echo(error.format_message())
                sys.exit(0)
            _fail(error.format_message(), error.exit_code, error)
        except AttnctlError as error:
            _fail(error.message, error.exit_code, error)
        except typer.Abort as error:
            _fail("aborted", RUNTIME, error)
        except BrokenPipeError:
            raise
        except Exception as error:  # a bug: still one line, the traceback with --debug
            _fail(f"internal error: {type(error).__name__}: {error}", RUNTIME, error)
        sys.exit(result if isinstance(result, int) else 0)


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of what is left for
    a closed pipe does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real descriptor (a test's stream)
        pass


MAX_COLUMNS = 1000  # wider terminals get this width: no renderer gains beyond it


@contextlib.contextmanager
def _terminal_conventions() -> Iterator[None]:
    """An unusable COLUMNS is ignored, and piped output has no trailing spaces.

    COLUMNS that is not a positive integer (0, -5, "abc") is treated as unset, as most
    programs do; one above :data:`MAX_COLUMNS` is lowered to it. Both rich (our output
    and Typer's help) and click read it from the environment, so it is set there for the
    duration of the command and restored afterwards.
    """
    saved = os.environ.get("COLUMNS")
    if saved is not None:
        usable = saved.strip().isdigit() and int(saved) > 0  # isdigit: no sign
        if usable:  # " 80" too, which rich alone would not read
            os.environ["COLUMNS"] = str(min(int(saved), MAX_COLUMNS))
        else:
            del os.environ["COLUMNS"]
    stdout = sys.stdout
    piped = stdout is not None and not _is_terminal(stdout)
    if piped:
        sys.stdout = _TrimmedLines(stdout)  # type: ignore[assignment]
    try:
        yield
    finally:
        if piped:
            sys.stdout.finish()  # type: ignore[attr-defined]
            sys.stdout = stdout
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or unusual stream
        return False


class _TrimmedLines:
    """A text stream that writes each line without its trailing spaces (rich pads cells)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._pending = ""

    def write(self, text: str) -> int:
        lines = (self._pending + text).split("\n")
        self._pending = lines.pop()
        if lines:
            self._stream.write("".join(line.rstrip(" \t") + "\n" for line in lines))
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:  # a line not ended yet waits: more of it may follow
        self._stream.flush()

    def finish(self) -> None:
        if self._pending:
            self._stream.write(self._pending.rstrip(" \t"))
            self._pending = ""
        self._stream.flush()

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:  # encoding, errors, fileno, buffer, ...
        return getattr(self._stream, name)


def _fail(message: str, code: int, error: BaseException) -> None:
    if _state["debug"]:
        traceback.print_exception(error)
    if not message.strip():  # "no arguments": click has printed the help already
        sys.exit(code)
    first = printable(message.strip().splitlines()[0])
    hint = "" if code != USAGE or _state["debug"] else " (see --help)"
    typer.echo(f"attnctl: error: {first}{hint}", err=True)
    sys.exit(code)


app = typer.Typer(
    cls=_OneLineErrors,
    help="See what one multi-head attention layer does: tokens, shapes at every stage, "
    "per-head weights, memory.",
    context_settings={"help_option_names": ["-h", "--help"]},
    no_args_is_help=True,
    add_completion=True,  # --install-completion, --show-completion
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"attnctl {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show the traceback behind an error.")
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", "-V", callback=_version, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    _state["debug"] = debug
