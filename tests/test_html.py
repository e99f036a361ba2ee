"""run … --html FILE: one self-contained page that holds what --json holds."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_models
import tiny_seq2seq
from typer.testing import CliRunner

from attnctl.cli import app
from attnctl.render.html import (
    ATTENTION_KEYS,
    DATA_ID,
    WIDE_LIMIT,
    decode_attention,
    encode_attention,
    html_page,
    page_data,
    script_json,
)

RUNNER = CliRunner()
SMALL = ("--d-model", "32", "--heads", "4", "--device", "cpu")
DATA_BLOCK = re.compile(
    rf'<script type="application/json" id="{DATA_ID}">(?P<data>.*?)</script>', re.DOTALL
)


def invoke(*args: str):
    env = {"COLUMNS": "100", "NO_COLOR": "1", "TERM": "dumb"}
    return RUNNER.invoke(app, list(args), env=env)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("html-models")
    return {
        "gpt2": tiny_models.write("gpt2", folder / "gpt2"),
        "marian": tiny_seq2seq.write("marian", folder / "marian"),
    }


def words(text: str) -> list[str]:
    return text.split()


def views(models: dict[str, Path]) -> dict[str, tuple[str, ...]]:
    """Every run view the page draws: (arguments of run)."""
    gpt2, marian = str(models["gpt2"]), str(models["marian"])
    cpu = ("--device", "cpu")
    return {
        "seeded": ("Are you OK?", *SMALL),
        "batch": ("the cat", "a dog sat down", *SMALL),
        "context": ("the cat sat", "--context", "a dog ran off", *SMALL),
        "model-layer": ("hello world", "--model", gpt2, "--layer", "1", *cpu),
        "model-all": ("hello world", "--model", gpt2, "--layer", "all", *cpu),
        "rows": ("abcdefghijkl", *words("--tokenizer char --rows 0:3 --rows last:2"), *SMALL),
        "generate": ("hello", "--model", gpt2, "--generate", "3", *cpu),
        "generate-all": ("hello", "--model", gpt2, *words("--generate 2 --layer all"), *cpu),
        "seq2seq": ("猫吃鱼", "--model", marian, "--generate", "4", *cpu),
        "seq2seq-all": ("猫吃鱼", "--model", marian, *words("--generate 3 --layer all"), *cpu),
    }


VIEW_NAMES = ("seeded", "batch", "context", "model-layer", "model-all", "rows", "generate",
              "generate-all", "seq2seq", "seq2seq-all")  # fmt: skip


def embedded(page: str) -> dict:
    """The document the page embeds (its one data block)."""
    blocks = DATA_BLOCK.findall(page)
    assert len(blocks) == 1
    return json.loads(blocks[0])


def assert_self_contained(page: str) -> None:
    lowered = page.lower()
    # the only "http" is the Content-Security-Policy's http-equiv: no URL of any scheme
    assert lowered.replace("http-equiv", "").count("http") == 0
    for forbidden in ("://", "url(", "@import", "@font-face", "fetch(", "xmlhttprequest",
                      "websocket", "eventsource", "sendbeacon", "import(", "<link", "<iframe",
                      "<img", "<object", "<embed"):  # fmt: skip
        assert forbidden not in lowered, forbidden
    # no protocol-relative URL either: the markup, style and script hold no "//" at all (the
    # data block's base64 may)
    assert "//" not in DATA_BLOCK.sub("", page)
    for attribute in re.findall(r"""\b(?:src|href|action|srcset)\s*=\s*["']?([^"'\s>]*)""", page):
        assert attribute.startswith(("#", "data:")), attribute
    assert "default-src 'none'" in page  # the browser itself refuses any request
    for markup_sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write"):
        assert markup_sink not in page, markup_sink  # user text goes in as textContent


def html_and_json(args: tuple[str, ...], path: Path) -> tuple[str, dict]:
    """The page written by run ARGS --html PATH --json, and the JSON printed."""
    result = invoke("run", *args, "--json", "--html", str(path))
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    return path.read_text(encoding="utf-8"), json.loads(result.stdout)


def attention_arrays(document: dict) -> dict[str, object]:
    """Each attention array of a document by where it is: key, or layers[.kind].N."""
    found = {key: document[key] for key in ATTENTION_KEYS if document.get(key) is not None}
    layers = document.get("layers")
    groups = layers.items() if isinstance(layers, dict) else [("", layers or [])]
    for kind, blocks in groups:
        for index, block in enumerate(blocks or []):
            found[f"layers.{kind}.{index}"] = block["attention"]
    return found


def assert_close(decoded: list, original: list, bits: int) -> None:
    top = (1 << bits) - 1
    for per_text, want_text in zip(decoded, original, strict=True):
        for head, want_head in zip(per_text, want_text, strict=True):
            for row, want in zip(head, want_head, strict=True):
                step = max(want) / top
                bound = step / 2 * 1.0001 + 1e-12
                assert len(row) == len(want)
                for got, weight in zip(row, want, strict=True):
                    if weight <= 0:
                        assert got == 0.0  # exactly 0 (a masked key) stays exactly 0
                    elif weight < step / 2:
                        assert got == pytest.approx(step, rel=1e-6)  # above 0: one step
                    else:
                        assert abs(got - weight) <= bound


# ---------------------------------------------------------------- every view


@pytest.mark.parametrize("name", VIEW_NAMES)
def test_every_view_gives_a_self_contained_page_holding_the_json(name, models, tmp_path):
    page, document = html_and_json(views(models)[name], tmp_path / "report.html")
    assert page.startswith("<!DOCTYPE html>")
    assert_self_contained(page)
    data = embedded(page)
    want, got = attention_arrays(document), attention_arrays(data)
    assert want and got.keys() == want.keys()
    for where, encoded in got.items():
        assert encoded["encoding"] == "rowmax-uint"
        assert encoded["bits"] == 16  # a short input: 16 bits a weight
        assert_close(decode_attention(encoded), want[where], encoded["bits"])
    # everything else is the JSON document, key for key
    rest = {k: v for k, v in data.items() if k not in ATTENTION_KEYS and k != "layers"}
    assert rest == {k: v for k, v in document.items() if k not in ATTENTION_KEYS and k != "layers"}
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]  # no temporary file left


