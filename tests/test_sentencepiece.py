"""`attnctl tokenizer DIR`: tokenizer.json from Marian's source.spm + vocab.json and T5's
spiece.model, against transformers' own tokenizers (MarianTokenizer, which runs
sentencepiece; T5Tokenizer converted from the spm) and sentencepiece itself.

The sentencepiece models are trained here, on scripts/corpus, with the `sentencepiece`
package (a test extra): nmt_nfkc and identity normalisation, with and without
add_dummy_prefix. The Marian folders are shaped like opus-mt's: a vocab.json shared by both
sides in an order unlike the spm ids, ``</s>`` 0, ``<unk>`` 1, pieces only the target
side has, language codes, ``<pad>`` last.
"""

from __future__ import annotations

import json
import random
import re
import struct
from pathlib import Path

import pytest
import sentencepiece  # a test extra, like transformers (and protobuf for its T5 converter)
import transformers
from test_terminal import SEPARATORS, help_words, invoke_at

from attnctl.text.sentencepiece import parse_model

ROOT = Path(__file__).resolve().parent.parent
CORPUS = [
    line
    for name in ("en.txt", "zh.txt")
    for line in (ROOT / "scripts" / "corpus" / name).read_text(encoding="utf-8").splitlines()
    if line.strip()
]
# Pieces that only the target side has: vocab.json holds them, source.spm never makes them
TARGET_ONLY = ["▁Katze", "Ж", "жизнь", "▁the▁cat", "<s>", "ß", "▁Straße"]
CODES = [">>fra<<", ">>deu<<"]
EXTRA_TEXTS = [
    "Are you OK?",
    "猫吃鱼",
    "猫吃鱼, and the cat eats fish: 猫は魚を食べる",
    "  two  spaces\tand tab\n newline ",
    " a ",
    "a\n\nb",
    "\t x \t",
    "\u3000ideographic\u00a0space",
    "ＡＢＣ１２３ full width",  # NFKC makes these ASCII
    "Ｈｅｌｌｏ，　世界！",
    "ﬁ ligature ① ㈱",
    "e\u0301 combining, é precomposed",
    "emoji 🙂🙂 x",
    "Ω≈ç√∫˜µ≤≥÷ and Ж",
    "한국어 텍스트 العربية",
    "Katze, die Katze, xЖy, жизнь, the cat",
    "Straße",  # ß unknown to source.spm: vocab.json's ß, never ▁Straße
    "<s> x",
    "a</s>b <unk> <pad>",
    ">>fra<< Are you OK?",
    ">>fra<<猫吃鱼",
    ">>deu<<   Hello",
    "x" * 60,
]
TEXTS = CORPUS + EXTRA_TEXTS
CONFIGS = [("nmt_nfkc", True), ("nmt_nfkc", False), ("identity", True), ("identity", False)]
CONFIG_IDS = [f"{n}-{'prefix' if p else 'noprefix'}" for n, p in CONFIGS]


