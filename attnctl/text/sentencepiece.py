"""tokenizer.json from a model folder's sentencepiece files (``attnctl tokenizer DIR``).

attnctl reads only tokenizer.json at run time. Marian folders (opus-mt) ship ``source.spm``
and ``vocab.json`` instead, and transformers has no converter for them; T5 folders may ship
only ``spiece.model``. This module reads the sentencepiece ModelProto itself (a small
protobuf reader: no sentencepiece or protobuf package) and builds the same tokenizer with
the `tokenizers` library:

- a Unigram model with the scores sentencepiece's lattice uses, over vocab.json's ids
  (Marian) or the spm's own ids followed by the ``<extra_id_*>`` sentinels in
  transformers' reversed order (T5); pieces the spm never makes from text (vocab.json's
  target-side pieces, control pieces) get a score no segmentation chooses;
- the spm normalizer: its precompiled character map, and sentencepiece's whitespace rules
  (only U+0020 counts: leading and trailing spaces removed, runs of spaces made one);
- a Metaspace pre-tokenizer and decoder (``▁``, prepended as the spm's add_dummy_prefix),
  then user-defined pieces and runs of characters the spm does not know as pre-tokens of
  their own, as they are pieces of their own in sentencepiece;
- Marian's language codes (``>>fra<<``) as special tokens, and ``</s>`` appended after
  every text, as transformers' Marian and T5 tokenizers do.

Every field read is checked; a bad file is one :class:`AttnctlError` line (exit 2).
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnctl.errors import AttnctlError
from attnctl.model.config import read_json_object, regular_file

MAX_MODEL_BYTES = 256 * 2**20  # real spm models are about 1 MiB; a bigger file is not one
MAX_VARINT_BYTES = 10
DEFAULT_EXTRA_IDS = 100  # transformers' T5Tokenizer, when tokenizer_config.json names none
UNK_PENALTY = 10.0  # sentencepiece and tokenizers: an unknown character costs min score - 10

# sentencepiece's enums (sentencepiece_model.proto)
UNIGRAM, BPE, WORD, CHAR = 1, 2, 3, 4
MODEL_TYPES = {UNIGRAM: "unigram", BPE: "BPE", WORD: "word", CHAR: "char"}
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Wire types of the protobuf encoding
VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5


@dataclass(frozen=True)
class Piece:
    text: str
    score: float
    kind: int  # NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED or BYTE


@dataclass(frozen=True)
class SentencePieceModel:
    """The parts of a sentencepiece ModelProto that decide how a text is split."""

    pieces: list[Piece]
    model_type: int = UNIGRAM
    byte_fallback: bool = False
    treat_whitespace_as_suffix: bool = False
    normalizer_name: str = ""
    charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True
    escape_whitespaces: bool = True


@dataclass(frozen=True)
class Written:
    """What ``attnctl tokenizer`` wrote."""

    path: Path
    vocab_size: int
    family: str  # "Marian" or "T5"
    source: str  # the files it was built from
    left_out: list[str]  # source.spm pieces vocab.json lacks (Marian reads them as <unk>)


# ---------------------------------------------------------------- the protobuf reader


class _Malformed(Exception):
    """A reason; :func:`read_model` adds the file's name."""


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    for i in range(MAX_VARINT_BYTES):
        if pos + i >= len(data):
            raise _Malformed("it ends inside a field (truncated?)")
        byte = data[pos + i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos + i + 1
        shift += 7
    raise _Malformed("a varint is longer than 10 bytes")


def _fields(data: memoryview) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of one message; a length is checked against the
    bytes that are really there before it is used."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise _Malformed("a field has number 0")
        if wire == VARINT:
            value, pos = _varint(data, pos)
        elif wire in (FIXED64, FIXED32, LENGTH_DELIMITED):
            if wire == LENGTH_DELIMITED:
                size, pos = _varint(data, pos)
            else:
                size = 8 if wire == FIXED64 else 4
            if size > len(data) - pos:
                raise _Malformed("it ends inside a field (truncated?)")
            value, pos = data[pos : pos + size], pos + size
        else:
            raise _Malformed(f"field {number} has wire type {wire}, which protobuf does not use")
        yield number, wire, value


def _expect(name: str, wire: int, expected: int) -> None:
    if wire != expected:
        raise _Malformed(f"{name} has the wrong wire type ({wire}, expected {expected})")


def _string(name: str, value: memoryview) -> str:
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError:
        raise _Malformed(f"{name} is not UTF-8") from None


def _int32(value: int) -> int:
    value &= 2**64 - 1  # negative int32 values are sent as 10-byte two's complement
    return value - 2**64 if value >= 2**63 else value


def _piece(data: memoryview, index: int) -> Piece:
    text, score, kind = None, 0.0, NORMAL
    for number, wire, value in _fields(data):
        if number == 1:
            _expect(f"piece {index}'s text", wire, LENGTH_DELIMITED)
            text = _string(f"piece {index}'s text", value)
        elif number == 2:
            _expect(f"piece {index}'s score", wire, FIXED32)
            score = struct.unpack("<f", value)[0]
        elif number == 3:
            _expect(f"piece {index}'s type", wire, VARINT)
            kind = _int32(value)
    if not text:
        raise _Malformed(f"piece {index} has no text")
    if not math.isfinite(score):
        raise _Malformed(f"piece {index} ({text!r}) has the score {score}")
    if kind not in (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE):
        raise _Malformed(f"piece {index} ({text!r}) has the unknown type {kind}")
    return Piece(text, score, kind)


def parse_model(data: bytes) -> SentencePieceModel:
    """A ModelProto's pieces, trainer_spec and normalizer_spec; raises _Malformed."""
    view = memoryview(data)
    pieces: list[Piece] = []
    trainer: dict[str, Any] = {}
    normalizer: dict[str, Any] = {}
    for number, wire, value in _fields(view):
        if number == 1:  # repeated SentencePiece pieces
            _expect("a piece", wire, LENGTH_DELIMITED)
            pieces.append(_piece(value, len(pieces)))
        elif number == 2:  # TrainerSpec
            _expect("trainer_spec", wire, LENGTH_DELIMITED)
            names = {3: "model_type", 24: "treat_whitespace_as_suffix", 35: "byte_fallback"}
            for field, field_wire, field_value in _fields(value):
                if field in names:
                    _expect(f"trainer_spec.{names[field]}", field_wire, VARINT)
                    trainer[names[field]] = _int32(field_value)
        elif number == 3:  # NormalizerSpec
            _expect("normalizer_spec", wire, LENGTH_DELIMITED)
            for field, field_wire, field_value in _fields(value):
                if field == 1:
                    _expect("normalizer_spec.name", field_wire, LENGTH_DELIMITED)
                    normalizer["normalizer_name"] = _string("normalizer_spec.name", field_value)
                elif field == 2:
                    _expect("normalizer_spec.precompiled_charsmap", field_wire, LENGTH_DELIMITED)
                    normalizer["charsmap"] = bytes(field_value)
                elif field in (3, 4, 5):
                    name = {3: "add_dummy_prefix", 4: "remove_extra_whitespaces"}.get(
                        field, "escape_whitespaces"
                    )
                    _expect(f"normalizer_spec.{name}", field_wire, VARINT)
                    normalizer[name] = field_value != 0
    if not pieces:
        raise _Malformed("it has no pieces (not a sentencepiece model?)")
    seen: dict[str, int] = {}
    for index, piece in enumerate(pieces):
        if piece.text in seen:
            raise _Malformed(f"pieces {seen[piece.text]} and {index} are both {piece.text!r}")
        seen[piece.text] = index
    model = SentencePieceModel(
        pieces,
        model_type=trainer.get("model_type", UNIGRAM),
        byte_fallback=bool(trainer.get("byte_fallback", 0)),
        treat_whitespace_as_suffix=bool(trainer.get("treat_whitespace_as_suffix", 0)),
        **normalizer,
    )
    _check_charsmap(model.charsmap)
    return model


def _check_charsmap(charsmap: bytes) -> None:
    """sentencepiece's layout: a little-endian u32 trie size, the trie (u32 units), strings."""
    if not charsmap:
        return
    if len(charsmap) < 4:
        raise _Malformed("its precompiled_charsmap is shorter than 4 bytes")
    trie_size = struct.unpack("<I", charsmap[:4])[0]
    if trie_size % 4 or trie_size > len(charsmap) - 4:
        raise _Malformed(
            f"its precompiled_charsmap claims a trie of {trie_size} bytes in "
            f"{len(charsmap) - 4} (truncated?)"
        )


def read_model(path: Path) -> SentencePieceModel:
    regular_file(path, "sentencepiece model")
    size = path.stat().st_size
    if size > MAX_MODEL_BYTES:
        raise AttnctlError(
            f"malformed sentencepiece model {path}: {size} bytes is more than a sentencepiece "
            f"model holds ({MAX_MODEL_BYTES} at most)"
        )
    try:
        data = path.read_bytes()
    except OSError as error:
        raise AttnctlError(f"cannot read sentencepiece model {path}: {error.strerror}") from None
    try:
        model = parse_model(data)
    except _Malformed as reason:
        raise AttnctlError(f"malformed sentencepiece model {path}: {reason}") from None
    _check_supported(model, path)
    return model


def _check_supported(model: SentencePieceModel, path: Path) -> None:
    """What the tokenizer.json below reproduces exactly; anything else is refused by name."""
    if model.model_type != UNIGRAM:
        kind = MODEL_TYPES.get(model.model_type, f"type {model.model_type}")
        raise AttnctlError(
            f"{path} is a {kind} sentencepiece model; attnctl tokenizer builds only unigram ones"
        )
    refused = [
        (model.byte_fallback, "byte_fallback"),
        (model.treat_whitespace_as_suffix, "treat_whitespace_as_suffix"),
        (not model.escape_whitespaces, "escape_whitespaces: false"),
        (any(p.kind == BYTE for p in model.pieces), "byte pieces"),
    ]
    for present, name in refused:
        if present:
            raise AttnctlError(
                f"{path} uses sentencepiece's {name}, which attnctl tokenizer does not reproduce"
            )
    unknown = [p for p in model.pieces if p.kind == UNKNOWN]
    if len(unknown) != 1:
        raise AttnctlError(
            f"malformed sentencepiece model {path}: it has {len(unknown)} unknown pieces, "
            "expected one"
        )


# ---------------------------------------------------------------- the tokenizer


def _never_score(model: SentencePieceModel, longest: int) -> float:
    """A score no Unigram path chooses where sentencepiece has pieces or unknowns instead:
    below any path over ``longest`` characters (each node costs at least min − 10)."""
    lowest = min([0.0] + [p.score for p in model.pieces if p.kind == NORMAL])
    return (longest + 1) * (lowest - UNK_PENALTY)


def _spm_score(model: SentencePieceModel, piece: Piece, never: float) -> float:
    """The score sentencepiece's lattice gives a piece (unigram_model.cc): a user-defined
    piece ``length · max score − 0.1`` (so that it is chosen), a piece it never puts in the
    lattice (control, unknown, unused) ``never``."""
    if piece.kind == NORMAL:
        return piece.score
    if piece.kind == USER_DEFINED:
        highest = max([p.score for p in model.pieces if p.kind == NORMAL], default=0.0)
        return len(piece.text) * highest - 0.1
    return never


def _build(
    model: SentencePieceModel,
    vocab: list[tuple[str, float]],
    unk_id: int,
    special: list[str],
    eos: str,
    pair_eos_between: bool,
) -> str:
    """tokenizer.json text: Unigram over ``vocab`` (id = position) and the spm's rules."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from tokenizers import models as tokenizer_models

    tokenizer = Tokenizer(tokenizer_models.Unigram(vocab, unk_id, False))
    steps = []
    if model.charsmap:
        try:
            steps.append(normalizers.Precompiled(model.charsmap))
        except BaseException as error:  # an Exception, or a Rust panic (a BaseException)
            _reraise_unless_tokenizers(error)
            raise _Malformed(f"its precompiled_charsmap is not readable: {error}") from None
    if model.remove_extra_whitespaces:  # sentencepiece: only U+0020 is whitespace here
        steps += [
            normalizers.Replace(Regex(" {2,}"), " "),
            normalizers.Replace(Regex(r"\A | \z"), ""),
        ]
    if steps:
        tokenizer.normalizer = normalizers.Sequence(steps)
    prepend = "always" if model.add_dummy_prefix else "never"
    # split=False: one Viterbi over the whole text, as sentencepiece does (a piece may
    # hold a ▁ in its middle where the spm was trained without split_by_whitespace).
    # Then user-defined pieces and runs of characters the spm does not know become
    # pre-tokens of their own, as they are pieces of their own in sentencepiece: a
    # vocab.json piece holding such a character never swallows the known ones around it.
    user_defined = sorted((p.text for p in model.pieces if p.kind == USER_DEFINED), key=len)
    alternatives = [_escaped(text) for text in reversed(user_defined)]  # longest first
    known = {text for text, _ in vocab}
    alternatives.append(f"[^{_character_class(model, known)}]+")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace("▁", prepend, split=False),
            pre_tokenizers.Split(Regex("|".join(alternatives)), behavior="isolated"),
        ]
    )
    tokenizer.decoder = decoders.Metaspace("▁", prepend, split=False)
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    eos_id = tokenizer.token_to_id(eos)
    pair = ["$A", eos, "$B:1", f"{eos}:1"] if pair_eos_between else ["$A", "$B:1", f"{eos}:1"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=["$A", eos], pair=pair, special_tokens=[(eos, eos_id)]
    )
    try:
        tokenizer.encode("Are you OK? 猫吃鱼 ＡＢＣ ﬁ")  # a charsmap that fails only in use
    except BaseException as error:
        _reraise_unless_tokenizers(error)
        raise _Malformed(f"its precompiled_charsmap is not readable: {error}") from None
    return tokenizer.to_str(pretty=True)


def _reraise_unless_tokenizers(error: BaseException) -> None:
    """Ctrl-C and exits go on; tokenizers' errors and panics (pyo3's PanicException is a
    BaseException) become a line about the file."""
    if isinstance(error, Exception) or type(error).__name__ == "PanicException":
        return
    raise error


def _escaped(text: str) -> str:
    return "".join(f"\\x{{{ord(char):x}}}" for char in text)


def _character_class(model: SentencePieceModel, known: set[str]) -> str:
    """The spm's characters (its one-character pieces that the tokenizer has) as regex
    ranges: \\x{41}-\\x{5a}..."""
    singles = (p.text for p in model.pieces if p.kind == NORMAL and len(p.text) == 1)
    points = sorted({ord(text) for text in singles if text in known})
    ranges: list[list[int]] = []
    for point in points:
        if ranges and point == ranges[-1][1] + 1:
            ranges[-1][1] = point
        else:
            ranges.append([point, point])
    return "".join(f"\\x{{{a:x}}}" if a == b else f"\\x{{{a:x}}}-\\x{{{b:x}}}" for a, b in ranges)


def _token_setting(config: dict[str, Any], key: str, default: str, path: Path) -> str:
    value = config.get(key, default)
    if isinstance(value, dict):  # {"content": "</s>", "__type": "AddedToken", ...}
        value = value.get("content")
    if not isinstance(value, str) or not value:
        raise AttnctlError(
            f"malformed tokenizer config {path}: {key} must be a token, got {value!r}"
        )
    return value


def _tokenizer_config(folder: Path) -> tuple[dict[str, Any], Path]:
    path = folder / "tokenizer_config.json"
    return (read_json_object(path, "tokenizer config") if path.exists() else {}), path


def _read_vocab(path: Path) -> list[str]:
    """vocab.json (piece -> id) as the pieces in id order; ids 0..N-1, each once."""
    data = read_json_object(path, "vocabulary")
    by_id: dict[int, str] = {}
    for piece, token_id in data.items():
        if type(token_id) is not int:
            raise AttnctlError(
                f"malformed vocabulary {path}: {piece!r} has the id {token_id!r}, not an integer"
            )
        if not 0 <= token_id < len(data):
            raise AttnctlError(
                f"malformed vocabulary {path}: {piece!r} has the id {token_id}, outside "
                f"0..{len(data) - 1} for {len(data)} pieces"
            )
        if token_id in by_id:
            raise AttnctlError(
                f"malformed vocabulary {path}: {by_id[token_id]!r} and {piece!r} both have "
                f"the id {token_id}"
            )
        if not piece:
            raise AttnctlError(f"malformed vocabulary {path}: a piece is empty")
        by_id[token_id] = piece
    if not by_id:
        raise AttnctlError(f"malformed vocabulary {path}: it is empty")
    return [by_id[i] for i in range(len(by_id))]  # ids in range and unique: all of 0..N-1


def marian_tokenizer(folder: Path) -> tuple[str, int, list[str]]:
    """Marian's source side: source.spm's segmentation, vocab.json's ids (transformers'
    MarianTokenizer: spm pieces looked up in vocab.json, a leading >>xx<< split off)."""
    spm_path = folder / "source.spm"
    model = read_model(spm_path)
    config, config_path = _tokenizer_config(folder)
    if config.get("separate_vocabs", False) is not False:
        raise AttnctlError(
            f"{config_path} sets separate_vocabs: attnctl tokenizer builds only Marian "
            "tokenizers with one vocab.json for both sides"
        )
    unk = _token_setting(config, "unk_token", "<unk>", config_path)
    eos = _token_setting(config, "eos_token", "</s>", config_path)
    pad = _token_setting(config, "pad_token", "<pad>", config_path)
    vocab_path = folder / "vocab.json"
    pieces = _read_vocab(vocab_path)
    ids = {piece: i for i, piece in enumerate(pieces)}
    for token in (unk, eos):
        if token not in ids:
            raise AttnctlError(f"malformed vocabulary {vocab_path}: it has no {token}")
    spm = {p.text: p for p in model.pieces}
    # Pieces the spm makes that vocab.json lacks: MarianTokenizer reads them as <unk>, and
    # a tokenizer.json cannot give two pieces one id, so they are left out of its lattice
    # (sentencepiece would pick them; this picks the best of the rest) and reported.
    left_out = [
        p.text for p in model.pieces if p.kind in (NORMAL, USER_DEFINED) and p.text not in ids
    ]
    # transformers' MarianTokenizer: every vocab.json piece >>…<< is a language code (>>fra<<)
    codes = [p for p in pieces if p.startswith(">>") and p.endswith("<<")]
    special = [t for t in (eos, unk, pad) if t in ids] + codes
    # Pieces the spm never produces from text (vocab.json's other pieces: the target
    # side's, <pad>, language codes; the spm's control pieces) keep their ids but lose
    # to every segmentation sentencepiece has.
    never = _never_score(model, max(len(p) for p in pieces))
    vocab = []
    for piece in pieces:
        found = spm.get(piece)
        vocab.append((piece, never if found is None else _spm_score(model, found, never)))
    try:
        text = _build(model, vocab, ids[unk], special, eos, pair_eos_between=False)
    except _Malformed as reason:
        raise AttnctlError(f"malformed sentencepiece model {spm_path}: {reason}") from None
    return text, len(pieces), left_out


def t5_tokenizer(folder: Path) -> tuple[str, int, list[str]]:
    """T5: spiece.model's pieces with their ids, then <extra_id_{N-1}> … <extra_id_0> as
    transformers' T5Tokenizer adds them (so <extra_id_0> is the last id)."""
    spm_path = folder / "spiece.model"
    model = read_model(spm_path)
    config, config_path = _tokenizer_config(folder)
    extra_ids = config.get("extra_ids", DEFAULT_EXTRA_IDS)
    if type(extra_ids) is not int or not 0 <= extra_ids <= 10_000:
        raise AttnctlError(
            f"malformed tokenizer config {config_path}: extra_ids must be an integer from 0 "
            f"to 10000, got {extra_ids!r}"
        )
    eos = _token_setting(config, "eos_token", "</s>", config_path)
    never = _never_score(model, max(len(p.text) for p in model.pieces))
    vocab = [(p.text, _spm_score(model, p, never)) for p in model.pieces]
    names = {p.text for p in model.pieces}
    sentinels = [f"<extra_id_{i}>" for i in range(extra_ids - 1, -1, -1)]
    clash = next((s for s in sentinels if s in names), None)
    if clash:
        raise AttnctlError(f"{spm_path} already has a piece {clash}, a sentinel T5 adds")
    if eos not in names:
        raise AttnctlError(f"malformed sentencepiece model {spm_path}: it has no {eos}")
    vocab += [(s, 0.0) for s in sentinels]
    model_config = folder / "config.json"
    if model_config.exists():
        rows = read_json_object(model_config, "model config").get("vocab_size")
        if type(rows) is int and rows < len(vocab):
            raise AttnctlError(
                f"{spm_path} has {len(model.pieces)} pieces and {extra_ids} sentinels, "
                f"{len(vocab)} ids, more than the model's vocab_size {rows}"
            )
    unk_id = next(i for i, p in enumerate(model.pieces) if p.kind == UNKNOWN)
    special = [p.text for p in model.pieces if p.kind in (UNKNOWN, CONTROL)]
    try:
        text = _build(model, vocab, unk_id, special + sentinels, eos, pair_eos_between=True)
    except _Malformed as reason:
        raise AttnctlError(f"malformed sentencepiece model {spm_path}: {reason}") from None
    return text, len(vocab), []


