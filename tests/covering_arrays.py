"""A covering subset of a grid of option dicts: every ``strength`` values of as many
options that the grid holds together appear together in at least one chosen case, so a
slow check runs on a fraction of a product and still meets every such interaction."""

from __future__ import annotations

import itertools


def covering_subset(cases: list[dict], strength: int) -> list[dict]:
    """Greedy (the case covering most of what is left first, ties to the earliest), so
    the same cases every run; every combination present in ``cases`` is covered."""

    def combinations(case: dict) -> set[tuple]:
        return set(itertools.combinations(sorted(case.items(), key=str), strength))

    left = set().union(*(combinations(case) for case in cases))
    chosen = []
    while left:
        best = max(cases, key=lambda case: len(combinations(case) & left))
        left -= combinations(best)
        chosen.append(best)
    return chosen
