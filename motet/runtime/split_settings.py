"""Split serving's settings (`motet serve --split '<JSON>'`), each misuse refused with a
sentence that says why. SplitEngine (split.py) runs them.

  prefill_device, decode_device  accelerator numbers, different: both or neither (neither:
                                 both engines run on what the host offers, such as the CPU)
  min_prompt_tokens              hand a prompt over only when the decode engine would read
                                 at least this many new tokens itself (default 2048)
  dir                            a fresh folder for the session files is made in it, and
                                 removed at close (default: /dev/shm when it has over 2 GiB
                                 free, else the temp folder)
  prefill_args, decode_args      one role's extra `motet mux` arguments: "KEY=VALUE" for its
                                 environment ("RAM_GB=8") or "--flag[=value]" for its command
                                 line ("--experts=tiered"). What a session file must match
                                 (SNAP/--model, CTX/--max-context, KV_SLOTS/--kv-slots,
                                 --dtype, --kv-dtype, JAX_PLATFORMS) may be given only alike
                                 in both.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

MIN_PROMPT_TOKENS = 2048
SHM = Path("/dev/shm")
SHM_MIN_FREE = 2 << 30  # bytes /dev/shm must have free to hold the session files

# ---- settings ------------------------------------------------------------------------

KEYS = ("prefill_device", "decode_device", "min_prompt_tokens", "dir", "prefill_args", "decode_args")
ENV_KEY = re.compile(r"[A-Z_][A-Z0-9_]*\Z")
# What both engines must agree on, since a session file restores only into an engine of
# the same weights and KV shape: (what it is, its environment key, its `motet mux` flag).
MUST_MATCH = (
    ("the model", "SNAP", "--model"),
    ("the context length", "CTX", "--max-context"),
    ("the number of KV slots", "KV_SLOTS", "--kv-slots"),
    ("the weights' dtype", None, "--dtype"),
    ("the weights' quantization", None, "--quantize"),
    ("the KV cache's dtype", None, "--kv-dtype"),
    ("the JAX backend", "JAX_PLATFORMS", None),
)
SET_BY_SPLIT = {  # per-role entries the split sets itself: why they cannot be given
    "SERVE": "the split talks to its engines through the mux protocol and sets SERVE itself",
    "SERVE_BATCH": "the split talks to its engines through the mux protocol and sets SERVE_BATCH itself",
    "SERVE_TOPK": "the split talks to its engines through the mux protocol and sets SERVE_TOPK itself",
    "--batch": "the split talks to its engines through the mux protocol and sets --batch itself",
    "--topk": "the split talks to its engines through the mux protocol and sets --topk itself",
    "CUDA_VISIBLE_DEVICES": "each engine's accelerator is given by prefill_device and decode_device",
}
ROLE_FLAGS = ("--experts", "--device-gb", "--ram-gb", "--heat-file", "--expert-policy", "--no-prefetch",
              "--compile-cache", "--model", "--max-context", "--kv-slots", "--dtype",
              "--quantize", "--kv-dtype")


class SplitConfigError(ValueError):
    """A split configuration that cannot run; the message is a sentence saying why."""


@dataclass(frozen=True)
class RoleArgs:
    """One role's extra `motet mux` arguments: environment entries and flags."""

    env: Mapping[str, str] = field(default_factory=dict)
    flags: tuple[str, ...] = ()

    @classmethod
    def parse(cls, key: str, entries) -> RoleArgs:
        """`entries`: a list of "KEY=VALUE" (the child's environment) and "--flag" or
        "--flag=value" (its command line) strings."""
        if isinstance(entries, str) or not isinstance(entries, (list, tuple)):
            raise SplitConfigError(f'{key} must be a list of strings such as "RAM_GB=8" or "--experts=tiered", '
                                   f"not {entries!r}.")
        env, flags = {}, []
        for entry in entries:
            if not isinstance(entry, str):
                raise SplitConfigError(f"{key} holds {entry!r}, which is not a string; write each entry as "
                                       '"KEY=VALUE" or "--flag=value".')
            name = entry.split("=", 1)[0]
            if reason := SET_BY_SPLIT.get(name):
                raise SplitConfigError(f"{key} cannot set {name}: {reason}.")
            if entry.startswith("--"):
                if name not in ROLE_FLAGS:
                    raise SplitConfigError(f"{key} holds {name}, which is not a motet mux flag a role can take "
                                           f"(those are {', '.join(ROLE_FLAGS)}).")
                flags.append(entry)
            elif "=" in entry and ENV_KEY.match(name):
                env[name] = entry.split("=", 1)[1]
            else:
                raise SplitConfigError(f"{key} holds {entry!r}, which is neither KEY=VALUE nor --flag[=value]; "
                                       'write a flag and its value as one entry, as in "--ram-gb=8".')
        return cls(env, tuple(flags))

    def value(self, env_key: str | None, flag: str | None) -> str | None:
        """What these arguments set for a setting (the flag wins, as in `motet mux`)."""
        for entry in reversed(self.flags):
            if flag is not None and (entry == flag or entry.startswith(flag + "=")):
                return entry.split("=", 1)[1] if "=" in entry else ""
        return self.env.get(env_key) if env_key is not None else None


