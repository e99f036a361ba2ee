"""Record what CUDA really allocates for attnctl's cases, and compare it with attnctl's estimate.

On a machine with an NVIDIA GPU, from the repository root (about five minutes):

    PYTHONUNBUFFERED=1 python3 benchmarks/cuda_memory.py --out OUT [--budget-s 300]

Without a GPU, to check the script itself:

    python3 benchmarks/cuda_memory.py --out OUT --dry-run                # plan, validate args
    python3 benchmarks/cuda_memory.py --out OUT --device-for-test cpu    # every phase, on the CPU

The script itself needs only the standard library (torch is imported by the processes it
starts, never by itself, so it holds no CUDA context of its own). attnctl is run as
``python3 -m attnctl ...`` with PYTHONPATH set to the repository root. Phases, in order of
value, each with its share of ``--budget-s`` (a share left unused passes on to the next;
whatever is not started by the end of the budget is recorded as skipped):

1. device (5 %) -> ``device.json``: the GPU (name, compute capability, memory, SMs), torch,
   CUDA, cuDNN, driver (nvidia-smi), the SDPA backends enabled, the allocator and cuBLAS
   variables, and the CUDA context's cost: free memory (NVML, nvidia-smi, mem_get_info) before
   any CUDA call and after init, the first allocation, matmul, cuDNN call, SDPA and backward,
   measured in a process of its own while nothing else runs on the GPU.
2. primitives (18 %) -> ``primitives.json``: ``first_ops``: in fresh processes, what
   the first matmul of each dtype, F.linear with a bias (addmm), a batched matmul, the first
   backward (the autograd thread's cuBLAS handle), SDPA and Adam add to memory_allocated and
   memory_reserved, with the new blocks the allocator holds; ``allocator_rounding``: the
   bytes the allocator gives a request of 1, 511, 512, 513 ... bytes. ``sdpa``: for float32,
   bfloat16, float16 x head dim 64/128/80/256 x masks (none, is_causal, boolean causal,
   boolean sliding window of 128, float additive causal) x kv heads 8/2 (enable_gqa) x L 512,
   2048 (B 1, H 8): torch's choice (``torch._fused_sdp_choice``), which fused kernels accept
   the inputs and why not (``can_use_*`` with debug, the warnings they give), and for the
   default backend (plus MATH at L 512) the same figures as record_primitives.py
   (``infer_peak``, ``infer_kept``, ``train_fwd_kept``, ``train_fwd_peak``,
   ``train_bwd_peak``), relative to memory_allocated before the call, with the warnings.
3. memory (32 %) -> ``memory.jsonl``: ``attnctl memory ARGS --measure --json --device cuda``,
   one process a case, ``--parallel`` (8) at a time, as the earlier recording in
   ../shared/cuda-reference: ``args``, ``command``, ``exit_code``, ``stderr_tail``, ``wall_s``,
   ``measured_peak_bytes`` (results[0].measured_peak_bytes: the forward pass's, or with
   --train the training step's), ``attnctl_estimate`` (results[0].peak_bytes, with --train
   results[0].training.peak_bytes), ``comparisons`` (every estimate the document pairs with
   a measurement: KV cache, the cache after --generate, an encoder-decoder's ``measured``),
   ``cuda_stats`` (the process's max_memory_allocated, max_memory_reserved and requested
   bytes at each reset_peak_memory_stats attnctl makes, i.e. per stage, and at exit, with
   num_alloc_retries and num_ooms: reserved - allocated is the fragmentation) and the whole
   ``document``. The cases (``--list-cases`` prints them) cover what the 56 public ones do
   not: sliding windows, GQA/MQA, float16, head dims 80/96/128/256, rope/alibi/qk-norm/
   softcap, stacks, batches, odd lengths, presets, cross-attention, a longer KV cache,
   training of each, and tiny checkpoints written at start with transformers (Llama with GQA,
   GPT-2, Mistral with a sliding window, Marian and BART encoder-decoders), generation too.
   ``runner`` ``wrapped`` means run through this script's ``_attnctl`` hook (which reads the
   allocator's figures; attnctl itself is unchanged), ``plain`` exactly as the command says.
4. timing (32 %) -> ``timing.json``: whole-process wall time and peak RSS of
   ``attnctl run --file F --device cuda --dtype bfloat16 --impl sdpa`` (output to /dev/null)
   against a plain script running the same layer (tokenize, embed, positions, q/k/v, SDPA,
   out projection, residual, LayerNorm) in bfloat16 on CUDA, 3 rounds interleaved, medians,
   at 131,072 and 32,768 tokens (bundled tokenizer); the plain script's own component
   seconds; attnctl under cProfile (top functions by own and cumulative time, attnctl's
   components) and under torch.profiler (top operators by device and CPU time); attnctl with
   ``--rows 0`` (no weight rows shown but the first).
5. fit (13 %) -> ``fit.jsonl``: ``memory --fit --device cuda`` for math/float32 and
   sdpa/bfloat16, then ``--measure`` at the answer (math: the length; sdpa: the batch at the
   default length), with ``--force`` if the pre-flight refuses, and at 1.05x the answer
   (never with --force: the pre-flight should refuse it with exit 1).

Also ``summary.txt`` (per case: estimate, measured, difference, reserved - allocated; the fit
and timing results) and ``log.txt`` (the progress lines). At most 7 files, flat in --out,
each written as it goes (JSON lines flushed a line at a time, JSON files rewritten whole
after each step), so a kill leaves what was done. Nothing raises past a case: each error is
recorded where the result would have been.

Options: --budget-s (300), --parallel (8), --case-timeout (60), --only PHASES (comma list),
--timing-tokens (131072,32768), --rounds (3), --list-cases. ``--dry-run`` runs no
measurement: it prints the plan, writes the checkpoints and texts, and checks every case's
arguments with attnctl (``--device cuda`` and ``--device cpu``, without --measure: the
estimate only) and the fit and timing commands on the CPU at small sizes.
``--device-for-test cpu`` runs every phase with ``--device cpu`` at small sizes (lengths cut
to 97 at most, texts of 2,048 and 512 tokens, ``--budget 256MiB`` for ``--fit``), so that
every path of the GPU run but the CUDA calls themselves runs once before a GPU is at hand
(``CUDA_MEMORY_TEST_FAULT=abort:5,sticky:9`` also crashes the SDPA grid at those rows, to
check that it goes on after them).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import json
import math
import os
import platform
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TOKENIZER = ROOT / "attnctl" / "data" / "tokenizer.json"
PYTHON = sys.executable or "python3"
# each phase's share of the budget; what a phase leaves unused passes on to the next
SHARES = {"device": 5, "primitives": 18, "memory": 32, "timing": 32, "fit": 13}
PHASES = tuple(SHARES)
ENV_KEYS = (
    "CUBLAS_WORKSPACE_CONFIG",
    "CUBLASLT_WORKSPACE_SIZE",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "CUDA_MODULE_LOADING",
    "CUDA_VISIBLE_DEVICES",
    "TORCH_CUDNN_V8_API_LRU_CACHE_LIMIT",
    "TORCH_CUDNN_SDPA_ENABLED",
    "NVIDIA_TF32_OVERRIDE",
    "CUDA_LAUNCH_BLOCKING",
    "OMP_NUM_THREADS",
)
STDERR_TAIL = 2000
TEST_LENGTH = 97  # --device-for-test: lengths cut to this at most


# ---------------------------------------------------------------------------------------------
# small helpers


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def short_error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:500]


def tail(text: str | None, limit: int = STDERR_TAIL) -> str:
    return (text or "")[-limit:]


def base_env(**extra: str) -> dict[str, str]:
    """The environment of every process started: attnctl from this tree, unbuffered."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["COLUMNS"] = "120"
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # bytecode cached, as on a user's machine
    env.update(extra)
    return env


def git_commit() -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        status = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if done.returncode == 0:
            dirty = " (with uncommitted changes)" if status.stdout.strip() else ""
            return done.stdout.strip() + dirty
    except Exception:
        pass
    return None


SMI_STUCK = threading.Event()  # once nvidia-smi has hung, it is not asked again


def nvidia_smi(query: str, kind: str = "gpu") -> list[dict[str, str]] | str:
    """nvidia-smi --query-{kind}=QUERY as a list of dicts, or the error as a string."""
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi not found"
    if SMI_STUCK.is_set():
        return "nvidia-smi hung before: not asked"
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-{kind}={query}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=8,
        )
    except subprocess.TimeoutExpired as error:
        SMI_STUCK.set()
        return short_error(error)
    except Exception as error:
        return short_error(error)
    if done.returncode != 0:
        return f"exit {done.returncode}: {tail(done.stdout + done.stderr, 300)}"
    keys = query.split(",")
    return [
        dict(zip(keys, (v.strip() for v in line.split(",")), strict=False))
        for line in done.stdout.splitlines()
        if line.strip()
    ]


# ---------------------------------------------------------------------------------------------
# the run: budget, output files, processes


