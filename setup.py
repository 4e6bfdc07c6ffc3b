"""The native quantized-matmul kernels (motet/model/kernels), built with the machine's
C++ compiler during the ordinary install. The build is optional: where it fails, the
install goes on and motet uses the XLA path (motet/model/native.py says which)."""

from setuptools import Extension, setup


def ffi_include() -> list[str]:
    try:
        import jax.ffi

        return [jax.ffi.include_dir()]
    except Exception:  # noqa: BLE001 - no jax at build time: the build fails and is skipped
        return []


KERNELS = "motet/model/kernels/"
setup(
    ext_modules=[
        Extension(
            "motet.model._qmatmul",
            sources=[KERNELS + f"qmatmul_{part}.cc" for part in ("ffi", "base", "avx2", "avx512", "avx512vnni")]
            + [KERNELS + name for name in ("moe.cc", "norm_rope.cc", "kv_write.cc", "kv_copy.cc", "sample.cc")],
            include_dirs=ffi_include(),
            language="c++",
            extra_compile_args=["-O3", "-std=c++17", "-w"],
            depends=[KERNELS + name for name in ("qmatmul.h", "qmatmul_headers.h", "qmatmul_body.inc",
                                                 "scales_body.inc", "attend_body.inc", "swiglu_body.inc", "matvec_avx2.inc",
                                                 "matvec_avx512.inc", "four_entries.inc",
                                                 "avx512_body.inc", "pairs_vnni.inc", "pairs_avx2.inc")],
            optional=True,
        )
    ]
)
