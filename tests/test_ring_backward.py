"""Ring attention's backward (``nn/ring_attention.RingAttention``) over 2 and 4 gloo
processes: every weight's gradient, summed over the context-parallel ranks (they hold
the same weights, each its L / C tokens), is one device's for the whole sequence, and
each rank's output chunk is one device's. Causal and unmasked rings, grouped and
multi-query K/V, RoPE at the chunk's positions, bfloat16.
"""

from __future__ import annotations

import pytest
import torch
from ring_ranks import Case, declare_rings, probe, setting, token_ids

from attnctl.stages.plan import build_plan

CAUSAL_ROPE = dict(d_model=16, heads=4, mask="causal", pos="rope", norm="pre")
GQA = dict(CAUSAL_ROPE, kv_heads=2, norm_type="rms")
NO_MASK = dict(d_model=16, heads=4, pos="learned")  # post-norm, positions from the table
MQA = dict(d_model=16, heads=2, kv_heads=1, norm="pre", mask="causal", pos="rope")
NARROW = dict(GQA, dtype="bfloat16")

RINGS = declare_rings(__name__, {
    2: [Case(CAUSAL_ROPE, 8, 2, train=True), Case(NO_MASK, 8, 1, train=True),
        Case(MQA, 6, 2, train=True), Case(NARROW, 8, 2, train=True)],
    4: [Case(CAUSAL_ROPE, 8, 2, train=True), Case(GQA, 8, 1, train=True),
        Case(NO_MASK, 8, 2, train=True)],
})  # fmt: skip


@pytest.fixture(scope="module")
def rings(ring_pool):
    return {size: ring_pool.get(__name__, size) for size in RINGS}


def _one_device(case: Case):
    """One device's output (B, L, D) and every weight's gradient of the same loss."""
    from attnctl.nn.model import forward
    from attnctl.nn.weights import model_weights

    config, model, vocab_size = setting(case)
    plan = build_plan(config, case.seq_len, case.batch, vocab_size, model=model)
    torch.manual_seed(config.seed)
    weights = model_weights(plan.description, plan.config, torch.device("cpu"), blocks=None)
    named = {k: v.detach().requires_grad_() for k, v in weights.named.items()}
    ids = token_ids(case, vocab_size)
    output = forward(plan.description, named, ids, last=case.layer, training=True).output
    (output.float() * probe(case, output.shape[-1])).sum().backward()
    gradients = {k: v.grad.float() for k, v in named.items() if v.grad is not None}
    return output.detach().float(), gradients


CASES = [(size, n) for size, cases in RINGS.items() for n in range(len(cases))]


@pytest.mark.parametrize("size,index", CASES, ids=[f"C{s}-{n}" for s, n in CASES])
def test_ring_gradients_summed_over_the_ranks_are_one_devices(rings, size, index):
    case, results = RINGS[size][index], rings[size][index]
    output, expected = _one_device(case)
    exact = case.options.get("dtype", "float32") == "float32"
    gathered = torch.cat([torch.tensor(r.output) for r in results], dim=1)  # (B, L, D)
    torch.testing.assert_close(gathered, output, atol=1e-5 if exact else 3e-2, rtol=0)
    assert set(results[0].gradients) == set(expected)
    for name, gradient in expected.items():
        summed = sum(torch.tensor(r.gradients[name]) for r in results)
        scale = float(gradient.abs().max())
        tolerance = (1e-5 if exact else 2e-2) * max(scale, 1.0)
        torch.testing.assert_close(summed, gradient, atol=tolerance, rtol=0, msg=name)


@pytest.mark.parametrize("size,index", CASES, ids=[f"C{s}-{n}" for s, n in CASES])
def test_each_ranks_training_step_is_its_replay_to_the_byte(rings, size, index):
    """Each rank's step (forward, ring attention's backward, Adam), measured, equals the
    replay of its rank plan (``replay/ring.py``) phase by phase and between one
    gradient and the next."""
    from attnctl.model.layout import Layout
    from attnctl.parallel.plan import rank_plan
    from attnctl.replay.step import estimate_training

    case, results = RINGS[size][index], rings[size][index]
    config, model, vocab_size = setting(case)
    for rank, result in enumerate(results):
        plan = rank_plan(config, case.seq_len, case.batch, vocab_size, Layout(cp=size), model,
                         case.layer, cp_rank=rank)  # fmt: skip
        predicted = estimate_training(plan)
        where = f"rank {rank}"
        assert predicted.phase_peak_bytes == result.phase_peak_bytes, where
        assert predicted.gradient_window_bytes == result.gradient_window_bytes, where
