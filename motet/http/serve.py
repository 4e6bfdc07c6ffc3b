"""`motet serve`: the app on Hypercorn's Trio worker, the engine in the same Trio loop.

    serve_app(engine, settings)  serves until its shutdown trigger returns or its scope is
                                 cancelled; started with `nursery.start`, it reports the
                                 URLs it bound (port 0 picks a free one)
    banner(url, model, ...)      what the command prints once it listens (motet/cli/compose.py
                                 opens the engine and runs the app)

Shutdown: the first SIGINT or SIGTERM stops accepting connections, answers new requests
503, and gives streams in flight `shutdown_grace_s` to finish; then the engine drains.
A second signal aborts at once.
"""

from __future__ import annotations

import logging
import signal

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from ..runtime.engine_api import EngineAPI
from ..runtime.serve_settings import ServeSettings
from .app import create_app
from .send_timeout import SendTimeout


def hypercorn_config(settings: ServeSettings) -> Config:
    config = Config()
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    config.bind = [f"{host}:{settings.port}"]
    # A connection idle this long before its request's headers are complete is closed
    # (Hypercorn keeps its idle timer running until the headers are in), and the headers
    # may not exceed max_header_bytes. Hypercorn's `read_timeout` is left unset: it bounds
    # every socket read, also while a long answer streams and the client rightly sends
    # nothing. A slow body is bounded by the app's BODY_TIMEOUT instead.
    config.keep_alive_timeout = settings.header_timeout_s
    config.h11_max_incomplete_size = settings.max_header_bytes
    config.graceful_timeout = settings.shutdown_grace_s
    config.accesslog = None
    # Hypercorn's errors through logging, formatted and filtered as the rest of motet's
    # (a name, not "-", so it adds no stderr handler of its own)
    config.errorlog = logging.getLogger("hypercorn.error")
    return config


async def serve_app(engine: EngineAPI, settings: ServeSettings, *, shutdown_trigger=None,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve `engine` over HTTP until `shutdown_trigger()` returns (never when None: until
    the caller's scope is cancelled). `task_status.started` gets the bound URLs. The slot
    folder (`slot_save_path`) is created first when it is missing."""
    if settings.slot_save_path is not None:  # an OSError here is the command's error
        await trio.Path(settings.slot_save_path).mkdir(parents=True, exist_ok=True)
    app = create_app(engine, settings)
    server = app.extensions["motet"]

    async def closing():
        await shutdown_trigger()
        server.closing = True  # requests still arriving on open connections get a 503

    # Each write of a response is bounded: a client that stops reading loses its request
    await hypercorn_serve(SendTimeout(app, settings.send_timeout_s), hypercorn_config(settings),
                          task_status=task_status,
                          shutdown_trigger=closing if shutdown_trigger is not None else None)


async def wait_for_signal() -> None:
    """Returns at the first SIGINT or SIGTERM; the next one interrupts as usual."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return


def banner(url: str, model: str, with_key: bool) -> str:
    """What `motet serve` prints once it listens: where, and how to call it."""
    auth = " -H \"Authorization: Bearer $MOTET_API_KEY\"" if with_key else ""
    key = "os.environ['MOTET_API_KEY']" if with_key else "'none'"
    body = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'
    return (
        f"motet: serving {model} at {url} (web page: {url}/, metrics: {url}/metrics)\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'\n"
        f"  python -c \"import os; from openai import OpenAI; "
        f"c = OpenAI(base_url='{url}/v1', api_key={key}); "
        f"print(c.chat.completions.create(model='{model}', "
        f"messages=[{{'role': 'user', 'content': 'Hello!'}}]).choices[0].message.content)\"\n"
    )
