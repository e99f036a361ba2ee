"""The options commands share: the layer options (and --model), --json, --seq-len, --batch.

Choices come from config.py, the one place that lists them. The options arrive as given:
``app.resolve_layer`` validates them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from enum import Enum, StrEnum
from typing import Annotated, Any

import typer

from attnctl.app import LayerRequest
from attnctl.model.config import (
    DTYPES,
    IMPLS,
    MASKS,
    NORM_TYPES,
    NORMS,
    POSITIONS,
    QK_NORMS,
    ROPE_TYPES,
)
from attnctl.model.families import supported_names

# Choices come from config.py, the one place that lists them.
Pos = StrEnum("Pos", {value: value for value in POSITIONS})
Mask = StrEnum("Mask", {value: value for value in MASKS})
Norm = StrEnum("Norm", {value: value for value in NORMS})
NormType = StrEnum("NormType", {value: value for value in NORM_TYPES})
QkNorm = StrEnum("QkNorm", {value: value for value in QK_NORMS})
RopeType = StrEnum("RopeType", {value: value for value in ROPE_TYPES})
Impl = StrEnum("Impl", {value: value for value in IMPLS})
DType = StrEnum("DType", {value: value for value in DTYPES})


def _option(kind: Any, *names: str, help: str) -> Any:
    metavar = None
    if isinstance(kind, type) and issubclass(kind, Enum):
        # a short metavar and the choices in the help text, where they wrap between words
        # (a long [a|b|c] metavar is broken mid-word on narrow terminals)
        metavar = names[0].split("-")[-1].upper()  # --norm-type: TYPE
        help = f"{help} One of: {', '.join(choice.value for choice in kind)}."
    option = typer.Option(*names, help=help, metavar=metavar, rich_help_panel="Layer")
    return Annotated[kind | None, option]


# name -> annotation; every one defaults to None, meaning "not given: keep the preset's value"
LAYER_OPTIONS: dict[str, Any] = {
    "config": _option(
        str, "--config", "-c", help="Preset name (one of configs/*.toml) or a TOML path."
    ),
    "tokenizer": _option(
        str, "--tokenizer", help="'bundled' (default), 'char', or a tokenizer.json path."
    ),
    "d_model": _option(int, "--d-model", help="Model width D. Default 512."),
    "heads": _option(
        int, "--heads", help="Attention heads H (must divide D unless --head-dim). Default 8."
    ),
    "kv_heads": _option(
        int,
        "--kv-heads",
        help="Key/value heads for GQA (divides --heads; 1 = MQA). Default --heads.",
    ),
    "head_dim": _option(int, "--head-dim", help="Width d_k of each head; 0 = D / H. Default 0."),
    "bias": _option(bool, "--bias/--no-bias", help="Bias in W_q, W_k, W_v, W_o. Default --bias."),
    "pos": _option(
        Pos,
        "--pos",
        help="Added to the embeddings (sinusoidal, learned), rotating Q and K (rope) or "
        "biasing the scores (alibi). Default sinusoidal.",
    ),
    "mask": _option(Mask, "--mask", help="Attention mask. Default none."),
    "window": _option(
        int,
        "--window",
        help="Sliding window (with --mask causal): query i sees keys i-W < j <= i; "
        "0 = none. Default 0.",
    ),
    "window_pattern": _option(
        str,
        "--sliding",
        help="Which layers of a stack slide, repeated: s slides, f sees every earlier key "
        "(Gemma 3: sssssf). Default: every layer.",
    ),
    "rope_theta": _option(
        float,
        "--rope-theta",
        help="RoPE's base: pair i turns at base to the power -2i/d_k. Default 10000.",
    ),
    "rope_type": _option(
        RopeType,
        "--rope-type",
        help="RoPE's long-context scaling (with --pos rope; yarn's betas, longrope's factor "
        "lists and the rest are preset keys). Default default.",
    ),
    "rope_factor": _option(
        float, "--rope-factor", help="The scaling factor of --rope-type. Default 1."
    ),
    "rope_original_max_positions": _option(
        int,
        "--rope-length",
        help="The length the scaling starts from (llama3, yarn, longrope; dynamic: the "
        "trained length). Default 8192.",
    ),
    "norm": _option(
        Norm,
        "--norm",
        help="post: Norm(x + attn(x)); pre: x + attn(Norm(x)); none: attn(x). Default post.",
    ),
    "norm_type": _option(NormType, "--norm-type", help="LayerNorm or RMSNorm. Default layer."),
    "qk_norm": _option(
        QkNorm,
        "--qk-norm",
        help="Normalise q and k (a --norm-type norm): each head over d_k (Qwen3), or all "
        "heads at once before the split (OLMo 2). Default none.",
    ),
    "query_scale": _option(
        float,
        "--query-scale",
        help="Multiplies Q·Kᵀ (Gemma: 1/√s, s its pre-attention scalar); 0 = 1/√d_k. Default 0.",
    ),
    "softcap": _option(
        float,
        "--softcap",
        help="Soft-cap the scores: cap·tanh(s/cap) before masks (Gemma 2); math path "
        "only; 0 = off. Default 0.",
    ),
    "impl": _option(
        Impl,
        "--impl",
        help="math builds every weight; sdpa is the fused kernel; auto is math while every "
        "weight is shown, else sdpa. Default auto.",
    ),
    "dropout": _option(
        float, "--dropout", help="Dropout on the attention weights (memory --train). Default 0."
    ),
    "seed": _option(int, "--seed", help="Seed of the weights (torch's manual_seed). Default 42."),
    "device": _option(str, "--device", help="auto, cpu, cuda, cuda:N or mps. Default auto."),
    "dtype": _option(DType, "--dtype", help="Parameter and activation dtype. Default float32."),
    "gpu": _option(
        str,
        "--gpu",
        help="Plan for this GPU, from any machine: h200, h100, a100-80gb, a100-40gb, l4, "
        "rtx-4090 (memory, compute capability, workspaces).",
    ),
    "torch_rules": _option(
        str,
        "--torch",
        help="The torch version whose CUDA rules the plan follows (SDPA kernels, "
        "workspaces), like 2.11. Default: the installed torch.",
    ),
}


MODEL_OPTION = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        metavar="DIR",
        help="A local model folder (config.json, model.safetensors, tokenizer.json): "
        f"{supported_names()}. Its config sets the layer.",
        rich_help_panel="Model",
    ),
]


def layer_options(
    command: Callable[..., None] | None = None,
    *,
    leave_out: tuple[str, ...] = (),
    with_model: bool = False,
) -> Any:
    """Give a command the layer options; it receives them as one ``layer``, a
    :class:`LayerRequest` that ``app.resolve_layer`` turns into the validated layer.

    ``leave_out`` names options the command does not offer (they keep the preset's value).
    ``with_model`` adds ``--model DIR``: then the layer comes from the model's config.json
    (the request's ``model_dir``). Use it bare (``@layer_options``) or with arguments
    (``@layer_options(leave_out=...)``).
    """
    if command is None:
        return functools.partial(layer_options, leave_out=leave_out, with_model=with_model)
    unknown = set(leave_out) - set(LAYER_OPTIONS)
    if unknown:
        raise ValueError(f"no such layer option: {sorted(unknown)}")
    offered = {name: kind for name, kind in LAYER_OPTIONS.items() if name not in leave_out}
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != "layer"]
    shared = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=kind)
        for name, kind in offered.items()
    ]
    if with_model:
        shared.append(
            inspect.Parameter(
                "model", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=MODEL_OPTION
            )
        )

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> None:
        given = {name: kwargs.pop(name, None) for name in LAYER_OPTIONS}
        values = {k: v.value if isinstance(v, Enum) else v for k, v in given.items()}
        directory = kwargs.pop("model", None) if with_model else None
        command(layer=LayerRequest(values, directory), **kwargs)

    wrapper.__signature__ = signature.replace(parameters=own + shared)  # type: ignore[attr-defined]
    return wrapper


JsonOption = Annotated[bool, typer.Option("--json", help="Print only JSON on stdout.")]
SaveOption = Annotated[
    str | None,
    typer.Option(
        "--save",
        metavar="FILE",
        help="Also write every recorded stage's tensor and the attention (every head, as "
        "--json has it) to FILE.safetensors, with the config and tokens as metadata.",
    ),
]
HtmlOption = Annotated[
    str | None,
    typer.Option(
        "--html",
        metavar="FILE",
        help="Also write a self-contained HTML report to FILE, with the weights --json "
        "holds: every head (those --head names, with --head) and the query rows computed "
        "(--rows; with --generate or an encoder–decoder every row).",
    ),
]
SeqLenOption = Annotated[int, typer.Option("--seq-len", "-L", help="Sequence length L.")]
BatchOption = Annotated[int, typer.Option("--batch", "-B", help="Batch size B.")]
ContextLenOption = Annotated[
    int | None,
    typer.Option("--context-len", help="Cross-attention: keys and values from a context of N."),
]
GenerateOption = Annotated[
    int | None,
    typer.Option(
        "--generate",
        metavar="N",
        help="With --model: append N tokens greedily with a KV cache, and show each step "
        "(stops early when every text has ended). An encoder–decoder always generates: "
        "default 20.",
        rich_help_panel="Model",
    ),
]
EncoderLayerOption = Annotated[
    str | None,
    typer.Option(
        "--encoder-layer",
        metavar="N",
        help="An encoder–decoder's encoder block to show (-1 = the last). Default --layer's "
        "block, else the last.",
        rich_help_panel="Model",
    ),
]


SVG_OPTION = Annotated[
    str | None,
    typer.Option(
        "--svg",
        metavar="FILE",
        help="Also save the terminal view as a self-contained SVG (no font or URL to fetch).",
    ),
]


def svg_option(command: Callable[..., None]) -> Any:
    """Give a command ``--svg FILE``: what it prints is recorded and saved as an SVG.

    The path is checked before the command runs (exit 2: see :mod:`attnctl.output_files`;
    the command refuses its own output files naming the same file), and refused with
    ``--json`` (there is no terminal view to draw). The file is written after the command
    (also when it exits with a code, as ``check`` does when a comparison fails); an error
    during the run writes nothing.
    """
    signature = inspect.signature(command, eval_str=True)
    svg = inspect.Parameter(
        "svg", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=SVG_OPTION
    )

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> None:
        given = kwargs.pop("svg", None)
        if given is None:
            command(**kwargs)
            return
        from attnctl.errors import USAGE, AttnctlError
        from attnctl.output_files import claimed
        from attnctl.render.svg import check_svg_path, recording, write_svg

        if kwargs.get("as_json"):
            raise AttnctlError("--svg draws the terminal view: not with --json", exit_code=USAGE)
        output = check_svg_path(given)
        title = f"attnctl {command.__name__}"
        with recording() as consoles, claimed(output):  # the command's own outputs: not here
            try:
                command(**kwargs)
            except typer.Exit:
                write_svg(consoles, output, title)
                raise
        write_svg(consoles, output, title)

    wrapper.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*signature.parameters.values(), svg]
    )
    return wrapper


View = StrEnum("View", {value: value for value in ("tables", "heatmap")})
ViewOption = Annotated[
    View,
    typer.Option(
        "--view",
        metavar="VIEW",
        help="How weights show: tables (numbers) or heatmap (coloured cells, two query "
        "rows a line; shade characters without colour). One of: tables, heatmap.",
    ),
]