def _train(path: Path, lines: list[str], normalization: str, dummy_prefix: bool, **ids) -> Path:
    prefix = path.with_suffix("")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(prefix),
        vocab_size=ids.pop("vocab_size", 700),
        hard_vocab_limit=False,
        model_type=ids.pop("model_type", "unigram"),
        normalization_rule_name=normalization,
        add_dummy_prefix=dummy_prefix,
        character_coverage=0.98,  # some rare characters stay unknown
        bos_id=-1,
        minloglevel=2,
        num_threads=1,
        **ids,
    )
    prefix.with_suffix(".model").rename(path)
    return path


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """One source, target and T5 spm per configuration, trained once."""
    cache: dict[tuple[str, bool], Path] = {}

    def _get(normalization: str, dummy_prefix: bool) -> Path:
        key = (normalization, dummy_prefix)
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"spm-{normalization}-{dummy_prefix}")
            marian = {"eos_id": 0, "unk_id": 1, "pad_id": -1}
            _train(folder / "source.spm", CORPUS, normalization, dummy_prefix, **marian)
            target = CORPUS[: len(CORPUS) // 2][::-1]  # another "language": fewer pieces
            _train(folder / "target.spm", target, normalization, dummy_prefix, **marian)
            t5 = {"pad_id": 0, "eos_id": 1, "unk_id": 2}
            _train(folder / "spiece.model", CORPUS, normalization, dummy_prefix, **t5)
            cache[key] = folder
        return cache[key]

    return _get


def marian_folder(trained, tmp_path: Path, normalization="nmt_nfkc", dummy_prefix=True) -> Path:
    """source.spm, target.spm, vocab.json (opus-mt's shape) and tokenizer_config.json."""
    return _marian_folder_from(trained(normalization, dummy_prefix), tmp_path)


def _marian_folder_from(spm_folder: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "opus-mt"
    folder.mkdir()
    pieces: list[str] = []
    for side in ("source", "target"):
        (folder / f"{side}.spm").write_bytes((spm_folder / f"{side}.spm").read_bytes())
        processor = sentencepiece.SentencePieceProcessor(model_file=str(folder / f"{side}.spm"))
        pieces += [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
    rest = list(dict.fromkeys(p for p in pieces + TARGET_ONLY if p not in ("</s>", "<unk>")))
    random.Random(0).shuffle(rest)  # not the spm's order
    order = ["</s>", "<unk>", *rest, *CODES, "<pad>"]
    vocab = {piece: i for i, piece in enumerate(order)}
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=1))
    config = {"source_lang": "en", "target_lang": "fr", "model_max_length": 512}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def t5_folder(trained, tmp_path: Path, normalization="nmt_nfkc", dummy_prefix=True, extra=7):
    folder = tmp_path / "t5"
    folder.mkdir()
    spm = trained(normalization, dummy_prefix) / "spiece.model"
    (folder / "spiece.model").write_bytes(spm.read_bytes())
    config = {"tokenizer_class": "T5Tokenizer", "extra_ids": extra}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "config.json").write_text(json.dumps({"model_type": "t5", "vocab_size": 1000}))
    return folder


