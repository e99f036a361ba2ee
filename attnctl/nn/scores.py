"""What is done to the scores Q·Kᵀ before the softmax, shared by every attention path
(``attention``, ``ring_attention``): the scale, and Gemma 2's soft cap."""

from __future__ import annotations

import math

import torch

from attnctl.model.config import LayerConfig


def scale_scores(config: LayerConfig, scores: torch.Tensor) -> torch.Tensor:
    """Q·Kᵀ times query_scale, else divided by √d_k (in place)."""
    if config.query_scale:
        return scores.mul_(config.query_scale)
    return scores.div_(math.sqrt(config.d_k))


def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """cap·tanh(scores/cap): every score within (-cap, cap) (Gemma 2).

    In place, as the plan says, unless autograd records it (gradcheck, a training step):
    tanh's backward needs its output, which an in-place multiply would overwrite.
    """
    if scores.requires_grad and torch.is_grad_enabled():
        return torch.tanh(scores / cap) * cap
    return scores.div_(cap).tanh_().mul_(cap)
