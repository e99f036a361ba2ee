"""memory per device under a split (--tp, --sp, --cp, --pp, --dp, --zero, --micro-batch,
--recompute): refusals, the arithmetic against the single-device estimate, the weights'
shares, ZeRO, Korthikanti et al. 2022's activation counts, --budget, the views."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re

import json_contract
import pytest
import tiny_models
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_terminal import assert_fits, invoke_at, json_of

from attnctl.app.requests import LayerRequest, MemoryRequest
from attnctl.app.use_cases import memory_use_case, sized_plan
from attnctl.memory.estimate import estimate, format_bytes, kv_cache_bytes
from attnctl.model.config import build_config
from attnctl.model.families import read_model
from attnctl.model.layout import (
    Layout,
    vocab_rows,
    zero_distinct_ranks,
    zero_pieces,
    zero_ranges,
)
from attnctl.parallel.plan import rank_plan, rank_weights
from attnctl.parallel.split import Split, attention_matrix_bytes
from attnctl.parallel.split_report import steady_peak
from attnctl.render.terminal_parallel import parallel_view
from attnctl.replay.step import estimate_training, saved_activations
from attnctl.stages.plan import layer_parameters, seeded_model

FAST = settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> str:
    return str(tiny_models.write_header_only("gpt2-small", tmp_path_factory.mktemp("gpt2") / "m"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("llama") / "m"
    return str(tiny_models.write_header_only("llama-2-7b", folder))


def _json(invoke, *args: str) -> dict:
    result = invoke("memory", *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# ---------------------------------------------------------------- refusals


REFUSALS = [
    (("--tp", "3"), "--tp 3 does not divide the 8 attention heads"),
    (
        ("--d-model", "384", "--heads", "24", "--kv-heads", "6", "--tp", "4"),
        "--tp 4 and the 6 kv-heads",
    ),
    (("--pp", "2"), "--pp 2 is more pipeline stages than the 1 block"),
    (("--pp", "5", "--layers", "4"), "--pp 5 is more pipeline stages than the 4 blocks"),
    (("--cp", "3", "-L", "64"), "--cp 3 does not divide the length 64"),
    (("--zero", "1"), "--zero 1 shards over the data-parallel copies: give --dp 2 or more"),
    (("--zero", "2", "--dp", "2"), "--zero 2 shards training state"),
    (("--zero", "4", "--dp", "2", "--train"), "--zero must be 0, 1, 2 or 3, got 4"),
    (("--sp",), "--sp splits the sequence over the --tp ranks"),
    (("--sp", "--tp", "2", "-L", "63"), "--sp with --tp 2 does not divide the length 63"),
    (("--recompute", "full", "--dp", "2"), "--recompute full trades a training step's"),
    (("--recompute", "bogus"), "Invalid value for '--recompute'"),
    (("--tp", "0"), "--tp must be a positive integer, got 0"),
    (("--dp", "-1"), "--dp must be a positive integer, got -1"),
    (("--tp", str(2**21)), "--tp 2097152 is more than 1,048,576 devices"),
    (("--dp", "1024", "--pp", "1024", "--tp", "2"), "devices, more than 1,048,576"),
    (("--micro-batch", "3", "--batch", "4", "--tp", "2"), "--micro-batch 3 does not divide"),
    (("--micro-batch", "0", "--tp", "2"), "--micro-batch must be a positive integer"),
    (("--measure", "--pp", "2"), "--pp is estimated only"),
    # what the ranks would not run is refused, never measured as something else
    (("--measure", "--train", "--tp", "2", "--recompute", "selective"), "--recompute selective"),
    (("--measure", "--train", "--recompute", "full"), "--recompute full is estimated only"),
    (
        ("--measure", "--train", "--tp", "2", "--batch", "2", "--micro-batch", "1"),
        "--micro-batch 1 of --batch 2 accumulates 2, estimated only",
    ),
    (("--measure", "--batch", "2", "--micro-batch", "1"), "--measure of one device runs the"),
    (("--tp", "2", "-L", "64,128"), "one --seq-len"),
    (("--tp", "2", "--context-len", "8"), "cross-attention (--context-len)"),
    (("--tp", "2", "--dropout", "0.1", "--train", "--impl", "math"), "attention dropout"),
    (("--tp", "2", "--pos", "alibi"), "--tp with ALiBi is not modelled yet"),
    (("--tp", "2", "--budget", "1GiB", "--fit"), "give --budget SIZE or --fit, not both"),
    (("--tp", "2", "--budget", "lots"), "cannot read size 'lots'"),
]


@pytest.mark.parametrize(("args", "message"), REFUSALS)
def test_each_refusal_is_one_line_exit_2_nothing_on_stdout(invoke, args, message):
    result = invoke("memory", *args)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnctl: error: "), result.stderr
    assert message in lines[0]


def test_a_model_refusal_names_its_heads(invoke, llama):
    result = invoke("memory", "--model", llama, "--tp", "3")
    assert result.exit_code == 2 and result.stdout == ""
    assert "--tp 3 does not divide the 32 attention heads" in result.stderr
    result = invoke("memory", "--model", llama, "--pp", "33")
    assert "--pp 33 is more pipeline stages than the 32 blocks" in result.stderr
    result = invoke("memory", "--model", llama, "--tp", "2", "--generate", "4")
    assert result.exit_code == 2 and "--generate with a split" in result.stderr


def test_help_names_every_split_option_at_60_columns(invoke):
    result = invoke("memory", "--help", columns=60)
    assert result.exit_code == 0
    assert all(len(line) <= 60 for line in result.output.splitlines())
    for option in ("--tp", "--sp", "--cp", "--pp", "--dp", "--zero", "--micro-batch"):
        assert option in result.output
    assert "--recompute" in result.output and "selective" in result.output


# ---------------------------------------------------------------- one device, exactly


def _layer(**values):
    return build_config(None, **values)


def _split(layer, layout, train=False, layers=1, model=None) -> Split:
    description = model.with_run(layer) if model is not None else seeded_model(layer, 9000)
    return Split(layer, model, description, layout, train, layers)


LAYERS = st.fixed_dictionaries(
    {
        "d_model": st.sampled_from([32, 64]),
        "heads": st.sampled_from([2, 4]),
        "norm": st.sampled_from(["pre", "post"]),
        "pos": st.sampled_from(["sinusoidal", "learned", "rope"]),
        "mask": st.sampled_from(["none", "causal"]),
        "bias": st.booleans(),
        "dtype": st.sampled_from(["float32", "float16", "bfloat16"]),
        "impl": st.sampled_from(["math", "sdpa"]),
    }
)


@FAST
@given(
    values=LAYERS,
    length=st.integers(1, 24),
    batch=st.integers(1, 3),
    layers=st.integers(1, 3),
    train=st.booleans(),
)
def test_one_device_layout_equals_the_single_device_estimate(values, length, batch, layers, train):
    """T = C = P = D = 1: weights, activations, KV cache (and the training state and the
    saved activations) are the single-device estimate's, to the byte."""
    layer = _layer(**values)
    plan = sized_plan(layer, length, batch)
    split = Split(layer, None, plan.description, Layout(), train, layers)
    (row,) = split.per_device(length, batch, 1, length, batch)
    single = estimate(plan, layers)
    if train:
        training = estimate_training(plan, layers)
        assert row.weights_bytes == training.parameter_bytes
        assert row.gradients_bytes == training.gradient_bytes
        assert row.optimizer_bytes == training.optimizer_bytes + training.master_bytes
        assert row.master_bytes == training.master_bytes
        assert row.activations_bytes == training.saved_bytes
        assert row.kv_cache_bytes == 0
        # the step's peak is the replay's, phase by phase (not the sum of the parts)
        assert row.peak_bytes == training.peak_bytes
        assert row.phase_peak_bytes == tuple(
            training.parameter_bytes + peak for peak in training.phase_peak_bytes
        )
        assert row.peak_phase == training.peak_phase
    else:
        assert row.weights_bytes == single.parameter_bytes
        assert row.activations_bytes == single.peak_activation_bytes
        assert row.kv_cache_bytes == kv_cache_bytes(plan, length, layers)
        assert row.peak_bytes == single.peak_bytes + row.kv_cache_bytes
    assert (row.kind, row.blocks, row.in_flight) == ("all", (0, layers - 1), 1)


