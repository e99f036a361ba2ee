"""`attnctl check`: one configuration through the layer's two paths, an oracle, and gradcheck.

The math path (every weight built) and the same layer with SDPA are compared with each
other and with an oracle written here, independently of ``layer.py``:

- torch's own ``nn.MultiheadAttention`` given the same W_q, W_k, W_v, W_o, for every
  configuration it can express: grouped K/V heads (GQA) by repeating each K/V head's rows of
  W_k and W_v for the query heads that read it, ALiBi (and the causal mask with it) as a
  float ``attn_mask`` built here;
- with ``--pos rope``, which rotates Q and K inside the attention where
  ``nn.MultiheadAttention`` cannot reach: an "SDPA reference" that projects with the layer's
  weights, rotates the pairs (i, i + d_k/2) by angles computed here in float64, picks each
  query head's K/V head, and calls ``F.scaled_dot_product_attention``.

The attention outputs, the weights (where both sides have them) and the layer's output
(after its residual and norm, recomputed here) must agree within a tolerance for the dtype.
``torch.autograd.gradcheck`` then checks the layer's backward in float64. The positions
added to the embeddings (sinusoidal, learned) are the layer's own: the oracle starts from
the layer's input, and tests hold those tables to their formulas.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attnctl.model.config import LayerConfig
from attnctl.nn.layer import TORCH_DTYPES, AttentionLayer, resolve_device

# max |a - b| allowed, by dtype (times max(1, max |b|) for the layer output)
TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}
MHA = "nn.MultiheadAttention"
SDPA_REFERENCE = "SDPA reference"


@dataclass(frozen=True)
class Comparison:
    a: str
    b: str
    # "output": the attention output, before any residual; "weights"; "layer output": after
    # the residual and the norm
    what: str
    max_abs_diff: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance


@dataclass(frozen=True)
class CheckResult:
    comparisons: list[Comparison]
    gradcheck: bool
    gradcheck_note: str  # what was checked, or why it failed
    device: str
    skipped: list[str] = dataclasses.field(default_factory=list)  # comparisons not possible

    @property
    def ok(self) -> bool:
        return self.gradcheck and all(c.ok for c in self.comparisons)


@dataclass(frozen=True)
class ReferenceAttention:
    name: str  # who computed it
    output: torch.Tensor  # (B, L, D): after W_o, before any residual
    weights: torch.Tensor  # (B, H, L, Lk)


def _per_query_head(tensor: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """(Hkv·d_k, ...) rows of W_k, W_v or their bias -> (H·d_k, ...): query head h reads
    K/V head h // (H / Hkv), as in grouped-query attention."""
    groups = heads // kv_heads
    per_head = tensor.reshape(kv_heads, 1, -1, *tensor.shape[1:])  # (Hkv, 1, d_k, ...)
    expanded = per_head.expand(kv_heads, groups, *per_head.shape[2:])  # (Hkv, groups, d_k, ...)
    return expanded.reshape(heads * per_head.shape[2], *tensor.shape[1:])  # (H·d_k, ...)


def reference_mha(layer: AttentionLayer) -> nn.MultiheadAttention:
    """torch's own multi-head attention with this layer's W_q, W_k, W_v, W_o copied in.

    Under GQA, W_k and W_v get each K/V head's rows once per query head that reads it.
    """
    config = layer.config
    weight = layer.W_q.weight
    mha = nn.MultiheadAttention(config.d_model, config.heads, bias=config.bias, batch_first=True)
    mha = mha.to(device=weight.device, dtype=weight.dtype)

    def widened(tensor: torch.Tensor) -> torch.Tensor:
        return _per_query_head(tensor, config.heads, config.kv_heads)

    with torch.no_grad():
        mha.in_proj_weight.copy_(
            torch.cat([layer.W_q.weight, widened(layer.W_k.weight), widened(layer.W_v.weight)])
        )
        mha.out_proj.weight.copy_(layer.W_o.weight)
        if config.bias:
            mha.in_proj_bias.copy_(
                torch.cat([layer.W_q.bias, widened(layer.W_k.bias), widened(layer.W_v.bias)])
            )
            if layer.W_o.bias is not None:  # else W_o has none (output_bias = false)
                mha.out_proj.bias.copy_(layer.W_o.bias)
            else:
                mha.out_proj.bias.zero_()
    return mha.eval()