def _load(folder: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def _write(invoke, folder: Path, *extra: str):
    result = invoke("tokenizer", str(folder), *extra)
    assert result.exit_code == 0, result.output
    return result


# ---------------------------------------------------------------- Marian


def _marian_reference(folder: Path):
    return transformers.MarianTokenizer(
        str(folder / "source.spm"), str(folder / "target.spm"), str(folder / "vocab.json")
    )


@pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")
@pytest.mark.parametrize(("normalization", "dummy_prefix"), CONFIGS, ids=CONFIG_IDS)
def test_marian_ids_equal_transformers_marian_tokenizer(
    invoke, trained, tmp_path, normalization, dummy_prefix
):
    folder = marian_folder(trained, tmp_path, normalization, dummy_prefix)
    result = _write(invoke, folder)
    size = len(json.loads((folder / "vocab.json").read_text()))
    assert result.stdout == (
        f"wrote {folder / 'tokenizer.json'}: Marian tokenizer, vocab {size}, "
        "from source.spm and vocab.json\n"
    )
    ours, reference = _load(folder), _marian_reference(folder)
    assert ours.get_vocab_size() == size == reference.vocab_size
    assert ours.get_vocab() == reference.get_vocab()  # every piece keeps vocab.json's id
    differ = [t for t in TEXTS if ours.encode(t).ids != reference(t)["input_ids"]]
    assert differ == []
    assert len(TEXTS) >= 230
    eos = reference.eos_token_id
    assert all(ours.encode(t).ids[-1] == eos for t in TEXTS)  # </s> appended, no BOS
    assert ours.encode(">>fra<< Are you OK?").ids[0] == ours.token_to_id(">>fra<<")


USER_DEFINED = ["<sep>", "@@"]
USER_DEFINED_TEXTS = ["a<sep>b", "x @@ y", "<sep> <sep>", " <sep>x", "＠＠ full", "@@"]


@pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")
def test_user_defined_pieces_are_chosen_as_sentencepiece_chooses_them(invoke, tmp_path):
    """sentencepiece puts user-defined pieces in its lattice with a bonus (length · max
    score − 0.1), and ▁ stays a piece of its own before them."""
    spm_folder = tmp_path / "spm"
    spm_folder.mkdir()
    ids = {"eos_id": 0, "unk_id": 1, "pad_id": -1, "user_defined_symbols": USER_DEFINED}
    for side, lines in (("source", CORPUS), ("target", CORPUS[: len(CORPUS) // 2])):
        _train(spm_folder / f"{side}.spm", lines, "nmt_nfkc", True, **dict(ids))
    folder = _marian_folder_from(spm_folder, tmp_path)
    _write(invoke, folder)
    ours, reference = _load(folder), _marian_reference(folder)
    texts = USER_DEFINED_TEXTS + TEXTS
    differ = [t for t in texts if ours.encode(t).ids != reference(t)["input_ids"]]
    assert differ == []
    assert "<sep>" in ours.encode("a<sep>b").tokens
    # the same for T5: sentencepiece's own ids, then </s>
    t5 = tmp_path / "t5"
    t5.mkdir()
    ids = {"pad_id": 0, "eos_id": 1, "unk_id": 2, "user_defined_symbols": USER_DEFINED}
    _train(t5 / "spiece.model", CORPUS, "nmt_nfkc", True, **ids)
    _write(invoke, t5)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(t5 / "spiece.model"))
    ours = _load(t5)
    texts = [t for t in texts if "<" not in t or "<sep>" in t]  # no </s>, <unk>, <pad>
    assert [t for t in texts if ours.encode(t).ids != [*processor.encode(t), 1]] == []


@pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")
def test_marian_decodes_what_it_encodes(invoke, trained, tmp_path):
    folder = marian_folder(trained, tmp_path)
    _write(invoke, folder)
    ours = _load(folder)
    for text in ("Are you OK?", "猫吃鱼", "the cat eats fish"):
        assert ours.decode(ours.encode(text).ids) == text


def test_attnctl_runs_with_the_written_tokenizer(invoke, trained, tmp_path):
    folder = marian_folder(trained, tmp_path)
    _write(invoke, folder)
    path = str(folder / "tokenizer.json")
    result = invoke("run", "Are you OK?", "--tokenizer", path, "--json", "--device", "cpu")
    assert result.exit_code == 0, result.output
    ids = [token["id"] for token in json.loads(result.stdout)["tokens"][0]]
    assert ids == _load(folder).encode("Are you OK?").ids
    assert ids[-1] == 0  # </s>


def test_an_existing_tokenizer_json_is_kept_unless_force(invoke, trained, tmp_path):
    folder = marian_folder(trained, tmp_path)
    (folder / "tokenizer.json").write_text("mine\n")
    result = invoke("tokenizer", str(folder))
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("attnctl: error: ")
    assert f"{folder / 'tokenizer.json'} exists already; give --force" in result.stderr
    assert (folder / "tokenizer.json").read_text() == "mine\n"
    _write(invoke, folder, "--force")
    assert _load(folder).get_vocab_size() > 700
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []


# ---------------------------------------------------------------- T5


def test_t5_ids_equal_transformers_t5_tokenizer(invoke, trained, tmp_path):
    """T5's own setting (nmt_nfkc, add_dummy_prefix): transformers converts spiece.model
    itself (T5Converter, with sentencepiece and protobuf); the ids are the same."""
    folder = t5_folder(trained, tmp_path)
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    result = _write(invoke, folder)
    pieces = sentencepiece.SentencePieceProcessor(model_file=str(folder / "spiece.model"))
    size = pieces.get_piece_size() + 7
    assert result.stdout == (
        f"wrote {folder / 'tokenizer.json'}: T5 tokenizer, vocab {size}, from spiece.model\n"
    )
    ours = _load(folder)
    assert ours.get_vocab() == reference.get_vocab()
    assert ours.token_to_id("<extra_id_0>") == size - 1  # reversed, as transformers adds them
    assert ours.token_to_id("<extra_id_6>") == size - 7
    texts = [*TEXTS, "<extra_id_0> x <extra_id_6>.", "a</s>b"]
    differ = [t for t in texts if ours.encode(t).ids != reference(t)["input_ids"]]
    assert differ == []


@pytest.mark.parametrize(("normalization", "dummy_prefix"), CONFIGS, ids=CONFIG_IDS)
def test_t5_ids_equal_sentencepiece(invoke, trained, tmp_path, normalization, dummy_prefix):
    """Every configuration, also those where transformers' converter departs from the spm
    (it always prepends ▁ and splits on any Unicode whitespace): sentencepiece's ids + </s>."""
    folder = t5_folder(trained, tmp_path, normalization, dummy_prefix)
    _write(invoke, folder)
    ours = _load(folder)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(folder / "spiece.model"))
    texts = [t for t in TEXTS if "</s>" not in t and "<unk>" not in t and "<pad>" not in t]
    differ = [t for t in texts if ours.encode(t).ids != [*processor.encode(t), 1]]
    assert differ == []
    assert len(texts) >= 230


# ---------------------------------------------------------------- bad input


def _fails(invoke, folder: Path, message: str, *extra: str) -> None:
    result = invoke("tokenizer", str(folder), *extra)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnctl: error: "), result.stderr
    assert message in lines[0], lines[0]
    if folder.is_dir():
        assert not (folder / "tokenizer.json").exists()
        assert [p.name for p in folder.iterdir() if p.name.startswith(".tokenizer")] == []


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _spm_bytes(folder: Path) -> bytes:
    return (folder / "source.spm").read_bytes()


BAD_SPM = {
    "truncated": (lambda data: data[: len(data) // 2], "truncated?"),
    "empty": (lambda data: b"", "it has no pieces"),
    "text": (lambda data: b"placeholder: not a sentencepiece model\n", "malformed sentencepiece"),
    "a length beyond the file": (
        lambda data: b"\x0a" + _varint(2**40) + b"x" * 16,
        "it ends inside a field (truncated?)",
    ),
    "an endless varint": (lambda data: b"\x0a" + b"\xff" * 20, "longer than 10 bytes"),
    "a group wire type": (lambda data: b"\x0b\x0c", "wire type 3"),
    "a piece without text": (lambda data: b"\x0a\x05\x15\x00\x00\x80\xbf", "has no text"),
    "a NaN score": (
        lambda data: b"\x0a\x08\x0a\x01a\x15" + struct.pack("<f", float("nan")),
        "has the score nan",
    ),
    "a string where a score goes": (
        lambda data: b"\x0a\x06\x0a\x01a\x12\x01b",
        "piece 0's score has the wrong wire type",
    ),
    "not UTF-8": (lambda data: b"\x0a\x03\x0a\x01\xff", "piece 0's text is not UTF-8"),
    "duplicate pieces": (
        lambda data: b"\x0a\x03\x0a\x01a" * 2,
        "pieces 0 and 1 are both 'a'",
    ),
    "a piece of unknown type": (lambda data: b"\x0a\x05\x0a\x01a\x18\x09", "unknown type 9"),
    "no unknown piece": (lambda data: b"\x0a\x03\x0a\x01a", "it has 0 unknown pieces"),
}


@pytest.mark.parametrize("case", list(BAD_SPM), ids=list(BAD_SPM))
def test_a_broken_source_spm_is_one_line(invoke, trained, tmp_path, case):
    folder = marian_folder(trained, tmp_path)
    change, message = BAD_SPM[case]
    (folder / "source.spm").write_bytes(change(_spm_bytes(folder)))
    _fails(invoke, folder, message)


def test_a_broken_charsmap_is_one_line(invoke, trained, tmp_path):
    folder = marian_folder(trained, tmp_path)
    data = _spm_bytes(folder)
    model = parse_model(data)
    assert len(model.charsmap) > 1000  # nmt_nfkc's map
    start = data.index(model.charsmap)
    broken = data[:start] + struct.pack("<I", len(model.charsmap) * 2) + data[start + 4 :]
    (folder / "source.spm").write_bytes(broken)
    _fails(invoke, folder, "precompiled_charsmap claims a trie of")


def test_a_bpe_sentencepiece_model_is_named(invoke, trained, tmp_path):
    folder = marian_folder(trained, tmp_path)
    ids = {"eos_id": 0, "unk_id": 1, "pad_id": -1, "model_type": "bpe"}
    _train(folder / "source.spm", CORPUS, "nmt_nfkc", True, **ids)
    _fails(invoke, folder, "source.spm is a BPE sentencepiece model; attnctl tokenizer builds")


def _edit_vocab(folder: Path, change) -> None:
    vocab = json.loads((folder / "vocab.json").read_text())
    (folder / "vocab.json").write_text(json.dumps(change(vocab), ensure_ascii=False))


BAD_VOCAB = {
    "a list": (lambda v: list(v), "expected a JSON object"),
    "a string id": (lambda v: {**v, "</s>": "0"}, "'</s>' has the id '0', not an integer"),
    "a bool id": (lambda v: {**v, "</s>": False}, "'</s>' has the id False"),
    "a float id": (lambda v: {**v, "</s>": 0.0}, "'</s>' has the id 0.0"),
    "an id out of range": (lambda v: {**v, "<pad>": len(v)}, "outside 0.."),
    "a negative id": (lambda v: {**v, "<pad>": -1}, "'<pad>' has the id -1, outside"),
    "duplicate ids": (lambda v: {**v, "<pad>": 0, "new": len(v) - 1}, "both have the id 0"),
    "no unk": (
        lambda v: {("<UNK>" if k == "<unk>" else k): i for k, i in v.items()},
        "it has no <unk>",
    ),
    "empty": (lambda v: {}, "it is empty"),
}


@pytest.mark.parametrize("case", list(BAD_VOCAB), ids=list(BAD_VOCAB))
def test_a_bad_vocab_json_is_one_line(invoke, trained, tmp_path, case):
    folder = marian_folder(trained, tmp_path)
    change, message = BAD_VOCAB[case]
    _edit_vocab(folder, change)
    _fails(invoke, folder, message)


@pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")
def test_source_pieces_vocab_json_lacks_are_left_out_and_reported(invoke, trained, tmp_path):
    """MarianTokenizer reads them as <unk>; a tokenizer.json cannot give two pieces one id,
    so they leave the lattice: the other texts keep MarianTokenizer's ids."""
    folder = marian_folder(trained, tmp_path)
    _edit_vocab(folder, lambda v: {**{k: i for k, i in v.items() if k != "▁the"}, "x-": v["▁the"]})
    result = _write(invoke, folder)
    assert result.stdout.startswith(f"wrote {folder / 'tokenizer.json'}: Marian tokenizer")
    assert result.stderr == (
        "attnctl: note: 1 piece of source.spm not in vocab.json (the first '▁the'): "
        "transformers' MarianTokenizer reads them as <unk>, this tokenizer.json splits them "
        "into pieces vocab.json has\n"
    )
    ours, reference = _load(folder), _marian_reference(folder)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(folder / "source.spm"))
    untouched = [t for t in TEXTS if "▁the" not in processor.encode(t, out_type=str)]
    assert len(untouched) >= 100
    assert [t for t in untouched if ours.encode(t).ids != reference(t)["input_ids"]] == []
    assert reference("the cat")["input_ids"][0] == reference.unk_token_id
    assert reference.unk_token_id not in ours.encode("the cat").ids
    assert ours.decode(ours.encode("the cat").ids) == "the cat"


def test_other_marian_settings_are_refused_by_name(invoke, trained, tmp_path):
    folder = marian_folder(trained, tmp_path)
    (folder / "tokenizer_config.json").write_text(json.dumps({"separate_vocabs": True}))
    _fails(invoke, folder, "sets separate_vocabs")
    (folder / "tokenizer_config.json").write_text(json.dumps({"unk_token": 7}))
    _fails(invoke, folder, "unk_token must be a token, got 7")
    (folder / "tokenizer_config.json").write_text("{not json")
    _fails(invoke, folder, "malformed tokenizer config")


def test_byte_fallback_is_refused_by_name(invoke, trained, tmp_path):
    folder = marian_folder(trained, tmp_path)
    ids = {"eos_id": 0, "unk_id": 1, "pad_id": -1, "byte_fallback": True, "vocab_size": 1000}
    _train(folder / "source.spm", CORPUS, "nmt_nfkc", True, **ids)
    _fails(invoke, folder, "uses sentencepiece's byte_fallback")


def test_bad_t5_settings_are_one_line(invoke, trained, tmp_path):
    folder = t5_folder(trained, tmp_path, extra=-1)
    _fails(invoke, folder, "extra_ids must be an integer from 0 to 10000, got -1")
    (folder / "tokenizer_config.json").write_text(json.dumps({"extra_ids": True}))
    _fails(invoke, folder, "got True")
    (folder / "tokenizer_config.json").write_text(json.dumps({"extra_ids": 500}))
    _fails(invoke, folder, "more than the model's vocab_size 1000")


def test_a_folder_without_sentencepiece_files_is_one_line(invoke, tmp_path):
    _fails(invoke, tmp_path, f"no sentencepiece files in {tmp_path}")
    _fails(invoke, tmp_path / "nowhere", f"model folder not found: {tmp_path / 'nowhere'}")
    (tmp_path / "file").write_text("x")
    _fails(invoke, tmp_path / "file", "model folder not a folder")


def test_a_huge_length_field_is_refused_at_once():
    """A length that the file cannot hold is refused before any loop or allocation."""
    from attnctl.text.sentencepiece import _fields, _Malformed

    with pytest.raises(_Malformed, match="truncated"):
        list(_fields(memoryview(b"\x0a" + _varint(2**62))))


# ---------------------------------------------------------------- help


@pytest.mark.parametrize("columns", ["80", "60"])
def test_tokenizer_help_never_breaks_a_word(columns):
    out = invoke_at(("tokenizer", "--help"), columns).stdout
    assert "…" not in out
    assert all(len(line) <= int(columns) for line in out.splitlines())
    shown = {word.rstrip(".") for word in re.split(SEPARATORS, out)}
    words = help_words(("tokenizer",))
    assert {"source.spm", "vocab.json", "spiece.model", "--force"} <= set(words) | shown
    assert not [word for word in words if word not in shown]


# ---------------------------------------------------------------- the missing-tokenizer line


@pytest.mark.parametrize("family", ["marian", "t5"])
def test_a_folder_without_tokenizer_json_points_to_attnctl_tokenizer(invoke, tmp_path, family):
    import tiny_seq2seq

    folder = tiny_seq2seq.write_sentencepiece_only(family, tmp_path / family)
    result = invoke("run", "Are you OK?", "--model", str(folder), "--device", "cpu")
    assert result.exit_code == 2 and result.stdout == ""
    files = "source.spm, vocab.json" if family == "marian" else "spiece.model"
    assert f"no tokenizer.json in {folder}, only " in result.stderr
    assert f"({files}): make it with `attnctl tokenizer {folder}`" in result.stderr
    assert "transformers cannot" not in result.stderr
    # the placeholder files are no sentencepiece models: one line, nothing written
    _fails(invoke, folder, "malformed sentencepiece model")


# ---------------------------------------------------------------- end to end


@pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")
def test_an_opus_mt_like_folder_runs_as_transformers_does(invoke, trained, tmp_path):
    """source.spm + vocab.json -> attnctl tokenizer -> run --model: the tokens are
    MarianTokenizer's, and the encoder attention transformers' eager one on those ids."""
    import tiny_seq2seq
    import torch

    folder = marian_folder(trained, tmp_path)
    _write(invoke, folder)
    model = tiny_seq2seq.build_model("marian", _load(folder))
    model.save_pretrained(folder, safe_serialization=True)
    text = "Are you OK? 猫吃鱼"
    args = ("run", text, "--model", str(folder), "--layer", "1", "--json", "--device", "cpu")
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    source_ids = _marian_reference(folder)(text)["input_ids"]
    assert [token["id"] for token in report["tokens"][0]] == source_ids
    with torch.no_grad():
        encoded = model.model.encoder(torch.tensor([source_ids]), output_attentions=True)
    ours = torch.tensor(report["attention"])  # (B, H, L, L)
    assert ours.shape == encoded.attentions[1].shape
    assert (ours - encoded.attentions[1]).abs().max() <= 1e-5


def test_attnctl_tokenizer_never_imports_torch(trained, tmp_path):
    import subprocess
    import sys

    folder = marian_folder(trained, tmp_path)
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from attnctl.cli import app\n"
        f"result = CliRunner().invoke(app, ['tokenizer', {str(folder)!r}])\n"
        "assert result.exit_code == 0, result.output\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
    assert (folder / "tokenizer.json").is_file()
