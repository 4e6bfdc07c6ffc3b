"""What the HTTP tests share: servers over the tiny llama or the default model, on the
in-process Engine or a `motet mux` child (conftest.py's `serve_tiny` and `serve_smol`
fixtures hand them out), the official openai clients, and reading server-sent events."""

from __future__ import annotations

import json
import shlex
from contextlib import asynccontextmanager
from functools import partial

import httpx
import openai
import trio
from conftest import MUX_COMMAND

from motet.cli.compose import open_engine
from motet.engines.engine import Engine
from motet.http.serve import serve_app
from motet.runtime.serve_settings import ServeSettings

# as tests/engine_helpers.py, without the warm-up (tests/test_warm_start.py covers it)
TINY = dict(kv_slots=4, max_context=256, prefill_chunk=16, prefill_chunk_alone=16, warm_up=False)
SMOL = dict(kv_slots=16, max_context=512, prefill_chunk=64, prefill_chunk_alone=64, warm_up=False)
TIMEOUT = 240  # seconds; a hang fails the test instead of the suite
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]
MUX_CMD = shlex.join(MUX_COMMAND)  # `motet mux`, sharing the tests' compilation cache


@asynccontextmanager
async def serving(engine, **settings):
    """The app for `engine` on a free loopback port; yields its base URL."""
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(partial(serve_app, engine, ServeSettings(port=0, **settings)))
        yield urls[0]
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def engine_server(model, engine_kw, **settings):
    """The server over an in-process Engine; yields (engine, url)."""
    with trio.fail_after(TIMEOUT):
        async with Engine(model, **engine_kw) as engine, serving(engine, **settings) as url:
            yield engine, url


def tiny_server(llama, engine_kw=TINY, **settings):
    return engine_server(llama, engine_kw, **settings)


@asynccontextmanager
async def mux_server(model_path, engine_kw=TINY, **settings):
    """The server over `motet mux` running `model_path`, opened as `motet serve
    --engine-cmd` opens it (a RestartingEngine); yields (engine, url). The child takes
    the slots, context and queue limit of `engine_kw`, not its prefill chunk."""
    geometry = {k: engine_kw[k] for k in ("kv_slots", "max_context", "queue_limit") if k in engine_kw}
    settings = ServeSettings(port=0, engine_cmd=MUX_CMD, model_path=model_path, **geometry, **settings)
    with trio.fail_after(TIMEOUT):
        async with open_engine(settings, None) as engine, trio.open_nursery() as nursery:
            url = (await nursery.start(partial(serve_app, engine, settings)))[0]
            yield engine, url
            nursery.cancel_scope.cancel()


def sync_client(url: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


def async_client(url: str, **kw) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


async def in_thread(fn, *args, **kwargs):
    return await trio.to_thread.run_sync(partial(fn, *args, **kwargs))


async def sse_objects(response: httpx.Response) -> list:
    """The data of each server-sent event: JSON objects, and the final "[DONE]"."""
    out = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", line  # events are `data:` lines and blank separators only
    return out


async def wait_until(predicate, poll_s: float = 0.01):
    while not predicate():
        await trio.sleep(poll_s)
