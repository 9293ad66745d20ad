"""Request metrics kept as plain numbers on the hot path and turned into Prometheus families only when /metrics is
scraped. (prometheus-client's own Counter and Histogram take a lock on every update, which a server answering
thousands of requests per second on one event loop pays for nothing.)"""
from __future__ import annotations

import bisect
import collections
import math

from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString


class PlainCounter:
    """A monotonically increasing number, exported by the :class:`RequestMetrics` it belongs to."""
    __slots__ = ("documentation", "value")

    def __init__(self, documentation: str):
        self.documentation, self.value = documentation, 0

    def inc(self, amount: float = 1) -> None:
        self.value += amount


class RequestMetrics:
    """``{prefix}_requests_total{endpoint,status}``, ``{prefix}_request_latency_seconds{endpoint}`` and any plain
    counters added with :meth:`counter`. Register on a ``CollectorRegistry``; call :meth:`observe` per request."""

    def __init__(self, prefix: str, buckets: tuple[float, ...]):
        self.prefix = prefix
        self.buckets = tuple(sorted(buckets))
        self.counts: collections.Counter[tuple[str, int]] = collections.Counter()
        self.hist: dict[str, list] = {}              # endpoint -> [counts per bucket (+Inf last), sum]
        self.counters: dict[str, PlainCounter] = {}

    def observe(self, endpoint: str, status: int, seconds: float | None = None) -> None:
        """A request answered with ``status``; its latency goes into the histogram when it succeeded (status < 400:
        refusals and errors, often answered in microseconds, would pull the percentiles down exactly when the
        answers are slowest; they are counted by status)."""
        self.counts[(endpoint, status)] += 1
        if seconds is None or status >= 400:
            return
        h = self.hist.get(endpoint)
        if h is None:
            h = self.hist[endpoint] = [[0] * (len(self.buckets) + 1), 0.0]
        h[0][bisect.bisect_left(self.buckets, seconds)] += 1      # the first bucket whose bound is >= seconds
        h[1] += seconds

    def counter(self, name: str, documentation: str) -> PlainCounter:
        """A counter exported as ``{name}_total``."""
        return self.counters.setdefault(name, PlainCounter(documentation))

    def collect(self):
        c = CounterMetricFamily(f"{self.prefix}_requests", "Requests answered", labels=["endpoint", "status"])
        for (endpoint, status), n in sorted(self.counts.items()):
            c.add_metric([endpoint, str(status)], n)
        yield c
        h = HistogramMetricFamily(f"{self.prefix}_request_latency_seconds",
                                  "Latency of successful requests (status < 400)", labels=["endpoint"])
        for endpoint, (counts, total) in sorted(self.hist.items()):
            cumulative, buckets = 0, []
            for bound, n in zip(self.buckets + (math.inf,), counts):
                cumulative += n
                buckets.append((floatToGoString(bound), cumulative))
            h.add_metric([endpoint], buckets, total)
        yield h
        for name, c in self.counters.items():
            yield CounterMetricFamily(name, c.documentation, value=c.value)
