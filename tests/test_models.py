"""Pretrained checkpoints (--model): every layer against transformers' eager attention,
the plan against the run and the measured bytes, and one clear line for every bad folder."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_models
import torch
import transformers  # a test extra (pip install -e ".[test]"): the oracle
from family_checks import tolerance_of
from json_contract import only_length

from attnctl.memory.estimate import estimate
from attnctl.memory.measure import measure_forward
from attnctl.model.config import DTYPE_BYTES
from attnctl.model.families import read_model, supported
from attnctl.nn.layer import Recorder
from attnctl.nn.model import forward
from attnctl.nn.weights import model_weights
from attnctl.stages.plan import build_plan

CPU = ("--device", "cpu")
TEXT = "Are you OK? 猫吃鱼, the cat eats the fish."
TOLERANCE = 1e-5


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {family: tiny_models.write(family, root / family) for family in tiny_models.FAMILIES}


def reference(directory: Path, texts: list[str]):
    """transformers' own tokenizer and eager attention: (input ids, mask, per-layer weights)."""
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json")
    )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(0)
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    model = transformers.AutoModel.from_pretrained(directory, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(
            input_ids=encoded["input_ids"],
            attention_mask=encoded["attention_mask"],
            output_attentions=True,
        )
    return encoded["input_ids"], encoded["attention_mask"], out.attentions


def run_json(invoke, *args: str) -> dict:
    result = invoke("run", *args, *CPU, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# ---------------------------------------------------------------- against transformers


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_every_layer_equals_transformers_eager_attention(invoke, models, family):
    directory = models[family]
    ids, _, attentions = reference(directory, [TEXT])
    everything = run_json(
        invoke, TEXT, "--model", str(directory), "--layer", "all", "--rows", "all"
    )
    assert [t["id"] for t in everything["tokens"][0]] == ids[0].tolist()
    assert len(everything["layers"]) == len(attentions) == 3
    for n, expected in enumerate(attentions):
        one = run_json(invoke, TEXT, "--model", str(directory), "--layer", str(n), "--rows", "all")
        ours = torch.tensor(one["attention"])  # (B, H, Lq, Lk)
        assert one["layer"] == n and ours.shape == expected.shape
        assert (ours - expected).abs().max() <= tolerance_of(family), f"layer {n}"
        summary = torch.tensor(everything["layers"][n]["attention"])
        assert (summary - expected).abs().max() <= tolerance_of(family), f"--layer all, {n}"


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 4.0},
        # original 16 puts the tiny model's 4 frequencies on both sides of and inside the blend
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 16},
    ],
)  # fmt: skip
def test_scaled_rope_equals_transformers(invoke, tmp_path, rope):
    """Llama 3.1's rope_scaling (and linear position interpolation), every layer."""
    directory = tiny_models.write("llama", tmp_path, rope_parameters={"rope_theta": 500.0, **rope})
    _, _, attentions = reference(directory, [TEXT])
    everything = run_json(
        invoke, TEXT, "--model", str(directory), "--layer", "all", "--rows", "all"
    )
    assert everything["config"]["rope_type"] == rope["rope_type"]
    for n, expected in enumerate(attentions):
        ours = torch.tensor(everything["layers"][n]["attention"])
        assert (ours - expected).abs().max() <= TOLERANCE, f"layer {n}"
    plain_rope = {"rope_type": "default", "rope_theta": 500.0}
    plain = tiny_models.write("llama", tmp_path / "plain", rope_parameters=plain_rope)
    unscaled = run_json(invoke, TEXT, "--model", str(plain), "--layer", "2", "--rows", "all")
    difference = torch.tensor(unscaled["attention"]) - attentions[2]
    assert difference.abs().max() > 1e-3  # the scaling matters here


