"""The native quantized-matmul kernels (motet/model/kernels), built with the machine's
C++ compiler during the ordinary install. The build is optional: where it fails, the
install goes on and motet uses the XLA path (motet/model/native.py says which)."""

import os
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def ffi_include() -> list[str]:
    try:
        import jax.ffi

        return [jax.ffi.include_dir()]
    except Exception:  # noqa: BLE001 - no jax at build time: the build fails and is skipped
        return []


class ParallelBuildExt(build_ext):
    """Compiles an extension's sources side by side, one compiler a core: the kernels'
    ten files took 106 s one after another on a 2-core machine, most of an install."""

    def build_extension(self, ext):
        compile_one = self.compiler.compile

        def compile_all(sources, *args, **kwargs):
            with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
                objects = pool.map(lambda source: compile_one([source], *args, **kwargs), sources)
                return [path for paths in objects for path in paths]

        self.compiler.compile = compile_all
        try:
            super().build_extension(ext)
        finally:
            del self.compiler.compile


KERNELS = "motet/model/kernels/"
setup(
    cmdclass={"build_ext": ParallelBuildExt},
    ext_modules=[
        Extension(
            "motet.model._qmatmul",
            # the long compiles first, so that the short ones fill in beside them
            sources=[KERNELS + f"qmatmul_{part}.cc" for part in ("ffi", "base", "avx2", "avx512", "avx512vnni")]
            + [KERNELS + f"{name}.cc" for name in ("pool", "moe", "norm_rope", "kv_write", "kv_copy", "sample")],
            include_dirs=ffi_include(),
            language="c++",
            extra_compile_args=["-O3", "-std=c++17", "-w"],
            # every header and included file: a change to any rebuilds the extension
            depends=[KERNELS + name for name in sorted(os.listdir(KERNELS)) if name.endswith((".h", ".inc"))],
            optional=True,
        )
    ]
)
