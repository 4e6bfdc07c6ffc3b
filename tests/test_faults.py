"""Faults, on the real server: what clients see when something under them breaks.

- A mux engine behind `motet serve --engine-cmd` killed mid-stream: a streaming client
  gets an in-band error frame and its stream ends, a non-streaming one a 503 JSON error,
  a request queued for a slot a 503 too (none hangs); the child is started again and the
  next request succeeds. (The restart alone: test_http.py's
  test_a_mux_engine_behind_the_server_is_started_again_when_it_dies.)
- The model's files disappearing after start: an engine already loaded keeps serving; a
  mux child that must start again without them is reported on /health (503, the reason)
  and requests get a 503 at once, until the files are back.
- A session file truncated or corrupted on disk is refused with its reason: covered byte
  by byte in test_session_file.py (test_truncation_anywhere_is_refused,
  test_a_flipped_byte_anywhere_is_refused, test_truncation_of_larger_files_is_refused,
  test_a_flipped_byte_in_the_layer_data_is_refused_naming_the_layer), and fuzzed in
  test_fuzz.py. Not here yet: restoring a slot from one (KVSAVE) and prefill workers do
  not exist, so neither do their faults (a save interrupted, a worker dying mid-transfer).
- A full disk when `motet mux` persists a slot (KVSAVE=1): every turn still answers, each
  failed write is logged and counted (`KVSAVE_FAIL <slot> <failures so far>` before the
  turn's DONE), and no partial file is left.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys

import httpx
import pytest
import trio
from conftest import GOLDEN, REPO
from http_helpers import HELLO, TIMEOUT, mux_server, tiny_server, wait_until
from test_mux_sessions import LLAMA, submit

from motet.engines.mux_engine import MuxEngine
from motet.model import load_model
from motet.protocol import mux
from motet.runtime.errors import BadRequest

MUX = {"kv_slots": 2, "max_context": 256}
LONG = {"model": "m", "messages": HELLO, "max_tokens": 240, "temperature": 0}


async def sse_events(lines):
    """The data of each server-sent event: JSON objects, and the final "[DONE]"."""
    async for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


async def test_a_mux_engine_killed_mid_stream_fails_every_waiting_client_cleanly():
    async with mux_server(GOLDEN / "llama", MUX) as (engine, url):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
            answers = {}

            async def ask(name, body):
                answers[name] = await http.post("/v1/chat/completions", json=body)

            async with http.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as stream:
                events = sse_events(stream.aiter_lines())
                async for event in events:  # the role chunk, then tokens: wait for one
                    if event["choices"][0]["delta"].get("content"):
                        break
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(ask, "running", LONG)  # the second slot
                    await wait_until(lambda: engine.statistics().running == 2)
                    nursery.start_soon(ask, "queued", {**LONG, "messages": [{"role": "user", "content": "x"}]})
                    await wait_until(lambda: engine.statistics().waiting == 1)
                    engine.current.process.kill()  # the child dies mid-answer
                    rest = [event async for event in events]  # it ends: a hang fails the timeout
            assert stream.status_code == 200
            *tokens, error = rest
            assert "[DONE]" not in rest and all("choices" in t for t in tokens)
            assert error["error"]["type"] == "server_error" and error["error"]["code"] == "engine_exited"
            for name in ("running", "queued"):
                response = answers[name]
                assert response.status_code == 503, (name, response.text)
                assert response.json()["error"]["code"] == "engine_exited"
                assert response.headers["Retry-After"] == "1"
            await wait_until(lambda: engine.current is not None and not engine.statistics().closing)
            again = await http.post("/v1/chat/completions", json={**LONG, "max_tokens": 3})
    assert again.status_code == 200 and again.json()["choices"][0]["finish_reason"] == "length"
    assert engine.restarts == 1


async def test_a_loaded_engine_keeps_serving_when_its_model_files_are_gone(tmp_path):
    model_dir = tmp_path / "llama"
    shutil.copytree(GOLDEN / "llama", model_dir)
    model = load_model(model_dir)  # as `motet serve --model` loads it, before serving
    engine_kw = {"kv_slots": 2, "max_context": 256, "prefill_chunk": 16, "prefill_chunk_alone": 16}
    async with tiny_server(model, engine_kw) as (engine, url), httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
        shutil.rmtree(model_dir)
        chat = await http.post("/v1/chat/completions", json={**LONG, "max_tokens": 4})
        streamed = await http.post("/v1/completions", json={
            "model": "m", "prompt": "a new conversation", "max_tokens": 4, "stream": True})
        health = await http.get("/health")
        direct = await engine.complete("and the engine itself", max_tokens=3)
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 4
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    assert health.status_code == 200 and direct.stats.emitted_tokens == 3


async def test_a_mux_child_that_cannot_start_again_is_reported_and_requests_get_503(tmp_path):
    model_dir, away = tmp_path / "llama", tmp_path / "moved"
    shutil.copytree(GOLDEN / "llama", model_dir)
    async with mux_server(model_dir, MUX) as (engine, url):
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
            before = await http.post("/v1/chat/completions", json={**LONG, "max_tokens": 2})
            model_dir.rename(away)  # the model's files are gone
            engine.current.process.kill()  # and the child must start again
            await wait_until(lambda: engine.start_error is not None, poll_s=0.05)
            health = await http.get("/health")
            with trio.fail_after(10):  # at once, not a hang
                chat = await http.post("/v1/chat/completions", json={**LONG, "max_tokens": 2})
                completion = await http.post("/v1/completions", json={"model": "m", "prompt": "hi"})
                stream = await http.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": True})
            away.rename(model_dir)  # the files are back: the next start works
            await wait_until(lambda: engine.current is not None, poll_s=0.05)
            after = await http.post("/v1/chat/completions", json={**LONG, "max_tokens": 2})
            healthy = await http.get("/health")
    assert before.status_code == 200 and after.status_code == 200 and healthy.status_code == 200
    assert health.status_code == 503 and health.json()["status"] == "error"
    reason = health.json()["reason"]
    assert reason.startswith("the engine cannot start: ") and "could not load its model" in reason
    for response in (chat, completion, stream):
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["code"] == "engine_unavailable" and "could not load its model" in error["message"]
        assert response.headers["Retry-After"] == "1"


async def test_what_the_mux_wire_cannot_carry_is_refused_at_entry():
    # Not by the child at the request's first event, which for a request that waited for
    # a slot would come inside a 200 stream (the soak met a NUL the tiny model had written).
    engine = MuxEngine(["motet", "mux"])  # not started: these are refused before the wire
    for prompt, reason in (("a\x00b", "NUL"), ("a\ud800", "lone surrogate")):
        with pytest.raises(BadRequest, match=reason):
            async with engine.stream(prompt, max_tokens=1):
                pass


def test_kvsave_fail_is_an_extension_line_other_servers_skip():
    line = mux.encode_kvsave_fail(mux.KvSaveFail(3, 7))
    assert line == b"KVSAVE_FAIL 3 7\n"
    assert mux.ExtendedResponseDecoder().feed(line) == [mux.KvSaveFail(3, 7)]
    assert mux.ResponseDecoder().feed(line) == []  # an unknown kind: skipped
    bad = mux.ExtendedResponseDecoder().feed(b"KVSAVE_FAIL 3\nKVSAVE_FAIL -1 2\nKVSAVE_FAIL 1 x\n")
    assert [type(e) for e in bad] == [mux.BadLine] * 3


@pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="needs prlimit (Linux)")
async def test_a_full_disk_when_persisting_is_counted_and_every_turn_still_answers(tmp_path):
    # RLIMIT_FSIZE stands in for a full disk: a write past it fails with EFBIG (CPython
    # ignores SIGXFSZ). A slot file of the tiny llama is well past 2 KiB. No compilation
    # cache (it writes large files), and stderr a pipe (a file would meet the limit too).
    # The limit is set with prlimit once the child runs (before READY, so before any slot
    # write), not with a preexec_fn, which would fork this multithreaded (JAX) process.
    # Without a cache, the warm-up is off too: it would compile every shape of the child.
    kv = tmp_path / "kv"
    command = (sys.executable, "-m", "motet", "mux", "--compile-cache", "", "--no-warm-up")
    stderr = bytearray()
    with trio.fail_after(TIMEOUT):
        process = await trio.lowlevel.open_process(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, **LLAMA, "KVSAVE": "1", "KVSAVE_DIR": str(kv)}, cwd=REPO,
        )
        decoder, events = mux.ExtendedResponseDecoder(), []

        async def until(done):
            while not done():
                data = await process.stdout.receive_some(65536)
                assert data, "the engine closed its stdout"
                events.extend(decoder.feed(data))

        async def drain_stderr():
            while data := await process.stderr.receive_some(65536):
                stderr.extend(data)

        try:
            resource.prlimit(process.pid, resource.RLIMIT_FSIZE, (2048, 2048))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(drain_stderr)
                await until(lambda: mux.Ready() in events)
                for rid, slot in ((1, 0), (2, 1)):  # the second turn is answered too
                    await process.stdin.send_all(submit(rid, slot))
                    await until(lambda: any(isinstance(e, mux.Done) and e.request_id == rid for e in events))
                await process.stdin.aclose()  # EOF: the engine exits
                while data := await process.stdout.receive_some(65536):
                    events.extend(decoder.feed(data))
                assert await process.wait() == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    for rid, slot, failures in ((1, 0, 1), (2, 1, 2)):
        done = next(i for i, e in enumerate(events) if isinstance(e, mux.Done) and e.request_id == rid)
        assert any(isinstance(e, mux.Data) and e.request_id == rid for e in events[:done])
        assert mux.KvSaveFail(slot, failures) in events[:done]  # counted, before the DONE
    assert sum(isinstance(e, mux.KvSaveFail) for e in events) == 2
    assert [p for p in kv.rglob("*") if not p.is_dir()] == []  # no partial file left
    log = stderr.decode(errors="replace")
    assert "KVSAVE: slot 0 not saved" in log and "File too large" in log
