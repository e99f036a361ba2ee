"""The command line: the only module that prints or exits.

Errors end here: a click usage error or an :class:`AttnctlError` becomes one line on
stderr and its exit code (2 for usage, 1 for run-time failures); ``--debug`` adds the
traceback. torch and tokenizers are imported only inside ``run``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from enum import Enum, StrEnum
from typing import Annotated, Any

import typer
from rich.console import Console
from typer.core import TyperGroup

from attnctl import __version__
from attnctl.config import (
    DTYPE_BYTES,
    DTYPES,
    IMPLS,
    LARGEST_SIZE,
    MASKS,
    NORM_TYPES,
    NORMS,
    POSITIONS,
    QK_NORMS,
    LayerConfig,
    build_config,
    resolve_impl,
)
from attnctl.describe import ModelDescription
from attnctl.errors import RUNTIME, USAGE, AttnctlError
from attnctl.families import read_model, supported_names
from attnctl.memory import (
    MemoryReport,
    allowed_impls,
    estimate,
    fit,
    kv_cache_bytes,
    longest_input,
    parse_size,
)
from attnctl.plan import Plan, build_plan
from attnctl.render import (
    blocks_json,
    blocks_view,
    check_json,
    check_view,
    memory_json,
    memory_view,
    printable,
    run_json,
    run_view,
    shapes_json,
    shapes_view,
)
from attnctl.tokenize import encode_batch, vocab_size
from attnctl.training import estimate_training
from attnctl.window import DEFAULT_HEADS_SHOWN, DEFAULT_ROWS, choose_heads, choose_rows

# Newer Typer vendors click; its BadParameter's bases name the ClickException it raises.
ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
_state = {"debug": False}


class _OneLineErrors(TyperGroup):
    """Turn every usage error and AttnctlError into one line on stderr."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        with _terminal_conventions():
            return self._guarded_main(*args, standalone_mode=standalone_mode, **kwargs)

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
        except Exception as error:  # a bug: still one line, the traceback with --debug
            _fail(f"internal error: {type(error).__name__}: {error}", RUNTIME, error)
        sys.exit(result if isinstance(result, int) else 0)


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


# ---------------------------------------------------------------- layer options


# Choices come from config.py, the one place that lists them.
Pos = StrEnum("Pos", {value: value for value in POSITIONS})
Mask = StrEnum("Mask", {value: value for value in MASKS})
Norm = StrEnum("Norm", {value: value for value in NORMS})
NormType = StrEnum("NormType", {value: value for value in NORM_TYPES})
QkNorm = StrEnum("QkNorm", {value: value for value in QK_NORMS})
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
    "heads": _option(int, "--heads", help="Attention heads H (must divide D). Default 8."),
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
MODEL_KEEPS = ("dtype", "device", "impl", "tokenizer")  # options that still apply to a model


def layer_options(
    command: Callable[..., None] | None = None, *, leave_out: tuple[str, ...] = ()
) -> Any:
    """Give a command the layer options; it receives them as one validated ``layer``.

    ``leave_out`` names options the command does not offer (they keep the preset's value).
    A command with a ``model`` parameter also gets ``--model DIR``: then the layer comes
    from the model's config.json and ``model`` is its :class:`ModelDescription` (else None).
    Use it bare (``@layer_options``) or with arguments (``@layer_options(leave_out=...)``).
    """
    if command is None:
        return functools.partial(layer_options, leave_out=leave_out)
    unknown = set(leave_out) - set(LAYER_OPTIONS)
    if unknown:
        raise ValueError(f"no such layer option: {sorted(unknown)}")
    offered = {name: kind for name, kind in LAYER_OPTIONS.items() if name not in leave_out}
    signature = inspect.signature(command, eval_str=True)
    takes_model = "model" in signature.parameters
    own = [p for p in signature.parameters.values() if p.name not in ("layer", "model")]
    shared = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=kind)
        for name, kind in offered.items()
    ]
    if takes_model:
        shared.append(
            inspect.Parameter(
                "model", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=MODEL_OPTION
            )
        )

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> None:
        given = {name: kwargs.pop(name, None) for name in LAYER_OPTIONS}
        values = {k: v.value if isinstance(v, Enum) else v for k, v in given.items()}
        if not takes_model:
            command(layer=build_config(values.pop("config"), **values), **kwargs)
            return
        directory = kwargs.pop("model")
        if directory is None:
            layer = build_config(values.pop("config"), **values)
            command(layer=layer, model=None, **kwargs)
            return
        clashing = [k for k, v in values.items() if v is not None and k not in MODEL_KEEPS]
        if clashing:
            option = "--" + clashing[0].replace("_", "-")
            raise AttnctlError(
                f"{option} comes from the model's config.json; with --model only "
                + ", ".join(f"--{k}" for k in MODEL_KEEPS)
                + " may be given"
            )
        model = read_model(directory)
        layer = model.layer_config(**{k: values[k] for k in MODEL_KEEPS})
        command(layer=layer, model=model, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=own + shared)  # type: ignore[attr-defined]
    return wrapper


