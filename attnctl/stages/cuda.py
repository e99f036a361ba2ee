"""What a forward pass allocates on CUDA beyond its stages' tensors, as lines of the plan.

A plan's stages are the tensors the model's code makes; on CUDA torch allocates more,
each here a :class:`DeviceLine` with a name a user understands and the stages it is
alive over (``model/gpu.py`` holds the rules by GPU and torch version):

- ``cublas_workspace``: cuBLAS's workspace, from the first matrix product on, kept by
  the process (one per handle; a backward on autograd's thread takes another);
- ``cublaslt_workspace``: cuBLASLt's, from the first projection with a bias on;
- ``norm_statistics``: LayerNorm's mean and 1/σ (RMSNorm's 1/rms), float32 per row;
- ``bmm_copies``: the math path's Q, Kᵀ and V heads copied to be one batched product
  when B and H do not fold into one batch dimension of a view (B > 1);
- ``sdpa_buffers``: what the SDPA kernel torch picks keeps beside its output (cuDNN),
  the float copy of a boolean mask, and the matrices of a fallback to the math kernel.

The caching allocator rounds every block up to 512 bytes; ``memory.estimate`` rounds
each stage's tensor, and scratch is summed from rounded pieces (``PlanBuilder.pieces``).
The torch twin is the CUDA allocator itself: ``memory --measure --device cuda`` checks
each line against ``torch.cuda.max_memory_allocated``, stage by stage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from attnctl.model.config import DTYPE_BYTES, LayerConfig
from attnctl.model.gpu import CudaTarget, SdpaChoice, rounded, sdpa_choice
from attnctl.trace import Stage

MATRIX_PRODUCTS = ("q", "k", "v", "scores", "weighted_values", "output_projection",
                   "ffn_gate", "ffn_up", "ffn_down")  # fmt: skip
PROJECTIONS = ("q", "k", "v")
NORMS = ("norm", "post_norm", "ffn_norm", "ffn_post_norm", "embedding_norm", "q_norm",
         "k_norm")  # fmt: skip
SCOPES = ("cross_",)


@dataclass(frozen=True)
class DeviceLine:
    """Bytes a device allocates that no stage's tensor holds: alive from stage ``first``
    to stage ``last`` (None: kept by the process past the plan's end)."""

    name: str
    what: str
    bytes: int
    first: str
    last: str | None = None
    fallback: bool = False  # the matrices of a fallback to the math kernel

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def fallbacks(
    lines: tuple[DeviceLine, ...], kernels: tuple[SdpaChoice, ...]
) -> list[tuple[SdpaChoice, int]]:
    """Each SDPA call that falls back to the math kernel, with the bytes it costs."""
    costs = [line.bytes for line in lines if line.fallback]
    fallen = [choice for choice in kernels if choice.fallback]
    return list(zip(fallen, costs, strict=True))


def _base(name: str) -> str:
    for scope in SCOPES:
        if name.startswith(scope):
            return name.removeprefix(scope)
    return name


def cuda_lines(
    stages: list[Stage],
    sizes: dict[str, int],
    config: LayerConfig,
    target: CudaTarget,
    workspaces: bool = True,
) -> tuple[list[Stage], list[DeviceLine], list[SdpaChoice]]:
    """The stages as CUDA makes them (a fallback's output is a copy at ``concat``), the
    lines CUDA adds to them, and the SDPA kernel of each fused call. ``workspaces``:
    the process has not made cuBLAS's and cuBLASLt's yet (an encoder–decoder's decoder
    runs after its encoder, which made them)."""
    lines: list[DeviceLine] = []
    names = [s.name for s in stages]
    if workspaces:
        lines += _workspaces(stages, config, target)
    lines += _norm_statistics(stages)
    lines += _bmm_copies(stages, sizes)
    choices: list[SdpaChoice] = []
    stages = list(stages)
    for index, stage in enumerate(stages):
        if _base(stage.name) != "weighted_values" or "F.scaled_dot" not in stage.what:
            continue
        choice, extra = _sdpa(stage, stages, sizes, config, target)
        choices.append(choice)
        lines += extra
        if choice.fallback:  # the math kernel's (B, H, L, d_k) output: concat copies it
            concat = names.index(stage.name.replace("weighted_values", "concat"), index)
            stages[concat] = dataclasses.replace(stages[concat], view_of=None)
    return stages, lines, choices


def _workspaces(stages: list[Stage], config: LayerConfig, target: CudaTarget) -> list[DeviceLine]:
    first = next((s.name for s in stages if _base(s.name) in MATRIX_PRODUCTS), None)
    if first is None:
        return []
    lines = [DeviceLine(
        "cublas_workspace",
        f"cuBLAS's workspace ({target.gpu.sm}), from the first matrix product on",
        target.cublas_workspace_bytes(), first,
    )]  # fmt: skip
    biased = next((s.name for s in stages if _base(s.name) in PROJECTIONS), None)
    if config.bias and biased is not None:
        lines.append(DeviceLine(
            "cublaslt_workspace",
            "cuBLASLt's workspace, from the first projection with a bias on",
            target.cublaslt_workspace_bytes(), biased,
        ))  # fmt: skip
    return lines


def _norm_statistics(stages: list[Stage]) -> list[DeviceLine]:
    lines = []
    for stage in stages:
        if _base(stage.name) not in NORMS or not stage.what:
            continue
        rows = 1
        for n in stage.shape[:-1]:
            rows *= n
        if stage.what.startswith("LayerNorm"):
            what, nbytes = "LayerNorm's mean and 1/σ, float32 per row", 2 * rounded(4 * rows)
        elif stage.what.startswith("RMSNorm"):
            what, nbytes = "RMSNorm's 1/rms, float32 per row", rounded(4 * rows)
        else:
            continue
        lines.append(DeviceLine("norm_statistics", what, nbytes, stage.name, stage.name))
    return lines


def _folds(stage: Stage, sizes: dict[str, int]) -> bool:
    """Whether a (B, H, L, d_k) stage's B and H fold into one batch of a view: it owns
    its memory in that order, or a size-1 dim makes the order not matter."""
    return stage.view_of is None or sizes["B"] == 1 or stage.shape[1] == 1 or stage.shape[2] == 1


def _bmm_copies(stages: list[Stage], sizes: dict[str, int]) -> list[DeviceLine]:
    by_name = {s.name: s for s in stages}
    lines = []
    for stage in stages:
        base = _base(stage.name)
        if base == "scores" or (base == "weighted_values" and "F.scaled_dot" not in stage.what):
            heads = [by_name[r] for r in stage.reads if r in by_name and len(by_name[r].dims) == 4
                     and by_name[r].dims[-1] == "d_k"]  # fmt: skip
            copied = [h for h in heads if not _folds(h, sizes)]
            if copied:
                names = " and ".join(_base(h.name).removesuffix("_heads") for h in copied)
                nbytes = sum(rounded(h.bytes) for h in copied)
                what = f"{names} heads copied for one batched product (B·H not one view batch)"
                lines.append(DeviceLine("bmm_copies", what, nbytes, stage.name, stage.name))
    return lines


def _sdpa(
    stage: Stage,
    stages: list[Stage],
    sizes: dict[str, int],
    config: LayerConfig,
    target: CudaTarget,
) -> tuple[SdpaChoice, list[DeviceLine]]:
    """The kernel of one SDPA stage and what it allocates beside its output."""
    by_name = {s.name: s for s in stages}
    mask = next((by_name[r] for r in stage.reads if _base(r) in ("mask", "padding_mask")), None)
    padded = any(_base(s.name) == "padding_mask" for s in stages)
    masked = mask is not None or padded or config.pos == "alibi"
    grouped = config.kv_heads != config.heads
    choice = sdpa_choice(target, config.dtype, config.d_k, grouped, masked, config.dropout)
    element = DTYPE_BYTES[config.dtype]
    batch, heads, length = sizes["B"], config.heads, stage.shape[2]
    crossed = "Lc" in sizes and (config.cross or stage.name.startswith("cross_"))
    keys = sizes["Lc"] if crossed else sizes["L"]
    lines: list[DeviceLine] = []
    name = stage.name
    if config.pos != "alibi" and (mask is not None or padded):
        # a boolean attn_mask becomes a float one of the dtype: (L, Lk) for a window,
        # (B, 1, 1, Lk) for padding, (B, 1, L, Lk) for both
        rows = (length if mask is not None else 1) * (batch if padded else 1)
        lines.append(DeviceLine("sdpa_buffers", f"the boolean mask made a {config.dtype} one",
                                rounded(rows * keys * element), name, name))  # fmt: skip
    if choice.kernel == "cudnn":
        lines.append(DeviceLine("sdpa_buffers", "cuDNN's statistics and workspace", 3 * 512,
                                name, name))  # fmt: skip
    elif choice.fallback:
        matrix = rounded(batch * heads * length * keys * element)
        kv = rounded(batch * heads * keys * config.d_k * element) if grouped else 0
        causal = config.mask == "causal" and mask is None
        nbytes = (
            2 * matrix  # the scores and their softmax
            + rounded(batch * heads * length * keys)  # _safe_softmax: scores == -inf
            + rounded(batch * heads * length)  # the rows that are all -inf
            + 512  # a scalar
            + 2 * kv  # K and V repeated to every query head (enable_gqa)
            + (rounded(length * keys * element) if causal else 0)  # is_causal as a mask
        )
        lines.append(DeviceLine("sdpa_buffers", "the math kernel's B·H·L·Lk matrices (a fallback)",
                                nbytes, name, name, fallback=True))  # fmt: skip
    return choice, lines
