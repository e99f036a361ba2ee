"""An attention sublayer in torch, recording every stage as it runs.

The textbook computation (seed 000's ``MultiHeadAttention``, seed 003's residual and
LayerNorm), written so that each tensor is released right after its last use: what it
holds at any moment is what ``memory.py`` predicts from the plan, whose stages are
``attnctl/stages/attention.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnctl.errors import AttnctlError
from attnctl.model.config import LayerConfig
from attnctl.model.describe import Attention
from attnctl.model.rope import attention_scaling
from attnctl.nn import Record, no_record, positions, ring_attention
from attnctl.nn.attention_state import AttentionResult, Call, Live, dims_of
from attnctl.nn.collectives import (
    TensorGroup,
    column_projection,
    gather_sequence,
    kept_shard,
    output_bias,
    reduce_partial,
)
from attnctl.nn.kv_cache import KVCache, keep
from attnctl.nn.scores import scale_scores, soft_cap


def norm(config: LayerConfig, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """LayerNorm or RMSNorm over the last dim, as the sublayer's config says."""
    if config.norm_type == "layer":
        return F.layer_norm(x, (x.shape[-1],), weight, bias, config.norm_eps)
    return F.rms_norm(x, (x.shape[-1],), weight, config.norm_eps)


def _scaled(table: torch.Tensor, scaling: float) -> torch.Tensor:
    """A float32 cos or sin table times RoPE's attention scaling, in place (1: as it is)."""
    return table if scaling == 1 else table.mul_(scaling)


def attention(
    sublayer: Attention,
    weights: dict[str, torch.Tensor],
    owned: list[torch.Tensor],
    context: list[torch.Tensor] | None = None,
    padding: torch.Tensor | None = None,
    record: Record = no_record,
    keep_weights: bool = False,
    window: tuple[list[int], list[int]] | None = None,
    training: bool = False,
    cache: list[torch.Tensor] | None = None,
    past: KVCache | None = None,
    offset: int = 0,
    position_bias: list[torch.Tensor] | None = None,
    group: TensorGroup | None = None,
) -> AttentionResult:
    """Run the sublayer on ``owned = [x]`` (B, L, D); it takes x out, so x is freed as soon
    as this sublayer is done with it.

    ``weights``: this sublayer's tensors by short name (``W_q.weight``, ``norm.bias``, ...).
    ``context = [c]``, c (B, Lc, D): cross-attention's keys and values come from it (taken
    out like x).
    ``padding`` (B, Lk) bool, True = a real key (SDPA's convention), gives padded keys
    weight exactly 0; ``nn.MultiheadAttention``'s key_padding_mask is its negation.
    ``keep_weights``: return the math path's (B, H, L, Lk) weights.
    ``window`` (heads, rows): also the softmax weights of those heads and query rows (on
    the SDPA path computed from the Q and K heads at hand).
    ``cache``: K and V heads (B, Hkv, n, d_k) are appended as a decoder keeps them, the last
    n = min(Lk, window) positions (all without a window), each its own copy.
    ``past``: a decoding step (math path): the new tokens' K and V join those kept from
    the steps before (and are kept for the next), or cross-attention's K and V are made
    once; ``offset``: the position of x's first token. ``position_bias = []``: T5's
    relative bias, appended by the block that computes it and read by those after.
    ``group``: one rank of a tensor-parallel split (``nn/collectives.py``): ``weights``
    are its heads' and ``sublayer`` its cut config; W_o's partial sums are added over the
    ranks, and under sequence parallelism x is this rank's (B, L/T, D), gathered first.
    """
    config = sublayer.config
    x = owned.pop()
    cross = sublayer.kind == "cross_attention"
    context = context.pop() if context is not None else None
    reused = cross and past is not None and past.keys is not None  # K, V made at step 0
    ring = ring_attention.current()  # context parallel: this rank holds L / C of the tokens
    if ring is not None and (cross or past is not None or padding is not None):
        raise AttnctlError("ring attention (--cp) runs self-attention over unpadded sequences")
    dims = dims_of(config, x, group, cross, context, past if reused else None)
    call = Call(sublayer, weights, record, padding, keep_weights, window, training, offset,
                 position_bias, past, group, ring, dims)  # fmt: skip
    live = Live(x, context)  # the steps take them: each freed when they are done with it
    del x, context

    # 1. project (from Norm(x) in a pre-norm sublayer), then split D into heads: views
    _project_queries(call, live)
    if reused:  # a decoding step: cross-attention's K and V heads are the first step's
        return _attend_kept_cross(call, live)
    _project_keys_values(call, live)
    _query_heads(call, live, record)
    _key_value_heads(call, live)
    if config.pos == "rope":  # rotate Q and K by their positions; V is left alone
        _rope_rotation(call, live, ring.length if ring is not None else offset + dims.seq_len)
    if cache is not None:  # what a decoder keeps of this block, as it uses them
        kept = sublayer.window or dims.key_len
        for kept_heads in (live.k, live.v):
            tail = kept_heads[:, :, -kept:]  # (B, Hkv, min(Lk, W), d_k)
            cache.append(tail.clone(memory_format=torch.contiguous_format))
    if past is not None:  # a decoding step: attend over what was kept and the new K, V
        return _decode_step(call, live)
    return _attend_sequence(call, live)


