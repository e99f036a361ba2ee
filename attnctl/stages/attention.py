"""The plan of an attention sublayer: projections, heads, positions, scores, weights, output.

The torch twin is ``attnctl/nn/attention.py``; both name every stage literally.
"""

from __future__ import annotations

from attnctl.model.config import LayerConfig
from attnctl.model.describe import NORM_NAMES, Attention
from attnctl.model.rope import attention_scaling
from attnctl.stages import MASK_CONVENTION, PlanBuilder
from attnctl.stages.collectives import gather_sequence, reduce_partial
from attnctl.stages.ring_attention import plan_ring_attention


def plan_attention(
    plan: PlanBuilder, sublayer: Attention, x: str, context: str | None, padding: bool
) -> str:
    """Stages of one attention sublayer reading ``x`` (keys and values from ``context`` in
    cross-attention); ``padding``: padded keys are masked. Returns the last stage's name."""
    config = sublayer.config
    sizes = plan.sizes
    cross = context is not None
    key_len = "Lc" if cross else "L"  # the keys' length: the context's, or the text's own
    grouped = config.kv_heads != config.heads  # grouped-query (GQA) or multi-query attention
    # H·d_k, the heads side by side: D, or D_q when head_dim is not D / H
    q_width = "D_q" if "D_q" in sizes else "D"
    kv_width = f"B {key_len} {'D_kv' if grouped else q_width}"
    kv_heads = f"B {'Hkv' if grouped else 'H'} {key_len} d_k"
    kv_split = "Hkv" if grouped else "H"
    scale = f"· {config.query_scale:g}" if config.query_scale else "/ √d_k"
    if config.query_scale == 1:  # T5: no scaling (folded into W_q in training)
        scale = "(unscaled)"

    h, q = _project_queries(plan, config, x, q_width)  # h: x, or Norm(x) in a pre-norm sublayer
    source = context if cross else h  # what K and V are projected from
    k = _project_keys_values(plan, config, source, context, kv_width, kv_split)
    q = _query_heads(plan, config, q)
    k, v = _key_value_heads(plan, config, k, key_len, kv_heads, kv_split)
    if config.pos == "rope":
        q, k = _rope_rotation(plan, config, q, k, kv_split)
    ring = plan.context_parallel > 1  # context parallel: ring attention over the chunks
    if grouped and config.impl == "math" and not ring:  # each K/V head serves H/Hkv heads
        repeat = f"repeat_interleave({config.groups}, dim=1): one copy per query head"
        k = plan.add("k_repeated", f"B H {key_len} d_k", (k,), what=repeat)
        v = plan.add("v_repeated", f"B H {key_len} d_k", (v,), what=repeat)

    if ring:
        attended = plan_ring_attention(plan, config, q, k, v, scale)
    elif config.impl == "math":
        attended = _math_attention(plan, sublayer, q, k, v, key_len, padding, scale)
    else:
        attended = _sdpa_attention(plan, config, q, k, v)
    return _output(plan, sublayer, x, attended, q_width)


def _project_queries(
    plan: PlanBuilder, config: LayerConfig, x: str, q_width: str
) -> tuple[str, str]:
    """Step 1's start: h = x, or Norm(x) in a pre-norm sublayer (gathered under sequence
    parallelism), and Q = h · W_q. Returns (h, the last Q stage)."""
    norm_name = NORM_NAMES[config.norm_type]
    bias = " + b" if config.bias else ""
    h = x  # what the projections read: x, or Norm(x) in a pre-norm sublayer
    if config.norm == "pre":
        h = plan.add(
            "norm", plan.hidden, (x,), what=f"{norm_name} over D, before attention (pre-norm)"
        )
    h = gather_sequence(plan, h)  # sequence parallel: the whole sequence, from every rank
    q = plan.add("q", f"B L {q_width}", (h,), what="x · W_q" + bias)
    if config.qk_norm == "all":  # OLMo 2
        q = plan.add("q_norm", f"B L {q_width}", (q,), what=f"{_across(config)}: H·d_k")
    return h, q


