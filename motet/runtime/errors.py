"""The engine API's typed errors. Each has a stable code; the mux protocol and the HTTP
server map these codes 1:1 to their own (`ERROR <id> <CODE>`, HTTP statuses)."""

from __future__ import annotations


class EngineError(Exception):
    code = "ENGINE_ERROR"


class BadRequest(EngineError):
    code = "BAD_REQUEST"


class EmptyPrompt(EngineError):
    code = "EMPTY_PROMPT"

    def __init__(self, message: str = "the prompt is empty"):
        super().__init__(message)


class SlotBusy(EngineError):
    code = "SLOT_BUSY"

    def __init__(self, slot: int):
        super().__init__(f"KV slot {slot} is busy")
        self.slot = slot


class DuplicateId(EngineError):
    code = "DUPLICATE_ID"

    def __init__(self, request_id: int):
        super().__init__(f"request id {request_id} is already in flight")
        self.request_id = request_id


class ContextExceeded(EngineError):
    code = "CONTEXT_EXCEEDED"

    def __init__(self, used: int, limit: int):
        super().__init__(f"the prompt needs {used} tokens; the context holds {limit}")
        self.used = used
        self.limit = limit


class QueueFull(EngineError):
    code = "QUEUE_FULL"

    def __init__(self, limit: int):
        super().__init__(f"every KV slot is busy and {limit} requests already wait")
        self.limit = limit


class NotFound(EngineError):
    code = "NOT_FOUND"

    def __init__(self, request_id: int):
        super().__init__(f"no request with id {request_id} is in flight")
        self.request_id = request_id


class Cancelled(EngineError):
    code = "CANCELLED"

    def __init__(self, request_id: int | None = None):
        super().__init__("the request was cancelled")
        self.request_id = request_id


class EngineClosed(EngineError):
    code = "SHUTTING_DOWN"

    def __init__(self):
        super().__init__("the engine is shutting down")


class EngineUnavailable(EngineClosed):
    """No engine serves now: one died, or cannot start; the next may (a 503)."""

    code = "ENGINE_UNAVAILABLE"

    def __init__(self, start_error: str | None, what: str = "the mux engine"):
        reason = f": it did not start again ({start_error})" if start_error else ""
        Exception.__init__(self, f"{what} is starting again" + reason)
