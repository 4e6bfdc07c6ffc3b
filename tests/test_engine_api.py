"""Every engine implements EngineAPI (runtime/engine_api.py), the one interface the fronts
are typed on: each member is there, and each method takes every parameter the protocol
names (by name, or through **kwargs). The in-process Engine also implements what the
stdio bridge and the worker need (InProcessEngineAPI), checked on a running one."""

from __future__ import annotations

import inspect

import pytest
from conftest import GOLDEN

from motet import Engine, MuxEngine, RestartingEngine, SplitEngine
from motet.runtime.api import Health
from motet.runtime.engine_api import EngineAPI, InProcessEngineAPI

ENGINES = (Engine, MuxEngine, SplitEngine, RestartingEngine)


def protocol_members(protocol) -> dict[str, object]:
    own = {}
    for klass in reversed(protocol.__mro__):
        if klass.__dict__.get("_is_protocol"):
            own.update({name: value for name, value in vars(klass).items()
                        if not name.startswith("_") and name != "_is_protocol"})
    own.update({name: None for name in getattr(protocol, "__annotations__", {})})
    return own


def test_a_protocol_names_what_the_fronts_call():
    members = protocol_members(EngineAPI)
    assert {"stream", "complete", "chat", "stream_chat", "cancel", "stop", "save_slot", "restore_slot",
            "erase_slot", "statistics", "expert_state", "startup", "health", "name", "render_chat"} <= set(members)
    assert {"telemetry", "hold_slot", "install_slot", "kv_slots", "session_header"} <= set(
        protocol_members(InProcessEngineAPI))


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.__name__)
def test_each_engine_offers_every_method_with_its_parameters(engine):
    for name, member in protocol_members(EngineAPI).items():
        if name == "name":  # a property, or an attribute __init__ sets
            assert isinstance(getattr(engine, name, None), property) or "self.name = " in inspect.getsource(
                engine.__init__), f"{engine.__name__} has no name"
            continue
        method = getattr(engine, name, None)
        assert callable(method), f"{engine.__name__} has no {name}()"
        wanted = inspect.signature(member).parameters
        offered = inspect.signature(method).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in offered.values())
        for parameter in wanted.values():
            if parameter.kind is parameter.VAR_KEYWORD:
                assert takes_any, f"{engine.__name__}.{name} takes no keyword arguments"
            elif parameter.name not in offered:
                assert takes_any, f"{engine.__name__}.{name} lacks {parameter.name}"
        assert inspect.iscoroutinefunction(method) == inspect.iscoroutinefunction(member), (engine, name)


async def test_a_running_engine_is_an_in_process_engine_and_healthy():
    async with Engine(GOLDEN / "llama", kv_slots=1, max_context=64) as engine:
        assert isinstance(engine, EngineAPI) and isinstance(engine, InProcessEngineAPI)
        health = engine.health()
        answer = await engine.complete("hello", max_tokens=2)
    assert health == Health("ok", None, engine.startup(), None)
    assert answer.stats.finish_reason == "length"
    assert engine.health().status == "closing"  # stopped: it serves no more
