"""Tiered experts are the same model: greedy tokens identical to resident mode and logits
within the golden tolerance, for every MoE architecture, at pool sizes down to top-k
slots per layer; and every move between device, RAM and disk keeps the tiers whole."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN, TINY_GEO

from motet.model import load_model
from motet.model.expert_pool import DEVICE, DISK, RAM, ExpertPool, Placement
from motet.model.expert_source import ArrayExpertReader, SourceExpertReader, with_packed_experts
from motet.model.generate import decode_step, prefill_slot
from motet.model.kv import init_kv
from motet.model.tiered_model import TieredModel

ATOL = 1e-4  # the golden tests' tolerance; measured differences here are <= 2e-5
MOE_ARCHS = ("qwen3_moe", "olmoe", "mixtral")
STEPS = 8


@pytest.fixture(scope="module")
def lazy_model():
    """lazy_model(arch): the golden checkpoint with its experts left in the file."""
    loaded = {}

    def get(arch: str):
        if arch not in loaded:
            loaded[arch] = load_model(GOLDEN / arch, lazy_experts=True)
        return loaded[arch]

    return get


def pool_sizes(cfg) -> list[int]:
    return sorted({cfg.n_experts_per_tok, cfg.n_experts // 2 + 1, cfg.n_experts})


def make_pool(model, slots: int, ram: int | None = None, reader=None) -> ExpertPool:
    cfg = model.config
    return ExpertPool(reader or model.expert_reader, sum(cfg.moe_layers), cfg.n_experts, slots, ram)


def long_prompt(arch: str, vocab: int) -> list[int]:
    """The golden prompt and 20 more tokens: two chunks of 16, so prefill reads history."""
    prompt = np.load(GOLDEN / arch / "golden.npz")["prompt_ids"].tolist()
    return prompt + np.random.default_rng(7).integers(3, vocab, 20).tolist()


def greedy(prefill, decode, prompt: list[int]):
    """Prefill then STEPS - 1 greedy decode steps: (tokens, logits [STEPS, V], routing of
    the prompt [layers, len, k])."""
    logits, routing = prefill(prompt)
    out = [np.asarray(logits)]
    tokens = [int(np.argmax(out[-1]))]
    for i in range(STEPS - 1):
        out.append(np.asarray(decode([tokens[-1]], [0], [len(prompt) + i])[0]))
        tokens.append(int(np.argmax(out[-1])))
    return tokens, np.stack(out), routing


def resident_run(model, prompt):
    state = {"kv": init_kv(model.config, TINY_GEO)}

    def prefill(ids):
        logits, state["kv"], routing = prefill_slot(model, state["kv"], TINY_GEO, 0, ids, 0, with_routing=True)
        return logits, routing

    def decode(tokens, slots, positions):
        logits, state["kv"] = decode_step(model, state["kv"], TINY_GEO, tokens, slots, positions)
        return logits

    return greedy(prefill, decode, prompt)


def tiered_run(tiered: TieredModel, prompt):
    state = {"kv": init_kv(tiered.cfg, TINY_GEO)}

    def prefill(ids):
        logits, state["kv"], routing = tiered.prefill_slot(state["kv"], TINY_GEO, 0, ids, 0)
        return logits, routing

    def decode(tokens, slots, positions):
        logits, state["kv"], _ = tiered.decode_step(state["kv"], TINY_GEO, tokens, slots, positions)
        return logits

    return greedy(prefill, decode, prompt)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_tiered_equals_resident_at_every_pool_size(tiny_model, lazy_model, arch):
    model, lazy = tiny_model(arch), lazy_model(arch)
    prompt = long_prompt(arch, model.config.vocab_size)
    want_tokens, want_logits, want_routing = resident_run(model, prompt)
    for slots in pool_sizes(model.config):
        # with prefetch and one-jit steps when nothing misses; layer by layer only, no prefetch
        for prefetch, optimistic in ((True, True), (False, False)):
            pool = make_pool(lazy, slots)
            tiered = TieredModel(lazy, pool, prefetch=prefetch, optimistic=optimistic)
            tokens, logits, routing = tiered_run(tiered, prompt)
            assert tokens == want_tokens, f"{slots} slots, prefetch {prefetch}, optimistic {optimistic}"
            np.testing.assert_allclose(logits, want_logits, rtol=0, atol=ATOL)
            np.testing.assert_array_equal(routing, want_routing)
            assert pool.stats.lookups > 0 and sum(pool.counts()) == pool.R * pool.E


@pytest.mark.parametrize("arch", ("qwen3_moe", "mixtral"))
def test_a_batch_needing_more_experts_than_the_pool_runs_in_passes(tiny_model, lazy_model, arch):
    """16 rows in different slots route to every expert of a layer; a pool of top-k slots
    runs each layer in several passes and still gives each row its own answer."""
    model, lazy = tiny_model(arch), lazy_model(arch)
    cfg = model.config
    rng = np.random.default_rng(3)
    prompts = {s: rng.integers(3, cfg.vocab_size, 4 + s).tolist() for s in range(16)}
    kv_res, kv_tier = init_kv(cfg, TINY_GEO), init_kv(cfg, TINY_GEO)
    tiered = TieredModel(lazy, make_pool(lazy, cfg.n_experts_per_tok))
    for s, p in prompts.items():
        _, kv_res = prefill_slot(model, kv_res, TINY_GEO, s, p, 0)
        _, kv_tier, _ = tiered.prefill_slot(kv_tier, TINY_GEO, s, p, 0)
    args = ([int(t) for t in rng.integers(3, cfg.vocab_size, 16)], list(range(16)), [len(p) for p in prompts.values()])
    want, _, routing = decode_step(model, kv_res, TINY_GEO, *args, with_routing=True)
    got, _, tiered_routing = tiered.decode_step(kv_tier, TINY_GEO, *args)
    assert len(np.unique(routing[0])) > cfg.n_experts_per_tok  # more than one pass
    np.testing.assert_array_equal(tiered_routing, routing)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=ATOL)
    np.testing.assert_array_equal(np.asarray(got).argmax(-1), np.asarray(want).argmax(-1))


def test_a_step_that_misses_an_expert_is_thrown_away_and_run_layer_by_layer(tiny_model, lazy_model):
    """A full pool runs one-jit steps; after a step finds an expert missing (forced here
    by emptying a slot behind the pool's back), that step is redone layer by layer with
    the same result, and the next step tries one-jit again once nothing missed."""
    model, lazy = tiny_model("olmoe"), lazy_model("olmoe")
    cfg = model.config
    prompt = long_prompt("olmoe", cfg.vocab_size)
    want_tokens, want_logits, _ = resident_run(model, prompt)
    pool = make_pool(lazy, cfg.n_experts)
    pool.fill(np.zeros((pool.R, pool.E)))
    tiered = TieredModel(lazy, pool)
    calls = {"layers": 0}
    layers = tiered._layers

    def counting(*args):
        calls["layers"] += 1
        return layers(*args)

    tiered._layers = counting
    state = {"kv": init_kv(cfg, TINY_GEO)}
    logits, state["kv"], _ = tiered.prefill_slot(state["kv"], TINY_GEO, 0, prompt, 0)
    assert calls["layers"] == 0  # every expert on the device: one-jit prefill
    tokens = [int(np.argmax(logits))]
    for r in range(pool.R):  # evict everything behind the pool's back: the next step misses
        pool.lut[r, :] = -1
        pool.occupant[r, :] = -1
    pool.version += 1
    logits, state["kv"], _ = tiered.decode_step(state["kv"], TINY_GEO, tokens, [0], [len(prompt)])
    assert calls["layers"] == 1 and tiered.optimistic is False
    np.testing.assert_allclose(np.asarray(logits[0]), want_logits[1], rtol=0, atol=ATOL)
    tokens.append(int(np.argmax(np.asarray(logits[0]))))
    assert tokens == want_tokens[:2]


def test_the_file_reader_gives_the_packed_weights_and_lazy_loading_packs_none(tiny_model, lazy_model):
    model, lazy = tiny_model("mixtral"), lazy_model("mixtral")  # 3 shards, per-expert tensors
    assert all("experts_gate_up" not in layer for layer in lazy.weights["layers"])
    assert lazy.info()["parameters"] == model.info()["parameters"]
    from_file = SourceExpertReader(lazy.config, lazy.expert_reader.source)
    from_memory = ArrayExpertReader.from_weights(model.config, model.weights)
    for r in range(sum(model.config.moe_layers)):
        for e in range(model.config.n_experts):
            for a, b in zip(from_file.read(r, e), from_memory.read(r, e)):
                np.testing.assert_array_equal(a, b)
    packed = with_packed_experts(lazy)
    prompt = long_prompt("mixtral", model.config.vocab_size)[:12]
    np.testing.assert_allclose(packed.logits(prompt), model.logits(prompt), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="tiered"):
        lazy.logits(prompt)


class CountingReader:
    """Counts disk reads, so a test can tell a RAM hit from a disk read."""

    def __init__(self, inner):
        self.inner, self.reads = inner, []

    def read(self, r, e):
        self.reads.append((r, e))
        return self.inner.read(r, e)


def check_tiers(pool: ExpertPool):
    """Counts per tier sum to R × E, agree with the tier map, and each pool slot holds
    exactly the expert its lookup says, with that expert's weights."""
    device, ram, disk = pool.counts()
    assert device + ram + disk == pool.R * pool.E
    tiers = pool.tier_map()
    assert [(tiers == t).sum() for t in (DEVICE, RAM, DISK)] == [device, ram, disk]
    for r in range(pool.R):
        gu, dn = (np.asarray(a) for a in pool.pools[r])
        for s, e in enumerate(pool.occupant[r]):
            if e >= 0:
                assert pool.lut[r, e] == s
                want_gu, want_dn = pool.reader.inner.read(r, int(e))
                np.testing.assert_array_equal(gu[s], want_gu)
                np.testing.assert_array_equal(dn[s], want_dn)


def test_every_tier_transition(lazy_model):
    """One layer, 2 pool slots, RAM for 2 experts: disk → device, device → RAM, RAM →
    device (no disk read), RAM → disk when RAM overflows, disk → RAM when warmed, and
    device → disk when RAM has no room for an evicted cold expert."""
    lazy = lazy_model("olmoe")
    reader = CountingReader(lazy.expert_reader)
    pool = make_pool(lazy, slots=2, ram=2, reader=reader)
    r = 0

    def need(*experts):
        pool.begin_step()
        for group in pool.passes(r, np.asarray(experts)):
            pool.ensure(r, group)
        check_tiers(pool)
        return [(m.expert, m.old_tier, m.new_tier) for m in pool.take_stats().moves]

    assert need(0, 1) == [(0, DISK, DEVICE), (1, DISK, DEVICE)]
    assert need(2) == [(0, DEVICE, RAM), (2, DISK, DEVICE)]  # LRU victim 0 goes to RAM
    reads = len(reader.reads)
    assert need(0) == [(1, DEVICE, RAM), (0, RAM, DEVICE)]  # back from RAM: no disk read
    assert len(reader.reads) == reads
    assert need(3) == [(2, DEVICE, RAM), (3, DISK, DEVICE)]  # RAM: 1, 2 (full)
    assert need(4) == [(1, RAM, DISK), (0, DEVICE, RAM), (4, DISK, DEVICE)]  # 1 was coldest
    # The policy warms expert 5 (hot) into RAM and ranks 2 above 0: 0 is dropped.
    rank = np.zeros((pool.R, pool.E))
    rank[r, [5, 2]] = 10.0
    empty = (frozenset(),) * pool.R
    warm = tuple(frozenset({5}) if i == r else frozenset() for i in range(pool.R))
    pool.apply(Placement(empty, warm, rank))
    check_tiers(pool)
    assert [(m.expert, m.old_tier, m.new_tier) for m in pool.take_stats().moves] == [(0, RAM, DISK), (5, DISK, RAM)]
    # 5 leaves RAM for the device first, so evicted 3 finds room there; RAM is then full
    # of experts no colder than 4 (a tie keeps the incumbent): 4 goes to disk.
    assert sorted(need(5, 6)) == [(3, DEVICE, RAM), (4, DEVICE, DISK), (5, RAM, DEVICE), (6, DISK, DEVICE)]


def test_pinned_experts_stay_and_prefetch_uses_only_free_slots(lazy_model):
    lazy = lazy_model("qwen3_moe")  # 8 experts, top-2
    pool = make_pool(lazy, slots=4, reader=CountingReader(lazy.expert_reader))
    rank = np.zeros((pool.R, pool.E))
    rank[:, [6, 7]] = 5.0
    pinned = (frozenset({6, 7}),) * pool.R
    pool.apply(Placement(pinned, (frozenset(),) * pool.R, rank))
    assert {int(e) for e in pool.occupant[0] if e >= 0} == {6, 7}
    for experts in ([0, 1], [2, 3], [4, 5]):
        pool.begin_step()
        pool.prefetch(0, np.asarray(experts))
        check_tiers(pool)
        assert {6, 7} <= {int(e) for e in pool.occupant[0]}  # pins survive prefetches
        assert set(experts) <= {int(e) for e in pool.occupant[0]}
    pool.take_stats()
    pool.begin_step()
    pool.passes(0, np.asarray([4, 6]))  # guessed 4 and 5; routed 4 and 6
    stats = pool.take_stats()
    assert (stats.lookups, stats.hits) == (2, 2)
    assert (stats.guessed, stats.guessed_right, stats.routed_after_guess) == (2, 1, 2)


def test_fill_starts_warm_from_heat(lazy_model):
    lazy = lazy_model("qwen3_moe")
    pool = make_pool(lazy, slots=2, ram=3, reader=CountingReader(lazy.expert_reader))
    heat = np.zeros((pool.R, pool.E))
    heat[0, [5, 3, 1, 0]] = [9, 8, 7, 6]
    heat[1, [2, 4]] = [1, 0.5]
    pool.fill(heat)
    check_tiers(pool)
    assert set(pool.occupant[0]) == {5, 3} and set(pool.occupant[1]) == {2, 4}
    assert set(pool.ram) == {(0, 1), (0, 0)}  # the hottest of the rest with heat, RAM-bound


def test_a_gguf_expert_is_read_alone_and_equals_its_slice_of_the_whole(tmp_path):
    """GGUF stacks a layer's experts in one tensor (quantized or not): expert e read on
    its own dequantizes to the same values as row e of the whole tensor, and read still
    quantized (the disk tier of a quantized model) it holds the same blocks as expert e
    of the whole tensor repacked."""
    import gguf
    import jax

    from motet.model.gguf_file import GGUFSource, open_gguf
    from motet.model.quant import QTensor, dequantize, host_index

    w = np.random.default_rng(0).standard_normal((4, 8, 64)).astype(np.float32)  # [E, f, d]
    path = tmp_path / "experts.gguf"
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_tensor("blk.0.ffn_gate_exps.weight", w)
    for name, kind in (("ffn_up_exps", gguf.GGMLQuantizationType.Q8_0),
                       ("ffn_down_exps", gguf.GGMLQuantizationType.Q4_1)):
        raw = gguf.quants.quantize(w, kind)
        writer.add_tensor(f"blk.0.{name}.weight", raw, raw_shape=raw.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    source = GGUFSource(path, open_gguf(path), None)
    for name in ("0.experts.gate", "0.experts.up", "0.experts.down"):
        whole = source.get(name)
        for e in range(4):
            np.testing.assert_array_equal(source.get_expert(name, e), whole[e])
    np.testing.assert_array_equal(source.get("0.experts.gate"), w)
    assert source.get_packed("0.experts.gate") is None and source.get_packed_expert("0.experts.gate", 1) is None
    for name in ("0.experts.up", "0.experts.down"):
        packed = source.get_packed(name)
        assert packed.shape == (4, 8, 64)
        for e in range(4):
            one = source.get_packed_expert(name, e)
            assert isinstance(one, QTensor) and one.shape == (8, 64)
            for got, want in zip(jax.tree.leaves(one), jax.tree.leaves(host_index(packed, e))):
                np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(np.asarray(dequantize(one)), source.get_expert(name, e))


def test_bfloat16_pools_stay_close_to_resident_bfloat16(lazy_model):
    """The pool keeps the model's dtype (bfloat16 on GPUs). In bfloat16 a different order
    of adding a token's experts rounds differently, so tokens may part where two are
    nearly tied: compare the prompt's logits with the golden bf16 test's tolerance."""
    model = load_model(GOLDEN / "qwen3_moe", dtype="bfloat16")
    lazy = load_model(GOLDEN / "qwen3_moe", dtype="bfloat16", lazy_experts=True)
    cfg = model.config
    prompt = long_prompt("qwen3_moe", cfg.vocab_size)
    kv = init_kv(cfg, TINY_GEO, jnp.bfloat16)
    want, _ = prefill_slot(model, kv, TINY_GEO, 0, prompt, 0)
    pool = ExpertPool(lazy.expert_reader, sum(cfg.moe_layers), cfg.n_experts, 3, None, lazy.weights["lm_head"].dtype)
    got, _, _ = TieredModel(lazy, pool).prefill_slot(init_kv(cfg, TINY_GEO, jnp.bfloat16), TINY_GEO, 0, prompt, 0)
    assert pool.pools[0][0].dtype == jnp.bfloat16 and pool.stats.lookups > pool.stats.hits
    want, got = np.asarray(want, np.float32), np.asarray(got, np.float32)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


def test_a_placement_moves_pools_alike_however_its_sets_iterate():
    """A group's followers rebuild each placement's sets from lists (actors/follower.py),
    and a set of experts can iterate in another order than process 0's: with ties in
    heat, both pools must still pin and warm the same experts into the same slots."""
    experts = 64  # ids past a small set's table collide, so insertion order shows
    rng = np.random.default_rng(0)
    reader = ArrayExpertReader([rng.standard_normal((experts, 8, 8)).astype(np.float32)],
                               [rng.standard_normal((experts, 4, 8)).astype(np.float32)])
    tied = np.zeros((1, experts))
    pools = []
    for order in ([33, 1, 41, 9, 17], [9, 41, 1, 33, 17]):
        assert list(frozenset(order)) != sorted(order)  # iteration order is not by value
        pool = ExpertPool(reader, 1, experts, 4, ram_capacity=2)
        pool.fill(tied, warm_ram=False)
        pool.begin_step()  # the start-up's slots are no longer this step's
        pool.apply(Placement((frozenset(order),), (frozenset(reversed(order)),), tied), max_moves=4)
        pools.append(pool)
    first, second = pools
    assert first.occupant.tolist() == second.occupant.tolist()
    assert sorted(first.ram) == sorted(second.ram)
    assert sorted(int(e) for e in first.occupant[0]) == [1, 9, 17, 33]  # the lowest of the tied pins
