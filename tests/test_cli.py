"""Every command and option through the CLI, with golden output for the rendering."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from json_contract import only_length

CPU = ("--device", "cpu")


def run_json(invoke, *args):
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# ---------------------------------------------------------------- golden output


@pytest.mark.parametrize("columns", [80, 200])
def test_run_golden(invoke, golden, columns):
    result = invoke("run", "Are you OK?", "--config", "are-you-ok", *CPU, columns=columns)
    assert result.exit_code == 0, result.output
    golden(f"run_are_you_ok_{columns}.txt", result.stdout)


# Seed 000's weights for 猫吃鱼, head 0 (the tutorial's printout). Their 7th and 8th decimals
# differ between CPUs' vector units (0.34518778 with AVX-512, 0.34518781 with
# ATEN_CPU_CAPABILITY=default), so the golden text has 4 decimals, as print(tensor) shows
# them: every weight is at least 9e-6 from a rounding boundary, ~300 float32 steps.
SEED_000_HEAD_0 = [
    [0.27858627, 0.32334039, 0.39807332],
    [0.31398129, 0.34083092, 0.34518778],
    [0.32009554, 0.30858979, 0.37131470],
]


def test_run_cat_eats_fish_golden(invoke, golden):
    args = ("run", "猫吃鱼", "--config", "configs/cat-eats-fish.toml", *CPU)
    result = invoke(*args, "--digits", "4")
    assert result.exit_code == 0, result.output
    assert "0.2786   0.3233  0.3981*" in result.stdout
    golden("run_cat_eats_fish_80.txt", result.stdout)
    head_0 = torch.tensor(run_json(invoke, *args)["attention"][0][0])
    assert (head_0 - torch.tensor(SEED_000_HEAD_0)).abs().max() <= 1e-6


@pytest.mark.parametrize("columns", [80, 200])
def test_shapes_golden(invoke, golden, columns):
    result = invoke("shapes", "--device", "cpu", columns=columns)
    assert result.exit_code == 0, result.output
    golden(f"shapes_default_{columns}.txt", result.stdout)


def test_memory_golden(invoke, golden):
    result = invoke("memory", "--seq-len", "2048", "--mask", "causal")
    assert result.exit_code == 0, result.output
    golden("memory_2048_causal_80.txt", result.stdout)


# ---------------------------------------------------------------- run


def test_run_shows_tokens_every_stage_all_heads_and_memory(invoke):
    out = invoke("run", "Are you OK?", "--heads", "8", *CPU).stdout
    stages = ["token_ids", "embeddings", "positions", "q_heads", "scores", "weights",
              "weighted_values", "concat", "output_projection", "residual", "norm"]  # fmt: skip
    for stage in stages:
        assert f" {stage} " in out
    assert "(1, 8, 4, 64)" in out and "(1, 8, 4, 4)" in out
    assert all(f"head {h}" in out for h in range(8))
    assert "parameters" in out and "peak" in out


def test_head_option_selects_heads(invoke):
    out = invoke("run", "Are you OK?", "--head", "5", "--head", "2", *CPU).stdout
    assert "head 5" in out and "head 2" in out
    assert "head 0" not in out
    assert out.index("head 5") < out.index("head 2")


def test_many_heads_show_eight_by_default(invoke):
    out = invoke("run", "hi", "--heads", "16", *CPU).stdout
    assert "head 7" in out and "head 8" not in out
    assert "heads 8–15 not shown" in out


def weight_rows(output: str, head: int) -> list[str]:
    """The data rows of one head's weight table: lines like ' 3 ?   0.13  0.22  0.36*  0.28'."""
    section = output.split(f"head {head}", 1)[1].split("heads at a glance", 1)[0]
    return [line for line in section.splitlines() if re.match(r"^\s*\d+ .*\d\.\d", line)]


