"""MuxEngine as a client of *any* mux engine: what the shared suite in test_engine*.py
cannot show. Scripted fake engines (a protocol peer written in plain Python, replaying
frames built with motet's encoders) make interleaving, odd lines and a dying child
deterministic; the real `motet mux` shows load failures, a killed child, slot choice and
requests waiting for a slot."""

from __future__ import annotations

import json
import sys
from functools import partial

import pytest
import trio
import trio.testing
from conftest import GOLDEN, MUX_COMMAND

from motet.engines.mux_engine import EngineExited, EngineStartError, MuxEngine
from motet.model.errors import ModelError
from motet.protocol import mux
from motet.runtime.api import EngineStatistics, FinishEvent, Perf
from motet.runtime.errors import EngineClosed, NotFound, QueueFull

TIMEOUT = 120  # seconds
LLAMA = {"SNAP": str(GOLDEN / "llama"), "CTX": "256"}

# A scripted mux engine: it runs its plan's steps ("write" these bytes, "read" n request
# lines, "exit" with a status), logs every request line it reads, then reads to EOF.
FAKE_ENGINE = r'''
import json, sys
steps = json.load(open(sys.argv[1]))
received = open(sys.argv[2], "ab", buffering=0)
stdin, stdout = sys.stdin.buffer, sys.stdout.buffer

def read_request():
    line = stdin.readline()
    if not line:
        sys.exit(0)
    received.write(line)
    words = line.split()
    if words[:1] == [b"SUBMIT"]:
        stdin.read(int(words[3]) + 1)

for op, arg in steps:
    if op == "write":
        stdout.write(bytes.fromhex(arg))
        stdout.flush()
    elif op == "read":
        for _ in range(arg):
            read_request()
    else:
        sys.exit(arg)
while True:
    read_request()
'''

HANDSHAKE = (mux.encode_ready() + mux.encode_telemetry("STAT", 0, "0.00", "0.0", "0.10")
             + mux.encode_telemetry("EMAP", 2, 2, "80808080"))


def fake_engine(tmp_path, *steps) -> tuple[list[str], object]:
    """The command of a fake engine running `steps`, and the file of what it read."""
    plan = [(op, arg.hex() if isinstance(arg, bytes) else arg) for op, arg in steps]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    (tmp_path / "fake_engine.py").write_text(FAKE_ENGINE)
    received = tmp_path / "received"
    received.write_bytes(b"")
    return [sys.executable, str(tmp_path / "fake_engine.py"), str(tmp_path / "plan.json"), str(received)], received


def token(rid: int, text: bytes, *alternatives: tuple[float, bytes]) -> bytes:
    """A token as an engine with SERVE_TOPK=1 writes it: DATA (none when empty), TOPK."""
    data = f"DATA {rid} {len(text)}\n".encode() + text + b"\n" if text else b""
    return data + mux.encode_topk(rid, [(-0.1, text), *alternatives])


def done(rid: int, emitted: int, prompt_tokens: int, length_limited: bool) -> bytes:
    return mux.encode_done(mux.Done(rid, emitted, 10.0, 100.0, 0.5, prompt_tokens, length_limited))


async def collect(engine, prompt, log: dict, **kwargs):
    async with engine.stream(prompt, **kwargs) as events:
        log[events.request_id] = [event async for event in events]


