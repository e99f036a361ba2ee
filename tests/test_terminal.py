"""Terminal conventions: narrow terminals cut nothing, piped output has no trailing spaces,
COLUMNS that cannot be used is ignored, help keeps its words whole, completion, -V, stdin."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from attnctl.cli import app
from attnctl.memory.estimate import format_bytes
from attnctl.render import difference_bound, shape_text

CPU = ("--device", "cpu")
LONG = " ".join(f"w{i}" for i in range(60))  # 170 tokens: windows of rows, top keys
RUNNER = CliRunner()


def invoke_at(args: tuple[str, ...], columns: str | None, input: str | None = None):
    env = {"NO_COLOR": "1", "TERM": "dumb", "COLUMNS": columns}  # None: COLUMNS unset
    return RUNNER.invoke(app, list(args), env=env, input=input)


@functools.cache
def json_of(args: tuple[str, ...]) -> dict:
    result = invoke_at((*args, "--json"), "200")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def whole(value: str, output: str) -> bool:
    """The value appears in the output as it is, not cut or broken across lines.

    Whitespace (a line break included) counts as one space, so a table row or a value
    wrapped at its own space both match, and a value must stand between whitespace.
    """
    flat = " ".join(output.split())
    return re.search(rf"(?<!\S){re.escape(value)}(?!\S)", flat) is not None


def stage_values(stages: list[dict], device: bool = True) -> list[str]:
    values = []
    for stage in stages:
        size = f"view of {stage['view_of']}" if stage.get("view_of") else None
        values += [stage["name"], shape_text(tuple(stage["shape"])), stage["dtype"]]
        values.append(size or format_bytes(stage["bytes"]))
        values += [stage["device"]] if device else []
    return values


def run_values(args: tuple[str, ...]) -> list[str]:
    data = json_of(args)
    memory = data["memory"]
    values = stage_values(data["stages"])
    values += [format_bytes(memory[k]) for k in ("parameters_bytes", "peak_bytes")]
    values += [f"{memory['parameters']:,}"]
    values += [str(token["id"]) for row in data["tokens"] for token in row]
    return values


def shapes_values(args: tuple[str, ...]) -> list[str]:
    return stage_values(json_of(args)["stages"], device=False)


def memory_values(args: tuple[str, ...]) -> list[str]:
    data = json_of(args)
    values = []
    documents = data["results"]  # one per length
    for document in documents:
        values += [format_bytes(document["peak_bytes"]), format_bytes(document["kv_cache_bytes"])]
        values += [format_bytes(document["parameters_bytes"])]
        if document["training_bytes"] is not None:
            values.append(format_bytes(document["training_bytes"]))
        if document["measured_peak_bytes"] is not None:
            values.append(format_bytes(document["measured_peak_bytes"]))
        if len(documents) == 1:  # one length in detail: every stage and every dtype
            for stage in document["stages"]:
                values += [stage["name"], format_bytes(stage["live_bytes"])]
                if stage["measured_live_bytes"] is None:
                    values.append(shape_text(tuple(stage["shape"])))
            values += [format_bytes(row["peak_bytes"]) for row in document["by_dtype"].values()]
    for key in ("max_seq_len", "max_batch"):
        values += [f"{found:,}" for found in (data[key] or {}).values()]
    return values


def check_values(args: tuple[str, ...]) -> list[str]:
    values = []
    for c in json_of(args)["comparisons"]:
        values += [c["a"], c["b"], c["what"], difference_bound(c["max_abs_diff"])]
        values += [f"{c['tolerance']:.0e}", "ok" if c["ok"] else "FAIL"]
    return values


COMMANDS = {
    "run": (("run", "Are you OK?", *CPU), run_values),
    "run one token": (("run", "a", *CPU), run_values),
    "run a batch": (("run", "Are you OK?", "hi", "--heads", "4", *CPU), run_values),
    "run long": (("run", LONG, "--d-model", "16", "--heads", "2", *CPU), run_values),
    "run cross": (
        ("run", "Are you OK?", "--config", "cross-attention", "--context", "我很好，谢谢", *CPU),
        run_values,
    ),
    "shapes": (("shapes",), shapes_values),
    "shapes cross": (
        ("shapes", "--config", "cross-attention", "--context-len", "6"),
        shapes_values,
    ),
    "shapes gqa": (("shapes", "--kv-heads", "2", "--batch", "3"), shapes_values),
    "memory": (("memory",), memory_values),
    "memory sweep": (("memory", "--seq-len", "512,2048,8192"), memory_values),
    "memory budget": (("memory", "--budget", "16GiB"), memory_values),
    "memory train": (("memory", "--train", "--seq-len", "64"), memory_values),
    "memory measure": (("memory", "--measure", "--seq-len", "32", *CPU), memory_values),
    "check": (("check", *CPU), check_values),
}


def assert_fits(output: str, width: int, values: list[str]) -> None:
    lines = output.splitlines()
    too_long = [line for line in lines if len(line) > width]
    assert not too_long, f"lines longer than {width}: {too_long[:3]}"
    # the one announced cut: a long input's echo in the header, the same at every width
    assert "…" not in re.sub(r"…\s+\(\d[\d,]*\s+characters\s+in\s+all\)", "", output)
    folded = "".join(line.strip() for line in lines)

    def shown(value: str) -> bool:
        if len(value) <= width:
            return whole(value, output)
        # longer than a line: wrapped at its spaces, and a word longer than a line folded
        return all(whole(w, output) if len(w) <= width else w in folded for w in value.split())

    missing = [value for value in dict.fromkeys(values) if not shown(value)]
    assert not missing, f"not whole at {width} columns: {missing[:10]}"


@pytest.mark.parametrize("name", COMMANDS)
@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(width=st.integers(min_value=20, max_value=200))
def test_every_value_stays_whole_at_every_width(name, width):
    args, values_of = COMMANDS[name]
    result = invoke_at(args, str(width))
    assert result.exit_code == 0, result.output
    assert_fits(result.stdout, width, values_of(args))


@pytest.mark.parametrize("width", [20, 33, 80, 200])
def test_a_model_summary_of_every_block_fits(models_dir, width):
    args = ("run", "the cat sat on the mat", "--model", str(models_dir / "gpt2"))
    args = (*args, "--layer", "all", *CPU)
    result = invoke_at(args, str(width))
    assert result.exit_code == 0, result.output
    data = json_of(args)
    values = [str(layer["layer"]) for layer in data["layers"]]
    values += [format_bytes(data["memory"]["peak_bytes"])]
    values += [stat["kind"] for layer in data["layers"] for stat in layer["head_stats"]]
    assert_fits(result.stdout, width, values)
    grid = result.stdout.split("heads by block\n")[1].split("\nP previous")[0]  # to the legend
    marks = sum(len(re.sub(r"^layer +\d+ ", "", line).replace(" ", ""))
                for line in grid.splitlines() if line.startswith("layer "))  # fmt: skip
    assert marks == sum(len(layer["head_stats"]) for layer in data["layers"])  # every head


@pytest.mark.parametrize("width", [20, 37, 80])
@pytest.mark.parametrize("command", ["run", "shapes", "memory"])
def test_a_model_fits(models_dir, command, width):
    model = ("--model", str(models_dir / "gpt2"))
    args, values_of = {
        "run": (("run", "the cat sat", *model, "--layer", "-1", *CPU), run_values),
        "shapes": (("shapes", *model), shapes_values),
        "memory": (("memory", "--seq-len", "64", *model), memory_values),
    }[command]
    result = invoke_at(args, str(width))
    assert result.exit_code == 0, result.output
    assert_fits(result.stdout, width, values_of(args))


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from tiny_models import write

    directory = tmp_path_factory.mktemp("models")
    write("gpt2", directory / "gpt2")
    return directory


# the three cases the issue names, each failing before narrow layouts existed


def test_memory_at_60_columns_prints_whole_sizes():
    out = invoke_at(("memory",), "60").stdout
    assert "16.00 K…" not in out and "…" not in out
    assert whole("16.00 KiB", out) and whole("(1, 8, 2048, 2048)", out)


def test_check_at_60_columns_keeps_its_verdicts():
    result = invoke_at(("check", *CPU), "60")
    compared = len(json_of(("check", *CPU))["comparisons"])
    verdicts = result.stdout.split("gradcheck:")[0]  # the comparisons, not gradcheck's
    assert len(re.findall(r"(?<!\S)ok(?!\S)", verdicts)) == compared


def test_shapes_at_40_columns_keeps_dtype_and_bytes():
    out = invoke_at(("shapes",), "40").stdout
    stages = json_of(("shapes",))["stages"]
    assert len(re.findall(r"(?<!\S)float32(?!\S)", out)) >= len(stages) - 1  # token_ids: int64
    assert whole("32.00 KiB", out) and whole("int64", out) and whole("128 B", out)


def test_one_token_at_80_columns_keeps_the_device_and_bytes():
    out = invoke_at(("run", "a", *CPU), "80").stdout
    stages = out.split("attention weights")[0].split("stages")[1]
    # every stage's device: in its column, or once for all when the column does not fit
    on_each = len(re.findall(r"(?<!\S)cpu(?!\S)", stages)) == 17
    assert on_each or "every stage on cpu" in stages
    assert whole("8 B", stages) and whole("view of weighted_values", stages)
    assert whole("2.00 KiB", stages) and whole("(1, 8, 1, 64)", stages)


# ---------------------------------------------------------------- COLUMNS and pipes


@pytest.mark.parametrize("columns", ["0", "-5", "abc", "", "1.5"])
@pytest.mark.parametrize("args", [("shapes",), ("--help",), ("check", "--help")])
def test_unusable_columns_is_ignored(args, columns):
    result = invoke_at(args, columns)
    unset = invoke_at(args, None)
    assert result.exit_code == unset.exit_code == 0, result.output
    assert result.stdout == unset.stdout and result.stdout.strip()


def test_columns_with_spaces_is_read():
    assert invoke_at(("shapes",), " 40 ").stdout == invoke_at(("shapes",), "40").stdout


def test_huge_columns_is_quick_and_bounded():
    started = time.perf_counter()
    for args in [("memory", "--seq-len", "512,2048"), ("shapes",), ("--help",)]:
        result = invoke_at(args, "100000")
        assert result.exit_code == 0, result.output
        assert len(result.stdout) < 100_000
    assert time.perf_counter() - started < 20


@pytest.mark.parametrize(
    "args",
    [
        ("run", "Are you OK?", *CPU),
        ("run", "Are you OK?", "hi", "--rows", "0:1", *CPU),
        ("shapes",),
        ("memory", "--seq-len", "64,128"),
        ("memory", "--budget", "1GiB", "--train"),
        ("check", *CPU),
        ("--help",),
        ("run", "--help"),
        ("memory", "--help"),
        ("shapes", "--json"),
        ("--show-completion", "bash"),
    ],
    ids=lambda args: " ".join(args)[:30],
)
@pytest.mark.parametrize("columns", ["40", "80", "200"])
def test_piped_output_has_no_trailing_spaces(args, columns, monkeypatch):
    # Typer's switch: --show-completion takes the shell's name instead of detecting it
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")
    result = invoke_at(args, columns)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()
    bad = [line for line in result.stdout.splitlines() if line != line.rstrip()]
    assert not bad, bad[:3]


# ---------------------------------------------------------------- check's differences


def test_differences_show_as_a_bound_that_holds_on_any_cpu():
    assert difference_bound(2.46e-07) == difference_bound(2.98e-07) == "< 1e-06"
    assert difference_bound(0.0) == "0"
    assert difference_bound(1e-06) == "< 1e-05"  # strictly above
    assert difference_bound(9.99e-07) == "< 1e-06"
    assert difference_bound(0.297) == "< 1e+00"
    assert difference_bound(float("nan")) == "nan"


def test_check_view_is_the_same_for_two_cpus_float_noise():
    from rich.console import Console

    from attnctl.model.config import build_config
    from attnctl.nn.check import CheckResult, Comparison
    from attnctl.render import check_view
    from attnctl.stages.plan import build_plan

    plan = build_plan(build_config(None), 16, 2, 2214)

    def shown(difference: float) -> str:
        comparison = Comparison("math", "sdpa", "output", difference, 1e-05)
        result = CheckResult([comparison], True, "float64", "cpu")
        console = Console(width=80, no_color=True, highlight=False)
        with console.capture() as capture:
            console.print(check_view(result, plan))
        return capture.get()

    avx2, avx512 = shown(2.46e-07), shown(2.98e-07)
    assert avx2 == avx512
    assert "< 1e-06" in avx2 and "e-07" not in avx2
    assert "the exact values are in --json" in avx2
    exact = json_of(("check", *CPU))["comparisons"][0]["max_abs_diff"]
    assert isinstance(exact, float)  # --json keeps the exact value


# ---------------------------------------------------------------- options and help


def test_short_version_flag():
    assert invoke_at(("-V",), "80").stdout == invoke_at(("--version",), "80").stdout
    assert invoke_at(("-V",), "80").stdout.startswith("attnctl ")


def test_shell_completion_is_offered(monkeypatch):
    monkeypatch.setenv("_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION", "1")  # name the shell
    help_text = invoke_at(("--help",), "80").stdout
    assert "--install-completion" in help_text and "--show-completion" in help_text
    script = RUNNER.invoke(app, ["--show-completion", "bash"], prog_name="attnctl")
    assert script.exit_code == 0 and "_ATTNCTL_COMPLETE" in script.stdout


def test_completion_keeps_help_fast():
    """Completion imports nothing that --help did not import already, and --help is quick."""
    code = (
        "import sys\n"
        "import attnctl.cli as cli\n"
        "cli.app._add_completion = {on}\n"
        "sys.argv = ['attnctl', '--help']\n"
        "try:\n"
        "    cli.main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(' '.join(sorted(sys.modules)), file=sys.stderr)\n"
    )

    def modules(on: bool) -> set[str]:
        done = subprocess.run(
            [sys.executable, "-c", code.format(on=on)], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert ("--show-completion" in done.stdout) == on
        return set(done.stderr.split())

    assert modules(True) - modules(False) == set()
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "attnctl", "--help"], capture_output=True, check=True)
    assert time.perf_counter() - started < 3.0  # about 0.2 s; torch alone would take over 1 s


def test_run_dash_reads_stdin():
    from_stdin = invoke_at(("run", "-", "--json", *CPU), "80", input="Are you OK?")
    from_file = invoke_at(("run", "--file", "-", "--json", *CPU), "80", input="Are you OK?")
    from_argument = invoke_at(("run", "Are you OK?", "--json", *CPU), "80")
    assert from_stdin.exit_code == 0, from_stdin.output
    assert json.loads(from_stdin.stdout) == json.loads(from_file.stdout)
    assert json.loads(from_stdin.stdout) == json.loads(from_argument.stdout)
    twice = invoke_at(("run", "-", "-"), "80", input="hi")
    assert twice.exit_code == 2 and "stdin can be read once" in twice.stderr


@pytest.mark.parametrize("command", ["run", "shapes", "check"])
def test_dropout_is_offered_only_where_it_acts(command, tmp_path):
    assert "--dropout" not in invoke_at((command, "--help"), "200").stdout
    preset = tmp_path / "dropout.toml"
    preset.write_text("dropout = 0.1\n")  # a preset may still carry it: refused by name
    args = (command, *(["hi"] if command == "run" else []), "--config", str(preset))
    result = invoke_at(args, "80")
    assert result.exit_code == 2 and "dropout acts only in training" in result.stderr


def test_memory_keeps_dropout_for_training():
    assert "--dropout" in invoke_at(("memory", "--help"), "200").stdout
    trained = invoke_at(("memory", "--train", "--dropout", "0.1", "--seq-len", "8"), "80")
    assert trained.exit_code == 0, trained.output


SEPARATORS = r"[\s|<>\[\](),;:'\"│╭╮╰╯─]+"  # around words in help, the box drawn too


def help_words(command: tuple[str, ...]) -> list[str]:
    """Every word of a command's help and its options' help, and each choice of each option."""
    import typer

    target = typer.main.get_command(app)
    if command:
        target = target.commands[command[0]]
    texts = [target.help or ""] + [getattr(p, "help", None) or "" for p in target.params]
    words = [w.rstrip(".") for text in texts for w in re.split(SEPARATORS, text) if w]
    for param in target.params:
        words += [str(choice) for choice in getattr(param.type, "choices", None) or ()]
    return words


@pytest.mark.parametrize("columns", ["80", "60"])
@pytest.mark.parametrize("command", [(), ("run",), ("shapes",), ("memory",), ("check",)])
def test_help_never_breaks_a_word(command, columns):
    out = invoke_at((*command, "--help"), columns).stdout
    assert "…" not in out
    assert all(len(line) <= int(columns) for line in out.splitlines())
    shown = {word.rstrip(".") for word in re.split(SEPARATORS, out)}
    words = help_words(command)
    assert not [word for word in words if word not in shown]
    assert not command or {"bfloat16", "sinusoidal", "causal"} <= set(words)


def test_the_layer_line_names_positions_the_embeddings_add(tmp_path):
    """GPT-2's attention adds no positions, its embeddings a learned table: the "layer"
    line says so, as the HTML header does, and never "pos none" for it."""
    import tiny_models

    gpt2 = str(tiny_models.write_header_only("gpt2-small", tmp_path / "gpt2"))
    for command in ("shapes", "memory"):
        out = " ".join(invoke_at((command, "--model", gpt2), "200").stdout.split())
        assert "pos learned (embeddings)" in out and "pos none" not in out, out
    seeded = " ".join(invoke_at(("shapes", "--pos", "none"), "200").stdout.split())
    assert "pos none ·" in seeded  # the seeded layer without positions anywhere
    learned = " ".join(invoke_at(("shapes", "--pos", "learned"), "200").stdout.split())
    assert "pos learned ·" in learned  # its own option, said as given
