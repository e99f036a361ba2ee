"""run --view heatmap: shade characters without colour, half blocks and a legend with it."""

from __future__ import annotations

import io
import itertools
from pathlib import Path

import pytest
import tiny_models
import tiny_seq2seq
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.cells import cell_len
from rich.console import Console, Group
from rich.style import Style
from rich.text import Text

from attnctl.app import LayerRequest
from attnctl.app.requests import RunRequest
from attnctl.app.use_cases import run_use_case
from attnctl.render.terminal_generation import generation_view, translation_view
from attnctl.render.terminal_heatmap import (
    FIXED_SCALE_KEYS,
    KEY_LABEL_CELLS,
    MAX_CELL_WIDTH,
    SHADE_CHARS,
    UPPER_HALF,
    Panel,
    cell_label,
    heatmap_view,
    key_buckets,
    legend,
    panel_lines,
    shade_char,
    shortened,
    weight_color,
)
from attnctl.report.generation import GenerationReport, TranslationReport
from attnctl.trace import Token

CPU = ("--device", "cpu")
SHADES = set(SHADE_CHARS[1:])
CORPUS = Path(__file__).parent.parent / "scripts" / "corpus" / "en.txt"


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    return tiny_models.write("gpt2", tmp_path_factory.mktemp("heatmap") / "gpt2")


@pytest.fixture(scope="module")
def marian(tmp_path_factory) -> Path:
    return tiny_seq2seq.write("marian", tmp_path_factory.mktemp("heatmap") / "marian")


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
    if isinstance(report, GenerationReport):
        view = generation_view(report, console.width, heatmap=True, color=color)
    elif isinstance(report, TranslationReport):
        view = translation_view(report, console.width, heatmap=True, color=color)
    else:
        view = heatmap_view(report, console.width, color)
    console.print(view)
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


def test_json_is_refused_in_one_line_in_every_view(invoke, gpt2, marian):
    for args in (
        (),
        ("--model", str(gpt2), "--layer", "all"),
        ("--model", str(gpt2), "--generate", "2"),
        ("--model", str(marian)),
    ):
        result = invoke("run", "the cat", *args, "--view", "heatmap", "--json", *CPU)
        assert result.exit_code == 2, result.output
        assert result.stdout == ""
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("attnctl: error: --view heatmap")
        assert "--json" in lines[0]
    bad = invoke("run", "the cat", "--view", "pictures", *CPU)
    assert bad.exit_code == 2 and bad.stdout == ""


@pytest.mark.parametrize("no_color", [False, True])
def test_the_cli_draws_half_blocks_only_on_a_colour_console(monkeypatch, no_color):
    from typer.testing import CliRunner

    from attnctl import cli

    def colour_console() -> Console:  # a terminal with truecolor, as rich detects one
        return Console(force_terminal=True, color_system="truecolor", width=80)

    monkeypatch.setattr(cli.output, "terminal", colour_console)
    env = {"COLUMNS": "80", **({"NO_COLOR": "1"} if no_color else {})}
    args = ["run", "the cat eats the fish", "--head", "0", "--view", "heatmap", *CPU]
    result = CliRunner().invoke(cli.app, args, env=env)
    assert result.exit_code == 0, result.output
    assert (UPPER_HALF in result.stdout) == (not no_color)
    assert bool(set(result.stdout) & SHADES - {"█"}) == no_color


# ---------------------------------------------------------------- every view (issue 13.4)


def report_of(model: Path, *texts: str, **options):
    """The report the CLI draws for ``run TEXT... --model model`` with ``options``."""
    return run_use_case(RunRequest(LayerRequest({"device": "cpu"}, str(model)), texts=list(texts),
                                   **options))  # fmt: skip


def shades(weights) -> str:
    return "".join(shade_char(w) for w in weights)


def tile_cells(line: str) -> list[str]:
    """One line of a block's heads side by side: each head's cells, one a key."""
    return line.split("│")[1:-1]


def section(text: str, start: str, end: str | None = None) -> str:
    """The output from the line starting with ``start`` to the one starting with ``end``."""
    after = text[text.index("\n" + start) + 1 :]
    return after if end is None else after[: after.index("\n" + end) + 1]


def argmax(weights) -> int:
    return max(range(len(weights)), key=weights.__getitem__)


