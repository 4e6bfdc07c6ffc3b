"""What the two stdio bridges (mux and legacy) share: host facts for telemetry lines, and
a graceful stop — stop reading, give the work in flight a few seconds, then cancel it."""

from __future__ import annotations

import psutil
import trio


def rss_gb() -> float:
    return psutil.Process().memory_info().rss / 1e9


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


class Intake:
    """A bridge's reading side. `shutdown(grace)` (a signal) ends the reading at once;
    the requests in flight then have `grace` seconds to finish before they are cancelled.
    EOF on stdin ends the reading too, without the deadline."""

    def __init__(self):
        self.reading = trio.CancelScope()
        self.work: trio.Nursery | None = None  # where requests in flight run

    def shutdown(self, grace: float) -> None:
        self.reading.cancel()
        if self.work is not None:
            self.work.cancel_scope.deadline = min(self.work.cancel_scope.deadline, trio.current_time() + grace)
