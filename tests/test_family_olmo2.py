"""OLMo 2: norms on the sublayers' outputs only, q/k RMSNorm across all heads before the
split, against transformers' eager attention."""

from __future__ import annotations

import pytest
import tiny_models
from family_checks import assert_every_layer_matches, parameters_of, refused

TEXT = "Are you OK? 猫吃鱼, the cat eats the fish."


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    return tiny_models.write("olmo2", tmp_path_factory.mktemp("olmo2") / "olmo2")


def test_every_layer_equals_transformers_on_a_padded_batch(invoke, olmo2):
    assert_every_layer_matches(invoke, olmo2, [TEXT, "the dog sleeps", tiny_models.LONG_TEXT])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_weights_equal_transformers_in_float32(invoke, tmp_path, dtype):
    folder = tiny_models.write("olmo2", tmp_path / dtype, dtype=dtype)
    assert_every_layer_matches(invoke, folder, [TEXT, "the dog sleeps"])


def test_tied_embeddings(invoke, tmp_path):
    folder = tiny_models.write("olmo2", tmp_path / "tied", **tiny_models.OPTIONS["olmo2"]["tied"])
    assert_every_layer_matches(invoke, folder, [TEXT])


def test_the_stages_show_no_pre_norm_and_both_output_norms(invoke, olmo2):
    import json

    data = json.loads(invoke("shapes", "--model", str(olmo2), "--json").stdout)
    names = [s["name"] for s in data["stages"]]
    assert "norm" not in names and "ffn_norm" not in names
    assert names.index("q_norm") < names.index("q_heads")  # across all heads, then split
    assert {"post_norm", "ffn_post_norm"} <= set(names)


def test_olmo_2_1b_has_its_published_parameter_count(invoke, tmp_path):
    folder = tiny_models.write_header_only("olmo-2-1b", tmp_path / "o", dtype="float32")
    assert parameters_of(invoke, folder) == 1_484_916_736


def test_yarn_equals_transformers(invoke, tmp_path):
    rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1000.0,
            "original_max_position_embeddings": 16}  # fmt: skip
    folder = tiny_models.write("olmo2", tmp_path / "yarn", rope_parameters=rope)
    assert_every_layer_matches(invoke, folder, [TEXT, tiny_models.LONG_TEXT])


def test_partial_rotation_is_refused(invoke, tmp_path):
    """transformers' OLMo 2 cannot rotate part of a head under scaling (its default RoPE
    never reads the factor)."""
    folder = tiny_models.write("olmo2", tmp_path / "p")
    rope = {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}
    tiny_models.rewrite_config(folder, rope_parameters=rope)
    assert "partial_rotary_factor" in refused(invoke, folder, "shapes")


def test_the_summary_says_where_the_norms_are(invoke, olmo2):
    text = invoke("shapes", "--model", str(olmo2), "--device", "cpu").stdout
    assert "norms after each sublayer" in " ".join(text.split())
