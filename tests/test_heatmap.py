"""run --view heatmap: shade characters without colour, half blocks and a legend with it."""

from __future__ import annotations

import io
import itertools
from pathlib import Path

import pytest
import tiny_models
import tiny_seq2seq
from rich.cells import cell_len
from rich.console import Console
from rich.text import Text

from attnctl.app import LayerRequest
from attnctl.app.requests import RunRequest
from attnctl.app.use_cases import run_use_case
from attnctl.render.terminal_heatmap import (
    SHADE_CHARS,
    UPPER_HALF,
    heatmap_view,
    key_buckets,
    shade_char,
)

CPU = ("--device", "cpu")
SHADES = set(SHADE_CHARS[1:])
CORPUS = Path(__file__).parent.parent / "scripts" / "corpus" / "en.txt"


def matrix_lines(text: str) -> list[str]:
    """The heatmap's rows: the lines with a │ between label and cells."""
    return [line for line in text.splitlines() if "│" in line]


def rendered(report, width: int, color: bool) -> str:
    """The view as a terminal would get it: ANSI codes when ``color``."""
    buffer = io.StringIO()
    console = Console(
        file=buffer,
        width=width,
        color_system="truecolor" if color else None,
        force_terminal=color,
        highlight=False,
        emoji=False,
    )
    console.print(heatmap_view(report, console.width, color))
    return buffer.getvalue()


def test_no_color_output_uses_shade_characters_and_is_deterministic(invoke):
    args = ("run", "the cat eats the fish", "--mask", "causal", "--head", "0", *CPU)
    first = invoke(*args, "--view", "heatmap")
    assert first.exit_code == 0, first.output
    assert first.stdout == invoke(*args, "--view", "heatmap").stdout
    rows = matrix_lines(first.stdout)
    assert len(rows) == 7  # one line a query row without colour
    cells = "".join(line.split("│", 1)[1] for line in rows)
    assert set(cells) <= set(SHADE_CHARS) and UPPER_HALF not in first.stdout
    # causal: the first query sees only itself (7 keys: 3 cells each)
    assert rows[0].split("│", 1)[1] == "███"
    assert "legend:" in first.stdout and "head 0" in first.stdout
    assert "\x1b[" not in first.stdout
    tables = invoke(*args)  # the default view stays the tables
    assert "attention weights" in tables.stdout and "│█" not in tables.stdout


def test_shade_characters_follow_the_weight():
    assert shade_char(0.0) == " "
    assert shade_char(1e-6) == "░"  # any weight above 0 shows
    assert shade_char(1.0) == "█"
    levels = [SHADE_CHARS.index(shade_char(w / 100)) for w in range(101)]
    assert levels == sorted(levels) and set(levels) == set(range(len(SHADE_CHARS)))


def test_colour_output_has_half_blocks_two_rows_a_line_and_a_legend():
    request = RunRequest(
        LayerRequest({"device": "cpu", "mask": "causal"}), texts=["the cat eats the fish"]
    )
    report = run_use_case(request)
    out = rendered(report, 80, color=True)
    assert UPPER_HALF in out and "\x1b[38;2;" in out and "48;2;" in out  # fg and bg colours
    assert "legend:" in out and "██" in out
    text_only = Text.from_ansi(out).plain
    heads = len(report.heads)
    assert len(matrix_lines(text_only)) == heads * 4  # 7 rows: 4 lines each
    assert not set(text_only) & SHADES - {"█"}  # colour: no shade characters in cells
    # a rich console without colour (NO_COLOR) gets the shade characters instead
    no_color = rendered(report, 80, color=False)
    assert UPPER_HALF not in no_color and "\x1b[" not in no_color
    assert len(matrix_lines(no_color)) == heads * 7


@pytest.mark.parametrize("width", [40, 41, 57, 80, 123, 160, 200])
@pytest.mark.parametrize("color", [True, False])
def test_no_line_exceeds_the_width(width, color):
    request = RunRequest(
        LayerRequest({"device": "cpu"}),
        texts=["猫吃鱼, the cat eats the fish. " * 6, "a dog"],
        heads=[0, 3],
    )
    report = run_use_case(request)
    out = rendered(report, width, color)
    text = Text.from_ansi(out).plain if color else out
    assert text.strip()
    assert all(cell_len(line) <= width for line in text.splitlines())
    keys = report.windows[0].keys
    cells = len(matrix_lines(text)[0].split("│", 1)[1].rstrip())
    if f"{keys} keys in" in text:  # pooled: as many columns as fit
        assert keys > cells >= width - 20
    else:
        assert cells in (keys, 2 * keys, 3 * keys)