@FAST
@given(
    values=LAYERS,
    length=st.integers(1, 24),
    batch=st.integers(1, 3),
    layers=st.integers(1, 3),
    copies=st.integers(2, 8),
)
def test_data_parallel_copies_train_as_one_device(values, length, batch, layers, copies):
    """--dp D, ZeRO 0: every copy runs the single-device step, so its peak is the
    single-device replay's to the byte, phase by phase (the backward's transients with it)."""
    layer = _layer(**values)
    plan = sized_plan(layer, length, batch)
    split = Split(layer, None, plan.description, Layout(dp=copies), True, layers)
    (row,) = split.per_device(length, batch, 1, length, batch)
    training = estimate_training(plan, layers)
    assert row.peak_bytes == training.peak_bytes
    assert row.phase_peak_bytes == tuple(
        training.parameter_bytes + peak for peak in training.phase_peak_bytes
    )


def test_the_cli_dp_training_peak_is_the_one_device_peak(invoke, llama):
    """`memory --dp 4 --train` said 185.36 MiB per device beside 413.36 MiB on one device
    (the parts summed, the backward's transients left out); a tall stack and header-only
    Llama-2-7B too."""
    for args in (("--dp", "4"), ("--dp", "2", "--layers", "3", "-L", "64"),
                 ("--dp", "2", "--model", llama, "-L", "256")):  # fmt: skip
        document = _json(invoke, *args, "--train")
        (device,) = document["per_device"]
        (whole,) = document["results"]
        assert device["peak_bytes"] == whole["training_bytes"]
        assert device["peak_phase"] == whole["training"]["peak_phase"]


def test_a_tall_data_parallel_stack_trains_as_one_device():
    """Above the replay's exact height the single-device phases are carried on along a
    line; a DP copy's are carried on the same way (70 blocks), and a stage's replay is
    kept between calls (--budget)."""
    layer = _layer(d_model=32, heads=2, mask="causal", pos="rope", norm="pre")
    plan = sized_plan(layer, 12, 1)
    split = Split(layer, None, plan.description, Layout(dp=3), True, 70)
    (row,) = split.per_device(12, 1, 1, 12, 1)
    assert row.peak_bytes == estimate_training(plan, 70).peak_bytes
    assert list(split._steps) == [(12, 1, 70, None, None)]  # no ZeRO shard, no units
    split.per_device(12, 1, 1, 12, 1)
    assert len(split._steps) == 1


