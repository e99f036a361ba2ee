"""The input as given: texts and contexts (arguments, files, stdin), --layer, --seq-len lists."""

from __future__ import annotations

import sys

from attnctl.errors import AttnctlError
from attnctl.literal import printable
from attnctl.model.describe import ModelDescription

MAX_TEXT_BYTES = 4 * 2**20  # about a million tokens: hours of attention on a CPU


def choose_blocks(block: str | None, model: ModelDescription | None) -> list[int] | None:
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


def read_texts(texts: list[str] | None, file: str | None) -> list[str]:
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


def read_contexts(contexts: list[str] | None, file: str | None, texts: int) -> list[str]:
    """No context, or one per text (a single one serves every text)."""
    if contexts and file is not None:
        raise AttnctlError("give the context either as --context or --context-file, not both")
    if file is not None:
        contexts = read_texts(None, file)
    if not contexts:
        return []
    contexts = [_checked_text(context) for context in contexts]
    if len(contexts) == 1:
        return contexts * texts
    if len(contexts) != texts:
        raise AttnctlError(f"{len(contexts)} contexts for {texts} texts: give one, or one per text")
    return contexts


def parse_lengths(text: str) -> list[int]:
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
