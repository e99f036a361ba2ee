"""Encoder–decoder plans and memory: what ``shapes`` and ``memory`` predict is what runs.

Every stage of an encoder block and of a decoder block (its self-attention, its
cross-attention over the encoder output, its feed-forward) as nn/model.forward records
it, for the tiny Marian, BART, T5 v1 and T5 v1.1 checkpoints written by transformers;
the bytes alive at each stage, the decoder's KV cache and the cross-attention's K and V
equal to what a run holds, to the byte.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import tiny_models
import tiny_seq2seq
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from json_contract import only_length

from attnctl.memory.estimate import cross_kv_cache_groups, estimate, kv_cache_groups
from attnctl.memory.measure import measure_forward, measure_seq2seq_caches
from attnctl.model.families import read_model
from attnctl.nn.generate import decoder_weights
from attnctl.nn.layer import TORCH_DTYPES, Recorder
from attnctl.nn.model import forward
from attnctl.nn.positions import sinusoidal_halves
from attnctl.nn.weights import model_weights
from attnctl.stages.plan import build_plan, build_seq2seq_plans

FAMILIES = tiny_seq2seq.SEQ2SEQ_FAMILIES
BATCH, SOURCE, TARGET = 2, 7, 5


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("seq2seq_memory")
    return {family: tiny_seq2seq.write(family, root / family) for family in FAMILIES}


def source_padding(batch: int, length: int) -> torch.Tensor:
    """(B, S) True = a real token: the last row half padding, as measure.py pads."""
    padding = torch.ones(batch, length, dtype=torch.bool)
    padding[-1, (length + 1) // 2 :] = False
    return padding


def recorded(model, config, block: int, source: int, target: int, padded: bool):
    """The stages nn/model.forward records in encoder block ``block`` over a source and
    in decoder block ``block`` over a target with cross-attention to the source."""
    run = model.with_run(config)
    weights = model_weights(run, config, torch.device("cpu"), blocks=None).named
    torch.manual_seed(0)
    source_ids = torch.randint(3, model.vocab_size, (BATCH, source))
    target_ids = torch.randint(3, model.vocab_size, (BATCH, target))
    padding = source_padding(BATCH, source) if padded else None
    encoder_output = torch.randn(BATCH, source, model.hidden, dtype=TORCH_DTYPES[config.dtype])
    encoder, decoder = Recorder(), Recorder()
    with torch.inference_mode():
        forward(run, weights, source_ids, last=block, record=encoder, recorded=block,
                padding=padding)  # fmt: skip
        forward(run.decoder, decoder_weights(weights), target_ids, last=block, record=decoder,
                recorded=block, context=encoder_output, context_padding=padding)  # fmt: skip
    return encoder.stages, decoder.stages


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("block", [0, 1])
@pytest.mark.parametrize("padded", [True, False])
def test_plans_equal_the_recorded_stages(folders, family, dtype, block, padded):
    model = read_model(folders[family])
    config = model.layer_config(dtype=dtype, impl="math", device="cpu")
    encoder_stages, decoder_stages = recorded(model, config, block, SOURCE, TARGET, padded)
    encoder_plan, decoder_plan = build_seq2seq_plans(
        model, config, SOURCE, TARGET, BATCH, padded, block, block, device="cpu"
    )
    assert [s.to_dict() for s in encoder_stages] == [s.to_dict() for s in encoder_plan.stages]
    assert [s.to_dict() for s in decoder_stages] == [s.to_dict() for s in decoder_plan.stages]
    assert decoder_plan.sizes["Lc"] == SOURCE and decoder_plan.sizes["L"] == TARGET
    assert decoder_plan.stage("encoder_output").shape == (BATCH, SOURCE, model.hidden)
    cross = decoder_plan.stage("cross_scores")
    assert cross.dims == ("B", "H", "L", "Lc") and cross.shape[2:] == (TARGET, SOURCE)
    assert decoder_plan.stage("cross_k").reads == ("encoder_output",)
    assert decoder_plan.stage("cross_weights").reads == ("cross_scores",)
    names = {s.name for s in decoder_plan.stages}
    assert ("padding_mask" in names) == padded
    if family.startswith("t5"):
        bias = encoder_plan.stage("position_bias")
        assert bias.shape == (model.heads, SOURCE, SOURCE)
        assert decoder_plan.stage("position_bias").shape == (model.heads, TARGET, TARGET)
        if block == 0:  # computed here, with its scratch, and kept for the blocks after
            assert bias.scratch > 0 and encoder_plan.held_until["position_bias"]
        else:  # block 0's, alive from the start
            assert "block 0" in encoder_plan.stage("scores").what
            assert "position_bias" in encoder_plan.given and bias.scratch == 0
    if family == "marian":
        assert encoder_plan.stage("positions").scratch > 0


# T5's relative bias is added to the scores: the math path only (validate refuses sdpa)
KERNELS = [(f, impl) for f in FAMILIES for impl in ("math", "sdpa") if f[:2] != "t5" or impl < "s"]


@pytest.mark.parametrize("family,impl", KERNELS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sizes", [(2, 7, 5), (1, 40, 64)])
def test_estimate_equals_the_measured_bytes(folders, family, dtype, impl, sizes):
    """Encoder block 0 and decoder block 0, each stage's live bytes to the byte."""
    batch, source, target = sizes
    model = read_model(folders[family])
    config = model.layer_config(dtype=dtype, impl=impl, device="cpu")
    plans = build_seq2seq_plans(model, config, source, target, batch, True, device="cpu")
    for plan in plans:
        predicted, measured = estimate(plan), measure_forward(plan)
        assert list(measured.stage_peak_bytes) == list(predicted.live_bytes), plan.stages
        assert measured.peak_activation_bytes == predicted.peak_activation_bytes
        assert measured.parameter_bytes == predicted.parameter_bytes


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    family=st.sampled_from(FAMILIES),
    batch=st.integers(1, 3),
    source=st.integers(1, 64),
    target=st.integers(1, 64),
    padded=st.booleans(),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
)
def test_any_sizes_plan_and_measure_alike(folders, family, batch, source, target, padded, dtype):
    """Any batch, source and target length within the positions, any dtype: each stage's
    live bytes (one per stage recorded) are what a run of the block holds."""
    model = read_model(folders[family])
    config = model.layer_config(dtype=dtype, impl="math", device="cpu")
    plans = build_seq2seq_plans(model, config, source, target, batch, padded, device="cpu")
    for plan in plans:
        predicted, measured = estimate(plan), measure_forward(plan)
        assert list(measured.stage_peak_bytes) == list(predicted.live_bytes)
    assert plans[1].sizes["Lc"] == source


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_caches_equal_what_the_decoder_keeps(folders, family, dtype):
    """Self-attention K, V of T positions and cross-attention K, V of S positions per
    decoder block, as a run keeping them holds them."""
    model = read_model(folders[family])
    config = model.layer_config(dtype=dtype, device="cpu")
    _, decoder_plan = build_seq2seq_plans(model, config, 6, 9, 3, device="cpu")
    self_groups = kv_cache_groups(decoder_plan, 9)
    cross_groups = cross_kv_cache_groups(decoder_plan)
    element = TORCH_DTYPES[dtype].itemsize
    layers = model.decoder.layers
    assert sum(g.bytes for g in self_groups) == layers * 2 * 3 * 9 * model.hidden * element
    assert sum(g.bytes for g in cross_groups) == layers * 2 * 3 * 6 * model.hidden * element
    assert [g.tokens for g in cross_groups] == [6]
    measured_self, measured_cross = measure_seq2seq_caches(decoder_plan)
    assert measured_self == sum(g.bytes for g in self_groups)
    assert measured_cross == sum(g.bytes for g in cross_groups)