def _console() -> Console:
    # COLUMNS, NO_COLOR and "not a terminal" are honoured by rich itself
    return Console(highlight=False, emoji=False)


def _print_json(document: dict[str, Any]) -> None:
    typer.echo(json.dumps(document, ensure_ascii=False, indent=2))


JsonOption = Annotated[bool, typer.Option("--json", help="Print only JSON on stdout.")]
SeqLenOption = Annotated[int, typer.Option("--seq-len", "-L", help="Sequence length L.")]
BatchOption = Annotated[int, typer.Option("--batch", "-B", help="Batch size B.")]
ContextLenOption = Annotated[
    int | None,
    typer.Option("--context-len", help="Cross-attention: keys and values from a context of N."),
]


# ---------------------------------------------------------------- commands


@app.command()
@layer_options(leave_out=("dropout",))  # dropout acts only in training (memory --train)
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
            "last), or 'all' for a summary of every block. Default 0.",
            rich_help_panel="Model",
        ),
    ] = None,
    as_json: JsonOption = False,
    *,
    layer: LayerConfig,
    model: ModelDescription | None,
) -> None:
    """Run one attention layer on TEXT (a batch for several) and show every stage and weights."""
    if layer.dropout:
        raise AttnctlError("dropout acts only in training; see memory --train")
    if not 0 <= digits <= 8:
        raise AttnctlError(f"digits must be between 0 and 8, got {digits}")
    blocks = _choose_blocks(block, model)
    texts = _read_texts(text, file)
    contexts = _read_contexts(context, context_file, len(texts))
    if model is not None and contexts:
        raise AttnctlError(f"{model.name} has no cross-attention: leave out --context")
    if layer.cross and not contexts:
        raise AttnctlError("this layer is cross-attention: give --context TEXT (or --context-file)")
    own_tokenizer = None if model is None else model.path / "tokenizer.json"
    if own_tokenizer and layer.tokenizer == str(own_tokenizer) and not own_tokenizer.is_file():
        raise AttnctlError(f"no tokenizer.json in {model.path}; give one with --tokenizer")
    both = encode_batch(texts + contexts, layer.tokenizer)  # one vocabulary for both
    batch, context_batch = both.split(len(texts))
    cross = context_batch if contexts else None
    seq_len = batch.seq_len
    if model is not None and blocks:  # a sliding window past which attnctl's weights differ
        model.check_run_length(seq_len, max(blocks) + 1)
    heads = choose_heads(head, layer.heads)
    every_block = blocks is not None and len(blocks) > 1  # --layer all: a summary of each
    if not head and not as_json and not every_block:  # compute only the tables printed
        heads = heads[:DEFAULT_HEADS_SHOWN]
    query_rows = choose_rows(rows, seq_len)
    layer = resolve_impl(layer, shows_every_weight=len(query_rows) == seq_len)
    from attnctl.runner import device_errors, needs_padding_mask, run

    padded = needs_padding_mask(cross or batch, layer)
    context_len = cross.seq_len if cross else None
    vocab = batch.vocab_size if model is None else model.vocab_size
    shown_block = blocks[0] if blocks and len(blocks) == 1 else 0
    plan = build_plan(
        layer,
        seq_len,
        len(texts),
        vocab,
        padded=padded,
        context_len=context_len,
        model=model,
        layer_index=shown_block,
    )
    memory = estimate(plan)
    # the weights shown become Python floats: about 32 bytes each, beside the 4 of float32
    per_block = len(texts) * len(heads) * len(query_rows) * (context_len or seq_len) * 36
    shown_bytes = per_block * (len(blocks) if blocks else 1)

    what = "the layer" if model is None else model.name
    weights = memory.parameter_bytes  # a model: only the blocks up to the one shown load
    if model is not None:
        weights = model.loaded_values(max(blocks) + 1) * DTYPE_BYTES[layer.dtype]
    need = weights + memory.peak_activation_bytes + shown_bytes
    _preflight(plan, need, force, blocks=max(blocks) + 1 if blocks else 1)
    with (
        _progress(f"running {what} over {len(texts)} x {seq_len} tokens"),
        device_errors(layer.device),
    ):
        traces = run(batch, layer, model, blocks, heads, query_rows, context=cross)
    if as_json:
        if every_block:
            _print_json(blocks_json(traces, plan, memory))
        else:
            _print_json(run_json(traces[0], plan, memory))
        return
    console = _console()
    if every_block:
        console.print(blocks_view(texts, traces, plan, memory, console.width))
        return
    console.print(run_view(texts, traces[0], plan, memory, heads, console.width, digits, contexts))
    if not head and layer.heads > len(heads):
        console.print(
            f"heads {len(heads)}–{layer.heads - 1} not shown; pick them with --head N", style="dim"
        )


