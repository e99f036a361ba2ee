"""Properties of the query-row window (--rows) and the ranges it hides."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnctl.errors import AttnctlError
from attnctl.window import DEFAULT_ROWS, choose_rows, hidden_ranges

lengths = st.integers(1, 5000)


@given(lengths)
def test_default_window_is_everything_or_both_ends(seq_len):
    rows = choose_rows(None, seq_len)
    if seq_len <= DEFAULT_ROWS:
        assert rows == list(range(seq_len))
    else:
        half = DEFAULT_ROWS // 2
        assert rows == [*range(half), *range(seq_len - half, seq_len)]


@given(seq_len=lengths, start=st.integers(0, 6000), size=st.integers(1, 6000))
def test_a_slice_selects_exactly_its_rows_or_fails(seq_len, start, size):
    spec = f"{start}:{start + size}"
    if start + size > seq_len:  # never clamped, however far past the input it reaches
        with pytest.raises(AttnctlError, match=r"reaches past the input: its query rows are 0–"):
            choose_rows([spec], seq_len)
    else:
        assert choose_rows([spec], seq_len) == list(range(start, start + size))


@pytest.mark.parametrize("spec", ["0:11", f"0:{10**30}", "999", f"{10**30}", "last:11", "3:11"])
def test_rows_past_the_input_are_refused_alike(spec):
    with pytest.raises(AttnctlError) as caught:
        choose_rows([spec], 10)
    assert caught.value.message == f"--rows {spec!r} reaches past the input: its query rows are 0–9"
    assert choose_rows(["0:10", "last:10", "9"], 10) == list(range(10))


@given(seq_len=lengths, specs=st.lists(st.integers(1, 100).map(lambda n: f"last:{n}"), max_size=3))
def test_rows_are_sorted_unique_and_in_range(seq_len, specs):
    if any(int(spec[5:]) > seq_len for spec in specs):
        with pytest.raises(AttnctlError, match="reaches past the input"):
            choose_rows(specs, seq_len)
        return
    rows = choose_rows(specs or None, seq_len)
    assert rows == sorted(set(rows)) and all(0 <= r < seq_len for r in rows)


@given(seq_len=lengths, data=st.data())
def test_hidden_ranges_are_the_complement(seq_len, data):
    shown = sorted(set(data.draw(st.lists(st.integers(0, seq_len - 1), max_size=40))))
    hidden = {i for a, b in hidden_ranges(shown, seq_len) for i in range(a, b + 1)}
    assert hidden == set(range(seq_len)) - set(shown)
