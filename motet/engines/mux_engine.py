"""MuxEngine: the Engine API over any mux engine, run as a child process.

    async with MuxEngine(["motet", "mux"], env={"SNAP": "model.gguf"}, kv_slots=4) as engine:
        async with engine.stream("Once upon a time", max_tokens=32) as events:
            async for event in events:
                ...

One reader task demultiplexes the child's stdout into per-request channels; one writer task
owns its stdin. The wire has no "any slot": slots are chosen here (runtime/slot_table.py).

What the wire imposes: prompts are text (token ids are a BadRequest); the seed, cuts,
penalties, biases and stop ids SUBMIT has no field for go as its options [extension]
(protocol/mux/options.py), as does a grammar's `after`; token ids are None,
logprobs come only with `top_logprobs` (from TOPK lines); stop strings are matched
here, then STOP ends the request; a request that waited for a slot meets a refusal
(ContextExceeded, ...) at its first event, not at entry.

A slot's KV goes through motet's [extension] commands: save_slot / restore_slot /
erase_slot (SAVE, RESTORE, ERASE) and prefill (PREFILL); a slot they use is not chosen for
a request meanwhile. A restored slot's text is unknown here: a request continuing it names it.
"""

from __future__ import annotations

import itertools
import logging
import os
import shlex
import subprocess
import time
from collections.abc import Mapping, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import trio

from ..protocol import mux
from ..protocol.mux.options import grammar_after_option
from ..protocol.sampling_keys import pairs_of
from ..runtime.api import EngineStatistics, ExpertState, GenerationRequest, SlotFile, StartupReport
from ..runtime.collect import Collected
from ..runtime.errors import BadRequest, EngineClosed, NotFound
from ..runtime.service import Service
from ..runtime.slot_table import SlotTable
from .chat_files import ChatFiles
from .mux_report import ChildReport
from .mux_stream import EngineExited, EngineStartError, MuxStream, SlotCommand, check_wire_prompt, wire_request_id

log = logging.getLogger(__name__)
READ_SIZE = 65536
CHILD_ENV = {"SERVE": "1", "SERVE_BATCH": "1", "SERVE_TOPK": "1"}
EXIT_GRACE_S = 10.0  # once its stdin is closed, how long the child has to exit


async def _kill(process: trio.Process) -> None:
    process.kill()  # leaving on an error: no grace