def test_every_block_shows_each_blocks_heads_side_by_side_from_its_weights(invoke, gpt2):
    text = "the cat eats the fish"
    result = invoke("run", text, "--model", str(gpt2), "--layer", "all", "--view", "heatmap", *CPU)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "heads by block" not in out  # the heads map of the tables view is replaced
    report = report_of(gpt2, text, block="all")
    heads = list(report.heads)
    assert len(report.traces) == 3 and heads == [0, 1, 2, 3]  # every head of every block
    tokens = report.trace.tokens[0]
    for trace in report.traces:
        block = section(out, f"block {trace.layer}\n", "\n")  # to the blank line after it
        header = block.splitlines()[1]
        assert header.split() == [w for h in heads for w in ("head", str(h))]
        lines = matrix_lines(block)
        assert len(lines) == len(tokens)  # one line a query row, plain
        for row, line in enumerate(lines):
            assert line.split("│")[0].split()[0] == str(row)  # the query's position labels it
            drawn = tile_cells(line)
            assert len(drawn) == len(heads)
            for head_index, cells in enumerate(drawn):
                weights = trace.attention[0][head_index][row]
                assert cells == shades(weights)  # one cell a key, every key (causal: spaces)
                strongest = argmax(weights)
                assert cells[strongest] == max(cells, key=SHADE_CHARS.index)
                assert set(cells[row + 1 :]) <= {" "}  # GPT-2 is causal
    assert "--layer N (0–2)" in out


def test_every_block_of_a_long_input_pools_its_keys_and_names_the_rows_left_out(tmp_path):
    llama = tiny_models.write("llama", tmp_path / "llama")
    long_text = CORPUS.read_text(encoding="utf-8")[:3000]
    report = report_of(llama, long_text, block="all", heads=[1])
    keys = report.windows[0].keys
    for width in (40, 80, 120):
        out = rendered(report, width, color=False)
        assert all(cell_len(line) <= width for line in out.splitlines())
        assert out.count("⋮ query rows 16–") == len(report.traces)
        lines = matrix_lines(out)
        assert len(lines) == 32 * len(report.traces)  # the first and last 16 rows
        columns = len(tile_cells(lines[0])[0])
        assert keys > columns >= width - 20
        assert f"{keys} keys in {columns} columns" in out


def test_generation_draws_the_final_sequence_with_prompt_and_generated_apart(invoke, gpt2):
    args = ("run", "the cat eats", "--model", str(gpt2), "--generate", "4", "--head", "1", *CPU)
    result = invoke(*args, "--view", "heatmap")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "steps · block 2" in out and "KV cache at the end" in out  # the steps stay
    assert "attention weights of the final sequence" not in out  # the tables are replaced
    report = report_of(gpt2, "the cat eats", generate=4, heads=[1])
    prompt = len(report.prompt_tokens[0])
    final = prompt + 4
    assert f"prompt 0–{prompt - 1}, generated {prompt}–{final - 1}" in out
    lines = out.splitlines()
    rows = matrix_lines(out)
    assert len(rows) == final
    # a line between the prompt's last row and the first generated one says so
    separator = lines.index(rows[prompt]) - 1
    assert lines[separator].startswith(f"╌ generated: rows {prompt}–{final - 1}, each")
    assert lines[separator - 1] == rows[prompt - 1]
    # over the keys: └generated stands at the first generated key's column
    marks = next(line for line in lines if "└generated" in line)
    bar = rows[-1].index("│")
    cell = len(rows[-1].split("│", 1)[1]) // final  # the last row reads every key
    assert marks.index("└generated") == bar + 1 + prompt * cell
    assert marks.index("└prompt") == bar + 1
    trace = report.trace
    for row, line in enumerate(rows):
        weights = trace.attention[0][trace.attention_heads.index(1)][row]
        expected = "".join(shade_char(w) * cell for w in weights)
        assert line.split("│", 1)[1] == expected.rstrip()  # piped: no trailing spaces
        assert line.split("│")[0].split()[0] == str(row)