async def test_interleaved_requests_are_demultiplexed(tmp_path, caplog):
    wire = (
        token(7, b"Hel", (-1.0, b"He")) + token(9, b"\xc3")  # half of an "é"
        + b"FUTURE_KIND 1 2 3\n"  # a kind nobody knows yet: skipped
        + token(7, b"lo", (-2.0, b"l")) + b"REPIN 3 7 1 0\n"
        + token(9, b"\xa9t\xc3\xa9") + b"HITS 2 2 c0\n"
        + b"DONE x\n"  # a known kind that does not parse: logged, skipped
        + b"TURN 7 0 5 0.2500\n"
        + mux.encode_telemetry("PERF", 7, "1.5", 0, 0, "1.0", 0, 0, "0.25")
        + mux.encode_telemetry("ENTROPY", "1.000", "0.500") + b"GPUS 1 3.5 80.0 4\n"
        + mux.encode_telemetry("EMAP", 2, 2, "81828384") + b"HITS 2 2 40\n"
        + done(7, 2, 5, True)
        + mux.encode_data(9, "!")  # text after the last token: the tail
        + done(9, 2, 4, False)  # no TURN: the slot sent, nothing reused, TTFT measured
    )
    command, received = fake_engine(tmp_path, ("write", HANDSHAKE), ("read", 2), ("write", wire))
    log = {}
    with trio.fail_after(TIMEOUT):
        async with MuxEngine(command, kv_slots=2) as engine:
            assert engine.expert_state().emap == bytes([0x80] * 4)  # from the handshake
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(collect, engine, "first", log, request_id=7, top_logprobs=2))
                await trio.testing.wait_all_tasks_blocked()  # 7 is sent (on slot 0) first
                nursery.start_soon(partial(collect, engine, "second", log, request_id=9))
            state = engine.expert_state()

    *tokens7, finish7 = log[7]
    assert [t.text for t in tokens7] == ["Hel", "lo"]
    assert all(t.token_id is None for t in tokens7)
    assert [c.text for c in tokens7[0].top] == ["Hel", "He"] and tokens7[0].logprob == -0.1
    s = finish7.stats
    assert (s.request_id, s.slot, s.finish_reason, s.prompt_tokens, s.reused_tokens, s.emitted_tokens) == (
        7, 0, "length", 5, 5, 2)
    assert s.time_to_first_token_s == 0.25 and s.decode_tokens_per_s == 10.0
    assert finish7.report.perf == Perf(1.5, 0, 0, 1.0, 0, 0, 0.25)
    assert finish7.report.entropy == (1.0, 0.5)
    assert finish7.report.gpus == ((3.5, 80.0, 4),)
    assert finish7.report.repin == ((3, 7, 1, 0),)
    assert finish7.telemetry is None

    *tokens9, finish9 = log[9]
    assert [t.text for t in tokens9] == ["", "été"]  # the character completes on the second
    assert all(t.top == () and t.logprob is None for t in tokens9)  # none asked for
    assert finish9.text_tail == "!"
    s = finish9.stats
    assert (s.slot, s.finish_reason, s.reused_tokens, s.emitted_tokens) == (1, "stop", 0, 2)
    assert s.time_to_first_token_s > 0
    assert finish9.report.repin == ((3, 7, 1, 0),)  # in flight when it came

    assert state.rows == state.cols == 2
    assert (state.emap, state.hits, state.seq, state.entropy) == (bytes.fromhex("81828384"), b"\x40", 2, (1.0, 0.5))
    assert "bad line" in caplog.text
    submits = [line.split() for line in received.read_bytes().splitlines()]
    assert [(w[0], w[1], w[2]) for w in submits] == [(b"SUBMIT", b"7", b"0"), (b"SUBMIT", b"9", b"1")]


async def test_a_stop_string_ends_the_request_with_stop(tmp_path):
    first = token(4, b"Hello") + token(4, b" wor") + token(4, b"ld and")
    later = token(4, b" more") + done(4, 5, 3, False)
    command, received = fake_engine(tmp_path, ("write", HANDSHAKE), ("read", 1), ("write", first),
                                    ("read", 1), ("write", later))
    with trio.fail_after(TIMEOUT):
        async with MuxEngine(command) as engine:
            async with engine.stream("say it", stop="world", request_id=4) as events:
                seen = [event async for event in events]
    *tokens, finish = seen
    assert [t.text for t in tokens] == ["Hello", " ", ""]  # the stop string is never released
    assert finish.stats.finish_reason == "stop"
    assert finish.stats.emitted_tokens == 3  # what was kept, not what the engine ran on to
    assert finish.text_tail == ""
    assert received.read_bytes().splitlines()[-1] == b"STOP 4"


