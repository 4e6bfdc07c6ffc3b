"""The scheduler's pure policy: prefix reuse, slot choice and stop strings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from motet.actors.policy import StopMatcher
from motet.runtime.slot_table import SlotView, choose_slot, common_prefix, reusable_prefix

# ---- common_prefix / reusable_prefix ---------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "n"),
    [
        ((), (), 0),
        ((1, 2, 3), (), 0),
        ((1, 2, 3), (1, 2, 3), 3),
        ((1, 2, 3), (1, 2, 3, 4), 3),
        ((1, 2, 3, 4), (1, 2), 2),
        ((1, 2, 3), (1, 9, 3), 1),
        ((5, 2, 3), (1, 2, 3), 0),
    ],
)
def test_common_prefix(a, b, n):
    assert common_prefix(a, b) == n
    assert common_prefix(b, a) == n
    assert common_prefix(list(a), b) == n  # any sequences


def test_reusable_prefix_keeps_the_common_part():
    assert reusable_prefix((1, 2, 3, 4), (1, 2, 9, 9)) == 2
    assert reusable_prefix((), (1, 2, 3)) == 0
    assert reusable_prefix((7,), (1, 2, 3)) == 0


def test_reusable_prefix_always_reruns_the_last_prompt_token():
    # The whole prompt is resident, or even more than the prompt: the last prompt token
    # is still run, since its logits choose the first new token.
    assert reusable_prefix((1, 2, 3), (1, 2, 3)) == 2
    assert reusable_prefix((1, 2, 3, 4, 5), (1, 2, 3)) == 2
    assert reusable_prefix((1,), (1,)) == 0


@given(st.lists(st.integers(0, 3), max_size=12),
       st.lists(st.integers(0, 3), min_size=1, max_size=12))
def test_reusable_prefix_property(history, prompt):
    n = reusable_prefix(history, prompt)
    assert 0 <= n <= len(prompt) - 1
    assert history[:n] == prompt[:n]
    assert n == min(common_prefix(history, prompt), len(prompt) - 1)


# ---- choose_slot -----------------------------------------------------------------------


def view(index, history=(), *, busy=False, last_used=-1):
    return SlotView(index, busy, tuple(history), last_used)


def test_choose_slot_prefers_the_longest_reusable_prefix():
    prompt = (1, 2, 3, 4, 5)
    slots = [
        view(0, (1, 2), last_used=5),
        view(1, (1, 2, 3, 4, 9), last_used=1),
        view(2, (1, 2, 3), last_used=9),
        view(3, (), last_used=-1),
    ]
    assert choose_slot(slots, prompt) == 1


def test_choose_slot_skips_busy_slots_even_with_the_best_prefix():
    prompt = (1, 2, 3, 4)
    slots = [view(0, (1, 2, 3, 4), busy=True), view(1, (1, 2), last_used=3), view(2, last_used=0)]
    assert choose_slot(slots, prompt) == 1


def test_choose_slot_prefix_ties_take_the_least_recently_used():
    # Two slots could serve the prompt equally well. Claiming the older one keeps the
    # more recent conversation's history whole (the claimed slot gets truncated).
    prompt = (1, 2, 3, 8)
    slots = [view(0, (1, 2, 3, 4), last_used=7), view(1, (1, 2, 3, 5), last_used=3)]
    assert choose_slot(slots, prompt) == 1
    slots = [view(0, (1, 2, 3, 4), last_used=3), view(1, (1, 2, 3, 5), last_used=7)]
    assert choose_slot(slots, prompt) == 0


def test_choose_slot_without_a_prefix_takes_the_least_recently_used_idle_slot():
    prompt = (9, 9, 9)
    slots = [
        view(0, (1, 2), last_used=4),
        view(1, (3,), last_used=2),
        view(2, (), busy=True, last_used=0),  # older, but busy
        view(3, (5, 6), last_used=8),
    ]
    assert choose_slot(slots, prompt) == 1
    # Never-used slots (last_used -1) go first.
    assert choose_slot([*slots, view(4)], prompt) == 4


def test_choose_slot_a_one_token_prompt_reuses_nothing():
    # A one-token prompt can reuse nothing (its only token is re-run), so the match on
    # slot 0 does not count and the least recently used slot wins.
    slots = [view(0, (7, 8), last_used=5), view(1, (1,), last_used=1)]
    assert choose_slot(slots, (7,)) == 1


def test_choose_slot_all_busy_is_none():
    slots = [view(i, (1, 2, 3), busy=True, last_used=i) for i in range(4)]
    assert choose_slot(slots, (1, 2, 3, 4)) is None
    assert choose_slot([], (1, 2)) is None


@given(
    st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 2), max_size=6)),
        min_size=1, max_size=6,
    ),
    st.lists(st.integers(0, 2), min_size=1, max_size=6),
    st.randoms(use_true_random=False),
)
def test_choose_slot_property(specs, prompt, rnd):
    stamps = list(range(len(specs)))
    rnd.shuffle(stamps)  # distinct last_used stamps
    slots = [view(i, h, busy=b, last_used=stamps[i]) for i, (b, h) in enumerate(specs)]
    idle = [s for s in slots if not s.busy]
    chosen = choose_slot(slots, prompt)
    if not idle:
        assert chosen is None
        return
    best = max(reusable_prefix(s.history, prompt) for s in idle)
    pick = slots[chosen]
    assert not pick.busy
    assert reusable_prefix(pick.history, prompt) == best
    # Among the equally good, the least recently used.
    ties = [s for s in idle if reusable_prefix(s.history, prompt) == best]
    assert pick.last_used == min(s.last_used for s in ties)


# ---- StopMatcher -----------------------------------------------------------------------


def feed(matcher: StopMatcher, pieces):
    """Push pieces until a stop; returns (what each push released, stopped)."""
    out = []
    for piece in pieces:
        text, stopped = matcher.push(piece)
        out.append(text)
        if stopped:
            return out, True
    return out, False


def test_no_stops_passes_text_through():
    m = StopMatcher([])
    assert m.push("abc") == ("abc", False)
    assert m.push("") == ("", False)
    assert m.flush() == ""
    assert StopMatcher([""]).push("x") == ("x", False)  # empty stop strings are ignored


def test_stop_inside_one_push():
    m = StopMatcher(["STOP"])
    assert m.push("one two STOP three") == ("one two ", True)


def test_stop_split_across_many_pushes_never_leaks():
    m = StopMatcher(["</end>"])
    out, stopped = feed(m, ["hello ", "<", "/", "e", "n", "d", ">", " after"])
    assert stopped
    assert out == ["hello ", "", "", "", "", "", ""]
    assert "".join(out) == "hello "


def test_a_prefix_that_does_not_complete_is_released_later():
    m = StopMatcher(["STOP"])
    assert m.push("abS") == ("ab", False)
    assert m.push("T") == ("", False)
    assert m.push("x") == ("STx", False)  # "STx" can no longer start "STOP"
    assert m.push("ST") == ("", False)
    assert m.flush() == "ST"  # the end of the text releases what was held
    assert m.flush() == ""


def test_hold_back_only_the_longest_possible_start():
    # "aaab" with stop "aab": after "aaa" only "aa" may still start the stop.
    m = StopMatcher(["aab"])
    out, stopped = feed(m, ["a", "a", "a", "b"])
    assert stopped
    assert out == ["", "", "a", ""]


def test_multiple_stops():
    m = StopMatcher(["\n\n", "User:"])
    assert m.push("Answer\n") == ("Answer", False)
    assert m.push("Us") == ("\n", False)  # "\nU" starts neither stop; "Us" may start "User:"
    assert m.push("er:") == ("", True)
    m = StopMatcher(["\n\n", "User:"])
    assert feed(m, ["x", "\n", "\n", "User:"]) == (["x", "", ""], True)


def test_the_earliest_match_wins():
    m = StopMatcher(["world", "lo w"])
    assert m.push("hello world") == ("hel", True)
    m = StopMatcher(["lo w", "world"])  # order of the stops does not matter
    assert m.push("hello world") == ("hel", True)
    m = StopMatcher(["xyz", "o"])
    assert feed(m, ["hell", "o xyz"]) == (["hell", ""], True)


def test_flush_without_stops_held():
    m = StopMatcher(["STOP"])
    assert m.push("plain") == ("plain", False)
    assert m.flush() == ""


# The stream's text, cut into pieces at random points, with stop strings from the same
# small alphabet so that matches and near-matches are common.
ALPHABET = "ab\n"
texts = st.text(ALPHABET, max_size=40)
stop_strings = st.text(ALPHABET, min_size=1, max_size=4)


@st.composite
def split_text(draw):
    text = draw(texts)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return text, [text[i:j] for i, j in zip(bounds, bounds[1:])]


def expected_output(text: str, stops) -> str:
    """The text cut before the match that ends first (ties: the one that starts first)."""
    hits = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
    return text[: min(hits)[1]] if hits else text


def check_stream(pieces, stops):
    m = StopMatcher(stops)
    text = "".join(pieces)
    want = expected_output(text, stops)
    emitted, seen = "", ""
    for piece in pieces:
        released, stopped = m.push(piece)
        emitted += released
        seen += piece
        # Nothing released is ever taken back: it is a prefix of the final output.
        assert want.startswith(emitted)
        if stopped:
            assert emitted == want
            return
        # What is held back is the unreleased rest of the text, and only as much as
        # could still start a stop string.
        assert emitted + m.pending == seen
        assert len(m.pending) < max(len(s) for s in stops)
        assert m.pending == "" or any(s.startswith(m.pending) for s in stops)
    assert emitted + m.flush() == want == text


@settings(max_examples=400)
@given(split_text(), stop_strings)
def test_stop_matcher_property_one_stop(split, stop):
    _, pieces = split
    check_stream(pieces, [stop])


@settings(max_examples=400)
@given(split_text(), st.lists(stop_strings, min_size=2, max_size=3))
def test_stop_matcher_property_several_stops(split, stops):
    # The output is the text cut before the first stop to complete, whatever the pieces,
    # even when one stop string contains another.
    _, pieces = split
    check_stream(pieces, stops)


def test_a_stop_inside_another_stop_gives_the_same_output_however_split():
    for pieces in (["abcd"], ["abc", "d"], ["a", "b", "c", "d"]):
        check_stream(pieces, ["abcd", "c"])
