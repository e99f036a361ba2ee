"""A decoder's KV cache in torch: what one attention sublayer keeps between decoding steps.

``nn/attention.py`` appends each step's K and V heads (self-attention) or makes them once
(cross-attention) and keeps them here with :func:`keep`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    """One attention sublayer's keys and values as a decoder keeps them between steps.

    Self-attention appends each step's K and V heads and, with a sliding window, keeps
    the last ``window`` positions (those before fell out: ``start`` moves on);
    cross-attention projects the encoder output once, at the first step, and reuses it.
    """

    keys: torch.Tensor | None = None  # (B, Hkv, T, d_k), rotated as the scores used them
    values: torch.Tensor | None = None  # (B, Hkv, T, d_k)
    start: int = 0  # the position of keys[:, :, 0]

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def bytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))


def keep(past: KVCache, window: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Keep K and V (B, Hkv, T, d_k) for the next step; a sliding window keeps the last
    ``window`` positions, copied so that the ones dropped are freed."""
    if window and k.shape[2] > window:
        past.start += k.shape[2] - window
        k = k[:, :, -window:].clone(memory_format=torch.contiguous_format)  # (B, Hkv, W, d_k)
        v = v[:, :, -window:].clone(memory_format=torch.contiguous_format)
    past.keys, past.values = k, v
