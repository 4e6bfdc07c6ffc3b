"""The one place that reads the command line and the environment: build_config turns a
command's flags, with the environment where a flag is not given, into its Config
(runtime/config.py), which the command passes down."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from ..runtime.config import (
    DEFAULT_BURST,
    DEFAULT_COMPILE_CACHE,
    MAX_BURST,
    ChatSettings,
    Config,
    DistributedSettings,
    ExpertSettings,
    ModelSettings,
    MuxSettings,
    SamplingSettings,
    WorkerSettings,
)
from ..runtime.serve_settings import ServeSettings
from ..runtime.split_settings import SplitSettings

DEFAULT_KV_SAVE_DIR = Path.home() / ".cache" / "motet" / "sessions"


def build_config(args, env: Mapping[str, str]) -> Config:
    """`args`: the parsed command line (flags.build_parser); `env`: the environment."""
    command = args.command
    model = model_settings(args, env)
    experts = expert_settings(args, env) if command in ("mux", "serve") else ExpertSettings()
    group = distributed_settings(args, env) if command in ("mux", "serve") else None
    if getattr(args, "prefix_cache_gb", 0.0) < 0:
        raise ValueError(f"--prefix-cache-gb must be >= 0, got {args.prefix_cache_gb}")
    if not 1 <= getattr(args, "decode_burst", DEFAULT_BURST) <= MAX_BURST:
        raise ValueError(f"--decode-burst must be in [1, {MAX_BURST}], got {args.decode_burst}")
    config = Config(command, model, experts=experts, group=group, warm_up=getattr(args, "warm_up", True),
                    share_prefixes=getattr(args, "share_prefixes", True),
                    prefix_cache_gb=getattr(args, "prefix_cache_gb", 0.0),
                    decode_burst=getattr(args, "decode_burst", DEFAULT_BURST))
    match command:
        case "chat":
            sampling = SamplingSettings(max_tokens=args.max_tokens, temperature=args.temperature,
                                        top_p=args.top_p, seed=args.seed)
            return replace(config, sampling=sampling, chat=ChatSettings(args.prompt, args.system))
        case "info":
            return replace(config, kv_slots=args.kv_slots)
        case "mux":
            mux = mux_settings(args, env, experts)
            # the model SNAP (or --model) names, at its own context: CTX is the engine's
            return replace(config, model=replace(model, path=mux.model, max_context=None), mux=mux,
                           kv_slots=1 if mux.legacy else mux.kv_slots,
                           sampling=SamplingSettings(temperature=args.temperature, top_p=args.top_p))
        case "serve":
            return replace(config, serve=serve_settings(args, env, model, experts), kv_slots=args.kv_slots)
        case "worker":
            worker = WorkerSettings(role=args.role, listen=args.listen, request_wait=args.request_wait,
                                    prefill=args.prefill)
            return replace(config, worker=worker, kv_slots=args.kv_slots)
    raise ValueError(f"no command {command!r}")


def model_settings(args, env: Mapping[str, str]) -> ModelSettings:
    cache = args.compile_cache if args.compile_cache is not None else Path(
        env.get("MOTET_COMPILE_CACHE", DEFAULT_COMPILE_CACHE))
    return ModelSettings(path=args.model, dtype=args.dtype, max_context=args.max_context,
                         compile_cache=cache if str(cache) not in ("", ".") else None,
                         mesh=args.mesh or env.get("MOTET_MESH") or None, kv_dtype=args.kv_dtype,
                         activations=args.activations)


def expert_settings(args, env: Mapping[str, str]) -> ExpertSettings:
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

    return ExpertSettings(
        mode=value("EXPERTS", args.experts, str) or "auto",
        device_experts_per_layer=value("EXPERT_CAP", args.expert_cache, int) or None,
        device_gb=value("DEVICE_GB", args.device_gb, float),
        ram_gb=value("RAM_GB", args.ram_gb, float),
        heat_file=value("HEAT_FILE", args.heat_file, Path),
        policy=value("EXPERT_POLICY", args.expert_policy, str) or "heat",
        prefetch=not args.no_prefetch and env.get("EXPERT_PREFETCH", "1") != "0",
    )


def mux_settings(args, env: Mapping[str, str], experts: ExpertSettings | None = None) -> MuxSettings:
    """`motet mux`'s: the environment a server sets (SNAP, KV_SLOTS, CTX, ...), flags winning."""
    def number(name: str, flag, default: int) -> int:
        if flag is not None:
            return flag
        try:
            return int(env.get(name, default))
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {env[name]!r}") from None

    return MuxSettings(
        model=args.model or (snap_path(env["SNAP"]) if env.get("SNAP") else None),
        legacy=env.get("SERVE") == "1" and env.get("SERVE_BATCH") != "1" and not args.batch,
        kv_slots=number("KV_SLOTS", args.kv_slots, 1),
        context=number("CTX", args.max_context, 4096),
        topk=args.topk if args.topk is not None else env.get("SERVE_TOPK") == "1",
        ngen=number("NGEN", args.ngen, 256),
        kv_save_dir=_kv_save_dir(args, env),
        experts=experts if experts is not None else expert_settings(args, env),
    )