def test_each_row_marks_its_maximum(invoke):
    data = run_json(invoke, "run", "Are you OK?", "--head", "0", *CPU)
    out = invoke("run", "Are you OK?", "--head", "0", *CPU).stdout
    rows = weight_rows(out, 0)
    assert len(rows) == 4
    for query, line in enumerate(rows):
        weights = data["attention"][0][0][query]
        cells = line.split()[-4:]
        starred = [i for i, c in enumerate(cells) if c.endswith("*")]
        assert starred == [max(range(4), key=weights.__getitem__)]
        assert [float(c.rstrip("*")) for c in cells] == [round(w, 2) for w in weights]


def test_causal_mask_is_shown_with_its_convention(invoke):
    out = invoke("run", "Are you OK?", "--mask", "causal", *CPU).stdout
    assert " mask " in out and "True = may attend" in out
    data = run_json(invoke, "run", "Are you OK?", "--mask", "causal", *CPU)
    first_head = data["attention"][0][0]
    assert all(first_head[q][k] == 0 for q in range(4) for k in range(q + 1, 4))


def test_sdpa_run_computes_the_same_weights_as_math(invoke):
    out = invoke("run", "Are you OK?", "--impl", "sdpa", *CPU).stdout
    assert "sdpa (weights only for the rows shown)" in out and "head 0" in out
    assert " scores " not in out  # the fused kernel never builds them
    sdpa = run_json(invoke, "run", "Are you OK?", "--impl", "sdpa", *CPU)
    math = run_json(invoke, "run", "Are you OK?", "--impl", "math", *CPU)
    assert (sdpa["impl"], math["impl"]) == ("sdpa", "math")
    diff = (torch.tensor(sdpa["attention"]) - torch.tensor(math["attention"])).abs().max()
    assert diff <= 1e-6


LONG = " ".join(f"w{i}" for i in range(60))
LONG_TOKENS = 170  # with the bundled tokenizer: "w", "12" pieces and so on


@pytest.mark.parametrize("columns", [80, 200])
def test_long_inputs_show_a_window_and_top_keys(invoke, columns, tmp_path):
    path = tmp_path / "long.txt"
    path.write_text(LONG)
    args = ("run", "--file", str(path), "--head", "0", "--d-model", "16", "--heads", "2", *CPU)
    result = invoke(*args, columns=columns)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= columns
    assert "attention  sdpa (weights only for the rows shown)" in result.stdout
    assert f"query rows 16–{LONG_TOKENS - 17} not computed" in result.stdout
    assert "keys do not fit" in result.stdout and "strongest keys" in result.stdout
    assert f"tokens 16–{LONG_TOKENS - 17} not listed" in result.stdout
    data = run_json(invoke, *args)
    assert len(data["tokens"][0]) == LONG_TOKENS
    assert data["attention_rows"] == [*range(16), *range(LONG_TOKENS - 16, LONG_TOKENS)]
    assert torch.tensor(data["attention"]).shape == (1, 1, 32, LONG_TOKENS)
    assert "scores" not in {s["name"] for s in data["stages"]}
    # each shown row lists keys from strongest to weakest, as the JSON has them
    rows = weight_rows(result.stdout, 0)
    assert len(rows) == 32
    for position, line in enumerate(rows):
        keys = [int(cell.split()[0]) for cell in re.split(r"\s{2,}", line.strip())[1:]]
        weights = data["attention"][0][0][position]
        ranked = sorted(range(LONG_TOKENS), key=weights.__getitem__, reverse=True)
        assert keys == ranked[: len(keys)]


