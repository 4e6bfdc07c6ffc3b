"""What an engine's process gives back: the pages of its shared libraries that were never
written (JAX's compiler's code, mostly; runtime/code_pages.py), after which JAX still
computes and compiles, and malloc's free pages after a long prefill chunk
(actors/runner.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import motet.runtime.allocator as allocator
from motet.actors.expert_policy import ExpertPlan
from motet.actors.runner import ModelRunner
from motet.actors.step_rows import SamplingRow
from motet.model.kv import KVGeometry
from motet.runtime.allocator import TRIM_AFTER_TOKENS
from motet.runtime.code_pages import Mapping, clean_library_pages

SITE = "/venv/lib/python3.11/site-packages"


def mapping(start: str, end: str, perms: str, path: str, rss: int, dirty: int = 0, anonymous: int = 0) -> str:
    return (f"{start}-{end} {perms} 00000000 00:00 0 {path}\n"
            f"Size:             {rss + 8} kB\nRss:              {rss} kB\n"
            f"Private_Clean:    {rss - dirty} kB\nPrivate_Dirty:    {dirty} kB\n"
            f"Anonymous:        {anonymous} kB\nVmFlags: rd mr mw me\n")


def test_only_library_pages_that_were_never_written_are_chosen():
    smaps = "".join([
        mapping("1000", "9000", "r--p", f"{SITE}/jaxlib/libjax_common.so", 20),
        mapping("9000", "f000", "r-xp", f"{SITE}/jaxlib/libjax_common.so", 16),
        mapping("f000", "10000", "r--p", f"{SITE}/jaxlib/libjax_common.so", 4, dirty=4),  # RELRO
        mapping("10000", "11000", "rw-p", f"{SITE}/jaxlib/libjax_common.so", 4),
        mapping("11000", "12000", "r-xp", f"{SITE}/jax_plugins/xla_cuda12/xla_cuda_plugin.so", 8),
        mapping("12000", "13000", "r-xp", f"{SITE}/jaxlib/mosaic/libother.so", 0),  # nothing resident
        mapping("13000", "14000", "r-xp", "/usr/lib/x86_64-linux-gnu/libc.so.6", 12),
        mapping("14000", "15000", "r--p", f"{SITE}/jaxlib/libjax_common.so (deleted)", 4),
        mapping("15000", "16000", "rw-p", "", 40, anonymous=40),
        mapping("16000", "17000", "r--p", f"{SITE}/jaxlib/cuda/_versions.so", 4, anonymous=4),
        mapping("17000", "18000", "r--p", "/home/user/.cache/motet/model.gguf", 4),  # not a library
        mapping("18000", "19000", "r--p", "/usr/lib/locale/C.utf8/LC_CTYPE", 4),
    ])
    assert clean_library_pages(smaps) == [Mapping(0x1000, 0x9000, 20), Mapping(0x9000, 0xF000, 16),
                                          Mapping(0x11000, 0x12000, 8), Mapping(0x13000, 0x14000, 12)]


# A fresh interpreter compiles, gives its libraries' clean pages back, and computes again.
PROBE = """
import json
import jax, jax.numpy as jnp
from motet.runtime.code_pages import clean_library_pages, give_back_code_pages

def resident_kb():
    return sum(m.resident_kb for m in clean_library_pages(open("/proc/self/smaps").read()))

step = jax.jit(lambda x: (x @ x.T).sum())
first = float(step(jnp.arange(64.0).reshape(8, 8)))
before = resident_kb()
dropped = give_back_code_pages()
after = resident_kb()
again = float(step(jnp.arange(64.0).reshape(8, 8)))
fresh = float(jax.jit(lambda x: (x * 3).sum())(jnp.arange(64.0)))  # a compile after
print(json.dumps({"before": before, "dropped": dropped, "after": after,
                  "first": first, "again": again, "fresh": fresh}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_a_process_drops_its_libraries_clean_pages_and_still_computes():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["before"] > 20 * 1024  # a compile leaves tens of MB of jaxlib resident
    assert got["dropped"] > got["before"] * 1024 / 2  # (the call itself may touch a few pages more)
    assert got["after"] < got["before"] / 4
    x = np.arange(64.0).reshape(8, 8)
    assert got["again"] == got["first"] == float((x @ x.T).sum())
    assert got["fresh"] == 3 * sum(range(64))


@pytest.mark.parametrize("experts", ["resident", "tiered"])
@pytest.mark.parametrize("tokens, trims", [(TRIM_AFTER_TOKENS - 1, 0), (TRIM_AFTER_TOKENS, 1)])
def test_a_long_prefill_chunk_gives_mallocs_free_pages_back(tiny_model, monkeypatch, experts, tokens, trims):
    geo = KVGeometry(n_slots=2, max_context=256, chunk=TRIM_AFTER_TOKENS)
    if experts == "resident":
        runner = ModelRunner(tiny_model("llama"), geo)
    else:
        model = tiny_model("qwen3_moe")
        cfg = model.config
        runner = ModelRunner(model, geo, ExpertPlan("tiered", sum(cfg.moe_layers), cfg.n_experts, 4, None, 1))
    given = []
    monkeypatch.setattr(allocator, "give_back_free", lambda: given.append(True) or True)
    row = SamplingRow(0.0, 1.0, 0, 0.0, runner.new_key(0), False)
    runner.prefill(0, list(range(3, 3 + tokens)), 0, row)
    assert len(given) == trims
