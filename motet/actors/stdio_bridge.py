"""StdioBridge: speaks the mux protocol over a pair of byte streams (stdin/stdout in
`motet mux`) to any engine with the runtime API. One reader task decodes requests; every
line goes through one writer, so frames never interleave. Each request, and each of the
[extension] slot commands (SAVE, RESTORE, ERASE, PREFILL), runs in a task of its own, so
the reader keeps reading; the bridge tracks which slot each uses, so a slot is busy from
its command to its last line, in the order the commands came."""

from __future__ import annotations

import hashlib
import logging
import os
import re
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import trio

from ..protocol import mux
from ..protocol.mux.options import grammar_after, sampling_fields
from ..protocol.session_file import SessionError
from ..runtime.api import ExpertTiers, FinishEvent, Grammar, StepRouting, TokenEvent
from ..runtime.engine_api import Events, InProcessEngineAPI
from ..runtime.errors import BadRequest, ContextExceeded, DuplicateId, EngineError, NotFound, SlotBusy
from ..runtime.experts import HITS_EVERY, ExpertMap, device_moves
from ..runtime.slot_table import SlotTable
from .bridge import Intake, cpu_name, rss_gb

log = logging.getLogger(__name__)
READ_SIZE = 65536


@dataclass(frozen=True)
class BridgeSettings:
    topk: bool = False  # SERVE_TOPK=1: a TOPK line per token
    kv_save_dir: Path | None = None  # KVSAVE: where each slot's session persists (None: it does not)


def safe_name(fingerprint: str) -> str:
    """A model fingerprint as one file name: letters, digits, `._-` (a long one is cut,
    a hash of the whole keeping it distinct)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", fingerprint).lstrip(".") or "model"
    if len(name) > 128:
        name = f"{name[:96]}-{hashlib.sha256(fingerprint.encode()).hexdigest()[:16]}"
    return name


class SlotStore:
    """KVSAVE: each slot's session file, `<dir>/<model>/slot-<n>.session`, restored at
    start and written at the end of every turn. A file that cannot be read or written
    costs a warning on stderr, never a turn; the writes that failed are counted."""

    def __init__(self, engine: InProcessEngineAPI, root: Path):
        self.engine = engine
        self.folder = root.expanduser() / safe_name(engine.session_header.model)
        self.failures = 0  # writes that failed since start

    def path(self, slot: int) -> Path:
        return self.folder / f"slot-{slot}.session"

    async def restore_all(self) -> None:
        for slot in range(self.engine.kv_slots):
            path = self.path(slot)
            if not path.exists():
                continue
            try:
                restored = await self.engine.restore_slot(slot, path)
            except (SessionError, OSError) as exc:
                log.warning("KVSAVE: slot %d starts empty: %s refused: %s", slot, path, exc)
            else:
                log.info("KVSAVE: slot %d restored %d tokens from %s", slot, restored.tokens, path)

    async def persist(self, slot: int) -> bool:
        """Write the slot's file; False when it failed (the old file, if any, is kept)."""
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            await self.engine.save_slot(slot, self.path(slot))
        except (OSError, ValueError, EngineError) as exc:  # a full disk, no permission
            self.failures += 1
            log.warning("KVSAVE: slot %d not saved to %s (%d failures so far): %s",
                        slot, self.path(slot), self.failures, exc)
            return False
        return True

    def forget(self, slot: int) -> None:
        try:
            self.path(slot).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("KVSAVE: slot %d: %s not removed: %s", slot, self.path(slot), exc)


