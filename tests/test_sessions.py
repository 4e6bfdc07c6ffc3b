"""Save and restore a slot's KV through session files, on the in-process Engine with real
models: a restored slot answers exactly as if it had never left, a refused file leaves the
slot as it was, prefill-only requests stop at n - 1 tokens, and a held slot is refused to
requests while other slots keep decoding."""

from __future__ import annotations

import dataclasses

import pytest
import trio

from motet.engines.engine import Engine
from motet.protocol.session_file import SessionError
from motet.runtime.errors import SlotBusy

TINY = dict(kv_slots=4, max_context=256, prefill_chunk=16, prefill_chunk_alone=16)
TIMEOUT = 240
PROMPT = tuple(range(5, 70))  # token ids: the tiny models' vocab is 512


@pytest.fixture
def olmoe(tiny_model):
    return tiny_model("olmoe")


async def ids(engine, prompt, **kwargs):
    return (await engine.complete(prompt, **kwargs)).token_ids


@pytest.mark.parametrize("arch", ["llama", "olmoe"])
async def test_restored_slot_answers_as_if_it_never_left(tiny_model, arch, tmp_path):
    model = tiny_model(arch)
    with trio.fail_after(TIMEOUT):
        async with Engine(model, **TINY) as engine:
            first = await engine.complete(PROMPT, max_tokens=12, slot=0)
            saved = await engine.save_slot(0, tmp_path / "s.session")
            turn2 = PROMPT + first.token_ids + (7, 8, 9, 10)
            expected = await engine.complete(turn2, max_tokens=12, slot=0)
        assert saved.tokens == len(PROMPT) + len(first.token_ids) - 1  # the last token is never fed
        assert saved.bytes == (tmp_path / "s.session").stat().st_size
        async with Engine(model, **TINY) as engine:
            restored = await engine.restore_slot(2, tmp_path / "s.session")
            got = await engine.complete(turn2, max_tokens=12, slot=2)
        assert restored.tokens == saved.tokens
        assert got.stats.reused_tokens == saved.tokens  # read from the file, not recomputed
        assert got.token_ids == expected.token_ids


async def test_prefill_only_stops_one_token_short_and_a_continuing_request_resumes(llama):
    with trio.fail_after(TIMEOUT):
        async with Engine(llama, **TINY) as engine:
            stats = await engine.prefill(PROMPT, slot=1)
            assert (stats.finish_reason, stats.emitted_tokens) == ("prefilled", 0)
            again = await engine.prefill(PROMPT, slot=1)  # nothing left to read
            assert again.reused_tokens == len(PROMPT) - 1
            resumed = await engine.complete(PROMPT, max_tokens=8, slot=1)
            assert resumed.stats.reused_tokens == len(PROMPT) - 1
            fresh = await engine.complete(PROMPT, max_tokens=8, slot=3)
            assert resumed.token_ids == fresh.token_ids


def header_variants(header):
    yield "model", dataclasses.replace(header, model="other-model")
    yield "engine_version", dataclasses.replace(header, engine_version="0.0.0")
    yield "dtype", dataclasses.replace(header, dtype="bfloat16")
    yield "kv_heads", dataclasses.replace(header, kv_heads=header.kv_heads + 1)
    yield "max_context", dataclasses.replace(header, max_context=header.max_context * 2)
    yield "rope_theta", dataclasses.replace(header, rope_theta=header.rope_theta + 1)
    yield "settings", dataclasses.replace(header, settings={"backend": "tpu"})
    # KV computed from a file's quantized weights is not what its float32 copy computes
    assert dict(header.settings)["weights"] == "float32"
    yield "weights", dataclasses.replace(header, settings={**dict(header.settings), "weights": "quantized"})


async def test_a_mismatched_or_damaged_file_is_refused_and_the_slot_keeps_its_kv(llama, tmp_path):
    path = tmp_path / "s.session"
    with trio.fail_after(TIMEOUT):
        async with Engine(llama, **TINY) as engine:
            await engine.complete(PROMPT, max_tokens=4, slot=0)
            saved = await engine.save_slot(0, path)
            other = PROMPT[:20] + (300,) * 30
            await engine.complete(other, max_tokens=4, slot=1)
            good = engine.session_header
            for field, header in header_variants(good):
                engine.session_header = header
                with pytest.raises(SessionError, match=field):
                    await engine.restore_slot(1, path)
            engine.session_header = good
            data = bytearray(path.read_bytes())
            data[-5] ^= 0x40  # a flipped bit in the last layer's V
            (tmp_path / "bad.session").write_bytes(bytes(data))
            with pytest.raises(SessionError, match="checksum"):
                await engine.restore_slot(1, tmp_path / "bad.session")
            again = await engine.complete(other, max_tokens=4, slot=1)
            assert again.stats.reused_tokens == len(other) - 1  # slot 1 kept its own KV
            restored = await engine.restore_slot(1, path)
            assert restored.tokens == saved.tokens


