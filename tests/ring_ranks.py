"""Context-parallel ranks for the tests: C gloo processes on the loopback address, each
running its chunk of the seeded layer under ring attention and measuring what it holds.

:func:`run_ring` starts them (forked from a fork server, a free port, bounded waits,
killed in a finally)
and returns each rank's :class:`RankResult` for each case.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.multiprocessing as mp

VOCAB = 50
TIMEOUT_S = 60


@dataclass(frozen=True)
class Case:
    options: dict  # build_config's keyword arguments (a checkpoint's: its run settings)
    seq_len: int
    batch: int = 1
    model: str = ""  # a checkpoint folder: its block ``layer`` (after blocks 0 … layer - 1)
    layer: int = 0
    train: bool = False  # the backward of (output ∘ probe).sum() instead of a measured forward


@dataclass
class RankResult:
    output: list  # (B, L/C, D) as lists (a tensor would pass as shared memory, which
    # outlives no process): this rank's chunk of the layer's output, in float32
    peak_bytes: int  # measured activations at the busiest moment (LiveStorages)
    stage_peak_bytes: tuple[int, ...]  # measured, at each recorded stage
    stages: list[tuple[str, tuple[int, ...], str]]  # recorded: name, shape, dtype
    kv_cache_bytes: int  # the K and V this rank keeps (its L/C tokens)
    ops: list[str]  # the aten / c10d ops the dispatch mode saw, once each
    gradients: dict | None = None  # a training case's: every weight's gradient here
    phase_peak_bytes: tuple[int, ...] = ()  # a training case's step, measured (measure_step)
    gradient_window_bytes: tuple[int, ...] = ()
    stage_window_bytes: tuple[int, ...] = ()


def probe(case: Case, width: int) -> torch.Tensor:
    """A training case's (B, L, D) weights of the output in the loss, the same everywhere."""
    generator = torch.Generator().manual_seed(4321)
    return torch.randn(case.batch, case.seq_len, width, generator=generator)


def token_ids(case: Case, vocab_size: int = VOCAB) -> torch.Tensor:
    """The case's (B, L) input, the same in every process."""
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab_size, (case.batch, case.seq_len), generator=generator)


def setting(case: Case):
    """(the run's config, the checkpoint's description or None, the vocabulary size)."""
    from attnctl.model.config import build_config

    if not case.model:
        return build_config(device="cpu", **case.options), None, VOCAB
    from pathlib import Path

    from attnctl.model.families import read_model

    spec = read_model(Path(case.model))
    return spec.layer_config(device="cpu", **case.options), spec, spec.vocab_size


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ring(size: int, cases: list[Case]) -> list[list[RankResult]]:
    """``size`` ranks each running every case: results[case][rank]."""
    # a fork server that has imported torch and attnctl forks each rank: no rank pays the
    # imports, and none is forked from a process whose OpenMP threads have run
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(
        ["torch", "torch.distributed", "ring_ranks", "attnctl.stages.plan"]
    )
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_rank_main, args=(rank, size, port, cases, results), daemon=True)
        for rank in range(size)
    ]
    try:
        for process in processes:
            process.start()
        by_rank = {}
        for _ in range(size):
            try:
                rank, outcome = results.get(timeout=TIMEOUT_S)
            except queue.Empty:
                raise AssertionError(f"a ring rank gave no answer in {TIMEOUT_S} s") from None
            if isinstance(outcome, str):
                raise AssertionError(f"ring rank {rank} failed:\n{outcome}")
            by_rank[rank] = outcome
        for process in processes:
            process.join(timeout=TIMEOUT_S)
        return [[by_rank[rank][n] for rank in range(size)] for n in range(len(cases))]
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=5)


def _rank_main(rank: int, size: int, port: int, cases: list[Case], results) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=TIMEOUT_S),
        )
        try:
            results.put((rank, [_run_case(rank, size, case) for case in cases]))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _train_case(rank: int, size: int, case: Case) -> RankResult:
    """The rank's chunk of the layer forward and backward (ring attention's own backward):
    its output and every weight's gradient, this rank's share (the ranks' sum is one
    device's)."""
    from attnctl.model.layout import Layout
    from attnctl.nn.model import forward
    from attnctl.nn.ring_attention import Ring, running
    from attnctl.nn.weights import model_weights
    from attnctl.parallel.plan import rank_plan

    config, model, vocab_size = setting(case)
    plan = rank_plan(config, case.seq_len, case.batch, vocab_size, Layout(cp=size), model,
                     case.layer, cp_rank=rank)  # fmt: skip
    torch.manual_seed(config.seed)
    weights = model_weights(plan.description, plan.config, torch.device("cpu"), blocks=None)
    named = {k: v.detach().requires_grad_() for k, v in weights.named.items()}
    chunk = case.seq_len // size
    ids = token_ids(case, vocab_size)[:, rank * chunk : (rank + 1) * chunk].clone()  # (B, L/C)
    ring = Ring(rank, size, case.seq_len)
    with running(ring):
        output = forward(plan.description, named, ids, last=case.layer, offset=ring.offset,
                         training=True).output  # (B, L/C, D)  # fmt: skip
    mine = probe(case, output.shape[-1])[:, rank * chunk : (rank + 1) * chunk]
    (output.float() * mine).sum().backward()
    gradients = {k: v.grad.float().tolist() for k, v in named.items() if v.grad is not None}
    measured = _measured_step(plan, weights, ids, ring, case.layer)
    return RankResult(output.detach().float().tolist(), 0, (), [], 0, [], gradients,
                      measured.phase_peak_bytes, measured.gradient_window_bytes,
                      measured.stage_window_bytes)  # fmt: skip


