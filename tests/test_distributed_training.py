"""``memory --measure --train --tp T [--sp]``: a training step of each rank's shard, run
on torch.distributed (gloo), held to the per-device step of ``memory --train --tp T``
phase by phase, to the byte; and its gradients held to the single device's, cut the same
way (the collectives' autograd, the replicated weights' sums, the bias after the sum).

The ranks of each size are started once a session for every module's batches
(``rank_pool.py``: each process imports torch once) and run every case in turn.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from rank_pool import Batch, rank_batch, split_batch
from split_cases import (
    assert_steps_to_the_byte,
    covering,
    measured_document,
    one_device_gradients,
)

from attnctl.model.config import LayerConfig, resolve_impl, validate
from attnctl.model.describe import seeded_model
from attnctl.model.layout import Layout
from attnctl.parallel.distributed import SplitCase, measure_task

TIMEOUT = 300  # seconds a start of the ranks may take at most, here
# FFN, biases, qk norms; GPT-2 and Phi-3 store fused and transposed tensors, which a rank
# holds apart (parallel.plan.held_apart)
FAMILIES = ("llama", "bert", "qwen2", "qwen3", "mistral", "gemma3", "gpt2", "phi3")


def _layer(model, impl: str = "math"):
    from attnctl.app.calls import model_layer

    return model_layer(model, {"device": "cpu", "impl": impl})


def _sweep(tp: int) -> list[SplitCase]:
    """Small stacks of 2 blocks over norm, positions, mask, kernel and the options that
    change the step (per-head q/k norm, head_dim, a window, a soft cap, half precision,
    one or two kv-heads, copied on T / Hkv ranks), with and without SP."""
    variants = [{}, {"qk_norm": "head", "norm_type": "rms"}, {"head_dim": 12}, {"window": 3},
                {"softcap": 5.0, "impl": "math"}, {"dtype": "bfloat16", "bias": False},
                {"kv_heads": 1}, {"kv_heads": 2, "dtype": "float16"}]  # fmt: skip
    # every two options' values together once on 2 ranks; each value once on 4 (2 cores)
    chosen = covering(variants, strength=2 if tp == 2 else 1)
    return [SplitCase(config, 8, 2, 50, Layout(tp=tp, sp=sp), None, True, 2)
            for config, sp in chosen]  # fmt: skip


def _cases(tp: int, models) -> list[SplitCase]:
    named = []
    for family, impl, sp in itertools.product(FAMILIES, ("math", "sdpa"), (False, True)):
        fewer = tp == 4 and (impl, sp) != ("sdpa", True)  # 4 ranks on 2 cores: fewer
        if fewer or (family == "bert" and impl == "sdpa"):
            continue
        model = models[family]
        layout = Layout(tp=tp, sp=sp)
        named.append(SplitCase(_layer(model, impl), 8, 2, model.vocab_size, layout, model, True))
    return [*_sweep(tp), *named]


@rank_batch(2, 4)
def measured_batch(tp: int, tiny) -> Batch:
    return split_batch(_cases(tp, tiny), TIMEOUT)


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def measured(request, rank_pool):
    return rank_pool.get(measured_batch, request.param)


def test_every_rank_steps_as_the_split_estimates_to_the_byte(measured):
    cases, results = measured
    for case, ranks in zip(cases, results, strict=True):
        assert_steps_to_the_byte(case, ranks, case.layout.tp)
        for rank in ranks:
            assert "training step" in rank.method and rank.collective_buffer_bytes > 0


def test_the_step_is_the_peak_of_the_per_device_table(measured):
    """What a rank is held to is ``memory --train --tp T``'s own per-device row."""
    from attnctl.parallel.split import Split

    cases, results = measured
    case, ranks = cases[-1], results[-1]  # a checkpoint
    description = case.model.with_run(case.config)
    split = Split(case.config, case.model, description, case.layout, True, 1)
    (device,) = split.per_device(case.seq_len, case.batch, 1, 0, case.batch)
    assert device.peak_bytes == ranks[0].peak_bytes == ranks[0].measured_peak_bytes
    assert device.weights_bytes == ranks[0].measured_parameter_bytes


# ---------------------------------------------------------------- the gradients


GRADIENT_CASES = [
    # pre-norm: a post-norm's last LayerNorm summed has a gradient of 0 (float noise only)
    ("layer", dict(d_model=32, heads=4, norm="pre", pos="learned"), 2, True),
    (
        "layer",
        dict(
            d_model=32,
            heads=4,
            kv_heads=1,
            norm="pre",
            pos="rope",
            mask="causal",
            norm_type="rms",
            qk_norm="head",
        ),
        2,
        False,
    ),
    ("layer", dict(d_model=32, heads=8, kv_heads=2, norm="pre", pos="rope"), 4, False),
    ("layer", dict(d_model=32, heads=4, impl="sdpa", mask="causal", norm="pre"), 4, True),
    ("llama", {}, 2, True),
    ("bert", {}, 2, False),
    ("qwen3", {}, 2, False),
    ("gpt2", {}, 2, True),
    ("phi3", {}, 2, False),
]


