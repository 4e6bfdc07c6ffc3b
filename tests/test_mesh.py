"""Sharding over a device mesh (motet/model/sharding.py).

The layouts run on 4 virtual CPU devices in a subprocess (tests/mesh_check.py: the
device count is fixed when JAX is imported, and this suite runs on one device); the
mesh option's parsing and refusals are checked here in-process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache

import pytest
from conftest import REPO

from motet.model.moe import dispatches
from motet.model.sharding import MeshSpec, moe_layer_traffic, step_traffic

# Sharded logits vs one device, max |difference| over every logit of 4 greedy steps:
# measured 6e-6 to 1.6e-5 (psums and split matmuls add in another order), with logits up
# to ~27; the ragged path on the mesh vs transformers: 1.4e-5 to 2.1e-5. 1e-4 is the
# golden tests' tolerance against transformers.
ATOL = 1e-4
TIMEOUT = 600  # seconds per subprocess: compiles dominate; warm (.jax_cache/mesh) it is ~30 s


@cache
def mesh_check(what: str):
    done = subprocess.run([sys.executable, str(REPO / "tests" / "mesh_check.py"), what], cwd=REPO,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_layout_matches_one_device():
    results = mesh_check("models")
    layouts = {(r["arch"], r["layout"]) for r in results}
    for arch in ("qwen3_moe", "olmoe", "mixtral"):
        assert {(arch, lay) for lay in ("ep=4", "ep=2,tp=2", "tp=4")} <= layouts
    assert {("llama", "tp=2"), ("llama", "tp=4")} <= layouts
    for r in results:
        case = f"{r['arch']} {r['layout']} ({r['weights']} weights)"
        assert r["tokens"] == r["one_device"], case
        assert r["max_abs_logit_diff"] < ATOL, case
        tp = MeshSpec.parse(r["layout"]).tp
        assert r["kv_heads_per_device"] == [r["kv_heads"] // tp], case  # KV split with its heads
        # tp past the file's KV heads: each repeated on tp / kv_heads devices, one a device
        assert r["kv_heads"] == max(r["file_kv_heads"], tp), case
    assert {(r["layout"], r["file_kv_heads"], r["kv_heads"]) for r in results if r["arch"] == "qwen3_moe"} >= {
        ("tp=4", 2, 4), ("tp=4", 4, 4)}  # repeated, and split
    assert {(r["arch"], r["layout"]) for r in results if "int8" in r["weights"]} == {
        ("llama", "tp=2"), ("qwen3_moe", "tp=4")}  # an 8-bit cache over the mesh
    ragged = [r["ragged_prefill_vs_golden"] for r in results if r["ragged_prefill_vs_golden"] is not None]
    assert len(ragged) == 3 and max(ragged) < ATOL  # the GPU expert path, against transformers


def test_engine_on_a_mesh_matches_one_device():
    """Actors, three requests batched in three slots, a second turn reusing its prefix,
    and a session file saved from the sharded KV and restored into another slot."""
    r = mesh_check("engine")
    one, mesh = r["one_device"], r["mesh"]
    assert mesh == one
    assert mesh["compiles_after_ready"] == 0  # every sharded shape was compiled before ready
    assert mesh["reused"] == mesh["reusable"] > 0
    assert mesh["third_reused"] > mesh["reusable"]
    assert all(len(tokens) == 5 for tokens in mesh["first"])


def test_tiered_experts_on_meshes_match_resident_on_one_device():
    """A pool of half the experts split over ep=2, ep=4 and ep=2×tp=2 (each device's
    share for its own experts, with tp its share of each one's width): the same greedy
    tokens as resident experts on one device, by one-jit steps, layer by layer (with tp,
    each layer's attention per shard of its heads), through the runner and the Engine;
    every expert in its owner's slots and each device's pool shard holding just those."""
    results = mesh_check("tiered")
    assert {(r["layout"], r["how"]) for r in results} == {("ep=2", "engine"), ("ep=2,tp=2", "engine")} | {
        (lay, how) for lay in ("ep=2", "ep=4", "ep=2,tp=2") for how in ("one-jit", "layers", "runner")}
    for r in results:
        case = f"{r['arch']} {r['layout']} {r['how']}"
        assert r["tokens"] == r["one_device"], case
        assert r["misses"] > 0 and r["counts"], case  # the pool was too small: experts moved
        if r["how"] == "engine":
            assert r["mode"] == "tiered" and r["slots"] == 4, case
            assert r["compiles_after_ready"] == 0, case  # tiered on the mesh: warm at start too
            continue
        assert r["in_owner_range"] and r["shards_hold_own"], case
        assert r["slots_per_device"] == [r["slots"] // MeshSpec.parse(r["layout"]).ep], case
    assert sum(r["one_jit_steps"] for r in results if r["how"] == "one-jit") > 0  # the shard_map step ran
    assert all(r["one_jit_steps"] == r["thrown_away"] == 0 for r in results if r["how"] == "layers")
    assert all("must both divide by 2" in r["uneven_pool"] for r in results)  # 3 slots on ep=2: refused


def test_dispatched_tokens_match_one_device():
    """ep's token dispatch (all_to_all to the experts' ranks and back), forced for every
    batch: prompts of 5, 24 and 64 tokens and greedy decode steps on ep=4 and ep=2×tp=2,
    and with one slot per pair of ranks, where each batch falls back to the psum."""
    results = mesh_check("dispatch")
    for r in results:
        case = f"{r['arch']} {r['layout']} capacity {r['capacity']} {r.get('tokens', 'greedy')}"
        assert r["max_abs_logit_diff"] < ATOL, case
        if "greedy" in r:
            assert r["greedy"] == r["one_device"], case
    prompts = [r for r in results if "tokens" in r]
    assert len(prompts) == 18
    assert sum(r["dispatched"] for r in prompts if r["capacity"] > 1) >= 10  # most fit their slots
    assert not any(r["dispatched"] for r in prompts if r["capacity"] < 1)  # none fit one slot


def test_dispatch_where_it_was_measured_faster():
    """benchmarks/ep_dispatch.py on 4 virtual CPU devices: ep=4 from 32 tokens; not ep=2,
    not a decode batch, and not on GPUs, where it was not measured."""
    assert dispatches(4, 32, "cpu") and dispatches(8, 512, "cpu")
    assert not dispatches(4, 16, "cpu") and not dispatches(2, 512, "cpu") and not dispatches(4, 512, "gpu")


# ---- the option itself, in-process --------------------------------------------------


@pytest.mark.parametrize(("text", "spec"), [
    ("ep=4", MeshSpec(ep=4)), ("tp=2", MeshSpec(tp=2)), ("ep=2,tp=2", MeshSpec(2, 2)),
    (" tp=2 , ep=4 ", MeshSpec(4, 2)),
])
def test_parse(text, spec):
    assert MeshSpec.parse(text) == spec
    assert MeshSpec.parse(str(spec)) == spec


@pytest.mark.parametrize(("text", "words"), [
    ("", "name at least one axis"), ("dp=2", "each part is ep=N or tp=N"), ("ep=0", "positive integer"),
    ("ep=two", "positive integer"), ("ep=2,ep=2", "given twice"), ("ep", "each part is ep=N"),
])
def test_parse_refuses_bad_specs(text, words):
    with pytest.raises(ValueError, match=words):
        MeshSpec.parse(text)


def test_layouts_must_divide_the_model(tiny_model):
    qwen, llama = tiny_model("qwen3_moe").config, tiny_model("llama").config
    MeshSpec(ep=8).check(qwen)
    with pytest.raises(ValueError, match="8 experts do not divide into ep=3"):
        MeshSpec(ep=3).check(qwen)
    MeshSpec(tp=4).check(qwen)  # each of its 2 KV heads on two devices
    with pytest.raises(ValueError, match=r"4 attention heads over 2 KV heads do not split into tp=3 .*; "
                                         r"tp=2 or tp=4 would"):
        MeshSpec(tp=3).check(qwen)
    with pytest.raises(ValueError, match="tp=8 .*; tp=2 or tp=4 would"):
        MeshSpec(tp=8).check(qwen)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        MeshSpec(ep=2).check(llama)


def test_too_few_devices():
    with pytest.raises(ValueError, match="needs 4 devices, but only 1 is visible"):
        MeshSpec(ep=2, tp=2).build()


def test_moe_layer_traffic_psum_against_dispatch(tiny_model):
    cfg = tiny_model("qwen3_moe").config  # d = 64, 2 experts a token
    token = 64 * 4
    assert moe_layer_traffic(cfg, 1, rows=16) == {"psum": 0.0, "dispatch": 0.0}
    four = moe_layer_traffic(cfg, 4, rows=16)
    assert four["psum"] == 2 * 16 * token * 3 / 4
    # 4 tokens a device, each to 3·(1 - (3/4)^2) remote devices on average, and back
    assert four["dispatch"] == pytest.approx(2 * 4 * 3 * (1 - 0.75**2) * token)
    one = moe_layer_traffic(cfg, 4, rows=1)  # one token cannot be split: dispatch sends more
    assert one["dispatch"] > one["psum"]


def test_step_traffic(tiny_model):
    cfg = tiny_model("qwen3_moe").config  # 3 layers, 2 of them MoE; d = 64
    row = 64 * 4  # one token's activation, f32
    assert step_traffic(cfg, MeshSpec(), rows=1)["total"] == 0
    ep4 = step_traffic(cfg, MeshSpec(ep=4), rows=1)
    assert ep4["attention_psum"] == 0 and ep4["ffn_psum"] == 2 * (2 * row * 3 / 4)
    tp2 = step_traffic(cfg, MeshSpec(tp=2), rows=1)
    assert tp2["total"] == 6 * row and tp2["psums_per_step"] == 6
