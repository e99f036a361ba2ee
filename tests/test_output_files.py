"""--html, --svg and --save FILE: one check before the run, one atomic write after it.

Every refusal is one line on stderr, exit 2, nothing on stdout, before the run starts, and
no file is created. The tests run as root, where permissions bind nobody: an unwritable
folder is also tried where root cannot write (/proc, /sys).
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attnctl.cli import app

SMALL = ("--d-model", "16", "--heads", "2", "--device", "cpu", "--seed", "1")
RUN = ("run", "the cat", *SMALL)
# each option and a file name it accepts
OPTIONS = {"--html": "out.html", "--svg": "out.svg", "--save": "out.safetensors"}
RUNNER = CliRunner()


def invoke(*args: str):
    env = {"COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"}
    return RUNNER.invoke(app, list(args), env=env)


@pytest.fixture
def run_not_reached(monkeypatch):
    """Fail the test if the run starts: refusals come before it."""
    import attnctl.app.use_cases as use_cases

    def not_reached(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(use_cases, "run_use_case", not_reached)


def refused(result, option: str, says: str, code: int = 2) -> None:
    assert result.exit_code == code, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"attnctl: error: {option} ") and says in lines[0], lines[0]


def listing(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


# ---------------------------------------------------------------- what may be written


@pytest.mark.parametrize("option", OPTIONS)
def test_a_symlink_is_followed_and_its_target_written(option, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    name = OPTIONS[option]
    link = tmp_path / name
    link.symlink_to(elsewhere / name)  # dangling: the target is written in its folder
    result = invoke(*RUN, option, str(link))
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and os.readlink(link) == str(elsewhere / name)
    written = (elsewhere / name).read_bytes()
    assert len(written) > 100
    assert listing(elsewhere) == [name]  # no temporary file left
    # an existing target is replaced through the link, which stays
    (elsewhere / name).write_bytes(b"old")
    assert invoke(*RUN, option, str(link)).exit_code == 0
    # (safetensors may order its header differently from one write to the next)
    assert link.is_symlink() and len((elsewhere / name).read_bytes()) == len(written)
    assert listing(tmp_path) == ["elsewhere", name] and listing(elsewhere) == [name]


@pytest.mark.parametrize("option", OPTIONS)
def test_a_fifo_is_refused_also_through_a_symlink(option, tmp_path, run_not_reached):
    fifo = tmp_path / OPTIONS[option]
    os.mkfifo(fifo)
    refused(invoke(*RUN, option, str(fifo)), option, "is a FIFO, not a regular file")
    link = tmp_path / f"link{OPTIONS[option]}"
    link.symlink_to(fifo)
    refused(invoke(*RUN, option, str(link)), option, "is a FIFO, not a regular file")
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and link.is_symlink()
    assert listing(tmp_path) == sorted([fifo.name, link.name])


@pytest.mark.parametrize("option", OPTIONS)
def test_a_device_is_refused(option, tmp_path, run_not_reached):
    # through a link in tmp_path, so that a regression replaces the link, not /dev/null
    link = tmp_path / OPTIONS[option]
    link.symlink_to("/dev/null")
    refused(invoke(*RUN, option, str(link)), option, "is a character device")
    assert link.is_symlink() and stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.parametrize("option", OPTIONS)
def test_a_folder_is_refused_also_through_a_symlink(option, tmp_path, run_not_reached):
    folder = tmp_path / OPTIONS[option]
    folder.mkdir()
    refused(invoke(*RUN, option, str(folder)), option, "is a folder, not a file")
    link = tmp_path / f"link{OPTIONS[option]}"
    link.symlink_to(folder)
    refused(invoke(*RUN, option, str(link)), option, "is a folder, not a file")
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("option", OPTIONS)
def test_a_missing_folder_is_refused_in_the_same_words(option, tmp_path, run_not_reached):
    missing = tmp_path / "missing" / OPTIONS[option]
    refused(invoke(*RUN, option, str(missing)), option, f"no folder {missing.parent}")
    assert listing(tmp_path) == []


@pytest.mark.parametrize("option", OPTIONS)
def test_a_dash_is_refused_by_name(option, tmp_path, monkeypatch, run_not_reached):
    monkeypatch.chdir(tmp_path)
    refused(invoke(*RUN, option, "-"), option, "'-' is not a file name here")
    assert listing(tmp_path) == []


# ---------------------------------------------------------------- folders nobody may write


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("folder", ["/proc", "/sys"])
def test_a_folder_root_cannot_write_is_refused_before_the_run(option, folder, run_not_reached):
    # os.access says yes to root here; only really creating a file tells
    if not Path(folder).is_dir():
        pytest.fail(f"{folder} is missing: the test needs Linux's {folder}")
    target = f"{folder}/{OPTIONS[option]}"
    refused(invoke(*RUN, option, target), option, f"the folder {folder} is not writable")
    assert not os.path.lexists(target)


@pytest.mark.parametrize(
    "command",
    [
        ("shapes", "-L", "8", *SMALL),
        ("memory", "-L", "64", "--d-model", "16", "--heads", "2"),
        ("check", "-L", "4", "-B", "1", *SMALL),
    ],
    ids=lambda command: command[0],
)
def test_svg_on_every_command_refuses_such_a_folder_before_printing(command):
    refused(invoke(*command, "--svg", "/proc/view.svg"), "--svg", "the folder /proc is not")
    assert not os.path.lexists("/proc/view.svg")


@pytest.mark.parametrize("option", OPTIONS)
def test_a_read_only_folder_is_refused_exactly_when_a_file_cannot_be_made_there(option, tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        try:  # root may write here anyway: the check must agree with what really happens
            (folder / "probe").touch()
            (folder / "probe").unlink()
            writable = True
        except PermissionError:
            writable = False
        result = invoke(*RUN, option, str(folder / OPTIONS[option]))
        if writable:
            assert result.exit_code == 0, result.output
            assert listing(folder) == [OPTIONS[option]]
        else:
            refused(result, option, "is not writable")
            assert listing(folder) == []
    finally:
        folder.chmod(0o700)


# ---------------------------------------------------------------- one file, two options


@pytest.mark.parametrize(
    ("first", "second", "name"),
    [
        ("--html", "--svg", "same.out"),
        ("--save", "--html", "same.safetensors"),
        ("--save", "--svg", "same.safetensors"),
    ],
)
def test_two_outputs_naming_one_file_are_refused(
    first, second, name, tmp_path, monkeypatch, run_not_reached
):
    monkeypatch.chdir(tmp_path)
    says = f"{first} and {second} name the same file: {name}"
    refused(invoke(*RUN, first, name, second, name), first, says)
    refused(invoke(*RUN, second, f"./{name}", first, name), first, says)
    assert listing(tmp_path) == []
    # through a symlink, and an existing file through a hard link
    Path("link").symlink_to(name)
    refused(invoke(*RUN, first, name, second, "link"), first, "name the same file")
    Path(name).write_bytes(b"old")
    os.link(name, "hard")
    refused(invoke(*RUN, first, name, second, "hard"), first, "name the same file")
    assert Path(name).read_bytes() == b"old" and listing(tmp_path) == ["hard", "link", name]


def test_three_different_files_are_written(tmp_path):
    paths = {option: tmp_path / name for option, name in OPTIONS.items()}
    result = invoke(*RUN, *(str(part) for item in paths.items() for part in item))
    assert result.exit_code == 0, result.output
    assert listing(tmp_path) == sorted(OPTIONS.values())


# ---------------------------------------------------------------- modes


@pytest.fixture
def umask():
    """Set the process's umask for a test; restored after."""
    before = os.umask(0o022)
    try:
        yield os.umask
    finally:
        os.umask(before)


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002], ids=oct)
def test_a_new_file_gets_0666_less_the_umask(option, mask, tmp_path, umask):
    umask(mask)
    target = tmp_path / OPTIONS[option]
    result = invoke(*RUN, option, str(target))
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~mask


