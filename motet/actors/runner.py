"""The device runner: owns the weights, the KV cache and the jitted calls. Its methods
run in the scheduler's one worker thread; nothing else touches device state."""

from __future__ import annotations

import time
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from ..model.generate import decode_step, prefill_slot
from ..model.kv import KVGeometry, init_kv
from ..model.model import Model
from ..model.sampling import request_key, sample

TOP_CANDIDATES = 5


@dataclass(frozen=True)
class SamplingRow:
    """One row of a sampling call: the request's parameters and its current PRNG key."""

    temperature: float
    top_p: float
    key: np.ndarray  # uint32[2]
    want_top: bool


@dataclass(frozen=True)
class Sampled:
    token: int
    logprob: float
    next_key: np.ndarray
    top: tuple[tuple[int, float], ...]  # (token id, logprob) best first; empty unless asked
    experts: np.ndarray  # the experts that computed the token fed in: [MoE layers, k...]


class ModelRunner:
    def __init__(self, model: Model, geo: KVGeometry):
        self.model = model
        self.geo = geo
        self.kv = init_kv(model.config, geo, model.weights["lm_head"].dtype)
        # Seconds spent sampling so far: the scheduler splits a step's time with it.
        self.sample_seconds = 0.0

    @staticmethod
    def new_key(seed: int) -> np.ndarray:
        return np.asarray(request_key(seed % (1 << 63)))  # JAX seeds are int64

    def prefill(self, slot: int, ids: list[int], offset: int, row: SamplingRow) -> Sampled:
        """Run `ids` (at most one chunk) into `slot` at `offset` and sample the next token
        from the last one's logits."""
        logits, experts = self.extend(slot, ids, offset)
        # the prompt's routing counts toward the first token: [layers, k·len(ids)]
        layers, tokens, k = experts.shape
        return self._sample(logits[None], [row], experts.reshape(1, layers, tokens * k))[0]

    def extend(self, slot: int, ids: list[int], offset: int):
        """Run a chunk into the cache: (logits after its last token, routing [layers, t, k])."""
        logits, self.kv, experts = prefill_slot(
            self.model, self.kv, self.geo, slot, ids, offset, with_routing=True
        )
        return logits, experts

    def decode(self, tokens: list[int], slots: list[int], positions: list[int],
               rows: list[SamplingRow]) -> list[Sampled]:
        """One batched step: each row feeds its token at its position in its slot, then
        samples its next token."""
        logits, self.kv, experts = decode_step(
            self.model, self.kv, self.geo, tokens, slots, positions, with_routing=True
        )
        return self._sample(logits, rows, experts.transpose(1, 0, 2))

    def _sample(self, logits, rows: list[SamplingRow], experts: np.ndarray) -> list[Sampled]:
        """experts: per row, the routing of what it fed in, [rows, MoE layers, ...]."""
        t = time.perf_counter()
        n_top = TOP_CANDIDATES if any(r.want_top for r in rows) else 0
        tokens, logprobs, keys, top_ids, top_lp = sample(
            logits,
            jnp.asarray([r.temperature for r in rows], jnp.float32),
            jnp.asarray([r.top_p for r in rows], jnp.float32),
            jnp.asarray(np.stack([r.key for r in rows])),
            n_top=n_top,
        )
        tokens, logprobs, keys, top_ids, top_lp = (
            np.asarray(a) for a in (tokens, logprobs, keys, top_ids, top_lp)
        )
        self.sample_seconds += time.perf_counter() - t
        return [
            Sampled(
                token=int(tokens[i]),
                logprob=float(logprobs[i]),
                next_key=keys[i],
                top=tuple(zip(top_ids[i].tolist(), top_lp[i].tolist())) if r.want_top else (),
                experts=experts[i],
            )
            for i, r in enumerate(rows)
        ]