class Run:
    """The budget, the output folder, the log, and every process started (to end on a kill)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.budget = float(args.budget_s)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix="cuda_memory_"))
        self.lock = threading.RLock()  # the signal handler may log while the lock is held
        self.live: set[subprocess.Popen] = set()
        self.log_file = open(self.out / "log.txt", "a", encoding="utf-8")  # noqa: SIM115
        self.test_device = args.device_for_test
        self.device = args.device_for_test or "cuda"
        self.dry = args.dry_run
        self.memory_rows: list[dict] = []
        self.fit_rows: list[dict] = []
        self.timing: dict[str, Any] = {}
        self.phase_seconds: dict[str, float] = {}
        self.summary_written = False
        self.device_line = ""

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def remaining(self) -> float:
        return self.budget - self.elapsed()

    def phase_end(self, phase: str) -> float:
        """Seconds from the start by which ``phase`` should be done (cumulative shares)."""
        done = 0.0
        for name in PHASES:
            done += SHARES[name]
            if name == phase:
                break
        return self.budget * done / sum(SHARES.values())

    def phase_left(self, phase: str) -> float:
        return min(self.phase_end(phase), self.budget) - self.elapsed()

    def note(self, message: str) -> None:
        line = f"[{self.elapsed():6.1f}s] {message}"
        with self.lock:
            print(line, flush=True)
            self.log_file.write(line + "\n")
            self.log_file.flush()

    def write_json(self, name: str, value: Any) -> None:
        """Rewrite OUT/name whole (through a temporary file and a rename)."""
        path = self.out / name
        text = json.dumps(value, indent=1, default=str)
        with self.lock:
            temporary = self.tmp / (name + ".part")
            temporary.write_text(text, encoding="utf-8")
            shutil.move(str(temporary), str(path))

    def append_jsonl(self, name: str, value: Any) -> None:
        line = json.dumps(value, default=str)
        with self.lock, open(self.out / name, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
            handle.flush()

    def kill_all(self) -> None:
        with self.lock:
            live = list(self.live)
        for process in live:
            with contextlib.suppress(Exception):
                process.kill()

    def process(
        self,
        command: list[str],
        timeout: float,
        env: dict[str, str] | None = None,
        capture_stdout: bool = True,
        cwd: Path = ROOT,
    ) -> dict[str, Any]:
        """Run one process to its end or ``timeout``: exit code, wall seconds, peak RSS,
        stdout (unless not captured: /dev/null), stderr. Never raises."""
        result: dict[str, Any] = {"exit_code": None, "timed_out": False}
        timeout = max(1.0, timeout)
        start = time.perf_counter()
        try:
            with (
                tempfile.TemporaryFile(dir=self.tmp) as out,
                tempfile.TemporaryFile(dir=self.tmp) as err,
            ):
                process = subprocess.Popen(
                    command,
                    stdout=out if capture_stdout else subprocess.DEVNULL,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                    env=env or base_env(),
                    cwd=str(cwd),
                )
                with self.lock:
                    self.live.add(process)
                try:
                    status, usage = self._wait(process, start, timeout, result)
                finally:
                    with self.lock:
                        self.live.discard(process)
                result["wall_s"] = round(time.perf_counter() - start, 4)
                code = os.waitstatus_to_exitcode(status)
                process.returncode = code
                result["exit_code"] = code
                result["max_rss_bytes"] = usage.ru_maxrss * 1024
                out.seek(0)
                err.seek(0)
                result["stdout"] = out.read().decode("utf-8", "replace") if capture_stdout else ""
                result["stderr"] = err.read().decode("utf-8", "replace")
        except Exception as error:
            result["error"] = short_error(error)
            result.setdefault("wall_s", round(time.perf_counter() - start, 4))
            result.setdefault("stdout", "")
            result.setdefault("stderr", "")
        return result

    @staticmethod
    def _wait(process: subprocess.Popen, start: float, timeout: float, result: dict) -> Any:
        """os.wait4 (for the child's own peak RSS), killing it past ``timeout``."""
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                return status, usage
            if time.perf_counter() - start > timeout:
                result["timed_out"] = True
                process.kill()
                _, status, usage = os.wait4(process.pid, 0)
                return status, usage
            time.sleep(0.005)


# ---------------------------------------------------------------------------------------------
# the memory cases


def memory_cases() -> list[dict[str, Any]]:
    """The cases of the memory phase, most telling first. 'CKPT/name' is a checkpoint folder
    written at start. None of them is one of the 56 public cases except the controls."""
    cases: list[dict[str, Any]] = []

    def add(group: str, args: list[Any], runner: str = "wrapped") -> None:
        cases.append(
            {
                "id": f"c{len(cases) + 1:02d}",
                "group": group,
                "args": [str(a) for a in args],
                "runner": runner,
            }
        )

    L = "--seq-len"
    f32, bf16, f16 = "float32", "bfloat16", "float16"
    public = ["--impl", "sdpa", "--dtype", bf16, L, 2048, "--mask", "none", "--batch", 1]
    add("control (public case)", public)
    add("control (public case, plain)", public, runner="plain")
    add("control (public case)", ["--impl", "math", "--dtype", f32, L, 2048, "--train"])
    # grouped-query attention: float32 SDPA falls back to math
    for dtype in (f32, bf16):
        for n in (2048, 8192):
            add("gqa", ["--kv-heads", 2, "--impl", "sdpa", "--dtype", dtype, L, n])
    add("gqa", ["--kv-heads", 2, "--impl", "math", "--dtype", f32, L, 2048])
    add("mqa", ["--kv-heads", 1, "--impl", "sdpa", "--dtype", bf16, L, 2048])
    for dtype in (f32, bf16):
        add(
            "gqa+window",
            [
                "--kv-heads",
                2,
                "--mask",
                "causal",
                "--window",
                128,
                "--impl",
                "sdpa",
                "--dtype",
                dtype,
                L,
                8192,
            ],
        )
    # sliding window: a boolean mask that SDPA converts
    for impl in ("math", "sdpa"):
        for dtype in (f32, bf16):
            for n in (2048, 8192):
                add(
                    "window",
                    ["--mask", "causal", "--window", 128, "--impl", impl, "--dtype", dtype, L, n],
                )
    # training
    for impl, dtype in (("math", f32), ("sdpa", f32), ("sdpa", bf16)):
        add(
            "train+window",
            [
                "--train",
                "--mask",
                "causal",
                "--window",
                128,
                "--impl",
                impl,
                "--dtype",
                dtype,
                L,
                2048,
            ],
        )
    for dtype in (f32, bf16):
        add("train+gqa", ["--train", "--kv-heads", 2, "--impl", "sdpa", "--dtype", dtype, L, 2048])
    add("train+layers", ["--train", "--layers", 2, "--impl", "sdpa", "--dtype", bf16, L, 2048])
    add("train+layers", ["--train", "--layers", 2, "--impl", "math", "--dtype", f32, L, 1024])
    for impl in ("math", "sdpa"):
        add("train+float16", ["--train", "--impl", impl, "--dtype", f16, L, 2048])
    add(
        "train+head_dim128",
        ["--train", "--d-model", 1024, "--heads", 8, "--impl", "sdpa", "--dtype", bf16, L, 2048],
    )
    add(
        "train+rope",
        ["--train", "--pos", "rope", "--norm", "pre", "--impl", "sdpa", "--dtype", bf16, L, 2048],
    )
    add("train+batch", ["--train", "--batch", 2, "--impl", "sdpa", "--dtype", f32, L, 2048])
    add("train+long", ["--train", "--impl", "sdpa", "--dtype", bf16, L, 8192])
    add("train+alibi", ["--train", "--pos", "alibi", "--impl", "math", "--dtype", f32, L, 1024])
    add("train+dropout", ["--train", "--dropout", 0.1, "--impl", "math", "--dtype", f32, L, 512])
    add("train+odd_length", ["--train", "--impl", "sdpa", "--dtype", bf16, L, 1000])
    # float16
    for impl in ("math", "sdpa"):
        add("float16", ["--impl", impl, "--dtype", f16, L, 2048])
    add("float16", ["--impl", "sdpa", "--dtype", f16, "--mask", "causal", L, 8192])
    # head dims (d_model / heads, or --head-dim)
    for dtype in (f32, bf16):
        add(
            "head_dim128",
            ["--d-model", 1024, "--heads", 8, "--impl", "sdpa", "--dtype", dtype, L, 2048],
        )
    add("head_dim128", ["--d-model", 1024, "--heads", 8, "--impl", "math", "--dtype", f32, L, 2048])
    for dtype in (f32, bf16):
        add(
            "head_dim256",
            ["--d-model", 1024, "--heads", 4, "--impl", "sdpa", "--dtype", dtype, L, 2048],
        )
    for dtype in (f32, bf16):
        add(
            "head_dim80",
            ["--d-model", 640, "--heads", 8, "--impl", "sdpa", "--dtype", dtype, L, 2048],
        )
    add("head_dim96", ["--head-dim", 96, "--impl", "sdpa", "--dtype", bf16, L, 2048])
    # positions, norms, scores
    for dtype in (f32, bf16):
        add(
            "rope+pre",
            ["--pos", "rope", "--norm", "pre", "--impl", "sdpa", "--dtype", dtype, L, 2048],
        )
    add(
        "rope+rms+causal",
        [
            "--pos",
            "rope",
            "--norm",
            "pre",
            "--norm-type",
            "rms",
            "--mask",
            "causal",
            "--impl",
            "sdpa",
            "--dtype",
            bf16,
            L,
            2048,
        ],
    )
    add(
        "qk_norm",
        ["--qk-norm", "head", "--norm-type", "rms", "--impl", "sdpa", "--dtype", bf16, L, 2048],
    )
    for dtype in (f32, bf16):
        add("alibi", ["--pos", "alibi", "--impl", "math", "--dtype", dtype, L, 2048])
    add("softcap", ["--softcap", 50, "--impl", "math", "--dtype", f32, L, 2048])
    add("no_bias", ["--no-bias", "--impl", "sdpa", "--dtype", bf16, L, 2048])
    # stacks and batches
    for layers in (2, 4):
        add("layers", ["--layers", layers, "--impl", "sdpa", "--dtype", bf16, L, 2048])
    add("layers", ["--layers", 2, "--impl", "math", "--dtype", f32, L, 2048])
    add(
        "layers+sliding",
        [
            "--layers",
            4,
            "--sliding",
            "sssf",
            "--mask",
            "causal",
            "--window",
            128,
            "--impl",
            "sdpa",
            "--dtype",
            bf16,
            L,
            2048,
        ],
    )
    add("batch", ["--batch", 4, "--impl", "sdpa", "--dtype", bf16, L, 2048])
    add("batch", ["--batch", 4, "--impl", "math", "--dtype", f32, L, 1024])
    # odd lengths: rounding
    for n in (1000, 3001):
        for impl, dtype in (("math", f32), ("sdpa", f32), ("sdpa", bf16)):
            add("odd_length", ["--impl", impl, "--dtype", dtype, L, n])
    add("odd_length", ["--impl", "sdpa", "--dtype", bf16, L, 1])
    add("odd_length", ["--impl", "math", "--dtype", f32, L, 77])
    # presets, cross-attention, a KV cache longer than the input
    for impl, dtype in (("math", f32), ("sdpa", bf16)):
        add(
            "cross_attention",
            [
                "--config",
                "cross-attention",
                "--impl",
                impl,
                "--dtype",
                dtype,
                L,
                1024,
                "--context-len",
                2048,
            ],
        )
    for dtype in (f32, bf16):
        add("preset", ["--config", "modern-decoder", "--impl", "sdpa", "--dtype", dtype, L, 2048])
    add("preset", ["--config", "decoder", "--impl", "sdpa", "--dtype", f32, L, 2048])
    add("preset", ["--config", "transformer-base", L, 4096])
    add(
        "kv_cache",
        ["--kv-cache", 4096, "--mask", "causal", "--impl", "sdpa", "--dtype", bf16, L, 2048],
    )
    # checkpoints written at start (CHECKPOINTS)
    add("checkpoint llama (gqa)", ["--model", "CKPT/llama", L, 2048])
    add(
        "checkpoint llama (gqa)",
        ["--model", "CKPT/llama", "--impl", "sdpa", "--dtype", bf16, L, 2048],
    )
    add("checkpoint llama generate", ["--model", "CKPT/llama", L, 1024, "--generate", 64])
    add(
        "checkpoint llama train",
        ["--model", "CKPT/llama", "--train", "--impl", "sdpa", "--dtype", bf16, L, 1024],
    )
    add("checkpoint gpt2", ["--model", "CKPT/gpt2", "--impl", "math", L, 2048])
    add("checkpoint gpt2", ["--model", "CKPT/gpt2", "--impl", "sdpa", "--dtype", bf16, L, 2048])
    add("checkpoint gpt2 generate", ["--model", "CKPT/gpt2", L, 512, "--generate", 32])
    add(
        "checkpoint mistral (window)",
        ["--model", "CKPT/mistral", "--impl", "sdpa", "--dtype", bf16, L, 2048],
    )
    add(
        "checkpoint marian (enc-dec)",
        ["--model", "CKPT/marian", "--src-len", 1024, "--tgt-len", 512],
    )
    add(
        "checkpoint marian (enc-dec)",
        [
            "--model",
            "CKPT/marian",
            "--impl",
            "sdpa",
            "--dtype",
            bf16,
            "--src-len",
            1024,
            "--tgt-len",
            512,
        ],
    )
    add("checkpoint bart (enc-dec)", ["--model", "CKPT/bart", "--src-len", 1024, "--tgt-len", 256])
    return cases


LENGTH_OPTIONS = ("--seq-len", "--src-len", "--tgt-len", "--context-len", "--kv-cache")


def shrink(args: list[str]) -> list[str]:
    """--device-for-test: every length cut to TEST_LENGTH at most (odd ones stay odd)."""
    out = list(args)
    for i, arg in enumerate(out[:-1]):
        if arg in LENGTH_OPTIONS and out[i + 1].isdigit():
            n = int(out[i + 1])
            if n > TEST_LENGTH:
                out[i + 1] = str(TEST_LENGTH if n % 2 else TEST_LENGTH - 1)
    return out


def with_checkpoints(args: list[str], folders: dict[str, str]) -> tuple[list[str], str | None]:
    """Replace CKPT/name by the folder written at start; the name, or None."""
    out, name = [], None
    for arg in args:
        if arg.startswith("CKPT/"):
            name = arg.split("/", 1)[1]
            if name not in folders:
                raise RuntimeError(f"checkpoint {name!r} was not written")
            arg = folders[name]
        out.append(arg)
    return out, name


def attnctl_command(subcommand_args: list[str]) -> list[str]:
    return [PYTHON, "-m", "attnctl", *subcommand_args]


def wrapped_command(stats_path: Path, subcommand_args: list[str]) -> list[str]:
    return [PYTHON, str(Path(__file__).resolve()), "_attnctl", str(stats_path), *subcommand_args]


def figures(doc: dict) -> tuple[int | None, int | None, list[dict]]:
    """(estimate, measured, comparisons) of a `memory --measure --json` document."""
    comparisons: list[dict] = []

    def pair(what: str, estimate: Any, measured: Any) -> None:
        if measured is not None or estimate is not None:
            difference = None
            if isinstance(estimate, int) and isinstance(measured, int):
                difference = measured - estimate
            comparisons.append(
                {
                    "what": what,
                    "estimate": estimate,
                    "measured": measured,
                    "measured_minus_estimate": difference,
                }
            )

    if doc.get("kind") == "encoder-decoder":
        measured = doc.get("measured") or {}
        for key in (
            "parameters_bytes",
            "encoder_peak_activation_bytes",
            "decoder_peak_activation_bytes",
            "kv_cache_bytes",
            "cross_kv_cache_bytes",
        ):
            pair(key, doc.get(key), measured.get(key))
        return doc.get("peak_bytes"), None, comparisons
    results = doc.get("results") or [{}]
    result = results[0]
    training = result.get("training")
    estimate = training.get("peak_bytes") if training else result.get("peak_bytes")
    measured = result.get("measured_peak_bytes")
    what = "training step peak" if training else "forward pass peak"
    pair(what, estimate, measured)
    if result.get("measured_kv_cache_bytes") is not None:
        pair("kv_cache_bytes", result.get("kv_cache_bytes"), result.get("measured_kv_cache_bytes"))
    after = result.get("kv_cache_after_generate")
    if after:
        pair("kv_cache_after_generate", after.get("bytes"), after.get("measured_bytes"))
    for rank in doc.get("measured_per_rank") or []:
        pair(f"rank {rank.get('rank')}", rank.get("peak_bytes"), rank.get("measured_peak_bytes"))
    return estimate, measured, comparisons


def read_stats(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except Exception:
        return None


def reserved_summary(stats: dict | None) -> dict[str, int] | None:
    """The process's highest allocated and reserved peaks (over every stage)."""
    if not stats:
        return None
    snaps = [*stats.get("resets", []), stats.get("final") or {}]
    allocated = [s.get("allocated_peak") for s in snaps if s.get("allocated_peak") is not None]
    reserved = [s.get("reserved_peak") for s in snaps if s.get("reserved_peak") is not None]
    if not allocated or not reserved:
        return None
    return {
        "max_allocated": max(allocated),
        "max_reserved": max(reserved),
        "reserved_minus_allocated": max(reserved) - max(allocated),
    }


# ---------------------------------------------------------------------------------------------
# phase 1: device


def phase_device(run: Run) -> None:
    info: dict[str, Any] = {
        "recorded_at": now_iso(),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": sys.version,
        "argv": sys.argv,
        "attnctl_commit": git_commit(),
        "cpu_count": os.cpu_count(),
        "env": {key: os.environ.get(key) for key in ENV_KEYS},
        "nvidia_smi": nvidia_smi(
            "name,driver_version,memory.total,memory.used,memory.free,compute_cap,pstate,"
            "clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu,"
            "persistence_mode,compute_mode"
        ),
        "nvidia_smi_basic": nvidia_smi("name,driver_version,memory.total,memory.used,memory.free"),
        "nvidia_smi_apps_before": nvidia_smi("pid,process_name,used_memory", "compute-apps"),
    }
    run.write_json("device.json", info)
    command = [PYTHON, str(Path(__file__).resolve()), "_device", run.device]
    result = run.process(command, timeout=min(90.0, max(10.0, run.remaining())))
    info["probe_exit_code"] = result["exit_code"]
    info["probe_wall_s"] = result.get("wall_s")
    info["probe"] = last_json(result.get("stdout", ""))
    if result["exit_code"] != 0 or info["probe"] is None:
        info["probe_stderr_tail"] = tail(result.get("stderr"))
        info["probe_error"] = result.get("error") or "no JSON from the probe"
    run.write_json("device.json", info)
    probe = info["probe"] or {}
    context = probe.get("context_bytes_after_init")
    run.device_line = (
        f"{probe.get('name', run.device)} (cc {probe.get('capability', '?')}), torch "
        f"{probe.get('torch', '?')}, CUDA {probe.get('cuda', '?')}, cuDNN {probe.get('cudnn', '?')}"
    )
    run.note(
        f"device: {probe.get('name', '?')}, cc {probe.get('capability', '?')}, torch "
        f"{probe.get('torch', '?')}, cuDNN {probe.get('cudnn', '?')}, context "
        f"{context if context is not None else '?'} B (probe exit {result['exit_code']})"
    )


def last_json(text: str) -> Any:
    """The last line of ``text`` that parses as JSON, or None."""
    for line in reversed((text or "").strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


# ---------------------------------------------------------------------------------------------
# phase 2: primitives

FIRST_OP_SEQUENCES: dict[str, dict[str, Any]] = {
    "fp32_first": {
        "steps": [
            "matmul:float32",
            "matmul:bfloat16",
            "matmul:float16",
            "linear_bias:float32",
            "linear_bias:bfloat16",
            "bmm:float32",
            "backward:float32",
            "backward:bfloat16",
            "adam:float32",
            "adam_default:float32",
        ]
    },
    "bf16_first": {
        "steps": [
            "matmul:bfloat16",
            "matmul:float32",
            "matmul:float16",
            "linear_bias:bfloat16",
            "bmm:bfloat16",
            "backward:bfloat16",
            "adam:bfloat16",
        ]
    },
    "fp16_first": {"steps": ["matmul:float16", "matmul:float32", "backward:float16"]},
    "linear_bias_fp32_first": {
        "steps": [
            "linear_bias:float32",
            "matmul:float32",
            "linear_bias:bfloat16",
            "linear:bfloat16",
        ]
    },
    "linear_bias_bf16_first": {
        "steps": [
            "linear_bias:bfloat16",
            "matmul:bfloat16",
            "linear:bfloat16",
            "linear_bias:float32",
        ]
    },
    "sdpa_bf16_first": {
        "steps": ["sdpa:bfloat16", "sdpa_backward:bfloat16", "matmul:bfloat16", "backward:bfloat16"]
    },
    "sdpa_fp32_first": {"steps": ["sdpa:float32", "sdpa_backward:float32", "matmul:float32"]},
    "allocator_rounding": {"steps": ["alloc_rounding"]},
    "fp32_first_CUBLAS_WORKSPACE_CONFIG_4096_8": {
        "steps": ["matmul:float32", "linear_bias:bfloat16", "backward:float32"],
        "env": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
    },
}


def phase_primitives(run: Run) -> None:
    doc: dict[str, Any] = {
        "recorded_at": now_iso(),
        "device": run.device,
        "first_ops": {},
        "sdpa_env": None,
        "sdpa": [],
        "sdpa_skipped": [],
    }
    run.write_json("primitives.json", doc)
    script = str(Path(__file__).resolve())

    def one(name: str) -> None:
        spec = FIRST_OP_SEQUENCES[name]
        env = base_env(**spec.get("env", {}))
        command = [PYTHON, script, "_firstops", run.device, ",".join(spec["steps"])]
        result = run.process(command, timeout=min(60.0, max(5.0, run.remaining())), env=env)
        record = last_json(result.get("stdout", "")) or {}
        record.update(
            exit_code=result["exit_code"], wall_s=result.get("wall_s"), env=spec.get("env", {})
        )
        if result["exit_code"] != 0 or "steps" not in record:
            record["stderr_tail"] = tail(result.get("stderr"))
            record["error"] = result.get("error") or "the probe failed"
        with run.lock:
            doc["first_ops"][name] = record
        run.write_json("primitives.json", doc)

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(FIRST_OP_SEQUENCES)) as pool:
        list(pool.map(one, FIRST_OP_SEQUENCES))
    failed = [n for n, r in doc["first_ops"].items() if r.get("error")]
    run.note(
        f"primitives: {len(FIRST_OP_SEQUENCES)} first-op probes done"
        + (f" ({len(failed)} failed: {', '.join(failed)})" if failed else "")
    )
    fp32 = doc["first_ops"].get("fp32_first", {}).get("steps") or []
    if fp32:
        run.note(
            "primitives: first fp32 matmul adds "
            f"{fp32[0].get('allocated_delta')} B allocated (kept beyond its output: "
            f"{fp32[0].get('workspace_like_bytes')} B)"
        )

    left = run.phase_left("primitives")
    if left < 5:
        doc["sdpa_skipped"] = ["the whole grid: no time left"]
        run.write_json("primitives.json", doc)
        run.note("primitives: SDPA grid skipped (no time left)")
        return
    deadline = time.time() + left
    small = "small" if run.test_device else "full"
    count = 0
    last_index = -1
    finished = False

    def on_line(line: str) -> None:
        nonlocal count, last_index, finished
        try:
            row = json.loads(line)
        except ValueError:
            return
        with run.lock:
            if row.get("kind") == "env":
                doc["sdpa_env"] = row
            elif row.get("kind") == "skipped":
                doc["sdpa_skipped"] = row.get("rows", [])
                finished = True
            else:
                doc["sdpa"].append(row)
                last_index = max(last_index, int(row.get("index", -1)))
                count += 1
        if count % 10 == 0 or row.get("kind") in ("env", "skipped"):
            run.write_json("primitives.json", doc)

    doc["sdpa_runs"] = []
    for attempt in range(4):  # a crash (or a broken CUDA context) goes on after the last row
        first = last_index + 1
        command = [PYTHON, script, "_sdpa_grid", run.device, f"{deadline:.3f}", small, str(first)]
        left = deadline - time.time()
        result = stream_process(run, command, timeout=left + 15, on_line=on_line)
        record = {
            "from_index": first,
            "exit_code": result["exit_code"],
            "wall_s": result.get("wall_s"),
            "timed_out": result["timed_out"],
        }
        if result["exit_code"] != 0:
            record["stderr_tail"] = tail(result.get("stderr"))
        doc["sdpa_runs"].append(record)
        run.write_json("primitives.json", doc)
        if finished or result["exit_code"] == 0 or time.time() > deadline - 3:
            break
        if result["exit_code"] != 3:  # a crash inside the next row: record it, go on after it
            last_index += 1
            died = f"the process died here (exit {result['exit_code']})"
            doc["sdpa"].append({"kind": "row", "index": last_index, "error": died})
        run.note(
            f"primitives: SDPA grid process ended with exit {result['exit_code']} at "
            f"index {last_index}; attempt {attempt + 2} goes on after it"
        )
    errors = sum(1 for r in doc["sdpa"] if r.get("error"))
    run.note(
        f"primitives: SDPA grid {count} rows ({errors} with an error, "
        f"{len(doc['sdpa_skipped'])} skipped) in {result.get('wall_s', 0):.1f}s, "
        f"exit {result['exit_code']}"
    )


def stream_process(run: Run, command: list[str], timeout: float, on_line: Any) -> dict:
    """Run a process, handing each stdout line to ``on_line`` as it comes; killed past
    ``timeout``. Never raises."""
    result: dict[str, Any] = {"exit_code": None, "timed_out": False}
    start = time.perf_counter()
    try:
        with tempfile.TemporaryFile(dir=run.tmp) as err:
            process = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=base_env(),
                cwd=str(ROOT),
                text=True,
                encoding="utf-8",
                errors="replace",
            )
            with run.lock:
                run.live.add(process)

            def kill() -> None:
                result["timed_out"] = True
                process.kill()

            timer = threading.Timer(max(1.0, timeout), kill)
            timer.start()
            try:
                assert process.stdout is not None
                for line in process.stdout:
                    try:
                        on_line(line)
                    except Exception as error:
                        result.setdefault("line_errors", []).append(short_error(error))
                result["exit_code"] = process.wait()
            finally:
                timer.cancel()
                with run.lock:
                    run.live.discard(process)
            err.seek(0)
            result["stderr"] = err.read().decode("utf-8", "replace")
    except Exception as error:
        result["error"] = short_error(error)
    result["wall_s"] = round(time.perf_counter() - start, 3)
    return result


# ---------------------------------------------------------------------------------------------
# background makers: checkpoints and texts (on the CPU, no CUDA)


class Background:
    """A maker process started at once; ``wait`` gives its JSON (or an error) by a deadline."""

    def __init__(self, run: Run, name: str, command: list[str], timeout: float) -> None:
        self.name = name
        self.result: dict[str, Any] | None = None
        self.done = threading.Event()
        env = base_env(CUDA_VISIBLE_DEVICES="")  # never touches the GPU

        def work() -> None:
            try:
                outcome = run.process(command, timeout=timeout, env=env)
                value = last_json(outcome.get("stdout", ""))
                self.result = {
                    "value": value,
                    "exit_code": outcome["exit_code"],
                    "wall_s": outcome.get("wall_s"),
                }
                if value is None or outcome["exit_code"] != 0:
                    self.result["error"] = (
                        outcome.get("error")
                        or f"exit {outcome['exit_code']}: {tail(outcome.get('stderr'), 800)}"
                    )
            except Exception as error:
                self.result = {"value": None, "error": short_error(error)}
            finally:
                self.done.set()

        self.thread = threading.Thread(target=work, name=name, daemon=True)
        self.thread.start()

    def wait(self, seconds: float) -> dict[str, Any]:
        if not self.done.wait(max(0.0, seconds)):
            return {"value": None, "error": f"{self.name} not done in time"}
        return self.result or {"value": None, "error": f"{self.name} gave nothing"}


# ---------------------------------------------------------------------------------------------
# phase 3: memory cases


def phase_memory(run: Run, checkpoints: Background) -> None:
    cases = memory_cases()
    stats_dir = run.tmp / "stats"
    stats_dir.mkdir(exist_ok=True)
    phase_end = run.phase_end("memory")
    done = Counter()

    def one(case: dict[str, Any]) -> None:
        row: dict[str, Any] = {
            "id": case["id"],
            "group": case["group"],
            "runner": case["runner"],
            "device": run.device,
        }
        args = list(case["args"])
        try:
            if run.elapsed() > phase_end or run.remaining() < 3:
                row.update(args=args, status="skipped", reason="time budget spent")
                return
            checkpoint = None
            if any(a.startswith("CKPT/") for a in args):
                made = checkpoints.wait(max(1.0, phase_end - run.elapsed()))
                folders = (made.get("value") or {}).get("folders") or {}
                if not all(a[len("CKPT/") :] in folders for a in args if a.startswith("CKPT/")):
                    row["checkpoint_errors"] = (made.get("value") or {}).get("errors") or made.get(
                        "error"
                    )
                args, checkpoint = with_checkpoints(args, folders)
                row["checkpoint"] = checkpoint
                row["checkpoint_config"] = (
                    (made.get("value") or {}).get("configs", {}).get(checkpoint)
                )
            if run.test_device:
                args = shrink(args)
            row["args"] = args
            full = ["memory", *args, "--measure", "--json", "--device", run.device]
            row["command"] = "attnctl " + " ".join(full).replace(str(run.tmp), "TMP")
            stats_path = stats_dir / f"{case['id']}.json"
            command = (
                attnctl_command(full)
                if case["runner"] == "plain"
                else wrapped_command(stats_path, full)
            )
            timeout = min(run.args.case_timeout, max(5.0, run.remaining()))
            result = run.process(command, timeout=timeout)
            row.update(
                exit_code=result["exit_code"],
                timed_out=result["timed_out"],
                wall_s=result.get("wall_s"),
                max_rss_bytes=result.get("max_rss_bytes"),
            )
            if result.get("stderr"):
                row["stderr_tail"] = tail(result["stderr"])
            if result.get("error"):
                row["error"] = result["error"]
            row["cuda_stats"] = read_stats(stats_path)
            row["reserved"] = reserved_summary(row["cuda_stats"])
            document = None
            if result["exit_code"] == 0:
                try:
                    document = json.loads(result["stdout"])
                except ValueError as error:
                    row["error"] = f"no JSON on stdout: {error}"
            if document is not None:
                estimate, measured, comparisons = figures(document)
                row.update(
                    measured_peak_bytes=measured,
                    attnctl_estimate=estimate,
                    measured_minus_estimate=(
                        measured - estimate
                        if measured is not None and estimate is not None
                        else None
                    ),
                    comparisons=comparisons,
                    document=document,
                )
            row["status"] = "ok" if document is not None else "failed"
        except Exception as error:
            row.update(
                status="failed",
                error=short_error(error),
                traceback=tail(traceback.format_exc(), 1500),
            )
        finally:
            row.setdefault("args", args)
            run.append_jsonl("memory.jsonl", row)
            with run.lock:
                run.memory_rows.append(row)
                done[row.get("status", "?")] += 1

    with concurrent.futures.ThreadPoolExecutor(max_workers=run.args.parallel) as pool:
        list(pool.map(one, cases))
    run.note(f"memory: {len(cases)} cases: " + ", ".join(f"{v} {k}" for k, v in done.items()))


# ---------------------------------------------------------------------------------------------
# phase 4: timing

PLAIN_LAYER = r"""
import time
started = time.perf_counter()
import json, math, sys
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

imported = time.perf_counter()
device, dtype = torch.device(sys.argv[3]), getattr(torch, sys.argv[4])
tokenizer = Tokenizer.from_file(sys.argv[1])
ids = tokenizer.encode(open(sys.argv[2], encoding="utf-8").read()).ids
tokenized = time.perf_counter()
d_model, heads = 512, 8
d_k = d_model // heads
torch.manual_seed(42)
embedding = torch.nn.Embedding(tokenizer.get_vocab_size(), d_model)
w_q, w_k, w_v, w_o = (torch.nn.Linear(d_model, d_model) for _ in range(4))
norm = torch.nn.LayerNorm(d_model)
for module in (embedding, w_q, w_k, w_v, w_o, norm):
    module.to(device=device, dtype=dtype)
if device.type == "cuda":
    torch.cuda.synchronize()
weighted = time.perf_counter()
with torch.inference_mode():
    token_ids = torch.tensor([ids], device=device)
    seq_len = token_ids.shape[1]
    position = torch.arange(seq_len, device=device).unsqueeze(1)
    steps = torch.arange(0, d_model, 2, device=device)
    frequency = torch.exp(steps * (-math.log(10000.0) / d_model))
    table = torch.zeros(seq_len, d_model, device=device)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)
    x = embedding(token_ids) + table.to(dtype)
    q, k, v = (w(x).view(1, seq_len, heads, d_k).transpose(1, 2) for w in (w_q, w_k, w_v))
    attended = F.scaled_dot_product_attention(q, k, v)
    out = norm(x + w_o(attended.transpose(1, 2).reshape(1, seq_len, d_model)))
    if device.type == "cuda":
        torch.cuda.synchronize()
ran = time.perf_counter()
print(tuple(out.shape), out.dtype)
times = {"import_s": imported - started, "tokenize_s": tokenized - imported,
         "weights_s": weighted - tokenized, "forward_s": ran - weighted, "tokens": seq_len,
         "script_s": ran - started}
print("PLAIN_TIMES " + json.dumps(times), file=sys.stderr)
"""


def plain_times(stderr: str) -> dict | None:
    for line in reversed((stderr or "").splitlines()):
        if line.startswith("PLAIN_TIMES "):
            try:
                return json.loads(line[len("PLAIN_TIMES ") :])
            except ValueError:
                return None
    return None


def timing_commands(run: Run, text: str, script: str, dtype: str) -> dict[str, list[str]]:
    device = run.device
    attnctl = ["run", "--file", text, "--device", device, "--dtype", dtype, "--impl", "sdpa"]
    return {
        "attnctl run --file": attnctl_command(attnctl),
        "plain script, sdpa": [PYTHON, script, str(TOKENIZER), text, device, dtype],
        "attnctl run --file --rows 0": attnctl_command([*attnctl, "--rows", "0"]),
    }


def phase_timing(run: Run, texts: Background) -> None:
    doc = run.timing
    doc.update(recorded_at=now_iso(), device=run.device, runs=[], medians={}, ratios={})
    run.write_json("timing.json", doc)
    end = run.phase_end("timing")
    made = texts.wait(max(1.0, end - run.elapsed()))
    value = made.get("value") or {}
    doc["texts"] = value.get("texts") or made.get("error")
    files = {int(k): v for k, v in (value.get("files") or {}).items()}
    if not files:
        doc["error"] = f"no texts: {made.get('error')}"
        run.write_json("timing.json", doc)
        run.note(f"timing: skipped, no texts ({made.get('error')})")
        return
    script = str(run.tmp / "plain_layer.py")
    Path(script).write_text(PLAIN_LAYER, encoding="utf-8")
    dtype = "bfloat16"
    doc["dtype"] = dtype
    doc["plain_script"] = PLAIN_LAYER
    doc["commands"] = {
        str(n): {
            k: " ".join(c).replace(str(run.tmp), "TMP")
            for k, c in timing_commands(run, path, script, dtype).items()
        }
        for n, path in files.items()
    }
    last: dict[str, float] = {}

    def timed(tokens: int, name: str, round_: int) -> dict | None:
        commands = timing_commands(run, files[tokens], script, dtype)
        guess = last.get(f"{tokens}/{name}", 10.0)
        if run.elapsed() + guess > min(end + 10, run.budget - 2):
            doc["runs"].append(
                {
                    "tokens": tokens,
                    "name": name,
                    "round": round_,
                    "status": "skipped",
                    "reason": "time budget",
                }
            )
            return None
        result = run.process(
            commands[name], timeout=min(120.0, max(5.0, run.remaining())), capture_stdout=False
        )
        last[f"{tokens}/{name}"] = result.get("wall_s") or guess
        row = {
            "tokens": tokens,
            "name": name,
            "round": round_,
            "wall_s": result.get("wall_s"),
            "max_rss_bytes": result.get("max_rss_bytes"),
            "exit_code": result["exit_code"],
            "timed_out": result["timed_out"],
            "status": "ok" if result["exit_code"] == 0 else "failed",
        }
        if name.startswith("plain"):
            row["plain_times"] = plain_times(result.get("stderr", ""))
        if result["exit_code"] != 0 or result.get("error"):
            row["stderr_tail"] = tail(result.get("stderr"))
            row["error"] = result.get("error")
        doc["runs"].append(row)
        medians(doc)
        run.write_json("timing.json", doc)
        run.note(
            f"timing: {tokens} tokens, {name}, round {round_}: "
            f"{row['wall_s']}s (exit {row['exit_code']})"
        )
        return row

    sizes = sorted(files, reverse=True)
    biggest = sizes[0]
    for tokens in sizes[:1]:
        for round_ in range(run.args.rounds):
            timed(tokens, "attnctl run --file", round_)
            timed(tokens, "plain script, sdpa", round_)
    profile_cprofile(run, doc, files[biggest], biggest, dtype, end)
    for tokens in sizes[1:]:
        for round_ in range(run.args.rounds):
            timed(tokens, "attnctl run --file", round_)
            timed(tokens, "plain script, sdpa", round_)
    profile_torch(run, doc, files[biggest], biggest, dtype, end, script)
    timed(biggest, "attnctl run --file --rows 0", 0)
    medians(doc)
    run.write_json("timing.json", doc)
    for tokens, ratio in doc["ratios"].items():
        run.note(f"timing: {tokens} tokens: attnctl / plain = {ratio}")


def medians(doc: dict) -> None:
    groups: dict[str, dict[str, list[float]]] = {}
    for row in doc["runs"]:
        if row.get("status") == "ok" and row.get("wall_s") is not None:
            groups.setdefault(str(row["tokens"]), {}).setdefault(row["name"], []).append(
                row["wall_s"]
            )
    doc["medians"] = {
        t: {n: round(statistics.median(v), 4) for n, v in names.items()}
        for t, names in groups.items()
    }
    doc["ratios"] = {}
    for tokens, names in doc["medians"].items():
        a, p = names.get("attnctl run --file"), names.get("plain script, sdpa")
        if a and p:
            doc["ratios"][tokens] = round(a / p, 4)


COMPONENTS = (
    "measured_rates",
    "estimated_seconds",
    "preflight",
    "import_torch",
    "tune_allocator",
    "scaled_dot_product_attention",
    "encode",
    "encode_batch",
    "tokenize",
    "main",
    "_lazy_init",
    "synchronize",
    "print",
    "render",
    "to_dict",
)


def profile_cprofile(run: Run, doc: dict, text: str, tokens: int, dtype: str, end: float) -> None:
    guess = 15.0
    if run.elapsed() + guess > min(end + 10, run.budget - 2):
        doc["cprofile"] = {"status": "skipped", "reason": "time budget"}
        run.write_json("timing.json", doc)
        return
    path = run.tmp / "attnctl.prof"
    args = ["run", "--file", text, "--device", run.device, "--dtype", dtype, "--impl", "sdpa"]
    command = [PYTHON, "-m", "cProfile", "-o", str(path), "-m", "attnctl", *args]
    result = run.process(
        command, timeout=min(120.0, max(5.0, run.remaining())), capture_stdout=False
    )
    record: dict[str, Any] = {
        "tokens": tokens,
        "wall_s": result.get("wall_s"),
        "exit_code": result["exit_code"],
        "command": " ".join(command).replace(str(run.tmp), "TMP"),
    }
    try:
        record.update(cprofile_tables(path))
    except Exception as error:
        record["error"] = short_error(error)
        record["stderr_tail"] = tail(result.get("stderr"))
    doc["cprofile"] = record
    run.write_json("timing.json", doc)
    run.note(
        f"timing: cProfile of attnctl at {tokens} tokens: {result.get('wall_s')}s, exit "
        f"{result['exit_code']}"
    )


def cprofile_tables(path: Path) -> dict[str, Any]:
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]

    def name(key: tuple) -> str:
        file, line, function = key
        parts = Path(file).parts
        where = "/".join(parts[-2:]) if len(parts) > 1 else file
        return f"{where}:{line}({function})"

    rows = [
        {"function": name(k), "calls": v[1], "tottime": round(v[2], 4), "cumtime": round(v[3], 4)}
        for k, v in stats.items()
    ]
    total = max((r["cumtime"] for r in rows), default=0.0)
    by_tot = sorted(rows, key=lambda r: -r["tottime"])[:25]
    by_cum = sorted(rows, key=lambda r: -r["cumtime"])[:25]
    components = {}
    for key, value in stats.items():
        if key[2] in COMPONENTS or any(c in key[2] for c in ("measured_rates", "sdpa")):
            label = name(key)
            components[label] = round(value[3], 4)
    attnctl = sorted(
        (r for r in rows if "attnctl" in r["function"] and r["cumtime"] > 0.02),
        key=lambda r: -r["cumtime"],
    )[:60]
    return {
        "total_s": round(total, 4),
        "top_tottime": by_tot,
        "top_cumtime": by_cum,
        "components_cumtime": dict(sorted(components.items(), key=lambda kv: -kv[1])[:40]),
        "attnctl_functions": attnctl,
    }