@pytest.mark.parametrize("option", OPTIONS)
def test_an_existing_file_keeps_its_mode(option, tmp_path, umask):
    umask(0o022)
    target = tmp_path / OPTIONS[option]
    target.write_bytes(b"old")
    target.chmod(0o640)
    result = invoke(*RUN, option, str(target))
    assert result.exit_code == 0, result.output
    assert target.read_bytes() != b"old"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640


# ---------------------------------------------------------------- a failed write


@pytest.mark.parametrize("option", OPTIONS)
def test_a_full_disk_is_one_line_naming_the_users_path_and_leaves_nothing(
    option, tmp_path, monkeypatch
):
    import attnctl.output_files as output_files

    real_fdopen = os.fdopen

    class FullDisk:
        """The temporary file's stream: half of it fits, then the disk is full."""

        def __init__(self, descriptor: int, *args, **kwargs) -> None:
            self.stream = real_fdopen(descriptor, *args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc_info) -> None:
            self.stream.close()

        def write(self, data: bytes) -> int:
            self.stream.write(data[: len(data) // 2])
            self.stream.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"/{tmp_path}/.tmp-name")

    monkeypatch.setattr(output_files.os, "fdopen", FullDisk)
    if option == "--save":  # safetensors writes the tensors itself, and says so its own way
        import safetensors.torch
        from safetensors import SafetensorError

        def full_disk(tensors, filename, metadata=None) -> None:
            Path(filename).write_bytes(b"half a file")
            raise SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28) "
                f'at path "{tmp_path}/.tmpAb12"'
            )

        monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    name = OPTIONS[option]
    (tmp_path / name).write_bytes(b"old")
    link = tmp_path / f"link-{name}"
    link.symlink_to(name)
    result = invoke(*RUN, option, str(link))
    assert result.exit_code == 1
    assert result.stderr == f"attnctl: error: {option} {link}: No space left on device\n"
    assert (tmp_path / name).read_bytes() == b"old"
    assert listing(tmp_path) == sorted([name, link.name])  # no temporary file


def test_the_module_is_light():
    code = (
        "import sys, attnctl.output_files\n"
        "print(sorted(m for m in ('torch', 'rich', 'safetensors') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
