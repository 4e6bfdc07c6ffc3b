"""Split serving (motet/engines/split.py, runtime/split_settings.py): the settings and every refusal with its sentence; the
slot table alone; then two real `motet mux` children on the tiny llama: long prompts
handed over give the greedy text of one engine, short ones are read in place, handovers
run while other slots decode, and a dead prefill engine or a refused session file only
makes the decode engine read the prompt itself."""

from __future__ import annotations

import json
import shlex
from functools import partial

import pytest
import trio
import trio.testing
from conftest import GOLDEN, MUX_COMMAND

from motet.engines.engine import Engine
from motet.engines.split import SplitEngine
from motet.engines.split_children import open_split_engines
from motet.runtime.api import SplitStatistics
from motet.runtime.errors import BadRequest, Cancelled, QueueFull, SlotBusy
from motet.runtime.slot_table import SlotQueue
from motet.runtime.split_settings import SplitConfigError, SplitSettings

TIMEOUT = 240  # seconds
LLAMA = GOLDEN / "llama"
GEOMETRY = dict(kv_slots=4, max_context=256)
MIN = 8  # min_prompt_tokens in the end-to-end tests
SHORT = "Hello there"  # fewer than MIN tokens, and no prefix of a LONG one
LONG = [  # each well over MIN tokens
    "The sea is wide and the sky is blue, and the ships sail far away to the west",
    "Three small robots walked along the shore, counting the shells and the stones they met",
    "Once upon a time a fox and a crow argued about the best way to cross the river at night",
]


# ---- settings ------------------------------------------------------------------------


def test_defaults_and_a_full_setting():
    assert SplitSettings.from_dict({}) == SplitSettings()
    s = SplitSettings()
    assert (s.prefill_device, s.decode_device, s.min_prompt_tokens, s.dir) == (None, None, 2048, None)
    s = SplitSettings.from_json(json.dumps({
        "prefill_device": 0, "decode_device": 1, "min_prompt_tokens": 512, "dir": "/tmp/x",
        "prefill_args": ["RAM_GB=8", "--experts=tiered", "--dtype=bfloat16"],
        "decode_args": ["--no-prefetch", "--dtype=bfloat16", "KVSAVE=1"],
    }))
    assert (s.prefill_device, s.decode_device, s.min_prompt_tokens, str(s.dir)) == (0, 1, 512, "/tmp/x")
    assert dict(s.prefill_args.env) == {"RAM_GB": "8"}
    assert s.prefill_args.flags == ("--experts=tiered", "--dtype=bfloat16")
    assert dict(s.decode_args.env) == {"KVSAVE": "1"}
    assert s.decode_args.flags == ("--no-prefetch", "--dtype=bfloat16")


