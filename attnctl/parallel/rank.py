"""One rank of a tensor- and context-parallel split: ``python -m attnctl.parallel.rank`` (started
by ``attnctl/parallel/distributed.py``, never by hand).

It reads its work as one JSON document on stdin (``{"rank", "world", "port",
"tasks": [...]}``), joins the group with ``torch.distributed.init_process_group``
over TCP on 127.0.0.1 (gloo on the CPU, NCCL on CUDA), runs each task in turn on its
share of the same weights the single device would use, and writes ONE JSON document on
stdout: ``{"rank", "results": [...], "start_seconds"}`` or ``{"rank", "error"}``. Each
task is ``measure`` (block 0 under ``measure.LiveStorages``, as ``memory --measure``;
a task's ``tp`` and ``cp`` place the rank in its TP group and CP ring, :func:`rank_places`)
or ``run`` (blocks 0..N over given token ids, the output and the shown weights back).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Any

from attnctl.parallel.rank_place import (
    RankPlace,
    _config,
    _full_model,
    _rank_weights,
    _stages,
    rank_places,
)
from attnctl.parallel.rank_training import train_task

STARTED = time.perf_counter()

# a test's way to make a rank fail, crash or hang: "error:RANK", "crash:RANK", "hang"
FAULT_VARIABLE = "ATTNCTL_TEST_RANK_FAULT"


def _die_with_parent(parent: int) -> None:
    """Linux: a signal when the parent dies, so no rank outlives attnctl even when it is
    killed outright (SIGKILL leaves it no time to kill the ranks itself)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # it died before the prctl: go now
        os._exit(1)


def measure_task(task: dict[str, Any], place: RankPlace, device) -> dict[str, Any]:
    """Block 0 with the embeddings under LiveStorages, as ``measure.measure_forward``:
    the rank's heads (its TP group's share) of its chunk of the sequence (its CP ring's
    share, attended by ring attention)."""
    import contextlib

    import torch

    from attnctl.memory.measure import _measure
    from attnctl.model.layout import Layout
    from attnctl.nn.collectives import TensorGroup
    from attnctl.nn.layer import Recorder
    from attnctl.nn.model import forward
    from attnctl.nn.ring_attention import running
    from attnctl.parallel.plan import rank_plan

    config = _config(task["config"])
    group, ring = place.group, place.ring
    layout = Layout(tp=place.tp, sp=bool(task["sp"]), cp=place.cp)
    model_dir = task.get("model_dir")
    full = _full_model(config, task["vocab_size"], model_dir)
    model = None if model_dir is None else full
    plan = rank_plan(
        config, task["seq_len"], task["batch"], task["vocab_size"], layout, model,
        cp_rank=place.cp_rank,
    )  # fmt: skip
    torch.manual_seed(config.seed)  # the seeded layer's weights, then the token ids drawn
    shard = _rank_weights(full, config, device, group or TensorGroup(0, 1), None)
    drawn = torch.randint(0, full.vocab_size, (plan.batch, task["seq_len"]), device=device)
    chunk = task["seq_len"] // place.cp  # this rank's tokens: (B, L/C), its own storage
    token_ids = drawn[:, place.cp_rank * chunk : (place.cp_rank + 1) * chunk].clone()
    del drawn
    offset = 0 if ring is None else ring.offset
    recorder = Recorder()

    def run(record) -> None:
        def both(name: str, tensor: torch.Tensor, dims: str) -> None:
            recorder(name, tensor, dims)
            record(name, tensor, dims)

        with running(ring) if ring is not None else contextlib.nullcontext():
            forward(plan.description, shard, token_ids, record=both, last=0, recorded=0,
                    group=group, offset=offset)  # fmt: skip

    stored = list(shard.values())
    parameter_bytes = sum(t.numel() * t.element_size() for t in stored)
    measured = _measure(run, stored, [token_ids], parameter_bytes, device)
    return {
        "rank": place.rank,
        "parameter_bytes": measured.parameter_bytes,
        "peak_activation_bytes": measured.peak_activation_bytes,
        "stage_peak_bytes": list(measured.stage_peak_bytes),
        "method": measured.method,
        "device": measured.device,
        "stages": _stages(recorder.stages),
    }


