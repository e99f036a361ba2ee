"""Which heads and query rows `run` computes weights for. Standard library only.

Long inputs make the full (B, H, L, L) weights huge; `run` computes only the rows and
heads it shows. ``--rows`` takes ``A:B`` (0-based, B excluded), ``last:N``, ``N`` or
``all``, and may be repeated. By default short inputs show every row and long ones
their first and last ``DEFAULT_ROWS // 2``.
"""

from __future__ import annotations

from collections.abc import Sequence

from attnctl.errors import AttnctlError

DEFAULT_ROWS = 32  # query rows shown when --rows is not given
DEFAULT_HEADS_SHOWN = 8  # weight tables printed when --head is not given


def choose_heads(requested: list[int] | None, count: int) -> Sequence[int]:
    """The heads to compute weights for: those asked for, in order, else all of them (a
    range: nothing is made per head before the run has checked what it can afford)."""
    if not requested:
        return range(count)
    for head in requested:
        if not 0 <= head < count:
            raise AttnctlError(f"--head {head} does not exist; heads are 0–{count - 1}")
    return list(dict.fromkeys(requested))


def choose_rows(specs: list[str] | None, seq_len: int) -> list[int]:
    """Query rows to compute, sorted and unique."""
    if not specs:
        if seq_len <= DEFAULT_ROWS:
            return list(range(seq_len))
        half = DEFAULT_ROWS // 2
        return list(range(half)) + list(range(seq_len - half, seq_len))
    rows: set[int] = set()
    for spec in specs:
        rows.update(_parse_rows(spec, seq_len))
    return sorted(rows)


def _parse_rows(spec: str, seq_len: int) -> range:
    """One --rows spec as a range of query rows; every row it names must exist."""
    text = spec.strip()
    last = seq_len - 1
    try:
        if text == "all":
            chosen = range(seq_len)
        elif text.startswith("last:"):
            count = int(text[5:])
            if count <= 0:
                raise ValueError
            chosen = range(seq_len - count, seq_len)
        elif ":" in text:
            start_text, end_text = text.split(":", 1)
            start = int(start_text) if start_text else 0
            end = int(end_text) if end_text else seq_len
            if start < 0 or end <= start:
                raise ValueError
            chosen = range(start, end)
        else:
            index = int(text)
            if index < 0:
                raise ValueError
            chosen = range(index, index + 1)
    except ValueError:
        raise AttnctlError(f"--rows {spec!r} is not A:B, last:N, N or all (A < B, N > 0)") from None
    if chosen.start < 0 or chosen.stop > seq_len:  # never clamped: a typo is not a window
        raise AttnctlError(f"--rows {spec!r} reaches past the input: its query rows are 0–{last}")
    return chosen


def hidden_ranges(shown: list[int], count: int) -> list[tuple[int, int]]:
    """The (first, last) index ranges of 0..count-1 that ``shown`` leaves out."""
    gaps, previous = [], -1
    for index in [*shown, count]:
        if index > previous + 1:
            gaps.append((previous + 1, index - 1))
        previous = index
    return gaps