def profile_torch(
    run: Run, doc: dict, text: str, tokens: int, dtype: str, end: float, script: str
) -> None:
    results = {}
    for name, target in (
        (
            "attnctl",
            [
                "-m",
                "attnctl",
                "run",
                "--file",
                text,
                "--device",
                run.device,
                "--dtype",
                dtype,
                "--impl",
                "sdpa",
            ],
        ),
        ("plain script", ["--script", script, str(TOKENIZER), text, run.device, dtype]),
    ):
        if run.elapsed() + 20 > min(end + 10, run.budget - 2):
            results[name] = {"status": "skipped", "reason": "time budget"}
            continue
        out = run.tmp / f"torchprof_{name.replace(' ', '_')}.json"
        command = [PYTHON, str(Path(__file__).resolve()), "_torchprof", str(out), *target]
        result = run.process(
            command, timeout=min(150.0, max(5.0, run.remaining())), capture_stdout=False
        )
        record = read_stats(out) or {}
        record.update(tokens=tokens, wall_s=result.get("wall_s"), exit_code=result["exit_code"])
        if result["exit_code"] != 0 or not record.get("top_self_device"):
            record["stderr_tail"] = tail(result.get("stderr"))
        results[name] = record
        doc["torch_profiler"] = results
        run.write_json("timing.json", doc)
        run.note(
            f"timing: torch.profiler of {name} at {tokens} tokens: {result.get('wall_s')}s, "
            f"exit {result['exit_code']}"
        )
    doc["torch_profiler"] = results
    run.write_json("timing.json", doc)


