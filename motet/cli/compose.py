"""Composition: which engine a command runs, opened around the front that serves it.
The fronts (http/, wire/) see only EngineAPI; this is where the engines are chosen."""

from __future__ import annotations

import logging
import signal
import sys
from contextlib import asynccontextmanager
from functools import partial

import trio

from ..engines.restarting import RestartingEngine
from ..http.serve import banner, serve_app, wait_for_signal
from ..runtime.config import Config, WorkerSettings
from ..runtime.groups import sole, sole_error
from ..runtime.serve_settings import ServeSettings
from ..wire.worker import Worker

log = logging.getLogger("motet")


@asynccontextmanager
async def open_engine(settings: ServeSettings, model, mirror=None):
    """The in-process Engine around `model` (`mirror`: process 0 of a group, Engine's),
    or `engine_cmd` driven through a MuxEngine
    that is started again whenever the child exits, or with `split` a SplitEngine over two
    of them (`engine_cmd`, default `motet mux`)."""
    if settings.split is not None:
        from ..engines.split_children import open_split_engines

        async with open_split_engines(settings.split, settings.model_path, kv_slots=settings.kv_slots,
                                      max_context=settings.max_context, command=settings.engine_cmd,
                                      queue_limit=settings.queue_limit) as engine:
            yield engine
        return
    if settings.engine_cmd is None:
        from ..engines.engine import Engine

        async with Engine(model, kv_slots=settings.kv_slots, max_context=settings.max_context,
                          queue_limit=settings.queue_limit, experts=settings.experts,
                          mirror=mirror, compile_cache=settings.compile_cache,
                          warm_up=settings.warm_up, share_prefixes=settings.share_prefixes,
                          prefix_cache_gb=settings.prefix_cache_gb, decode_burst=settings.decode_burst) as engine:
            yield engine
        return
    from ..engines.mux_engine import MuxEngine

    env = {"CTX": str(settings.max_context)}
    if settings.model_path is not None:
        env["SNAP"] = str(settings.model_path)
    mux = partial(MuxEngine, settings.engine_cmd, env=env, kv_slots=settings.kv_slots,
                  chat_model=settings.model_path, queue_limit=settings.queue_limit)
    engine = RestartingEngine(mux, kv_slots=settings.kv_slots)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            try:
                yield engine
            finally:
                engine.close()  # the child drains and exits; run() returns
    except BaseExceptionGroup as group:  # one error (a child that cannot start): itself
        raise sole(group) from None


def run_serve(settings: ServeSettings, model=None, mirror=None) -> int:
    """`motet serve`: `model` is a loaded Model (None with `engine_cmd`); `mirror`: on
    process 0 of a group, where the engine's runner sends its device calls."""

    async def main():
        async with open_engine(settings, model, mirror) as engine:
            async with trio.open_nursery() as nursery:
                urls = await nursery.start(partial(serve_app, engine, settings,
                                                   shutdown_trigger=wait_for_signal))
                for url in urls:
                    sys.stderr.write(banner(url, engine.name, settings.api_key is not None))
                sys.stderr.flush()

    try:
        try:
            trio.run(main)
        except BaseExceptionGroup as group:  # one error (Ctrl+C, a taken port): itself
            raise sole(group) from None
    except OSError as exc:  # the port is taken, the address is not ours, no such command
        sys.stderr.write(f"motet: error: {exc}\n")
        return 2
    return 0


# ---- motet worker --------------------------------------------------------------------


def run_worker(config: Config) -> int:
    settings, model = config.worker, config.model
    assert settings is not None  # a worker command's config has its part
    engine = dict(kv_slots=config.kv_slots, max_context=model.max_context or 4096, dtype=model.dtype,
                  kv_dtype=model.kv_dtype, activations=model.activations, mesh=model.mesh,
                  compile_cache=model.compile_cache,
                  warm_up=config.warm_up, share_prefixes=config.share_prefixes,
                  prefix_cache_gb=config.prefix_cache_gb, decode_burst=config.decode_burst)
    try:
        with sole_error():
            trio.run(serve_worker, model.path, engine, settings)
    except OSError as exc:  # the address is taken or not ours
        print(f"motet: error: {exc}", file=sys.stderr)
        return 2
    return 0


async def serve_worker(model, engine_kwargs: dict, settings: WorkerSettings) -> None:
    """Serve until SIGINT or SIGTERM; then stop accepting, and the engine drains."""
    from ..engines.engine import Engine

    async with Engine(model, **engine_kwargs) as engine:
        async with trio.open_nursery() as nursery:
            address = await nursery.start(Worker(engine, settings).serve)
            print(f"listening on {address}", file=sys.stderr, flush=True)
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    log.info("%s: stopping", signal.Signals(signum).name)
                    break
            nursery.cancel_scope.cancel()