def test_window_weights_equal_the_math_path(invoke, tmp_path):
    path = tmp_path / "long.txt"
    path.write_text(LONG)
    common = ("--file", str(path), "--d-model", "32", "--heads", "4", "--mask", "causal", *CPU)
    window = run_json(invoke, "run", *common, "--rows", "last:3", "--rows", "5", "--head", "2")
    last3 = [LONG_TOKENS - 3, LONG_TOKENS - 2, LONG_TOKENS - 1]
    assert window["impl"] == "sdpa" and window["attention_rows"] == [5, *last3]
    assert window["attention_heads"] == [2]
    full = run_json(invoke, "run", *common, "--rows", "all", "--head", "2")
    assert full["impl"] == "math" and full["attention_rows"] == list(range(LONG_TOKENS))
    expected = torch.tensor(full["attention"])[:, :, [5, *last3]]
    assert (torch.tensor(window["attention"]) - expected).abs().max() <= 1e-6
    assert torch.tensor(window["attention"])[0, 0, 0, 6:].abs().max() == 0  # causal row 5


def test_text_from_stdin(invoke):
    result = invoke("run", "--file", "-", "--json", *CPU, input="Are you OK?")
    assert [t["text"] for t in json.loads(result.stdout)["tokens"][0]] == ["Are", "you", "OK", "?"]


def test_weights_too_small_for_the_digits_use_exponent_notation():
    from attnctl.render import weight_text

    assert weight_text(0.3141, 2) == "0.31"
    assert weight_text(0.00031, 2) == "3.1e-04"
    assert weight_text(0.0, 2) == "0.00"


def test_bpe_pieces_are_marked_in_the_token_table(invoke):
    out = invoke("run", "龘", "--d-model", "16", "--heads", "2", *CPU).stdout
    assert "piece 1/3 of one character" in out and "piece 3/3" in out


def test_char_and_path_tokenizers(invoke, tmp_path):
    data = run_json(invoke, "run", "abca", "--tokenizer", "char", *CPU)
    assert [t["id"] for t in data["tokens"][0]] == [0, 1, 2, 0]
    assert data["vocab_size"] == 3
    from attnctl.text.tokenize import BUNDLED_PATH

    copy = tmp_path / "tokenizer.json"
    copy.write_text(BUNDLED_PATH.read_text(encoding="utf-8"), encoding="utf-8")
    data = run_json(invoke, "run", "Are you OK?", "--tokenizer", str(copy), *CPU)
    assert [t["text"] for t in data["tokens"][0]] == ["Are", "you", "OK", "?"]


def test_run_json_schema(invoke):
    data = run_json(invoke, "run", "Are you OK?", "--heads", "8", *CPU)
    assert {"config", "tokens", "stages", "attention", "memory"} <= set(data)
    assert data["tokens"] == [
        [{"id": t["id"], "text": text, "start": s, "end": e, "pad": False}
         for t, text, (s, e) in zip(data["tokens"][0], ["Are", "you", "OK", "?"],
                                    [(0, 3), (4, 7), (8, 10), (10, 11)], strict=True)]
    ]  # fmt: skip
    for stage in data["stages"]:
        assert {"name", "dims", "shape", "dtype", "device", "bytes"} <= set(stage)
    attention = torch.tensor(data["attention"])
    assert attention.shape == (1, 8, 4, 4)
    assert torch.allclose(attention.sum(-1), torch.ones(1, 8, 4))
    assert data["memory"]["attention_matrix_bytes"] == 8 * 4 * 4 * 4
    assert data["config"]["heads"] == 8


@pytest.mark.parametrize(
    "options",
    [[], ["--mask", "causal", "--pos", "none"], ["--impl", "sdpa", "--dtype", "bfloat16"],
     ["--norm", "none", "--no-bias", "--heads", "4", "--d-model", "32"], ["-c", "cat-eats-fish"]],
)  # fmt: skip
def test_shapes_agree_with_what_run_records(invoke, options):
    ran = run_json(invoke, "run", "Are you OK?", *options, *CPU)
    seq_len = str(len(ran["tokens"][0]))
    planned = run_json(invoke, "shapes", "--seq-len", seq_len, *options, *CPU)
    assert planned["stages"] == ran["stages"]
    assert set(planned) >= {"config", "stages"}


