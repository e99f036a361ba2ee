"""Starting the ranks: one ``python -m attnctl.parallel.rank`` process a rank, each in a
process group of its own, joined over TCP on the loopback at a free port; their replies
read back; every rank ended with attnctl (at exit, on a failure, on Ctrl-C)."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from attnctl.errors import RUNTIME, AttnctlError

# a rank's start: torch imported (0.8 s warm on this machine, ~20 s from a cold disk),
# then the group joined; the work's own time is added by the caller's estimate
START_SECONDS = 60.0

DEFAULT_TIMEOUT_SECONDS = 300.0

# what a rank says when another one died under it: the other's message is the cause
LOST_PEER = ("Connection closed by peer", "remote worker", "Connection reset")


@dataclass
class RankReply:
    rank: int
    results: list[dict[str, Any]]
    timings: dict[str, float]
    resident_peak_bytes: int | None = None  # the process's peak resident memory (Linux)


def threads_per_rank(ranks: int) -> int:
    """OMP_NUM_THREADS for each rank: the cores shared out, one at least."""
    return max(1, (os.cpu_count() or 1) // ranks)


def free_port() -> int:
    """A TCP port nothing listens on, on the loopback address only."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _kill_groups(groups: set[int]) -> None:
    for group in list(groups):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
        groups.discard(group)


def _rank_environment(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",  # the loopback only: never another interface
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        GLOO_SOCKET_IFNAME=_loopback_name(),
        PYTHONUNBUFFERED="1",
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _loopback_name() -> str:
    """The loopback interface's name (gloo binds its sockets there, not elsewhere)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        names = []
    return "lo" if "lo" in names or not names else names[0]


def run_ranks(
    world: int,
    tasks: list[dict[str, Any]],
    device: str = "cpu",
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
) -> list[RankReply]:
    """Start ``world`` ranks, each running ``tasks`` in turn; their replies in rank order.

    Raises AttnctlError (exit 1) with the first failing rank's message, or when a rank
    ends without a reply, or when they are not done within ``timeout`` seconds; every
    rank is killed first."""
    port = free_port()
    threads = threads_per_rank(world)
    env = _rank_environment(threads)
    started: list[tuple[subprocess.Popen, Any, Any]] = []
    groups: set[int] = set()
    with contextlib.ExitStack() as files:
        try:
            for rank in range(world):
                out = files.enter_context(tempfile.TemporaryFile())
                err = files.enter_context(tempfile.TemporaryFile())
                process = subprocess.Popen(
                    [sys.executable, "-m", "attnctl.parallel.rank"],
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=err,
                    env=env,
                    start_new_session=True,  # its own process group: killed as one
                )
                groups.add(process.pid)
                _LIVE.add(process.pid)
                started.append((process, out, err))
                document = {
                    "rank": rank,
                    "world": world,
                    "port": port,
                    "parent": os.getpid(),
                    "device": device,
                    "threads": threads,
                    "timeout": max(30, int(timeout)),
                    "tasks": tasks,
                }
                process.stdin.write(json.dumps(document).encode())
                process.stdin.close()
            return _wait(started, timeout)
        finally:  # a failure, a timeout, Ctrl-C: no rank is left running
            _kill_groups(groups)
            _LIVE.difference_update({p.pid for p, _, _ in started})
            for process, _, _ in started:
                with contextlib.suppress(Exception):
                    process.wait(timeout=5)


def _wait(started: list[tuple[subprocess.Popen, Any, Any]], timeout: float) -> list[RankReply]:
    deadline = time.monotonic() + timeout
    replies: dict[int, RankReply] = {}
    while len(replies) < len(started):
        failures = []  # of the ranks that ended since the last look
        for rank, (process, out, err) in enumerate(started):
            if rank in replies or process.poll() is None:
                continue
            try:
                replies[rank] = _reply(rank, process.returncode, out, err)
            except AttnctlError as error:
                failures.append(error)
        if failures:  # the cause, not the ranks that lost their peer because of it
            raise min(failures, key=lambda e: any(w in e.message for w in LOST_PEER))
        if len(replies) < len(started):
            if time.monotonic() > deadline:
                running = [r for r in range(len(started)) if r not in replies]
                raise AttnctlError(
                    f"rank {running[0]}: no reply within {timeout:g} s; every rank stopped",
                    exit_code=RUNTIME,
                )
            time.sleep(0.02)
    return [replies[rank] for rank in range(len(started))]


def _reply(rank: int, code: int, out: Any, err: Any) -> RankReply:
    out.seek(0)
    text = out.read().decode(errors="replace").strip()
    try:
        document = json.loads(text) if text else None
    except ValueError:
        document = None
    if isinstance(document, dict) and "error" in document:
        raise AttnctlError(f"rank {rank}: {document['error']}", exit_code=RUNTIME)
    if not isinstance(document, dict) or code != 0:
        err.seek(0)
        lines = [line for line in err.read().decode(errors="replace").splitlines() if line]
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        said = f": {lines[-1].strip()}" if lines else ""
        raise AttnctlError(f"rank {rank} {how} without a result{said}", exit_code=RUNTIME)
    timings = {k: float(v) for k, v in document.items() if k.endswith("_seconds")}
    return RankReply(rank, document["results"], timings, document.get("resident_peak_bytes"))


_LIVE: set[int] = set()  # the process groups of ranks still running
atexit.register(_kill_groups, _LIVE)
