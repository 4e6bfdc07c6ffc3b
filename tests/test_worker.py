"""`motet worker` over the TCP wire: real worker processes on loopback, serving the tiny
llama. A decode + prefill pair answers exactly as a mono worker does (greedy), also for
several requests at once; a handover that fails in any way (no peer, a peer killed, a
connection cut mid-transfer, a flipped byte, refused facts) is no error for the client:
the decode worker reads the prompt itself (fallback=1) and still answers right; malformed
requests get K_ERROR with the codec's exact sentence, and the worker serves on."""

from __future__ import annotations

import itertools
import re
import signal
import struct
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import trio
from conftest import COMPILE_CACHE, GOLDEN, REPO

from motet.protocol import wire
from motet.protocol.wire import K_DECODE, K_ERROR, K_FIRST, K_GEN, K_LAYER, K_PREFILL, K_RESULT, Frame, Msg
from motet.runtime.addresses import format_address, parse_address
from motet.wire.frame_io import FrameStream, connect, request

TIMEOUT = 120
START_S = 240  # a worker's start, compiling on a cold cache
PROMPT = "Once upon a time, in a land far away"
PROMPTS = ("the sea", "Hello, world", "a b c d e f g", "1 2 3 4 5 6 7 8 9 10", "The quick brown fox", "why?")


@dataclass
class Worker:
    process: subprocess.Popen
    log: Path
    address: str = ""


def start_worker(log: Path, role: str, *flags: str) -> Worker:
    command = [sys.executable, "-m", "motet", "worker", "--role", role, "--listen", "127.0.0.1:0",
               "--model", str(GOLDEN / "llama"), "--max-context", "256", "--compile-cache", str(COMPILE_CACHE),
               *flags]
    with open(log, "wb") as err:
        process = subprocess.Popen(command, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=err)
    return Worker(process, log)


def wait_listening(worker: Worker) -> Worker:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        found = re.search(r"^listening on (\S+)$", worker.log.read_text(errors="replace"), re.M)
        if found:
            worker.address = found[1]
            return worker
        if worker.process.poll() is not None:
            pytest.fail(f"the worker exited with {worker.process.returncode}:\n{worker.log.read_text()}")
        time.sleep(0.05)
    pytest.fail(f"the worker did not listen within {START_S} s:\n{worker.log.read_text()}")


def stop(worker: Worker) -> None:
    if worker.process.poll() is None:
        worker.process.send_signal(signal.SIGTERM)
        try:
            worker.process.wait(30)
        except subprocess.TimeoutExpired:
            worker.process.kill()
            worker.process.wait()


@dataclass
class Workers:
    mono: Worker
    prefill: Worker
    decode: Worker


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("workers")
    started = []
    try:
        mono = start_worker(logs / "mono.log", "mono")
        started.append(mono)
        prefill = start_worker(logs / "prefill.log", "prefill")
        started.append(prefill)
        wait_listening(prefill)
        decode = start_worker(logs / "decode.log", "decode", "--prefill", prefill.address, "--kv-slots", "4")
        started.append(decode)
        yield Workers(wait_listening(mono), prefill, wait_listening(decode))
    finally:
        for worker in started:
            stop(worker)


@pytest.fixture
def spare_prefill(tmp_path):
    """A prefill worker of its own, for a test to kill."""
    worker = start_worker(tmp_path / "spare.log", "prefill")
    try:
        yield wait_listening(worker)
    finally:
        stop(worker)


async def ask(address: str, kind: int, prompt: str, **fields) -> Msg:
    """A request that must be answered K_RESULT."""
    answer_kind, answer = await request(address, kind, Msg(fields, prompt), wait=TIMEOUT)
    assert answer_kind == K_RESULT, answer
    return answer