def _count(key: str, value, least: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise SplitConfigError(f"{key} must be {what} ({least} or more), not {value!r}.")
    return value


@dataclass(frozen=True)
class SplitSettings:
    """The `--split` option, checked once here: every refusal is a SplitConfigError."""

    prefill_device: int | None = None  # accelerator numbers; None and None: both on the CPU
    decode_device: int | None = None
    min_prompt_tokens: int = MIN_PROMPT_TOKENS
    dir: Path | None = None  # a fresh folder is made in it (default: /dev/shm, else the temp folder)
    prefill_args: RoleArgs = RoleArgs()
    decode_args: RoleArgs = RoleArgs()

    def __post_init__(self):
        for key in ("prefill_device", "decode_device"):
            if getattr(self, key) is not None:
                _count(key, getattr(self, key), 0, "an accelerator number")
        _count("min_prompt_tokens", self.min_prompt_tokens, 1, "a whole number of tokens")
        if (self.prefill_device is None) != (self.decode_device is None):
            raise SplitConfigError("give both prefill_device and decode_device, or neither (then both engines "
                                   "run on what the host offers them, such as the CPU).")
        if self.prefill_device is not None and self.prefill_device == self.decode_device:
            raise SplitConfigError(f"prefill_device and decode_device are both accelerator {self.decode_device}; "
                                   "each engine needs an accelerator of its own.")
        if self.dir is not None and self.dir.exists() and not self.dir.is_dir():
            raise SplitConfigError(f"dir {str(self.dir)!r} is a file, not a folder for session files.")
        if self.prefill_args.env.get("KVSAVE", "0").strip() not in ("", "0"):
            raise SplitConfigError("prefill_args cannot set KVSAVE: the prefill engine's slots only pass prompts "
                                   "on, and keeping them between runs would only cost time.")
        for what, env_key, flag in MUST_MATCH:
            prefill, decode = self.prefill_args.value(env_key, flag), self.decode_args.value(env_key, flag)
            if prefill != decode:
                name = " / ".join(n for n in (env_key, flag) if n)
                raise SplitConfigError(
                    f"prefill_args and decode_args set {name} differently ({_shown(prefill)} and "
                    f"{_shown(decode)}): both engines must agree on {what}, since a session file only "
                    "restores into an engine of the same weights and KV shape.")

    @classmethod
    def from_dict(cls, raw) -> SplitSettings:
        if not isinstance(raw, dict):
            raise SplitConfigError(f'the split settings must be a JSON object such as {{"prefill_device": 0, '
                                   f'"decode_device": 1}}, not {raw!r}.')
        for key in raw:
            if key not in KEYS:
                raise SplitConfigError(f"the split settings have no key {key!r}; the known keys are "
                                       f"{', '.join(KEYS)}.")
        folder = raw.get("dir")
        if folder is not None and (not isinstance(folder, str) or not folder.strip()):
            raise SplitConfigError(f"dir must be the name of a folder, not {folder!r}.")
        return cls(
            prefill_device=raw.get("prefill_device"), decode_device=raw.get("decode_device"),
            min_prompt_tokens=raw.get("min_prompt_tokens", MIN_PROMPT_TOKENS),
            dir=Path(folder) if folder is not None else None,
            prefill_args=RoleArgs.parse("prefill_args", raw.get("prefill_args", [])),
            decode_args=RoleArgs.parse("decode_args", raw.get("decode_args", [])),
        )

    @classmethod
    def from_json(cls, text: str) -> SplitSettings:
        """What `motet serve --split '{...}'` gives."""
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise SplitConfigError(f"the split settings are not valid JSON ({exc}); write them as "
                                   '{"prefill_device": 0, "decode_device": 1}.') from None
        return cls.from_dict(raw)

    def make_dir(self) -> Path:
        """A fresh folder for this split's session files (the caller removes it)."""
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            return Path(tempfile.mkdtemp(prefix="motet-split-", dir=self.dir))
        try:
            if os.access(SHM, os.W_OK) and shutil.disk_usage(SHM).free > SHM_MIN_FREE:
                return Path(tempfile.mkdtemp(prefix="motet-split-", dir=SHM))
        except OSError:
            pass
        return Path(tempfile.mkdtemp(prefix="motet-split-"))


def _shown(value: str | None) -> str:
    return "unset" if value is None else repr(value)