class MuxEngine(ChatFiles, Service, Collected):
    """`command` (a string is split as a shell would) runs with `env` over the caller's
    environment and SERVE=1 SERVE_BATCH=1 SERVE_TOPK=1 KV_SLOTS=kv_slots; its settings are
    read from those alone. `chat_model`: whose name, chat template and tokenizer it reads
    (ChatFiles; default: `env`'s SNAP, else the default model)."""

    def __init__(self, command: Sequence[str] | str, *, env: Mapping[str, str] | None = None,
                 kv_slots: int = 1, chat_model: str | Path | None = None, queue_limit: int = 64):
        self.command = shlex.split(command) if isinstance(command, str) else list(command)
        self.env = {**CHILD_ENV, "KV_SLOTS": str(kv_slots), **(env or {})}
        self.kv_slots = int(self.env["KV_SLOTS"])
        self.topk = self.env.get("SERVE_TOPK") == "1"  # then every token ends with a TOPK line
        ChatFiles.__init__(self, chat_model if chat_model is not None else self.env.get("SNAP") or None)
        # The child's slots as seen from here: whose each is, its last turn's prompt and
        # answer as text, and the requests waiting for one.
        self._slots: SlotTable[MuxStream | SlotCommand] = SlotTable(self.kv_slots, queue_limit)
        self._streams: dict[int, MuxStream] = {}  # every request open here, by id
        self._probes: dict[int, list[trio.Event]] = {}  # CANCEL/STOP of ids unknown here
        self._commands: dict[int, SlotCommand] = {}  # SAVE/RESTORE/ERASE awaiting their answer, by id
        self._ids = itertools.count(1)
        self._report = ChildReport()  # how it came up, and its telemetry lines
        self.process: trio.Process | None = None  # the child, once started
        self._closing = self._eof = False  # eof: the child's stdout ended
        self._exit_status: int | None = None
        self._exited = trio.Event()  # the reader is done: nothing more comes from the child

    # ---- life cycle -----------------------------------------------------------------

    async def start(self, nursery: trio.Nursery) -> None:
        """Start the child and wait for its READY; EngineStartError if it never comes."""
        started = time.perf_counter()
        self.process = process = await nursery.start(partial(
            trio.run_process, self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            env={**os.environ, **self.env}, check=False, deliver_cancel=_kill,
        ))
        assert process.stdin is not None and process.stdout is not None  # both piped
        decoder = mux.ExtendedResponseDecoder()
        while data := await process.stdout.receive_some(READ_SIZE):
            events = decoder.feed(bytes(data))
            if fail := next((e for e in events if isinstance(e, mux.LoadFail)), None):
                status = await process.wait()
                raise EngineStartError(f"the mux engine could not load its model ({fail.kind}): "
                                       f"{fail.detail} (exit status {status})", status, fail.kind)
            if mux.Ready() in events:
                self._report.ready_s = time.perf_counter() - started
                break
        else:
            status = await process.wait()
            raise EngineStartError(f"{shlex.join(self.command)} exited with status {status} before READY",
                                   status)
        # Unbounded, yet bounded in fact: each request adds a SUBMIT and a CANCEL or STOP
        # or two, and each cancel() or stop() waits for its answer before it sends again.
        self._out, frames = trio.open_memory_channel(float("inf"))
        nursery.start_soon(self._writer, frames, process.stdin)
        nursery.start_soon(self._reader, decoder, process)
        for event in events[events.index(mux.Ready()) + 1 :]:
            self._on_event(event)
        self._nursery = nursery

    async def _close(self) -> None:
        await self.aclose()

    def _closed_now(self) -> None:
        self._closing = True

    async def drain(self) -> None:
        """Refuse new requests and wait until every request in flight has finished."""
        self._closing = True
        for stream in list(self._streams.values()):
            await stream.ended.wait()

    async def aclose(self) -> None:
        """Drain, then close the child's stdin (its cue to exit) and give it time to exit."""
        await self.drain()
        self._out.close()  # the writer sends what is queued, then closes stdin
        with trio.move_on_after(EXIT_GRACE_S):
            await self._exited.wait()

    def _closed_error(self) -> EngineClosed:
        return EngineExited(self._exit_status) if self._eof else EngineClosed()

    # ---- the child's stdin and stdout ---------------------------------------------------

    async def _writer(self, frames: trio.MemoryReceiveChannel, stdin: trio.abc.SendStream):
        async with frames, stdin:
            async for frame in frames:
                try:
                    await stdin.send_all(frame)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return  # the child is gone; the reader tells whoever waits

    def _send(self, frame: bytes, quiet: bool = False) -> None:
        """Queue a frame for the child; frames reach it in the order they are sent."""
        try:
            self._out.send_nowait(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            if not quiet:
                raise self._closed_error() from None

    async def _reader(self, decoder, process: trio.Process):
        assert process.stdout is not None  # piped
        try:
            while data := await process.stdout.receive_some(READ_SIZE):
                for event in decoder.feed(bytes(data)):
                    self._on_event(event)
            self._eof = True
            with trio.move_on_after(EXIT_GRACE_S):
                self._exit_status = await process.wait()
        finally:  # however it ended, all that waits on the child fails now
            self._exited.set()
            self._slots.queue.clear()
            for stream in list(self._streams.values()):
                self._end(stream, self._closed_error())
            for rid in list(self._commands):
                self._answer(rid, self._closed_error())
            for waiter in itertools.chain(*self._probes.values()):
                waiter.set()
            self._out.close()

    def _on_event(self, event) -> None:
        # Data, TopK, Turn, Done and Error name a request; the rest do not.
        stream = self._streams.get(getattr(event, "request_id", 0))
        match event:
            case mux.Saved() | mux.Restored() | mux.Erased() | mux.SessionRefused() | mux.Error() if (
                event.request_id in self._commands
            ):
                self._answer(event.request_id, event)
            case mux.Data() | mux.TopK() if stream is not None:
                stream.first_at = stream.first_at or time.perf_counter()
                stream.answer += event.data if isinstance(event, mux.Data) else b""
                self._route(stream, event)
            case mux.Turn() if stream is not None:
                stream.turn = event
            case mux.Error(code="NOT_FOUND") if self._probes.get(event.request_id):
                self._probes[event.request_id].pop(0).set()
            case mux.Error(code="NOT_FOUND"):
                pass  # a STOP or CANCEL that crossed its request's end: a SUBMIT never gets it
            case mux.Done() | mux.Error() | mux.Prefilled() if stream is not None:
                self._end(stream, event)
            case mux.Warmup():
                self._report.warmup = event
            case mux.Telemetry(kind, fields):
                try:
                    self._report.line(kind, fields, self._streams)
                except (ValueError, IndexError, TypeError) as exc:  # TypeError: too few fields
                    log.warning("mux engine: unreadable %s line: %s", kind, exc)
            case mux.BadLine(line, reason):
                log.warning("mux engine: skipped a bad line (%s): %r", reason, line[:200])
            case _:
                log.debug("mux engine: %r for no open request", event)

    def _route(self, stream: MuxStream, item) -> None:
        try:
            stream.send.send_nowait(item)  # unbounded: a request's frames are bounded by max_tokens
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # its caller left; a CANCEL is on its way

    def _end(self, stream: MuxStream, final) -> None:
        """A request's last frame (or a failure): free its slot, submit who waited for one."""
        del self._streams[stream.request_id]
        stream.ended_at = time.perf_counter()
        stream.entropy_gpus = (self._report.experts.entropy, self._report.gpus)
        # A finished, prefilled or cancelled turn leaves its KV in the slot; a refused one none.
        cancelled = isinstance(final, mux.Error) and final.code == "CANCELLED" and stream.slot is not None
        self._route(stream, final)
        stream.send.close()
        stream.ended.set()
        kept = isinstance(final, mux.Done | mux.Prefilled) or cancelled  # else the KV is as it was
        history = stream.prompt + stream.answer.decode("utf-8", "replace") if kept else None
        self._free(stream.slot, stream, history, touch=kept)

    def _answer(self, rid: int, answer) -> None:
        """A slot command's answer (or the child's end): its caller wakes, its slot frees."""
        command = self._commands.pop(rid)
        command.answer = answer
        command.answered.set()
        if isinstance(answer, mux.Erased):  # empty: the first choice for a new conversation
            self._slots.forget(command.slot)
        restored = isinstance(answer, mux.Restored)  # text unknown here: no prefix to offer, used now
        self._free(command.slot, command, "" if restored else None, touch=restored)

    def _free(self, slot: int | None, holder: MuxStream | SlotCommand, history: str | None = None,
              touch: bool = True) -> None:
        """The holder's slot is free (`history`: the text it holds now); who waited for one
        is submitted. The table compares any sequences: here histories are text."""
        if slot is not None:
            for stream, got in self._slots.release(slot, holder, history, touch):
                assert isinstance(stream, MuxStream)  # commands never queue
                self._submit(stream, got, quiet=True)  # a dead child: the reader tells

    # ---- requests ---------------------------------------------------------------------

    def _submit(self, stream: MuxStream, slot: int, quiet: bool = False) -> None:
        r, payload = stream.request, stream.prompt.encode()
        if r.prefill_only:
            self._send(mux.encode_prefill(mux.Prefill(stream.request_id, slot, payload)), quiet)
        else:
            grammar = None if r.grammar is None else mux.grammar_to_wire(r.grammar)
            after = (grammar_after_option(r.grammar.after),) if r.grammar is not None and r.grammar.after else ()
            submit = mux.Submit(stream.request_id, slot, r.max_tokens, r.temperature, r.top_p, payload, grammar,
                                pairs_of(vars(r)) + after)
            self._send(mux.encode_submit(submit), quiet)
        stream.slot, stream.sent_at = slot, time.perf_counter()

    async def _wait_cancelled(self, slot: int) -> None:
        """A request its caller left keeps its slot until the child's CANCELLED (the slot
        is persisted first): a new request for that slot waits for it, as the in-process
        scheduler takes the cancel before the next submit."""
        for stream in list(self._streams.values()):
            if stream.slot == slot and stream.cancelled:
                await stream.ended.wait()

    def _cancel(self, stream: MuxStream) -> None:
        stream.cancelled = True
        if stream.slot is not None:
            self._send(mux.encode_cancel(stream.request_id), quiet=True)
        else:  # the child never got it: it ends here
            self._slots.withdraw(stream)
            self._end(stream, mux.Error(stream.request_id, "CANCELLED"))

    @asynccontextmanager
    async def stream(self, prompt, **fields):
        """As Engine.stream; the fields SUBMIT's line has no place for go as its options
        [extension] (seed, top_k, min_p, the penalties, logit_bias, stop_token_ids)."""
        request = GenerationRequest.of(prompt, **fields)
        slot, request_id = request.slot, request.request_id
        # What the wire cannot carry is refused here, at entry, not by the child at the first
        # event (in-band, for a request that waited for a slot), nor in _submit (the reader's)
        check_wire_prompt(prompt)
        if slot is not None:
            self._check_slot(slot)
            await self._wait_cancelled(slot)
        self._check_open()
        rid = self._request_id(request_id)
        events = MuxStream(self, rid, prompt, request)
        if slot is not None:
            self._slots.hold(slot, events, share=True)  # the child answers when it is busy
        else:  # QueueFull; None: accepted, as in Engine, and it runs when a slot frees
            slot = self._slots.take(events, prompt)
        if slot is not None:
            try:
                self._submit(events, slot)
            except EngineClosed:
                self._free(slot, events, touch=False)
                raise
        self._streams[rid] = events
        try:
            if slot is not None:
                await events._fill()  # the child's first answer: a refusal raises here
            yield events
        finally:
            events._receive.close()
            if not events.ended.is_set():  # left early (a break, a cancel): cancel it
                self._cancel(events)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.kv_slots:
            raise BadRequest(f"slot must be in [0, {self.kv_slots - 1}], got {slot}")

    def _check_open(self) -> None:
        if self.process is None or self._closing:
            raise EngineClosed()
        if self._exited.is_set():
            raise self._closed_error()

    def _request_id(self, request_id: int | None) -> int:
        return wire_request_id(request_id, self._streams.keys() | self._commands.keys(), self._ids)

    # ---- a slot's KV [extension] ---------------------------------------------------------

    async def save_slot(self, slot: int, path: str | Path) -> SlotFile:
        """As Engine.save_slot (SAVE): the path is the child's, as it sees the file system."""
        saved = await self._slot_command(slot, lambda rid: mux.encode_save(mux.Save(rid, slot, str(path))))
        return SlotFile(saved.slot, saved.tokens, saved.bytes, saved.ms)

    async def restore_slot(self, slot: int, path: str | Path) -> SlotFile:
        """As Engine.restore_slot (RESTORE): a refused file raises SessionError with the
        child's reason, and the slot keeps what it held."""
        got = await self._slot_command(slot, lambda rid: mux.encode_restore(mux.Restore(rid, slot, str(path))))
        return SlotFile(got.slot, got.tokens, got.bytes, got.ms)

    async def erase_slot(self, slot: int) -> int:
        """As Engine.erase_slot (ERASE): the number of tokens the slot held."""
        return (await self._slot_command(slot, lambda rid: mux.encode_erase(mux.Erase(rid, slot)))).tokens

    async def _slot_command(self, slot: int, encode):
        """Send `encode(id)` and wait for its answer; the child's refusal raised as Engine's."""
        self._check_slot(slot)
        self._check_open()
        rid = self._request_id(None)
        command = SlotCommand(slot)
        self._slots.hold(slot, command, share=True)  # the child answers when it is busy
        self._commands[rid] = command
        try:
            self._send(encode(rid))
        except EngineClosed:
            del self._commands[rid]
            self._free(slot, command, touch=False)
            raise
        await command.answered.wait()
        return command.result()

    def startup(self) -> StartupReport | None:
        """How the child came up (ChildReport.startup)."""
        return self._report.startup()

    def statistics(self) -> EngineStatistics:
        """Requests running and waiting now, as this client sees them (a snapshot)."""
        running = sum(s.slot is not None for s in self._streams.values())
        closing = self._closing or self._exited.is_set()
        return EngineStatistics(running, len(self._slots.queue), self.kv_slots, closing)

    async def cancel(self, request_id: int) -> None:
        """Cancel a request; returns once it has ended. NotFound when none has this id."""
        stream = self._streams.get(request_id) or await self._not_found(request_id, mux.encode_cancel)
        self._cancel(stream)
        await stream.ended.wait()

    async def stop(self, request_id: int) -> None:
        """End a request now through its normal finish; NotFound when none has this id."""
        stream = self._streams.get(request_id) or await self._not_found(request_id, mux.encode_stop)
        if stream.slot is None:
            raise NotFound(request_id)  # waiting here, not running: as in Engine
        self._send(mux.encode_stop(request_id))
        await stream.ended.wait()

    async def _not_found(self, rid: int, encode):
        """An id unknown here: ask the child all the same, and raise its NOT_FOUND."""
        answer = trio.Event()
        self._probes.setdefault(rid, []).append(answer)
        self._send(encode(rid))
        await answer.wait()
        raise self._closed_error() if self._exited.is_set() else NotFound(rid)

    def expert_state(self) -> ExpertState:
        """The latest EMAP, HITS (seq counts them) and ENTROPY lines."""
        return self._report.experts
