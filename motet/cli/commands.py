"""Each command: the parts it runs, with its Config (cli/config.py built it)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from ..actors.device_group import join_group
from ..runtime.config import Config, ModelSettings, SamplingSettings

log = logging.getLogger("motet")


def open_model(settings: ModelSettings, lazy_experts: bool = False):
    from ..model import load_model
    from ..model.compilation import use_compile_cache

    use_compile_cache(settings.compile_cache)  # before the first compile: loading places weights

    log.info("loading %s", settings.path or "the default model (SmolLM2-135M-Instruct)")
    return load_model(settings.path, dtype=settings.dtype, max_context=settings.max_context,
                      lazy_experts=lazy_experts, mesh=settings.mesh,
                      kv_dtype=settings.kv_dtype, activations=settings.activations)


def cmd_info(config: Config) -> int:
    from ..actors.warmup import WarmupPlan
    from ..engines.engine_args import PREFILL_CHUNK, lone_prompt_chunk
    from ..model.kv import KVGeometry, kv_bytes_per_position
    from ..model.loader import kernel_name

    model = open_model(config.model)
    info = model.info()
    formats = info.pop("tensor_formats")
    width = max(map(len, info))
    lines = [f"{key:<{width}}  {value}" for key, value in info.items()]
    x = "int8 per 32 values where AVX2's kernels take it" if model.config.x_bits == 8 else "int16 per 32 values"
    lines.append(f"tensors (quantized products: {kernel_name()}; x rounded to {x}):")
    lines += [f"  {group:<16} {', '.join(g['formats']):<12} {g['values']:>12,} values {g['bytes']:>14,} bytes "
              f"({8 * g['bytes'] / g['values']:.2f} bits each)" for group, g in formats.items()]
    lines.append(f"bytes read per decode token: {info['decode_bytes'] / 1e6:.1f} MB of weights")
    slots = config.kv_slots
    context = min(config.model.max_context or 4096, model.config.max_context)
    alone = lone_prompt_chunk(None, PREFILL_CHUNK, any(model.config.moe_layers))
    geo = KVGeometry(n_slots=slots, max_context=context, chunk=alone)
    per_position = kv_bytes_per_position(model.config, model.kv_dtype)
    kv_mb = per_position * geo.length * (slots + 1) / 1e6
    lines.append(f"KV cache: {model.kv_dtype}, {per_position:,} bytes a position; {slots} slots of {context} "
                 f"(and a scratch slot, {geo.length} positions each): {kv_mb:.1f} MB")
    lines.append(f"compiled before ready ({slots} KV slots, context {context}, prefill chunks of up to {alone}, "
                 f"{PREFILL_CHUNK} while streams decode; experts resident):")
    lines += [f"  {line}" for line in WarmupPlan.of(geo, burst=config.decode_burst).describe()]
    sys.stdout.write("\n".join(lines) + "\n")  # the answer the user asked for, as chat's is
    return 0


def _answer(model, messages: list[dict], sampling: SamplingSettings) -> str:
    from ..model.detokenizer import IncrementalDetokenizer
    from ..model.generate import generate

    ids = model.tokenizer.encode(model.render_chat(messages))
    detok = IncrementalDetokenizer(model.tokenizer)
    parts = []
    for token in generate(model, ids, max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                          top_p=sampling.top_p, seed=sampling.seed):
        text = detok.push(token)
        if text:
            parts.append(text)
            sys.stdout.write(text)
            sys.stdout.flush()
    tail = detok.flush()
    parts.append(tail)
    sys.stdout.write(tail + "\n")
    sys.stdout.flush()
    return "".join(parts)


def cmd_chat(config: Config) -> int:
    assert config.chat is not None  # a chat command's config has its part
    sampling, chat = config.sampling, config.chat
    model = open_model(config.model)
    messages = [{"role": "system", "content": chat.system}] if chat.system else []
    if chat.prompt is not None:
        _answer(model, messages + [{"role": "user", "content": chat.prompt}], sampling)
        return 0
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        messages.append({"role": "assistant", "content": _answer(model, messages, sampling)})


SHUTDOWN_GRACE_S = 5.0  # after SIGTERM/SIGINT, requests in flight get this long to finish


def cmd_mux(config: Config, mirror=None) -> int:
    """mirror: on process 0 of a group, where the runner sends its device calls."""
    import trio

    from ..actors.legacy_bridge import LegacyBridge, LegacySettings
    from ..actors.stdio_bridge import BridgeSettings, StdioBridge
    from ..engines.engine import Engine

    assert config.mux is not None  # a mux command's config has its part
    mux, settings = config.mux, config.model
    from ..model.compilation import use_compile_cache

    use_compile_cache(settings.compile_cache)
    # stdout carries the protocol only: keep a private handle to it, and point fd 1 (and
    # anything a library prints there) at stderr.
    protocol_fd = os.dup(1)
    os.dup2(2, 1)
    from ..model import ModelError, ModelFileError, UnsupportedModelError, load_model

    try:
        loaded = load_model(settings.path, dtype=settings.dtype, mesh=settings.mesh, kv_dtype=settings.kv_dtype,
                            activations=settings.activations,
                            lazy_experts=mux.experts.mode != "resident")
    except (ModelError, OSError, MemoryError) as exc:
        # An extension servers may read instead of READY; the reason also goes to stderr.
        kind = ("nomem" if isinstance(exc, MemoryError)
                else "unsupported" if isinstance(exc, UnsupportedModelError)
                else "format" if isinstance(exc, ModelFileError) and Path(str(settings.path or "")).exists()
                else "io")
        detail = " ".join(str(exc).split())
        os.write(protocol_fd, f"LOAD_FAIL kind={kind} {detail}\n".encode())
        sys.stderr.write(f"motet: error: {exc}\n")
        return 2

    async def serve():
        async with Engine(loaded, kv_slots=config.kv_slots, max_context=mux.context, experts=mux.experts,
                          mesh=settings.mesh, mirror=mirror, compile_cache=settings.compile_cache,
                          warm_up=config.warm_up, share_prefixes=config.share_prefixes,
                          prefix_cache_gb=config.prefix_cache_gb, decode_burst=config.decode_burst) as engine:
            stdin = trio.lowlevel.FdStream(os.dup(0))
            stdout = trio.lowlevel.FdStream(protocol_fd)
            if mux.legacy:
                sampling = LegacySettings(ngen=mux.ngen, temperature=config.sampling.temperature,
                                          top_p=config.sampling.top_p)
                bridge = LegacyBridge(engine, sampling, stdin, stdout)
            else:
                bridge = StdioBridge(engine, BridgeSettings(topk=mux.topk, kv_save_dir=mux.kv_save_dir),
                                     stdin, stdout)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_stop_on_signal, bridge.intake, nursery.cancel_scope)
                await bridge.run()
                nursery.cancel_scope.cancel()

    trio.run(serve)
    return 0


async def _stop_on_signal(intake, scope):
    """The first SIGTERM/SIGINT stops reading and gives requests in flight a grace period;
    a second one ends them now."""
    import signal

    import trio

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            if intake.reading.cancel_called:
                log.warning("second signal: stopping now")
                intake.shutdown(0.0)
            else:
                log.info("%s: finishing requests in flight (at most %.0f s)",
                         signal.Signals(signum).name, SHUTDOWN_GRACE_S)
                intake.shutdown(SHUTDOWN_GRACE_S)


def cmd_serve(config: Config, mirror=None) -> int:
    from .compose import run_serve

    settings = config.serve
    assert settings is not None  # a serve command's config has its part
    lazy = settings.experts.mode != "resident"  # tiered or not is decided once the model is known
    in_process = settings.engine_cmd is None and settings.split is None
    model = open_model(config.model, lazy) if in_process else None
    return run_serve(settings, model, mirror)


def cmd_worker(config: Config) -> int:
    from .compose import run_worker

    return run_worker(config)


def in_group(command):
    """The command as one process of a group when its config names one (the flags or
    MOTET_ variables): jax.distributed first of all, then process 0 runs
    `command(config, mirror)` and the others follow it (docs/scaling.md)."""

    def run(config: Config) -> int:
        if config.group is None:
            return command(config)
        if config.serve is not None and (config.serve.engine_cmd is not None or config.serve.split is not None):
            raise ValueError("a group of processes serves with the in-process engine: "
                             "leave out --engine-cmd and --split")
        with join_group(config.group, config.model.mesh) as group:
            if group.leader:
                return command(config, group.send)
            return follow_leader(config.model, config.experts.mode != "resident", group)

    return run


def follow_leader(model: ModelSettings, lazy_experts: bool, group) -> int:
    """A process > 0 of a group: the model loaded as process 0 loads it (its experts left
    in the file until process 0's plan says where they go), then process 0's device
    calls, repeated until it stops."""
    from ..actors.follower import follow

    follow(open_model(model, lazy_experts), group.receive)
    return 0
