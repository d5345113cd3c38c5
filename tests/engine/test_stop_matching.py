"""Stop strings are matched incrementally: scanning only the new text (and a stop's length before it)
finds exactly what a full scan finds, and streams hold back exactly the tail that could start a stop."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.llm_engine import _first_stop
from model.chat_parse import held_back

pieces = st.lists(st.text("abc", max_size=4), min_size=1, max_size=30)
stops = st.lists(st.text("abc", min_size=1, max_size=5), min_size=1, max_size=4).map(tuple)


def naive_first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    return min((i for s in stops if (i := text.find(s)) >= 0), default=None)


@given(pieces, stops)
def test_incremental_stop_search_equals_a_full_scan(parts: list[str], stops: tuple[str, ...]):
    text = ""
    for part in parts:
        text += part
        found = _first_stop(text, len(part), stops)
        assert found == naive_first_stop(text, stops)
        if found is not None:  # the engine finishes the request at the first match
            return


@given(st.text("abc", max_size=12), st.text("abc", min_size=1, max_size=6))
def test_held_back_is_the_longest_proper_prefix_of_the_stop_ending_the_text(text: str, stop: str):
    longest = max((n for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)
    assert held_back(text, stop) == longest