# ---------------------------------------------------------------------------------------------
# phase 5: fit


def phase_fit(run: Run) -> None:
    stats_dir = run.tmp / "fit_stats"
    stats_dir.mkdir(exist_ok=True)
    counter = [0]

    def attnctl(step: str, args: list[str], timeout: float = 60.0) -> dict[str, Any]:
        counter[0] += 1
        row: dict[str, Any] = {"step": step, "args": args, "device": run.device}
        if run.remaining() < 3:
            row.update(status="skipped", reason="time budget spent")
            run.append_jsonl("fit.jsonl", row)
            run.fit_rows.append(row)
            return row
        stats = stats_dir / f"{counter[0]}.json"
        full = ["memory", *args, "--json", "--device", run.device]
        row["command"] = "attnctl " + " ".join(full)
        row["free_before"] = nvidia_smi("memory.used,memory.free") if not run.test_device else None
        result = run.process(
            wrapped_command(stats, full), timeout=min(timeout, max(3.0, run.remaining()))
        )
        row.update(
            exit_code=result["exit_code"],
            timed_out=result["timed_out"],
            wall_s=result.get("wall_s"),
            stderr_tail=tail(result.get("stderr")),
        )
        row["cuda_stats"] = read_stats(stats)
        row["reserved"] = reserved_summary(row["cuda_stats"])
        document = None
        if result["exit_code"] == 0:
            try:
                document = json.loads(result["stdout"])
            except ValueError as error:
                row["error"] = f"no JSON: {error}"
        if document is not None:
            keep = ("budget_bytes", "max_seq_len", "max_batch", "seq_lens", "batch")
            row["answer"] = {k: document.get(k) for k in keep}
            estimate, measured, _ = figures(document) if document.get("results") else (None,) * 3
            row.update(attnctl_estimate=estimate, measured_peak_bytes=measured)
        row["status"] = "ok" if result["exit_code"] == 0 else "failed"
        run.append_jsonl("fit.jsonl", row)
        run.fit_rows.append(row)
        run.note(
            f"fit: {step}: exit {row['exit_code']} in {row['wall_s']}s"
            + (f", answer {row.get('answer')}" if row.get("answer") else "")
        )
        return row

    def measure(step: str, args: list[str], force: bool = True) -> None:
        """--measure; if the pre-flight refuses (and ``force``), again with --force."""
        row = attnctl(step, [*args, "--measure"])
        refused = row.get("exit_code") not in (0, None) and not row.get("timed_out")
        if force and refused and run.remaining() > 10:
            attnctl(step + " --force", [*args, "--measure", "--force"])

    budget = ["--budget", "256MiB"] if run.test_device else ["--fit"]
    for impl, dtype in (("math", "float32"), ("sdpa", "bfloat16")):
        if run.remaining() < 5:
            run.append_jsonl(
                "fit.jsonl",
                {"step": f"{impl} {dtype}", "status": "skipped", "reason": "time budget spent"},
            )
            continue
        base = ["--impl", impl, "--dtype", dtype]
        answer = attnctl(f"{impl} {dtype}: {budget[0]}", [*base, *budget]).get("answer") or {}
        try:
            if impl == "math":
                length = int((answer.get("max_seq_len") or {})[impl])
                measure(f"{impl} {dtype}: measure at the answer", [*base, "--seq-len", str(length)])
                measure(
                    f"{impl} {dtype}: measure at 1.05x",
                    [*base, "--seq-len", str(math.ceil(length * 1.05))],
                    force=False,  # the pre-flight should refuse it: no out-of-memory on purpose
                )
            else:
                length = int((answer.get("seq_lens") or [2048])[0])
                batch = int((answer.get("max_batch") or {})[impl])
                lengths = ["--seq-len", str(length)]
                measure(
                    f"{impl} {dtype}: measure at the answer (batch)",
                    [*base, *lengths, "--batch", str(batch)],
                )
                measure(
                    f"{impl} {dtype}: measure at 1.05x (batch)",
                    [*base, *lengths, "--batch", str(math.ceil(batch * 1.05))],
                    force=False,
                )
        except Exception as error:
            row = {
                "step": f"{impl} {dtype}",
                "status": "failed",
                "error": short_error(error),
                "answer": answer,
            }
            run.append_jsonl("fit.jsonl", row)
            run.fit_rows.append(row)


