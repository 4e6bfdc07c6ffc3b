"""Split serving (motet/engines/split.py) with two real `motet mux` children on the tiny
llama: long prompts handed over give the greedy text of one engine, short ones are read
in place, handovers run while other slots decode, and a dead prefill engine or a refused
session file only makes the decode engine read the prompt itself. The settings, their
refusals and the slot table alone: test_split_settings.py."""

from __future__ import annotations

import shlex
from functools import partial

import pytest
import trio
import trio.testing
from conftest import GOLDEN, MUX_COMMAND

from motet.engines.engine import Engine
from motet.engines.split import SplitEngine
from motet.engines.split_children import open_split_engines
from motet.runtime.errors import Cancelled
from motet.runtime.split_settings import SplitSettings

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
    engines = partial(Engine, tiny_model("llama"), kv_slots=2, max_context=256, prefill_chunk=16, prefill_chunk_alone=16)
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
    decode = partial(Engine, tiny_model("llama"), kv_slots=2, max_context=256, prefill_chunk=16, prefill_chunk_alone=16)
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
