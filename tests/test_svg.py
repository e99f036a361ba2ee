"""--svg FILE on run, shapes, memory and check: the terminal view as a self-contained SVG."""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
from typer.testing import CliRunner

from attnctl.cli import app
from attnctl.render.terminal_heatmap import UPPER_HALF

SVG_NAMESPACE = "http://www.w3.org/2000/svg"
SMALL = ("--d-model", "16", "--heads", "2", "--device", "cpu", "--seed", "1")
COMMANDS = {
    "run": ("run", "the cat sat", *SMALL),
    "shapes": ("shapes", "-L", "8", *SMALL),
    "memory": ("memory", "-L", "64,128", "--d-model", "16", "--heads", "2"),
    "check": ("check", "-L", "4", "-B", "1", *SMALL),
}
RUNNER = CliRunner()


def invoke(*args: str, columns: int = 80):
    env = {"COLUMNS": str(columns), "NO_COLOR": "1", "TERM": "dumb"}
    return RUNNER.invoke(app, list(args), env=env)


def svg_of(args: tuple[str, ...], path: Path, columns: int = 80) -> tuple[str, str]:
    """(what was printed, the SVG's text) of the command with --svg path."""
    result = invoke(*args, "--svg", str(path), columns=columns)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    return result.stdout, path.read_text(encoding="utf-8")


def svg_texts(document: str) -> str:
    """Every text element's content, in order (rich writes spaces as no-break spaces)."""
    root = ElementTree.fromstring(document)
    texts = root.iter(f"{{{SVG_NAMESPACE}}}text")
    return "".join(element.text or "" for element in texts).replace("\xa0", " ")


def assert_self_contained(document: str) -> None:
    # the namespace is an identifier nothing fetches; no other URL, font, link or clip reference
    assert document.count(SVG_NAMESPACE) == 1
    rest = document.replace(f'xmlns="{SVG_NAMESPACE}"', "")
    for forbidden in ("http", "url(", "href", "@font-face", "@import", "<script"):
        assert forbidden not in rest.lower(), forbidden


@pytest.mark.parametrize("name", COMMANDS)
def test_the_view_is_saved_as_a_self_contained_svg(name, tmp_path):
    args = COMMANDS[name]
    plain = invoke(*args)
    assert plain.exit_code == 0, plain.output
    printed, document = svg_of(args, tmp_path / "view.svg")
    assert printed == plain.stdout  # the terminal output is unchanged
    root = ElementTree.fromstring(document)
    assert root.tag == f"{{{SVG_NAMESPACE}}}svg"
    assert_self_contained(document)
    drawn = svg_texts(document)
    assert f"attnctl {name}" in drawn  # the title
    for line in printed.splitlines():  # every printed word is drawn, in order
        for word in line.split():
            assert word in drawn, word
    assert [p.name for p in tmp_path.iterdir()] == ["view.svg"]  # no temporary file left


@pytest.mark.parametrize("name", COMMANDS)
def test_the_same_input_gives_the_same_bytes(name, tmp_path):
    first, second = tmp_path / "first.svg", tmp_path / "second.svg"
    svg_of(COMMANDS[name], first)
    svg_of(COMMANDS[name], second)
    assert first.read_bytes() == second.read_bytes()


def test_user_text_is_escaped(tmp_path):
    sentence = '</text><script>alert("x")</script> & <b>'
    args = ("run", sentence, "--tokenizer", "char", *SMALL)
    printed, document = svg_of(args, tmp_path / "escaped.svg", columns=120)
    assert "<script" not in document and "&lt;script&gt;" in document
    assert_self_contained(document)
    root = ElementTree.fromstring(document)
    assert not [e for e in root.iter() if e.tag.endswith("script")]
    drawn = svg_texts(document)
    assert sentence in printed and sentence in drawn
    for token in ("<", "&", '"'):  # char tokens, each in the token table
        assert re.search(rf"\d+\s+\d+\s+{re.escape(token)}\s", drawn)


def test_the_picture_has_the_console_width(tmp_path):
    def width(columns: int) -> float:
        _, document = svg_of(COMMANDS["shapes"], tmp_path / f"{columns}.svg", columns)
        return float(ElementTree.fromstring(document).get("viewBox").split()[2])

    narrow, wide = width(40), width(120)
    assert narrow < wide
    # rich's cells: 0.61 of a 20 px font each, plus the same margins at both widths
    assert wide - narrow == pytest.approx(80 * 20 * 0.61, abs=1)