# ---------------------------------------------------------------------------------------------
# summary


def size(n: Any) -> str:
    if not isinstance(n, int):
        return "-"
    return f"{n:,}"


def write_summary(run: Run) -> None:
    """summary.txt, printed too: one line a memory case (more where a second figure differs),
    the fit steps, the timing medians."""
    if run.summary_written:
        return
    run.summary_written = True
    lines = [
        f"cuda_memory.py: {run.device_line or run.device}; {now_iso()}; {run.elapsed():.0f}s of "
        f"{run.budget:.0f}s; phases: "
        + ", ".join(f"{k} {v:.0f}s" for k, v in run.phase_seconds.items())
    ]
    width = 46
    head = (
        f"{'id':<3} {'case':<{width}} {'estimate':>13} {'measured':>13} {'meas-est':>12} "
        f"{'%':>6} {'res-alloc':>11} {'rc':>3} {'s':>4}"
    )
    if run.memory_rows:
        lines += [
            "",
            "memory (meas-est: measured - estimate; res-alloc: max reserved - max allocated)",
        ]
        lines.append(head)
    for row in sorted(run.memory_rows, key=lambda r: r.get("id", "")):
        args = " ".join(row.get("args") or []).replace(str(run.tmp), "")
        args = args.replace("--seq-len", "L").replace("--dtype ", "").replace("--impl ", "")
        if row.get("runner") == "plain":
            args = "[plain] " + args
        label = args if len(args) <= width else args[: width - 2] + ".."
        comparisons = row.get("comparisons") if row.get("status") == "ok" else None
        comparisons = comparisons or [{}]
        code = row.get("exit_code")
        rc = str(code) if code is not None else str(row.get("status", "?"))[:3]
        reserved = (row.get("reserved") or {}).get("reserved_minus_allocated")
        seconds = f"{row.get('wall_s') or 0:.0f}"
        first = True
        for comp in comparisons:
            est, meas = comp.get("estimate"), comp.get("measured")
            diff = comp.get("measured_minus_estimate")
            if not first and diff == 0 and row.get("document", {}).get("kind") != "encoder-decoder":
                continue  # a second figure that agrees: no line
            pct = f"{100 * diff / est:+.1f}" if isinstance(diff, int) and est else "-"
            name = label if first else f"  {comp.get('what', '')}"[:width]
            lines.append(
                f"{row.get('id', '')[-3:]:<3} {name:<{width}} {size(est):>13} {size(meas):>13} "
                f"{size(diff):>12} {pct:>6} {size(reserved) if first else '':>11} "
                f"{rc if first else '':>3} {seconds if first else '':>4}"
            )
            first = False
    if run.fit_rows:
        lines += ["", "fit"]
        for row in run.fit_rows:
            answer = {k: v for k, v in (row.get("answer") or {}).items() if v is not None}
            last_line = (tail(row.get("stderr_tail"), 200).strip().splitlines() or [""])[-1]
            lines.append(
                f"  {row.get('step', '')}: {row.get('status')}, exit {row.get('exit_code')}, "
                f"estimate {size(row.get('attnctl_estimate'))}, measured "
                f"{size(row.get('measured_peak_bytes'))}, reserved-allocated "
                f"{size((row.get('reserved') or {}).get('reserved_minus_allocated'))}; "
                f"{answer or last_line[:120]}"
            )
    if run.timing.get("medians"):
        lines += ["", "timing (medians, whole process)"]
        for tokens, names in run.timing["medians"].items():
            ratio = run.timing.get("ratios", {}).get(tokens)
            lines.append(
                f"  {tokens} tokens: "
                + ", ".join(f"{n} {s:.2f}s" for n, s in names.items())
                + (f"; attnctl / plain {ratio:.2f}x" if ratio else "")
            )
    text = "\n".join(lines) + "\n"
    try:
        (run.out / "summary.txt").write_text(text, encoding="utf-8")
    except Exception as error:
        print(f"summary.txt not written: {error}")
    print(text, flush=True)


# ---------------------------------------------------------------------------------------------
# dry run: the plan, and every command's arguments checked with attnctl


def dry_run(run: Run, checkpoints: Background, texts: Background) -> int:
    cases = memory_cases()
    run.note(f"dry run: {len(cases)} memory cases planned")
    for case in cases:
        print(
            f"  {case['id']} {case['group']:<30} {' '.join(case['args'])}"
            + (" [plain]" if case["runner"] == "plain" else "")
        )
    made = checkpoints.wait(300)
    folders = (made.get("value") or {}).get("folders") or {}
    run.note(
        f"dry run: checkpoints {sorted(folders)}; errors: "
        f"{(made.get('value') or {}).get('errors') or made.get('error')}"
    )
    failures = []

    def check(case: dict[str, Any]) -> None:
        try:
            args, _ = with_checkpoints(case["args"], folders)
        except Exception as error:
            failures.append((case["id"], "-", short_error(error)))
            return
        for device in ("cuda", "cpu"):
            result = run.process(
                attnctl_command(["memory", *args, "--json", "--device", device]), timeout=120
            )
            ok = result["exit_code"] == 0
            if ok:
                try:
                    figures(json.loads(result["stdout"]))
                except Exception as error:
                    ok, result["stderr"] = False, short_error(error)
            if not ok:
                failures.append((case["id"], device, tail(result.get("stderr"), 300).strip()))

    with concurrent.futures.ThreadPoolExecutor(max_workers=run.args.parallel) as pool:
        list(pool.map(check, cases))
    run.note(
        f"dry run: memory args checked (estimate only, --device cuda and cpu): "
        f"{len(cases) - len({f[0] for f in failures})} of {len(cases)} pass"
    )
    for failure in failures:
        run.note(f"  FAILED {failure[0]} ({failure[1]}): {failure[2]}")
    # fit: the --fit command on the CPU
    for impl, dtype in (("math", "float32"), ("sdpa", "bfloat16")):
        args = ["memory", "--fit", "--impl", impl, "--dtype", dtype, "--json", "--device", "cpu"]
        result = run.process(attnctl_command(args), timeout=120)
        try:
            answer = json.loads(result["stdout"])
            got = (answer["max_seq_len"][impl], answer["max_batch"][impl], answer["seq_lens"])
        except Exception as error:
            got = f"FAILED: {short_error(error)} {tail(result.get('stderr'), 300)}"
            failures.append(("fit", impl, got))
        run.note(f"dry run: --fit {impl} {dtype} on the CPU: {got}")
    # timing: both commands on a small text, on the CPU
    made = texts.wait(300)
    value = made.get("value") or {}
    run.note(f"dry run: texts {value.get('texts') or made.get('error')}")
    files = value.get("files") or {}
    if files:
        small = min(files, key=int)
        script = run.tmp / "plain_layer.py"
        script.write_text(PLAIN_LAYER, encoding="utf-8")
        saved = run.device
        run.device = "cpu"
        try:
            commands = timing_commands(run, files[small], str(script), "bfloat16")
        finally:
            run.device = saved
        for name, command in commands.items():
            result = run.process(command, timeout=300, capture_stdout=False)
            ok = result["exit_code"] == 0
            extra = plain_times(result.get("stderr", "")) if name.startswith("plain") else ""
            run.note(
                f"dry run: timing command {name!r} at {small} tokens on the CPU: exit "
                f"{result['exit_code']} in {result.get('wall_s')}s {extra or ''}"
            )
            if not ok:
                failures.append(("timing", name, tail(result.get("stderr"), 300)))
        # the token count attnctl sees is the one the text was cut to
        command = attnctl_command(
            ["run", "--file", files[small], "--json", "--rows", "0", "--device", "cpu"]
        )
        result = run.process(command, timeout=300)
        try:
            seen = json.loads(result["stdout"])["stages"][0]["shape"][1]
        except Exception as error:
            seen = f"unreadable ({short_error(error)})"
        wanted = (value.get("texts") or {}).get(small, {}).get("tokens")
        run.note(f"dry run: attnctl sees {seen} tokens in the {small}-token text ({wanted} made)")
        if seen != wanted:
            failures.append(("timing", "token count", f"{seen} != {wanted}"))
    else:
        failures.append(("timing", "texts", str(made.get("error"))))
    run.note(f"dry run: {'all checks pass' if not failures else f'{len(failures)} FAILED'}")
    return 1 if failures else 0


