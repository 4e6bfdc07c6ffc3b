"""The Scheduler actor: admission, serial chunked prefill, and one continuous-batched
decode step after another across the KV slots.

One loop iteration: take messages (submits, cancels) → run one prefill chunk if a
prompt is waiting → run one decode step for every decoding request → emit events.
Device work runs in one worker thread so the event loop stays responsive; a cancel or a
new submit takes effect at the next step boundary.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import trio

from ..model.detokenizer import IncrementalDetokenizer
from ..runtime.actor import open_inbox, open_reply
from ..runtime.api import (
    EngineStatistics,
    FinishEvent,
    GenerationRequest,
    StepRouting,
    Telemetry,
    TokenEvent,
    TopCandidate,
    TurnReport,
    TurnStats,
)
from ..runtime.errors import (
    BadRequest,
    ContextExceeded,
    DuplicateId,
    EmptyPrompt,
    EngineClosed,
    QueueFull,
    SlotBusy,
)
from ..runtime.experts import REPIN_KEPT, device_moves, turn_entropy, turn_perf
from .expert_cache import ExpertCache, TurnEnded
from .kv_slot import Claim, Extend, KVSlot, Probe, Release, SetHistory
from .policy import StopMatcher, choose_slot
from .runner import ExpertStep, ModelRunner
from .slot_io import FreeSlot, HoldSlot, ReadLayers, WriteLayers
from .step_rows import DecodeInFlight, Sampled, SamplingRow

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submit:
    request_id: int
    request: GenerationRequest
    prompt: tuple[int, ...]
    events: trio.MemorySendChannel  # first an Accepted or an EngineError, then the stream


@dataclass(frozen=True)
class Cancel:
    request_id: int
    reply: trio.MemorySendChannel | None = None  # gets True, or False for an unknown id


@dataclass(frozen=True)
class StopNow:
    """End a request now through its normal finish (finish reason `stop`)."""

    request_id: int
    reply: trio.MemorySendChannel | None = None  # gets True, or False for an unknown id


@dataclass(frozen=True)
class Subscribe:
    """Send every turn's Telemetry and every step's StepRouting to this channel (dropped
    when it is full)."""

    channel: trio.MemorySendChannel


@dataclass(frozen=True)
class Drain:
    """Refuse new requests; reply once every request in flight has finished."""

    reply: trio.MemorySendChannel


@dataclass(frozen=True)
class Accepted:
    request_id: int


@dataclass
class Active:
    """A request the scheduler is working on."""

    submit: Submit
    slot: int
    reused: int
    detok: IncrementalDetokenizer
    stops: StopMatcher
    key: np.ndarray
    started: float
    cursor: int = 0  # prompt tokens whose KV is written
    target: int = 0  # prompt tokens to write: all, or all but the last (prefill_only)
    next_token: int | None = None  # sampled, not yet fed back
    position: int = 0  # where next_token goes
    emitted: int = 0
    first_token_at: float | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    sample_s: float = 0.0
    expert_counts: np.ndarray | None = None
    token_ids: list[int] = field(default_factory=list)
    pool_lookups: int = 0  # tiered experts: unique experts its steps needed
    pool_hits: int = 0  # of those, on the device already
    repin: list[tuple[int, int, int, int]] = field(default_factory=list)  # moves onto the device
    expert_wait_s: float = 0.0  # its steps' seconds moving experts
    expert_disk_s: float = 0.0  # of those, reading the model file

    @property
    def request(self) -> GenerationRequest:
        return self.submit.request

    @property
    def rid(self) -> int:
        return self.submit.request_id

    def count_experts(self, experts: np.ndarray) -> None:
        if self.expert_counts is not None:
            add_routing(self.expert_counts, experts)

    def count_step(self, step: ExpertStep) -> None:
        self.pool_lookups += step.lookups
        self.pool_hits += step.hits
        self.expert_wait_s += step.wait_s
        self.expert_disk_s += step.disk_s
        self.repin.extend(device_moves(step.moves))
        del self.repin[:-REPIN_KEPT]

    def sampling_row(self) -> SamplingRow:
        r = self.request
        return SamplingRow(r.temperature, r.top_p, self.key, r.top_logprobs > 0)


def add_routing(counts: np.ndarray, experts: np.ndarray) -> None:
    """Add routed-expert ids ([MoE layers, ...]) to per-layer, per-expert counts."""
    if experts.size:
        layers = experts.reshape(experts.shape[0], -1)
        np.add.at(counts, (np.arange(layers.shape[0])[:, None], layers), 1)


def _tell(sub: Submit, event) -> bool:
    """Put an event on a request's stream; False when its reader is gone (a cancel)."""
    try:
        sub.events.send_nowait(event)
        return True
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return False


