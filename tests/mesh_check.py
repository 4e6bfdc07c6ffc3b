"""Sharded runs on 4 virtual CPU devices against one device, printing JSON (for
test_mesh.py, which starts this in a subprocess: the device count is fixed when JAX is
imported, and the rest of the suite runs on one device).

    python tests/mesh_check.py models   # greedy tokens and logits per (arch, layout)
    python tests/mesh_check.py engine   # the full Engine on a mesh vs on one device
    python tests/mesh_check.py tiered   # tiered experts, a pool per ep device, vs resident
    python tests/mesh_check.py dispatch # ep's token dispatch (all_to_all) vs one device

The tiny golden checkpoints have 4 query heads over 2 KV heads, so at tp=4 each KV head
is repeated on two devices; one more case splits 4 KV heads over tp=4 (the same
architecture with 8 heads / 4 KV heads and seeded random weights).
"""

from __future__ import annotations

import os
import sys
import tempfile

DEVICES = 4
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
).strip()

import json  # noqa: E402
from dataclasses import replace  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden"
jax.config.update("jax_compilation_cache_dir", str(REPO / ".jax_cache" / "mesh"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

from motet.model import load_model  # noqa: E402
from motet.model.generate import decode_step, model_kv_sharding, prefill_slot  # noqa: E402
from motet.model.kv import KVGeometry, init_kv  # noqa: E402
from motet.model.model import Model  # noqa: E402
from motet.model.sharding import gate_up_layout, model_mesh  # noqa: E402
from motet.model.weights import pack_weights  # noqa: E402

MOE_ARCHS = ("qwen3_moe", "olmoe", "mixtral")
MOE_LAYOUTS = ("ep=4", "ep=2,tp=2", "tp=4")
DENSE_LAYOUTS = ("tp=2", "tp=4")
STEPS = 4  # greedy tokens per run: the prefill's and 3 decode steps'
# One chunk holds every golden prompt (so prefill compiles once per layout).
GEO = KVGeometry(n_slots=2, max_context=96, chunk=64)


class RandomSource:
    """Seeded random tensors in the shapes pack_weights asks for (weights.TensorSource)."""

    def __init__(self, cfg, seed: int = 0):
        d, hd, f, ff = cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size, cfg.intermediate_size
        q, kv, e = cfg.n_heads * hd, cfg.n_kv_heads * hd, cfg.n_experts
        norm = (hd, hd) if cfg.qk_norm == "head" else (q, kv)
        self.shapes = {
            "embed": (cfg.vocab_size, d), "lm_head": (cfg.vocab_size, d), "final_norm": (d,),
            "q": (q, d), "k": (kv, d), "v": (kv, d), "o": (d, q), "attn_norm": (d,), "ffn_norm": (d,),
            "q_norm": (norm[0],), "k_norm": (norm[1],), "router": (e, d),
            "experts.gate": (e, f, d), "experts.up": (e, f, d), "experts.down": (e, d, f),
            "gate": (ff, d), "up": (ff, d), "down": (d, ff),
        }
        self.seed = seed

    def _shape(self, name: str):
        layer, _, rest = name.partition(".")
        return self.shapes[rest if layer.isdigit() else name]

    def has(self, name: str) -> bool:
        return True

    def describe(self, name: str) -> str:
        return f"random {name}"

    def release_pages(self) -> None:  # nothing is mapped
        pass

    def file_rows(self, name: str) -> None:
        return None

    def get(self, name: str) -> np.ndarray:
        shape = self._shape(name)
        rng = np.random.default_rng([self.seed, sum(map(ord, name)), len(name)])
        if len(shape) == 1:  # norms
            return (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        scale = 3.0 if name in ("lm_head", "embed") else 1.0  # sharp logits: clear greedy picks
        return (scale * rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)


def random_model(arch: str, mesh=None) -> Model:
    """The golden arch with 8 heads / 4 KV heads (tp=4 divides them) and random weights."""
    golden = load_model(GOLDEN / arch)
    cfg = replace(golden.config, n_heads=8, n_kv_heads=4)
    weights = pack_weights(cfg, RandomSource(cfg), mesh=None if mesh is None else model_mesh(mesh, cfg))
    return replace(golden, config=cfg, weights=weights)


def greedy(model: Model, prompt: list[int]):
    """STEPS greedy tokens through prefill_slot/decode_step in slot 1, and their logits."""
    kv = init_kv(model.config, GEO, model.kv_dtype, sharding=model_kv_sharding(model))
    logits, kv = prefill_slot(model, kv, GEO, 1, prompt, 0)
    rows = [np.asarray(logits)]
    tokens = [int(rows[-1].argmax())]
    for i in range(STEPS - 1):
        logits, kv = decode_step(model, kv, GEO, [tokens[-1]], [1], [len(prompt) + i])
        rows.append(np.asarray(logits[0]))
        tokens.append(int(rows[-1].argmax()))
    # KV heads per device after the writes (the cache must stay split with its heads)
    kv_heads = sorted({shard.data.shape[1] for a in jax.tree.leaves(kv) for shard in a.addressable_shards})
    return tokens, np.stack(rows), kv_heads


def ragged_prefill_error(model: Model, arch: str) -> float:
    """Max |logit - transformers'| of a whole-prompt prefill through the ragged_dot expert
    path (the GPU one; the CPU default is grouped), on the mesh."""
    import jax.numpy as jnp

    from motet.model.forward import prefill
    from motet.model.kv import bucket

    golden = np.load(GOLDEN / arch / "golden.npz")
    n = len(golden["prompt_ids"])
    padded = np.zeros(bucket(n), np.int32)
    padded[:n] = golden["prompt_ids"]
    logits, _, _, _ = prefill(model.weights, [], [], jnp.asarray(padded), 0, 0, n, cfg=model.config,
                              with_history=False, all_logits=True, moe_impl="ragged")
    return float(np.abs(np.asarray(logits[:n]) - golden["logits"]).max())


RANDOM = "random 8 heads / 4 KV heads"
INT8_KV = "golden, an int8 KV cache"


def check_models() -> list[dict]:
    cases = [(arch, layout, "golden") for arch in MOE_ARCHS for layout in MOE_LAYOUTS]
    cases += [("llama", layout, "golden") for layout in DENSE_LAYOUTS] + [("qwen3_moe", "tp=4", RANDOM)]
    cases += [("llama", "tp=2", INT8_KV), ("qwen3_moe", "tp=4", INT8_KV)]  # values and scales split alike
    results, references = [], {}
    for arch, layout, weights in cases:
        prompt = np.load(GOLDEN / arch / "golden.npz")["prompt_ids"].tolist()
        if weights in ("golden", INT8_KV):
            kv_dtype = "int8" if weights == INT8_KV else "auto"
            make = lambda mesh, arch=arch, kv_dtype=kv_dtype: load_model(GOLDEN / arch, mesh=mesh,  # noqa: E731
                                                                          kv_dtype=kv_dtype)
        else:
            make = lambda mesh, arch=arch: random_model(arch, mesh)  # noqa: E731
        if (arch, weights) not in references:
            one = make(None)
            references[arch, weights] = (*greedy(one, prompt), one.config.n_kv_heads)
        ref_tokens, ref_logits, _, _ = references[arch, weights]
        model = make(layout)
        tokens, logits, kv_heads = greedy(model, prompt)
        ragged = None
        if weights == "golden" and arch in MOE_ARCHS and layout == "ep=2,tp=2":
            ragged = ragged_prefill_error(model, arch)
        results.append({
            "arch": arch, "layout": layout, "weights": weights, "tokens": tokens, "one_device": ref_tokens,
            "ragged_prefill_vs_golden": ragged,
            "max_abs_logit_diff": float(np.abs(logits - ref_logits).max()),
            "logit_scale": float(np.abs(ref_logits).max()), "kv_heads": model.config.n_kv_heads,
            "file_kv_heads": references[arch, weights][3],
            "kv_heads_per_device": kv_heads,
        })
    return results


async def _engine_turns(model_path: Path, mesh) -> dict:
    import trio

    from motet.engines.engine import Engine

    prompt = np.load(model_path / "golden.npz")["prompt_ids"].tolist()
    prompts = [prompt, prompt[3:], prompt[::-1]]
    async with Engine(model_path, mesh=mesh, kv_slots=4, max_context=96, prefill_chunk=16,
                      prefill_chunk_alone=16) as engine:
        first: dict[int, tuple] = {}

        async def one(i):
            # the second stream penalized: its batches sample again, on the mesh too
            extra = {"frequency_penalty": 1.5, "logit_bias": {prompt[0]: 2.0}} if i == 1 else {}
            got = await engine.complete(prompts[i], max_tokens=5, slot=i, **extra)
            first[i] = got.token_ids

        async with trio.open_nursery() as nursery:  # three streams batched together
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        follow = prompts[0] + list(first[0]) + prompt[:7]
        second = await engine.complete(follow, max_tokens=5, slot=0)
        # The slot's KV through a session file (read from and written into the sharded
        # cache) into another slot, and a third turn there.
        with tempfile.TemporaryDirectory() as tmp:
            await engine.save_slot(0, Path(tmp) / "s0")
            await engine.restore_slot(3, Path(tmp) / "s0")
        third = await engine.complete(follow + list(second.token_ids) + prompt[7:9], max_tokens=5, slot=3)
        compiles = engine.startup().compiles_after_ready  # every sharded shape compiled at start
    return {"first": [list(first[i]) for i in range(len(prompts))], "second": list(second.token_ids),
            "reused": second.stats.reused_tokens, "reusable": len(prompts[0]) + len(first[0]) - 1,
            "third": list(third.token_ids), "third_reused": third.stats.reused_tokens,
            "compiles_after_ready": compiles}


def check_engine(arch: str = "qwen3_moe", mesh: str = "ep=2,tp=2") -> dict:
    import trio

    one = trio.run(_engine_turns, GOLDEN / arch, None)
    sharded = trio.run(_engine_turns, GOLDEN / arch, mesh)
    return {"arch": arch, "layout": mesh, "one_device": one, "mesh": sharded}


# Prompts of two chunks and more (prefill reads its history), and enough decode steps
# for the pool to miss, evict and prefetch.
TIERED_GEO = KVGeometry(n_slots=2, max_context=64, chunk=16)
TIERED_STEPS = 8


def _tiered_greedy(prefill, decode, prompt: list[int]) -> list[int]:
    """TIERED_STEPS greedy tokens, then the last decode step three times more (the same
    token at the same position: once what it needs is in the pool, a one-jit step)."""
    tokens = [prefill(prompt)]
    for i in range(TIERED_STEPS - 1):
        tokens.append(decode(tokens[-1], len(prompt) + i))
    return tokens + [decode(tokens[-2], len(prompt) + TIERED_STEPS - 2) for _ in range(3)]


def _pool_owners(pool) -> dict:
    """Whether every expert sits in its owner's slot range, and whether each device's
    shard of every pool array holds exactly the experts of its own range (compared with
    the model file's copy: with tp, its own columns of the tp-ordered gate/up)."""
    tp = pool.mesh.shape["tp"] if pool.mesh is not None else 1
    in_range, shards_ok, shard_slots = True, True, set()
    for r in range(pool.R):
        for g in range(pool.groups):
            held = pool.occupant[r, list(pool.owner_slots(g))]
            in_range &= bool(all(e < 0 or pool.owner(int(e)) == g for e in held))
        for shard in pool.pools[r][0].addressable_shards:
            rows = range(*shard.index[0].indices(pool.C))
            shard_slots.add(len(rows))
            for s in rows:
                e = int(pool.occupant[r, s])
                if e >= 0:
                    want = gate_up_layout(np.asarray(pool.reader.read(r, e)[0]), tp)[shard.index[1:]]
                    shards_ok &= bool(np.allclose(np.asarray(shard.data)[s - rows.start], want))
    return {"in_owner_range": in_range, "shards_hold_own": shards_ok, "slots_per_device": sorted(shard_slots)}


def _count_fused(tiered) -> dict:
    """Count the tiered model's one-jit steps kept and thrown away (a missing expert)."""
    counts, run = {"kept": 0, "thrown": 0}, tiered._fused

    def counted(n, step):
        tried = tiered.allow_optimistic and tiered.optimistic
        out = run(n, step)
        if tried:
            counts["kept" if out is not None else "thrown"] += 1
        return out

    tiered._fused = counted
    return counts


def check_tiered(arch: str = "qwen3_moe") -> list[dict]:
    """Tiered experts at a pool of half the experts on ep=2, ep=4 and ep=2,tp=2 (each
    device's share of the pool for its own experts) against resident experts on one device: the
    TieredModel both ways (one-jit steps with prefetch, layer by layer without), and the
    ModelRunner built with a tiered plan on the mesh."""
    import trio

    from motet.actors.expert_policy import ExpertPlan
    from motet.actors.runner import ModelRunner, SamplingRow
    from motet.model.expert_pool import ExpertPool
    from motet.model.expert_source import ArrayExpertReader
    from motet.model.tiered_model import TieredModel

    resident = load_model(GOLDEN / arch)
    cfg = resident.config
    prompt = np.load(GOLDEN / arch / "golden.npz")["prompt_ids"].tolist()
    prompt += np.random.default_rng(7).integers(3, cfg.vocab_size, 20).tolist()

    def resident_prefill(ids):
        state["kv"] = init_kv(cfg, TIERED_GEO)
        logits, state["kv"] = prefill_slot(resident, state["kv"], TIERED_GEO, 1, ids, 0)
        return int(np.asarray(logits).argmax())

    def resident_decode(token, at):
        logits, state["kv"] = decode_step(resident, state["kv"], TIERED_GEO, [token], [1], [at])
        return int(np.asarray(logits[0]).argmax())

    state: dict = {}
    want = _tiered_greedy(resident_prefill, resident_decode, prompt)
    try:  # a pool that does not split into equal ranges per ep group
        ExpertPool(ArrayExpertReader.from_weights(cfg, resident.weights), sum(cfg.moe_layers), cfg.n_experts,
                   3, None, mesh=model_mesh("ep=2", cfg))
        uneven = "accepted"
    except ValueError as exc:
        uneven = str(exc)
    slots, results = cfg.n_experts // 2, []
    for layout in ("ep=2", "ep=4", "ep=2,tp=2"):
        lazy = load_model(GOLDEN / arch, lazy_experts=True, mesh=layout)
        for prefetch, optimistic in ((True, True), (False, False)):
            pool = ExpertPool(lazy.expert_reader, sum(cfg.moe_layers), cfg.n_experts, slots, None, mesh=model_mesh(layout, cfg))
            pool.fill(np.zeros((pool.R, pool.E)))
            tiered = TieredModel(lazy, pool, prefetch=prefetch, optimistic=optimistic)
            fused = _count_fused(tiered)

            def tiered_prefill(ids):
                state["kv"] = init_kv(cfg, TIERED_GEO, sharding=model_kv_sharding(lazy))
                logits, state["kv"], _ = tiered.prefill_slot(state["kv"], TIERED_GEO, 1, ids, 0)
                return int(np.asarray(logits).argmax())

            def tiered_decode(token, at):
                logits, state["kv"], _ = tiered.decode_step(state["kv"], TIERED_GEO, [token], [1], [at])
                return int(np.asarray(logits[0]).argmax())

            tokens = _tiered_greedy(tiered_prefill, tiered_decode, prompt)
            stats = pool.take_stats()
            results.append({"arch": arch, "layout": layout, "how": "one-jit" if optimistic else "layers",
                            "tokens": tokens, "one_device": want, "slots": slots,
                            "misses": stats.lookups - stats.hits, "moves": len(stats.moves),
                            "one_jit_steps": fused["kept"], "thrown_away": fused["thrown"],
                            "counts": sum(pool.counts()) == pool.R * pool.E, **_pool_owners(pool)})
        # the runner, given a tiered plan and the mesh, on the model loaded on one device
        plan = ExpertPlan("tiered", sum(cfg.moe_layers), cfg.n_experts, slots, None, 1)
        runner = ModelRunner(resident, TIERED_GEO, plan, mesh=layout)
        greedy_row = SamplingRow(0.0, 1.0, 0, 0.0, ModelRunner.new_key(0), False)
        tokens = _tiered_greedy(lambda ids: runner.prefill(1, ids, 0, greedy_row)[0].token,
                                lambda token, at: runner.decode([token], [1], [at], [greedy_row])[0].token, prompt)
        runner.take_expert_step()  # adds the run's lookups and hits to its totals
        results.append({"arch": arch, "layout": layout, "how": "runner", "tokens": tokens, "one_device": want,
                        "slots": slots, "misses": int(runner.totals[0] - runner.totals[1]), "moves": None,
                        "one_jit_steps": None, "thrown_away": None,
                        "counts": True, **_pool_owners(runner.pool)})
    # the full Engine with a budget of half the experts per layer, on ep=2 and ep=2,tp=2
    one = trio.run(_tiered_engine, None)
    for layout in ("ep=2", "ep=2,tp=2"):
        engine = trio.run(_tiered_engine, layout)
        results.append({"arch": arch, "layout": layout, "how": "engine", "tokens": engine["tokens"],
                        "one_device": one["tokens"], "slots": engine["pool_slots"], "misses": engine["misses"],
                        "moves": None, "one_jit_steps": None, "thrown_away": None, "counts": engine["counts"],
                        "mode": engine["mode"], "compiles_after_ready": engine["compiles_after_ready"]})
    return [{**r, "uneven_pool": uneven} for r in results]


async def _tiered_engine(mesh, arch: str = "qwen3_moe") -> dict:
    """Three requests through an Engine: resident on one device (mesh None), or tiered at
    half the experts per layer on the mesh."""
    from motet.engines.engine import Engine
    from motet.runtime.config import ExpertSettings

    path = GOLDEN / arch
    prompt = np.load(path / "golden.npz")["prompt_ids"].tolist()
    with tempfile.TemporaryDirectory() as tmp:
        half = load_model(path).config.n_experts // 2
        experts = None if mesh is None else ExpertSettings(device_experts_per_layer=half, heat_file=Path(tmp) / "heat.json")
        async with Engine(path, mesh=mesh, kv_slots=4, max_context=96, prefill_chunk=16, prefill_chunk_alone=16,
                          experts=experts) as engine:
            tokens = [list((await engine.complete(p, max_tokens=6)).token_ids)
                      for p in (prompt, prompt[::-1], prompt[2:])]
            tiers = engine.expert_tiers()
            compiles = engine.startup().compiles_after_ready
    return {"tokens": tokens, "mode": tiers.mode, "pool_slots": tiers.pool_slots, "misses": tiers.lookups - tiers.hits,
            "counts": tiers.device + tiers.ram + tiers.disk == tiers.rows * tiers.cols,
            "compiles_after_ready": compiles}


def check_dispatch() -> list[dict]:
    """Every batch dispatched over ep (moe.experts_dispatched, its threshold set to one
    token): whole prompts of several lengths and greedy decode steps, against one
    device; then with one slot per pair of ranks, where every batch overflows and takes
    the replicate-and-psum path."""
    import jax.numpy as jnp

    from motet.model import moe
    from motet.model.forward import prefill
    from motet.model.kv import bucket

    moe.DISPATCH_MIN_TOKENS, moe.DISPATCH_MIN_EP = {"cpu": 1}, 2
    results = []
    for arch in ("qwen3_moe", "mixtral"):
        prompt = np.load(GOLDEN / arch / "golden.npz")["prompt_ids"]
        one = load_model(GOLDEN / arch)
        for layout, capacity in (("ep=4", 2.0), ("ep=2,tp=2", 2.0), ("ep=4", 1e-3)):
            moe.DISPATCH_CAPACITY = capacity
            jax.clear_caches()  # the steps read these constants when traced
            model = load_model(GOLDEN / arch, mesh=layout)
            ep = int(layout.split(",")[0].split("=")[1])
            for n in (5, 24, 64):
                ids = np.resize(prompt, n)
                padded = jnp.asarray(np.pad(ids, (0, bucket(n) - n)).astype(np.int32))
                run = [prefill(m.weights, [], [], padded, 0, 0, n, cfg=m.config, with_history=False,
                               all_logits=True) for m in (one, model)]
                want, got = (np.asarray(r[0][:n]) for r in run)
                chosen = np.asarray(run[0][3][0])  # the first MoE layer's experts [t, k]
                share = -(-len(chosen) // ep)
                per_rank = chosen.reshape(-1, chosen.shape[1]) // (model.config.n_experts // ep)
                counts = [np.bincount(per_rank[r * share:(r + 1) * share].ravel(), minlength=ep).max()
                          for r in range(ep)]
                results.append({"arch": arch, "layout": layout, "capacity": capacity, "tokens": n,
                                "dispatched": bool(max(counts) <= max(1, int(capacity * share * chosen.shape[1] / ep))),
                                "max_abs_logit_diff": float(np.abs(got - want).max()),
                                "logit_scale": float(np.abs(want).max())})
            tokens, logits, _ = greedy(model, prompt.tolist())
            ref_tokens, ref_logits, _ = greedy(one, prompt.tolist())
            results.append({"arch": arch, "layout": layout, "capacity": capacity, "greedy": tokens,
                            "one_device": ref_tokens, "max_abs_logit_diff": float(np.abs(logits - ref_logits).max()),
                            "logit_scale": float(np.abs(ref_logits).max())})
    return results


def main(argv: list[str]) -> None:
    what = argv[1] if len(argv) > 1 else "models"
    if len(jax.devices()) != DEVICES:
        raise SystemExit(f"expected {DEVICES} devices, got {jax.devices()}")
    out = {"models": check_models, "engine": check_engine, "tiered": check_tiered, "dispatch": check_dispatch}[what]()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv)
