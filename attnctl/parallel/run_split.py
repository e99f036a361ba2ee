"""``run --tp T [--sp]``: the same run over T ranks, each with its share of the heads, and
the ranks' traces put together as one device's; and the probe of what the backend
allocates inside a collective (``collective_buffers``)."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

from attnctl.errors import AttnctlError
from attnctl.model.config import LayerConfig
from attnctl.model.describe import ModelDescription
from attnctl.model.layout import Layout, rank_heads
from attnctl.parallel.distributed import _task
from attnctl.parallel.launch import (
    DEFAULT_TIMEOUT_SECONDS,
    run_ranks,
)
from attnctl.stages.plan import Plan


def head_ranks(heads: int, kv_heads: int, tp: int) -> list[tuple[range, range]]:
    """Each rank's (query heads, kv-heads)."""
    return [rank_heads(heads, kv_heads, tp, rank) for rank in range(tp)]


@dataclass
class SplitRun:
    """``run --tp T``: the traces as one device's run gives them (every shown head's
    weights gathered from the rank that holds it), the output, and how it was split."""

    traces: list[Any]  # runner's Trace: its stages are rank 0's (the collectives in them)
    output: Any  # torch.Tensor (B, L, D): the last block's output, every token
    layout: Layout
    plan: Plan  # rank 0's, whose stages the trace recorded
    heads: list[tuple[range, range]]  # per rank: its query heads and kv-heads
    timings: list[dict[str, float]]  # per rank: seconds to import, to join, to work


def run_task(
    config: LayerConfig,
    token_ids: list[list[int]],
    vocab_size: int,
    layout: Layout,
    model: ModelDescription | None,
    block: int,
    heads: list[int],
    rows: list[int],
    padding: list[list[bool]] | None,
) -> dict[str, Any]:
    """The JSON one rank is given to run blocks 0..``block`` over ``token_ids``."""
    return {
        **_task("run", config, model, vocab_size, layout),
        "token_ids": token_ids,
        "last": block,
        "heads": heads,
        "rows": rows,
        "padding": padding,
    }


def run_split(
    batch: Any,
    config: LayerConfig,
    model: ModelDescription | None,
    block: int,
    heads: list[int],
    rows: list[int],
    layout: Layout,
    padded: bool,
    timeout: float = DEFAULT_TIMEOUT_SECONDS,
) -> SplitRun:
    """Run the seeded layer or a model's blocks 0..``block`` over ``batch`` (a tokenized,
    padded batch) on ``layout.tp`` processes; ``config`` resolved as ``run`` resolves it,
    the split checked (:func:`check_split_run`) and the memory pre-flighted by the caller.
    """
    import torch

    from attnctl.nn.runner import shown_weights
    from attnctl.parallel.plan import _renamed, rank_plan
    from attnctl.trace import Stage, Trace

    padded_rows = batch.padded_rows()
    token_ids = [[t.id for t in row] for row in padded_rows]
    padding = None
    if padded:  # (B, L) True = a real key, as runner.padding_mask makes it
        padding = [[n < len(row) for n in range(batch.seq_len)] for row in batch.rows]
    vocab = batch.vocab_size if model is None else model.vocab_size
    task = run_task(config, token_ids, vocab, layout, model, block, heads, rows, padding)
    device = str(_device(config))
    replies = run_ranks(layout.tp, [task], device, timeout)
    results = [reply.results[0] for reply in replies]
    by_head = {}
    for result in results:
        weights = torch.tensor(result["weights"])  # (B, h, r, Lk)
        for index, head in enumerate(result["heads"]):
            by_head[head] = weights[:, index]
    window = torch.stack([by_head[h] for h in heads], dim=1)  # (B, heads, r, Lk)
    outputs = [torch.tensor(result["output"]) for result in results]
    output = torch.cat(outputs, dim=1) if layout.sp else outputs[0]  # (B, L, D)
    plan = rank_plan(config, batch.seq_len, len(padded_rows), vocab, layout, model, block)
    recorded = [Stage(**{**s, "dims": tuple(s["dims"]), "shape": tuple(s["shape"])})
                for s in results[0]["stages"]]  # fmt: skip
    full = model.config if model is not None else config
    stages = _renamed(dataclasses.replace(plan, stages=recorded), full, layout.tp).stages
    attention, top, sums = shown_weights(window, rows, [len(row) for row in batch.rows])
    trace = Trace(
        tokens=padded_rows,
        stages=stages,
        attention=attention,
        attention_heads=heads,
        attention_rows=rows,
        top_keys=top,
        device=device,
        tokenizer=batch.name,
        vocab_size=batch.vocab_size,
        impl=config.impl,
        layer=None if model is None else block,
        sums=sums,
    )
    attention_config = (model.with_run(config).blocks[block].attention.config if model
                        else config)  # fmt: skip
    return SplitRun(
        [trace], output, layout, plan,
        head_ranks(attention_config.heads, attention_config.kv_heads, layout.tp),
        [reply.timings for reply in replies],
    )  # fmt: skip


def _device(config: LayerConfig) -> Any:
    from attnctl.nn.layer import resolve_device

    return resolve_device(config.device)


def collective_buffers(tp: int, mebibytes: int, timeout: float = DEFAULT_TIMEOUT_SECONDS):
    """What gloo allocates inside each collective, measured on ``tp`` ranks over a float32
    (B, L, D) of ``mebibytes`` (Linux only: it reads and resets VmHWM): per rank
    ``{"bytes": the (B, L, D)'s, "buffers": {collective: bytes}}``."""
    if not sys.platform.startswith("linux"):
        raise AttnctlError("measuring gloo's buffers reads /proc/self/status: Linux only")
    task = {"kind": "buffers", "sp": True, "mebibytes": mebibytes}
    replies = run_ranks(tp, [task], "cpu", timeout)
    return [reply.results[0] for reply in replies]
