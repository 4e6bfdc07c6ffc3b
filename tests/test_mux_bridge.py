"""`motet mux` as other servers drive it: the real subprocess, raw bytes on its stdin,
every stdout byte parsed as protocol (first part of issue 4's conformance suite)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import GOLDEN, REPO

from motet.protocol import mux

PROMPT = b"<|im_start|>user\nTell me about the sea.<|im_end|>\n<|im_start|>assistant\n"


def submit(rid: int, slot: int, max_tokens: int = 8, prompt: bytes = PROMPT, extra: str = "") -> bytes:
    return f"SUBMIT {rid} {slot} {len(prompt)} {max_tokens} 0 1{extra}\n".encode() + prompt + b"\n"


def run_mux(stdin: bytes, *, env: dict | None = None, args=(), decoder=mux.ResponseDecoder,
            warm_up: bool = False) -> tuple[int, list, bytes]:
    """A `motet mux` child fed `stdin`; it skips the warm-up (tested once, below) unless
    warm_up, as the protocol is what these tests are about."""
    args = (*args, *([] if warm_up else ["--no-warm-up"]))
    environ = {**os.environ, "SNAP": str(GOLDEN / "llama"), "SERVE": "1", "SERVE_BATCH": "1",
               "KV_SLOTS": "2", "CTX": "256", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "motet", "mux", "--compile-cache", str(REPO / ".jax_cache" / "tests"), *args],
        input=stdin, capture_output=True, env=environ, timeout=300, cwd=REPO,
    )
    events = decoder().feed(proc.stdout)
    return proc.returncode, events, proc.stderr


class MuxProcess:
    """A `motet mux` child driven turn by turn: write requests, read until a condition."""

    def __init__(self, env: dict | None = None):
        environ = {**os.environ, "SNAP": str(GOLDEN / "llama"), "SERVE": "1", "SERVE_BATCH": "1",
                   "KV_SLOTS": "2", "CTX": "256", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "motet", "mux", "--compile-cache", str(REPO / ".jax_cache" / "tests"),
             "--no-warm-up"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=environ, cwd=REPO,
        )
        self.decoder, self.events = mux.ResponseDecoder(), []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()

    def send(self, data: bytes):
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def read_until(self, done) -> list:
        while not done(self.events):
            data = os.read(self.proc.stdout.fileno(), 65536)
            assert data, "the engine closed its stdout"
            self.events += self.decoder.feed(data)
        return self.events

    def finish(self, timeout: float = 60) -> int:
        rest, _ = self.proc.communicate(timeout=timeout)
        self.events += self.decoder.feed(rest)
        return self.proc.returncode


def frames(events, kind, rid=None):
    return [e for e in events if isinstance(e, kind) and (rid is None or e.request_id == rid)]


def text_of(events, rid) -> bytes:
    return b"".join(e.data for e in frames(events, mux.Data, rid))


def test_handshake_generation_and_eof():
    code, events, _ = run_mux(submit(1, 0))
    assert code == 0
    assert isinstance(events[0], mux.Ready)
    assert [e.kind for e in events[1:5]] == ["STAT", "HWINFO", "TIERS", "EMAP"]
    assert "|" in events[2].fields[-1]  # <cpu>|<gpu>, the bar present with no GPU
    assert not frames(events, mux.BadLine)  # stdout held protocol and nothing else
    (done,) = frames(events, mux.Done, 1)
    assert done.emitted == 8 and done.length_limited and done.prompt_tokens > 0
    kinds = [e.kind for e in events[events.index(done) - 7 : events.index(done)]]
    assert kinds == ["HWINFO", "PERF", "ENTROPY", "GPUS", "TIERS", "EMAP", "HITS"]
    assert text_of(events, 1)


def test_ready_comes_after_the_warm_up_and_says_how_it_went():
    """[extension] WARMUP ends the start-up lines (a plain server skips it, above)."""
    _, events, stderr = run_mux(b"", decoder=mux.ExtendedResponseDecoder, warm_up=True)
    assert [type(e) for e in events[:6]] == [mux.Ready, *[mux.Telemetry] * 4, mux.Warmup]
    warmup = events[5]
    assert warmup.shapes > 0 and warmup.compiled + warmup.from_cache > warmup.shapes
    assert warmup.ready_s >= warmup.warmup_s > 0
    assert b"warm-up: ran decode 2 rows" in stderr  # the progress lines go to stderr


def test_greedy_output_is_identical_across_processes():
    first = run_mux(submit(1, 0))[1]
    second = run_mux(submit(1, 0))[1]
    assert text_of(first, 1) == text_of(second, 1)


def test_slot_busy_duplicate_and_not_found():
    wire = submit(1, 0, 40) + submit(2, 0) + submit(1, 1) + b"CANCEL 99\nSTOP 98\n"
    code, events, _ = run_mux(wire)
    assert code == 0
    errors = {(e.request_id, e.code) for e in frames(events, mux.Error)}
    assert errors == {(2, "SLOT_BUSY"), (1, "DUPLICATE_ID"), (99, "NOT_FOUND"), (98, "NOT_FOUND")}
    (done,) = frames(events, mux.Done, 1)  # the first request still completes
    assert done.emitted == 40


def test_cancel_during_decode():
    code, events, _ = run_mux(submit(3, 0, 200) + b"CANCEL 3\n")
    assert code == 0
    assert frames(events, mux.Error, 3) == [mux.Error(3, "CANCELLED")]
    assert not frames(events, mux.Done, 3)


def test_stop_ends_through_done():
    code, events, _ = run_mux(submit(4, 0, 200) + b"STOP 4\n")
    (done,) = frames(events, mux.Done, 4)
    assert done.emitted < 200 and not done.length_limited


def test_context_exceeded_then_a_small_request_works():
    long_prompt = b"the sea " * 300
    code, events, _ = run_mux(submit(5, 0, 8, long_prompt) + submit(6, 0), env={"CTX": "128"})
    (error,) = frames(events, mux.Error, 5)
    assert error.code == "CONTEXT_EXCEEDED" and error.args[1] == "128" and int(error.args[0]) > 128
    assert frames(events, mux.Done, 6)


def test_bad_requests_keep_the_stream():
    wire = b"SUBMIT x\n" + submit(7, 9) + submit(8, 0, 8, b"a\x00b") + submit(9, 0, 8, PROMPT, " 3")[:-1] + b"xyz\n" + submit(10, 1)
    code, events, _ = run_mux(wire)
    codes = {(e.request_id, e.code) for e in frames(events, mux.Error)}
    assert codes == {(0, "BAD_REQUEST"), (7, "BAD_REQUEST"), (8, "BAD_REQUEST"), (9, "BAD_REQUEST")}
    assert frames(events, mux.Done, 10)


def with_grammar(rid: int, slot: int, grammar: bytes, max_tokens: int = 200) -> bytes:
    """A SUBMIT whose seventh field carries `grammar`, after the payload."""
    head = f"SUBMIT {rid} {slot} {len(PROMPT)} {max_tokens} 0 1 {len(grammar)}\n".encode()
    return head + PROMPT + grammar + b"\n"


def test_a_grammar_in_the_seventh_field_constrains_the_answer():
    """As colibri's gateway sends response_format: GBNF, or a JSON schema as its text.
    One that cannot compile (a GBNF rule never defined) is BAD_REQUEST, as before."""
    schema = {"type": "object", "additionalProperties": False, "required": ["size"],
              "properties": {"size": {"enum": ["small", "large"]}}}
    wire = (with_grammar(1, 0, b'root ::= "sea" | "ocean"') + with_grammar(2, 1, json.dumps(schema).encode())
            + with_grammar(3, 2, b"root ::= nowhere"))
    code, events, _ = run_mux(wire, env={"KV_SLOTS": "3"})
    assert code == 0
    assert text_of(events, 1) in (b"sea", b"ocean")
    assert json.loads(text_of(events, 2)) in ({"size": "small"}, {"size": "large"})
    assert not frames(events, mux.Done, 1)[0].length_limited
    assert [e.code for e in frames(events, mux.Error, 3)] == ["BAD_REQUEST"]


def test_bad_frame_is_answered_then_the_engine_exits_0():
    wire = submit(11, 0, 8) + b"SUBMIT 12 1 3 8 0 1\nabcX" + submit(13, 1)
    code, events, _ = run_mux(wire)
    assert code == 0
    assert frames(events, mux.Error, 12) == [mux.Error(12, "BAD_FRAME")]
    assert frames(events, mux.Done, 11)  # in flight before the bad frame: finishes
    assert not frames(events, mux.Done, 13)  # after it: never read


def test_serve_topk():
    code, events, _ = run_mux(submit(14, 0, 4), env={"SERVE_TOPK": "1"})
    topks = frames(events, mux.TopK, 14)
    assert len(topks) >= 3 and all(len(t.candidates) == 5 for t in topks)
    assert all(t.candidates[0][0] >= t.candidates[-1][0] for t in topks)


def test_prefix_reuse_on_a_second_turn_is_reported():
    with MuxProcess() as engine:
        engine.send(submit(20, 0, 6))
        answer = text_of(engine.read_until(lambda ev: frames(ev, mux.Done, 20)), 20)
        second = PROMPT + answer + b"<|im_end|>\n<|im_start|>user\nAnd rivers?<|im_end|>\n<|im_start|>assistant\n"
        engine.send(submit(21, 0, 6, second))
        events = engine.read_until(lambda ev: frames(ev, mux.Done, 21))
    turns = {int(e.fields[0]): e.fields for e in frames(events, mux.Telemetry) if e.kind == "TURN"}
    assert turns[20][1:3] == ("0", "0")  # slot 0, nothing reused on a fresh slot
    assert int(turns[21][2]) >= len(PROMPT) // 8  # the second turn kept the first's prefix
    (done,) = frames(events, mux.Done, 21)
    assert int(turns[21][2]) < done.prompt_tokens


def test_hits_lines_come_during_decode_for_a_moe_model():
    code, events, _ = run_mux(submit(22, 0, 30), env={"SNAP": str(GOLDEN / "olmoe")})
    assert code == 0
    (done,) = frames(events, mux.Done, 22)
    end = events.index(done)
    first_data = events.index(frames(events, mux.Data, 22)[0])
    hits = [e for e in events[first_data:end] if isinstance(e, mux.Telemetry) and e.kind == "HITS"]
    assert len(hits) >= 4  # ~every 6 steps over 30 tokens, and the one in the final block
    rows, cols = int(hits[0].fields[0]), int(hits[0].fields[1])
    assert cols > 1 and all(int(h.fields[2], 16) for h in hits[:-1])  # a MoE map; experts routed
    assert len(bytes.fromhex(hits[0].fields[2])) == (rows * cols + 7) // 8
    (entropy,) = [e for e in events[first_data:end] if isinstance(e, mux.Telemetry) and e.kind == "ENTROPY"]
    assert len(entropy.fields) == rows and all(float(h) > 0 for h in entropy.fields)


def test_sigterm_lets_requests_in_flight_finish_then_exits_0():
    with MuxProcess() as engine:
        engine.send(submit(30, 0, 60))
        engine.read_until(lambda ev: frames(ev, mux.Data, 30))  # decoding has begun
        engine.proc.terminate()
        engine.send(submit(31, 1))  # after the signal: never read
        code = engine.finish()  # stdin stays open: the signal alone ends the engine
        events = engine.events
    assert code == 0
    assert frames(events, mux.Done, 30) or frames(events, mux.Error, 30) == [mux.Error(30, "CANCELLED")]
    assert not frames(events, mux.Done, 31) and not frames(events, mux.Error, 31)


def test_the_legacy_protocol():
    chat = b"Hello there\n"
    raw = b"<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    wire = (chat + b"\x02MORE\n" + b"\x02RESET\n" + chat
            + f"\x02PROMPT {len(raw)} 4 0 1\n".encode() + raw + b"\n" + b"\x02BOGUS\n")
    environ = {**os.environ, "SNAP": str(GOLDEN / "llama"), "SERVE": "1", "CTX": "256", "NGEN": "5"}
    proc = subprocess.run(
        [sys.executable, "-m", "motet", "mux", "--compile-cache", str(REPO / ".jax_cache" / "tests")],
        input=wire, capture_output=True, env=environ, timeout=300, cwd=REPO,
    )
    assert proc.returncode == 0
    head, _, rest = proc.stdout.partition(b"\n")
    assert head == mux.READY and rest.startswith(b"STAT 0 0.00 0.0 ")
    answers = rest.split(b"\n", 1)[1].split(b"\x01\x01END\x01\x01\n")
    stats = [a.split(b"\n", 1)[0].split() for a in answers[1:]]
    assert len(stats) == 4  # chat line, MORE, the same chat line after RESET, PROMPT
    first, more, again, _ = answers[0], *(a.split(b"\n", 1)[1] for a in answers[1:4])
    assert stats[0][:2] == [b"STAT", b"5"] and stats[0][-1] == b"1"  # cut at NGEN
    assert more and stats[1][-1] in (b"0", b"1")  # MORE carried the answer on
    assert again == first  # RESET forgot the conversation: the same turn, the same greedy answer
    assert stats[3][1] == b"4" and int(stats[3][5]) > 0
    assert answers[4].split(b"\n", 1)[1] == b"\x01\x01ERROR BAD_REQUEST\x01\x01\n"


@pytest.mark.parametrize(("snap", "kind"), [("missing.gguf", "io"), ("not-a-model.bin", "format")])
def test_a_model_that_cannot_load_is_one_load_fail_line_and_a_nonzero_exit(tmp_path, snap, kind):
    path = tmp_path / snap
    if snap.endswith(".bin"):
        path.write_bytes(b"definitely not a model")
    environ = {**os.environ, "SNAP": str(path), "SERVE": "1", "SERVE_BATCH": "1"}
    proc = subprocess.run([sys.executable, "-m", "motet", "mux"], input=b"", capture_output=True,
                          env=environ, timeout=120, cwd=REPO)
    assert proc.returncode == 2
    assert proc.stdout.startswith(f"LOAD_FAIL kind={kind} ".encode())
    assert proc.stdout.count(b"\n") == 1 and snap.encode() in proc.stdout  # one line, no READY
    assert b"motet: error:" in proc.stderr and snap.encode() in proc.stderr