def test_the_second_step_holds_the_moments_through_the_forward_and_backward():
    layer = _layer(d_model=64, heads=4, dtype="bfloat16")
    split = _split(layer, Layout(pp=2, dp=2, zero=1), train=True, layers=4)
    stages = split.per_device(512, 2, 2, 512, 4)  # the backward the busiest
    moments = [row.optimizer_bytes - row.master_bytes for row in stages]
    expected = max(
        max(row.phase_peak_bytes[0] + m, row.phase_peak_bytes[1] + m, row.phase_peak_bytes[2])
        for row, m in zip(stages, moments, strict=True)
    )
    assert steady_peak(stages) == expected > max(row.peak_bytes for row in stages)
    assert any(format_bytes(expected) in note for note in split.notes(stages, 2))


def test_zero_takes_its_shards_out_of_every_phase():
    """ZeRO 1 shards the masters (every phase) and the moments (the optimizer step), 2 the
    gradients too (reduce-scattered as they arrive), 3 the weights too (each unit
    gathered while it is read): the optimizer step only falls; the forward falls by
    exactly what was sharded of what it holds, and under ZeRO 3 rises by the unit
    gathered at its peak (the embeddings' or a block's)."""
    layer = _layer(d_model=64, heads=4, dtype="bfloat16")
    splits = [_split(layer, Layout(dp=4, zero=zero), train=True, layers=3) for zero in range(4)]
    zero0, zero1, zero2, zero3 = [split.per_device(16, 2, 1, 16, 2)[0] for split in splits]
    assert all(a <= b for a, b in zip(zero1.phase_peak_bytes, zero0.phase_peak_bytes, strict=True))
    steps = [row.phase_peak_bytes[2] for row in (zero0, zero1, zero2, zero3)]
    assert steps == sorted(steps, reverse=True) and len(set(steps)) == 4
    # from the first gradient on ZeRO 2 holds its shard, where ZeRO 1 holds the gradients
    # made so far: early in the backward (the peak, here) that can be more
    assert zero2.phase_peak_bytes[1] <= zero1.phase_peak_bytes[1] + zero2.gradients_bytes
    assert zero1.phase_peak_bytes[0] == zero0.phase_peak_bytes[0] - (
        zero0.master_bytes - zero1.master_bytes
    )
    # ZeRO 2's shard is made by the first gradient's hook: the forward is ZeRO 1's; the
    # backward frees each gradient once it is reduce-scattered into the shard
    assert zero2.phase_peak_bytes[0] == zero1.phase_peak_bytes[0]
    assert zero2.phase_peak_bytes[2] == zero1.phase_peak_bytes[2] - (
        zero1.gradients_bytes - zero2.gradients_bytes
    )
    units = splits[3].unit_bytes(0)  # the embeddings' (here the larger), a block's
    assert zero3.gathered_bytes == units[0] > units[1]  # the largest unit
    sharded = zero2.phase_peak_bytes[0] - (zero2.weights_bytes - zero3.weights_bytes)
    assert sharded + min(units) <= zero3.phase_peak_bytes[0] <= sharded + max(units)


def test_micro_batches_in_flight_and_accumulated_gradients_join_the_step():
    """Stage 0 of 3 holds the saved activations of the other micro-batches in flight
    during its forward and backward; with more micro-batches a step than in flight, the
    gradients of the earlier ones are held too."""
    layer = _layer(d_model=64, heads=4)
    split = _split(layer, Layout(pp=3), train=True, layers=6)
    alone, three, four = (split.per_device(16, 2, m, 16, 2 * m)[0] for m in (1, 3, 4))
    assert (alone.in_flight, three.in_flight, four.in_flight) == (1, 3, 3)
    for phase in (0, 1):
        assert three.phase_peak_bytes[phase] - alone.phase_peak_bytes[phase] == (
            2 * alone.activations_bytes
        )
        assert four.phase_peak_bytes[phase] - three.phase_peak_bytes[phase] == (
            three.gradients_bytes
        )
    assert alone.phase_peak_bytes[2] == three.phase_peak_bytes[2] == four.phase_peak_bytes[2]


def test_a_model_on_one_device_equals_its_estimate(llama):
    model = read_model(llama)
    layer = model.layer_config(dtype="float16", impl="math")
    plan = sized_plan(layer, 256, 2, model=model)
    for train in (False, True):
        (row,) = _split(layer, Layout(), train, model=model).per_device(256, 2, 1, 256, 2)
        if train:
            training = estimate_training(plan)
            assert row.gradients_bytes == training.gradient_bytes
            assert row.optimizer_bytes == training.optimizer_bytes + training.master_bytes
            assert row.activations_bytes == training.saved_bytes
            assert row.peak_bytes == training.peak_bytes
            assert row.phase_peak_bytes == tuple(
                training.parameter_bytes + peak for peak in training.phase_peak_bytes
            )
        else:
            assert row.weights_bytes == estimate(plan).parameter_bytes
            assert row.activations_bytes == estimate(plan).peak_activation_bytes


def test_the_cli_split_over_copies_alone_keeps_the_single_device_numbers(invoke):
    """--dp 2 without ZeRO: each copy holds what one device holds."""
    document = _json(invoke, "--dp", "2", "-L", "48", "--layers", "2")
    (device,) = document["per_device"]
    (whole,) = document["results"]
    assert device["weights_bytes"] == whole["parameters_bytes"]
    assert device["activations_bytes"] == whole["peak_activation_bytes"]
    assert device["kv_cache_bytes"] == whole["kv_cache_bytes"]
    assert device["peak_bytes"] == whole["peak_bytes"] + whole["kv_cache_bytes"]
    assert document["layout"]["devices"] == 2 and document["measured_per_rank"] is None
    plain = _json(invoke, "-L", "48")
    assert plain["per_device"] is None and plain["layout"] is None
    assert plain.keys() == document.keys()


