"""The training-step model (training.py) against a measured step, and --train / --dropout."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import tiny_models
import torch
from json_contract import only_length

from attnctl.errors import AttnctlError
from attnctl.memory.measure import measure_training
from attnctl.model.config import (
    DTYPES,
    MASKS,
    NORM_TYPES,
    NORMS,
    POSITIONS,
    LayerConfig,
    build_config,
    validate,
)
from attnctl.model.families import read_model
from attnctl.nn.layer import AttentionLayer
from attnctl.replay.stages import ENTRIES
from attnctl.replay.step import EXACT_LAYERS, _replay, estimate_training
from attnctl.stages.plan import build_plan


@pytest.fixture
def one_thread():
    """Tiny tensors: one thread is faster than waiting on a second on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SMALL = {"d_model": 16, "heads": 4, "device": "cpu"}  # d_k 4: even, for RoPE


def accepted_variants() -> list[dict]:
    """Every layer validate accepts, over pos × mask × norm × norm type × kv-heads (H, 1,
    H/2) × cross-attention × impl; the other options (dtype, biases, dropout, padding,
    batch, lengths) take turns along the list, so each value meets many of the rest."""
    turns = itertools.cycle(  # odd periods innermost: impl alternates, these do not
        itertools.product(
            [False, True],  # padded
            [0.0, 0.1],  # dropout (math only)
            DTYPES,  # 3
            [(True, True), (True, False), (False, True)],  # bias, output_bias
            [(1, 6), (2, 5), (3, 9), (2, 16), (1, 11)],  # batch, length
        )
    )
    accepted = []
    for pos, mask, norm, norm_type, kv_heads, cross, impl in itertools.product(
        POSITIONS, MASKS, NORMS, NORM_TYPES, (4, 1, 2), (False, True), ("math", "sdpa")
    ):
        padded, dropout, dtype, (bias, output_bias), (batch, length) = next(turns)
        options = dict(
            pos=pos, mask=mask, norm=norm, norm_type=norm_type, kv_heads=kv_heads, impl=impl,
            dtype=dtype, bias=bias, output_bias=output_bias,
            dropout=dropout if impl == "math" else 0.0,
        )  # fmt: skip
        try:
            validate(LayerConfig(**SMALL, **options, cross=cross))
        except AttnctlError:  # no causal mask, rope or alibi with a context; no sdpa alibi
            assert (cross and (mask == "causal" or pos in ("rope", "alibi"))) or (
                impl == "sdpa" and pos == "alibi"
            )
            continue
        sizes = dict(batch=batch, seq_len=length, context_len=length + 3 if cross else None)
        accepted.append({"options": options, "padded": padded, **sizes})
    return accepted


VARIANTS = accepted_variants()


def _case_id(case: dict) -> str:
    options = case["options"]
    cross = "cross" if case["context_len"] else "self"
    return "-".join(map(str, [*options.values(), cross, case["batch"], case["seq_len"]]))


def test_the_grid_is_what_validate_accepts():
    # math: 234 as in test_check (5 pos × 2 masks × 3 norms × 2 types × 3 kv-heads, and
    # 3 pos × 3 × 2 × 3 with a context); sdpa: the same without alibi (-36)
    assert len(VARIANTS) == 234 + 234 - 36
    for key in ("dtype", "bias", "output_bias", "dropout"):  # every value comes round
        assert len({str(case["options"][key]) for case in VARIANTS}) >= 2
    assert {case["batch"] for case in VARIANTS} == {1, 2, 3} and any(
        case["padded"] for case in VARIANTS
    )


def _estimate_and_measure(case: dict, layers: int = 1):
    config = build_config(**SMALL, **case["options"])
    plan = build_plan(
        config,
        case["seq_len"],
        case["batch"],
        vocab_size=7,
        padded=case["padded"],
        context_len=case["context_len"],
    )
    return estimate_training(plan, layers), measure_training(plan.config, plan, layers)


