"""The versioned JSON contract (issue 13.5): docs/schema, schema_version, one shape per command.

Every document the suite prints is checked by the autouse fixture in conftest.py; here: the
schemas themselves, every command and option in a matrix (valid, schema_version first, the
same keys whatever the options), and documents the schemas must refuse.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import subprocess
import sys
from pathlib import Path

import json_contract
import pytest
import tiny_models
import tiny_seq2seq
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from typer.testing import CliRunner

from attnctl.cli import app
from attnctl.model.config import LayerConfig
from attnctl.render.json import RUN_KEYS, SCHEMA_VERSION, schema_file

ROOT = Path(__file__).resolve().parent.parent
SMALL = ("--d-model", "16", "--heads", "2", "--device", "cpu")
# the options of each command that change what its document holds; each kind's documents
# must have the same keys, in the same order
MATRIX = {
    "run": {
        "seeded": ("run", "the cat eats", *SMALL),
        "batch": ("run", "the cat", "a dog sleeps here", *SMALL),
        "context": ("run", "the cat", "--context", "a dog", "--config", "cross-attention",
                    *SMALL),
        "rows and sdpa": ("run", "the cat eats the fish", "--rows", "last:2", "--head", "1",
                          "--impl", "sdpa", *SMALL),
        "model layer": ("run", "the cat", "--model", "{gpt2}", "--layer", "1", "--device", "cpu"),
        "model all": ("run", "the cat", "--model", "{gpt2}", "--layer", "all", "--device", "cpu"),
        "generate": ("run", "the cat", "--model", "{gpt2}", "--generate", "2", "--device", "cpu"),
        "generate all": ("run", "the cat", "--model", "{gpt2}", "--generate", "2", "--layer",
                         "all", "--device", "cpu"),
        "encoder-decoder": ("run", "the cat", "--model", "{bart}", "--generate", "2",
                            "--device", "cpu"),
        "encoder-decoder all": ("run", "the cat", "--model", "{bart}", "--layer", "all",
                                "--device", "cpu"),
    },
    "shapes": {
        "seeded": ("shapes", *SMALL),
        "context": ("shapes", "--context-len", "8", "--batch", "2", *SMALL),
        "head dim": ("shapes", "--head-dim", "4", *SMALL),
        "model": ("shapes", "--model", "{gpt2}"),
        "encoder-decoder": ("shapes", "--model", "{bart}"),
        "encoder-decoder lengths": ("shapes", "--model", "{bart}", "--src-len", "5",
                                    "--tgt-len", "3"),
    },
    "memory": {
        "one length": ("memory", "--seq-len", "16", *SMALL),
        "lengths": ("memory", "--seq-len", "16,32,64", *SMALL),
        "train": ("memory", "--seq-len", "16", "--train", *SMALL),
        "measure": ("memory", "--seq-len", "16", "--measure", *SMALL),
        "train measure": ("memory", "--seq-len", "16", "--train", "--measure", *SMALL),
        "budget": ("memory", "--seq-len", "16", "--budget", "1GiB", *SMALL),
        "lengths budget": ("memory", "--seq-len", "16,32", "--budget", "1GiB", *SMALL),
        "kv cache": ("memory", "--seq-len", "16", "--kv-cache", "0", "--layers", "3", *SMALL),
        "model": ("memory", "--model", "{gpt2}", "--seq-len", "8", "--device", "cpu"),
        "generate": ("memory", "--model", "{gpt2}", "--seq-len", "8", "--generate", "4",
                     "--device", "cpu"),
        "generate measure": ("memory", "--model", "{gpt2}", "--seq-len", "8,12", "--generate",
                             "4", "--measure", "--device", "cpu"),
        "encoder-decoder": ("memory", "--model", "{bart}", "--device", "cpu"),
        "encoder-decoder measure": ("memory", "--model", "{bart}", "--src-len", "6",
                                    "--tgt-len", "4", "--measure", "--device", "cpu"),
    },
    "check": {
        "seeded": ("check", "--seq-len", "4", *SMALL),
        "causal gqa": ("check", "--seq-len", "4", "--mask", "causal", "--kv-heads", "1",
                       *SMALL),
        "softcap": ("check", "--seq-len", "4", "--softcap", "5", *SMALL),
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("schema-models")
    return {
        "gpt2": tiny_models.write("gpt2", root / "gpt2"),
        "bart": tiny_seq2seq.write("bart", root / "bart"),
    }


@pytest.fixture(scope="module")
def documents(folders) -> dict[tuple[str, str], dict]:
    """(command, case) -> the document its --json printed, as JSON gives it back."""
    runner = CliRunner()
    env = {"COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb"}
    found = {}
    for command, cases in MATRIX.items():
        for case, args in cases.items():
            filled = [arg.format(**{k: str(v) for k, v in folders.items()}) for arg in args]
            result = runner.invoke(app, [*filled, "--json"], env=env)
            assert result.exit_code == 0, (case, result.output)
            found[command, case] = json.loads(result.stdout)
    return found


# ---------------------------------------------------------------- the schemas


@pytest.mark.parametrize("command", json_contract.COMMANDS)
def test_each_schema_is_a_valid_draft_2020_12_schema(command):
    schema = json_contract.schema(command)
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] == f"urn:attnctl:schema:{command}:v{SCHEMA_VERSION}"
    assert command in schema["title"] and schema["description"]


def test_the_schema_files_are_what_the_script_writes():
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_schemas

    for command in json_contract.COMMANDS:
        path = ROOT / "docs" / "schema" / f"{command}.schema.json"
        assert path.read_text(encoding="utf-8") == make_schemas.text(command), (
            f"{path.name} is out of date: run python scripts/make_schemas.py"
        )


def test_the_package_finds_each_schema():
    for command in json_contract.COMMANDS:  # a source checkout: docs/schema itself
        assert schema_file(command) == ROOT / "docs" / "schema" / f"{command}.schema.json"
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.schema\.json"):
        schema_file("tokenizer")


def test_the_config_schema_has_every_field_of_the_layer_config():
    fields = [field.name for field in dataclasses.fields(LayerConfig)]
    for command in json_contract.COMMANDS:
        config = json_contract.schema(command)["$defs"]["config"]
        assert list(config["properties"]) == config["required"] == fields
        assert config["additionalProperties"] is False


def test_the_run_schema_lists_the_keys_the_code_writes():
    layer = json_contract.schema("run")["$defs"]["layer"]
    assert layer["required"] == ["schema_version", "command", "kind", *RUN_KEYS]


# ---------------------------------------------------------------- every option


@pytest.mark.parametrize(
    ("command", "case"), [(c, case) for c, cases in MATRIX.items() for case in cases]
)
def test_every_option_gives_a_valid_document_with_its_version_first(documents, command, case):
    document = documents[command, case]
    json_contract.check(document, command)
    assert list(document)[:3] == ["schema_version", "command", "kind"]
    assert document["schema_version"] == SCHEMA_VERSION == 1
    assert document["command"] == command


@pytest.mark.parametrize("command", list(MATRIX))
def test_one_shape_per_command_and_kind_whatever_the_options(documents, command):
    """The keys (and their order) of every document of one command and kind are the same;
    memory's entries per length and stages too."""
    by_kind: dict[str, dict[str, list[str]]] = {}
    for (name, case), document in documents.items():
        if name == command:
            by_kind.setdefault(document["kind"], {})[case] = list(document)
    expected_kinds = {"layer"} if command == "check" else {"layer", "encoder-decoder"}
    assert set(by_kind) == expected_kinds
    for kind, keys in by_kind.items():
        first = next(iter(keys.values()))
        assert all(k == first for k in keys.values()), (kind, keys)
    if command != "memory":
        return
    entries = [
        entry
        for (name, _), document in documents.items()
        if name == "memory" and document["kind"] == "layer"
        for entry in document["results"]
    ]
    assert len({tuple(entry) for entry in entries}) == 1
    stages = [stage for entry in entries for stage in entry["stages"]]
    assert len({tuple(stage) for stage in stages}) == 1


