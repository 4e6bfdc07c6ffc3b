"""JAX compilation as motet uses it: the persistent cache set up in one place, a count of
the executables built, and compiling several lowered functions at once.

    use_compile_cache(path)          the cache every entry point turns on (None: off)
    CompileCounter().start()         .now() -> CompileCount(requests, from_cache); .stop()
    compiling_ahead(lowerings, ...)  trace and lower one by one, compile in threads
    drop_lowerings()                 forget the lowered modules JAX keeps once compiled
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import jax
from jax import monitoring

log = logging.getLogger(__name__)

# Every executable JAX builds or takes from the persistent cache ends one such span.
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def use_compile_cache(path: Path | str | None) -> Path | None:
    """Turn JAX's persistent compilation cache on in `path` (None: leave it off). Every
    executable is written, however fast it compiled (JAX's default keeps only those over
    a second), so a second start of the same model and geometry compiles nothing.

    JAX opens its cache once per process, at the first compile: a later call with
    another folder changes nothing, and this says so. Returns the folder in use."""
    if path is None:
        return current_compile_cache()
    path = Path(path).expanduser()
    current = current_compile_cache()
    if current is not None and current != path and _cache_opened():
        log.warning("JAX's compilation cache is already open in %s; %s is not used", current, path)
        return current
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path


def current_compile_cache() -> Path | None:
    """The folder JAX's persistent cache is set to, or None."""
    # the option is a property JAX adds at run time, unknown to its type stubs
    value = jax.config.values["jax_compilation_cache_dir"]
    return Path(value) if value else None


def _cache_opened() -> bool:
    from jax._src import compilation_cache  # one of two places motet reads JAX's private state

    return compilation_cache._cache is not None


@dataclass(frozen=True)
class CompileCount:
    """Executables JAX needed since a counter started: `requests` in all, of which
    `from_cache` came from the persistent cache; the rest XLA compiled."""

    requests: int = 0
    from_cache: int = 0

    @property
    def compiled(self) -> int:
        return self.requests - self.from_cache

    def __sub__(self, other: CompileCount) -> CompileCount:
        return CompileCount(self.requests - other.requests, self.from_cache - other.from_cache)


class CompileCounter:
    """Counts, through jax.monitoring, every executable this process builds or loads
    while it is open (any thread, any caller: JAX's events are process-wide)."""

    def __init__(self):
        self._requests = 0
        self._from_cache = 0
        self._lock = threading.Lock()  # the listeners run in whichever thread compiles

    def start(self) -> CompileCounter:
        monitoring.register_event_duration_secs_listener(self._on_duration)
        monitoring.register_event_listener(self._on_event)
        return self

    def stop(self) -> None:
        monitoring.unregister_event_duration_listener(self._on_duration)
        monitoring.unregister_event_listener(self._on_event)

    def now(self) -> CompileCount:
        with self._lock:
            return CompileCount(self._requests, self._from_cache)

    def _on_duration(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == _COMPILE_EVENT:
            with self._lock:
                self._requests += 1

    def _on_event(self, event: str, **kwargs) -> None:
        if event == _CACHE_HIT_EVENT:
            with self._lock:
                self._from_cache += 1


def compile_workers() -> int:
    """Threads that compile at once: XLA's compiler releases the GIL and already splits
    one module's code generation over threads, so a few are enough."""
    return max(1, min(4, os.cpu_count() or 1))


@contextmanager
def compiling_ahead(lowerings: Iterable[tuple[Hashable, Callable[[], object]]], *, workers: int,
                    done: Callable[[Hashable], None]) -> Iterator[Callable[[Hashable], bool]]:
    """Trace and lower each (key, lower) in turn (Python work, one at a time) and compile
    the lowered modules in `workers` threads, done(key) after each. Yields wait(key),
    which returns once that key's compile is done (at once for a key not given), so a
    caller can run what is compiled while the rest compiles; it returns whether every
    compile is done. The executables land in JAX's caches, where the first real call
    with the same shapes finds them."""
    with ThreadPoolExecutor(workers, thread_name_prefix="motet-compile") as pool:
        futures: dict[Hashable, list[Future]] = {}
        for key, lower in lowerings:
            futures.setdefault(key, []).append(pool.submit(_compile, key, lower(), done))

        def wait(key: Hashable) -> bool:
            for future in futures.pop(key, ()):
                future.result()  # a compile error is the caller's
            return all(future.done() for pending in futures.values() for future in pending)

        yield wait
        for key in list(futures):
            wait(key)


def _compile(key, lowered, done: Callable[[Hashable], None]) -> None:
    started = time.perf_counter()
    lowered.compile()
    log.debug("compiled %s in %.2f s", key, time.perf_counter() - started)
    done(key)


def drop_lowerings() -> int:
    """Forget the MLIR modules JAX keeps of every jitted function it has lowered (two
    caches hold each), and return how many there were. Each module holds a context of
    its own with every dialect loaded: the default model's 55 held 60 MB once an engine
    was warm (docs/performance.md). The executables stay where calls find them; only a
    call that misses them lowers again, then reads the persistent cache."""
    from jax._src import pjit  # with pxla, the other place motet reads JAX's private state
    from jax._src.interpreters import pxla

    found = (getattr(pjit, "_pjit_lower", None), getattr(pxla, "_cached_lowering_to_hlo", None))
    caches = [c for c in found if c is not None and hasattr(c, "cache_clear") and hasattr(c, "cache_info")]
    if not caches:
        return 0  # a JAX that keeps them elsewhere, or not at all
    count = caches[0].cache_info().currsize
    for cache in caches:
        cache.cache_clear()
    gc.collect()  # the modules' Python objects hold one another: only the collector frees them
    return count