REFUSALS = [
    ([0, 1], r"must be a JSON object such as"),
    ({"prefill_gpu": 0}, r"have no key 'prefill_gpu'; the known keys are prefill_device, decode_device, "
                         r"min_prompt_tokens, dir, prefill_args, decode_args\."),
    ({"prefill_device": 1, "decode_device": 1},
     r"prefill_device and decode_device are both accelerator 1; each engine needs an accelerator of its own\."),
    ({"prefill_device": 0}, r"give both prefill_device and decode_device, or neither"),
    ({"prefill_device": -1, "decode_device": 1}, r"prefill_device must be an accelerator number \(0 or more\), "
                                                 r"not -1\."),
    ({"prefill_device": True, "decode_device": 1}, r"prefill_device must be an accelerator number .* not True"),
    ({"prefill_device": "0", "decode_device": 1}, r"prefill_device must be an accelerator number .* not '0'"),
    ({"min_prompt_tokens": 0}, r"min_prompt_tokens must be a whole number of tokens \(1 or more\), not 0\."),
    ({"min_prompt_tokens": -5}, r"min_prompt_tokens must be .* not -5"),
    ({"min_prompt_tokens": 2.5}, r"min_prompt_tokens must be .* not 2\.5"),
    ({"min_prompt_tokens": "2048"}, r"min_prompt_tokens must be .* not '2048'"),
    ({"dir": ""}, r"dir must be the name of a folder, not ''\."),
    ({"dir": 5}, r"dir must be the name of a folder, not 5\."),
    ({"prefill_args": "RAM_GB=8"}, r"prefill_args must be a list of strings"),
    ({"decode_args": [8]}, r"decode_args holds 8, which is not a string"),
    ({"decode_args": ["8"]}, r"decode_args holds '8', which is neither KEY=VALUE nor --flag\[=value\]; "
                             r"write a flag and its value as one entry"),
    ({"decode_args": ["ram_gb=8"]}, r"neither KEY=VALUE nor --flag"),
    ({"prefill_args": ["--layer-split=2"]}, r"prefill_args holds --layer-split, which is not a motet mux flag "
                                            r"a role can take \(those are --experts, "),
    ({"prefill_args": ["SERVE_TOPK=0"]}, r"prefill_args cannot set SERVE_TOPK: the split talks to its engines "
                                         r"through the mux protocol"),
    ({"decode_args": ["--batch"]}, r"decode_args cannot set --batch"),
    ({"decode_args": ["CUDA_VISIBLE_DEVICES=3"]},
     r"decode_args cannot set CUDA_VISIBLE_DEVICES: each engine's accelerator is given by prefill_device"),
    ({"prefill_args": ["CTX=512"]}, r"prefill_args and decode_args set CTX / --max-context differently \('512' "
                                    r"and unset\): both engines must agree on the context length, since a "
                                    r"session file only restores into an engine of the same weights and KV "
                                    r"shape\."),
    ({"prefill_args": ["CTX=1024"], "decode_args": ["--max-context=512"]},
     r"set CTX / --max-context differently \('1024' and '512'\)"),
    ({"decode_args": ["KV_SLOTS=2"]}, r"KV_SLOTS / --kv-slots differently .* the number of KV slots"),
    ({"prefill_args": ["--dtype=bfloat16"]}, r"--dtype differently \('bfloat16' and unset\).* the weights' dtype"),
    ({"decode_args": ["--kv-dtype=float32"]}, r"--kv-dtype differently \(unset and 'float32'\).* the KV cache's dtype"),
    ({"decode_args": ["SNAP=/other/model.gguf"]}, r"SNAP / --model differently .* agree on the model"),
    ({"prefill_args": ["JAX_PLATFORMS=cpu"]}, r"JAX_PLATFORMS differently .* the JAX backend"),
    ({"prefill_args": ["KVSAVE=1"]}, r"prefill_args cannot set KVSAVE: the prefill engine's slots only pass"),
]


@pytest.mark.parametrize("raw, message", REFUSALS)
def test_every_refusal_says_why(raw, message):
    with pytest.raises(SplitConfigError, match=message):
        SplitSettings.from_dict(raw)


def test_refusals_that_need_json_or_a_file(tmp_path):
    with pytest.raises(SplitConfigError, match=r"the split settings are not valid JSON \(.*\); write them as"):
        SplitSettings.from_json("{prefill_device: 0}")
    (tmp_path / "f").write_text("")
    with pytest.raises(SplitConfigError, match=r"dir '.*f' is a file, not a folder for session files\."):
        SplitSettings.from_dict({"dir": str(tmp_path / "f")})
    with pytest.raises(SplitConfigError, match="both accelerator 2"):
        SplitSettings(prefill_device=2, decode_device=2)  # checked however it is built
    assert issubclass(SplitConfigError, ValueError)


def test_the_same_value_in_both_roles_is_no_mismatch_and_a_flag_wins():
    s = SplitSettings.from_dict({"prefill_args": ["CTX=512"], "decode_args": ["--max-context=512"]})
    assert s.prefill_args.value("CTX", "--max-context") == "512"
    s = SplitSettings.from_dict({"prefill_args": ["CTX=1024", "--max-context=512"], "decode_args": ["CTX=512"]})
    assert s.decode_args.value("CTX", "--max-context") == "512"


def test_the_session_folder_is_fresh(tmp_path):
    given = SplitSettings(dir=tmp_path / "sessions")
    a, b = given.make_dir(), given.make_dir()
    assert a != b and a.parent == b.parent == tmp_path / "sessions"
    default = SplitSettings().make_dir()
    try:
        assert default.is_dir() and default.name.startswith("motet-split-")
    finally:
        default.rmdir()