# ---------------------------------------------------------------------------------------------
# main


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", help="folder for the output files (made if missing)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="total seconds (300)")
    parser.add_argument("--parallel", type=int, default=8, help="memory cases at a time (8)")
    parser.add_argument("--case-timeout", type=float, default=60.0, help="seconds a case (60)")
    parser.add_argument("--only", default=",".join(PHASES), help="phases to run, comma list")
    parser.add_argument("--timing-tokens", default="131072,32768", help="token counts to time")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (3)")
    parser.add_argument("--dry-run", action="store_true", help="plan and check args, no CUDA")
    parser.add_argument(
        "--device-for-test",
        choices=("cpu",),
        default=None,
        help="run every phase on this device at small sizes",
    )
    parser.add_argument("--list-cases", action="store_true", help="print the memory cases")
    args = parser.parse_args(argv)
    if not args.out and not args.list_cases:
        parser.error("--out is required")
    unknown = set(args.only.split(",")) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases {sorted(unknown)}; phases: {', '.join(PHASES)}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.list_cases:
        for case in memory_cases():
            print(
                f"{case['id']} {case['group']:<30} {' '.join(case['args'])}"
                + (" [plain]" if case["runner"] == "plain" else "")
            )
        return 0
    run = Run(args)
    only = set(args.only.split(","))

    def on_signal(number: int, frame: Any) -> None:
        run.note(f"signal {number}: ending the processes started and writing the summary")
        run.kill_all()
        try:
            write_summary(run)
        finally:
            shutil.rmtree(run.tmp, ignore_errors=True)
            os._exit(128 + number)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    run.note(
        f"cuda_memory.py: out {run.out}, budget {run.budget:.0f}s, device {run.device}"
        f"{', dry run' if run.dry else ''}; phases {', '.join(p for p in PHASES if p in only)}"
    )

    # the makers run on the CPU from the start, beside the GPU phases
    script = str(Path(__file__).resolve())
    tokens = [int(t) for t in args.timing_tokens.split(",") if t]
    if run.test_device or run.dry:
        tokens = [2048, 512]
    checkpoints = Background(
        run,
        "checkpoints",
        [PYTHON, script, "_checkpoints", str(run.tmp / "checkpoints")],
        timeout=240,
    )
    texts = Background(
        run,
        "texts",
        [PYTHON, script, "_texts", str(run.tmp / "texts"), ",".join(map(str, tokens))],
        timeout=240,
    )
    if run.dry:
        try:
            code = dry_run(run, checkpoints, texts)
        finally:
            run.kill_all()
            shutil.rmtree(run.tmp, ignore_errors=True)
        run.note(f"dry run done in {run.elapsed():.1f}s")
        return code
    phases = {
        "device": lambda: phase_device(run),
        "primitives": lambda: phase_primitives(run),
        "memory": lambda: phase_memory(run, checkpoints),
        "timing": lambda: phase_timing(run, texts),
        "fit": lambda: phase_fit(run),
    }
    for name in PHASES:
        if name not in only:
            continue
        if run.remaining() < 10 and name in ("device", "primitives"):
            run.note(f"{name}: skipped (budget spent)")
            run.phase_seconds[name] = 0.0
            continue  # the later phases record each of their steps as skipped themselves
        started = run.elapsed()
        run.note(f"{name}: start (due by {run.phase_end(name):.0f}s)")
        try:
            phases[name]()
        except Exception as error:
            run.note(f"{name}: FAILED {short_error(error)}\n{traceback.format_exc()}")
        run.phase_seconds[name] = run.elapsed() - started
        run.note(f"{name}: done in {run.phase_seconds[name]:.1f}s")
    run.kill_all()
    try:
        write_summary(run)
    except Exception as error:
        run.note(f"summary: FAILED {short_error(error)}\n{traceback.format_exc()}")
    run.note(f"done in {run.elapsed():.1f}s; files in {run.out}")
    shutil.rmtree(run.tmp, ignore_errors=True)
    return 0


# =============================================================================================
# The probes: run by this file in processes of their own (`python3 cuda_memory.py _NAME ...`).
# They import torch; the part above never does.


def _drop_own_folder() -> None:
    """benchmarks/ holds generate.py, distributed.py...: keep them from shadowing modules."""
    if sys.path and sys.path[0] and Path(sys.path[0]).resolve() == HERE:
        sys.path.pop(0)


class Memory:
    """The caching allocator's figures on CUDA; zeros elsewhere (so the probes run on a CPU)."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch = torch
        self.cuda = device.startswith("cuda")
        self.device = torch.device(device)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def allocated(self) -> int:
        self.sync()
        return self.torch.cuda.memory_allocated() if self.cuda else 0

    def reserved(self) -> int:
        return self.torch.cuda.memory_reserved() if self.cuda else 0

    def peak(self) -> int:
        self.sync()
        return self.torch.cuda.max_memory_allocated() if self.cuda else 0

    def reset(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()

    def requested(self) -> int:
        if not self.cuda:
            return 0
        return int(self.torch.cuda.memory_stats().get("requested_bytes.all.current", 0))

    def blocks(self) -> Counter:
        """The allocated blocks' sizes (a multiset)."""
        if not self.cuda:
            return Counter()
        sizes: Counter = Counter()
        for segment in self.torch.cuda.memory_snapshot():
            for block in segment.get("blocks", []):
                if block.get("state") == "active_allocated":
                    sizes[int(block.get("size", 0))] += 1
        return sizes

    def segments(self) -> Counter:
        if not self.cuda:
            return Counter()
        return Counter(int(s.get("total_size", 0)) for s in self.torch.cuda.memory_snapshot())


