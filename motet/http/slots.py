"""llama.cpp's slot routes: a KV slot saved to a file, restored from one, or erased.

    POST /slots/{id_slot}?action=save     {"filename": "a.bin"}  id_slot, filename, n_saved,
                                                                 n_written, timings.save_ms
    POST /slots/{id_slot}?action=restore  {"filename": "a.bin"}  id_slot, filename, n_restored,
                                                                 n_read, timings.restore_ms
    POST /slots/{id_slot}?action=erase                           id_slot, n_erased

Files live in the folder given by `--slot-save-path` (`ServeSettings.slot_save_path`) and
never outside it: a filename must be a plain name (`check_filename` says why not), and
once joined to the folder and resolved (links followed) it must still lie directly in
the folder. Without the folder, save and restore are a 501; erase needs none.

Written against the engine API only (save_slot, restore_slot, erase_slot, statistics),
so the in-process Engine and a MuxEngine plug in alike.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import trio
from quart import request

from ..protocol.session_file import SessionError
from ..runtime.engine_api import EngineAPI
from ..runtime.errors import EngineError
from .errors import ApiError, InvalidRequest, from_slot_file

log = logging.getLogger(__name__)

ACTIONS = ("save", "restore", "erase")
# With the temporary file's "." prefix and random suffix, still under NAME_MAX (255 bytes)
MAX_FILENAME_BYTES = 200
# What check_filename accepts, as the OpenAPI document states it (lengths apart)
FILENAME_PATTERN = r"^[^./\\\x00-\x1f\x7f][^/\\\x00-\x1f\x7f]*$"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SLOT_ID = re.compile(r"[0-9]{1,9}")


def check_filename(name: object) -> str:
    """`name` when it is a plain file name; an InvalidRequest saying why it is not."""
    def refuse(why: str):
        return InvalidRequest(f"'filename' {why}", "filename")

    if name is None:
        raise refuse("is required: the name of a file in the slot folder, e.g. \"chat.bin\"")
    if not isinstance(name, str):
        raise refuse("must be a string: the name of a file in the slot folder")
    if name == "":
        raise refuse("is empty")
    if "/" in name or "\\" in name:
        raise refuse("must be a plain file name, without '/' or '\\'")
    if name.startswith("."):
        raise refuse("may not start with '.' (so '.' and '..' are refused too)")
    if _CONTROL.search(name):
        raise refuse("may not hold control characters (NUL included)")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate, from JSON's "\ud800"
        raise refuse("is not valid Unicode text") from None
    if size > MAX_FILENAME_BYTES:
        raise refuse(f"is {size} bytes long in UTF-8; at most {MAX_FILENAME_BYTES} are allowed")
    return name


def parse_slot(text: str, slots: int) -> int:
    """The slot the path names; an InvalidRequest unless it is one of the `slots`."""
    if _SLOT_ID.fullmatch(text) is None or (slot := int(text)) >= slots:
        raise InvalidRequest(f"the slot id must be an integer in [0, {slots - 1}]; got {text!r}", "id_slot")
    return slot


async def folder_path(folder: Path, name: str) -> Path:
    """`folder / name`, refused when a link there leads out of the folder (`folder` is
    resolved already)."""
    path = folder / name
    if Path(await trio.Path(path).resolve()).parent != folder:
        raise InvalidRequest("'filename' names a link that leads out of the slot folder", "filename")
    return path


async def json_body() -> dict[str, object]:
    data = await request.get_data(cache=False)  # 413 past the limit, 408 past the timeout
    if not data.strip():
        return {}
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        raise InvalidRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object, e.g. {\"filename\": \"chat.bin\"}")
    return body


class SlotRoutes:
    """The slot actions of one app."""

    def __init__(self, engine: EngineAPI, settings):
        self.engine = engine
        self.folder: Path | None = settings.slot_save_path
        self.retry_after_s = settings.retry_after_s

    async def post(self, id_slot: str) -> dict | ApiError:
        """`POST /slots/{id_slot}?action=...`: the answer, or the error to send."""
        slot = parse_slot(id_slot, self.engine.statistics().slots_total)
        action = request.args.get("action")
        if action not in ACTIONS:
            given = "none was given" if action is None else f"got {action!r}"
            raise InvalidRequest(f"the query parameter 'action' must be save, restore or erase; {given}",
                                 "action")
        if action == "erase":
            try:
                erased = await self.engine.erase_slot(slot)
            except EngineError as exc:
                return from_slot_file(exc, action, None, self.retry_after_s)
            return {"id_slot": slot, "n_erased": erased}
        if self.folder is None:
            return ApiError(501, f"slot files are off: the server was started without --slot-save-path, "
                            f"so '{action}' is not available (erase is)", type="not_supported_error",
                            code="not_supported")
        filename = check_filename((await json_body()).get("filename"))
        path = await folder_path(self.folder, filename)
        try:
            if action == "save":
                done = await self.engine.save_slot(slot, path)
            else:
                done = await self.engine.restore_slot(slot, path)
        except (SessionError, OSError, EngineError) as exc:
            error = from_slot_file(exc, action, filename, self.retry_after_s)
            if error.status >= 500:  # the answer names the file only; the log says where
                log.warning("slot %d: the %s of %s failed: %s", slot, action, path, exc)
            return error
        if action == "save":
            return {"id_slot": slot, "filename": filename, "n_saved": done.tokens, "n_written": done.bytes,
                    "timings": {"save_ms": done.ms}}
        return {"id_slot": slot, "filename": filename, "n_restored": done.tokens, "n_read": done.bytes,
                "timings": {"restore_ms": done.ms}}
