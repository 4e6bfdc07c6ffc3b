"""What a mux child says beyond its requests' frames: how it came up (the seconds to its
READY, its WARMUP line), and its telemetry lines (the expert map and heat: EMAP, HITS,
ENTROPY; its GPUs; each turn's PERF and REPIN, which go to that turn's stream)."""

from __future__ import annotations

from ..protocol import mux
from ..runtime.api import ExpertState, Perf, StartupReport
from .mux_stream import MuxStream


class ChildReport:
    def __init__(self) -> None:
        self.experts = ExpertState(0, 0, b"", b"", 0, ())
        self.gpus: tuple[tuple[float, float, int], ...] = ()
        self.ready_s: float | None = None  # from spawning the child to its READY
        self.warmup: mux.Warmup | None = None  # the child's WARMUP line

    def line(self, kind: str, fields: tuple[str, ...], streams: dict[int, MuxStream]) -> None:
        """One telemetry line; ValueError, IndexError or TypeError when it is unreadable."""
        x = self.experts
        if kind == "PERF" and (stream := streams.get(int(fields[0]))) is not None:
            stream.perf = Perf(*map(float, fields[1:8]))
        elif kind == "ENTROPY":
            self.experts = ExpertState(x.rows, x.cols, x.emap, x.hits, x.seq, tuple(map(float, fields)))
        elif kind == "GPUS":
            self.gpus = tuple((float(fields[i]), float(fields[i + 1]), int(fields[i + 2]))
                              for i in range(1, 1 + 3 * int(fields[0]), 3))
        elif kind == "REPIN":
            a, b, c, d = map(int, fields[:4])  # too few: a ValueError, the line skipped
            for stream in (s for s in streams.values() if s.slot is not None):
                stream.repin.append((a, b, c, d))
        elif kind in ("EMAP", "HITS"):
            rows, cols, bits = int(fields[0]), int(fields[1]), bytes.fromhex(fields[2])
            self.experts = (ExpertState(rows, cols, bits, x.hits, x.seq, x.entropy) if kind == "EMAP"
                            else ExpertState(rows, cols, x.emap, bits, x.seq + 1, x.entropy))

    def startup(self) -> StartupReport | None:
        """The seconds from spawning the child to its READY (what a request waited), with
        what its WARMUP line says (only the seconds when it sends none)."""
        if self.ready_s is None:
            return None
        w = self.warmup
        if w is None:
            return StartupReport(self.ready_s)
        return StartupReport(self.ready_s, w.load_s, w.warmup_s, w.shapes, w.compiled, w.from_cache)
