"""ServeSettings: everything `motet serve` needs, a part of the command's Config (built
once in cli/config.py and passed down); validated here, once."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import motet

from .config import DEFAULT_BURST, ExpertSettings
from .split_settings import SplitSettings

DEFAULT_WEB_DIR = Path(motet.__file__).resolve().parent / "web"
# What one request may ask by default (http/openai_schema.py checks it)
MAX_STOPS = 4
MAX_MESSAGES = 256
MAX_STOP_CHARS = 256
MAX_PROMPT_CHARS = 1 << 20
ToolFamily = Literal["hermes", "llama3_json", "mistral"]  # the formats tool calls are read in
TOOL_FAMILIES: tuple[ToolFamily, ...] = ("hermes", "llama3_json", "mistral")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve to anything


@dataclass(frozen=True)
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    kv_slots: int = 16
    max_context: int = 4096
    queue_limit: int = 64  # requests waiting for a slot; past it, 429
    api_key: str | None = field(default=None, repr=False)  # never in a repr, hence never in a log
    allow_insecure_bind: bool = False
    cors_origins: tuple[str, ...] = ()  # exact origins; "*" only when given
    max_body_bytes: int = 1 << 20  # past it, 413
    body_timeout_s: float = 30.0  # a request body not read in full by then: 408
    header_timeout_s: float = 10.0  # a connection idle before its headers are complete
    max_header_bytes: int = 16 << 10
    send_timeout_s: float = 30.0  # one write of a response not taken by then (a client that
    # stopped reading): the connection is closed and its request cancelled
    experts: ExpertSettings = ExpertSettings()  # where a MoE model's experts live (in-process)
    # What one request may ask (past a limit: a 400 naming the field); max_tokens is
    # bounded by max_context
    max_messages: int = MAX_MESSAGES
    max_stops: int = MAX_STOPS
    max_stop_chars: int = MAX_STOP_CHARS
    max_prompt_chars: int = MAX_PROMPT_CHARS  # characters, before tokenizing
    shutdown_grace_s: float = 10.0  # streams in flight may finish within this on shutdown
    default_max_tokens: int = 4096  # when a request gives none; the context ends a turn too
    retry_after_s: int = 1  # the Retry-After of 429/409/503 answers
    web_dir: Path = DEFAULT_WEB_DIR
    engine_cmd: str | None = None  # a mux engine command line; None: the in-process Engine
    model_path: Path | None = None  # with engine_cmd: the child's model (SNAP), and the chat
    # template rendered here; None: the default model
    slot_save_path: Path | None = None  # the folder of POST /slots/{id}?action=save|restore
    # files (created when serving starts); None: those answer 501, erase still works
    split: SplitSettings | None = None  # --split: a prefill and a decode engine (split.py)
    compile_cache: Path | None = None  # the in-process engine's JAX compilation cache; None: off
    warm_up: bool = True  # the in-process engine compiles every shape before it serves
    share_prefixes: bool = True  # the in-process engine copies prefixes between slots
    prefix_cache_gb: float = 0.0  # and keeps those pushed out of its slots in host RAM
    decode_burst: int = DEFAULT_BURST  # and the most decode steps of one stream a device call takes
    tool_parser: ToolFamily | None = None  # the format of the model's tool calls (http/tool_calls.py);
    # None: the one its chat template asks for

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.kv_slots < 1:
            raise ValueError(f"kv_slots must be at least 1, got {self.kv_slots}")
        if self.queue_limit < 0:
            raise ValueError(f"queue_limit must be >= 0, got {self.queue_limit}")
        for name in ("max_context", "max_body_bytes", "max_header_bytes", "max_messages",
                     "max_stop_chars", "max_prompt_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.tool_parser not in (None, *TOOL_FAMILIES):
            raise ValueError(f"tool_parser must be one of {', '.join(TOOL_FAMILIES)}, got {self.tool_parser!r}")
        for name in ("body_timeout_s", "header_timeout_s", "send_timeout_s"):
            if not getattr(self, name) > 0:  # also refuses NaN
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_stops < 0:
            raise ValueError(f"max_stops must be >= 0, got {self.max_stops}")
        if self.slot_save_path is not None:
            folder = Path(self.slot_save_path).resolve()  # absolute, links followed, once
            if folder.exists() and not folder.is_dir():
                raise ValueError(f"--slot-save-path {folder} exists and is not a folder")
            object.__setattr__(self, "slot_save_path", folder)
        if self.api_key == "":
            raise ValueError("the API key is empty")
        if self.api_key is None and not self.allow_insecure_bind and not is_loopback(self.host):
            raise ValueError(
                f"refusing to serve on {self.host} without an API key: anyone who can reach "
                "it could use the model. Give --api-key (or MOTET_API_KEY), bind 127.0.0.1, "
                "or pass --allow-insecure-bind"
            )
