"""Per-head statistics on hand-made weights whose patterns are known."""

from __future__ import annotations

import json
import math
from array import array

import pytest

from attnctl.stats import head_stats
from attnctl.trace import Token, Trace

CPU = ("--device", "cpu")


def trace_of(matrices: list[list[list[float]]], ids: list[int]) -> Trace:
    """A one-text trace whose heads have these (L x L) weights."""
    tokens = [Token(i, f"t{i}", p, p + 1) for p, i in enumerate(ids)]
    n = len(ids)
    return Trace(
        tokens=[tokens],
        stages=[],
        attention=[[[array("f", row) for row in matrix] for matrix in matrices]],
        attention_heads=list(range(len(matrices))),
        attention_rows=list(range(n)),
        top_keys=[[[list(range(n)) for _ in range(n)] for _ in matrices]],
        device="cpu",
        tokenizer="test",
        vocab_size=10,
        impl="math",
    )


def one_hot(n: int, target) -> list[list[float]]:
    return [[1.0 if k == target(i) else 0.0 for k in range(n)] for i in range(n)]


IDS = [5, 6, 7, 5, 6]  # "A B C A B": the second A's induction key is position 1 (B)


@pytest.mark.parametrize(
    "target,kind,field",
    [
        (lambda i: i, "diagonal", "diagonal"),
        (lambda i: max(i - 1, 0), "previous", "previous"),
        (lambda i: 0, "first", "first"),
    ],
)
def test_one_hot_heads_are_named_by_their_pattern(target, kind, field):
    (stats,) = head_stats(trace_of([one_hot(5, target)], IDS))
    assert stats.kind == kind
    assert getattr(stats, field) == pytest.approx(1.0)
    assert stats.entropy == 0


def test_induction_and_same_token():
    n = len(IDS)
    matrix = [[1.0 / n] * n for _ in range(n)]
    matrix[3] = [0, 1.0, 0, 0, 0]  # the second A attends to B, the token after the first A
    matrix[4] = [0, 0, 1.0, 0, 0]  # the second B attends to C, the token after the first B
    (stats,) = head_stats(trace_of([matrix], IDS))
    assert stats.induction == pytest.approx(1.0)
    assert stats.same_token == pytest.approx(0.0)
    assert stats.kind == "induction"


def test_uniform_heads_are_diffuse_and_patterns_need_the_input():
    n = 4
    (stats,) = head_stats(trace_of([[[1 / n] * n] * n], [1, 2, 3, 4]))
    assert stats.entropy == pytest.approx(math.log(n), rel=1e-6)
    assert stats.entropy_fraction == pytest.approx(1.0, rel=1e-6)
    assert stats.kind == "diffuse"
    assert stats.same_token is None and stats.induction is None  # no repeated token


def test_stats_in_run_output_and_json(invoke):
    result = invoke("run", "the cat sat on the mat", "--d-model", "64", *CPU)
    assert "heads at a glance" in result.stdout and "induct" in result.stdout
    data = json.loads(
        invoke("run", "the cat sat on the mat", "--d-model", "64", *CPU, "--json").stdout
    )
    stats = data["head_stats"]
    assert [s["head"] for s in stats] == list(range(8))
    for s in stats:
        assert 0 <= s["entropy_fraction"] <= 1 + 1e-6
        assert s["kind"] in (
            "previous",
            "first",
            "diagonal",
            "same_token",
            "induction",
            "mixed",
            "diffuse",
        )
        weights = data["attention"][0][s["head"]]
        mean_first = sum(row[0] for row in weights) / len(weights)
        assert s["first"] == pytest.approx(mean_first, abs=1e-6)


@pytest.mark.parametrize(
    "texts, options",
    [
        (["Are you OK? Are you OK?", "猫吃鱼"], {}),  # padded, with repeated tokens
        (["Are you OK? Are you OK?"], {"rows": [0, 3, 7]}),  # some rows only (sdpa)
        (["the cat eats the fish"], {"context": "猫吃鱼, 猫吃鱼"}),  # cross-attention
    ],
)
def test_the_runs_sums_give_the_same_statistics_as_the_reference(texts, options):
    """run computes entropies and column sums in torch; stats.py's own loops are the oracle."""
    import dataclasses

    from attnctl.model.config import build_config
    from attnctl.nn.runner import run
    from attnctl.text.tokenize import encode_batch

    context = options.get("context")
    config = build_config(device="cpu", d_model=32, heads=4, cross=context is not None)
    both = encode_batch(texts + ([context] * len(texts) if context else []), "bundled")
    batch, contexts = both.split(len(texts))
    [trace] = run(batch, config, rows=options.get("rows"), context=contexts if context else None)
    assert trace.sums is not None
    fast = head_stats(trace)
    reference = head_stats(dataclasses.replace(trace, sums=None))
    assert len(fast) == len(reference) == len(texts) * 4
    for ours, theirs in zip(fast, reference, strict=True):
        for field, value in ours.to_dict().items():
            if isinstance(value, float):
                assert value == pytest.approx(getattr(theirs, field), rel=1e-9, abs=1e-12), field
            else:
                assert value == theirs.to_dict()[field], field
