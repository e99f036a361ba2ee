"""Positions in torch: sinusoidal tables, RoPE's angles and rotation, ALiBi's bias, masks.

``attnctl/nn/attention.py`` and ``nn/embeddings.py`` call these through this module
(``positions.rotate``), so a test can swap one for a broken twin and watch ``check``
catch it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attnctl.model import rope
from attnctl.model.config import LayerConfig


def sinusoidal_positions(
    seq_len: int,
    d_model: int,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
    offset: int = 0,
) -> torch.Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/D)), PE[pos, 2i+1] = cos(pos / 10000^(2i/D)); (L, D),
    for positions offset … offset + L - 1."""
    position = torch.arange(offset, offset + seq_len, device=device, dtype=torch.float32).unsqueeze(
        1
    )  # (L, 1)
    frequency = torch.exp(
        torch.arange(0, d_model, 2, device=device, dtype=torch.float32)
        * (-math.log(10000.0) / d_model)
    )  # (ceil(D/2),)
    angles = position * frequency  # (L, ceil(D/2))
    table = torch.empty(seq_len, d_model, device=device, dtype=dtype or torch.float32)  # (L, D)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : d_model // 2])
    return table


def sinusoidal_halves(
    positions: torch.Tensor, d_model: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Marian's table: sin(pos / 10000^(2i/D)) in columns i < D/2, cos in i + D/2 (of the
    ceil(D/2) frequencies, cos fills what is left); positions (L,) int64 -> (L, D).

    transformers builds the whole table in float64 numpy, then stores it as float32: so
    here, on the CPU (each float64 sin and cos rounded into a float32 table), then moved
    to the positions' device in the run's dtype. What it holds is what ``plan.py`` counts.
    """
    half = (d_model + 1) // 2  # sin columns
    exponents = torch.arange(0, d_model, 2, dtype=torch.float64) / d_model  # 2i/D, (⌈D/2⌉,)
    frequencies = torch.pow(10000.0, exponents)  # (⌈D/2⌉,) float64
    del exponents
    angles = positions.cpu().to(torch.float64).unsqueeze(1) / frequencies  # (L, ⌈D/2⌉)
    del frequencies
    table = torch.empty(angles.shape[0], d_model, dtype=torch.float32)  # (L, D)
    table[:, :half] = angles.sin()
    table[:, half:] = angles.cos()[:, : d_model - half]
    del angles
    return table.to(device=positions.device, dtype=dtype or torch.float32)


def relative_buckets(
    relative: torch.Tensor, bidirectional: bool, buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's bucket of each key-minus-query distance (any shape, int64) -> same shape, int64.

    Bidirectional (the encoder): half the buckets for keys after the query. Then small
    distances (below half the buckets left) each get their own bucket, larger ones share
    buckets on a log scale up to ``max_distance``, and farther ones the last bucket.
    """
    bucket = torch.zeros_like(relative)
    if bidirectional:
        buckets //= 2
        bucket += (relative > 0).long() * buckets
        distance = relative.abs()
    else:  # causal: a key after the query is never seen; its distance counts as 0
        distance = -torch.clamp(relative, max=0)
    exact = buckets // 2
    small = distance < exact
    logarithmic = (
        exact
        + (
            torch.log(distance.float() / exact) / math.log(max_distance / exact) * (buckets - exact)
        ).long()
    )
    logarithmic = torch.clamp(logarithmic, max=buckets - 1)
    return bucket + torch.where(small, distance, logarithmic)


def relative_bias(
    table: torch.Tensor,
    query_start: int,
    queries: int,
    key_start: int,
    keys: int,
    bidirectional: bool,
    max_distance: int,
) -> torch.Tensor:
    """T5's position bias from its (buckets, H) table: (H, Lq, Lk), in the table's dtype,
    for queries at positions query_start… and keys at key_start….

    The bias depends on key - query alone, so each of the Lq + Lk - 1 distances is bucketed
    and looked up once (small vectors), and the (H, Lq, Lk) matrix is one copy of a
    strided view of them: no (Lq, Lk) table of distances or buckets is ever made.
    """
    nearest = key_start - (query_start + queries - 1)  # the smallest key - query
    distances = torch.arange(nearest, nearest + queries + keys - 1, device=table.device)
    bucket = relative_buckets(distances, bidirectional, table.shape[0], max_distance)
    del distances
    by_distance = F.embedding(bucket, table).t().flip(-1)  # (H, Lq + Lk - 1), farthest first
    del bucket
    # row i, column t of the unfolded view is distance (Lk - 1 - t) - i + ... : flipped on
    # the last dim it is key j - query i
    return by_distance.unfold(-1, keys, 1).flip(-1)  # (H, Lq, Lk)


