"""A small numpy quantizer for ggml's K formats (Q4_K, Q5_K, Q6_K), which gguf-py can
read but not write: the tests use it to build quantized GGUF files.

    raw = quantize_k(x, "Q4_K")   # x float32 [..., cols], cols % 256 == 0
    writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType.Q4_K)

`raw` is uint8 [..., cols // 256 * block_bytes], the byte shape GGUFWriter turns back
into the logical [..., cols]. The scheme is plain min/max (Q4_K, Q5_K) or absmax (Q6_K)
per sub-block, with the sub-block scales themselves quantized against one f16 scale per
256-value super-block; it is not llama.cpp's error-minimising search. Every value comes
back within (about) half of its super-block's widest step, and the rounding is arranged
so that quantize_k(dequantize(raw)) gives back raw byte for byte.
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # values per super-block
KINDS = ("Q4_K", "Q5_K", "Q6_K")


def _f16(v: np.ndarray) -> np.ndarray:
    """v as the f16 the block stores, back in float32 so later maths uses what the
    reader will see."""
    return v.astype(np.float16).astype(np.float32)


def _f16_down(v: np.ndarray) -> np.ndarray:
    """v as an f16 not above it, back in float32. Noise of a float ulp is ignored, so
    that v = 63 * f / 63 for an f16 f gives back f and not the f16 below it."""
    f = v.astype(np.float16)
    f = np.where(f.astype(np.float32) > v * (1 + 1e-6), np.nextafter(f, np.float16(0)), f)
    return f.astype(np.float32)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, 0 where b is 0: all-zero or constant sub-blocks have a zero scale."""
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b != 0)


def _sub_scales(span: np.ndarray, d: np.ndarray, top: int, cap: int) -> np.ndarray:
    """Integer sub-block scales sc (step d*sc, sc <= cap) for sub-blocks whose values lie
    within `span` of their base and should reach level `top`.

    Rounding sc up never clips the top value, but can leave it on level top-1; then a
    re-quantization of the dequantized values would pick a smaller scale and move every
    value. So in that case sc is rounded down and the top value clips onto level `top`,
    which keeps quantize(dequantize(raw)) == raw. The clipping costs under (top - 1/2)*d,
    half the super-block's largest step or less. The 1e-4 keeps float noise in s*d/d from
    tipping a re-quantization onto the next integer."""
    r = _safe_div(span, d[:, None]) / top
    up = np.clip(np.ceil(r - 1e-4), 0, cap)
    down = np.clip(np.floor(r + 1e-4), 0, cap)
    short = np.round(_safe_div(span, d[:, None] * up)) < top
    return np.where(short, down, up)


def _pack_scales_mins(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and eight 6-bit mins -> ggml's 12-byte K_SCALE layout: bytes
    0-3 and 4-7 hold scales/mins 0-3 in their low 6 bits and the top 2 bits of scales/mins
    4-7 above them; bytes 8-11 hold the low 4 bits of scale 4-7 | min 4-7 << 4."""
    lo_sc, hi_sc = sc[:, :4], sc[:, 4:]
    lo_mn, hi_mn = mn[:, :4], mn[:, 4:]
    return np.concatenate([
        lo_sc | ((hi_sc >> 4) << 6),
        lo_mn | ((hi_mn >> 4) << 6),
        (hi_sc & 0x0F) | ((hi_mn & 0x0F) << 4),
    ], axis=1).astype(np.uint8)


def _quantize_min_max(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Affine quantization of [n, 256] super-blocks as 8 sub-blocks of 32, each
    x ~ d*sc*q - dmin*m with q in [0, levels). Returns (d, dmin, packed scales, q)."""
    sub = blocks.reshape(-1, 8, 32)
    # m is unsigned and dmin kept >= 0 (as ggml writes them), so a sub-block's base can
    # only sit at or below 0: one that is all positive is quantized from 0
    lo = np.minimum(sub.min(axis=2), 0)
    # m is rounded down so the lowest value always lands on level 0 (clipped there), which
    # re-quantization needs to see the same min; dmin is rounded down so that the largest
    # min still gets m = 63 and re-quantization finds the same dmin
    dmin = _f16_down((-lo).max(axis=1) / 63)
    m = np.clip(np.floor(_safe_div(-lo, dmin[:, None]) + 1e-4), 0, 63)
    offset = dmin[:, None] * m
    # the step is sized from the min as stored, so the rounding of m cannot push the top
    # of the sub-block out of range
    span = np.maximum(sub.max(axis=2) + offset, 0)
    d = _f16(span.max(axis=1) / (levels - 1) / 63)
    sc = _sub_scales(span, d, levels - 1, 63)
    q = np.round(_safe_div(sub + offset[..., None], (d[:, None] * sc)[..., None]))
    q = np.clip(q, 0, levels - 1).astype(np.uint8).reshape(-1, QK_K)
    return d, dmin, _pack_scales_mins(sc.astype(np.uint8), m.astype(np.uint8)), q


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """The low 4 bits of [n, 256] values as 128 bytes: byte i of each 32-byte group g
    holds sub-block 2g's value i low and sub-block 2g+1's high."""
    q = (q & 0x0F).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _quantize_min_max(blocks, 16)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, _nibbles(q)], axis=1)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _quantize_min_max(blocks, 32)
    # bit k of high-bit byte i is bit 4 of sub-block k's value i
    hi = ((q >> 4) & 1).reshape(-1, 8, 32) << np.arange(8, dtype=np.uint8)[None, :, None]
    qh = np.bitwise_or.reduce(hi, axis=1).astype(np.uint8)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, qh, _nibbles(q)], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """Symmetric: x ~ d*sc*(q - 32) per 16 values, with q - 32 kept in [-31, 31] so the
    scale needs no sign (it is stored as int8, as ggml expects)."""
    sub = blocks.reshape(-1, 16, 16)
    span = np.abs(sub).max(axis=2)
    d = _f16(span.max(axis=1) / 31 / 127)
    sc = _sub_scales(span, d, 31, 127)
    q = np.round(_safe_div(sub, (d[:, None] * sc)[..., None]))
    # -32 is left unused: a value there would look like a wider span on re-quantization
    q = (np.clip(q, -31, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    # each 128-value half: ql byte i holds value i (low nibble) and value 64+i (high);
    # qh byte i holds the top 2 bits of values i, 32+i, 64+i, 96+i
    low = q & 0x0F
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4),
                         low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    top = (q >> 4) << np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    qh = np.bitwise_or.reduce(top, axis=2).astype(np.uint8)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64),
                           sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)


_QUANTIZERS = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def quantize_k(x: np.ndarray, kind: str) -> np.ndarray:
    """x float [..., cols] (cols a multiple of 256) -> uint8 [..., cols // 256 * block
    bytes] of `kind` ("Q4_K", "Q5_K" or "Q6_K") blocks, row-major like ggml."""
    if kind not in _QUANTIZERS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    x = np.asarray(x, dtype=np.float32)
    if x.ndim < 1 or x.shape[-1] % QK_K:
        raise ValueError(f"last dim must be a multiple of {QK_K}, got shape {x.shape}")
    # past 1e6 the f16 block scales (dmin = |min| / 63 first) would overflow
    if not (np.abs(x) < 1e6).all():
        raise ValueError("values must be finite and under 1e6 in magnitude")
    raw = _QUANTIZERS[kind](x.reshape(-1, QK_K))
    return raw.reshape(*x.shape[:-1], -1)
