"""`sample`: per-row temperature, top-k, top-p, min-p and PRNG key in one batched call,
every test on both of its forms (the native kernel and XLA's)."""

from __future__ import annotations

import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from motet.model import native, sampling
from motet.model.sampling import open_mask, request_key, sample

VOCAB = 1000


@pytest.fixture(autouse=True, params=["native", "xla"])
def form(request, monkeypatch):
    """This module's `sample` forced to one form."""
    if request.param == "native" and not native.available():
        pytest.skip("the native kernels were not built here")
    monkeypatch.setattr(sys.modules[__name__], "sample",
                        partial(sampling.sample, use_native=request.param == "native"))
    return request.param


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 3.0, size=(n, VOCAB)).astype(np.float32)


def keys(*seeds: int) -> jax.Array:
    return jnp.stack([request_key(s) for s in seeds])


def run(logits, temperature, top_p, key, want_top=False, top_k=0, min_p=0.0):
    b = len(logits)

    def per_row(value, dtype):
        return jnp.broadcast_to(jnp.asarray(value, dtype), (b,))

    return sample(jnp.asarray(logits), per_row(temperature, jnp.float32), per_row(top_p, jnp.float32),
                  per_row(top_k, jnp.int32), per_row(min_p, jnp.float32), key, want_top)


def draws(seed: int, steps: int, logits: np.ndarray, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0) -> list[int]:
    """`steps` tokens from one row, chaining the key the way a request does."""
    key, out = keys(seed), []
    for _ in range(steps):
        token, _, key, _, _ = run(logits[None], temperature, top_p, key, top_k=top_k, min_p=min_p)
        out.append(int(token[0]))
    return out


def test_temperature_zero_is_argmax():
    logits = rows(4)
    tokens, logprob, _, _, _ = run(logits, 0.0, 1.0, keys(0, 1, 2, 3))
    np.testing.assert_array_equal(np.asarray(tokens), logits.argmax(-1))
    expected = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)[np.arange(4), logits.argmax(-1)]
    np.testing.assert_allclose(np.asarray(logprob), np.asarray(expected), rtol=1e-6, atol=1e-6)


def test_mixed_batch_gives_greedy_rows_their_argmax():
    """Greedy rows next to sampled rows (one of them with top-p, which switches on the
    nucleus mask for the whole batch) still get their argmax."""
    logits = rows(4, seed=1)
    temperature = jnp.asarray([0.0, 1.5, 0.0, 1.0], jnp.float32)
    top_p = jnp.asarray([1.0, 1.0, 0.5, 0.9], jnp.float32)
    top_k, min_p = jnp.asarray([0, 3, 0, 0], jnp.int32), jnp.asarray([0.0, 0.0, 0.0, 0.1], jnp.float32)
    for seed in range(5):
        tokens, _, _, _, _ = sample(jnp.asarray(logits), temperature, top_p, top_k, min_p,
                                    keys(seed, seed + 10, seed + 20, seed + 30))
        tokens = np.asarray(tokens)
        assert tokens[0] == logits[0].argmax()
        assert tokens[2] == logits[2].argmax()


def test_same_seed_same_tokens_different_seed_differs():
    flat = np.random.default_rng(2).normal(0.0, 0.1, size=VOCAB).astype(np.float32)
    first = draws(7, 6, flat)
    assert draws(7, 6, flat) == first
    assert draws(8, 6, flat) != first
    assert len(set(first)) > 1  # the chained key moves on between steps


def test_tiny_top_p_is_argmax():
    logits = rows(3, seed=3)
    for seed in range(5):
        tokens, _, _, _, _ = run(logits, 1.0, 1e-6, keys(seed, seed + 1, seed + 2))
        np.testing.assert_array_equal(np.asarray(tokens), logits.argmax(-1))


def test_top_p_samples_only_from_the_nucleus():
    """Three tokens hold ~all the mass; top_p 0.5 keeps only the most likely ones."""
    logits = np.full(VOCAB, -20.0, np.float32)
    logits[[5, 6, 7]] = [2.0, 1.0, 0.0]  # probabilities ≈ 0.67, 0.24, 0.09
    seen = {t for seed in range(20) for t in draws(seed, 1, logits, top_p=0.5)}
    assert seen == {5}
    seen = {t for seed in range(40) for t in draws(seed, 1, logits, top_p=0.8)}
    assert seen == {5, 6}


def test_top_candidates_are_the_best_logprobs_sorted():
    logits = rows(2, seed=4)
    _, _, _, top_ids, top_lp = run(logits, 0.7, 1.0, keys(0, 1), want_top=True)
    top_ids, top_lp = np.asarray(top_ids), np.asarray(top_lp)
    assert top_ids.shape == top_lp.shape == (2, 5)
    logprobs = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    for r in range(2):
        np.testing.assert_array_equal(top_ids[r], np.argsort(-logits[r])[:5])
        assert np.all(np.diff(top_lp[r]) <= 0)
        np.testing.assert_allclose(top_lp[r], logprobs[r, top_ids[r]], rtol=1e-6, atol=1e-6)


def test_no_top_candidates_by_default():
    """Not asked for, they are zeros of the same shape: one compiled sampler either way."""
    _, _, _, top_ids, top_lp = run(rows(2), 0.0, 1.0, keys(0, 1))
    assert np.asarray(top_ids).shape == np.asarray(top_lp).shape == (2, 5)
    assert not np.asarray(top_ids).any() and not np.asarray(top_lp).any()