def _project_keys_values(
    plan: PlanBuilder,
    config: LayerConfig,
    source: str,
    context: str | None,
    kv_width: str,
    kv_split: str,
) -> str:
    """K = source · W_k and V = source · W_v, the source being the context in
    cross-attention. Returns the last K stage (V's is "v")."""
    bias = " + b" if config.bias else ""
    source_name = "encoder output" if context == "encoder_output" else "x"
    k = plan.add("k", kv_width, (source,), what=f"{source_name} · W_k" + bias)
    if config.qk_norm == "all":
        k = plan.add("k_norm", kv_width, (k,), what=f"{_across(config)}: {kv_split}·d_k")
    plan.add("v", kv_width, (source,), what=f"{source_name} · W_v" + bias)
    return k


def _across(config: LayerConfig) -> str:
    """The q/k norm of OLMo 2 in words: over every head at once."""
    return f"{NORM_NAMES[config.norm_type]} over every head at once, before the split"


def _each_head(config: LayerConfig) -> str:
    """The q/k norm of Qwen3 and Gemma 3 in words: each head over its d_k."""
    return f"{NORM_NAMES[config.norm_type]} of each head over d_k, on the view (B, L, heads, d_k)"


def _query_heads(plan: PlanBuilder, config: LayerConfig, q: str) -> str:
    """Q as heads (B, H, L, d_k): a view, each head normed first where the model does
    that. Returns the Q heads' stage."""
    if config.qk_norm == "head":  # Qwen3, Gemma 3
        q = plan.add("q_norm", "B L H d_k", (q,), what=_each_head(config))
    split = "transpose(1, 2): no copy"
    return plan.add("q_heads", "B H L d_k", (q,), view_of=q, what=f"view (B, L, H, d_k), {split}")


def _key_value_heads(
    plan: PlanBuilder, config: LayerConfig, k: str, key_len: str, kv_heads: str, kv_split: str
) -> tuple[str, str]:
    """K and V as heads (B, Hkv, Lk, d_k): views, each K head normed first where the model
    does that. Returns the K and V heads' stages."""
    if config.qk_norm == "head":
        k = plan.add("k_norm", f"B {key_len} {kv_split} d_k", (k,), what=_each_head(config))
    split = "transpose(1, 2): no copy"
    k = plan.add(
        "k_heads", kv_heads, (k,), view_of=k, what=f"view (B, L, {kv_split}, d_k), {split}"
    )
    v = plan.add(
        "v_heads", kv_heads, ("v",), view_of="v", what=f"view (B, L, {kv_split}, d_k), {split}"
    )
    return k, v


def _rope_rotation(
    plan: PlanBuilder, config: LayerConfig, q: str, k: str, kv_split: str
) -> tuple[str, str]:
    """RoPE: the angles, their cos and sin, then Q and K heads rotated by their positions.
    Returns the rotated Q and K stages."""
    seq_len = plan.sizes["L"]
    half = config.d_k // 2
    plan.add(
        "rope_angles",
        "L d_k",
        dtype="float32",
        what=f"RoPE angles pos·θ_i, θ_i = {config.rope_theta:g}^(-2i/d_k)"
        + ("" if config.rope_type == "default" else f", {config.rope_type} scaling"),
        scratch=plan.pieces(4 * half, 4 * seq_len, 4 * seq_len * half),  # θ_i, pos, outer
    )
    # cos() and sin() in float32, then .to() the dtype
    cast = plan.pieces(seq_len * config.d_k * 4) if config.dtype != "float32" else 0
    scaling = attention_scaling(config.rope)  # yarn, longrope: in place, in float32
    times = "" if scaling == 1 else f" × {scaling:.6g} (attention scaling)"
    plan.add("rope_cos", "L d_k", ("rope_angles",), what="cos of the angles" + times, scratch=cast)
    plan.add("rope_sin", "L d_k", ("rope_angles",), what="sin of the angles" + times, scratch=cast)
    turn = "x·cos + rotate_half(x)·sin: RoPE turns each pair of dims"
    k_dims = f"B {kv_split} L d_k"
    # scratch: rotate_half(x) and its product with sin
    q = plan.add(
        "q_rotated",
        "B H L d_k",
        (q, "rope_cos", "rope_sin"),
        what=turn,
        scratch=plan.pieces(plan.nbytes("B H L d_k"), plan.nbytes("B H L d_k")),
    )
    k = plan.add(
        "k_rotated",
        k_dims,
        (k, "rope_cos", "rope_sin"),
        what=turn,
        scratch=plan.pieces(plan.nbytes(k_dims), plan.nbytes(k_dims)),
    )
    return q, k


