"""Rolling one-minute request statistics (requests/s, and latency percentiles of the successful answers).

The window holds counts, not samples: one slot per second (its requests, its successes, a sparse histogram of its
latencies over log-spaced buckets, each 4% wider than the one before), and running totals over the slots in the
window. Adding a request and reading the summary cost the same at 10 requests/s and at 10,000: a list of samples
held 600,000 entries at that rate and sorted them on every /stats (150 ms with the event loop stopped). Percentiles
are the middle of their bucket: within 2% of the exact sample percentile."""
from __future__ import annotations

import collections
import math
import time

BASE = 1e-4                     # seconds: the first bucket holds every latency up to BASE * RATIO
RATIO = 1.04                    # each bucket's upper bound over its lower bound
BUCKETS = 460                   # BASE * RATIO ** BUCKETS is 6,800 s: the last bucket holds the rest
_INV_LOG = 1.0 / math.log(RATIO)


def bucket(latency: float) -> int:
    """The bucket of a latency in seconds: i holds (BASE * RATIO ** i, BASE * RATIO ** (i + 1)]."""
    if latency <= BASE:
        return 0
    return min(BUCKETS - 1, int(math.log(latency / BASE) * _INV_LOG))


def middle(i: int) -> float:
    """The value reported for a latency in bucket ``i``: the geometric middle of its bounds."""
    return BASE * RATIO ** (i + 0.5)


class Window:
    def __init__(self, seconds: float = 60.0):
        self.seconds = seconds
        self.started = time.monotonic()
        # (second, {bucket: count}, [requests, ok]), oldest first; only seconds that had requests
        self.slots: collections.deque[tuple[int, dict[int, int], list[int]]] = collections.deque()
        self.hist = [0] * BUCKETS          # totals over the slots in the window
        self.requests = 0
        self.ok = 0

    def add(self, latency: float, status: int) -> None:
        sec = int(time.monotonic())
        slots = self.slots
        if not slots or slots[-1][0] != sec:
            self._trim(sec)
            slots.append((sec, {}, [0, 0]))
        _, hist, counts = slots[-1]
        counts[0] += 1
        self.requests += 1
        if status < 400:          # latencies of answers only: a refusal's (a 400 or 429 in microseconds) is not one
            i = bucket(latency)
            hist[i] = hist.get(i, 0) + 1
            self.hist[i] += 1
            counts[1] += 1
            self.ok += 1

    def _trim(self, sec: int) -> None:
        """Drop the slots of seconds that left the window (a slot covers its whole second)."""
        slots, total = self.slots, self.hist
        while slots and slots[0][0] <= sec - self.seconds:
            _, hist, (n, ok) = slots.popleft()
            for i, c in hist.items():
                total[i] -= c
            self.requests -= n
            self.ok -= ok

    def percentiles(self, qs: tuple[float, ...]) -> list[float | None]:
        """The latency at each quantile of ``qs`` (ascending): the nearest-rank percentile, the ``ceil(q * n)``-th
        smallest (0-based ``ceil(q * n) - 1``) of the successful answers' latencies, as its bucket's middle; None
        when the window has none."""
        n = self.ok
        if not n:
            return [None] * len(qs)
        ranks = [min(n - 1, max(0, math.ceil(q * n) - 1)) for q in qs]
        out, seen, k = [], 0, 0
        for i, c in enumerate(self.hist):
            seen += c
            while k < len(ranks) and ranks[k] < seen:
                out.append(middle(i))
                k += 1
            if k == len(ranks):
                break
        return out

    def summary(self) -> dict:
        now = time.monotonic()
        self._trim(int(now))
        p50, p90, p99 = (None if v is None else round(v, 4) for v in self.percentiles((0.5, 0.9, 0.99)))
        span = min(self.seconds, max(now - self.started, 1.0))     # the first minute is not a whole minute yet
        return {"window_seconds": round(span, 1), "requests": self.requests, "ok": self.ok,
                "requests_per_second": round(self.requests / span, 3),
                "latency_p50": p50, "latency_p90": p90, "latency_p99": p99}
