"""Qwen3: heads of their own width (head_dim), q/k RMSNorm per head before RoPE, Qwen's
sliding-window keys, against transformers' eager attention."""

from __future__ import annotations

import json

import pytest
import tiny_models
from family_checks import assert_every_layer_matches, parameters_of, refused
from json_contract import only_length

TEXT = "Are you OK? 猫吃鱼, the cat eats the fish."


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return tiny_models.write("qwen3", tmp_path_factory.mktemp("qwen3") / "qwen3")


def test_every_layer_equals_transformers_on_a_padded_batch(invoke, qwen3):
    assert_every_layer_matches(invoke, qwen3, [TEXT, "the dog sleeps", tiny_models.LONG_TEXT])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_weights_equal_transformers_in_float32(invoke, tmp_path, dtype):
    folder = tiny_models.write("qwen3", tmp_path / dtype, dtype=dtype)
    assert_every_layer_matches(invoke, folder, [TEXT, "the dog sleeps"])


@pytest.mark.parametrize("variant", ["untied", "bias"])
def test_variants_equal_transformers(invoke, tmp_path, variant):
    folder = tiny_models.write("qwen3", tmp_path / variant, **tiny_models.OPTIONS["qwen3"][variant])
    assert_every_layer_matches(invoke, folder, [TEXT])


def test_sliding_blocks_from_max_window_layers(invoke, tmp_path):
    keys = tiny_models.OPTIONS["qwen3"]["sliding"]  # block 0 full, blocks 1 and 2 slide
    folder = tiny_models.write("qwen3", tmp_path / "sliding", **keys)
    assert_every_layer_matches(invoke, folder, ["cat", TEXT, tiny_models.LONG_TEXT])
    memory = only_length(
        json.loads(invoke("memory", "--model", str(folder), "--seq-len", "40", "--json").stdout)
    )
    assert [(g["window"], g["layers"], g["tokens"]) for g in memory["kv_cache"]] == [
        (None, 1, 40),
        (tiny_models.SHORT_WINDOW, 2, tiny_models.SHORT_WINDOW),
    ]


def test_qwen3_0_6b_has_its_published_count_and_its_own_head_dim(invoke, tmp_path):
    """head_dim 128, not hidden/heads = 64: the KV cache is twice what D/H would give."""
    folder = tiny_models.write_header_only("qwen3-0.6b", tmp_path / "q", dtype="bfloat16")
    assert parameters_of(invoke, folder) == 596_049_920
    memory = only_length(
        json.loads(invoke("memory", "--model", str(folder), "--seq-len", "1000", "--json").stdout)
    )
    assert memory["kv_cache_bytes"] == 2 * 28 * 8 * 128 * 2 * 1000  # 114,688 B a token


def test_dynamic_rope_equals_transformers(invoke, tmp_path):
    """Past max_position_embeddings (16) the base grows with the length."""
    folder = tiny_models.write("qwen3", tmp_path / "q", max_position_embeddings=16,
                               rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                "rope_theta": 1000.0})  # fmt: skip
    assert_every_layer_matches(invoke, folder, [TEXT, tiny_models.LONG_TEXT])


def test_refused_keys(invoke, tmp_path):
    keys = tiny_models.OPTIONS["qwen3"]["sliding"]
    sliding = tiny_models.write("qwen3", tmp_path / "s", is_causal=False, **keys)
    assert "config.json: is_causal " in refused(invoke, sliding, "shapes")


def test_is_causal_false_is_honoured(invoke, tmp_path):
    folder = tiny_models.write("qwen3", tmp_path / "bidirectional", is_causal=False)
    assert_every_layer_matches(invoke, folder, [TEXT, "the dog sleeps"])