@rank_batch(2, 4)
def gradients_batch(tp: int, models) -> Batch:
    """GRADIENT_CASES of ``tp`` ranks, each rank's gradients sent back."""
    cases, wholes = [], []
    for what, values, ranks, sp in GRADIENT_CASES:
        if ranks != tp:
            continue
        if what == "layer":
            config = resolve_impl(validate(LayerConfig(**{"impl": "math", "device": "cpu",
                                                          **values})))  # fmt: skip
            case = SplitCase(config, 8, 2, 50, Layout(tp=tp, sp=sp), None, True, 2)
            full = seeded_model(config, 50)
        else:
            model = models[what]
            case = SplitCase(_layer(model), 8, 2, model.vocab_size, Layout(tp=tp, sp=sp), model,
                             True)  # fmt: skip
            full = model.with_run(case.config)
        cases.append(case)
        wholes.append(full)
    tasks = [{**measure_task(case), "gradients": True} for case in cases]
    return Batch(tasks, TIMEOUT, lambda replies: (cases, wholes, replies))


@pytest.mark.parametrize("tp", [2, 4])
def test_every_gradient_is_the_single_devices_cut_the_same_way(tp, rank_pool):
    """Each rank's gradient of every weight (after the replicated ones' sums) is its
    share of one device's: the collectives' backward, the kv-heads copied on
    T / Hkv ranks, the per-head norms, the norms and biases under SP."""
    from attnctl.nn.collectives import TensorGroup, shard_weights

    cases, wholes, replies = rank_pool.get(gradients_batch, tp)
    for index, (case, full) in enumerate(zip(cases, wholes, strict=True)):
        expected = one_device_gradients(case, full)
        # float32 sums in another order: within 1e-4 of the model's largest gradient (a
        # missing sum over the ranks would be off by as much as the value; W_k's bias has
        # a gradient of 0, softmax being blind to a shift of every score of a row)
        scale = 1e-4 * max(float(g.abs().max()) for g in expected.values())
        for reply in replies:
            got = reply.results[index]["gradients"]
            cut = shard_weights(expected, full, TensorGroup(reply.rank, tp), full.vocab_size)
            assert set(got) == set(cut), f"case {index} rank {reply.rank}"
            for name, gradient in got.items():
                where = f"case {index} rank {reply.rank} {name}"
                torch.testing.assert_close(torch.tensor(gradient), cut[name].float(), rtol=0,
                                           atol=scale, msg=where)  # fmt: skip


# ---------------------------------------------------------------- the command


def test_memory_measure_train_prints_each_rank_and_its_phases(invoke, ranks_once):
    args = ("memory", "-L", "16", "--d-model", "64", "--heads", "4", "--kv-heads", "2",
            "--pos", "rope", "--mask", "causal", "--norm", "pre", "--tp", "2", "--sp",
            "--train", "--layers", "2")  # fmt: skip
    ranks, device = measured_document(invoke, *args)
    for rank in ranks:  # the TP ranks alike: each is the per-device row
        assert rank["peak_bytes"] == device["peak_bytes"]
        assert rank["phase_peak_bytes"] == device["phase_peak_bytes"]
    text = invoke(*args, "--measure", columns=100)
    assert text.exit_code == 0
    assert "a training step of 2 blocks" in text.stdout and "every rank: forward" in text.stdout
    assert len(ranks_once) == 1  # one start of the ranks: the text is the JSON's measurement


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (("--cp", "2", "--impl", "sdpa"), "--cp with --impl sdpa is not modelled"),
    ],
)
def test_memory_measure_train_refusals_start_no_process(invoke, extra, words):
    result = invoke("memory", "-L", "16", "--d-model", "32", "--heads", "4", "--train",
                    "--measure", *extra)  # fmt: skip
    assert result.exit_code == 2 and words in result.stderr and result.stdout == ""


def test_a_fused_checkpoint_trains_split_to_the_byte(invoke, tiny):
    """GPT-2's c_attn (W_q, W_k, W_v in one transposed tensor) and Phi-3's qkv_proj, each
    part held as a tensor of its own on a rank (``parallel.plan.held_apart``)."""
    for family in ("gpt2", "phi3"):
        folder = str(tiny[family].source.path)
        ranks, _ = measured_document(invoke, "memory", "-L", "16", "--model", folder,
                                          "--tp", "2", "--train")  # fmt: skip
        assert [rank["rank"] for rank in ranks] == [0, 1], family
