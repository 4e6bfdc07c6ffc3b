"""Where each expert of a tiered model lives — device pool, host RAM or disk — and the
moves between them. Plain host code owned by the runner thread: the forward pass asks it
for pool slots layer by layer; the policy (the ExpertCache actor) only hands it a
`Placement` between steps.

Tiers are exclusive: an expert is in exactly one, so per-tier counts always sum to
layers × experts. Promotion: disk → RAM (warming) and disk/RAM → device (a miss, a
prefetch or a pin). Demotion: a device eviction goes back to RAM, and RAM beyond its
budget drops its coldest experts back to disk (they are re-read from the mmapped file).

r indexes the model's MoE layers (0 … R-1), e an expert, s a pool slot (0 … C-1).

On a device mesh with ep expert-parallel groups (sharding.py), group g owns experts
[g·E/ep, (g+1)·E/ep) and the pool's slots [g·C/ep, (g+1)·C/ep): an expert only ever
goes into its owner's slot range, so each device's shard of the pool arrays holds its
own experts, and every choice below (start-up fill, victims, passes, pins) is made per
owner range. The expert → slot table stays one host array (replicated in the step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from .panels import as_read_here
from .quant import QTensor, host_index, stack
from .sharding import EP, TP, gate_up_layout
from .tiered import POOL_SPECS, put_experts, take_experts

DISK, RAM, DEVICE = 0, 1, 2  # EMAP's 2-bit tier


def move_sizes(slots: int) -> tuple[int, ...]:
    """How many experts one upload or copy back moves, padded: powers of two up to the
    pool's slots (a few compiled sizes; a padded repeat is a no-op)."""
    top = 1 << (slots - 1).bit_length()
    return tuple(1 << i for i in range(top.bit_length()))


def _padded(n: int, items: list):
    """items (n of them: arrays or QTensors) stacked and padded to the next power of two
    by repeating the last."""
    size = 1 << (n - 1).bit_length()
    return stack(items + [items[-1]] * (size - n))


class ExpertReader(Protocol):
    """One expert's packed weights from the model file (mmapped): gate_up [d, 2f],
    down [f, d], float32, or QTensors [2f, d], [d, f] as a quantized file holds them
    (the layout of weights.py, one expert at a time; expert_source.py)."""

    def read(self, r: int, e: int) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass(frozen=True)
class Placement:
    """The policy's wish between steps. pinned[r]: experts to hold on the device (never
    more than the pool minus its free-floating slots); warm[r]: experts worth pulling
    from disk into RAM; rank [R, E]: priority (heat): RAM drops the lowest first, and
    among pool slots used equally recently the lowest is evicted first."""

    pinned: tuple[frozenset[int], ...]
    warm: tuple[frozenset[int], ...]
    rank: np.ndarray


@dataclass(frozen=True)
class Move:
    layer: int  # MoE layer index r
    expert: int
    old_tier: int
    new_tier: int


@dataclass
class LookupStats:
    """Pool lookups since the last take: unique (layer, expert) pairs a step needed,
    those already on the device, and the prefetch guesses against what was routed."""

    lookups: int = 0
    hits: int = 0
    guessed: int = 0  # experts named by a guess
    guessed_right: int = 0  # of those, routed by the layer
    routed_after_guess: int = 0  # experts routed by layers that had a guess
    moves: list[Move] = field(default_factory=list)
    load_s: float = 0.0  # host seconds spent moving experts (evictions, reads, uploads)
    read_s: float = 0.0  # of those, reading the model file (the disk tier)