def rotary_angles(
    seq_len: int,
    d_k: int,
    device: torch.device | None = None,
    config: LayerConfig | None = None,
    start: int = 0,
    stop: int | None = None,
) -> torch.Tensor:
    """RoPE angles pos·θ_i, θ_i = theta^(-2i/d_k), laid out for half-rotation: (L, d_k),
    for positions ``start`` … ``stop`` - 1 (default: all ``seq_len``) of a sequence of
    ``seq_len`` tokens (a decoding step's new tokens; a context-parallel rank's chunk).

    ``config`` gives the base (rope_theta) and any long-context scaling (rope_type):
    linear and llama3 here, dynamic, yarn and longrope from ``attnctl.model.rope`` (which depend
    on the length: dynamic and longrope change past the original one).
    """
    theta = config.rope_theta if config is not None else 10000.0
    if config is not None and config.rope_type in ("dynamic", "yarn", "longrope"):
        frequencies = rope.inverse_frequencies(config.rope, d_k, seq_len)  # float64
        inv_freq = torch.tensor(frequencies, device=device, dtype=torch.float32)  # (d_k/2,)
    else:
        inv_freq = torch.pow(
            theta, torch.arange(0, d_k, 2, device=device, dtype=torch.float32).div_(-d_k)
        )  # (d_k/2,)
    if config is not None and config.rope_type in ("linear", "llama3"):
        scaled = [scaled_frequency(f, config) for f in inv_freq.tolist()]
        inv_freq = torch.tensor(scaled, device=device, dtype=torch.float32)  # (d_k/2,)
    stop = seq_len if stop is None else stop
    position = torch.arange(start, stop, device=device, dtype=torch.float32)  # (L,)
    angles = torch.outer(position, inv_freq)  # (L, d_k/2)
    return torch.cat((angles, angles), dim=-1)  # (L, d_k): dims i and i + d_k/2 share θ_i


def scaled_frequency(frequency: float, config: LayerConfig) -> float:
    """One RoPE frequency under "linear" or "llama3" scaling (as Hugging Face defines them)."""
    factor = config.rope_factor
    if config.rope_type == "linear":
        return frequency / factor
    original = config.rope_original_max_positions
    low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
    wavelength = 2 * math.pi / frequency
    if wavelength < original / high:  # fast: kept
        return frequency
    if wavelength > original / low:  # slow: stretched by the factor
        return frequency / factor
    smooth = (original / wavelength - low) / (high - low)  # in between: blended
    return (1 - smooth) * frequency / factor + smooth * frequency


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin: each pair (i, i + d_k/2) turns by its angle (RoPE)."""
    half = x.shape[-1] // 2
    rotated = x * cos  # (B, heads, L, d_k)
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # rotate_half(x)
    rotated += turned * sin
    return rotated


def alibi_slopes(heads: int, device: torch.device | None = None) -> torch.Tensor:
    """ALiBi's slope per head, m_h = 2^(-8(h+1)/H): (H,), float32."""
    exponents = torch.arange(1, heads + 1, device=device, dtype=torch.float32).mul_(-8.0 / heads)
    return torch.pow(2.0, exponents)  # (H,)


def alibi_bias(
    heads: int, seq_len: int, device: torch.device | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """ALiBi: bias[h, i, j] = -m_h·|i - j|, slopes m_h = 2^(-8(h+1)/H): (H, L, L)."""
    # the slopes inline, as alibi_slopes computes them: the exponents stay alive with the
    # |i - j| table, the float32 scratch plan.py counts
    exponents = torch.arange(1, heads + 1, device=device, dtype=torch.float32).mul_(-8.0 / heads)
    slopes = torch.pow(2.0, exponents)  # (H,)
    position = torch.arange(seq_len, device=device, dtype=torch.float32)  # (L,)
    distance = (position.unsqueeze(0) - position.unsqueeze(1)).abs_()  # (L, L): |i - j|
    bias = distance * slopes.neg_().view(heads, 1, 1)  # (H, L, L), float32
    return bias.to(dtype or torch.float32)


def causal_mask(seq_len: int, device: torch.device | None = None) -> torch.Tensor:
    """(L, L) bool, True = may attend (SDPA's convention): each query sees itself and earlier keys.

    ``nn.MultiheadAttention`` wants the opposite (True = blocked): pass ``~causal_mask(L)``.
    """
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril_()


def visible_keys(seq_len: int, window: int, device: torch.device | None = None) -> torch.Tensor:
    """The causal mask, or with ``window`` > 0 a sliding window: (L, L) bool, True = may attend.

    Query i sees keys i - window < j <= i, itself and the window - 1 before it (as
    transformers' ``sliding_window_causal_mask_function``), in place on the causal mask.
    """
    allowed = causal_mask(seq_len, device)  # (L, L)
    if window:
        allowed.triu_(1 - window)  # and j >= i - window + 1
    return allowed


def visible(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window: int = 0
) -> torch.Tensor:
    """(Lq, Lk) bool, True = may attend, for queries and keys at these absolute positions:
    a key at or before the query, and with ``window`` within it (p - window < j <= p).
    What ``visible_keys`` is when both are 0 … L-1; a decoding step's queries are later."""
    allowed = key_positions.unsqueeze(0) <= query_positions.unsqueeze(1)  # (Lq, Lk)
    if window:
        allowed &= key_positions.unsqueeze(0) > query_positions.unsqueeze(1) - window
    return allowed