def test_memory_of_one_length_and_of_several_have_one_form(documents):
    one, several = documents["memory", "one length"], documents["memory", "lengths"]
    assert list(one) == list(several)
    assert one["seq_lens"] == [16] and [r["seq_len"] for r in one["results"]] == [16]
    assert several["seq_lens"] == [r["seq_len"] for r in several["results"]] == [16, 32, 64]
    for document in (one, several):
        assert document["budget_bytes"] is document["max_seq_len"] is None
    budget = documents["memory", "lengths budget"]
    assert budget["budget_bytes"] == 2**30 and set(budget["max_seq_len"]) == {"math", "sdpa"}
    trained = documents["memory", "train measure"]["results"][0]
    assert trained["training"]["peak_bytes"] == trained["training_bytes"]
    assert trained["measured_what"] == "training step"
    assert all(s["measured_live_bytes"] is None for s in trained["stages"])  # a forward's
    measured = documents["memory", "measure"]["results"][0]
    assert all(isinstance(s["measured_live_bytes"], int) for s in measured["stages"])
    plain = one["results"][0]
    assert plain["training"] is plain["measured_peak_bytes"] is None
    assert plain["kv_cache_after_generate"] is None
    generated = documents["memory", "generate measure"]["results"]
    assert [g["kv_cache_after_generate"]["tokens"] for g in generated] == [12, 16]


