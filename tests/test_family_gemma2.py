"""Gemma 2: √D embeddings, four (1 + w) RMSNorms a block, head_dim, query_pre_attn_scalar,
soft-capped scores and even blocks that slide, against transformers' eager attention."""

from __future__ import annotations

import pytest
import tiny_models
import torch
from family_checks import assert_every_layer_matches, parameters_of, refused

from attnctl.memory.estimate import estimate
from attnctl.memory.measure import measure_forward
from attnctl.model.families import read_model
from attnctl.nn.layer import Recorder
from attnctl.nn.model import forward
from attnctl.nn.weights import model_weights
from attnctl.stages.plan import build_plan

SHORT = ["cat", "dog"]  # within the tiny window of 6: sliding blocks attend fully
LONG = "Are you OK? 猫吃鱼, the cat eats the fish."


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    return tiny_models.write("gemma2", tmp_path_factory.mktemp("gemma2") / "gemma2")


def test_every_layer_equals_transformers_on_a_padded_batch(invoke, gemma2):
    assert_every_layer_matches(invoke, gemma2, [*SHORT, "a"])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_weights_equal_transformers_in_float32(invoke, tmp_path, dtype):
    folder = tiny_models.write("gemma2", tmp_path / dtype, dtype=dtype)
    assert_every_layer_matches(invoke, folder, SHORT)


@pytest.mark.parametrize("variant", ["untied", "no_softcap", "pattern"])
def test_variants_equal_transformers(invoke, tmp_path, variant):
    keys = tiny_models.OPTIONS["gemma2"][variant]
    folder = tiny_models.write("gemma2", tmp_path / variant, **keys)
    assert_every_layer_matches(invoke, folder, SHORT)


def test_the_soft_cap_and_the_query_scale_matter(invoke, tmp_path, gemma2):
    """Without them the weights differ: the tests above would see a missing one."""
    from family_checks import attnctl_layers

    capped = attnctl_layers(invoke, gemma2, ["dog"])
    plain = tiny_models.rewrite_config(
        tiny_models.write("gemma2", tmp_path / "plain"),
        attn_logit_softcapping=None, query_pre_attn_scalar=16,
    )  # fmt: skip
    uncapped = attnctl_layers(invoke, plain, ["dog"])
    difference = torch.tensor(capped["layers"][1]["attention"]) - torch.tensor(
        uncapped["layers"][1]["attention"]
    )
    assert difference.abs().max() > 1e-3


def test_inputs_past_the_window_equal_transformers(invoke, gemma2):
    """The even blocks slide over 6 keys, the odd ones see every earlier key."""
    assert_every_layer_matches(invoke, gemma2, [LONG, tiny_models.LONG_TEXT])


@pytest.mark.parametrize("layer_index", [0, 1])
@pytest.mark.parametrize("impl", ["math", "sdpa"])  # no soft-cap on SDPA
def test_plan_equals_the_recorded_stages_and_the_measured_bytes(
    tmp_path, gemma2, layer_index, impl
):
    folder = gemma2
    if impl == "sdpa":
        keys = tiny_models.OPTIONS["gemma2"]["no_softcap"]
        folder = tiny_models.write("gemma2", tmp_path / "sdpa", **keys)
    model = read_model(folder)
    config = model.layer_config(device="cpu", impl=impl)
    weights = model_weights(model, config, torch.device("cpu"), blocks=layer_index + 1)
    record = Recorder()
    ids = torch.randint(0, model.vocab_size, (2, 9))
    with torch.inference_mode():
        forward(model.with_run(config), weights.named, ids, last=layer_index, record=record,
                recorded=layer_index)  # fmt: skip
    plan = build_plan(config, 9, 2, model.vocab_size, "cpu", model=model, layer_index=layer_index)
    assert [s.to_dict() for s in record.stages] == [s.to_dict() for s in plan.stages]
    names = {s.name for s in plan.stages}
    assert {"scaled_embeddings", "post_norm", "ffn_post_norm"} <= names
    assert ("softcap" in names) == (impl == "math")
    if layer_index == 0:
        measured = measure_forward(plan)
        assert list(measured.stage_peak_bytes) == list(estimate(plan).live_bytes)
        assert measured.peak_bytes == estimate(plan).peak_bytes


def test_gemma_2_2b_has_its_published_parameter_count(invoke, tmp_path):
    folder = tiny_models.write_header_only("gemma-2-2b", tmp_path / "g", dtype="bfloat16")
    assert parameters_of(invoke, folder) == 2_614_341_888


def test_refused_keys(invoke, tmp_path):
    folder = tiny_models.write("gemma2", tmp_path / "b", use_bidirectional_attention=True)
    assert "use_bidirectional_attention" in refused(invoke, folder, "shapes")
    tiny_models.rewrite_config(folder, use_bidirectional_attention=False, sliding_window=None)
    assert "config.json: sliding_window is null" in refused(invoke, folder, "shapes")
