"""Quantized weights: a small pytree of packed values and per-block scales, and the one
matrix product every projection, expert and LM head goes through.

A `QTensor` stands for a float32 matrix [..., N, K] (rows are outputs, as GGUF stores
them), kept as one of two layouts:
  q4  values uint8 [..., N, K/2]: in each block of 32, byte i holds value i in its low
      nibble and value i + 16 in its high one; block 32
  q8  values int8 [..., N, K]; block 16 or 32
  p8  a q8 matrix of Q6_K or Q5_K blocks as the integer kernels' panels of 16 rows, and
      p4 a q4 one of Q4_K, Q4_1 or Q4_0 blocks (panel_layout.py; panels.py holds them so
      where the AVX2 or AVX-512 VNNI kernels run)
with scale [..., N, K/block] and, where the format has one, min likewise: a weight is
q · scale + min. Scales and mins are as the file keeps them, so no value changes:
float16 (Q4_0, Q4_1, Q8_0), or for the K types small integers (uint8, or int8 for Q6_K)
times a float32 super entry per `group` blocks (super_scale, super_min [..., N,
K/block/group]): Q4_K then takes 4.75 bits a value where float32 scales took 6.
Float32 scales are the plain form (--quantize's, and stacks of parts that differ).
Every GGUF type motet reads repacks into one of these exactly (gguf_quants.py).

`matmul(x, w)` takes a QTensor, a QRows (a matrix in pieces of different layouts)
or a plain [K, N] array. On the CPU a QTensor goes to
the native kernel (kernels/, through jax.ffi) where it was built; elsewhere, and
where it was not, the block is dequantized inside the jitted computation, which GPUs
fuse into the dot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp
import numpy as np

from . import file_rows, native
from .panel_layout import PANELS, rows_of_panels

F32 = jnp.float32
LAYOUTS = ("q4", "q8", *PANELS)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QTensor:
    values: jax.Array | np.ndarray
    scale: jax.Array | np.ndarray
    min: jax.Array | np.ndarray | None
    layout: str = field(metadata=dict(static=True))
    block: int = field(metadata=dict(static=True))
    # the file's type ("Q4_K", ...), for `motet info`
    source: str = field(default="", metadata=dict(static=True))
    # packed K-type scales and mins: scale (and min) hold integers, times these per group
    super_scale: jax.Array | np.ndarray | None = None
    super_min: jax.Array | np.ndarray | None = None
    group: int = field(default=0, metadata=dict(static=True))
    # what the native products quantize x to: int16 per 32 values, or 8 (int8, as
    # llama.cpp does) where a kernel has that form: every product over panels, and AVX2's
    # of many rows over q4
    x_bits: int = field(default=16, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """The float matrix it stands for."""
        return (*self.scale.shape[:-1], self.scale.shape[-1] * self.block)

    @property
    def dtype(self):
        """What its products are computed in."""
        return np.dtype(np.float32)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.values, self.scale, self.min, self.super_scale, self.super_min)
                   if a is not None)


def _widened(entries, supers, group: int, xp):
    """Scales or mins as float32: packed integers times their group's super entry."""
    if supers is None:
        return entries.astype(xp.float32)
    grouped = entries.reshape(*entries.shape[:-1], -1, group).astype(xp.float32)
    return (grouped * supers[..., None]).reshape(entries.shape)


def scales_of(w: QTensor, xp=jnp):
    """(scale, min or None) as float32 arrays [..., N, K/block], in numpy or inside jit."""
    mins = None if w.min is None else _widened(w.min, w.super_min, w.group, xp)
    return _widened(w.scale, w.super_scale, w.group, xp), mins


def plain(w: QTensor) -> QTensor:
    """w with float32 scales and mins (host arrays): the form parts that differ stack in."""
    if w.super_scale is None and w.super_min is None:
        return w
    scale, mins = scales_of(jax.tree.map(np.asarray, w), np)
    return QTensor(w.values, scale, mins, w.layout, w.block, w.source)


def dequantize(w: QTensor, dtype=F32) -> jax.Array:
    """The float matrix [..., N, K], inside jitted code."""
    if w.layout in PANELS:
        w = rows_of_panels(w)
    lead = w.values.shape[:-1]
    if w.layout == "q4":
        v = w.values.reshape(*lead, -1, 16)
        q = jnp.concatenate([v & 15, v >> 4], axis=-1)
    else:
        q = jnp.reshape(w.values, (*lead, -1, w.block))
    scale, mins = scales_of(w)
    out = q.astype(dtype) * scale[..., None].astype(dtype)
    if mins is not None:
        out = out + mins[..., None].astype(dtype)
    return out.reshape(*lead, -1)