def test_special_tokens_come_from_the_models_tokenizer(invoke, models):
    bert = run_json(invoke, "Are you OK?", "--model", str(models["bert"]))["tokens"][0]
    assert (bert[0]["text"], bert[-1]["text"]) == ("[CLS]", "[SEP]")
    for family in ("llama", "mistral"):
        tokens = run_json(invoke, "Are you OK?", "--model", str(models[family]))["tokens"][0]
        assert tokens[0]["text"] == "<s>"
    gpt2 = run_json(invoke, "Are you OK?", "--model", str(models["gpt2"]))["tokens"][0]
    assert gpt2[0]["text"] == "A"  # GPT-2 adds no special tokens


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_rows_through_sdpa_equal_the_eager_weights(invoke, models, family):
    """--rows computes only some query rows (SDPA for the output): still the same weights."""
    directory = models[family]
    _, _, attentions = reference(directory, [TEXT])
    data = run_json(
        invoke, TEXT, "--model", str(directory), "--layer", "2", "--rows", "3:6", "--head", "1"
    )
    assert data["impl"] == "sdpa" and data["attention_rows"] == [3, 4, 5]
    expected = attentions[2][:, [1]][:, :, 3:6]
    assert (torch.tensor(data["attention"]) - expected).abs().max() <= TOLERANCE


def test_padded_bert_batch_equals_transformers_with_its_attention_mask(invoke, models):
    texts = ["Are you OK?", "猫吃鱼, the cat eats the fish."]
    ids, mask, attentions = reference(models["bert"], texts)
    data = run_json(invoke, *texts, "--model", str(models["bert"]), "--layer", "1")
    assert [[t["id"] for t in row] for row in data["tokens"]] == ids.tolist()
    ours, expected = torch.tensor(data["attention"]), attentions[1]
    for row, length in enumerate(mask.sum(-1).tolist()):  # the real queries of each text
        assert (ours[row, :, :length] - expected[row, :, :length]).abs().max() <= TOLERANCE
        assert ours[row, :, :, length:].abs().sum() == 0  # padded keys get nothing


@pytest.mark.parametrize(
    ("family", "model_class", "prefix"),
    [("bert", "BertForMaskedLM", "bert."), ("llama", "LlamaForCausalLM", "model.")],
)
def test_task_heads_prefixes_and_shards_are_read(
    invoke, models, tmp_path, family, model_class, prefix
):
    """BertForMaskedLM keeps "bert.…", LlamaForCausalLM "model.…"; big models come in shards."""
    base = transformers.AutoModel.from_pretrained(models[family])
    config = base.config
    config.architectures = [model_class]
    with_head = getattr(transformers, model_class)(config).eval()
    inner = getattr(with_head, prefix.rstrip("."))
    inner.load_state_dict(base.state_dict(), strict=False)  # BertForMaskedLM has no pooler
    with_head.save_pretrained(tmp_path, max_shard_size="20KB")  # several shards + an index
    shutil.copy(models[family] / "tokenizer.json", tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    spec = read_model(tmp_path)
    assert spec.checkpoint.prefix == prefix
    assert len({t.file for t in spec.checkpoint.tensors.values()}) > 1
    ours = run_json(invoke, "Are you OK?", "--model", str(tmp_path), "--layer", "2")
    plain = run_json(invoke, "Are you OK?", "--model", str(models[family]), "--layer", "2")
    assert ours["attention"] == plain["attention"]


def test_old_layernorm_names_and_stored_buffers_are_understood(invoke, models, tmp_path):
    """Checkpoints converted from TensorFlow name LayerNorm's tensors gamma and beta; old
    GPT-2 files store the causal mask as h.N.attn.bias. Neither changes what runs."""
    from safetensors.torch import load_file, save_file

    bert = _copy(models, "bert", tmp_path)
    tensors = load_file(bert / "model.safetensors")
    renamed = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
            "LayerNorm.bias", "LayerNorm.beta"
        ): v
        for k, v in tensors.items()
    }
    assert renamed.keys() != tensors.keys()
    save_file(renamed, bert / "model.safetensors")
    gpt2 = _copy(models, "gpt2", tmp_path)
    tensors = load_file(gpt2 / "model.safetensors")
    for n in range(3):
        tensors[f"h.{n}.attn.bias"] = torch.ones(1, 1, 64, 64).tril()
    save_file(tensors, gpt2 / "model.safetensors")
    for family, changed in (("bert", bert), ("gpt2", gpt2)):
        ours = run_json(invoke, "Are you OK?", "--model", str(changed), "--layer", "2")
        plain = run_json(invoke, "Are you OK?", "--model", str(models[family]), "--layer", "2")
        assert ours["attention"] == plain["attention"]
        assert ours["memory"]["parameters"] == plain["memory"]["parameters"]


