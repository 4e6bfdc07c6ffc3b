"""A SplitEngine over two `motet mux` children, one a role."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path

from ..runtime.split_settings import RoleArgs, SplitSettings
from .chat_files import ChatFiles
from .split import SplitEngine
from .supervisor import OpenEngine


def mux_command() -> tuple[str, ...]:
    return (sys.executable, "-m", "motet", "mux")


def open_split_engines(settings: SplitSettings, model_path: str | Path | None, *, kv_slots: int,
                       max_context: int, command: Sequence[str] | str | None = None,
                       env: Mapping[str, str] | None = None, queue_limit: int = 64, **split_kwargs) -> SplitEngine:
    """A SplitEngine over two `motet mux` children (or `command`) on `model_path` (None:
    the default model), started by `async with`. Each child gets CTX=max_context KVSAVE=0,
    then `env`, then its role's KEY=VALUE entries and flags; with devices given,
    CUDA_VISIBLE_DEVICES=<its device>. `split_kwargs` go to SplitEngine."""
    from .mux_engine import MuxEngine

    base = tuple(shlex.split(command) if isinstance(command, str) else command or mux_command())
    # The split hands sessions over itself: no child keeps its slots between runs unless
    # the decode role's args ask (KVSAVE=1, KVSAVE_DIR=...)
    common = {"CTX": str(max_context), "KVSAVE": "0", **(env or {})}
    if model_path is not None:
        common["SNAP"] = str(model_path)

    def opener(device: int | None, args: RoleArgs) -> OpenEngine:
        role_env = {**common, **args.env}
        if device is not None:
            role_env["CUDA_VISIBLE_DEVICES"] = str(device)
        return partial(MuxEngine, base + args.flags, env=role_env, kv_slots=kv_slots,
                       chat_model=model_path, queue_limit=queue_limit)

    return SplitEngine(opener(settings.prefill_device, settings.prefill_args),
                       opener(settings.decode_device, settings.decode_args), settings,
                       encode=ChatFiles(model_path).encode, queue_limit=queue_limit, **split_kwargs)