def _scores(
    plan: PlanBuilder,
    sublayer: Attention,
    q: str,
    k: str,
    key_len: str,
    padding: bool,
    scale: str,
) -> str:
    """The math path's scores: Q · Kᵀ scaled, soft-capped, biased, blocked keys at -inf.
    Returns the last stage that writes them."""
    config = sublayer.config
    scores = plan.add(
        "scores",
        f"B H L {key_len}",
        (q, k),
        # the negated padding mask (B·L bools) is made after q and k are freed, so it
        # never raises this stage's peak
        what=f"Q · Kᵀ {scale}, one L×{key_len} per head"
        + ("; padded keys set to -inf" if padding and not config.softcap else "")
        + (
            "; + block 0's relative position bias"
            if config.pos == "relative" and not sublayer.computes_bias
            else "; + the relative position bias"
            if config.pos == "relative"
            else ""
        ),
    )
    if config.softcap:
        cap = f"{config.softcap:g}"
        scores = plan.add(
            "softcap",
            f"B H L {key_len}",
            (scores,),
            view_of=scores,
            what=f"{cap}·tanh(scores/{cap}) in place, before masks"
            + ("; padded keys set to -inf" if padding else ""),
            # the negated padding mask, made while the scores alone are alive
            scratch=plan.pieces(plan.nbytes(f"B {key_len}", "bool")) if padding else 0,
        )
    if config.pos == "relative":  # T5: a learned bias per head by bucketed distance
        plan_relative_bias(plan, sublayer, scores, key_len)
    if config.pos == "alibi":
        heads, length = config.heads, plan.sizes["L"]
        # float32 scratch: exponents and slopes (H each), positions (L), |i - j| (L·L),
        # and the float32 bias itself before .to() when the dtype is narrower
        narrow = 4 * heads * length * length if config.dtype != "float32" else 0
        plan.add(
            "alibi",
            "H L L",
            what="ALiBi bias -m_h·|i - j| added to the scores in place",
            scratch=plan.pieces(4 * heads, 4 * heads, 4 * length, 4 * length * length, narrow),
        )
    if config.mask == "causal":
        plan.add(
            "mask",
            "L L",
            (scores,),
            dtype="bool",
            what=f"{_causal(config)}; {MASK_CONVENTION}; blocked scores set to -inf in place",
        )
    return scores


def _math_attention(
    plan: PlanBuilder,
    sublayer: Attention,
    q: str,
    k: str,
    v: str,
    key_len: str,
    padding: bool,
    scale: str,
) -> str:
    """The textbook path: the scores, their softmax (dropped out in training), times V.
    Returns the attended values' stage."""
    config = sublayer.config
    scores = _scores(plan, sublayer, q, k, key_len, padding, scale)
    weights = plan.add(
        "weights", f"B H L {key_len}", (scores,), what="softmax over keys: rows sum to 1"
    )
    if config.dropout > 0:  # training only: the plan of a --train configuration
        weights = plan.add(
            "dropout",
            f"B H L {key_len}",
            (weights,),
            what=f"dropout p={config.dropout} on the weights (training only), seeded",
        )
    return plan.add("weighted_values", "B H L d_k", (weights, v), what="weights · V")


def _sdpa_attention(plan: PlanBuilder, config: LayerConfig, q: str, k: str, v: str) -> str:
    """The fused kernel's path: no weights stored (a bool mask for a sliding window).
    Returns the attended values' stage."""
    reads = (q, k, v)
    if config.window:  # the kernel's is_causal has no window: a bool attn_mask
        reads += (
            plan.add(
                "mask",
                "L L",
                dtype="bool",
                what=f"{_causal(config)}; {MASK_CONVENTION}; SDPA's attn_mask",
            ),
        )
    return plan.add(
        "weighted_values",
        "B H L d_k",
        reads,
        what="F.scaled_dot_product_attention"
        + (" (is_causal)" if config.mask == "causal" and not config.window else "")
        + (" (attn_mask)" if config.window else "")
        + (f" (scale {config.query_scale:g})" if config.query_scale else "")
        + ": weights never stored",
    )


