"""The device runner: owns the weights, the KV cache and the jitted calls, and in tiered
mode the expert pool (the per-layer lookup the forward pass consults). Its methods run in
the scheduler's one worker thread; nothing else touches device state."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import jax
import numpy as np

from ..model.burst import BURST_ROWS, bursts_run, dispatch_burst, read_burst
from ..model.expert_pool import ExpertPool, ExpertReader, Placement
from ..model.expert_source import ArrayExpertReader, with_packed_experts
from ..model.forward import empty_carry
from ..model.generate import dispatch_decode, model_kv_sharding, padded_rows, prefill_slot, read_decode
from ..model.kv import (
    MIN_BUCKET,
    KVGeometry,
    batch_bucket,
    copy_slot_prefix,
    init_kv,
    read_slot_layer,
    write_slot_layer,
)
from ..model.logit_history import begin, empty_history, resample, sample_with_history, start_rows
from ..model.model import Model
from ..model.sampling import native_unless_on, open_mask, request_key, sample
from ..model.sharding import MeshSpec, mesh_of, model_mesh, place_weights
from ..model.tiered import shared_model_weights, shared_weight_bytes
from ..model.tiered_model import TieredModel
from ..protocol.mirror import Op, encode
from ..runtime.allocator import give_back_after_prefill
from ..runtime.api import ExpertTiers
from .expert_policy import ExpertPlan
from .step_rows import DecodeInFlight, Sampled, SamplingRow, sampled_rows, sampling_arrays
from .tier_snapshot import tiers_snapshot

# Loads one placement may start per layer between two steps: re-pinning catches up over
# a few steps instead of stalling one.
MAX_MOVES_PER_PLACEMENT = 4
MIRROR_RECORDS = (SamplingRow, ExpertPlan)  # the records a mirror frame may carry (protocol/mirror.py)


@dataclass(frozen=True)
class ExpertStep:
    """A device call's expert traffic (tiered mode), and the tiers after it if they moved."""

    lookups: int = 0
    hits: int = 0
    moves: tuple[tuple[int, int, int, int], ...] = ()  # layer, expert, old tier, new tier
    tiers: ExpertTiers | None = None
    wait_s: float = 0.0  # seconds the step spent moving experts
    disk_s: float = 0.0  # of those, reading them from the model file


