"""Several processes as one engine (actors/device_group.py, actors/follower.py): the
settings in-process, and two real `motet mux` processes on 127.0.0.1 joined by
jax.distributed (gloo): process 0 answers through its front, process 1 follows, both stop
cleanly. Two layouts: the tiny qwen3_moe ep=2,tp=2 over 2 virtual CPU devices per process
(ep across the processes), and the tiny llama tp=2 over one device each (KV heads split
across the processes, so reading a slot's KV is a gather)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from argparse import Namespace

import pytest
import trio
from conftest import GOLDEN, REPO

from motet.cli import main
from motet.cli.config import distributed_settings
from motet.engines.engine import Engine
from motet.protocol import mux
from motet.runtime.addresses import format_address, parse_address
from motet.runtime.config import DistributedSettings

PROMPT = b"<|im_start|>user\nTell me about the sea.<|im_end|>\n<|im_start|>assistant\n"
NEXT = b"<|im_end|>\n<|im_start|>user\nAnd the mountains?<|im_end|>\n<|im_start|>assistant\n"
TOKENS = 8
CTX = 256
TIMEOUT = 240  # seconds for the whole two-process run (cold compiles take most of it)
STOP_WITHIN = 60  # seconds from SIGTERM on process 0 until both have exited


# ---- DistributedSettings --------------------------------------------------------------


def flags(coordinator=None, num_processes=None, process_id=None) -> Namespace:
    return Namespace(coordinator=coordinator, num_processes=num_processes, process_id=process_id)


def test_no_flags_is_one_process():
    assert distributed_settings(flags(), {}) is None


def test_flags_and_environment():
    env = {"MOTET_COORDINATOR": "10.0.0.1:1234", "MOTET_NUM_PROCESSES": "4", "MOTET_PROCESS_ID": "3"}
    assert distributed_settings(flags(), env) == DistributedSettings("10.0.0.1:1234", 4, 3)
    ours = distributed_settings(flags("host-a:99", None, 0), env)  # flags win
    assert ours == DistributedSettings("host-a:99", 4, 0) and ours.leader


@pytest.mark.parametrize(("given", "words"), [
    (flags("h:1", 2), "missing: --process-id"),
    (flags(None, 2, 1), "missing: --coordinator"),
    (flags("h:1", 2, 2), r"process id must be in \[0, 1\] for 2 processes, got 2"),
    (flags("h:1", 2, -1), r"process id must be in \[0, 1\]"),
    (flags("h:1", 0, 0), "number of processes must be a positive integer, got 0"),
    (flags("h", 2, 0), "HOST:PORT"),
    (flags("h:0", 2, 0), r"port in \[1, 65535\]"),
    (flags("h:70000", 2, 0), r"port in \[1, 65535\]"),
    (flags(":80", 2, 0), "HOST:PORT"),
    (flags("::1:80", 2, 0), "IPv6 in brackets"),
    (flags("[::1:80", 2, 0), r"in brackets, \[::1\]:PORT"),
    (flags("[nope]:80", 2, 0), "not an IPv6 address"),
])
def test_refusals(given, words):
    with pytest.raises(ValueError, match=words):
        distributed_settings(given, {})


def test_a_bad_variable_is_named():
    with pytest.raises(ValueError, match="MOTET_PROCESS_ID must be an integer, got 'one'"):
        distributed_settings(flags("h:1", 2), {"MOTET_PROCESS_ID": "one"})


def test_addresses():
    assert parse_address("127.0.0.1:5000") == ("127.0.0.1", 5000)
    assert parse_address("[::1]:5000") == ("::1", 5000)
    assert parse_address("node-7.cluster:80") == ("node-7.cluster", 80)
    assert parse_address(format_address("::1", 7000)) == ("::1", 7000)  # brackets written and read back
    assert parse_address("127.0.0.1:0", listening=True) == ("127.0.0.1", 0)  # a listener: any free port
    with pytest.raises(ValueError, match=r"an address needs a port in \[1, 65535\], not '127.0.0.1:0'"):
        parse_address("127.0.0.1:0")  # a peer to reach


def test_the_commands_refuse_a_group_without_a_mesh(capsys):
    group = ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "1"]
    assert main(["mux", *group]) == 2
    assert "name its layout over all their devices with --mesh" in capsys.readouterr().err
    assert main(["serve", "--engine-cmd", "motet mux", *group, "--mesh", "ep=2"]) == 2
    assert "leave out --engine-cmd and --split" in capsys.readouterr().err
    assert main(["serve", "--num-processes", "2"]) == 2
    assert "missing: --coordinator, --process-id" in capsys.readouterr().err


# ---- two processes ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_until(proc, decoder, events: list, done, deadline: float) -> list:
    while not done(events):
        assert time.monotonic() < deadline, f"no answer in {TIMEOUT} s: {events[-5:]}"
        data = os.read(proc.stdout.fileno(), 65536)
        assert data, "process 0 closed its stdout"
        events += decoder.feed(data)
    return events


def stderr_tails(tmp_path) -> str:
    """What both processes printed last: a failure names the process that died, and why."""
    return "\n\n".join(f"process {i}'s stderr:\n" + (tmp_path / f"process{i}.stderr").read_text(errors="replace")[-3000:]
                       for i in (0, 1))


def answered(rid: int, kind):
    return lambda events: any(isinstance(e, (kind, mux.Error)) and e.request_id == rid for e in events)


def text_of(events, rid: int) -> str:
    return b"".join(e.data for e in events if isinstance(e, mux.Data) and e.request_id == rid).decode()


def one_device_answers(model, session) -> tuple[str, str]:
    """The same two turns on one device in this process: the first in slot 0, saved and
    restored into slot 1, the second there."""
    async def run():
        async with Engine(model, kv_slots=2, max_context=CTX) as engine:
            first = await engine.complete(PROMPT.decode(), max_tokens=TOKENS, slot=0)
            await engine.save_slot(0, session)
            await engine.restore_slot(1, session)
            second = await engine.complete((PROMPT.decode() + first.text + NEXT.decode()), max_tokens=TOKENS,
                                           slot=1)
            return first.text, second.text

    return trio.run(run)


@pytest.mark.parametrize(("arch", "mesh", "devices", "expert_cap"),
                         [("qwen3_moe", "ep=2,tp=2", 2, None), ("llama", "tp=2", 1, None),
                          ("qwen3_moe", "ep=2,tp=2", 2, 4)], ids=["ep-tp", "tp", "tiered"])
def test_two_processes_serve_through_process_0_and_stop_cleanly(tmp_path, tiny_model, arch, mesh, devices,
                                                                expert_cap):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "SNAP": str(GOLDEN / arch), "SERVE": "1", "SERVE_BATCH": "1", "KV_SLOTS": "2",
           "CTX": str(CTX), "KVSAVE": "0"}
    if expert_cap is not None:  # a pool of 4 of the 8 experts a layer, 2 on each process's devices
        env |= {"EXPERT_CAP": str(expert_cap), "HEAT_FILE": str(tmp_path / "heat.json")}
    command = [sys.executable, "-m", "motet", "mux", "--compile-cache", str(REPO / ".jax_cache" / "dist"),
               "--mesh", mesh, "--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2"]
    logs = [open(tmp_path / f"process{i}.stderr", "wb") for i in (0, 1)]
    procs = []
    try:
        procs.append(subprocess.Popen([*command, "--process-id", "1"], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=logs[1], env=env, cwd=REPO))
        leader = subprocess.Popen([*command, "--process-id", "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=logs[0], env=env, cwd=REPO)
        procs.append(leader)
        deadline = time.monotonic() + TIMEOUT
        decoder, events = mux.ExtendedResponseDecoder(), []

        def ask(rid: int, line: bytes, kind):
            leader.stdin.write(line)
            leader.stdin.flush()
            try:
                read_until(leader, decoder, events, answered(rid, kind), deadline)
            except AssertionError as failure:
                raise AssertionError(f"{failure}\n\n{stderr_tails(tmp_path)}") from None
            (answer,) = [e for e in events if isinstance(e, (kind, mux.Error)) and e.request_id == rid]
            assert isinstance(answer, kind), answer
            return answer

        # a turn, its KV saved (read back from both processes' shards) and restored into
        # another slot (written to both), and a second turn on top of it
        ask(1, mux.encode_submit(mux.Submit(1, 0, TOKENS, 0.0, 1.0, PROMPT)), mux.Done)
        session = str(tmp_path / "turn.session")
        ask(2, mux.encode_save(mux.Save(2, 0, session)), mux.Saved)
        restored = ask(3, mux.encode_restore(mux.Restore(3, 1, session)), mux.Restored)
        second = PROMPT + text_of(events, 1).encode() + NEXT
        done = ask(4, mux.encode_submit(mux.Submit(4, 1, TOKENS, 0.0, 1.0, second)), mux.Done)
        assert done.emitted == TOKENS and restored.tokens > 0

        leader.send_signal(signal.SIGTERM)  # the first signal: finish what runs, then leave
        codes = [proc.wait(timeout=STOP_WITHIN) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    stderr = [(tmp_path / f"process{i}.stderr").read_text(errors="replace") for i in (0, 1)]
    assert codes == [0, 0], stderr_tails(tmp_path)
    assert "process 0 stopped after" in stderr[1]  # process 1 followed to the end
    if expert_cap is not None:  # both pools moved experts, alike, or the answers would differ
        assert "experts tiered" in stderr[1], stderr[1][-3000:]
        assert int(re.search(r"; (\d+) expert moves here\)", stderr[1])[1]) > 0
        assert re.search(r"PLACE [1-9]", stderr[1]), "no placement reached process 1"
    assert (text_of(events, 1), text_of(events, 4)) == one_device_answers(tiny_model(arch), tmp_path / "one.session")