def test_a_half_precision_checkpoint_runs_in_its_dtype(invoke, models, tmp_path):
    model = transformers.AutoModel.from_pretrained(models["llama"]).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    shutil.copy(models["llama"] / "tokenizer.json", tmp_path)
    data = run_json(invoke, "Are you OK?", "--model", str(tmp_path), "--layer", "1")
    assert data["config"]["dtype"] == "bfloat16"
    assert {s["dtype"] for s in data["stages"] if s["name"] == "scores"} == {"bfloat16"}
    wide = run_json(
        invoke, "Are you OK?", "--model", str(tmp_path), "--layer", "1", "--dtype", "float32"
    )
    difference = torch.tensor(data["attention"]) - torch.tensor(wide["attention"])
    assert 0 < difference.abs().max() < 0.05  # bfloat16 rounding, not another model


# ---------------------------------------------------------------- plan, trace, memory


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
@pytest.mark.parametrize("impl", ["math", "sdpa"])
@pytest.mark.parametrize("layer_index", [0, 2])
def test_plan_equals_the_recorded_stages(models, family, impl, layer_index):
    spec = read_model(models[family])
    config = spec.layer_config(device="cpu", impl=impl)
    weights = model_weights(spec, config, torch.device("cpu"), blocks=layer_index + 1)
    record = Recorder()
    ids = torch.randint(0, spec.vocab_size, (2, 9))
    with torch.inference_mode():
        model = spec.with_run(config)
        forward(model, weights.named, ids, last=layer_index, record=record, recorded=layer_index)
    plan = build_plan(config, 9, 2, spec.vocab_size, "cpu", model=spec, layer_index=layer_index)
    assert [s.to_dict() for s in record.stages] == [s.to_dict() for s in plan.stages]
    assert ("hidden" in {s.name for s in plan.stages}) == (layer_index > 0)


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
@pytest.mark.parametrize(
    ("impl", "dtype", "batch", "padded"),
    [("math", "float32", 1, False), ("sdpa", "bfloat16", 3, False), ("math", "float16", 2, True)],
)
def test_memory_estimate_equals_measured_bytes(models, family, impl, dtype, batch, padded):
    spec = read_model(models[family])
    config = spec.layer_config(device="cpu", impl=impl, dtype=dtype)
    padded = padded and config.mask != "causal"  # right padding needs no mask under causal
    plan = build_plan(config, 40, batch, spec.vocab_size, model=spec, padded=padded)
    measured = measure_forward(plan)
    assert list(measured.stage_peak_bytes) == list(estimate(plan).live_bytes)
    assert measured.peak_bytes == estimate(plan).peak_bytes  # weights included


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_run_loads_only_the_blocks_it_needs(models, family):
    """What run's memory check counts for --layer N is what it loads: blocks 0..N."""
    spec = read_model(models[family])
    config = spec.layer_config(device="cpu")
    for blocks in (1, 2, 3):
        loaded = model_weights(spec, config, torch.device("cpu"), blocks=blocks)
        assert loaded.parameter_bytes == spec.loaded_values(blocks) * 4
    assert (
        spec.loaded_values(1)
        < spec.loaded_values(3)
        <= sum(t.count for t in spec.checkpoint.tensors.values())
    )