def _kv_save_dir(args, env: Mapping[str, str]) -> Path | None:
    """KVSAVE=1 (the default) or 0; the folder from --kv-save-dir, else KVSAVE_DIR."""
    kvsave = env.get("KVSAVE", "1").strip() or "1"
    if kvsave not in ("0", "1"):
        raise ValueError(f"KVSAVE must be 0 or 1, got {env['KVSAVE']!r}")
    if kvsave == "0":
        return None
    return args.kv_save_dir or (Path(env["KVSAVE_DIR"]) if env.get("KVSAVE_DIR") else DEFAULT_KV_SAVE_DIR)


def snap_path(snap: str) -> Path:
    """SNAP: a .gguf file, a directory holding one, or a Hugging Face model directory."""
    path = Path(snap)
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    return path


def serve_settings(args, env: Mapping[str, str], model: ModelSettings, experts: ExpertSettings) -> ServeSettings:
    """Checked (e.g. no key on a public address) before the model loads."""
    extra = {"web_dir": args.web_dir} if args.web_dir is not None else {}
    return ServeSettings(
        host=args.host, port=args.port, kv_slots=args.kv_slots, max_context=args.max_context or 4096,
        queue_limit=args.queue_limit, api_key=args.api_key or env.get("MOTET_API_KEY") or None,
        allow_insecure_bind=args.allow_insecure_bind, cors_origins=tuple(args.cors_origin),
        max_body_bytes=args.max_body_bytes, engine_cmd=args.engine_cmd, model_path=args.model,
        slot_save_path=args.slot_save_path, experts=experts, **extra,
        split=SplitSettings.from_json(args.split) if args.split is not None else None,
        send_timeout_s=args.send_timeout, compile_cache=model.compile_cache, warm_up=args.warm_up,
        share_prefixes=args.share_prefixes, prefix_cache_gb=args.prefix_cache_gb, tool_parser=args.tool_parser,
        decode_burst=args.decode_burst,
    )


def distributed_settings(args, env: Mapping[str, str]) -> DistributedSettings | None:
    """From --coordinator, --num-processes, --process-id (flags win over MOTET_COORDINATOR,
    MOTET_NUM_PROCESSES, MOTET_PROCESS_ID); None when none is given."""
    given: dict[str, str | int] = {}
    for flag, name in (("coordinator", "MOTET_COORDINATOR"), ("num_processes", "MOTET_NUM_PROCESSES"),
                       ("process_id", "MOTET_PROCESS_ID")):
        value = getattr(args, flag, None)
        if value is None and env.get(name, "").strip():
            value = env[name].strip()
            if flag != "coordinator":
                try:
                    value = int(value)
                except ValueError:
                    raise ValueError(f"{name} must be an integer, got {env[name]!r}") from None
        if value is not None:
            given[flag] = value
    if not given:
        return None
    missing = [f"--{flag.replace('_', '-')}" for flag in ("coordinator", "num_processes", "process_id")
               if flag not in given]
    if missing:
        raise ValueError(f"several processes need --coordinator, --num-processes and --process-id "
                         f"together (or their MOTET_ variables); missing: {', '.join(missing)}")
    return DistributedSettings(str(given["coordinator"]), int(given["num_processes"]), int(given["process_id"]))