# ---------------------------------------------------------------- the weights' shares


def _seeded_extras(layer, tp: int, layers: int, vocab: int) -> int:
    """What T ranks hold beyond the whole layer: the replicated weights' copies, the kv
    heads' replicas, the vocabulary's pad rows (worked out here from the config)."""
    d, kv, d_k = layer.d_model, layer.kv_heads, layer.d_k
    per_layer = 2 * d if layer.norm != "none" else 0  # the norm's weight and bias
    if layer.bias and layer.output_bias:
        per_layer += d  # W_o's bias
    extra = (tp - 1) * per_layer * layers
    if layer.pos == "learned":
        extra += (tp - 1) * layer.max_positions * d
    if tp > kv:
        kv_values = 2 * kv * d_k * d + (2 * kv * d_k if layer.bias else 0)
        extra += (tp // kv - 1) * kv_values * layers
    return extra + (tp * vocab_rows(vocab, tp) - vocab) * d


@FAST
@given(
    heads=st.sampled_from([4, 8]),
    kv_heads=st.sampled_from([1, 2, 4]),
    tp=st.sampled_from([1, 2, 4, 8]),
    pp=st.integers(1, 3),
    layers=st.integers(3, 5),
    pos=st.sampled_from(["sinusoidal", "learned"]),
    bias=st.booleans(),
    vocab=st.integers(100, 131),
)
def test_weights_over_every_rank_are_the_whole_plus_the_copies(
    heads, kv_heads, tp, pp, layers, pos, bias, vocab
):
    if heads % tp or kv_heads > heads:
        return
    layer = _layer(d_model=64, heads=heads, kv_heads=kv_heads, pos=pos, bias=bias)
    description = seeded_model(layer, vocab)
    layout = Layout(tp=tp, pp=pp)
    held = sum(
        tp * share.values * share.copies
        for stage in range(pp)
        for share in rank_weights(description, layout, stage, layers)
    )
    parameters = layer_parameters(layer, vocab)
    shared = sum(p.count for p in parameters if p.name.startswith(("embedding.", "positions.")))
    whole = shared + layers * (sum(p.count for p in parameters) - shared)
    assert held == whole + _seeded_extras(layer, tp, layers, vocab)


def test_llama_tp_and_pp_weights_are_the_whole_plus_the_replicated_norms(llama):
    model = read_model(llama)
    layer = model.layer_config(dtype="float16")
    d, blocks = 4096, 32
    whole = 6_738_415_616
    for tp, pp in ((1, 1), (2, 1), (2, 2), (4, 4), (8, 3)):
        split = _split(layer, Layout(tp=tp, pp=pp), model=model)
        held = sum(tp * split.weight_values(stage) for stage in range(pp))
        norms = (2 * blocks + 1) * d  # each block's two RMSNorms and the final one
        assert held == whole + (tp - 1) * norms


def test_the_tied_head_is_copied_to_the_last_stage(gpt2):
    model = read_model(gpt2)
    layer = model.layer_config(dtype="float16")
    split = _split(layer, Layout(tp=2, pp=2), model=model)
    names = [s.name for s in split.shares[1]]
    assert any(name.startswith("lm_head (tied") for name in names)
    tied = next(s for s in split.shares[1] if s.name.startswith("lm_head (tied"))
    assert tied.values == vocab_rows(50257, 2) * 768
    assert any("tied LM head" in note for note in split.notes((), 1))
    # the copy is held but not trained (the step's loss is the last block's output)
    assert split.trained_values(1) == split.weight_values(1) - tied.values - 2 * 768


# ---------------------------------------------------------------- ZeRO


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_llama_tp2_pp2_dp4_zero_stages(llama, zero):
    model = read_model(llama)
    layer = model.layer_config(dtype="bfloat16")
    layout = Layout(tp=2, pp=2, dp=4, zero=zero)
    split = _split(layer, layout, train=True, model=model)
    for stage in (0, 1):
        trained = split.trained_values(stage)
        shard = math.ceil(trained / 4)
        weights, gradients, optimizer, masters, gathered = split.state(stage)
        n = shard if zero else trained
        assert optimizer == 12 * n and masters == 4 * n
        assert gradients == 2 * (shard if zero >= 2 else trained)
        untrained = split.weight_values(stage) - trained
        assert weights == 2 * ((shard if zero == 3 else trained) + untrained)
        # a shard times D covers the whole, padded by less than D values
        assert 0 <= 4 * shard - trained < 4
        if zero == 3:  # a block on one of 2 TP ranks: half its projections, both norms
            block = (4 * 4096 * 4096 + 3 * 4096 * 11008) // 2 + 2 * 4096
            assert gathered == 2 * block
        else:
            assert gathered == 0


@FAST
@given(sizes=st.lists(st.integers(1, 60), min_size=1, max_size=12), ranks=st.integers(1, 40))
def test_zero_pieces_tile_the_flat_buffer(sizes, ranks):
    """Every rank's pieces of Megatron's flat layout: together each tensor once, in order,
    each rank at most S = ⌈n / D⌉ values and exactly S before the padding."""
    total = sum(sizes)
    shard = -(-total // ranks)
    covered = {index: [] for index in range(len(sizes))}
    for rank in range(ranks):
        ranges = zero_ranges(sizes, ranks, rank)
        assert zero_ranges(sizes, ranks, rank, list(itertools.accumulate(sizes))) == ranges
        pieces = zero_pieces(sizes, ranks, rank)
        assert pieces == [end - first for _, first, end in ranges] and all(pieces)
        assert sum(pieces) == max(0, min(shard, total - rank * shard))
        assert [index for index, _, _ in ranges] == sorted({i for i, _, _ in ranges})
        for index, first, end in ranges:
            covered[index].append((first, end))
    assert sum(sum(zero_pieces(sizes, ranks, r)) for r in range(ranks)) == total
    for index, size in enumerate(sizes):  # each tensor cut into consecutive pieces
        bounds = covered[index]
        assert bounds[0][0] == 0 and bounds[-1][1] == size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))


