"""attnctl.model.rope against transformers: config classes, ROPE_INIT_FUNCTIONS, rotary modules."""

from __future__ import annotations

import copy
import math
import random
import subprocess
import sys
import warnings
from unittest import mock

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import modeling_rope_utils
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from attnctl.errors import AttnctlError
from attnctl.model.rope import (
    Rope,
    attention_scaling,
    describe,
    inverse_frequencies,
    rope_from_config,
    rotary_dim,
)

FAMILIES = {  # convention -> (config class, rotary embedding, sizes)
    "llama": (transformers.LlamaConfig, LlamaRotaryEmbedding, "standard"),
    "qwen3": (transformers.Qwen3Config, Qwen3RotaryEmbedding, "standard"),
    "phi3": (transformers.Phi3Config, Phi3RotaryEmbedding, "phi3"),
    "gemma3": (transformers.Gemma3TextConfig, Gemma3RotaryEmbedding, "gemma3"),
}
SIZES = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2}
HEAD_DIM = {"llama": 32, "qwen3": 32, "phi3": 32, "gemma3": 32}
SIZES_OF = {
    "llama": SIZES,
    "qwen3": SIZES | {"head_dim": 32},
    "phi3": SIZES,
    "gemma3": SIZES | {"head_dim": 32, "num_hidden_layers": 6},
}


def _factors(count: int, seed: int) -> list[float]:
    generator = random.Random(seed)
    return [round(generator.uniform(1.0, 6.0), 4) for _ in range(count)]