def reference_bias(config: LayerConfig, seq_len: int, key_len: int) -> torch.Tensor | None:
    """What is added to the scores, in float64 on the CPU: (H, L, Lk), or None if nothing.

    ALiBi's -m_h·|i - j| with m_h = 2^(-8(h+1)/H), and -inf where the causal mask blocks
    key j > query i, and where a sliding window blocks j <= i - window.
    """
    queries = torch.arange(seq_len, dtype=torch.float64).view(seq_len, 1)  # (L, 1)
    keys = torch.arange(key_len, dtype=torch.float64).view(1, key_len)  # (1, Lk)
    bias = torch.zeros(config.heads, seq_len, key_len, dtype=torch.float64)  # (H, L, Lk)
    if config.pos == "alibi":
        head = torch.arange(config.heads, dtype=torch.float64).view(-1, 1, 1)  # (H, 1, 1)
        slope = 2.0 ** (-8.0 * (head + 1) / config.heads)  # (H, 1, 1)
        bias -= slope * (queries - keys).abs()  # (H, L, Lk)
    if config.mask == "causal":
        bias.masked_fill_(keys > queries, float("-inf"))
    if config.window:  # a sliding window: nor keys window or more back
        bias.masked_fill_(keys <= queries - config.window, float("-inf"))
    if config.pos != "alibi" and config.mask != "causal":
        return None
    return bias


def needs_sdpa_reference(config: LayerConfig) -> bool:
    """What ``nn.MultiheadAttention`` cannot express: RoPE (it turns Q and K inside the
    attention), heads that are not D / H wide (its heads always split embed_dim; kdim
    and vdim change only the key and value inputs, never the width of Q), and a query
    scale other than 1/√d_k (it has none to set), soft-capped scores, or q/k norms."""
    return (
        config.pos == "rope"
        or config.q_width != config.d_model
        or config.query_scale != 0
        or config.softcap != 0
        or config.qk_norm != "none"
    )


def mha_attention(
    layer: AttentionLayer, x: torch.Tensor, source: torch.Tensor
) -> ReferenceAttention:
    """nn.MultiheadAttention on queries from x (B, L, D), keys and values from source."""
    config = layer.config
    batch, seq_len, key_len = x.shape[0], x.shape[1], source.shape[1]
    bias = reference_bias(config, seq_len, key_len)
    attn_mask = None  # float: added to the scores, one (L, Lk) per batch row and head
    if bias is not None:
        bias = bias.to(device=x.device, dtype=x.dtype)
        attn_mask = bias.expand(batch, *bias.shape).reshape(-1, seq_len, key_len)  # (B·H, L, Lk)
    output, weights = reference_mha(layer)(
        x, source, source, attn_mask=attn_mask, need_weights=True, average_attn_weights=False
    )
    return ReferenceAttention(MHA, output, weights)


def reference_frequencies(config: LayerConfig, seq_len: int = 1) -> torch.Tensor:
    """RoPE's θ_i = rope_theta^(-2i/d_k), scaled as Hugging Face defines rope_type, for a
    pass over ``seq_len`` positions (dynamic and longrope depend on it): (d_k/2,).

    Written here in float64 torch, apart from the layer's ``attnctl.model.rope`` (which tests hold
    to transformers' ROPE_INIT_FUNCTIONS, as they hold this).
    """
    d_k, original = config.d_k, config.rope_original_max_positions
    exponent = torch.arange(0, d_k, 2, dtype=torch.float64) / d_k
    theta = config.rope_theta
    if config.rope_type == "dynamic" and seq_len > original:  # NTK: a larger base
        stretch = config.rope_factor * seq_len / original - (config.rope_factor - 1)
        theta = theta * stretch ** (d_k / (d_k - 2))
    frequency = 1.0 / theta**exponent  # (d_k/2,)
    factor = config.rope_factor
    if config.rope_type == "longrope":
        chosen = config.rope_long_factor if seq_len > original else config.rope_short_factor
        return frequency / torch.tensor(chosen, dtype=torch.float64)
    if config.rope_type == "yarn":
        return _reference_yarn(config, frequency)
    if config.rope_type == "linear":
        return frequency / factor
    if config.rope_type == "llama3":
        original = config.rope_original_max_positions
        low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
        wavelength = 2 * math.pi / frequency
        smooth = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)
        blended = (1 - smooth) * frequency / factor + smooth * frequency
        slow, fast = wavelength > original / low, wavelength < original / high
        return torch.where(slow, frequency / factor, torch.where(fast, frequency, blended))
    return frequency