def probe_device(device: str) -> dict[str, Any]:
    """The CUDA context's cost and the device's description (run alone on the GPU)."""
    out: dict[str, Any] = {"steps": []}
    nvml = None
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(0))
        out["nvml_driver"] = str(pynvml.nvmlSystemGetDriverVersion())
    except Exception as error:
        out["nvml_error"] = short_error(error)

    def read_nvml() -> dict[str, Any]:
        if nvml is None:
            return {}
        module, handle = nvml
        got: dict[str, Any] = {}
        try:
            memory = module.nvmlDeviceGetMemoryInfo(handle)
            got.update(
                nvml_free=int(memory.free), nvml_used=int(memory.used), nvml_total=int(memory.total)
            )
        except Exception as error:
            got["nvml_error"] = short_error(error)
        try:
            for process in module.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid == os.getpid():
                    got["nvml_process_used"] = int(process.usedGpuMemory or 0)
        except Exception as error:
            got["nvml_process_error"] = short_error(error)
        return got

    def read_smi() -> dict[str, Any]:
        got: dict[str, Any] = {}
        gpu = nvidia_smi("memory.used,memory.free")
        if isinstance(gpu, list) and gpu:
            got.update(
                smi_used_mib=gpu[0].get("memory.used"), smi_free_mib=gpu[0].get("memory.free")
            )
        apps = nvidia_smi("pid,used_memory", "compute-apps")
        if isinstance(apps, list):
            mine = [a for a in apps if a.get("pid") == str(os.getpid())]
            got["smi_process_used_mib"] = mine[0].get("used_memory") if mine else None
        return got

    torch = None

    def step(name: str, action: Any = None) -> None:
        record: dict[str, Any] = {"step": name}
        started = time.perf_counter()
        try:
            if action is not None:
                action()
            if torch is not None and device.startswith("cuda") and torch.cuda.is_initialized():
                torch.cuda.synchronize()
        except Exception as error:
            record["error"] = short_error(error)
        record["seconds"] = round(time.perf_counter() - started, 4)
        got = read_nvml()
        record.update(got)
        if "nvml_free" not in got or name in ("before_import_torch", "first backward float32"):
            record.update(read_smi())  # slower (a process): where NVML is missing, and twice
        cuda_ready = (
            torch is not None
            and device.startswith("cuda")
            and torch.cuda.is_initialized()
            and name != "before_import_torch"
        )
        if cuda_ready and name not in ("import torch", "torch.cuda.init"):
            try:
                free, total = torch.cuda.mem_get_info()
                record.update(
                    mem_get_info_free=int(free),
                    mem_get_info_total=int(total),
                    torch_allocated=int(torch.cuda.memory_allocated()),
                    torch_reserved=int(torch.cuda.memory_reserved()),
                )
            except Exception as error:
                record["mem_get_info_error"] = short_error(error)
        out["steps"].append(record)

    step("before_import_torch")

    def do_import() -> None:
        nonlocal torch
        import torch as imported

        torch = imported

    step("import torch", do_import)
    assert torch is not None
    cuda = device.startswith("cuda") and torch.cuda.is_available()
    dev = torch.device(device if cuda else "cpu")
    out.update(
        torch=torch.__version__,
        cuda=torch.version.cuda,
        device=str(dev),
        cuda_available=torch.cuda.is_available(),
    )
    try:
        out["cudnn"] = torch.backends.cudnn.version()
    except Exception as error:
        out["cudnn"] = short_error(error)
    if cuda:
        step("torch.cuda.init", torch.cuda.init)
        step("mem_get_info (creates the context)", lambda: torch.cuda.mem_get_info())
    keep: list[Any] = []
    a32 = {}

    def first_alloc() -> None:
        keep.append(torch.empty(1, device=dev))

    def matmul(dtype: Any) -> Any:
        def act() -> None:
            a = torch.randn(256, 256, device=dev).to(dtype)
            a32[str(dtype)] = a
            keep.append(a @ a)

        return act

    def linear_bias() -> None:
        x = torch.randn(64, 256, device=dev, dtype=torch.bfloat16)
        w = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
        b = torch.randn(256, device=dev, dtype=torch.bfloat16)
        keep.append(torch.nn.functional.linear(x, w, b))

    def conv() -> None:
        x = torch.randn(1, 3, 32, 32, device=dev)
        w = torch.randn(8, 3, 3, 3, device=dev)
        keep.append(torch.nn.functional.conv2d(x, w))

    def sdpa(dtype: Any) -> Any:
        def act() -> None:
            q = torch.randn(1, 8, 512, 64, device=dev, dtype=dtype)
            keep.append(torch.nn.functional.scaled_dot_product_attention(q, q, q))

        return act

    def backward() -> None:
        x = torch.randn(256, 256, device=dev, requires_grad=True)
        (x @ x).sum().backward()
        keep.append(x.grad)

    step("first allocation (1 float)", first_alloc)
    step("first matmul float32", matmul(torch.float32))
    step("first matmul bfloat16", matmul(torch.bfloat16))
    step("first F.linear with bias bfloat16", linear_bias)
    step("first cuDNN call (conv2d float32)", conv)
    step("first SDPA bfloat16", sdpa(torch.bfloat16))
    step("first SDPA float32", sdpa(torch.float32))
    step("first backward float32", backward)
    keep.clear()
    a32.clear()
    if cuda:
        step("after freeing and torch.cuda.empty_cache()", torch.cuda.empty_cache)
    # the context: free before any CUDA call, less free now, less what torch's allocator holds
    first = out["steps"][0]
    before = first.get("nvml_free")
    if before is None and first.get("smi_free_mib") not in (None, ""):
        try:
            before = int(float(first["smi_free_mib"])) * 2**20
        except ValueError:
            before = None
    out["free_before_any_cuda_call"] = before
    for record in out["steps"]:
        if before is not None and record.get("mem_get_info_free") is not None:
            record["context_bytes"] = (
                before - record["mem_get_info_free"] - record.get("torch_reserved", 0)
            )
    with_context = [r for r in out["steps"] if "context_bytes" in r]
    if with_context:
        out["context_bytes_after_init"] = with_context[0]["context_bytes"]
        out["context_bytes_at_end"] = with_context[-1]["context_bytes"]
    if cuda:
        props = torch.cuda.get_device_properties(dev)
        described = {}
        for key in dir(props):
            if not key.startswith("_"):
                try:
                    value = getattr(props, key)
                except Exception:
                    continue
                if isinstance(value, (int, float, str, bool)):
                    described[key] = value
                elif value is not None and not callable(value):
                    described[key] = str(value)
        out["properties"] = described
        out["name"] = props.name
        out["capability"] = f"{props.major}.{props.minor}"
        out["total_memory"] = props.total_memory
        out["multi_processor_count"] = props.multi_processor_count
        out["arch_list"] = torch.cuda.get_arch_list()
    settings: dict[str, Any] = {}
    for key, getter in (
        ("flash_sdp_enabled", lambda: torch.backends.cuda.flash_sdp_enabled()),
        ("mem_efficient_sdp_enabled", lambda: torch.backends.cuda.mem_efficient_sdp_enabled()),
        ("cudnn_sdp_enabled", lambda: torch.backends.cuda.cudnn_sdp_enabled()),
        ("math_sdp_enabled", lambda: torch.backends.cuda.math_sdp_enabled()),
        ("sdp_priority_order", lambda: sdp_priority_order()),
        ("cudnn_enabled", lambda: torch.backends.cudnn.enabled),
        ("cudnn_benchmark", lambda: torch.backends.cudnn.benchmark),
        ("matmul_allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
        ("float32_matmul_precision", lambda: torch.get_float32_matmul_precision()),
        ("preferred_blas_library", lambda: str(torch.backends.cuda.preferred_blas_library())),
        ("allocator_backend", lambda: torch.cuda.get_allocator_backend()),
        ("cuda_device_count", lambda: torch.cuda.device_count()),
    ):
        try:
            settings[key] = getter()
        except Exception as error:
            settings[key] = short_error(error)
    out["settings"] = settings
    out["env"] = {key: os.environ.get(key) for key in ENV_KEYS}
    return out


def probe_first_ops(device: str, steps: list[str]) -> dict[str, Any]:
    """In a fresh process: what each step adds to the allocator (allocated, reserved, peak,
    the new blocks), the first step being the process's first CUDA work."""
    import torch
    import torch.nn.functional as F

    mem = Memory(device)
    dev = mem.device
    out: dict[str, Any] = {"device": str(dev), "torch": torch.__version__, "steps": []}
    if mem.cuda:
        torch.cuda.init()
    for spec in steps:
        name, _, dtype_name = spec.partition(":")
        dtype = getattr(torch, dtype_name) if dtype_name else torch.float32
        record: dict[str, Any] = {"step": spec}
        if name == "alloc_rounding":
            record["rows"] = alloc_rounding(mem)
            out["steps"].append(record)
            continue
        try:
            # inputs first (their bytes are not the step's)
            inputs: dict[str, Any] = {}
            if name in ("matmul", "linear", "linear_bias"):
                inputs["a"] = torch.randn(256, 256, device=dev).to(dtype)
                inputs["w"] = torch.randn(256, 256, device=dev).to(dtype)
                inputs["b"] = torch.randn(256, device=dev).to(dtype)
            elif name == "bmm":
                inputs["a"] = torch.randn(8, 256, 64, device=dev).to(dtype)
                inputs["w"] = torch.randn(8, 64, 256, device=dev).to(dtype)
            elif name == "backward":
                inputs["a"] = torch.randn(256, 256, device=dev).to(dtype).requires_grad_()
                inputs["w"] = torch.randn(256, 256, device=dev).to(dtype).requires_grad_()
            elif name in ("sdpa", "sdpa_backward"):
                for key in "qkv":
                    inputs[key] = torch.randn(1, 8, 512, 64, device=dev, dtype=dtype)
                    if name == "sdpa_backward":
                        inputs[key].requires_grad_()
            elif name in ("adam", "adam_default"):
                inputs["params"] = [
                    torch.randn(512, 512, device=dev).to(dtype).requires_grad_() for _ in range(2)
                ]
                for p in inputs["params"]:
                    p.grad = torch.randn_like(p)
            mem.sync()
            blocks_before, segments_before = mem.blocks(), mem.segments()
            base, reserved_base, requested_base = mem.allocated(), mem.reserved(), mem.requested()
            mem.reset()
            started = time.perf_counter()
            kept: Any = None
            if name == "matmul":
                kept = inputs["a"] @ inputs["w"]
            elif name == "linear_bias":
                kept = F.linear(inputs["a"], inputs["w"], inputs["b"])
            elif name == "linear":
                kept = F.linear(inputs["a"], inputs["w"])
            elif name == "bmm":
                kept = torch.bmm(inputs["a"], inputs["w"])
            elif name == "backward":
                (inputs["a"] @ inputs["w"]).sum().backward()
                kept = [inputs["a"].grad, inputs["w"].grad]
            elif name == "sdpa":
                kept = F.scaled_dot_product_attention(inputs["q"], inputs["k"], inputs["v"])
            elif name == "sdpa_backward":
                o = F.scaled_dot_product_attention(inputs["q"], inputs["k"], inputs["v"])
                o.sum().backward()
                kept = [inputs[key].grad for key in "qkv"]
                del o
            elif name in ("adam", "adam_default"):
                foreach = False if name == "adam" else None
                optimizer = torch.optim.Adam(inputs["params"], foreach=foreach)
                optimizer.step()
                kept = optimizer
            else:
                raise ValueError(f"unknown step {spec}")
            mem.sync()
            record["seconds"] = round(time.perf_counter() - started, 5)
            after = mem.allocated()
            record.update(
                allocated_delta=after - base,
                reserved_delta=mem.reserved() - reserved_base,
                peak_delta=mem.peak() - base,
                requested_delta=mem.requested() - requested_base,
            )
            outputs = kept if isinstance(kept, list) else [kept]
            out_bytes = sum(
                t.untyped_storage().nbytes() for t in outputs if isinstance(t, torch.Tensor)
            )
            record["output_bytes"] = out_bytes
            record["workspace_like_bytes"] = record["allocated_delta"] - out_bytes
            new_blocks = mem.blocks() - blocks_before
            record["new_blocks"] = sorted(new_blocks.elements(), reverse=True)[:40]
            record["new_segments"] = sorted(
                (mem.segments() - segments_before).elements(), reverse=True
            )[:20]
            del kept, outputs
            inputs.clear()
        except Exception as error:
            record["error"] = short_error(error)
        out["steps"].append(record)
    out["final_allocated"] = mem.allocated()
    out["final_reserved"] = mem.reserved()
    return out


def alloc_rounding(mem: Memory) -> list[dict[str, Any]]:
    """The allocator's rounding: bytes counted for requests of each size (uint8 tensors)."""
    torch = mem.torch
    rows = []
    sizes = [
        1,
        8,
        511,
        512,
        513,
        1024,
        4096,
        1048575,
        1048576,
        1048577,
        2097153,
        10485759,
        10485761,
        20971521,
        33554433,
        104857601,
    ]
    for n in sizes:
        row: dict[str, Any] = {"request_bytes": n}
        try:
            if mem.cuda:
                torch.cuda.empty_cache()
            base, reserved, requested = mem.allocated(), mem.reserved(), mem.requested()
            t = torch.empty(n, dtype=torch.uint8, device=mem.device)
            row.update(
                allocated_delta=mem.allocated() - base,
                reserved_delta=mem.reserved() - reserved,
                requested_delta=mem.requested() - requested,
            )
            del t
        except Exception as error:
            row["error"] = short_error(error)
        rows.append(row)
    try:  # ten 1-byte tensors side by side
        base = mem.allocated()
        many = [torch.empty(1, dtype=torch.uint8, device=mem.device) for _ in range(10)]
        rows.append({"request_bytes": "10 x 1", "allocated_delta": mem.allocated() - base})
        del many
    except Exception as error:
        rows.append({"request_bytes": "10 x 1", "error": short_error(error)})
    return rows


def backend_names() -> dict[int, str]:
    from torch.nn.attention import SDPBackend

    try:
        return {int(v): k for k, v in SDPBackend.__members__.items()}
    except Exception:
        return {int(b): b.name for b in SDPBackend}  # type: ignore[attr-defined]


def sdp_priority_order() -> list[str]:
    """The order in which torch tries the SDPA backends (this device's)."""
    import torch

    names = backend_names()
    return [names.get(int(b), str(b)) for b in torch._C._get_sdp_priority_order()]


STICKY_CUDA_ERRORS = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
)


def probe_sdpa_grid(device: str, deadline: float, small: bool, first: int = 0) -> None:
    """SDPA's kernel choice and memory over a grid, one JSON line a row on stdout, from grid
    index ``first`` on. An error that leaves the CUDA context unusable ends the process (the
    caller starts another after that row)."""
    import warnings

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mem = Memory(device)
    dev = mem.device
    names = backend_names()
    env = {"kind": "env", "torch": torch.__version__, "device": str(dev), "names": names}
    try:
        env.update(
            flash=torch.backends.cuda.flash_sdp_enabled(),
            mem_efficient=torch.backends.cuda.mem_efficient_sdp_enabled(),
            cudnn_sdp=torch.backends.cuda.cudnn_sdp_enabled(),
            math=torch.backends.cuda.math_sdp_enabled(),
        )
        env["priority_order"] = sdp_priority_order()
    except Exception as error:
        env["settings_error"] = short_error(error)
    print(json.dumps(env), flush=True)
    lengths = (32, 64) if small else (512, 2048)
    window = 8 if small else 128
    dtypes = (torch.bfloat16, torch.float32, torch.float16)
    head_dims = (64, 128, 80, 256)
    masks = ("none", "is_causal", "bool_causal", "bool_window", "float_causal")
    grid = [
        (d, dt, hkv, mask, n)
        for d in head_dims
        for dt in dtypes
        for hkv in (8, 2)
        for mask in masks
        for n in lengths
    ]
    skipped = []
    for index, (d, dtype, hkv, mask, n) in enumerate(grid):
        if index < first:
            continue
        key = {
            "index": index,
            "head_dim": d,
            "dtype": str(dtype).replace("torch.", ""),
            "kv_heads": hkv,
            "mask": mask,
            "L": n,
        }
        if time.time() > deadline:
            skipped = [
                dict(
                    zip(
                        ("head_dim", "dtype", "kv_heads", "mask", "L"),
                        (g[0], str(g[1]).replace("torch.", ""), g[2], g[3], g[4]),
                        strict=True,
                    )
                )
                for g in grid[index:]
            ]
            for row, g in zip(skipped, grid[index:], strict=True):
                row["index"] = grid.index(g)
            break
        faults = os.environ.get("CUDA_MEMORY_TEST_FAULT", "")  # tests: "abort:5,sticky:9"
        if f"abort:{index}" in faults.split(","):
            os.abort()
        backends = ["default"] + (["MATH"] if n == lengths[0] else [])
        for backend in backends:
            row = {"kind": "row", "B": 1, "H": 8, **key, "backend": backend}
            started = time.perf_counter()
            try:
                if f"sticky:{index}" in faults.split(","):
                    raise RuntimeError("CUDA error: an illegal memory access was encountered")
                sdpa_row(
                    torch,
                    F,
                    SDPBackend,
                    sdpa_kernel,
                    warnings,
                    mem,
                    dev,
                    names,
                    row,
                    d,
                    dtype,
                    hkv,
                    mask,
                    n,
                    window,
                    backend,
                )
            except Exception as error:
                row["error"] = short_error(error)
            row["seconds"] = round(time.perf_counter() - started, 4)
            print(json.dumps(row, default=str), flush=True)
            if any(e in str(row.get("error", "")) for e in STICKY_CUDA_ERRORS):
                os._exit(3)  # the context is broken: the caller goes on in a new process
    print(json.dumps({"kind": "skipped", "rows": skipped}), flush=True)