def free_port_address() -> str:
    """An address where nothing listens (a port just freed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return format_address("127.0.0.1", s.getsockname()[1])


# ---- answers --------------------------------------------------------------------------


async def test_decode_and_prefill_answer_exactly_as_mono(workers):
    with trio.fail_after(TIMEOUT):
        mono = await ask(workers.mono.address, K_GEN, PROMPT, max_tokens=24)
        split = await ask(workers.decode.address, K_DECODE, PROMPT, max_tokens=24)
        once = await ask(workers.decode.address, K_DECODE, PROMPT, max_tokens=1)
        mono_once = await ask(workers.mono.address, K_GEN, PROMPT, max_tokens=1)
    assert mono.body and split.body == mono.body
    assert split.get("tokens") == mono.get("tokens") == "24" and split.get("finish") == mono.get("finish")
    assert split.get("fallback") == "0" and "reason" not in dict(split.fields)
    n = split.number("prompt_tokens")
    assert split.number("reused") == n  # the prompt's KV came over the wire, none recomputed
    assert split.number("bytes") == 2 * (16 + 2 * n * 2 * 16 * 4)  # 2 layers: head + K + V, f32
    for key in ("prefill_ms", "transfer_ms", "ms"):
        split.number(key)
    assert once.body == mono_once.body and once.get("tokens") == "1" and once.get("finish") == "length"


async def test_the_engines_sampling_keys_reach_it_on_mono_and_split_workers(workers):
    """top_k, min_p, the penalties, logit_bias and stop_token_ids reach the engine. Split
    answers as mono for a greedy request with a repetition penalty and a bias (a
    sampled one draws its continuation with keys of its own, and the decode side counts
    the first token as the prompt's for presence and frequency)."""
    keys = {"temperature": "0.8", "seed": "3", "top_k": "5", "min_p": "0.05", "presence_penalty": "0.5",
            "frequency_penalty": "0.25", "repetition_penalty": "1.3"}
    greedy = {"repetition_penalty": "1.5", "logit_bias": "9:-100,11:3.5"}
    with trio.fail_after(TIMEOUT):
        plain = await ask(workers.mono.address, K_GEN, PROMPT, max_tokens=8, temperature="0.8", seed="3")
        mono = await ask(workers.mono.address, K_GEN, PROMPT, max_tokens=8, **keys)
        unpenalized = await ask(workers.mono.address, K_GEN, PROMPT, max_tokens=12)
        penalized = await ask(workers.mono.address, K_GEN, PROMPT, max_tokens=12, **greedy)
        split = await ask(workers.decode.address, K_DECODE, PROMPT, max_tokens=12, **greedy)
        forced = await ask(workers.mono.address, K_GEN, PROMPT, max_tokens=3, logit_bias="7:100")
        stopped = await ask(workers.mono.address, K_GEN, PROMPT, max_tokens=3, logit_bias="7:100", stop_token_ids="7")
    assert mono.body != plain.body  # the keys changed what was drawn
    assert penalized.body != unpenalized.body
    assert split.body == penalized.body and split.get("fallback") == "0"
    assert forced.get("tokens") == "3" and (forced.get("finish"), stopped.get("finish")) == ("length", "stop")
    assert stopped.get("tokens") == "0"  # token 7 first, and it ends the turn


async def test_several_decode_requests_at_once_each_answer_right(workers):
    results = {}

    async def one(name, address, kind, prompt):
        results[name, prompt] = await ask(address, kind, prompt, max_tokens=16)

    with trio.fail_after(TIMEOUT):
        for prompt in PROMPTS:
            await one("mono", workers.mono.address, K_GEN, prompt)
        async with trio.open_nursery() as nursery:  # six requests, four slots
            for prompt in PROMPTS:
                nursery.start_soon(one, "split", workers.decode.address, K_DECODE, prompt)
    for prompt in PROMPTS:
        split, mono = results["split", prompt], results["mono", prompt]
        assert (split.body, split.get("tokens"), split.get("fallback")) == (mono.body, mono.get("tokens"), "0")


async def test_a_turn_that_ends_at_its_first_token_moves_no_kv(workers):
    with trio.fail_after(TIMEOUT):
        # near-uniform sampling: find a seed whose first token ends the turn (405 did when written)
        for seed in itertools.chain([405], range(3000)):
            mono = await ask(workers.mono.address, K_GEN, "hi", max_tokens=4, temperature=100, seed=seed)
            if mono.get("finish") == "stop" and mono.get("tokens") == "0":
                break
        split = await ask(workers.decode.address, K_DECODE, "hi", max_tokens=4, temperature=100, seed=seed)
    assert (split.body, split.get("tokens"), split.get("finish")) == ("", "0", "stop")
    assert split.get("fallback") == "0" and split.get("bytes") == "0"


async def test_the_prefill_worker_streams_each_layer_then_first(workers):
    with trio.fail_after(TIMEOUT):
        async with connect(workers.prefill.address) as frames:
            await frames.send_msg(K_PREFILL, Msg({"temperature": "0"}, PROMPT))
            layers = [wire.decode_layer((await frames.receive()).payload) for _ in range(2)]
            first = await frames.receive()
        mono = await ask(workers.mono.address, K_GEN, PROMPT, max_tokens=1)
    assert first.kind == K_FIRST
    msg = wire.decode_msg(first.payload)
    n = msg.number("tokens")
    assert [(layer.layer, layer.rows, len(layer.data)) for layer in layers] == [(i, n, 2 * n * 2 * 16 * 4) for i in (0, 1)]
    assert (msg.get("dtype"), msg.get("layers"), msg.get("kv_heads"), msg.get("head_dim")) == ("float32", "2", "2", "16")
    assert msg.get("model").startswith("llama:") and msg.get("kv_layout") == "tokens,kv_heads,head_dim"
    assert msg.number("bytes") == sum(16 + len(layer.data) for layer in layers)
    assert msg.number("first") >= 0 and mono.get("tokens") == "1"


# ---- fallback -------------------------------------------------------------------------


async def test_no_prefill_worker_listening_means_fallback(workers):
    with trio.fail_after(TIMEOUT):
        mono = await ask(workers.mono.address, K_GEN, PROMPT, max_tokens=12)
        split = await ask(workers.decode.address, K_DECODE, PROMPT, max_tokens=12, prefill=free_port_address())
    assert split.get("fallback") == "1" and "connect to" in split.get("reason")
    assert split.body == mono.body and split.get("tokens") == mono.get("tokens")


async def test_a_killed_prefill_worker_means_fallback(workers, spare_prefill):
    with trio.fail_after(TIMEOUT):
        mono = await ask(workers.mono.address, K_GEN, PROMPT, max_tokens=12)
        before = await ask(workers.decode.address, K_DECODE, PROMPT, max_tokens=12, prefill=spare_prefill.address)
        spare_prefill.process.kill()
        await trio.to_thread.run_sync(spare_prefill.process.wait)
        after = await ask(workers.decode.address, K_DECODE, PROMPT, max_tokens=12, prefill=spare_prefill.address)
    assert before.get("fallback") == "0" and after.get("fallback") == "1"
    assert before.body == after.body == mono.body


@pytest.fixture(scope="module")
def eight_bit(tmp_path_factory):
    """A prefill worker and a decode worker with an int8 KV cache."""
    logs = tmp_path_factory.mktemp("eight_bit")
    started = []
    try:
        prefill = start_worker(logs / "prefill.log", "prefill", "--kv-dtype", "int8")
        started.append(prefill)
        wait_listening(prefill)
        decode = start_worker(logs / "decode.log", "decode", "--prefill", prefill.address, "--kv-dtype", "int8")
        started.append(decode)
        yield prefill, wait_listening(decode)
    finally:
        for worker in started:
            stop(worker)


async def test_an_int8_cache_crosses_the_wire_as_it_is_and_a_float_peer_is_refused(workers, eight_bit):
    """The K_LAYER frames of an int8 cache carry a byte a value and a float32 scale a
    position and KV head; the decode worker goes on from them as from its own prefill
    (the same greedy answer); an int8 decode worker refuses a float32 prefill worker's
    KV and reads the prompt itself."""
    prefill, decode = eight_bit
    with trio.fail_after(TIMEOUT):
        async with connect(prefill.address) as frames:
            await frames.send_msg(K_PREFILL, Msg({"temperature": "0", "dtype": "int8"}, PROMPT))
            layers = [wire.decode_layer((await frames.receive()).payload) for _ in range(2)]
            first = wire.decode_msg((await frames.receive()).payload)
        split = await ask(decode.address, K_DECODE, PROMPT, max_tokens=12)
        alone = await ask(decode.address, K_DECODE, PROMPT, max_tokens=12, prefill=free_port_address())
        mixed = await ask(decode.address, K_DECODE, PROMPT, max_tokens=12, prefill=workers.prefill.address)
    n = first.number("tokens")
    assert [len(layer.data) for layer in layers] == [2 * n * 2 * (16 + 4)] * 2
    assert (first.get("dtype"), first.get("kv_layout")) == ("int8", "tokens,kv_heads,head_dim+f32_scale")
    assert split.get("fallback") == "0" and alone.get("fallback") == "1"
    assert split.body == alone.body and split.get("tokens") == alone.get("tokens")
    assert mixed.get("fallback") == "1" and "dtype" in mixed.get("reason") and mixed.body == alone.body


def keep(frame: Frame):
    return [frame]


@asynccontextmanager
async def proxy(target: str, downstream=keep, upstream=keep):
    """A TCP proxy to `target` passing frames through `upstream` (client → target) and
    `downstream` (target → client): each returns the frames to pass on, or None to cut
    the connection."""

    async def pump(source, sink, change, done: trio.CancelScope):
        out = FrameStream(sink)
        try:
            async for frame in FrameStream(source):
                changed = change(frame)
                if changed is None:
                    break
                for f in changed:
                    await out.send(f.kind, f.payload)
        except (trio.BrokenResourceError, trio.ClosedResourceError, wire.WireError):
            pass
        done.cancel()  # either side ending ends both

    async def handle(client):
        server = await trio.open_tcp_stream(*parse_address(target))
        async with client, server:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, client, server, upstream, nursery.cancel_scope)
                nursery.start_soon(pump, server, client, downstream, nursery.cancel_scope)

    async with trio.open_nursery() as nursery:
        [listener] = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        yield format_address(*listener.socket.getsockname()[:2])
        nursery.cancel_scope.cancel()


