"""Per-GPU memory of published parallel layouts: the references beside attnctl's figures.

    python benchmarks/parallel_references.py [--json] [--only NAME,...] [--models DIR]

For each configuration below (Megatron-LM's small functional-test GPT, Llama-3-70B and
Llama-3.1-405B with the layouts NeMo's recipes and the Llama 3 paper publish) it prints:

- Megatron's theoretical memory (weights + optimizer, activations), by calling the real
  ``compute_weight_and_optimizer_memory`` / ``compute_activation_memory`` of the
  ``megatron-bridge`` wheel (``megatron/bridge/training/utils/theoretical_memory_utils.py``),
  its port of Megatron-LM's ``megatron/training/theoretical_memory_usage.py``. The
  ``megatron-core`` wheel does not ship that file (it packages ``megatron/core`` only), and
  the bridge's package imports transformer_engine (CUDA only) on the way: the module is
  loaded from its file with its two imports stood in for (see ``megatron_functions``);
- DeepSpeed's ZeRO-2 and ZeRO-3 model-state estimates per GPU (the functions that
  ``estimate_zero{2,3}_model_states_mem_needs_all_cold`` print, called directly);
- attnctl's ``per_device`` from ``attnctl memory ... --json``, or "n/a (why)" while that
  command cannot answer.

Neither reference is a runtime dependency of attnctl: install them into a separate venv,
``pip install megatron-core deepspeed`` and ``pip install --no-deps megatron-bridge``
(DS_BUILD_OPS=0; both run on the CPU). A missing one prints "n/a". What each reference
models and leaves out: docs/parallel-references.md.

The folders are header-only (tests/tiny_models.py ``write_header_only``): 405B's is an
811 GB sparse file holding about 150 KB.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30

# Every figure below names its source: an id of this table.
SOURCES = {
    "llama3-paper": {
        "title": "The Llama 3 Herd of Models (Llama Team, AI @ Meta, 2024), arXiv:2407.21783",
        "where": "section 3.3.2 'Parallelism for Model Scaling', Table 4 'Scaling "
        "configurations and MFU for each stage of Llama 3 405B pre-training'; section "
        "3.3.1 'Training Infrastructure' (Compute, Storage)",
        "url": "https://arxiv.org/abs/2407.21783",
    },
    "nemo-llama3-70b": {
        "title": "NVIDIA NeMo 2.0 recipe llama3_70b (trainer() defaults and pretrain_recipe())",
        "where": "nemo/collections/llm/recipes/llama3_70b.py",
        "url": "https://github.com/NVIDIA/NeMo/blob/main/nemo/collections/llm/recipes/llama3_70b.py",
    },
    "nemo-llama31-405b": {
        "title": "NVIDIA NeMo 2.0 recipe llama31_405b (trainer() defaults and pretrain_recipe())",
        "where": "nemo/collections/llm/recipes/llama31_405b.py",
        "url": "https://github.com/NVIDIA/NeMo/blob/main/nemo/collections/llm/recipes/llama31_405b.py",
    },
    "bridge-llama3": {
        "title": "Megatron-Bridge 0.3.1 recipes llama3_70b_pretrain_config, "
        "llama31_405b_pretrain_config",
        "where": "megatron/bridge/recipes/llama/llama3.py (the megatron-bridge wheel)",
        "url": "https://github.com/NVIDIA-NeMo/Megatron-Bridge",
    },
    "megatron-test-gpt": {
        "title": "Megatron-LM functional test gpt3_mcore_te_tp2_pp2",
        "where": "tests/functional_tests/test_cases/gpt/gpt3_mcore_te_tp2_pp2/model_config.yaml",
        "url": "https://github.com/NVIDIA/Megatron-LM/tree/main/tests/functional_tests/"
        "test_cases/gpt/gpt3_mcore_te_tp2_pp2",
    },
    "hf-llama-3-70b": {
        "title": "meta-llama/Meta-Llama-3-70B config.json (model card: 70B, GQA, 8K context)",
        "where": "config.json",
        "url": "https://huggingface.co/meta-llama/Meta-Llama-3-70B",
    },
    "hf-llama-3.1-405b": {
        "title": "meta-llama/Llama-3.1-405B config.json (model card: 405B, 128K context)",
        "where": "config.json",
        "url": "https://huggingface.co/meta-llama/Llama-3.1-405B",
    },
}

# What the Llama 3 paper says about memory, word for word where quoted.
PUBLISHED_MEMORY_NOTES = (
    ("llama3-paper", "3.3.1 Compute", "Llama 3 405B is trained on up to 16K H100 GPUs, each "
     "running at 700W TDP with 80GB HBM3"),
    ("llama3-paper", "3.3.1 Storage", "Checkpointing saves each GPU's model state, ranging "
     "from 1 MB to 4 GB per GPU, for recovery and debugging"),
    ("llama3-paper", "3.3.2", "Our use of FSDP for Llama 3 shards optimizer states and "
     "gradients, but for model shards we do not reshard after forward computation to avoid "
     "an extra all-gather communication during backward passes"),
    ("llama3-paper", "3.3.2", "The first stage consumes more memory due to the embedding and "
     "the warm-up micro-batches"),
    ("llama3-paper", "3.3.2", "To balance the pipeline, we reduce one Transformer layer each "
     "from the first and the last stages, respectively"),
    ("llama3-paper", "3.3.2", "With these optimizations, we could pre-train Llama 3 on "
     "sequences of 8K tokens without activation checkpointing"),
)  # fmt: skip

HBM_PER_GPU = {"llama3-paper": 80 * 10**9}  # H100 80GB: decimal gigabytes


@dataclass(frozen=True)
class Model:
    """A header-only folder's recipe and the numbers the references take from it."""

    name: str  # tests/tiny_models.py FULL_SIZE key
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int  # as stored (already padded for Megatron's GPT)
    swiglu: bool
    tied: bool
    source: str