def run_task(task: dict[str, Any], group, device) -> dict[str, Any]:
    """Blocks 0..``last`` over the given token ids: this rank's output (its L / T tokens
    under SP), its stages of block ``last`` and the weights of its shown heads."""
    import torch

    from attnctl.model.layout import Layout, rank_heads
    from attnctl.nn.layer import Recorder
    from attnctl.nn.model import forward
    from attnctl.parallel.plan import rank_plan

    config = _config(task["config"])
    layout = Layout(tp=group.size, sp=group.sequence_parallel)
    model_dir = task.get("model_dir")
    last = task["last"]
    token_ids = torch.tensor(task["token_ids"], device=device)  # (B, L)
    full = _full_model(config, task["vocab_size"], model_dir)
    model = None if model_dir is None else full
    batch, seq_len = token_ids.shape
    plan = rank_plan(config, seq_len, batch, task["vocab_size"], layout, model, layer_index=last)
    shard = _rank_weights(full, config, device, group, last + 1)
    attention = full.blocks[last].attention.config
    mine, _ = rank_heads(attention.heads, attention.kv_heads, group.size, group.rank)
    shown = [h for h in task["heads"] if h in mine]
    local = [h - mine.start for h in shown] or [0]  # a window of one head at least
    padding = task.get("padding")
    if padding is not None:
        padding = torch.tensor(padding, dtype=torch.bool, device=device)  # (B, Lk)
    recorder = Recorder()
    with torch.inference_mode():
        result = forward(
            plan.description, shard, token_ids, last=last, records={last: recorder},
            padding=padding, shown=[last], window=(local, task["rows"]), group=group,
        )  # fmt: skip
    weights = result.windows[last][:, : len(shown)]  # (B, h, r, Lk)
    return {
        "rank": group.rank,
        "heads": shown,
        "weights": weights.float().cpu().tolist(),
        "output": result.output.float().cpu().tolist(),  # (B, L or L/T, D)
        "stages": _stages(recorder.stages),
    }


def buffers_task(task: dict[str, Any], group, device) -> dict[str, Any]:
    """What the backend allocates inside each collective of ``nn/collectives.py``, beyond
    the tensors it is given: the rise of this process's peak resident memory (VmHWM,
    reset first; Linux) over one collective of a float32 (B, L, D) of ``mebibytes``,
    and over one ring attention step's isend / irecv of it (``send_recv``), with every
    tensor it is handed already in memory."""
    import torch
    import torch.distributed as dist

    from attnctl.nn.collectives import TensorGroup, gather_sequence, reduce_partial

    width, batch = 64, 2
    length = task["mebibytes"] * 2**20 // 4 // batch // width
    length -= length % group.size
    split = TensorGroup(group.rank, group.size, sequence_parallel=True)
    whole = TensorGroup(group.rank, group.size)
    partial = torch.ones(batch, length, width, device=device)  # (B, L, D)
    mine = torch.ones(batch, length // group.size, width, device=device)  # (B, L/T, D)
    incoming = torch.zeros_like(partial)  # (B, L, D): ring attention's receive buffer
    risen = {}
    for name, collective in (
        ("all_gather", lambda: gather_sequence(split, mine)),
        ("reduce_scatter", lambda: reduce_partial(split, partial)),
        ("all_reduce", lambda: reduce_partial(whole, partial)),
        ("reduce", lambda: _in_place(dist.reduce, partial, dst=0)),  # ZeRO 2's gradients
        ("broadcast", lambda: _in_place(dist.broadcast, partial, src=0)),  # ZeRO's pieces
        ("send_recv", lambda: _ring_pass(group, partial, incoming)),
    ):
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # the peak resident memory starts again from here
        before = _resident_peak()
        returned = collective()
        after = _resident_peak()
        handed = returned is partial or returned is incoming
        made = 0 if handed else returned.numel() * returned.element_size()
        risen[name] = after - before - made  # what it returned is not the backend's own
        del returned
    return {"rank": group.rank, "bytes": batch * length * width * 4, "buffers": risen}


def _in_place(collective, tensor, **where):
    """``collective(tensor, ...)``, which works in place: returns ``tensor``."""
    collective(tensor, **where)
    return tensor


def _ring_pass(group, sent, received):
    """One step of ring attention's transfers: ``sent`` to the next rank, the one
    before's into ``received`` (``batch_isend_irecv``, as ``nn/ring_attention.attend``);
    returns ``received``, which was already in memory."""
    import torch.distributed as dist

    after, before = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, sent, after), dist.P2POp(dist.irecv, received, before)]
    )
    for work in works:
        work.wait()
    return received


