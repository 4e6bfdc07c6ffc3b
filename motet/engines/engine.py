"""Engine: the in-process engine. It loads a model, starts the actors in a Trio nursery
and offers the API the fronts and embedding programs use.

    async with Engine() as engine:
        async with engine.stream("Once upon a time", max_tokens=32) as events:
            async for event in events:
                ...
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import trio

from ..actors.expert_cache import ExpertCache, HeatFile, SaveHeat
from ..actors.expert_policy import ExpertPlan, ExpertPolicy
from ..actors.kv_slot import KVSlot
from ..actors.runner import ModelRunner
from ..actors.scheduler import Cancel, Drain, Scheduler, StopNow, Subscribe
from ..actors.warmup import StartupClock, WarmupPlan, warm_up
from ..model.compilation import current_compile_cache
from ..model.kv import KVGeometry
from ..model.model import Model
from ..model.sharding import MeshSpec
from ..protocol.session_file import SessionHeader
from ..runtime.actor import EventStream, open_reply
from ..runtime.api import (
    EngineStatistics,
    ExpertState,
    ExpertTiers,
    GenerationRequest,
    SlotFile,
    StartupReport,
    StepRouting,
    Telemetry,
)
from ..runtime.choices import Choices, choice_fields
from ..runtime.collect import Collected
from ..runtime.config import DEFAULT_BURST, DEFAULT_COMPILE_CACHE, ExpertSettings
from ..runtime.errors import EngineClosed, NotFound
from ..runtime.experts import HITS_EVERY, ExpertMap, turn_entropy
from ..runtime.service import Service
from . import sessions, tokens
from .engine_args import MAX_SLOTS, PREFILL_CHUNK, check_engine_arguments, lone_prompt_chunk
from .experts_plan import plan_engine_experts
from .submission import submit_of, submitted

log = logging.getLogger(__name__)


class Engine(Service, Collected):
    def __init__(
        self,
        model: Model | str | Path | None = None,
        *,
        kv_slots: int = MAX_SLOTS,
        max_context: int = 4096,
        dtype: str = "auto",
        kv_dtype: str = "auto",
        activations: str | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        prefill_chunk_alone: int | None = None,
        queue_limit: int = 64,
        experts: ExpertSettings | None = None,
        mesh: MeshSpec | str | None = None,
        mirror: Callable[[bytes], None] | None = None,
        compile_cache: Path | str | None = "auto",
        warm_up: bool = True,
        share_prefixes: bool = True,
        prefix_cache_gb: float = 0.0,
        decode_burst: int = DEFAULT_BURST,
    ):
        """dtype: "auto" runs a quantized file's weights as it holds them; "float32" or
        "bfloat16" dequantizes every weight; "int8" or "int4" (the CLI's --quantize) is
        auto with the file's float tensors quantized at load.
        kv_dtype: the KV cache's element type, "float32", "float16" or "bfloat16", or 8
        bits with a float32 scale per position and KV head: "int8" or "fp8" (e4m3); "auto":
        float16 under quantized weights (as llama.cpp's cache), else the weights' dtype
        (a Model passed in keeps the one it was loaded with).
        activations: what the quantized products round x to, "int16" or "int8" (as
        llama.cpp: a faster prefill, about 1e-2 of a product's largest output off); None:
        a Model passed in keeps its own, a path loads with int16.
        experts: where a MoE model's experts live (default: all on the device unless
        a budget says otherwise; see ExpertSettings). mesh: shard the model over several
        devices of this process, e.g. "ep=2,tp=2" (docs/scaling.md); experts stay resident.
        mirror: on process 0 of a group, where the runner sends its device calls for the
        other processes (actors/device_group.py Group.send; docs/scaling.md).
        compile_cache: JAX's persistent compilation cache — "auto": the folder this
        program gave JAX, else ~/.cache/motet/jax; a folder; None: none set here.
        warm_up: compile and run every shape before the engine is ready (the default;
        False starts sooner and compiles on first use, while requests wait).
        share_prefixes: a prompt whose prefix another slot holds, busy or idle, starts
        from a device copy of it when that beats reading it (the warm-up times both).
        prefix_cache_gb: host RAM for prefixes pushed out of the slots, written back into
        a slot when a prompt starts with one (0: none kept).
        prefill_chunk, prefill_chunk_alone: the most tokens of a prompt a prefill step reads while
        other streams decode (each waits for a chunk), and while none does (None: engine_args's rule).
        decode_burst: the most decode steps of one stream a device call takes (1 to 16) while
        no other request waits and it samples plainly: its tokens arrive that many at a time."""
        check_engine_arguments(kv_slots, kv_dtype, activations, prefill_chunk, prefill_chunk_alone, decode_burst,
                               prefix_cache_gb)
        self._model_arg = model
        self.kv_slots = kv_slots
        self.max_context = max_context
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.activations = activations
        self.prefill_chunk = prefill_chunk
        self.prefill_chunk_alone = prefill_chunk_alone
        self.queue_limit = queue_limit
        self.expert_settings = experts or ExpertSettings()
        self.mesh = None if mesh is None else MeshSpec.of(mesh)
        self._mirror = mirror
        self.compile_cache = compile_cache
        self.warm_up = warm_up
        self.share_prefixes = share_prefixes
        self.decode_burst = decode_burst
        self.prefix_store_bytes = int(prefix_cache_gb * 1e9)
        self._clock: StartupClock | None = None
        self.expert_plan: ExpertPlan | None = None
        self.heat_file: HeatFile | None = None
        self._expert_cache: ExpertCache | None = None
        self.model: Model | None = None
        self.session_header: SessionHeader | None = None  # what a session file must match (known once loaded)
        self._scheduler: Scheduler | None = None
        # Ids the engine picks live in the top half of u64, so they never meet the small
        # ids callers (and mux clients) choose themselves.
        self._ids = itertools.count(1 << 63)
        self._closed = False
        self._nursery_cm = None
        self._nursery: trio.Nursery | None = None

    # ---- life cycle -----------------------------------------------------------------

    async def start(self, nursery: trio.Nursery) -> None:
        """Load the model, compile every shape it will run, and start the actors in
        `nursery`; returns once all are ready."""
        cache = self.compile_cache
        if cache == "auto":
            cache = current_compile_cache() or DEFAULT_COMPILE_CACHE
        self._clock = clock = StartupClock(None if cache is None else Path(cache))  # stopped in _closed_now
        try:
            await self._start(nursery, clock)
        except BaseException:
            clock.stop()
            raise

    async def _start(self, nursery: trio.Nursery, clock: StartupClock) -> None:
        self.model = await trio.to_thread.run_sync(self._load)
        context = min(self.max_context, self.model.config.max_context)
        alone = lone_prompt_chunk(self.prefill_chunk_alone, self.prefill_chunk, any(self.model.config.moe_layers))
        geo = KVGeometry(n_slots=self.kv_slots, max_context=context, chunk=alone)
        expert_plan, policy = await trio.to_thread.run_sync(self._plan_experts)
        runner = await trio.to_thread.run_sync(
            partial(ModelRunner, self.model, geo, expert_plan,
                    prefetch=self.expert_settings.prefetch, rank=policy.rank() if policy else None,
                    mesh=self.mesh, mirror=self._mirror, burst=self.decode_burst)
        )
        clock.loaded = time.monotonic()
        plan = self.warmup_plan(geo)
        if self.warm_up:
            await trio.to_thread.run_sync(warm_up, runner, plan, clock.progress)
        clock.warmed = time.monotonic()
        if policy is not None:
            self._expert_cache = ExpertCache(policy, tiered=expert_plan.mode == "tiered",
                                             heat_file=self.heat_file)
            await nursery.start(self._expert_cache.run)
        slots = [KVSlot(i) for i in range(self.kv_slots)]
        for slot in slots:
            await nursery.start(slot.run)
        self._scheduler = Scheduler(runner, slots, self.queue_limit, self._expert_cache, self.share_prefixes,
                                    self.prefix_store_bytes, chunk_beside_decodes=self.prefill_chunk)
        await nursery.start(self._scheduler.run)
        self._experts = ExpertMap.for_model(self.model.config)
        self._experts.set_tiers(runner.expert_tiers())
        await nursery.start(self._watch_experts)
        self._nursery = nursery
        self.session_header = sessions.session_header(self.model, context)
        clock.ready(len(plan.shapes) if self.warm_up else 0)

    async def _watch_experts(self, *, task_status=trio.TASK_STATUS_IGNORED):
        channel = await self.telemetry(buffer=1024)
        task_status.started()
        steps = 0
        async for event in channel:
            if isinstance(event, StepRouting):
                self._experts.add_step(event)
                steps += event.steps
                if steps >= HITS_EVERY:
                    steps = 0
                    self._experts.take_hits()
            elif isinstance(event, Telemetry):
                self._experts.end_turn(turn_entropy(event.expert_counts, self._experts.rows))

    def warmup_plan(self, geo: KVGeometry) -> WarmupPlan:
        """The shapes this engine compiles before it is ready (once its model is known)."""
        plan = self.expert_plan
        return WarmupPlan.of(geo, plan.pool_slots if plan is not None and plan.mode == "tiered" else None,
                             self.decode_burst)

    def startup(self) -> StartupReport | None:
        """How this engine started (None before it is ready), with the executables
        needed since it became ready: 0 unless some shape was missed."""
        return None if self._clock is None else self._clock.now()

    def _load(self) -> Model:
        if isinstance(self._model_arg, Model):
            return self._model_arg.with_settings(self.kv_dtype, self.activations)
        from ..model.loader import load_model

        started = time.monotonic()
        log.info("loading %s", self._model_arg or "the default model")
        # Unless forced resident, the experts stay in the file until the plan is known.
        lazy = self.expert_settings.mode != "resident"
        model = load_model(self._model_arg, dtype=self.dtype, lazy_experts=lazy, mesh=self.mesh,
                           kv_dtype=self.kv_dtype, activations=self.activations or "int16")
        log.info("model ready in %.1f s", time.monotonic() - started)
        return model

    def _plan_experts(self) -> tuple[ExpertPlan, ExpertPolicy | None]:
        """Resident or tiered, and the policy that keeps the heat (None for a dense
        model). A budget too small for the model raises ValueError here."""
        self.expert_plan, self.heat_file, policy = plan_engine_experts(self._loaded(), self.expert_settings)
        return self.expert_plan, policy

    def _loaded(self) -> Model:
        """The model, once start() has loaded it."""
        if self.model is None:
            raise RuntimeError("the engine has not started")
        return self.model

    def _header(self) -> SessionHeader:
        """What a session file must match, once start() is done; before, a slot command
        is refused as a request is (EngineClosed)."""
        if self.session_header is None:
            raise EngineClosed()
        return self.session_header

    async def _close(self) -> None:
        await self.drain()  # requests in flight finish first

    def _closed_now(self) -> None:
        self._closed = True
        if self._clock is not None:
            self._clock.stop()

    async def drain(self) -> None:
        """Refuse new requests and wait until every request in flight has finished."""
        await self._ask(Drain)

    async def _send(self, message) -> None:
        if self._scheduler is None or self._closed:
            raise EngineClosed()
        try:
            await self._scheduler.inbox.send.send(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise EngineClosed() from None

    async def _ask(self, make_message):
        """Send a message carrying a reply channel and wait for the answer."""
        reply, answer = open_reply()
        await self._send(make_message(reply))
        try:
            return await answer.receive()
        except trio.EndOfChannel:
            raise EngineClosed() from None

    # ---- the API --------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The model's name, as the HTTP server's `model` field shows it ("" before start,
        as the other engines say it)."""
        return self.model.name if self.model is not None else ""

    def statistics(self) -> EngineStatistics:
        """Requests running and waiting now (a snapshot; the scheduler's own counts)."""
        if self._scheduler is None:
            return EngineStatistics(0, 0, self.kv_slots, self._closed)
        stats = self._scheduler.statistics()
        return stats if not self._closed else EngineStatistics(0, 0, self.kv_slots, True)

    @property
    def tokenizer(self):
        return self._loaded().tokenizer

    def decode(self, ids) -> str:
        """The text a stream gives for `ids` (the same detokenizer, token by token)."""
        return tokens.detokenize(self._loaded().tokenizer, ids)

    def encode(self, prompt: str | list[int] | tuple[int, ...]) -> tuple[int, ...]:
        if not isinstance(prompt, str):
            return tuple(int(t) for t in prompt)
        return tuple(tokens.tokenize(self._loaded().tokenizer, prompt))

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return tokens.tokenize(self._loaded().tokenizer, text, add_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return tokens.detokenize(self._loaded().tokenizer, ids)

    @asynccontextmanager
    async def stream(self, prompt, **fields):
        """Submit a request (`fields`: GenerationRequest's, as EngineAPI.stream lists them);
        yields its EventStream. Leaving the block early, or a cancel of the surrounding
        scope, cancels the request."""
        request = GenerationRequest.of(prompt, **fields)
        rid = request.request_id if request.request_id is not None else next(self._ids)
        submit, receive = submit_of(self._loaded(), self.encode(prompt), [request], [rid])
        events = EventStream(rid, receive)
        async with submitted(self._send, submit, receive, lambda: [rid] if events.finish is None else []):
            yield events

    @asynccontextmanager
    async def choices(self, prompt, n: int, **fields):
        """n answers to one prompt (EngineAPI.choices): it is prefilled once, and each
        other choice starts from a copy of its KV in a free slot."""
        requests = [GenerationRequest.of(prompt, **each) for each in choice_fields(n, fields)]
        rids = [next(self._ids) for _ in requests]
        submit, receive = submit_of(self._loaded(), self.encode(prompt), requests, rids)
        choices = Choices(rids, receive)
        async with submitted(self._send, submit, receive,
                             lambda: [rid for rid, end in zip(rids, choices.finishes) if end is None]):
            yield choices

    def render_chat(self, messages: list[dict], **template_kwargs) -> str:
        return self._loaded().render_chat(messages, add_generation_prompt=True, **template_kwargs)

    async def cancel(self, request_id: int) -> None:
        """Cancel a request in flight; NotFound when there is none with this id."""
        if not await self._ask(lambda reply: Cancel(request_id, reply)):
            raise NotFound(request_id)

    async def stop(self, request_id: int) -> None:
        """End a request now through its normal finish; NotFound when there is none."""
        if not await self._ask(lambda reply: StopNow(request_id, reply)):
            raise NotFound(request_id)

    # ---- a slot's KV: session files and handovers ----------------------------------------

    async def save_slot(self, slot: int, path: str | Path) -> SlotFile:
        """Write the slot's tokens and KV to a session file (atomically). The slot must be
        idle (SlotBusy otherwise); other slots keep decoding meanwhile."""
        return await sessions.save_slot(self._ask, self._header(), slot, Path(path))

    async def restore_slot(self, slot: int, path: str | Path) -> SlotFile:
        """Load a session file into an idle slot. A file made under other settings, or
        damaged, raises SessionError with the reason, and the slot keeps what it held."""
        return await sessions.restore_slot(self._ask, self._header(), slot, Path(path))

    async def erase_slot(self, slot: int) -> int:
        """Forget an idle slot's history; the number of tokens it held."""
        return await sessions.erase_slot(self._ask, slot)

    def hold_slot(self, slot: int):
        """`async with engine.hold_slot(slot) as hold`: the slot kept from requests while
        its KV is read (`hold.read(layer, tokens)`) or written (`hold.write`), layer by
        layer; `hold.history` is what it holds, and setting `hold.new_history` says what
        it holds afterwards."""
        return sessions.held_slot(self._ask, slot)

    async def install_slot(self, slot: int, tokens, layers) -> None:
        """Write KV layers (an async iterable of (K, V) [tokens, kv_heads, head_dim]) into
        an idle slot as they arrive; it holds `tokens` once the last one is in."""
        await sessions.install(self._ask, slot, tokens, layers)

    def expert_state(self) -> ExpertState:
        """The expert map now: heat per (MoE layer, expert), the experts routed in the
        last few steps, the last turn's routing entropy."""
        return self._experts.state()

    def expert_tiers(self) -> ExpertTiers:
        """Where the experts are now (after the last step): per (MoE layer, expert) its
        tier, counts and bytes per tier, pool hits and prefetch accuracy so far."""
        tiers = self._experts.tiers
        assert tiers is not None  # set from the runner's at start; a step only ever replaces them
        return tiers

    async def save_expert_heat(self):
        """Write the heat file now (it is also written at turn ends, at most every 30 s,
        and at shutdown); the path written, or None when there is none to write."""
        if self._expert_cache is None:
            return None
        reply, answer = open_reply()
        await self._expert_cache.inbox.send.send(SaveHeat(reply))
        return await answer.receive()

    async def telemetry(self, buffer: int = 64) -> trio.MemoryReceiveChannel:
        """A channel of per-turn Telemetry and per-step StepRouting; a full channel misses
        events rather than slowing the engine."""
        send, receive = trio.open_memory_channel(buffer)
        await self._send(Subscribe(send))
        return receive