@FAST
@given(sizes=st.lists(st.integers(1, 60), min_size=1, max_size=12), ranks=st.integers(1, 40))
def test_zero_distinct_ranks_hold_every_kind_of_rank(sizes, ranks):
    kinds = {tuple(zero_pieces(sizes, ranks, r)) for r in range(ranks)}
    chosen = zero_distinct_ranks(sizes, ranks)
    assert len(chosen) <= len(sizes) + 3 and all(0 <= r < ranks for r in chosen)
    assert {tuple(zero_pieces(sizes, ranks, r)) for r in chosen} == kinds


def test_zero_distinct_ranks_of_a_million_ranks_are_few():
    sizes = [4096 * 4096, 4096, 11008 * 4096]
    chosen = zero_distinct_ranks(sizes, 2**20)
    assert len(chosen) <= 6
    assert zero_pieces(sizes, 2**20, chosen[-1]) == []  # the padding's rank is among them


@FAST
@given(dp=st.integers(2, 9), zero=st.sampled_from([1, 2, 3]), tp=st.sampled_from([1, 2]))
def test_zero_state_times_the_copies_covers_the_whole(dp, zero, tp):
    layer = _layer(d_model=64, heads=4, dtype="float16")
    whole = _split(layer, Layout(tp=tp), train=True, layers=3)
    sharded = _split(layer, Layout(tp=tp, dp=dp, zero=zero), train=True, layers=3)
    w0, g0, o0, _, _ = whole.state(0)
    w, g, o, _, _ = sharded.state(0)
    assert o * dp >= o0 and o * dp - o0 < 12 * dp
    assert (g * dp >= g0) if zero >= 2 else g == g0
    assert (w * dp >= w0) if zero == 3 else w == w0


@FAST
@given(dp=st.integers(2, 9), zero=st.sampled_from([1, 2, 3]), mixed=st.booleans())
def test_zero_device_is_the_busiest_rank_of_its_pieces(dp, zero, mixed):
    """Under ZeRO each rank's step state is its own pieces' (moments, masters, a step
    count a piece, Adam's temporaries of its largest): the table's device is the busiest
    of every rank, each rank's figures at hand (the measurement compares rank by rank)."""
    from attnctl.replay.step import adam_temporaries

    layer = _layer(d_model=36, heads=4, dtype="bfloat16" if mixed else "float32")
    split = _split(layer, Layout(dp=dp, zero=zero), train=True, layers=2)
    sizes = split.trained_sizes(0)
    ranks = [split.per_device(16, 2, 1, 16, 2, rank=r)[0] for r in range(dp)]
    for rank, row in enumerate(ranks):
        pieces = zero_pieces(sizes, dp, rank)
        assert row.optimizer_bytes == sum(pieces) * (12 if mixed else 8)
        assert row.master_bytes == sum(pieces) * 4 * mixed
        whole = split.rank_optimizer(0, rank)
        assert whole.tensors == len(pieces) and whole.temporaries == adam_temporaries(pieces)
    (device,) = split.per_device(16, 2, 1, 16, 2)
    assert device.peak_bytes == max(row.peak_bytes for row in ranks)
    assert device == next(row for row in ranks if row.peak_bytes == device.peak_bytes)
    steps = {row.phase_peak_bytes[2] for row in ranks}
    assert len(steps) > 1  # 36 · 36 values a matrix: the ranks' pieces differ


def test_context_parallel_ranks_share_the_zero_shards_and_the_sequence():
    """--cp's factors besides ring attention: D·C optimizer shards, L / C positions of the
    cache."""
    layer = _layer(d_model=64, heads=4, dtype="float16")
    split = _split(layer, Layout(cp=2, dp=2, zero=1), train=True, layers=2)
    assert split.state_ranks == 4
    plain = _split(layer, Layout(), layers=2)
    halved = _split(layer, Layout(cp=2), layers=2)
    assert halved.kv_cache_bytes(64, 1, 0) * 2 == plain.kv_cache_bytes(64, 1, 0)
    assert halved.kv_cache_bytes(63, 1, 0) == plain.kv_cache_bytes(64, 1, 0) // 2


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_on_the_cli_is_the_busiest_ring_rank_s_plan(invoke, cp):
    layer = ("--d-model", "64", "--heads", "8", "--kv-heads", "2", "--pos", "rope",
             "--mask", "causal", "--norm", "pre")  # fmt: skip
    document = _json(invoke, *layer, "--cp", str(cp), "-L", "64", "--batch", "2")
    (device,) = document["per_device"]
    single = _json(invoke, *layer, "-L", "64", "--batch", "2")["results"][0]
    assert device["kv_cache_bytes"] * cp == single["kv_cache_bytes"]  # L / C positions
    config = _layer(d_model=64, heads=8, kv_heads=2, pos="rope", mask="causal", norm="pre")
    plans = [
        rank_plan(config, 64, 2, 9000, Layout(cp=cp), cp_rank=r)  # any V
        for r in range(cp)
    ]
    busiest = max(estimate(plan).peak_activation_bytes for plan in plans)
    assert device["activations_bytes"] == busiest
    assert busiest < single["peak_activation_bytes"]