def _xla_matmul(x: jax.Array, w: QTensor) -> jax.Array:
    if w.layout in PANELS:
        w = rows_of_panels(w)
    if math.prod(x.shape[:-1]) == 1 and w.values.ndim == 2:
        return jax.lax.platform_dependent(x, w, cpu=_dequantized_dot, default=_reduced_row)
    return _dequantized_dot(x, w)


def _dequantized_dot(x: jax.Array, w: QTensor) -> jax.Array:
    return jnp.einsum("...k,nk->...n", x, dequantize(w, x.dtype), preferred_element_type=F32)


def _reduced_row(x: jax.Array, w: QTensor) -> jax.Array:
    """One row x [..., K] (a decode token) times w.T as a single multiply-and-reduce, the
    weights widened elementwise inside it: XLA:GPU fuses that and reads the packed bytes
    once, where its dot read a materialised float32 copy (an H200, the 151,936 × 2048
    head: Q8_0 2.49 TB/s against 0.48, Q4_K 1.08 against 0.27). Not on XLA:CPU, where
    such reductions are the slowest form (docs/performance.md)."""
    n, k = w.shape
    scale, mins = scales_of(w)
    scale = scale[..., None]
    mins = 0.0 if mins is None else mins[..., None]
    if w.layout == "q4":  # a byte holds values i and i + 16 of its block: x's halves meet them apart
        v = w.values.reshape(n, k // w.block, w.block // 2)
        xs = x.astype(F32).reshape(k // w.block, 2, w.block // 2)
        terms = ((v & 15) * scale + mins) * xs[:, 0] + ((v >> 4) * scale + mins) * xs[:, 1]
    else:
        v = w.values.reshape(n, k // w.block, w.block)
        terms = (v * scale + mins) * x.astype(F32).reshape(k // w.block, w.block)
    return jnp.sum(terms, axis=(1, 2)).reshape(*x.shape[:-1], n)


def ffi_operands(w: QTensor) -> tuple[tuple, dict]:
    """A QTensor as the kernels take it (kernels/qmatmul_ffi.cc's Matrix): its five
    buffers (an empty float32 array for one it lacks) and its attributes."""
    none = jnp.zeros((0,), F32)
    buffers = tuple(none if a is None else a for a in (w.values, w.scale, w.min, w.super_scale, w.super_min))
    return buffers, {"kind": np.int64(LAYOUTS.index(w.layout)), "block": np.int64(w.block),
                     "has_min": np.int64(w.min is not None), "group": np.int64(w.group),
                     "x_bits": np.int64(w.x_bits)}


def _native_matmul(x: jax.Array, w: QTensor, index=None) -> jax.Array:
    n = w.values.shape[-2]
    target = native.QMATMUL if index is None else native.QMATMUL_STACKED
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((*x.shape[:-1], n), F32))
    buffers, attributes = ffi_operands(w)
    return call(x.astype(F32), *buffers, *(() if index is None else (index,)), **attributes)


def qmatmul(x: jax.Array, w: QTensor, use_native: bool | None = None, index=None) -> jax.Array:
    """x [..., K] @ w.T → [..., N] in float32. w: one [N, K] matrix, or with `index` (an
    int32 scalar, traced) matrix `index` of a stack [E, N, K], which the kernel reads in
    place (a slice of it would be copied first). use_native: None picks the kernel on the
    CPU where it was built; False forces the dequantize-and-dot path (tests)."""
    if w.values.ndim != (2 if index is None else 3):
        raise ValueError(f"qmatmul takes one [N, K] matrix, or a stack [E, N, K] and an index; got {w.shape}")
    use_native = native.use_kernel(use_native, True, "quantized product")
    if index is not None:
        index = jnp.asarray(index, jnp.int32).reshape(())

        def xla(x, w, index):
            return _xla_matmul(x, jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, 0, False), w))

        if not use_native:
            return xla(x, w, index)
        return jax.lax.platform_dependent(x, w, index, cpu=_native_matmul, default=xla)
    if not use_native:
        return _xla_matmul(x, w)
    return jax.lax.platform_dependent(x, w, cpu=_native_matmul, default=_xla_matmul)


X_BITS = (16, 8)


# The GGUF types whose values lie within [-32, 31] as int8 (q8: Q5_K's and Q6_K's, and
# the 4-bit ones widened to stack with them): the int8 products take those as unsigned
# bytes plus 32, and an int8 x as signed ones.
SIX_BIT_SOURCES = frozenset({"Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"})


def takes_int8_x(w: QTensor) -> bool:
    """Whether the kernels' int8 form of x can take w: 4-bit values, or int8 values of
    six bits (by the file's types: `source` joins a stack's with "+")."""
    return w.layout == "q4" or set(w.source.split("+")) <= SIX_BIT_SOURCES


def with_x_bits(tree, bits: int):
    """The QTensors of a pytree (a layer's weights, a pool's stacks) set to quantize x to
    `bits` in their native products where they can take it (takes_int8_x): a static
    field, so no array is touched."""
    if bits not in X_BITS:
        raise ValueError(f"x is quantized to 16 or 8 bits, not {bits}")
    if bits == 16:
        return tree
    return jax.tree.map(lambda t: replace(t, x_bits=bits) if isinstance(t, QTensor) and takes_int8_x(t) else t,
                        tree, is_leaf=lambda t: isinstance(t, QTensor))


def matmul(x: jax.Array, w) -> jax.Array:
    """x @ W for a plain [K, N] array, or x @ w.T for a QTensor [N, K]: the one entry
    point of every weight product. The result has x's dtype."""
    if isinstance(w, QTensor):
        return qmatmul(x, w).astype(x.dtype)
    if isinstance(w, QRows):
        return jnp.concatenate([matmul(x, p) for p in w.pieces], axis=-1)
    return jnp.dot(x, w)


def matmul_stacked(x: jax.Array, w, index) -> jax.Array:
    """x times matrix `index` (traced) of a stack: [E, K, N] plain (sliced), or a QTensor
    [E, N, K] (read in place by the kernel). The result has x's dtype."""
    if isinstance(w, QTensor):
        return qmatmul(x, w, index=index).astype(x.dtype)
    return jnp.dot(x, jax.lax.dynamic_index_in_dim(w, index, 0, keepdims=False))


def matmul_gathered(x: jax.Array, w, index: jax.Array) -> jax.Array:
    """Row a of x [A, K] times matrix index[a] of a stack ([E, K, N] plain, or a QTensor
    [E, N, K]), as [A, N] in x's dtype: a batch of matrix-vector products over the
    gathered matrices, which reads only the matrices `index` names."""
    if isinstance(w, QTensor):
        picked = dequantize(pick_rows(w, index), x.dtype)
        return jnp.einsum("ak,ank->an", x, picked, preferred_element_type=F32).astype(x.dtype)
    return jnp.einsum("ak,akn->an", x, w[index])


def take_rows(w, rows) -> jax.Array:
    """Rows of a matrix as floats (an embedding lookup): of a QTensor, or of a file's own
    blocks (file_rows.py), only those rows are dequantized."""
    if isinstance(w, file_rows.FileRows):
        return file_rows.take(w, rows)
    return dequantize(pick_rows(w, rows)) if isinstance(w, QTensor) else w[rows]


def pick_rows(w: QTensor, rows) -> QTensor:
    """Those rows, in that order, still packed (a lookup, or a reordering at load)."""
    if w.layout in PANELS and w.values.ndim == 2:  # a stack's experts are whole matrices
        raise ValueError(f"a {w.layout} matrix holds its rows in panels of 16: take rows of rows_of_panels(w)")
    return jax.tree.map(lambda a: a[rows], w)


def as_q8(w: QTensor, block: int) -> QTensor:
    """The same values as int8 with a scale per `block` (≤ w.block): exact, for stacking
    tensors of different layouts into one matrix."""
    if w.layout == "q8" and w.block == block:
        return w
    w = plain(w)
    values = np.asarray(w.values)
    if w.layout == "q4":
        v = values.reshape(*values.shape[:-1], -1, 16)
        values = np.concatenate([v & 15, v >> 4], axis=-1).reshape(*values.shape[:-1], -1)
    repeat = w.block // block
    scale = np.repeat(np.asarray(w.scale), repeat, axis=-1)
    mins = None if w.min is None else np.repeat(np.asarray(w.min), repeat, axis=-1)
    return QTensor(values.astype(np.int8), scale, mins, "q8", block, w.source)


def stack_rows(parts: list[QTensor]) -> QTensor:
    """One matrix whose rows are the parts' rows (Q, K and V; gate and up; of a stack of
    experts, each expert's), in the most compact layout all of them fit exactly."""
    form = {(p.layout, p.block, p.min is None, p.group, np.dtype(p.scale.dtype)) for p in parts}
    if len(form) > 1:
        parts = [plain(p) for p in parts]
    if len({(p.layout, p.block, p.min is None) for p in parts}) > 1:
        block = min(p.block for p in parts)
        parts = [as_q8(p, block) for p in parts]
        if any(p.min is not None for p in parts):
            parts = [p if p.min is not None else
                     QTensor(p.values, p.scale, np.zeros_like(p.scale), p.layout, p.block, p.source)
                     for p in parts]
    first = parts[0]
    sources = "+".join(dict.fromkeys(p.source for p in parts))

    def cat(name):
        arrays = [getattr(p, name) for p in parts]
        return None if arrays[0] is None else np.concatenate([np.asarray(a) for a in arrays], axis=-2)

    return QTensor(cat("values"), cat("scale"), cat("min"), first.layout, first.block, sources,
                   cat("super_scale"), cat("super_min"), first.group)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QRows:
    """A matrix whose rows come in pieces of different layouts, each held as the file
    holds it: Q and K as Q4_K beside V as Q6_K, where one stack would widen all three to
    int8 with float32 scales and mins per 16 (12 bits a value where Q4_K takes 4.75)."""
    pieces: tuple[QTensor, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        n = sum(p.shape[-2] for p in self.pieces)
        return (*self.pieces[0].shape[:-2], n, self.pieces[0].shape[-1])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    @property
    def layout(self) -> str:
        return " | ".join(p.layout for p in self.pieces)

    @property
    def source(self) -> str:
        return " | ".join(p.source or p.layout for p in self.pieces)


def join_rows(parts: list[QTensor]) -> QTensor | QRows:
    """One matrix of the parts' rows: stacked where their layouts agree, else in pieces,
    runs of alike parts stacked, so no part is widened (a matrix product takes the pieces
    in turn). For matrices that go through `matmul`; a stack of experts takes
    `stack_rows`, which the experts' kernel reads as one."""
    def form(p: QTensor) -> tuple:
        return p.layout, p.block, p.min is None

    runs: list[list[QTensor]] = []
    for p in parts:
        if runs and form(runs[-1][0]) == form(p):
            runs[-1].append(p)
        else:
            runs.append([p])
    pieces = tuple(run[0] if len(run) == 1 else stack_rows(run) for run in runs)
    return pieces[0] if len(pieces) == 1 else QRows(pieces)


def stack(items: list) -> np.ndarray | QTensor:
    """Host matrices (plain or QTensors of one layout) stacked on a new first axis: a
    layer's experts, or the experts of one move to the pool."""
    return jax.tree.map(lambda *leaves: np.stack(leaves), *items)


def host_index(w, i: int):
    """Matrix i of a host stack, copied out (so it holds no view of the stack)."""
    return jax.tree.map(lambda a: np.array(a[i]), w)


def as_float_stack(w) -> jax.Array:
    """A stack of matrices as float x @ W operands [E, K, N], inside jitted code: for
    lax.ragged_dot, which takes no QTensor (the GPU path)."""
    return dequantize(w).swapaxes(-1, -2) if isinstance(w, QTensor) else w


QUANTIZE_BLOCK = 32


def quantize(w: np.ndarray, layout: str, source: str) -> QTensor:
    """Weight-only, group-wise quantization of a float matrix [..., N, K] (K a multiple of
    32) on the host, a group of 32 along K each: q8 is symmetric (scale = absmax / 127, no
    min), q4 asymmetric (scale = (max - min) / 15, min), as GGUF's Q8_0 and Q4_1 are."""
    w = np.asarray(w, np.float32)
    groups = w.reshape(*w.shape[:-1], -1, QUANTIZE_BLOCK)
    if layout == "q8":
        scale = np.abs(groups).max(axis=-1) / 127
        q = np.rint(groups / np.where(scale == 0, 1, scale)[..., None])
        values, mins = np.clip(q, -127, 127).astype(np.int8).reshape(w.shape), None
    elif layout == "q4":
        mins = groups.min(axis=-1)
        scale = (groups.max(axis=-1) - mins) / 15
        q = np.clip(np.rint((groups - mins[..., None]) / np.where(scale == 0, 1, scale)[..., None]), 0, 15)
        q = q.astype(np.uint8)
        values = (q[..., :16] | (q[..., 16:] << 4)).reshape(*w.shape[:-1], -1)
    else:
        raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")
    return QTensor(values, scale.astype(np.float32), mins, layout, QUANTIZE_BLOCK, source)
