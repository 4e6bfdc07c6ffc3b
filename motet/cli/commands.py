"""Each command: its settings from the flags, then the parts it runs."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from ..actors.device_group import DistributedSettings, join_group
from ..runtime.config import ExpertSettings, ModelSettings, SamplingSettings
from .flags import expert_settings, model_settings, sampling_settings

log = logging.getLogger("motet")


def open_model(settings: ModelSettings, lazy_experts: bool = False):
    from ..model import load_model
    from ..model.compilation import use_compile_cache

    use_compile_cache(settings.compile_cache)  # before the first compile: loading places weights

    log.info("loading %s", settings.path or "the default model (SmolLM2-135M-Instruct)")
    return load_model(settings.path, dtype=settings.dtype, max_context=settings.max_context,
                      lazy_experts=lazy_experts and settings.mesh is None, mesh=settings.mesh,
                      kv_dtype=settings.kv_dtype)


def cmd_info(args) -> int:
    from ..actors.warmup import WarmupPlan
    from ..engines.engine import PREFILL_CHUNK
    from ..model.kv import KVGeometry, kv_bytes_per_position
    from ..model.loader import kernel_name

    model = open_model(model_settings(args))
    info = model.info()
    formats = info.pop("tensor_formats")
    width = max(map(len, info))
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    print(f"tensors (quantized products: {kernel_name()}):")
    for group, g in formats.items():
        print(f"  {group:<16} {'+'.join(g['formats']):<12} {g['values']:>12,} values {g['bytes']:>14,} bytes "
              f"({8 * g['bytes'] / g['values']:.2f} bits each)")
    print(f"bytes read per decode token: {info['decode_bytes'] / 1e6:.1f} MB of weights")
    context = min(args.max_context or 4096, model.config.max_context)
    geo = KVGeometry(n_slots=args.kv_slots, max_context=context, chunk=PREFILL_CHUNK)
    per_position = kv_bytes_per_position(model.config, model.kv_dtype)
    kv_mb = per_position * geo.length * (args.kv_slots + 1) / 1e6
    print(f"KV cache: {model.kv_dtype}, {per_position:,} bytes a position; {args.kv_slots} slots of {context} "
          f"(and a scratch slot, {geo.length} positions each): {kv_mb:.1f} MB")
    print(f"compiled before ready ({args.kv_slots} KV slots, context {context}, prefill chunks of "
          f"{PREFILL_CHUNK}; experts resident):")
    for line in WarmupPlan.of(geo).describe():
        print(f"  {line}")
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


def cmd_chat(args) -> int:
    sampling = sampling_settings(args)
    model = open_model(model_settings(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    if args.prompt is not None:
        _answer(model, messages + [{"role": "user", "content": args.prompt}], sampling)
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


def _snap_path(snap: str) -> Path:
    """SNAP: a .gguf file, a directory holding one, or a Hugging Face model directory."""
    path = Path(snap)
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    return path


SHUTDOWN_GRACE_S = 5.0  # after SIGTERM/SIGINT, requests in flight get this long to finish
DEFAULT_KV_SAVE_DIR = Path.home() / ".cache" / "motet" / "sessions"


@dataclass(frozen=True)
class MuxSettings:
    """`motet mux`'s settings: the environment a server sets, the flags winning."""

    model: Path | None
    legacy: bool  # SERVE=1 without SERVE_BATCH=1
    kv_slots: int
    context: int
    topk: bool
    ngen: int
    kv_save_dir: Path | None  # KVSAVE: each slot's session persists here; None: KVSAVE=0
    experts: ExpertSettings = ExpertSettings()

    @classmethod
    def from_args(cls, args, env) -> MuxSettings:
        def number(name: str, flag, default: int) -> int:
            if flag is not None:
                return flag
            try:
                return int(env.get(name, default))
            except ValueError:
                raise ValueError(f"{name} must be an integer, got {env[name]!r}") from None

        return cls(
            model=args.model or (_snap_path(env["SNAP"]) if env.get("SNAP") else None),
            legacy=env.get("SERVE") == "1" and env.get("SERVE_BATCH") != "1" and not args.batch,
            kv_slots=number("KV_SLOTS", args.kv_slots, 1),
            context=number("CTX", args.max_context, 4096),
            topk=args.topk if args.topk is not None else env.get("SERVE_TOPK") == "1",
            ngen=number("NGEN", args.ngen, 256),
            kv_save_dir=cls._kv_save_dir(args, env),
            experts=expert_settings(args, env),
        )

    @staticmethod
    def _kv_save_dir(args, env) -> Path | None:
        """KVSAVE=1 (the default) or 0; the folder from --kv-save-dir, else KVSAVE_DIR."""
        kvsave = env.get("KVSAVE", "1").strip() or "1"
        if kvsave not in ("0", "1"):
            raise ValueError(f"KVSAVE must be 0 or 1, got {env['KVSAVE']!r}")
        if kvsave == "0":
            return None
        return args.kv_save_dir or (Path(env["KVSAVE_DIR"]) if env.get("KVSAVE_DIR") else DEFAULT_KV_SAVE_DIR)


