"""The Scheduler actor: admission, serial chunked prefill, and one continuous-batched
decode step after another across the KV slots.

One loop iteration: take messages (submits, cancels) → run one prefill chunk if a
prompt is waiting (the geometry's longest chunk while no stream decodes, else
chunk_beside_decodes: each stream waits for a chunk) → run one decode step for every
decoding request → emit events.
Device work runs in one worker thread so the event loop stays responsive; a cancel or a
new submit takes effect at the next step boundary.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import trio

from ..model.detokenizer import IncrementalDetokenizer
from ..runtime.actor import open_inbox, open_reply
from ..runtime.api import EngineStatistics, FinishEvent, FinishReason, TokenEvent, TopCandidate
from ..runtime.errors import QueueFull
from ..runtime.slot_table import SlotTable
from .active_request import Active, end_unstarted, tell
from .expert_cache import ExpertCache
from .kv_slot import Claim, Extend, KVSlot, Release, SetHistory
from .policy import StopMatcher, refusal
from .prefix_cache import PrefixCache
from .publisher import Publisher
from .runner import ModelRunner
from .scheduler_messages import Accepted, Cancel, Drain, StopNow, Submit, Subscribe, refuse_queued
from .slot_io import FreeSlot, HoldSlot, ReadLayers, WriteLayers
from .slot_transfers import SlotTransfers, Transfer
from .step_rows import FILLER_ROW, DecodeInFlight, Sampled, dispatch_steps, next_step_rows

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, runner: ModelRunner, slots: list[KVSlot], queue_limit: int,
                 experts: ExpertCache | None = None, share_prefixes: bool = True, prefix_store_bytes: int = 0, *,
                 chunk_beside_decodes: int):
        self.runner = runner
        self.experts = experts
        self.tokenizer = runner.model.tokenizer
        self.eos = self.tokenizer.eos_ids
        self.slots = slots
        # whose each slot is (a request's Submit, or a transfer), what each free one holds,
        # and the requests waiting for one, admitted in order as slots free up
        self.table: SlotTable[Submit | Transfer] = SlotTable(len(slots), queue_limit)
        self.max_context = runner.geo.max_context
        self.publisher = Publisher(runner, experts)
        self.chunk_alone = runner.geo.chunk
        self.chunk_beside_decodes = chunk_beside_decodes  # at most chunk_alone (engine_args.lone_prompt_chunk)
        self.inbox = open_inbox()
        self.active: dict[int, Active] = {}
        self.prefilling: deque[int] = deque()
        self.decoding: list[int] = []
        self.limiter = trio.CapacityLimiter(1)  # the one thread that touches the device
        self.closing = False
        self.drained: list[trio.MemorySendChannel] = []
        self.transfers = SlotTransfers(slots, self.table, runner, self.limiter)
        self.prefixes = PrefixCache(runner, self.table, slots, self.limiter, share_prefixes, prefix_store_bytes)
        # per request with n > 1 choices whose prompt is not prefilled yet, its other choices
        self.forks: dict[int, list[Submit]] = {}
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
            refuse_queued(self.inbox.receive)
            for act in self.active.values():
                act.submit.events.close()
            for sub in self._queued() + [fork for forks in self.forks.values() for fork in forks]:
                sub.events.close()
                for fork in sub.forks:
                    fork.events.close()

    def _notify_drained(self):
        if self.closing and not self.active and not self.table.queue:
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
                self.publisher.subscribers.append(channel)
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
                await self._start_admitted(await self.transfers.handle(msg))
            case _:
                raise TypeError(f"the scheduler got an unknown message {msg!r}")

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(len(self.active), len(self.table.queue), len(self.slots), self.closing,
                                self.prefixes.stored_bytes)

    def _queued(self) -> list[Submit]:
        return [sub for sub, _ in self.table.queue if isinstance(sub, Submit)]

    def in_flight(self) -> set[int]:
        waiting = self._queued() + [fork for forks in self.forks.values() for fork in forks]
        return set(self.active) | {s.request_id for s in waiting}

    # ---- admission ------------------------------------------------------------------

    async def _submit(self, sub: Submit):
        req = sub.request
        busy = req.slot is not None and self.table.held(req.slot)
        error = refusal(sub.request_id, req.slot, len(sub.prompt), closing=self.closing,
                        in_flight=self.in_flight(), max_context=self.max_context, slots=len(self.slots), busy=busy)
        if error is not None:
            tell(sub, error)
            return
        if req.slot is None:
            try:
                slot = self.table.take(sub, sub.prompt)
            except QueueFull as full:
                tell(sub, full)
                return
            if slot is None:  # queued
                if not tell(sub, Accepted(sub.request_id)):
                    self.table.withdraw(sub)
                return
        else:
            slot = req.slot
            self.table.hold(slot, sub)
        if tell(sub, Accepted(sub.request_id)):
            await self._start(sub, slot)
        else:  # the caller has already gone
            await self._start_admitted(self.table.release(slot, sub, touch=False))

    async def _start(self, sub: Submit, slot: int):
        """Start a request on the slot the table holds for it."""
        await self.prefixes.keep(slot, sub.prompt)
        send, recv = open_reply()
        await self.slots[slot].inbox.send.send(Claim(sub.prompt, send))
        own = await recv.receive()
        reused = await self.prefixes.fill(sub.prompt, slot, own, self.active.values())
        self.active[sub.request_id] = act = self._active(sub, slot, reused, copied=reused - own)
        if sub.forks:
            self.forks[sub.request_id] = list(sub.forks)
        if act.cursor >= act.target:  # a prefill-only request the slot already holds
            await self._finish(act, "prefilled")
            return
        self.prefilling.append(sub.request_id)

    def _active(self, sub: Submit, slot: int, reused: int, copied: int = 0) -> Active:
        req = sub.request
        seed = req.seed if req.seed is not None else sub.request_id
        return Active(
            submit=sub, slot=slot, reused=reused, copied=copied, cursor=reused,
            detok=IncrementalDetokenizer(self.tokenizer), stops=StopMatcher(req.stop),
            key=self.runner.new_key(seed), started=time.perf_counter(),
            expert_counts=self.publisher.expert_zeros.copy(),
            target=len(sub.prompt) - 1 if req.prefill_only else len(sub.prompt),
        )

    async def _take_fork_slots(self, act: Active) -> list[Active]:
        """The other choices of `act`, whose prompt's last chunk runs next: each that gets
        a free slot starts there from the copy of act's KV that the chunk makes; the
        rest queue as requests of their own."""
        forks = []
        for sub in self.forks.pop(act.rid, []):
            slot = self.table.pick(sub.prompt)
            if slot is None:
                await self._submit(sub)
                continue
            self.table.hold(slot, sub)
            await self.prefixes.keep(slot, sub.prompt)
            self.active[sub.request_id] = fork = self._active(sub, slot, len(sub.prompt), copied=len(sub.prompt))
            fork.position = len(sub.prompt)
            forks.append(fork)
        return forks

    # ---- device work ----------------------------------------------------------------

    async def _prefill_chunk(self):
        act = self.active[self.prefilling[0]]
        prompt = act.submit.prompt
        size = self.chunk_beside_decodes if self.decoding else self.chunk_alone
        chunk = list(prompt[act.cursor : min(act.cursor + size, act.target)])
        last = act.cursor + len(chunk) == act.target
        started, sampling = time.perf_counter(), self.runner.sample_seconds
        forks = await self._take_fork_slots(act) if last and not act.request.prefill_only else []
        fork_sampled: list[Sampled] = []
        if last and not act.request.prefill_only:
            (sampled, *fork_sampled), step = await self._on_device(
                self.runner.prefill, act.slot, chunk, act.cursor, act.sampling_row(), act.history_start(),
                [(fork.slot, fork.sampling_row()) for fork in forks])
        else:
            (_, experts), step = await self._on_device(self.runner.extend, act.slot, chunk, act.cursor)
            act.count_experts(experts)
            self.publisher.routing([experts], len(chunk), step)
        act.count_step(step)
        act.sample_s += self.runner.sample_seconds - sampling
        act.prefill_s += time.perf_counter() - started - (self.runner.sample_seconds - sampling)
        act.cursor += len(chunk)
        await self.slots[act.slot].inbox.send.send(Extend(tuple(chunk)))
        for fork, fork_first in zip(forks, fork_sampled):
            await self.slots[fork.slot].inbox.send.send(SetHistory(prompt))
            self.decoding.append(fork.rid)
            await self._accept_token(fork, fork_first)
        if not last or act.rid not in self.active:
            return
        if act.request.prefill_only:
            await self.transfers.device_io(self.runner.wait_ready)  # "prefilled" means the KV is there
            await self._finish(act, "prefilled")
            return
        self.publisher.routing([sampled.experts], len(chunk), step)
        self.prefilling.popleft()
        act.position = len(prompt)
        self.decoding.append(act.rid)
        await self._accept_token(act, sampled)

    async def _decode_step(self):
        """Read one decode step (or a burst of several: _next_rows) back and hand out its
        tokens. When the runner chains steps, the step after it is dispatched first, fed
        on the device with the tokens this one sampled: the device computes step t + 1
        while the host reads, detokenizes and sends step t (a row that ended at step t
        computed one token more, dropped: its KV past the slot's history is never read).
        With a grammar, step t + 1 is sampled in the next round (runner.finish), once its masks know token t."""
        current = self.ahead
        fresh = self._next_rows([]) if current is None else None
        unread, unread_steps = (current[0], current[1].steps) if current else (fresh[0], fresh[2])
        constrained = any(self.active[rid].submit.constraint is not None for rid in self.decoding)
        ahead = self.runner.chains and (self.runner.defers or not constrained)
        following = self._next_rows(unread, not constrained, unread_steps) if ahead else ([], None, 1)
        deferred = current is not None and current[1].deferred  # sampled with its rows as they are now
        renewed = [a.sampling_row() if self._decoding(a) else FILLER_ROW for a in current[0]] if deferred else []
        started, sampling, run = time.perf_counter(), self.runner.sample_seconds, self.runner

        def work():
            step = run.finish(current[1], renewed) if current else run.dispatch(*fresh[1], steps=fresh[2])
            after = ((following[0], run.dispatch(*following[1], defer=constrained, steps=following[2]))
                     if following[0] else None)
            return unread, run.collect_steps(step), after

        (acts, by_step, self.ahead), step = await self._on_device(work)
        sample_s = self.runner.sample_seconds - sampling
        decode_s = time.perf_counter() - started - sample_s
        self.publisher.begin_call(step, len(by_step))
        for i, results in enumerate(by_step):
            # a row that ended after this step was dispatched computed a token nobody reads
            live = [(act, sampled) for act, sampled in zip(acts, results) if self._decoding(act)]
            self.publisher.gather([sampled.experts for _, sampled in live])
            for act, sampled in live:
                if i == 0:
                    act.count_step(step, decode_s, sample_s)
                act.decoded.append(act.next_token)
                act.position += 1
                if act.rid in self.active:
                    await self._accept_token(act, sampled)
        self.publisher.flush(last=True)
        if self.ahead is not None and not any(self._decoding(a) for a in self.ahead[0]):
            self.ahead = None

    def _next_rows(self, unread: list[Active], masked: bool = True, unread_steps: int = 1):
        """next_step_rows's rows and arguments, and the steps their dispatch takes: one while a
        prompt waits or a row has a grammar (checked token by token, even before its `after`
        text), else as many as a burst may (step_rows.dispatch_steps)."""
        rows, args = next_step_rows(unread, [self.active[r] for r in self.decoding], self._decoding, self.max_context,
                                    masked, unread_steps)
        grammar = any(a.submit.constraint is not None for a in rows)
        most = 1 if self.prefilling or self.table.queue or grammar else self.runner.burst_steps(args[3])
        return rows, args, dispatch_steps(rows, args, most, self.max_context)

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
        if act.grammar_refuses(token):
            await self._finish(act, "grammar")
            return
        if token in self.eos or token in act.request.stop_token_ids:
            await self._finish(act, "stop")
            return
        act.emitted += 1
        act.token_ids.append(token)
        text, stopped = act.stops.push(act.watch(act.detok.push(token)))
        top = tuple(TopCandidate(tid, self.tokenizer.decode([tid]), lp)
                    for tid, lp in sampled.top[: act.request.top_logprobs])
        if not tell(act.submit, TokenEvent(act.rid, text, token, sampled.logprob, top)):
            await self._finish(act, "cancelled")
            return
        if stopped:
            await self._finish(act, "stop", stop_matched=True)
        elif act.emitted >= act.request.max_tokens or act.position + 1 >= self.max_context:
            await self._finish(act, "length")
        else:
            act.next_token = token

    async def _cancel(self, rid: int) -> bool:
        for sub in self._queued():
            if sub.request_id == rid:
                self.table.withdraw(sub)
                for one in (sub, *sub.forks):
                    end_unstarted(one, "cancelled")
                return True
        for forks in self.forks.values():
            for fork in forks:
                if fork.request_id == rid:
                    forks.remove(fork)
                    end_unstarted(fork, "cancelled")
                    return True
        if rid in self.active:
            await self._finish(self.active[rid], "cancelled")
            return True
        return False

    async def _finish(self, act: Active, reason: FinishReason, stop_matched: bool = False):
        rid = act.rid
        del self.active[rid]
        for fork in self.forks.pop(rid, []):  # its prompt never got prefilled: they end as it did
            end_unstarted(fork, reason)
        if rid in self.decoding:
            self.decoding.remove(rid)
        if rid in self.prefilling:
            self.prefilling.remove(rid)
        stats, telemetry = act.turn_stats(reason, time.perf_counter()), act.telemetry()
        report = self.publisher.report(stats, telemetry, act)
        tell(act.submit, FinishEvent(stats, act.tail(reason, stop_matched), telemetry, report, act.stops.matched))
        act.submit.events.close()
        if act.decoded:  # a busy slot's history is first read at its release
            await self.slots[act.slot].inbox.send.send(Extend(tuple(act.decoded)))
        send, recv = open_reply()
        await self.slots[act.slot].inbox.send.send(Release(send))
        admitted = self.table.release(act.slot, act.submit, await recv.receive())
        self.publisher.turn_ended(telemetry)
        await self._start_admitted(admitted)

    async def _start_admitted(self, admitted: list[tuple[Submit | Transfer, int]]):
        """Start the waiting requests a freed slot admitted (the table holds theirs)."""
        for sub, slot in admitted:
            assert isinstance(sub, Submit)  # transfers hold a slot at once, or are refused: they never queue
            await self._start(sub, slot)