def _measured_step(plan, weights, ids, ring, layer: int):
    """The rank's training step as ``measure.measure_training`` runs one device's: loss =
    output.sum(), Adam on the weights (the shared ones, then the block's), under
    ``measure.measure_step``."""
    from attnctl.memory.measure import measure_step
    from attnctl.nn.model import forward
    from attnctl.nn.ring_attention import running

    named = {k: v.detach().clone().requires_grad_() for k, v in weights.named.items()}
    parameters = [v for k, v in named.items() if not k.startswith("blocks.")]
    parameters += [v for k, v in named.items() if k.startswith("blocks.")]
    parameter_bytes = sum(p.numel() * p.element_size() for p in parameters)

    def run(record):
        with running(ring):
            return forward(plan.description, named, ids, last=layer, offset=ring.offset,
                           record=record, training=True)  # fmt: skip

    return measure_step(run, parameters, [ids], parameter_bytes,
                        plan.config.dtype != "float32", torch.device("cpu"))  # fmt: skip


def _run_case(rank: int, size: int, case: Case) -> RankResult:
    if case.train:
        return _train_case(rank, size, case)
    from attnctl.memory.measure import LiveStorages, _measure_dispatch
    from attnctl.model.layout import Layout
    from attnctl.nn.model import forward
    from attnctl.nn.ring_attention import Ring, running
    from attnctl.nn.weights import model_weights
    from attnctl.parallel.plan import rank_plan

    config, model, vocab_size = setting(case)
    layout = Layout(cp=size)
    plan = rank_plan(
        config, case.seq_len, case.batch, vocab_size, layout, model, case.layer, cp_rank=rank
    )
    description = plan.description
    torch.manual_seed(config.seed)
    weights = model_weights(description, plan.config, torch.device("cpu"), blocks=None)
    chunk = case.seq_len // size
    ids = token_ids(case, vocab_size)[:, rank * chunk : (rank + 1) * chunk].clone()  # (B, L/C)
    blocks = dict(last=case.layer, recorded=case.layer)
    ring = Ring(rank, size, case.seq_len)
    outputs: list[torch.Tensor] = []
    stages: list[tuple[str, tuple[int, ...], str]] = []
    ops: dict[str, None] = {}

    def run(record) -> None:
        def both(name: str, tensor: torch.Tensor, dims: str) -> None:
            stages.append((name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")))
            record(name, tensor, dims)

        with running(ring):
            result = forward(
                description, weights.named, ids, record=both, offset=ring.offset, **blocks
            )
        outputs.append(result.output)

    original = LiveStorages.__torch_dispatch__

    def seen(self, func, types, args=(), kwargs=None):
        ops[str(func)] = None
        return original(self, func, types, args, kwargs)

    LiveStorages.__torch_dispatch__ = seen
    try:
        measured = _measure_dispatch(run, weights.stored, [ids], weights.parameter_bytes, "cpu")
    finally:
        LiveStorages.__torch_dispatch__ = original
    cache: list[torch.Tensor] = []
    with torch.inference_mode(), running(ring):
        last = description.layers - 1  # every block's K and V, as measure_forward keeps them
        forward(description, weights.named, ids, last=last, recorded=None, cache=cache,
                offset=ring.offset)  # fmt: skip
    return RankResult(
        outputs[0].float().tolist(),
        measured.peak_activation_bytes,
        measured.stage_peak_bytes,
        stages,
        sum(t.untyped_storage().nbytes() for t in cache),
        list(ops),
    )


_DECLARED: dict[str, dict[int, list[Case]]] = {}  # test module -> ring size -> its cases


def declare_rings(module: str, rings: dict[int, list[Case]]) -> dict[int, list[Case]]:
    """A test module's rings (size -> cases), run by the session's :class:`RingPool`."""
    _DECLARED[module] = rings
    return rings


class RingPool:
    """Runs the declared rings of the ``modules`` selected this session, one start per
    ring size for all of them, on first demand (each start costs seconds: the ranks
    join, warm up, run); a module gets its own cases' results, in its order."""

    def __init__(self, modules: set[str]) -> None:
        self._modules = modules
        self._results: dict[tuple[str, int], list[list[RankResult]]] = {}

    def get(self, module: str, size: int) -> list[list[RankResult]]:
        if (module, size) not in self._results:
            users = [m for m, rings in _DECLARED.items()
                     if size in rings and (m in self._modules or m == module)
                     and (m, size) not in self._results]  # fmt: skip
            cases = [case for m in users for case in _DECLARED[m][size]]
            results = run_ring(size, cases)
            first = 0
            for m in users:
                last = first + len(_DECLARED[m][size])
                self._results[m, size] = results[first:last]
                first = last
        return self._results[module, size]