def _project_queries(call: Call, live: Live) -> None:
    """``live.h`` = x or Norm(x) (gathered under SP), and ``live.q`` = h · W_q (B, L, H·d_k)."""
    config, weights, record, group = call.sublayer.config, call.weights, call.record, call.group
    norm_weight, norm_bias = weights.get("norm.weight"), weights.get("norm.bias")
    live.h = live.x
    if config.norm == "pre":
        live.h = norm(config, live.x, norm_weight, norm_bias)  # (B, L, D)
        record("norm", live.h, call.dims.hidden)
    live.shard = kept_shard(group, live.h)  # what W_q, W_k, W_v keep for a training step under SP
    live.h = gather_sequence(group, live.h, record)  # sequence parallel: (B, L, D) from every rank
    if group is not None and group.sequence_parallel and not call.sublayer.residual:
        live.x = None  # no residual: the gathered sequence is all that is read from here
    live.q = column_projection(
        group, live.h, live.shard, weights["W_q.weight"], weights.get("W_q.bias")
    )  # (B, L, H·d_k)
    record("q", live.q, f"B L {call.dims.q_width}")
    if config.qk_norm == "all":  # OLMo 2: over every head at once, before the split
        q_norm_weight, q_norm_bias = weights["q_norm.weight"], weights.get("q_norm.bias")
        live.q = norm(config, live.q, q_norm_weight, q_norm_bias)  # (B, L, H·d_k)
        record("q_norm", live.q, f"B L {call.dims.q_width}")


def _project_keys_values(call: Call, live: Live) -> None:
    """``live.k``, ``live.v`` = h · W_k, h · W_v (B, Lk, Hkv·d_k), h the context in cross."""
    sublayer, weights, record, group = call.sublayer, call.weights, call.record, call.group
    config, kv_dims = sublayer.config, call.dims.kv_dims
    if sublayer.kind == "cross_attention":  # keys and values from the context (an encoder's)
        live.h = live.context
        live.context = None
        if not sublayer.residual:
            live.x = None  # no residual, and K and V come from the context: x is done
    live.k = column_projection(
        group, live.h, live.shard, weights["W_k.weight"], weights.get("W_k.bias")
    )  # (B, Lk, Hkv·d_k)
    record("k", live.k, kv_dims)
    if config.qk_norm == "all":
        k_norm_weight, k_norm_bias = weights["k_norm.weight"], weights.get("k_norm.bias")
        live.k = norm(config, live.k, k_norm_weight, k_norm_bias)  # (B, Lk, Hkv·d_k)
        record("k_norm", live.k, kv_dims)
    live.v = column_projection(
        group, live.h, live.shard, weights["W_v.weight"], weights.get("W_v.bias")
    )  # (B, Lk, Hkv·d_k)
    live.h = live.shard = None
    if not sublayer.residual:
        live.x = None  # no residual: x is not needed again
    record("v", live.v, kv_dims)


