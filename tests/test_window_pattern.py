"""--sliding (window_pattern): which layers of a seeded stack slide (Gemma's sssssf)."""

from __future__ import annotations

import json

import pytest
from json_contract import only_length

SMALL = ("--d-model", "64", "--heads", "4", "--mask", "causal", "--window", "8")


def memory_json(invoke, *args: str) -> dict:
    """memory's document of one length: its entry."""
    result = invoke("memory", *SMALL, *args, "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    return only_length(json.loads(result.stdout))


def test_the_pattern_sets_each_layers_kv_cache(invoke):
    data = memory_json(invoke, "--seq-len", "64", "--layers", "8", "--sliding", "sssf")
    per_position = 2 * 4 * 16 * 4  # K and V, 4 heads of 16, float32
    assert [(g["window"], g["layers"], g["tokens"], g["bytes"]) for g in data["kv_cache"]] == [
        (8, 6, 8, 6 * 8 * per_position),
        (None, 2, 64, 2 * 64 * per_position),
    ]
    every = memory_json(invoke, "--seq-len", "64", "--layers", "8")  # no pattern: all slide
    assert [(g["window"], g["layers"]) for g in every["kv_cache"]] == [(8, 8)]


def test_the_layer_shown_is_the_patterns_first(invoke):
    full = json.loads(invoke("shapes", *SMALL, "--sliding", "fs", "--json").stdout)
    sliding = json.loads(invoke("shapes", *SMALL, "--sliding", "sf", "--json").stdout)
    assert full["config"]["window"] == 0 and sliding["config"]["window"] == 8
    shown = " ".join(invoke("shapes", *SMALL, "--sliding", "sf").stdout.split())
    assert "window 8" in shown
    assert "window 8" not in " ".join(invoke("shapes", *SMALL, "--sliding", "fs").stdout.split())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (("--sliding", "sx"), "window_pattern must be up to 4096 letters s"),
        (("--window", "0", "--sliding", "sf"), "window_pattern says which layers slide"),
    ],
)
def test_bad_patterns_are_one_line(invoke, options, message):
    result = invoke("shapes", *SMALL, *options)
    assert result.exit_code == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr


def test_training_a_mixed_stack_is_refused_and_a_uniform_one_measured(invoke):
    refused = invoke("memory", *SMALL, "--seq-len", "16", "--layers", "4", "--train",
                     "--sliding", "sf", "--device", "cpu")  # fmt: skip
    assert refused.exit_code == 2 and "does not model --sliding sf" in refused.stderr
    data = memory_json(invoke, "--seq-len", "16", "--layers", "2", "--train", "--measure",
                       "--sliding", "s")  # fmt: skip
    assert data["training_bytes"] == data["measured_peak_bytes"]


def test_a_mixed_stack_measures_no_kv_cache_of_one_layer(invoke):
    mixed = memory_json(invoke, "--seq-len", "16", "--layers", "2", "--measure",
                        "--sliding", "sf")  # fmt: skip
    assert mixed["measured_kv_cache_bytes"] is None
    alike = memory_json(invoke, "--seq-len", "16", "--layers", "2", "--measure")
    assert alike["measured_kv_cache_bytes"] == alike["kv_cache_bytes"]