def test_the_rows_computed_are_the_rows_in_the_page(models, tmp_path):
    page, document = html_and_json(views(models)["rows"], tmp_path / "rows.html")
    data = embedded(page)
    assert data["attention_rows"] == document["attention_rows"] == [0, 1, 2, 10, 11]
    assert data["attention"]["shape"] == [1, 4, 5, 12]


def test_without_json_the_page_is_the_same_and_the_terminal_view_is_printed(tmp_path):
    args = ("run", "Are you OK?", *SMALL)
    with_json = invoke(*args, "--json", "--html", str(tmp_path / "a.html"))
    alone = invoke(*args, "--html", str(tmp_path / "b.html"))
    assert with_json.exit_code == alone.exit_code == 0, alone.output
    assert alone.stdout == invoke(*args).stdout  # the terminal view, unchanged
    assert (tmp_path / "a.html").read_bytes() == (tmp_path / "b.html").read_bytes()


def test_every_head_is_in_the_page_even_where_the_terminal_shows_eight(tmp_path):
    path = tmp_path / "heads.html"
    result = invoke("run", "Are you OK?", "--d-model", "48", "--heads", "12", "--device", "cpu",
                    "--html", str(path))  # fmt: skip
    assert result.exit_code == 0, result.output
    data = embedded(path.read_text(encoding="utf-8"))
    assert data["attention_heads"] == list(range(12))
    assert data["attention"]["shape"] == [1, 12, 4, 4]


def test_head_and_rows_choose_what_the_page_holds_as_its_help_says(tmp_path):
    path = tmp_path / "one.html"
    result = invoke("run", "abcdefghijkl", *words("--tokenizer char --head 2 --rows 0:1"),
                    *SMALL, "--html", str(path))  # fmt: skip
    assert result.exit_code == 0, result.output
    data = embedded(path.read_text(encoding="utf-8"))
    assert (data["attention_heads"], data["attention_rows"]) == ([2], [0])
    assert data["attention"]["shape"] == [1, 1, 1, 12]  # one head, one row, every key
    from attnctl.cli.options import HtmlOption

    help_text = HtmlOption.__metadata__[0].help
    for said in ("every head", "those --head names", "the query rows computed", "--rows"):
        assert said in help_text, help_text