def nth_layer(n: int, change):
    """A downstream change applied to the n-th K_LAYER frame only."""
    seen = itertools.count()

    def on(frame: Frame):
        if frame.kind == K_LAYER and next(seen) == n:
            return change(frame)
        return [frame]

    return on


def flip_a_byte(frame: Frame):
    payload = bytearray(frame.payload)
    payload[16 + 37] ^= 0x08  # inside the layer's bytes, past its head
    return [Frame(frame.kind, bytes(payload))]


async def test_a_checksum_broken_in_flight_means_fallback_and_the_right_text(workers):
    with trio.fail_after(TIMEOUT):
        mono = await ask(workers.mono.address, K_GEN, PROMPT, max_tokens=12)
        async with proxy(workers.prefill.address, nth_layer(1, flip_a_byte)) as via:
            split = await ask(workers.decode.address, K_DECODE, PROMPT, max_tokens=12, prefill=via)
        again = await ask(workers.decode.address, K_DECODE, PROMPT, max_tokens=12)  # the slots still work
    assert split.get("fallback") == "1" and "checksum" in split.get("reason")
    assert split.body == again.body == mono.body and again.get("fallback") == "0"


async def test_a_connection_cut_mid_transfer_means_fallback(workers):
    with trio.fail_after(TIMEOUT):
        mono = await ask(workers.mono.address, K_GEN, PROMPT, max_tokens=12)
        async with proxy(workers.prefill.address, nth_layer(1, lambda frame: None)) as via:
            split = await ask(workers.decode.address, K_DECODE, PROMPT, max_tokens=12, prefill=via)
    assert split.get("fallback") == "1" and "EndOfChannel" in split.get("reason")
    assert split.body == mono.body