class Scheduler:
    def __init__(self, runner: ModelRunner, slots: list[KVSlot], queue_limit: int,
                 experts: ExpertCache | None = None):
        self.runner = runner
        self.experts = experts
        self.tokenizer = runner.model.tokenizer
        self.eos = self.tokenizer.eos_ids
        self.slots = slots
        self.queue_limit = queue_limit
        self.max_context = runner.geo.max_context
        cfg = runner.model.config
        self.expert_zeros = np.zeros((sum(cfg.moe_layers), cfg.n_experts), np.int64)
        self.dense_layers = 0 if cfg.is_moe else cfg.n_layers
        self.chunk = runner.geo.chunk
        self.inbox = open_inbox()
        self.active: dict[int, Active] = {}
        self.waiting: deque[Submit] = deque()  # admitted in order as slots free up
        self.prefilling: deque[int] = deque()
        self.decoding: list[int] = []
        self.clock = 0
        self.telemetry_subscribers: list[trio.MemorySendChannel] = []
        self.limiter = trio.CapacityLimiter(1)  # the one thread that touches the device
        self.closing = False
        self.drained: list[trio.MemorySendChannel] = []
        self.held: set[int] = set()  # slots whose KV is being saved or installed
        # a decode step dispatched and not yet read back: its rows and the runner's handle
        self.ahead: tuple[list[Active], DecodeInFlight] | None = None

    # ---- the loop -------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        task_status.started()
        try:
            while True:
                if not (self.prefilling or self.decoding):
                    self._notify_drained()
                    msg = await self.inbox.receive.receive()
                    await self._handle(msg)
                await self._take_queued()
                if self.prefilling:
                    await self._prefill_chunk()
                    await self._take_queued()
                if self.decoding:
                    await self._decode_step()
        finally:
            # Whatever ends the loop, nobody waits forever: later sends to the inbox fail,
            # and a stream closed without a finish event reads as "shutting down".
            self._refuse_queued_messages()
            for act in self.active.values():
                act.submit.events.close()
            for sub in self.waiting:
                sub.events.close()

    def _refuse_queued_messages(self):
        while True:
            try:
                msg = self.inbox.receive.receive_nowait()
            except (trio.WouldBlock, trio.ClosedResourceError):
                break
            match msg:
                case Submit(events=events):
                    events.close()
                case Cancel(reply=reply) | StopNow(reply=reply) if reply is not None:
                    reply.send_nowait(False)
                case Drain(reply):
                    reply.send_nowait(None)
                case HoldSlot(reply=reply) | ReadLayers(reply=reply) | WriteLayers(reply=reply):
                    reply.close()
                case FreeSlot(reply=reply) if reply is not None:
                    reply.close()
        self.inbox.receive.close()

    def _notify_drained(self):
        if self.closing and not self.active and not self.waiting:
            for reply in self.drained:
                reply.send_nowait(None)
            self.drained.clear()

    async def _take_queued(self):
        while True:
            try:
                msg = self.inbox.receive.receive_nowait()
            except trio.WouldBlock:
                return
            await self._handle(msg)

    async def _handle(self, msg):
        match msg:
            case Submit():
                await self._submit(msg)
            case Cancel(rid, reply):
                found = await self._cancel(rid)
                if reply is not None:
                    reply.send_nowait(found)
            case Subscribe(channel):
                self.telemetry_subscribers.append(channel)
            case Drain(reply):
                self.closing = True
                self.drained.append(reply)
                self._notify_drained()
            case StopNow(rid, reply):
                found = rid in self.active
                if found:
                    await self._finish(self.active[rid], "stop")
                if reply is not None:
                    reply.send_nowait(found)
            case HoldSlot() | ReadLayers() | WriteLayers() | FreeSlot():
                await self._slot_io(msg)
            case _:
                raise TypeError(f"the scheduler got an unknown message {msg!r}")

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(len(self.active), len(self.waiting), len(self.slots), self.closing)

    def in_flight(self) -> set[int]:
        return set(self.active) | {s.request_id for s in self.waiting}

    # ---- admission ------------------------------------------------------------------

    async def _submit(self, sub: Submit):
        req, n = sub.request, len(sub.prompt)
        error = None
        if self.closing:
            error = EngineClosed()
        elif sub.request_id in self.in_flight():
            error = DuplicateId(sub.request_id)
        elif n == 0:
            error = EmptyPrompt()
        elif n >= self.max_context:
            error = ContextExceeded(n, self.max_context)
        elif req.slot is not None and not 0 <= req.slot < len(self.slots):
            error = BadRequest(f"slot must be in [0, {len(self.slots) - 1}], got {req.slot}")
        elif req.slot is not None and self._busy(req.slot):
            error = SlotBusy(req.slot)
        if error is not None:
            _tell(sub, error)
            return
        if req.slot is None:
            slot = await self._pick_slot(sub.prompt)
            if slot is None:
                if len(self.waiting) >= self.queue_limit:
                    _tell(sub, QueueFull(self.queue_limit))
                elif _tell(sub, Accepted(sub.request_id)):
                    self.waiting.append(sub)
                return
        else:
            slot = req.slot
        if _tell(sub, Accepted(sub.request_id)):  # else the caller has already gone
            await self._start(sub, slot)

    def _busy(self, slot: int) -> bool:
        return slot in self.held or any(a.slot == slot for a in self.active.values())

    async def _pick_slot(self, prompt) -> int | None:
        views = []
        for s in self.slots:
            if not self._busy(s.index):
                send, recv = open_reply()
                await s.inbox.send.send(Probe(send))
                views.append(await recv.receive())
        return choose_slot(views, prompt)

    async def _start(self, sub: Submit, slot: int):
        send, recv = open_reply()
        await self.slots[slot].inbox.send.send(Claim(sub.request_id, sub.prompt, send))
        reused = await recv.receive()
        req = sub.request
        seed = req.seed if req.seed is not None else sub.request_id
        act = Active(
            submit=sub, slot=slot, reused=reused, cursor=reused,
            detok=IncrementalDetokenizer(self.tokenizer), stops=StopMatcher(req.stop),
            key=self.runner.new_key(seed), started=time.perf_counter(),
            expert_counts=self.expert_zeros.copy(),
            target=len(sub.prompt) - 1 if req.prefill_only else len(sub.prompt),
        )
        self.active[sub.request_id] = act
        if act.cursor >= act.target:  # a prefill-only request the slot already holds
            await self._finish(act, "prefilled")
            return
        self.prefilling.append(sub.request_id)

    # ---- a slot's KV in and out (slot_io) ---------------------------------------------

    async def _slot_io(self, msg):
        match msg:
            case HoldSlot(slot, reply):
                if not 0 <= slot < len(self.slots):
                    reply.send_nowait(BadRequest(f"slot must be in [0, {len(self.slots) - 1}], got {slot}"))
                elif self._busy(slot):
                    reply.send_nowait(SlotBusy(slot))
                else:
                    self.held.add(slot)
                    probe, answer = open_reply()
                    await self.slots[slot].inbox.send.send(Probe(probe))
                    reply.send_nowait((await answer.receive()).history)
            case ReadLayers(slot, layers, tokens, reply) if slot in self.held:
                read = self.runner.read_layers
                reply.send_nowait(await self._device_io(read, slot, layers.start, len(layers), tokens))
            case WriteLayers(slot, first, pairs, reply) if slot in self.held:
                reply.send_nowait(await self._device_io(self.runner.write_layers, slot, first, list(pairs)))
            case ReadLayers(slot, reply=reply) | WriteLayers(slot, reply=reply):
                reply.send_nowait(BadRequest(f"slot {slot} is not held for a KV transfer"))
            case FreeSlot(slot, history, reply):
                if slot in self.held:
                    if history is not None:
                        await self.slots[slot].inbox.send.send(SetHistory(tuple(history)))
                    self.held.discard(slot)
                if reply is not None:
                    reply.send_nowait(None)
                await self._admit_waiting()

    async def _device_io(self, call, *args):
        """A KV transfer call in the device thread: its result, or the exception it raised
        (a bad transfer fails the caller, not the scheduler)."""
        try:
            return await trio.to_thread.run_sync(call, *args, limiter=self.limiter)
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            return exc

    # ---- device work ----------------------------------------------------------------

    async def _prefill_chunk(self):
        act = self.active[self.prefilling[0]]
        prompt = act.submit.prompt
        chunk = list(prompt[act.cursor : min(act.cursor + self.chunk, act.target)])
        last = act.cursor + len(chunk) == act.target
        started, sampling = time.perf_counter(), self.runner.sample_seconds
        if last and not act.request.prefill_only:
            sampled, step = await self._on_device(
                self.runner.prefill, act.slot, chunk, act.cursor, act.sampling_row()
            )
        else:
            (_, experts), step = await self._on_device(self.runner.extend, act.slot, chunk, act.cursor)
            act.count_experts(experts)
            self._publish_routing([experts], len(chunk), step)
        act.count_step(step)
        act.sample_s += self.runner.sample_seconds - sampling
        act.prefill_s += time.perf_counter() - started - (self.runner.sample_seconds - sampling)
        act.cursor += len(chunk)
        await self.slots[act.slot].inbox.send.send(Extend(tuple(chunk)))
        if not last or act.rid not in self.active:
            return
        if act.request.prefill_only:
            await self._device_io(self.runner.wait_ready)  # "prefilled" means the KV is there
            await self._finish(act, "prefilled")
            return
        self._publish_routing([sampled.experts], len(chunk), step)
        self.prefilling.popleft()
        act.position = len(prompt)
        self.decoding.append(act.rid)
        await self._accept_token(act, sampled)

    async def _decode_step(self):
        """Read one decode step back and hand out its tokens. When the runner chains
        steps, the step after it is dispatched first, its continuing rows fed on the
        device with the tokens this one sampled: the device computes step t + 1 while
        the host reads, detokenizes and sends step t. A row that turns out to have ended
        at step t has computed one token more, which is dropped (its KV past the slot's
        history is never read)."""
        current = self.ahead
        fresh = self._decode_rows([]) if current is None else None
        unread = (current or fresh)[0]
        following = self._decode_rows(unread) if self.runner.chains else ([], None)
        started, sampling = time.perf_counter(), self.runner.sample_seconds

        def work():
            step = current or (fresh[0], self.runner.dispatch(*fresh[1]))
            after = (following[0], self.runner.dispatch(*following[1])) if following[0] else None
            return step[0], self.runner.collect(step[1]), after

        (acts, results, self.ahead), step = await self._on_device(work)
        sample_s = self.runner.sample_seconds - sampling
        decode_s = time.perf_counter() - started - sample_s
        # a row that ended after this step was dispatched computed a token nobody reads
        live = [(act, sampled) for act, sampled in zip(acts, results) if self._decoding(act)]
        self._publish_routing([sampled.experts for _, sampled in live], len(live), step)
        for act, sampled in live:
            act.count_step(step)
            act.decode_s += decode_s
            act.sample_s += sample_s
            await self.slots[act.slot].inbox.send.send(Extend((act.next_token,)))
            act.position += 1
            if act.rid in self.active:
                await self._accept_token(act, sampled)
        if self.ahead is not None and not any(self._decoding(a) for a in self.ahead[0]):
            self.ahead = None

    def _decode_rows(self, unread: list[Active]):
        """The rows of the next decode step and the runner's arguments for them. unread:
        the rows of a step dispatched and not yet read back; those that go on are chained
        to it (their token is on the device), unless they end at it for their length.
        Every other decoding row feeds its token from the host."""
        rows = [a for a in unread if self._decoding(a) and not self._ends_at_unread_step(a)]
        chained = [True] * len(rows)
        in_unread = set(map(id, unread))  # by identity: Active's fields hold arrays
        for rid in self.decoding:
            act = self.active[rid]
            if id(act) not in in_unread:
                rows.append(act)
                chained.append(False)
        tokens = [0 if link else a.next_token for a, link in zip(rows, chained)]
        positions = [a.position + link for a, link in zip(rows, chained)]
        args = (tokens, [a.slot for a in rows], positions, [a.sampling_row() for a in rows], chained)
        return rows, args

    def _ends_at_unread_step(self, act: Active) -> bool:
        """Whether the unread step `act` is in ends it for its length, whatever it samples."""
        return act.emitted + 1 >= act.request.max_tokens or act.position + 2 >= self.max_context

    def _decoding(self, act: Active) -> bool:
        return self.active.get(act.rid) is act and act.rid in self.decoding

    async def _on_device(self, call, *args):
        """Run a runner call in the device thread, after the expert cache's newest
        placement (if any): (its result, the expert traffic of the call)."""
        placement = self.experts.newest_placement() if self.experts is not None else None

        def work():
            if placement is not None:
                self.runner.apply_placement(placement)
            return call(*args), self.runner.take_expert_step()

        return await trio.to_thread.run_sync(work, limiter=self.limiter)

    # ---- per-token bookkeeping ------------------------------------------------------

    async def _accept_token(self, act: Active, sampled: Sampled):
        """Emit a freshly sampled token and decide whether the request goes on."""
        now = time.perf_counter()
        if act.first_token_at is None:
            act.first_token_at = now
        act.key = sampled.next_key
        act.count_experts(sampled.experts)
        token = sampled.token
        if token in self.eos:
            await self._finish(act, "stop")
            return
        act.emitted += 1
        act.token_ids.append(token)
        text, stopped = act.stops.push(act.detok.push(token))
        top = tuple(
            TopCandidate(tid, self.tokenizer.decode([tid]), lp) for tid, lp in sampled.top
        )[: act.request.top_logprobs]
        if not self._send(act, TokenEvent(act.rid, text, token, sampled.logprob, top)):
            await self._finish(act, "cancelled")
            return
        if stopped:
            await self._finish(act, "stop", stop_matched=True)
        elif act.emitted >= act.request.max_tokens or act.position + 1 >= self.max_context:
            await self._finish(act, "length")
        else:
            act.next_token = token

    def _send(self, act: Active, event) -> bool:
        return _tell(act.submit, event)

    async def _cancel(self, rid: int) -> bool:
        for sub in list(self.waiting):
            if sub.request_id == rid:
                self.waiting.remove(sub)
                self._send_final_cancel(sub, rid)
                return True
        if rid in self.active:
            await self._finish(self.active[rid], "cancelled")
            return True
        return False

    def _send_final_cancel(self, sub: Submit, rid: int):
        stats = TurnStats(rid, -1, "cancelled", len(sub.prompt), 0, 0, 0.0, 0.0, 0.0)
        _tell(sub, FinishEvent(stats))

    async def _finish(self, act: Active, reason: str, stop_matched: bool = False):
        rid = act.rid
        del self.active[rid]
        if rid in self.decoding:
            self.decoding.remove(rid)
        if rid in self.prefilling:
            self.prefilling.remove(rid)
        now = time.perf_counter()
        tail = ""
        if reason != "cancelled" and not stop_matched:
            # Release what was held back: partial UTF-8, and a stop-string prefix that
            # never completed (unless the rest of the text completes it).
            tail, matched = act.stops.push(act.detok.flush())
            if not matched:
                tail += act.stops.flush()
        first = act.first_token_at or now
        decode_s = now - first
        stats = TurnStats(
            request_id=rid, slot=act.slot, finish_reason=reason,
            prompt_tokens=len(act.submit.prompt), reused_tokens=act.reused,
            emitted_tokens=act.emitted, time_to_first_token_s=first - act.started,
            decode_tokens_per_s=(act.emitted - 1) / decode_s if act.emitted > 1 and decode_s > 0 else 0.0,
            total_s=now - act.started,
        )
        telemetry = self._telemetry(act)
        self._send(act, FinishEvent(stats, tail, telemetry, self._report(stats, telemetry, act)))
        act.submit.events.close()
        self.clock += 1
        await self.slots[act.slot].inbox.send.send(Release(rid, self.clock))
        self._publish(telemetry)
        if self.experts is not None:
            try:
                self.experts.inbox.send.send_nowait(TurnEnded())
            except trio.WouldBlock:
                pass  # the heat is saved at a later turn's end, or at shutdown
        await self._admit_waiting()

    async def _admit_waiting(self):
        while self.waiting:
            slot = await self._pick_slot(self.waiting[0].prompt)
            if slot is None:
                return
            await self._start(self.waiting.popleft(), slot)

    def _telemetry(self, act: Active) -> Telemetry:
        counts = tuple(tuple(int(c) for c in layer) for layer in act.expert_counts)
        return Telemetry(act.rid, act.prefill_s, act.decode_s, act.sample_s, counts,
                         act.expert_wait_s, act.expert_disk_s)

    def _report(self, stats: TurnStats, telemetry: Telemetry, act: Active) -> TurnReport:
        entropy = turn_entropy(telemetry.expert_counts, self.dense_layers)
        hit_pct = 100.0 * act.pool_hits / act.pool_lookups if act.pool_lookups else 100.0
        return TurnReport(turn_perf(stats, telemetry), entropy, gpus=self.runner.expert_tiers().gpus,
                          repin=tuple(act.repin), hit_pct=hit_pct)

    def _publish_routing(self, experts: list[np.ndarray], tokens: int, step: ExpertStep):
        """Tell the expert cache and subscribers which experts a step used ([MoE layers,
        ...] ids per part), and its pool traffic."""
        if self.experts is None and not self.telemetry_subscribers:
            return
        counts = self.expert_zeros.copy()
        for part in experts:
            add_routing(counts, part)
        if self.experts is not None and counts.size:
            self.experts.observe_nowait(counts)
        if self.telemetry_subscribers:
            self._publish(StepRouting(
                tuple(tuple(int(c) for c in row) for row in counts), tokens,
                step.lookups, step.hits, step.moves, step.tiers,
            ))

    def _publish(self, event: Telemetry | StepRouting):
        for ch in list(self.telemetry_subscribers):
            try:
                ch.send_nowait(event)
            except trio.WouldBlock:
                pass  # a slow subscriber misses a turn rather than stalling decode
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self.telemetry_subscribers.remove(ch)