def test_check_saves_its_view_also_when_it_fails(tmp_path, monkeypatch):
    from attnctl.app import use_cases

    real = use_cases.check_use_case

    def failing(*args, **kwargs):  # gradcheck "failed": check exits 1 after its view
        report = real(*args, **kwargs)
        return dataclasses.replace(
            report, result=dataclasses.replace(report.result, gradcheck=False)
        )

    monkeypatch.setattr(use_cases, "check_use_case", failing)
    path = tmp_path / "check.svg"
    result = invoke(*COMMANDS["check"], "--svg", str(path))
    assert result.exit_code == 1, result.output
    assert result.stderr == ""
    assert "attnctl check" in svg_texts(path.read_text(encoding="utf-8"))


def one_line_error(result, code: int, message: str) -> None:
    assert result.exit_code == code, result.output
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith("attnctl: error: --svg") and message in result.stderr


@pytest.mark.parametrize("name", COMMANDS)
def test_a_folder_or_a_missing_folder_is_refused_before_the_run(name, tmp_path):
    one_line_error(invoke(*COMMANDS[name], "--svg", str(tmp_path)), 2, "is a folder")
    missing = tmp_path / "no" / "such" / "view.svg"
    one_line_error(invoke(*COMMANDS[name], "--svg", str(missing)), 2, "no folder")
    a_file = tmp_path / "file"
    a_file.write_text("")
    one_line_error(invoke(*COMMANDS[name], "--svg", str(a_file / "x.svg")), 2, "no folder")
    one_line_error(invoke(*COMMANDS[name], "--svg", ""), 2, "needs a file name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_an_unwritable_folder_is_refused(tmp_path, monkeypatch):
    # permissions bind nobody when the tests run as root: the check asks os.access
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode: mode != os.W_OK and real_access(path, mode)
    )
    path = tmp_path / "x.svg"
    one_line_error(invoke(*COMMANDS["shapes"], "--svg", str(path)), 2, "not writable")
    assert not path.exists()


@pytest.mark.parametrize("name", COMMANDS)
def test_svg_with_json_is_refused(name, tmp_path):
    path = tmp_path / "view.svg"
    one_line_error(invoke(*COMMANDS[name], "--json", "--svg", str(path)), 2, "--json")
    assert not path.exists()


