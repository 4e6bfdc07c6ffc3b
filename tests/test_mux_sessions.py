"""Sessions over the mux protocol (issue 7): SAVE / RESTORE / ERASE / PREFILL on a real
`motet mux` child, KVSAVE persistence across restarts and at CANCEL, and MuxEngine's slot
methods. The children run the tiny golden llama, so each start takes seconds."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing
from conftest import GOLDEN, MUX_COMMAND, REPO

from motet.actors.stdio_bridge import safe_name
from motet.engines.mux_engine import EngineExited, MuxEngine
from motet.engines.sessions import model_fingerprint, session_header
from motet.protocol import mux
from motet.protocol.session_file import SessionError, read_session, write_session
from motet.runtime.errors import BadRequest, SlotBusy

TIMEOUT = 180  # seconds, per test
CTX = 256
LLAMA = {"SNAP": str(GOLDEN / "llama"), "SERVE": "1", "SERVE_BATCH": "1", "KV_SLOTS": "3", "CTX": str(CTX)}
PROMPT = b"<|im_start|>user\nTell me about the sea.<|im_end|>\n<|im_start|>assistant\n"
OTHER = b"<|im_start|>user\nWhat do zebras eat?<|im_end|>\n<|im_start|>assistant\n"


def submit(rid: int, slot: int, prompt: bytes = PROMPT, max_tokens: int = 8) -> bytes:
    return mux.encode_submit(mux.Submit(rid, slot, max_tokens, 0.0, 1.0, prompt))


class Child:
    """A `motet mux` child: requests written to its stdin, its stdout read as protocol
    (with motet's extension lines), its stderr kept in a file."""

    def __init__(self, process: trio.Process, stderr_path):
        self.process = process
        self.stderr_path = stderr_path
        self.decoder = mux.ExtendedResponseDecoder()
        self.events: list = []

    async def send(self, data: bytes) -> None:
        await self.process.stdin.send_all(data)

    async def until(self, done) -> list:
        while not done(self.events):
            data = await self.process.stdout.receive_some(65536)
            assert data, "the engine closed its stdout"
            self.events += self.decoder.feed(data)
        return self.events

    async def answer(self, rid: int):
        """The request's last line: DONE, an ERROR, or a slot command's reply."""
        finals = (mux.Done, mux.Error, mux.SessionRefused, mux.Saved, mux.Restored, mux.Erased, mux.Prefilled)
        await self.until(lambda events: last(events, rid, finals))
        return last(self.events, rid, finals)

    async def close(self) -> int:
        """Close stdin (EOF: the engine exits) and read what is left."""
        await self.process.stdin.aclose()
        while data := await self.process.stdout.receive_some(65536):
            self.events += self.decoder.feed(data)
        return await self.process.wait()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


def last(events, rid: int, kinds):
    found = [e for e in events if isinstance(e, kinds) and e.request_id == rid]
    return found[-1] if found else None


@asynccontextmanager
async def child(tmp_path, name: str = "child", flags: tuple[str, ...] = (), **env):
    stderr_path = tmp_path / f"{name}.stderr"
    with open(stderr_path, "wb") as stderr:
        process = await trio.lowlevel.open_process(
            [*MUX_COMMAND, *flags], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
            env={**os.environ, **LLAMA, **env}, cwd=REPO,
        )
    try:
        c = Child(process, stderr_path)
        await c.until(lambda events: mux.Ready() in events)
        yield c
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def text_of(events, rid: int) -> bytes:
    return b"".join(e.data for e in events if isinstance(e, mux.Data) and e.request_id == rid)


def turn_of(events, rid: int) -> mux.Turn:
    (turn,) = [e for e in events if isinstance(e, mux.Turn) and e.request_id == rid]
    return turn


@pytest.fixture
def header(tiny_model):
    """What the child's session files must match (its model, CTX, backend)."""
    return session_header(tiny_model("llama"), CTX)


@pytest.fixture
def model_dir(tiny_model):
    """The folder under KVSAVE_DIR where the child keeps the llama's slot files."""
    return safe_name(model_fingerprint(tiny_model("llama")))


# ---- SAVE / RESTORE / ERASE over the wire ------------------------------------------------


async def test_save_then_restore_into_another_slot_answers_as_if_it_never_left(tmp_path, header):
    path = tmp_path / "sea.session"
    with trio.fail_after(TIMEOUT):
        # no prefix sharing: a fresh slot reads the prompt itself, not a copy of slot 0's
        async with child(tmp_path, flags=("--no-share-prefixes",)) as c:
            await c.send(submit(1, 0))
            assert isinstance(await c.answer(1), mux.Done)
            turn2 = PROMPT + text_of(c.events, 1) + b"<|im_end|>\n<|im_start|>user\nAnd rivers?<|im_end|>\n"
            await c.send(mux.encode_save(mux.Save(2, 0, str(path))))
            saved = await c.answer(2)
            await c.send(mux.encode_restore(mux.Restore(3, 1, str(path))))
            restored = await c.answer(3)
            # The copy, the original and a fresh slot, one at a time (a batch may round otherwise).
            for rid, slot in ((4, 1), (5, 0), (7, 2)):
                await c.send(submit(rid, slot, turn2))
                await c.answer(rid)
            await c.send(mux.encode_erase(mux.Erase(6, 1)))
            erased = await c.answer(6)
            await c.send(submit(8, 1, turn2))
            await c.answer(8)
            assert await c.close() == 0
    assert saved == mux.Saved(2, 0, saved.tokens, path.stat().st_size, saved.ms) and saved.tokens > 0
    assert len(read_session(path, header).tokens) == saved.tokens
    assert restored == mux.Restored(3, 1, saved.tokens, saved.bytes, restored.ms)
    copy, original, fresh = turn_of(c.events, 4), turn_of(c.events, 5), turn_of(c.events, 7)
    assert copy.reused_tokens == original.reused_tokens > 0 and fresh.reused_tokens == 0
    assert text_of(c.events, 4) == text_of(c.events, 5) == text_of(c.events, 7)  # greedy: the same answer
    assert erased.slot == 1 and erased.tokens > copy.reused_tokens  # the restored KV and turn 4's
    assert turn_of(c.events, 8).reused_tokens == 0  # erased: nothing left to reuse
    assert not [e for e in c.events if isinstance(e, mux.BadLine)]


async def test_a_damaged_or_foreign_file_is_refused_with_the_reason_and_the_slot_keeps_its_kv(
        tmp_path, header):
    good = tmp_path / "good.session"
    with trio.fail_after(TIMEOUT):
        async with child(tmp_path) as c:
            await c.send(submit(1, 0) + submit(2, 1, OTHER))
            await c.answer(1), await c.answer(2)
            await c.send(mux.encode_save(mux.Save(3, 0, str(good))))
            await c.answer(3)

            session = read_session(good, header)
            data = good.read_bytes()
            files = {"truncated": data[:-7], "checksum": data[:-5] + bytes([data[-5] ^ 0x40]) + data[-4:]}
            for name, changed in (("model", dataclasses.replace(header, model="another-model:0123")),
                                  ("max_context", dataclasses.replace(header, max_context=2 * CTX))):
                write_session(tmp_path / f"{name}.session", changed, session.tokens, session.layers)
            for name, content in files.items():
                (tmp_path / f"{name}.session").write_bytes(content)

            reasons = {}
            for rid, name in enumerate(("truncated", "checksum", "model", "max_context"), start=10):
                await c.send(mux.encode_restore(mux.Restore(rid, 1, str(tmp_path / f"{name}.session"))))
                refused = await c.answer(rid)
                assert isinstance(refused, mux.SessionRefused), refused
                reasons[name] = refused.reason
            await c.send(mux.encode_restore(mux.Restore(20, 1, str(tmp_path / "missing.session")))
                         + mux.encode_save(mux.Save(21, 0, str(tmp_path / "no" / "such" / "dir.session")))
                         + mux.encode_erase(mux.Erase(22, 7)))
            other_errors = [await c.answer(rid) for rid in (20, 21, 22)]
            turn2 = OTHER + text_of(c.events, 2) + b"<|im_end|>\n"
            await c.send(submit(30, 1, turn2))
            await c.answer(30)
            assert await c.close() == 0
    assert reasons["truncated"].startswith("truncated: the file ends inside")
    assert "the checksum says" in reasons["checksum"]
    assert reasons["model"].startswith("the session does not match this engine: model: expected")
    assert "max_context: expected 256, found 512" in reasons["max_context"]
    assert other_errors == [mux.Error(rid, "BAD_REQUEST") for rid in (20, 21, 22)]
    assert "missing.session" in c.stderr() and "dir.session" in c.stderr()  # the OSErrors, said on stderr
    assert turn_of(c.events, 30).reused_tokens > 0  # slot 1 kept its own conversation


async def test_a_slot_in_use_is_busy_and_ids_in_flight_are_duplicates(tmp_path):
    with trio.fail_after(TIMEOUT):
        async with child(tmp_path) as c:
            await c.send(submit(1, 0, max_tokens=200))
            await c.until(lambda events: text_of(events, 1))  # decoding on slot 0
            await c.send(mux.encode_save(mux.Save(2, 0, str(tmp_path / "busy.session")))
                         + mux.encode_erase(mux.Erase(1, 2))  # id 1 is in flight
                         + mux.encode_prefill(mux.Prefill(3, 0, PROMPT))
                         + mux.encode_prefill(mux.Prefill(4, 1, PROMPT)))
            answers = [await c.answer(rid) for rid in (2, 3, 4)]
            duplicate = last(c.events, 1, mux.Error)
            await c.send(submit(5, 1, PROMPT))  # continues what PREFILL read
            await c.send(mux.encode_cancel(1))
            await c.answer(5), await c.answer(1)
            assert await c.close() == 0
    assert answers[:2] == [mux.Error(2, "SLOT_BUSY"), mux.Error(3, "SLOT_BUSY")]
    assert duplicate == mux.Error(1, "DUPLICATE_ID")
    prefilled = answers[2]
    # slot 1 was empty, but busy slot 0 holds the same prompt: its KV is copied, none read
    assert isinstance(prefilled, mux.Prefilled) and (prefilled.slot, prefilled.reused) == (1, prefilled.tokens)
    assert prefilled.tokens > 0
    assert turn_of(c.events, 5).reused_tokens == prefilled.tokens  # all but the last token, kept
    assert not os.path.exists(tmp_path / "busy.session")


# ---- KVSAVE: persistence ----------------------------------------------------------------


async def test_a_conversation_persists_across_a_restart(tmp_path, model_dir, header):
    kv = {"KVSAVE": "1", "KVSAVE_DIR": str(tmp_path / "kv")}
    slot_file = tmp_path / "kv" / model_dir / "slot-0.session"
    with trio.fail_after(TIMEOUT):
        async with child(tmp_path, "first", **kv) as c:
            await c.send(submit(1, 0))
            await c.answer(1)
            assert len(read_session(slot_file, header).tokens) > 0  # written before DONE
            assert await c.close() == 0
        turn2 = PROMPT + text_of(c.events, 1) + b"<|im_end|>\n<|im_start|>user\nAnd rivers?<|im_end|>\n"
        async with child(tmp_path, "second", **kv) as again:
            await again.send(submit(2, 0, turn2))
            await again.answer(2)
            assert await again.close() == 0
    assert turn_of(again.events, 2).reused_tokens > 0  # no RESTORE: the slot came back at start
    assert "slot 0 restored" in again.stderr()
    assert oct(slot_file.stat().st_mode & 0o777) == "0o600"


async def test_cancel_persists_the_slot_before_acknowledging(tmp_path, model_dir, header, tiny_model):
    kv = {"KVSAVE": "1", "KVSAVE_DIR": str(tmp_path / "kv")}
    slot_file = tmp_path / "kv" / model_dir / "slot-1.session"
    with trio.fail_after(TIMEOUT):
        async with child(tmp_path, **kv) as c:
            await c.send(submit(1, 1, max_tokens=200))
            await c.until(lambda events: len([e for e in events if isinstance(e, mux.Data)]) >= 3)
            await c.send(mux.encode_cancel(1))
            assert await c.answer(1) == mux.Error(1, "CANCELLED")
            tokens = read_session(slot_file, header).tokens  # read as soon as CANCELLED is
            assert await c.close() == 0
    prompt_ids = tuple(tiny_model("llama").tokenizer.encode(PROMPT.decode(), add_special=True))
    assert tokens[: len(prompt_ids)] == prompt_ids
    assert len(tokens) > len(prompt_ids)  # and some of the cancelled answer


async def test_a_truncated_slot_file_at_start_is_refused_with_a_warning(tmp_path, model_dir):
    folder = tmp_path / "kv" / model_dir
    folder.mkdir(parents=True)
    (folder / "slot-0.session").write_bytes(b"motet session\n\x01\x00\x00\x00\x40")
    with trio.fail_after(TIMEOUT):
        async with child(tmp_path, KVSAVE="1", KVSAVE_DIR=str(tmp_path / "kv")) as c:  # READY all the same
            await c.send(submit(1, 0))
            assert isinstance(await c.answer(1), mux.Done)
            assert await c.close() == 0
    assert turn_of(c.events, 1).reused_tokens == 0
    assert "slot 0 starts empty" in c.stderr() and "truncated" in c.stderr()


async def test_kvsave_0_writes_nothing(tmp_path):
    with trio.fail_after(TIMEOUT):
        async with child(tmp_path, KVSAVE="0", KVSAVE_DIR=str(tmp_path / "kv")) as c:
            await c.send(submit(1, 0))
            await c.answer(1)
            assert await c.close() == 0
    assert not (tmp_path / "kv").exists()


# ---- MuxEngine's slot methods -------------------------------------------------------------


async def test_mux_engine_saves_restores_erases_and_prefills(tmp_path):
    path = tmp_path / "once.session"
    env = {"SNAP": str(GOLDEN / "llama"), "CTX": str(CTX)}
    with trio.fail_after(TIMEOUT):
        async with MuxEngine(MUX_COMMAND, env=env, kv_slots=3) as engine:
            once = await engine.complete("Once upon a time", max_tokens=6, slot=0)
            saved = await engine.save_slot(0, path)
            assert (saved.slot, saved.bytes) == (0, path.stat().st_size) and saved.tokens > 0
            restored = await engine.restore_slot(1, path)
            assert (restored.slot, restored.tokens) == (1, saved.tokens)
            assert engine._slots.histories[1] == ""  # its text is unknown here: no prefix to offer
            again = await engine.complete("Once upon a time" + once.text + " again", max_tokens=4, slot=1)
            assert again.stats.reused_tokens > 0
            assert await engine.erase_slot(1) > saved.tokens

            stats = await engine.prefill("Zebras are", slot=2)
            assert (stats.finish_reason, stats.slot, stats.reused_tokens, stats.emitted_tokens) == (
                "prefilled", 2, 0, 0)
            twice = await engine.prefill("Zebras are", slot=2)
            assert twice.reused_tokens == stats.prompt_tokens - 1
            auto = await engine.complete("Zebras are", max_tokens=2)  # the slot choice sees the prefill
            assert (auto.stats.slot, auto.stats.reused_tokens) == (2, stats.prompt_tokens - 1)

            path.write_bytes(path.read_bytes()[:-3])
            with pytest.raises(SessionError, match="^truncated: the file ends inside layer"):
                await engine.restore_slot(0, path)
            with pytest.raises(BadRequest):
                await engine.restore_slot(0, tmp_path / "missing.session")
            with pytest.raises(BadRequest):
                await engine.save_slot(3, path)  # out of range: refused here
            async with engine.stream("A long story", max_tokens=200, slot=0) as events:
                await events.__anext__()
                with pytest.raises(SlotBusy):
                    await engine.save_slot(0, tmp_path / "busy.session")
            engine.process.kill()
            await engine._exited.wait()
            with pytest.raises(EngineExited):
                await engine.erase_slot(0)


async def test_mux_engine_never_picks_a_slot_a_command_uses(tmp_path):
    from test_mux_engine import HANDSHAKE, done, fake_engine, token

    refusal = b"ERROR 3 SESSION_REFUSED the session does not match this engine: model: expected 'a', found 'b'\n"
    replies = (mux.encode_saved(mux.Saved(1, 0, 12, 3456, 7.5)) + token(2, b"Hi") + done(2, 1, 3, True)
               + refusal)
    # It reads SAVE and its path, SUBMIT, RESTORE and its path; then it answers.
    command, received = fake_engine(tmp_path, ("write", HANDSHAKE), ("read", 5), ("write", replies))
    with trio.fail_after(TIMEOUT):
        async with MuxEngine(command, kv_slots=2) as engine:
            async with trio.open_nursery() as nursery:
                saves = []

                async def save():
                    saves.append(await engine.save_slot(0, "/sessions/é.session"))

                nursery.start_soon(save)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(engine.complete, "hello")  # slot 0 is the LRU choice, but in use
                await trio.testing.wait_all_tasks_blocked()
                with pytest.raises(SessionError) as refused:
                    await engine.restore_slot(1, "x.session")
    assert refused.value.args[0] == "the session does not match this engine: model: expected 'a', found 'b'"
    assert [(s.slot, s.tokens, s.bytes, s.ms) for s in saves] == [(0, 12, 3456, 7.5)]
    lines = received.read_bytes().decode().splitlines()
    assert lines[:2] == [f"SAVE 1 0 {len('/sessions/é.session'.encode())}", "/sessions/é.session"]
    assert lines[2].startswith("SUBMIT 2 1 ")  # slot 1
    assert lines[3:5] == ["RESTORE 3 1 9", "x.session"]