def test_a_decoder_block_needs_the_source_length(folders):
    model = read_model(folders["bart"])
    config = model.layer_config(device="cpu")
    with pytest.raises(Exception, match="source's length"):
        build_plan(config, 4, 1, model.vocab_size, model=model.decoder)
    with pytest.raises(Exception, match="more than the 64 positions"):
        build_seq2seq_plans(model, config, 65, 4)
    with pytest.raises(Exception, match="target of 65 tokens"):
        build_seq2seq_plans(model, config, 4, 65)


@pytest.mark.parametrize("positions,width", [(64, 32), (512, 512), (33, 7), (9, 1), (70, 2)])
def test_marian_positions_are_bit_identical_to_transformers(positions, width):
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    table = MarianSinusoidalPositionalEmbedding(positions, width).create_weight()
    ours = sinusoidal_halves(torch.arange(positions), width)
    assert ours.dtype == table.dtype == torch.float32
    assert torch.equal(ours, table)


# ---------------------------------------------------------------- the commands


def memory_json(invoke, *args: str) -> dict:
    result = invoke("memory", *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_runs_memory_is_what_memory_says_for_its_lengths(invoke, folders, family, dtype):
    """run on an encoder–decoder: its ``memory`` equals memory --src-len S --tgt-len T."""
    folder = str(folders[family])
    result = invoke("run", "the cat sat", "--model", folder, "--generate", "3", "--json",
                    "--device", "cpu", "--dtype", dtype)  # fmt: skip
    assert result.exit_code == 0, result.output
    run = json.loads(result.stdout)
    source, target = len(run["source_tokens"][0]), len(run["target_tokens"][0])
    data = memory_json(invoke, "--model", folder, "--src-len", str(source), "--tgt-len",
                       str(target), "--dtype", dtype, "--device", "cpu")  # fmt: skip
    assert run["memory"] == {key: data[key] for key in run["memory"]}
    assert set(run["memory"]) == {
        "parameters", "parameters_bytes", "encoder_peak_activation_bytes",
        "decoder_peak_activation_bytes", "kv_cache_bytes", "cross_kv_cache_bytes", "peak_bytes",
    }  # fmt: skip
    # the run's KV cache at the end: its self-attention's and its cross-attention's
    assert run["kv_cache_bytes"] == data["kv_cache_bytes"] + data["cross_kv_cache_bytes"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_memory_measure_equals_every_part(invoke, folders, family, dtype):
    """Weights, each block's peak and both caches: estimated = measured, to the byte."""
    folder = str(folders[family])
    data = memory_json(invoke, "--model", folder, "--src-len", "9", "--tgt-len", "6",
                       "--batch", "2", "--dtype", dtype, "--measure")  # fmt: skip
    measured = data.pop("measured")
    assert measured.pop("device") == "cpu" and measured.pop("by") == "live tensor storages"
    assert measured == {key: data[key] for key in measured}
    element = TORCH_DTYPES[dtype].itemsize
    layers, hidden = 2, 32  # the fixtures' decoder blocks, D = H·d_k
    assert data["kv_cache_bytes"] == layers * 2 * 2 * 6 * hidden * element
    assert data["cross_kv_cache_bytes"] == layers * 2 * 2 * 9 * hidden * element
    assert [g["tokens"] for g in data["kv_cache"]] == [6]
    assert [g["tokens"] for g in data["cross_kv_cache"]] == [9]
    assert (data["src_len"], data["tgt_len"]) == (9, 6)
    stored = sum(math.prod(shape) for shape in stored_shapes(folders[family]).values())
    assert data["parameters"] == stored
    assert data["parameters_bytes"] == stored * element
    for block in ("encoder", "decoder"):
        stages = data[block]["stages"]
        assert [s["live_bytes"] for s in stages] == [s["measured_live_bytes"] for s in stages]
    assert data["decoder"]["sizes"]["Lc"] == 9 and data["encoder"]["sizes"]["L"] == 9
    assert data["peak_bytes"] == data["parameters_bytes"] + max(
        data["encoder_peak_activation_bytes"],
        data["decoder_peak_activation_bytes"] + data["kv_cache_bytes"]
        + data["cross_kv_cache_bytes"],
    )  # fmt: skip
    half = data["by_dtype"]["float16"]
    assert half["kv_cache_bytes"] * element == data["kv_cache_bytes"] * 2


def test_memory_terminal_names_every_part(invoke, folders):
    result = invoke("memory", "--model", str(folders["t5"]), "--src-len", "5", "--tgt-len",
                    "3", "--measure", columns=160)  # fmt: skip
    assert result.exit_code == 0, result.output
    for words in ("weights", "encoder activations", "decoder activations", "KV cache",
                  "cross K/V", "L = the source, 5 tokens", "Lc = the source, 5 tokens",
                  "cross_scores", "position_bias", "by dtype and implementation"):  # fmt: skip
        assert words in result.stdout, words
    assert "peak (sdpa)" not in result.stdout  # T5: the math path only


def stored_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        names = handle.keys()
        return {key: tuple(handle.get_slice(key).get_shape()) for key in names}


@pytest.mark.parametrize("family", FAMILIES)
def test_shapes_shows_the_encoder_and_the_decoder_block(invoke, folders, family):
    model = read_model(folders[family])
    result = invoke("shapes", "--model", str(folders[family]), "--src-len", "6", "--tgt-len",
                    "4", "--device", "cpu", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    config = model.layer_config(device="cpu")
    encoder, decoder = build_seq2seq_plans(model, config, 6, 4, device=config.device)
    assert data["encoder"]["stages"] == [s.to_dict() for s in encoder.stages]
    assert data["decoder"]["stages"] == [s.to_dict() for s in decoder.stages]
    assert (data["src_len"], data["tgt_len"]) == (6, 4)
    assert (data["model"]["layers"], data["model"]["decoder_layers"]) == (
        model.layers, model.decoder.layers
    )  # fmt: skip
    assert data["decoder"]["sizes"]["Lc"] == 6 and data["decoder"]["sizes"]["L"] == 4
    text = invoke("shapes", "--model", str(folders[family]), "--src-len", "6", "--tgt-len", "4",
                  columns=200).stdout  # fmt: skip
    assert "L = the source, 6 tokens" in text and "Lc = the source, 6 tokens" in text
    assert "cross_weights" in text and "B H L Lc" in text and "(1, 4, 4, 6)" in text


@pytest.mark.parametrize(
    "command,args,message",
    [
        ("memory", ["--seq-len", "8"], "is an encoder–decoder: give --src-len and --tgt-len"),
        ("shapes", ["--seq-len", "8"], "is an encoder–decoder: give --src-len and --tgt-len"),
        ("memory", ["--src-len", "65"], "--src-len 65 is more than the 64 positions MarianMT"),
        ("memory", ["--tgt-len", "65"], "--tgt-len 65 is more than the 64 positions MarianMT"),
        ("shapes", ["--src-len", "65"], "--src-len 65 is more than the 64 positions MarianMT"),
        ("memory", ["--src-len", "0"], "src-len must be a positive integer, got 0"),
        ("memory", ["--train"], "--train does not apply to MarianMT"),
        ("memory", ["--generate", "4"], "--generate does not apply to MarianMT"),
        ("memory", ["--kv-cache", "4"], "--kv-cache does not apply to MarianMT"),
        ("memory", ["--budget", "1GiB"], "--budget does not apply to MarianMT"),
        ("memory", ["--layers", "2"], "--layers does not apply to MarianMT"),
        ("shapes", ["--context-len", "4"], "--context-len is --src-len on an encoder–decoder"),
    ],
)
def test_bad_seq2seq_lengths_are_one_line(invoke, folders, command, args, message):
    result = invoke(command, "--model", str(folders["marian"]), *args)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("command", ["memory", "shapes"])
@pytest.mark.parametrize("option", ["--src-len", "--tgt-len"])
def test_source_and_target_lengths_need_an_encoder_decoder(invoke, causal, command, option):
    for args in ([], ["--model", str(causal["gpt2"])]):
        result = invoke(command, *args, option, "4")
        assert result.exit_code == 2 and result.stdout == ""
        assert f"{option} is an encoder–decoder's" in result.stderr
        assert "takes --seq-len" in result.stderr


# ---------------------------------------------------------------- memory --generate N


@pytest.fixture(scope="module")
def causal(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("causal_memory")
    return {f: tiny_seq2seq.write_causal(f, root / f) for f in ("gpt2", "mistral")}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "family,prompt,new,kept",
    [("gpt2", 6, 5, 11), ("mistral", 40, 20, 48), ("mistral", 3, 1, 4)],  # window 48
)
def test_memory_generate_is_the_cache_after_n_more_tokens(
    invoke, causal, dtype, family, prompt, new, kept
):
    data = memory_json(invoke, "--model", str(causal[family]), "--seq-len", str(prompt),
                       "--generate", str(new), "--dtype", dtype, "--measure")  # fmt: skip
    data = only_length(data)
    after = data["kv_cache_after_generate"]
    model = read_model(causal[family])
    per_position = 2 * model.kv_heads * model.config.d_k * TORCH_DTYPES[dtype].itemsize
    assert after["generate"] == new and after["tokens"] == prompt + new
    assert [g["tokens"] for g in after["kv_cache"]] == [kept]
    assert after["bytes"] == model.layers * kept * per_position
    assert after["measured_bytes"] == after["bytes"]  # really generated
    assert data["kv_cache_tokens"] == prompt  # the prompt's cache, as before


def test_memory_generate_keeps_each_kind_of_block(invoke, tmp_path):
    """Gemma 3: two sliding blocks keep their window of 6, the global one all 9 tokens."""
    folder = tiny_models.write("gemma3", tmp_path / "gemma3")
    data = memory_json(invoke, "--model", str(folder), "--seq-len", "5", "--generate", "4",
                       "--measure")  # fmt: skip
    data = only_length(data)
    after = data["kv_cache_after_generate"]
    assert [(g["window"], g["layers"], g["tokens"]) for g in after["kv_cache"]] == [
        (6, 2, 6),
        (None, 1, 9),
    ]
    assert after["measured_bytes"] == after["bytes"] == sum(g["bytes"] for g in after["kv_cache"])


def test_memory_generate_terminal_and_without_measure(invoke, causal):
    result = invoke("memory", "--model", str(causal["mistral"]), "--seq-len", "40",
                    "--generate", "20", columns=160)  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "KV cache after 20 more" in result.stdout
    assert "40 + 20 generated = 60 tokens" in result.stdout and "window 48" in result.stdout
    data = memory_json(invoke, "--model", str(causal["gpt2"]), "--seq-len", "4,8",
                       "--generate", "2")  # fmt: skip
    afters = [r["kv_cache_after_generate"] for r in data["results"]]
    assert [a["tokens"] for a in afters] == [6, 10]
    assert [a["measured_bytes"] for a in afters] == [None, None]
    sweep = invoke("memory", "--model", str(causal["gpt2"]), "--seq-len", "4,8", "--generate",
                   "2", "--measure", columns=160).stdout  # fmt: skip
    assert "KV cache after 2 more" in sweep and "measured" in sweep


@pytest.mark.parametrize(
    "args,message",
    [
        (["--generate", "-1"], "--generate takes a number of new tokens >= 1, got -1"),
        (["--generate", "0"], "--generate takes a number of new tokens >= 1, got 0"),
        (["--seq-len", "60", "--generate", "5"], "60 + --generate 5 = 65 tokens are more"),
        (["--generate", "64"], "--generate 64 leaves no room for a prompt in the 64 positions"),
        (["--generate", "2", "--kv-cache", "3"], "give --kv-cache N or --generate N, not both"),
        (["--generate", "2", "--train"], "--generate is inference: leave out --train"),
    ],
)
def test_bad_generate_is_one_line(invoke, causal, args, message):
    result = invoke("memory", "--model", str(causal["gpt2"]), *args)
    assert result.exit_code == 2 and result.stdout == ""
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_generate_needs_a_decoder_model(invoke, tmp_path):
    result = invoke("memory", "--generate", "3")
    assert result.exit_code == 2 and "--generate needs --model DIR" in result.stderr
    bert = tiny_models.write("bert", tmp_path / "bert")
    result = invoke("memory", "--model", str(bert), "--generate", "3")
    assert result.exit_code == 2 and "it generates nothing" in result.stderr


def test_generate_measure_needs_the_weights(invoke, causal, tmp_path):
    """A header-only folder (zeros) is refused before the model is loaded whole."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "zeros"
    shutil.copytree(causal["gpt2"], folder)
    tensors = load_file(folder / "model.safetensors")
    save_file({k: torch.zeros_like(v) for k, v in tensors.items()}, folder / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    result = invoke("memory", "--model", str(folder), "--seq-len", "4", "--generate", "2",
                    "--measure")  # fmt: skip
    assert result.exit_code == 2 and result.stdout == ""
    assert "it needs the trained weights" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1  # no time warning before it
    assert invoke("memory", "--model", str(folder), "--generate", "2").exit_code == 0


# ---------------------------------------------------------------- full-size headers

# the published parameter counts (Marian's sinusoidal tables are not stored; its
# final_logits_bias is a stored weight besides them: one per vocabulary entry)
FULL_SIZE = {
    "opus-mt-en-de": ("MarianMTModel", 73_886_208 + 58_101, dict(
        model_type="marian", vocab_size=58101, decoder_vocab_size=58101, d_model=512,
        encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
        decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048,
        max_position_embeddings=512, pad_token_id=58100, decoder_start_token_id=58100,
        scale_embedding=True, activation_function="swish")),
    "t5-small": ("T5ForConditionalGeneration", 60_506_624, dict(
        model_type="t5", vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6,
        num_heads=8, feed_forward_proj="relu")),
    "flan-t5-small": ("T5ForConditionalGeneration", 76_961_152, dict(
        model_type="t5", vocab_size=32128, d_model=512, d_kv=64, d_ff=1024, num_layers=8,
        num_decoder_layers=8, num_heads=6, feed_forward_proj="gated-gelu",
        tie_word_embeddings=False)),
}  # fmt: skip


def write_header_only(name: str, directory: Path) -> Path:
    """config.json and a sparse model.safetensors: the tensors save_pretrained stores
    (float buffers such as final_logits_bias too; a v1.1 T5's own lm_head.weight)."""
    import transformers

    class_name, _, values = FULL_SIZE[name]
    values = dict(values)
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        model = getattr(transformers, class_name)(config)
    config.save_pretrained(directory)
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters() if k not in ignored}
    shapes |= {k: tuple(b.shape) for k, b in model.named_buffers() if b.is_floating_point()}
    if not values.get("tie_word_embeddings", True):  # what a flan-t5 download holds
        shapes["lm_head.weight"] = (config.vocab_size, config.d_model)
        tiny_models.rewrite_config(
            directory, remove=("scale_decoder_outputs",), tie_word_embeddings=False
        )
    header, offset = {}, 0
    for key, shape in shapes.items():
        end = offset + math.prod(shape) * 2
        header[key] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header).encode()
    path = directory / "model.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw)
    os.truncate(path, 8 + len(raw) + offset)
    return directory


@pytest.mark.parametrize("name", list(FULL_SIZE))
def test_full_size_weights_from_the_headers(invoke, tmp_path, name):
    folder = write_header_only(name, tmp_path / name)
    data = memory_json(invoke, "--model", str(folder), "--src-len", "128", "--tgt-len", "32")
    assert data["parameters"] == FULL_SIZE[name][1]
    assert data["by_dtype"]["float32"]["parameters_bytes"] == 4 * FULL_SIZE[name][1]
    model = read_model(folder)
    per_block = 2 * model.decoder.heads * model.decoder.config.d_k * 2  # K and V, float16
    blocks = model.decoder.layers
    assert data["kv_cache_bytes"] == blocks * 32 * per_block
    assert data["cross_kv_cache_bytes"] == blocks * 128 * per_block
