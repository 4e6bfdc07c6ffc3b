"""HTTP errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and
the one table from the engine's typed errors to statuses. Pure: no I/O.

Statuses: a bad field or prompt is a 400 (`param` names it); a full queue is a 429 with
Retry-After; a pinned `cache_slot` that another request holds is a 409 with Retry-After
(it is not load, it is a conflict with that one request, and OpenAI clients retry 409 as
they retry 429); a closing engine is a 503 with Retry-After.

A slot file (`/slots/{id_slot}`): a file the engine refuses to restore is a 400 with its
reason, a missing one a 404, and a file system that fails a 500 saying so in a sentence
(the folder's path stays in the server's log).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..protocol.session_file import SessionError
from ..runtime.errors import (
    BadRequest,
    Cancelled,
    ContextExceeded,
    DuplicateId,
    EmptyPrompt,
    EngineClosed,
    EngineError,
    NotFound,
    QueueFull,
    SlotBusy,
)


class InvalidRequest(Exception):
    """A request field that is wrong: a 400 naming it (`param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class ApiError:
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def from_engine(exc: EngineError, prompt_param: str, retry_after_s: int) -> ApiError:
    """The answer to an engine's refusal; `prompt_param` is the field holding the prompt
    (`messages` or `prompt`)."""
    message = str(exc)
    match exc:
        case ContextExceeded():
            return ApiError(400, message, param=prompt_param, code="context_length_exceeded")
        case EmptyPrompt():
            return ApiError(400, message, param=prompt_param, code="empty_prompt")
        case BadRequest():
            return ApiError(400, message, code="bad_request")
        case SlotBusy():
            return ApiError(409, message, param="cache_slot", code="slot_busy",
                            retry_after_s=retry_after_s)
        case DuplicateId():
            return ApiError(409, message, code="duplicate_id")
        case QueueFull():
            return ApiError(429, message, type="rate_limit_error", code="queue_full",
                            retry_after_s=retry_after_s)
        case EngineClosed():  # shutting_down; engine_exited, engine_unavailable (a mux child)
            return ApiError(503, message, type="server_error", code=exc.code.lower(),
                            retry_after_s=retry_after_s)
        case Cancelled():
            return ApiError(503, message, type="server_error", code="cancelled")
        case NotFound():
            return ApiError(404, message, type="not_found_error", code="not_found")
    return ApiError(500, message, type="server_error", code=exc.code.lower())


def from_slot_file(exc: SessionError | OSError | EngineError, action: str, filename: str | None,
                   retry_after_s: int) -> ApiError:
    """The answer to a failed `action` (save, restore, erase) of a slot on `filename` (a
    plain name in the slot folder; None for erase)."""
    match exc:
        case SessionError():
            return ApiError(400, f"the file {filename!r} cannot be restored: {exc}", param="filename",
                            code="invalid_session_file")
        case FileNotFoundError() if action == "restore":
            return ApiError(404, f"there is no file {filename!r} in the slot folder", type="not_found_error",
                            param="filename", code="file_not_found")
        case IsADirectoryError():
            return ApiError(400, f"{filename!r} is a folder in the slot folder, not a file",
                            param="filename", code="is_a_folder")
        case OSError():
            done = "saved to" if action == "save" else "restored from"
            reason = exc.strerror or type(exc).__name__
            return ApiError(500, f"the slot could not be {done} {filename!r}: {reason}", type="server_error",
                            code="file_error")
        case SlotBusy():
            return ApiError(409, f"{exc}: a request or another slot action holds it", param="id_slot",
                            code="slot_busy", retry_after_s=retry_after_s)
        case BadRequest():
            return ApiError(400, str(exc), param="id_slot", code="bad_request")
    return from_engine(exc, "id_slot", retry_after_s)