def test_kv_cache_shards_kv_heads_and_replicates_past_them(llama):
    model = read_model(llama)
    layer = model.layer_config(dtype="float16")
    whole = 2 * 3 * 1000 * 32 * 128 * 2  # one block: K and V, B 3, 1000 tokens
    for tp in (1, 2, 4):
        split = _split(layer, Layout(tp=tp, pp=2), model=model)
        assert split.kv_cache_bytes(1000, 3, 0) == 16 * whole // tp
    gqa = _layer(d_model=64, heads=8, kv_heads=2)
    split = _split(gqa, Layout(tp=8), layers=1)
    assert split.kv_cache_bytes(10, 1, 0) == 2 * 10 * 1 * 8 * 4  # one kv-head on each
    assert any("replicated on 4 ranks" in note for note in split.notes((), 1))


# ---------------------------------------------------------------- Korthikanti et al. 2022


def _gpt2_block(gpt2, layout: Layout, length: int = 1024):
    model = read_model(gpt2)
    layer = model.layer_config(dtype="float16", impl="math")
    plan = rank_plan(layer, length, 1, model.vocab_size, layout, model=model)
    return plan, saved_activations(plan)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_korthikanti_without_sequence_parallelism(gpt2, tp):
    """sbh(10 + 24/t + 5as/(ht)) bytes a block, their GPT block in fp16 on the math path.
    attnctl's GPT-2 has no dropout, so their dropout terms are not held (the attention
    dropout's 1-byte mask and 2-byte output, 3as²b/t; the two sbh masks after the
    attention and the MLP); it keeps what they leave out: the causal mask masked_fill
    keeps (L·L bools a block) and each LayerNorm's mean and rstd (2·b·s in fp16)."""
    s, b, h, a = 1024, 1, 768, 12
    _, saved = _gpt2_block(gpt2, Layout(tp=tp))
    formula = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    dropout = 3 * a * s * s * b / tp + 2 * s * b * h
    kept = s * s + 2 * (2 * b * s * 2)
    assert saved.block_bytes == formula - dropout + kept
    # GPT-2 small at s = 1024: about 40 % of the formula is dropout's
    assert round(dropout / formula, 2) == {1: 0.44, 2: 0.42, 4: 0.39}[tp]


@pytest.mark.parametrize("tp", [2, 4])
def test_korthikanti_with_sequence_parallelism(gpt2, tp):
    """(sbh/t)(34 + 5as/h): all divided by t. attnctl's column-parallel projections keep
    each rank's L/T tokens and gather them again in the backward, as Megatron's do: the
    all-gathered (B, L, D) is not kept."""
    s, b, h, a = 1024, 1, 768, 12
    plan, saved = _gpt2_block(gpt2, Layout(tp=tp, sp=True))
    formula = s * b * h / tp * (34 + 5 * a * s / h)
    dropout = (3 * a * s * s * b + 2 * s * b * h) / tp
    kept = s * s + 2 * (2 * b * s * 2) / tp
    assert saved.block_bytes == formula - dropout + kept
    # selective recompute: 34sbh/t, less the two dropout masks; no B·H·L·L kept
    selective = saved.block_bytes - attention_matrix_bytes(plan, saved.block_by_stage)
    assert selective == 34 * s * b * h / tp - 2 * s * b * h / tp + 2 * (2 * b * s * 2) / tp


def test_recompute_on_the_cli(invoke, gpt2):
    base = ("--model", gpt2, "--dtype", "float16", "--impl", "math", "--train", "-L", "256")
    plan, saved = _gpt2_block(gpt2, Layout(tp=2, sp=True), 256)
    matrices = attention_matrix_bytes(plan, saved.block_by_stage)
    for recompute, expected in (
        ("none", saved.total(12)),
        ("selective", saved.total(12) - 12 * matrices + matrices),
        (
            "full",
            # each block's input, and one block's saved set in its backward, which holds
            # that block's input already (the recomputed norm saves the same storage)
            saved.embedding_bytes
            + 12 * (128 * 768 * 2)
            + saved.loss_bytes
            + saved.block_bytes
            - 128 * 768 * 2,
        ),
    ):
        document = _json(invoke, *base, "--tp", "2", "--sp", "--recompute", recompute)
        (device,) = document["per_device"]
        assert device["activations_bytes"] == expected, recompute


# ---------------------------------------------------------------- pipelines


def test_uneven_pipeline_stages_are_named_and_1f1b_holds_p_minus_p(invoke):
    args = ("--layers", "5", "--pp", "3", "--train", "--batch", "8", "--micro-batch", "2")
    document = _json(invoke, *args, "-L", "32")
    stages = document["per_device"]
    assert [d["kind"] for d in stages] == ["first", "middle", "last"]
    assert [d["blocks"] for d in stages] == [[0, 1], [2, 3], [4, 4]]
    assert [d["micro_batches_in_flight"] for d in stages] == [3, 2, 1]
    assert document["layout"]["micro_batches"] == 4
    text = invoke("memory", *args, "-L", "32").output
    assert "uneven split of 5 blocks over 3 stages" in text
    assert "first stage" in text and "middle stage" in text and "last stage" in text
    two = _json(invoke, "--layers", "4", "--pp", "2", "-L", "32")
    assert [d["kind"] for d in two["per_device"]] == ["first", "last"]