async def test_the_child_dying_fails_every_waiting_call_at_once(tmp_path):
    command, _ = fake_engine(tmp_path, ("write", HANDSHAKE), ("read", 1), ("write", token(1, b"Hi")),
                             ("read", 1), ("exit", 3))
    outcome = {}

    async def expect_exit(name, call, *, task_status=trio.TASK_STATUS_IGNORED):
        try:
            await call(task_status)
        except EngineClosed as exc:
            outcome[name] = exc

    async def running(task_status):
        async with engine.stream("one", max_tokens=100) as events:
            async for _ in events:
                pass

    async def waiting(task_status):
        async with engine.stream("two", max_tokens=100) as events:  # no slot free: it waits
            task_status.started()
            async for _ in events:
                pass

    with trio.fail_after(TIMEOUT):
        async with MuxEngine(command, kv_slots=1) as engine:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(expect_exit, "running", running)
                await trio.testing.wait_all_tasks_blocked()
                await nursery.start(expect_exit, "waiting", waiting)
                with trio.fail_after(5):  # promptly: no timeout involved
                    # Its CANCEL is the last thing the child reads: then it exits 3.
                    await expect_exit("cancel", lambda _: engine.cancel(99))
            with pytest.raises(EngineClosed):
                await engine.complete("later")
    assert set(outcome) == {"running", "waiting", "cancel"}
    assert all(isinstance(e, EngineExited) and e.status == 3 and "status 3" in str(e)
               for e in outcome.values())


async def test_a_killed_child_fails_its_stream_promptly():
    with trio.fail_after(TIMEOUT):
        async with MuxEngine(MUX_COMMAND, env=LLAMA, kv_slots=2) as engine:
            got = []
            with pytest.raises(EngineExited) as exited:
                async with engine.stream("A story that goes on", max_tokens=200) as events:
                    async for event in events:
                        got.append(event)
                        if len(got) == 3:
                            engine.process.kill()
            assert exited.value.status == -9
            assert 3 <= len(got) < 200 and not any(isinstance(e, FinishEvent) for e in got)


async def test_a_model_that_cannot_load_raises_at_entry(tmp_path):
    missing = tmp_path / "missing.gguf"
    with trio.fail_after(TIMEOUT):
        with pytest.raises(EngineStartError) as failed:
            async with MuxEngine(MUX_COMMAND, env={"SNAP": str(missing)}):
                pass
    assert isinstance(failed.value, ModelError)
    assert (failed.value.kind, failed.value.status) == ("io", 2)
    assert "missing.gguf" in str(failed.value) and "exit status 2" in str(failed.value)

    command, _ = fake_engine(tmp_path, ("write", b"STAT 0 0.00 0.0 0.1\n"), ("exit", 5))
    with trio.fail_after(TIMEOUT):
        with pytest.raises(EngineStartError, match="status 5 before READY") as failed:
            async with MuxEngine(command):
                pass
    assert failed.value.status == 5


async def test_slot_choice_and_requests_that_wait_for_a_slot():
    with trio.fail_after(TIMEOUT):
        async with MuxEngine(MUX_COMMAND, env=LLAMA, kv_slots=2, queue_limit=1) as engine:
            assert engine.name == "llama"
            once = await engine.complete("Once upon a time", max_tokens=6)
            other = await engine.complete("Zebras are", max_tokens=6)
            again = await engine.complete("Once upon a time" + once.text + " again", max_tokens=6)
            assert (once.stats.slot, other.stats.slot) == (0, 1)  # nothing shared: least recently used
            assert again.stats.slot == 0 and again.stats.reused_tokens > 0  # the longest shared prefix
            assert once.token_ids == ()

            async with trio.open_nursery() as nursery:
                rids = [await nursery.start(hold, engine, f"busy {i}") for i in range(2)]
                async with engine.stream("waits for a slot", max_tokens=4) as waiting:
                    assert engine.statistics() == EngineStatistics(2, 1, 2, False)
                    with pytest.raises(QueueFull):
                        await engine.complete("one too many")
                    with pytest.raises(NotFound):
                        await engine.stop(waiting.request_id)  # waiting, not running
                    await engine.cancel(waiting.request_id)  # never sent: it ends here
                    (finish,) = [event async for event in waiting]
                for rid in rids:
                    await engine.cancel(rid)
    assert finish.stats.finish_reason == "cancelled"
    assert (finish.stats.slot, finish.stats.emitted_tokens) == (-1, 0)


async def hold(engine, prompt, *, task_status=trio.TASK_STATUS_IGNORED):
    """A long request on a slot of its own, until cancelled."""
    async with engine.stream(prompt, max_tokens=200) as events:
        task_status.started(events.request_id)
        async for event in events:
            if isinstance(event, FinishEvent):
                assert event.stats.finish_reason == "cancelled"
