"""The penalties and logit_bias on the device (model/logit_history.py), on fixed logits:
each moves the scores as vLLM's does, per row in one batch, and leaves rows that do not
ask for it, and the reported logprobs, alone."""

from __future__ import annotations

import numpy as np
import pytest

from motet.model.logit_history import (
    begin,
    count_fed,
    empty_history,
    penalize,
    resample,
    sample_with_history,
    start_rows,
)
from motet.model.sampling import CARRY_WIDTH, SAMPLED_WIDTH, open_mask, request_key

VOCAB = 6
SLOTS = 3
LOGITS = np.array([2.0, -1.0, 0.5, 1.0, -2.0, 0.0], np.float32)


def penalties(*rows):
    """Per row (presence, frequency, repetition); a row reads its history unless None."""
    used = [r is not None for r in rows]
    rows = [r or (0.0, 0.0, 1.0) for r in rows]
    p, f, r = (np.asarray(col, np.float32) for col in zip(*rows))
    return p, f, r, np.asarray(used)


def history_with(slot: int, prompt=(), answer=(), bias=()):
    history = empty_history(SLOTS, VOCAB)
    history = begin(history, np.int32(slot), *start_rows(VOCAB, prompt, bias))
    for token in answer:
        history = count_fed(history, np.asarray([slot]), np.asarray([token]))
    return history


def scores(history, slots, pens, logits=LOGITS):
    batch = np.stack([logits] * len(slots))
    return np.asarray(penalize(batch, history, np.asarray(slots, np.int32), pens))


def test_frequency_penalty_subtracts_per_occurrence_in_the_answer():
    history = history_with(0, prompt=[1], answer=[3, 3, 0])
    out = scores(history, [0], penalties((0.0, 0.5, 1.0)))[0]
    np.testing.assert_allclose(out, LOGITS - 0.5 * np.array([1, 0, 0, 2, 0, 0]))


def test_presence_penalty_subtracts_once_per_token_in_the_answer():
    history = history_with(0, prompt=[1], answer=[3, 3, 0])
    out = scores(history, [0], penalties((1.5, 0.0, 1.0)))[0]
    np.testing.assert_allclose(out, LOGITS - 1.5 * np.array([1, 0, 0, 1, 0, 0]))


def test_repetition_penalty_covers_prompt_and_answer_by_sign():
    history = history_with(0, prompt=[1, 2], answer=[0])
    out = scores(history, [0], penalties((0.0, 0.0, 2.0)))[0]
    # 0 (answer, positive): halved; 1 (prompt, negative): doubled; 2 (prompt, positive): halved
    np.testing.assert_allclose(out, [1.0, -2.0, 0.25, 1.0, -2.0, 0.0])


def test_negative_penalties_encourage():
    history = history_with(0, answer=[4])
    out = scores(history, [0], penalties((-1.0, -0.5, 1.0)))[0]
    assert out[4] == pytest.approx(LOGITS[4] + 1.5)


def test_logit_bias_adds_to_its_tokens_only():
    history = history_with(1, bias=((4, 10.0), (0, -100.0)))
    out = scores(history, [1], penalties((0.0, 0.0, 1.0)))[0]
    np.testing.assert_allclose(out, LOGITS + np.array([-100, 0, 0, 0, 10, 0]))


def test_rows_mix_in_one_batch_and_others_keep_their_logits():
    history = history_with(0, answer=[3, 3])
    history = begin(history, np.int32(2), *start_rows(VOCAB, [], ((5, 7.0),)))
    out = scores(history, [0, 2, 0], penalties((0.0, 1.0, 1.0), (0.0, 0.0, 1.0), None))
    np.testing.assert_allclose(out[0], LOGITS - np.array([0, 0, 0, 2, 0, 0]))
    np.testing.assert_allclose(out[1], LOGITS + np.array([0, 0, 0, 0, 0, 7]))
    np.testing.assert_allclose(out[2], LOGITS)  # slot 0's history, not read by this row


def test_a_batch_without_penalties_is_its_logits():
    history = history_with(0, prompt=[0], answer=[0], bias=((0, 5.0),))
    np.testing.assert_array_equal(scores(history, [0, 0], penalties(None, None)), np.stack([LOGITS] * 2))