def test_keys_are_pooled_into_buckets_that_cover_every_key():
    for keys in (1, 7, 100, 4755):
        for columns in (1, 3, 40, 200):
            buckets = key_buckets(keys, columns)
            assert len(buckets) == min(keys, columns)
            assert buckets[0][0] == 0 and buckets[-1][1] == keys
            assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(buckets))


def test_long_inputs_show_the_rows_computed_and_say_which(invoke):
    result = invoke(
        "run", "--file", str(CORPUS), "--head", "0", "--view", "heatmap", *CPU, columns=100
    )
    assert result.exit_code == 0, result.output
    rows = matrix_lines(result.stdout)
    assert len(rows) == 32  # the default rows: the first and last 16
    assert "⋮ query rows 16–" in result.stdout and "not computed" in result.stdout
    assert "each column is the max of" in result.stdout
    assert all(len(line) <= 100 for line in result.stdout.splitlines())


def test_cjk_tokens_label_rows_and_keys_by_their_characters(invoke):
    result = invoke(
        "run", "猫吃鱼", "--config", "cat-eats-fish", "--head", "0", "--view", "heatmap", *CPU
    )
    assert result.exit_code == 0, result.output
    rows = matrix_lines(result.stdout)
    assert [line.split("│")[0].split()[-1] for line in rows] == ["猫", "吃", "鱼"]
    lines = result.stdout.splitlines()
    key_line = next(line for line in lines if "猫" in line and line.startswith(" "))
    assert key_line.split() == ["猫", "吃", "鱼"]


def test_context_batches_and_a_model_block(invoke, tmp_path):
    result = invoke(
        "run", "the cat", "a dog eats", "--context", "猫吃鱼 fish", "--head", "1",
        "--view", "heatmap", *CPU,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "head 1 · text 0" in result.stdout and "head 1 · text 1" in result.stdout
    assert "columns = context tokens" in result.stdout
    model = tiny_models.write("gpt2", tmp_path / "gpt2")
    result = invoke(
        "run", "the cat eats", "--model", str(model), "--layer", "2", "--head", "0",
        "--view", "heatmap", *CPU,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "block 2" in result.stdout and matrix_lines(result.stdout)
    first_row = matrix_lines(result.stdout)[0].split("│")[1]
    assert set(first_row) == {"█"} and len(first_row) <= 3  # GPT-2 is causal


def test_views_it_cannot_draw_are_refused_in_one_line(invoke, tmp_path):
    model = tiny_models.write("gpt2", tmp_path / "gpt2")
    seq2seq = tiny_seq2seq.write("marian", tmp_path / "marian")
    for args, named in (
        (("--model", str(model), "--layer", "all"), "--layer all"),
        (("--model", str(model), "--generate", "2"), "--generate"),
        (("--model", str(seq2seq)), "an encoder–decoder model"),
        (("--json",), "--json"),
    ):
        result = invoke("run", "the cat", *args, "--view", "heatmap", *CPU)
        assert result.exit_code == 2, result.output
        assert result.stdout == ""
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("attnctl: error: --view heatmap")
        assert named in lines[0]
    saved = tmp_path / "never.safetensors"  # refused before the run: nothing saved
    result = invoke("run", "the cat", "--model", str(seq2seq), "--view", "heatmap",
                    "--save", str(saved), *CPU)  # fmt: skip
    assert result.exit_code == 2 and not saved.exists()
    bad = invoke("run", "the cat", "--view", "pictures", *CPU)
    assert bad.exit_code == 2 and bad.stdout == ""


@pytest.mark.parametrize("no_color", [False, True])
def test_the_cli_draws_half_blocks_only_on_a_colour_console(monkeypatch, no_color):
    from typer.testing import CliRunner

    from attnctl import cli

    def colour_console() -> Console:  # a terminal with truecolor, as rich detects one
        return Console(force_terminal=True, color_system="truecolor", width=80)

    monkeypatch.setattr(cli, "_console", colour_console)
    env = {"COLUMNS": "80", **({"NO_COLOR": "1"} if no_color else {})}
    args = ["run", "the cat eats the fish", "--head", "0", "--view", "heatmap", *CPU]
    result = CliRunner().invoke(cli.app, args, env=env)
    assert result.exit_code == 0, result.output
    assert (UPPER_HALF in result.stdout) == (not no_color)
    assert bool(set(result.stdout) & SHADES - {"█"}) == no_color