class ModelRunner:
    def __init__(self, model: Model, geo: KVGeometry, plan: ExpertPlan | None = None, *,
                 prefetch: bool = True, rank: np.ndarray | None = None,
                 mesh: MeshSpec | str | None = None, mirror: Callable[[bytes], None] | None = None,
                 burst: int = 1):
        """plan: resident (None) or tiered experts; rank: the initial heat per (MoE layer,
        expert) the tiered pool starts from (hottest first onto the device); mesh: shard
        the weights and the KV over several devices (model/sharding.py) — weights loaded
        onto that mesh already stay where they are. mirror: on process 0 of a group
        (actors/device_group.py), where each device call goes as a frame first (START
        now, with the geometry and the experts' plan), for the other processes to repeat
        (actors/follower.py): they move their pools' experts alike. burst: the most
        decode steps one call may take for the rows burst_steps allows (1: none, as it is
        where steps do not chain or the cache does not take the native write)."""
        cfg = model.config
        tiered_plan = plan if plan is not None and plan.mode == "tiered" else None
        tiered = tiered_plan is not None
        reader: ExpertReader | None = model.expert_reader
        if tiered and reader is None:  # loaded with its experts: the pool reads them from there
            if mesh_of(model.weights) is not None and jax.process_count() > 1:  # each has its shards only
                raise ValueError("in a group of processes, a tiered model's experts are read from the "
                                 "file: load it with its experts left there (lazy_experts)")
            reader = ArrayExpertReader.from_weights(cfg, model.weights)
        if mesh is not None:
            device_mesh = model_mesh(mesh, cfg)
            placed = mesh_of(model.weights)
            if placed is None:
                # a tiered model's experts go to the pool, not onto the mesh
                weights = shared_model_weights(model.weights) if tiered else model.weights
                model = replace(model, weights=place_weights(weights, cfg, device_mesh))
            elif placed != device_mesh:
                raise ValueError(f"the model's weights are sharded over another mesh ({dict(placed.shape)}); "
                                 f"load them on one device or on the same mesh ({dict(device_mesh.shape)})")
        if tiered and mesh_of(model.weights) is not None:
            model = replace(model, weights=shared_model_weights(model.weights))  # the pool holds them
        self.geo = geo
        self.mirror = mirror
        if burst < 1:
            raise ValueError(f"a burst takes at least 1 step, got {burst}")
        self._mirror(Op.START, geo.n_slots, geo.max_context, geo.chunk, fingerprint(model), plan, rank, prefetch)
        if model.expert_reader is not None and not tiered:
            # loaded lazily, and the plan keeps them resident: read in after START, as the
            # followers do (placing them on a mesh of several processes takes every process)
            model = with_packed_experts(model)
        self.model = model
        dtype = model.weights["lm_head"].dtype
        self.kv = init_kv(cfg, geo, model.kv_dtype, model_kv_sharding(model))
        # per slot, what its last decode step sampled, and what its request has seen
        self.carry = empty_carry(geo.scratch_slot + 1, mesh_of(model.weights))
        self.history = empty_history(geo.scratch_slot + 1, cfg.vocab_size, mesh_of(model.weights))
        self._open_masks: dict[int, jax.Array] = {}  # per batch bucket
        # Seconds spent sampling in calls of their own (after a prefill, and tiered decode
        # steps; a resident decode step samples inside its own call): the scheduler splits
        # a step's time with it.
        self.sample_seconds = 0.0
        # The fewest prompt tokens a copy of another slot's KV must save to beat reading
        # them: the warm-up times both (warmup.copy_threshold); unmeasured, a chunk's least.
        self.copy_min_tokens = MIN_BUCKET
        self.shared_bytes = shared_weight_bytes(model.weights)
        self.tiered: TieredModel | None = None
        self.pool: ExpertPool | None = None
        # as ExpertMap: a dense model is one always-on expert per layer
        self.rows, self.cols = (sum(cfg.moe_layers), cfg.n_experts) if cfg.is_moe else (cfg.n_layers, 1)
        self.totals = np.zeros(5, np.int64)  # lookups, hits, guessed, right, routed
        if tiered_plan is not None:
            assert reader is not None  # read above, before the experts left the weights
            p = tiered_plan
            self.pool = ExpertPool(reader, p.layers, p.experts, p.pool_slots, p.ram_capacity,
                                   dtype, mesh=mesh_of(model.weights))
            self.pool.fill(np.zeros((p.layers, p.experts)) if rank is None else rank)
            self.pool.take_stats()  # the start-up loads are not a step's moves
            self.tiered = TieredModel(model, self.pool, prefetch=prefetch)
        self._tiers = tiers_snapshot(self.model, self.pool, self.totals, self.shared_bytes, self.rows, self.cols)
        # bursts chain their steps and store rows with the native write, neither of which changes later
        self.burst = burst if self.defers and bursts_run(self.model.weights, self.kv[0]) else 1

    @staticmethod
    def new_key(seed: int) -> np.ndarray:
        return np.asarray(request_key(seed % (1 << 63)))  # JAX seeds are int64

    def _mirror(self, op: Op, *args) -> None:
        """The seam every call that runs a computation over the device mesh goes through
        first: on a group's leader, the call as a frame for the followers."""
        if self.mirror is not None:
            self.mirror(encode(op, args, MIRROR_RECORDS))

    def prefill(self, slot: int, ids: list[int], offset: int, row: SamplingRow, history=None,
                forks: Sequence[tuple[int, SamplingRow]] = ()) -> list[Sampled]:
        """Run `ids` (at most one chunk) into `slot` at `offset` and sample the next token
        from the last one's logits. history: (the whole prompt, the logit bias) a request
        that reads its LogitHistory starts its slot's with (Active.history_start).
        forks: (slot, row) of the other choices of an n > 1 request, whose prompt this
        chunk ends: each gets a copy of the slot's KV and its own history, and samples
        its own first token from the same logits. Returns the Sampled of `row`, then
        of each fork."""
        self._mirror(Op.PREFILL, slot, ids, offset, row, history, [list(fork) for fork in forks])
        starts = [slot, *(fork_slot for fork_slot, _ in forks)]
        if history is not None:
            seen, bias = start_rows(self.model.config.vocab_size, *history)
            for start in starts:
                self.history = begin(self.history, np.int32(start), seen, bias)
        logits, experts = self._extend(slot, ids, offset)
        for fork_slot, _ in forks:
            self._copy(slot, fork_slot, offset + len(ids))
        # the prompt's routing counts toward the first token: [layers, k·len(ids)]
        layers, tokens, k = experts.shape
        routing = experts.reshape(1, layers, tokens * k)
        sampled = self.sample_logits(logits[None], [row], routing, [slot])
        for fork_slot, fork_row in forks:  # a row at a time: the one-row sampler is compiled already
            sampled += self.sample_logits(logits[None], [fork_row], routing[:, :, :0], [fork_slot])
        return sampled

    def copy_prefix(self, source: int, target: int, positions: int) -> None:
        """Slot `source`'s first `positions` positions of KV over slot `target`'s: a
        prompt's prefix that another slot holds (the target's positions past it are its
        own prefill's to write)."""
        self._mirror(Op.COPY_SLOT, source, target, positions)
        self._copy(source, target, positions)

    def _copy(self, source: int, target: int, positions: int) -> None:
        self.kv = copy_slot_prefix(self.kv, source, target, positions)

    def extend(self, slot: int, ids: list[int], offset: int):
        """Run a chunk into the cache: (logits after its last token, routing [layers, t, k])."""
        self._mirror(Op.EXTEND, slot, ids, offset)
        return self._extend(slot, ids, offset)

    def _extend(self, slot: int, ids: list[int], offset: int):
        if self.tiered is not None:
            logits, self.kv, experts = self.tiered.prefill_slot(self.kv, self.geo, slot, ids, offset)
        else:
            logits, self.kv, experts = prefill_slot(self.model, self.kv, self.geo, slot, ids, offset, with_routing=True)
        give_back_after_prefill(len(ids))
        return logits, experts

    def wait_ready(self) -> None:
        """Block until the device has finished every step dispatched so far (JAX runs
        them asynchronously; a prefill that samples nothing is otherwise still running
        when its call returns). Not mirrored: a wait on this process's own devices."""
        jax.block_until_ready(self.kv)

    @property
    def chains(self) -> bool:
        """Whether a decode step may take its rows' tokens from the step before it on the
        device (dispatch's chained). Not with tiered experts: their pool moves between
        steps on the host, after reading the routing of the step before."""
        return self.tiered is None

    def decode(self, tokens: list[int], slots: list[int], positions: list[int],
               rows: list[SamplingRow], chained: Sequence[bool] = ()) -> list[Sampled]:
        """One batched step, dispatched and read back (see dispatch)."""
        return self.collect(self.dispatch(tokens, slots, positions, rows, chained))

    def dispatch(self, tokens: list[int], slots: list[int], positions: list[int],
                 rows: list[SamplingRow], chained: Sequence[bool] = (), defer: bool = False,
                 steps: int = 1) -> DecodeInFlight:
        """Start one batched step: each row feeds its token at its position in its slot,
        then samples its next token (in the step's own compiled call, but for tiered
        experts). A row with chained[i] set goes on from the last step that fed its slot:
        it feeds the token that step sampled, with the key it left (tokens[i] and
        rows[i].key are not read), whether or not that step has been collected. Rows
        with penalties or a mask are sampled again (finish) right away, or with defer
        (`defers`) when the caller finishes the step with its rows' newer masks. steps
        > 1 (at most burst_steps): a burst, each row fed its token at positions[i], then
        what it sampled at each next position (read with collect_steps)."""
        self._mirror(Op.DECODE, tokens, slots, positions, rows, list(chained))
        if self.tiered is not None:
            if any(chained):
                raise ValueError("tiered decode steps do not chain (ModelRunner.chains)")
            logits, self.kv, experts = self.tiered.decode_padded(self.kv, self.geo, tokens, slots, positions)
            sampled = self.sample_logits(logits, rows, experts.transpose(1, 0, 2), slots, tokens)
            return DecodeInFlight(tuple(rows), results=tuple(sampled))
        if defer and not self.defers:
            raise ValueError("a group's leader does not defer a step's sampling (ModelRunner.defers)")
        *cuts, keys, _, _ = sampling_arrays(rows, batch_bucket(len(rows)))
        if steps > 1:
            if steps > self.burst_steps(rows):
                raise ValueError(f"these rows take at most {self.burst_steps(rows)} steps a call, not {steps}")
            packed, self.kv, self.carry = dispatch_burst(
                self.model, self.kv, self.geo, tokens, slots, positions, (*cuts, keys), any(r.want_top for r in rows),
                self.carry, chained, steps, self.burst)
            return DecodeInFlight(tuple(rows), packed, steps=steps)
        packed, self.kv, self.carry, logits, fed = dispatch_decode(
            self.model, self.kv, self.geo, tokens, slots, positions, (*cuts, keys), any(r.want_top for r in rows),
            self.carry, chained)
        padded_slots = padded_rows(self.geo, tokens, slots, positions)[1]
        step = DecodeInFlight(tuple(rows), packed, deferred=(logits, fed, padded_slots))
        return step if defer else self.finish(step, rows)

    def burst_steps(self, rows: list[SamplingRow]) -> int:
        """The most steps one dispatch may take for these rows: `burst` for one row that
        samples plainly, where its steps chain and the cache takes the native write
        (model/burst.py); else 1."""
        plain = 1 <= len(rows) <= BURST_ROWS and all(not r.uses_history and r.allowed is None for r in rows)
        return self.burst if plain else 1

    @property
    def defers(self) -> bool:
        """Whether dispatch may leave a step's second sampling to finish: not where the
        followers of a group repeat each call as it comes (they would sample at once)."""
        return self.chains and self.mirror is None

    def finish(self, step: DecodeInFlight, rows: Sequence[SamplingRow]) -> DecodeInFlight:
        """A dispatched step whose rows that read their history or a grammar's mask are
        sampled again from its logits (logit_history.resample; the step sampled them
        plainly). rows: the step's own, or for a deferred step the same requests' rows
        as they are now (a grammar's mask after the token the step before sampled)."""
        if not step.deferred:
            return step
        logits, fed, slots = step.deferred
        packed = step.packed
        if any(r.uses_history or r.allowed is not None for r in rows):
            *cuts, _, penalties, allowed = self._sampling(list(rows), len(slots))
            packed, self.carry, self.history = resample(logits, fed, packed, self.carry, self.history, slots,
                                                        tuple(cuts), np.bool_(any(r.want_top for r in rows)),
                                                        penalties, allowed, mesh=mesh_of(self.model.weights))
        return DecodeInFlight(tuple(rows), packed)

    def collect(self, step: DecodeInFlight) -> list[Sampled]:
        """A dispatched step's results, one per row (waiting for the device)."""
        if step.steps > 1:
            raise ValueError("a burst is read with collect_steps")
        if step.deferred:
            raise ValueError("a deferred step is read after ModelRunner.finish")
        if step.packed is None:
            return list(step.results)
        drawn, experts = read_decode(self.model, step.packed, len(step.rows))
        return sampled_rows(list(step.rows), drawn, experts)

    def collect_steps(self, step: DecodeInFlight) -> list[list[Sampled]]:
        """A dispatched step's or burst's results: per step, one per row."""
        if step.steps == 1:
            return [self.collect(step)]
        rows = list(step.rows)
        return [sampled_rows(rows, drawn, experts)
                for drawn, experts in read_burst(self.model, step.packed, len(rows), step.steps)]

    def sample_logits(self, logits, rows: list[SamplingRow], experts: np.ndarray, slots: Sequence[int],
                      fed: Sequence[int] = ()) -> list[Sampled]:
        """logits [bucket, vocab]: the rows, then padding rows. experts: as sampled_rows.
        slots: the rows' own; fed: the tokens a decode step fed them (none after a prefill),
        counted in their history before the rows that read it are penalized."""
        t = time.perf_counter()
        bucket = logits.shape[0]
        *cuts, penalties, allowed = self._sampling(rows, bucket)
        want_top = any(r.want_top for r in rows)
        native = native_unless_on(mesh_of(self.model.weights))
        if any(r.uses_history for r in rows):
            padded = np.full((2, bucket), [[self.geo.scratch_slot], [-1]], np.int32)
            padded[0, : len(slots)], padded[1, : len(fed)] = slots, fed
            self.history, drawn = sample_with_history(logits, cuts, want_top, self.history, *padded, penalties,
                                                      allowed, use_native=native)
        else:
            drawn = sample(logits, *cuts, want_top, None, allowed, use_native=native)
        drawn = jax.device_get(drawn)
        self.sample_seconds += time.perf_counter() - t
        return sampled_rows(rows, drawn, experts)

    def _sampling(self, rows: list[SamplingRow], bucket: int):
        """sampling_arrays for a padded batch; an unconstrained one takes the bitmask that
        allows every token from the device (no transfer a step). A device array either way:
        one call signature, so what the warm-up's grammar row loaded serves open masks too."""
        *head, allowed = sampling_arrays(rows, bucket)
        if allowed is not None:
            return (*head, jax.device_put(allowed))
        if bucket not in self._open_masks:
            self._open_masks[bucket] = jax.device_put(open_mask(bucket, self.model.config.vocab_size))
        return (*head, self._open_masks[bucket])

    # ---- one slot's KV, layer by layer (sessions and handovers) ---------------------------

    def read_layers(self, slot: int, first: int, count: int, tokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Layers first .. first + count - 1 of `slot`: (K, V) host arrays per layer."""
        self._mirror(Op.READ_LAYERS, slot, first, count, tokens)  # a gather when the KV spans processes
        return [read_slot_layer(self.kv, layer, slot, tokens) for layer in range(first, first + count)]

    def write_layers(self, slot: int, first: int, pairs: list) -> None:
        """(K, V) host arrays into layers first, first + 1, ... of `slot`."""
        self._mirror(Op.WRITE_LAYERS, slot, first, pairs)
        for layer, (k_rows, v_rows) in enumerate(pairs, first):
            self.kv = write_slot_layer(self.kv, self.geo, layer, slot, k_rows, v_rows)

    # ---- experts --------------------------------------------------------------------

    def apply_placement(self, placement: Placement) -> None:
        """The ExpertCache's latest wish, between steps (nothing to do when resident)."""
        if self.pool is not None:
            self._mirror(Op.PLACE, [sorted(pins) for pins in placement.pinned],
                         [sorted(warm) for warm in placement.warm], np.asarray(placement.rank, np.float64))
            self.pool.apply(placement, MAX_MOVES_PER_PLACEMENT)

    def warm_pool_prefill(self, size: int, offset: int, row: SamplingRow) -> None:
        """Warm-up, tiered: a prefill of `size` padding tokens over the pool on the scratch
        slot, and its first token sampled with `row`."""
        assert self.tiered is not None
        self._mirror(Op.WARM_PREFILL, size, offset, row)
        logits, self.kv = self.tiered.warm_prefill(self.kv, self.geo, size, offset)
        self.sample_logits(logits[None], [row], np.zeros((1, 0, 0), np.int32), [self.geo.scratch_slot])

    def warm_pool_decode(self, size: int, position: int, rows: list[SamplingRow]) -> None:
        """Warm-up, tiered: a decode step of `size` padding rows over the pool on the
        scratch slot, sampled once with each of `rows` (tiered rows sample in calls of
        their own)."""
        assert self.tiered is not None
        self._mirror(Op.WARM_DECODE, size, position, rows)
        logits, self.kv = self.tiered.warm_decode(self.kv, self.geo, size, position)
        for row in rows:
            self.sample_logits(logits, [row] * size, np.zeros((size, 0, 0), np.int32),
                               [self.geo.scratch_slot] * size, [0] * size)

    def warm_move(self, size: int) -> None:
        """Warm-up, tiered: a pool move of `size` experts compiled and run (nothing moves)."""
        assert self.pool is not None
        self._mirror(Op.WARM_MOVE, size)
        self.pool.warm_move(size)

    def take_expert_step(self) -> ExpertStep:
        """The expert traffic since the last take (a step, with any placement before it)."""
        if self.pool is None:
            return ExpertStep()
        stats = self.pool.take_stats()
        self.totals += (stats.lookups, stats.hits, stats.guessed, stats.guessed_right,
                        stats.routed_after_guess)
        moves = tuple((m.layer, m.expert, m.old_tier, m.new_tier) for m in stats.moves)
        self._tiers = tiers_snapshot(self.model, self.pool, self.totals, self.shared_bytes, self.rows, self.cols)
        return ExpertStep(stats.lookups, stats.hits, moves, self._tiers, stats.load_s, stats.read_s)

    def expert_tiers(self) -> ExpertTiers:
        return self._tiers

def fingerprint(model: Model) -> str:
    """What the processes of a group must have loaded alike: the model's geometry, its
    dtypes (weights and KV) and the mesh its weights are on."""
    mesh = mesh_of(model.weights)
    what = (model.config, str(model.weights["lm_head"].dtype), None if mesh is None else dict(mesh.shape),
            model.weight_format, model.kv_dtype)
    return hashlib.sha256(repr(what).encode()).hexdigest()[:16]