def test_options_reach_the_layer(invoke):
    data = run_json(invoke, "run", "Are you OK?", "--d-model", "48", "--heads", "3",
                    "--no-bias", "--pos", "none", "--norm", "none", "--seed", "7",
                    "--dtype", "float16", *CPU)  # fmt: skip
    assert data["config"] | {"d_model": 48, "heads": 3, "bias": False, "seed": 7} == data["config"]
    stages = {s["name"]: s for s in data["stages"]}
    assert "positions" not in stages and "norm" not in stages
    assert stages["q_heads"]["shape"] == [1, 3, 4, 16] and stages["q"]["dtype"] == "float16"


def test_seed_changes_the_weights_and_is_reproducible(invoke):
    a = run_json(invoke, "run", "Are you OK?", "--seed", "1", *CPU)["attention"]
    b = run_json(invoke, "run", "Are you OK?", "--seed", "1", *CPU)["attention"]
    c = run_json(invoke, "run", "Are you OK?", "--seed", "2", *CPU)["attention"]
    assert a == b != c


def test_device_auto_falls_back_to_what_is_there(invoke):
    data = run_json(invoke, "run", "hi", "--d-model", "8", "--heads", "2")
    expected = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert {s["device"] for s in data["stages"]} == {expected}


# ---------------------------------------------------------------- shapes and memory


def test_shapes_options(invoke):
    data = run_json(invoke, "shapes", "--seq-len", "7", "--batch", "3", "--heads", "4")
    stages = {s["name"]: s for s in data["stages"]}
    assert stages["scores"]["shape"] == [3, 4, 7, 7]
    assert stages["q_heads"]["dims"] == ["B", "H", "L", "d_k"]
    assert stages["q_heads"]["shape"] == [3, 4, 7, 128]
    out = invoke("shapes", "--seq-len", "7", "--batch", "3", "--heads", "4").stdout
    assert "B H L d_k" in out and "(3, 4, 7, 128)" in out and "B=3  L=7" in out


def test_memory_json_and_dtype_table(invoke):
    data = only_length(run_json(invoke, "memory", "--seq-len", "2048"))
    assert data["seq_len"] == 2048 and data["batch"] == 1
    assert data["attention_matrix_bytes"] == 8 * 2048 * 2048 * 4
    assert data["parameters_bytes"] == data["parameters"] * 4
    assert data["peak_bytes"] > data["parameters_bytes"] + 2 * data["attention_matrix_bytes"]
    assert {s["name"] for s in data["stages"]} >= {"scores", "weights"}
    assert data["by_dtype"]["bfloat16"]["attention_matrix_bytes"] == 8 * 2048 * 2048 * 2
    out = invoke("memory", "--seq-len", "2048", "--batch", "2").stdout
    for text in ("float32", "float16", "bfloat16", "256.00 MiB", "B·H·L·L·4 = 2·8·2048·2048·4"):
        assert text in out


def test_memory_sdpa_never_builds_the_matrices(invoke):
    data = only_length(run_json(invoke, "memory", "--seq-len", "4096", "--impl", "sdpa"))
    math = only_length(run_json(invoke, "memory", "--seq-len", "4096"))
    assert data["scores_bytes"] == data["weights_bytes"] == 0
    assert data["peak_bytes"] < math["peak_bytes"] / 10


# ---------------------------------------------------------------- errors