def without_facts(frame: Frame):
    if frame.kind != K_PREFILL:
        return [frame]
    msg = wire.decode_msg(frame.payload)
    kept = [(k, v) for k, v in msg.fields if k not in ("model", "dtype", "layers", "kv_heads", "head_dim", "kv_layout")]
    return [Frame(frame.kind, wire.encode_msg(Msg(kept, msg.body)))]


def another_model(frame: Frame):
    if frame.kind != K_FIRST:
        return [frame]
    msg = wire.decode_msg(frame.payload)
    return [Frame(frame.kind, wire.encode_msg(Msg(dict(msg.fields) | {"model": "other:0"}, msg.body)))]


async def test_facts_that_do_not_match_are_refused_at_either_end(workers):
    with trio.fail_after(TIMEOUT):
        mono = await ask(workers.mono.address, K_GEN, PROMPT, max_tokens=12)
        # the decode side checks K_FIRST (its own facts kept from the prefill worker)
        async with proxy(workers.prefill.address, another_model, without_facts) as via:
            late = await ask(workers.decode.address, K_DECODE, PROMPT, max_tokens=12, prefill=via)
        # the prefill side refuses a K_PREFILL naming other facts, before any work
        kind, early = await request(workers.prefill.address, K_PREFILL, Msg({"dtype": "bfloat16"}, PROMPT))
    assert late.get("fallback") == "1" and "model" in late.get("reason") and late.body == mono.body
    assert kind == K_ERROR and early.get("code") == "BAD_REQUEST"
    assert early.body == "the peer's dtype is 'bfloat16', this worker's 'float32'"


