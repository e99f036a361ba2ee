"""One rank's plan and weights under tensor (and sequence) parallelism, without torch:
what each rank holds adds up to the whole model, and T = 1 is the single device."""

from __future__ import annotations

import json

import pytest
import tiny_models
from hypothesis import given, settings
from hypothesis import strategies as st

from attnctl.errors import AttnctlError
from attnctl.memory.estimate import estimate
from attnctl.model.config import build_config
from attnctl.model.describe import seeded_model
from attnctl.model.families import read_model
from attnctl.model.layout import (
    Layout,
    check_blocks,
    check_layout,
    in_flight,
    kv_replicas,
    parse_stage_sizes,
    rank_heads,
    stage_blocks,
    stage_kind,
)
from attnctl.parallel.plan import check_split, rank_plan, rank_weights
from attnctl.stages.plan import build_plan, model_parameters


def modern(**overrides):
    values = dict(d_model=64, heads=8, kv_heads=2, norm="pre", pos="rope", mask="causal")
    values.update(overrides)
    return build_config(**values)


def test_one_rank_of_one_is_the_single_device_plan():
    config = modern()
    single = build_plan(config, 16, 2, 100)
    split = rank_plan(config, 16, 2, 100, Layout())
    assert split.stages == single.stages
    assert estimate(split) == estimate(single)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_the_attention_core_is_divided_by_t(tp):
    config = modern()
    single = {s.name: s for s in build_plan(config, 16, 2, 100).stages}
    split = {s.name: s for s in rank_plan(config, 16, 2, 100, Layout(tp=tp)).stages}
    for name in ("q", "q_heads", "scores", "weights", "weighted_values", "concat"):
        assert split[name].bytes * tp == single[name].bytes, name
    replicas = kv_replicas(config.kv_heads, tp)
    for name in ("k", "v", "k_rotated"):
        assert split[name].bytes * tp == single[name].bytes * replicas, name
    # the row-parallel output is whole on every rank, summed in place
    assert split["output_projection"].bytes == single["output_projection"].bytes
    assert split["all_reduce"].view_of == "output_projection"
    assert split["scores"].dims == ("B", "H/T", "L", "L")
    # kv-heads divided, one replicated kv-head, or one of each a rank (no groups left)
    expected = {2: "Hkv/T", 4: "1", 8: "H/T"}[tp]
    assert split["k_heads"].dims == ("B", expected, "L", "d_k")


def test_sequence_parallel_holds_l_over_t_between_the_sublayers():
    plan = rank_plan(modern(), 16, 1, 100, Layout(tp=4, sp=True))
    stages = {s.name: s for s in plan.stages}
    assert stages["norm"].dims == ("B", "L/T", "D") and stages["norm"].shape == (1, 4, 64)
    assert stages["all_gather"].shape == (1, 16, 64)  # the whole sequence, gathered
    assert stages["reduce_scatter"].shape == (1, 4, 64)
    assert stages["residual"].shape == (1, 4, 64)
    assert stages["embedding_reduce_scatter"].shape == (1, 4, 64)
    names = [s.name for s in plan.stages]
    assert names.index("all_gather") == names.index("norm") + 1
    assert "all_reduce" not in names


def test_a_rank_of_a_feed_forward_block_splits_its_columns(tmp_path):
    folder = tiny_models.write_header_only("llama-2-7b", tmp_path / "llama")
    model = read_model(folder)
    config = model.layer_config()
    single = {s.name: s for s in build_plan(config, 8, 1, model.vocab_size, model=model).stages}
    plan = rank_plan(config, 8, 1, model.vocab_size, Layout(tp=4), model=model, layer_index=1)
    split = {s.name: s for s in plan.stages}
    assert split["ffn_up"].bytes * 4 == single["ffn_up"].bytes
    assert split["ffn_up"].dims == ("B", "L", "I/T")
    assert split["ffn_down"].bytes == single["ffn_down"].bytes
    assert split["ffn_all_reduce"].view_of == "ffn_down"
    assert split["hidden"].dims == ("B", "L", "D")


