"""One embedding + multi-head attention layer in torch, recording every stage as it runs.

The forward pass is the textbook one (seed 000's ``MultiHeadAttention``, seed 003's
residual + LayerNorm), written so that each tensor is released right after its last
use: what it holds at any moment is what ``memory.py`` predicts from the plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from attnctl.config import LayerConfig, resolve_impl
from attnctl.errors import AttnctlError
from attnctl.trace import Stage

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Recorder:
    """Collects a :class:`Stage` per recorded tensor, without keeping the tensor alive.

    A tensor that shares the memory of an earlier recorded one still alive (the split
    heads) is marked ``view_of`` that stage: it costs no new bytes. Storages are held by
    weak reference, so a freed block that the allocator hands out again is no "view".
    """

    def __init__(self) -> None:
        self.stages: list[Stage] = []
        self._storages: list[tuple[str, StorageWeakRef]] = []

    def __call__(self, name: str, tensor: torch.Tensor, dims: str) -> None:
        storage = StorageWeakRef(tensor.untyped_storage())
        view_of = next(
            (n for n, ref in self._storages if not ref.expired() and ref.cdata == storage.cdata),
            None,
        )
        self.stages.append(
            Stage(
                name=name,
                dims=tuple(dims.split()),
                shape=tuple(tensor.shape),
                dtype=dtype_name(tensor.dtype),
                bytes=tensor.numel() * tensor.element_size(),
                device=str(tensor.device),
                view_of=view_of,
            )
        )
        if view_of is None:
            self._storages.append((name, storage))


def _no_record(name: str, tensor: torch.Tensor, dims: str) -> None:
    pass


def sinusoidal_positions(
    seq_len: int, d_model: int, device: torch.device | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/D)), PE[pos, 2i+1] = cos(pos / 10000^(2i/D)); (L, D)."""
    position = torch.arange(seq_len, device=device, dtype=torch.float32).unsqueeze(1)  # (L, 1)
    frequency = torch.exp(
        torch.arange(0, d_model, 2, device=device, dtype=torch.float32)
        * (-math.log(10000.0) / d_model)
    )  # (ceil(D/2),)
    angles = position * frequency  # (L, ceil(D/2))
    table = torch.empty(seq_len, d_model, device=device, dtype=dtype or torch.float32)  # (L, D)
    table[:, 0::2] = torch.sin(angles)
    table[:, 1::2] = torch.cos(angles[:, : d_model // 2])
    return table


def rotary_angles(
    seq_len: int, d_k: int, device: torch.device | None = None, config: LayerConfig | None = None
) -> torch.Tensor:
    """RoPE angles pos·θ_i, θ_i = theta^(-2i/d_k), laid out for half-rotation: (L, d_k).

    ``config`` gives the base (rope_theta) and any long-context scaling (rope_type).
    """
    theta = config.rope_theta if config is not None else 10000.0
    inv_freq = torch.pow(
        theta, torch.arange(0, d_k, 2, device=device, dtype=torch.float32).div_(-d_k)
    )  # (d_k/2,)
    if config is not None and config.rope_type != "default":
        scaled = [scaled_frequency(f, config) for f in inv_freq.tolist()]
        inv_freq = torch.tensor(scaled, device=device, dtype=torch.float32)  # (d_k/2,)
    position = torch.arange(seq_len, device=device, dtype=torch.float32)  # (L,)
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


@dataclass
class LayerOutput:
    output: torch.Tensor  # (B, L, D): after residual + norm when norm == "post"
    attention_output: torch.Tensor  # (B, L, D): W_o(concat), before any residual (kept: returned)
    weights: torch.Tensor | None  # (B, H, L, L) for impl "math" with keep_weights; else None
    window: torch.Tensor | None = None  # (B, h, r, Lk): sdpa's shown weights, when asked for


class AttentionLayer(nn.Module):
    """Embedding, positions, multi-head attention with explicit W_q, W_k, W_v, W_o, norm.

    Parameters are created in the tutorial's order (embedding, then W_q, W_k, W_v, W_o)
    so that ``torch.manual_seed(seed)`` before construction reproduces seed 000.
    """

    def __init__(self, config: LayerConfig, vocab_size: int) -> None:
        super().__init__()
        self.config = config = resolve_impl(config)  # a layer on its own builds every weight
        d_model = config.d_model
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.W_q = nn.Linear(d_model, d_model, bias=config.bias)
        kv_width = config.kv_heads * config.d_k  # narrower than d_model under GQA
        self.W_k = nn.Linear(d_model, kv_width, bias=config.bias)
        self.W_v = nn.Linear(d_model, kv_width, bias=config.bias)
        self.W_o = nn.Linear(d_model, d_model, bias=config.bias and config.output_bias)
        if config.pos == "learned":  # created after W_o so earlier weights keep their values
            self.positions = nn.Embedding(config.max_positions, d_model)
        self.norm = None
        if config.norm != "none":
            self.norm = (
                nn.LayerNorm(d_model, eps=config.norm_eps)
                if config.norm_type == "layer"
                else nn.RMSNorm(d_model, eps=config.norm_eps)
            )

    def embed(
        self,
        x: torch.Tensor,
        record: Callable = _no_record,
        prefix: str = "",
        length: str = "L",
        name: str | None = "embeddings",
    ) -> torch.Tensor:
        """Embeddings (B, len, D), plus positions when they are added to the embeddings.

        ``name``: the stage x is recorded as (None: not recorded, e.g. a model's layer 0,
        whose input is the embedding stage the model recorded already).
        """
        config = self.config
        if name is not None:
            record(f"{prefix}{name}", x, f"B {length} D")
        if config.pos in ("sinusoidal", "learned"):
            n = x.shape[1]
            if config.pos == "sinusoidal":
                positions = sinusoidal_positions(n, config.d_model, x.device, x.dtype)  # (len, D)
            else:
                positions = self.positions(torch.arange(n, device=x.device))  # (len, D)
            record(f"{prefix}positions", positions, f"{length} D")
            x = x + positions  # (B, len, D), positions broadcast over the batch
            del positions
            record(f"{prefix}x", x, f"B {length} D")
        return x

    def forward(
        self,
        token_ids: torch.Tensor | None,
        record: Callable[[str, torch.Tensor, str], None] = _no_record,
        keep_weights: bool = True,
        embeddings: torch.Tensor | None = None,
        padding: torch.Tensor | None = None,
        context_ids: torch.Tensor | None = None,
        input_name: str | None = "embeddings",
        window: tuple[list[int], list[int]] | None = None,
    ) -> LayerOutput:
        """Run the layer on token ids, or on ``embeddings`` (B, L, D) given instead of them.

        ``input_name``: what given embeddings are recorded as ("hidden" for a model's block
        input; None records nothing).
        ``padding`` (B, Lk) bool, True = a real key (SDPA's convention), gives padded keys
        weight exactly 0; ``nn.MultiheadAttention``'s key_padding_mask is its negation.
        ``context_ids`` (B, Lc) make it cross-attention: keys and values come from that text.
        ``window`` (heads, rows): on the SDPA path, also the softmax weights of those heads
        and query rows, from the Q and K heads at hand (``LayerOutput.window``).
        """
        config = self.config
        heads, d_k, d_model = config.heads, config.d_k, config.d_model
        cross = context_ids is not None
        key_len_dim = "Lc" if cross else "L"

        # 1. tokens -> vectors (+ positions), for the text and for a context
        if embeddings is None:
            record("token_ids", token_ids, "B L")
            if cross:
                record("context_ids", context_ids, "B Lc")
            if padding is not None:
                record("padding_mask", padding, f"B {key_len_dim}")
            x = self.embed(self.embedding(token_ids), record, "", "L")  # (B, L, D)
        else:  # (B, L, D): a model's hidden state, or float64 inputs for gradcheck
            x = self.embed(embeddings, record, "", "L", input_name)
        context = None
        if cross:
            context = self.embed(self.embedding(context_ids), record, "context_", "Lc")
        batch, seq_len = x.shape[:2]
        key_len = context.shape[1] if cross else seq_len

        # 2. project (from Norm(x) in a pre-norm layer), then split D into heads: views
        h = x
        if config.norm == "pre":
            h = self.norm(x)  # (B, L, D)
            record("norm", h, "B L D")
        q = self.W_q(h)  # (B, L, D)
        record("q", q, "B L D")
        kv_heads, grouped = config.kv_heads, config.kv_heads != heads
        kv_width = "D_kv" if grouped else "D"
        kv_dims = f"B {key_len_dim} {kv_width}"
        kv_split = f"B {'Hkv' if grouped else 'H'} {key_len_dim} d_k"
        if cross:  # keys and values from the context (an encoder's output, in a decoder)
            h = context
            del context
            if self.norm is None:
                del x  # no residual, and K and V come from the context: x is done
        k = self.W_k(h)  # (B, Lk, Hkv * d_k)
        record("k", k, kv_dims)
        v = self.W_v(h)  # (B, Lk, Hkv * d_k)
        del h
        if self.norm is None and not cross:
            del x  # no residual: x is not needed again
        record("v", v, kv_dims)
        q = q.view(batch, seq_len, heads, d_k).transpose(1, 2)  # (B, H, L, d_k)
        record("q_heads", q, "B H L d_k")
        k = k.view(batch, key_len, kv_heads, d_k).transpose(1, 2)  # (B, Hkv, Lk, d_k)
        record("k_heads", k, kv_split)
        v = v.view(batch, key_len, kv_heads, d_k).transpose(1, 2)  # (B, Hkv, Lk, d_k)
        record("v_heads", v, kv_split)
        if config.pos == "rope":  # rotate Q and K by their positions; V is left alone
            angles = rotary_angles(seq_len, d_k, q.device, config)  # (L, d_k), float32
            record("rope_angles", angles, "L d_k")
            cos = angles.cos().to(q.dtype)  # (L, d_k)
            record("rope_cos", cos, "L d_k")
            sin = angles.sin().to(q.dtype)  # (L, d_k)
            del angles
            record("rope_sin", sin, "L d_k")
            q = rotate(q, cos, sin)  # (B, H, L, d_k)
            record("q_rotated", q, "B H L d_k")
            k = rotate(k, cos, sin)  # (B, Hkv, L, d_k)
            del cos, sin
            record("k_rotated", k, kv_split)
        if grouped and config.impl == "math":  # each K/V head serves `groups` query heads
            k = k.repeat_interleave(config.groups, dim=1)  # (B, H, Lk, d_k)
            record("k_repeated", k, f"B H {key_len_dim} d_k")
            v = v.repeat_interleave(config.groups, dim=1)  # (B, H, Lk, d_k)
            record("v_repeated", v, f"B H {key_len_dim} d_k")

        # 3. scaled dot-product attention, per head
        causal = config.mask == "causal"
        weights = shown = None
        if config.impl == "math":
            scores = torch.matmul(q, k.transpose(-2, -1)).div_(math.sqrt(d_k))  # (B, H, L, Lk)
            del q, k
            if padding is not None:  # padded keys: -inf before the softmax
                scores.masked_fill_(padding.logical_not()[:, None, None, :], float("-inf"))
            record("scores", scores, f"B H L {key_len_dim}")
            if config.pos == "alibi":  # distance penalties, one slope per head
                bias = alibi_bias(heads, seq_len, scores.device, scores.dtype)  # (H, L, L)
                scores += bias  # (B, H, L, L), in place
                record("alibi", bias, "H L L")  # after use: the add belongs to this stage
                del bias
            if causal:
                allowed = causal_mask(seq_len, scores.device)  # (L, L), True = may attend
                record("mask", allowed, "L L")
                scores.masked_fill_(allowed.logical_not(), float("-inf"))
                del allowed
            weights = torch.softmax(scores, dim=-1)  # (B, H, L, Lk)
            del scores
            record("weights", weights, f"B H L {key_len_dim}")
            if self.training and config.dropout > 0:  # training only: zero some weights
                dropped = F.dropout(weights, config.dropout)  # (B, H, L, Lk)
                record("dropout", dropped, f"B H L {key_len_dim}")
                attended = torch.matmul(dropped, v)  # (B, H, L, d_k)
                del dropped
            else:
                attended = torch.matmul(weights, v)  # (B, H, L, d_k)
            if not keep_weights:
                weights = None
        else:
            gqa = {"enable_gqa": True} if grouped else {}  # the kernel groups K/V natively
            # bool attn_mask: True = may attend; a float one is added to the scores
            attn_mask = None if padding is None else padding[:, None, None, :]  # (B, 1, 1, L)
            is_causal = causal
            if config.pos == "alibi":  # the bias as a float mask, -inf where a key is blocked
                attn_mask = _alibi_attn_mask(heads, seq_len, causal, attn_mask, q, record)
                is_causal = False  # in the float mask already (SDPA takes one or the other)
            attended = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=is_causal, **gqa
            )
            del attn_mask
            # attended: (B, H, L, d_k)
            if window is not None:  # the weights shown, while Q and K are at hand
                shown = _window_weights(config, q, k, *window, padding)
            del q, k
        del v
        record("weighted_values", attended, "B H L d_k")

        # 4. heads side by side again, then the output projection
        concat = attended.transpose(1, 2).contiguous().view(batch, seq_len, d_model)  # (B, L, D)
        del attended
        record("concat", concat, "B L D")
        attention_output = self.W_o(concat)  # (B, L, D)
        del concat
        record("output_projection", attention_output, "B L D")

        # 5. residual, then the norm in a post-norm layer (as in the original Transformer)
        output = attention_output
        if self.norm is not None:
            output = x + attention_output  # (B, L, D)
            del x
            record("residual", output, "B L D")
        if config.norm == "post":
            output = self.norm(output)  # (B, L, D)
            record("norm", output, "B L D")
        return LayerOutput(output, attention_output, weights, shown)


def _alibi_attn_mask(
    heads: int,
    seq_len: int,
    causal: bool,
    allowed: torch.Tensor | None,
    like: torch.Tensor,
    record: Callable[[str, torch.Tensor, str], None],
) -> torch.Tensor:
    """ALiBi for SDPA: the (H, L, L) bias with -inf where a key is blocked, as a float mask.

    The math path adds the same bias to the scores and sets the same keys to -inf, so the
    softmax sees equal numbers. ``allowed`` (B, 1, 1, L) bool, True = a real key, or None;
    with it the mask is (B, H, L, L). Users cannot pick this path (``validate`` refuses
    sdpa with alibi: the memory of a float mask inside CPU SDPA is not modelled); ``check``
    builds it to compare with the math path.
    """
    bias = alibi_bias(heads, seq_len, like.device, like.dtype)  # (H, L, L)
    record("alibi", bias, "H L L")
    if causal:
        bias.masked_fill_(causal_mask(seq_len, bias.device).logical_not(), float("-inf"))
    if allowed is not None:  # padded keys: -inf in every head and row of their text
        bias = bias.masked_fill(allowed.logical_not(), float("-inf"))  # (B, H, L, L)
    return bias


def attention_window(
    layer: AttentionLayer,
    token_ids: torch.Tensor | None,
    heads: list[int],
    rows: list[int],
    padding: torch.Tensor | None = None,
    context_ids: torch.Tensor | None = None,
    embeddings: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax weights for some heads and query rows only: (B, len(heads), len(rows), L).

    Exactly the matching slice of the math path's (B, H, L, L) weights, without ever
    building them: the keys are projected for every position, the queries only for
    ``rows``. This is what ``run`` shows when the output itself comes from SDPA.
    ``embeddings`` (B, L, D), given instead of token ids: a model's block input.
    """
    config = layer.config
    if embeddings is None:
        embeddings = layer.embedding(token_ids)  # (B, L, D)
    batch, seq_len = embeddings.shape[:2]
    device = embeddings.device
    rows_t = torch.tensor(rows, device=device)
    x = layer.embed(embeddings, name=None)  # (B, L, D), with positions where they are added
    if config.norm == "pre":
        x = layer.norm(x)  # (B, L, D): the projections read Norm(x)
    source = x  # keys from the text itself, or from a context
    if context_ids is not None:
        source = layer.embed(layer.embedding(context_ids))
    key_len = source.shape[1]
    k = layer.W_k(source)  # (B, Lk, Hkv * d_k)
    k = k.view(batch, key_len, config.kv_heads, config.d_k).transpose(1, 2)  # (B, Hkv, Lk, d_k)
    q = layer.W_q(x[:, rows_t])  # (B, r, D)
    del x
    q = q.view(batch, len(rows), config.heads, config.d_k).transpose(1, 2)  # (B, H, r, d_k)
    if config.pos == "rope":  # keys at every position, queries at theirs
        angles = rotary_angles(seq_len, config.d_k, q.device, config)  # (L, d_k)
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        k = rotate(k, cos, sin)  # (B, Hkv, L, d_k)
        q = rotate(q, cos[rows_t], sin[rows_t])  # (B, H, r, d_k)
    return _window_weights(config, q, k, heads, rows, padding, queries_given=True)


def _window_weights(
    config: LayerConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    heads: list[int],
    rows: list[int],
    padding: torch.Tensor | None,
    queries_given: bool = False,
) -> torch.Tensor:
    """Softmax weights of ``heads`` x ``rows`` from Q heads (B, H, L, d_k) (or, with
    ``queries_given``, only the rows: (B, H, r, d_k)) and K heads (B, Hkv, Lk, d_k), as
    rotated (RoPE) as the attention uses them: (B, h, r, Lk), the math path's slice."""
    device = q.device
    heads_t = torch.tensor(heads, device=device)
    rows_t = torch.tensor(rows, device=device)
    q = q[:, heads_t] if queries_given else q[:, heads_t][:, :, rows_t]  # (B, h, r, d_k)
    k = k[:, heads_t // config.groups]  # (B, h, Lk, d_k): the K head each query head reads
    scores = torch.matmul(q, k.transpose(-2, -1)).div_(math.sqrt(config.d_k))  # (B, h, r, Lk)
    del q, k
    keys = torch.arange(scores.shape[-1], device=device)
    if config.pos == "alibi":  # -m_h·|row - key|, for the heads and rows shown only
        distance = (keys.unsqueeze(0) - rows_t.unsqueeze(1)).abs().float()  # (r, L)
        slopes = alibi_slopes(config.heads, device)[heads_t]  # (h,)
        bias = distance * slopes.neg_().view(-1, 1, 1)  # (h, r, L), float32 like alibi_bias
        scores += bias.to(scores.dtype)
        del bias
    if config.mask == "causal":
        allowed = keys.unsqueeze(0) <= rows_t.unsqueeze(1)  # (r, L), True = may attend
        scores.masked_fill_(allowed.logical_not(), float("-inf"))
    if padding is not None:  # (B, L), True = a real token
        scores.masked_fill_(padding.logical_not()[:, None, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1)  # (B, h, r, L)


def causal_mask(seq_len: int, device: torch.device | None = None) -> torch.Tensor:
    """(L, L) bool, True = may attend (SDPA's convention): each query sees itself and earlier keys.

    ``nn.MultiheadAttention`` wants the opposite (True = blocked): pass ``~causal_mask(L)``.
    """
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril_()


def resolve_device(spec: str) -> torch.device:
    """auto = cuda, else mps, else cpu; a device that is not there is a usage error."""
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    mps = getattr(torch.backends, "mps", None)
    mps_ok = bool(mps and mps.is_available())
    if spec == "auto":
        return torch.device("cuda" if cuda_count else "mps" if mps_ok else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "mps":
        if not mps_ok:
            raise AttnctlError("device mps is not available on this machine")
        return torch.device("mps")
    index = int(spec.partition(":")[2] or 0)
    if index >= cuda_count:
        have = f"{cuda_count} CUDA device(s)" if cuda_count else "no CUDA device"
        raise AttnctlError(f"device {spec} is not available: torch sees {have}")
    return torch.device(spec)
