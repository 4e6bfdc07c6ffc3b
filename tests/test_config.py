"""The one Config (runtime/config.py), built once from the flags and the environment by
cli/config.py: each command gets its own part, flags win over variables, and a bad
value is refused before anything loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from motet.cli.config import build_config
from motet.cli.flags import build_parser
from motet.runtime.config import DEFAULT_BURST, DEFAULT_COMPILE_CACHE, Config


def config(*argv: str, env: dict[str, str] | None = None) -> Config:
    return build_config(build_parser().parse_args(list(argv)), env or {})


def test_each_command_gets_its_own_part_and_no_other():
    parts = ("chat", "mux", "serve", "worker")
    for argv, own in ((["chat", "hi"], "chat"), (["info"], None), (["mux"], "mux"), (["serve"], "serve"),
                      (["worker", "--role", "mono", "--listen", "127.0.0.1:0"], "worker")):
        built = config(*argv)
        assert built.command == argv[0]
        assert {p for p in parts if getattr(built, p) is not None} == ({own} if own else set())


def test_the_environment_fills_in_where_a_flag_is_not_given():
    env = {"MOTET_COMPILE_CACHE": "/tmp/jax-here", "MOTET_MESH": "ep=2", "MOTET_API_KEY": "k",
           "KV_SLOTS": "3", "SNAP": "/models/m.gguf", "CTX": "512", "EXPERTS": "tiered"}
    serve = config("serve", env=env)
    assert serve.model.compile_cache == Path("/tmp/jax-here") and serve.model.mesh == "ep=2"
    assert serve.serve.api_key == "k" and serve.experts.mode == "tiered" and serve.serve.experts.mode == "tiered"
    mux = config("mux", env=env)
    assert (mux.kv_slots, mux.mux.context, mux.model.path, mux.model.max_context) == (3, 512, Path("/models/m.gguf"),
                                                                                     None)
    assert config("info").model.compile_cache == DEFAULT_COMPILE_CACHE


def test_flags_win_over_the_environment():
    env = {"MOTET_COMPILE_CACHE": "/tmp/a", "MOTET_MESH": "ep=2", "MOTET_API_KEY": "k", "KV_SLOTS": "3",
           "MOTET_COORDINATOR": "h:1", "MOTET_NUM_PROCESSES": "2", "MOTET_PROCESS_ID": "1"}
    built = config("mux", "--compile-cache", "/tmp/b", "--mesh", "tp=2", "--kv-slots", "5", "--process-id", "0",
                   env=env)
    assert (built.model.compile_cache, built.model.mesh, built.kv_slots) == (Path("/tmp/b"), "tp=2", 5)
    assert built.group is not None and built.group.leader and built.group.num_processes == 2
    assert config("serve", "--api-key", "mine", env=env).serve.api_key == "mine"
    assert config("chat", "--compile-cache", "", env=env).model.compile_cache is None  # '' turns it off


def test_the_prefix_flags_reach_every_engine_command():
    worker = ["worker", "--role", "mono", "--listen", "127.0.0.1:0"]
    for argv in (["mux"], ["serve"], worker):
        assert (config(*argv).share_prefixes, config(*argv).prefix_cache_gb) == (True, 0.0)
        built = config(*argv, "--no-share-prefixes", "--prefix-cache-gb", "2.5")
        assert (built.share_prefixes, built.prefix_cache_gb) == (False, 2.5)
    serve = config("serve", "--no-share-prefixes", "--prefix-cache-gb", "1").serve
    assert (serve.share_prefixes, serve.prefix_cache_gb) == (False, 1.0)


def test_the_decode_burst_reaches_every_engine_command():
    for argv in (["mux"], ["serve"], ["worker", "--role", "mono", "--listen", "127.0.0.1:0"]):
        assert config(*argv).decode_burst == DEFAULT_BURST
        assert config(*argv, "--decode-burst", "1").decode_burst == 1
    assert config("serve", "--decode-burst", "8").serve.decode_burst == 8


def test_a_legacy_mux_serves_one_slot_and_keeps_its_sampling():
    built = config("mux", "--temperature", "0.5", env={"SERVE": "1", "KV_SLOTS": "4"})
    assert built.mux.legacy and built.kv_slots == 1 and built.sampling.temperature == 0.5


@pytest.mark.parametrize("argv, env, message", [
    (["mux"], {"KV_SLOTS": "17"}, "KV_SLOTS must be in"),
    (["mux"], {"KV_SLOTS": "many"}, "KV_SLOTS must be an integer"),
    (["serve", "--host", "0.0.0.0"], {}, "without an API key"),
    (["serve"], {"MOTET_NUM_PROCESSES": "2"}, "missing: --coordinator"),
    (["chat", "--temperature", "-1"], {}, "temperature"),
    (["serve", "--prefix-cache-gb", "-1"], {}, "--prefix-cache-gb must be >= 0"),
    (["mux", "--decode-burst", "0"], {}, r"--decode-burst must be in \[1, 16\], got 0"),
    (["worker", "--role", "decode", "--listen", "nowhere"], {}, "HOST:PORT"),
])
def test_a_bad_value_is_refused_with_its_name(argv, env, message):
    with pytest.raises(ValueError, match=message):
        config(*argv, env=env)
