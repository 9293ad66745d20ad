"""Rolling one-minute request statistics (requests/s, latency percentiles)."""
from __future__ import annotations

import collections
import time


class Window:
    def __init__(self, seconds: float = 60.0):
        self.seconds = seconds
        self.started = time.monotonic()
        self.samples: collections.deque[tuple[float, float, int]] = collections.deque()   # (t, latency, status)

    def add(self, latency: float, status: int) -> None:
        now = time.monotonic()
        self.samples.append((now, latency, status))
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self.samples and now - self.samples[0][0] > self.seconds:
            self.samples.popleft()

    def summary(self) -> dict:
        now = time.monotonic()
        self._trim(now)
        lat = sorted(s[1] for s in self.samples)
        ok = sum(1 for s in self.samples if s[2] < 400)

        def pct(q: float):
            return round(lat[min(len(lat) - 1, int(q * len(lat)))], 4) if lat else None
        span = min(self.seconds, max(now - self.started, 1.0))     # the first minute is not a whole minute yet
        return {"window_seconds": round(span, 1), "requests": len(lat), "ok": ok,
                "requests_per_second": round(len(lat) / span, 3),
                "latency_p50": pct(0.5), "latency_p90": pct(0.9), "latency_p99": pct(0.99)}