ERRORS = [
    (["run", "hi", "--heads", "7"], 2, "heads=7 does not divide d_model=512; head counts that "
     "work: 1, 2, 4, 8, 16, 32, 64, 128, 256, 512"),
    (["run", "hi", "--heads", "0"], 2, "heads must be a positive integer"),
    (["shapes", "--heads", "-3"], 2, "heads must be a positive integer"),
    (["shapes", "--seq-len", "0"], 2, "seq-len must be a positive integer"),
    (["memory", "--seq-len", "-5"], 2, "seq-len must be a positive integer"),
    (["memory", "--batch", "0"], 2, "batch must be a positive integer"),
    (["run", ""], 2, "a text is empty"),
    (["run", "hi", "--device", "tpu"], 2, "unknown device 'tpu'"),
    (["run", "hi", "--dtype", "float64"], 2, "'float64' is not one of"),
    (["run", "hi", "--heads", "abc"], 2, "Invalid value for '--heads'"),
    (["run", "hi", "--frobnicate"], 2, "No such option: --frobnicate"),
    (["run"], 2, "give the text either as TEXT or with --file PATH"),
    (["run", "hi", "--file", "x.txt"], 2, "not both or neither"),
    (["run", "--file", "/no/such.txt"], 2, "text file not found: /no/such.txt"),
    (["run", "hi", "--rows", "5:2"], 2, "--rows '5:2' is not A:B, last:N, N or all"),
    (["run", "hi", "--rows", "last:0"], 2, "is not A:B, last:N, N or all"),
    (["run", "hi", "--rows", "9"], 2, "--rows '9' reaches past the input: its query rows are 0–"),
    (["run", "hi", "--rows", "x"], 2, "is not A:B"),
    (["run", "hi", "--config", "nope"], 2, "unknown preset 'nope'"),
    (["shapes", "--config", "missing.toml"], 2, "config file not found: missing.toml"),
    (["run", "hi", "--tokenizer", "/no/tokenizer.json"], 2, "tokenizer file not found"),
    (["shapes", "--tokenizer", "/no/tokenizer.json"], 2, "tokenizer file not found"),
    (["run", "hi", "--head", "8"], 2, "--head 8 does not exist; heads are 0–7"),
    (["run", "hi", "--digits", "12"], 2, "--digits must be between 0 and 8"),
]  # fmt: skip
if not torch.cuda.is_available() or torch.cuda.device_count() < 8:
    ERRORS.append((["run", "hi", "--device", "cuda:7"], 2, "device cuda:7 is not available"))
if not torch.cuda.is_available():
    ERRORS.append((["run", "hi", "--device", "cuda"], 2, "device cuda is not available"))


@pytest.mark.parametrize("args,code,message", ERRORS, ids=[" ".join(e[0]) for e in ERRORS])
def test_bad_input_is_one_line_and_the_right_exit_code(invoke, args, code, message):
    result = invoke(*args)
    assert result.exit_code == code, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("attnctl: error: ")
    assert message in lines[0]


@pytest.mark.parametrize(
    "text,message",
    [("colour = 1\n", "unknown key 'colour'"), ("heads = [", "malformed config")],
)
def test_bad_config_files_exit_2(invoke, tmp_path, text, message):
    path = tmp_path / "preset.toml"
    path.write_text(text)
    result = invoke("run", "hi", "--config", str(path))
    assert result.exit_code == 2 and message in result.stderr
    assert len(result.stderr.splitlines()) == 1