def test_generation_with_every_block_marks_the_generated_rows_in_each_block(gpt2):
    report = report_of(gpt2, "the cat eats", generate=3, block="all")
    prompt = len(report.prompt_tokens[0])
    out = rendered(report, 80, color=False)
    assert out.count(f"╌ generated: rows {prompt}–{prompt + 2}") == len(report.traces)
    for trace in report.traces:
        assert f"\nblock {trace.layer}\n" in out
    rows = matrix_lines(out)
    assert len(rows) == (prompt + 3) * len(report.traces)
    last = report.traces[-1]
    for row, line in enumerate(rows[-(prompt + 3) :]):
        for head_index, cells in enumerate(tile_cells(line)):
            assert cells == shades(last.attention[0][head_index][row])


def test_an_encoder_decoder_draws_its_three_attentions_with_their_tokens(invoke, marian):
    text = "Are you OK?"
    args = ("run", text, "--model", str(marian), "--generate", "4", "--head", "2", *CPU)
    result = invoke(*args, "--view", "heatmap")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "steps · decoder block 1" in out and "alignment · block 1" in out
    assert "cross-attention weights, decoder block" not in out  # the tables are replaced
    report = report_of(marian, text, generate=4, heads=[2])
    view = report.view
    head = view.heads.index(2)
    sources = [t for t in view.source_tokens[0] if not t.pad]
    targets = view.target_tokens[0]
    kinds = [
        ("encoder self-attention heatmaps, encoder block 1", view.encoder_attention, sources,
         sources, "source"),
        ("decoder self-attention heatmaps, decoder block 1", view.decoder_attention, targets,
         targets, "target"),
        ("cross-attention heatmaps, decoder block 1", view.cross_attention, targets, sources,
         "source"),
    ]  # fmt: skip
    ends = [kinds[1][0], kinds[2][0], "legend:"]
    for (title, attention, queries, keys, corner), end in zip(kinds, ends, strict=True):
        part = section(out, title, end)
        lines = part.splitlines()
        title_end = lines.index("head 2")  # the title may wrap; one head: one map
        assert lines[title_end + 1].split()[0] == corner  # what the columns are
        assert lines[title_end + 1].split()[1:] == [str(n) for n in range(len(keys))]
        rows = matrix_lines(part)
        assert len(rows) == len(queries)
        matrix = attention[0][head]
        cell = len(rows[-1].split("│", 1)[1]) // len(keys)  # the last row reads every key
        assert cell == 3  # few keys: three cells each
        for row, line in enumerate(rows):
            label = line.split("│")[0].split()
            assert label[0] == str(row)
            assert label[1] == queries[row].text.replace(" ", "␣")[:8]  # " you": "␣you"
            weights = matrix[row][: len(keys)]
            assert line.split("│", 1)[1] == "".join(shade_char(w) * cell for w in weights).rstrip()
            strongest = argmax(weights)
            drawn = line.split("│", 1)[1][::cell]
            assert drawn[strongest] == max(drawn, key=SHADE_CHARS.index)
    # the cross-attention's keys are the source tokens, labelled on top
    cross = section(out, kinds[2][0], "legend:").splitlines()
    names = cross[cross.index("head 2") + 2].split()
    assert names[0] == "A" and "</s>" in names


def test_an_encoder_decoder_with_every_block_draws_each_kind_per_block(marian):
    report = report_of(marian, "Are you OK?", "the cat", generate=3, block="all", heads=[0, 3])
    out = rendered(report, 80, color=False)
    for kind, stack in (("encoder self-attention", "encoder"), ("decoder self-attention",
                        "decoder"), ("cross-attention", "decoder")):  # fmt: skip
        assert f"{kind} heatmaps of every block" in out
        for trace in report.block_traces[kind.split()[0].replace("cross-attention", "cross")]:
            for text in (0, 1):
                assert f"{stack} block {trace.layer} · text {text}" in out
    # text 1's encoder block 0: its own 3 source tokens, without the padding
    part = section(out, "encoder block 0 · text 1", "\n")
    trace = report.block_traces["encoder"][0]
    lines = matrix_lines(part)
    own = sum(not t.pad for t in trace.tokens[1])
    assert len(lines) == own < len(trace.tokens[1])
    for row, line in enumerate(lines):
        for head_index, cells in enumerate(tile_cells(line)):
            assert cells == shades(trace.attention[1][head_index][row][:own])


def styled_cells(line: Text) -> list[tuple[str, Style]]:
    """Each character after the first │ of a colour line, with its style."""
    styles = [Style() for _ in line.plain]
    for span in line.spans:
        style = Style.parse(span.style) if isinstance(span.style, str) else span.style
        for i in range(span.start, span.end):
            styles[i] += style
    start = line.plain.index("│") + 1
    return list(zip(line.plain[start:], styles[start:], strict=True))


