"""Every config.json key that changes what a checkpoint's blocks compute: honoured (equal to
transformers' eager attention on a tiny checkpoint written by transformers with that key
set) or refused with one line naming the key; and bad checkpoint files, one line, fast.

docs/model-config-keys.md lists the keys per family; each row has a case here."""

from __future__ import annotations

import json
import math
import shutil
import struct
import time
from pathlib import Path

import pytest
import tiny_models
import torch
import transformers

from attnctl.model.families import read_model

CPU = ("--device", "cpu")
TEXT = "Are you OK? 猫吃鱼, the cat eats the fish."
SHORT = "the"  # fewer tokens than the tests' windows of 8
TOLERANCE = 1e-5


def _eager(directory: Path, text: str):
    """transformers' own reading of the folder: (config, per-layer eager attention weights)."""
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json")
    )
    ids = tokenizer([text], return_tensors="pt")["input_ids"]
    model = transformers.AutoModel.from_pretrained(directory, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True)
    return model, out.attentions


def _ours(invoke, directory: Path, text: str, layer: str = "all") -> list[torch.Tensor]:
    result = invoke("run", text, "--model", str(directory), "--layer", layer, "--rows", "all",
                    *CPU, "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    if layer != "all":
        return [torch.tensor(data["attention"])]
    return [torch.tensor(block["attention"]) for block in data["layers"]]


def _patch(directory: Path, **changes) -> Path:
    """Set keys in config.json as a file would hold them (None: delete the key)."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return directory


def _assert_equal_to_transformers(invoke, directory: Path, text: str = TEXT) -> None:
    _, attentions = _eager(directory, text)
    ours = _ours(invoke, directory, text)
    assert len(ours) == len(attentions)
    for n, (mine, theirs) in enumerate(zip(ours, attentions, strict=True)):
        assert mine.shape == theirs.shape
        assert (mine - theirs).abs().max() <= TOLERANCE, f"layer {n}"


# ---------------------------------------------------------------- honoured keys

# (family, keys given to transformers when it builds and saves the tiny model)
HONOURED = {
    "bert is_decoder": ("bert", {"is_decoder": True}),
    "bert layer_norm_eps": ("bert", {"layer_norm_eps": 0.5}),
    "bert hidden_act": ("bert", {"hidden_act": "relu"}),
    "bert type_vocab_size": ("bert", {"type_vocab_size": 5}),
    "bert chunk_size_feed_forward": ("bert", {"chunk_size_feed_forward": 1}),
    "bert dropouts": ("bert", {"hidden_dropout_prob": 0.7, "attention_probs_dropout_prob": 0.7}),
    "gpt2 n_inner": ("gpt2", {"n_inner": 40}),
    "gpt2 activation_function": ("gpt2", {"activation_function": "relu"}),
    "gpt2 layer_norm_epsilon": ("gpt2", {"layer_norm_epsilon": 0.5}),
    "gpt2 reorder_and_upcast_attn": ("gpt2", {"reorder_and_upcast_attn": True}),
    "gpt2 dropouts": ("gpt2", {"attn_pdrop": 0.7, "resid_pdrop": 0.7, "embd_pdrop": 0.7}),
    "llama attention_bias": ("llama", {"attention_bias": True}),
    "llama mlp_bias": ("llama", {"mlp_bias": True}),
    "llama rms_norm_eps": ("llama", {"rms_norm_eps": 0.5}),
    "llama hidden_act": ("llama", {"hidden_act": "gelu"}),
    "llama swish": ("llama", {"hidden_act": "swish"}),
    "llama head_dim": ("llama", {"head_dim": 8}),
    "llama head_dim of its own": ("llama", {"head_dim": 4}),  # not hidden / heads
    "phi3 head_dim of its own": ("phi3", {"head_dim": 12}),
    "llama num_key_value_heads": ("llama", {"num_key_value_heads": 1}),
    "llama pretraining_tp": ("llama", {"pretraining_tp": 2}),
    "llama attention_dropout": ("llama", {"attention_dropout": 0.7}),
    "llama tie_word_embeddings": ("llama", {"tie_word_embeddings": True}),
    "llama rope_theta": ("llama", {"rope_parameters": {"rope_type": "default",
                                                       "rope_theta": 50.0}}),
    "llama yarn": ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                 "rope_theta": 500.0,
                                                 "original_max_position_embeddings": 16}}),
    "llama dynamic": ("llama", {"max_position_embeddings": 16, "rope_parameters": {
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0}}),  # the text is longer
    "qwen2 longrope": ("qwen2", {"max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 500.0, "short_factor": [1.0, 1.5, 2.0, 3.0],
        "long_factor": [1.0, 2.5, 6.0, 12.0], "original_max_position_embeddings": 16}}),
    "mistral sliding_window null": ("mistral", {"sliding_window": None}),
    "mistral rms_norm_eps": ("mistral", {"rms_norm_eps": 0.5}),
    "qwen2 rms_norm_eps": ("qwen2", {"rms_norm_eps": 0.5}),
    # transformers' mask functions read is_causal for every decoder: false sees every key
    "gpt2 is_causal false": ("gpt2", {"is_causal": False}),
    "llama is_causal false": ("llama", {"is_causal": False}),
    "qwen2 is_causal false": ("qwen2", {"is_causal": False}),
    "qwen2 window past every block": (
        "qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3},
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", HONOURED)
def test_honoured_keys_equal_transformers_eager_attention(invoke, tmp_path, case):
    family, keys = HONOURED[case]
    directory = tiny_models.write(family, tmp_path / family, **keys)
    _assert_equal_to_transformers(invoke, directory)


def test_default_keys_change_the_weights_here(invoke, tmp_path):
    """The honoured values are far enough from the defaults that ignoring them would show."""
    plain = {f: tiny_models.write(f, tmp_path / f) for f in ("bert", "llama")}
    causal = tiny_models.write("bert", tmp_path / "causal", is_decoder=True)
    eps = tiny_models.write("llama", tmp_path / "eps", rms_norm_eps=0.5)
    for changed, base in ((causal, plain["bert"]), (eps, plain["llama"])):
        _, theirs = _eager(changed, TEXT)
        mine = _ours(invoke, base, TEXT)
        assert (mine[2] - theirs[2]).abs().max() > 1e-2


def test_keys_transformers_does_not_read_for_the_family_change_nothing(invoke, tmp_path):
    """Mistral and Qwen2 fix their biases in code: attention_bias and mlp_bias are unread."""
    for family in ("mistral", "qwen2"):
        directory = tiny_models.write(family, tmp_path / family)
        _patch(directory, attention_bias=True, mlp_bias=True, pretraining_tp=4)
        assert read_model(directory).blocks[0].sublayers[1].bias is False
        _assert_equal_to_transformers(invoke, directory)
    mistral = _patch(tmp_path / "mistral", layer_types=["sliding_attention"] * 3)
    _assert_equal_to_transformers(invoke, mistral)  # transformers' Mistral reads no layer_types


def test_rope_scaling_wins_over_rope_parameters_as_in_transformers(invoke, tmp_path):
    """With both keys, transformers reads rope_scaling whole (and the top-level rope_theta)."""
    directory = tiny_models.write("llama", tmp_path / "both")
    _patch(
        directory,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        rope_theta=300.0,
    )
    model, _ = _eager(directory, TEXT)
    assert model.config.rope_parameters["rope_type"] == "linear"
    assert model.config.rope_parameters["rope_theta"] == 300.0
    _assert_equal_to_transformers(invoke, directory)
    only_parameters = _patch(directory, rope_scaling=None, rope_theta=None)
    _, other = _eager(only_parameters, TEXT)
    _patch(directory, rope_scaling={"rope_type": "linear", "factor": 4.0}, rope_theta=300.0)
    assert (_ours(invoke, directory, TEXT)[2] - other[2]).abs().max() > 1e-3


@pytest.mark.parametrize(
    "keys",
    [
        {"rope_scaling": {"type": "linear", "factor": 2.0}},  # the old name of rope_type
        # a top-level original_max_position_embeddings wins over the dict's
        {"original_max_position_embeddings": 16,
         "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 32}},
        # without one, max_position_embeddings stands in
        {"max_position_embeddings": 16,
         "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0,
                             "partial_rotary_factor": 0.5}},  # unread by the default RoPE
    ],
)  # fmt: skip
def test_rope_keys_as_transformers_reads_them(invoke, tmp_path, keys):
    directory = _patch(tiny_models.write("llama", tmp_path / "llama"), **keys)
    _assert_equal_to_transformers(invoke, directory)


# ---------------------------------------------------------------- sliding windows


@pytest.mark.parametrize(
    ("family", "keys"),
    [
        ("mistral", {"sliding_window": 8}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3}),
        ("qwen2", {"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 0}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8,
                   "layer_types": ["full_attention", "sliding_attention", "full_attention"]}),
    ],
)  # fmt: skip
def test_each_blocks_window_is_transformers(invoke, tmp_path, family, keys):
    """Per block, as transformers builds the model, past the window too."""
    directory = _patch(tiny_models.write(family, tmp_path / family), **keys)
    model, attentions = _eager(directory, TEXT)
    window = model.config.sliding_window or 0  # what transformers' masks read
    if family == "qwen2":
        kinds = model.config.layer_types
        assert [layer.self_attn.sliding_window or 0 for layer in model.layers] == [
            window if kind == "sliding_attention" else 0 for kind in kinds
        ]
        windows = tuple(window if kind == "sliding_attention" else 0 for kind in kinds)
    else:  # Mistral's mask has the window in every block
        windows = (window,) * len(model.layers)
    spec = read_model(directory)
    assert spec.layer_windows == windows
    long = attentions[0].shape[-1]
    assert long > 8
    for n in range(3):  # every block, sliding ones past their window too
        (ours,) = _ours(invoke, directory, TEXT, str(n))
        assert (ours - attentions[n]).abs().max() <= TOLERANCE
        if windows[n]:  # nothing before the window: exactly 0
            rows = torch.arange(long)[:, None]
            keys = torch.arange(long)[None, :]
            assert ours[0][:, (keys <= rows - windows[n]).expand(long, long)].abs().max() == 0
    _, short = _eager(directory, SHORT)  # within the window every block is exact
    for n, ours in enumerate(_ours(invoke, directory, SHORT)):
        assert (ours - short[n]).abs().max() <= TOLERANCE


def test_a_missing_sliding_window_is_transformers_default(tmp_path):
    directory = _patch(tiny_models.write("mistral", tmp_path / "m"), sliding_window=None)
    assert "sliding_window" not in json.loads((directory / "config.json").read_text())
    config = transformers.AutoConfig.from_pretrained(directory)
    assert read_model(directory).layer_windows == (config.sliding_window,) * 3 == (4096,) * 3


def test_shapes_and_memory_answer_past_the_window(invoke, tmp_path):
    """The window masks scores; no shape or byte changes: the default length of 16 works."""
    directory = tiny_models.write("mistral", tmp_path / "m", sliding_window=8)
    for args in (["shapes"], ["memory"], ["memory", "-L", "40"], ["shapes", "-L", "40"]):
        result = invoke(*args, "--model", str(directory), *CPU)
        assert result.exit_code == 0, result.output


# ---------------------------------------------------------------- refused keys

REFUSED = {
    "bert position_embedding_type": (
        "bert", {"position_embedding_type": "relative_key"}, "position_embedding_type"),
    "bert add_cross_attention": (
        "bert", {"add_cross_attention": True, "is_decoder": True}, "add_cross_attention"),
    "gpt2 add_cross_attention": ("gpt2", {"add_cross_attention": True}, "add_cross_attention"),
    "gpt2 scale_attn_weights": ("gpt2", {"scale_attn_weights": False}, "scale_attn_weights"),
    "gpt2 scale_attn_by_inverse_layer_idx": (
        "gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    "llama partial_rotary_factor": (
        "llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                      "partial_rotary_factor": 0.5}},
        "rope_parameters.partial_rotary_factor"),
    "llama nested rope": (
        "llama", {"rope_parameters": {"full_attention": {"rope_type": "default"}}},
        "rope_parameters.full_attention"),
    "llama hidden_act": ("llama", {"hidden_act": "quick_gelu"}, "hidden_act"),
    "qwen2 sliding layers without a window": (
        "qwen2", {"use_sliding_window": False,
                  "layer_types": ["sliding_attention", "full_attention", "full_attention"]},
        "layer_types"),
    "mistral is_causal false with a window": ("mistral", {"is_causal": False}, "is_causal"),
    "qwen2 layer_types length": (
        "qwen2", {"use_sliding_window": True, "layer_types": ["full_attention"]}, "layer_types"),
}  # fmt: skip


def _one_line_exit_2(result, started: float) -> str:
    assert time.perf_counter() - started < 5
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnctl: error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("case", REFUSED)
def test_refused_keys_exit_2_naming_the_key(invoke, tmp_path, case):
    family, keys, named = REFUSED[case]
    directory = _patch(tiny_models.write(family, tmp_path / family), **keys)
    for command in (["run", "hi"], ["shapes"]):
        started = time.perf_counter()
        line = _one_line_exit_2(invoke(*command, "--model", str(directory), *CPU), started)
        assert f"config.json: {named} " in line


def test_upcast_scores_are_refused_in_half_precision(invoke, tmp_path):
    directory = tiny_models.write("gpt2", tmp_path / "g", reorder_and_upcast_attn=True)
    started = time.perf_counter()
    result = invoke("run", "hi", "--model", str(directory), "--dtype", "bfloat16", *CPU)
    assert "reorder_and_upcast_attn" in _one_line_exit_2(result, started)
    half = tmp_path / "half"  # stored in float16: refused, unless the run is in float32
    transformers.AutoModel.from_pretrained(directory).half().save_pretrained(half)
    shutil.copy(directory / "tokenizer.json", half)
    started = time.perf_counter()
    result = invoke("run", "hi", "--model", str(half), *CPU)
    assert "add --dtype float32" in _one_line_exit_2(result, started)
    result = invoke("run", "hi", "--model", str(half), "--dtype", "float32", *CPU)
    assert result.exit_code == 0, result.output


# ---------------------------------------------------------------- bad files: one line, fast


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pristine")
    return {f: tiny_models.write(f, root / f) for f in ("gpt2", "llama")}


def _copy(folders, family: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folders[family], tmp_path / family))


BAD_CONFIG_VALUES = {
    "model_type a list": ("gpt2", {"model_type": ["gpt2"]}, "model_type ['gpt2']"),
    "model_type a number": ("gpt2", {"model_type": 2}, "model_type 2"),
    "a billion layers": ("gpt2", {"n_layer": 10**9}, "n_layer is 1000000000 but the weights"),
    "a million layers": ("llama", {"num_hidden_layers": 10**6}, "num_hidden_layers is 1000000"),
    "a huge vocabulary": ("llama", {"vocab_size": 10**12}, "embed_tokens.weight has shape"),
    "a huge width": ("gpt2", {"n_embd": 10**18, "n_head": 7}, "wte.weight has shape"),
    "rope_scaling a string": ("llama", {"rope_scaling": "linear"}, "rope_scaling must be an"),
    "rope_parameters a list": ("llama", {"rope_parameters": [1]}, "rope_parameters must be"),
    "rope factor a string": (
        "llama", {"rope_parameters": {"rope_type": "linear", "factor": "4"}},
        "rope_parameters.factor must be a finite number"),
    "rope factor NaN": (
        "llama", {"rope_parameters": {"rope_type": "linear", "factor": math.nan}},
        "rope_parameters.factor must be a finite number"),
    "rope_type a list": (
        "llama", {"rope_parameters": {"rope_type": ["linear"]}}, "rope_parameters.rope_type"),
    # read when no rope_parameters holds a rope_theta of its own (transformers' order)
    "rope_theta negative": ("llama", {"rope_theta": -1.0, "rope_parameters": None},
                            "rope_theta must be a finite number"),
    "rope_theta a boolean": ("llama", {"rope_theta": True, "rope_parameters": None},
                             "rope_theta must be a finite number"),
    "rope_theta 1": (
        "llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1}},
        "rope_parameters.rope_theta must be a finite number above 1"),
    "llama3 original a float": (
        "llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1,
                                      "high_freq_factor": 4, "original_max_position_embeddings":
                                      16.5}}, "original_max_position_embeddings must be an"),
    "llama3 low above high": (
        "llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4,
                                      "high_freq_factor": 1}},
        "high_freq_factor must be above low_freq_factor"),
    "heads a boolean": ("llama", {"num_attention_heads": True}, "num_attention_heads must be an"),
    "width a float": ("llama", {"hidden_size": 32.0}, "hidden_size must be an integer"),
    "layers zero": ("gpt2", {"n_layer": 0}, "n_layer must be an integer >= 1"),
    "n_inner zero": ("gpt2", {"n_inner": 0}, "n_inner must be an integer >= 1"),
    "eps zero": ("llama", {"rms_norm_eps": 0}, "rms_norm_eps must be a finite number above 0"),
    "eps infinite": ("gpt2", {"layer_norm_epsilon": math.inf}, "layer_norm_epsilon must be"),
    "eps a string": ("gpt2", {"layer_norm_epsilon": "1e-5"}, "layer_norm_epsilon must be"),
    "a boolean as a string": ("gpt2", {"scale_attn_weights": "yes"}, "scale_attn_weights must"),
    "activation a list": ("gpt2", {"activation_function": ["relu"]}, "activation_function must"),
    "kv heads negative": ("llama", {"num_key_value_heads": -2}, "num_key_value_heads must be"),
    "window negative": ("llama", {"model_type": "mistral", "sliding_window": -1},
                        "sliding_window must be an integer >= 1"),
    "max_window_layers negative": (
        "llama", {"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": -1},
        "max_window_layers must be an integer >= 0"),
    "layer_types a string": ("llama", {"model_type": "qwen2", "layer_types": "full_attention"},
                             "layer_types must be a list"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_CONFIG_VALUES)
def test_bad_config_values_exit_2_fast(invoke, folders, tmp_path, case):
    family, keys, message = BAD_CONFIG_VALUES[case]
    directory = _patch(_copy(folders, family, tmp_path), **keys)
    for command in (["run", "hi"], ["shapes"], ["memory"]):
        started = time.perf_counter()
        line = _one_line_exit_2(invoke(*command, "--model", str(directory), *CPU), started)
        assert message in line


def _header_file(path: Path, header, data: bytes = b"", length: int | None = None) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def _tensor(**changes):
    return {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24], **changes}


BAD_HEADERS = {
    "not an object": (["wte.weight"], bytes(24), None, "the header is not a JSON object"),
    "an entry not an object": ({"wte.weight": [1, 2]}, bytes(24), None, "not an object"),
    "dtype a number": ({"wte.weight": _tensor(dtype=4)}, bytes(24), None, "has dtype 4"),
    "unknown dtype": ({"wte.weight": _tensor(dtype="Q4")}, bytes(24), None, "unknown dtype"),
    "negative size": ({"wte.weight": _tensor(shape=[-2, -3])}, bytes(24), None, "has shape"),
    "boolean size": ({"wte.weight": _tensor(shape=[True, 3])}, bytes(24), None, "has shape"),
    "shape a string": ({"wte.weight": _tensor(shape="2,3")}, bytes(24), None, "has shape"),
    "offsets reversed": ({"wte.weight": _tensor(data_offsets=[24, 0])}, bytes(24), None,
                         "data_offsets [24, 0]"),
    "offsets past the end": ({"wte.weight": _tensor(data_offsets=[0, 10**12])}, bytes(24), None,
                             "within its 24 bytes"),
    "offsets of floats": ({"wte.weight": _tensor(data_offsets=[0.0, 24.0])}, bytes(24), None,
                          "data_offsets"),
    "size not the shape's": ({"wte.weight": _tensor(data_offsets=[0, 20])}, bytes(24), None,
                             "has shape (2, 3) of F32 but 20 bytes"),
    "metadata not strings": ({"__metadata__": {"format": 1}, "wte.weight": _tensor()},
                             bytes(24), None, "__metadata__ must map names to strings"),
    "header longer than the file": ({"wte.weight": _tensor()}, bytes(24), 10**6,
                                    "header length 1000000 does not fit"),
    "tensors sharing bytes": ({"wte.weight": _tensor(), "wpe.weight": _tensor()}, bytes(24),
                              None, "tensors 'wpe.weight' and 'wte.weight' overlap"),
}  # fmt: skip


@pytest.mark.parametrize("case", [*BAD_HEADERS, "nested too deeply", "a key twice"])
def test_bad_safetensors_headers_exit_2_fast(invoke, folders, tmp_path, case):
    directory = _copy(folders, "gpt2", tmp_path)
    if case == "nested too deeply":  # JSON no parser can hold: a RecursionError in Python
        raw = b"[" * 100_000 + b"]" * 100_000
        (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
        header, data, length, message = None, b"", None, "nested too deeply"
    elif case == "a key twice":  # json.loads alone would keep the second
        entry = json.dumps(_tensor())
        raw = f'{{"wte.weight": {entry}, "wte.weight": {entry}}}'.encode()
        (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(24))
        message = "the key 'wte.weight' appears twice"
    else:
        header, data, length, message = BAD_HEADERS[case]
        _header_file(directory / "model.safetensors", header, data, length)
    started = time.perf_counter()
    line = _one_line_exit_2(invoke("shapes", "--model", str(directory)), started)
    assert "malformed safetensors file" in line and message in line


@pytest.mark.parametrize(
    ("shard", "message"),
    [
        (5, "must be a file name, got 5"),
        ("../model.safetensors", "is not a file in"),
        ("/etc/passwd", "is not a file in"),
        ("sub/model.safetensors", "is not a file in"),
    ],
)
def test_shard_index_names_only_files_in_the_folder(invoke, folders, tmp_path, shard, message):
    directory = _copy(folders, "llama", tmp_path)
    (directory / "model.safetensors").rename(directory / "shard.safetensors")
    index = {"weight_map": {"embed_tokens.weight": "shard.safetensors", "norm.weight": shard}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    started = time.perf_counter()
    line = _one_line_exit_2(invoke("shapes", "--model", str(directory)), started)
    assert "malformed shard index" in line and message in line
    index["weight_map"]["norm.weight"] = "shard.safetensors"  # the same folder, named well
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    assert invoke("shapes", "--model", str(directory)).exit_code == 0


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_folder_in_place_of_a_file_cannot_be_read(invoke, folders, tmp_path, name):
    directory = _copy(folders, "gpt2", tmp_path)
    (directory / name).unlink()
    (directory / name).mkdir()
    started = time.perf_counter()
    line = _one_line_exit_2(invoke("shapes", "--model", str(directory)), started)
    assert "cannot read" in line and name in line and "malformed" not in line


def test_a_config_nested_too_deeply_is_malformed(invoke, folders, tmp_path):
    directory = _copy(folders, "gpt2", tmp_path)
    (directory / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    started = time.perf_counter()
    line = _one_line_exit_2(invoke("shapes", "--model", str(directory)), started)
    assert "malformed model config" in line and "nested too deeply" in line


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_permission_denied_cannot_be_read(invoke, folders, tmp_path, monkeypatch, name):
    """Tests run as root here, who may read anything: the denial is simulated at open."""
    directory = _copy(folders, "gpt2", tmp_path)
    denied = directory / name
    real_open = Path.open

    def open_(self, *args, **kwargs):
        if self == denied:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_)
    started = time.perf_counter()
    line = _one_line_exit_2(invoke("shapes", "--model", str(directory)), started)
    assert "cannot read" in line and "Permission denied" in line and name in line


@pytest.mark.parametrize("impl", ["math", "sdpa"])
def test_a_causal_bert_plans_what_it_runs(tmp_path, impl):
    """is_decoder adds the causal mask to BERT's post-norm blocks: plan == recorded stages."""
    from attnctl.nn.layer import Recorder
    from attnctl.nn.model import forward
    from attnctl.nn.weights import model_weights
    from attnctl.stages.plan import build_plan

    spec = read_model(tiny_models.write("bert", tmp_path / "b", is_decoder=True))
    config = spec.layer_config(device="cpu", impl=impl)
    assert (config.mask, config.norm) == ("causal", "post")
    weights = model_weights(spec, config, torch.device("cpu"), blocks=2)
    record = Recorder()
    with torch.inference_mode():
        ids = torch.randint(0, spec.vocab_size, (2, 9))
        forward(spec.with_run(config), weights.named, ids, last=1, record=record, recorded=1)
    plan = build_plan(config, 9, 2, spec.vocab_size, "cpu", model=spec, layer_index=1)
    assert [s.to_dict() for s in record.stages] == [s.to_dict() for s in plan.stages]


def test_gpt2_aliases_win_over_the_n_keys_as_in_transformers(invoke, tmp_path):
    """transformers' attribute_map sets n_embd from hidden_size after n_embd: the alias wins."""
    directory = tiny_models.write("gpt2", tmp_path / "g")
    _patch(directory, n_embd=64, hidden_size=32, n_head=8, num_attention_heads=4, n_layer=9,
           num_hidden_layers=3, n_positions=8, max_position_embeddings=64)  # fmt: skip
    model, _ = _eager(directory, TEXT)
    assert (model.config.n_embd, model.config.n_head, model.config.n_layer) == (32, 4, 3)
    _assert_equal_to_transformers(invoke, directory)
