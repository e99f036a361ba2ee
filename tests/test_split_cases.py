"""The covering sets the split tests run instead of every case of their grids."""

from __future__ import annotations

import itertools

import pytest
from split_cases import _small_layers, covering

VARIANTS = [{}, {"head_dim": 12}, {"window": 3}, {"kv_heads": 1}]


def _factors(config, sp: bool) -> tuple:
    variant = next(i for i, v in reversed(list(enumerate(VARIANTS)))
                   if all(getattr(config, k) == x for k, x in v.items()))  # fmt: skip
    return (config.norm, config.pos, config.mask, config.impl, variant, sp)


@pytest.mark.parametrize("strength", [1, 2])
def test_every_value_or_pair_of_the_grid_is_in_the_covering_set(strength):
    grid = [(config, sp) for config, _ in _small_layers(VARIANTS) for sp in (False, True)]
    chosen = covering(VARIANTS, strength)
    assert len(chosen) < len(grid) / 4

    def combinations(cases) -> set:
        return {c for case in cases
                for c in itertools.combinations(enumerate(_factors(*case)), strength)}  # fmt: skip

    assert combinations(chosen) == combinations(grid)
    assert covering(VARIANTS, strength) == chosen  # the same cases every run