def write_tokenizer(folder: Path, force: bool = False) -> Written:
    """Write ``folder/tokenizer.json`` from Marian's or T5's sentencepiece files."""
    if not folder.is_dir():
        what = "not found" if not folder.exists() else "not a folder"
        raise AttnctlError(f"model folder {what}: {folder}")
    target = folder / "tokenizer.json"
    if (target.exists() or target.is_symlink()) and not force:
        raise AttnctlError(f"{target} exists already; give --force to replace it")
    if (folder / "source.spm").exists():
        text, size, left_out = marian_tokenizer(folder)
        family, source = "Marian", "source.spm and vocab.json"
    elif (folder / "spiece.model").exists():
        text, size, left_out = t5_tokenizer(folder)
        family, source = "T5", "spiece.model"
    else:
        raise AttnctlError(
            f"no sentencepiece files in {folder}: attnctl tokenizer reads Marian's source.spm "
            "and vocab.json or T5's spiece.model"
        )
    _write_atomically(target, text)
    return Written(target, size, family, source, left_out)


def _write_atomically(target: Path, text: str) -> None:
    """A temporary file in the same folder, renamed over ``target``: never half a file."""
    try:
        handle, temporary = tempfile.mkstemp(prefix=".tokenizer.", suffix=".tmp", dir=target.parent)
    except OSError as error:
        raise AttnctlError(f"cannot write {target}: {error.strerror or error}") from None
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.write("\n")
        os.chmod(temporary, 0o644)  # mkstemp makes it private; a tokenizer.json is not
        os.replace(temporary, target)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise AttnctlError(f"cannot write {target}: {error.strerror or error}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


__all__ = ["Written", "parse_model", "read_model", "write_tokenizer"]