@pytest.mark.parametrize("case", VARIANTS, ids=_case_id)
def test_training_replay_equals_a_measured_step(case, one_thread):
    """To the byte: the peak, the peak of each phase (forward, backward, Adam), the
    forward's peak within each stage of the layer, and the backward's between one
    parameter's gradient and the next."""
    predicted, measured = _estimate_and_measure(case)
    assert predicted.phase_peak_bytes == measured.phase_peak_bytes
    assert predicted.stage_window_bytes == measured.stage_window_bytes
    assert predicted.gradient_window_bytes == measured.gradient_window_bytes
    assert len(measured.gradient_window_bytes) >= 5  # W_q, W_k, W_v, W_o, embedding
    assert predicted.peak_bytes == measured.peak_bytes


def _with(options: dict, cases: list[dict]) -> list[dict]:
    """The cases with ``options`` added, where validate accepts them (sdpa: no dropout)."""
    chosen = []
    for case in cases:
        merged = {**case["options"], **options}
        try:
            validate(LayerConfig(**SMALL, **merged, cross=bool(case["context_len"])))
        except AttnctlError:
            continue
        chosen.append({**case, "options": merged})
    return chosen


# options the grid above leaves at their default, each over every 5th variant (both
# impls, every dtype, padding, cross-attention, GQA and positions among them)
EXTRA_OPTIONS = [
    {"head_dim": 12},  # H·d_k = 48, wider than D = 16
    {"head_dim": 6},
    {"head_dim": 2},  # narrower than D
    {"qk_norm": "head"},  # Qwen3, Gemma 3: each head over its d_k
    {"qk_norm": "head", "head_dim": 12},
    {"qk_norm": "all"},  # OLMo 2: every head at once
    {"qk_norm": "all", "head_dim": 6},
    {"mask": "causal", "window": 3},  # Mistral, Gemma: a sliding window (sdpa: attn_mask)
    {"mask": "causal", "window": 1, "head_dim": 12},
    {"mask": "causal", "window": 4, "qk_norm": "head"},
    {"softcap": 5.0},  # Gemma 2 (math only: SDPA cannot cap the scores)
    {"softcap": 2.0, "mask": "causal", "window": 3, "head_dim": 6},
]
EXTRA = [(options, case) for options in EXTRA_OPTIONS for case in _with(options, VARIANTS[::5])]


@pytest.mark.parametrize(("options", "case"), EXTRA, ids=[f"{o}-{_case_id(c)}" for o, c in EXTRA])
def test_more_options_train_as_replayed(options, case, one_thread):
    predicted, measured = _estimate_and_measure(case)
    assert predicted.phase_peak_bytes == measured.phase_peak_bytes
    assert predicted.stage_window_bytes == measured.stage_window_bytes
    assert predicted.gradient_window_bytes == measured.gradient_window_bytes
    assert predicted.peak_bytes == measured.peak_bytes


def test_the_more_options_meet_both_impls_and_every_dtype():
    for options in EXTRA_OPTIONS:
        cases = [c for o, c in EXTRA if o == options]
        impls = {"math"} if "softcap" in options else {"math", "sdpa"}
        assert {c["options"]["impl"] for c in cases} == impls, options
        assert {c["options"]["dtype"] for c in cases} == set(DTYPES), options


EXTRA_STACKS = EXTRA[::14]


@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize(
    ("options", "case"), EXTRA_STACKS, ids=[f"{o}-{_case_id(c)}" for o, c in EXTRA_STACKS]
)
def test_more_options_stack_as_replayed(options, case, layers, one_thread):
    predicted, measured = _estimate_and_measure(case, layers)
    assert predicted.phase_peak_bytes == measured.phase_peak_bytes
    assert predicted.stage_window_bytes == measured.stage_window_bytes  # block 0's
    assert predicted.gradient_window_bytes == measured.gradient_window_bytes
    assert predicted.peak_bytes == measured.peak_bytes


STACKS = [case for case in VARIANTS[::9]]  # every 9th variant, as stacks of 2 and 3