class ExpertPool:
    def __init__(self, reader: ExpertReader, n_layers: int, n_experts: int, slots: int,
                 ram_capacity: int | None, dtype=jnp.float32, mesh: Mesh | None = None):
        if not 1 <= slots <= n_experts:
            raise ValueError(f"pool slots must be in [1, {n_experts}], got {slots}")
        self.reader, self.R, self.E, self.C = reader, n_layers, n_experts, slots
        self.mesh = mesh
        groups = 1 if mesh is None else mesh.shape[EP]
        if n_experts % groups or slots % groups:
            raise ValueError(f"on ep={groups} the pool is split into {groups} equal slot ranges, one per "
                             f"device group's own experts: {slots} slots and {n_experts} experts per layer "
                             f"must both divide by {groups}")
        self.groups, self.group_slots, self.group_experts = groups, slots // groups, n_experts // groups
        self.ram_capacity = ram_capacity  # experts over all layers; None: no limit
        self.host_dtype = np.dtype(dtype)  # of float experts; quantized ones stay as read
        # Each layer's pool takes the shapes of its first expert as read: a quantized
        # file may hold some layers' experts in more bits than others.
        self.stats = LookupStats()
        templates = [self._read(r, 0) for r in range(n_layers)]
        self.quantized = any(isinstance(t[0], QTensor) for t in templates)
        if self.quantized and mesh is not None:
            raise ValueError("quantized experts are not split over a mesh yet: load with --dtype float32")
        self.expert_bytes = np.array([sum(w.nbytes for w in t) for t in templates], np.int64)
        where = (None, None) if mesh is None else tuple(NamedSharding(mesh, spec) for spec in POOL_SPECS)
        self.pools = [tuple(jax.tree.map(lambda a: jnp.zeros((slots, *a.shape), a.dtype, device=place), w)
                            for w, place in zip(t, where)) for t in templates]
        self.stats = LookupStats()  # the templates' reads are no step's
        self.lut = np.full((n_layers, n_experts), -1, np.int32)  # expert → slot, -1 off device
        self.occupant = np.full((n_layers, slots), -1, np.int32)  # slot → expert, -1 empty
        self.slot_used = np.zeros((n_layers, slots), np.int64)  # step of last use (LRU)
        # None: an expert being evicted from the device this moment (_evict)
        self.ram: dict[tuple[int, int], tuple[np.ndarray, np.ndarray] | None] = {}
        self.ram_used = np.zeros((n_layers, n_experts), np.int64)
        self.rank = np.zeros((n_layers, n_experts))
        self.pinned: list[frozenset[int]] = [frozenset()] * n_layers
        self.guesses: list[np.ndarray | None] = [None] * n_layers
        self.step = 0
        self.version = 0  # moves on whenever the lookup (expert → slot) changes

    # ---- state ---------------------------------------------------------------------

    def tier(self, r: int, e: int) -> int:
        return DEVICE if self.lut[r, e] >= 0 else RAM if (r, e) in self.ram else DISK

    def tier_map(self) -> np.ndarray:
        """[R, E] uint8 tiers."""
        tiers = np.zeros((self.R, self.E), np.uint8)
        for r, e in self.ram:
            tiers[r, e] = RAM
        tiers[self.lut >= 0] = DEVICE
        return tiers

    def counts(self) -> tuple[int, int, int]:
        """(device, RAM, disk) expert counts; they sum to R × E."""
        device, ram = int((self.lut >= 0).sum()), len(self.ram)
        return device, ram, self.R * self.E - device - ram

    def device_bytes(self) -> int:
        """Bytes of the device pools (every slot, filled or not)."""
        return int(self.C * self.expert_bytes.sum())

    def ram_bytes(self) -> int:
        """Bytes of the experts host RAM holds now."""
        return int(sum(self.expert_bytes[r] for r, _ in self.ram))

    def owner(self, e: int) -> int:
        """The ep group whose devices hold expert e (0 off a mesh)."""
        return e // self.group_experts

    def owner_slots(self, g: int) -> range:
        """The pool slots of ep group g: only its own experts go there."""
        return range(g * self.group_slots, (g + 1) * self.group_slots)

    def take_stats(self) -> LookupStats:
        stats, self.stats = self.stats, LookupStats()
        return stats

    # ---- the forward pass's calls --------------------------------------------------

    def begin_step(self) -> None:
        self.step += 1

    def all_present(self, r: int, needed: np.ndarray) -> None:
        """A layer's needed experts were all on the device (the caller checked): count
        the hits and mark the slots used."""
        self.stats.lookups += len(needed)
        self.stats.hits += len(needed)
        self._score_guess(r, needed)
        self.slot_used[r, self.lut[r, needed]] = self.step

    def passes(self, r: int, needed: np.ndarray) -> list[np.ndarray]:
        """Split a layer's unique needed experts into groups that fit the pool, those
        already on the device first (a step that needs more than C experts — on a mesh,
        more than C/ep of one group's — runs the layer in several passes). Counts the
        lookups and hits."""
        present = needed[self.lut[r, needed] >= 0]
        missing = needed[self.lut[r, needed] < 0]
        self.stats.lookups += len(needed)
        self.stats.hits += len(present)
        self._score_guess(r, needed)
        order = np.concatenate([present, missing])
        # the i-th of an owner's experts goes into pass i // (its slots)
        owners = order // self.group_experts
        nth = np.zeros(len(order), np.int64)
        for g in np.unique(owners):
            nth[owners == g] = np.arange(int((owners == g).sum()))
        which = nth // self.group_slots
        return [order[which == p] for p in range(int(which.max()) + 1)] if len(order) else []

    def ensure(self, r: int, group: np.ndarray) -> np.ndarray:
        """Put every expert of `group` (at most C, C/ep per owner) in the pool; returns
        the lookup row (expert → slot). The victims are slots holding none of the group."""
        self.slot_used[r, self.lut[r, group][self.lut[r, group] >= 0]] = self.step
        missing = [int(e) for e in group if self.lut[r, e] < 0]
        if missing:
            keep = set(int(e) for e in group)
            self._load(r, self._pair(r, missing, lambda e: e not in keep))
        return self.lut[r]

    def prefetch(self, r: int, guess: np.ndarray) -> None:
        """Load the guessed experts of layer r (its unique ids, most-guessed first) into
        slots that are free-floating (not pinned) and unused this step; remembers the
        guess to score it when the layer routes."""
        self.guesses[r] = guess
        missing = [int(e) for e in guess if self.lut[r, e] < 0]
        if not missing:
            return
        keep = self.pinned[r] | set(guess.tolist())
        self._load(r, self._pair(r, missing, lambda e: e not in keep, this_step=False))

    # ---- between steps: the policy's placement ------------------------------------

    def apply(self, placement: Placement, max_moves: int | None = None) -> None:
        """Pin and warm as the policy asks (at most max_moves loads per layer, so one
        placement never stalls a step for long). Ties in rank go to the lower expert, so
        the processes of a group, each given the placement's sets, move alike."""
        self.rank = np.asarray(placement.rank, np.float64)
        self.pinned = list(placement.pinned)
        for r in range(self.R):
            want = self._pinnable(r, placement.pinned[r])
            missing = [e for e in want if self.lut[r, e] < 0][:max_moves]
            if missing:
                keep = set(want)
                self._load(r, self._pair(r, missing, lambda e: e not in keep, this_step=False))
            warm = np.fromiter(placement.warm[r], np.int64, len(placement.warm[r]))
            off_device = [int(e) for e in warm[self.lut[r, warm] < 0] if (r, int(e)) not in self.ram]
            for e in sorted(off_device, key=lambda e: (-self.rank[r, e], e))[:max_moves]:
                if not self._ram_room(r, e):
                    break
                self.ram[(r, e)] = self._read(r, e)
                self.ram_used[r, e] = self.step
                self.stats.moves.append(Move(r, e, DISK, RAM))

    def fill(self, rank: np.ndarray, warm_ram: bool = True) -> None:
        """Start-up: each layer's pool gets its C highest-ranked experts (ties: lowest
        index first), and with warm_ram RAM gets the next ones of positive rank, hottest
        first, as far as its budget goes (a restarted engine starts warm)."""
        self.rank = np.asarray(rank, np.float64)
        rest = []
        for r in range(self.R):
            for g in range(self.groups):  # each owner range from the owner's own experts
                own = np.arange(g * self.group_experts, (g + 1) * self.group_experts)
                order = own[np.argsort(-self.rank[r, own], kind="stable")]
                self._load(r, [(int(e), s) for s, e in zip(self.owner_slots(g), order)])
                rest += [(self.rank[r, e], r, int(e)) for e in order[self.group_slots :]]
        if not warm_ram:
            return
        for heat, r, e in sorted(rest, key=lambda x: -x[0]):
            if heat <= 0 or not self._ram_room(r, e):
                break
            self.ram[(r, e)] = self._read(r, e)
            self.stats.moves.append(Move(r, e, DISK, RAM))

    # ---- moves ---------------------------------------------------------------------

    def _pinnable(self, r: int, pinned: frozenset[int]) -> list[int]:
        """The pinned experts the pool holds, hottest first: at most C, and on a mesh at
        most ceil(pins / ep) per owner, so each owner's range keeps slots that float."""
        cap = -(-len(pinned) // self.groups) if self.groups > 1 else self.C
        taken = [0] * self.groups
        want = []
        for e in sorted(pinned, key=lambda e: (-self.rank[r, e], e))[: self.C]:
            if taken[self.owner(e)] < cap:
                taken[self.owner(e)] += 1
                want.append(e)
        return want

    def _pair(self, r: int, experts: list[int], evictable, this_step: bool = True) -> list[tuple[int, int]]:
        """(expert, slot) for experts to load, each into its owner's range."""
        pairs: list[tuple[int, int]] = []
        for g in range(self.groups):
            mine = [e for e in experts if self.owner(e) == g]
            if mine:
                pairs += zip(mine, self._victims(r, len(mine), evictable, this_step, g))
        return pairs

    def _victims(self, r: int, n: int, evictable, this_step: bool = True, owner: int = 0) -> list[int]:
        """n pool slots for new experts: empty ones first, then unpinned before pinned,
        least recently used, lowest rank. (Recency before heat: with routing as local as
        real routing is, an expert just loaded for this passage is the next one needed;
        heat decides what is pinned. Measured on the benchmark's traces, this order is at
        least as good as plain LRU, ranking by heat first was worse.) Slots used this
        step are taken only when this_step (a layer that needs more than are free). Only slots of the owner's range."""
        slots = []
        for s in self.owner_slots(owner):
            e = int(self.occupant[r, s])
            if e < 0:
                slots.append((-1, 0, 0, 0.0, s))
            elif evictable(e) and (this_step or self.slot_used[r, s] < self.step):
                slots.append((0, e in self.pinned[r], self.slot_used[r, s], self.rank[r, e], s))
        slots.sort()
        return [s for *_, s in slots[:n]]

    def _load(self, r: int, pairs: list[tuple[int, int]]) -> None:
        """Upload experts into slots (one jitted call per layer), evicting what was there.
        Experts coming from RAM leave it first, so the evicted may take their room."""
        if not pairs:
            return
        started = time.perf_counter()
        coming = [(e, s, self.tier(r, e)) for e, s in pairs]
        from_ram = {e: self.ram.pop((r, e)) for e, _, tier in coming if tier == RAM}
        self._evict(r, [(int(self.occupant[r, s]), s) for _, s in pairs if self.occupant[r, s] >= 0])
        gate_up, down = [], []
        for e, s, tier in coming:
            held = from_ram[e] if tier == RAM else self._read(r, e)
            assert held is not None  # RAM holds a None only while _evict runs
            gu, dn = held
            gate_up.append(gu)
            down.append(dn)
            self.lut[r, e], self.occupant[r, s], self.slot_used[r, s] = s, e, self.step
            self.stats.moves.append(Move(r, e, tier, DEVICE))
        self.version += 1
        slots = [s for _, s in pairs]
        pad = partial(_padded, len(pairs))
        self.pools[r] = put_experts(*self.pools[r], pad(slots).astype(np.int32), pad(gate_up), pad(down),
                                    mesh=self.mesh)
        self.stats.load_s += time.perf_counter() - started

    def _evict(self, r: int, victims: list[tuple[int, int]]) -> None:
        """Experts (e, slot) leave the device: to RAM where it has room (their slots
        copied back in one call), else to disk."""
        to_ram = []
        for e, s in victims:
            self.lut[r, e], self.occupant[r, s] = -1, -1
            if self._ram_room(r, e):
                self.ram[(r, e)] = None  # filled below; holds its place in the budget
                self.ram_used[r, e] = self.step
                to_ram.append((e, s))
            else:
                self.stats.moves.append(Move(r, e, DEVICE, DISK))
        if not to_ram:
            return
        slots = _padded(len(to_ram), [s for _, s in to_ram]).astype(np.int32)
        gate_up, down = jax.tree.map(np.asarray, take_experts(*self.pools[r], slots, mesh=self.mesh))
        for i, (e, _) in enumerate(to_ram):
            if (r, e) in self.ram:  # else a later victim of this eviction took its room
                self.ram[(r, e)] = (host_index(gate_up, i), host_index(down, i))
                self.stats.moves.append(Move(r, e, DEVICE, RAM))

    def warm_move(self, n: int) -> None:
        """Run a copy back and an upload of n experts (one of move_sizes) once, copying
        slots of the first layer onto themselves: compiled, and nothing moved."""
        slots = np.minimum(np.arange(n), self.C - 1).astype(np.int32)
        gate_up, down = jax.tree.map(np.asarray, take_experts(*self.pools[0], slots, mesh=self.mesh))
        self.pools[0] = put_experts(*self.pools[0], slots, gate_up, down, mesh=self.mesh)

    def _ram_room(self, r: int, e: int) -> bool:
        """Make room in RAM for (r, e) by dropping colder experts to disk; False when
        (r, e) is no warmer than the coldest (an incumbent keeps its place on a tie), or
        RAM holds nothing at all."""
        if self.ram_capacity is None:
            return True
        while len(self.ram) >= self.ram_capacity:
            if not self.ram:
                return False
            coldest = min(self.ram, key=lambda k: (self.rank[k], self.ram_used[k]))
            if (self.rank[coldest], self.ram_used[coldest]) >= (self.rank[r, e], self.step):
                return False
            # a None is an expert being evicted from the device this moment (_evict)
            self.stats.moves.append(Move(*coldest, RAM if self.ram.pop(coldest) is not None else DEVICE, DISK))
        return True

    def _read(self, r: int, e: int) -> tuple[np.ndarray, np.ndarray]:
        started = time.perf_counter()
        gu, dn = self.reader.read(r, e)
        if isinstance(gu, QTensor):
            gu, dn = as_read_here((gu, dn))
        else:
            gu, dn = np.asarray(gu, self.host_dtype), np.asarray(dn, self.host_dtype)
        if self.mesh is not None:  # RAM and the pool hold the layout of its tp shards
            gu = gate_up_layout(gu, self.mesh.shape[TP])
        self.stats.read_s += time.perf_counter() - started
        return gu, dn

    def _score_guess(self, r: int, routed: np.ndarray) -> None:
        guess, self.guesses[r] = self.guesses[r], None
        if guess is not None:
            self.stats.guessed += len(guess)
            self.stats.guessed_right += int(np.isin(guess, routed).sum())
            self.stats.routed_after_guess += len(routed)
