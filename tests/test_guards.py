"""Resource guards and bad input: what this process may use, how long a run takes, and
every malformed number or file ending in one line, the right exit code, within seconds."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import json_contract
import pytest
import torch
from json_contract import only_length

import attnctl.memory.resources as resources
from attnctl.errors import AttnctlError
from attnctl.memory.resources import Available, cpu_available, forward_flops
from attnctl.model.config import build_config
from attnctl.stages.plan import build_plan

CPU = ("--device", "cpu")
GiB = 2**30


def one_clean_line(result, code: int) -> str:
    """The error line of a failed command: nothing on stdout, one line on stderr."""
    assert result.exit_code == code, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnctl: error: "), result.stderr
    return lines[0]


# ---------------------------------------------------------------- memory this process may use


def fake_proc(tmp_path: Path, cgroup: str, available_kib: int = 20 * 2**20) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 99 kB\nMemAvailable: {available_kib} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "status").write_text("VmSize:\t1000 kB\nVmData:\t500 kB\n")
    return proc


def write(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


def test_a_cgroup_v2_limit_below_the_machine_is_what_counts(tmp_path):
    proc = fake_proc(tmp_path, "0::/user.slice/job\n")
    root = tmp_path / "cgroup"
    write(root, cgroup_controllers="memory\n")
    write(root / "user.slice", memory_max="max\n", memory_current="123\n")
    write(
        root / "user.slice" / "job",
        memory_max=f"{4 * GiB}\n",
        memory_current=f"{GiB}\n",
        memory_stat=f"anon 1\ninactive_file {GiB // 2}\nactive_file 7\n",
    )
    available = cpu_available(proc, root)
    assert available == Available(4 * GiB - GiB + GiB // 2, "cgroup memory.max")


def test_a_parent_cgroup_limits_its_children(tmp_path):
    proc = fake_proc(tmp_path, "0::/a/b\n")
    root = tmp_path / "cgroup"
    write(root, cgroup_controllers="memory\n")
    write(root / "a", memory_max=f"{2 * GiB}\n", memory_current=f"{GiB}\n")
    write(root / "a" / "b", memory_max=f"{8 * GiB}\n", memory_current=f"{GiB}\n")
    assert cpu_available(proc, root) == Available(GiB, "cgroup memory.max")


def test_a_cgroup_v1_limit_counts_too(tmp_path):
    proc = fake_proc(tmp_path, "5:devices:/\n4:memory:/box/one\n0::/\n")
    root = tmp_path / "cgroup"
    write(
        root / "memory" / "box" / "one",
        memory_limit_in_bytes=f"{3 * GiB}\n",
        memory_usage_in_bytes=f"{GiB}\n",
        memory_stat="total_inactive_file 0\n",
    )
    write(root / "memory", memory_limit_in_bytes="9223372036854771712\n")  # v1's "no limit"
    assert cpu_available(proc, root) == Available(2 * GiB, "cgroup memory.limit_in_bytes")


def test_without_limits_the_machine_counts(tmp_path):
    proc = fake_proc(tmp_path, "0::/\n", available_kib=1234)
    root = tmp_path / "cgroup"
    write(root, cgroup_controllers="memory\n", memory_max="max\n")
    assert cpu_available(proc, root) == Available(1234 * 1024, "MemAvailable")


def test_garbage_in_proc_or_cgroup_files_is_no_limit(tmp_path):
    proc = fake_proc(tmp_path, "nonsense\n0::/x\n")
    root = tmp_path / "cgroup"
    write(root, cgroup_controllers="memory\n")
    write(root / "x", memory_max="lots\n", memory_current="-1\n", memory_stat="\x00\n")
    assert cpu_available(proc, root).source == "MemAvailable"


def run_limited(args: list[str], limit: int) -> subprocess.CompletedProcess:
    """attnctl in a process whose address space is limited, as under `ulimit -v`."""

    def limit_address_space() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return subprocess.run(
        [sys.executable, "-m", "attnctl", *args],
        capture_output=True,
        text=True,
        preexec_fn=limit_address_space,
        timeout=120,
    )


def test_the_rlimits_count_what_is_in_use(tmp_path, monkeypatch):
    proc = fake_proc(tmp_path, "0::/\n")  # VmSize 1000 kB, VmData 500 kB
    limits = {resource.RLIMIT_AS: (GiB, GiB), resource.RLIMIT_DATA: (resource.RLIM_INFINITY,) * 2}
    monkeypatch.setattr(resource, "getrlimit", lambda kind: limits[kind])
    assert resources._rlimits(proc) == [Available(GiB - 1000 * 1024, "RLIMIT_AS")]
    limits[resource.RLIMIT_DATA] = (GiB // 2, GiB // 2)
    assert Available(GiB // 2 - 500 * 1024, "RLIMIT_DATA") in resources._rlimits(proc)


def test_the_preflight_honours_ulimit_v():
    # 16 GiB of weights: refused under a 4 GiB address space
    done = run_limited(["run", "hi", "--d-model", "32768", "--heads", "8", *CPU], 4 * GiB)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("attnctl: error: the estimated peak of 16.27 GiB is more than")
    # the limit counts unless the machine itself has less than it free
    said = {"left by RLIMIT_AS on cpu; use --force"}
    if cpu_available().bytes < 4 * GiB:
        said.add("free on cpu; use --force")
    assert any(text in done.stderr for text in said)
    assert done.stderr.count("\n") == 1
    # a layer that fits runs under the same limit
    fits = run_limited(["run", "hi", "--json", *CPU], 4 * GiB)
    assert fits.returncode == 0 and json_contract.loads(fits.stdout, "run")["attention"]


# ---------------------------------------------------------------- time


def test_forward_flops_count_every_product():
    config = build_config(d_model=64, heads=4, kv_heads=2)
    plan = build_plan(config, 10, 3, 100)
    tokens, d, kv = 3 * 10, 64, 2 * 16
    projections = 2 * tokens * (d * d + 2 * d * kv + d * d)  # W_q, W_k, W_v, W_o
    attention = 2 * (2 * 3 * 4 * 10 * 10 * 16)  # Q·Kᵀ and weights·V, per head
    assert forward_flops(plan) == (projections, attention)
    assert forward_flops(plan, blocks=5) == (5 * projections, 5 * attention)


def test_a_long_run_says_how_long_first(invoke, monkeypatch):
    monkeypatch.setattr(resources, "CEILING_PER_CPU_CORE", 1.0)  # time even a short run
    monkeypatch.setattr(resources, "measured_rates", lambda device, dtype: (1e3, 1e3))
    result = invoke("run", "Are you OK?", "--json", *CPU)
    assert result.exit_code == 0
    json.loads(result.stdout)  # stdout stays pure JSON
    note = result.stderr.splitlines()
    assert len(note) == 1
    assert note[0].startswith("attnctl: this will take about ")
    assert note[0].endswith(" on cpu (its operations at the speed measured here just now)")


def test_a_quick_run_is_not_timed(invoke, monkeypatch):
    def never(device, dtype):
        raise AssertionError("a quick run measured the device")

    monkeypatch.setattr(resources, "measured_rates", never)
    result = invoke("run", "Are you OK?", *CPU)
    assert result.exit_code == 0 and result.stderr == ""


def test_the_measured_rates_are_rates():
    matmul, sdpa = resources.measured_rates(torch.device("cpu"), torch.float32, seconds=0.001)
    assert 1e6 < matmul < 1e15 and 1e6 < sdpa < 1e15


def test_duration_text():
    assert resources.duration_text(42) == "42 s"
    assert resources.duration_text(200) == "3.3 min"
    assert resources.duration_text(3 * 3600) == "3.0 h"


# ---------------------------------------------------------------- numbers typed by the user


HUGE = str(10**18)
QUICK_REFUSALS = [
    # a hint that lists divisors must not loop up to a huge or prime width
    (["shapes", "--d-model", "1000000007", "--heads", "2"],
     "heads=2 does not divide d_model=1000000007; head counts up to 4096 that work: 1"),
    (["shapes", "--d-model", HUGE, "--heads", "7"],
     f"heads=7 does not divide d_model={HUGE}; head counts up to 4096 that work: 1, 2, 4, 5, 8"),
    (["shapes", "--d-model", HUGE, "--heads", HUGE, "--kv-heads", "3"],
     f"kv-heads=3 does not divide heads={HUGE}; kv-head counts up to 4096 that work: 1, 2"),
    # --rows names rows of the input, or is refused: never clamped
    (["run", "hi", "--rows", f"0:{10**30}"], f"--rows '0:{10**30}' reaches past the input"),
    (["run", "hi", "--rows", "last:3"], "--rows 'last:3' reaches past the input"),
]  # fmt: skip


@pytest.mark.parametrize(
    "args,message", QUICK_REFUSALS, ids=[" ".join(a) for a, _ in QUICK_REFUSALS]
)
def test_huge_numbers_are_refused_at_once(invoke, args, message):
    start = time.perf_counter()
    line = one_clean_line(invoke(*args, *CPU) if args[0] == "run" else invoke(*args), 2)
    assert time.perf_counter() - start < 5
    assert message in line


@pytest.mark.parametrize(
    "args",
    [["--seq-len", "20000"], ["--batch", "100000"], ["--d-model", "65536"]],
    ids=lambda a: " ".join(a),
)
def test_check_goes_through_the_preflight(invoke, monkeypatch, args):
    monkeypatch.setattr(resources, "available_memory", lambda device: Available(8 * GiB, "x"))
    line = one_clean_line(invoke("check", *args, *CPU), 1)
    assert "is more than the 8.00 GiB left by x on cpu; use --force to try anyway" in line


# ---------------------------------------------------------------- tokenizer files


def tokenizer_file(tmp_path: Path, vocab, added=None) -> str:
    data = {"model": {"type": "BPE", "vocab": vocab, "merges": []}}  # one token a character
    if added is not None:
        data["added_tokens"] = added
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data))
    return str(path)


BAD_VOCABS = {
    "empty": ({}, None, "its vocabulary is empty"),
    "string ids": ({"h": "0", "i": "1"}, None, "token ids must be integers from 0 to 4294967295"),
    "bool id": ({"h": True, "i": 1}, None, "got True"),
    "negative id": ({"h": 0, "i": -5}, None, "got -5"),
    "id past u32": ({"h": 0, "i": 2**40}, None, f"got {2**40}"),
    "float id": ({"h": 0.0}, None, "got 0.0"),
    "vocab a string": ("abc", None, "model.vocab must be an object or a list"),
    "added not a list": ({"h": 0}, {"id": 3}, "added_tokens must be a list of tokens"),
    "added id a string": ({"h": 0}, [{"id": "9", "content": "x"}], "got '9'"),
}


@pytest.mark.parametrize("command", ["shapes", "check", "run"])
@pytest.mark.parametrize("case", BAD_VOCABS, ids=list(BAD_VOCABS))
def test_a_malformed_vocabulary_is_one_line(invoke, tmp_path, command, case):
    vocab, added, message = BAD_VOCABS[case]
    path = tokenizer_file(tmp_path, vocab, added)
    args = {"shapes": ["shapes"], "check": ["check", *CPU], "run": ["run", "hi", *CPU]}[command]
    start = time.perf_counter()
    line = one_clean_line(invoke(*args, "--tokenizer", path), 2)
    assert time.perf_counter() - start < 5
    assert f"malformed tokenizer {path}" in line and message in line


def test_gaps_in_the_ids_get_embedding_rows(invoke, tmp_path):
    """tokenizers counts 2 tokens here; the embedding still needs a row for id 1000."""
    path = tokenizer_file(tmp_path, {"h": 0, "i": 1000})
    shapes = json.loads(invoke("shapes", "--tokenizer", path, "--json").stdout)
    run = json.loads(invoke("run", "hi", "--tokenizer", path, "--json", *CPU).stdout)
    assert shapes["sizes"]["V"] == run["vocab_size"] == 1001
    assert [t["id"] for t in run["tokens"][0]] == [0, 1000]


def test_an_unreadable_tokenizer_says_so(invoke, tmp_path):
    folder = tmp_path / "tokenizer.json"
    folder.mkdir()  # a folder where the file should be
    line = one_clean_line(invoke("shapes", "--tokenizer", str(folder)), 2)
    assert "tokenizer file not found" in line or "cannot read" in line


def test_validation_errors_are_usage_errors():
    with pytest.raises(AttnctlError) as caught:
        build_config(d_model=10**18 + 1, heads=2)
    assert caught.value.exit_code == 2


@pytest.mark.parametrize("key", ["rope_theta", "rope_factor", "norm_eps", "dropout"])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_a_preset_number_must_be_finite(invoke, tmp_path, key, value):
    preset = tmp_path / "p.toml"
    preset.write_text(f"{key} = {value}\n")
    line = one_clean_line(invoke("shapes", "--config", str(preset)), 2)
    assert f"{key} must be" in line


@pytest.mark.parametrize(
    "args,message",
    [
        (["memory", "--budget", "9" * 400 + "TiB"], "is more than 2^64 bytes"),
        (["memory", "--budget", "1e5GiB"], "cannot read size '1e5GiB'"),
        (["shapes", "--seq-len", str(2**63)], "seq-len must be below 2^63"),
        (["shapes", "--batch", str(10**30)], "batch must be below 2^63"),
        (["shapes", "--context-len", str(2**63)], "context-len must be below 2^63"),
        (["memory", "--layers", str(10**30)], "layers must be below 2^63"),
        (["memory", "--kv-cache", str(2**63)], "kv-cache must be below 2^63"),
        (
            ["shapes", "--d-model", str(10**20), "--heads", str(10**20)],
            "d_model must be below 2^63",
        ),
    ],
    ids=lambda a: " ".join(a)[:40] if isinstance(a, list) else "",
)
def test_sizes_no_tensor_can_have_are_refused(invoke, args, message):
    assert message in one_clean_line(invoke(*args), 2)


def test_every_head_of_a_huge_layer_is_not_listed_before_the_preflight(invoke, monkeypatch):
    monkeypatch.setattr(resources, "available_memory", lambda device: Available(GiB, "x"))
    start = time.perf_counter()
    args = ["run", "hi", "--d-model", str(10**12), "--heads", str(10**12), "--json", *CPU]
    assert "is more than the 1.00 GiB left by x" in one_clean_line(invoke(*args), 1)
    assert time.perf_counter() - start < 5


# ---------------------------------------------------------------- texts and files


def test_a_text_is_read_up_to_its_limit(invoke, tmp_path):
    import attnctl.app

    big = tmp_path / "big.txt"
    big.write_bytes(b"a" * (attnctl.app.MAX_TEXT_BYTES + 1))
    start = time.perf_counter()
    line = one_clean_line(invoke("run", "--file", str(big), *CPU), 2)
    assert time.perf_counter() - start < 5
    assert line.startswith(f"attnctl: error: text file {big} is longer than the 4 MiB")


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_an_endless_device_as_text_ends_at_once(invoke, device):
    start = time.perf_counter()
    line = one_clean_line(invoke("run", "--file", device, *CPU), 2)
    assert time.perf_counter() - start < 5 and "is longer than the 4 MiB" in line


def test_texts_that_are_not_utf8_are_refused(invoke, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ab\xff\xfecd")
    assert "not UTF-8 text (invalid start byte at byte 2)" in one_clean_line(
        invoke("run", "--file", str(bad), *CPU), 2
    )
    # bytes a shell passes in argv arrive as surrogates
    line = one_clean_line(invoke("run", "ab\udcff\udcfecd", *CPU), 2)
    assert "is not valid UTF-8" in line
    line = one_clean_line(
        invoke("run", "hi", "--context", "\udcff", "--config", "cross-attention"), 2
    )
    assert "is not valid UTF-8" in line


def test_stdin_as_text(tmp_path):
    def attnctl(*args: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "attnctl", *args], capture_output=True, timeout=60, **kwargs
        )

    empty = attnctl("run", "-", *CPU, stdin=subprocess.DEVNULL)
    assert empty.returncode == 2 and b"a text is empty" in empty.stderr
    closed = attnctl("run", "-", *CPU, stdin=subprocess.DEVNULL, preexec_fn=lambda: os.close(0))
    assert closed.returncode == 2 and closed.stdout == b""
    assert closed.stderr == b"attnctl: error: cannot read stdin: it is closed (see --help)\n"
    not_utf8 = attnctl("run", "-", *CPU, input=b"ab\xff\xfecd")
    assert not_utf8.returncode == 2 and not_utf8.stdout == b""
    assert b"cannot read stdin: not UTF-8 text" in not_utf8.stderr
    done = attnctl("run", "-", "--json", *CPU, input="猫吃鱼".encode())
    assert done.returncode == 0 and json_contract.loads(done.stdout, "run")["tokens"]


def test_run_gives_large_blocks_back_to_the_system(invoke, monkeypatch):
    import attnctl.nn.runner

    attnctl.nn.runner.tune_allocator()  # callable here (glibc's mallopt, or nothing elsewhere)
    calls = []
    monkeypatch.setattr(attnctl.nn.runner, "tune_allocator", lambda: calls.append(1))
    assert invoke("run", "hi", *CPU).exit_code == 0 and calls == [1]


def test_torch_is_imported_out_of_the_collectors_sight():
    code = (
        "import gc, sys, attnctl.memory.resources as r; r.import_torch(); "
        "print('torch' in sys.modules, gc.isenabled(), gc.get_freeze_count() > 100_000)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["True", "True", "True"], done.stderr


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)  # opening it would wait for a writer forever
    return path


def run_attnctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "attnctl", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("option", ["--tokenizer", "--config"])
def test_a_pipe_as_a_file_is_refused_without_opening_it(fifo, option):
    done = run_attnctl("shapes", option, str(fifo))
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert f"{fifo}: not a regular file (a pipe or device)" in done.stderr


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_pipe_in_a_model_folder_is_refused_without_opening_it(tmp_path, name):
    sys.path.insert(0, str(Path(__file__).parent))
    import tiny_models

    folder = tiny_models.write("gpt2", tmp_path / "gpt2")
    (folder / name).unlink()
    os.mkfifo(folder / name)
    done = run_attnctl("shapes", "--model", str(folder))
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert "not a regular file (a pipe or device)" in done.stderr


def test_folders_and_files_in_the_wrong_place(invoke, tmp_path):
    line = one_clean_line(invoke("shapes", "--tokenizer", str(tmp_path)), 2)
    assert line.startswith(f"attnctl: error: cannot read tokenizer file {tmp_path}: it is a folder")
    line = one_clean_line(invoke("run", "--file", str(tmp_path), *CPU), 2)
    assert f"cannot read text file {tmp_path}: it is a folder" in line
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    line = one_clean_line(invoke("shapes", "--model", str(plain)), 2)
    assert f"--model needs a folder, and {plain} is not one" in line


@pytest.mark.parametrize("name", ["", " "])
def test_an_empty_config_name_is_refused(invoke, name):
    line = one_clean_line(invoke("run", "hi", "--config", name, *CPU), 2)
    assert f"--config needs a preset name or a TOML path, got {name!r}" in line


# ---------------------------------------------------------------- forced past the estimate


def test_forced_past_what_can_exist_is_still_one_error_line(invoke):
    result = invoke("run", "hi", "--force", "--d-model", str(10**18), "--heads", "1", *CPU)
    line = one_clean_line(result, 1)  # not timed either: it cannot fit
    assert line.startswith("attnctl: error: the layer failed on cpu: ")


def test_sizes_print_in_their_unit_however_large():
    from attnctl.memory.estimate import format_bytes

    assert format_bytes(2**50) == "1.00 PiB" and format_bytes(3 * 2**60) == "3.00 EiB"
    assert format_bytes(10**80) == "8.7e+61 EiB"
    assert resources.duration_text(5 * 86400) == "5 days"
    assert resources.duration_text(1e30) == "over a year"


# ---------------------------------------------------------------- learned positions


def test_the_budget_search_stops_at_the_learned_positions(invoke):
    data = json.loads(invoke("memory", "--pos", "learned", "--budget", "1TiB", "--json").stdout)
    assert data["max_seq_len"] == {"math": 2048, "sdpa": 2048}  # memory is not the limit
    text = invoke("memory", "--pos", "learned", "--budget", "1TiB").stdout
    assert "L stops at the 2,048 learned positions\n" in text
    data = json.loads(invoke("memory", "--pos", "learned", "--budget", "100MiB", "--json").stdout)
    assert data["max_seq_len"]["math"] < 2048


def test_memory_of_a_model_defaults_to_the_length_it_takes(invoke, tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    import tiny_models

    folder = tiny_models.write("gpt2", tmp_path / "gpt2")  # 64 positions
    data = only_length(json.loads(invoke("memory", "--model", str(folder), "--json").stdout))
    assert data["seq_len"] == 64
    line = one_clean_line(invoke("memory", "--model", str(folder), "-L", "65"), 2)
    assert "65 tokens are more than the 64 positions" in line


def test_the_final_line_end_of_a_file_is_no_token(invoke, tmp_path):
    with_end = tmp_path / "a.txt"
    with_end.write_text("Are you OK?\n")
    from_file = json.loads(invoke("run", "--file", str(with_end), "--json", *CPU).stdout)
    from_argv = json.loads(invoke("run", "Are you OK?", "--json", *CPU).stdout)
    assert from_file["tokens"] == from_argv["tokens"]
    inner = tmp_path / "b.txt"
    inner.write_text("Are\nyou\n\n")  # only the last line end goes
    tokens = json.loads(invoke("run", "--file", str(inner), "--json", *CPU).stdout)["tokens"]
    assert [t["text"] for t in tokens[0]].count("\n") == 2


def test_run_refuses_the_zeros_of_a_header_only_checkpoint(invoke, tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    import tiny_models

    folder = tiny_models.write_header_only("gpt2-small", tmp_path / "gpt2")  # block 0: 90 MB
    assert invoke("shapes", "--model", str(folder)).exit_code == 0  # headers are enough here
    line = one_clean_line(invoke("run", "hi", "--model", str(folder), "--tokenizer", "bundled",
                                 *CPU), 2)  # fmt: skip
    assert "is all zeros: a header-only checkpoint?" in line


def test_a_reader_that_leaves_early_ends_the_json_quietly(tmp_path):
    """`attnctl run … --json | head -c 100`: the document is written as it is encoded, and a
    closed pipe stops it with exit 1 and nothing on stderr (no traceback, no internal error)."""
    text = tmp_path / "long.txt"
    text.write_text(" ".join(["the cat eats fish"] * 150), encoding="utf-8")  # ~600 tokens
    process = subprocess.Popen(
        [sys.executable, "-m", "attnctl", "run", "--file", str(text), "--json", "--device", "cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None and process.stderr is not None
    assert process.stdout.read(100).startswith(b'{\n  "schema_version": 1')
    process.stdout.close()  # the document is megabytes: far more than a pipe holds
    error = process.stderr.read()
    assert process.wait(timeout=120) == 1
    assert error == b""