def _output(plan: PlanBuilder, sublayer: Attention, x: str, attended: str, q_width: str) -> str:
    """Steps 3 and 4: heads side by side, W_o (summed over the ranks under tensor
    parallelism), then the residual and the norms. Returns the last stage's name."""
    config = sublayer.config
    sizes = plan.sizes
    norm_name = NORM_NAMES[config.norm_type]
    # transpose(1, 2).contiguous() copies only when the memory order really changes: not
    # when H == 1 or L == 1 (size-1 dims don't count), and not after the fused kernels,
    # which write (B, L, H, d_k) order already. The run's trace confirms each case.
    no_copy = config.impl == "sdpa" or config.heads == 1 or sizes["L"] == 1
    concat = plan.add(
        "concat",
        f"B L {q_width}",
        (attended,),
        view_of=attended if no_copy else None,
        what="transpose(1, 2).contiguous().view: heads side by side"
        + (" (already in order: no copy)" if no_copy else " (a copy)"),
    )
    has_output_bias = config.bias and config.output_bias
    if plan.tensor_parallel > 1:  # the bias is added after the ranks' sum
        projected = f"concat · W_o: this rank's {sizes['H']} heads' partial sum"
        projected += " (b after the sum)" if has_output_bias else ""
    else:
        projected = "concat · W_o" + (" + b" if has_output_bias else "")
    out = plan.add("output_projection", "B L D", (concat,), what=projected)
    out = reduce_partial(plan, out, bias=has_output_bias)  # tensor parallel: the ranks' sum
    if sublayer.output_norm:  # Gemma, OLMo 2: the attention output normalised first
        out = plan.add(
            "post_norm", plan.hidden, (out,), what=f"{norm_name} over D of the attention output"
        )
    if sublayer.residual:
        residual = plan.add("residual", plan.hidden, (x, out), what="x + attention output")
    if config.norm == "post":
        plan.add("norm", plan.hidden, (residual,), what=f"{norm_name} over D (post-norm)")
    return plan.last


def plan_relative_bias(plan: PlanBuilder, sublayer: Attention, scores: str, key_len: str) -> str:
    """T5's (H, L, Lk) position bias, added to the scores in place: computed by the block
    that holds the bucket table (block 0) and kept for every block after, which adds it.

    The torch twin is ``nn/positions.relative_bias``: the n = L + Lk - 1 distances
    (int64) are bucketed (41 bytes of int64 and bool temporaries per distance at the
    busiest moment, measured), looked up once (n, H), transposed into a copy (H, n), and
    the (H, L, Lk) bias is one copy of a strided view of that.
    """
    if not sublayer.computes_bias:
        return plan.add(
            "position_bias",
            f"H L {key_len}",
            (scores,),
            what="block 0's relative position bias (kept since then), added in place",
        )
    sizes = plan.sizes
    config = sublayer.config
    distances = sizes["L"] + sizes[key_len] - 1
    by_distance = plan.nbytes("H") * distances  # (n, H) or (H, n) in the dtype
    bias = plan.nbytes(f"H L {key_len}")
    busiest = max(
        (8 + 41) * distances,  # the distances and the bucketing's temporaries
        8 * distances + 2 * by_distance,  # the buckets, the lookup and its transposed copy
        by_distance + bias,  # the transposed copy and the bias
    )
    side = "both ways (encoder)" if config.mask != "causal" else "causal (decoder)"
    return plan.add(
        "position_bias",
        f"H L {key_len}",
        (scores,),
        what=f"relative position bias: key - query distances in {config.relative_buckets} "
        f"buckets, {side}, up to {config.relative_distance}; added in place, kept for the "
        "blocks after",
        scratch=busiest - bias,
    )


def _causal(config: LayerConfig) -> str:
    """The causal mask in words, with its sliding window."""
    if not config.window:
        return "causal"
    return f"causal, sliding window {config.window}: query i sees keys i - {config.window} < j <= i"
