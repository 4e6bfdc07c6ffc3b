"""The `motet` command: builds settings from flags and composes the parts.

stdout carries only what the user asked for (answers, info); logs go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from .actors.device_group import DistributedSettings, join_group
from .runtime.config import DEFAULT_COMPILE_CACHE, EXPERT_MODES, ExpertSettings, ModelSettings, SamplingSettings

log = logging.getLogger("motet")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None,
                   help="a .gguf file or a Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="auto: a quantized GGUF's weights stay quantized (computed in float32); "
                        "float32 or bfloat16: every weight dequantized to that type")
    p.add_argument("--quantize", choices=("int8", "int4"), default=None,
                   help="quantize the weights a checkpoint holds as floats (bf16/f32 safetensors, "
                        "F16/F32 GGUF) at load: weight-only, a scale per 32 values")
    p.add_argument("--kv-dtype", choices=("auto", "float32", "float16", "bfloat16"), default="auto",
                   help="the KV cache's element type (auto: float16 under quantized weights, as "
                        "llama.cpp's cache; otherwise the weights' dtype)")
    p.add_argument("--max-context", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--compile-cache", type=Path,
                   default=Path(os.environ.get("MOTET_COMPILE_CACHE", DEFAULT_COMPILE_CACHE)),
                   help="JAX's persistent compilation cache (MOTET_COMPILE_CACHE; '' turns it off)")
    p.add_argument("--mesh", default=os.environ.get("MOTET_MESH") or None, metavar="ep=N,tp=M",
                   help="shard the model over this process's devices: experts along ep, heads and FFN "
                   "widths along tp (MOTET_MESH; docs/scaling.md)")


def _add_warm_up_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="be ready before compiling every shape (requests then wait while each new one compiles)")


def _add_group_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="several processes as one engine: process 0's address for jax.distributed "
                   "(MOTET_COORDINATOR; docs/scaling.md)")
    p.add_argument("--num-processes", type=int, default=None, metavar="N",
                   help="processes in the group (MOTET_NUM_PROCESSES); --mesh then spans all their devices")
    p.add_argument("--process-id", type=int, default=None, metavar="I",
                   help="this process, 0 to N-1 (MOTET_PROCESS_ID): 0 serves, the others follow it")


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)


def _add_expert_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experts", choices=EXPERT_MODES, default=None,
                   help="expert placement (EXPERTS; default auto: tiered only when over a budget)")
    p.add_argument("--device-gb", type=float, default=None, help="device budget for the weights, GB (DEVICE_GB)")
    p.add_argument("--ram-gb", type=float, default=None, help="host RAM for experts off the device, GB (RAM_GB)")
    p.add_argument("--heat-file", type=Path, default=None,
                   help="where expert heat persists (HEAT_FILE; default: next to the model when tiered)")
    p.add_argument("--expert-policy", choices=("heat", "lru"), default=None, help="EXPERT_POLICY (default heat)")
    p.add_argument("--no-prefetch", action="store_true", default=None,
                   help="do not guess the next layer's experts (EXPERT_PREFETCH=0)")


def expert_settings(args, env) -> ExpertSettings:
    """Flags win over the environment; the positional cap is the mux servers' expert-cache size."""
    def value(name: str, flag, kind):
        if flag is not None:
            return flag
        if not env.get(name):
            return None
        try:
            return kind(env[name])
        except ValueError:
            raise ValueError(f"{name} must be a {kind.__name__}, got {env[name]!r}") from None

    heat = value("HEAT_FILE", args.heat_file, Path)
    return ExpertSettings(
        mode=value("EXPERTS", args.experts, str) or "auto",
        device_experts_per_layer=value("EXPERT_CAP", args.expert_cache, int) or None,
        device_gb=value("DEVICE_GB", args.device_gb, float),
        ram_gb=value("RAM_GB", args.ram_gb, float),
        heat_file=heat,
        policy=value("EXPERT_POLICY", args.expert_policy, str) or "heat",
        prefetch=not args.no_prefetch and env.get("EXPERT_PREFETCH", "1") != "0",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="motet", description="motet: an MoE LLM inference engine")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="answer a prompt (or chat interactively), streamed")
    chat.add_argument("prompt", nargs="?", help="one-shot prompt; without it, an interactive loop")
    chat.add_argument("--system", default=None, help="a system message")
    _add_model_flags(chat)
    _add_sampling_flags(chat)
    info = sub.add_parser("info", help="describe the model, and what an engine would compile for it")
    info.add_argument("--kv-slots", type=int, default=16, help="the engine's KV slots (what it compiles)")
    _add_model_flags(info)
    muxp = sub.add_parser("mux", help="serve the mux protocol on stdin/stdout (SNAP, KV_SLOTS, CTX, "
                          "SERVE_TOPK from the environment; flags win)")
    muxp.add_argument("expert_cache", nargs="?", type=int, default=None,
                      help="experts per MoE layer on the device (EXPERT_CAP; 0 or absent: no limit)")
    _add_expert_flags(muxp)
    muxp.add_argument("--kv-slots", type=int, default=None, help="KV slots, 1-16 (KV_SLOTS; default 1)")
    muxp.add_argument("--topk", action="store_true", default=None, help="a TOPK line per token (SERVE_TOPK=1)")
    muxp.add_argument("--batch", action="store_true", help="the mux protocol even without SERVE_BATCH=1")
    muxp.add_argument("--ngen", type=int, default=None,
                      help="legacy protocol: tokens per answer to a chat line (NGEN; default 256)")
    _add_model_flags(muxp)
    muxp.add_argument("--kv-save-dir", type=Path, default=None,
                      help="where each slot's session persists (KVSAVE_DIR; default ~/.cache/motet/sessions; "
                      "KVSAVE=0 turns persistence off)")
    muxp.add_argument("--temperature", type=float, default=0.0, help="legacy protocol chat lines: 0 = greedy")
    muxp.add_argument("--top-p", type=float, default=1.0, help="legacy protocol chat lines")
    _add_group_flags(muxp)
    _add_warm_up_flag(muxp)
    servep = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (and the web page)")
    servep.add_argument("--host", default="127.0.0.1")
    servep.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    servep.add_argument("--kv-slots", type=int, default=16)
    servep.add_argument("--api-key", default=None, help="required on /v1, /experts, /metrics (MOTET_API_KEY)")
    servep.add_argument("--allow-insecure-bind", action="store_true",
                        help="serve on a non-loopback address without an API key")
    servep.add_argument("--cors-origin", action="append", default=[], help="an allowed origin (repeatable)")
    servep.add_argument("--max-body-bytes", type=int, default=1 << 20)
    servep.add_argument("--queue-limit", type=int, default=64, help="requests waiting for a slot (past it: 429)")
    servep.add_argument("--web-dir", type=Path, default=None,
                        help="the folder served at / (default: the page shipped in the package, motet/web/)")
    servep.add_argument("--engine-cmd", default=None, help='a mux engine to drive, e.g. "motet mux"')
    servep.add_argument("--send-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="close a connection whose client takes no bytes of an answer for this long "
                        "(its request is cancelled, its slot freed)")
    servep.add_argument("--split", default=None, metavar="JSON",
                        help='split serving: a prefill and a decode engine, e.g. \'{"prefill_device": 0, '
                        '"decode_device": 1, "min_prompt_tokens": 2048}\' (\'{}\': defaults; README)')
    servep.add_argument("--slot-save-path", type=Path, default=None,
                        help="the folder of POST /slots/{id}?action=save|restore files (created if missing)")
    servep.add_argument("--expert-cap", dest="expert_cache", type=int, default=None,
                        help="experts per MoE layer on the device (EXPERT_CAP; 0 or absent: no limit)")
    _add_expert_flags(servep)
    _add_model_flags(servep)
    _add_group_flags(servep)
    _add_warm_up_flag(servep)
    workerp = sub.add_parser("worker", help="a prefill, decode or mono worker on the TCP wire (docs/wire.md)")
    workerp.add_argument("--role", choices=("mono", "prefill", "decode"), required=True)
    workerp.add_argument("--listen", required=True, metavar="HOST:PORT",
                         help="where to listen (port 0 picks a free one; 'listening on HOST:PORT' goes to stderr)")
    workerp.add_argument("--kv-slots", type=int, default=4, help="KV slots, 1-16: requests served at once")
    workerp.add_argument("--request-wait", type=float, default=600.0,
                         help="seconds a decode worker waits for its prefill worker (default 600)")
    workerp.add_argument("--prefill", default=None, metavar="HOST:PORT",
                         help="decode: the prefill worker (a request's prefill= key wins)")
    _add_model_flags(workerp)
    _add_warm_up_flag(workerp)
    return parser