def _reference_yarn(config: LayerConfig, frequency: torch.Tensor) -> torch.Tensor:
    """YaRN: θ_i kept for the pairs turning more than beta_fast times in the original length,
    θ_i / factor for those turning fewer than beta_slow times, a linear ramp between."""
    d_k, base = config.d_k, config.rope_theta

    def pair_turning(times: float) -> float:  # the pair index that turns `times` times
        return (
            d_k
            * math.log(config.rope_original_max_positions / (times * 2 * math.pi))
            / (2 * math.log(base))
        )

    low, high = pair_turning(config.rope_beta_fast), pair_turning(config.rope_beta_slow)
    if config.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d_k - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(d_k // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return frequency / config.rope_factor * ramp + frequency * (1 - ramp)


def reference_rope_scaling(config: LayerConfig) -> float:
    """What yarn and longrope multiply cos and sin by (1 for the other types)."""
    factor, given = config.rope_factor, config.rope_attention_factor
    if config.rope_type not in ("yarn", "longrope"):
        return 1.0
    if given:
        return given
    if config.rope_type == "longrope":
        if factor <= 1:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(config.rope_original_max_positions))

    def yarn_mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if config.rope_mscale and config.rope_mscale_all_dim:
        return yarn_mscale(config.rope_mscale) / yarn_mscale(config.rope_mscale_all_dim)
    return yarn_mscale(1.0)


def _turn_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turn each pair (x_i, x_{i + d_k/2}) by its angle: x (..., L, d_k), cos, sin (L, d_k/2)."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]  # (..., L, d_k/2) each
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


def sdpa_reference_attention(
    layer: AttentionLayer, x: torch.Tensor, source: torch.Tensor
) -> ReferenceAttention:
    """The attention written out here with the layer's weights; F.scaled_dot_product_attention
    for the output, softmax(Q·Kᵀ/√d_k + bias) for the weights."""
    config = layer.config
    heads, kv_heads, d_k = config.heads, config.kv_heads, config.d_k
    batch, seq_len, key_len = x.shape[0], x.shape[1], source.shape[1]
    q = F.linear(x, layer.W_q.weight, layer.W_q.bias)  # (B, L, H·d_k)
    k = F.linear(source, layer.W_k.weight, layer.W_k.bias)  # (B, Lk, Hkv·d_k)
    v = F.linear(source, layer.W_v.weight, layer.W_v.bias)  # (B, Lk, Hkv·d_k)
    if config.qk_norm == "all":  # over every head at once, before the split
        q, k = written_norm(config, q, layer.q_norm), written_norm(config, k, layer.k_norm)
    q = q.view(batch, seq_len, heads, d_k)  # (B, L, H, d_k)
    k = k.view(batch, key_len, kv_heads, d_k)  # (B, Lk, Hkv, d_k)
    if config.qk_norm == "head":  # each head over its d_k
        q, k = written_norm(config, q, layer.q_norm), written_norm(config, k, layer.k_norm)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, L, d_k), (B, Hkv, Lk, d_k)
    v = v.view(batch, key_len, kv_heads, d_k).transpose(1, 2)  # (B, Hkv, Lk, d_k)
    if config.pos == "rope":
        position = torch.arange(seq_len, dtype=torch.float64)  # (L,)
        angles = torch.outer(position, reference_frequencies(config, seq_len))  # (L, d_k/2)
        scaling = reference_rope_scaling(config)
        cos = (angles.cos() * scaling).to(device=x.device, dtype=x.dtype)
        sin = (angles.sin() * scaling).to(device=x.device, dtype=x.dtype)
        q, k = _turn_pairs(q, cos, sin), _turn_pairs(k, cos, sin)
    kv_head = torch.arange(heads, device=x.device) // (heads // kv_heads)  # (H,)
    k, v = k[:, kv_head], v[:, kv_head]  # (B, H, Lk, d_k): the K/V head each query head reads
    bias = reference_bias(config, seq_len, key_len)
    if bias is not None:
        bias = bias.to(device=x.device, dtype=x.dtype)  # (H, L, Lk)
    scale = config.query_scale or 1 / math.sqrt(d_k)
    scores = q @ k.transpose(-2, -1) * scale  # (B, H, L, Lk)
    if config.softcap:  # cap·tanh(s/cap), before the bias and the masks
        scores = config.softcap * torch.tanh(scores / config.softcap)
    weights = torch.softmax(scores if bias is None else scores + bias, dim=-1)
    if config.softcap:  # no SDPA kernel soft-caps: the weights written out, times V
        attended = weights @ v  # (B, H, L, d_k)
    else:
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    concat = attended.transpose(1, 2).reshape(batch, seq_len, heads * d_k)  # (B, L, H·d_k)
    output = F.linear(concat, layer.W_o.weight, layer.W_o.bias)  # (B, L, D)
    return ReferenceAttention(SDPA_REFERENCE, output, weights)


