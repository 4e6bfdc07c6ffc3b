"""The Quart-Trio app: OpenAI routes, /health, /experts, /metrics, /slots (slots.py) and
the web folder.

Written against the engine API only (stream, render_chat, name, statistics,
expert_state; save_slot, restore_slot, erase_slot), so the in-process Engine and a
MuxEngine plug in alike.

Auth: with an API key set, `/v1/*`, `/experts`, `/metrics` and `/slots` need it (`Authorization:
Bearer <key>` or `x-api-key: <key>`); `/health` (for load balancers), `/openapi.json` and
the web folder (the page asks for the key itself) stay open. The key is compared in
constant time and never logged. CORS answers only the origins given, and
preflights before auth, since browsers send no credentials on a preflight.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import time

import trio
from quart import Response, request
from quart.typing import RouteCallable
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, NotFound

from ..runtime.engine_api import EngineAPI
from ..runtime.errors import EngineError
from ..runtime.serve_settings import ServeSettings
from . import anthropic_schema as messages_shape
from . import openai_responses as shape
from . import static
from .anthropic_schema import parse_messages
from .errors import ApiError, InvalidRequest, from_engine, invalid
from .generate import Generation, Turn, whole_parts
from .metrics import Metrics, RecentRate
from .openai_schema import ChatRequest, Limits, parse_chat, parse_completion, parse_detokenize, parse_tokenize
from .openapi import openapi_document
from .reasoning import ReasoningSplitter, opens_reasoning
from .slots import SlotRoutes
from .tool_calls import ToolCallStream, ToolFamily
from .tools import call_grammar, render_with_tools

log = logging.getLogger(__name__)

MESSAGES = "/v1/messages"  # Anthropic's routes, which answer errors in its shape
PROTECTED = ("/v1/", "/experts", "/metrics", "/slots", "/tokenize", "/detokenize")
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type, X-Api-Key"
CORS_MAX_AGE_S = 600


def error_response(error: ApiError) -> Response:
    """The error in OpenAI's shape, or in Anthropic's on its routes."""
    body = messages_shape.error_body(error) if request.path.startswith(MESSAGES) else error.body()
    return Response(json.dumps(body), status=error.status, headers=error.headers(), content_type="application/json")


class Server:
    """One app's state: the engine, the settings, the metrics; `closing` is set when the
    server begins to shut down (new requests get a 503 from then on)."""

    def __init__(self, engine: EngineAPI, settings: ServeSettings):
        self.engine = engine
        self.settings = settings
        self.limits = Limits(settings.max_messages, settings.max_stops, settings.max_stop_chars,
                             settings.max_prompt_chars, max_tokens=settings.max_context)
        self.metrics = Metrics(engine)
        self.decode_rate = RecentRate()
        self.generation = Generation(engine, self.metrics, self.decode_rate,
                                     settings.default_max_tokens, settings.retry_after_s)
        self.slots = SlotRoutes(engine, settings)
        self.created = int(time.time())
        self.closing = False

    # ---- around every request -------------------------------------------------------

    async def before(self):
        if (size := _head_size(request.scope)) > self.settings.max_header_bytes:
            # Hypercorn's own limit (h11's) only sees headers that arrive in pieces: a head
            # that comes in one read of up to 64 KiB passes it, so the limit is kept here
            return error_response(ApiError(
                431, f"the request line and headers are {size} bytes; at most "
                f"{self.settings.max_header_bytes} are allowed", code="request_header_fields_too_large"))
        if request.method == "OPTIONS":
            return self._preflight()
        key = self.settings.api_key
        if key is not None and request.path.startswith(PROTECTED) and not self._authorized(key):
            return error_response(ApiError(401, "a valid API key is required (Authorization: "
                                           "Bearer <key>, or x-api-key: <key>)", code="invalid_api_key"))
        return None

    def _authorized(self, key: str) -> bool:
        auth = request.headers.get("Authorization", "")
        given = [auth[7:].strip()] if auth[:7].lower() == "bearer " else []
        given += request.headers.getlist("X-Api-Key")
        expected = key.encode()
        # compare_digest on every candidate, so the time taken does not tell which failed
        return any([hmac.compare_digest(g.encode(), expected) for g in given])

    def _allowed_origin(self) -> str | None:
        origin = request.headers.get("Origin")
        origins = self.settings.cors_origins
        if "*" in origins:
            return "*"
        return origin if origin is not None and origin in origins else None

    def _preflight(self) -> Response:
        response = Response("", status=204)
        if self._allowed_origin() is not None:
            response.headers["Access-Control-Allow-Methods"] = CORS_METHODS
            response.headers["Access-Control-Allow-Headers"] = CORS_HEADERS
            response.headers["Access-Control-Max-Age"] = str(CORS_MAX_AGE_S)
        return response

    async def after(self, response: Response) -> Response:
        origin = self._allowed_origin()
        if origin is not None:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Expose-Headers"] = "Retry-After"
            if origin != "*":
                response.headers.add("Vary", "Origin")
        return response

    async def http_error(self, error: HTTPException):
        """Routing and body errors (404, 405, 408, 413) in OpenAI's shape too."""
        assert error.code is not None  # Quart hands one without a code back as it is, to no handler
        message = {413: f"the request body is larger than {self.settings.max_body_bytes} bytes",
                   404: f"nothing at {request.path}"}.get(error.code, error.description or error.name)
        kind = "not_found_error" if error.code == 404 else "invalid_request_error"
        code = (error.name or "error").lower().replace(" ", "_")  # e.g. request_entity_too_large
        return error_response(ApiError(error.code, message, type=kind, code=code))

    async def invalid_request(self, error: InvalidRequest):
        return error_response(invalid(error.message, error.param))

    async def server_error(self, error: Exception):
        log.exception("unhandled error in %s %s", request.method, request.path, exc_info=error)
        return error_response(ApiError(500, "internal error", type="server_error", code="internal_error"))

    # ---- the OpenAI routes ----------------------------------------------------------

    async def chat_completions(self):
        made = self._chat_turn(parse_chat(await self._json(), self.limits))
        return made if isinstance(made, Response) else await self._generate(*made)

    def _chat_turn(self, body: ChatRequest) -> tuple[Turn, str] | Response:
        """A chat request's turn (its answer's reasoning and tool calls read apart) and
        its prompt, or the error response."""
        rendered = self._render(body)
        if isinstance(rendered, Response):
            return rendered
        prompt, family = rendered
        options = body.options
        if body.tools is not None and body.tools.forced:  # the answer is a call, by grammar
            options = dataclasses.replace(options, grammar=call_grammar(body.tools, family or "hermes"))
        opened = opens_reasoning(prompt)
        return Turn(True, self.engine.name, options, trio.current_time(), reasoning=ReasoningSplitter(opened),
                    reasoning_opened=opened, tools=None if family is None else ToolCallStream(family)), prompt

    def _render(self, body: ChatRequest) -> tuple[str, ToolFamily | None] | Response:
        """The conversation through the chat template, with the format to read the
        answer's tool calls in when it has tools (tools.render_with_tools), or the error
        response."""
        messages, kwargs = [dict(m) for m in body.messages], body.options.template_kwargs or {}
        try:
            if body.tools is None:
                return self.engine.render_chat(messages, **kwargs), None
            return render_with_tools(self.engine.render_chat, messages, body.tools, self.settings.tool_parser,
                                     **kwargs)
        except ValueError as exc:  # the chat template refused this conversation
            raise InvalidRequest(str(exc), "messages") from None
        except EngineError as exc:  # no engine to render with (a mux child starting again)
            return error_response(from_engine(exc, "messages", self.settings.retry_after_s))

    # ---- Anthropic's Messages ---------------------------------------------------------

    async def messages(self):
        made = self._chat_turn(parse_messages(await self._json(), self.limits))
        if isinstance(made, Response):
            return made
        turn, prompt = made
        if self.closing:
            return self._shutting_down()
        if turn.options.stream:
            stream = await self.generation.open_stream(turn, prompt, anthropic=True)
            if isinstance(stream, ApiError):
                return error_response(stream)
            return Response(stream, content_type="text/event-stream; charset=utf-8",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        finishes = await self.generation.collect([turn], prompt)
        if isinstance(finishes, ApiError):
            return error_response(finishes)
        finish = finishes[0]
        thought, text, calls = whole_parts(turn, "".join(turn.texts) + finish.text_tail)
        return messages_shape.message(messages_shape.message_id(), turn.model, text, finish, thought, calls)

    async def count_tokens(self):
        body = parse_messages(await self._json(), self.limits, count_only=True)
        rendered = self._render(body)
        if isinstance(rendered, Response):
            return rendered
        try:
            return {"input_tokens": len(self.engine.tokenize(rendered[0]))}
        except EngineError as exc:  # text no tokenizer reads; no engine (a mux child starting again)
            return error_response(from_engine(exc, "messages", self.settings.retry_after_s))

    async def completions(self):
        body = parse_completion(await self._json(), self.limits)
        return await self._generate(Turn(False, self.engine.name, body.options, trio.current_time()),
                                    body.prompt)

    async def tokenize(self):
        """vLLM's /tokenize: the ids a prompt (or messages through the template) reads as."""
        body = parse_tokenize(await self._json(), self.limits)
        param = "prompt" if body.messages is None else "messages"
        try:
            text = body.prompt if body.messages is None else self.engine.render_chat([dict(m) for m in body.messages])
            assert text is not None  # parse_tokenize gives one of the two
            ids = self.engine.tokenize(text, body.add_special)
        except ValueError as exc:  # the chat template refused this conversation
            raise InvalidRequest(str(exc), "messages") from None
        except EngineError as exc:  # text no tokenizer reads; no engine (a mux child starting again)
            return error_response(from_engine(exc, param, self.settings.retry_after_s))
        return {"count": len(ids), "max_model_len": self.settings.max_context, "tokens": ids}

    async def detokenize(self):
        """vLLM's /detokenize: the text of token ids, as a stream writes it."""
        ids = parse_detokenize(await self._json(), self.limits)
        try:
            return {"prompt": self.engine.detokenize(ids)}
        except EngineError as exc:  # an id outside the vocabulary; no engine
            return error_response(from_engine(exc, "tokens", self.settings.retry_after_s))

    async def _json(self) -> object:
        data = await request.get_data(cache=False)  # 413 past the limit, 408 past the timeout
        try:
            return json.loads(data)
        except (ValueError, RecursionError):  # also bad UTF-8, nesting too deep, huge numbers
            raise InvalidRequest("the request body is not valid JSON") from None

    def _shutting_down(self) -> Response:
        return error_response(ApiError(503, "the server is shutting down", type="server_error",
                                       code="shutting_down", retry_after_s=self.settings.retry_after_s))

    async def _generate(self, turn: Turn, prompt: str):
        if self.closing:
            return self._shutting_down()
        slot = turn.options.cache_slot
        if slot is not None and slot >= (slots := self.engine.statistics().slots_total):
            raise InvalidRequest(f"'cache_slot' must be in [0, {slots - 1}]; got {slot}", "cache_slot")
        if not turn.options.stream:
            answer = await self.generation.answer(turn, prompt)
            return error_response(answer) if isinstance(answer, ApiError) else answer
        body = await self.generation.open_stream(turn, prompt)
        if isinstance(body, ApiError):
            return error_response(body)
        return Response(body, content_type="text/event-stream; charset=utf-8",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def models(self):
        return {"object": "list", "data": [shape.model_card(self.engine.name, self.created)]}

    async def model(self, model_id: str):
        if model_id != self.engine.name:
            return error_response(ApiError(404, f"the model {model_id!r} does not exist",
                                           param="model", code="model_not_found"))
        return shape.model_card(self.engine.name, self.created)

    # ---- motet's own routes ---------------------------------------------------------

    async def health(self):
        if self.closing:
            return {"status": "closing", "reason": "the server is shutting down"}, 503
        health = self.engine.health()
        if health.status == "error":  # a child that cannot start says why (its model file gone...)
            return {"status": "error", "reason": f"the engine cannot start: {health.reason}"}, 503
        if health.status == "closing":
            reason = "the engine is not serving (closing, or starting again)"
            return {"status": "closing", "reason": reason}, 503
        body = {"status": "ok"}
        if health.startup is not None:  # time to ready, and the executables it took
            body["startup"] = dataclasses.asdict(health.startup)
        if health.split is not None:  # a dead prefill engine is no outage: the decode engine reads
            body["split"] = dataclasses.asdict(health.split)
        if stored := self.engine.statistics().prefix_store_bytes:  # --prefix-cache-gb
            body["prefix_store_bytes"] = stored
        return body

    async def openapi(self):
        return openapi_document(self.settings, self.engine.name, self.engine.statistics().slots_total)

    async def experts(self):
        state, stats = self.engine.expert_state(), self.engine.statistics()
        report = self.generation.last_report
        return {
            "rows": state.rows, "cols": state.cols, "map": state.emap.hex(), "hits": state.hits.hex(),
            "seq": state.seq, "entropy": list(state.entropy),
            "gpus": [list(g) for g in report.gpus] if report else [],
            "repin": [list(r) for r in report.repin] if report else [],
            "slots_busy": stats.running, "slots_total": stats.slots_total,
            "tokens_per_s": self.decode_rate.rate(trio.current_time()),
        }

    async def slot_action(self, id_slot: str):
        if self.closing:
            return self._shutting_down()
        answer = await self.slots.post(id_slot)
        return error_response(answer) if isinstance(answer, ApiError) else answer

    async def prometheus(self):
        return Response(self.metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")

    async def web(self, path: str = ""):
        root = self.settings.web_dir
        if request.path == "/v1" or request.path.startswith("/v1/"):  # no page fallback for the API
            raise NotFound()
        if not root.is_dir():
            if request.path == "/":
                return Response(static.missing_page(root), content_type="text/html; charset=utf-8")
            raise NotFound()
        found = static.resolve(root, request.scope.get("raw_path") or request.path.encode(), request.path)
        if found is None:
            raise NotFound()
        return Response(await trio.Path(found).read_bytes(), content_type=static.content_type(found),
                        headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})


def _head_size(scope: dict) -> int:
    """The request line and headers as sent, in bytes (near enough: separators counted)."""
    line = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 16
    return line + sum(len(name) + len(value) + 4 for name, value in scope.get("headers", ()))


def create_app(engine: EngineAPI, settings: ServeSettings) -> QuartTrio:
    """The app for `engine`; its Server is `app.extensions["motet"]`."""
    server = Server(engine, settings)
    app = QuartTrio("motet", static_folder=None)  # static files: our own route, checked
    app.config.update(
        MAX_CONTENT_LENGTH=settings.max_body_bytes,
        BODY_TIMEOUT=settings.body_timeout_s,
        RESPONSE_TIMEOUT=None,  # a long answer streams as long as it takes
    )
    app.before_request(server.before)
    app.after_request(server.after)
    app.register_error_handler(HTTPException, server.http_error)
    app.register_error_handler(InvalidRequest, server.invalid_request)
    app.register_error_handler(Exception, server.server_error)
    routes: list[tuple[str, RouteCallable, str]] = [
        ("/v1/chat/completions", server.chat_completions, "POST"),
        ("/v1/completions", server.completions, "POST"),
        ("/v1/messages", server.messages, "POST"),
        ("/v1/messages/count_tokens", server.count_tokens, "POST"),
        ("/v1/models", server.models, "GET"),
        ("/v1/models/<path:model_id>", server.model, "GET"),
        ("/tokenize", server.tokenize, "POST"),
        ("/detokenize", server.detokenize, "POST"),
        ("/health", server.health, "GET"),
        ("/openapi.json", server.openapi, "GET"),
        ("/experts", server.experts, "GET"),
        ("/metrics", server.prometheus, "GET"),
        ("/slots/<id_slot>", server.slot_action, "POST"),
        ("/", server.web, "GET"),
        ("/<path:path>", server.web, "GET"),
    ]
    for rule, view, method in routes:
        app.add_url_rule(rule, rule, view, methods=[method])
    app.extensions["motet"] = server
    return app