@pytest.mark.parametrize("family", tiny_models.FAMILIES)
def test_memory_uses_the_models_own_config(invoke, models, family):
    spec = read_model(models[family])
    result = invoke("memory", "--model", str(models[family]), "--seq-len", "40", "--json")
    assert result.exit_code == 0, result.output
    data = only_length(json.loads(result.stdout))
    stored = sum(t.count for t in spec.checkpoint.tensors.values())
    assert data["parameters"] == stored  # every tensor of the checkpoint, once
    assert data["parameters_bytes"] == stored * DTYPE_BYTES[spec.dtype]
    kept = [min(40, window) if window else 40 for window in spec.layer_windows]  # per block
    kv = 2 * sum(kept) * spec.kv_heads * spec.config.d_k * DTYPE_BYTES[spec.dtype]
    assert data["kv_cache_bytes"] == kv
    assert data["config"]["heads"] == spec.heads and data["config"]["kv_heads"] == spec.kv_heads
    shapes = json.loads(invoke("shapes", "--model", str(models[family]), "--json").stdout)
    model_type = {"gemma3": "gemma3_text"}.get(family, family)  # the text model's type
    assert shapes["model"]["model_type"] == model_type == data["model"]["model_type"]
    by_name = {s["name"]: s for s in shapes["stages"]}
    assert by_name["ffn_down"]["shape"] == [1, 16, spec.hidden]
    assert by_name["k_heads"]["shape"] == [1, spec.kv_heads, 16, spec.config.d_k]
    assert shapes["sizes"]["I"] == spec.intermediate


@pytest.mark.parametrize(
    ("name", "parameters", "kv_per_token"),
    [
        ("gpt2-small", 124_439_808, 2 * 12 * 768 * 2),
        ("bert-base", 109_482_240, 2 * 12 * 768 * 2),
        ("llama-2-7b", 6_738_415_616, 2 * 32 * 4096 * 2),  # 0.5 MiB a token in float16
        ("llama-3.2-1b", 1_235_814_400, 2 * 16 * 8 * 64 * 2),  # GQA: 8 K/V heads of 32
        ("qwen2.5-0.5b", 494_032_768, 2 * 24 * 2 * 64 * 2),  # biases in W_q, W_k, W_v only
    ],
)
def test_full_size_models_have_their_published_parameter_counts(
    invoke, tmp_path, name, parameters, kv_per_token
):
    """Header-only checkpoints of the real configurations, named and shaped by transformers."""
    directory = tiny_models.write_header_only(name, tmp_path / name)
    result = invoke("memory", "--model", str(directory), "--seq-len", "256", "--json")
    assert result.exit_code == 0, result.output
    data = only_length(json.loads(result.stdout))
    assert data["parameters"] == parameters
    assert data["parameters_bytes"] == 2 * parameters  # stored as float16
    assert data["kv_cache_bytes"] == 256 * kv_per_token


def test_shapes_and_memory_of_a_model_never_import_torch(models):
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from attnctl.cli import app\n"
        f"for args in (['shapes', '--model', {str(models['llama'])!r}],\n"
        f"             ['memory', '--model', {str(models['llama'])!r}, '-L', '512,4096']):\n"
        "    result = CliRunner().invoke(app, args)\n"
        "    assert result.exit_code == 0, result.output\n"
        "heavy = sorted(m for m in ('torch', 'tokenizers', 'safetensors') if m in sys.modules)\n"
        "print(','.join(heavy) or 'none')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "none"


# ---------------------------------------------------------------- views


def test_run_view_names_the_model_and_the_block(invoke, models):
    result = invoke("run", "Are you OK?", "--model", str(models["gpt2"]), "--layer", "-1", *CPU)
    assert result.exit_code == 0, result.output
    assert "GPT-2 · 3 layers" in result.stdout and "· block 2" in result.stdout
    assert "ffn_residual" in result.stdout and "heads at a glance" in result.stdout


def test_layer_all_summarises_every_block(invoke, models):
    result = invoke("run", TEXT, "--model", str(models["llama"]), "--layer", "all", *CPU)
    assert result.exit_code == 0, result.output
    assert "every block (heads by kind)" in result.stdout
    assert "the 10 most clear-cut heads" in result.stdout
    table = result.stdout.split("every block")[1].split("entropy: mean")[0]
    assert [line.split()[0] for line in table.splitlines()[4:7]] == ["0", "1", "2"]
    grid = result.stdout.split("heads by block\n")[1].splitlines()
    assert grid[0].split() == ["head", "0", "1", "2", "3"]
    for n, row in enumerate(grid[1:4]):  # one mark per head: its kind
        label, marks = row[:8], row[8:].split()
        assert label == f"layer {n} " and len(marks) == 4
        assert set(marks) <= {"P", "F", "D", "S", "I", "·", "~"}


