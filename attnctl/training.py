"""Memory of one training step (forward, backward, Adam), replayed without torch.

Inference frees a tensor after its last use; training keeps what autograd saves for
the backward pass, then allocates gradients in the order the autograd engine runs.
The replay below follows the layer's code and that order op by op (the measured
timeline of `memory --measure --train` is what it was written against), so its peak
is the peak of the real step, not a sum of guesses.

The step is: forward, ``loss = output.sum()``, ``loss.backward()``, ``Adam.step()``
(foreach=False). In float32 Adam updates the parameters directly. In float16 and
bfloat16 it is mixed precision: float32 master weights live beside the model for the
whole run, their float32 gradients are made from the model's just before the step,
and Adam's two moments are float32.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnctl.config import DTYPE_BYTES
from attnctl.errors import AttnctlError
from attnctl.plan import Plan

FP32 = 4


@dataclass(frozen=True)
class TrainingEstimate:
    parameter_bytes: int  # the model's weights in its dtype (stack)
    gradient_bytes: int  # their gradients, same dtype (stack)
    master_bytes: int  # float32 master weights (mixed precision only)
    optimizer_bytes: int  # Adam's two float32 moments
    saved_bytes: int  # what one layer keeps for backward when its forward ends
    peak_bytes: int  # parameters + the most alive at once during the whole step
    peak_phase: str  # "forward", "backward" or "optimizer step"
    layers: int = 1


class _Replay:
    """Alive tensors by name; an op frees first, then allocates, then the peak is read."""

    def __init__(self) -> None:
        self.live: dict[str, int] = {}
        self.current = 0
        self.peak = 0
        self.peak_phase = ""
        self.phase = "forward"

    def op(self, *allocs: tuple[str, int], free: tuple[str, ...] = (), transient: int = 0) -> None:
        for name in free:
            self.current -= self.live.pop(name)
        for name, nbytes in allocs:
            assert name not in self.live, name
            self.live[name] = nbytes
            self.current += nbytes
        if self.current + transient > self.peak:
            self.peak, self.peak_phase = self.current + transient, self.phase


def estimate_training(plan: Plan, layers: int = 1) -> TrainingEstimate:
    config, sizes = plan.config, plan.sizes
    if config.impl not in ("math", "sdpa"):
        raise AttnctlError(f"cannot replay training for impl {config.impl!r}")
    if "Lc" in sizes:
        raise AttnctlError("memory --train does not model cross-attention yet (inference does)")
    for option, value, modelled in (
        ("--kv-heads", config.kv_heads, config.heads),
        ("--softcap", config.softcap, 0.0),
        ("--qk-norm", config.qk_norm, "none"),
        ("--window", config.window, 0),
        (
            "--head-dim",
            config.head_dim,
            None if config.q_width != config.d_model else config.head_dim,
        ),
        ("--norm", config.norm, None if config.norm == "pre" else config.norm),
        ("--norm-type", config.norm_type, "layer"),
        ("--pos", config.pos, config.pos if config.pos in ("sinusoidal", "none") else None),
        ("output_bias", config.output_bias, True),
    ):
        if value != modelled:
            raise AttnctlError(
                f"memory --train does not model {option} {value} yet (inference does)"
            )
    e = DTYPE_BYTES[config.dtype]
    mixed = config.dtype != "float32"
    b, length, d, h = sizes["B"], sizes["L"], sizes["D"], sizes["H"]
    unit = b * length * d * e  # one (B, L, D) activation
    matrix = b * h * length * length * e  # one (B, H, L, L) matrix
    half = (d + 1) // 2
    params = [(p.name, p.count) for p in plan.parameters]
    shared = sum(n for name, n in params if name.startswith("embedding."))
    per_layer = sum(n for _, n in params) - shared
    stack_count = shared + layers * per_layer

    r = _Replay()
    if mixed:  # float32 master weights exist for the whole run
        r.op(("masters", stack_count * FP32))
    r.op(("ids", b * length * 8))

    # ---- forward with autograd: tensors saved for backward stay alive
    r.op(("emb", unit))
    x = "emb"
    if config.pos == "sinusoidal":
        r.op(("table", length * d * e), transient=FP32 * (length + half + 2 * length * half))
        r.op(("x", unit))
        r.op(free=("emb", "table"))
        x = "x"
    r.op(("q", unit))  # each projection saves its input x
    r.op(("k", unit))
    r.op(("v", unit))
    causal = config.mask == "causal"
    if config.impl == "math":
        r.op(("scores", matrix))  # bmm saves q and k
        if causal:
            r.op(("allowed", length * length))
            r.op(("blocked", length * length))  # masked_fill_ saves it
            r.op(("weights", matrix), free=("allowed",))
        else:
            r.op(("weights", matrix))  # softmax saves its output
        r.op(free=("scores",))
        dropout = config.dropout > 0
        if dropout:  # the mask (activation dtype on CPU) and the dropped weights are saved
            r.op(("dropout_mask", matrix))
            r.op(("dropped", matrix))
        r.op(("attended", unit))  # bmm saves the (dropped) weights and v
        r.op(("concat", unit))  # W_o saves concat
        r.op(free=("attended",))
    else:
        r.op(("attended", unit), ("logsumexp", b * h * length * FP32))  # all saved
        r.live["concat"] = 0  # a view of attended: W_o saves it, no new bytes
    r.op(("out", unit))
    post = config.norm == "post"
    if post:
        r.op(("residual", unit))
        r.op(("normed", unit), ("mean", b * length * FP32), ("rstd", b * length * FP32))
    output = "normed" if post else "out"
    r.op(("loss", e))
    saved = r.current - r.live["ids"] - r.live.get("masters", 0) - unit * (2 if post else 1)

    # ---- backward, in the order the autograd engine runs it
    r.phase = "backward"
    r.op(("seed", e), free=(output, "out") if post else (output,))
    grads: list[str] = []

    def param_grad(name: str, nbytes: int) -> None:
        r.op((name, nbytes))
        grads.append(name)

    x_grad: str | None = None
    if post:
        r.op(("g_residual", unit), ("g_norm.weight", d * e), ("g_norm.bias", d * e))
        grads += ["g_norm.weight", "g_norm.bias"]
        r.op(free=("residual", "mean", "rstd"))
        x_grad = "g_residual"  # the residual add sends the same gradient to x and to W_o
    _linear_backward(r, "o", unit, d * d * e, d * e, config.bias, param_grad, "g_concat")
    if config.impl == "math":
        r.op(free=("concat",))
        r.op(("g_v", unit))
        if dropout:
            r.op(("g_dropped", matrix))
            r.op(free=("v", "g_concat", "dropped"))
            r.op(("g_weights", matrix))
            r.op(free=("dropout_mask", "g_dropped"))
        else:
            r.op(("g_weights", matrix))
            r.op(free=("v", "g_concat"))
        r.op(("g_scores", matrix))
        if causal:
            r.op(("g_masked", matrix), free=("weights", "g_weights"))
            r.op(("g_scaled", matrix), free=("blocked", "g_scores"))
            r.op(free=("g_masked",))
        else:
            r.op(("g_scaled", matrix), free=("weights", "g_weights"))
            r.op(free=("g_scores",))
        r.op(("g_q", unit))
        r.op(("g_k", unit))
        r.op(free=("q", "k", "g_scaled"))
        for name in ("g_k", "g_q"):  # the head split's view needs contiguous gradients
            r.op((name + "'", unit))
            r.op(free=(name,))
            r.live[name] = r.live.pop(name + "'")
    else:
        r.op(("g_q", unit), ("g_k", unit), ("g_v", unit))
        r.op(free=("q", "k", "v", "attended", "logsumexp", "g_concat", "concat"))
    pending: tuple[str, ...] = ()  # an accumulation's inputs, freed at the next op
    for position, proj in enumerate(("v", "k", "q")):
        if pending:
            r.op(free=pending)
            pending = ()
        part = f"g_x_{proj}"
        _linear_backward(r, proj, unit, d * d * e, d * e, config.bias, param_grad, part)
        last = position == 2  # the last projection's backward releases the saved x
        r.op(free=(f"g_{proj}", x) if last else (f"g_{proj}",))
        if x_grad is None:
            x_grad = part
        else:  # x's gradient buffer: old + new, out of place
            total = f"g_x_after_{proj}"
            r.op((total, unit))
            pending, x_grad = (x_grad, part), total
    r.op(("g_embedding.weight", shared * e), free=pending)
    grads.append("g_embedding.weight")
    r.op(free=(x_grad, "seed"))

    # ---- optimizer step
    r.phase = "optimizer step"
    step = stack_count * FP32
    if mixed:  # float32 gradients for the masters, made from the model's
        r.op(("master_grads", step))
    r.op(("adam_moments", 2 * step), ("adam_steps", len(params) * FP32))
    # per tensor, Adam makes sqrt(v) and the quotient `denom`; the previous tensor's
    # denom is freed only when the new one is assigned
    sizes_fp32 = [n * FP32 for _, n in params]
    r.op(transient=max(2 * s + p for s, p in zip(sizes_fp32, [0, *sizes_fp32], strict=False)))

    model_bytes = stack_count * e
    stack_extra = (layers - 1) * (per_layer * e + saved)  # more weights' grads, more saved
    return TrainingEstimate(
        parameter_bytes=model_bytes,
        gradient_bytes=stack_count * e,
        master_bytes=step if mixed else 0,
        optimizer_bytes=2 * step,
        saved_bytes=saved,
        peak_bytes=model_bytes + r.peak + stack_extra,
        peak_phase=r.peak_phase,
        layers=layers,
    )


def _linear_backward(
    r: _Replay, proj: str, unit: int, weight: int, bias: int, has_bias: bool, param_grad, out: str
) -> None:
    """A linear layer's backward: the input's gradient and the weight's (and bias's)."""
    if has_bias:  # addmm: input grad first, then weight, then bias
        r.op((out, unit))
        param_grad(f"g_W_{proj}.weight", weight)
        param_grad(f"g_W_{proj}.bias", bias)
    else:  # mm: weight grad first
        param_grad(f"g_W_{proj}.weight", weight)
        r.op((out, unit))