def test_keys_that_do_not_apply_are_null(documents):
    seeded = documents["run", "seeded"]
    assert seeded["model"] is seeded["layer"] is seeded["layers"] is None
    generation = ("prompt_tokens", "generated_ids", "steps", "stop", "kv_cache", "kv_cache_layer")
    assert all(seeded[key] is None for key in generation)
    every = documents["run", "model all"]
    assert every["layer"] is every["attention"] is every["head_stats"] is None
    # --layer all: the stage table is block 0's (the embeddings, then the block), as shapes
    # plans it; block 1's (--layer 1) starts from the hidden states
    block_0 = [s["name"] for s in documents["shapes", "model"]["stages"]]
    assert [s["name"] for s in every["stages"]] == block_0 and block_0[0] == "token_ids"
    assert block_0 != [s["name"] for s in documents["run", "model layer"]["stages"]]
    assert [block["layer"] for block in every["layers"]] == [0, 1, 2]
    assert documents["run", "context"]["context_tokens"] is not None
    generated = documents["run", "generate"]
    assert generated["layers"] is None and len(generated["steps"]) == 2
    translation = documents["run", "encoder-decoder"]
    assert translation["kind"] == "encoder-decoder" and translation["layers"] is None
    assert set(documents["run", "encoder-decoder all"]["layers"]) == {"encoder", "decoder", "cross"}
    assert documents["memory", "encoder-decoder"]["measured"] is None
    assert documents["memory", "encoder-decoder measure"]["measured"]["by"]


# ---------------------------------------------------------------- what the schemas refuse


def broken_copies(documents) -> list[tuple[str, str, dict]]:
    """(why, command, document) for documents each schema must refuse."""
    run = documents["run", "seeded"]
    memory = documents["memory", "lengths"]
    shapes = documents["shapes", "encoder-decoder"]
    check = documents["check", "seeded"]

    def set_first(nested: list, value) -> None:  # the innermost first item of nested lists
        while isinstance(nested[0], list):
            nested = nested[0]
        nested[0] = value

    def changed(document: dict, change) -> dict:
        document = copy.deepcopy(document)
        change(document)
        return document

    return [
        ("a key left out", "run", changed(run, lambda d: d.pop("context_tokens"))),
        ("a key not in the schema", "run", changed(run, lambda d: d.update(extra=1))),
        ("another version", "run", changed(run, lambda d: d.update(schema_version=2))),
        ("no kind", "run", changed(run, lambda d: d.pop("kind"))),
        ("an unknown kind", "run", changed(run, lambda d: d.update(kind="decoder"))),
        ("the wrong command", "run", changed(run, lambda d: d.update(command="shapes"))),
        ("a weight above 1", "run", changed(run, lambda d: set_first(d["attention"], 1.5))),
        ("negative bytes", "run", changed(run, lambda d: d["memory"].update(peak_bytes=-1))),
        ("bytes not whole", "run", changed(run, lambda d: d["memory"].update(peak_bytes=1.5))),
        ("a zero in a shape", "run", changed(run, lambda d: set_first(d["stages"][0]["shape"], 0))),
        ("an unknown impl", "run", changed(run, lambda d: d.update(impl="flash"))),
        ("a config key not in LayerConfig", "run", changed(run, lambda d: d["config"].update(x=1))),
        ("the layer kind's key in an encoder-decoder's", "shapes",
         changed(shapes, lambda d: d.update(seq_len=16))),
        ("one length's keys at the top", "memory",
         changed(memory, lambda d: d.update(peak_bytes=1))),
        ("no results", "memory", changed(memory, lambda d: d.update(results=[]))),
        ("a results entry without training", "memory",
         changed(memory, lambda d: d["results"][0].pop("training"))),
        ("ok as a string", "check", changed(check, lambda d: d.update(ok="yes"))),
    ]  # fmt: skip