MODELS = {
    "llama-3-70b": Model("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256, True, False,
                         "hf-llama-3-70b"),
    "llama-3.1-405b": Model("llama-3.1-405b", 126, 16384, 128, 8, 128, 53248, 128256, True,
                            False, "hf-llama-3.1-405b"),
    # GPT-2's 50,257 tokens padded as Megatron-LM pads them: to a multiple of
    # make-vocab-size-divisible-by (128) times TP (2) = 256, i.e. 50,432
    "gpt-megatron-test": Model("gpt-megatron-test", 12, 512, 8, 8, 64, 2048, 50432, False, True,
                               "megatron-test-gpt"),
}  # fmt: skip


@dataclass(frozen=True)
class Configuration:
    """One published layout. ``sources`` maps each field that was published to its source."""

    name: str
    model: str
    tp: int
    pp: int
    cp: int
    dp: int
    seq_len: int
    micro_batch: int
    global_batch: int
    sp: bool
    vpp: int | None  # interleaved stages per rank; None: not interleaved (or not published)
    recompute: str  # none | selective | full
    distributed_optimizer: bool  # Megatron's ZeRO-1-like sharding of fp32 state over DP
    zero: int  # the ZeRO stage attnctl is asked for: the closest to what the run shards
    sources: dict[str, str]
    assumptions: tuple[str, ...] = ()
    pp_blocks: str = ""  # each stage's blocks when not even (attnctl's --pp-blocks)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def batch_per_dp_rank(self) -> int:
        return self.global_batch // self.dp

    @property
    def micro_batches(self) -> int:
        """Micro-batches each data-parallel rank runs per step (its gradient accumulation)."""
        return self.global_batch // (self.dp * self.micro_batch)


