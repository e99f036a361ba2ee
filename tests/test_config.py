from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnctl.errors import AttnctlError
from attnctl.model.config import (
    LayerConfig,
    build_config,
    divisors,
    load_preset,
    preset_names,
    validate,
)

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_are_the_transformer_base_preset():
    assert build_config() == build_config("transformer-base") == validate(LayerConfig())
    assert build_config().kv_heads == 8  # 0 in a preset means "as many as heads"
    assert (LayerConfig().d_model, LayerConfig().heads) == (512, 8)


def test_presets_exist_and_load():
    assert {"cat-eats-fish", "are-you-ok", "transformer-base"} <= set(preset_names())
    fish = build_config("cat-eats-fish")
    assert (fish.d_model, fish.heads, fish.pos, fish.norm, fish.tokenizer, fish.seed) == (
        8, 2, "none", "none", "char", 42,
    )  # fmt: skip
    ok = build_config(str(ROOT / "configs" / "are-you-ok.toml"))
    assert (ok.d_model, ok.heads, ok.norm, ok.pos) == (64, 8, "post", "sinusoidal")


def test_command_line_overrides_the_file():
    config = build_config("cat-eats-fish", heads=4, pos="sinusoidal")
    assert (config.d_model, config.heads, config.pos, config.tokenizer) == (
        8,
        4,
        "sinusoidal",
        "char",
    )


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("colour = 3\n", "unknown key 'colour'"),
        ("heads = 'eight'\n", "heads must be int"),
        ("heads = true\n", "heads must be int"),
        ("bias = 1\n", "bias must be bool"),
        ("pos = 'spiral'\n", "pos must be one of sinusoidal, learned, rope, alibi, none"),
        ("heads = [\n", "malformed config"),
        ("d_model = 10\nheads = 4\n", "head counts that work: 1, 2, 5, 10"),
        ("norm_eps = 0\n", "norm_eps must be positive"),
        ("rope_theta = 1\n", "rope_theta must be above 1"),
        ("rope_type = 'ntk'\n", "rope_type must be one of default, linear, llama3"),
        ("rope_factor = -2\n", "rope_factor (--rope-factor) must be positive, got -2"),
        (
            "rope_original_max_positions = 0\n",
            "rope_original_max_positions (--rope-length) must be a positive integer, got 0",
        ),
        (
            'rope_type = "yarn"\n',
            "rope_type yarn scales RoPE, and pos is sinusoidal: add --pos rope",
        ),
        ("rope_factor = 4.0\n", "rope_factor 4 scales nothing without a rope_type"),
        ("rope_low_freq_factor = 4.0\n", "0 < rope_low_freq_factor < rope_high_freq_factor"),
        ("output_bias = 0\n", "output_bias must be bool"),
    ],
)
def test_bad_files_are_named_errors(tmp_path, text, fragment):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(AttnctlError) as caught:
        build_config(str(path))
    assert fragment in caught.value.message
    assert caught.value.exit_code == 2


def test_missing_preset_and_file():
    with pytest.raises(AttnctlError, match="unknown preset 'nope'; presets: are-you-ok"):
        load_preset("nope")
    with pytest.raises(AttnctlError, match=r"config file not found: missing\.toml"):
        load_preset("missing.toml")


@given(d_model=st.integers(-4, 2048), heads=st.integers(-4, 600))
def test_validation_accepts_exactly_the_buildable_layers(d_model, heads):
    buildable = d_model > 0 and heads > 0 and d_model % heads == 0
    try:
        config = build_config(d_model=d_model, heads=heads)
    except AttnctlError as error:
        assert not buildable
        assert error.exit_code == 2
        if d_model > 0 and heads > 0:
            listed = error.message.rsplit(": ", 1)[1].split(", ")
            assert [int(h) for h in listed] == divisors(d_model)
            assert f"heads={heads}" in error.message
    else:
        assert buildable
        assert config.d_k * config.heads == d_model


@given(device=st.text(max_size=12))
def test_device_names_are_checked_without_torch(device):
    valid = device in ("auto", "cpu", "mps", "cuda") or (
        device.startswith("cuda:") and device[5:].isdigit() and device[5:].isascii()
    )
    try:
        build_config(device=device)
    except AttnctlError as error:
        assert not valid and "unknown device" in error.message
    else:
        assert valid


def test_installed_wheel_carries_the_presets_tokenizer_and_schemas(tmp_path):
    wheel_dir = tmp_path / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheel_dir), str(ROOT)],
        check=True, capture_output=True,
    )  # fmt: skip
    import zipfile

    (wheel,) = wheel_dir.glob("attnctl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "attnctl/configs/cat-eats-fish.toml" in names
    assert "attnctl/data/tokenizer.json" in names
    # run --html reads its script and style sheet from the package
    for asset in ("report.js", "report.css"):
        assert f"attnctl/render/html_assets/{asset}" in names
    for command in ("run", "shapes", "memory", "check"):  # docs/schema, byte for byte
        inside = zipfile.ZipFile(wheel).read(f"attnctl/schema/{command}.schema.json")
        assert inside == (ROOT / "docs" / "schema" / f"{command}.schema.json").read_bytes()


def test_decoder_and_modern_decoder_presets():
    decoder = build_config("decoder")
    assert (decoder.mask, decoder.d_model, decoder.heads, decoder.norm) == ("causal", 64, 8, "post")
    modern = build_config("modern-decoder")
    assert (modern.kv_heads, modern.pos, modern.norm, modern.norm_type, modern.bias) == (
        2, "rope", "pre", "rms", False,
    )  # fmt: skip
    assert modern.mask == "causal"