def test_statistics_map_to_prometheus_names():
    stats = SplitStatistics(5, 2, 1, 2, 1000, 1500.0, 20.0, 30.0, True, False, 1, 8, None)
    metrics = {name: (kind, value) for name, kind, _, value in stats.metrics()}
    assert metrics["motet_split_handovers"] == ("counter", 2)
    assert metrics["motet_split_prefill_seconds"] == ("counter", 1.5)
    assert metrics["motet_split_decode_alive"] == ("gauge", 0.0)
    assert all(not name.endswith("_total") for name in metrics)
    assert len(metrics) == len(stats.metrics())


# ---- the slot table ------------------------------------------------------------------


async def test_slot_queue_chooses_as_the_scheduler_and_queues_in_order():
    with trio.fail_after(10):
        table = SlotQueue(2, queue_limit=1)
        a = await table.take((1, 2, 3))
        table.give_back(a, (1, 2, 3, 4))
        assert await table.take((1, 2, 3, 9)) == a  # the longest shared prefix
        b = await table.take((7, 7))
        assert b != a
        with pytest.raises(SlotBusy):
            await table.take((5,), slot=b)
        with pytest.raises(BadRequest):
            await table.take((5,), slot=2)
        got = []

        async def waiter(*, task_status=trio.TASK_STATUS_IGNORED):
            task_status.started()
            got.append(await table.take((5, 5)))

        async with trio.open_nursery() as nursery:
            await nursery.start(waiter)
            await trio.testing.wait_all_tasks_blocked()
            assert table.waiting == 1
            with pytest.raises(QueueFull):
                await table.take((6,))
            table.give_back(b)
        assert got == [b] and table.busy == {a, b}


