"""The KV-cache paths (prefill_slot, decode_step) agree with a plain full forward
(Model.logits) however the work is split: into chunks, into buckets, into batches of
rows in different slots, onto a reused prefix, or padded with scratch rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDEN, TINY_GEO

from motet.model.forward import prefill
from motet.model.generate import decode_step, prefill_slot
from motet.model.kv import KVGeometry, bucket, init_kv
from motet.model.kv_layout import keys_in_order

# Measured max |difference| between the paths here (logits and cached K/V): tiny models
# ≤ 2.2e-5 (logits up to ~33), SmolLM2 6.6e-5 (logit std ~3). Tolerances ~4-5x above.
ATOL = 1e-4
DEFAULT_MODEL_ATOL = 3e-4
# The default model runs quantized: a decode step's one-row products quantize x to
# int16 (docs/performance.md), a full forward's many-row ones do not (or, with AVX-512
# VNNI, do so per call as integer pairs), so the two agree to about 1e-2 of logits whose
# spread is about 8 (a cache bug is off by whole units).
QUANTIZED_DECODE_ATOL = 1e-2


def golden_prompt(arch: str) -> list[int]:
    return np.load(GOLDEN / arch / "golden.npz")["prompt_ids"].tolist()


def snapshot(kv):
    """A copy of the cache: prefill_slot and decode_step donate the one they are given."""
    return jax.tree.map(jnp.copy, kv)


def host(kv):
    """The caches as host arrays, K in order: [slots, kv_heads, head_dim, length]."""
    k, v = kv
    return [keys_in_order(np.asarray(x)) for x in k], [np.asarray(x) for x in v]


def make_prompt(vocab: int, length: int, salt: int) -> list[int]:
    """A deterministic pseudo-random prompt (avoiding the low special ids)."""
    rng = np.random.default_rng(1000 + salt)
    return rng.integers(3, vocab, size=length).tolist()


def close(a, b, atol=None):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=ATOL if atol is None else atol)


def greedy_through_cache(model, geo, slot, prompt, steps):
    """prefill_slot then greedy decode_step: (tokens, logits per step [steps, V])."""
    kv = init_kv(model.config, geo)
    logits, kv = prefill_slot(model, kv, geo, slot, prompt, 0)
    out, tokens = [np.asarray(logits)], []
    for i in range(steps - 1):
        tokens.append(int(np.argmax(out[-1])))
        logits, kv = decode_step(model, kv, geo, [tokens[-1]], [slot], [len(prompt) + i])
        out.append(np.asarray(logits[0]))
    tokens.append(int(np.argmax(out[-1])))
    return tokens, np.stack(out)


@pytest.mark.parametrize("arch", ("llama", "qwen3_moe", "olmoe"))
def test_prefill_then_decode_equals_full_forward_tiny(tiny_model, arch):
    model, prompt = tiny_model(arch), golden_prompt(arch)
    geo = TINY_GEO
    tokens, step_logits = greedy_through_cache(model, geo, 1, prompt, steps=6)
    full = model.logits(prompt + tokens[:-1])
    close(step_logits, full[len(prompt) - 1 :])


def test_prefill_then_decode_equals_full_forward_default(default_model):
    """SmolLM2 through generate()'s own geometry (one slot, the whole context, chunk
    512), so the compiled prefill and decode are the ones `motet chat` runs."""
    model = default_model
    prompt = model.tokenizer.encode(model.render_chat([{"role": "user", "content": "What is the capital of France?"}]))
    geo = KVGeometry(n_slots=1, max_context=model.config.max_context, chunk=512)
    tokens, step_logits = greedy_through_cache(model, geo, 0, prompt, steps=6)
    full = model.logits(prompt + tokens[:-1])
    close(step_logits, full[len(prompt) - 1 :],
          atol=QUANTIZED_DECODE_ATOL if model.weight_format == "quantized" else DEFAULT_MODEL_ATOL)
    np.testing.assert_array_equal(step_logits.argmax(-1), full[len(prompt) - 1 :].argmax(-1))


@pytest.mark.parametrize(("arch", "chunk"), [("llama", 16), ("llama", 7), ("qwen3_moe", 16)])
def test_chunked_prefill_equals_one_chunk(tiny_model, arch, chunk):
    """Several chunks, each attending to cached history (7 is not a power of two, so the
    chunk's bucket is capped at 7), vs one chunk of 512: the same last logits and the
    same cached K/V at every real position."""
    model = tiny_model(arch)
    prompt = golden_prompt(arch) + make_prompt(model.config.vocab_size, 20, 0)
    n = len(prompt)
    results = []
    for size in (chunk, 512):
        geo = KVGeometry(n_slots=TINY_GEO.n_slots, max_context=TINY_GEO.max_context, chunk=size)
        logits, (k, v) = prefill_slot(model, init_kv(model.config, geo), geo, 0, prompt, 0)
        results.append((np.asarray(logits), [x[0, :, :, :n] for x in host((k, v))[0]],
                        [np.asarray(x[0, :, :n]) for x in v]))
    (logits, ks, vs), (one_logits, one_k, one_v) = results
    close(one_logits, model.logits(prompt)[-1])
    close(logits, one_logits)
    for a, b in zip(ks + vs, one_k + one_v):
        close(a, b)


@pytest.mark.parametrize("arch", ("llama", "qwen3_moe"))
def test_bucket_padding_does_not_change_results(tiny_model, arch):
    """The same prompt padded to 32, 64 and 128 tokens: the same last logits and K/V."""
    model = tiny_model(arch)
    prompt = golden_prompt(arch)
    n = len(prompt)
    outs = []
    for size in (bucket(n), 2 * bucket(n), 4 * bucket(n)):
        padded = np.zeros(size, np.int32)
        padded[:n] = prompt
        logits, new_k, new_v, _ = prefill(
            model.weights, [], [], jnp.asarray(padded), 0, 0, n, cfg=model.config, with_history=False
        )
        outs.append((np.asarray(logits), [np.asarray(x[..., :n]) for x in new_k],
                     [np.asarray(x[:, :n]) for x in new_v]))
    for logits, ks, vs in outs[1:]:
        close(logits, outs[0][0])
        for a, b in zip(ks + vs, outs[0][1] + outs[0][2]):
            close(a, b)


def fill_slots(model, geo, prompts: dict[int, list[int]]):
    """A cache with prompts[slot] prefilled into each slot; returns (kv, last logits per slot)."""
    kv = init_kv(model.config, geo)
    last = {}
    for slot, prompt in prompts.items():
        logits, kv = prefill_slot(model, kv, geo, slot, prompt, 0)
        last[slot] = np.asarray(logits)
    return kv, last


@pytest.mark.parametrize("arch", ("llama", "qwen3_moe"))
def test_batch_of_16_equals_each_row_alone(tiny_model, arch):
    model = tiny_model(arch)
    vocab = model.config.vocab_size
    geo = TINY_GEO
    # Row r: a prompt of 3 + r tokens in slot (5r + 3) % 16, so rows sit at different
    # positions (across two history buckets), in slots out of row order.
    rows = [((5 * r + 3) % 16, make_prompt(vocab, 3 + r, r)) for r in range(16)]
    kv, last = fill_slots(model, geo, dict(rows))
    tokens = [int(np.argmax(last[slot])) for slot, _ in rows]
    slots = [slot for slot, _ in rows]
    positions = [len(p) for _, p in rows]

    batched, _ = decode_step(model, snapshot(kv), geo, tokens, slots, positions)
    batched = np.asarray(batched)
    assert batched.shape == (16, vocab)
    for r, (slot, prompt) in enumerate(rows):
        alone, _ = decode_step(model, snapshot(kv), geo, [tokens[r]], [slot], [positions[r]])
        alone = np.asarray(alone[0])
        assert batched[r].argmax() == alone.argmax(), f"row {r}"
        close(batched[r], alone)
        close(batched[r], model.logits(prompt + [tokens[r]])[-1])


@pytest.mark.parametrize("arch", ("llama", "qwen3_moe"))
def test_prefix_reuse_equals_fresh_prefill(tiny_model, arch):
    """Slot 0 holds prompt A (40 tokens). A second prompt B shares A's first 13 tokens:
    prefilling only B's suffix at offset 13 must equal a fresh prefill of B, and the
    stale positions of A past B's end must not leak into the next decode step."""
    model = tiny_model(arch)
    vocab = model.config.vocab_size
    a = make_prompt(vocab, 40, 1)
    b = a[:13] + make_prompt(vocab, 10, 2)
    geo = TINY_GEO
    kv, _ = fill_slots(model, geo, {0: a})
    logits, kv = prefill_slot(model, kv, geo, 0, b[13:], 13)
    fresh, fresh_kv = prefill_slot(model, init_kv(model.config, geo), geo, 1, b, 0)
    close(logits, fresh)
    full = model.logits(b)
    close(logits, full[-1])
    n = len(b)
    (k_reused, v_reused), (k_fresh, v_fresh) = host(kv), host(fresh_kv)
    for layer in range(model.config.n_layers):
        close(k_reused[layer][0, ..., :n], k_fresh[layer][1, ..., :n])  # K [.., d, length]
        close(v_reused[layer][0, :, :n], v_fresh[layer][1, :, :n])  # V [.., length, d]
    token = int(np.argmax(np.asarray(logits)))
    step, _ = decode_step(model, kv, geo, [token], [0], [len(b)])
    close(step[0], model.logits(b + [token])[-1])


@pytest.mark.parametrize("arch", ("llama", "qwen3_moe"))
def test_padded_decode_rows_leave_other_rows_and_slots_alone(tiny_model, arch):
    """3 real rows run as a batch of 4 (one scratch row): the real rows' logits equal
    each row alone, every other slot (slot 1 holds a prompt) keeps its K/V, and the rows'
    own slots change only at the position each row wrote, to what it writes alone."""
    model = tiny_model(arch)
    vocab = model.config.vocab_size
    geo = TINY_GEO
    prompts = {s: make_prompt(vocab, 5 + 4 * s, 10 + s) for s in range(4)}
    kv, last = fill_slots(model, geo, prompts)
    before = host(kv)
    slots = [2, 0, 3]
    tokens = [int(np.argmax(last[s])) for s in slots]
    positions = [len(prompts[s]) for s in slots]

    batched, after = decode_step(model, snapshot(kv), geo, tokens, slots, positions)
    after = host(after)
    assert np.asarray(batched).shape == (3, vocab)
    written = {}  # slot → (K column, V row) that row wrote when run alone
    for i, (slot, pos) in enumerate(zip(slots, positions)):
        alone, alone_kv = decode_step(model, snapshot(kv), geo, [tokens[i]], [slot], [pos])
        close(batched[i], alone[0])
        close(batched[i], model.logits(prompts[slot] + [tokens[i]])[-1])
        k_alone, v_alone = host(alone_kv)
        written[slot] = [(k[slot][..., pos], v[slot][:, pos]) for k, v in zip(k_alone, v_alone)]

    (k_before, v_before), (k_after, v_after) = before, after
    for layer in range(model.config.n_layers):
        kb, ka = k_before[layer], k_after[layer]  # [slots + 1, kv_heads, head_dim, length]
        vb, va = v_before[layer], v_after[layer]  # [slots + 1, kv_heads, length, head_dim]
        for other in set(range(geo.n_slots)) - set(slots):  # slot 1 and the empty ones
            np.testing.assert_array_equal(ka[other], kb[other])
            np.testing.assert_array_equal(va[other], vb[other])
        for slot, pos in zip(slots, positions):
            keep = np.arange(geo.length) != pos
            np.testing.assert_array_equal(ka[slot][..., keep], kb[slot][..., keep])
            np.testing.assert_array_equal(va[slot][:, keep], vb[slot][:, keep])
            k_col, v_row = written[slot][layer]
            close(ka[slot][..., pos], k_col)
            close(va[slot][:, pos], v_row)


@pytest.mark.parametrize("arch", ("llama", "qwen3_moe"))
def test_a_padded_chunk_past_the_cache_end_keeps_the_history(tiny_model, arch):
    """A slot holds the context and no chunk more: a chunk whose padding reaches past the
    last position (40 tokens padded to 64, at offset 200 of 256) stores its real rows,
    drops the padding, and leaves the history before it untouched."""
    model = tiny_model(arch)
    geo = KVGeometry(n_slots=2, max_context=256, chunk=64)
    assert geo.length == 256
    prompt = make_prompt(model.config.vocab_size, 240, 7)
    _, kv = prefill_slot(model, init_kv(model.config, geo), geo, 1, prompt[:200], 0)
    before = host(kv)
    logits, kv = prefill_slot(model, kv, geo, 1, prompt[200:], 200)
    close(logits, model.logits(prompt)[-1])
    _, whole = prefill_slot(model, init_kv(model.config, geo), geo, 1, prompt, 0)
    (k_before, v_before), (k_after, v_after), (k_whole, v_whole) = before, host(kv), host(whole)
    for layer in range(model.config.n_layers):
        np.testing.assert_array_equal(k_after[layer][1][..., :200], k_before[layer][1][..., :200])
        np.testing.assert_array_equal(v_after[layer][1][:, :200], v_before[layer][1][:, :200])
        close(k_after[layer][1][..., :240], k_whole[layer][1][..., :240])
        close(v_after[layer][1][:, :240], v_whole[layer][1][:, :240])


def test_a_slot_holds_the_context_in_whole_attention_blocks():
    assert KVGeometry(n_slots=16, max_context=768, chunk=256).length == 768
    assert KVGeometry(n_slots=16, max_context=1000, chunk=256).length == 1024
    # the longest padded chunk fits, however short the context
    assert KVGeometry(n_slots=1, max_context=600, chunk=1024).length == 1024