def test_layer_all_maps_every_head_even_past_the_eight_tables_shown(invoke, tmp_path):
    wide = {"num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 48}
    directory = tiny_models.write("llama", tmp_path, head_dim=4, **wide)
    result = invoke("run", TEXT, "--model", str(directory), "--layer", "all", *CPU)
    assert result.exit_code == 0, result.output
    grid = result.stdout.split("heads by block\n")[1].splitlines()
    assert grid[0].split() == ["head", *map(str, range(12))]
    assert all(len(row[8:].split()) == 12 for row in grid[1:4])


# ---------------------------------------------------------------- bad folders and options


def _copy(models: dict[str, Path], family: str, tmp_path: Path) -> Path:
    target = tmp_path / family
    shutil.copytree(models[family], target)
    return target


def _rewrite_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    header, offset, data = {}, 0, b""
    for name, (dtype, shape, payload) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + len(payload)],
        }
        offset += len(payload)
        data += payload
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _drop_tensor(directory: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    del tensors[name]
    save_file(tensors, directory / "model.safetensors")


def _quantize_one(directory: Path) -> None:
    """Rewrite the checkpoint with one tensor stored as int8 (a quantized model)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    name = next(k for k in tensors if k.endswith("q_proj.weight"))
    tensors[name] = tensors[name].to(torch.int8)
    save_file(tensors, directory / "model.safetensors")


BAD_FOLDERS = {
    "no folder": (lambda d: shutil.rmtree(d), "model folder not found"),
    "no config": (lambda d: (d / "config.json").unlink(), "no config.json in"),
    "garbled config": (
        lambda d: (d / "config.json").write_text("{not json"),
        "malformed model config",
    ),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), "no model.safetensors in"),
    "pickle only": (
        lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"),
        "has pytorch_model.bin but no model.safetensors; attnctl never unpickles",
    ),
    "unknown architecture": (
        lambda d: _rewrite_config(d, model_type="falcon"),
        f"has model_type 'falcon'; attnctl supports {supported()}",
    ),
    "mBART": (
        lambda d: _rewrite_config(d, model_type="mbart"),
        "has model_type 'mbart': mBART is pre-norm with final norms, unlike BART: another "
        "family; attnctl does not run it yet, and "
        f"supports {supported()}",
    ),
    "MoE blocks": (
        lambda d: _rewrite_config(d, model_type="mixtral"),
        "has model_type 'mixtral': its blocks are mixtures of experts (MoE)",
    ),
    "MLA": (
        lambda d: _rewrite_config(d, model_type="deepseek_v3"),
        "multi-head latent attention (MLA)",
    ),
    "mismatched shapes": (
        lambda d: _rewrite_config(d, intermediate_size=64),
        "layers.0.mlp.gate_proj.weight has shape (48, 32) but config.json implies (64, 32)",
    ),
    "missing tensor": (
        lambda d: _drop_tensor(d, "layers.1.input_layernorm.weight"),
        "have no layers.1.input_layernorm.weight, which a Llama with this config.json needs",
    ),
    "more layers than blocks": (
        lambda d: _rewrite_config(d, num_hidden_layers=4),
        "config.json: num_hidden_layers is 4 but the weights hold 3 blocks",
    ),
    "unsupported dtype": (
        _quantize_one,
        "is stored as I8; attnctl reads F32 (float32), F16 (float16), BF16 (bfloat16)",
    ),
    "incomplete rope scaling": (
        lambda d: _rewrite_config(d, rope_parameters={"rope_type": "llama3", "factor": 8.0}),
        "config.json: rope_parameters.rope_type 'llama3' needs low_freq_factor",
    ),
    "unknown rope": (
        lambda d: _rewrite_config(d, rope_parameters={"rope_type": "ntk", "factor": 4.0}),
        "rope_parameters.rope_type",
    ),
    "garbled weights": (
        lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64),
        "malformed safetensors file",
    ),
    "heads do not divide": (
        lambda d: _rewrite_config(d, num_attention_heads=5, head_dim=None),
        "kv-heads=2 does not divide heads=5",  # head_dim is then 32 // 5, as in transformers
    ),
}


@pytest.mark.parametrize("case", BAD_FOLDERS)
@pytest.mark.parametrize("command", ["run", "shapes", "memory"])
def test_bad_model_folders_exit_2_with_one_line(invoke, models, tmp_path, case, command):
    directory = _copy(models, "llama", tmp_path)
    damage, message = BAD_FOLDERS[case]
    damage(directory)
    args = ["run", "Are you OK?"] if command == "run" else [command]
    result = invoke(*args, "--model", str(directory), *CPU)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnctl: error: "), result.stderr
    assert message in lines[0]
    assert result.stdout == ""


def test_a_handwritten_header_with_a_bad_shape_is_caught(invoke, models, tmp_path):
    directory = _copy(models, "gpt2", tmp_path)
    _write_safetensors(directory / "model.safetensors", {"wte.weight": ("F32", [3, 2], bytes(24))})
    result = invoke("shapes", "--model", str(directory))
    assert result.exit_code == 2
    assert "wte.weight has shape (3, 2) but config.json implies (400, 32)" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layer", "3"], "--layer 3 is out of range: the model has 3 layers (0–2, or -1 for"),
        (["--layer", "-4"], "--layer -4 is out of range"),
        (["--layer", "first"], "--layer must be a block number or 'all', got 'first'"),
        (["--heads", "2"], "--heads comes from the model's config.json"),
        (["--config", "decoder"], "--config comes from the model's config.json"),
        (["--context", "猫"], "GPT-2 has no cross-attention"),
    ],
)
def test_model_option_misuse_exits_2(invoke, models, args, message):
    result = invoke("run", "Are you OK?", "--model", str(models["gpt2"]), *args, *CPU)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "hi", "--layer", "1"], "--layer picks a block of a pretrained model"),
        (["memory", "--model", "{gpt2}", "--layers", "4"], "--layers does not apply to --model"),
        (["shapes", "--model", "{gpt2}", "-L", "65"], "65 tokens are more than the 64 positions"),
    ],
)
def test_other_misuse_exits_2(invoke, models, args, message):
    args = [a.format(**models) for a in args]
    result = invoke(*args, *CPU)
    assert result.exit_code == 2, result.output
    assert message in result.stderr


def test_a_tokenizer_that_pads_and_truncates_gives_the_texts_own_tokens(invoke, models, tmp_path):
    """sentence-transformers export tokenizers that pad to 128 and truncate."""
    from tokenizers import Tokenizer

    directory = _copy(models, "bert", tmp_path)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.enable_padding(length=40, pad_token="[PAD]", pad_id=0)
    tokenizer.enable_truncation(max_length=4)
    tokenizer.save(str(directory / "tokenizer.json"))
    padded = run_json(invoke, TEXT, "--model", str(directory))["tokens"][0]
    plain = run_json(invoke, TEXT, "--model", str(models["bert"]))["tokens"][0]
    assert padded == plain and len(plain) > 4 and plain[-1]["text"] == "[SEP]"


def test_run_needs_the_models_tokenizer(invoke, models, tmp_path):
    directory = _copy(models, "bert", tmp_path)
    (directory / "tokenizer.json").unlink()
    assert invoke("shapes", "--model", str(directory)).exit_code == 0  # shapes needs none
    result = invoke("run", "hi", "--model", str(directory), *CPU)
    assert result.exit_code == 2
    assert f"no tokenizer.json in {directory}; give one with --tokenizer" in result.stderr
    # a tokenizer whose ids the model has no rows for
    text = "multi-head attention"  # the bundled tokenizer has ids up to 2213
    gpt2 = str(models["gpt2"])
    result = invoke("run", text, "--model", gpt2, "--tokenizer", "bundled", *CPU)
    assert result.exit_code == 2
    assert "token id 1247 is outside the model's vocabulary of 400" in result.stderr