def model_settings(args) -> ModelSettings:
    cache = args.compile_cache if str(args.compile_cache) not in ("", ".") else None
    return ModelSettings(path=args.model, dtype=args.dtype, max_context=args.max_context, compile_cache=cache,
                         mesh=args.mesh, kv_dtype=args.kv_dtype)


def sampling_settings(args) -> SamplingSettings:
    return SamplingSettings(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)


def open_model(settings: ModelSettings, lazy_experts: bool = False):
    from .model import load_model
    from .model.compilation import use_compile_cache

    use_compile_cache(settings.compile_cache)  # before the first compile: loading places weights

    log.info("loading %s", settings.path or "the default model (SmolLM2-135M-Instruct)")
    return load_model(settings.path, dtype=settings.dtype, max_context=settings.max_context,
                      lazy_experts=lazy_experts and settings.mesh is None, mesh=settings.mesh,
                      kv_dtype=settings.kv_dtype)


def cmd_info(args) -> int:
    from .actors.warmup import WarmupPlan
    from .engines.engine import PREFILL_CHUNK
    from .model.kv import KVGeometry, kv_bytes_per_position
    from .model.loader import kernel_name

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
    from .model.detokenizer import IncrementalDetokenizer
    from .model.generate import generate

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

    from .actors.legacy_bridge import LegacyBridge, LegacySettings
    from .actors.stdio_bridge import BridgeSettings, StdioBridge
    from .engines.engine import Engine

    mux = MuxSettings.from_args(args, os.environ)
    if not 1 <= mux.kv_slots <= 16:
        raise ValueError(f"KV_SLOTS must be in [1, 16], got {mux.kv_slots}")
    settings = model_settings(args)
    from .model.compilation import use_compile_cache

    use_compile_cache(settings.compile_cache)
    # stdout carries the protocol only: keep a private handle to it, and point fd 1 (and
    # anything a library prints there) at stderr.
    protocol_fd = os.dup(1)
    os.dup2(2, 1)
    from .model import ModelError, ModelFileError, UnsupportedModelError, load_model

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
    from .http.serve import run
    from .http.settings import ServeSettings
    from .runtime.split_settings import SplitSettings

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
    return run(settings, model, mirror)


def cmd_worker(args) -> int:
    from .wire.worker import run_worker

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
    from .actors.follower import follow

    settings = model_settings(args)
    if args.command == "mux":  # mux loads SNAP (or --model) at the model's own context
        settings = replace(settings, path=MuxSettings.from_args(args, os.environ).model, max_context=None)
    follow(open_model(settings), group.receive)
    return 0


COMMANDS = {"chat": cmd_chat, "info": cmd_info, "mux": in_group(cmd_mux), "serve": in_group(cmd_serve),
            "worker": cmd_worker}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "quantize", None):  # one weight format passed down: --dtype's
        if args.dtype != "auto":
            parser.error(f"--quantize {args.quantize} computes in float32 from quantized weights; "
                         f"it cannot go with --dtype {args.dtype}")
        args.dtype = args.quantize
    logging.basicConfig(stream=sys.stderr, level=logging.DEBUG if args.verbose else logging.INFO,
                        format="motet: %(message)s")
    # JAX reports each accelerator plugin it did not find; that is not news on a CPU host.
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
    from .model.errors import ModelError

    try:
        return COMMANDS[args.command](args)
    except (ModelError, ValueError) as exc:
        print(f"motet: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
