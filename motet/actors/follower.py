"""A follower: a process > 0 of a group (actors/device_group.py). It runs no front and no
actors; it builds the same ModelRunner as process 0 over the same global mesh and repeats
every device call process 0's runner makes, in the same order, until STOP.

    follow(model, group.receive)   # returns the number of calls repeated

The leader's runner sends START (its KV geometry, its model's fingerprint and its experts'
plan) when it is built, then one frame per device call (protocol/mirror.py). Results are
dropped: process 0 samples and answers. A tiered pool moves alike on every process: each
reads its experts from its own copy of the model file, and the leader's placements come
as frames too. A call that raises raised on process 0 too (same arguments, same
code) and process 0's scheduler deals with it, so the follower goes on.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from ..model.expert_pool import Placement
from ..model.kv import KVGeometry
from ..model.model import Model
from ..protocol.mirror import MirrorError, Op, decode
from .runner import MIRROR_RECORDS, ModelRunner, fingerprint

log = logging.getLogger(__name__)

# The arguments come decoded from a frame: each call takes its own.
CALLS: dict[Op, Callable[..., object]] = {
    Op.PREFILL: ModelRunner.prefill,
    Op.EXTEND: ModelRunner.extend,
    Op.DECODE: ModelRunner.decode,
    Op.READ_LAYERS: ModelRunner.read_layers,
    Op.WRITE_LAYERS: ModelRunner.write_layers,
    Op.COPY_SLOT: ModelRunner.copy_prefix,
    Op.PLACE: lambda runner, pinned, warm, rank: runner.apply_placement(
        Placement(tuple(map(frozenset, pinned)), tuple(map(frozenset, warm)), rank)),
    Op.WARM_PREFILL: ModelRunner.warm_pool_prefill,
    Op.WARM_DECODE: ModelRunner.warm_pool_decode,
    Op.WARM_MOVE: ModelRunner.warm_move,
}


def follow(model: Model, receive: Callable[[], bytes]) -> int:
    """Build the runner when process 0 does, then repeat its calls until STOP."""
    op, args = decode(receive(), MIRROR_RECORDS)
    if op is Op.STOP:
        log.info("process 0 stopped before it built its runner")
        return 0
    if op is not Op.START:
        raise MirrorError(f"the first frame from process 0 is START or STOP, got {op.name}")
    slots, context, chunk, theirs, plan, rank, prefetch = args
    if theirs != fingerprint(model):
        raise MirrorError("this process loaded another model, dtype or mesh than process 0: "
                          "start every process of a group with the same model flags")
    runner = ModelRunner(model, KVGeometry(n_slots=slots, max_context=context, chunk=chunk), plan,
                         prefetch=prefetch, rank=rank)
    log.info("following process 0: %d KV slots of %d positions, experts %s", slots, context,
             "resident" if plan is None else plan.mode)
    calls: Counter[str] = Counter()
    moves = 0
    while True:
        op, args = decode(receive(), MIRROR_RECORDS)
        if op is Op.STOP:
            log.info("process 0 stopped after %d calls (%s; %d expert moves here)", calls.total(),
                     ", ".join(f"{name} {n}" for name, n in sorted(calls.items())), moves)
            return calls.total()
        call = CALLS.get(op)
        if call is None:
            raise MirrorError(f"unexpected {op.name} from process 0 while following")
        try:
            call(runner, *args)
        except Exception as exc:  # noqa: BLE001 - process 0 had the same error and handles it
            log.warning("%s failed here as on process 0: %s", op.name, exc)
        calls[op.name] += 1
        moves += len(runner.take_expert_step().moves)  # process 0's scheduler takes its own
