from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from attnctl.errors import AttnctlError
from attnctl.text.tokenize import BUNDLED_PATH, encode, vocab_size

ROOT = Path(__file__).resolve().parent.parent


def texts(encoded):
    return [t.text for t in encoded.tokens]


def test_bundled_tokenizer_handles_the_tutorial_sentences():
    assert texts(encode("Are you OK?", "bundled")) == ["Are", "you", "OK", "?"]
    fish = encode("猫吃鱼", "bundled")
    assert texts(fish) == ["猫", "吃", "鱼"]
    assert [(t.start, t.end) for t in fish.tokens] == [(0, 1), (1, 2), (2, 3)]
    assert 2000 <= fish.vocab_size <= 5000  # "a few thousand"


def test_unmerged_character_is_labelled_as_pieces_of_itself():
    tokens = encode("龘", "bundled").tokens  # a rare character: 3 byte-level tokens
    assert len(tokens) == 3
    assert [t.text for t in tokens] == ["龘"] * 3
    assert [(t.piece, t.pieces) for t in tokens] == [(1, 3), (2, 3), (3, 3)]


def test_labels_are_text_spans_never_byte_level_strings():
    for token in encode("我喜欢吃苹果，因为它们很甜 Are you OK?", "bundled").tokens:
        assert not set(token.text) & set("ĠçĮ«åĲĥ"), token


def test_char_tokenizer_numbers_characters_by_first_appearance():
    encoded = encode("猫吃鱼猫", "char")
    assert [t.id for t in encoded.tokens] == [0, 1, 2, 0]
    assert encoded.vocab_size == 3


def test_any_tokenizer_json_can_be_loaded(tmp_path):
    tokenizer = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, "[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    encoded = encode("hello there world", str(path))
    assert [t.id for t in encoded.tokens] == [0, 2, 1]
    assert texts(encoded) == ["hello", "there", "world"]
    assert vocab_size(str(path), 10) == 3 == encoded.vocab_size


def test_vocab_size_without_tokenizers_matches_the_library():
    assert vocab_size("bundled", 4) == Tokenizer.from_file(str(BUNDLED_PATH)).get_vocab_size()
    assert vocab_size("char", 17) == 17


@pytest.mark.parametrize("content", ["{not json", '{"model": 3}', "[1, 2]"])
def test_malformed_tokenizer_files_are_usage_errors(tmp_path, content):
    path = tmp_path / "tokenizer.json"
    path.write_text(content)
    with pytest.raises(AttnctlError, match="malformed tokenizer") as caught:
        encode("hi", str(path))
    assert caught.value.exit_code == 2


def test_empty_sentence_and_missing_file():
    with pytest.raises(AttnctlError, match="empty"):
        encode("", "bundled")
    with pytest.raises(AttnctlError, match=r"tokenizer file not found: /no/such\.json"):
        encode("hi", "/no/such.json")


def test_shipped_tokenizer_is_what_the_build_script_makes():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_tokenizer.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_lone_sentencepiece_word_mark_is_the_space_not_a_piece_of_the_next_character(
    tmp_path,
):
    """Metaspace tokenizers (Marian, T5) give "▁" alone the span of the character after it."""
    import tiny_seq2seq

    path = tmp_path / "tokenizer.json"
    tiny_seq2seq.build_tokenizer("marian").save(str(path))
    tokens = encode("猫吃鱼", str(path)).tokens
    assert [t.text for t in tokens] == [" ", "猫", " ", "吃", " ", "鱼", "</s>"]
    assert [(t.piece, t.pieces) for t in tokens] == [(1, 1)] * 7
    assert [(t.start, t.end) for t in tokens[:2]] == [(0, 0), (0, 1)]
