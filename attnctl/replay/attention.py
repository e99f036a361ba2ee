"""What autograd does at each stage of an attention sublayer: its entries in the table
of ``replay/stages.py`` (projections, q/k norms, heads, RoPE, K/V repeats, scores, the
softcap, masks, softmax, dropout, the weighted values, concat, residual).

Written, like the others, against the measured timeline of ``memory --measure --train``.
"""

from __future__ import annotations

from attnctl.model.describe import Attention
from attnctl.replay.autograd import Tensor
from attnctl.replay.stages import (
    FP32,
    Walk,
    entry,
    linear,
    norm_over_last,
    row_parallel_linear,
)
from attnctl.trace import Stage


@entry("q", "k", "v", "output_projection")
def _projection(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    name = {"q": "W_q", "k": "W_k", "v": "W_v", "output_projection": "W_o"}[walk.base]
    bias = walk.config.bias and (name != "W_o" or walk.config.output_bias)
    if name == "W_o":  # under tensor parallelism its bias is added after the ranks' sum
        return row_parallel_linear(walk, stage, ins[0], name, bias)
    strided = walk.base == "k" and _key_gradient_is_strided(walk)
    x = walk.column_input(stage, ins[0])
    return linear(walk, stage, x, name, bias, strided_gradient=strided)


def _key_gradient_is_strided(walk: Walk) -> bool:
    """Whether K's gradient comes back from Q·Kᵀ's bmm laid out (B, H, d_k, L): its view
    as (B, L, H·d_k) needs no copy in the heads' backward, but it is not contiguous, so
    the projection's backward copies it when it flattens it to (B·L, H·d_k) (B > 1)."""
    config = walk.config
    if config.impl != "math" or config.pos == "rope" or config.kv_heads != config.heads:
        return False
    if walk.plan.context_parallel > 1:  # ring attention's backward makes it contiguous
        return False
    # a norm over every head gets it; a LayerNorm of each head's d_k returns a contiguous
    # one, an RMSNorm's elementwise ops one laid out as it came
    if config.qk_norm == "all" or (config.qk_norm == "head" and config.norm_type == "layer"):
        return False
    k_heads = walk.stage(walk.qualified("k_heads"))
    batch, length = k_heads.shape[0], k_heads.shape[2]
    # one head too (a rank's under T = H): F.linear's copy then takes the original's
    # place at once, but a sequence-parallel projection's backward holds both
    return batch > 1 and length > 1


def block_window(walk: Walk) -> int:
    """The sliding window of the block being replayed (Gemma's alternate: 0 = global)."""
    blocks = walk.plan.description.blocks  # a checkpoint's every one; a stack's one
    block = blocks[walk.block] if walk.plan.model is not None else blocks[0]
    return next(s.config.window for s in block.sublayers if isinstance(s, Attention))


@entry("q_heads", "k_heads", "v_heads")
def _split_heads(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    """view(B, L, H, d_k).transpose(1, 2): no bytes. Its backward views the gradient back
    as (B, L, D), which copies a gradient laid out (B, H, L, d_k)."""
    (x,) = ins
    r = walk.replay
    out = r.view(x)
    walk.split.add(stage.name)
    heads, length = stage.shape[1], stage.shape[2]
    config = walk.config
    copies = heads > 1 and length > 1
    direct = config.impl == "math" and config.pos != "rope" and config.kv_heads == config.heads
    if walk.base == "k_heads" and direct:
        # bmm's gradient for a transposed K views back as (B, L, H·d_k) without a copy;
        # with B > 1 the projection's backward copies it (``_key_gradient_is_strided``)
        copies = False
    if config.impl == "sdpa" and config.pos != "rope":
        copies = False  # the fused backward returns each gradient in its input's layout
    steps = (("grad", 0, x.nbytes),) if copies else (("pass", 0),)
    return r.node(out, (x,), (), steps)


@entry("q_norm", "k_norm")
def _qk_norm(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    """Q or K normalised: over every head at once (B, L, H·d_k), or over each head's d_k
    on the view (B, L, H, d_k), whose node hands the gradient back to the projection."""
    r = walk.replay
    (x,) = ins
    if walk.config.qk_norm == "head":  # q.view(B, L, H, d_k)
        x = r.node(r.view(x), (x,), (), (("pass", 0),))
    return norm_over_last(walk, stage, x, walk.config.norm_type, walk.param(walk.base))


# ------------------------------------------------------------------ positions in the heads


@entry("rope_angles", "rope_cos", "rope_sin")
def _rope_table(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    return walk.replay.new(stage.bytes, transient=stage.scratch)  # no gradient


@entry("q_rotated", "k_rotated")
def _rotate(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    """positions.rotate: x·cos + cat(-x[..., d/2:], x[..., :d/2])·sin, every op a node."""
    r = walk.replay
    x, cos, sin = ins
    full, half = stage.bytes, stage.bytes // 2
    with_cos = r.node(r.new(full), (x,), (cos,), (("grad", 0, full),))  # x * cos
    upper = r.node(r.view(x), (x,), (), (("grad", 0, full),))  # x[..., d/2:]: slice_backward
    negated = r.node(r.new(half), (upper,), (), (("grad", 0, half),))
    lower = r.node(r.view(x), (x,), (), (("grad", 0, full),))  # x[..., :d/2]
    turned = r.node(r.new(full), (negated, lower), (), (("pass", 0), ("pass", 1)))  # cat
    r.drop(negated.storage)
    product = r.node(r.new(full), (turned,), (sin,), (("grad", 0, full),))  # turned * sin
    out = r.node(r.view(with_cos), (with_cos, product), (), (("pass", 0), ("pass", 1)))  # +=
    r.drop(product.storage)
    r.drop(turned.storage)
    walk.split.add(stage.name)  # elementwise ops keep x's (B, L, H, d_k) memory order
    return out


@entry("k_repeated", "v_repeated")
def _repeat(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    """repeat_interleave: unsqueeze, expand, reshape (a copy); its backward sums the
    groups back into the K/V heads."""
    r = walk.replay
    (x,) = ins
    return r.node(r.new(stage.bytes), (x,), (), (("grad", 0, x.nbytes),))


# ------------------------------------------------------------------ scores and weights


def _operand(walk: Walk, name: str, tensor: Tensor, stage_of: Stage) -> Tensor:
    """matmul's reshape of a (B, H, L, d_k) operand to (B·H, L, d_k): a copy when the
    heads do not merge (the copy is what bmm keeps)."""
    if name in walk.split and walk.merges_badly(stage_of):
        r = walk.replay
        copy = r.new(tensor.nbytes)
        r.node(copy, (tensor,), (), (("pass", 0),))
        return copy
    return tensor


@entry("scores")
def _scores(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    r = walk.replay
    q_name, k_name = stage.reads
    q = _operand(walk, q_name, ins[0], walk.stage(q_name))
    k = _operand(walk, k_name, ins[1], walk.stage(k_name))
    out = r.new(stage.bytes)  # bmm keeps both operands
    r.node(out, (q, k), (q, k), (("grad", 0, q.nbytes), ("grad", 1, k.nbytes)))
    for operand, given in ((q, ins[0]), (k, ins[1])):
        if operand is not given:
            r.drop(operand.storage)  # matmul's temporary: only bmm holds it now
    scaled = r.node(r.view(out), (out,), (), (("grad", 0, stage.bytes),))  # .div_(√d_k)
    if "padding_mask" in walk.tensors and not walk.config.softcap:  # else after the cap
        name = walk.qualified("scores")

        def mask_padding() -> None:  # after `del q, k`: masked_fill_ keeps the negated mask
            negated = r.new(walk.tensors["padding_mask"].nbytes)
            masked = r.node(r.view(out), (scaled,), (negated,), (("grad", 0, stage.bytes),))
            r.drop(negated.storage)
            walk.tensors[name] = masked

        walk.then.append(mask_padding)
    return scaled


@entry("softcap")
def _softcap(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    """Gemma 2: tanh(scores / cap) * cap, out of place under autograd (tanh keeps its
    output); the capped scores replace the scores, which are freed; then padded keys."""
    r = walk.replay
    (scores,) = ins
    divided = r.node(r.new(stage.bytes), (scores,), (), (("grad", 0, stage.bytes),))
    tanh = r.new(stage.bytes)
    r.node(tanh, (divided,), (tanh,), (("grad", 0, stage.bytes),))
    r.drop(divided.storage)
    capped = r.node(r.new(stage.bytes), (tanh,), (), (("grad", 0, stage.bytes),))
    r.drop(tanh.storage)
    r.drop(scores.storage)  # `scores = soft_cap(scores)`: the uncapped ones go
    if "padding_mask" in walk.tensors:  # masked_fill_ keeps the negated mask
        negated = r.new(walk.tensors["padding_mask"].nbytes)
        capped = r.node(r.view(capped), (capped,), (negated,), (("grad", 0, stage.bytes),))
        r.drop(negated.storage)
    walk.tensors[walk.qualified("scores")] = capped
    return capped


@entry("alibi")
def _alibi(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    r = walk.replay
    bias = r.new(stage.bytes, transient=stage.scratch)
    scores = walk.tensors[walk.qualified("scores")]
    walk.tensors[walk.qualified("scores")] = r.node(r.view(scores), (scores,), (), (("pass", 0),))
    return bias


@entry("mask")
def _causal(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    r = walk.replay
    if walk.config.impl != "math":  # SDPA's (L, L) attn_mask for a sliding window
        if not block_window(walk):  # a block without one (Gemma's global layers): is_causal
            return r.new(0, read=False)
        return r.new(stage.bytes)
    (scores,) = ins
    allowed = r.new(stage.bytes)
    name = walk.qualified("scores")

    def fill() -> None:  # after the mask is recorded: masked_fill_(allowed.logical_not())
        blocked = r.new(stage.bytes)  # kept by masked_fill_
        filled = r.node(r.view(scores), (scores,), (blocked,), (("grad", 0, scores.nbytes),))
        r.drop(blocked.storage)
        walk.tensors[name] = filled

    walk.later.append(fill)
    return allowed


@entry("weights")
def _softmax(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    r = walk.replay
    scores = walk.tensors[walk.qualified("scores")]  # the latest in-place version
    out = r.new(stage.bytes)
    return r.node(out, (scores,), (out,), (("grad", 0, stage.bytes),))


@entry("dropout")
def _dropout(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    r = walk.replay
    (weights,) = ins
    mask = r.new(stage.bytes)  # in the activation dtype on CPU, kept by the product
    out = r.new(stage.bytes)
    r.node(out, (weights,), (mask,), (("grad", 0, stage.bytes),))
    r.drop(mask.storage)
    return out


@entry("weighted_values")
def _weighted_values(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    r = walk.replay
    if walk.config.impl == "math":
        v_name = stage.reads[1]
        weights = ins[0]
        v = _operand(walk, v_name, ins[1], walk.stage(v_name))
        out = r.new(stage.bytes)
        steps: tuple[tuple, ...] = (("grad", 1, v.nbytes), ("grad", 0, weights.nbytes))
        if walk.merges_badly(stage):  # the incoming (B, H, L, d_k) gradient is a view of
            steps = (("temp", "g", stage.bytes), ("drop_incoming",), *steps, ("free", "g"))
        r.node(out, (weights, v), (weights, v), steps)
        if v is not ins[1]:
            r.drop(v.storage)
        return out
    q, k, v = ins[:3]
    saved = [q, k, v]
    padded = "padding_mask" in walk.tensors
    keys = walk.sizes.get("Lc", walk.sizes["L"])
    mask_bytes = walk.sizes["B"] * keys  # (B, 1, 1, Lk) bool
    # a sliding window's (L, L) bool mask (causal: no padding mask)
    windowed = len(ins) > 3 and block_window(walk) > 0
    assert not (windowed and padded)
    if windowed:
        mask_bytes = ins[3].nbytes
    if padded or windowed:  # the bool mask as an additive one: where(m, 0, -inf)
        scalars = [r.new(walk.e), r.new(walk.e)]
        saved.append(r.new(mask_bytes * walk.e))  # kept
        for scalar in scalars:
            r.drop(scalar.storage)
    out = r.new(stage.bytes, read=False)
    logsumexp = r.new(walk.sizes["B"] * walk.sizes["H"] * walk.sizes["L"] * FP32)
    r.node(
        out, (q, k, v), (*saved, out, logsumexp),
        (("grad", 0, q.nbytes), ("grad", 1, k.nbytes), ("grad", 2, v.nbytes)),
    )  # fmt: skip
    r.drop(logsumexp.storage)
    for tensor in saved[3:]:
        r.drop(tensor.storage)
    return out


@entry("concat")
def _concat(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    r = walk.replay
    (attended,) = ins
    out = r.view(attended) if stage.view_of else r.new(stage.bytes)  # .contiguous()
    return r.node(out, (attended,), (), (("pass", 0),))


@entry("residual")
def _residual(walk: Walk, stage: Stage, ins: list[Tensor]) -> Tensor:
    r = walk.replay
    out = r.new(stage.bytes)
    return r.node(out, tuple(ins), (), (("pass", 0), ("pass", 1)))
