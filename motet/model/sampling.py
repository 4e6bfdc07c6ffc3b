"""Sampling on the device: per-row temperature, top-k, top-p, min-p and PRNG key, so a
batch that mixes greedy and sampled requests runs one compiled function (one per batch
size, with or without top candidates).

On one CPU the draw is one native call (kernels/sample.cc) where the kernels were built:
XLA:CPU sorted the whole vocabulary for a top-k or top-p cut (10-13 ms a row at 49152
tokens) and every compiled step held the sampler's kernels. Both forms draw alike: the
cuts keep the same tokens, and one uniform number a row picks the first kept token, in
the vocabulary's order, whose running probability passes it.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from . import native


def request_key(seed: int) -> jax.Array:
    """A request's raw PRNG key (uint32[2])."""
    return jax.random.key_data(jax.random.key(seed))


def _top_p_mask(logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """Logits with the tail beyond each row's nucleus set to -inf (the top token is always kept)."""
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
    keep_sorted = (before < top_p[:, None]) | (jnp.arange(logits.shape[-1]) == 0)
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(keep_sorted)
    return jnp.where(keep, logits, -jnp.inf)


def _top_k_mask(logits: jax.Array, top_k: jax.Array) -> jax.Array:
    """Logits below each row's k-th largest set to -inf (k 0: the row keeps them all;
    ties with the k-th are kept too)."""
    vocab = logits.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(-jnp.sort(-logits, axis=-1), (k - 1)[:, None], axis=-1)
    return jnp.where(logits >= kth, logits, -jnp.inf)


def _min_p_mask(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Logits of tokens less likely than min_p times the row's likeliest set to -inf
    (min_p 0: none)."""
    floor = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]
    return jnp.where(logits >= floor, logits, -jnp.inf)


def _only_allowed(scores: jax.Array, allowed: jax.Array) -> jax.Array:
    """Scores of the tokens whose bit is clear set to -inf."""
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    keep = bits.reshape(allowed.shape[0], -1)[:, : scores.shape[-1]].astype(jnp.bool_)
    return jnp.where(keep, scores, -jnp.inf)


def open_mask(rows: int, vocab: int) -> np.ndarray:
    """The bitmask that allows every token, for `rows` rows."""
    return np.full((rows, (vocab + 31) // 32), -1, np.int32)


TOP_CANDIDATES = 5  # the most top logprobs a request may ask for


def _draw_by_uniform(scaled: jax.Array, uniform: jax.Array) -> jax.Array:
    """Per row, the first token (in the vocabulary's order) whose running probability
    under `scaled` (cut tokens at -inf) passes uniform [b] in [0, 1) times the total."""
    weights = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))
    running = jnp.cumsum(weights, axis=-1)
    first = jnp.sum(running <= uniform[:, None] * running[:, -1:], axis=-1)
    last_kept = scaled.shape[-1] - 1 - jnp.argmax((weights > 0)[:, ::-1], axis=-1)
    return jnp.minimum(first, last_kept)  # rounding can leave the target past the end


def _xla_sample(logits, scores, temperature, top_p, top_k, min_p, uniform, want_top):
    greedy = jnp.argmax(scores, axis=-1)

    def draw(_):
        scaled = scores / jnp.maximum(temperature, 1e-6)[:, None]
        scaled = jax.lax.cond(jnp.any(top_k > 0), lambda s: _top_k_mask(s, top_k), lambda s: s, scaled)
        scaled = jax.lax.cond(jnp.any(top_p < 1.0), lambda s: _top_p_mask(s, top_p), lambda s: s, scaled)
        scaled = jax.lax.cond(jnp.any(min_p > 0.0), lambda s: _min_p_mask(s, min_p), lambda s: s, scaled)
        return _draw_by_uniform(scaled, uniform).astype(greedy.dtype)

    drawn = jax.lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy, None)
    tokens = jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)
    log_total = jax.nn.logsumexp(logits, axis=-1)
    token_logprob = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - log_total

    def top(_):
        top_logits, top_ids = jax.lax.top_k(logits, TOP_CANDIDATES)
        return top_ids.astype(jnp.int32), top_logits - log_total[:, None]

    def none(_):
        shape = (logits.shape[0], TOP_CANDIDATES)
        return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, logits.dtype)

    top_ids, top_lp = jax.lax.cond(want_top, top, none, None)
    return tokens, token_logprob, top_ids, top_lp


def native_unless_on(mesh) -> bool | None:
    """sample's use_native for arrays placed on `mesh` (None: one device): the native
    draw where it applies, XLA's form over a mesh, whose arrays span devices."""
    return None if mesh is None else False


def _native_sample(logits, scores, temperature, top_p, top_k, min_p, uniform, want_top):
    b = logits.shape[0]
    shapes = (jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.float32),
              jax.ShapeDtypeStruct((b, TOP_CANDIDATES), jnp.int32),
              jax.ShapeDtypeStruct((b, TOP_CANDIDATES), jnp.float32))
    return jax.ffi.ffi_call(native.SAMPLE, shapes)(logits, scores, temperature, top_p, top_k, min_p, uniform,
                                                   jnp.asarray(want_top, jnp.bool_))


@partial(jax.jit, static_argnames="use_native")
def sample(logits, temperature, top_p, top_k, min_p, keys, want_top=False, scores=None, allowed=None, *,
           use_native: bool | None = None):
    """Pick one token per row.

    logits [b, v] float32; temperature, top_p, min_p [b] float32; top_k [b] int32 (0:
    none); keys [b, 2] uint32; want_top: a bool, traced (the top candidates cost time
    only when asked for); scores: what to pick from where not the logits themselves (a
    penalized batch's, logit_history.penalize); allowed: int32 [b, ceil(v / 32)], the
    tokens each row may draw as bits (constraint.py's bitmask; all ones: any, and a
    batch of such rows skips the mask). A sampled row draws from its logits over
    temperature, cut to its top k, then to its nucleus (top_p), then to the tokens at
    least min_p times as likely as its likeliest, by one uniform number from its key.
    use_native: the native draw (None: on one CPU where it was built; False on a mesh,
    where the arrays span devices).
    Returns (tokens [b], logprob of each token [b], next keys [b, 2], the top
    candidates' ids [b, TOP_CANDIDATES] and logprobs, zeros unless want_top). Logprobs
    are of the model's distribution before penalties, temperature and the cuts, as
    OpenAI reports them (vLLM's default too).
    """
    scores = logits if scores is None else scores
    if allowed is not None:
        scores = jax.lax.cond(jnp.any(allowed != -1), lambda s: _only_allowed(s, allowed), lambda s: s, scores)
    split = jax.vmap(lambda k: jax.random.split(jax.random.wrap_key_data(k)))(keys)
    use, nxt = split[:, 0], split[:, 1]
    uniform = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(use)
    args = (logits, scores, temperature, top_p, top_k, min_p, uniform, want_top)
    if native.use_kernel(use_native, logits.dtype == jnp.float32, "sampling"):
        drawn = jax.lax.platform_dependent(*args, cpu=_native_sample, default=_xla_sample)
    else:
        drawn = _xla_sample(*args)
    tokens, token_logprob, top_ids, top_lp = drawn
    return tokens, token_logprob, jax.random.key_data(nxt), top_ids, top_lp


SAMPLED_WIDTH = 4 + 2 * TOP_CANDIDATES  # token, logprob, key (2), top ids, top logprobs
CARRY_WIDTH = 4  # the columns a decode step leaves its slot: token, logprob, key


def pack_sampled(drawn) -> jax.Array:
    """sample's outputs as one int32 array [b, SAMPLED_WIDTH], floats by their bits: read
    back in one transfer, where five cost 0.25 ms a step more (measured)."""
    tokens, logprob, keys, top_ids, top_lp = drawn

    def bits(a):
        return jax.lax.bitcast_convert_type(a, jnp.int32)

    return jnp.concatenate([tokens[:, None], bits(logprob)[:, None], bits(keys), top_ids, bits(top_lp)], axis=1)


def unpack_sampled(packed: np.ndarray):
    """pack_sampled's array, read back: sample's outputs as host arrays (views of it)."""
    top = 4 + TOP_CANDIDATES
    return (packed[:, 0], packed[:, 1].view(np.float32), packed[:, 2:4].view(np.uint32),
            packed[:, 4:top], packed[:, top:SAMPLED_WIDTH].view(np.float32))
