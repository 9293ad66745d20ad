"""The balancer's rolling one-minute statistics (balancer/stats.py): counts per second, not samples."""
import random

from balancer import stats


def clock(monkeypatch, start: float = 1000.0) -> list:
    now = [start]
    monkeypatch.setattr(stats.time, "monotonic", lambda: now[0])
    return now


def test_percentiles_are_within_two_percent_of_the_samples(monkeypatch):
    clock(monkeypatch)
    rng = random.Random(0)
    lat = [10 ** rng.uniform(-3.5, 1.5) for _ in range(5000)]      # 0.3 ms to 30 s
    w = stats.Window(60.0)
    for x in lat:
        w.add(x, 200)
    exact = sorted(lat)
    for q, got in zip((0.5, 0.9, 0.99), w.percentiles((0.5, 0.9, 0.99))):
        want = exact[int(q * len(exact))]
        assert abs(got - want) <= 0.021 * want, (q, got, want)
    s = w.summary()
    assert s["requests"] == s["ok"] == 5000
    assert abs(s["latency_p50"] - exact[2500]) <= 0.021 * exact[2500] + 1e-4


def test_requests_leave_the_window_with_their_latencies(monkeypatch):
    now = clock(monkeypatch)
    w = stats.Window(60.0)
    for _ in range(100):
        w.add(5.0, 200)               # slow ones, then 50 s later fast ones and errors
    now[0] += 50
    for _ in range(10):
        w.add(0.01, 200)
        w.add(0.01, 503)
    s = w.summary()
    assert (s["requests"], s["ok"]) == (120, 110) and s["latency_p50"] > 4.8
    now[0] += 15                       # the slow second is 65 s old now
    s = w.summary()
    assert (s["requests"], s["ok"]) == (20, 10)
    assert 0.0098 < s["latency_p50"] < 0.0102 and s["latency_p99"] < 0.0102
    now[0] += 60
    s = w.summary()
    assert (s["requests"], s["latency_p50"], s["latency_p99"]) == (0, None, None)


def test_what_it_holds_does_not_grow_with_the_request_rate(monkeypatch):
    """A loaded balancer answers ~10,000 requests a second: the window keeps per-second counts, so 200 s of that
    hold at most 60 slots of a few buckets each, where a list of samples held 600,000."""
    now = clock(monkeypatch)
    w = stats.Window(60.0)
    rng = random.Random(1)
    for _ in range(200):
        now[0] += 1
        for _ in range(2000):
            w.add(rng.uniform(0.02, 0.04), 200)
    assert len(w.slots) == 60 and w.requests == 120_000
    assert sum(len(h) for _, h, _ in w.slots) <= 60 * 20          # 20-40 ms spans 18 buckets
    assert sum(w.hist) == w.requests