def test_only_the_stages_holding_vocabulary_rows_say_so(llama):
    # the seeded layer's first stage holds the token embedding; Llama's last its LM head
    seeded = invoke_at(("memory", "--layers", "6", "--pp", "3", "--tp", "2"), "200").stdout
    weights = [line for line in seeded.splitlines() if line.startswith("weights")]
    assert ["vocab rows / 2" in line for line in weights] == [True, False, False], weights
    args = ("memory", "--model", llama, "--tp", "8", "--pp", "4", "-L", "512")
    weights = [line for line in invoke_at(args, "200").stdout.splitlines() if "weights " in line]
    assert ["vocab rows / 8" in line for line in weights] == [True, False, True], weights


# ---------------------------------------------------------------- --budget


def test_budget_finds_the_longest_length_and_micro_batch_per_device(invoke, llama):
    args = ("--model", llama, "--tp", "2", "--sp", "--pp", "2", "--dtype", "float16")
    document = _json(invoke, *args, "-L", "512", "--budget", "8GiB")
    fit = document["per_device_fit"]
    budget = 8 * 2**30
    assert fit["budget_bytes"] == budget
    longest = fit["max_seq_len"]
    assert longest % 2 == 0 and longest > 0
    peaks = [
        max(d["peak_bytes"] for d in _json(invoke, *args, "-L", str(n))["per_device"])
        for n in (longest, longest + 2)
    ]
    assert peaks[0] <= budget < peaks[1]
    micro = fit["max_micro_batch"]
    at = [
        max(d["peak_bytes"] for d in _json(invoke, *args, "-L", "512", "-B", str(n))["per_device"])
        for n in (micro, micro + 1)
    ]
    assert at[0] <= budget < at[1]
    assert document["max_seq_len"] is None  # the single-device fit is not asked for


# ---------------------------------------------------------------- the views


@FAST
@given(width=st.integers(min_value=24, max_value=160))
def test_per_device_tables_never_cut_a_number(width):
    args = ("memory", "--layers", "5", "--pp", "3", "--tp", "2", "--sp", "--train", "--dtype",
            "bfloat16", "--dp", "4", "--zero", "3", "--batch", "4", "--micro-batch", "1",
            "-L", "64", "--budget", "64MiB")  # fmt: skip
    document = json_of(args)  # the same at every width: made once
    values = []
    for device in document["per_device"]:
        if device["kind"] == "middle":
            continue  # the busiest middle stage is shown (one here)
        for key in ("weights_bytes", "gradients_bytes", "optimizer_bytes", "gathered_bytes",
                    "activations_bytes", "peak_bytes"):  # fmt: skip
            if device[key]:
                values.append(format_bytes(device[key]))
    result = invoke_at(args, str(width))
    assert result.exit_code == 0, result.output
    assert_fits(result.stdout, width, values)


def test_measured_per_rank_shows_when_a_report_carries_it():
    """A hand-made report's measured list is shown and kept (tests/test_distributed.py
    measures a real one)."""
    from rich.console import Console

    from attnctl.render.json import parallel_fields
    from attnctl.render.json_memory import memory_document

    request = MemoryRequest(LayerRequest(), seq_len="32", layout=Layout(tp=2))
    command = memory_use_case(request)
    measured = [
        {
            "rank": 0,
            "peak_bytes": 1_234_567,
            "measured_peak_bytes": 1_234_000,
            "collective_buffer_bytes": 9_000_000,
        },
        {
            "rank": 1,
            "peak_bytes": 1_234_567,
            "measured_peak_bytes": 1_235_000,
            "collective_buffer_bytes": 9_000_000,
        },
    ]
    parallel = dataclasses.replace(command.parallel, measured_per_rank=measured)
    command = dataclasses.replace(command, parallel=parallel)
    console = Console(width=70, record=True, color_system=None)
    console.print(parallel_view(command, 70))
    text = console.export_text()
    assert "measured on torch.distributed, per rank" in text
    assert "+567 B" in text and "-433 B" in text
    unmeasured_phases = {"phase_peak_bytes": None, "measured_phase_peak_bytes": None}
    expected = [{**entry, **unmeasured_phases} for entry in measured]  # a forward pass's
    assert parallel_fields(parallel)["measured_per_rank"] == expected
    document = json.loads(json.dumps(memory_document(command)))
    json_contract.check(document, "memory")  # the schema takes the list too
    assert document["measured_per_rank"] == expected
    broken = {**document, "measured_per_rank": [{"rank": 0, "peak_bytes": 1}]}
    assert json_contract.problems(broken, "memory")