@pytest.mark.parametrize(
    "name", ["gpt2-small", "llama-3.2-1b", "phi-3-mini-4k", "qwen3-0.6b", "gemma-2-2b"]
)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_rank_and_stage_together_hold_the_model_and_the_replicas(name, tp, tmp_path):
    model = read_model(tiny_models.write_header_only(name, tmp_path / name))
    whole = sum(p.count for p in model_parameters(model))
    for pp in (1, 2):
        layout = Layout(tp=tp, pp=pp)
        check_split(layout, model, [8])
        held = replicated = 0
        for stage in range(pp):
            for share in rank_weights(model, layout, stage):
                held += share.values * tp
                if share.rule == "replicated":
                    replicated += share.values * (tp - 1)
                elif "kv-head, on" in share.rule:
                    copies = kv_replicas(model.kv_heads, tp)  # each kv-head on this many
                    replicated += share.values * tp - share.values * tp // copies
                elif share.rule == "vocab rows ⌈V/T⌉":  # the pad rows to a multiple of T
                    rows = -(-share.shape[0] // tp)
                    replicated += (rows * tp - share.shape[0]) * (share.values // rows)
        tied_copy = 0
        if pp > 1 and model.head is not None and model.head.tied:
            tied_copy = model.vocab_size * model.hidden
        assert held - replicated - tied_copy == whole


@given(
    heads_per_kv=st.integers(1, 4),
    kv_heads=st.sampled_from([1, 2, 4, 8]),
    tp=st.sampled_from([1, 2, 4, 8]),
)
@settings(max_examples=60, deadline=None)
def test_each_query_head_lives_on_one_rank_with_its_kv_head(heads_per_kv, kv_heads, tp):
    heads = heads_per_kv * kv_heads
    if heads % tp or (kv_heads % tp and tp % kv_heads):
        with pytest.raises(AttnctlError, match="--tp"):
            check_split(Layout(tp=tp), seeded_model(modern(heads=heads, kv_heads=kv_heads,
                                                         d_model=8 * heads), 10), [8])  # fmt: skip
        return
    owners: dict[int, int] = {}
    for rank in range(tp):
        queries, kv = rank_heads(heads, kv_heads, tp, rank)
        for head in queries:
            assert head not in owners
            owners[head] = rank
            assert head // heads_per_kv in kv  # the kv-head this query head reads is here
    assert sorted(owners) == list(range(heads))


def test_pipeline_stages_split_the_blocks_first_stages_longer():
    assert stage_blocks(10, 4) == (range(0, 3), range(3, 6), range(6, 8), range(8, 10))
    assert stage_blocks(8, 4) == tuple(range(n, n + 2) for n in (0, 2, 4, 6))
    assert [stage_kind(s, 3) for s in range(3)] == ["first", "middle", "last"]
    assert stage_kind(0, 1) == "all"
    assert [in_flight(s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight(0, 4, 2) == 2


@pytest.mark.parametrize(
    "layout,train,message",
    [
        (Layout(tp=0), False, "--tp must be a positive integer"),
        (Layout(zero=1), True, "--zero 1 shards over the data-parallel copies: give --dp 2"),
        (Layout(dp=2, zero=2), False, "add --train"),
        (Layout(zero=4, dp=2), True, "--zero must be 0, 1, 2 or 3"),
        (Layout(sp=True), False, "--sp splits the sequence over the --tp ranks"),
        (Layout(recompute="full"), False, "add --train"),
        (Layout(recompute="some"), True, "--recompute must be one of"),
        (Layout(micro_batch=0), False, "--micro-batch must be a positive integer"),
        (Layout(tp=1 << 21), False, "more than 1,048,576 devices"),
    ],
)
def test_options_that_cannot_make_a_layout_are_refused_by_name(layout, train, message):
    with pytest.raises(AttnctlError, match=message.replace("(", r"\(")):
        check_layout(layout, train=train)


def test_measure_refuses_what_it_cannot_start():
    with pytest.raises(AttnctlError, match="at most 64"):
        check_layout(Layout(tp=16, cp=8), train=False, measure=True)
    with pytest.raises(AttnctlError, match="--pp is estimated only"):
        check_layout(Layout(pp=2), train=False, measure=True)


@pytest.mark.parametrize(
    "layout,lengths,message",
    [
        (Layout(tp=3), [8], "--tp 3 does not divide the 8 attention heads"),
        (Layout(tp=4), [8], None),  # 2 kv-heads, each on 2 ranks
        (Layout(tp=2, sp=True), [7], "--sp with --tp 2 does not divide the length 7"),
        (Layout(cp=3), [8], "--cp 3 does not divide the length 8"),
        (Layout(pp=2), [8], "--pp 2 is more pipeline stages than the 1 block"),
    ],
)
def test_splits_the_model_cannot_take_are_refused_by_name(layout, lengths, message):
    model = seeded_model(modern(), 100)
    if message is None:
        check_split(layout, model, lengths)
        return
    with pytest.raises(AttnctlError, match=message):
        check_split(layout, model, lengths)


def test_kv_heads_neither_dividing_nor_divided_by_t_are_refused():
    model = seeded_model(modern(d_model=96, heads=12, kv_heads=6), 100)
    with pytest.raises(AttnctlError, match="--tp 4 and the 6 kv-heads: T must divide them"):
        check_split(Layout(tp=4), model, [8])


def test_what_a_split_does_not_model_is_refused_by_name():
    with pytest.raises(AttnctlError, match="ALiBi"):
        check_split(Layout(tp=2), seeded_model(modern(pos="alibi"), 10), [8])
    with pytest.raises(AttnctlError, match="OLMo 2"):
        check_split(Layout(tp=2), seeded_model(modern(qk_norm="all"), 10), [8])


def test_pipeline_stages_can_be_given_their_blocks():
    assert parse_stage_sizes("7,8x2,7") == (7, 8, 8, 7)
    layout = Layout(pp=4, pp_blocks=(7, 8, 8, 7))
    check_blocks(layout, 30)
    assert layout.stage_ranges(30) == (range(0, 7), range(7, 15), range(15, 23), range(23, 30))


@pytest.mark.parametrize(
    "text,message",
    [
        ("1,2x,3", "cannot read --pp-blocks"),
        ("a", "cannot read --pp-blocks"),
        ("0,4", "every stage needs one block at least"),
        ("2x0", "every stage needs one block at least"),
        ("2x1000000000000", "more than 1,048,576 stages"),
    ],
)
def test_unreadable_stage_blocks_are_refused(text, message):
    with pytest.raises(AttnctlError, match=message):
        parse_stage_sizes(text)


def test_stage_blocks_must_match_the_stages_and_the_blocks(invoke):
    with pytest.raises(AttnctlError, match="gives 4 stages and --pp 3"):
        check_blocks(Layout(pp=3, pp_blocks=(1, 1, 1, 1)), 4)
    with pytest.raises(AttnctlError, match="adds up to 4 blocks; the model has 5 blocks"):
        check_blocks(Layout(pp=4, pp_blocks=(1, 1, 1, 1)), 5)
    result = invoke("memory", "-L", "8", "--layers", "6", "--pp-blocks", "1,3,2", "--json")
    assert result.exit_code == 0, result.output
    blocks = [device["blocks"] for device in json.loads(result.stdout)["per_device"]]
    assert blocks == [[0, 0], [1, 3], [4, 5]]
    refused = invoke("memory", "-L", "8", "--layers", "6", "--pp-blocks", "2,2")
    assert refused.exit_code == 2 and refused.stdout == ""
    assert "adds up to 4 blocks; the model has 6 blocks" in refused.stderr


def test_a_weight_no_block_reads_is_held_by_the_last_stage(tmp_path):
    model = read_model(tiny_models.write_header_only("bert-base", tmp_path / "bert"))
    whole = sum(p.count for p in model_parameters(model))
    layout = Layout(pp=2)
    held = sum(share.values for stage in (0, 1) for share in rank_weights(model, layout, stage))
    assert held == whole  # the pooler too
    last = {share.name for share in rank_weights(model, layout, 1)}
    assert any("pooler" in name for name in last)
