"""Context parallelism (``--cp``): ring attention over 2 and 4 gloo processes.

Each rank's chunk of the output equals the single-device layer's, and each rank's
measured live storages equal its rank plan's estimate to the byte, stage by stage.
The processes are started once per ring size (``ring_ranks.py``) for every case.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ring_ranks import VOCAB, Case, declare_rings, run_ring, setting, token_ids

from attnctl.errors import AttnctlError
from attnctl.memory.estimate import estimate, kv_cache_bytes
from attnctl.model.config import build_config
from attnctl.model.describe import seeded_model
from attnctl.model.layout import Layout
from attnctl.parallel.plan import check_split, rank_plan
from attnctl.stages.plan import build_plan
from attnctl.stages.ring_attention import last_step, receives, sends

CAUSAL_ROPE = dict(d_model=16, heads=4, mask="causal", pos="rope", norm="pre")
GQA = dict(CAUSAL_ROPE, kv_heads=2, norm_type="rms")
NO_MASK = dict(d_model=16, heads=4, pos="learned")  # post-norm, positions from the table
MQA_SINUSOIDAL = dict(d_model=16, heads=2, kv_heads=1, norm="pre")  # a K/V chunk in order
DYNAMIC = dict(CAUSAL_ROPE, rope_type="dynamic", rope_factor=2.0, rope_original_max_positions=4)
NARROW = dict(GQA, dtype="bfloat16")

RINGS = declare_rings(
    __name__,
    {
        2: [
            Case(CAUSAL_ROPE, 8, 2),
            Case(GQA, 8, 2),
            Case(NO_MASK, 8, 1),
            Case(MQA_SINUSOIDAL, 6, 2),
            Case(DYNAMIC, 8, 1),
            Case(NARROW, 8, 2),
        ],
        4: [Case(CAUSAL_ROPE, 8, 2), Case(GQA, 8, 1), Case(NO_MASK, 8, 1)],
    },
)
EXACT = {"float32"}  # the dtypes whose output is compared with one device's to 1e-5


@pytest.fixture(scope="module")
def rings(ring_pool):
    """{C: results[case][rank]}: each ring run once, for all its cases."""
    return {size: ring_pool.get(__name__, size) for size in RINGS}


def _cases():
    return [(size, n) for size, cases in RINGS.items() for n in range(len(cases))]


def _one_device(case: Case) -> torch.Tensor:
    """The layer's output (a checkpoint's: block ``case.layer``'s) on one device."""
    from attnctl.nn.model import forward
    from attnctl.nn.weights import model_weights

    config, model, vocab_size = setting(case)
    plan = build_plan(config, case.seq_len, case.batch, vocab_size, model=model)
    torch.manual_seed(config.seed)
    weights = model_weights(plan.description, plan.config, torch.device("cpu"), blocks=None)
    ids = token_ids(case, vocab_size)
    with torch.inference_mode():
        return forward(plan.description, weights.named, ids, last=case.layer).output  # (B, L, D)


def _check_output(case: Case, results) -> None:
    """The ranks' chunks of the output, put together, as one device's."""
    gathered = torch.cat([torch.tensor(r.output) for r in results], dim=1)
    expected = _one_device(case).float()  # (B, L, D)
    assert gathered.shape == expected.shape
    tolerance = 1e-5 if case.options.get("dtype", "float32") in EXACT else 3e-2
    torch.testing.assert_close(gathered, expected, atol=tolerance, rtol=0)


def _check_bytes(case: Case, size: int, results) -> None:
    """Each rank's recorded stages and live bytes, stage by stage, as its rank plan's."""
    config, model, vocab_size = setting(case)
    for rank, result in enumerate(results):
        plan = rank_plan(
            config, case.seq_len, case.batch, vocab_size, Layout(cp=size), model, case.layer,
            cp_rank=rank,
        )  # fmt: skip
        predicted = estimate(plan)
        planned = [(s.name, s.shape, s.dtype) for s in plan.stages]
        assert result.stages == planned, f"rank {rank}"
        # a later block's input: its window holds the blocks before it, run in full
        after = next((n + 1 for n, s in enumerate(plan.stages) if s.name == "hidden"), 0)
        measured, estimated = result.stage_peak_bytes[after:], predicted.live_bytes[after:]
        assert measured == estimated, f"rank {rank}"
        assert result.peak_bytes == predicted.peak_activation_bytes, f"rank {rank}"
        assert result.kv_cache_bytes == kv_cache_bytes(plan)  # its L/C tokens, every block


