"""Settings built once from the command line (or by an embedding program) and passed down:
each layer's part, and the one Config of a `motet` command that holds them (built in
cli/config.py, the only code that reads the flags and the environment)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

from .addresses import parse_address
from .api import sampling_problem

# The most decode steps of one stream a device call takes (model/burst.py), by default
# and at most: a burst's tokens reach the caller together.
DEFAULT_BURST, MAX_BURST = 4, 16

if TYPE_CHECKING:  # it holds an ExpertSettings: its module imports this one
    from .serve_settings import ServeSettings

# JAX's persistent compilation cache, for every entry point (the CLI's --compile-cache and
# MOTET_COMPILE_CACHE move it; Engine(compile_cache=...) too).
DEFAULT_COMPILE_CACHE = Path.home() / ".cache" / "motet" / "jax"


# auto: quantized weights as the file holds them; float32 / bfloat16 dequantize;
# int8 / int4 (--quantize): auto, with the file's float tensors quantized at load
WeightFormat = Literal["auto", "float32", "bfloat16", "int8", "int4"]
# the KV cache's element type; auto: float16 under quantized weights, else the weights'
KVDtype = Literal["auto", "float32", "float16", "bfloat16", "int8", "fp8"]  # runtime/kv_format.py
# what the quantized products round x to (model/loader.py ACTIVATIONS)
Activations = Literal["int16", "int8"]
ExpertMode = Literal["auto", "resident", "tiered"]
ExpertPolicyKind = Literal["heat", "lru"]  # actors/expert_policy.py


@dataclass(frozen=True)
class ModelSettings:
    path: Path | None = None  # None: the embedded default model
    dtype: WeightFormat = "auto"
    max_context: int | None = None  # None: the model's own
    compile_cache: Path | None = None  # JAX's persistent compilation cache
    mesh: str | None = None  # shard over devices, "ep=2,tp=2" (docs/scaling.md); None: one device
    kv_dtype: KVDtype = "auto"
    activations: Activations = "int16"

    def __post_init__(self):
        if self.dtype not in get_args(WeightFormat):
            raise ValueError(f"dtype must be auto, float32, bfloat16, int8 or int4, got {self.dtype!r}")
        if self.kv_dtype not in get_args(KVDtype):
            raise ValueError(f"kv_dtype must be auto, float32, float16, bfloat16, int8 or fp8, got {self.kv_dtype!r}")
        if self.activations not in get_args(Activations):
            raise ValueError(f"activations must be int16 or int8, got {self.activations!r}")
        if self.max_context is not None and self.max_context < 16:
            raise ValueError(f"max_context must be at least 16, got {self.max_context}")


@dataclass(frozen=True)
class SamplingSettings:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if (problem := sampling_problem(self.max_tokens, self.temperature, self.top_p)) is not None:
            raise ValueError(problem)


EXPERT_MODES = get_args(ExpertMode)


@dataclass(frozen=True)
class ExpertSettings:
    """Where a MoE model's experts live. `auto` keeps every expert on the device unless a
    budget (experts per layer, or device GB) says they do not fit; then the model runs
    tiered: a pool of experts per layer on the device, the rest in host RAM (up to
    ram_gb; None: no limit) and on disk (read from the mmapped model file)."""

    mode: ExpertMode = "auto"
    device_experts_per_layer: int | None = None  # None or 0: no limit
    device_gb: float | None = None  # the device budget for weights (shared + expert pools)
    ram_gb: float | None = None  # host RAM for experts off the device; None: no limit
    # Heat persists here; None: next to the model in tiered mode (a cache folder when the
    # model's folder is read-only), nowhere in resident mode.
    heat_file: Path | None = None
    heat_cache_dir: Path = Path.home() / ".cache" / "motet" / "heat"
    policy: ExpertPolicyKind = "heat"
    prefetch: bool = True

    def __post_init__(self):
        if self.mode not in EXPERT_MODES:
            raise ValueError(f"expert mode must be one of {', '.join(EXPERT_MODES)}, got {self.mode!r}")
        if self.device_experts_per_layer is not None and self.device_experts_per_layer < 0:
            raise ValueError(f"device experts per layer must be >= 0, got {self.device_experts_per_layer}")
        for name in ("device_gb", "ram_gb"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.heat_file is not None:
            object.__setattr__(self, "heat_file", Path(self.heat_file))
        if self.policy not in ("heat", "lru"):
            raise ValueError(f"expert policy must be heat or lru, got {self.policy!r}")


# ---- each command's own settings ------------------------------------------------------


@dataclass(frozen=True)
class ChatSettings:
    prompt: str | None  # one-shot; None: an interactive loop
    system: str | None = None  # a system message


@dataclass(frozen=True)
class MuxSettings:
    """`motet mux`'s: the environment a server sets (cli/config.py: SNAP, KV_SLOTS, CTX,
    SERVE_TOPK, NGEN, KVSAVE...), the flags winning."""

    model: Path | None
    legacy: bool  # SERVE=1 without SERVE_BATCH=1
    kv_slots: int
    context: int
    topk: bool
    ngen: int
    kv_save_dir: Path | None  # KVSAVE: each slot's session persists here; None: KVSAVE=0
    experts: ExpertSettings = ExpertSettings()

    def __post_init__(self):
        if not 1 <= self.kv_slots <= 16:
            raise ValueError(f"KV_SLOTS must be in [1, 16], got {self.kv_slots}")


WorkerRole = Literal["mono", "prefill", "decode"]
WORKER_ROLES = get_args(WorkerRole)
REQUEST_WAIT_S = 600.0  # how long a caller waits for a request's answer on the TCP wire


@dataclass(frozen=True)
class WorkerSettings:
    role: WorkerRole
    listen: str  # HOST:PORT; port 0 picks a free one
    request_wait: float = REQUEST_WAIT_S  # the longest wait on a peer's answer
    prefill: str | None = None  # decode: the prefill worker a request names none

    def __post_init__(self):
        if self.role not in WORKER_ROLES:
            raise ValueError(f"a worker's role is one of {', '.join(WORKER_ROLES)}, not {self.role!r}")
        if self.listen is not None:
            parse_address(self.listen, listening=True)
        if self.prefill is not None:
            parse_address(self.prefill)
        if not self.request_wait > 0:
            raise ValueError(f"the request wait is a positive number of seconds, not {self.request_wait}")


@dataclass(frozen=True)
class DistributedSettings:
    """Where a group of processes meets and who this process is in it (docs/scaling.md)."""

    coordinator: str  # HOST:PORT of process 0's coordination service
    num_processes: int
    process_id: int

    def __post_init__(self):
        if isinstance(self.num_processes, bool) or not isinstance(self.num_processes, int) \
                or self.num_processes < 1:
            raise ValueError(f"the number of processes must be a positive integer, got {self.num_processes!r}")
        if isinstance(self.process_id, bool) or not isinstance(self.process_id, int) \
                or not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"the process id must be in [0, {self.num_processes - 1}] for "
                             f"{self.num_processes} processes, got {self.process_id!r}")
        parse_address(self.coordinator, "the coordinator address")

    @property
    def leader(self) -> bool:
        return self.process_id == 0


# ---- the one Config ---------------------------------------------------------------------

Command = Literal["chat", "info", "mux", "serve", "worker"]


@dataclass(frozen=True)
class Config:
    """Everything one `motet` command runs with: built once from its flags and the
    environment (cli/config.py, the only code that reads either) and passed down, each
    part to the layer that takes it. The parts a command has no use for keep their
    defaults (None for another command's own)."""

    command: Command
    model: ModelSettings
    sampling: SamplingSettings = SamplingSettings()
    experts: ExpertSettings = ExpertSettings()
    kv_slots: int = 16  # the engine's KV slots
    warm_up: bool = True  # the engine compiles every shape before it serves
    share_prefixes: bool = True  # a prompt's prefix another slot holds is copied, not read again
    prefix_cache_gb: float = 0.0  # host RAM for prefixes pushed out of the slots
    decode_burst: int = DEFAULT_BURST  # the most decode steps of one stream a device call takes
    group: DistributedSettings | None = None  # one process of a group
    chat: ChatSettings | None = None
    mux: MuxSettings | None = None
    serve: ServeSettings | None = None
    worker: WorkerSettings | None = None