class StdioBridge:
    def __init__(self, engine: InProcessEngineAPI, settings: BridgeSettings, receive, send):
        self.engine = engine
        self.settings = settings
        self.input = receive
        self.output = send
        self.out_send, self.out_receive = trio.open_memory_channel(1024)
        self.intake = Intake()
        self.experts = ExpertMap.for_model(engine.model.config)
        self.experts.set_tiers(engine.expert_tiers())
        self.store = SlotStore(engine, settings.kv_save_dir) if settings.kv_save_dir is not None else None
        # which request or command id uses each slot; the engine keeps what each holds
        self.slots: SlotTable[int] = SlotTable(engine.kv_slots)

    async def run(self) -> None:
        """Until stdin ends (or a bad frame): then in-flight requests finish first."""
        async with trio.open_nursery() as writer_scope:
            writer_scope.start_soon(self._writer)
            routing = await self.engine.telemetry(buffer=1024)
            if self.store is not None:
                await self.store.restore_all()  # before READY: nothing is read meanwhile
            await self._handshake()
            hits_scope = trio.CancelScope()
            writer_scope.start_soon(self._hits, routing, hits_scope)
            async with trio.open_nursery() as requests:
                self.intake.work = requests
                with self.intake.reading:
                    await self._reader(requests)
            hits_scope.cancel()
            await self.out_send.aclose()  # the writer writes what is queued, then ends

    async def _hits(self, routing, scope: trio.CancelScope):
        """A HITS line every few device steps: the experts routed since the last one."""
        with scope:
            steps = 0
            async for event in routing:
                if isinstance(event, StepRouting):
                    self.experts.add_step(event)
                    repin = b"".join(mux.encode_telemetry("REPIN", *move) for move in device_moves(event.moves))
                    if repin:
                        await self._write(repin)
                    steps += event.steps
                    if steps >= HITS_EVERY:
                        steps = 0
                        await self._write(self._hits_line())

    def _hits_line(self) -> bytes:
        return mux.encode_telemetry("HITS", self.experts.rows, self.experts.cols, self.experts.take_hits().hex())

    async def _writer(self):
        async with self.out_receive:
            async for frame in self.out_receive:
                await self.output.send_all(frame)

    async def _write(self, frame: bytes):
        await self.out_send.send(frame)

    def _hwinfo(self) -> bytes:
        vm = psutil.virtual_memory()
        gpus = self._expert_tiers().gpus  # the engine's view of its GPUs (none on a CPU host)
        return mux.encode_telemetry(
            "HWINFO", os.cpu_count(), f"{vm.total / 1e9:.1f}", f"{vm.available / 1e9:.1f}", len(gpus),
            f"{sum(total for _, total, _ in gpus):.1f}", f"{cpu_name()}|",
        )

    def _expert_tiers(self) -> ExpertTiers:
        tiers = self.experts.tiers
        assert tiers is not None  # the engine's, set in __init__; a step only ever replaces them
        return tiers

    def _tiers(self) -> bytes:
        tiers = self._expert_tiers()
        return mux.encode_telemetry(
            "TIERS", *self.experts.tier_counts(), f"{tiers.device_gb:.2f}", f"{tiers.ram_gb:.2f}"
        )

    @staticmethod
    def _gpus(gpus) -> bytes:
        return mux.encode_telemetry(
            "GPUS", len(gpus), *(x for used, total, n in gpus for x in (f"{used:.2f}", f"{total:.2f}", n))
        )

    async def _handshake(self):
        await self._write(
            mux.encode_ready()
            + mux.encode_telemetry("STAT", 0, "0.00", "0.0", f"{rss_gb():.2f}")
            + self._hwinfo() + self._tiers() + self._emap() + self._warmup()
        )

    def _warmup(self) -> bytes:
        """[extension] How the engine came up (servers skip a line kind they do not know)."""
        r = self.engine.startup()
        # ready, and in this process: every field is known (a mux child's report may lack some)
        assert (r is not None and r.load_s is not None and r.warmup_s is not None and r.shapes is not None
                and r.compiled is not None and r.from_cache is not None)
        return mux.encode_warmup(mux.Warmup(r.ready_s, r.load_s, r.warmup_s, r.shapes, r.compiled, r.from_cache))

    def _emap(self) -> bytes:
        return mux.encode_telemetry("EMAP", self.experts.rows, self.experts.cols, self.experts.emap().hex())

    async def _reader(self, requests: trio.Nursery):
        decoder = mux.RequestDecoder()
        while not decoder.closed:
            data = await self.input.receive_some(READ_SIZE)
            if not data:
                return  # EOF: the nursery waits for the requests in flight
            for event in decoder.feed(data):
                await self._dispatch(event, requests)

    async def _dispatch(self, event, requests: trio.Nursery):
        match event:
            case mux.Submit():
                await self._submit(event, requests)
            case mux.Cancel(rid):
                await self._control(self.engine.cancel, rid)
            case mux.Stop(rid):
                await self._control(self.engine.stop, rid)
            case mux.Prefill():
                await self._submit(event, requests)
            case mux.Save() | mux.Restore() | mux.Erase():
                if await self._claim(event.request_id, event.slot):
                    requests.start_soon(self._slot_command, event)
            case mux.Malformed(rid, reason):
                log.warning("request %d: %s", rid, reason)
                await self._write(mux.encode_error(rid, BadRequest.code))
            case mux.BadFrame(rid):
                await self._write(mux.encode_error(rid, "BAD_FRAME"))

    async def _control(self, call, rid: int):
        try:
            await call(rid)
        except NotFound:
            await self._write(mux.encode_error(rid, NotFound.code))

    async def _claim(self, rid: int, slot: int) -> bool:
        """Mark the slot used by `rid` until its last line; False (and the error written)
        when the id is in flight or the slot in use."""
        in_flight = any(rid in ids for ids in self.slots.holders.values())
        error = DuplicateId(rid) if in_flight else SlotBusy(slot) if self.slots.held(slot) else None
        if error is not None:
            await self._write(mux.encode_error(rid, error.code))
            return False
        self.slots.hold(slot, rid)
        return True

    def _release(self, rid: int, slot: int) -> None:
        self.slots.release(slot, rid, touch=False)  # the engine picks no slot here: no recency to keep

    async def _submit(self, sub: mux.Submit | mux.Prefill, requests: trio.Nursery):
        if b"\x00" in sub.payload:
            await self._write(mux.encode_error(sub.request_id, BadRequest.code))
            return
        if not await self._claim(sub.request_id, sub.slot):
            return
        prompt = sub.payload.decode("utf-8", "replace")
        request = AsyncExitStack()  # the stream block, left by _relay once the request is over
        try:
            if isinstance(sub, mux.Prefill):
                stream = self.engine.stream(prompt, max_tokens=1, slot=sub.slot, request_id=sub.request_id,
                                            prefill_only=True)
            else:
                stream = self.engine.stream(
                    prompt, max_tokens=max(1, sub.max_tokens), temperature=sub.temperature,
                    top_p=sub.top_p, slot=sub.slot, request_id=sub.request_id,
                    top_logprobs=5 if self.settings.topk else 0, grammar=_grammar(sub), **sampling_fields(sub.options),
                )
            events = await request.enter_async_context(stream)
        except EngineError as exc:
            self._release(sub.request_id, sub.slot)
            await self._write(self._error(sub.request_id, exc))
            return
        requests.start_soon(self._relay, sub, request, events)

    def _error(self, rid: int, exc: EngineError) -> bytes:
        if isinstance(exc, ContextExceeded):
            return mux.encode_error(rid, exc.code, exc.used, exc.limit)
        return mux.encode_error(rid, exc.code)

    async def _relay(self, sub: mux.Submit | mux.Prefill, request: AsyncExitStack, events: Events):
        """Write one request's frames; the request was accepted before this task starts."""
        rid = sub.request_id
        try:
            async for event in events:
                if isinstance(event, TokenEvent):
                    frame = mux.encode_data(rid, event.text)
                    if self.settings.topk and event.top:
                        frame += mux.encode_topk(
                            rid, [(c.logprob, c.text.encode()) for c in event.top]
                        )
                    if frame:
                        await self._write(frame)
                elif isinstance(event, FinishEvent):
                    await self._persist(sub.slot)  # before the turn's last line
                    self._release(rid, sub.slot)  # the next command may use the slot at once
                    await self._write(self._finish(sub, event))
        finally:
            self._release(rid, sub.slot)
            await request.aclose()

    async def _persist(self, slot: int) -> None:
        """KVSAVE the slot (when on); a write that failed is also told to the server,
        counted ([extension] `KVSAVE_FAIL <slot> <failures so far>`)."""
        if self.store is not None and not await self.store.persist(slot):
            await self._write(mux.encode_kvsave_fail(mux.KvSaveFail(slot, self.store.failures)))

    async def _slot_command(self, command: mux.Save | mux.Restore | mux.Erase):
        """Run a SAVE, RESTORE or ERASE (the slot claimed) and write its answer."""
        rid, slot = command.request_id, command.slot
        try:
            reply = await self._run_slot_command(command)
        except SessionError as exc:
            reply = mux.encode_session_refused(rid, str(exc))
        except EngineError as exc:
            reply = self._error(rid, exc)
        except (OSError, ValueError) as exc:  # an unreadable or unwritable path
            log.warning("request %d: %s", rid, exc if isinstance(command, mux.Erase) else f"{command.path}: {exc}")
            reply = mux.encode_error(rid, BadRequest.code)
        finally:
            self._release(rid, slot)
        await self._write(reply)

    async def _run_slot_command(self, command: mux.Save | mux.Restore | mux.Erase) -> bytes:
        rid, slot = command.request_id, command.slot
        match command:
            case mux.Save(path=path):
                f = await self.engine.save_slot(slot, path)
                return mux.encode_saved(mux.Saved(rid, slot, f.tokens, f.bytes, f.ms))
            case mux.Restore(path=path):
                f = await self.engine.restore_slot(slot, path)
                await self._persist(slot)  # a restart finds what the slot holds now
                return mux.encode_restored(mux.Restored(rid, slot, f.tokens, f.bytes, f.ms))
            case mux.Erase():
                tokens = await self.engine.erase_slot(slot)
                if self.store is not None:
                    self.store.forget(slot)
                return mux.encode_erased(mux.Erased(rid, slot, tokens))

    def _finish(self, sub: mux.Submit | mux.Prefill, event: FinishEvent) -> bytes:
        """A turn's last lines: its DONE with the telemetry block, PREFILLED, or CANCELLED."""
        rid, stats = sub.request_id, event.stats
        if isinstance(sub, mux.Prefill):
            if stats.finish_reason != "prefilled":  # cancelled (or stopped) part way
                return mux.encode_error(rid, "CANCELLED")
            ms = stats.total_s * 1000
            return mux.encode_prefilled(mux.Prefilled(rid, stats.slot, stats.prompt_tokens - 1,
                                                      stats.reused_tokens, ms))
        if stats.finish_reason == "cancelled":
            return mux.encode_error(rid, "CANCELLED")
        tail = mux.encode_data(rid, event.text_tail) if event.text_tail else b""
        report = event.report
        assert report is not None  # the in-process engine reports every turn that was not cancelled
        self.experts.end_turn(report.entropy)
        p = report.perf
        perf = mux.encode_telemetry(
            "PERF", rid, *(f"{x:.4f}" for x in (p.dt, p.t_edisk, p.t_ewait, p.t_emm, p.t_attn, p.t_kvb, p.t_head))
        )
        # [extension] what the turn reused: servers that do not know TURN skip it
        turn = mux.encode_telemetry(
            "TURN", rid, stats.slot, stats.reused_tokens, f"{stats.time_to_first_token_s:.4f}"
        )
        done = mux.Done(
            rid, stats.emitted_tokens, stats.decode_tokens_per_s, report.hit_pct, rss_gb(),
            stats.prompt_tokens, stats.finish_reason == "length",
        )
        return (
            tail + turn + self._hwinfo() + perf
            + mux.encode_telemetry("ENTROPY", *(f"{h:.3f}" for h in report.entropy))
            + self._gpus(report.gpus) + self._tiers() + self._emap()
            + self._hits_line()
            + mux.encode_done(done)
        )


def _grammar(sub: mux.Submit) -> Grammar | None:
    """The grammar a SUBMIT carries, waiting for its `grammar_after` text if it names one."""
    grammar = None if sub.grammar is None else mux.grammar_from_wire(sub.grammar)
    after = grammar_after(sub.options)
    if after is None:
        return grammar
    if grammar is None:
        raise BadRequest("grammar_after is given without a grammar")
    return replace(grammar, after=after)