def cmd_mux(args, mirror=None) -> int:
    """mirror: on process 0 of a group, where the runner sends its device calls."""
    import trio

    from ..actors.legacy_bridge import LegacyBridge, LegacySettings
    from ..actors.stdio_bridge import BridgeSettings, StdioBridge
    from ..engines.engine import Engine

    mux = MuxSettings.from_args(args, os.environ)
    if not 1 <= mux.kv_slots <= 16:
        raise ValueError(f"KV_SLOTS must be in [1, 16], got {mux.kv_slots}")
    settings = model_settings(args)
    from ..model.compilation import use_compile_cache

    use_compile_cache(settings.compile_cache)
    # stdout carries the protocol only: keep a private handle to it, and point fd 1 (and
    # anything a library prints there) at stderr.
    protocol_fd = os.dup(1)
    os.dup2(2, 1)
    from ..model import ModelError, ModelFileError, UnsupportedModelError, load_model

    try:
        loaded = load_model(mux.model, dtype=args.dtype, mesh=args.mesh, kv_dtype=args.kv_dtype,
                            lazy_experts=mux.experts.mode != "resident" and args.mesh is None)
    except (ModelError, OSError, MemoryError) as exc:
        # An extension servers may read instead of READY; the reason also goes to stderr.
        kind = ("nomem" if isinstance(exc, MemoryError)
                else "unsupported" if isinstance(exc, UnsupportedModelError)
                else "format" if isinstance(exc, ModelFileError) and Path(str(mux.model or "")).exists()
                else "io")
        detail = " ".join(str(exc).split())
        os.write(protocol_fd, f"LOAD_FAIL kind={kind} {detail}\n".encode())
        print(f"motet: error: {exc}", file=sys.stderr)
        return 2

    async def serve():
        kv_slots = 1 if mux.legacy else mux.kv_slots
        async with Engine(loaded, kv_slots=kv_slots, max_context=mux.context, experts=mux.experts,
                          mesh=args.mesh, mirror=mirror, compile_cache=settings.compile_cache,
                          warm_up=args.warm_up) as engine:
            stdin = trio.lowlevel.FdStream(os.dup(0))
            stdout = trio.lowlevel.FdStream(protocol_fd)
            if mux.legacy:
                sampling = LegacySettings(ngen=mux.ngen, temperature=args.temperature, top_p=args.top_p)
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


def cmd_serve(args, mirror=None) -> int:
    from ..http.settings import ServeSettings
    from ..runtime.split_settings import SplitSettings
    from .compose import run_serve

    extra = {"web_dir": args.web_dir} if args.web_dir is not None else {}
    settings = ServeSettings(
        host=args.host, port=args.port, kv_slots=args.kv_slots, max_context=args.max_context or 4096,
        queue_limit=args.queue_limit, api_key=args.api_key or os.environ.get("MOTET_API_KEY") or None,
        allow_insecure_bind=args.allow_insecure_bind, cors_origins=tuple(args.cors_origin),
        max_body_bytes=args.max_body_bytes, engine_cmd=args.engine_cmd, model_path=args.model,
        slot_save_path=args.slot_save_path, experts=expert_settings(args, os.environ), **extra,
        split=SplitSettings.from_json(args.split) if args.split is not None else None,
        send_timeout_s=args.send_timeout, compile_cache=model_settings(args).compile_cache, warm_up=args.warm_up,
    )  # checked (e.g. no key on a public address) before the model loads
    lazy = settings.experts.mode != "resident"  # tiered or not is decided once the model is known
    in_process = args.engine_cmd is None and settings.split is None
    model = open_model(model_settings(args), lazy) if in_process else None
    return run_serve(settings, model, mirror)


def cmd_worker(args) -> int:
    from .compose import run_worker

    return run_worker(args, model_settings(args).compile_cache)


def in_group(command):
    """The command as one process of a group when the flags (or MOTET_ variables) name one:
    jax.distributed first of all, then process 0 runs `command(args, mirror)` and the
    others follow it (docs/scaling.md)."""

    def run(args) -> int:
        group_settings = DistributedSettings.from_args(args, os.environ)
        if group_settings is None:
            return command(args)
        if getattr(args, "engine_cmd", None) is not None or getattr(args, "split", None) is not None:
            raise ValueError("a group of processes serves with the in-process engine: "
                             "leave out --engine-cmd and --split")
        with join_group(group_settings, args.mesh) as group:
            if group.leader:
                return command(args, group.send)
            return follow_leader(args, group)

    return run


def follow_leader(args, group) -> int:
    """A process > 0 of a group: the model loaded as process 0 loads it, then process 0's
    device calls, repeated until it stops."""
    from ..actors.follower import follow

    settings = model_settings(args)
    if args.command == "mux":  # mux loads SNAP (or --model) at the model's own context
        settings = replace(settings, path=MuxSettings.from_args(args, os.environ).model, max_context=None)
    follow(open_model(settings), group.receive)
    return 0
