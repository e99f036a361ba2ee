"""Gemma 3 (text): q/k RMSNorm (1 + w) per head, a RoPE per kind of block, every
pattern-th block global, against transformers' eager attention."""

from __future__ import annotations

import json

import pytest
import tiny_models
import torch
from family_checks import assert_every_layer_matches, attnctl_layers, parameters_of, refused
from json_contract import only_length

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
def gemma3(tmp_path_factory):
    return tiny_models.write("gemma3", tmp_path_factory.mktemp("gemma3") / "gemma3")


def test_every_layer_equals_transformers_on_a_padded_batch(invoke, gemma3):
    assert_every_layer_matches(invoke, gemma3, [*SHORT, "a"])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_weights_equal_transformers_in_float32(invoke, tmp_path, dtype):
    folder = tiny_models.write("gemma3", tmp_path / dtype, dtype=dtype)
    assert_every_layer_matches(invoke, folder, SHORT)


@pytest.mark.parametrize("variant", ["untied", "plain_rope"])
def test_variants_equal_transformers(invoke, tmp_path, variant):
    keys = tiny_models.OPTIONS["gemma3"][variant]
    folder = tiny_models.write("gemma3", tmp_path / variant, **keys)
    assert_every_layer_matches(invoke, folder, SHORT)


def test_each_kind_of_block_has_its_own_rope(gemma3):
    model = read_model(gemma3)
    sliding, _, full = (block.attention for block in model.blocks)
    assert (sliding.window, full.window) == (tiny_models.SHORT_WINDOW, 0)
    assert (sliding.config.rope_theta, sliding.config.rope_type) == (10.0, "default")
    assert (full.config.rope_theta, full.config.rope_type, full.config.rope_factor) == (
        1000.0, "linear", 4.0,
    )  # fmt: skip


def test_the_old_config_form_reads_the_same(invoke, tmp_path, gemma3):
    """rope_theta / rope_local_base_freq / sliding_window_pattern, as Gemma 3 shipped."""
    old = tiny_models.write("gemma3", tmp_path / "old")
    tiny_models.rewrite_config(
        old, remove=("layer_types", "_sliding_window_pattern", "rope_parameters"),
        rope_theta=1000.0, rope_local_base_freq=10.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
    )  # fmt: skip
    ours, theirs = attnctl_layers(invoke, old, ["dog"]), attnctl_layers(invoke, gemma3, ["dog"])
    for mine, expected in zip(ours["layers"], theirs["layers"], strict=True):
        assert torch.tensor(mine["attention"]).equal(torch.tensor(expected["attention"]))


def test_inputs_past_the_window_equal_transformers(invoke, gemma3):
    """Blocks 0 and 1 slide over 6 keys with the local RoPE, block 2 is global."""
    assert_every_layer_matches(invoke, gemma3, [LONG, tiny_models.LONG_TEXT])


@pytest.mark.parametrize("layer_index", [0, 2])
@pytest.mark.parametrize("impl", ["math", "sdpa"])
def test_plan_equals_the_recorded_stages_and_the_measured_bytes(gemma3, layer_index, impl):
    model = read_model(gemma3)
    config = model.layer_config(device="cpu", impl=impl)
    weights = model_weights(model, config, torch.device("cpu"), blocks=layer_index + 1)
    record = Recorder()
    ids = torch.randint(0, model.vocab_size, (2, 9))
    with torch.inference_mode():
        forward(model.with_run(config), weights.named, ids, last=layer_index, record=record,
                recorded=layer_index)  # fmt: skip
    plan = build_plan(config, 9, 2, model.vocab_size, "cpu", model=model, layer_index=layer_index)
    assert [s.to_dict() for s in record.stages] == [s.to_dict() for s in plan.stages]
    assert {"q_norm", "k_norm", "post_norm", "ffn_post_norm"} <= {s.name for s in plan.stages}
    if layer_index == 0:  # memory measures block 0: every block holds the same bytes
        measured = measure_forward(plan)
        assert list(measured.stage_peak_bytes) == list(estimate(plan).live_bytes)
        assert measured.kv_cache_bytes == estimate_kv(plan)


def estimate_kv(plan) -> int:
    from attnctl.memory.estimate import kv_cache_bytes

    return kv_cache_bytes(plan)


def test_gemma_3_1b_at_32k_keeps_the_window_in_its_sliding_blocks(invoke, tmp_path):
    """22 blocks keep 512 positions, the 4 global ones (5, 11, 17, 23) all 32,768."""
    folder = tiny_models.write_header_only("gemma-3-1b", tmp_path / "g", dtype="bfloat16")
    data = only_length(
        json.loads(invoke("memory", "--model", str(folder), "--seq-len", "32768", "--json").stdout)
    )
    assert data["parameters"] == 999_885_952 == parameters_of(invoke, folder)
    per_position = 2 * 1 * 256 * 2  # K and V, one KV head of 256, bfloat16
    assert [(g["window"], g["layers"], g["tokens"], g["bytes"]) for g in data["kv_cache"]] == [
        (512, 22, 512, 22 * 512 * per_position),
        (None, 4, 32768, 4 * 32768 * per_position),
    ]
    assert data["kv_cache_bytes"] == 145_752_064  # not 872,415,232 as if every block were full
    text = invoke("memory", "--model", str(folder), "--seq-len", "32768").stdout
    assert "window 512" in text and "full attention" in text


def test_refused_keys(invoke, tmp_path):
    folder = tiny_models.write("gemma3", tmp_path / "cap")
    tiny_models.rewrite_config(folder, attn_logit_softcapping=50.0)
    assert "config.json: attn_logit_softcapping " in refused(invoke, folder, "shapes")
    tiny_models.rewrite_config(
        folder, attn_logit_softcapping=None, use_bidirectional_attention=True
    )
    assert "config.json: use_bidirectional_attention " in refused(invoke, folder, "shapes")