def _resident_peak() -> int | None:
    """This process's peak resident memory (Linux's VmHWM), or None elsewhere."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _fault(rank: int) -> None:
    """A test's fault, before a task runs (FAULT_VARIABLE; unset: nothing)."""
    fault = os.environ.get(FAULT_VARIABLE, "")
    kind, _, which = fault.partition(":")
    if not fault or (which and int(which) != rank):
        return
    if kind == "hang":
        time.sleep(3600)
    if kind == "error":
        from attnctl.errors import AttnctlError

        raise AttnctlError("a failure asked for by " + FAULT_VARIABLE)
    if kind == "crash":
        os._exit(3)  # no JSON at all: the parent says how it ended


TASKS = {"measure": measure_task, "run": run_task, "buffers": buffers_task}
PLACED = {"measure": measure_task, "train": train_task}  # given the rank's place


def main() -> int:
    document = json.loads(sys.stdin.read())
    rank, world = document["rank"], document["world"]
    _die_with_parent(document["parent"])
    try:
        import torch
        import torch.distributed as dist

        from attnctl.nn.collectives import TensorGroup
        from attnctl.nn.layer import resolve_device

        imported = time.perf_counter()
        threads = document.get("threads")
        if threads:
            torch.set_num_threads(threads)
        device = resolve_device(document["device"])
        backend = "gloo"
        if device.type == "cuda":  # one GPU a rank
            backend, device = "nccl", torch.device("cuda", rank)
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{document['port']}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=document["timeout"]),
        )
        joined = time.perf_counter()
        results = []
        places = rank_places(rank, world, document["tasks"])
        for task, place in zip(document["tasks"], places, strict=True):
            _fault(rank)
            if task["kind"] in PLACED:
                results.append(PLACED[task["kind"]](task, place, device))
            else:  # a --tp split over the whole world
                group = place.group or TensorGroup(rank, world, bool(task["sp"]))
                results.append(TASKS[task["kind"]](task, group, device))
        dist.barrier()  # every rank done with every collective before any leaves
        reply = {
            "rank": rank,
            "results": results,
            "import_seconds": imported - STARTED,
            "join_seconds": joined - imported,
            "work_seconds": time.perf_counter() - joined,
            "resident_peak_bytes": _resident_peak(),
        }
    except Exception as error:  # one line for the parent, whatever it was
        from attnctl.errors import AttnctlError

        text = error.message if isinstance(error, AttnctlError) else f"{type(error).__name__}: "
        if not isinstance(error, AttnctlError):
            text += (str(error).strip().splitlines() or [""])[0]
        reply = {"rank": rank, "error": text}
    sys.stdout.write(json.dumps(reply))
    sys.stdout.flush()
    # out at once: the group's threads are not torn down (gloo's teardown may abort
    # while a peer is gone), and the parent kills what is left of the ranks anyway
    os._exit(0 if "error" not in reply else 1)


if __name__ == "__main__":
    main()