CONFIGURATIONS = (
    Configuration(
        "gpt-megatron-test tp2 pp2", "gpt-megatron-test", tp=2, pp=2, cp=1, dp=2,
        seq_len=1024, micro_batch=4, global_batch=32, sp=False, vpp=None, recompute="none",
        distributed_optimizer=False, zero=0,
        sources={"model, layout, batch": "megatron-test-gpt"},
        assumptions=("DP 2: the test runs on one 8-GPU node (8 / (TP 2 · PP 2))",),
    ),
    Configuration(
        "llama-3-70b nemo", "llama-3-70b", tp=4, pp=4, cp=2, dp=1, seq_len=8192,
        micro_batch=1, global_batch=512, sp=True, vpp=5, recompute="none",
        distributed_optimizer=True, zero=1,
        sources={"layout": "nemo-llama3-70b", "batch": "nemo-llama3-70b",
                 "the same layout": "bridge-llama3", "model": "hf-llama-3-70b"},
        assumptions=("DP 1: the recipe's 4 nodes of 8 GPUs (32 = TP 4 · PP 4 · CP 2)",),
    ),
    Configuration(
        "llama-3.1-405b nemo", "llama-3.1-405b", tp=8, pp=9, cp=4, dp=2, seq_len=8192,
        micro_batch=1, global_batch=512, sp=True, vpp=2, recompute="none",
        distributed_optimizer=True, zero=1,
        sources={"layout": "nemo-llama31-405b", "batch": "nemo-llama31-405b",
                 "model": "hf-llama-3.1-405b"},
        assumptions=("DP 2: trainer()'s default 72 nodes of 8 GPUs (576 = TP 8 · PP 9 · CP 4 "
                     "· 2); pretrain_recipe() passes its own default, 1 node",),
    ),
    Configuration(
        "llama-3.1-405b paper 8k/8192", "llama-3.1-405b", tp=8, pp=16, cp=1, dp=64,
        seq_len=8192, micro_batch=1, global_batch=64 * 32, sp=True, vpp=None,
        recompute="none", distributed_optimizer=True, zero=2,
        sources={"GPUs, TP, CP, PP, DP, seq, batch/DP 32": "llama3-paper",
                 "no recompute at 8K": "llama3-paper", "model": "hf-llama-3.1-405b",
                 "one block fewer on the first and last stages": "llama3-paper"},
        assumptions=("micro-batch 1 (not published)", "SP on (not published; Megatron's "
                     "activation formula assumes it)", "interleaved schedule, V not "
                     "published: computed as 1F1B", "FSDP as ZeRO-2 for attnctl: gradients "
                     "and optimizer sharded, weights kept whole between forward and backward"),
        pp_blocks="7,8x14,7",
    ),
    Configuration(
        "llama-3.1-405b paper 8k/16384", "llama-3.1-405b", tp=8, pp=16, cp=1, dp=128,
        seq_len=8192, micro_batch=1, global_batch=128 * 16, sp=True, vpp=None,
        recompute="none", distributed_optimizer=True, zero=2,
        sources={"GPUs, TP, CP, PP, DP, seq, batch/DP 16": "llama3-paper",
                 "model": "hf-llama-3.1-405b",
                 "one block fewer on the first and last stages": "llama3-paper"},
        assumptions=("micro-batch 1", "SP on", "computed as 1F1B", "FSDP as ZeRO-2"),
        pp_blocks="7,8x14,7",
    ),
    Configuration(
        "llama-3.1-405b paper 128k/16384", "llama-3.1-405b", tp=8, pp=16, cp=16, dp=8,
        seq_len=131072, micro_batch=1, global_batch=8 * 16, sp=True, vpp=None,
        recompute="none", distributed_optimizer=True, zero=2,
        sources={"GPUs, TP, CP, PP, seq, batch/DP 16": "llama3-paper",
                 "model": "hf-llama-3.1-405b",
                 "one block fewer on the first and last stages": "llama3-paper"},
        assumptions=("DP 8 = 16,384 / (8 · 16 · 16), which the 16M tokens per batch also "
                     "give (131,072 · 16 · 8); the arXiv HTML's Table 4 prints 4",
                     "micro-batch 1", "SP on", "recompute none (the paper says so for 8K "
                     "only)", "computed as 1F1B", "FSDP as ZeRO-2"),
        pp_blocks="7,8x14,7",
    ),
)  # fmt: skip


# ---------------------------------------------------------------------------------------
# the model's tensors, from its header-only folder