def test_malformed_tokenizer_exits_2(invoke, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("{oops")
    for command in (["run", "hi"], ["shapes"]):
        result = invoke(*command, "--tokenizer", str(path))
        assert result.exit_code == 2 and "malformed tokenizer" in result.stderr


def test_out_of_memory_is_a_runtime_failure(invoke, monkeypatch):
    import attnctl.nn.model

    def explode(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    monkeypatch.setattr(attnctl.nn.model, "forward", explode)
    result = invoke("run", "hi", *CPU)
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        "attnctl: error: out of memory on cpu: CUDA out of memory. Tried to allocate 64.00 GiB"
    )


def test_no_arguments_is_the_help(invoke):
    result = invoke()
    assert result.exit_code == 0  # asking for nothing is asking what attnctl does
    assert result.stdout == invoke("--help").stdout
    assert "Usage: " in result.stdout and "COMMAND" in result.stdout
    assert result.stderr == ""


def test_debug_shows_the_traceback(invoke):
    result = invoke("--debug", "run", "hi", "--heads", "7")
    assert result.exit_code == 2
    assert "Traceback" in result.stderr and "AttnctlError" in result.stderr


def test_user_text_is_printed_literally(invoke):
    sentence = "[red]alarm[/red] [bold]x\x1b[31mred\x07"
    result = invoke("run", sentence, "--d-model", "8", "--heads", "2", *CPU)
    assert result.exit_code == 0, result.output
    assert "[red]alarm[/red] [bold]x\\x1b[31mred\\x07" in result.stdout
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout
    bad = invoke("run", "hi", "--config", "[red]nope\x1b")
    assert "unknown preset '[red]nope\\x1b'" in bad.stderr and "\x1b" not in bad.stderr


def test_no_colour_codes_when_not_a_terminal(invoke):
    assert "\x1b[" not in invoke("run", "Are you OK?", *CPU).stdout


def test_python_dash_m_and_version():
    done = subprocess.run(
        [sys.executable, "-m", "attnctl", "--version"], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.startswith("attnctl ")
    done = subprocess.run(
        [sys.executable, "-m", "attnctl", "shapes", "--heads", "5"], capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "heads=5" in done.stderr


@pytest.mark.parametrize(
    "command",
    [["run", "Are you OK?"], ["memory", "--seq-len", "64", "--measure"], ["check"]],
    ids=["run", "memory --measure", "check"],
)
def test_preflight_refuses_what_does_not_fit_unless_forced(invoke, monkeypatch, command):
    import attnctl.memory.resources

    free = attnctl.memory.resources.Available(1000, "MemAvailable")
    monkeypatch.setattr(attnctl.memory.resources, "available_memory", lambda device: free)
    result = invoke(*command, *CPU)
    assert result.exit_code == 1
    assert re.fullmatch(
        r"attnctl: error: the estimated peak of [\d.]+ MiB is more than the 1000 B free on "
        r"cpu; use --force to try anyway\n",
        result.stderr,
    )
    assert invoke(*command, *CPU, "--force").exit_code == 0


def test_free_memory_reads_the_system():
    from attnctl.memory.resources import available_memory

    free = available_memory(torch.device("cpu"))
    assert free is not None and 0 < free.bytes <= 2**50


def test_progress_shows_on_a_terminal_and_not_elsewhere(invoke):
    import io

    from rich.console import Console

    from attnctl.cli.output import progress as _progress

    stream = io.StringIO()
    with _progress("measuring things", Console(file=stream, force_terminal=True, width=80)):
        pass
    assert "measuring things" in stream.getvalue()
    quiet = io.StringIO()
    with _progress("measuring things", Console(file=quiet, force_terminal=False)):
        pass
    assert quiet.getvalue() == ""
    result = invoke("memory", "--seq-len", "32", "--measure", *CPU)
    assert result.exit_code == 0 and result.stderr == ""


def test_readme_examples_are_the_real_output():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, str(root / "scripts" / "update_readme.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, (
        f"examples are stale (run scripts/update_readme.py): {done.stdout}{done.stderr[-2000:]}"
    )


def test_text_output_computes_only_the_heads_it_prints(invoke, monkeypatch):
    import attnctl.nn.runner

    seen = {}
    original = attnctl.nn.runner.run

    def spy(batch, config, model=None, layers=None, heads=None, *args, **kwargs):
        seen["heads"] = heads
        return original(batch, config, model, layers, heads, *args, **kwargs)

    monkeypatch.setattr(attnctl.nn.runner, "run", spy)
    invoke("run", LONG, "--heads", "16", "--d-model", "32", *CPU)
    assert list(seen["heads"]) == list(range(8))
    run_json(invoke, "run", LONG, "--heads", "16", "--d-model", "32", *CPU)
    assert list(seen["heads"]) == list(range(16))