@pytest.mark.parametrize("size,index", _cases(), ids=[f"C{s}-{n}" for s, n in _cases()])
def test_ring_output_equals_one_device(rings, size, index):
    _check_output(RINGS[size][index], rings[size][index])


@pytest.mark.parametrize("size,index", _cases(), ids=[f"C{s}-{n}" for s, n in _cases()])
def test_each_rank_holds_its_plan_to_the_byte(rings, size, index):
    _check_bytes(RINGS[size][index], size, rings[size][index])


def test_a_checkpoints_blocks_under_ring_attention(tmp_path):
    """A tiny Llama (GQA, RoPE, RMSNorm, a gated feed-forward): block 0 with the
    embeddings, and block 1 after it (its input the block before's output)."""
    import tiny_models

    directory = str(tiny_models.write("llama", tmp_path / "llama"))
    cases = [Case({"impl": "math"}, 8, 2, directory, 0), Case({"impl": "math"}, 8, 1, directory, 1)]
    for case, results in zip(cases, run_ring(2, cases), strict=True):
        _check_output(case, results)
        _check_bytes(case, 2, results)


def test_point_to_point_ops_allocate_nothing_the_measure_sees(rings):
    """gloo's send and recv reach the dispatcher as c10d ops returning a work, no
    tensor: they write into the receive buffers the plan counts and allocate nothing
    visible (the bytes above agree to the byte with them in the run)."""
    seen = {op for results in rings.values() for case in results for r in case for op in r.ops}
    assert {op for op in seen if op.startswith("c10d.")} == {
        "c10d.send.default",
        "c10d.recv_.default",
    }


def test_the_default_rank_is_the_busiest():
    for options in (CAUSAL_ROPE, GQA, NO_MASK):
        config = build_config(device="cpu", **options)
        for size in (2, 3, 4, 8):
            layout = Layout(cp=size)
            peaks = [
                estimate(rank_plan(config, 8 * size, 2, VOCAB, layout, cp_rank=r)).peak_bytes
                for r in range(size)
            ]
            assert estimate(rank_plan(config, 8 * size, 2, VOCAB, layout)).peak_bytes == max(peaks)


def test_causal_ranks_skip_the_later_chunks_and_pass_only_what_is_needed():
    config = build_config(device="cpu", **CAUSAL_ROPE)
    layout = Layout(cp=4)
    scored = []
    for rank in range(4):
        names = [s.name for s in rank_plan(config, 16, 1, VOCAB, layout, cp_rank=rank).stages]
        scored.append(sum(n.endswith(".scores") for n in names))
        assert sum(n.endswith(".recv_k") for n in names) == rank  # chunks rank-1 … 0
        assert sum(n.endswith(".sent_k") for n in names) == (0 if rank == 3 else rank + 1)
    assert scored == [1, 2, 3, 4]
    unmasked = build_config(device="cpu", **NO_MASK)
    names = [s.name for s in rank_plan(unmasked, 16, 1, VOCAB, layout, cp_rank=0).stages]
    assert sum(n.endswith(".scores") for n in names) == 4
    assert (
        sum(n.endswith(".recv_k") for n in names) == 3 == sum(n.endswith(".sent_k") for n in names)
    )


@settings(max_examples=60, deadline=None)
@given(ranks=st.integers(2, 40), causal=st.booleans())
def test_the_ring_schedule_brings_each_rank_exactly_the_keys_it_sees(ranks, causal):
    """Simulated over every rank: each step holds the chunk that arrived (or its own),
    every receive meets a send, and rank r scores every chunk, or under the causal
    mask chunks 0 … r, each once."""
    held = {rank: rank for rank in range(ranks)}  # step 0: each its own chunk
    scored: dict[int, list[int]] = {rank: [] for rank in range(ranks)}
    for step in range(ranks):
        arriving = {}
        for rank in range(ranks):
            if step <= last_step(ranks, rank, causal):
                assert held.get(rank) == (rank - step) % ranks
                scored[rank].append(held[rank])
            if sends(ranks, rank, step, causal):
                assert rank in held and step <= last_step(ranks, rank, causal)
                arriving[(rank + 1) % ranks] = held[rank]
        receivers = {r for r in range(ranks) if receives(ranks, r, step, causal)}
        assert receivers == set(arriving)
        held = arriving
    for rank, chunks in scored.items():
        expected = range(rank + 1) if causal else range(ranks)
        assert sorted(chunks) == list(expected)