def test_top_p_zero_keeps_the_top_token():
    """_top_p_mask promises the top token is always kept; at top_p=0 (which OpenAI's API
    accepts) the draw should be the argmax."""
    logits = rows(2, seed=5)
    tokens, _, _, _, _ = run(logits, 1.0, 0.0, keys(0, 1))
    np.testing.assert_array_equal(np.asarray(tokens), logits.argmax(-1))


def flat_five() -> np.ndarray:
    """Five tokens with most of the mass, the fifth 1/20 as likely as the first."""
    logits = np.full(VOCAB, -30.0, np.float32)
    logits[[10, 11, 12, 13, 14]] = np.log([1.0, 0.8, 0.6, 0.3, 0.05])
    return logits


def test_top_k_samples_only_from_the_k_likeliest():
    logits = flat_five()
    seen = {t for seed in range(60) for t in draws(seed, 1, logits, top_k=2)}
    assert seen == {10, 11}
    seen = {t for seed in range(200) for t in draws(seed, 1, logits, top_k=4)}
    assert seen == {10, 11, 12, 13}
    assert {t for seed in range(5) for t in draws(seed, 1, logits, top_k=1)} == {10}


def test_min_p_drops_tokens_below_its_share_of_the_likeliest():
    logits = flat_five()
    seen = {t for seed in range(200) for t in draws(seed, 1, logits, min_p=0.5)}
    assert seen == {10, 11, 12}  # 0.3 and 0.05 are under half of 1.0
    seen = {t for seed in range(400) for t in draws(seed, 1, logits, min_p=0.04)}
    assert seen == {10, 11, 12, 13, 14}


def test_cuts_apply_per_row_in_one_batch():
    """One row cut to its top token, the next by min_p, the third free: each keeps its own."""
    logits = np.stack([flat_five()] * 3)
    seen: list[set] = [set(), set(), set()]
    for seed in range(200):
        tokens, _, _, _, _ = sample(jnp.asarray(logits), jnp.ones(3, jnp.float32), jnp.ones(3, jnp.float32),
                                    jnp.asarray([1, 0, 0], jnp.int32), jnp.asarray([0.0, 0.5, 0.0], jnp.float32),
                                    keys(seed, seed + 1000, seed + 2000))
        for r, t in enumerate(np.asarray(tokens)):
            seen[r].add(int(t))
    assert seen[0] == {10}
    assert seen[1] == {10, 11, 12}
    assert seen[2] == {10, 11, 12, 13, 14}


def test_cuts_leave_logprobs_and_greedy_rows_alone():
    """Logprobs are of the model's distribution before any cut; a greedy row takes its
    argmax whatever its cuts say."""
    logits = rows(2, seed=6)
    plain = run(logits, 0.0, 1.0, keys(0, 1))
    cut = run(logits, 0.0, 1.0, keys(0, 1), top_k=3, min_p=0.2)
    np.testing.assert_array_equal(np.asarray(cut[0]), logits.argmax(-1))
    np.testing.assert_allclose(np.asarray(cut[1]), np.asarray(plain[1]), rtol=1e-6)


def mask_of(*allowed_ids: int) -> np.ndarray:
    """constraint.py's bitmask for one row: only these tokens."""
    mask = np.zeros((VOCAB + 31) // 32, np.uint32)
    for t in allowed_ids:
        mask[t // 32] |= np.uint32(1 << (t % 32))
    return mask.view(np.int32)


def test_a_bitmask_limits_greedy_and_sampled_rows_and_leaves_others_and_logprobs_alone():
    logits = np.stack([flat_five()] * 3)
    allowed = np.stack([mask_of(13), mask_of(12, 14, 999), open_mask(1, VOCAB)[0]])
    ones = jnp.ones(3, jnp.float32)
    seen: list[set] = [set(), set(), set()]
    for seed in range(100):
        tokens, logprob, *_ = sample(jnp.asarray(logits), jnp.asarray([0.0, 1.0, 1.0], jnp.float32), ones,
                                     jnp.zeros(3, jnp.int32), jnp.zeros(3, jnp.float32),
                                     keys(seed, seed + 1000, seed + 2000), False, None, allowed)
        for r, t in enumerate(np.asarray(tokens)):
            seen[r].add(int(t))
        log_total = np.log(np.exp(logits[0].astype(np.float64)).sum())
        assert float(logprob[0]) == pytest.approx(logits[0, 13] - log_total, abs=1e-4)  # the model's own
    assert seen[0] == {13}  # greedy: the best allowed token, not the argmax
    assert seen[1] == {12, 14}  # 999 is allowed but 1e-13 as likely
    assert seen[2] == {10, 11, 12, 13, 14}


def test_bits_past_the_vocabulary_and_the_last_word_are_read_right():
    vocab = 70  # three words, the last one partly used
    logits = np.zeros((1, vocab), np.float32)
    for token in (0, 31, 32, 63, 64, 69):
        allowed = np.zeros((1, 3), np.uint32)
        allowed[0, token // 32] = np.uint32(1 << (token % 32))
        allowed[0, 2] |= np.uint32(0xFFFFFFC0)  # bits of ids 70..95, past the vocabulary
        picked = sample(jnp.asarray(logits), jnp.zeros(1, jnp.float32), jnp.ones(1, jnp.float32),
                        jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.float32), keys(0), False, None,
                        allowed.view(np.int32))[0]
        assert int(picked[0]) == token