def sdpa_row(
    torch: Any,
    F: Any,
    SDPBackend: Any,
    sdpa_kernel: Any,
    warnings: Any,
    mem: Memory,
    dev: Any,
    names: dict,
    row: dict,
    d: int,
    dtype: Any,
    hkv: int,
    mask_mode: str,
    n: int,
    window: int,
    backend: str,
) -> None:
    B, H = 1, 8
    q = torch.randn(B, H, n, d, device=dev, dtype=dtype)
    k = torch.randn(B, hkv, n, d, device=dev, dtype=dtype)
    v = torch.randn(B, hkv, n, d, device=dev, dtype=dtype)
    gqa = hkv != H
    row["enable_gqa"] = gqa
    mask, causal = None, False
    if mask_mode == "is_causal":
        causal = True
    elif mask_mode == "bool_causal":
        mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
    elif mask_mode == "bool_window":
        i = torch.arange(n, device=dev)
        mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    elif mask_mode == "float_causal":
        keep = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        mask = torch.zeros(n, n, dtype=dtype, device=dev).masked_fill(~keep, float("-inf"))
    row["mask_bytes"] = mask.untyped_storage().nbytes() if mask is not None else 0
    kwargs: dict[str, Any] = {"attn_mask": mask, "is_causal": causal}
    if gqa:
        kwargs["enable_gqa"] = True
    if backend == "default":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, causal, enable_gqa=gqa)
            except TypeError:
                choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, causal)
            row["default_choice"] = names.get(int(choice), int(choice))
        row["choice_warnings"] = [str(w.message)[:400] for w in caught]
        row["eligible"] = eligibility(torch, warnings, q, k, v, mask, causal, gqa)
    context = sdpa_kernel([getattr(SDPBackend, backend)]) if backend != "default" else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if context is not None:
            context.__enter__()
        try:
            with torch.inference_mode():
                base = mem.allocated()
                mem.reset()
                o = F.scaled_dot_product_attention(q, k, v, **kwargs)
                row["infer_peak"] = mem.peak() - base
                row["infer_kept"] = mem.allocated() - base
                row["out_bytes"] = o.untyped_storage().nbytes()
                del o
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            base = mem.allocated()
            mem.reset()
            o = F.scaled_dot_product_attention(qg, kg, vg, **kwargs)
            row["train_fwd_kept"] = mem.allocated() - base
            row["train_fwd_peak"] = mem.peak() - base
            mem.reset()
            o.sum().backward()
            row["train_bwd_peak"] = mem.peak() - base
            del o
            row["train_bwd_kept"] = mem.allocated() - base
            row["grad_bytes"] = sum(t.grad.untyped_storage().nbytes() for t in (qg, kg, vg))
            del qg, kg, vg
        finally:
            if context is not None:
                context.__exit__(None, None, None)
    row["warnings"] = [str(w.message)[:400] for w in caught]


def eligibility(
    torch: Any, warnings: Any, q: Any, k: Any, v: Any, mask: Any, causal: bool, gqa: bool
) -> dict[str, Any]:
    """Which fused kernels accept these inputs (torch.backends.cuda.can_use_*), and why not."""
    out: dict[str, Any] = {}
    try:
        from torch.backends.cuda import SDPAParams

        try:
            params = SDPAParams(q, k, v, mask, 0.0, causal, gqa)
        except TypeError:
            params = SDPAParams(q, k, v, mask, 0.0, causal)
    except Exception as error:
        return {"error": short_error(error)}
    for name in ("flash", "efficient", "cudnn"):
        check = getattr(torch.backends.cuda, f"can_use_{name}_attention", None)
        if check is None:
            out[name] = None
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out[name] = bool(check(params, True))
            except Exception as error:
                out[name] = short_error(error)
        reasons = [str(w.message)[:300] for w in caught]
        if reasons:
            out[f"{name}_why_not"] = reasons
    return out


def run_attnctl_with_stats(stats_path: str, argv: list[str]) -> None:
    """`python -m attnctl ARGV`, recording the allocator's peaks at each
    torch.cuda.reset_peak_memory_stats attnctl makes (its stages) and at exit."""
    import atexit
    import gc
    import runpy

    gc.disable()  # as attnctl's own import_torch: torch's objects frozen out of the collector
    try:
        import torch
    finally:
        gc.enable()
    gc.freeze()
    stats: dict[str, Any] = {"resets": []}

    def snapshot() -> dict[str, Any]:
        values = torch.cuda.memory_stats()
        return {
            "allocated_peak": int(torch.cuda.max_memory_allocated()),
            "reserved_peak": int(torch.cuda.max_memory_reserved()),
            "requested_peak": values.get("requested_bytes.all.peak"),
            "allocated": values.get("allocated_bytes.all.current"),
            "reserved": values.get("reserved_bytes.all.current"),
            "num_alloc_retries": values.get("num_alloc_retries"),
            "num_ooms": values.get("num_ooms"),
            "segments": values.get("segment.all.current"),
        }

    original = torch.cuda.reset_peak_memory_stats

    def reset(device: Any = None) -> None:
        try:
            if torch.cuda.is_initialized():
                stats["resets"].append(snapshot())
        except Exception as error:
            stats.setdefault("errors", []).append(short_error(error))
        return original(device)

    torch.cuda.reset_peak_memory_stats = reset

    def write() -> None:
        try:
            if torch.cuda.is_initialized():
                stats["final"] = snapshot()
                free, total = torch.cuda.mem_get_info()
                stats["mem_get_info_at_exit"] = [int(free), int(total)]
        except Exception as error:
            stats.setdefault("errors", []).append(short_error(error))
        with contextlib.suppress(Exception):
            Path(stats_path).write_text(json.dumps(stats), encoding="utf-8")

    atexit.register(write)
    sys.argv = ["attnctl", *argv]
    runpy.run_module("attnctl", run_name="__main__", alter_sys=True)


def run_under_torch_profiler(out_path: str, argv: list[str]) -> None:
    """attnctl (-m attnctl ARGS) or a script (--script PATH ARGS) under torch.profiler."""
    import runpy

    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    record: dict[str, Any] = {"activities": [str(a) for a in activities]}
    code: Any = 0
    try:
        profiler = profile(activities=activities)
        profiler.__enter__()
    except Exception as error:
        record["cuda_profiler_error"] = short_error(error)
        profiler = profile(activities=[ProfilerActivity.CPU])
        profiler.__enter__()
    started = time.perf_counter()
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv[1:]
            runpy.run_path(argv[1], run_name="__main__")
    except SystemExit as done:
        code = done.code
    finally:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        record["run_s"] = round(time.perf_counter() - started, 4)
        try:
            profiler.__exit__(None, None, None)
            events = profiler.key_averages()

            def value(event: Any, *names: str) -> float:
                for name in names:
                    got = getattr(event, name, None)
                    if got is not None:
                        return float(got)
                return 0.0

            rows = [
                {
                    "name": e.key,
                    "count": e.count,
                    "self_device_us": value(e, "self_device_time_total", "self_cuda_time_total"),
                    "device_us": value(e, "device_time_total", "cuda_time_total"),
                    "self_cpu_us": value(e, "self_cpu_time_total"),
                    "cpu_us": value(e, "cpu_time_total"),
                }
                for e in events
            ]
            record["top_self_device"] = sorted(rows, key=lambda r: -r["self_device_us"])[:25]
            record["top_cpu_total"] = sorted(rows, key=lambda r: -r["cpu_us"])[:25]
            record["top_self_cpu"] = sorted(rows, key=lambda r: -r["self_cpu_us"])[:25]
            record["sdpa_like"] = [
                r
                for r in rows
                if "attention" in r["name"].lower()
                or "sdp" in r["name"].lower()
                or "cudnn" in r["name"].lower()
            ][:40]
            record["total_self_device_us"] = sum(r["self_device_us"] for r in rows)
        except Exception as error:
            record["profiler_error"] = short_error(error)
        record["exit_code"] = code
        Path(out_path).write_text(json.dumps(record, default=str), encoding="utf-8")
    sys.exit(code)


def make_texts(folder: str, counts: list[int]) -> dict[str, Any]:
    """Texts of exactly (or about) each count of tokens with the bundled tokenizer, from the
    repository's corpus (as benchmarks/long_input.py), cut at a token's end."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    corpus = "\n".join(
        p.read_text(encoding="utf-8") for p in sorted((ROOT / "scripts" / "corpus").glob("*.txt"))
    )
    per_copy = len(tokenizer.encode(corpus).ids)
    Path(folder).mkdir(parents=True, exist_ok=True)
    files, texts = {}, {}
    for count in counts:
        copies = count // max(1, per_copy) + 2
        text = "\n".join([corpus] * copies)
        encoding = tokenizer.encode(text)
        # cut at a token's end; attnctl drops a final line end, so the text ends on none
        cut, got = "", 0
        for extra in range(50):
            cut = text[: encoding.offsets[count - 1 + extra][1]].rstrip("\r\n")
            got = len(tokenizer.encode(cut).ids)
            if got >= count:
                break
        while got > count and cut:  # a merge across the cut: drop characters
            shorter = cut[:-1].rstrip("\r\n")
            if len(tokenizer.encode(shorter).ids) < count:
                break
            cut = shorter
            got = len(tokenizer.encode(cut).ids)
        path = Path(folder) / f"text_{count}.txt"
        path.write_text(cut, encoding="utf-8")
        files[str(count)] = str(path)
        texts[str(count)] = {"tokens": got, "characters": len(cut), "bytes": path.stat().st_size}
    return {"files": files, "texts": texts}


CHECKPOINT_SPECS = ("llama", "gpt2", "mistral", "marian", "bart")


def make_checkpoints(folder: str) -> dict[str, Any]:
    """Small random checkpoints written by transformers, with tests/'s tokenizers and draw:
    Llama (GQA 8/2, d 512), GPT-2 (d 256, 4 heads), Mistral (GQA, sliding window 256),
    Marian and BART (encoder-decoders, d 256, 4 heads)."""
    sys.path.insert(0, str(ROOT / "tests"))
    out: dict[str, Any] = {"folders": {}, "configs": {}, "errors": {}}
    try:
        import tiny_models
        import tiny_seq2seq
        import transformers

        transformers.utils.logging.disable_progress_bar()
        out["transformers"] = transformers.__version__
    except Exception as error:
        out["errors"]["import"] = short_error(error)
        return out
    root = Path(folder)

    def causal(name: str, config_class: str, model_class: str, family: str, **values: Any) -> None:
        directory = root / name
        directory.mkdir(parents=True, exist_ok=True)
        tokenizer = tiny_models.build_tokenizer(family)
        tokenizer.save(str(directory / "tokenizer.json"))
        config = getattr(transformers, config_class)(
            vocab_size=tokenizer.get_vocab_size(), **values
        )
        model = getattr(transformers, model_class)._from_config(config, attn_implementation="eager")
        model = tiny_models._draw(model, family)
        model.save_pretrained(directory, safe_serialization=True)

    makers = {
        "llama": lambda: causal(
            "llama",
            "LlamaConfig",
            "LlamaForCausalLM",
            "llama",
            hidden_size=512,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=1024,
            max_position_embeddings=8192,
        ),
        "gpt2": lambda: causal(
            "gpt2",
            "GPT2Config",
            "GPT2LMHeadModel",
            "gpt2",
            n_embd=256,
            n_layer=2,
            n_head=4,
            n_positions=4096,
            bos_token_id=0,
            eos_token_id=0,
        ),
        "mistral": lambda: causal(
            "mistral",
            "MistralConfig",
            "MistralForCausalLM",
            "mistral",
            hidden_size=512,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=1024,
            max_position_embeddings=8192,
            sliding_window=256,
        ),
        "marian": lambda: tiny_seq2seq.write(
            "marian",
            root / "marian",
            d_model=256,
            encoder_ffn_dim=512,
            decoder_ffn_dim=512,
            max_position_embeddings=2048,
        ),
        "bart": lambda: tiny_seq2seq.write(
            "bart",
            root / "bart",
            d_model=256,
            encoder_ffn_dim=512,
            decoder_ffn_dim=512,
            max_position_embeddings=2048,
        ),
    }
    for name in CHECKPOINT_SPECS:
        try:
            makers[name]()
            out["folders"][name] = str(root / name)
            out["configs"][name] = json.loads((root / name / "config.json").read_text())
        except Exception as error:
            out["errors"][name] = short_error(error)
    return out


def probe_main(argv: list[str]) -> int:
    """The probes' entry: `cuda_memory.py _NAME ARGS`."""
    _drop_own_folder()
    name, rest = argv[0], argv[1:]
    if name == "_attnctl":
        run_attnctl_with_stats(rest[0], rest[1:])
        return 0
    if name == "_torchprof":
        run_under_torch_profiler(rest[0], rest[1:])
        return 0
    if name == "_device":
        print(json.dumps(probe_device(rest[0]), default=str), flush=True)
    elif name == "_firstops":
        print(json.dumps(probe_first_ops(rest[0], rest[1].split(",")), default=str), flush=True)
    elif name == "_sdpa_grid":
        probe_sdpa_grid(rest[0], float(rest[1]), rest[2] == "small", int(rest[3]))
    elif name == "_texts":
        counts = [int(c) for c in rest[1].split(",") if c]
        print(json.dumps(make_texts(rest[0], counts)), flush=True)
    elif name == "_checkpoints":
        print(json.dumps(make_checkpoints(rest[0]), default=str), flush=True)
    else:
        print(f"unknown probe {name}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        sys.exit(probe_main(sys.argv[1:]))
    sys.exit(main(sys.argv[1:]))