@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("case", STACKS, ids=_case_id)
def test_a_stack_is_replayed_and_measured_alike(case, layers, one_thread):
    predicted, measured = _estimate_and_measure(case, layers)
    assert predicted.phase_peak_bytes == measured.phase_peak_bytes
    assert predicted.stage_window_bytes == measured.stage_window_bytes  # block 0's
    assert predicted.gradient_window_bytes == measured.gradient_window_bytes
    assert predicted.peak_bytes == measured.peak_bytes
    assert measured.parameter_bytes == predicted.parameter_bytes


def test_a_tall_stack_carries_the_last_layers_on():
    """Past EXACT_LAYERS each phase peak follows the line of the last two replayed
    layers: the same as replaying every layer."""
    for options in ({}, {"pos": "learned", "impl": "sdpa", "norm": "none"},
                    {"kv_heads": 2, "pos": "rope", "dtype": "bfloat16"}):  # fmt: skip
        plan = build_plan(build_config(**SMALL, **options), 64, 2, vocab_size=100)
        for layers in (EXACT_LAYERS + 1, EXACT_LAYERS + 37):
            carried = estimate_training(plan, layers)
            replayed = _replay(plan, layers)
            assert carried.phase_peak_bytes == replayed.phase_peaks
            assert carried.saved_bytes == replayed.saved


@pytest.mark.parametrize("impl", ["math", "sdpa"])
def test_training_estimate_at_a_real_size(impl):
    config = build_config(impl=impl, device="cpu", mask="causal")
    plan = build_plan(config, 512, 1, vocab_size=2214)
    predicted = estimate_training(plan)
    measured = measure_training(config, plan)
    assert measured.peak_bytes == predicted.peak_bytes
    assert measured.phase_peak_bytes == predicted.phase_peak_bytes


def test_training_breakdown():
    plan = build_plan(build_config(), 128, 1, vocab_size=100)
    full = estimate_training(plan)
    count = plan.parameter_count
    assert full.parameter_bytes == full.gradient_bytes == 4 * count
    assert full.optimizer_bytes == 8 * count and full.master_bytes == 0
    half = estimate_training(build_plan(build_config(dtype="bfloat16"), 128, 1, vocab_size=100))
    assert half.parameter_bytes == half.gradient_bytes == 2 * count
    assert half.master_bytes == 4 * count and half.optimizer_bytes == 8 * count
    long = estimate_training(build_plan(build_config(), 2048, 1, vocab_size=100))
    matrix = 8 * 2048 * 2048 * 4
    assert long.peak_phase == "backward"
    assert long.peak_bytes > 3 * matrix  # weights, their gradient and the scores' gradient


def test_dropout_zeroes_weights_in_training_only():
    config = build_config(d_model=32, heads=4, dropout=0.5)
    torch.manual_seed(0)
    layer = AttentionLayer(config, 10)
    ids = torch.randint(0, 10, (1, 12))
    torch.manual_seed(1)
    a = layer(ids).output
    torch.manual_seed(1)
    b = layer(ids).output
    assert torch.equal(a, b)  # seeded: the same mask twice
    with torch.no_grad():
        trained = layer(ids).output
        evaluated = layer.eval()(ids).output
    assert not torch.allclose(trained, evaluated)
    assert torch.equal(evaluated, layer(ids).output)


