"""Tiered experts against resident ones, on a synthetic MoE of realistic routing geometry
(16 MoE layers, 64 experts, top-8; hidden sizes scaled down for a 2-core CPU): decode
tokens/s and expert-pool hit rate at pools of 100%, 50%, 25% and 12.5% of the experts,
for the heat policy with prefetch, the heat policy without it, and plain LRU.

    .venv/bin/python benchmarks/expert_tiers.py [--quick] [--rows 1,4]   (6-12 minutes; --quick 2)

NOT a trained model. Its routing is made skewed and local on purpose, the way real MoE
routing is: tokens come from topics (Zipf-popular, s=1.1) in runs of ~24 tokens
(temporal locality); a token's embedding is its topic's direction plus noise; and each
layer's router leans each topic toward 12 experts drawn Zipf-like (s=0.8) over the 64
(a popular expert serves many topics); the layers' weights (std 0.07) move the hidden
state enough that the next layer's router, applied early, guesses about 85% of its
experts (the synthetic model sets that figure, a trained one has its own). The experts
off the device are read from .npy files on local disk through np.memmap (the "disk"
tier; the page cache may serve them). Tokens are fed from the streams (teacher
forcing), the same for every configuration, and tiered greedy choices are checked
against resident ones. On a CPU the "device" is host memory too: a load is a copy that
nothing overlaps, so prefetch's extra loads cost throughput here that an accelerator's
asynchronous copies would hide; the hit rate is the policy's own measure.

Prints one JSON object, then a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from motet.actors.expert_policy import ExpertPolicy, PolicySettings
from motet.actors.runner import MAX_MOVES_PER_PLACEMENT
from motet.model import ModelConfig
from motet.model.expert_pool import ExpertPool
from motet.model.expert_source import ArrayExpertReader
from motet.model.generate import decode_step, prefill_slot
from motet.model.kv import KVGeometry, init_kv
from motet.model.model import Model
from motet.model.tiered_model import TieredModel

TOPICS, TOPIC_EXPERTS, RUN_LENGTH = 48, 12, 24
TOPIC_ZIPF, EXPERT_ZIPF = 1.1, 0.8
LAYER_SCALE = 0.07  # std of the layers' weights: how far each layer moves the hidden state
PROMPT = 8  # tokens prefilled per row before decoding
POLICIES = {  # name → (PolicySettings kind, prefetch)
    "heat+prefetch": ("heat", True),
    "heat": ("heat", False),
    "lru": ("lru", False),
}


def config() -> ModelConfig:
    return ModelConfig(
        arch="qwen3_moe", vocab_size=4096, hidden_size=256, n_layers=16, n_heads=4, n_kv_heads=2,
        head_dim=64, intermediate_size=0, rope_theta=1e6, rms_eps=1e-6, max_context=1024,
        tie_embeddings=False, qk_norm="head", n_experts=64, n_experts_per_tok=8,
        moe_intermediate_size=256, norm_topk_prob=True,
    )


def zipf(n: int, s: float) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1) ** s
    return p / p.sum()


def synthetic(cfg: ModelConfig, seed: int = 0):
    """(weights in weights.py's layout, topic of each token, topic directions)."""
    rng = np.random.default_rng(seed)
    d, e, f, hd = cfg.hidden_size, cfg.n_experts, cfg.moe_intermediate_size, cfg.head_dim

    def w(*shape, scale):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * scale)

    centers = rng.standard_normal((TOPICS, d)).astype(np.float32)
    token_topic = np.arange(cfg.vocab_size) % TOPICS
    embed = centers[token_topic] + 0.6 * rng.standard_normal((cfg.vocab_size, d)).astype(np.float32)
    popular = zipf(e, EXPERT_ZIPF)
    layers = []
    for _ in range(cfg.n_layers):
        router = rng.standard_normal((d, e)).astype(np.float32) * 0.02
        for t in range(TOPICS):  # each topic leans toward its experts in this layer
            chosen = rng.choice(e, TOPIC_EXPERTS, replace=False, p=popular)
            router[:, chosen] += 0.35 * centers[t][:, None] / np.sqrt(d)
        layers.append({
            "attn_norm": jnp.ones(d), "ffn_norm": jnp.ones(d), "q_norm": jnp.ones(hd), "k_norm": jnp.ones(hd),
            "wqkv": w(d, (cfg.n_heads + 2 * cfg.n_kv_heads) * hd, scale=LAYER_SCALE),
            "wo": w(cfg.n_heads * hd, d, scale=LAYER_SCALE), "router": jnp.asarray(router),
            "experts_gate_up": w(e, d, 2 * f, scale=LAYER_SCALE), "experts_down": w(e, f, d, scale=LAYER_SCALE),
        })
    weights = {"embed": jnp.asarray(embed), "lm_head": w(d, cfg.vocab_size, scale=0.05),
               "final_norm": jnp.ones(d), "layers": layers}
    return weights, token_topic