def _query_heads(call: Call, live: Live, record: Record) -> None:
    """``live.q`` (B, L, H·d_k) as heads (B, H, L, d_k): a view, normed first where it is."""
    config, weights, dims = call.sublayer.config, call.weights, call.dims
    live.q = live.q.view(dims.batch, dims.seq_len, config.heads, config.d_k)  # (B, L, H, d_k)
    if config.qk_norm == "head":  # Qwen3, Gemma 3: each head over its d_k, before RoPE
        live.q = norm(config, live.q, weights["q_norm.weight"], weights.get("q_norm.bias"))
        record("q_norm", live.q, "B L H d_k")
    live.q = live.q.transpose(1, 2)  # (B, H, L, d_k)
    record("q_heads", live.q, "B H L d_k")


def _key_value_heads(call: Call, live: Live) -> None:
    """``live.k``, ``live.v`` as heads (B, Hkv, Lk, d_k): views, K normed first where it is."""
    config, weights, record, dims = call.sublayer.config, call.weights, call.record, call.dims
    batch, key_len, kv_heads, d_k = dims.batch, dims.key_len, config.kv_heads, config.d_k
    live.k = live.k.view(batch, key_len, kv_heads, d_k)  # (B, Lk, Hkv, d_k)
    if config.qk_norm == "head":
        live.k = norm(config, live.k, weights["k_norm.weight"], weights.get("k_norm.bias"))
        record("k_norm", live.k, f"B {dims.key_len_dim} {'Hkv' if dims.grouped else 'H'} d_k")
    live.k = live.k.transpose(1, 2)  # (B, Hkv, Lk, d_k)
    record("k_heads", live.k, dims.kv_split)
    live.v = live.v.view(batch, key_len, kv_heads, d_k).transpose(1, 2)  # (B, Hkv, Lk, d_k)
    record("v_heads", live.v, dims.kv_split)


def _rope_rotation(call: Call, live: Live, length: int) -> None:
    """RoPE: Q and K heads turned by the new tokens' positions, at ``length``'s frequencies."""
    config, record, offset = call.sublayer.config, call.record, call.offset
    seq_len, d_k = call.dims.seq_len, config.d_k
    # the new tokens' positions only (a decoding step; a context-parallel rank's chunk),
    # at the frequencies of the whole sequence
    angles = positions.rotary_angles(
        length, d_k, live.q.device, config, start=offset, stop=offset + seq_len
    )  # (L, d_k), float32
    record("rope_angles", angles, "L d_k")
    scaling = attention_scaling(config.rope)  # yarn, longrope: cos and sin times it
    cos = _scaled(angles.cos(), scaling).to(live.q.dtype)  # (L, d_k)
    record("rope_cos", cos, "L d_k")
    sin = _scaled(angles.sin(), scaling).to(live.q.dtype)  # (L, d_k)
    del angles
    record("rope_sin", sin, "L d_k")
    live.q = positions.rotate(live.q, cos, sin)  # (B, H, L, d_k)
    record("q_rotated", live.q, "B H L d_k")
    live.k = positions.rotate(live.k, cos, sin)  # (B, Hkv, L, d_k)
    del cos, sin
    record("k_rotated", live.k, call.dims.kv_split)


def _attend_kept_cross(call: Call, live: Live) -> AttentionResult:
    """A decoding step of cross-attention, over the K, V heads the first step kept in past."""
    past = call.past
    live.h = None
    _query_heads(call, live, no_record)  # (B, H, L, d_k)
    return _attend(
        call.sublayer, call.weights, live.x, live.q, past.keys, past.values, call.padding,
        call.record, call.keep_weights, call.window, call.offset, call.position_bias, past,
        key_start=0,
    )  # fmt: skip


def _decode_step(call: Call, live: Live) -> AttentionResult:
    """A decoding step: the new K, V heads join (and are kept with) past's, then attend."""
    past, dims = call.past, call.dims
    key_start = past.start
    if call.sublayer.kind != "cross_attention" and past.keys is not None:
        live.k = torch.cat((past.keys, live.k), dim=2)  # (B, Hkv, T, d_k)
        live.v = torch.cat((past.values, live.v), dim=2)  # (B, Hkv, T, d_k)
    keep(past, call.sublayer.window, live.k, live.v)
    return _attend(
        call.sublayer, call.weights, live.x, live.q, live.k, live.v, call.padding, call.record,
        call.keep_weights, call.window, call.offset, call.position_bias, past, key_start,
        (dims.key_len_dim, dims.q_width),
    )  # fmt: skip