def test_each_schema_refuses_a_broken_document(documents):
    for why, command, document in broken_copies(documents):
        assert json_contract.problems(document, command), f"accepted: {why}"
        with pytest.raises(AssertionError, match="breaks its schema"):
            json_contract.check(document, command)


def test_schema_version_must_come_first(documents):
    document = dict(documents["check", "seeded"])
    moved = {**{k: v for k, v in document.items() if k != "schema_version"}, "schema_version": 1}
    assert json_contract.validator("check").is_valid(moved)  # the schema cannot see order
    (problem,) = json_contract.problems(moved, "check")
    assert "schema_version is not the first key" in problem


def test_the_suite_hook_fails_a_test_whose_command_prints_a_broken_document(
    invoke, monkeypatch, _json_follows_its_schema
):
    import attnctl.render.json

    good = attnctl.render.json.check_json
    monkeypatch.setattr(
        attnctl.render.json, "check_json", lambda *args: {**good(*args), "ok": "yes"}
    )
    result = invoke("check", "--seq-len", "4", *SMALL, "--json")
    assert result.exit_code == 1 and result.stdout == ""
    assert "breaks its schema" in result.stderr and "at ok" in result.stderr
    (recorded,) = _json_follows_its_schema
    assert "check: at ok: 'yes' is not of type 'boolean'" in recorded
    _json_follows_its_schema.clear()  # this test expected it: the fixture lets it pass


# ---------------------------------------------------------------- outside the suite


def test_python_m_jsonschema_validates_a_document_from_the_command_line(tmp_path):
    """What docs/json.md tells a reader to run, on attnctl's real stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "attnctl", "shapes", *SMALL, "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    json_contract.loads(done.stdout, "shapes")
    document = tmp_path / "shapes.json"
    document.write_text(done.stdout, encoding="utf-8")
    schema = ROOT / "docs" / "schema" / "shapes.schema.json"
    ok = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-m", "jsonschema", "-i",
         str(document), str(schema)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert ok.returncode == 0 and ok.stdout == "", ok.stdout + ok.stderr
    document.write_text(done.stdout.replace('"batch": 1', '"batch": 0'), encoding="utf-8")
    refused = subprocess.run(
        [sys.executable, "-W", "ignore::DeprecationWarning", "-m", "jsonschema", "-i",
         str(document), str(schema)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 1 and "0 is less than the minimum of 1" in refused.stderr


# ---------------------------------------------------------------- the suite's fast path

REPLACEMENTS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 3),
    st.floats(-0.5, 1.5),
    st.sampled_from(["", "layer", "math", "float32", "cpu", "eos", "forward pass"]),
    st.sampled_from([[], {}, [0.5], [[0.5]], [1, 2], [0], {"x": 1}]),
)


def value_paths(node, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value (lists: their first two items)."""
    found = [prefix]
    if isinstance(node, dict):
        for key, child in node.items():
            found += value_paths(child, (*prefix, key))
    elif isinstance(node, list):
        for index, child in enumerate(node[:2]):
            found += value_paths(child, (*prefix, index))
    return found


@functools.cache
def plain_validator(command: str) -> Draft202012Validator:
    return Draft202012Validator(json_contract.schema(command))


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_the_fast_path_gives_jsonschemas_verdict(documents, data):
    """The suite's compiled checks (json_contract) against jsonschema alone, on documents
    with one value replaced, deleted or added anywhere."""
    command, case = data.draw(st.sampled_from(sorted(documents)))
    document = copy.deepcopy(documents[command, case])
    path = data.draw(st.sampled_from(value_paths(document)[1:]))
    *parents, last = path
    parent = functools.reduce(lambda node, key: node[key], parents, document)
    action = data.draw(st.sampled_from(["replace", "delete", "add"]))
    if action == "replace":
        parent[last] = data.draw(REPLACEMENTS)
    elif action == "delete":
        del parent[last]
    elif isinstance(parent[last], dict):
        parent[last]["extra"] = data.draw(REPLACEMENTS)
    fast = json_contract.validator(command).is_valid(document)
    assert fast == plain_validator(command).is_valid(document), (path, action)
    assert bool(json_contract.problems(document, command)) == (not fast)
