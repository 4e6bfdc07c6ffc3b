"""Prefill into a KV slot and batched decode over slots: the calls a runner makes, and a
plain single-stream generator on top of them (for `motet chat` and for checks)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..runtime.api import Grammar
from .errors import ContextLengthError
from .forward import decode, decode_sampled, prefill
from .kv import KVGeometry, batch_bucket, bucket, init_kv
from .kv_writes import write_chunk, write_rows
from .logit_history import begin, empty_history, sample_with_history, start_rows
from .model import Model
from .sampling import SAMPLED_WIDTH, open_mask, request_key, unpack_sampled
from .sharding import kv_sharding, mesh_of


def model_kv_sharding(model: Model):
    """Where the model's KV cache goes: split with its heads on the weights' mesh, or
    None (the default device)."""
    mesh = mesh_of(model.weights)
    return None if mesh is None else kv_sharding(mesh)


def _routing(per_layer: list, rows: int) -> np.ndarray:
    """Expert ids of the real rows, [MoE layers, rows, k] (k = 0 for a dense model).
    Cut on the host: a slice on the device would compile once per row count."""
    if not per_layer:
        return np.zeros((0, rows, 0), np.int32)
    return np.stack([np.asarray(ids)[:rows] for ids in per_layer])


def prefill_slot(model: Model, kv, geo: KVGeometry, slot: int, ids: Sequence[int], offset: int,
                 moe_impl: str = "auto", with_routing: bool = False):
    """Run `ids` into `slot` from position `offset` in chunks of at most geo.chunk tokens.

    Returns (logits [vocab] after the last token, the updated kv), plus with_routing the
    chosen experts [MoE layers, len(ids), k]. Every chunk attends to the slot's history,
    an empty one at offset 0 included: one compiled function per chunk size.
    """
    if offset + len(ids) > geo.max_context:
        raise ContextLengthError(offset + len(ids), geo.max_context)
    k, v = kv
    logits, routing = None, []
    for start in range(0, len(ids), geo.chunk):
        chunk = np.asarray(ids[start : start + geo.chunk], np.int32)
        padded = np.zeros(bucket(len(chunk), cap=geo.chunk), np.int32)
        padded[: len(chunk)] = chunk
        pos = offset + start
        logits, new_k, new_v, chosen = prefill(
            model.weights, k, v, jax.device_put(padded), slot, pos, len(chunk),
            cfg=model.config, moe_impl=moe_impl,
        )
        k, v = write_chunk(k, v, new_k, new_v, slot, pos)
        if with_routing:
            routing.append(_routing(chosen, len(chunk)))
    if with_routing:
        return logits, (k, v), np.concatenate(routing, axis=1)
    return logits, (k, v)


def padded_rows(geo: KVGeometry, tokens, slots, positions):
    """A decode step's rows padded to a batch bucket; padding rows write to the scratch
    slot. Host arrays (tokens, slots, positions), int32."""
    n = len(tokens)
    b = batch_bucket(n)
    tok = np.zeros(b, np.int32)
    slot = np.full(b, geo.scratch_slot, np.int32)
    pos = np.zeros(b, np.int32)
    tok[:n], slot[:n], pos[:n] = tokens, slots, positions
    return tok, slot, pos


def chained_rows(geo: KVGeometry, tokens, slots, positions, chained: Sequence[bool]):
    """padded_rows, and each padded row's chained flag (the real rows', then False)."""
    tok, slot, pos = padded_rows(geo, tokens, slots, positions)
    link = np.zeros(len(tok), np.bool_)
    link[: len(chained)] = chained
    return tok, slot, pos, link


def decode_step(model: Model, kv, geo: KVGeometry, tokens: Sequence[int], slots: Sequence[int],
                positions: Sequence[int], moe_impl: str = "auto", with_routing: bool = False):
    """One batched step: row i feeds tokens[i] at positions[i] of slots[i].

    Rows are padded to a batch bucket with rows that write to the scratch slot.
    Returns (logits [rows, vocab] for the real rows, the updated kv), plus with_routing
    the chosen experts [MoE layers, rows, k].
    """
    n = len(tokens)
    logits, kv, routing = decode_padded(model, kv, geo, tokens, slots, positions, moe_impl)
    logits = logits if logits.shape[0] == n else logits[:n]
    return (logits, kv, routing) if with_routing else (logits, kv)


def decode_padded(model: Model, kv, geo: KVGeometry, tokens: Sequence[int], slots: Sequence[int],
                  positions: Sequence[int], moe_impl: str = "auto"):
    """decode_step with the logits of every row of the padded batch, [bucket, vocab] (what
    a batched sampler takes without a cut that would compile once per row count), and
    the routing of the real rows."""
    tok, slot, pos = padded_rows(geo, tokens, slots, positions)  # as dispatch_decode
    k, v = kv
    logits, new_k, new_v, chosen = decode(model.weights, k, v, tok, slot, pos, cfg=model.config,
                                          moe_impl=moe_impl)
    return logits, write_rows(k, v, new_k, new_v, slot, pos), _routing(chosen, len(tokens))


def dispatch_decode(model: Model, kv, geo: KVGeometry, tokens: Sequence[int], slots: Sequence[int],
                    positions: Sequence[int], sampling, want_top: bool, carry, chained: Sequence[bool] = (),
                    moe_impl: str = "auto"):
    """decode_padded and sampling.sample in one compiled call, dispatched and not waited
    for. sampling: forward.decode_sampled's, host arrays over the padded batch; carry,
    chained: as forward.decode_sampled (chained: per real row, none set when empty).
    Returns (the step's packed output on the device, for read_decode; the updated kv;
    the updated carry; the logits and what each row fed, for logit_history.resample)."""
    # host arrays go to the calls as they are: jax.device_put takes 70 µs an array here,
    # the call itself 10 µs more
    tok, slot, pos, link = chained_rows(geo, tokens, slots, positions, chained)
    k, v = kv
    k, v, packed, carry, logits, fed = decode_sampled(model.weights, k, v, tok, slot, pos, sampling,
                                                      np.bool_(want_top), carry, link, cfg=model.config,
                                                      moe_impl=moe_impl)
    return packed, (k, v), carry, logits, fed


def read_decode(model: Model, packed, rows: int):
    """A dispatched step's output read back (waiting for it): (sample's outputs as host
    arrays over the padded batch, the routing of the real rows [rows, MoE layers, k])."""
    return unpack_decode(model.config, np.asarray(packed), rows)


def unpack_decode(cfg, packed: np.ndarray, rows: int):
    """read_decode's outputs from a step's packed output on the host."""
    routing = packed[:rows, SAMPLED_WIDTH:].reshape(rows, sum(cfg.moe_layers), cfg.n_experts_per_tok)
    return unpack_sampled(packed[:, :SAMPLED_WIDTH]), routing


def generate(model: Model, prompt_ids: Sequence[int], *, max_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, seed: int = 0, presence_penalty: float = 0.0,
             frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
             logit_bias: Sequence[tuple[int, float]] = (), grammar: Grammar | None = None,
             max_context: int | None = None, chunk: int = 512) -> Iterator[int]:
    """Yield sampled token ids one by one until an end-of-turn token, max_tokens, the
    end of the context (prompt and answer together at most the context) or a token
    the grammar refuses (a grammar that leaves none). The end-of-turn token itself is
    not yielded. The penalties, the bias and the grammar mean what the engine's do."""
    limit = min(max_context or model.config.max_context, model.config.max_context)
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty")
    if len(prompt_ids) >= limit:
        raise ContextLengthError(len(prompt_ids), limit)
    geo = KVGeometry(n_slots=1, max_context=limit, chunk=chunk)
    kv = init_kv(model.config, geo, model.kv_dtype, model_kv_sharding(model))
    logits, kv = prefill_slot(model, kv, geo, 0, prompt_ids, 0)
    logits = logits[None]
    key = request_key(seed)[None]
    cuts = (jnp.asarray([temperature], jnp.float32), jnp.asarray([top_p], jnp.float32),
            jnp.asarray([top_k], jnp.int32), jnp.asarray([min_p], jnp.float32))
    vocab = model.config.vocab_size
    history = begin(empty_history(1, vocab), np.int32(0), *start_rows(vocab, prompt_ids, tuple(logit_bias)))
    penalties = tuple(np.asarray([v], np.float32) for v in (presence_penalty, frequency_penalty, repetition_penalty))
    penalties += (np.asarray([True]),)
    constraint = model.grammars.compile(grammar) if grammar is not None else None
    position, fed = len(prompt_ids), -1
    eos = model.tokenizer.eos_ids
    for _ in range(max_tokens):
        allowed = open_mask(1, vocab) if constraint is None else constraint.allowed()[None]
        history, (token, _, key, _, _) = sample_with_history(logits, (*cuts, key), False, history,
                                                             np.zeros(1, np.int32), np.asarray([fed], np.int32),
                                                             penalties, allowed)
        token_id = fed = int(token[0])
        if constraint is not None and not constraint.accept(token_id):
            return
        if token_id in eos:
            return
        yield token_id
        if position + 1 >= limit:  # prompt and answer fill the context
            return
        logits, kv = decode_step(model, kv, geo, [token_id], [0], [position])
        position += 1
