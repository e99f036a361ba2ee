"""The ``cuda`` key of ``run``, ``shapes`` and ``memory`` documents: what a CUDA plan
assumes (the GPU, the torch rules) and adds (its SDPA kernels, warnings, device lines)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from attnctl.render.text import fallback_texts

if TYPE_CHECKING:
    from attnctl.stages.plan import Plan


def cuda_dict(plan: Plan) -> dict[str, Any] | None:
    """A CUDA plan's GPU and torch rules, its SDPA kernels, fallback warnings and the
    lines CUDA allocates beside the stages' tensors (null on another device)."""
    target = plan.cuda
    if target is None:
        return None
    return {
        "gpu": target.gpu.name,
        "label": target.gpu.label,
        "capability": target.gpu.sm,
        "memory_bytes": target.gpu.total_bytes,
        "planned": target.named,
        "torch_rules": target.torch.name,
        "cudnn": target.torch.cudnn,
        "verified": target.verified,
        "assumptions": target.summary(),
        "sdpa": [
            {
                "kernel": c.kernel,
                "label": c.label,
                "dtype": plan.config.dtype,
                "reason": c.reason,
                "fallback": c.fallback,
            }
            for c in plan.sdpa_kernels
        ],
        "warnings": fallback_texts(plan),
        "device_lines": [line.to_dict() for line in plan.device_lines],
    }
