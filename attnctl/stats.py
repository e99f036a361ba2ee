"""Per-head statistics from the computed weights: what kind of head is this?

Standard library only; it reads the same rows the tables show. For each head, over its
query rows (the text's own tokens), it gives the mean entropy (and its fraction of the
most a row could have), the key that receives the most weight on average, and the mean
weight on common patterns: previous token (i-1), first token (0, an "attention sink"),
itself (i, the diagonal), earlier copies of the same token, and induction (the token
right after an earlier copy of this one). A pattern the input cannot show is None.
"""

from __future__ import annotations

import bisect
import math
import operator
from dataclasses import asdict, dataclass, replace
from typing import Any

from attnctl.trace import Trace

PATTERNS = ("previous", "first", "diagonal", "same_token", "induction")
KIND_THRESHOLD = 0.4  # a pattern holding this much weight on average names the head


@dataclass(frozen=True)
class HeadStats:
    batch_row: int
    head: int
    rows: int  # query rows the figures average over
    entropy: float  # mean over rows, in nats
    entropy_fraction: float  # of the most each row could have (log of its keys); 1 = uniform
    top_key: int  # the key with the largest mean weight
    top_key_text: str
    previous: float | None
    first: float | None
    diagonal: float | None  # weight on itself
    same_token: float | None
    induction: float | None
    layer: int | None = None  # a pretrained model's block

    @property
    def kind(self) -> str:
        """The pattern that dominates, if one holds KIND_THRESHOLD of the weight, else 'mixed'."""
        scores = {p: getattr(self, p) for p in PATTERNS if getattr(self, p) is not None}
        best = max(scores, key=scores.__getitem__, default=None)
        if best is not None and scores[best] >= KIND_THRESHOLD:
            return best
        return "diffuse" if self.entropy_fraction >= 0.9 else "mixed"

    @property
    def strength(self) -> float:
        """The weight its strongest pattern holds: how clear-cut the head is."""
        return max((getattr(self, p) or 0.0) for p in PATTERNS)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kind": self.kind}


def head_stats(trace: Trace) -> list[HeadStats]:
    """Statistics for every computed head of every text, from its own (unpadded) rows."""
    results = []
    for batch_row, tokens in enumerate(trace.tokens):
        keys = tokens if trace.context_tokens is None else trace.context_tokens[batch_row]
        key_count = sum(not t.pad for t in keys)
        query_count = sum(not t.pad for t in tokens)
        self_attention = trace.context_tokens is None
        rows = [(i, r) for i, r in enumerate(trace.attention_rows) if r < query_count]
        if not rows:
            continue
        ids = [t.id for t in keys[:key_count]] if self_attention else None
        where: dict[int, list[int]] = {}  # token id -> its positions, in order
        for position, token in enumerate(ids or ()):
            where.setdefault(token, []).append(position)
        for head_index, head in enumerate(trace.attention_heads):
            matrix = trace.attention[batch_row][head_index]
            if trace.sums is None:
                sums = _row_sums(matrix, rows, key_count)
            else:
                sums = (
                    trace.sums.entropy[batch_row][head_index],
                    trace.sums.support[batch_row][head_index],
                    trace.sums.columns[batch_row][head_index][:key_count],
                )
            stats = _one_head(batch_row, head, matrix, rows, ids, where, keys, sums)
            results.append(stats if trace.layer is None else replace(stats, layer=trace.layer))
    return results


def _row_sums(matrix, rows, key_count) -> tuple[list[float], list[int], list[float]]:
    """Each row's entropy and support, each key's column sum (over the query rows given)."""
    entropy, support = [0.0] * len(matrix), [0] * len(matrix)
    columns = [0.0] * key_count
    for row_index, _ in rows:
        weights = matrix[row_index][:key_count]  # the real keys (no padding)
        columns = list(map(operator.add, columns, weights))  # map: C speed, long rows
        positive = [w for w in weights if w > 0]
        entropy[row_index] = -sum(map(operator.mul, positive, map(math.log, positive)))
        support[row_index] = len(positive)
    return entropy, support, columns


def _one_head(batch_row, head, matrix, rows, ids, where, keys, sums) -> HeadStats:
    """``ids`` and ``where`` (each token's positions): self-attention only; None for a
    context, whose positions do not line up with the queries'. ``sums``: row entropies,
    row supports and column sums (see :func:`_row_sums`)."""
    row_entropy, row_support, column_sums = sums
    key_count = len(column_sums)
    entropies, fractions = [], []
    patterns: dict[str, list[float]] = {p: [] for p in PATTERNS}
    for row_index, query in rows:
        weights = matrix[row_index]
        entropy, support = row_entropy[row_index], row_support[row_index]
        entropies.append(entropy)
        if support > 1:
            fractions.append(entropy / math.log(support))
        patterns["first"].append(weights[0])
        if ids is None:
            continue
        patterns["diagonal"].append(weights[query])
        if query > 0:
            patterns["previous"].append(weights[query - 1])
        positions = where[ids[query]]
        copies = positions[: bisect.bisect_left(positions, query)]  # earlier copies
        if copies:
            patterns["same_token"].append(sum(weights[k] for k in copies))
            after = [k + 1 for k in copies if k + 1 < key_count]
            patterns["induction"].append(sum(weights[k] for k in after))
    top_key = max(range(key_count), key=column_sums.__getitem__)

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    return HeadStats(
        batch_row=batch_row,
        head=head,
        rows=len(rows),
        entropy=sum(entropies) / len(entropies),
        entropy_fraction=mean(fractions) if fractions else 0.0,
        top_key=top_key,
        top_key_text=keys[top_key].text,
        **{p: mean(v) for p, v in patterns.items()},
    )