def test_memory_train_cli(invoke):
    result = invoke("memory", "--seq-len", "128", "--train", "--measure", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "training peak" in result.stdout and "Adam moments" in result.stdout
    data = only_length(json.loads(
        invoke("memory", "--seq-len", "128", "--train", "--measure", "--device", "cpu",
               "--json").stdout
    ))  # fmt: skip
    assert data["measured_what"] == "training step"
    assert data["measured_peak_bytes"] == data["training_bytes"]
    assert data["training"]["optimizer_bytes"] == 8 * data["parameters"]
    bf16 = only_length(json.loads(
        invoke("memory", "--seq-len", "128", "--train", "--dtype", "bfloat16", "--json").stdout
    ))  # fmt: skip
    assert bf16["training"]["master_bytes"] == 4 * bf16["parameters"]
    untrained = only_length(json.loads(invoke("memory", "--json").stdout))
    assert untrained["training_bytes"] is None and untrained["training"] is None


@pytest.mark.parametrize(
    "options",
    [
        ["--kv-heads", "2"],
        ["--kv-heads", "1", "--impl", "sdpa"],
        ["--norm", "pre"],
        ["--norm-type", "rms", "--dtype", "bfloat16"],
        ["--pos", "rope", "--norm", "pre", "--norm-type", "rms"],
        ["--pos", "alibi", "--mask", "causal"],
        ["--pos", "learned"],
        ["--context-len", "24"],
        ["--layers", "3", "--pos", "rope", "--kv-heads", "2"],
    ],
)
def test_memory_train_measures_what_it_once_refused(invoke, options):
    """--kv-heads, positions, pre-norm, RMSNorm, cross-attention and a --layers stack:
    memory --train models them, and --measure equals the estimate to the byte."""
    args = ["memory", "--seq-len", "32", "--d-model", "64", "--heads", "4", *options]
    result = invoke(*args, "--train", "--measure", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    data = only_length(json.loads(result.stdout))
    assert data["measured_what"] == "training step"
    assert data["measured_peak_bytes"] == data["training_bytes"]
    # the stages' live bytes are a forward pass's: no training numbers beside them
    assert all(stage["measured_live_bytes"] is None for stage in data["stages"])


def test_budget_with_train_solves_the_training_peak(invoke):
    data = json.loads(
        invoke("memory", "--seq-len", "256", "--train", "--budget", "1GiB", "--json").stdout
    )
    for impl in ("math", "sdpa"):
        config = build_config(impl=impl)

        def peak(length, config=config):
            return estimate_training(build_plan(config, length, 1, 2214)).peak_bytes

        longest = data["max_seq_len"][impl]
        assert peak(longest) <= 2**30 < peak(longest + 1)


@pytest.mark.parametrize(
    "args,message",
    [
        (["run", "hi", "--dropout", "0.1"], "No such option: --dropout"),  # not offered
        (["shapes", "--dropout", "0.1"], "No such option: --dropout"),
        (["memory", "--dropout", "0.1"], "dropout acts only in training; add --train"),
        (["memory", "--train", "--dropout", "1.5"], "dropout must be at least 0 and below 1"),
        (["memory", "--train", "--dropout", "0.1", "--impl", "sdpa"], "use --impl math"),
    ],
)
def test_dropout_misuse_is_a_usage_error(invoke, args, message):
    result = invoke(*args)
    assert result.exit_code == 2 and message in result.stderr


def test_dropout_is_a_stage_of_the_training_plan(invoke):
    out = invoke("memory", "--seq-len", "64", "--train", "--dropout", "0.1").stdout
    assert " dropout " in out and "n/a" in out  # sdpa cannot model dropout: no column value
    data = only_length(json.loads(
        invoke("memory", "--seq-len", "64", "--train", "--dropout", "0.1", "--json").stdout
    ))  # fmt: skip
    names = [s["name"] for s in data["stages"]]
    assert names.index("weights") + 1 == names.index("dropout")
    assert set(data["by_impl"]) == {"math"}


def test_dropout_matches_torch_dropout_on_the_weights():
    """With the same RNG state, the layer equals the textbook computation using F.dropout
    on the softmax weights; kept weights are scaled by 1/(1-p), the rest are 0."""
    import math

    import torch.nn.functional as F

    from attnctl.nn.positions import sinusoidal_positions

    p = 0.3
    config = build_config(d_model=32, heads=4, dropout=p, norm="none")
    torch.manual_seed(0)
    layer = AttentionLayer(config, 30)  # training mode: dropout acts
    ids = torch.randint(0, 30, (2, 6))
    with torch.no_grad():
        torch.manual_seed(7)
        ours = layer(ids).attention_output
        x = layer.embedding(ids) + sinusoidal_positions(6, 32)
        q, k, v = (w(x).view(2, 6, 4, 8).transpose(1, 2) for w in (layer.W_q, layer.W_k, layer.W_v))
        weights = (q @ k.transpose(-2, -1) / math.sqrt(8)).softmax(-1)
        torch.manual_seed(7)  # the layer draws nothing else before its dropout
        dropped = F.dropout(weights, p)
        expected = layer.W_o((dropped @ v).transpose(1, 2).reshape(2, 6, 32))
    assert (ours - expected).abs().max() <= 1e-6
    kept = dropped != 0
    assert torch.allclose(dropped[kept], weights[kept] / (1 - p))
    assert 0 < kept.float().mean() < 1


# ---------------------------------------------------------------- checkpoints' blocks


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trained")
    return {family: tiny_models.write(family, root / family) for family in tiny_models.FAMILIES}


# every family's blocks train as replayed (Gemma 2, whose scores are soft-capped, on the
# math path only: tested below)
TRAINED = ("bert", "gpt2", "llama", "qwen2", "phi3", "qwen3", "mistral", "olmo2", "gemma3")


def test_every_family_is_trained():
    assert set(TRAINED) == set(tiny_models.FAMILIES)


def test_a_window_after_a_global_block_is_refused_on_sdpa_by_name(invoke, tmp_path, one_thread):
    """Qwen3 with sliding layers after a full one: the SDPA replay takes its attn_mask
    from the first block, so it refuses; the math path trains as measured."""
    folder = tiny_models.write(
        "qwen3", tmp_path / "qwen3", **tiny_models.OPTIONS["qwen3"]["sliding"]
    )
    args = ("memory", "--model", str(folder), "--train", "--seq-len", "12", "--device", "cpu")
    result = invoke(*args, "--impl", "sdpa")
    assert result.exit_code == 2 and result.stdout == ""
    assert "does not model --impl sdpa with a sliding-window block after one" in result.stderr
    model = read_model(folder)
    plan = build_plan(model.layer_config(device="cpu", impl="math"), 12, 2, model.vocab_size,
                      model=model)  # fmt: skip
    predicted, measured = estimate_training(plan), measure_training(plan.config, plan)
    assert predicted.phase_peak_bytes == measured.phase_peak_bytes
    assert predicted.gradient_window_bytes == measured.gradient_window_bytes
    assert predicted.stage_window_bytes == measured.stage_window_bytes


@pytest.mark.parametrize(
    ("dtype", "batch", "seq_len", "padded"),
    [("float32", 1, 9, False), ("bfloat16", 3, 12, False), ("float16", 2, 7, True)],
)
def test_gemma2_trains_as_replayed(tmp_path, dtype, batch, seq_len, padded, one_thread):
    """Gemma 2: soft-capped scores, sliding and global layers, norms after each sublayer,
    embeddings scaled by √D, norm weights stored minus one."""
    model = read_model(tiny_models.write("gemma2", tmp_path / "gemma2"))
    config = model.layer_config(device="cpu", impl="math", dtype=dtype)
    padded = padded and config.mask != "causal"
    plan = build_plan(config, seq_len, batch, model.vocab_size, model=model, padded=padded)
    predicted, measured = estimate_training(plan), measure_training(plan.config, plan)
    assert predicted.phase_peak_bytes == measured.phase_peak_bytes
    assert predicted.stage_window_bytes == measured.stage_window_bytes
    assert predicted.gradient_window_bytes == measured.gradient_window_bytes
    assert predicted.peak_bytes == measured.peak_bytes
    assert predicted.layers == model.layers > 1


@pytest.mark.parametrize("family", TRAINED)
@pytest.mark.parametrize(
    ("impl", "dtype", "batch", "seq_len", "padded"),
    [("math", "float32", 1, 9, False), ("sdpa", "bfloat16", 3, 12, False),
     ("math", "float16", 2, 7, True), ("sdpa", "float32", 2, 16, True)],
)  # fmt: skip
def test_a_checkpoints_blocks_train_as_replayed(
    checkpoints, family, impl, dtype, batch, seq_len, padded, one_thread
):
    """Every block of the model (BERT post-norm with its segment and embedding norm,
    GPT-2 pre-norm LayerNorm with its fused, transposed c_attn, Llama/Qwen2 pre-norm
    RMSNorm, SwiGLU, GQA, Phi-3's fused qkv_proj and gate_up_proj, Qwen3's q/k norms of
    each head and head_dim, Mistral's sliding window, OLMo 2's q/k norms over all heads
    and output norms, Gemma 3's sliding and global layers, scaled embeddings and norm
    weights stored minus one): to the byte, phase by phase."""
    model = read_model(checkpoints[family])
    config = model.layer_config(device="cpu", impl=impl, dtype=dtype)
    padded = padded and config.mask != "causal"  # right padding needs no mask under causal
    plan = build_plan(config, seq_len, batch, model.vocab_size, model=model, padded=padded)
    predicted = estimate_training(plan)
    measured = measure_training(plan.config, plan)
    assert predicted.phase_peak_bytes == measured.phase_peak_bytes
    assert predicted.stage_window_bytes == measured.stage_window_bytes
    assert predicted.gradient_window_bytes == measured.gradient_window_bytes
    assert predicted.peak_bytes == measured.peak_bytes
    assert predicted.layers == model.layers > 1
    assert predicted.parameter_bytes == plan.parameter_bytes  # every weight it loads


def test_memory_train_of_a_model_measures_alike(invoke, checkpoints):
    args = ["memory", "--model", str(checkpoints["llama"]), "--seq-len", "12", "--train"]
    result = invoke(*args, "--measure", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    data = only_length(json.loads(result.stdout))
    assert data["measured_peak_bytes"] == data["training_bytes"]
    assert data["training"]["optimizer_bytes"] < 8 * data["parameters"]  # not the final norm


@pytest.mark.parametrize(
    ("seq_len", "batch", "impl", "dtype"),
    [(60, 3, "math", "float32"), (64, 2, "sdpa", "bfloat16")],
)
def test_long_inputs_move_the_peak_into_the_blocks(
    checkpoints, seq_len, batch, impl, dtype, one_thread
):
    """Longer inputs: the attention's backward, not the embedding's, holds the peak."""
    for family in ("bert", "gpt2", "qwen2", "mistral", "qwen3", "olmo2", "gemma3"):
        model = read_model(checkpoints[family])
        config = model.layer_config(device="cpu", impl=impl, dtype=dtype)
        plan = build_plan(config, seq_len, batch, model.vocab_size, model=model)
        predicted = estimate_training(plan)
        measured = measure_training(plan.config, plan)
        assert predicted.phase_peak_bytes == measured.phase_peak_bytes, family
        assert predicted.gradient_window_bytes == measured.gradient_window_bytes, family
        assert predicted.stage_window_bytes == measured.stage_window_bytes, family
        assert predicted.peak_bytes == measured.peak_bytes, family


def test_an_unknown_stage_is_refused_by_name(monkeypatch):
    plan = build_plan(build_config(**SMALL), 8, 1, vocab_size=7)
    monkeypatch.delitem(ENTRIES, "weights")
    with pytest.raises(AttnctlError, match="does not replay the stage 'weights' yet"):
        estimate_training(plan)


@pytest.mark.parametrize(
    ("family", "config"),
    [("bert", {"hidden_act": "relu"}), ("gpt2", {"activation_function": "relu"}),
     ("llama", {"hidden_act": "gelu"})],
)  # fmt: skip
def test_other_activations_train_as_replayed(tmp_path, family, config, one_thread):
    """relu keeps its output for the backward, gelu its input."""
    model = read_model(tiny_models.write(family, tmp_path / family, **config))
    plan = build_plan(model.layer_config(device="cpu"), 40, 3, model.vocab_size, model=model)
    predicted, measured = estimate_training(plan), measure_training(plan.config, plan)
    assert predicted.phase_peak_bytes == measured.phase_peak_bytes
    assert predicted.gradient_window_bytes == measured.gradient_window_bytes


def test_a_gated_relu_is_refused_in_one_line(invoke, tmp_path):
    directory = tiny_models.write("llama", tmp_path / "relu", hidden_act="relu")
    result = invoke("memory", "--model", str(directory), "--train", "--measure", "--device", "cpu")
    assert result.exit_code == 2 and result.stdout == ""
    assert "does not model a gated relu feed-forward" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
