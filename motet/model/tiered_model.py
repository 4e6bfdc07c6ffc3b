"""`TieredModel`: prefill and decode of a model whose experts live in an ExpertPool, the
same calls (and results) as generate.py's prefill_slot/decode_step.

Two ways to run a step:

- layer by layer (tiered.py's pieces): after a MoE layer's router runs, its routed
  experts (of the real rows only: padding rows are masked out, so their experts are
  never loaded) are looked up in the pool, the missing ones loaded once each, and the
  layer's MoE runs over the pool; meanwhile the guess the router piece made for the next
  MoE layer is prefetched into that layer's pool.
- optimistically, as one jitted step (forward.py's, each MoE layer reading its pool
  through its expert → slot table), when the last step found every expert it needed on
  the device. The step only returns K/V rows, so if an expert turns out to be missing
  nothing is written: the step is thrown away and run layer by layer. A pool that holds
  what the routing wants so runs at the speed of resident experts.

On a mesh (the model's shared weights placed on it, the pool split along ep with each
device group's slots holding its own experts, and along tp each expert's width,
expert_pool.py) both ways run there: the one-jit step is forward.py's shard_map, where
each device keeps the routed experts whose slot is in its range; a layer piece runs
replicated, or with tp > 1 as a shard_map over its attention heads, and a layer's MoE
over the pool is a shard_map of the same kind.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .errors import ContextLengthError
from .expert_pool import ExpertPool
from .forward import decode, prefill
from .generate import padded_rows
from .kv import KVGeometry, bucket
from .kv_writes import write_chunk, write_rows
from .model import Model
from .sharding import mesh_of
from .tiered import (
    embed_tokens,
    head,
    head_row,
    layer_chunk,
    layer_rows,
    moe_over_pool,
    shared_weights,
    top_weights,
)


class TieredModel:
    def __init__(self, model: Model, pool: ExpertPool, moe_impl: str = "auto", prefetch: bool = True,
                 optimistic: bool = True):
        cfg = self.cfg = model.config
        self.pool, self.prefetch, self.allow_optimistic = pool, prefetch, optimistic
        self.mesh = mesh_of(model.weights)
        if self.mesh != pool.mesh:
            raise ValueError("the expert pool must be on the mesh the model's weights are on")
        self.impl = moe_impl
        self.top = top_weights(model.weights)
        self.layers = [shared_weights(layer) for layer in model.weights["layers"]]
        moe = [i for i in range(cfg.n_layers) if cfg.moe_layers[i]]
        self.moe_index = {i: r for r, i in enumerate(moe)}  # model layer → MoE layer r
        # For each MoE layer, the next MoE layer's norm and router (its guess), or None.
        self.next_router: list[dict | None] = []
        for i in range(cfg.n_layers):
            later = [j for j in moe if j > i]
            nxt = self.layers[later[0]] if later and cfg.moe_layers[i] else None
            self.next_router.append(
                {"ffn_norm": nxt["ffn_norm"], "router": nxt["router"]} if nxt else None
            )
        self.optimistic = optimistic  # try the one-jit step next time
        self._luts: tuple[int, list] = (-1, [])  # (pool version, per-layer device tables)

    def decode_step(self, kv, geo: KVGeometry, tokens: Sequence[int], slots: Sequence[int],
                    positions: Sequence[int]):
        """As generate.decode_step(with_routing=True): (logits [rows, vocab], kv,
        routing [MoE layers, rows, k])."""
        n = len(tokens)
        logits, kv, routing = self.decode_padded(kv, geo, tokens, slots, positions)
        return (logits if logits.shape[0] == n else logits[:n]), kv, routing

    def decode_padded(self, kv, geo: KVGeometry, tokens: Sequence[int], slots: Sequence[int],
                      positions: Sequence[int]):
        """As generate.decode_padded: the logits of every row of the padded batch."""
        n = len(tokens)
        tok_d, slot_d, pos_d = (jax.device_put(a) for a in padded_rows(geo, tokens, slots, positions))
        k_cache, v_cache = kv
        fused = self._fused(n, lambda w: decode(w, k_cache, v_cache, tok_d, slot_d, pos_d,
                                                cfg=self.cfg, moe_impl=self.impl))
        if fused is not None:
            logits, new_k, new_v, routing = fused
        else:
            x, new_k, new_v, routing = self._layers(tok_d, n, self._rows_piece(kv, slot_d, pos_d))
            logits = head(self.cfg, self.top, x)
        return logits, write_rows(k_cache, v_cache, new_k, new_v, slot_d, pos_d), routing

    def prefill_slot(self, kv, geo: KVGeometry, slot: int, ids: Sequence[int], offset: int):
        """As generate.prefill_slot(with_routing=True): (logits [vocab], kv,
        routing [MoE layers, len(ids), k])."""
        if offset + len(ids) > geo.max_context:
            raise ContextLengthError(offset + len(ids), geo.max_context)
        logits, routing = None, []
        for start in range(0, len(ids), geo.chunk):
            chunk = np.asarray(ids[start : start + geo.chunk], np.int32)
            n = len(chunk)
            padded = np.zeros(bucket(n, cap=geo.chunk), np.int32)
            padded[:n] = chunk
            at, tokens = offset + start, jax.device_put(padded)
            k_cache, v_cache = kv
            fused = self._fused(n, lambda w: prefill(w, k_cache, v_cache, tokens, slot, at, n, cfg=self.cfg,
                                                     moe_impl=self.impl))
            if fused is not None:
                logits, new_k, new_v, chosen = fused
            else:
                x, new_k, new_v, chosen = self._layers(tokens, n, self._chunk_piece(kv, slot, at))
                logits = head_row(self.cfg, self.top, x, n - 1)
            kv = write_chunk(k_cache, v_cache, new_k, new_v, slot, at)
            routing.append(chosen)
        return logits, kv, np.concatenate(routing, axis=1)

    def _rows_piece(self, kv, slots, positions):
        def piece(i, x, nxt):
            return layer_rows(self.cfg, self.layers[i], nxt, x, kv[0][i], kv[1][i], slots, positions, self.mesh)

        return piece

    def _chunk_piece(self, kv, slot: int, offset: int):
        def piece(i, x, nxt):
            return layer_chunk(self.cfg, self.layers[i], nxt, x, kv[0][i], kv[1][i], slot, offset, self.mesh)

        return piece

    # ---- warm-up: every shape compiled, no expert moved ----------------------------------

    def warm_decode(self, kv, geo: KVGeometry, rows: int, position: int):
        """Run both ways of a decode step of `rows` padded rows at `position` of the
        scratch slot without touching the pool (its lookups, stats and contents stay as
        they were): the padded logits and the kv."""
        scratch = [geo.scratch_slot] * rows
        padded = padded_rows(geo, [0] * rows, scratch, [position] * rows)
        tok_d, slot_d, pos_d = (jax.device_put(a) for a in padded)
        k_cache, v_cache = kv
        decode(self.pooled_weights(), k_cache, v_cache, tok_d, slot_d, pos_d, cfg=self.cfg, moe_impl=self.impl)
        x, new_k, new_v, _ = self._layers(tok_d, rows, self._rows_piece(kv, slot_d, pos_d), dry=True)
        return head(self.cfg, self.top, x), write_rows(k_cache, v_cache, new_k, new_v, slot_d, pos_d)

    def warm_prefill(self, kv, geo: KVGeometry, tokens: int, offset: int):
        """The same for a prefill chunk of `tokens` (padded) tokens at `offset`: the
        logits of its last token and the kv."""
        slot, padded = geo.scratch_slot, jax.device_put(np.zeros(tokens, np.int32))
        k_cache, v_cache = kv
        prefill(self.pooled_weights(), k_cache, v_cache, padded, slot, offset, tokens, cfg=self.cfg,
                moe_impl=self.impl)
        x, new_k, new_v, _ = self._layers(padded, tokens, self._chunk_piece(kv, slot, offset), dry=True)
        return head_row(self.cfg, self.top, x, tokens - 1), write_chunk(k_cache, v_cache, new_k, new_v, slot, offset)

    # ---- the one-jit step ----------------------------------------------------------

    def _fused(self, n: int, run):
        """Run the whole step over the pools if the last step found all its experts:
        (logits, new K, new V, routing [MoE layers, n, k]), or None (run it by layers)."""
        if not (self.allow_optimistic and self.optimistic):
            return None
        logits, new_k, new_v, chosen = run(self.pooled_weights())
        routing = np.stack([np.asarray(ids)[:n] for ids in chosen])  # [R, n, k]
        lut = self.pool.lut
        if (np.take_along_axis(lut, routing.reshape(len(lut), -1), axis=1) < 0).any():
            self.optimistic = False  # an expert was missing: throw the step away
            return None
        self.pool.begin_step()
        for r in range(len(lut)):
            self.pool.all_present(r, np.unique(routing[r]))
        return logits, new_k, new_v, routing

    def pooled_weights(self) -> dict:
        """The model's weights with each MoE layer reading its pool through its table."""
        version, tables = self._luts
        if version != self.pool.version:
            where = None if self.mesh is None else NamedSharding(self.mesh, P())  # replicated
            tables = [jax.device_put(row, where) for row in self.pool.lut]
            self._luts = (self.pool.version, tables)
        layers = list(self.layers)
        for i, r in self.moe_index.items():
            gate_up, down = self.pool.pools[r]
            layers[i] = {**layers[i], "experts_gate_up": gate_up, "experts_down": down,
                         "expert_slots": tables[r]}
        return {**self.top, "layers": layers}

    # ---- layer by layer ------------------------------------------------------------

    def _layers(self, tokens, n: int, piece, dry: bool = False):
        """Run every layer over tokens [t] of which the first n are real: (hidden states,
        new K and V per layer, the real rows' expert ids [MoE layers, n, k]). dry: every
        MoE layer runs over its pool with nothing routed (the same compiled functions, no
        lookups, no loads: a warm-up)."""
        if not dry:
            self.pool.begin_step()
        before = self.pool.stats.lookups - self.pool.stats.hits
        x = embed_tokens(self.top, tokens)
        new_k, new_v, routing = [], [], []
        real = np.arange(tokens.shape[0]) < n
        for i in range(self.cfg.n_layers):
            x, h, w, ids, guess, k, v = piece(i, x, self.next_router[i])
            new_k.append(k)
            new_v.append(v)
            if h is None:
                continue  # a dense layer: done inside the piece
            r = self.moe_index[i]
            ids = np.asarray(ids)
            routing.append(ids[:n])
            if dry:
                nothing = np.zeros(ids.shape, np.int32)
                x = moe_over_pool(x, h, w, nothing.astype(np.float32), nothing, *self.pool.pools[r],
                                  impl=self.impl, mesh=self.mesh, x_bits=self.cfg.x_bits)
                continue
            x = self._moe(r, x, h, w, ids, real)
            if guess is not None and self.prefetch:
                self.pool.prefetch(r + 1, _by_votes(np.asarray(guess)[:n]))
        if not dry:
            self.optimistic = self.pool.stats.lookups - self.pool.stats.hits == before  # no misses
        rows = np.zeros((0, n, 0), np.int32)
        return x, new_k, new_v, (np.stack(routing) if routing else rows)

    def _moe(self, r: int, x, h, w, ids: np.ndarray, real: np.ndarray):
        """The layer's MoE over its pool, in as many passes as its experts need."""
        needed = np.unique(ids[real])
        slots = self.pool.lut[r][ids]
        if (slots[real] >= 0).all():  # the common case: one pass, nothing to load
            self.pool.all_present(r, needed)
            mask = np.broadcast_to(real[:, None], ids.shape)
            return moe_over_pool(x, h, w, mask.astype(np.float32), np.where(mask, slots, 0).astype(np.int32),
                                 *self.pool.pools[r], impl=self.impl, mesh=self.mesh, x_bits=self.cfg.x_bits)
        for group in self.pool.passes(r, needed):
            lut = self.pool.ensure(r, group)
            in_pass = real[:, None] & np.isin(ids, group)
            slot_ids = np.where(in_pass, lut[ids], 0).astype(np.int32)
            x = moe_over_pool(x, h, w, in_pass.astype(np.float32), slot_ids, *self.pool.pools[r],
                              impl=self.impl, mesh=self.mesh, x_bits=self.cfg.x_bits)
        return x


def _by_votes(guess: np.ndarray) -> np.ndarray:
    """The unique guessed experts, the ones most rows named first."""
    experts, votes = np.unique(guess, return_counts=True)
    return experts[np.argsort(-votes, kind="stable")]
