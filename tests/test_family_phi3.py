"""Phi-3: fused qkv_proj and gate_up_proj, a window on every block, against transformers."""

from __future__ import annotations

import pytest
import tiny_models
from family_checks import assert_every_layer_matches, parameters_of, tolerance_of

TEXT = "Are you OK? 猫吃鱼, the cat eats the fish."
SHORT = "cat"  # fewer tokens than the tiny window of 6


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    return tiny_models.write("phi3", tmp_path_factory.mktemp("phi3") / "phi3")


def test_every_layer_equals_transformers_on_a_padded_batch(invoke, phi3):
    assert_every_layer_matches(invoke, phi3, [TEXT, "the dog sleeps", tiny_models.LONG_TEXT],
                               tolerance=tolerance_of("phi3"))  # fmt: skip


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_weights_equal_transformers_in_float32(invoke, tmp_path, dtype):
    folder = tiny_models.write("phi3", tmp_path / dtype, dtype=dtype)
    assert_every_layer_matches(invoke, folder, [TEXT, "the dog sleeps"])


def test_tied_embeddings(invoke, tmp_path):
    folder = tiny_models.write("phi3", tmp_path / "tied", **tiny_models.OPTIONS["phi3"]["tied"])
    assert_every_layer_matches(invoke, folder, [TEXT])


def test_the_window_applies_to_every_block(invoke, tmp_path):
    folder = tiny_models.write("phi3", tmp_path / "w", **tiny_models.OPTIONS["phi3"]["sliding"])
    assert_every_layer_matches(invoke, folder, [SHORT, TEXT, tiny_models.LONG_TEXT])


def test_longrope_takes_the_long_factors_past_the_original_length(invoke, tmp_path):
    """16 original positions: a short text turns by the short factors, a long one by the
    long ones, each times the attention factor, as transformers does."""
    keys = tiny_models.OPTIONS["phi3"]["longrope"]
    folder = tiny_models.write("phi3", tmp_path / "longrope", **keys)
    assert_every_layer_matches(invoke, folder, ["cat"])
    assert_every_layer_matches(invoke, folder, [TEXT, tiny_models.LONG_TEXT])


def test_phi3_mini_has_its_published_parameter_count(invoke, tmp_path):
    folder = tiny_models.write_header_only("phi-3-mini-4k", tmp_path / "mini")
    count = parameters_of(invoke, folder)
    assert count == tiny_models.PUBLISHED_PARAMETERS["phi-3-mini-4k"] == 3_821_079_552
