"""Sharded runs on 4 virtual CPU devices against one device, printing JSON (for
test_mesh.py, which starts this in a subprocess: the device count is fixed when JAX is
imported, and the rest of the suite runs on one device).

    python tests/mesh_check.py models   # greedy tokens and logits per (arch, layout)
    python tests/mesh_check.py engine   # the full Engine on a mesh vs on one device

Layouts the tiny golden checkpoints cannot split (tp=4: they have 2 KV heads) run on the
same architecture with 8 heads / 4 KV heads and seeded random weights.
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
from motet.model.sharding import model_mesh  # noqa: E402
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
    kv = init_kv(model.config, GEO, sharding=model_kv_sharding(model))
    logits, kv = prefill_slot(model, kv, GEO, 1, prompt, 0)
    rows = [np.asarray(logits)]
    tokens = [int(rows[-1].argmax())]
    for i in range(STEPS - 1):
        logits, kv = decode_step(model, kv, GEO, [tokens[-1]], [1], [len(prompt) + i])
        rows.append(np.asarray(logits[0]))
        tokens.append(int(rows[-1].argmax()))
    # KV heads per device after the writes (the cache must stay split with its heads)
    kv_heads = sorted({shard.data.shape[1] for a in kv[0] + kv[1] for shard in a.addressable_shards})
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


def check_models() -> list[dict]:
    cases = [(arch, layout) for arch in MOE_ARCHS for layout in MOE_LAYOUTS]
    cases += [("llama", layout) for layout in DENSE_LAYOUTS]
    results, references = [], {}
    for arch, layout in cases:
        prompt = np.load(GOLDEN / arch / "golden.npz")["prompt_ids"].tolist()
        tiny = load_model(GOLDEN / arch).config
        try:
            model_mesh(layout, tiny)
            weights, make = "golden", (lambda mesh, arch=arch: load_model(GOLDEN / arch, mesh=mesh))
        except ValueError:  # the tiny checkpoint does not split this way
            weights, make = "random 8 heads / 4 KV heads", (lambda mesh, arch=arch: random_model(arch, mesh))
        if (arch, weights) not in references:
            references[arch, weights] = greedy(make(None), prompt)
        ref_tokens, ref_logits, _ = references[arch, weights]
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
            "kv_heads_per_device": kv_heads,
        })
    return results


async def _engine_turns(model_path: Path, mesh) -> dict:
    import trio

    from motet.engine import Engine

    prompt = np.load(model_path / "golden.npz")["prompt_ids"].tolist()
    prompts = [prompt, prompt[3:], prompt[::-1]]
    async with Engine(model_path, mesh=mesh, kv_slots=4, max_context=96, prefill_chunk=16) as engine:
        first: dict[int, tuple] = {}

        async def one(i):
            got = await engine.complete(prompts[i], max_tokens=5, slot=i)
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
    return {"first": [list(first[i]) for i in range(len(prompts))], "second": list(second.token_ids),
            "reused": second.stats.reused_tokens, "reusable": len(prompts[0]) + len(first[0]) - 1,
            "third": list(third.token_ids), "third_reused": third.stats.reused_tokens}


def check_engine(arch: str = "qwen3_moe", mesh: str = "ep=2,tp=2") -> dict:
    import trio

    one = trio.run(_engine_turns, GOLDEN / arch, None)
    sharded = trio.run(_engine_turns, GOLDEN / arch, mesh)
    return {"arch": arch, "layout": mesh, "one_device": one, "mesh": sharded}


def main(argv: list[str]) -> None:
    what = argv[1] if len(argv) > 1 else "models"
    if len(jax.devices()) != DEVICES:
        raise SystemExit(f"expected {DEVICES} devices, got {jax.devices()}")
    out = check_models() if what == "models" else check_engine()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv)