def _attend_sequence(call: Call, live: Live) -> AttentionResult:
    """Steps 2 to 4 over a whole sequence: math, SDPA or a ring's attention, W_o, residual."""
    sublayer, record, ring, dims = call.sublayer, call.record, call.ring, call.dims
    config = sublayer.config
    if dims.grouped and config.impl == "math" and ring is None:  # each K/V head serves `groups`
        live.k = live.k.repeat_interleave(config.groups, dim=1)  # (B, H, Lk, d_k)
        record("k_repeated", live.k, f"B H {dims.key_len_dim} d_k")
        live.v = live.v.repeat_interleave(config.groups, dim=1)  # (B, H, Lk, d_k)
        record("v_repeated", live.v, f"B H {dims.key_len_dim} d_k")

    # 2. scaled dot-product attention, per head
    kept = shown = None
    if ring is not None:  # ring attention over every rank's K, V chunk (nn/ring_attention.py)
        held = [live.q, live.k, live.v]
        live.q = live.k = live.v = None  # the ring takes them: each freed when it is done with it
        attended = ring_attention.attend(config, held, ring, record)  # (B, H, L, d_k)
    elif config.impl == "math":
        attended, kept, shown = _math_attention(call, live)
    else:
        attended, shown = _sdpa_attention(call, live)
    live.v = None
    record("weighted_values", attended, "B H L d_k")
    held = [attended]  # the helper takes them: each is freed when it is done with it
    del attended
    residual = []
    if sublayer.residual:  # (without a residual x was freed already)
        residual.append(live.x)
        live.x = None
    output, attention_output = _output(
        sublayer, call.weights, held, residual, record, dims.q_width, call.group
    )
    return AttentionResult(output, attention_output, kept, shown)


def _scores(call: Call, live: Live) -> torch.Tensor:
    """The math path's (B, H, L, Lk) scores from Q and K (freed): scaled, capped, biased, masked."""
    sublayer, padding, record, dims = call.sublayer, call.padding, call.record, call.dims
    config, seq_len, key_len_dim = sublayer.config, dims.seq_len, dims.key_len_dim
    scores = scale_scores(config, torch.matmul(live.q, live.k.transpose(-2, -1)))  # (B, H, L, Lk)
    live.q = live.k = None
    if config.softcap:  # Gemma 2: cap·tanh(scores/cap), before any mask or bias
        record("scores", scores, f"B H L {key_len_dim}")
        scores = soft_cap(scores, config.softcap)  # in place
        if padding is not None:  # padded keys: -inf before the softmax
            scores.masked_fill_(padding.logical_not()[:, None, None, :], float("-inf"))
        record("softcap", scores, f"B H L {key_len_dim}")
    else:
        if padding is not None:  # padded keys: -inf before the softmax
            scores.masked_fill_(padding.logical_not()[:, None, None, :], float("-inf"))
        record("scores", scores, f"B H L {key_len_dim}")
    if config.pos == "relative":  # T5: a learned bias by bucketed distance
        position_bias = call.position_bias
        scores += _relative_bias(sublayer, call.weights, position_bias, seq_len, dims.key_len, 0, 0)
        record("position_bias", position_bias[0], f"H L {key_len_dim}")
    if config.pos == "alibi":  # distance penalties, one slope per head
        bias = positions.alibi_bias(config.heads, seq_len, scores.device, scores.dtype)  # (H, L, L)
        scores += bias  # (B, H, L, L), in place
        record("alibi", bias, "H L L")  # after use: the add belongs to this stage
        del bias
    if config.mask == "causal":
        # (L, L), True = may attend; with a sliding window only the last `window` keys
        allowed = positions.visible_keys(seq_len, config.window, scores.device)
        record("mask", allowed, "L L")
        scores.masked_fill_(allowed.logical_not(), float("-inf"))
        del allowed
    return scores