def test_the_same_input_gives_the_same_bytes(models, tmp_path):
    for name in ("seeded", "model-all", "seq2seq"):
        first, second = tmp_path / f"{name}-1.html", tmp_path / f"{name}-2.html"
        for path in (first, second):
            result = invoke("run", *views(models)[name], "--html", str(path))
            assert result.exit_code == 0, result.output
        assert first.read_bytes() == second.read_bytes()


def test_extra_keys_and_nulls_pass_through(tmp_path):
    """Keys a later schema adds and keys present as null where they do not apply."""
    result = invoke("run", "Are you OK?", *SMALL, "--json")
    document = json.loads(result.stdout)
    nulls = words(
        "prompt_tokens source_tokens target_tokens layers steps "
        "alignment encoder_attention decoder_attention cross_attention generated_text"
    )
    widened = {**document, "a_later_key": {"x": [1, 2]}, **dict.fromkeys(nulls)}
    data = page_data(widened)
    assert data["schema_version"] == document["schema_version"] == 1
    assert data["a_later_key"] == {"x": [1, 2]} and all(data[key] is None for key in nulls)
    assert data["attention"]["shape"] == [1, 4, 4, 4]
    assert embedded(html_page(widened)) == data


# ---------------------------------------------------------------- user text


INJECTION = "</script><img src=x onerror=alert(1)> <!-- <script>alert(2)</script>"


def test_a_sentence_cannot_close_the_script_or_add_markup(tmp_path):
    path = tmp_path / "inject.html"
    result = invoke("run", INJECTION, "--tokenizer", "char", *SMALL, "--html", str(path))
    assert result.exit_code == 0, result.output
    page = path.read_text(encoding="utf-8")
    assert page.lower().count("</script") == 2  # the data block's end and the script's
    assert page.lower().count("<script") == 2
    assert "<img" not in page and "<!--" not in page
    raw = DATA_BLOCK.search(page)["data"]
    assert not set(raw) & set("<>&\u2028\u2029")
    texts = "".join(token["text"] for token in embedded(page)["tokens"][0])
    assert texts == INJECTION  # one token a character
    assert "&lt;/script&gt;" in page.split("</title>")[0]  # the tab's title, escaped


def test_tokens_with_markup_characters_round_trip(tmp_path):
    text = "a&b<c>d\"e'f\u2028g\u2029h"
    path = tmp_path / "quotes.html"
    result = invoke("run", text, "--tokenizer", "char", *SMALL, "--html", str(path))
    assert result.exit_code == 0, result.output
    page = path.read_text(encoding="utf-8")
    assert "\u2028" not in page and "\u2029" not in page
    tokens = [t["text"] for t in embedded(page)["tokens"][0]]
    assert {"&", "<", ">", '"', "'"} <= set(tokens)


def test_script_json_escapes_what_html_would_read():
    text = script_json({"t": "</script>&\u2028\u2029<!--"})
    assert text == '{"t":"\\u003c/script\\u003e\\u0026\\u2028\\u2029\\u003c!--"}'
    assert json.loads(text) == {"t": "</script>&\u2028\u2029<!--"}


def test_not_finite_numbers_become_null():
    data = page_data({"head_stats": [{"entropy": float("nan"), "top": float("inf")}]})
    assert data == {"head_stats": [{"entropy": None, "top": None}]}
    encoded = encode_attention([[[[float("nan"), 0.5, 0.5]]]])
    assert decode_attention(encoded) == [[[[0.0, 0.5, 0.5]]]]


# ---------------------------------------------------------------- the encoding


def test_the_encoding_holds_each_weight_within_half_a_step_of_its_row_maximum(monkeypatch):
    import attnctl.render.html as html_module

    rows = [
        [[[0.7, 0.2, 0.1, 0.0], [0.25, 0.25, 0.25, 0.25]], [[1e-9, 1e-6, 0.999, 0.0], [0.0] * 4]]
    ]
    wide = encode_attention(rows)
    monkeypatch.setattr(html_module, "WIDE_LIMIT", 0)  # the 8-bit form, as a long input gets
    narrow = encode_attention(rows)
    assert (wide["bits"], narrow["bits"]) == (16, 8)
    for encoded in (wide, narrow):
        assert_close(decode_attention(encoded), rows, encoded["bits"])
        assert decode_attention(encoded)[0][1][1] == [0.0] * 4  # a row of zeros stays zeros
        tiny, masked = decode_attention(encoded)[0][1][0][0], decode_attention(encoded)[0][1][0][3]
        assert tiny > 0 and masked == 0.0  # a weight of 1e-9 is not read as masked
    assert len(narrow["data"]) < len(wide["data"])


