"""Text helpers shared by every view: user text made printable, labels, one-line summaries."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from attnctl.literal import printable
from attnctl.model.config import LayerConfig
from attnctl.trace import Token

if TYPE_CHECKING:  # the plan's module is not needed to print a line
    from attnctl.stages.plan import Plan

LABEL_WIDTH = 10  # longest token label in weight tables before it is shortened
MAX_TEXT = 200  # characters of the input shown in the header
WIDE = 120  # from this width on, stage tables add a column explaining each stage


# ---------------------------------------------------------------- text helpers


def token_label_text(text: str, width: int = LABEL_WIDTH) -> str:
    label = printable(text)
    if label.strip() == "":
        label = label.replace(" ", "␣") or "∅"
    return label if len(label) <= width else label[: width - 1] + "…"


def token_label(token: Token, width: int | None = None) -> str:
    return token_label_text(token.text, width or 10**6)


def shape_text(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def config_line(config: LayerConfig, plan: Plan | None = None) -> str:
    """The layer's options in one line; ``plan``'s model's positions when its embeddings
    add them (GPT-2's and BERT's learned table, Marian's sinusoids) and the attention
    adds none (``pos none`` would read as no positions at all)."""
    kv = f", kv {config.kv_heads}" if config.kv_heads != config.heads else ""
    pos = config.pos
    description = None if plan is None else plan.description
    added = "none" if description is None else description.embeddings.positions
    if pos == "none" and added != "none":
        pos = f"{added.removesuffix('_halves')} (embeddings)"
    return (
        f"d_model {config.d_model} · heads {config.heads} (d_k {config.d_k}{kv}) · "
        f"pos {pos} · mask {config.mask} · norm {config.norm}"
        f"{' (rms)' if config.norm_type == 'rms' and config.norm != 'none' else ''} · "
        f"impl {config.impl} · bias {_bias_text(config)}{_math_text(config)}"
    )


def _math_text(config: LayerConfig) -> str:
    """The attention math that is not the textbook's, when set (issue 11's options)."""
    scaled = config.pos == "rope" and config.rope_type != "default"
    parts = [
        f"rope {config.rope_type} ×{config.rope_factor:g}" if scaled else "",
        f"window {config.window}" if config.window else "",
        f"qk-norm {config.qk_norm}" if config.qk_norm != "none" else "",
        f"query scale {config.query_scale:g}" if config.query_scale else "",
        f"softcap {config.softcap:g}" if config.softcap else "",
    ]
    return "".join(f" · {part}" for part in parts if part)


def _bias_text(config: LayerConfig) -> str:
    if not config.bias:
        return "off"
    return "on" if config.output_bias else "on (not W_o)"


def sizes_line(plan: Plan) -> str:
    grouped = plan.sizes["Hkv"] != plan.sizes["H"]  # K/V widths only matter under GQA
    shown = {k: v for k, v in plan.sizes.items() if grouped or k not in ("Hkv", "D_kv")}
    return "  ".join(f"{k}={v}" for k, v in shown.items())


def weight_text(weight: float, digits: int) -> str:
    """Fixed decimals, unless that would print a non-zero weight as 0.00 (then 3.1e-04)."""
    if weight == 0 or weight >= 0.5 * 10**-digits:
        return f"{weight:.{digits}f}"
    return f"{weight:.1e}"


def model_lines(plan: Plan, layer: int | None = None) -> list[tuple[str, str]]:
    """Header lines naming a pretrained model (none for attnctl's own layer)."""
    model = plan.model
    if model is None:
        return []
    where = f" · block {layer}" if layer is not None else ""
    return [("model", f"{printable(str(model.path))}{where}"), ("config", model.summary())]


def shown_text(text: str) -> str:
    shown = printable(text)
    if len(shown) > MAX_TEXT:
        shown = f"{shown[:MAX_TEXT]}… ({len(text):,} characters in all)"
    return shown


def difference_bound(difference: float) -> str:
    """A difference as the next power of ten above it (``< 1e-06``); 0 stays ``0``.

    Float noise differs between CPUs (AVX2 and AVX-512 round differently), so the exact
    value is not shown on screen (it is in --json); the bound itself can move by a power
    of ten between machines (the README's examples are compared allowing for it).
    """
    if difference == 0:
        return "0"
    if not math.isfinite(difference):
        return str(difference)  # nan or inf: nothing to bound
    exponent = math.floor(math.log10(difference)) + 1
    while 10.0**exponent <= difference:  # log10 may round either way at a power of ten
        exponent += 1
    while 10.0 ** (exponent - 1) > difference:
        exponent -= 1
    return f"< 1e{exponent:+03d}"


# ---------------------------------------------------------------- a CUDA plan


def kernel_text(plan: Plan) -> str:
    """The SDPA kernels of a CUDA plan, as "cuDNN, bfloat16, sm_90" (empty without one)."""
    if plan.cuda is None or not plan.sdpa_kernels:
        return ""
    labels = list(dict.fromkeys(choice.label for choice in plan.sdpa_kernels))
    return f"{' and '.join(labels)}, {plan.config.dtype}, {plan.cuda.gpu.sm}"


def fallback_texts(plan: Plan) -> list[str]:
    """One warning per SDPA call of the plan that falls back to the math kernel."""
    from attnctl.memory.estimate import format_bytes
    from attnctl.stages.cuda import fallbacks

    return [
        f"SDPA falls back to the math kernel ({choice.reason}): it builds the B·H·L·Lk "
        f"matrices a fused kernel avoids, {format_bytes(cost)} more"
        for choice, cost in fallbacks(plan.device_lines, plan.sdpa_kernels)
    ]


def cuda_rows(plan: Plan) -> list[tuple[str, str]]:
    """Header rows of a CUDA plan: the GPU and rules assumed, the SDPA kernel, warnings."""
    target = plan.cuda
    if target is None:
        return []
    rows = [("GPU", f"{target.summary()} · {target.verification()}")]
    kernel = kernel_text(plan)
    if kernel:
        rows.append(("SDPA", kernel))
    rows += [("warning", text) for text in fallback_texts(plan)]
    return rows