async def test_a_cancelled_waiter_leaves_the_queue():
    with trio.fail_after(10):
        table = SlotQueue(1, queue_limit=1)
        slot = await table.take((1,))
        got = []
        first = trio.CancelScope()

        async def one():
            with first:
                await table.take((2,))

        async def two():
            got.append(await table.take((3,)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            await trio.testing.wait_all_tasks_blocked()
            first.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert table.waiting == 0
            nursery.start_soon(two)  # the queue has room again
            await trio.testing.wait_all_tasks_blocked()
            table.give_back(slot)
        assert got == [slot] and table.busy == {slot}


# ---- two `motet mux` children ---------------------------------------------------------


def split_engine(min_prompt_tokens: int = MIN, **kwargs):
    return open_split_engines(SplitSettings(min_prompt_tokens=min_prompt_tokens), LLAMA, **GEOMETRY,
                              command=MUX_COMMAND, **kwargs)


async def single_engine_texts(tiny_model, prompts, max_tokens: int) -> list[str]:
    """What one engine answers (`motet mux` runs this same Engine: test_engine shows it)."""
    async with Engine(tiny_model("llama"), **GEOMETRY) as engine:
        return [(await engine.complete(p, max_tokens=max_tokens)).text for p in prompts]


async def test_a_long_prompt_is_handed_over_and_a_short_one_read_in_place(tiny_model):
    with trio.fail_after(TIMEOUT):
        expected = await single_engine_texts(tiny_model, [LONG[0], SHORT], 16)
        async with split_engine() as split:
            folder = split.dir
            long = await split.complete(LONG[0], max_tokens=16)
            after_long = split.split_statistics()
            short = await split.complete(SHORT, max_tokens=16)
            follow_up = await split.complete(LONG[0] + long.text + " and more", max_tokens=4)
            stats = split.split_statistics()
            assert list(folder.iterdir()) == []  # each file is deleted once restored
        assert not folder.exists()  # the folder goes at close
    assert [long.text, short.text] == expected
    assert (after_long.requests, after_long.handovers, after_long.fallbacks) == (1, 1, 0)
    assert long.stats.reused_tokens == long.stats.prompt_tokens - 1  # the decode engine read one token
    last = after_long.last
    assert last.tokens == long.stats.prompt_tokens - 1 and last.bytes > 0 and stats.bytes == last.bytes
    # the short prompt, and a follow-up that adds fewer than MIN tokens to its slot's history
    assert (stats.requests, stats.handovers, stats.short, stats.fallbacks) == (3, 1, 2, 0)
    assert follow_up.stats.reused_tokens > long.stats.prompt_tokens
    assert stats.prefill_alive and stats.decode_alive


async def test_handovers_land_while_other_slots_decode(tiny_model):
    with trio.fail_after(TIMEOUT):
        expected = await single_engine_texts(tiny_model, [SHORT, *LONG], 40)
        async with split_engine() as split:
            texts = [None] * (1 + len(LONG))
            async with split.stream(SHORT, max_tokens=40) as running:
                first = await running.__anext__()  # slot taken, decoding

                async def one(i):
                    texts[1 + i] = (await split.complete(LONG[i], max_tokens=40)).text

                async with trio.open_nursery() as nursery:  # three handovers at once
                    for i in range(len(LONG)):
                        nursery.start_soon(one, i)
                rest = [event async for event in running]
            texts[0] = first.text + "".join(getattr(e, "text", "") for e in rest) + running.finish.text_tail
            stats = split.split_statistics()
            slots = {split.decode.statistics().slots_total}
    assert texts == expected
    assert (stats.requests, stats.handovers, stats.short, stats.fallbacks) == (4, 3, 1, 0)
    assert slots == {4}


async def test_a_prefill_engine_killed_mid_request_costs_only_time(tiny_model):
    long = " ".join([LONG[1]] * 4)  # long enough that the prefill is in flight when it dies
    with trio.fail_after(TIMEOUT):
        expected = await single_engine_texts(tiny_model, [long, LONG[2]], 12)
        async with split_engine(prefill_restart_every_s=0.5) as split:
            answer = []

            async def request():
                answer.append(await split.complete(long, max_tokens=12))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(request)
                await trio.testing.wait_all_tasks_blocked()  # waiting for the prefill engine
                prefill = split.prefill
                prefill.process.kill()
            killed = split.split_statistics()
            await prefill.process.wait()
            await split.wait_prefill()  # started again in the background
            again = await split.complete(LONG[2], max_tokens=12)
            stats = split.split_statistics()
    assert [answer[0].text, again.text] == expected
    assert (killed.requests, killed.handovers, killed.fallbacks) == (1, 0, 1)
    assert (stats.requests, stats.handovers, stats.fallbacks, stats.prefill_restarts) == (2, 1, 1, 1)


async def test_a_dead_prefill_engine_is_not_asked_until_it_is_back(tiny_model, caplog):
    with trio.fail_after(TIMEOUT):
        expected = await single_engine_texts(tiny_model, LONG[:2], 12)
        async with split_engine() as split:  # restarts at most once a minute: not in this test
            prefill = split.prefill
            prefill.process.kill()
            await split.wait_prefill(serving=False)
            texts = [(await split.complete(p, max_tokens=12)).text for p in LONG[:2]]
            stats = split.split_statistics()
    assert texts == expected
    assert (stats.requests, stats.handovers, stats.fallbacks, stats.prefill_alive) == (2, 0, 2, False)
    reasons = [r.getMessage() for r in caplog.records if r.name == "motet.engines.split" and "no handover" in r.getMessage()]
    assert len(reasons) == 2 and all("the prefill engine is not running" in r for r in reasons)


async def test_a_refused_session_file_falls_back(tiny_model, caplog):
    async def damage(path):  # a flipped bit in the last layer: the checksum refuses it
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x40
        path.write_bytes(bytes(data))

    with trio.fail_after(TIMEOUT):
        expected = await single_engine_texts(tiny_model, LONG[:1], 16)
        async with split_engine(before_restore=damage) as split:
            got = await split.complete(LONG[0], max_tokens=16)
            stats = split.split_statistics()
            assert list(split.dir.iterdir()) == []
    assert got.text == expected[0]
    assert got.stats.reused_tokens == 0  # the decode engine read the prompt itself
    assert (stats.requests, stats.handovers, stats.fallbacks) == (1, 0, 1)
    assert any("SessionError" in r.getMessage() and "checksum" in r.getMessage()
               for r in caplog.records if r.name == "motet.engines.split")


async def test_cancel_during_a_handover_ends_the_request_and_frees_its_slots(tiny_model):
    """In-process engines (the split takes any engine with the slot methods)."""
    reached = trio.Event()

    async def park(path):
        reached.set()
        await trio.sleep_forever()

    prompt = tuple(range(5, 70))  # token ids
    engines = partial(Engine, tiny_model("llama"), kv_slots=2, max_context=256, prefill_chunk=16)
    with trio.fail_after(TIMEOUT):
        async with SplitEngine(engines, engines, SplitSettings(min_prompt_tokens=MIN), before_restore=park) as split:
            outcome = []

            async def request():
                try:
                    await split.complete(prompt, max_tokens=4)
                except Cancelled as exc:
                    outcome.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(request)
                await reached.wait()
                assert split.statistics().running == 1
                await split.cancel(1)  # the split's first request id
            assert len(outcome) == 1 and outcome[0].request_id == 1
            assert list(split.dir.iterdir()) == []
            assert split.statistics().running == 0
            short = await split.complete(prompt[:4], max_tokens=4)
            assert short.stats.emitted_tokens == 4


async def test_a_decode_engine_that_cannot_start_fails_the_start_and_leaves_no_folder(tmp_path):
    from motet.model.errors import ModelError

    settings = SplitSettings(dir=tmp_path)
    with trio.fail_after(TIMEOUT):
        with pytest.raises(ModelError, match="could not load its model"):
            async with open_split_engines(settings, tmp_path / "missing", **GEOMETRY, command=MUX_COMMAND):
                pass
    assert list(tmp_path.iterdir()) == []


async def test_a_prefill_engine_that_cannot_start_leaves_the_decode_engine_serving(tiny_model, tmp_path):
    prompt = tuple(range(5, 70))
    decode = partial(Engine, tiny_model("llama"), kv_slots=2, max_context=256, prefill_chunk=16)
    with trio.fail_after(TIMEOUT):
        async with SplitEngine(partial(Engine, tmp_path / "missing"), decode,
                               SplitSettings(min_prompt_tokens=MIN)) as split:
            got = await split.complete(prompt, max_tokens=4)
            stats = split.split_statistics()
    assert got.stats.emitted_tokens == 4 and got.stats.reused_tokens == 0
    assert (stats.requests, stats.fallbacks, stats.prefill_alive, stats.decode_alive) == (1, 1, False, True)


# ---- `motet serve --split`: the HTTP front over the two children ------------------------


async def test_serve_split_answers_over_http_and_reports_handovers(tiny_model):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from motet.cli.compose import open_engine
    from motet.http.serve import serve_app
    from motet.runtime.serve_settings import ServeSettings

    settings = ServeSettings(port=0, model_path=LLAMA, engine_cmd=shlex.join(MUX_COMMAND),
                             split=SplitSettings(min_prompt_tokens=MIN), **GEOMETRY)
    with trio.fail_after(TIMEOUT):
        expected = await single_engine_texts(tiny_model, [LONG[0]], 12)
        async with open_engine(settings, None) as engine, trio.open_nursery() as nursery:
            url = (await nursery.start(partial(serve_app, engine, settings)))[0]
            async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
                answer = await http.post("/v1/completions", json={
                    "model": "m", "prompt": LONG[0], "max_tokens": 12, "temperature": 0})
                health = (await http.get("/health")).json()
                scraped = (await http.get("/metrics")).text
                metrics = {s.name: s.value for f in text_string_to_metric_families(scraped) for s in f.samples}
                erased = await http.post("/slots/0", params={"action": "erase"})
            nursery.cancel_scope.cancel()
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == expected[0]
    assert health["status"] == "ok" and health["split"]["handovers"] == 1 and health["split"]["prefill_alive"]
    assert metrics["motet_split_handovers_total"] == 1 and metrics["motet_split_fallbacks_total"] == 0
    assert metrics["motet_split_handover_bytes_total"] == health["split"]["bytes"] > 0
    assert erased.status_code == 200 and erased.json()["id_slot"] == 0


def test_the_cli_refuses_a_bad_split_before_loading_anything(capsys):
    from motet.cli import main

    assert main(["serve", "--split", '{"prefill_gpu": 0}']) == 2
    assert "the split settings have no key 'prefill_gpu'" in capsys.readouterr().err
