"""RoPE scaling (yarn, dynamic, longrope, and linear and llama3 unchanged) in the built-in
layer, against transformers' ROPE_INIT_FUNCTIONS, in plan, trace, memory and ``check``."""

from __future__ import annotations

import json

import pytest
import torch

import attnctl.nn.attention
import attnctl.nn.positions
from attnctl.model.config import build_config
from attnctl.nn.check import run_check
from attnctl.nn.layer import AttentionLayer
from tests.test_attention_math import SDPA_REFERENCE, assert_plan_matches_in_dtype

# ---------------------------------------------------------------- RoPE scaling

ROPE_CASES = {  # LayerConfig keys; lengths on both sides of the original 16
    "yarn": dict(rope_type="yarn", rope_factor=4.0, rope_original_max_positions=16),
    "yarn mscale, no truncate": dict(
        rope_type="yarn", rope_factor=8.0, rope_original_max_positions=16, rope_mscale=0.7,
        rope_mscale_all_dim=0.3, rope_beta_fast=16.0, rope_beta_slow=2.0, rope_truncate=False,
        rope_theta=50000.0,
    ),
    "yarn attention factor": dict(
        rope_type="yarn", rope_factor=2.0, rope_original_max_positions=16,
        rope_attention_factor=1.3,
    ),
    "dynamic": dict(rope_type="dynamic", rope_factor=3.0, rope_original_max_positions=16),
    "longrope": dict(
        rope_type="longrope", rope_factor=4.0, rope_original_max_positions=16,
        rope_short_factor=(1.0, 1.1, 1.3, 1.7, 2.0, 2.2, 2.9, 3.0),
        rope_long_factor=(1.5, 2.0, 3.5, 6.0, 7.0, 9.0, 12.0, 15.5),
    ),
    "linear": dict(rope_type="linear", rope_factor=4.0),
    "llama3": dict(
        rope_type="llama3", rope_factor=8.0, rope_original_max_positions=64,
        rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
    ),
}  # fmt: skip
ROPE_SMALL = dict(d_model=64, heads=4, pos="rope", mask="causal", device="cpu")  # d_k 16


def transformers_rope(config, seq_len: int, float64: bool = False):
    """transformers' ROPE_INIT_FUNCTIONS for this layer's RoPE: (inv_freq, attention scaling)."""
    import copy
    import warnings
    from unittest import mock

    import transformers
    from transformers import modeling_rope_utils
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tests.test_rope import _Float64Torch

    parameters = {"rope_type": config.rope_type, "rope_theta": config.rope_theta}
    if config.rope_type != "default":
        parameters["factor"] = config.rope_factor
    if config.rope_type in ("llama3", "yarn", "longrope"):
        parameters["original_max_position_embeddings"] = config.rope_original_max_positions
    if config.rope_type == "llama3":
        parameters["low_freq_factor"] = config.rope_low_freq_factor
        parameters["high_freq_factor"] = config.rope_high_freq_factor
    if config.rope_type == "yarn":
        parameters.update(
            beta_fast=config.rope_beta_fast, beta_slow=config.rope_beta_slow,
            truncate=config.rope_truncate,
        )  # fmt: skip
        for key in ("mscale", "mscale_all_dim"):
            if getattr(config, f"rope_{key}"):
                parameters[key] = getattr(config, f"rope_{key}")
    if config.rope_type in ("yarn", "longrope") and config.rope_attention_factor:
        parameters["attention_factor"] = config.rope_attention_factor
    if config.rope_type == "longrope":
        parameters["short_factor"] = list(config.rope_short_factor)
        parameters["long_factor"] = list(config.rope_long_factor)
    sizes = {"hidden_size": config.d_model, "num_attention_heads": config.heads}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.Qwen3Config(
            **sizes, head_dim=config.d_k, rope_parameters=copy.deepcopy(parameters),
            max_position_embeddings=config.rope_original_max_positions,
        )  # fmt: skip
    function = ROPE_INIT_FUNCTIONS[config.rope_type]
    if float64:
        with mock.patch.object(modeling_rope_utils, "torch", _Float64Torch()):
            inv_freq, scaling = function(hf, None, seq_len=seq_len)
    else:
        inv_freq, scaling = function(hf, None, seq_len=seq_len)
    return inv_freq, float(scaling)