# ---- errors ---------------------------------------------------------------------------


async def error_of(address: str, data: bytes) -> str:
    """Send bytes as they are; the reason of the K_ERROR that must come back."""
    stream = await trio.open_tcp_stream(*parse_address(address))
    async with stream:
        await stream.send_all(data)
        frame = await FrameStream(stream).receive()
    assert frame.kind == K_ERROR
    return wire.decode_msg(frame.payload).body


async def test_malformed_requests_get_the_exact_sentence_and_the_worker_serves_on(workers):
    mono = workers.mono.address
    request_frame = wire.encode_frame
    with trio.fail_after(TIMEOUT):
        assert await error_of(mono, request_frame(K_GEN, b"max_tokens=2\nno equals\n\nhi")) == \
            "a header line without '=': \"no equals\""
        assert await error_of(mono, request_frame(K_GEN, b"\n\xff\xfe")) == "a message that is not UTF-8"
        assert await error_of(mono, struct.pack("<IB", wire.MAX_FRAME + 2, K_GEN)) == \
            f"a frame of {wire.MAX_FRAME + 1} payload bytes is over the limit of {wire.MAX_FRAME}"
        assert await error_of(mono, struct.pack("<I", 0)) == "a frame of length 0 has no kind byte"
        assert await error_of(mono, request_frame(K_GEN, b"max_tokens=two\n\nhi")) == "max_tokens: not a number"
        assert await error_of(mono, request_frame(K_GEN, b"top_p=nan\n\nhi")) == "top_p: 'nan' is not a number"
        assert await error_of(mono, request_frame(K_GEN, b"logit_bias=5\n\nhi")) == "logit_bias: '5' is not token:value"
        assert await error_of(mono, request_frame(K_GEN, b"stop_token_ids=1,x\n\nhi")) == \
            "stop_token_ids: 'x' is not a whole number"
        assert (await error_of(mono, request_frame(K_GEN, b"repetition_penalty=0\n\nhi"))).startswith("repetition_penalty")
        assert await error_of(mono, request_frame(K_GEN, b"max_tokens=0\n\nhi")) == \
            "max_tokens must be at least 1, got 0"
        assert await error_of(mono, request_frame(K_DECODE, b"\nhi")) == "a mono worker answers GEN, not DECODE"
        assert await error_of(mono, request_frame(99, b"")) == "a mono worker answers GEN, not kind 99"
        assert await error_of(workers.decode.address, request_frame(K_DECODE, b"prefill=nowhere\n\nhi")) == \
            "an address is HOST:PORT, not 'nowhere'"
        # over the limit: the answer, then the worker hangs up (nothing after can be trusted)
        stream = await trio.open_tcp_stream(*parse_address(mono))
        async with stream:
            await stream.send_all(struct.pack("<IB", wire.MAX_FRAME + 2, K_GEN) + b"x" * 1000)
            frames = FrameStream(stream)
            assert (await frames.receive()).kind == K_ERROR
            with pytest.raises((trio.EndOfChannel, trio.BrokenResourceError)):
                await frames.receive()
        # a bad message leaves the connection usable: the next request on it is answered
        async with connect(mono) as frames:
            await frames.send(K_GEN, b"oops\n\nhi")
            assert (await frames.receive()).kind == K_ERROR
            await frames.send_msg(K_GEN, Msg({"max_tokens": 3}, PROMPT))
            answer = await frames.receive()
        assert answer.kind == K_RESULT and wire.decode_msg(answer.payload).get("tokens") == "3"
    assert workers.mono.process.poll() is None