def streams(rows: int, steps: int, token_topic: np.ndarray, seed: int = 1) -> np.ndarray:
    """[steps, rows] tokens: runs of one topic (geometric lengths, mean RUN_LENGTH), topics
    drawn Zipf-like; each token a random one of its topic's."""
    rng = np.random.default_rng(seed)
    by_topic = [np.flatnonzero(token_topic == t) for t in range(TOPICS)]
    out = np.zeros((steps, rows), np.int32)
    for r in range(rows):
        i = 0
        while i < steps:
            topic = rng.choice(TOPICS, p=zipf(TOPICS, TOPIC_ZIPF))
            n = rng.geometric(1 / RUN_LENGTH)
            out[i : i + n, r] = rng.choice(by_topic[topic], min(n, steps - i))
            i += n
    return out


def write_experts(weights: dict, folder: Path) -> ArrayExpertReader:
    """Each layer's experts to .npy files, read back as memmaps: the disk tier."""
    gate_up, down = [], []
    for i, layer in enumerate(weights["layers"]):
        for name, out in (("experts_gate_up", gate_up), ("experts_down", down)):
            path = folder / f"{i}.{name}.npy"
            np.save(path, np.asarray(layer[name]))
            out.append(np.load(path, mmap_mode="r"))
    return ArrayExpertReader(gate_up, down)


class Lane:
    """One way of running the model: prefill(slot, ids), step(tokens, slots, positions)
    → (logits, routing [layers, rows, k]), and after(routing) between steps."""

    def __init__(self, prefill, step, after=lambda routing: None):
        self.prefill, self.step, self.after = prefill, step, after
        self.times, self.choices = [], []


def run_lanes(tokens: np.ndarray, warmup: int, lanes: list[Lane]) -> None:
    """Prefill each row's prompt, then decode the rest of its stream, the lanes in
    lockstep: a step of each in turn, so both see the same machine (others' load on
    this shared host comes and goes). Steps after `warmup` are timed (compiles and the
    pool filling up are not)."""
    rows = tokens.shape[1]
    for lane in lanes:
        for r in range(rows):
            lane.prefill(r, tokens[:PROMPT, r].tolist())
    for i in range(PROMPT, len(tokens)):
        for lane in lanes:
            t = time.perf_counter()
            logits, routing = lane.step(tokens[i].tolist(), list(range(rows)), [i] * rows)
            lane.choices.append(np.asarray(logits).argmax(-1))
            lane.after(routing)
            if i - PROMPT >= warmup:
                lane.times.append(time.perf_counter() - t)


def speed(lane: Lane, rows: int) -> dict:
    step = float(np.median(lane.times))
    return {"step_ms": step * 1e3, "tok_s": rows / step}


def resident(model: Model, geo: KVGeometry, keep_routing: bool = False) -> Lane:
    state = {"kv": init_kv(model.config, geo)}

    def prefill(slot, ids):
        _, state["kv"] = prefill_slot(model, state["kv"], geo, slot, ids, 0)

    def step(tokens, slots, positions):
        logits, state["kv"], routing = decode_step(model, state["kv"], geo, tokens, slots, positions,
                                                   with_routing=True)
        return logits, routing

    lane = Lane(prefill, step)
    if keep_routing:
        lane.routing = []
        lane.after = lane.routing.append
    return lane


def tiered(model: Model, reader, geo: KVGeometry, slots: int, policy_name: str, warmup: int) -> Lane:
    """The runner's loop without the actors around it: the policy's placement applied
    before each step (as the scheduler does with the ExpertCache's), its heat fed after."""
    cfg = model.config
    kind, prefetch = POLICIES[policy_name]
    R, E, k = cfg.n_layers, cfg.n_experts, cfg.n_experts_per_tok
    policy = ExpertPolicy(R, E, slots, k, None, PolicySettings(kind=kind, prefetch=prefetch))
    pool = ExpertPool(reader, R, E, slots, None)
    pool.fill(policy.rank())
    model_t = TieredModel(model, pool, prefetch=prefetch)
    state = {"kv": init_kv(cfg, geo)}
    totals = np.zeros(6)

    def prefill(slot, ids):
        _, state["kv"], _ = model_t.prefill_slot(state["kv"], geo, slot, ids, 0)

    def step(tokens, rows, positions):
        if policy.placement_due():
            pool.apply(policy.placement(), MAX_MOVES_PER_PLACEMENT)
        logits, state["kv"], routing = model_t.decode_step(state["kv"], geo, tokens, rows, positions)
        return logits, routing

    def after(routing):
        counts = np.zeros((R, E))
        for r in range(R):
            np.add.at(counts[r], routing[r].reshape(-1), 1)
        policy.observe(counts)
        s = pool.take_stats()
        if policy.step > warmup:
            totals[:] += (s.lookups, s.hits, s.guessed, s.guessed_right, s.routed_after_guess,
                          sum(m.new_tier == 2 for m in s.moves))

    lane = Lane(prefill, step, after)
    lane.totals = totals
    return lane


