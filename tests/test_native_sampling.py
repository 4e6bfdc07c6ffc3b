"""The native sampler (kernels/sample.cc) against sampling.py's XLA form: the same
tokens, logprobs and top candidates for the same logits, cuts and keys."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from motet.model import native
from motet.model.sampling import request_key, sample

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels were not built here")

ROWS, VOCAB = 48, 4096

# (temperature, top_p, top_k, min_p): each cut alone, together, and batches that mix them
SETTINGS = {
    "greedy": (0.0, 1.0, 0, 0.0),
    "temperature": (0.8, 1.0, 0, 0.0),
    "top_p": (1.0, 0.9, 0, 0.0),
    "small top_p": (0.7, 0.3, 0, 0.0),
    "top_k": (1.0, 1.0, 40, 0.0),
    "min_p": (1.0, 1.0, 0, 0.05),
    "llama.cpp's defaults": (0.8, 0.95, 40, 0.05),
    "hot and wide": (1.5, 0.99, 0, 0.0),
}


def logits_of(kind: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "peaked":  # a language model's: a few likely tokens, a long tail
        x = rng.standard_normal((ROWS, VOCAB)).astype(np.float32) * 2
        x[:, :8] += rng.uniform(6, 12, size=(ROWS, 8)).astype(np.float32)
        return x
    if kind == "ties":  # values from a few levels: equal logits across the cuts
        return rng.integers(-4, 4, size=(ROWS, VOCAB)).astype(np.float32)
    if kind == "masked":  # most tokens cut to -inf (a grammar's mask)
        x = rng.standard_normal((ROWS, VOCAB)).astype(np.float32) * 3
        x[rng.random((ROWS, VOCAB)) < 0.97] = -np.inf
        return x
    return rng.standard_normal((ROWS, VOCAB)).astype(np.float32) * 3


def both(logits, settings, seed, want_top=False, scores=None):
    b = len(logits)
    per_row = [np.resize(np.asarray(v), b) for v in zip(*settings)] if isinstance(settings, list) else \
        [np.full(b, v) for v in settings]
    temperature, top_p, top_k, min_p = (jnp.asarray(a, t) for a, t in zip(
        per_row, (jnp.float32, jnp.float32, jnp.int32, jnp.float32)))
    keys = jnp.stack([request_key(seed * 1000 + r) for r in range(b)])
    args = (jnp.asarray(logits), temperature, top_p, top_k, min_p, keys, want_top,
            None if scores is None else jnp.asarray(scores))
    return ([np.asarray(a) for a in sample(*args, use_native=True)],
            [np.asarray(a) for a in sample(*args, use_native=False)])


@pytest.mark.parametrize("kind", ["normal", "peaked", "ties", "masked"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_native_draw_is_xlas(kind, name):
    for seed in range(3):
        logits = logits_of(kind, seed)
        (tokens, logprob, next_keys, _, _), (x_tokens, x_logprob, x_keys, _, _) = both(logits, SETTINGS[name], seed)
        np.testing.assert_array_equal(tokens, x_tokens)
        np.testing.assert_allclose(logprob, x_logprob, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(next_keys, x_keys)
        assert np.isfinite(logits[np.arange(ROWS), tokens]).all()  # never a cut token


def test_a_batch_mixing_every_setting_draws_each_row_as_xla():
    logits = logits_of("peaked", 7)
    for seed in range(4):
        native_out, xla_out = both(logits, list(SETTINGS.values()), seed)
        np.testing.assert_array_equal(native_out[0], xla_out[0])


def test_penalized_scores_pick_and_logits_give_the_logprobs():
    logits = logits_of("peaked", 8)
    scores = logits - 5.0 * (np.arange(VOCAB) % 3 == 0)
    (tokens, logprob, _, _, _), (x_tokens, x_logprob, _, _, _) = both(logits, SETTINGS["top_p"], 1, scores=scores)
    np.testing.assert_array_equal(tokens, x_tokens)
    np.testing.assert_allclose(logprob, x_logprob, rtol=1e-5, atol=1e-5)


def test_top_candidates_match_with_ties_the_lower_id_first():
    logits = logits_of("ties", 9)
    (_, _, _, ids, lp), (_, _, _, x_ids, x_lp) = both(logits, SETTINGS["greedy"], 0, want_top=True)
    np.testing.assert_array_equal(ids, x_ids)
    np.testing.assert_allclose(lp, x_lp, rtol=1e-5, atol=1e-5)
    assert (np.diff(ids, axis=1)[np.diff(lp, axis=1) == 0] > 0).all()


def test_a_sampled_row_follows_its_distribution():
    """Over many keys one row's draws land on each token about as often as its
    probability says (two likely tokens and a third ten times rarer)."""
    logits = np.full((1, VOCAB), -30.0, np.float32)
    logits[0, [3, 700, 4000]] = np.log([0.5, 0.45, 0.05])
    counts = np.zeros(VOCAB)
    for seed in range(60):
        tokens = sample(jnp.asarray(np.repeat(logits, 50, 0)), jnp.ones(50), jnp.ones(50), jnp.zeros(50, jnp.int32),
                        jnp.zeros(50), jnp.stack([request_key(seed * 50 + r) for r in range(50)]),
                        use_native=True)[0]
        np.add.at(counts, np.asarray(tokens), 1)
    share = counts[[3, 700, 4000]] / counts.sum()
    assert counts.sum() == counts[[3, 700, 4000]].sum()
    np.testing.assert_allclose(share, [0.5, 0.45, 0.05], atol=0.03)
