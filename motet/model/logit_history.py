"""What a slot's request has seen, on the device, for the samplers that read it: the
presence, frequency and repetition penalties and logit_bias (vLLM's meanings).

Per KV slot (the scratch one included), three rows over the vocabulary: how often each
token was fed back as the answer (`counts`), which the prompt holds (`seen`), and the
request's logit_bias (`bias`). A request that uses them resets its slot's rows when its
prompt is read (`begin`); the decode steps count the tokens they feed (`count_fed`, a
scatter of one value a row), so a step chained on the device counts a token the host
has not read yet: the runner calls `resample` after every decode step of a batch that
holds such a row, and such a row is in every step until it ends. `penalize` runs only
when some row of a batch asks for it.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .kv_writes import cache_zeros
from .sampling import CARRY_WIDTH, SAMPLED_WIDTH, native_unless_on, pack_sampled, sample


class LogitHistory(NamedTuple):
    counts: jax.Array  # [slots, vocab] int32: the answer's tokens, fed back so far
    seen: jax.Array  # [slots, vocab] bool: the prompt's tokens
    bias: jax.Array  # [slots, vocab] float32: added to the logits


def empty_history(slots: int, vocab: int, mesh: Mesh | None = None) -> LogitHistory:
    """Zeroed rows for `slots` slots, whose pages count in the resident set once a
    request writes them (kv_writes.cache_zeros); on a mesh, whole on every device (as
    the carry)."""
    if mesh is None:
        return LogitHistory(*(cache_zeros((slots, vocab), t) for t in (jnp.int32, jnp.bool_, jnp.float32)))
    history = LogitHistory(jnp.zeros((slots, vocab), jnp.int32), jnp.zeros((slots, vocab), jnp.bool_),
                           jnp.zeros((slots, vocab), jnp.float32))
    return jax.device_put(history, NamedSharding(mesh, PartitionSpec()))


def start_rows(vocab: int, prompt, bias: tuple[tuple[int, float], ...]) -> tuple[np.ndarray, np.ndarray]:
    """A request's `seen` and `bias` rows, on the host (ids past `vocab` are dropped)."""
    seen = np.zeros(vocab, np.bool_)
    ids = np.asarray(prompt, np.int64)
    seen[ids[(ids >= 0) & (ids < vocab)]] = True
    row = np.zeros(vocab, np.float32)
    for token, value in bias:
        if 0 <= token < vocab:
            row[token] = value
    return seen, row


@partial(jax.jit, donate_argnums=0)
def begin(history: LogitHistory, slot, seen_row, bias_row) -> LogitHistory:
    """A new request in `slot` (traced: one compile for every slot): no answer yet, its
    prompt and bias."""
    return LogitHistory(history.counts.at[slot].set(0), history.seen.at[slot].set(seen_row),
                        history.bias.at[slot].set(bias_row))


def count_fed(history: LogitHistory, slots, tokens) -> LogitHistory:
    """Each row's fed token counted in its slot (a token < 0 counts nothing)."""
    tokens = jnp.where(tokens < 0, history.counts.shape[1], tokens)  # out of range: dropped
    return history._replace(counts=history.counts.at[slots, tokens].add(1, mode="drop"))


def penalize(logits, history: LogitHistory, slots, penalties):
    """The scores a batch samples from. penalties: per row [b], (presence, frequency,
    repetition (1: none), uses: whether the row reads its slot's history). Each row that
    uses its history gets, in order, the repetition penalty on every token of its
    prompt or answer (a positive logit divided by it, a negative one multiplied), the
    frequency penalty times the answer's count of each token, the presence penalty on
    each token the answer holds, then its logit_bias. Other rows keep their logits."""
    presence, frequency, repetition, uses = penalties

    def apply(logits):
        counts = history.counts[slots]
        answered = counts > 0
        repeated = history.seen[slots] | answered
        rep = repetition[:, None]
        scores = jnp.where(repeated, jnp.where(logits > 0, logits / rep, logits * rep), logits)
        scores = scores - frequency[:, None] * counts - presence[:, None] * answered
        scores = scores + history.bias[slots]
        return jnp.where(uses[:, None], scores, logits)

    return jax.lax.cond(jnp.any(uses), apply, lambda x: x, logits)


@partial(jax.jit, donate_argnums=3, static_argnames="use_native")
def sample_with_history(logits, cuts, want_top, history: LogitHistory, slots, fed, penalties, allowed, *,
                        use_native: bool | None = None):
    """sampling.sample of `logits` with cuts (temperature, top_p, top_k, min_p, keys) and
    `allowed`, each row's fed token (< 0: none) counted first and the rows penalized: for
    the samples taken outside a decode step (after a prefill; tiered decode). Returns
    (the history, sample's outputs). use_native: as sample's."""
    history = count_fed(history, slots, fed)
    return history, sample(logits, *cuts, want_top, penalize(logits, history, slots, penalties), allowed,
                           use_native=use_native)


@partial(jax.jit, static_argnames="mesh", donate_argnames=("packed", "carry", "history"))
def resample(logits, fed, packed, carry, history: LogitHistory, slots, cuts, want_top, penalties, allowed, *,
             mesh=None):
    """A decode step's rows sampled again with their history and masks: the step
    (forward.decode_sampled) samples plainly, and this call, dispatched right after it
    for a batch that holds a penalized or constrained row, counts what each row fed
    (`fed` [b, 3] int32: token, key words, as the step returns it) and draws from the
    step's logits with the same keys. cuts: sample's (temperature, top_p, top_k, min_p)
    without the keys. Returns (`packed` with sample's columns replaced, the carry with
    the rows' slots updated, the history)."""
    keys = jax.lax.bitcast_convert_type(fed[:, 1:3], jnp.uint32)
    history = count_fed(history, slots, fed[:, 0])
    scores = penalize(logits, history, slots, penalties)
    drawn = pack_sampled(sample(logits, *cuts, keys, want_top, scores, allowed,
                                use_native=native_unless_on(mesh)))
    carry = carry.at[slots].set(drawn[:, :CARRY_WIDTH])
    if mesh is not None:  # placed as the step and empty_history place them
        carry, history = jax.lax.with_sharding_constraint((carry, history), NamedSharding(mesh, PartitionSpec()))
    return packed.at[:, :SAMPLED_WIDTH].set(drawn), carry, history
