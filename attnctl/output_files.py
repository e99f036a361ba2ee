"""The files ``--save``, ``--html`` and ``--svg`` write: checked before the run, written after it.

:func:`checked_output` refuses (exit 2, before anything runs) a path that cannot be an output
file: an empty name, ``-`` (stdin elsewhere, not a file name), a folder, a missing folder, a
device, FIFO or socket, or a folder where a file cannot really be created (a temporary file
is created and removed there: ``os.access`` says yes to root on ``/sys`` or a read-only
mount). A symlink is followed: the file written is its target, which must be missing in an
existing folder or a regular file. :func:`refuse_same_file` refuses two options naming one
file. :func:`write_atomically` writes a temporary file in the target's folder and renames it
over the target, so a reader never sees half a file; a failure (a full disk) is one line
naming the user's path, exit 1, and leaves nothing behind. A new file gets ``0666 & ~umask``,
as ``open()`` would make it; an existing file keeps its permission bits (as ``>`` would).

Only the standard library is imported: the startup path stays light.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from attnctl.errors import RUNTIME, USAGE, AttnctlError
from attnctl.literal import printable

_NOT_REGULAR = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


@dataclass(frozen=True)
class OutputFile:
    """An output path that passed :func:`checked_output`."""

    option: str  # "--html", "--svg", "--save"
    given: str  # as the user typed it: every message names it
    target: Path  # the file replaced: the path itself, or where its symlinks lead

    @property
    def shown(self) -> str:
        return printable(self.given)


# the outputs an enclosing command claimed (--svg, checked before the command itself runs)
_claimed: ContextVar[tuple[OutputFile, ...]] = ContextVar("attnctl_outputs", default=())


def checked_output(given: str, option: str, *, suffix: str | None = None) -> OutputFile:
    """The file ``option`` names, refused (exit 2) when it cannot be written.

    ``suffix``: the name must end in it (and be more than it).
    """
    if not given.strip():
        raise AttnctlError(f"{option} needs a file name", exit_code=USAGE)
    if given == "-":
        raise AttnctlError(
            f"{option} -: '-' is not a file name here (it is stdin elsewhere); name a file",
            exit_code=USAGE,
        )
    shown = printable(given)
    path = Path(given).expanduser()
    if suffix is not None and (not path.name.endswith(suffix) or path.name == suffix):
        raise AttnctlError(f"{option} {shown}: the file name must end in {suffix}", exit_code=USAGE)
    try:
        status: os.stat_result | None = path.stat()  # follows symlinks
    except (FileNotFoundError, NotADirectoryError):
        status = None
    except OSError as error:  # a symlink loop, a folder that may not be searched
        raise AttnctlError(
            f"{option} {shown}: {error.strerror or error}", exit_code=USAGE
        ) from error
    if status is not None and stat.S_ISDIR(status.st_mode):
        raise AttnctlError(f"{option} {shown}: is a folder, not a file", exit_code=USAGE)
    if status is not None and not stat.S_ISREG(status.st_mode):
        kind = next((name for test, name in _NOT_REGULAR if test(status.st_mode)), "a special file")
        raise AttnctlError(f"{option} {shown}: is {kind}, not a regular file", exit_code=USAGE)
    if status is not None and _is_standard_stream(status):
        raise AttnctlError(
            f"{option} {shown}: is where this command's output goes; name another file",
            exit_code=USAGE,
        )
    target = Path(os.path.realpath(path))
    folder = target.parent
    folder_shown = printable(str(folder if path.is_symlink() else path.parent))
    if not folder.is_dir():
        raise AttnctlError(f"{option} {shown}: no folder {folder_shown}", exit_code=USAGE)
    if status is not None and not os.access(target, os.W_OK):
        raise AttnctlError(f"{option} {shown}: not writable", exit_code=USAGE)
    if not (os.access(folder, os.W_OK) and os.access(folder, os.X_OK)):
        raise AttnctlError(
            f"{option} {shown}: the folder {folder_shown} is not writable", exit_code=USAGE
        )
    try:  # root passes os.access on /sys and read-only mounts: really create a file there
        handle, probe = tempfile.mkstemp(prefix=f".{target.name}.", dir=folder)
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise AttnctlError(
            f"{option} {shown}: the folder {folder_shown} is not writable "
            f"({error.strerror or error})",
            exit_code=USAGE,
        ) from error
    return OutputFile(option, given, target)


def _is_standard_stream(status: os.stat_result) -> bool:
    """Whether a regular file is the one stdout or stderr writes to (``/dev/stdout`` when
    redirected): replacing it would lose what the command prints."""
    for descriptor in (1, 2):
        try:
            stream = os.fstat(descriptor)
        except OSError:
            continue
        if (stream.st_dev, stream.st_ino) == (status.st_dev, status.st_ino):
            return True
    return False


def _identity(output: OutputFile) -> tuple[object, ...]:
    """What two outputs share when they are one file: its inode, else its resolved path."""
    try:
        status = output.target.stat()
    except OSError:
        return ("path", str(output.target))
    return ("inode", status.st_dev, status.st_ino)


def refuse_same_file(*outputs: OutputFile | None) -> None:
    """Refuse (exit 2) two outputs, given here or claimed around the command, naming one file."""
    seen: dict[tuple[object, ...], OutputFile] = {}
    for output in (*(o for o in outputs if o is not None), *_claimed.get()):
        key = _identity(output)
        first = seen.setdefault(key, output)
        if first is not output:
            raise AttnctlError(
                f"{first.option} and {output.option} name the same file: {first.shown}",
                exit_code=USAGE,
            )


@contextlib.contextmanager
def claimed(output: OutputFile) -> Iterator[None]:
    """While it lasts, :func:`refuse_same_file` also compares with ``output``."""
    token = _claimed.set((*_claimed.get(), output))
    try:
        yield
    finally:
        _claimed.reset(token)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _mode_for(target: Path) -> int:
    """An existing regular file's permission bits, else a new file's ``0666 & ~umask``."""
    try:
        status = target.stat()
    except FileNotFoundError:
        status = None
    if status is not None and stat.S_ISREG(status.st_mode):
        return stat.S_IMODE(status.st_mode) & 0o777  # no set-id or sticky bits
    return 0o666 & ~_umask()


def write_atomically(output: OutputFile, content: bytes | str) -> int:
    """Write ``content`` (text as UTF-8) to ``output``'s target atomically; its bytes."""
    data = content.encode("utf-8") if isinstance(content, str) else content

    def write(temporary: str) -> None:
        with os.fdopen(os.open(temporary, os.O_WRONLY | os.O_TRUNC), "wb") as stream:
            stream.write(data)

    write_atomically_with(output, write)
    return len(data)


def write_atomically_with(output: OutputFile, write: Callable[[str], None]) -> None:
    """Let ``write`` fill a temporary file in the target's folder (given its path), then
    rename it over ``output``'s target.

    An I/O failure (an ``OSError`` from ``write`` too) is one line naming the user's path
    (exit 1), and the temporary file is removed.
    """
    temporary: str | None = None
    try:
        mode = _mode_for(output.target)
        handle, temporary = tempfile.mkstemp(
            prefix=f".{output.target.name}.", dir=output.target.parent
        )
        os.close(handle)
        write(temporary)
        os.chmod(temporary, mode)  # mkstemp's 0600 otherwise
        os.replace(temporary, output.target)
        temporary = None
    except OSError as error:
        raise AttnctlError(
            f"{output.option} {output.shown}: {error.strerror or error}", exit_code=RUNTIME
        ) from error
    finally:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