def test_colour_cells_carry_the_weights_of_both_rows(marian):
    report = report_of(marian, "Are you OK?", generate=4, heads=[1])
    out = rendered(report, 80, color=True)
    plain = Text.from_ansi(out).plain
    assert not set(plain) & SHADES - {"█"}
    lines = Text.from_ansi(out).split("\n")
    cross_start = next(n for n, line in enumerate(lines) if line.plain.startswith("cross-att"))
    rows = [line for line in lines[cross_start:] if "│" in line.plain]
    view = report.view
    matrix = view.cross_attention[0][view.heads.index(1)]
    sources = sum(not t.pad for t in view.source_tokens[0])
    assert len(rows) == (len(matrix) + 1) // 2  # two target rows a line
    for n, line in enumerate(rows):
        cells = styled_cells(line)
        cell = len(cells) // sources
        for key in range(sources):
            char, style = cells[key * cell]
            assert char == UPPER_HALF
            assert style.color.triplet == weight_color(matrix[2 * n][key]).triplet
            lower = matrix[2 * n + 1][key] if 2 * n + 1 < len(matrix) else None
            if lower is None:
                assert style.bgcolor is None
            else:
                assert style.bgcolor.triplet == weight_color(lower).triplet


VIEWS = {
    "every block": lambda gpt2, marian: report_of(
        gpt2, "猫吃鱼, the cat eats the fish.", "a dog", block="all"),
    "generate": lambda gpt2, marian: report_of(gpt2, "猫吃鱼 the cat", generate=5),
    "generate every block": lambda gpt2, marian: report_of(
        gpt2, "猫吃鱼 the cat", generate=3, block="all"),
    "encoder–decoder": lambda gpt2, marian: report_of(
        marian, "猫吃鱼, the cat eats the fish.", "hi", generate=5),
    "encoder–decoder every block": lambda gpt2, marian: report_of(
        marian, "猫吃鱼 the cat", generate=3, block="all"),
}  # fmt: skip


@pytest.fixture(scope="module")
def view_reports(gpt2, marian):
    return {name: make(gpt2, marian) for name, make in VIEWS.items()}


@pytest.mark.parametrize("name", VIEWS)
@pytest.mark.parametrize("width", [40, 80, 120])
@pytest.mark.parametrize("color", [True, False])
def test_every_view_fits_the_width_and_draws_something(view_reports, name, width, color):
    report = view_reports[name]
    out = rendered(report, width, color)
    text = Text.from_ansi(out).plain if color else out
    too_long = [line for line in text.splitlines() if cell_len(line) > width]
    assert not too_long, too_long[:3]
    rows = matrix_lines(text)
    assert rows
    cells = "".join(line.split("│", 1)[1] for line in rows)
    if color:
        assert UPPER_HALF in cells and not set(cells) & SHADES - {"█"}
    else:
        assert UPPER_HALF not in cells and set(cells) & SHADES
        assert "\x1b[" not in out
    assert "legend:" in text


@pytest.mark.parametrize("width", [20, 40])
def test_the_cli_fits_narrow_terminals_in_every_view(invoke, gpt2, marian, width):
    for args in (
        ("--model", str(gpt2), "--layer", "all"),
        ("--model", str(gpt2), "--generate", "3"),
        ("--model", str(marian), "--generate", "3"),
        ("--model", str(marian), "--generate", "3", "--layer", "all"),
    ):
        result = invoke("run", "猫吃鱼 the cat", *args, "--view", "heatmap", *CPU, columns=width)
        assert result.exit_code == 0, result.output
        assert all(cell_len(line) <= width for line in result.stdout.splitlines())
        assert matrix_lines(result.stdout)