def test_json_per_device_keys(invoke):
    document = _json(invoke, "--tp", "2", "--pp", "2", "--layers", "3", "--train", "-L", "32")
    keys = {"stage", "kind", "blocks", "weights_bytes", "gradients_bytes", "optimizer_bytes",
            "activations_bytes", "kv_cache_bytes", "peak_bytes"}  # fmt: skip
    for device in document["per_device"]:
        assert keys <= device.keys()
        # training: the peak is the busiest phase of the replayed step, not a sum of parts
        phases = device["phase_peak_bytes"]
        assert device["peak_bytes"] == max(phases.values())
        assert device["peak_phase"].replace(" ", "_") == max(phases, key=phases.get)
        state = ("weights_bytes", "gradients_bytes", "optimizer_bytes")
        assert phases["optimizer_step"] >= sum(device[k] for k in state)
        held = ("weights_bytes", "master_bytes", "gathered_bytes", "activations_bytes")
        assert phases["forward"] >= sum(device[k] for k in held)
    inference = _json(invoke, "--tp", "2", "--pp", "2", "--layers", "3", "-L", "32")
    for device in inference["per_device"]:
        parts = ("weights_bytes", "gradients_bytes", "optimizer_bytes", "gathered_bytes",
                 "activations_bytes", "kv_cache_bytes")  # fmt: skip
        assert device["peak_bytes"] == sum(device[k] for k in parts)
        assert device["phase_peak_bytes"] is None and device["peak_phase"] is None
    assert document["layout"] == {
        "tp": 2, "sp": False, "cp": 1, "pp": 2, "dp": 1, "zero": 0, "micro_batch": 1,
        "recompute": "none", "devices": 4, "micro_batches": 1, "kv_replicas": 1,
    }  # fmt: skip


def test_a_sliding_stack_keeps_its_windows_per_stage():
    """--sliding ssf over 7 layers: the stages' caches add up to the single device's, each
    counted by the pattern (never a loop over the stack's height)."""
    layer = _layer(d_model=64, heads=4, mask="causal", window=8, window_pattern="ssf")
    plan = sized_plan(layer, 20, 2)
    whole = kv_cache_bytes(plan, 20, 7)
    for pp in (1, 2, 3, 7):
        split = _split(layer, Layout(pp=pp), layers=7)
        assert sum(split.kv_cache_bytes(20, 2, stage) for stage in range(pp)) == whole
    tall = _split(layer, Layout(pp=2), layers=10**12)
    start, stop = 10**12 // 2, 10**12  # the last stage's blocks

    def count(rest: int) -> int:  # blocks n of the stage with n % 3 == rest
        return (stop - 1 - rest) // 3 - (start - 1 - rest) // 3

    full = count(2)
    per_token = 2 * 1 * 4 * 16 * 4  # K and V, B 1, 4 kv-heads of 16, float32
    expected = per_token * (8 * (stop - start - full) + 20 * full)
    assert tall.kv_cache_bytes(20, 1, 1) == expected


@FAST
@given(
    values=LAYERS, tp=st.sampled_from([2, 4]), length=st.integers(2, 16), batch=st.integers(1, 2)
)
def test_the_collectives_keep_nothing_for_the_backward(values, tp, length, batch):
    """Tensor parallel alone: a rank's block saves what the same block with H / T heads on
    one device saves (all_reduce adds in place, keeps nothing)."""
    from attnctl.parallel.plan import rank_config
    from attnctl.stages.plan import build_plan

    layer = _layer(**{**values, "heads": 4})
    on_rank = saved_activations(rank_plan(layer, length, batch, 9000, Layout(tp=tp)))
    alone = saved_activations(build_plan(rank_config(layer, tp), length, batch, 9000))
    assert on_rank.block_bytes == alone.block_bytes
    assert on_rank.block_by_stage == alone.block_by_stage


def test_a_negative_kv_cache_is_refused_with_a_split(invoke):
    result = invoke("memory", "--tp", "2", "--kv-cache", "-1")
    assert result.exit_code == 2 and result.stdout == ""
    assert "--kv-cache must be a number of tokens >= 0, got -1" in result.stderr


@pytest.mark.parametrize("width", [40, 55, 100])
def test_each_fit_answer_keeps_its_label_on_a_narrow_terminal(width):
    result = invoke_at(("memory", "--tp", "2", "--budget", "1GiB"), str(width))
    out = result.stdout
    assert re.search(r"longest L at micro-batch 1\s+[\d,]+$", out, re.M), out
    assert re.search(r"largest micro-batch at L=2048\s+[\d,]+$", out, re.M), out
    nothing = invoke_at(("memory", "--tp", "2", "--budget", "16"), str(width)).stdout
    assert "does not fit" in " ".join(nothing.split())
    title = "inference fits in 1.00 GiB on every device"
    assert (title in out.splitlines()) == (width >= len(title)), out  # one line where it fits


def test_the_kv_cache_line_says_what_a_sliding_window_keeps():
    args = ("memory", "--tp", "2", "-L", "64", "--mask", "causal", "--window", "16",
            "--layers", "4", "--sliding", "sf")  # fmt: skip
    out = " ".join(invoke_at(args, "200").stdout.split())
    assert "64 tokens, this rank's kv-heads; a sliding-window block keeps the last 16" in out
    plain = " ".join(invoke_at(("memory", "--tp", "2", "-L", "64"), "200").stdout.split())
    assert "sliding-window" not in plain


def test_measured_ranks_of_tp_and_cp_say_their_place():
    from rich.console import Console

    request = MemoryRequest(
        LayerRequest({"mask": "causal", "pos": "rope"}), seq_len="32", layout=Layout(tp=2, cp=2)
    )
    command = memory_use_case(request)
    measured = [
        {"rank": rank, "peak_bytes": 1000, "measured_peak_bytes": 1000,
         "collective_buffer_bytes": 8}
        for rank in range(4)
    ]  # fmt: skip
    parallel = dataclasses.replace(command.parallel, measured_per_rank=measured)
    console = Console(width=100, record=True, color_system=None)
    console.print(parallel_view(dataclasses.replace(command, parallel=parallel), 100))
    text = console.export_text()
    assert re.search(r"^\s*1\s+CP 0 · TP 1\s", text, re.M), text
    assert re.search(r"^\s*2\s+CP 1 · TP 0\s", text, re.M), text
