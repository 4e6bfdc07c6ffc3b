"""A short soak (benchmarks/soak.py): the HTTP server over the in-process Engine and over
a `motet mux` child, each under a mix of streams, client disconnects, dropped streams,
prompts past the context, bodies past the limit, bad fields and continued conversations;
then the invariants, not timings: every slot free, no task or thread left over, RSS flat
after the warm-up (a loose tolerance), and one terminal answer per request."""

from __future__ import annotations

import sys

import trio
from conftest import GOLDEN, REPO
from http_helpers import MUX_CMD, TIMEOUT

from motet.cli.compose import open_engine
from motet.engines.engine import Engine
from motet.runtime.serve_settings import ServeSettings

sys.path.insert(0, str(REPO / "benchmarks"))
from soak import soak  # noqa: E402

GEOMETRY = dict(kv_slots=4, max_context=256)
SETTINGS = dict(port=0, **GEOMETRY, max_body_bytes=64 << 10)
RSS_TOLERANCE_MIB = 128.0  # a leak per request would pass it within a few hundred


def check(report: dict, requests: int) -> None:
    assert all(report["invariants"].values()), report
    assert sum(report["answers"].values()) == requests
    assert report["answers"].get("disconnected", 0) > 0  # the mix did disconnect
    assert any(a.startswith("finish:") for a in report["answers"])
    assert any(a.startswith("error:400") for a in report["answers"])


async def test_soak_the_in_process_engine(tiny_model):
    with trio.fail_after(TIMEOUT):
        async with Engine(tiny_model("llama"), **GEOMETRY, prefill_chunk=16, prefill_chunk_alone=16) as engine:
            report = await soak(engine, ServeSettings(**SETTINGS), requests=40, concurrency=6, seed=1,
                                max_tokens=24, rss_tolerance_mib=RSS_TOLERANCE_MIB)
    check(report, 40)


async def test_soak_a_mux_engine():
    settings = ServeSettings(**SETTINGS, engine_cmd=MUX_CMD, model_path=GOLDEN / "llama")
    with trio.fail_after(TIMEOUT):
        async with open_engine(settings, None) as engine:
            report = await soak(engine, settings, requests=24, concurrency=6, seed=2, max_tokens=24,
                                rss_tolerance_mib=RSS_TOLERANCE_MIB)
    check(report, 24)
    assert report["after"]["child_rss_mib"] is not None
