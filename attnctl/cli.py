"""The command line: the only module that prints or exits.

Errors end here: a click usage error or an :class:`AttnctlError` becomes one line on
stderr and its exit code (2 for usage, 1 for run-time failures); ``--debug`` adds the
traceback. Each command parses its options, calls one use case (``app``) and renders its
report (``render``); torch and tokenizers are imported only by the use cases that run.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, RenderableType
from typer.core import TyperGroup

from attnctl import __version__
from attnctl.app.requests import (
    CheckRequest,
    Hooks,
    LayerRequest,
    MemoryRequest,
    RunRequest,
    ShapesRequest,
)
from attnctl.cli_options import (
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
from attnctl.parallel import RECOMPUTE, Layout, parse_stage_sizes
from attnctl.render.text import printable
from attnctl.window import DEFAULT_ROWS

# The use cases and views are imported by the command that runs (`attnctl --help` loads
# none of them: its start-up is a benchmark's target).

# Newer Typer vendors click; its BadParameter's bases name the ClickException it raises.
ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
_state = {"debug": False}


class _OneLineErrors(TyperGroup):
    """Turn every usage error and AttnctlError into one line on stderr."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        try:
            with _terminal_conventions():
                return self._guarded_main(*args, standalone_mode=standalone_mode, **kwargs)
        except BrokenPipeError:  # the reader left (`| head`): stop quietly, as click does
            _silence_stdout()
            sys.exit(RUNTIME)

    def _guarded_main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            result = super().main(*args, standalone_mode=False, **kwargs)
        except ClickException as error:
            if type(error).__name__ == "NoArgsIsHelpError":  # `attnctl` alone: the help
                typer.echo(error.format_message())
                sys.exit(0)
            _fail(error.format_message(), error.exit_code, error)
        except AttnctlError as error:
            _fail(error.message, error.exit_code, error)
        except typer.Abort as error:
            _fail("aborted", RUNTIME, error)
        except BrokenPipeError:
            raise
        except Exception as error:  # a bug: still one line, the traceback with --debug
            _fail(f"internal error: {type(error).__name__}: {error}", RUNTIME, error)
        sys.exit(result if isinstance(result, int) else 0)


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of what is left for
    a closed pipe does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real descriptor (a test's stream)
        pass


MAX_COLUMNS = 1000  # wider terminals get this width: no renderer gains beyond it


@contextlib.contextmanager
def _terminal_conventions() -> Iterator[None]:
    """An unusable COLUMNS is ignored, and piped output has no trailing spaces.

    COLUMNS that is not a positive integer (0, -5, "abc") is treated as unset, as most
    programs do; one above :data:`MAX_COLUMNS` is lowered to it. Both rich (our output
    and Typer's help) and click read it from the environment, so it is set there for the
    duration of the command and restored afterwards.
    """
    saved = os.environ.get("COLUMNS")
    if saved is not None:
        usable = saved.strip().isdigit() and int(saved) > 0  # isdigit: no sign
        if usable:  # " 80" too, which rich alone would not read
            os.environ["COLUMNS"] = str(min(int(saved), MAX_COLUMNS))
        else:
            del os.environ["COLUMNS"]
    stdout = sys.stdout
    piped = stdout is not None and not _is_terminal(stdout)
    if piped:
        sys.stdout = _TrimmedLines(stdout)  # type: ignore[assignment]
    try:
        yield
    finally:
        if piped:
            sys.stdout.finish()  # type: ignore[attr-defined]
            sys.stdout = stdout
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or unusual stream
        return False


class _TrimmedLines:
    """A text stream that writes each line without its trailing spaces (rich pads cells)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._pending = ""

    def write(self, text: str) -> int:
        lines = (self._pending + text).split("\n")
        self._pending = lines.pop()
        if lines:
            self._stream.write("".join(line.rstrip(" \t") + "\n" for line in lines))
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:  # a line not ended yet waits: more of it may follow
        self._stream.flush()

    def finish(self) -> None:
        if self._pending:
            self._stream.write(self._pending.rstrip(" \t"))
            self._pending = ""
        self._stream.flush()

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:  # encoding, errors, fileno, buffer, ...
        return getattr(self._stream, name)


def _fail(message: str, code: int, error: BaseException) -> None:
    if _state["debug"]:
        traceback.print_exception(error)
    if not message.strip():  # "no arguments": click has printed the help already
        sys.exit(code)
    first = printable(message.strip().splitlines()[0])
    hint = "" if code != USAGE or _state["debug"] else " (see --help)"
    typer.echo(f"attnctl: error: {first}{hint}", err=True)
    sys.exit(code)


app = typer.Typer(
    cls=_OneLineErrors,
    help="See what one multi-head attention layer does: tokens, shapes at every stage, "
    "per-head weights, memory.",
    context_settings={"help_option_names": ["-h", "--help"]},
    no_args_is_help=True,
    add_completion=True,  # --install-completion, --show-completion
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"attnctl {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show the traceback behind an error.")
    ] = False,
    version: Annotated[
        bool,
        typer.Option(
            "--version", "-V", callback=_version, is_eager=True, help="Print the version."
        ),
    ] = False,
) -> None:
    _state["debug"] = debug


JSON_WRITE_CHARS = 1 << 16  # --json is written in pieces of about this many characters


def _console() -> Console:
    from attnctl.render.svg import recorded  # --svg: the console records

    # COLUMNS, NO_COLOR and "not a terminal" are honoured by rich itself
    return recorded(Console(highlight=False, emoji=False))


def _print_json(document: dict[str, Any]) -> None:
    """The document on stdout, written as it is encoded: a long run's attention is tens of
    MB of text, which one string (and its lines, trimmed when piped) would hold several
    times over."""
    encoder = json.JSONEncoder(ensure_ascii=False, indent=2)
    pending: list[str] = []
    size = 0
    for chunk in encoder.iterencode(document):
        pending.append(chunk)
        size += len(chunk)
        if size >= JSON_WRITE_CHARS:
            sys.stdout.write("".join(pending))
            pending, size = [], 0
    sys.stdout.write("".join(pending) + "\n")
    sys.stdout.flush()


@contextlib.contextmanager
def _progress(description: str, console: Console | None = None) -> Iterator[None]:
    """A spinner with elapsed time on stderr while work runs; nothing unless it is a terminal."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        progress.add_task(description, total=None)
        yield


def _hooks() -> Hooks:
    """Spinners and warnings on stderr for the use cases, which never print."""
    return Hooks(progress=_progress, warn=lambda message: typer.echo(message, err=True))


# ---------------------------------------------------------------- commands


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
    request = RunRequest(
        layer=layer,
        texts=text,
        file=file,
        contexts=context,
        context_file=context_file,
        heads=head,
        rows=rows,
        digits=digits,
        force=force,
        block=block,
        every_weight=as_json or save is not None or html is not None,
        generate=generate,
        encoder_block=encoder_block,
        save=save,
        tp=tp,
        sp=sp,
    )
    heatmap = view == View.heatmap
    if heatmap and as_json:
        raise AttnctlError(
            "--view heatmap is not available with --json: it draws the weights in the "
            "terminal (--json carries every weight)",
            exit_code=USAGE,
        )
    from attnctl.app.use_cases import run_use_case
    from attnctl.render.json import blocks_json, generation_json, run_json, translation_json
    from attnctl.render.terminal_generation import generation_view, translation_view
    from attnctl.render.terminal_run import blocks_view, run_view
    from attnctl.report_generation import GenerationReport, TranslationReport

    report = run_use_case(request, _hooks())
    if as_json or save_target is not None or html_target is not None:
        # one document for stdout, the tensors file and the page: they hold the same numbers
        if isinstance(report, GenerationReport):
            document = generation_json(report)
        elif isinstance(report, TranslationReport):
            document = translation_json(report)
        else:
            document = blocks_json(report) if report.every_block else run_json(report)
        if save_target is not None:
            save_run(save_target, document, report)
        if html_target is not None:
            from attnctl.render.html import write_html

            write_html(html_target, document)
        if as_json:
            _print_json(document)
            return
    if isinstance(report, GenerationReport | TranslationReport):
        console = _console()
        view = generation_view if isinstance(report, GenerationReport) else translation_view
        if heatmap:
            _print_heatmap(console, lambda width, colour: view(report, width, True, colour))  # type: ignore[arg-type]
        else:
            console.print(view(report, console.width))  # type: ignore[arg-type]
        return
    console = _console()
    shown_on = [console]
    if heatmap:
        from attnctl.render.terminal_heatmap import heatmap_view

        shown_on = _print_heatmap(
            console, lambda width, colour: heatmap_view(report, width, colour)
        )
    elif report.every_block:
        console.print(blocks_view(report, console.width))
        return
    else:
        console.print(run_view(report, console.width))
    if report.heads_not_shown is not None:
        first, last = report.heads_not_shown
        for shown in shown_on:
            shown.print(f"heads {first}–{last} not shown; pick them with --head N", style="dim")


def _coloured(console: Console) -> bool:
    """Whether the heatmap draws coloured half blocks on ``console``: with 256 colours or
    more; with 16 (whose few blues cannot tell weights apart), none or ``NO_COLOR``, its
    shade characters."""
    return console.color_system in ("256", "truecolor") and not console.no_color


def _print_heatmap(console: Console, view: Callable[[int, bool], RenderableType]) -> list[Console]:
    """Print ``view(width, colour)`` on ``console`` as it can show it; with --svg, draw it
    again in colour into the recording (the picture's colours do not depend on stdout).
    The consoles printed on, for what follows the view."""
    from attnctl.render.svg import colour_recording

    console.print(view(console.width, _coloured(console)))
    picture = colour_recording(console)
    if picture is None:
        return [console]
    picture.print(view(console.width, True))
    return [console, picture]


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
    from attnctl.render.json_memory import shapes_document
    from attnctl.render.terminal_memory import seq2seq_shapes_view, shapes_view
    from attnctl.report import Seq2SeqShapes

    plan = shapes_use_case(ShapesRequest(layer, seq_len, batch, context_len, src_len, tgt_len))
    if as_json:
        _print_json(shapes_document(plan))
        return
    console = _console()
    if isinstance(plan, Seq2SeqShapes):
        console.print(seq2seq_shapes_view(plan, console.width))
        return
    console.print(shapes_view(plan, console.width))


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
    from attnctl.render.json_memory import memory_document
    from attnctl.render.terminal_memory import memory_view, seq2seq_memory_view
    from attnctl.report import Seq2SeqMemoryReport

    report = memory_use_case(request, _hooks())
    if as_json:
        _print_json(memory_document(report))
        return
    console = _console()
    if isinstance(report, Seq2SeqMemoryReport):
        console.print(seq2seq_memory_view(report, console.width))
        return
    if report.parallel is not None:
        from attnctl.render.terminal_parallel import parallel_view

        console.print(parallel_view(report, console.width))
        return
    console.print(memory_view(report, console.width))


@app.command()
@svg_option
@layer_options(leave_out=("dropout",))
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
    from attnctl.render.json import check_json
    from attnctl.render.terminal_check import check_view

    report = check_use_case(CheckRequest(layer, seq_len, batch, force), _hooks())
    if as_json:
        _print_json(check_json(report.result, report.plan))
    else:
        console = _console()
        console.print(check_view(report.result, report.plan))
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
    from attnctl.sentencepiece import write_tokenizer

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


def main() -> None:
    app()