def reference_norm(layer: AttentionLayer, h: torch.Tensor) -> torch.Tensor:
    """LayerNorm or RMSNorm over D with the layer's weights, written out, in float32 or wider."""
    return written_norm(layer.config, h, layer.norm)


def written_norm(config: LayerConfig, h: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """LayerNorm or RMSNorm over h's last dim with ``norm``'s weights, written out, in
    float32 or wider."""
    wide = h.to(torch.promote_types(h.dtype, torch.float32))  # (B, L, D)
    weight = norm.weight.to(wide.dtype)
    if config.norm_type == "layer":
        centred = wide - wide.mean(-1, keepdim=True)
        variance = centred.square().mean(-1, keepdim=True)  # biased, as LayerNorm's
        normed = centred / torch.sqrt(variance + config.norm_eps) * weight + norm.bias
    else:
        mean_square = wide.square().mean(-1, keepdim=True)
        normed = wide / torch.sqrt(mean_square + config.norm_eps) * weight
    return normed.to(h.dtype)


def reference_layer_output(
    layer: AttentionLayer, x: torch.Tensor, attention_output: torch.Tensor
) -> torch.Tensor:
    """post: Norm(x + attention); pre: x + attention; none: the attention output itself."""
    norm = layer.config.norm
    if norm == "none":
        return attention_output
    residual = x + attention_output  # (B, L, D)
    return reference_norm(layer, residual) if norm == "post" else residual


def vary_qk_norms(layer: AttentionLayer, seed: int) -> None:
    """q/k norm weights near 1 and biases near 0, drawn from ``seed`` (both paths get the
    same): a norm left at weight 1, bias 0 would hide a layer that ignores them."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for norm in (layer.q_norm, layer.k_norm):
            if norm is None:
                continue
            for name, parameter in norm.named_parameters():
                drawn = torch.randn(parameter.shape, generator=generator) * 0.5
                parameter.copy_(drawn + 1 if name == "weight" else drawn)


def run_check(config: LayerConfig, batch: int, seq_len: int, vocab_size: int) -> CheckResult:
    device = resolve_device(config.device)
    dtype = TORCH_DTYPES[config.dtype]
    generator = torch.Generator().manual_seed(config.seed)
    token_ids = torch.randint(0, vocab_size, (batch, seq_len), generator=generator).to(device)
    inputs = {}
    if config.cross:  # a context as long as the text, for the keys and values
        context = torch.randint(0, vocab_size, (batch, seq_len), generator=generator)
        inputs["context_ids"] = context.to(device)

    def build(impl: str) -> AttentionLayer:
        torch.manual_seed(config.seed)  # the same weights for every implementation
        # (sdpa is built even where users may not pick it, alibi: to be compared here)
        layer = AttentionLayer(dataclasses.replace(config, impl=impl), vocab_size)
        vary_qk_norms(layer, config.seed)
        return layer.to(device=device, dtype=dtype).eval()

    math_layer = build("math")
    # soft-capping is not additive: no SDPA kernel applies it, and the layer refuses sdpa
    sdpa_layer = None if config.softcap else build("sdpa")
    skipped = ["sdpa: F.scaled_dot_product_attention cannot soft-cap the scores"] * (
        sdpa_layer is None
    )
    tolerance = TOLERANCE[config.dtype]

    def compare(a: str, b: str, what: str, left: torch.Tensor, right: torch.Tensor) -> Comparison:
        max_abs_diff = (left.double() - right.double()).abs().max().item()
        # the layer output (a residual stream, normed or not) reaches several units, where
        # one step of a float16 or bfloat16 value is larger: the tolerance scales with it
        scale = max(1.0, right.abs().max().item()) if what == "layer output" else 1.0
        return Comparison(a, b, what, max_abs_diff, tolerance * scale)

    with torch.no_grad():
        math_run = math_layer(token_ids, **inputs)
        sdpa_run = None if sdpa_layer is None else sdpa_layer(token_ids, **inputs)
        x = math_layer.embed(math_layer.embedding(token_ids))  # (B, L, D): + added positions
        source = x  # keys and values: the text itself, or the context (not normed)
        if config.cross:
            source = math_layer.embed(math_layer.embedding(inputs["context_ids"]))
        queries = reference_norm(math_layer, x) if config.norm == "pre" else x
        if config.norm == "pre" and not config.cross:
            source = queries
        oracle = sdpa_reference_attention if needs_sdpa_reference(config) else mha_attention
        reference = oracle(math_layer, queries, source)
        layer_output = reference_layer_output(math_layer, x, reference.output)
        name = reference.name
        comparisons = [
            compare("math", name, "output", math_run.attention_output, reference.output),
            compare("math", name, "weights", math_run.weights, reference.weights),
            compare("math", name, "layer output", math_run.output, layer_output),
        ]
        if sdpa_run is not None:
            sdpa_output = sdpa_run.attention_output
            comparisons[:0] = [
                compare("math", "sdpa", "output", math_run.attention_output, sdpa_output)
            ]
            comparisons[3:3] = [compare("sdpa", name, "output", sdpa_output, reference.output)]
    passed, note = _gradcheck(config, vocab_size)
    return CheckResult(comparisons, passed, note, str(device), skipped)


def _gradcheck(config: LayerConfig, vocab_size: int) -> tuple[bool, str]:
    """gradcheck in float64 on the CPU, small sizes: embeddings -> the layer's output."""
    # a head_dim stays independent of D: 2-wide heads, D two wider than their concat
    head_dim, d_model = (2, config.heads * 2 + 2) if config.head_dim else (0, config.heads * 2)
    window = min(config.window, 2)  # a window that still acts on 3 tokens
    small = dataclasses.replace(
        config, d_model=d_model, head_dim=head_dim, window=window, impl="math", device="cpu"
    )
    if config.pos == "rope" and config.rope_type in ("dynamic", "longrope"):
        # 4-wide heads (dynamic's base needs r > 2), longrope's first two factors, and an
        # original length of 2, so that 3 tokens take the long branch
        small = dataclasses.replace(
            small,
            d_model=config.heads * 4,
            head_dim=4 if config.head_dim else 0,
            rope_original_max_positions=2,
            rope_short_factor=config.rope_short_factor[:2],
            rope_long_factor=config.rope_long_factor[:2],
        )
    # (kv_heads still divides heads, so the grouped path is checked too; alibi and rope too)
    torch.manual_seed(config.seed)
    layer = AttentionLayer(small, vocab_size).double()
    embeddings = torch.randn(2, 3, small.d_model, dtype=torch.float64, requires_grad=True)
    context = {"context_ids": torch.randint(0, vocab_size, (2, 4))} if config.cross else {}
    threads = torch.get_num_threads()
    # ~150 passes over tensors of a few hundred numbers: one thread, no waiting on others
    # (on a busy 2-core machine 7x faster than two)
    torch.set_num_threads(1)
    try:
        passed = torch.autograd.gradcheck(
            lambda e: layer(None, embeddings=e, **context).output,
            (embeddings,),
            eps=1e-6,
            atol=1e-5,
        )
    except RuntimeError as error:  # gradcheck raises with the mismatching Jacobians
        return False, str(error).strip().splitlines()[0]
    finally:
        torch.set_num_threads(threads)
    shape = f"(2, 3, {small.d_model})"
    return bool(passed), f"float64 CPU, embeddings {shape} -> output, {small.heads} heads"
