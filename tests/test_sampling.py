"""`sample`: per-row temperature, top-p and PRNG key in one batched call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from motet.model.sampling import request_key, sample

VOCAB = 1000


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 3.0, size=(n, VOCAB)).astype(np.float32)


def keys(*seeds: int) -> jax.Array:
    return jnp.stack([request_key(s) for s in seeds])


def run(logits, temperature, top_p, key, want_top=False):
    b = len(logits)
    return sample(
        jnp.asarray(logits),
        jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (b,)),
        jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (b,)),
        key,
        want_top,
    )


def draws(seed: int, steps: int, logits: np.ndarray, temperature=1.0, top_p=1.0) -> list[int]:
    """`steps` tokens from one row, chaining the key the way a request does."""
    key, out = keys(seed), []
    for _ in range(steps):
        token, _, key, _, _ = run(logits[None], temperature, top_p, key)
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
    for seed in range(5):
        tokens, _, _, _, _ = sample(jnp.asarray(logits), temperature, top_p, keys(seed, seed + 10, seed + 20, seed + 30))
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
