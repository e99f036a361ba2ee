"""`attnctl check`: one configuration through three implementations and gradcheck.

The math path (every weight built), the same layer with SDPA, and torch's own
``nn.MultiheadAttention`` given the same W_q, W_k, W_v, W_o: the attention outputs (and
the weights, where both sides have them) must agree within a tolerance for the dtype.
``torch.autograd.gradcheck`` then checks the layer's backward in float64.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from attnctl.config import LayerConfig
from attnctl.layer import TORCH_DTYPES, AttentionLayer, causal_mask, resolve_device

# max |a - b| allowed, by dtype
TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 5e-2}


@dataclass(frozen=True)
class Comparison:
    a: str
    b: str
    what: str  # "output" (the attention output, before any residual) or "weights"
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


def reference_mha(layer: AttentionLayer) -> nn.MultiheadAttention:
    """torch's own multi-head attention with this layer's W_q, W_k, W_v, W_o copied in."""
    config = layer.config
    weight = layer.W_q.weight
    mha = nn.MultiheadAttention(config.d_model, config.heads, bias=config.bias, batch_first=True)
    mha = mha.to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([layer.W_q.weight, layer.W_k.weight, layer.W_v.weight]))
        mha.out_proj.weight.copy_(layer.W_o.weight)
        if config.bias:
            mha.in_proj_bias.copy_(torch.cat([layer.W_q.bias, layer.W_k.bias, layer.W_v.bias]))
            if layer.W_o.bias is not None:  # else W_o has none (output_bias = false)
                mha.out_proj.bias.copy_(layer.W_o.bias)
            else:
                mha.out_proj.bias.zero_()
    return mha.eval()


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
        layer = AttentionLayer(dataclasses.replace(config, impl=impl), vocab_size)
        return layer.to(device=device, dtype=dtype).eval()

    math_layer, sdpa_layer = build("math"), build("sdpa")
    tolerance = TOLERANCE[config.dtype]

    def diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a.double() - b.double()).abs().max().item()

    with torch.no_grad():
        math = math_layer(token_ids, **inputs)
        sdpa = sdpa_layer(token_ids, **inputs)
        comparisons = [
            Comparison(
                "math", "sdpa", "output", diff(math.attention_output, sdpa.attention_output),
                tolerance,
            )
        ]  # fmt: skip
        skipped = []
        if config.kv_heads != config.heads:
            skipped.append("nn.MultiheadAttention has no grouped K/V heads (--kv-heads)")
        elif config.pos in ("rope", "alibi"):
            skipped.append(f"nn.MultiheadAttention cannot apply --pos {config.pos} inside")
        else:
            x = _layer_input(math_layer, token_ids)
            source = x  # keys and values: the text itself, or the context
            if config.cross:
                source = math_layer.embed(math_layer.embedding(inputs["context_ids"]))
            blocked = ~causal_mask(seq_len, device) if config.mask == "causal" else None
            mha_output, mha_weights = reference_mha(math_layer)(
                x, source, source, attn_mask=blocked, need_weights=True, average_attn_weights=False
            )
            comparisons += [
                Comparison("math", "nn.MultiheadAttention", "output",
                           diff(math.attention_output, mha_output), tolerance),
                Comparison("math", "nn.MultiheadAttention", "weights",
                           diff(math.weights, mha_weights), tolerance),
                Comparison("sdpa", "nn.MultiheadAttention", "output",
                           diff(sdpa.attention_output, mha_output), tolerance),
            ]  # fmt: skip
    passed, note = _gradcheck(config, vocab_size)
    return CheckResult(comparisons, passed, note, str(device), skipped)


def _layer_input(layer: AttentionLayer, token_ids: torch.Tensor) -> torch.Tensor:
    """What the projections read: embeddings (+ positions), normed first in a pre-norm layer."""
    x = layer.embed(layer.embedding(token_ids))  # (B, L, D)
    return layer.norm(x) if layer.config.norm == "pre" else x


def _gradcheck(config: LayerConfig, vocab_size: int) -> tuple[bool, str]:
    """gradcheck in float64 on the CPU, small sizes: embeddings -> the layer's output."""
    small = dataclasses.replace(config, d_model=config.heads * 2, impl="math", device="cpu")
    # (kv_heads still divides heads, so the grouped path is checked too)
    torch.manual_seed(config.seed)
    layer = AttentionLayer(small, vocab_size).double()
    embeddings = torch.randn(2, 3, small.d_model, dtype=torch.float64, requires_grad=True)
    context = {"context_ids": torch.randint(0, vocab_size, (2, 4))} if config.cross else {}
    try:
        passed = torch.autograd.gradcheck(
            lambda e: layer(None, embeddings=e, **context).output,
            (embeddings,),
            eps=1e-6,
            atol=1e-5,
        )
    except RuntimeError as error:  # gradcheck raises with the mismatching Jacobians
        return False, str(error).strip().splitlines()[0]
    shape = f"(2, 3, {small.d_model})"
    return bool(passed), f"float64 CPU, embeddings {shape} -> output, {small.heads} heads"
