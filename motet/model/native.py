"""The native CPU kernels (kernels/*.cc: quantized products, decode and prefill
attention, a MoE layer's experts, norms, a QKV projection made heads, KV cache writes,
zeros and prefix copies, sampling): found beside this module, where the install built
them, and registered with XLA once.

The install builds them with the machine's C++ compiler (setup.py); where it could
not, `available()` is False and quantized products take the XLA path (quant.py).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
from functools import cache
from pathlib import Path

import jax

log = logging.getLogger(__name__)

QMATMUL = "motet_qmatmul"
QMATMUL_STACKED = "motet_qmatmul_stacked"  # one matrix of a stack, by a traced index
ATTEND_ROWS = "motet_attend_rows"  # decode attention over the KV cache
ATTEND_CHUNK = "motet_attend_chunk"  # prefill attention: a chunk over its slot's history
MOE_EXPERTS = "motet_moe_experts"  # a MoE layer's routed experts, quantized
RMS_NORM = "motet_rms_norm"  # a root-mean-square norm, after a residual add or alone
QKV_HEADS = "motet_qkv_heads"  # a QKV projection as heads: split, q and k normed, turned
KV_WRITE = "motet_kv_write"  # a step's new K and V rows into every layer's cache, in place
KV_WRITE_SCALED = "motet_kv_write_scaled"  # the same into 8-bit caches (kv_quant.py), quantized
KV_ZEROS = "motet_kv_zeros"  # zeroed caches whose pages are touched only when written
KV_COPY = "motet_kv_copy"  # a slot's first positions over another's, every layer, in place
SAMPLE = "motet_sample"  # a batch's next tokens drawn from its logits (sampling.py)
LIBRARY = "_qmatmul"


def library_path() -> Path | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"{LIBRARY}{suffix}"
        if path.exists():
            return path
    return None


@cache
def _library() -> ctypes.CDLL | None:
    path = library_path()
    if path is None:
        log.info("the native quantized kernels were not built; quantized weights use the XLA path")
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("cannot load %s (%s); quantized weights use the XLA path", path, exc)
        return None
    lib.motet_qmatmul_isa.restype = ctypes.c_char_p
    lib.motet_qmatmul_select.argtypes = [ctypes.c_char_p]
    lib.motet_qmatmul_rows_at_once.argtypes = [ctypes.c_int]
    lib.motet_kv_write_f16c.argtypes = [ctypes.c_int]
    jax.ffi.register_ffi_target(QMATMUL, jax.ffi.pycapsule(lib.MotetQMatmul), platform="cpu")
    jax.ffi.register_ffi_target(QMATMUL_STACKED, jax.ffi.pycapsule(lib.MotetQMatmulStacked), platform="cpu")
    jax.ffi.register_ffi_target(ATTEND_ROWS, jax.ffi.pycapsule(lib.MotetAttendRows), platform="cpu")
    jax.ffi.register_ffi_target(ATTEND_CHUNK, jax.ffi.pycapsule(lib.MotetAttendChunk), platform="cpu")
    jax.ffi.register_ffi_target(MOE_EXPERTS, jax.ffi.pycapsule(lib.MotetMoeExperts), platform="cpu")
    jax.ffi.register_ffi_target(RMS_NORM, jax.ffi.pycapsule(lib.MotetRmsNorm), platform="cpu")
    jax.ffi.register_ffi_target(QKV_HEADS, jax.ffi.pycapsule(lib.MotetQkvHeads), platform="cpu")
    jax.ffi.register_ffi_target(KV_WRITE, jax.ffi.pycapsule(lib.MotetKvWrite), platform="cpu")
    jax.ffi.register_ffi_target(KV_WRITE_SCALED, jax.ffi.pycapsule(lib.MotetKvWriteScaled), platform="cpu")
    jax.ffi.register_ffi_target(KV_ZEROS, jax.ffi.pycapsule(lib.MotetKvZeros), platform="cpu")
    jax.ffi.register_ffi_target(KV_COPY, jax.ffi.pycapsule(lib.MotetKvCopy), platform="cpu")
    jax.ffi.register_ffi_target(SAMPLE, jax.ffi.pycapsule(lib.MotetSample), platform="cpu")
    return lib


def available() -> bool:
    return _library() is not None


def k_scales_packed() -> bool:
    """Whether a K type's scales stay as the file packs them (a small integer per block
    and a float per super-block) rather than widened to float32 at load. The AVX-512 and
    AVX2 dots read them in place: on a Zen 2 the MoE Q4_K_M file's weights take 254 MB
    rather than 308, for a 16-row step about 4% slower, its K-type products 5-20%
    (docs/performance.md). The baseline dots ran a fifth to a third slower on them, so
    there they are widened. Off the CPU the XLA path widens them inside the jitted
    computation."""
    return jax.default_backend() != "cpu" or instruction_set() in (None, "avx2", "avx512", "avx512vnni")


def use_kernel(asked: bool | None, applies: bool, what: str) -> bool:
    """Whether a computation runs on its native kernel. asked None: where the kernel was
    built and applies (its operands are of the kinds it takes); True: it must (an error
    where it cannot); False: never (tests compare it with the XLA path so)."""
    if asked is None:
        return applies and available()
    if asked and not (applies and available()):
        raise RuntimeError(f"the native {what} kernel was not built here, or does not take these operands")
    return asked


def instruction_set() -> str | None:
    """What the kernels run on this CPU: "avx512vnni", "avx512", "avx2" or "base"."""
    lib = _library()
    return None if lib is None else lib.motet_qmatmul_isa().decode()


def select_instruction_set(name: str) -> bool:
    """Run the kernels with `name` from now on (tests compare every one the CPU has);
    False where this CPU lacks it."""
    lib = _library()
    if lib is None or not lib.motet_qmatmul_select(name.encode()):
        return False
    lib.motet_kv_write_f16c(int(name != "base"))  # the baseline rounds halves without F16C
    return True


def rows_at_once(rows: int | None = None) -> int:
    """Weight rows the AVX-512 one-row dots take a pass (4 share each load of x; AMD's
    CPUs stream faster with 1): set it to 1 or 4 (0: as the CPU's vendor says; tests
    run both), or None to read it. 0 where the kernels were not built."""
    lib = _library()
    return 0 if lib is None else lib.motet_qmatmul_rows_at_once(-1 if rows is None else rows)


INSTRUCTION_SETS = ("avx512vnni", "avx512", "avx2", "base")
# The instruction sets whose kernels read matrices held as panels (panels.py); the
# others read rows, and refuse panels.
READ_PANELS = ("avx512vnni", "avx2")
# Where an instruction set's products take many rows of x as int16 pairs (AVX-512 VNNI,
# AVX2), the one whose products keep those rows in float32:
# tests and benchmarks score the two side by side.
FLOAT_ROWS_INSTEAD = {"avx512vnni": "avx512", "avx2": "base"}
