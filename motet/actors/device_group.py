"""Several processes (or hosts) as one engine, through `jax.distributed`.

    settings = config.group   # a DistributedSettings (cli/config.py); None: one process
    with join_group(settings, mesh) as group:   # jax.distributed.initialize, first of all
        if group.leader: ... the engine, its runner sending each device call: group.send
        else: ... follow(model, group.receive) until STOP

Process 0 (the leader) runs the actors and the front; every process holds a share of the
global mesh, and all must issue the same computations in the same order. The leader's
runner sends each device call as a mirror frame (protocol/mirror.py) through the
coordinator's key-value store (one key per follower, frame and part, write-once; a
follower deletes them 256 frames at a time once read); the followers repeat it. Leaving
the group, the leader sends STOP, and every process calls `jax.distributed.shutdown()`
(a barrier).

A dead peer is fatal for the group: its collectives fail, and the coordination service
ends the others within the heartbeat timeout (docs/scaling.md).

JAX is imported inside the functions: only a process that joins a group needs it here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..protocol.mirror import Op, encode, join, parts_in, split
from ..runtime.config import DistributedSettings

log = logging.getLogger(__name__)

INIT_TIMEOUT_S = 120  # every process must have joined by then
# A peer silent this long is dead, and so is the group. A loaded host can hold a live one
# back for seconds, so not much less (JAX's own default is 100 s).
HEARTBEAT_TIMEOUT_S = 30
SHUTDOWN_TIMEOUT_S = 30  # the leaving barrier waits this long for the others
POLL_MS = 60_000  # a follower's wait for the next op, renewed while the leader is idle
KEY_PREFIX = "motet/op"
BATCH = 256  # frames per key folder: a follower deletes a folder at once when it has read it


def frame_key(follower: int, n: int) -> str:
    """Frame n's first part for one follower; part i > 0 is under it, at <key>/<i>."""
    return f"{KEY_PREFIX}/{follower}/{n // BATCH}/{n % BATCH}"


@dataclass(frozen=True)
class ControlStatistics:
    """The control channel so far: frames, parts and bytes moved, seconds spent moving them."""

    frames: int
    parts: int
    bytes: int
    seconds: float


class Group:
    """This process's place in a joined group, and the control channel between the leader
    and the followers (the leader sends, each follower receives)."""

    def __init__(self, settings: DistributedSettings, client):
        self.settings = settings
        self.leader = settings.leader
        self._client = client  # the coordinator's key-value store (jax's DistributedRuntimeClient)
        self._next = 0  # the next frame's number
        self._lock = threading.Lock()
        self._stats = ControlStatistics(0, 0, 0, 0.0)

    def send(self, frame: bytes) -> None:
        """Leader: publish one frame for every follower (in order; returns once stored)."""
        assert self.leader, "only process 0 sends"
        started = time.perf_counter()
        parts = split(frame)
        with self._lock:
            n, self._next = self._next, self._next + 1
            for follower in range(1, self.settings.num_processes):
                key = frame_key(follower, n)
                for i, part in enumerate(parts[1:], 1):  # the first last: seeing it means all are there
                    self._client.key_value_set_bytes(f"{key}/{i}", part)
                self._client.key_value_set_bytes(key, parts[0])
            self._count(len(parts), len(frame), started)

    def receive(self) -> bytes:
        """Follower: the next frame, waiting as long as the leader is quiet (an error from the
        store, e.g. the coordinator gone with process 0, propagates). Each follower has its
        own keys, and deletes them a folder of BATCH frames at a time once read."""
        n = self._next
        key = frame_key(self.settings.process_id, n)
        first = self._wait(key)
        started = time.perf_counter()
        parts = [first] + [self._wait(f"{key}/{i}") for i in range(1, parts_in(first))]
        if n % BATCH == BATCH - 1:
            self._client.key_value_delete(key.rpartition("/")[0])  # the folder, and all under it
        self._next += 1
        frame = join(parts)
        self._count(len(parts), len(frame), started)
        return frame

    def _wait(self, key: str) -> bytes:
        while True:
            try:
                return self._client.blocking_key_value_get_bytes(key, POLL_MS)
            except Exception as exc:  # noqa: BLE001 - jax raises one type for every status
                if "DEADLINE_EXCEEDED" not in str(exc):
                    raise

    def _count(self, parts: int, size: int, started: float) -> None:
        s = self._stats
        self._stats = ControlStatistics(s.frames + 1, s.parts + parts, s.bytes + size,
                                        s.seconds + time.perf_counter() - started)

    def statistics(self) -> ControlStatistics:
        return self._stats

    def stop(self) -> None:
        """Leader: tell the followers to leave (after every op sent before)."""
        self.send(encode(Op.STOP, ()))


@contextmanager
def join_group(settings: DistributedSettings, mesh: str | None) -> Iterator[Group]:
    """Join the group (`jax.distributed.initialize`: call it before anything else touches
    JAX), check that `mesh` spans every process's devices, yield this process's Group; on
    the way out the leader sends STOP, and every process leaves through the shutdown
    barrier."""
    check_mesh(mesh, settings.num_processes)
    import jax
    from jax._src.distributed import global_state

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    jax.distributed.initialize(
        coordinator_address=settings.coordinator, num_processes=settings.num_processes,
        process_id=settings.process_id, initialization_timeout=INIT_TIMEOUT_S,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S, shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S,
    )
    log.info("process %d of %d joined at %s: %d devices, %d here", settings.process_id,
             settings.num_processes, settings.coordinator, len(jax.devices()), len(jax.local_devices()))
    group = Group(settings, global_state.client)
    try:
        if settings.num_processes > 1:
            from ..model.sharding import MeshSpec

            assert mesh is not None  # check_mesh refused a group without one
            size = MeshSpec.parse(mesh).size
            if size != len(jax.devices()):
                raise ValueError(f"mesh {mesh} uses {size} devices, but the {settings.num_processes} processes "
                                 f"hold {len(jax.devices())}: a mesh over several processes spans all of them")
        yield group
    finally:
        try:
            if group.leader:
                group.stop()
            stats = group.statistics()
            log.info("process %d leaves the group: %d control frames, %.1f KB, %.2f ms each",
                     settings.process_id, stats.frames, stats.bytes / 1e3,
                     1e3 * stats.seconds / max(1, stats.frames))
        finally:
            jax.distributed.shutdown()


def check_mesh(mesh: str | None, num_processes: int) -> None:
    """Several processes share one global mesh, named with --mesh, spanning every device."""
    if num_processes > 1 and mesh is None:
        raise ValueError(f"{num_processes} processes share one model: name its layout over all their "
                         f"devices with --mesh (e.g. --mesh ep={num_processes})")