# (family, config.json's RoPE keys, the lengths to run)
CASES = {
    "default": ("llama", {}, [16]),
    "default theta 5e5": ("llama", {"rope_theta": 500000.0}, [40]),
    "linear": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0}}, [24]),
    "linear legacy type, top-level theta": (
        "qwen3", {"rope_scaling": {"type": "linear", "factor": 2.5}, "rope_theta": 1e6}, [24]),
    "rope_scaling wins whole": (
        "qwen3", {"rope_scaling": {"rope_type": "linear", "factor": 3.0}, "rope_theta": 300.0,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}, [16]),
    "dict theta wins": (
        "qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 77.0},
                  "rope_theta": 5000.0}, [16]),
    "llama3": ("llama", {"max_position_embeddings": 256, "rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 10000.0}}, [32]),
    "llama3 top-level original wins": ("llama", {
        "max_position_embeddings": 256, "original_max_position_embeddings": 128,
        "rope_parameters": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0,
                            "high_freq_factor": 8.0, "original_max_position_embeddings": 64}},
        [32]),
    "llama3 original from max_position_embeddings": ("llama", {
        "max_position_embeddings": 50, "rope_scaling": {
            "rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0,
            "high_freq_factor": 3.0}}, [20]),
    "yarn": ("qwen3", {"max_position_embeddings": 128, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}, [48]),
    "yarn theta 1e6 mscale": ("qwen3", {"max_position_embeddings": 512, "rope_theta": 1e6,
                                         "rope_parameters": {
        "rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32,
        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2}}, [48]),
    "yarn mscale alone is unread": ("qwen3", {"rope_parameters": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
        "mscale": 2.0, "mscale_all_dim": 0}}, [30]),
    "yarn untruncated, attention_factor": ("llama", {"rope_parameters": {
        "rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 40,
        "truncate": False, "attention_factor": 1.25}}, [30]),
    "yarn null factor, beta 0": ("qwen3", {"max_position_embeddings": 96, "rope_parameters": {
        "rope_type": "yarn", "factor": None, "original_max_position_embeddings": 24,
        "beta_fast": 0}}, [30]),
    "yarn top-level original wins": ("qwen3", {
        "max_position_embeddings": 400, "original_max_position_embeddings": 50,
        "rope_scaling": {"type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 100}}, [30]),
    "dynamic": ("llama", {"max_position_embeddings": 32, "rope_parameters": {
        "rope_type": "dynamic", "factor": 2.0}}, [16, 31, 32, 33, 80]),
    "dynamic theta 1e6 factor 4": ("qwen3", {"max_position_embeddings": 20, "rope_theta": 1e6,
                                             "rope_scaling": {"type": "dynamic", "factor": 4.0}},
                                   [20, 64]),
    "longrope in a llama, original from max_position_embeddings": ("llama", {
        "max_position_embeddings": 40, "rope_parameters": {
            "rope_type": "longrope", "factor": 4.0, "short_factor": _factors(16, 13),
            "long_factor": _factors(16, 14)}}, [40, 41]),
    "phi3 longrope": ("phi3", {"max_position_embeddings": 128,
                               "original_max_position_embeddings": 32, "rope_scaling": {
        "type": "longrope", "short_factor": _factors(16, 1), "long_factor": _factors(16, 2)}},
        [16, 32, 33, 70]),
    "phi3 longrope, dict original unread": ("phi3", {
        "max_position_embeddings": 4096 * 4, "rope_parameters": {
            "rope_type": "longrope", "short_factor": _factors(16, 3),
            "long_factor": _factors(16, 4), "original_max_position_embeddings": 24}},
        [30, 4097]),
    "phi3 longrope factor and attention_factor": ("phi3", {
        "max_position_embeddings": 128, "original_max_position_embeddings": 32,
        "rope_scaling": {"rope_type": "longrope", "factor": 2.0, "attention_factor": 1.1,
                         "short_factor": _factors(16, 5), "long_factor": _factors(16, 6)}},
        [20, 40]),
    "phi3 legacy su": ("phi3", {"max_position_embeddings": 64,
                                "original_max_position_embeddings": 16, "rope_scaling": {
        "type": "su", "short_factor": _factors(16, 7), "long_factor": _factors(16, 8),
        "original_max_position_embeddings": 99}}, [10, 20]),
    "phi3 legacy yarn is longrope": ("phi3", {"max_position_embeddings": 64,
                                              "original_max_position_embeddings": 16,
                                              "rope_scaling": {
        "type": "yarn", "short_factor": _factors(16, 9), "long_factor": _factors(16, 10)}},
        [10, 20]),
    "phi3 partial rotary default": ("phi3", {"partial_rotary_factor": 0.75, "rope_theta": 500.0},
                                    [16]),
    "phi3 partial rotary longrope": ("phi3", {
        "max_position_embeddings": 128, "original_max_position_embeddings": 32,
        "partial_rotary_factor": 0.5, "rope_scaling": {
            "type": "longrope", "short_factor": _factors(8, 11), "long_factor": _factors(8, 12)}},
        [20, 40]),
    "phi3 dict partial wins": ("phi3", {"partial_rotary_factor": 0.25, "rope_parameters": {
        "rope_type": "default", "partial_rotary_factor": 0.5}}, [16]),
    "gemma3 defaults": ("gemma3", {}, [16]),
    "gemma3 legacy rope_scaling": ("gemma3", {
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_theta": 1e6,
        "rope_local_base_freq": 1e4}, [24]),
    "gemma3 nested yarn and own theta": ("gemma3", {
        "max_position_embeddings": 256, "rope_theta": 5.0, "rope_parameters": {
            "full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6,
                               "original_max_position_embeddings": 32},
            "sliding_attention": {"rope_type": "default", "rope_theta": 3000.0}}}, [40]),
    "gemma3 nested dynamic, sliding filled in": ("gemma3", {
        "max_position_embeddings": 24, "rope_local_base_freq": 2000.0, "rope_parameters": {
            "full_attention": {"type": "dynamic", "factor": 3.0}}}, [20, 50]),
    "gemma3 nested llama3 beside rope_scaling": ("gemma3", {
        "max_position_embeddings": 256,
        "rope_scaling": {"factor": 4.0},
        "rope_parameters": {"full_attention": {
            "rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0}}}, [30]),
}  # fmt: skip


def _transformers_config(family: str, keys: dict):
    config_class, _, _ = FAMILIES[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = config_class(**SIZES_OF[family], **copy.deepcopy(keys))
        config.standardize_rope_params()  # as every RoPE init function does before computing
    return config


def _layer_types(family: str) -> list[str | None]:
    return ["full_attention", "sliding_attention"] if family == "gemma3" else [None]


def _ours(family: str, keys: dict, layer_type: str | None, max_positions: int) -> Rope:
    return rope_from_config(
        copy.deepcopy(keys),
        "config.json",
        head_dim=HEAD_DIM[family],
        max_positions=max_positions,
        convention=FAMILIES[family][2],
        layer_type=layer_type,
    )


def _transformers_cos_sin(family, config, layer_type, seq_len):
    """A fresh rotary module's cos, sin for positions 0 … L-1, and the inv_freq it used."""
    _, module_class, _ = FAMILIES[family]
    module = module_class(config)
    x = torch.zeros(1, 1, seq_len, HEAD_DIM[family])
    position_ids = torch.arange(seq_len)[None]  # (1, L)
    if layer_type is None:
        cos, sin = module(x, position_ids)
        inv_freq, scaling = module.inv_freq, module.attention_scaling
    else:
        cos, sin = module(x, position_ids, layer_type)
        inv_freq = getattr(module, f"{layer_type}_inv_freq")
        scaling = getattr(module, f"{layer_type}_attention_scaling")
    return cos[0].double(), sin[0].double(), inv_freq.double(), scaling  # (L, r)


def _assert_close(ours: torch.Tensor, theirs: torch.Tensor, tolerance: torch.Tensor | float):
    error = (ours - theirs).abs()
    assert bool((error <= tolerance).all()), f"off by {(error - tolerance).max().item():.3g}"


@pytest.mark.parametrize("case", CASES)
def test_frequencies_scaling_cos_and_sin_equal_transformers(case):
    family, keys, lengths = CASES[case]
    config = _transformers_config(family, keys)
    for layer_type in _layer_types(family):
        rope = _ours(family, keys, layer_type, config.max_position_embeddings)
        for seq_len in lengths:
            cos, sin, inv_freq, scaling = _transformers_cos_sin(family, config, layer_type, seq_len)
            frequencies = torch.tensor(
                inverse_frequencies(rope, HEAD_DIM[family], seq_len), dtype=torch.float64
            )  # (r/2,)
            _assert_close(frequencies, inv_freq, 1e-6 * inv_freq.abs())
            ours_scaling = attention_scaling(rope)
            assert math.isclose(ours_scaling, float(scaling), rel_tol=1e-9)
            angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), frequencies)
            angles = torch.cat((angles, angles), dim=-1)  # (L, r): pairs (i, i + r/2)
            # float32 angles in transformers: 1e-6 of the angle, relative, on top of 1e-6
            tolerance = ours_scaling * (1e-6 * angles.abs() + 1e-6)
            _assert_close(angles.cos() * ours_scaling, cos, tolerance)
            _assert_close(angles.sin() * ours_scaling, sin, tolerance)


@pytest.mark.parametrize("case", CASES)
def test_init_functions_give_our_frequencies(case):
    """transformers' ROPE_INIT_FUNCTIONS at the same seq_len, for the scaled types."""
    family, keys, lengths = CASES[case]
    config = _transformers_config(family, keys)
    for layer_type in _layer_types(family):
        rope = _ours(family, keys, layer_type, config.max_position_embeddings)
        if rope.rope_type == "default":
            continue
        for seq_len in lengths:
            kwargs = {"layer_type": layer_type} if layer_type else {}
            inv_freq, factor = ROPE_INIT_FUNCTIONS[rope.rope_type](
                config, None, seq_len=seq_len, **kwargs
            )
            theirs = inv_freq.double()
            ours = torch.tensor(inverse_frequencies(rope, HEAD_DIM[family], seq_len)).double()
            _assert_close(ours, theirs, 1e-6 * theirs.abs())
            assert math.isclose(attention_scaling(rope), float(factor), rel_tol=1e-9)


@pytest.mark.parametrize("case", CASES)
def test_parsed_fields_equal_the_standardized_config(case):
    family, keys, _ = CASES[case]
    config = _transformers_config(family, keys)
    for layer_type in _layer_types(family):
        rope = _ours(family, keys, layer_type, config.max_position_embeddings)
        theirs = (
            config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
        )
        assert rope.theta == theirs["rope_theta"]
        assert rope.rope_type == theirs["rope_type"]
        if rope.rope_type != "default" or family == "phi3":
            assert rope.partial_rotary_factor == theirs.get("partial_rotary_factor", 1.0)
        if rope.rope_type in ("llama3", "yarn", "longrope"):
            assert rope.original_max_positions == theirs["original_max_position_embeddings"]
        if theirs.get("factor") is not None:
            assert rope.factor == theirs["factor"]
        for name in ("low_freq_factor", "high_freq_factor", "mscale", "mscale_all_dim",
                     "attention_factor", "truncate"):  # fmt: skip
            if theirs.get(name) is not None:
                assert getattr(rope, name) == theirs[name], name
        for name in ("short_factor", "long_factor"):
            if name in theirs:
                assert list(getattr(rope, name)) == theirs[name]


def test_every_type_is_covered():
    seen = set()
    for family, keys, _ in CASES.values():
        config = _transformers_config(family, keys)
        for layer_type in _layer_types(family):
            seen.add(_ours(family, keys, layer_type, config.max_position_embeddings).rope_type)
    assert seen == {"default", "linear", "dynamic", "yarn", "longrope", "llama3"}


def test_length_decides_dynamic_and_longrope_only():
    dynamic = Rope(theta=10000.0, rope_type="dynamic", factor=2.0, max_positions=32)
    default = Rope(theta=10000.0)
    assert inverse_frequencies(dynamic, 16, 32) == inverse_frequencies(default, 16, 32)
    assert inverse_frequencies(dynamic, 16, 33) < inverse_frequencies(default, 16, 33)
    longrope = Rope(rope_type="longrope", factor=4.0, original_max_positions=32,
                    short_factor=(1.0,) * 8, long_factor=(2.0,) * 8)  # fmt: skip
    halved = [f / 2 for f in inverse_frequencies(default, 16, 1)]
    assert inverse_frequencies(longrope, 16, 32) == inverse_frequencies(default, 16, 32)
    assert inverse_frequencies(longrope, 16, 33) == pytest.approx(halved, rel=1e-15)


def test_describe():
    assert describe(Rope(theta=1e6)) == "RoPE θ=1e+06"
    yarn = Rope(theta=1e6, rope_type="yarn", factor=4.0, original_max_positions=32768)
    assert describe(yarn) == "RoPE θ=1e+06, yarn ×4 from 32768"
    dynamic = Rope(rope_type="dynamic", factor=2.0, max_positions=4096)
    assert describe(dynamic) == "RoPE θ=10000, dynamic ×2 beyond 4096"
    assert describe(Rope(partial_rotary_factor=0.75)) == "RoPE θ=10000, 75% of each head"


def test_rope_needs_no_torch():
    code = "import sys, attnctl.model.rope; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- refused keys

LONG = {"max_position_embeddings": 128, "original_max_position_embeddings": 32}
FACTORS = {"short_factor": [1.0] * 16, "long_factor": [1.0] * 16}
REFUSED = {  # (convention, keys, layer_type, the label the line names)
    "theta text": ("standard", {"rope_theta": "big"}, None, "rope_theta"),
    "theta null": ("standard", {"rope_theta": None}, None, "rope_theta"),
    "dict theta 1": ("standard", {"rope_parameters": {"rope_theta": 1}}, None,
                     "rope_parameters.rope_theta"),
    "rope_scaling list": ("standard", {"rope_scaling": [1]}, None, "rope_scaling"),
    "rope_parameters text": ("standard", {"rope_parameters": "x"}, None, "rope_parameters"),
    "unknown type": ("standard", {"rope_scaling": {"rope_type": "ntk", "factor": 2}}, None,
                     "rope_scaling.rope_type"),
    "proportional": ("standard", {"rope_parameters": {"rope_type": "proportional"}}, None,
                     "rope_parameters.rope_type"),
    "legacy type unknown": ("standard", {"rope_scaling": {"type": "su"}}, None,
                            "rope_scaling.type"),
    "type contradicts rope_type": ("standard", {"rope_scaling": {
        "rope_type": "linear", "type": "dynamic", "factor": 2.0}}, None, "rope_scaling.type"),
    "nested in a flat family": ("standard", {"rope_parameters": {
        "full_attention": {"rope_type": "default"}}}, None, "rope_parameters.full_attention"),
    "linear without factor": ("standard", {"rope_parameters": {"rope_type": "linear"}}, None,
                              "rope_parameters.rope_type"),
    "linear factor text": ("standard", {"rope_parameters": {"rope_type": "linear",
                                                            "factor": "x"}}, None,
                           "rope_parameters.factor"),
    "linear factor 0": ("standard", {"rope_parameters": {"rope_type": "linear", "factor": 0}},
                        None, "rope_parameters.factor"),
    "linear factor inf": ("standard", {"rope_scaling": {"rope_type": "linear",
                                                        "factor": math.inf}}, None,
                          "rope_scaling.factor"),
    "dynamic factor null": ("standard", {"rope_scaling": {"rope_type": "dynamic",
                                                          "factor": None}}, None,
                            "rope_scaling.factor"),
    "partial in a full-rotation family": ("standard", {"partial_rotary_factor": 0.5,
                                                       "rope_scaling": {"rope_type": "linear",
                                                                        "factor": 2}}, None,
                                          "partial_rotary_factor"),
    "partial above 1": ("phi3", {"partial_rotary_factor": 1.5}, None, "partial_rotary_factor"),
    "partial null in phi3": ("phi3", {"partial_rotary_factor": None}, None,
                             "partial_rotary_factor"),
    "partial odd dims": ("phi3", {"rope_parameters": {"partial_rotary_factor": 0.3}}, None,
                         "rope_parameters.partial_rotary_factor"),
    "llama3 low text": ("standard", {"rope_parameters": {
        "rope_type": "llama3", "factor": 8, "low_freq_factor": "1", "high_freq_factor": 4}},
        None, "rope_parameters.low_freq_factor"),
    "llama3 high below low": ("standard", {"rope_parameters": {
        "rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1}},
        None, "rope_parameters.high_freq_factor"),
    "llama3 no high": ("standard", {"rope_parameters": {
        "rope_type": "llama3", "factor": 8, "low_freq_factor": 1}}, None,
        "rope_parameters.rope_type"),
    "llama3 original 0": ("standard", {"rope_parameters": {
        "rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
        "original_max_position_embeddings": 0}}, None,
        "rope_parameters.original_max_position_embeddings"),
    "top-level original float": ("standard", {"original_max_position_embeddings": 8.5,
                                              "rope_scaling": {"rope_type": "yarn",
                                                               "factor": 2}}, None,
                                 "original_max_position_embeddings"),
    "yarn no factor": ("standard", {"rope_scaling": {"rope_type": "yarn"}}, None,
                       "rope_scaling.rope_type"),
    "yarn beta_fast negative": ("standard", {"rope_scaling": {"rope_type": "yarn", "factor": 2,
                                                              "beta_fast": -1}}, None,
                                "rope_scaling.beta_fast"),
    "yarn beta_slow text": ("standard", {"rope_scaling": {"rope_type": "yarn", "factor": 2,
                                                          "beta_slow": "1"}}, None,
                            "rope_scaling.beta_slow"),
    "yarn mscale nan": ("standard", {"rope_scaling": {"rope_type": "yarn", "factor": 2,
                                                      "mscale": math.nan}}, None,
                        "rope_scaling.mscale"),
    "yarn mscale_all_dim negative": ("standard", {"rope_scaling": {
        "rope_type": "yarn", "factor": 2, "mscale_all_dim": -1}}, None,
        "rope_scaling.mscale_all_dim"),
    "yarn attention_factor 0": ("standard", {"rope_scaling": {
        "rope_type": "yarn", "factor": 2, "attention_factor": 0}}, None,
        "rope_scaling.attention_factor"),
    "yarn truncate text": ("standard", {"rope_scaling": {
        "rope_type": "yarn", "factor": 2, "truncate": "no"}}, None, "rope_scaling.truncate"),
    "longrope short missing": ("standard", {"rope_scaling": {
        "rope_type": "longrope", "long_factor": [1.0] * 16}}, None, "rope_scaling.rope_type"),
    "longrope short wrong length": ("phi3", LONG | {"rope_scaling": {
        "type": "longrope", "short_factor": [1.0] * 15, "long_factor": [1.0] * 16}}, None,
        "rope_scaling.short_factor"),
    "longrope long not numbers": ("phi3", LONG | {"rope_scaling": {
        "type": "longrope", "short_factor": [1.0] * 16, "long_factor": ["1"] * 16}}, None,
        "rope_scaling.long_factor"),
    "longrope long zero": ("phi3", LONG | {"rope_scaling": {
        "type": "longrope", "short_factor": [1.0] * 16, "long_factor": [0.0] * 16}}, None,
        "rope_scaling.long_factor"),
    "longrope factor negative": ("phi3", LONG | {"rope_scaling": {
        "type": "longrope", "factor": -2, **FACTORS}}, None, "rope_scaling.factor"),
    "longrope original 1": ("phi3", {"original_max_position_embeddings": 1, "rope_scaling": {
        "type": "longrope", **FACTORS}}, None, "original_max_position_embeddings"),
    "phi3 original null": ("phi3", {"original_max_position_embeddings": None, "rope_scaling": {
        "type": "longrope", **FACTORS}}, None, "original_max_position_embeddings"),
    "phi3 su without original": ("phi3", {"rope_scaling": {"type": "su", **FACTORS}}, None,
                                 "rope_scaling.type"),
    "phi3 linear": ("phi3", {"rope_scaling": {"rope_type": "linear", "factor": 2}}, None,
                    "rope_scaling.rope_type"),
    "gemma3 flat key": ("gemma3", {"rope_parameters": {"rope_type": "linear", "factor": 8}},
                        "full_attention", "rope_parameters.rope_type"),
    "gemma3 nested not an object": ("gemma3", {"rope_parameters": {"full_attention": 3}},
                                    "sliding_attention", "rope_parameters.full_attention"),
    "gemma3 rope_scaling without full": ("gemma3", {
        "rope_parameters": {"sliding_attention": {"rope_type": "default"}},
        "rope_scaling": {"rope_type": "linear", "factor": 8}}, "sliding_attention",
        "rope_scaling"),
    "gemma3 legacy type kept default": ("gemma3", {"rope_scaling": {"type": "linear",
                                                                    "factor": 8}},
                                        "full_attention", "rope_scaling.type"),
    "gemma3 local theta null": ("gemma3", {"rope_local_base_freq": None}, "sliding_attention",
                                "rope_local_base_freq"),
    "gemma3 nested truncate false": ("gemma3", {"rope_parameters": {"full_attention": {
        "rope_type": "yarn", "factor": 2, "truncate": False}}}, "full_attention",
        "rope_parameters.full_attention.truncate"),
    "gemma3 nested factor text": ("gemma3", {"rope_parameters": {"sliding_attention": {
        "rope_type": "linear", "factor": "2"}}}, "sliding_attention",
        "rope_parameters.sliding_attention.factor"),
}  # fmt: skip


@pytest.mark.parametrize("case", REFUSED)
def test_bad_keys_give_one_line_naming_the_key(case):
    convention, keys, layer_type, label = REFUSED[case]
    with pytest.raises(AttnctlError) as caught:
        rope_from_config(
            keys, "config.json", head_dim=32, max_positions=128, convention=convention,
            layer_type=layer_type,
        )  # fmt: skip
    message = caught.value.message
    assert "\n" not in message and caught.value.exit_code == 2
    assert message.startswith(f"config.json: {label} "), message


def test_dynamic_with_two_rotated_dims_is_refused():
    keys = {"rope_scaling": {"type": "dynamic", "factor": 2}}
    with pytest.raises(AttnctlError, match="'dynamic' needs at least 4 rotated dims"):
        rope_from_config(keys, "config.json", head_dim=2, max_positions=128)
    assert rope_from_config(keys, "config.json", head_dim=4, max_positions=128).factor == 2


@pytest.mark.parametrize("keys", [
    {"rope_scaling": {"type": "linear", "factor": 8}},
    {"rope_parameters": {"rope_type": "linear", "factor": 8}},
], ids=["legacy type", "flat key"])  # fmt: skip
def test_refused_gemma3_cases_are_the_ones_transformers_fails_or_ignores(keys):
    """The refusals above: transformers never applies their scaling. Which of the two it does
    depends on its version (5.0 raises KeyError on the flat key, 5.17 AttributeError, 5.25
    drops the scaling silently); either way the scaling the keys ask for is not applied."""
    try:
        config = _transformers_config("gemma3", keys)
    except (AttributeError, KeyError, TypeError, ValueError):
        return  # transformers fails on the keys
    assert config.rope_parameters["full_attention"]["rope_type"] == "default"  # it ignores them


# ---------------------------------------------------------------- properties

thetas = st.floats(min_value=2.0, max_value=1e7)
head_dims = st.integers(min_value=2, max_value=128).map(lambda n: 2 * n)
factors = st.floats(min_value=0.1, max_value=64.0)


@settings(max_examples=60, deadline=None)
@given(theta=thetas, head_dim=head_dims, factor=factors)
def test_linear_is_default_divided_by_the_factor(theta, head_dim, factor):
    linear = inverse_frequencies(Rope(theta, "linear", factor), head_dim, 1)
    default = inverse_frequencies(Rope(theta), head_dim, 1)
    assert linear == pytest.approx([f / factor for f in default], rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    theta=thetas,
    head_dim=head_dims,
    factor=factors,
    kind=st.sampled_from(["default", "linear", "dynamic", "yarn", "llama3", "longrope"]),
    original=st.integers(min_value=2, max_value=1 << 20),
    seq_len=st.integers(min_value=1, max_value=1 << 21),
    partial=st.sampled_from([0.25, 0.5, 1.0]),
)
def test_frequencies_are_positive_finite_and_fit_the_rotated_dims(
    theta, head_dim, factor, kind, original, seq_len, partial
):
    dim = int(head_dim * partial)
    if dim < 4 or dim % 2:
        return
    rope = Rope(
        theta, kind, factor, partial, max_positions=original, original_max_positions=original,
        short_factor=(1.5,) * (dim // 2), long_factor=(3.0,) * (dim // 2),
    )  # fmt: skip
    frequencies = inverse_frequencies(rope, head_dim, seq_len)
    assert len(frequencies) == rotary_dim(rope, head_dim) // 2
    assert all(math.isfinite(f) and f > 0 for f in frequencies)
    assert math.isfinite(attention_scaling(rope)) and attention_scaling(rope) > 0


@settings(max_examples=80, deadline=None)
@given(
    theta=st.floats(min_value=2.0, max_value=1e7),
    factor=st.floats(min_value=0.5, max_value=64.0),
    original=st.integers(min_value=2, max_value=1 << 17),
    beta_fast=st.floats(min_value=0.5, max_value=64.0),
    beta_slow=st.floats(min_value=0.1, max_value=8.0),
    truncate=st.booleans(),
    head_dim=st.sampled_from([8, 32, 64, 128]),
)
def test_yarn_equals_transformers_for_any_parameters(
    theta, factor, original, beta_fast, beta_slow, truncate, head_dim
):
    keys = {"rope_theta": theta, "rope_parameters": {
        "rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
        "beta_fast": beta_fast, "beta_slow": beta_slow, "truncate": truncate}}  # fmt: skip
    _assert_init_function_agrees(keys, head_dim)


@settings(max_examples=80, deadline=None)
@given(
    theta=st.floats(min_value=2.0, max_value=1e7),
    factor=st.floats(min_value=1.0, max_value=64.0),
    original=st.integers(min_value=2, max_value=1 << 17),
    low=st.floats(min_value=0.1, max_value=4.0),
    gap=st.floats(min_value=0.1, max_value=8.0),
    head_dim=st.sampled_from([8, 32, 64, 128]),
)
def test_llama3_equals_transformers_for_any_parameters(theta, factor, original, low, gap, head_dim):
    keys = {"rope_theta": theta, "rope_parameters": {
        "rope_type": "llama3", "factor": factor, "original_max_position_embeddings": original,
        "low_freq_factor": low, "high_freq_factor": low + gap}}  # fmt: skip
    _assert_init_function_agrees(keys, head_dim)


@settings(max_examples=80, deadline=None)
@given(
    theta=st.floats(min_value=2.0, max_value=1e7),
    factor=st.floats(min_value=0.5, max_value=64.0),
    seq_len=st.integers(min_value=1, max_value=1 << 18),
    head_dim=st.sampled_from([4, 8, 32, 64, 128]),
)
def test_dynamic_equals_transformers_at_any_length(theta, factor, seq_len, head_dim):
    keys = {"rope_theta": theta, "rope_scaling": {"rope_type": "dynamic", "factor": factor}}
    _assert_init_function_agrees(keys | {"max_position_embeddings": 32768}, head_dim, seq_len)


class _Float64Torch:
    """torch, except that torch.float and torch.float32 are float64: transformers' RoPE code
    computing in float64 throughout."""

    float = float32 = torch.float64

    def __getattr__(self, name: str):
        return getattr(torch, name)


def _assert_init_function_agrees(keys: dict, head_dim: int, seq_len: int = 1) -> None:
    """transformers' init function, run in float64, equals ours to 1e-12 relative.

    (In float32 it differs from exact math by up to ln θ·2^-24 in θ^(2i/r), 1.9e-6 at θ = 1e7;
    llama3's blend and yarn's ramp multiply such errors by up to the factor.)
    """
    sizes = {"hidden_size": 2 * head_dim, "num_attention_heads": 2, "head_dim": head_dim}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers.Qwen3Config(**sizes, **copy.deepcopy(keys))
    rope = rope_from_config(keys, "config.json", head_dim=head_dim, max_positions=32768)
    with mock.patch.object(modeling_rope_utils, "torch", _Float64Torch()):
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope.rope_type](config, None, seq_len=seq_len)
    assert inv_freq.dtype == torch.float64
    ours = torch.tensor(inverse_frequencies(rope, head_dim, seq_len), dtype=torch.float64)
    _assert_close(ours, inv_freq, 1e-12 * inv_freq.abs())
    assert math.isclose(attention_scaling(rope), float(scaling), rel_tol=1e-9)


# ---------------------------------------------------------------- published configs

PUBLISHED = {  # RoPE keys as these checkpoints' config.json hold them (longrope lists made up)
    "Llama-3.1-8B": ("llama", {"hidden_size": 4096, "num_attention_heads": 32,
                               "max_position_embeddings": 131072, "rope_theta": 500000.0,
                               "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 8192,
                                                "rope_type": "llama3"}},
                     None, "RoPE θ=500000, llama3 ×8 from 8192"),
    "Qwen3-8B with YaRN": ("qwen3", {"hidden_size": 4096, "num_attention_heads": 32,
                                     "head_dim": 128, "max_position_embeddings": 40960,
                                     "rope_theta": 1000000,
                                     "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 32768}},
                           None, "RoPE θ=1e+06, yarn ×4 from 32768"),
    "Phi-3-mini-128k": ("phi3", {"hidden_size": 3072, "num_attention_heads": 32,
                                 "max_position_embeddings": 131072,
                                 "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
                                 "rope_scaling": {"type": "longrope",
                                                  "short_factor": _factors(48, 21),
                                                  "long_factor": _factors(48, 22)}},
                        None, "RoPE θ=10000, longrope ×32 from 4096"),
    "Phi-4-mini": ("phi3", {"hidden_size": 3072, "num_attention_heads": 24,
                            "max_position_embeddings": 131072,
                            "original_max_position_embeddings": 4096,
                            "partial_rotary_factor": 0.75, "rope_theta": 10000.0,
                            "rope_scaling": {"type": "longrope",
                                             "short_factor": _factors(48, 23),
                                             "long_factor": _factors(48, 24)}},
                   None, "RoPE θ=10000, longrope ×32 from 4096, 75% of each head"),
    "Gemma-3-4b global": ("gemma3", {"hidden_size": 2560, "num_attention_heads": 8,
                                     "head_dim": 256, "max_position_embeddings": 131072,
                                     "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                                     "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
                          "full_attention", "RoPE θ=1e+06, linear ×8"),
    "Gemma-3-4b local": ("gemma3", {"hidden_size": 2560, "num_attention_heads": 8,
                                    "head_dim": 256, "max_position_embeddings": 131072,
                                    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
                         "sliding_attention", "RoPE θ=10000"),
}  # fmt: skip


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_configs(name):
    family, keys, layer_type, described = PUBLISHED[name]
    config_class, _, convention = FAMILIES[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = config_class(**copy.deepcopy(keys))
    head_dim = (
        getattr(config, "head_dim", None) or keys["hidden_size"] // keys["num_attention_heads"]
    )
    rope = rope_from_config(
        keys, "config.json", head_dim=head_dim, max_positions=keys["max_position_embeddings"],
        convention=convention, layer_type=layer_type,
    )  # fmt: skip
    assert describe(rope) == described
    for seq_len in (4096, 4097):
        if rope.rope_type == "default":
            continue
        kwargs = {"layer_type": layer_type} if layer_type else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope.rope_type](
            config, None, seq_len=seq_len, **kwargs
        )
        ours = torch.tensor(inverse_frequencies(rope, head_dim, seq_len), dtype=torch.float64)
        _assert_close(ours, inv_freq.double(), 1e-6 * inv_freq.double().abs())
        assert math.isclose(attention_scaling(rope), float(scaling), rel_tol=1e-9)