def pool_figures(lane: Lane) -> dict:
    lookups, hits, guessed, right, routed, loads = lane.totals
    return {"hit_rate": hits / lookups, "loads_per_step": loads / len(lane.times),
            "prefetch_recall": right / routed if routed else None,
            "prefetch_precision": right / guessed if guessed else None}


def routing_shape(routing: np.ndarray, experts: int) -> dict:
    """How skewed and local the synthetic routing is: usage entropy (bits; uniform is
    log2 E) and the share of a row's experts a layer reuses from the step before."""
    steps, layers, rows, k = routing.shape
    usage = np.zeros((layers, experts))
    for s in range(steps):
        for r in range(layers):
            np.add.at(usage[r], routing[s, r].reshape(-1), 1)
    p = usage / usage.sum(1, keepdims=True)
    entropy = float(np.mean([-(q[q > 0] * np.log2(q[q > 0])).sum() for q in p]))
    reuse = np.mean([len(set(routing[s, r, b]) & set(routing[s - 1, r, b])) / k
                     for s in range(1, steps) for r in range(layers) for b in range(rows)])
    top8 = float(np.mean(np.sort(p, axis=1)[:, -8:].sum(1)))
    return {"usage_entropy_bits": entropy, "uniform_bits": float(np.log2(experts)),
            "top8_share": top8, "consecutive_reuse": float(reuse)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, batch 1 only (about 2 minutes)")
    parser.add_argument("--rows", default=None, help="decode batch sizes, comma-separated (default 1,4)")
    args = parser.parse_args(argv)
    args.rows = args.rows or ("1" if args.quick else "1,4")
    cfg = config()
    weights, token_topic = synthetic(cfg)
    model = Model(config=cfg, weights=weights, tokenizer=None, path=Path("synthetic"), dtype="float32")
    warmup, steps = (16, 48) if args.quick else (24, 80)
    result = {"model": "synthetic MoE, 16 layers x 64 experts, top-8, d=256, f=256 (not trained)",
              "routing": f"topics Zipf s={TOPIC_ZIPF}, runs ~{RUN_LENGTH} tokens, {TOPIC_EXPERTS} experts "
                         f"per topic per layer drawn Zipf s={EXPERT_ZIPF}",
              "backend": jax.default_backend(), "timed_steps": steps, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        reader = write_experts(weights, Path(tmp))
        for rows in (int(r) for r in args.rows.split(",")):
            tokens = streams(rows, PROMPT + warmup + steps, token_topic)
            geo = KVGeometry(n_slots=rows, max_context=1024, chunk=16)
            for frac in (1.0, 0.5, 0.25, 0.125):
                for name in POLICIES:
                    base = resident(model, geo, keep_routing=True)
                    lane = tiered(model, reader, geo, int(cfg.n_experts * frac), name, warmup)
                    run_lanes(tokens, warmup, [base, lane])
                    if f"routing_b{rows}" not in result:
                        result[f"routing_b{rows}"] = routing_shape(np.stack(base.routing), cfg.n_experts)
                    same = float((np.stack(lane.choices) == np.stack(base.choices)).mean())
                    mine, theirs = speed(lane, rows), speed(base, rows)
                    result["runs"].append({
                        "rows": rows, "pool": frac, "policy": name, **mine, "resident_tok_s": theirs["tok_s"],
                        "vs_resident": mine["tok_s"] / theirs["tok_s"], **pool_figures(lane), "same_greedy": same,
                    })
    print(json.dumps(result, indent=1, default=float))
    print(f"\n{result['model']}; routing: {result['routing']}")
    for rows in (int(r) for r in args.rows.split(",")):
        shape = result[f"routing_b{rows}"]
        print(f"\nbatch {rows}: routing entropy {shape['usage_entropy_bits']:.2f} of {shape['uniform_bits']:.0f} bits, "
              f"top-8 experts take {shape['top8_share']:.0%}, {shape['consecutive_reuse']:.0%} of a token's experts "
              "reused by the next; resident and tiered timed in lockstep (median step)")
        runs = [r for r in result["runs"] if r["rows"] == rows]
        print(f"{'pool':>6} {'policy':<14} {'tok/s':>7} {'resident':>8} {'ratio':>6} {'hit':>6} {'vs lru':>7} "
              f"{'prefetch recall':>15} {'loads/step':>10} {'same':>5}")
        for r in runs:
            lru = next(x for x in runs if x["pool"] == r["pool"] and x["policy"] == "lru")
            pf = f"{r['prefetch_recall']:.0%}" if r["prefetch_recall"] is not None else "-"
            print(f"{r['pool']:>6.1%} {r['policy']:<14} {r['tok_s']:>7.1f} {r['resident_tok_s']:>8.1f} "
                  f"{r['vs_resident']:>6.0%} {r['hit_rate']:>6.1%} {100 * (r['hit_rate'] - lru['hit_rate']):>+6.1f}p "
                  f"{pf:>15} {r['loads_per_step']:>10.1f} {r['same_greedy']:>5.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