def test_begin_clears_the_slot_it_starts_and_no_other():
    history = history_with(0, prompt=[1], answer=[2, 2], bias=((3, 1.0),))
    history = count_fed(history, np.asarray([1]), np.asarray([4]))
    history = begin(history, np.int32(0), *start_rows(VOCAB, [5], ()))
    counts, seen, bias = (np.asarray(a) for a in history)
    assert counts[0].sum() == 0 and seen[0].tolist() == [False] * 5 + [True] and not bias[0].any()
    assert counts[1, 4] == 1


def test_fed_tokens_below_zero_count_nothing():
    history = count_fed(empty_history(SLOTS, VOCAB), np.asarray([0, 1]), np.asarray([-1, 2]))
    assert np.asarray(history.counts).sum() == 1


def test_sampling_with_history_picks_by_the_scores_and_reports_the_models_logprobs():
    history = history_with(0, bias=((4, 50.0),))
    logits = np.stack([LOGITS])
    cuts = (np.zeros(1, np.float32), np.ones(1, np.float32), np.zeros(1, np.int32), np.zeros(1, np.float32),
            np.asarray(request_key(0))[None])
    history, (token, logprob, *_) = sample_with_history(logits, cuts, False, history, np.asarray([0]),
                                                        np.asarray([-1]), penalties((0.0, 0.0, 1.0)),
                                                        open_mask(1, VOCAB))
    assert int(token[0]) == 4
    log_total = np.log(np.exp(LOGITS).sum())
    assert float(logprob[0]) == pytest.approx(LOGITS[4] - log_total, abs=1e-5)


def test_a_frequency_penalty_ends_a_greedy_loop():
    """Greedy decoding that repeats one token: with the token's count subtracted each
    time it is fed back, the argmax moves to another token."""
    history = history_with(0)
    cuts = (np.zeros(1, np.float32), np.ones(1, np.float32), np.zeros(1, np.int32), np.zeros(1, np.float32),
            np.asarray(request_key(0))[None])
    fed, picked = -1, []
    for _ in range(4):
        history, (token, *_) = sample_with_history(np.stack([LOGITS]), cuts, False, history, np.asarray([0]),
                                                   np.asarray([fed]), penalties((0.0, 0.8, 1.0)),
                                                   open_mask(1, VOCAB))
        fed = int(token[0])
        picked.append(fed)
    assert picked[0] == 0 and len(set(picked)) > 1


def test_resample_redraws_a_steps_rows_and_keeps_its_routing():
    """A decode step samples plainly; resample draws its penalized row again from the same
    logits and key, writes the pick over the step's sampled columns and into the slot's
    carry, and counts what the row fed, while the expert columns stay as they were."""
    history = history_with(1, bias=((4, 50.0),))
    logits = np.stack([LOGITS, LOGITS])
    key = np.asarray(request_key(3))
    fed = np.asarray([[2, *key.view(np.int32)], [0, 0, 0]], np.int32)
    routing = np.asarray([[7, 8], [9, 10]], np.int32)
    packed = np.concatenate([np.zeros((2, SAMPLED_WIDTH), np.int32), routing], axis=1)
    carry = np.zeros((SLOTS, CARRY_WIDTH), np.int32)
    cuts = (np.zeros(2, np.float32), np.ones(2, np.float32), np.zeros(2, np.int32), np.zeros(2, np.float32))
    packed, carry, history = resample(logits, fed, packed, carry, history, np.asarray([1, 2], np.int32), cuts,
                                      np.bool_(False), penalties((0.0, 0.0, 1.0), None), open_mask(2, VOCAB))
    packed, carry = np.asarray(packed), np.asarray(carry)
    assert packed[:, 0].tolist() == [4, 0]  # the bias wins row 0; row 1 keeps its argmax
    assert (packed[:, SAMPLED_WIDTH:] == routing).all()
    assert carry[1, 0] == 4 and carry[2, 0] == 0
    assert np.asarray(history.counts)[1, 2] == 1
    assert (packed[0, 2:4] == carry[1, 2:4]).all()  # the key after the draw, as the step would leave it
