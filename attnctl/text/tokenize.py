"""Tokenizers: the bundled byte-level BPE, any tokenizer.json, or one token per character.

Labels come from the tokenizer's character offsets, so a Chinese character shows as
猫, never as the byte-level string ``çĮ«``. Several tokens that cover the same
character span (an unmerged CJK character split into bytes) are numbered as pieces.
`tokenizers` is imported only when a BPE tokenizer is actually loaded.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from attnctl.errors import AttnctlError
from attnctl.model.config import read_json_object, regular_file
from attnctl.trace import Token

BUNDLED_PATH = Path(__file__).resolve().parent.parent / "data" / "tokenizer.json"


def tokenizer_path(spec: str) -> Path | None:
    """The tokenizer.json a spec names; None for the char tokenizer."""
    if spec == "char":
        return None
    path = BUNDLED_PATH if spec == "bundled" else Path(spec).expanduser()
    return regular_file(path, "tokenizer file", spec)


def vocab_size(spec: str, seq_len: int) -> int:
    """Vocabulary size without importing `tokenizers` (for `shapes` and `memory`).

    For ``char`` the vocabulary is the input's distinct characters: at most ``seq_len``.
    """
    path = tokenizer_path(spec)
    if path is None:
        return seq_len
    return _file_vocab_size(path)


MAX_TOKEN_ID = 2**32 - 1  # tokenizers stores ids as u32


@functools.lru_cache(maxsize=8)
def _file_vocab_size(path: Path) -> int:
    """One more than the largest id in model.vocab and added_tokens, each id checked."""
    data = read_json_object(path, "tokenizer")
    model = data.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...], ids are the positions
        ids = list(range(len(vocab)))
    elif isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: {token: id}
        ids = list(vocab.values())
    else:
        raise AttnctlError(f"malformed tokenizer {path}: model.vocab must be an object or a list")
    added = data.get("added_tokens") or []
    if not isinstance(added, list) or not all(isinstance(t, dict) and "id" in t for t in added):
        raise AttnctlError(f"malformed tokenizer {path}: added_tokens must be a list of tokens")
    ids += [t["id"] for t in added]
    for token_id in ids:
        if type(token_id) is not int or not 0 <= token_id <= MAX_TOKEN_ID:
            raise AttnctlError(
                f"malformed tokenizer {path}: token ids must be integers from 0 to "
                f"{MAX_TOKEN_ID}, got {token_id!r}"
            )
    if not ids:
        raise AttnctlError(f"malformed tokenizer {path}: its vocabulary is empty")
    return max(ids) + 1


@dataclass
class Encoded:
    """A tokenized text: tokens with labels, and the size of the vocabulary they index."""

    tokens: list[Token]
    vocab_size: int
    name: str  # for the header: "bundled BPE", "char", or the path


PAD_TOKENS = ("<pad>", "[PAD]", "<|pad|>", "<|endoftext|>")  # tried in order for padding


@dataclass
class Batch:
    """Several texts tokenized with one vocabulary, to be padded on the right."""

    rows: list[list[Token]]  # each text's own tokens, no padding
    vocab_size: int
    name: str
    pad_id: int

    @property
    def seq_len(self) -> int:
        return max(len(row) for row in self.rows)

    @property
    def padded(self) -> bool:
        return len({len(row) for row in self.rows}) > 1

    def split(self, count: int) -> tuple[Batch, Batch]:
        """The first ``count`` rows and the rest, sharing the vocabulary (texts, contexts)."""
        first, rest = self.rows[:count], self.rows[count:]
        return (
            Batch(first, self.vocab_size, self.name, self.pad_id),
            Batch(rest, self.vocab_size, self.name, self.pad_id),
        )

    def padded_rows(self) -> list[list[Token]]:
        """Each row filled up to ``seq_len`` with pad tokens (visible, marked ``pad``)."""
        return [
            row + [Token(self.pad_id, "<pad>", -1, -1, pad=True)] * (self.seq_len - len(row))
            for row in self.rows
        ]


def encode(text: str, spec: str) -> Encoded:
    """One text; see :func:`encode_batch` for several."""
    batch = encode_batch([text], spec)
    return Encoded(batch.rows[0], batch.vocab_size, batch.name)


def encode_batch(texts: list[str], spec: str) -> Batch:
    for text in texts:
        if text == "":
            raise AttnctlError("a text is empty; give some text to tokenize")
    path = tokenizer_path(spec)
    if path is None:
        batch = _encode_chars(texts)
    else:
        vocab = _file_vocab_size(path)  # every id checked before tokenizers reads the file
        tokenizer = _load(path, spec)
        rows = [_encode_bpe(text, tokenizer) for text in texts]
        pad_id = next((i for t in PAD_TOKENS if (i := tokenizer.token_to_id(t)) is not None), 0)
        name = "bundled BPE" if spec == "bundled" else str(path)
        # the embedding needs a row for the largest id, also where the ids have gaps
        batch = Batch(rows, vocab, name, pad_id)
    for text, row in zip(texts, batch.rows, strict=True):
        if not row:
            raise AttnctlError(f"the tokenizer produced no tokens for {text!r}")
    return batch


def _encode_chars(texts: list[str]) -> Batch:
    """One token per character; ids in order of first appearance (猫吃鱼 -> 0, 1, 2).

    One vocabulary for the whole batch; padding, when needed, gets the next id.
    """
    vocab: dict[str, int] = {}
    rows = []
    for text in texts:
        row = []
        for i, char in enumerate(text):
            row.append(Token(vocab.setdefault(char, len(vocab)), char, i, i + 1))
        rows.append(row)
    padded = len({len(row) for row in rows}) > 1  # (generous: one pad id whenever lengths differ)
    return Batch(rows, len(vocab) + padded, "char", len(vocab))


def _load(path: Path, spec: str):
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises plain Exception on bad files
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise AttnctlError(f"malformed tokenizer {spec}: {reason}") from error
    # Some exported tokenizers pad every text to a fixed length or cut it (sentence-
    # transformers' to 128): attnctl pads batches itself and reports texts too long.
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


METASPACE = "\u2581"  # ▁


def _encode_bpe(text: str, tokenizer) -> list[Token]:
    encoding = tokenizer.encode(text)
    spans = encoding.offsets
    special = encoding.special_tokens_mask
    pieces_of = encoding.tokens
    # sentencepiece's lone word-start mark "▁" (Marian, T5): tokenizers gives it the span
    # of the character after it; it is the space before that word, no piece of it
    marks = [
        not flag and piece == METASPACE for flag, piece in zip(special, pieces_of, strict=True)
    ]
    if any(marks):
        spans = [
            (span[0], span[0]) if mark else span for span, mark in zip(spans, marks, strict=True)
        ]
    pieces = Counter(spans)  # tokens sharing one non-empty span are pieces of one character
    seen: Counter[tuple[int, int]] = Counter()
    tokens = []
    append = tokens.append
    for i, (token_id, span) in enumerate(zip(encoding.ids, spans, strict=True)):
        start, end = span
        count = pieces[span]
        if count == 1 and end > start and not special[i]:  # the common case: a whole span
            append(Token(token_id, text[start:end], start, end))
            continue
        if special[i]:  # [CLS], <s>: no text of their own, show the token itself
            label = pieces_of[i]
        elif marks[i]:
            label = " "
        elif end > start:
            label = text[start:end]
        else:  # a whitespace token whose offsets were trimmed to nothing
            label = tokenizer.decode([token_id], skip_special_tokens=False)
        shared = end > start and not special[i]
        seen[span] += 1
        append(Token(token_id, label, start, end, count if shared else 1,
                     seen[span] if shared else 1))  # fmt: skip
    return tokens


DECODE_CONTEXT = 4  # tokens before each one decoded with it: a character split in bytes


def decode_pieces(
    rows: list[list[int]], spec: str, before_rows: list[list[int]] | None = None
) -> list[list[str]]:
    """Each generated token's text as the tokenizer decodes it in place: the text of the
    tokens before it and it, less the text of those before it (so a character whose
    bytes are split over several tokens shows at the last of them, the others as "\ufffd";
    and a word's leading space stays, which a decoder drops at the start of a text).
    ``before_rows``: the ids before each row (the prompt's). The char tokenizer has no ids
    to decode: its tokens show as their ids."""
    path = tokenizer_path(spec)
    if path is None:
        return [[f"<{token_id}>" for token_id in row] for row in rows]
    tokenizer = _load(path, spec)
    result = []
    for number, generated in enumerate(rows):
        earlier = before_rows[number][-DECODE_CONTEXT:] if before_rows else []
        row = [*earlier, *generated]
        pieces = []
        for n in range(len(earlier), len(row)):
            token_id = row[n]
            before = row[max(0, n - DECODE_CONTEXT) : n]
            head = tokenizer.decode(before, skip_special_tokens=False)
            whole = tokenizer.decode([*before, token_id], skip_special_tokens=False)
            common = 0  # "ab\ufffd" then "ab猫": the bytes of 猫 are whole now
            while common < min(len(head), len(whole)) and head[common] == whole[common]:
                common += 1
            pieces.append(whole[common:])
        result.append(pieces)
    return result


# What a model folder may hold instead of tokenizer.json, and how to make one from it
_CONVERTIBLE = (
    (("sentencepiece.bpe.model",), "a sentencepiece model"),
    (("vocab.json", "merges.txt"), "a byte-level BPE's vocab.json and merges.txt"),
)
_SAVE = (
    'python -c "from transformers import AutoTokenizer as T; '
    "T.from_pretrained('{dir}').save_pretrained('{dir}')\""
)


def missing_tokenizer(folder: Path) -> str:
    """The line for a model folder without tokenizer.json: attnctl reads no other
    tokenizer format (it never guesses one), so it says how to make the file."""
    start = f"no tokenizer.json in {folder}"
    own = (  # attnctl tokenizer reads these itself (attnctl/text/sentencepiece.py)
        (("source.spm",), "Marian's sentencepiece files (source.spm, vocab.json)"),
        (("spiece.model",), "T5's sentencepiece model (spiece.model)"),
    )
    for files, what in own:
        if all((folder / name).is_file() for name in files):
            return (
                f"{start}, only {what}: make it with `attnctl tokenizer {folder}`, "
                "or give one with --tokenizer"
            )
    for files, what in _CONVERTIBLE:
        if all((folder / name).is_file() for name in files):
            extra = (
                "pip install sentencepiece protobuf, then " if files[0].endswith("model") else ""
            )
            return (
                f"{start}, only {what}: make tokenizer.json with {extra}"
                + _SAVE.format(dir=folder)
                + ", or give one with --tokenizer"
            )
    return f"{start}; give one with --tokenizer"


def decode_texts(
    rows: list[list[int]], spec: str, before_rows: list[list[int]] | None = None
) -> list[str]:
    """Each row's generated text, decoded at once (a character split over tokens whole),
    after the ids before it (``before_rows``), as :func:`decode_pieces` reads them."""
    path = tokenizer_path(spec)
    if path is None:
        return ["".join(piece) for piece in decode_pieces(rows, spec)]
    tokenizer = _load(path, spec)
    texts = []
    for number, generated in enumerate(rows):
        earlier = before_rows[number][-DECODE_CONTEXT:] if before_rows else []
        head = tokenizer.decode(earlier, skip_special_tokens=False)
        whole = tokenizer.decode([*earlier, *generated], skip_special_tokens=False)
        common = 0
        while common < min(len(head), len(whole)) and head[common] == whole[common]:
            common += 1
        texts.append(whole[common:])
    return texts
