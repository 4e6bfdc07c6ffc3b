"""The expert telemetry the fronts show (runtime/experts.py's ExpertMap): EMAP's byte per
expert (tier << 6 | the bit length of its routed tokens, at most 63) and HITS' bit per
expert routed since the last look, most significant bit first, against the protocol's
own arithmetic written out one expert at a time."""

from __future__ import annotations

import numpy as np
import pytest

from motet.runtime.api import ExpertTiers, StepRouting
from motet.runtime.experts import DEVICE_TIER, MAX_HEAT, ExpertMap

ROWS, COLS = 2, 11  # 22 experts: HITS' third byte is part padding


def reference_emap(heat, tiers: bytes) -> bytes:
    flat = [int(n) for row in heat for n in row]
    return bytes((tier << 6) | min(MAX_HEAT, n.bit_length()) for tier, n in zip(tiers, flat))


def reference_bits(hits) -> bytes:
    flat = [bool(h) for row in hits for h in row]
    return bytes(sum(1 << (7 - j) for j, b in enumerate(flat[i:i + 8]) if b) for i in range(0, len(flat), 8))


def step(counts, tokens: int = 1, tiers: ExpertTiers | None = None) -> StepRouting:
    return StepRouting(np.asarray(counts, np.int64), tokens, tiers=tiers)


def test_heat_and_hits_as_the_protocol_counts_them():
    experts = ExpertMap(ROWS, COLS)
    first = np.zeros((ROWS, COLS), np.int64)
    first[0, :6] = [1, 2, 3, 4, 7, 8]
    first[1, [0, 9, 10]] = [2**40, 2**62, 5]
    second = np.zeros((ROWS, COLS), np.int64)
    second[0, [0, 10]] = [1, 1]
    experts.add_step(step(first))
    experts.add_step(step(second))
    heat = first + second
    tiers = bytes([DEVICE_TIER]) * (ROWS * COLS)
    assert experts.emap() == reference_emap(heat, tiers)
    assert experts.emap()[ROWS * COLS - 2] == (DEVICE_TIER << 6) | MAX_HEAT  # 2**62: capped
    assert experts.hit_bits() == reference_bits(heat > 0)
    assert experts.take_hits() == reference_bits(heat > 0) and experts.seq == 1
    assert experts.hit_bits() == bytes(3)  # nothing routed since
    experts.add_step(step(second))
    assert experts.take_hits() == reference_bits(second > 0) and experts.seq == 2
    assert experts.state().hits == reference_bits(second > 0)


def test_tiers_go_in_the_top_bits():
    experts = ExpertMap(ROWS, COLS)
    tiers = bytes(i % 3 for i in range(ROWS * COLS))
    counts = np.arange(ROWS * COLS, dtype=np.int64).reshape(ROWS, COLS) * 3
    experts.add_step(step(counts, tiers=ExpertTiers("tiered", ROWS, COLS, tiers, 8, 7, 7, 0.1, 0.2, 4)))
    assert experts.emap() == reference_emap(counts, tiers)
    assert experts.tier_counts() == (8, 7, 7)


def test_a_dense_step_runs_every_layers_one_expert():
    experts = ExpertMap(3, 1)
    experts.add_step(StepRouting(np.zeros((0, 0), np.int64), tokens=5))
    assert experts.emap() == bytes([(DEVICE_TIER << 6) | 3]) * 3
    assert experts.take_hits() == bytes([0b11100000])


@pytest.mark.parametrize("shape", [(ROWS, COLS + 1), (1, COLS)])
def test_counts_of_another_shape_are_refused(shape):
    experts = ExpertMap(ROWS, COLS)
    with pytest.raises(ValueError, match="counts of shape"):
        experts.add(np.ones(shape, np.int64))
    assert experts.emap() == bytes([DEVICE_TIER << 6]) * (ROWS * COLS)  # nothing added
