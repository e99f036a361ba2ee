"""Memory arithmetic over a plan: parameters, activations, attention matrices, peak.

The peak follows liveness: a tensor's memory is held from the stage that creates it
until the last stage that reads it (or a view of it) has been computed. Views
(split heads) add no bytes. Standard library only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from attnctl.config import DTYPE_BYTES, DTYPES
from attnctl.plan import Plan, build_plan


@dataclass(frozen=True)
class MemoryEstimate:
    parameters: int
    parameter_bytes: int
    activation_bytes: int  # every stage that allocates, summed (nothing freed)
    attention_matrix_bytes: int  # one B·H·L·L matrix in the layer's dtype
    scores_bytes: int  # 0 when the implementation never builds them (sdpa)
    weights_bytes: int
    live_bytes: tuple[int, ...]  # per stage: activation bytes alive while it is computed
    peak_activation_bytes: int
    peak_stage: str

    @property
    def peak_bytes(self) -> int:
        """Parameters plus the most activation memory alive at any one moment."""
        return self.parameter_bytes + self.peak_activation_bytes


def _storage_of(plan: Plan) -> dict[str, str]:
    """Map each stage to the stage that owns its memory (itself unless it is a view)."""
    owner: dict[str, str] = {}
    for stage in plan.stages:
        owner[stage.name] = owner[stage.view_of] if stage.view_of else stage.name
    return owner


def live_bytes_per_stage(plan: Plan) -> list[int]:
    owner = _storage_of(plan)
    index = {s.name: i for i, s in enumerate(plan.stages)}
    last = len(plan.stages) - 1
    last_use = {s.name: index[s.name] for s in plan.stages if s.allocates}
    for i, stage in enumerate(plan.stages):
        for read in stage.reads:
            last_use[owner[read]] = max(last_use[owner[read]], i)
    # the caller holds the input ids; the layer returns its output and the attention output
    for held in ("token_ids", "output_projection", plan.stages[-1].name):
        last_use[held] = last
    nbytes = {s.name: s.bytes for s in plan.stages}
    return [
        stage.scratch
        + sum(nbytes[name] for name, end in last_use.items() if index[name] <= i <= end)
        for i, stage in enumerate(plan.stages)
    ]


def estimate(plan: Plan) -> MemoryEstimate:
    by_name = {s.name: s for s in plan.stages}
    sizes = plan.sizes
    matrix_elems = sizes["B"] * sizes["H"] * sizes["L"] * sizes["L"]
    live = live_bytes_per_stage(plan)
    peak = max(live)
    return MemoryEstimate(
        parameters=plan.parameter_count,
        parameter_bytes=plan.parameter_bytes,
        activation_bytes=sum(s.bytes for s in plan.stages if s.allocates),
        attention_matrix_bytes=matrix_elems * DTYPE_BYTES[plan.config.dtype],
        scores_bytes=by_name["scores"].bytes if "scores" in by_name else 0,
        weights_bytes=by_name["weights"].bytes if "weights" in by_name else 0,
        live_bytes=tuple(live),
        peak_activation_bytes=peak,
        peak_stage=plan.stages[live.index(peak)].name,
    )


def kv_cache_bytes(plan: Plan, tokens: int | None = None) -> int:
    """K and V for ``tokens`` positions (default: the plan's length), every head, every row.

    2 · B · tokens · H · d_k elements in the layer's dtype: what a decoder keeps so it does
    not recompute the keys and values of earlier tokens.
    """
    count = plan.seq_len if tokens is None else tokens
    sizes = plan.sizes
    return 2 * sizes["B"] * count * sizes["H"] * sizes["d_k"] * DTYPE_BYTES[plan.config.dtype]


def dtype_table(plan: Plan) -> list[tuple[str, MemoryEstimate]]:
    """The same plan's estimate in every supported dtype."""
    rows = []
    for dtype in DTYPES:
        config = dataclasses.replace(plan.config, dtype=dtype)
        other = build_plan(config, plan.seq_len, plan.batch, plan.vocab_size)
        rows.append((dtype, estimate(other)))
    return rows


def format_bytes(n: int) -> str:
    """1024-based sizes: 512 B, 1.50 KiB, 10.04 MiB, 2.00 GiB."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{value:.2f} {unit}"
    raise AssertionError("unreachable")
