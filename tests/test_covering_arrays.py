"""The covering subsets that stand in for slow products meet every interaction."""

from __future__ import annotations

import itertools

from covering_arrays import covering_subset


def test_every_combination_of_the_grid_is_in_a_chosen_case():
    product = itertools.product(range(3), "xy", "pqr", (0, 1))
    grid = [dict(a=a, b=b, c=c, d=d) for a, b, c, d in product]
    for strength in (1, 2, 3):
        chosen = covering_subset(grid, strength)
        assert len(chosen) < len(grid)
        for case in grid:
            for combo in itertools.combinations(case.items(), strength):
                assert any(all(c[k] == v for k, v in combo) for c in chosen), combo


def test_a_combination_the_grid_lacks_is_not_asked_for():
    grid = [dict(a=1, b=1), dict(a=2, b=2)]
    assert covering_subset(grid, 2) == grid
