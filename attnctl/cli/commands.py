"""The commands: each parses its options, calls one use case (``app``) and hands its report
to :mod:`attnctl.cli.output`, which draws it. torch and tokenizers are imported only by the
use cases that run."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from attnctl.app.requests import (
    CheckRequest,
    LayerRequest,
    MemoryRequest,
    RunRequest,
    ShapesRequest,
)
from attnctl.cli import output
from attnctl.cli.application import app
from attnctl.cli.options import (
    BatchOption,
    ContextLenOption,
    EncoderLayerOption,
    GenerateOption,
    HtmlOption,
    JsonOption,
    SaveOption,
    SeqLenOption,
    View,
    ViewOption,
    layer_options,
    svg_option,
)
from attnctl.errors import RUNTIME, USAGE, AttnctlError
from attnctl.literal import printable
from attnctl.model.layout import RECOMPUTE, Layout, parse_stage_sizes
from attnctl.window import DEFAULT_ROWS


# dropout acts only in training (memory --train)
@app.command()
@svg_option
@layer_options(leave_out=("dropout",), with_model=True)
def run(
    text: Annotated[
        list[str] | None,
        typer.Argument(
            help="The sentence to run ('-' reads stdin, like --file -); several make a batch, "
            "padded on the right.",
            metavar="TEXT...",
        ),
    ] = None,
    file: Annotated[
        str | None,
        typer.Option("--file", "-f", help="Read the text from this file ('-' for stdin)."),
    ] = None,
    context: Annotated[
        list[str] | None,
        typer.Option(
            "--context",
            help="Cross-attention: keys and values from this text (once for every TEXT, or "
            "once per TEXT).",
        ),
    ] = None,
    context_file: Annotated[
        str | None,
        typer.Option("--context-file", help="Like --context, reading the context from a file."),
    ] = None,
    head: Annotated[
        list[int] | None,
        typer.Option("--head", help="Show this head's weights (repeatable). Default: heads 0–7."),
    ] = None,
    rows: Annotated[
        list[str] | None,
        typer.Option(
            "--rows",
            help="Query rows to compute and show: A:B, last:N, N or all (repeatable). "
            f"Default: all up to {DEFAULT_ROWS}, else the first and last {DEFAULT_ROWS // 2}.",
        ),
    ] = None,
    digits: Annotated[int, typer.Option("--digits", help="Decimals in weight tables.")] = 2,
    force: Annotated[
        bool, typer.Option("--force", help="Run even when the estimate exceeds free memory.")
    ] = False,
    block: Annotated[
        str | None,
        typer.Option(
            "--layer",
            metavar="N|all",
            help="With --model: the block to show, 0-based like output_attentions (-1 = the "
            "last), or 'all' for a summary of every block. Default 0 (--generate, and an "
            "encoder–decoder's decoder: the last).",
            rich_help_panel="Model",
        ),
    ] = None,
    generate: GenerateOption = None,
    encoder_block: EncoderLayerOption = None,
    view: ViewOption = View.tables,
    as_json: JsonOption = False,
    save: SaveOption = None,
    html: HtmlOption = None,
    tp: Annotated[
        int,
        typer.Option(
            "--tp",
            help="Tensor parallel: run split over this many processes on this machine "
            "(torch.distributed: gloo on the CPU, NCCL on CUDA), each with its share of the "
            "heads and feed-forward columns; the output equals one device's.",
            rich_help_panel="Parallel",
        ),
    ] = 1,
    sp: Annotated[
        bool,
        typer.Option(
            "--sp",
            help="With --tp: sequence parallel, the norms and residuals on L/T tokens each.",
            rich_help_panel="Parallel",
        ),
    ] = False,
    *,
    layer: LayerRequest,
) -> None:
    """Run one attention layer on TEXT (a batch for several) and show every stage and weights."""
    from attnctl.app.save import checked_save_path, save_run
    from attnctl.output_files import refuse_same_file

    if (tp != 1 or sp) and html is not None:  # before any file is claimed or process started
        raise AttnctlError("run --tp does not write --html yet: leave one of them out")
    save_target = None if save is None else checked_save_path(save)
    html_target = None
    if html is not None:  # the page's module loads only when a page is written
        from attnctl.render.html import check_html_path

        html_target = check_html_path(html)
    refuse_same_file(save_target, html_target)  # and --svg's, claimed around the command
    heatmap = view == View.heatmap
    if heatmap and as_json:
        raise AttnctlError(
            "--view heatmap is not available with --json: it draws the weights in the "
            "terminal (--json carries every weight)",
            exit_code=USAGE,
        )
    every_weight = as_json or save is not None or html is not None
    request = RunRequest(
        layer, text, file, context, context_file, head, rows, digits, force, block,
        every_weight, generate, encoder_block, save, tp, sp,
    )  # fmt: skip
    from attnctl.app.use_cases import run_use_case

    report = run_use_case(request, output.hooks())
    if every_weight:  # one document for stdout, the tensors file and the page
        document = output.document(report)
        if save_target is not None:
            save_run(save_target, document, report)
        if html_target is not None:
            from attnctl.render.html import write_html

            write_html(html_target, document)
        if as_json:
            output.print_json(document, "run")
            return
    output.show(report, "run", heatmap=heatmap)


SrcLenOption = Annotated[
    int | None,
    typer.Option("--src-len", help="An encoder–decoder's source length S (the encoder's L)."),
]
TgtLenOption = Annotated[
    int | None,
    typer.Option("--tgt-len", help="An encoder–decoder's target length T (the decoder's L)."),
]


@app.command()
@svg_option
@layer_options(leave_out=("dropout",), with_model=True)
def shapes(
    seq_len: Annotated[
        int | None, typer.Option("--seq-len", "-L", help="Sequence length L. Default 16.")
    ] = None,
    batch: BatchOption = 1,
    context_len: ContextLenOption = None,
    src_len: SrcLenOption = None,
    tgt_len: TgtLenOption = None,
    as_json: JsonOption = False,
    *,
    layer: LayerRequest,
) -> None:
    """Show the shape of every stage for a configuration, symbolically and with numbers."""
    from attnctl.app.use_cases import shapes_use_case

    plan = shapes_use_case(ShapesRequest(layer, seq_len, batch, context_len, src_len, tgt_len))
    output.show(plan, "shapes", as_json=as_json)


SPLIT = "Split over devices"  # memory's parallelism options, a panel of their own
Recompute = StrEnum("Recompute", {value: value for value in RECOMPUTE})


@app.command()
@svg_option
@layer_options(with_model=True)
def memory(
    seq_len: Annotated[
        str | None,
        typer.Option(
            "--seq-len",
            "-L",
            help="Sequence length L, or several: 512,2048,8192. Default 2048 (fewer for a "
            "model with fewer positions).",
        ),
    ] = None,
    batch: BatchOption = 1,
    context_len: ContextLenOption = None,
    layers: Annotated[int, typer.Option("--layers", help="Scale to a stack of N such layers.")] = 1,
    kv_cache: Annotated[
        int | None,
        typer.Option("--kv-cache", help="Tokens the KV cache holds.  Default: --seq-len."),
    ] = None,
    budget: Annotated[
        str | None,
        typer.Option("--budget", help="Solve the longest L and largest B that fit, e.g. 16GiB."),
    ] = None,
    fit_device: Annotated[
        bool,
        typer.Option("--fit", help="Like --budget, with the free memory of --device."),
    ] = False,
    train: Annotated[
        bool,
        typer.Option("--train", help="A training step: + gradients, Adam, saved activations."),
    ] = False,
    measure: Annotated[
        bool,
        typer.Option(
            "--measure", help="Also run the layer and measure its memory (imports torch)."
        ),
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Measure even when the estimate exceeds free memory.")
    ] = False,
    src_len: SrcLenOption = None,
    tgt_len: TgtLenOption = None,
    generate: Annotated[
        int | None,
        typer.Option(
            "--generate",
            help="A decoder-only model's KV cache after N more tokens (the prompt: --seq-len).",
        ),
    ] = None,
    tp: Annotated[
        int,
        typer.Option(
            "--tp", help="Tensor parallel: heads, FFN columns over T.", rich_help_panel=SPLIT
        ),
    ] = 1,
    sp: Annotated[
        bool, typer.Option("--sp", help="Sequence parallel (with --tp).", rich_help_panel=SPLIT)
    ] = False,
    cp: Annotated[
        int, typer.Option("--cp", help="Context parallel: L over C.", rich_help_panel=SPLIT)
    ] = 1,
    pp: Annotated[int, typer.Option("--pp", help="Pipeline stages P.", rich_help_panel=SPLIT)] = 1,
    pp_blocks: Annotated[
        str | None,
        typer.Option(
            "--pp-blocks",
            metavar="LIST",
            help="Blocks per stage, e.g. 7,8x14,7. Default even.",
            rich_help_panel=SPLIT,
        ),
    ] = None,
    dp: Annotated[
        int, typer.Option("--dp", help="Data-parallel copies D.", rich_help_panel=SPLIT)
    ] = 1,
    zero: Annotated[
        int,
        typer.Option("--zero", help="ZeRO stage 0-3 (with --dp, --train).", rich_help_panel=SPLIT),
    ] = 0,
    micro_batch: Annotated[
        int | None,
        typer.Option(
            "--micro-batch", help="Micro-batch size. Default --batch.", rich_help_panel=SPLIT
        ),
    ] = None,
    recompute: Annotated[
        Recompute,
        typer.Option(
            "--recompute",
            metavar="WHAT",
            help="With --train: none, selective or full.",
            rich_help_panel=SPLIT,
        ),
    ] = Recompute.none,
    as_json: JsonOption = False,
    *,
    layer: LayerRequest,
) -> None:
    """Estimate memory: parameters, every activation, the B·H·L·L matrices, peak, per dtype."""
    stage_sizes = parse_stage_sizes(pp_blocks) if pp_blocks is not None else ()
    if stage_sizes and pp == 1:
        pp = len(stage_sizes)
    layout = Layout(tp, sp, cp, pp, dp, zero, micro_batch, recompute.value, stage_sizes)
    request = MemoryRequest(
        layer=layer,
        seq_len=seq_len,
        batch=batch,
        context_len=context_len,
        layers=layers,
        kv_cache=kv_cache,
        budget=budget,
        fit_device=fit_device,
        train=train,
        measure=measure,
        force=force,
        src_len=src_len,
        tgt_len=tgt_len,
        generate=generate,
        layout=layout,
    )
    from attnctl.app.use_cases import memory_use_case

    output.show(memory_use_case(request, output.hooks()), "memory", as_json=as_json)


@app.command()
@svg_option
@layer_options(leave_out=("dropout", "gpu", "torch_rules"))
def check(
    seq_len: SeqLenOption = 16,
    batch: BatchOption = 2,
    force: Annotated[
        bool, typer.Option("--force", help="Run even when the estimate exceeds free memory.")
    ] = False,
    as_json: JsonOption = False,
    *,
    layer: LayerRequest,
) -> None:
    """Compare the math path, SDPA and nn.MultiheadAttention, and gradcheck the layer."""
    from attnctl.app.use_cases import check_use_case

    report = check_use_case(CheckRequest(layer, seq_len, batch, force), output.hooks())
    output.show(report, "check", as_json=as_json)
    if not report.result.ok:
        raise typer.Exit(RUNTIME)


@app.command()
def tokenizer(
    folder: Annotated[
        Path,
        typer.Argument(
            metavar="DIR",
            help="A Marian (opus-mt) folder with source.spm and vocab.json, or a T5 folder "
            "with spiece.model.",
            show_default=False,
        ),
    ],
    force: Annotated[
        bool, typer.Option("--force", help="Replace a tokenizer.json that is there already.")
    ] = False,
) -> None:
    """Write DIR/tokenizer.json from the folder's sentencepiece files (Marian, T5)."""
    from attnctl.text.sentencepiece import write_tokenizer

    written = write_tokenizer(folder.expanduser(), force=force)
    typer.echo(
        f"wrote {printable(str(written.path))}: {written.family} tokenizer, vocab "
        f"{written.vocab_size}, from {written.source}"
    )
    if written.left_out:
        typer.echo(
            f"attnctl: note: {len(written.left_out)} piece"
            f"{'s' if len(written.left_out) > 1 else ''} of source.spm not in "
            f"vocab.json (the first {printable(repr(written.left_out[0]))}): transformers' "
            "MarianTokenizer reads them as <unk>, this tokenizer.json splits them into "
            "pieces vocab.json has",
            err=True,
        )