def _choose_blocks(block: str | None, model: ModelDescription | None) -> list[int] | None:
    """--layer N or all, for a model (None without one): the blocks whose weights to show."""
    if model is None:
        if block is not None:
            raise AttnctlError("--layer picks a block of a pretrained model: give --model DIR")
        return None
    if block is None:
        return [0]
    if block.strip().lower() == "all":
        return list(range(model.layers))
    try:
        number = int(block)
    except ValueError:
        raise AttnctlError(f"--layer must be a block number or 'all', got {block!r}") from None
    if not -model.layers <= number < model.layers:
        raise AttnctlError(
            f"--layer {number} is out of range: the model has {model.layers} layers "
            f"(0–{model.layers - 1}, or -1 for the last)"
        )
    return [number % model.layers]


MAX_TEXT_BYTES = 4 * 2**20  # about a million tokens: hours of attention on a CPU


def _read_texts(texts: list[str] | None, file: str | None) -> list[str]:
    """TEXT arguments or one file's text; a TEXT of '-' (like --file -) reads stdin."""
    if bool(texts) == (file is not None):
        raise AttnctlError("give the text either as TEXT or with --file PATH, not both or neither")
    if file is None:
        if texts.count("-") > 1:
            raise AttnctlError("stdin can be read once: give '-' as one TEXT only")
        return [_read_text_file("-") if text == "-" else _checked_text(text) for text in texts]
    return [_read_text_file(file)]