def write_folder(model: Model, root: Path) -> Path:
    """The header-only folder (bfloat16) of ``model``; written once under ``root``."""
    folder = root / model.name
    if (folder / "model.safetensors").exists():
        return folder
    sys.path.insert(0, str(ROOT / "tests"))
    import tiny_models

    if model.name in tiny_models.FULL_SIZE:
        return tiny_models.write_header_only(model.name, folder, dtype="bfloat16")
    # the small GPT, which only this script needs: FULL_SIZE holds it while it is written
    tiny_models.FULL_SIZE[model.name] = (
        "GPT2LMHeadModel",
        {"model_type": "gpt2", "n_layer": model.layers, "n_embd": model.hidden,
         "n_head": model.heads, "n_inner": model.ffn, "n_positions": 1024,
         "vocab_size": model.vocab, "tie_word_embeddings": True},
    )  # fmt: skip
    try:
        return tiny_models.write_header_only(model.name, folder, dtype="bfloat16")
    finally:
        del tiny_models.FULL_SIZE[model.name]


def header_shapes(folder: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from the safetensors header (the data is never read)."""
    with (folder / "model.safetensors").open("rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(size))
    header.pop("__metadata__", None)
    return {name: entry["shape"] for name, entry in header.items()}


def stage_layers(layers: int, stages: int) -> list[int]:
    """Blocks per pipeline stage: ceil(layers / stages) each, the shortfall taken one block
    at a time from the last and first stages (Llama 3's 126 over 16: 7, 8 × 14, 7)."""
    each = math.ceil(layers / stages)
    counts = [each] * stages
    shortfall, turn = each * stages - layers, 0
    while shortfall:
        counts[-1 - turn // 2 if turn % 2 == 0 else turn // 2] -= 1
        shortfall, turn = shortfall - 1, turn + 1
    return counts


def shard_parameters(shapes: dict[str, list[int]], tp: int, pp: int) -> list[tuple[int, int]]:
    """(parameters, largest tensor's parameters) one rank of each pipeline stage holds:
    matrices split over TP (the embedding and head by vocabulary rows), norms whole; the
    embedding on the first stage, the final norm and the head on the last (a tied head
    has its own copy there when PP > 1, as Megatron keeps it)."""
    layers = 1 + max(int(n.split(".")[2]) for n in shapes if ".layers." in n or ".h." in n)
    counts = stage_layers(layers, pp)
    first_block = [sum(counts[:i]) for i in range(pp)]
    totals, largest = [0] * pp, [0] * pp

    def add(stage: int, shape: list[int]) -> None:
        count = math.prod(shape) // (tp if len(shape) == 2 else 1)
        totals[stage] += count
        largest[stage] = max(largest[stage], count)

    for name, shape in shapes.items():
        parts = name.split(".")
        if "layers" in parts or "h" in parts:
            block = int(parts[parts.index("layers" if "layers" in parts else "h") + 1])
            stage = max(i for i in range(pp) if first_block[i] <= block)
            add(stage, shape)
        elif "embed_tokens" in name or "wte" in name:
            add(0, shape)
            if pp > 1 and "lm_head.weight" not in shapes:  # tied: the last stage's copy
                add(pp - 1, shape)
        elif "wpe" in name:  # GPT-2's learned positions: the first stage
            add(0, shape)
        else:  # the final norm, the untied head
            add(pp - 1, shape)
    return list(zip(totals, largest, strict=True))


# ---------------------------------------------------------------------------------------
# Megatron


def megatron_functions() -> tuple[types.ModuleType, str]:
    """megatron-bridge's theoretical_memory_utils module, loaded from its file.

    The file imports ``ConfigContainer`` (a type annotation only) and
    ``calculate_padded_vocab_size`` (called only when ``should_pad_vocab``; its module
    imports transformer_engine). Both names are stood in for while the file loads; the
    functions called are the wheel's own, unchanged. Raises ImportError without the wheel.
    """
    version = importlib.metadata.version("megatron-bridge")
    spec = importlib.util.find_spec("megatron.bridge")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("megatron.bridge not found")
    path = Path(spec.submodule_search_locations[0]) / "training/utils/theoretical_memory_utils.py"
    config = types.ModuleType("megatron.bridge.training.config")
    config.ConfigContainer = object
    vocab = types.ModuleType("megatron.bridge.utils.vocab_utils")

    def calculate_padded_vocab_size(*args, **kwargs):
        raise RuntimeError("vocabulary padding needs transformer_engine: pass it padded")

    vocab.calculate_padded_vocab_size = calculate_padded_vocab_size
    stand_ins = {config.__name__: config, vocab.__name__: vocab}
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        module_spec = importlib.util.spec_from_file_location("_megatron_theoretical", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    finally:
        for name, before in saved.items():
            if before is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = before
    return module, f"megatron-bridge {version} ({path.name})"


def megatron_arguments(model: Model, layout: Configuration) -> types.SimpleNamespace:
    """The ConfigContainer fields the two functions read, as the bridge's recipe sets them."""
    import torch.nn.functional as F

    return types.SimpleNamespace(
        model=types.SimpleNamespace(
            num_layers=model.layers, hidden_size=model.hidden,
            num_attention_heads=model.heads, num_query_groups=model.kv_heads,
            kv_channels=model.head_dim, ffn_hidden_size=model.ffn,
            gated_linear_unit=model.swiglu, activation_func=F.silu if model.swiglu else F.gelu,
            num_moe_experts=None, share_embeddings_and_output_weights=model.tied,
            vocab_size=model.vocab, should_pad_vocab=False, make_vocab_size_divisible_by=128,
            tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp,
            context_parallel_size=layout.cp, sequence_parallel=layout.sp,
            seq_length=layout.seq_len,
            recompute_granularity=None if layout.recompute == "none" else layout.recompute,
        ),
        train=types.SimpleNamespace(
            micro_batch_size=layout.micro_batch, global_batch_size=layout.global_batch
        ),
        optimizer=types.SimpleNamespace(use_distributed_optimizer=layout.distributed_optimizer),
        data_parallel_size=layout.dp,
    )  # fmt: skip


def megatron_reference(model: Model, layout: Configuration) -> dict:
    """Bytes per GPU from Megatron's two functions (floats, as they return them)."""
    module, version = megatron_functions()
    args = megatron_arguments(model, layout)
    weights = module.compute_weight_and_optimizer_memory(args)
    activations = module.compute_activation_memory(args, num_microbatches=layout.micro_batches)
    return {"what": version, "weight_and_optimizer_bytes": weights,
            "activation_bytes": activations,
            "activation_without_sp_bytes_transcribed": megatron_lm_activation_without_sp(
                model, layout)}  # fmt: skip


# Megatron-LM's ``report_theoretical_memory`` uses the function above only with sequence
# parallelism and selective recompute; otherwise it calls ``compute_activation_memory_
# without_sp``, which no wheel ships (megatron-bridge 0.3.1 has no counterpart). Its
# formula, TRANSCRIBED (not called) from NVIDIA/Megatron-LM,
# megatron/training/theoretical_memory_usage.py at commit 00caa53af309 (2025):
MEGATRON_LM_SOURCE = (
    "NVIDIA/Megatron-LM megatron/training/theoretical_memory_usage.py @ 00caa53af309, "
    "compute_activation_memory_without_sp (transcribed)"
)


def megatron_lm_activation_without_sp(model: Model, layout: Configuration) -> float:
    """TRANSCRIBED from Megatron-LM (see MEGATRON_LM_SOURCE), not Megatron's code: per
    layer s·b·h·(10 + 24/t); the embedding's input (8·s·b·P) and dropout (s·b·h·P); the
    interleaving penalty or min(1, m/P); with P = 1 the logits and the final norm's output
    in 2 bytes; and 5 % on top."""
    s, b, h, t, p = layout.seq_len, layout.micro_batch, model.hidden, layout.tp, layout.pp
    total = s * b * h * (10 + 24 / t) * model.layers
    total += 8 * s * b * p + s * b * h * p
    if layout.vpp is not None:
        total *= 1 + (p - 1) / (p * layout.vpp)
    elif p > 1:
        total *= min(1, layout.micro_batches / p)
    if p == 1:
        total += (s * b * model.vocab / t + s * b * h) * 2
    return total * 1.05


# ---------------------------------------------------------------------------------------
# DeepSpeed


def deepspeed_reference(parameters: int, largest_layer: int, gpus: int) -> dict:
    """Model states per GPU from DeepSpeed's cold estimators, without offload.

    ``parameters``: the model (shard) each data-parallel replica holds; ``gpus``: the ranks
    ZeRO shards it over. DeepSpeed has no ZeRO-1 estimator.
    """
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        import deepspeed  # its import logs the accelerator it picks
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    _, zero2 = estimate_zero2_model_states_mem_needs(
        total_params=parameters, num_gpus_per_node=gpus, num_nodes=1, cpu_offload=False
    )
    _, zero3, _ = estimate_zero3_model_states_mem_needs(
        total_params=parameters, largest_layer_params=largest_layer, num_gpus_per_node=gpus,
        num_nodes=1, cpu_offload=False, cpu_offload_params=False, zero_init=True,
    )  # fmt: skip
    return {"what": f"deepspeed {deepspeed.__version__}", "zero1_bytes": None,
            "zero2_bytes": zero2, "zero3_bytes": zero3}  # fmt: skip


# ---------------------------------------------------------------------------------------
# attnctl


def attnctl_command(folder: Path, layout: Configuration, recompute: str) -> list[str]:
    command = [sys.executable, "-m", "attnctl", "memory", "--model", str(folder),
               "--tp", str(layout.tp), "--pp", str(layout.pp), "--cp", str(layout.cp),
               "--dp", str(layout.dp), "--zero", str(layout.zero), "--train",
               "--batch", str(layout.batch_per_dp_rank),
               "--micro-batch", str(layout.micro_batch), "--recompute", recompute,
               "--seq-len", str(layout.seq_len), "--json",
               # the runs use fused attention kernels: no B·H·L·L tensor saved; under CP
               # ring attention is the kernel (its online softmax saves none either)
               "--impl", "math" if layout.cp > 1 else "sdpa"]  # fmt: skip
    if layout.pp_blocks:
        command += ["--pp-blocks", layout.pp_blocks]
    return command + (["--sp"] if layout.sp else [])


def find_per_device(document: object) -> list | None:
    """The first ``per_device`` list anywhere in the document."""
    if isinstance(document, dict):
        if isinstance(document.get("per_device"), list):
            return document["per_device"]
        children = document.values()
    elif isinstance(document, list):
        children = document
    else:
        return None
    for child in children:
        found = find_per_device(child)
        if found is not None:
            return found
    return None


def attnctl_reference(folder: Path, layout: Configuration, recompute: str) -> dict:
    """attnctl's per-stage figures, or the reason there are none."""
    command = attnctl_command(folder, layout, recompute)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    except subprocess.TimeoutExpired:
        return {"na": "timed out after 300 s"}
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or [f"exit {done.returncode}"]
        return {"na": lines[-1][:160]}
    try:
        stages = find_per_device(json.loads(done.stdout))
    except json.JSONDecodeError:
        return {"na": "no JSON on stdout"}
    if not stages:
        return {"na": "no per_device in the JSON"}
    if isinstance(stages, dict):
        stages = [stages]
    return {"stages": stages}


# ---------------------------------------------------------------------------------------


@dataclass
class Row:
    configuration: Configuration
    parameters_per_stage: list[int]
    megatron: dict = field(default_factory=dict)
    deepspeed: dict = field(default_factory=dict)
    attnctl: dict = field(default_factory=dict)  # recompute as published
    attnctl_selective: dict = field(default_factory=dict)  # as Megatron assumes


def reference_rows(root: Path, names: set[str] | None, with_attnctl: bool = True) -> list[Row]:
    rows = []
    for layout in CONFIGURATIONS:
        if names and layout.name not in names:
            continue
        model = MODELS[layout.model]
        folder = write_folder(model, root)
        shards = shard_parameters(header_shapes(folder), layout.tp, layout.pp)
        row = Row(layout, [count for count, _ in shards])
        try:
            row.megatron = megatron_reference(model, layout)
        except ImportError as error:
            row.megatron = {"na": f"megatron-bridge not installed ({error})"}
        heaviest, largest = max(shards)
        try:  # ZeRO shards over every rank holding the same model shard: DP · CP
            row.deepspeed = deepspeed_reference(heaviest, largest, layout.dp * layout.cp)
        except ImportError as error:
            row.deepspeed = {"na": f"deepspeed not installed ({error})"}
        if not with_attnctl:
            row.attnctl = {"na": "not asked (--no-attnctl)"}
            rows.append(row)
            continue
        row.attnctl = attnctl_reference(folder, layout, layout.recompute)
        if layout.recompute != "selective":
            row.attnctl_selective = attnctl_reference(folder, layout, "selective")
        rows.append(row)
    return rows


def gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / GiB:9.2f}"


def attnctl_text(result: dict) -> str:
    if "na" in result:
        return f"attnctl: n/a ({result['na']})"
    parts = []
    for index, stage in enumerate(result["stages"]):
        states = sum(stage.get(k) or 0 for k in ("weights_bytes", "gradients_bytes",
                                                   "optimizer_bytes"))  # fmt: skip
        parts.append(f"stage {index}: states {gib(states).strip()} GiB, activations "
                     f"{gib(stage.get('activations_bytes')).strip()} GiB, peak "
                     f"{gib(stage.get('peak_bytes')).strip()} GiB")  # fmt: skip
    return "attnctl: " + "; ".join(parts)


def print_rows(rows: list[Row]) -> None:
    for row in rows:
        layout, megatron, deepspeed = row.configuration, row.megatron, row.deepspeed
        print(f"\n{layout.name}: {layout.gpus:,} GPUs = TP {layout.tp} · PP {layout.pp} · "
              f"CP {layout.cp} · DP {layout.dp}{' + SP' if layout.sp else ''}"
              f"{f' · VPP {layout.vpp}' if layout.vpp else ''}; seq {layout.seq_len:,}, "
              f"micro-batch {layout.micro_batch}, {layout.micro_batches} micro-batches per "
              f"step, recompute {layout.recompute}")  # fmt: skip
        print(f"  sources: {', '.join(f'{k}: {v}' for k, v in layout.sources.items())}")
        for assumption in layout.assumptions:
            print(f"  assumed: {assumption}")
        print(f"  parameters per rank, by stage: "
              f"{', '.join(f'{n:,}' for n in row.parameters_per_stage)}")  # fmt: skip
        if "na" in megatron:
            print(f"  Megatron: n/a ({megatron['na']})")
        else:
            print(
                f"  Megatron [{megatron['what']}] weights+optimizer "
                f"{gib(megatron['weight_and_optimizer_bytes'])} GiB, activations "
                f"{gib(megatron['activation_bytes'])} GiB (first stage; SP + selective "
                f"recompute assumed)"
            )
            print(f"  Megatron-LM without-SP activations [transcribed, not called] "
                  f"{gib(megatron['activation_without_sp_bytes_transcribed'])} GiB")  # fmt: skip
        if "na" in deepspeed:
            print(f"  DeepSpeed: n/a ({deepspeed['na']})")
        else:
            print(f"  DeepSpeed [{deepspeed['what']}] model states ZeRO-1 n/a, ZeRO-2 "
                  f"{gib(deepspeed['zero2_bytes'])} GiB, ZeRO-3 "
                  f"{gib(deepspeed['zero3_bytes'])} GiB")  # fmt: skip
        print(f"  {attnctl_text(row.attnctl)}  [recompute {layout.recompute}, "
              f"ZeRO {layout.zero}]")  # fmt: skip
        if row.attnctl_selective:
            print(f"  {attnctl_text(row.attnctl_selective)}  [recompute selective]")
    print("\nGiB = 2^30 bytes. The paper's GPUs hold 80 GB (74.5 GiB) of HBM each.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON document")
    parser.add_argument("--only", help="comma-separated configuration names")
    parser.add_argument("--models", type=Path, help="where the header-only folders go")
    parser.add_argument("--no-attnctl", action="store_true", help="the references only")
    args = parser.parse_args()
    names = set(args.only.split(",")) if args.only else None
    with tempfile.TemporaryDirectory(prefix="parallel-references-") as scratch:
        root = args.models or Path(scratch)
        rows = reference_rows(root, names, with_attnctl=not args.no_attnctl)
    if args.json:
        document = {
            "sources": SOURCES,
            "published_memory_notes": [list(n) for n in PUBLISHED_MEMORY_NOTES],
            "rows": [dict(asdict(row), configuration=asdict(row.configuration)) for row in rows],
        }
        print(json.dumps(document, indent=2))
        return 0
    print_rows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