def test_a_ragged_array_is_refused():
    from attnctl.errors import AttnctlError

    with pytest.raises(AttnctlError, match="not a"):
        encode_attention([[[[0.5, 0.5], [1.0]]]])


def test_a_long_input_stays_a_few_megabytes(tmp_path):
    text = ("the cat sat on the mat. " * 400)[:8192]
    source = tmp_path / "long.txt"
    source.write_text(text, encoding="utf-8")
    path = tmp_path / "long.html"
    result = invoke("run", "--file", str(source), "--tokenizer", "char", "--d-model", "32",
                    "--heads", "8", "--device", "cpu", "--html", str(path))  # fmt: skip
    assert result.exit_code == 0, result.output
    size = path.stat().st_size
    data = embedded(path.read_text(encoding="utf-8"))
    assert len(data["tokens"][0]) == 8192 and len(data["attention_rows"]) == 32  # default rows
    assert data["attention"]["shape"] == [1, 8, 32, 8192]
    assert WIDE_LIMIT < 8 * 32 * 8192 and data["attention"]["bits"] == 8
    assert size < 4_000_000, size  # 2.1 M weights: one byte each, base64


# ---------------------------------------------------------------- the file


@pytest.mark.parametrize(
    ("make", "given", "message"),
    [
        (None, "", "--html needs a file name"),
        ("dir", "out.html", "is a folder, not a file"),
        (None, "missing/out.html", "no folder"),
    ],
)
def test_a_path_that_cannot_be_written_is_refused_before_the_run(
    make, given, message, tmp_path, monkeypatch
):
    import attnctl.app.use_cases as use_cases

    def not_reached(*args, **kwargs):
        raise AssertionError("the run started")

    monkeypatch.setattr(use_cases, "run_use_case", not_reached)
    if make == "dir":
        (tmp_path / given).mkdir()
    target = str(tmp_path / given) if given else ""
    result = invoke("run", "the cat", *SMALL, "--html", target)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert [p.name for p in tmp_path.iterdir()] == (["out.html"] if make == "dir" else [])


def test_a_folder_that_is_not_writable_is_refused(tmp_path, monkeypatch):
    import attnctl.output_files as output_files

    # os.access, not chmod: root may write into a read-only folder
    monkeypatch.setattr(output_files.os, "access", lambda path, mode: False)
    result = invoke("run", "the cat", *SMALL, "--html", str(tmp_path / "out.html"))
    assert result.exit_code == 2 and "not writable" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_exits_1_and_keeps_the_old_file(tmp_path, monkeypatch):
    import attnctl.output_files as output_files

    def full_disk(source, destination):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(output_files.os, "replace", full_disk)
    target = tmp_path / "out.html"
    target.write_text("old", encoding="utf-8")
    result = invoke("run", "the cat", *SMALL, "--html", str(target))
    assert result.exit_code == 1
    assert result.stderr.strip().endswith("No space left on device")
    assert len(result.stderr.strip().splitlines()) == 1
    assert target.read_text(encoding="utf-8") == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.html"]


def test_a_run_that_fails_writes_nothing(tmp_path):
    target = tmp_path / "out.html"
    result = invoke("run", "the cat", *SMALL, "--head", "9", "--html", str(target))
    assert result.exit_code == 2, result.output
    assert not target.exists()


def test_help_names_the_option_and_never_loads_the_page_module():
    result = RUNNER.invoke(app, ["run", "--help"], env={"COLUMNS": "60", "NO_COLOR": "1"})
    assert result.exit_code == 0 and "--html" in result.stdout
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from attnctl.cli import app\n"
        "for args in (['--help'], ['run', '--help']):\n"
        "    assert CliRunner().invoke(app, args).exit_code == 0\n"
        "print('attnctl.render.html' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
