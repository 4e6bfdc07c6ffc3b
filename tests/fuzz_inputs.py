"""What the fuzz tests share (test_fuzz.py, test_fuzz_http.py): each parser's corpus of
seed files under tests/corpus/<parser>/, hypothesis's inputs drawn from them (arbitrary
bytes, and the seeds mutated), and feeding an input to a sans-IO decoder in pieces."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

CORPUS = Path(__file__).resolve().parent / "corpus"
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


def seeds(parser: str) -> list[Path]:
    return sorted(p for p in (CORPUS / parser).iterdir() if p.is_file())


def corpus(parser: str):
    """Parametrize a test over the parser's seed files (by name)."""
    return pytest.mark.parametrize("seed", seeds(parser), ids=lambda p: p.name)


@st.composite
def mutated(draw, parser: str) -> bytes:
    """A seed of `parser` with a few random edits."""
    data = bytearray(draw(st.sampled_from(seeds(parser))).read_bytes())
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        match draw(st.sampled_from(("flip", "insert", "delete", "splice", "cut"))):
            case "flip" if at < len(data):
                data[at] ^= draw(st.integers(1, 255))
            case "insert":
                data[at:at] = draw(st.binary(min_size=1, max_size=8))
            case "delete":
                del data[at : at + draw(st.integers(1, 16))]
            case "splice":  # a piece of the input again, elsewhere (frames out of order)
                start = draw(st.integers(0, len(data)))
                data[at:at] = data[start : start + draw(st.integers(1, 64))]
            case "cut":
                del data[at:]
    return bytes(data)


def inputs(parser: str, max_size: int = 300):
    return st.one_of(st.binary(max_size=max_size), mutated(parser))


CUTS = st.lists(st.integers(0, 100_000), max_size=8)


def feed_all(decoder, data: bytes, cuts=()) -> list:
    bounds = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    return [e for a, b in zip(bounds, bounds[1:]) for e in decoder.feed(data[a:b])]


def same(a: list, b: list) -> bool:
    return list(map(repr, a)) == list(map(repr, b))  # a "nan" field is read as NaN, never == itself
