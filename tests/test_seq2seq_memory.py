"""Encoder–decoder plans and memory: what ``shapes`` and ``memory`` predict is what runs.

Every stage of an encoder block and of a decoder block (its self-attention, its
cross-attention over the encoder output, its feed-forward) as nn/model.forward records
it, for the tiny Marian, BART, T5 v1 and T5 v1.1 checkpoints written by transformers;
the bytes alive at each stage, the decoder's KV cache and the cross-attention's K and V
equal to what a run holds, to the byte.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tiny_seq2seq
import torch

from attnctl.families import read_model
from attnctl.layer import TORCH_DTYPES, Recorder
from attnctl.measure import measure_forward, measure_seq2seq_caches
from attnctl.memory import cross_kv_cache_groups, estimate, kv_cache_groups
from attnctl.nn.generate import decoder_weights
from attnctl.nn.model import forward
from attnctl.nn.positions import sinusoidal_halves
from attnctl.nn.weights import model_weights
from attnctl.plan import build_plan, build_seq2seq_plans

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