def test_heads_that_do_not_fit_a_line_go_on_the_next_and_every_head_is_drawn(gpt2):
    report = report_of(gpt2, "the cat eats the fish", block="all")
    tokens = len(report.trace.tokens[0])
    for width, per_line in ((40, 2), (80, 4)):
        out = rendered(report, width, color=False)
        block = section(out, "block 0\n", "\n")
        headers = [line.split() for line in block.splitlines() if line.lstrip().startswith("head")]
        groups = [range(first, first + per_line) for first in range(0, 4, per_line)]
        assert headers == [[w for h in group for w in ("head", str(h))] for group in groups]
        lines = matrix_lines(block)
        assert len(lines) == tokens * (4 // per_line)
        drawn = [tile_cells(line) for line in lines]
        for head in range(4):
            group, column = divmod(head, per_line)
            for row in range(tokens):
                weights = report.trace.attention[0][head][row]
                assert drawn[group * tokens + row][column] == shades(weights)


@st.composite
def panels(draw) -> Panel:
    """A head's rows of weights over 1–200 keys, some rows left out, a prompt split maybe."""
    keys = draw(st.integers(1, 200))
    queries = draw(st.integers(1, 24))
    texts = st.sampled_from(
        ["a", "the", " cat", "猫", "吃鱼", "<pad>", "\t", "longer-token", " ", " 鱼 ", "dog "]
    )
    tokens = [Token(n, draw(texts), n, n + 1) for n in range(max(keys, queries))]
    positions = sorted(draw(st.sets(st.integers(0, queries - 1), min_size=1)))
    weight = st.one_of(st.just(0.0), st.floats(0, 1, allow_subnormal=False))
    rows = [draw(st.lists(weight, min_size=keys, max_size=keys)) for _ in positions]
    generated = draw(st.one_of(st.none(), st.integers(1, max(1, queries - 1))))
    return Panel("head 0", tokens, tokens, keys, rows, list(enumerate(positions)),
                 generated_from=generated)  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(panel=panels(), width=st.integers(20, 200), color=st.booleans())
def test_any_panel_fits_its_width_and_draws_each_columns_strongest_key(panel, width, color):
    console = Console(file=io.StringIO(), width=width, color_system="truecolor" if color else None,
                      force_terminal=color, highlight=False, emoji=False)  # fmt: skip
    with console.capture() as capture:
        console.print(Group(*panel_lines(panel, width, color)))
    out = capture.get()
    text = Text.from_ansi(out).plain if color else out
    assert all(cell_len(line) <= width for line in text.splitlines())
    rows = matrix_lines(text)
    computed = len(panel.computed)
    if color:  # two rows a line, one where a run of rows ends
        assert (computed + 1) // 2 <= len(rows) <= computed
        assert all(set(line.split("│", 1)[1].rstrip()) <= {UPPER_HALF} for line in rows)
        return
    assert len(rows) == computed  # a line a row
    for (index, _), line in zip(panel.computed, rows, strict=True):
        columns = max(1, width - cell_len(line.split("│")[0]) - 2)  # a CJK label: 2 cells
        buckets = key_buckets(panel.key_count, columns)
        assert len(buckets) == min(panel.key_count, columns)  # every key, pooled if need be
        cell = max(1, min(3, columns // len(buckets)))
        row = panel.rows[index]
        largest = max(row[: panel.key_count])
        scale = 1.0 / largest if panel.key_count > FIXED_SCALE_KEYS and largest > 0 else 1.0
        expected = "".join(shade_char(max(row[start:end]) * scale) * cell for start, end in buckets)
        assert line.split("│", 1)[1].rstrip() == expected.rstrip()


# ---------------------------------------------------------------- issue 13: scale, colours, labels


def plain_lines(renderables, width: int, color: bool) -> list[str]:
    """What a console of ``width`` shows of ``renderables``, without the ANSI codes."""
    console = Console(file=io.StringIO(), width=width, color_system="truecolor" if color else None,
                      force_terminal=color, highlight=False, emoji=False)  # fmt: skip
    with console.capture() as capture:
        console.print(Group(*renderables))
    out = capture.get()
    return (Text.from_ansi(out).plain if color else out).splitlines()


def words_at(line: str) -> list[tuple[int, str]]:
    """The space-separated words of ``line``, each with the terminal column it starts at."""
    words: list[tuple[int, str]] = []
    column, start, word = 0, 0, ""
    for char in line:
        if char == " ":
            if word:
                words.append((start, word))
            word = ""
        else:
            start = column if not word else start
            word += char
        column += cell_len(char)
    return [*words, (start, word)] if word else words


@settings(max_examples=60, deadline=None)
@given(panel=panels(), width=st.one_of(st.sampled_from([20, 40, 80, 120]), st.integers(20, 200)),
       color=st.booleans())  # fmt: skip
def test_each_key_label_starts_over_its_keys_cells_and_tokens_under_their_positions(
    panel, width, color
):
    lines = plain_lines(panel_lines(panel, width, color), width, color)
    assert all(cell_len(line) <= width for line in lines)
    label_cells = cell_len(matrix_lines("\n".join(lines))[0].split("│")[0])
    columns = max(1, width - label_cells - 2)
    buckets = key_buckets(panel.key_count, columns)
    cell = max(1, min(MAX_CELL_WIDTH, columns // len(buckets)))
    cell_column = {start: label_cells + 1 + c * cell for c, (start, _) in enumerate(buckets)}
    corner, *positions = words_at(lines[1])
    assert corner[1] == shortened(panel.corner, label_cells)
    assert positions and positions[0] == (label_cells + 1, "0")  # key 0 is always labelled
    assert all(cell_column[int(word)] == column for column, word in positions)
    key_at = {column: int(word) for column, word in positions}
    names = words_at(lines[2])
    assert names  # the first key's token at least
    for column, name in names:
        key = key_at[column]  # a token stands under its position, both over the key's cells
        assert name == shortened(cell_label(panel.keys[key]), KEY_LABEL_CELLS)


def test_a_space_at_either_end_of_a_token_shows_as_the_tables_blank_mark():
    def label(text: str) -> str:
        return cell_label(Token(0, text, 0, 1))

    assert [label(t) for t in (" you", "you ", " 鱼 ", " ", "  ", "a b", "\t")] == [
        "␣you", "you␣", "␣鱼␣", "␣", "␣␣", "a b", "\\t"
    ]  # fmt: skip


def test_a_leading_space_token_is_marked_and_labelled_over_its_cells(invoke, marian):
    for width in (20, 40, 80, 120):
        result = invoke("run", "Are you OK?", "--model", str(marian), "--view", "heatmap",
                        "--head", "0", *CPU, columns=width)  # fmt: skip
        assert result.exit_code == 0, result.output
        assert all(cell_len(line) <= width for line in result.stdout.splitlines())
        lines = result.stdout.splitlines()
        header = lines.index("head 0")  # the first map: the encoder's self-attention
        encoder = lines[header : lines.index("", header)]
        rows = matrix_lines("\n".join(encoder))
        assert any(row.split("│")[0].split()[-1] == "␣you" for row in rows)
        assert not any("  you" in line for line in encoder)
        if width == 40:  # the tokens fit: "␣you" starts where key 2's position and cells do
            positions, names = dict(words_at(encoder[1])), words_at(encoder[2])
            column = next(c for c, name in names if name == "␣you")
            assert positions[column] == "2"
            cells_start = rows[0].index("│") + 1
            assert column == cells_start + 2 * 3  # three cells a key


def long_panel(keys: int, peaks: list[int], seed: int) -> Panel:
    """Rows of weights about 1/keys (each row a softmax-like spread with one key stronger)."""
    import random

    rng = random.Random(seed)
    rows = []
    for peak in peaks:
        raw = [rng.random() + 0.5 for _ in range(keys)]
        raw[peak % keys] = 4.0
        total = sum(raw)
        rows.append([w / total for w in raw])
    tokens = [Token(n, "tok", n, n + 1) for n in range(keys)]
    return Panel("head 0", tokens, tokens, keys, rows, [(i, i) for i in range(len(rows))])


@settings(max_examples=25, deadline=None)
@given(keys=st.integers(FIXED_SCALE_KEYS + 1, 5000),
       peaks=st.lists(st.integers(0, 10**6), min_size=1, max_size=4),
       seed=st.integers(0, 2**16), width=st.sampled_from([20, 40, 80, 120]))  # fmt: skip
def test_many_keys_shade_each_row_by_its_own_largest_weight_and_say_so(keys, peaks, seed, width):
    panel = long_panel(keys, peaks, seed)
    lines = plain_lines(panel_lines(panel, width, False), width, False)
    assert all(cell_len(line) <= width for line in lines)
    text = " ".join("\n".join(lines).split())
    assert "each row on its own scale, shade = weight ÷ the row's largest" in text
    rows = matrix_lines("\n".join(lines))
    label_cells = cell_len(rows[0].split("│")[0])
    buckets = key_buckets(keys, max(1, width - label_cells - 2))
    for line, weights in zip(rows, panel.rows, strict=True):
        cells = line.split("│", 1)[1]
        largest = max(weights)
        assert cells == "".join(shade_char(max(weights[a:b]) * (1 / largest)) for a, b in buckets)
        assert "█" in cells  # the row's strongest key stands out, though its weight is small
        assert shade_char(largest) == "░"  # on the fixed 0–1 scale, every key would be ░
    legend_text = " ".join(legend(False, width, [keys]).plain.split())
    assert "weight ÷ the row's largest, each row on its own scale" in legend_text


def test_up_to_128_keys_keep_the_fixed_scale_and_its_legend():
    panel = long_panel(FIXED_SCALE_KEYS, [3], seed=1)
    text = "\n".join(plain_lines(panel_lines(panel, 200, False), 200, False))
    assert "own scale" not in text
    assert set(matrix_lines(text)[0].split("│", 1)[1]) == {"░"}  # 0–1: small weights are ░
    assert legend(False, 80, [FIXED_SCALE_KEYS]).plain == legend(False, 80).plain
    assert legend(False, 80).plain.endswith("(weight; one line a query row)")
    mixed = legend(True, 80, [8, FIXED_SCALE_KEYS + 1]).plain
    assert f"in maps of more than {FIXED_SCALE_KEYS} keys, weight ÷ the row's largest" in mixed


def test_a_long_input_shows_each_rows_strongest_keys(invoke):
    result = invoke("run", "--file", str(CORPUS), "--head", "0", "--view", "heatmap", *CPU,
                    columns=80)  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = matrix_lines(result.stdout)
    assert len(rows) == 32
    assert all("█" in row.split("│", 1)[1] for row in rows)  # each row's largest
    assert len({char for row in rows for char in row.split("│", 1)[1]}) >= 3  # not one shade
    text = " ".join(result.stdout.split())
    assert "keys: each row on its own scale, shade = weight ÷ the row's largest" in text
    assert "(weight ÷ the row's largest, each row on its own scale; one line a query row)" in text
    # the tokens under the positions: each starts at its position's column
    lines = result.stdout.splitlines()
    header = next(n for n, line in enumerate(lines) if line.lstrip().startswith("key 0"))
    positions = dict(words_at(lines[header]))
    assert all(column in positions for column, _ in words_at(lines[header + 1]))


@pytest.mark.usefixtures("fewer_colours")
@pytest.mark.parametrize("color_system", ["standard", "256", "truecolor"])
def test_half_blocks_need_256_colours_sixteen_get_shade_characters(monkeypatch, color_system):
    from typer.testing import CliRunner

    from attnctl import cli

    def terminal() -> Console:  # a terminal of color_system, as rich detects one
        return Console(force_terminal=True, color_system=color_system, width=80)

    monkeypatch.setattr(cli.output, "terminal", terminal)
    args = ["run", "the cat eats the fish", "--head", "0", "--view", "heatmap", *CPU]
    result = CliRunner().invoke(cli.app, args, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    cells = "".join(line.split("│", 1)[1] for line in matrix_lines(Text.from_ansi(
        result.stdout).plain))  # fmt: skip
    if color_system == "standard":  # 16 colours: black, grey and blue only; shades instead
        assert UPPER_HALF not in cells and set(cells) & SHADES - {"█"}
        legend_text = " ".join(Text.from_ansi(result.stdout).plain.split())
        assert "(weight; one line a query row)" in legend_text
    else:
        assert set(cells) == {UPPER_HALF}


@pytest.mark.usefixtures("fewer_colours")
@pytest.mark.parametrize(("term", "half_blocks"), [("xterm", False), ("xterm-256color", True)])
def test_a_forced_colour_terminal_is_drawn_by_its_colours(term, half_blocks):
    from typer.testing import CliRunner

    from attnctl.cli import app

    env = {"COLUMNS": "80", "FORCE_COLOR": "1", "TERM": term, "COLORTERM": None, "NO_COLOR": None}
    args = ["run", "the cat eats the fish", "--head", "0", "--view", "heatmap", *CPU]
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 0, result.output
    assert "\x1b[" in result.stdout  # rich sees a colour terminal
    assert (UPPER_HALF in result.stdout) == half_blocks
    assert bool(set(result.stdout) & SHADES - {"█"}) == (not half_blocks)