@pytest.mark.parametrize("case", ROPE_CASES)
@pytest.mark.parametrize("seq_len", [5, 16, 40])
def test_the_layer_rope_equals_transformers(case, seq_len):
    """The layer's angles and cos/sin scaling, and check's own reference, against
    transformers' init functions (float32 as the layer; float64 for the reference)."""
    from attnctl.model.rope import attention_scaling
    from attnctl.nn.check import reference_frequencies, reference_rope_scaling
    from attnctl.nn.positions import rotary_angles

    config = build_config(**ROPE_SMALL, **ROPE_CASES[case])
    inv_freq, scaling = transformers_rope(config, seq_len)
    angles = rotary_angles(seq_len, config.d_k, config=config).double()  # (L, d_k)
    expected = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq.double())
    assert (angles[:, : config.d_k // 2] - expected).abs().max() <= 1e-6 * max(seq_len, 1)
    assert torch.equal(angles[:, : config.d_k // 2], angles[:, config.d_k // 2 :])
    assert attention_scaling(config.rope) == pytest.approx(scaling, rel=1e-9)
    inv_freq64, scaling64 = transformers_rope(config, seq_len, float64=True)
    reference = reference_frequencies(config, seq_len)
    # transformers' longrope takes its exponents .float(): float32 even when patched
    relative = 1e-6 if config.rope_type == "longrope" else 1e-12
    assert ((reference - inv_freq64).abs() <= relative * inv_freq64.abs()).all()
    assert reference_rope_scaling(config) == pytest.approx(scaling64, rel=1e-12)


@pytest.mark.parametrize("case", ["linear", "llama3"])
def test_linear_and_llama3_angles_are_unchanged(case):
    """The float32 code they had before (θ_i in float32, then scaled one by one)."""
    from attnctl.nn.positions import rotary_angles, scaled_frequency

    config = build_config(**ROPE_SMALL, **ROPE_CASES[case])
    inv_freq = torch.pow(config.rope_theta, torch.arange(0, 16, 2, dtype=torch.float32).div_(-16))
    inv_freq = torch.tensor([scaled_frequency(f, config) for f in inv_freq.tolist()])
    angles = torch.outer(torch.arange(30, dtype=torch.float32), inv_freq)
    assert torch.equal(rotary_angles(30, 16, config=config), torch.cat((angles, angles), -1))


@pytest.mark.parametrize("case", ["yarn mscale, no truncate", "dynamic", "longrope"])
@pytest.mark.parametrize("impl,dtype", [("math", "float32"), ("sdpa", "float32"),
                                        ("math", "float16")])  # fmt: skip
def test_rope_scaling_plan_equals_trace_and_measurement(case, impl, dtype):
    config = build_config(**ROPE_SMALL, **ROPE_CASES[case], impl=impl, dtype=dtype, kv_heads=2)
    plan = assert_plan_matches_in_dtype(config, seq_len=20)  # past the original 16
    assert f"{config.rope_type} scaling" in plan.stage("rope_angles").what
    if case != "dynamic":
        assert "(attention scaling)" in plan.stage("rope_cos").what


def rope_preset(tmp_path, case: str) -> str:
    lines = [f"{k} = {json.dumps(v)}" for k, v in {**ROPE_SMALL, **ROPE_CASES[case]}.items()]
    path = tmp_path / "rope.toml"
    path.write_text("\n".join(lines).replace("(", "[").replace(")", "]") + "\n")
    return str(path)


@pytest.mark.parametrize("case", ["yarn", "dynamic", "longrope"])
def test_rope_scaling_in_check_and_its_breaks(case, tmp_path, invoke, monkeypatch):
    preset = rope_preset(tmp_path, case)
    for seq_len in ("6", "20"):  # below and past the original length
        data = json.loads(invoke("check", "-c", preset, "--seq-len", seq_len, "--json").stdout)
        assert data["ok"] and data["skipped"] == []
        assert {c["b"] for c in data["comparisons"]} == {"sdpa", SDPA_REFERENCE}
    config = build_config(**ROPE_SMALL, **ROPE_CASES[case])
    assert run_check(config, 2, 20, 30).ok
    import attnctl.model.rope

    unscaled = lambda rope, head_dim, seq_len: [  # noqa: E731
        1 / rope.theta ** (2 * i / head_dim) for i in range(head_dim // 2)
    ]
    monkeypatch.setattr(attnctl.model.rope, "inverse_frequencies", unscaled)
    result = run_check(config, 2, 20, 30)
    wrong = {c.a for c in result.comparisons if c.b == SDPA_REFERENCE and not c.ok}
    assert wrong == {"math", "sdpa"}


def test_a_layer_without_the_attention_scaling_is_caught(monkeypatch):
    config = build_config(**ROPE_SMALL, **ROPE_CASES["yarn"])
    assert run_check(config, 2, 8, 30).ok
    monkeypatch.setattr(attnctl.nn.attention, "attention_scaling", lambda rope: 1.0)
    result = run_check(config, 2, 8, 30)
    wrong = {c.a for c in result.comparisons if c.b == SDPA_REFERENCE and not c.ok}
    assert wrong == {"math", "sdpa"}


def test_the_rope_reference_is_not_the_layer(monkeypatch):
    import attnctl.model.rope
    import attnctl.nn.check

    def forbidden(*args, **kwargs):
        raise AssertionError("the reference used the layer's own code")

    for case in ("yarn mscale, no truncate", "dynamic", "longrope"):
        config = build_config(**ROPE_SMALL, **ROPE_CASES[case])
        torch.manual_seed(0)
        layer = AttentionLayer(config, 30).eval()
        x = torch.randn(2, 20, 64)
        with monkeypatch.context() as patched:
            for name in ("inverse_frequencies", "attention_scaling", "_yarn", "_mscale"):
                patched.setattr(attnctl.model.rope, name, forbidden)
            for name in ("rotate", "rotary_angles", "scaled_frequency"):
                patched.setattr(attnctl.nn.positions, name, forbidden)
            with torch.no_grad():
                reference = attnctl.nn.check.sdpa_reference_attention(layer, x, x)
        assert reference.output.shape == (2, 20, 64)


@pytest.mark.parametrize(
    "keys,message",
    [({"rope_type": "longrope", "rope_short_factor": [1.0], "rope_long_factor": [1.0]},
      "rope_short_factor must hold one factor per rotated pair: d_k/2 = 8, got 1"),
     ({"rope_type": "yarn", "rope_short_factor": [1.0] * 8},
      "rope_short_factor is read by rope_type longrope only, not yarn"),
     ({"rope_type": "longrope", "rope_short_factor": "1, 2"},
      "rope_short_factor must be a list of numbers"),
     ({"rope_type": "longrope", "rope_short_factor": [1.0] * 7 + [-1.0],
       "rope_long_factor": [1.0] * 8}, "rope_short_factor must hold positive finite numbers"),
     ({"rope_type": "yarn", "rope_beta_fast": -1.0}, "rope_beta_fast must be positive"),
     ({"rope_type": "yarn", "rope_attention_factor": -1.0},
      "rope_attention_factor must be positive (0 = unset)"),
     ({"rope_type": "dynamic", "d_model": 8}, "rope_type dynamic needs d_k >= 4"),
     ({"rope_type": "ntk"}, "rope_type must be one of default, linear, llama3, dynamic, yarn")],
)  # fmt: skip
def test_rope_scaling_misuse_exits_2(tmp_path, invoke, keys, message):
    values = {**ROPE_SMALL, **keys}
    path = tmp_path / "bad.toml"
    path.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in values.items()) + "\n")
    result = invoke("shapes", "-c", str(path))
    assert result.exit_code == 2 and message in result.stderr and result.stdout == ""


def test_the_rope_flags_equal_the_preset_keys(invoke, tmp_path):
    """--rope-theta, --rope-type, --rope-factor and --rope-length set what a preset does."""
    preset = tmp_path / "yarn.toml"
    preset.write_text('pos = "rope"\nrope_theta = 500.0\nrope_type = "yarn"\n'
                      "rope_factor = 4.0\nrope_original_max_positions = 16\n")  # fmt: skip
    flags = ["--pos", "rope", "--rope-theta", "500", "--rope-type", "yarn", "--rope-factor",
             "4", "--rope-length", "16"]  # fmt: skip
    common = ["run", "Are you OK? The cat eats the fish.", "--d-model", "32", "--heads", "4",
              "--device", "cpu", "--json"]  # fmt: skip
    by_flags = json.loads(invoke(*common, *flags).stdout)
    by_preset = json.loads(invoke(*common, "--config", str(preset)).stdout)
    assert by_flags["config"] == by_preset["config"]
    assert by_flags["config"]["rope_type"] == "yarn"
    assert by_flags["attention"] == by_preset["attention"]
    plain = json.loads(invoke(*common, "--pos", "rope", "--rope-theta", "500").stdout)
    assert plain["attention"] != by_flags["attention"]  # the scaling changes the weights