def _math_attention(
    call: Call, live: Live
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """softmax(scores) · V: (attended (B, H, L, d_k), weights kept, weights shown)."""
    config, record, key_len_dim = call.sublayer.config, call.record, call.dims.key_len_dim
    scores = _scores(call, live)
    probabilities = torch.softmax(scores, dim=-1)  # (B, H, L, Lk)
    del scores
    record("weights", probabilities, f"B H L {key_len_dim}")
    kept = shown = None
    if call.window is not None:  # the weights shown: a slice of these
        window_heads, window_rows = call.window
        shown = probabilities[:, window_heads][:, :, window_rows]  # (B, h, r, Lk)
    if call.training and config.dropout > 0:  # training only: zero some weights
        dropped = F.dropout(probabilities, config.dropout)  # (B, H, L, Lk)
        record("dropout", dropped, f"B H L {key_len_dim}")
        attended = torch.matmul(dropped, live.v)  # (B, H, L, d_k)
        del dropped
    else:
        attended = torch.matmul(probabilities, live.v)  # (B, H, L, d_k)
    if call.keep_weights:
        kept = probabilities
    del probabilities
    return attended, kept, shown


def _sdpa_attention(call: Call, live: Live) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused kernel on Q, K, V (Q, K freed): (attended (B, H, L, d_k), weights shown)."""
    config, padding, record = call.sublayer.config, call.padding, call.record
    if config.softcap:  # validate refuses it: never computed without the cap
        raise AttnctlError("softcap needs the math path: SDPA cannot soft-cap the scores")
    q, seq_len, causal = live.q, call.dims.seq_len, config.mask == "causal"
    gqa = {"enable_gqa": True} if call.dims.grouped else {}  # the kernel groups K/V natively
    # bool attn_mask: True = may attend; a float one is added to the scores
    attn_mask = None if padding is None else padding[:, None, None, :]  # (B, 1, 1, L)
    is_causal = causal
    if config.pos == "alibi":  # the bias as a float mask, -inf where a key is blocked
        attn_mask = _alibi_attn_mask(
            config.heads, seq_len, causal, attn_mask, q, record, config.window
        )
        is_causal = False  # in the float mask already (SDPA takes one or the other)
    elif config.window:  # sliding window: the (L, L) mask itself, True = may attend
        allowed = positions.visible_keys(seq_len, config.window, q.device)
        record("mask", allowed, "L L")
        attn_mask = allowed if attn_mask is None else allowed & attn_mask  # (B, 1, L, L)
        del allowed
        is_causal = False  # in the mask already
    # scale None: the kernel's own 1/√d_k
    attended = F.scaled_dot_product_attention(
        q,
        live.k,
        live.v,
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=config.query_scale or None,
        **gqa,
    )
    del attn_mask
    # attended: (B, H, L, d_k)
    shown = None
    if call.window is not None:  # the weights shown, while Q and K are at hand
        shown = window_weights(config, q, live.k, *call.window, padding)
    del q
    live.q = live.k = None
    return attended, shown


def _output(
    sublayer: Attention,
    weights: dict[str, torch.Tensor],
    held: list[torch.Tensor],
    residual: list[torch.Tensor],
    record: Record,
    q_width: str,
    group: TensorGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 3 and 4, for a whole sequence and for a decoding step: ``held = [attended]``
    (B, H, L, d_k) and ``residual = [x]`` (or [] without a residual), both taken out.
    Returns (the sublayer's output, W_o's output), each (B, L, D). ``group``: W_o holds
    this rank's heads' columns; its partial sums are added over the ranks (its bias
    after the sum), under sequence parallelism keeping this rank's (B, L/T, D)."""
    config = sublayer.config
    attended = held.pop()
    batch, heads, seq_len, d_k = attended.shape

    # 3. heads side by side again, then the output projection
    concat = attended.transpose(1, 2).contiguous()  # (B, L, H, d_k)
    concat = concat.view(batch, seq_len, heads * d_k)  # (B, L, H·d_k)
    del attended
    record("concat", concat, f"B L {q_width}")
    bias = weights.get("W_o.bias")
    attention_output = F.linear(concat, weights["W_o.weight"], output_bias(group, bias))
    del concat  # (B, L, D) above
    record("output_projection", attention_output, "B L D")
    attention_output = reduce_partial(group, attention_output, record, bias=bias)  # the sum
    hidden = "B L D" if group is None else group.hidden

    # 4. residual, then the norm in a post-norm sublayer (as in the original Transformer)
    output = attention_output
    if sublayer.output_norm:  # Gemma, OLMo 2: the attention output normalised first
        post_weight, post_bias = weights["post_norm.weight"], weights.get("post_norm.bias")
        output = norm(config, attention_output, post_weight, post_bias)  # (B, L, D)
        record("post_norm", output, hidden)
    if residual:
        x = residual.pop()
        output = x + output  # (B, L, D)
        del x
        record("residual", output, hidden)
    if config.norm == "post":
        output = norm(config, output, weights.get("norm.weight"), weights.get("norm.bias"))
        record("norm", output, hidden)
    return output, attention_output


def _alibi_attn_mask(
    heads: int,
    seq_len: int,
    causal: bool,
    allowed: torch.Tensor | None,
    like: torch.Tensor,
    record: Record,
    window: int = 0,
) -> torch.Tensor:
    """ALiBi for SDPA: the (H, L, L) bias with -inf where a key is blocked, as a float mask.

    The math path adds the same bias to the scores and sets the same keys to -inf, so the
    softmax sees equal numbers. ``allowed`` (B, 1, 1, L) bool, True = a real key, or None;
    with it the mask is (B, H, L, L). Users cannot pick this path (``validate`` refuses
    sdpa with alibi: the memory of a float mask inside CPU SDPA is not modelled); ``check``
    builds it to compare with the math path.
    """
    bias = positions.alibi_bias(heads, seq_len, like.device, like.dtype)  # (H, L, L)
    record("alibi", bias, "H L L")
    if causal:  # (and a sliding window's)
        visible = positions.visible_keys(seq_len, window, bias.device)  # (L, L)
        bias.masked_fill_(visible.logical_not(), float("-inf"))
    if allowed is not None:  # padded keys: -inf in every head and row of their text
        bias = bias.masked_fill(allowed.logical_not(), float("-inf"))  # (B, H, L, L)
    return bias


def window_weights(
    config: LayerConfig,
    q: torch.Tensor,
    k: torch.Tensor,
    heads: list[int],
    rows: list[int],
    padding: torch.Tensor | None,
) -> torch.Tensor:
    """Softmax weights of ``heads`` x ``rows`` from Q heads (B, H, L, d_k) and K heads
    (B, Hkv, Lk, d_k), as rotated (RoPE) as the attention uses them: (B, h, r, Lk), the
    math path's slice, without ever building the (B, H, L, Lk) weights."""
    device = q.device
    heads_t = torch.tensor(heads, device=device)
    rows_t = torch.tensor(rows, device=device)
    q = q[:, heads_t][:, :, rows_t]  # (B, h, r, d_k)
    k = k[:, heads_t // config.groups]  # (B, h, Lk, d_k): the K head each query head reads
    scores = scale_scores(config, torch.matmul(q, k.transpose(-2, -1)))  # (B, h, r, Lk)
    del q, k
    if config.softcap:
        scores = soft_cap(scores, config.softcap)
    keys = torch.arange(scores.shape[-1], device=device)
    if config.pos == "alibi":  # -m_h·|row - key|, for the heads and rows shown only
        distance = (keys.unsqueeze(0) - rows_t.unsqueeze(1)).abs().float()  # (r, L)
        slopes = positions.alibi_slopes(config.heads, device)[heads_t]  # (h,)
        bias = distance * slopes.neg_().view(-1, 1, 1)  # (h, r, L), float32 like alibi_bias
        scores += bias.to(scores.dtype)
        del bias
    if config.mask == "causal":
        allowed = keys.unsqueeze(0) <= rows_t.unsqueeze(1)  # (r, L), True = may attend
        if config.window:  # and only the last `window` keys: j > i - window
            allowed &= keys.unsqueeze(0) > rows_t.unsqueeze(1) - config.window
        scores.masked_fill_(allowed.logical_not(), float("-inf"))
    if padding is not None:  # (B, L), True = a real token
        scores.masked_fill_(padding.logical_not()[:, None, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1)  # (B, h, r, L)


def _relative_bias(
    sublayer: Attention,
    weights: dict[str, torch.Tensor],
    position_bias: list[torch.Tensor] | None,
    seq_len: int,
    key_len: int,
    offset: int,
    key_start: int,
) -> torch.Tensor:
    """T5's (H, L, Lk) bias: computed by the block that holds the table, reused after."""
    if position_bias is None:
        raise AttnctlError("T5's relative position bias needs the list the blocks share")
    if sublayer.computes_bias:
        config = sublayer.config
        bias = positions.relative_bias(
            weights["relative_bias.weight"],  # (buckets, H)
            offset,
            seq_len,
            key_start,
            key_len,
            bidirectional=config.mask != "causal",
            max_distance=config.relative_distance,
        )  # (H, L, Lk)
        position_bias.clear()
        position_bias.append(bias)
    return position_bias[0]


def _attend(
    sublayer: Attention,
    weights: dict[str, torch.Tensor],
    x: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    padding: torch.Tensor | None,
    record: Record,
    keep_weights: bool,
    window: tuple[list[int], list[int]] | None,
    offset: int,
    position_bias: list[torch.Tensor] | None,
    past: KVCache,
    key_start: int,
    dims: tuple[str, str] = ("L", "D"),
) -> AttentionResult:
    """A decoding step's attention (the math path): Q heads (B, H, L, d_k) of the new
    tokens at ``offset``… over K, V heads (B, Hkv, Lk, d_k) of positions ``key_start``…

    Its stages go to ``record`` under the whole sequence's names, ``dims`` naming the
    keys' and the heads' width (the first step over an empty cache records what the
    plan of the whole sequence names)."""
    config = sublayer.config
    seq_len = x.shape[1]
    key_len = k.shape[2]
    key_len_dim, q_width = dims
    if config.kv_heads != config.heads:  # each K/V head serves `groups` query heads
        k = k.repeat_interleave(config.groups, dim=1)  # (B, H, Lk, d_k)
        record("k_repeated", k, f"B H {key_len_dim} d_k")
        v = v.repeat_interleave(config.groups, dim=1)  # (B, H, Lk, d_k)
        record("v_repeated", v, f"B H {key_len_dim} d_k")
    scores = scale_scores(config, torch.matmul(q, k.transpose(-2, -1)))  # (B, H, L, Lk)
    del q, k
    if config.softcap:
        record("scores", scores, f"B H L {key_len_dim}")
        scores = soft_cap(scores, config.softcap)
    if padding is not None:  # padded keys (the source's, in cross-attention): -inf
        scores.masked_fill_(padding.logical_not()[:, None, None, :], float("-inf"))
    record("softcap" if config.softcap else "scores", scores, f"B H L {key_len_dim}")
    if config.pos == "relative":
        scores += _relative_bias(
            sublayer, weights, position_bias, seq_len, key_len, offset, key_start
        )
        record("position_bias", position_bias[0], f"H L {key_len_dim}")
    if config.pos == "alibi":
        raise AttnctlError("attnctl decodes no ALiBi model step by step")
    if config.mask == "causal":
        queries = torch.arange(offset, offset + seq_len, device=scores.device)  # (L,)
        keys = torch.arange(key_start, key_start + key_len, device=scores.device)  # (Lk,)
        allowed = positions.visible(queries, keys, config.window)  # (L, Lk)
        record("mask", allowed, f"L {key_len_dim}")
        scores.masked_fill_(allowed.logical_not(), float("-inf"))
    probabilities = torch.softmax(scores, dim=-1)  # (B, H, L, Lk)
    del scores
    record("weights", probabilities, f"B H L {key_len_dim}")
    shown = None
    if window is not None:
        window_heads, window_rows = window
        shown = probabilities[:, window_heads][:, :, window_rows]  # (B, h, r, Lk)
    attended = torch.matmul(probabilities, v)  # (B, H, L, d_k)
    kept = probabilities if keep_weights else None
    del probabilities, v
    record("weighted_values", attended, "B H L d_k")
    held = [attended]
    del attended
    residual = [x] if sublayer.residual else []
    del x
    output, attention_output = _output(sublayer, weights, held, residual, record, q_width)
    return AttentionResult(output, attention_output, kept, shown, key_start)