def test_a_failure_to_write_after_the_run_is_one_line_exit_1(tmp_path, monkeypatch):
    def refuse(source, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    path = tmp_path / "view.svg"
    result = invoke(*COMMANDS["shapes"], "--svg", str(path))
    assert result.exit_code == 1
    assert len(result.stderr.splitlines()) == 1
    assert "No space left on device" in result.stderr
    assert list(tmp_path.iterdir()) == []  # nor the temporary file
    assert result.stdout == invoke(*COMMANDS["shapes"]).stdout  # printed before the write


def test_an_error_during_the_run_writes_nothing(tmp_path):
    path = tmp_path / "view.svg"
    result = invoke("shapes", "--heads", "3", "--d-model", "16", "--svg", str(path))
    assert result.exit_code == 2
    assert not path.exists()


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import write

    return write("gpt2", tmp_path_factory.mktemp("svg-models") / "gpt2")


@pytest.fixture(scope="module")
def marian(tmp_path_factory) -> Path:
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_seq2seq import write

    return write("marian", tmp_path_factory.mktemp("svg-models") / "marian")


MODEL_VIEWS = {
    "every-block": ("--layer", "all"),
    "one-block": ("--layer", "-1"),
    "generate": ("--generate", "2"),
    "generate-every-block": ("--generate", "2", "--layer", "all"),
    "context": ("--context", "a dog"),
    "encoder-decoder": ("--generate", "3"),
    "encoder-decoder-every-block": ("--generate", "2", "--layer", "all"),
}
HEATMAP = ("--view", "heatmap")


@pytest.mark.parametrize("view", [(), HEATMAP], ids=["tables", "heatmap"])
@pytest.mark.parametrize("name", MODEL_VIEWS)
def test_every_model_view_of_run_is_saved(gpt2, marian, name, view, tmp_path):
    options = MODEL_VIEWS[name]
    folder = marian if name.startswith("encoder-decoder") else gpt2
    args = ("run", "the cat", "a <b> & c", "--model", str(folder), "--device", "cpu", *options)
    if options[0] == "--generate" and folder == gpt2:  # a decoder generates after one text
        args = ("run", "a <b> & c", "--model", str(gpt2), "--device", "cpu", *options)
    if options[0] == "--context":  # cross-attention: the seeded layer
        args = ("run", "the cat", "a <b> & c", *options, *SMALL)
    args = (*args, *view)
    plain = invoke(*args, columns=100)
    assert plain.exit_code == 0, plain.output
    printed, document = svg_of(args, tmp_path / "model.svg", columns=100)
    assert printed == plain.stdout
    assert_self_contained(document)
    drawn = svg_texts(document)
    if view:  # a heatmap's picture is its colour view, what a colour terminal shows
        assert UPPER_HALF not in printed and UPPER_HALF in drawn
        from rich.text import Text

        printed = Text.from_ansi(colour_run(args, tmp_path / "colour.svg").stdout).plain
        assert (tmp_path / "colour.svg").read_text(encoding="utf-8") == document
    assert [
        word for line in printed.splitlines() for word in line.split() if word not in drawn
    ] == []


def colour_run(args, path: Path, color_system: str = "truecolor", no_color: bool = False):
    """``args --svg path`` on a terminal of ``color_system`` (COLUMNS 100), as rich sees one."""
    from unittest import mock

    from rich.console import Console

    from attnctl import cli
    from attnctl.render.svg import recorded

    def colour_console() -> Console:
        return recorded(Console(force_terminal=True, color_system=color_system, width=100,
                                no_color=no_color, highlight=False, emoji=False))  # fmt: skip

    with mock.patch.object(cli.output, "terminal", colour_console):
        result = RUNNER.invoke(app, [*args, "--svg", str(path)], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    return result


def cell_colours(printed: str) -> tuple[set[str], set[str]]:
    """The hex colours of the heatmap's ▀ cells in ANSI output: upper rows', lower rows'."""
    from rich.text import Text

    upper, lower = set(), set()
    for line in Text.from_ansi(printed).split("\n"):
        for span in line.spans:
            if UPPER_HALF in line.plain[span.start : span.end]:
                upper.add(span.style.color.triplet.hex)
                if span.style.bgcolor is not None:
                    lower.add(span.style.bgcolor.triplet.hex)
    return upper, lower


@pytest.mark.parametrize("name", ["seeded", *MODEL_VIEWS])
def test_a_heatmap_keeps_its_colours_in_the_svg(gpt2, marian, name, tmp_path, monkeypatch):
    from rich.console import Console

    from attnctl import cli
    from attnctl.render.svg import recorded

    def colour_console() -> Console:  # a truecolor terminal, recording for --svg
        return recorded(Console(force_terminal=True, color_system="truecolor", width=100,
                                highlight=False, emoji=False))  # fmt: skip

    monkeypatch.setattr(cli.output, "terminal", colour_console)
    options = MODEL_VIEWS.get(name, ())
    folder = marian if name.startswith("encoder-decoder") else gpt2
    model = () if name in ("seeded", "context") else ("--model", str(folder))
    layer = SMALL if not model else ("--device", "cpu")
    args = ["run", "a <b> & c", *model, *options, *layer, *HEATMAP]
    path = tmp_path / "heatmap.svg"
    result = RUNNER.invoke(app, [*args, "--svg", str(path)], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    upper, lower = cell_colours(result.stdout)
    assert upper and lower  # the terminal got coloured half blocks
    document = path.read_text(encoding="utf-8")
    assert_self_contained(document)
    assert svg_texts(document).count(UPPER_HALF) == result.stdout.count(UPPER_HALF)
    foreground = set(re.findall(r"fill: (#[0-9a-f]{6})", document))
    background = set(re.findall(r'<rect fill="(#[0-9a-f]{6})"', document))
    assert upper <= foreground and lower <= background


@pytest.mark.usefixtures("fewer_colours")
@pytest.mark.parametrize("terminal", ["truecolor", "256", "standard", "no-color", "piped"])
def test_a_heatmaps_svg_is_the_same_file_whatever_stdout_is(terminal, tmp_path):
    """Coloured half blocks in the picture from a pipe, NO_COLOR, 16 colours or a colour
    terminal alike: the same bytes; the terminal itself gets what it can show."""
    args = ("run", "a <b> & c", *SMALL, *HEATMAP)
    reference = colour_run(args, tmp_path / "reference.svg")
    expected = (tmp_path / "reference.svg").read_text(encoding="utf-8")
    path = tmp_path / "heatmap.svg"
    if terminal == "piped":
        printed = svg_of(args, path, columns=100)[0]
    elif terminal == "no-color":
        printed = colour_run(args, path, no_color=True).stdout
    else:
        printed = colour_run(args, path, color_system=terminal).stdout
    document = path.read_text(encoding="utf-8")
    assert document == expected
    assert svg_texts(document).count(UPPER_HALF) == reference.stdout.count(UPPER_HALF) > 0
    assert (UPPER_HALF in printed) == (terminal in ("truecolor", "256"))
    assert len(set(re.findall(r"fill: (#[0-9a-f]{6})", document))) > 4  # the blues