def test_rank_plan_names_the_chunk_and_divides_with_tp_and_sp():
    config = build_config(device="cpu", d_model=64, heads=8, kv_heads=2, mask="causal", pos="rope")
    plan = rank_plan(config, 32, 2, VOCAB, Layout(tp=2, sp=True, cp=2))
    assert plan.seq_len == 16 and plan.sizes["L/C"] == 16 and plan.sizes["L/(C·T)"] == 8
    dims = {s.name: s.dims for s in plan.stages}
    assert dims["token_ids"] == ("B", "L/C")
    assert dims["residual"] == ("B", "L/(C·T)", "D")
    assert dims["ring0.scores"] == ("B", "H/T", "L/C", "L/C")
    assert dims["ring_k"] == ("B", "Hkv/T", "L/C", "d_k")
    assert not any("L" in s.dims for s in plan.stages)
    whole = build_plan(config, 32, 2, VOCAB)
    assert kv_cache_bytes(plan) * 2 * 2 == kv_cache_bytes(whole)  # L/C tokens, Hkv/T heads


def test_rotary_angles_of_a_chunk_are_the_whole_sequences_rows():
    from attnctl.nn.positions import rotary_angles

    for options in (CAUSAL_ROPE, DYNAMIC):
        config = build_config(**options)
        whole = rotary_angles(12, config.d_k, config=config)  # (L, d_k)
        assert torch.equal(
            rotary_angles(12, config.d_k, config=config, start=4, stop=8), whole[4:8]
        )


@pytest.mark.parametrize(
    "options,padded,message",
    [
        (dict(mask="causal", window=4), False, "--cp with a sliding window is not modelled"),
        (dict(pos="alibi"), False, "--cp with ALiBi is not modelled"),
        (dict(softcap=30.0), False, "--cp with soft-capped scores is not modelled"),
        (dict(dropout=0.1), False, "--cp with attention dropout is not modelled"),
        (dict(impl="sdpa"), False, "--cp with --impl sdpa is not modelled"),
        (dict(), True, "--cp with padded keys is not modelled"),
    ],
)
def test_what_ring_attention_does_not_model_is_refused_by_name(options, padded, message):
    config = build_config(**options)
    description = seeded_model(config, VOCAB)
    with pytest.raises(AttnctlError) as refused:
        check_split(Layout(cp=2), description, [8], padded=padded)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)
    check_split(Layout(), description, [8], padded=padded)  # one device: fine


def test_a_relative_position_bias_is_refused_by_name():
    """T5's bias comes from checkpoints only (encoder–decoders, refused whole): a block
    description with it stands in for a decoder-only model that had one."""
    description = seeded_model(build_config(), VOCAB)
    block = description.blocks[0]
    attention = dataclasses.replace(
        block.attention, config=dataclasses.replace(block.attention.config, pos="relative")
    )
    blocks = (dataclasses.replace(block, sublayers=(attention, *block.sublayers[1:])),)
    relative = dataclasses.replace(description, blocks=blocks)
    with pytest.raises(AttnctlError, match="--cp with T5's relative position bias"):
        check_split(Layout(cp=2), relative, [8])


def test_a_length_the_ranks_do_not_divide_is_refused():
    description = seeded_model(build_config(), VOCAB)
    with pytest.raises(AttnctlError, match="--cp 4 does not divide the length 10"):
        check_split(Layout(cp=4), description, [10])
    with pytest.raises(AttnctlError, match="--cp 512 is more than the 256 ranks"):
        check_split(Layout(cp=512), description, [512 * 8])
    check_split(Layout(cp=2), description, [8])  # (and trains: test_ring_backward.py)
    config = build_config(pos="learned", max_positions=8)
    with pytest.raises(AttnctlError, match="16 is longer than the 8 learned positions"):
        rank_plan(config, 16, 1, VOCAB, Layout(cp=2))  # each chunk fits; the whole does not


def test_the_torch_ring_refuses_what_it_does_not_run():
    """No process group is needed: each refusal comes before anything is sent."""
    from attnctl.nn.layer import AttentionLayer
    from attnctl.nn.ring_attention import Ring, attend, running

    layer = AttentionLayer(build_config(d_model=16, heads=4), VOCAB)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with running(Ring(rank=0, size=2, length=8)), pytest.raises(AttnctlError, match="unpadded"):
        layer(ids, padding=torch.ones(1, 4, dtype=torch.bool))
    windowed = build_config(d_model=16, heads=4, mask="causal", window=2)
    q = torch.zeros(1, 4, 4, 4)
    with pytest.raises(AttnctlError, match="--cp with a sliding window is not modelled yet"):
        attend(windowed, [q, q, q], Ring(0, 2, 8), lambda *_: None)  # the planner's words