async def test_a_float16_cache_round_trips_and_a_float32_engine_refuses_it(llama, tmp_path):
    """The header names the KV's element type: a float16 cache's file restores into a
    float16 engine (the same answer as never leaving) and is refused by a float32 one."""
    path = tmp_path / "s.session"
    with trio.fail_after(TIMEOUT):
        async with Engine(llama, kv_dtype="float16", **TINY) as engine:
            assert engine.session_header.dtype == "float16"
            first = await engine.complete(PROMPT, max_tokens=8, slot=0)
            saved = await engine.save_slot(0, path)
            turn2 = PROMPT + first.token_ids + (7, 8, 9)
            expected = await engine.complete(turn2, max_tokens=8, slot=0)
        # tokens, header and two bytes a value: K and V of every layer
        cfg = llama.config
        assert saved.bytes > 2 * 2 * cfg.n_layers * saved.tokens * cfg.n_kv_heads * cfg.head_dim
        async with Engine(llama, kv_dtype="float16", **TINY) as engine:
            await engine.restore_slot(3, path)
            got = await engine.complete(turn2, max_tokens=8, slot=3)
        assert got.stats.reused_tokens == saved.tokens and got.token_ids == expected.token_ids
        async with Engine(llama, kv_dtype="float32", **TINY) as engine:
            with pytest.raises(SessionError, match="dtype"):
                await engine.restore_slot(3, path)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
async def test_an_8_bit_cache_round_trips_and_other_engines_refuse_it(llama, tmp_path, kind):
    """An 8-bit cache's file holds its values and scales as the device does (a byte a
    value and 4 bytes a position and KV head), restores into an engine of the same kind
    (the same answer as never leaving), and is refused by one of another kind."""
    path = tmp_path / "s.session"
    with trio.fail_after(TIMEOUT):
        async with Engine(llama, kv_dtype=kind, **TINY) as engine:
            assert (engine.session_header.dtype, engine.session_header.k_layout) == (kind, "tokens,kv_heads,head_dim+f32_scale")
            first = await engine.complete(PROMPT, max_tokens=8, slot=0)
            saved = await engine.save_slot(0, path)
            turn2 = PROMPT + first.token_ids + (7, 8, 9)
            expected = await engine.complete(turn2, max_tokens=8, slot=0)
        cfg = llama.config
        kv_bytes = 2 * cfg.n_layers * saved.tokens * cfg.n_kv_heads * (cfg.head_dim + 4)
        assert kv_bytes < saved.bytes < kv_bytes + 4096
        async with Engine(llama, kv_dtype=kind, **TINY) as engine:
            await engine.restore_slot(3, path)
            got = await engine.complete(turn2, max_tokens=8, slot=3)
        assert got.stats.reused_tokens == saved.tokens and got.token_ids == expected.token_ids
        for other in ({"int8": "fp8", "fp8": "int8"}[kind], "float16"):
            async with Engine(llama, kv_dtype=other, **TINY) as engine:
                with pytest.raises(SessionError, match=f"dtype: expected '{other}', found '{kind}'"):
                    await engine.restore_slot(3, path)


async def test_a_slot_in_use_cannot_be_saved_and_a_held_slot_refuses_requests(llama, tmp_path):
    with trio.fail_after(TIMEOUT):
        async with Engine(llama, **TINY) as engine:
            async with engine.stream(PROMPT, max_tokens=200, slot=0) as events:
                await events.__anext__()
                with pytest.raises(SlotBusy):
                    await engine.save_slot(0, tmp_path / "busy.session")
                async with engine.hold_slot(1):
                    with pytest.raises(SlotBusy):
                        await engine.complete(PROMPT, max_tokens=2, slot=1)
                    tokens = 0
                    async for _ in events:  # slot 0 keeps decoding while slot 1 is held
                        tokens += 1
                assert tokens > 10
            assert (await engine.complete(PROMPT, max_tokens=2, slot=1)).stats.slot == 1


async def test_erase_forgets_the_history(llama):
    with trio.fail_after(TIMEOUT):
        async with Engine(llama, **TINY) as engine:
            await engine.complete(PROMPT, max_tokens=4, slot=0)
            assert await engine.erase_slot(0) == len(PROMPT) + 3
            again = await engine.complete(PROMPT, max_tokens=4, slot=0)
            assert again.stats.reused_tokens == 0