def _checked_text(text: str) -> str:
    """A TEXT argument: bytes the shell passed that are not UTF-8 are refused, not guessed."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise AttnctlError(f"the text {printable(text)!r} is not valid UTF-8") from None
    return text


def _read_text_file(file: str) -> str:
    """A file's (or stdin's) UTF-8 text without its final line end, read up to
    MAX_TEXT_BYTES: /dev/zero ends too."""
    what = "stdin" if file == "-" else f"text file {file}"
    try:
        if file == "-":
            if sys.stdin is None or sys.stdin.closed:
                raise AttnctlError("cannot read stdin: it is closed")
            stream = getattr(sys.stdin, "buffer", None)
            if stream is None:  # a text stream without bytes beneath (an embedding host)
                data = sys.stdin.read(MAX_TEXT_BYTES + 1).encode("utf-8", "surrogateescape")
            else:
                data = stream.read(MAX_TEXT_BYTES + 1)
        else:
            with open(file, "rb") as handle:
                data = handle.read(MAX_TEXT_BYTES + 1)
    except FileNotFoundError:
        raise AttnctlError(f"text file not found: {file}") from None
    except IsADirectoryError:
        raise AttnctlError(f"cannot read {what}: it is a folder") from None
    except (OSError, ValueError) as error:
        raise AttnctlError(
            f"cannot read {what}: {getattr(error, 'strerror', 0) or error}"
        ) from None
    if len(data) > MAX_TEXT_BYTES:
        raise AttnctlError(
            f"{what} is longer than the 4 MiB attnctl reads (about a million tokens): "
            "give a part of it"
        )
    try:  # the final line end is no token (as $(cat FILE) drops it): echo TEXT | run -
        return data.decode("utf-8").removesuffix("\n").removesuffix("\r")
    except UnicodeDecodeError as error:
        raise AttnctlError(
            f"cannot read {what}: not UTF-8 text ({error.reason} at byte {error.start})"
        ) from None


def _read_contexts(contexts: list[str] | None, file: str | None, texts: int) -> list[str]:
    """No context, or one per text (a single one serves every text)."""
    if contexts and file is not None:
        raise AttnctlError("give the context either as --context or --context-file, not both")
    if file is not None:
        contexts = _read_texts(None, file)
    if not contexts:
        return []
    contexts = [_checked_text(context) for context in contexts]
    if len(contexts) == 1:
        return contexts * texts
    if len(contexts) != texts:
        raise AttnctlError(f"{len(contexts)} contexts for {texts} texts: give one, or one per text")
    return contexts


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


@app.command()
@layer_options(leave_out=("dropout",))
def shapes(
    seq_len: SeqLenOption = 16,
    batch: BatchOption = 1,
    context_len: ContextLenOption = None,
    as_json: JsonOption = False,
    *,
    layer: LayerConfig,
    model: ModelDescription | None,
) -> None:
    """Show the shape of every stage for a configuration, symbolically and with numbers."""
    if layer.dropout:
        raise AttnctlError("dropout acts only in training; see memory --train")
    plan = _plan(layer, seq_len, batch, context_len, model)
    if as_json:
        _print_json(shapes_json(plan))
        return
    console = _console()
    console.print(shapes_view(plan, console.width))


@app.command()
@layer_options
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
    as_json: JsonOption = False,
    *,
    layer: LayerConfig,
    model: ModelDescription | None,
) -> None:
    """Estimate memory: parameters, every activation, the B·H·L·L matrices, peak, per dtype."""
    if seq_len is None:  # 2048, or all a model's (or layer's) learned positions
        seq_len = str(min(2048, longest_input(layer, model) or 2048))
    lengths = _parse_lengths(seq_len)
    stack, kv_layers = layers, layers  # --layers: weights and K/V of a stack of this layer
    if model is not None:
        clash = {"--layers": layers != 1, "--train": train, "--context-len": context_len}
        for option, given in clash.items():
            if given:
                raise AttnctlError(f"{option} does not apply to --model (a whole model's memory)")
        stack, kv_layers = 1, model.layers  # the plan holds every weight; K and V per block
    if kv_cache is not None and kv_cache < 0:
        raise AttnctlError(f"kv-cache must be a number of tokens >= 0, got {kv_cache}")
    for option, value in (("layers", layers), ("kv-cache", kv_cache)):
        if value is not None and value >= LARGEST_SIZE:
            raise AttnctlError(f"{option} must be below 2^63 (torch's largest size), got {value}")
    if budget is not None and fit_device:
        raise AttnctlError("give --budget SIZE or --fit, not both")

    if layer.dropout and not train:
        raise AttnctlError("dropout acts only in training; add --train")

    def peak_of(plan: Plan) -> int:
        if train:
            return estimate_training(plan, layers).peak_bytes
        return estimate(plan, stack).peak_bytes

    reports = []
    for length in lengths:
        plan = _plan(layer, length, batch, context_len, model)
        result = estimate(plan, stack)
        tokens = kv_cache if kv_cache is not None else context_len or length  # K/V's length
        report = MemoryReport(plan, result, tokens, kv_cache_bytes(plan, tokens, kv_layers))
        if train:
            report.training = estimate_training(plan, layers)
        if measure:
            _preflight(plan, peak_of(plan), force, passes=3 if train else 1)
            from attnctl.measure import measure_forward, measure_training

            what = "a training step" if train else "a forward pass"
            from attnctl.runner import device_errors

            with _progress(f"measuring {what} over {length} tokens"), device_errors(layer.device):
                if train:
                    report.measured = measure_training(plan.config, plan)
                else:
                    report.measured = measure_forward(plan)
        reports.append(report)
    budget_bytes = _device_free_bytes(layer.device) if fit_device else None
    if budget is not None:
        budget_bytes = parse_size(budget)
    fits = None
    if budget_bytes is not None:
        fits = {}
        for impl in allowed_impls(layer):  # not sdpa with dropout or alibi
            variant = dataclasses.replace(layer, impl=impl)
            sizer = functools.partial(_plan, variant, context_len=context_len, model=model)
            longest = longest_input(layer, model)  # learned positions end the search
            fits[impl] = fit(sizer, lengths[0], batch, budget_bytes, peak_of, longest)
    if as_json:
        _print_json(memory_json(reports, fits, budget_bytes))
        return
    console = _console()
    console.print(memory_view(reports, console.width, fits, budget_bytes))


def _plan(
    config: LayerConfig,
    seq_len: int,
    batch: int,
    context_len: int | None = None,
    model: ModelDescription | None = None,
) -> Plan:
    if model is not None:  # block 0 of the model stands for every block: they are alike
        return build_plan(config, seq_len, batch, model.vocab_size, config.device, model=model)
    vocab = vocab_size(config.tokenizer, seq_len + (context_len or 0))
    return build_plan(config, seq_len, batch, vocab, config.device, context_len=context_len)


def _parse_lengths(text: str) -> list[int]:
    lengths = []
    for part in text.split(","):
        try:
            length = int(part.strip())
        except ValueError:
            raise AttnctlError(
                f"seq-len {text!r} is not a length or a list like 512,2048,8192"
            ) from None
        if length <= 0:
            raise AttnctlError(f"seq-len must be a positive integer, got {length}")
        lengths.append(length)
    return list(dict.fromkeys(lengths))


def _device_free_bytes(device_spec: str) -> int:
    from attnctl.layer import resolve_device
    from attnctl.resources import available_memory

    device = resolve_device(device_spec)
    available = available_memory(device)
    if available is None:
        raise AttnctlError(f"cannot tell how much memory {device} has free; use --budget SIZE")
    return available.bytes


def _preflight(plan: Plan, need_bytes: int, force: bool, blocks: int = 1, passes: int = 1) -> None:
    """The one check before a command allocates: memory (skipped with --force), then time.

    A run estimated to take over LONG_RUN_SECONDS (its FLOPs at the rates measured on the
    device just now; ``passes`` forward passes of ``blocks`` blocks) says so on stderr first;
    one forced past the memory it may use is not timed (it fails, or the swap decides).
    """
    from attnctl.resources import import_torch

    import_torch()  # the first command to need it: with the collector paused
    from attnctl.layer import resolve_device
    from attnctl.resources import (
        LONG_RUN_SECONDS,
        available_memory,
        duration_text,
        estimated_seconds,
        preflight,
    )

    device = resolve_device(plan.config.device)
    if not force:
        preflight(need_bytes, device)
    else:
        available = available_memory(device)
        if available is not None and need_bytes > available.bytes:
            return
    seconds = estimated_seconds(plan, device, blocks)
    if seconds is not None and seconds * passes > LONG_RUN_SECONDS:
        typer.echo(
            f"attnctl: this will take about {duration_text(seconds * passes)} on {device} "
            "(its operations at the speed measured here just now)",
            err=True,
        )


@app.command()
@layer_options(leave_out=("dropout",))
def check(
    seq_len: SeqLenOption = 16,
    batch: BatchOption = 2,
    force: Annotated[
        bool, typer.Option("--force", help="Run even when the estimate exceeds free memory.")
    ] = False,
    as_json: JsonOption = False,
    *,
    layer: LayerConfig,
) -> None:
    """Compare the math path, SDPA and nn.MultiheadAttention, and gradcheck the layer."""
    if layer.dropout:
        raise AttnctlError("dropout acts only in training; check compares inference")
    plan = _plan(layer, seq_len, batch)  # validates the sizes before torch is imported
    # three copies of the layer (math, sdpa, nn.MultiheadAttention), each with its outputs
    _preflight(plan, 3 * estimate(plan).peak_bytes, force, passes=3)
    from attnctl.check import run_check
    from attnctl.runner import device_errors

    with _progress("comparing implementations and running gradcheck"), device_errors(layer.device):
        result = run_check(layer, batch, seq_len, plan.vocab_size)
    if as_json:
        _print_json(check_json(result, plan))
    else:
        console = _console()
        console.print(check_view(result, plan))
    if not result.ok:
        raise typer.Exit(RUNTIME)


def main() -> None:
    app()
