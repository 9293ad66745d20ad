"""Continuous vs static batching in one worker (not a test): open-loop Poisson arrivals at several rates, mixed
max_tokens and algorithms, against two `dllm-serve worker` processes that differ only in --continuous-batching /
--no-continuous-batching, measured side by side in one run (the rounds alternate which goes first).

  # the simulated device (worker/simulated.py, per-step cost: BASE + PER_ROW x rows seconds per denoising step)
  python bench/continuous_bench.py simulated --cost 0.005,0.0005 --batch-size 16 --duration 12
  # the CPU fixture model (real forwards of tests/fixtures/tiny-llada)
  python bench/continuous_bench.py cpu --batch-size 8 --duration 20

For each worker: throughput at saturation (a burst of requests far above capacity, completed requests and tokens per
second until the last answer), then p50/p99 latency at the offered loads given by --loads, as fractions of the
static worker's measured saturation throughput (the same arrivals for both workers).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from balancer_bench import Procs, free_port, wait_http  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def workload(n: int, rng: random.Random, lengths: list[int], algorithms: list[str]) -> list[dict]:
    out = []
    for _ in range(n):
        out.append({"prompt": [rng.randrange(1, 280) for _ in range(rng.randrange(4, 24))],
                    "max_tokens": rng.choice(lengths), "generation_algorithm": rng.choice(algorithms),
                    "block_length": 8, "ignore_eos": True})
    return out


async def fire(url: str, bodies: list[dict], arrivals: list[float]) -> tuple[list[float], float, int]:
    """Send body i at time arrivals[i] (seconds from now); returns latencies, the span until the last answer and the
    number of errors."""
    import aiohttp
    lat: list[float] = [0.0] * len(bodies)
    errors = 0
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        async def one(i):
            nonlocal errors
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.monotonic()))
            t = time.monotonic()
            async with s.post(url + "/v1/completions", json=bodies[i]) as r:
                await r.read()
                if r.status != 200:
                    errors += 1
            lat[i] = time.monotonic() - t
        await asyncio.gather(*[one(i) for i in range(len(bodies))])
    return lat, time.monotonic() - t0, errors


def work_bound(lengths: list[int], algorithms: list[str], batch: int, base: float, per_row: float,
               samples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """Saturation req/s of an ideal static and an ideal continuous scheduler for this mix on the per-step cost model
    (each round of steps costs BASE + PER_ROW x rows for every algorithm group with rows; a row takes one step per
    token): static runs batches of ``batch`` rows until each group's longest row ends, continuous keeps ``batch``
    rows running and refills a row's place the round it ends. No scheduling overhead on either side: the
    ratio of the two is the most continuous batching can gain on this workload."""
    rng = random.Random(seed)
    def row():
        return [rng.choice(algorithms), rng.choice(lengths)]
    cost, done = 0.0, 0
    for _ in range(samples):
        rows = [row() for _ in range(batch)]
        for g in set(a for a, _ in rows):
            ls = [n for a, n in rows if a == g]
            cost += sum(base + per_row * sum(1 for n in ls if n > k) for k in range(max(ls)))
        done += batch
    static = done / cost
    rows, cost, done = [row() for _ in range(batch)], 0.0, 0
    for _ in range(samples * max(lengths) // 2):
        cost += base * len(set(a for a, _ in rows)) + per_row * len(rows)
        for r in rows:
            r[1] -= 1
        for i, r in enumerate(rows):
            if r[1] == 0:
                rows[i] = row()
                done += 1
    return static, done / cost


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["simulated", "cpu"])
    ap.add_argument("--cost", default="0.005,0.0005", help="simulated: BASE,PER_ROW seconds per step")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--duration", type=float, default=12.0, help="seconds of arrivals per latency measurement")
    ap.add_argument("--burst", type=int, default=0, help="requests in the saturation burst (default 12 x batch)")
    ap.add_argument("--loads", default="0.5,0.8", help="offered loads, fractions of static saturation throughput")
    ap.add_argument("--lengths", default=None, help="max_tokens mix (default simulated 8,16,32,64; cpu 8,16,32)")
    ap.add_argument("--algorithms", default="basic,basic,basic,dual_cache")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    lengths = [int(x) for x in (args.lengths or ("8,16,32,64" if args.mode == "simulated" else "8,16,32")).split(",")]
    algorithms = args.algorithms.split(",")
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmpd:
        procs = Procs(Path(tmpd))
        try:
            urls = {}
            for mode in ("static", "continuous"):
                port = free_port()
                cmd = [sys.executable, "-m", "dllm_serve", "worker", "--model-path", str(ROOT / "tests/fixtures/tiny-llada"),
                       "--port", str(port), "--batch-size", str(args.batch_size), "--max-wait-time", "0",
                       "--max-queue", "100000", "--log-level", "warning", "--device", "cpu",
                       "--continuous-batching" if mode == "continuous" else "--no-continuous-batching"]
                if args.mode == "simulated":
                    cmd += ["--simulate-device", args.cost, "--simulate-per-step"]
                procs.start(cmd, f"worker-{mode}")
                urls[mode] = f"http://127.0.0.1:{port}"
            for u in urls.values():
                wait_http(u + "/health", check=lambda d: d.get("status") == "ready")
            what = (f"simulated device {args.cost} s per step (base, per row)" if args.mode == "simulated"
                    else "tests/fixtures/tiny-llada on the CPU")
            print(f"{what}; worker --batch-size {args.batch_size}; max_tokens from {lengths}, algorithms from "
                  f"{algorithms}, block 8, prompts of 4-23 tokens")
            # saturation: a burst far above capacity, all at t=0
            burst = args.burst or 12 * args.batch_size
            bodies = workload(burst, rng, lengths, algorithms)
            sat = {}
            for mode in ("static", "continuous"):
                asyncio.run(fire(urls[mode], bodies[:args.batch_size], [0.0] * args.batch_size))     # warm-up
                lat, span, errors = asyncio.run(fire(urls[mode], bodies, [0.0] * burst))
                tokens = sum(b["max_tokens"] for b in bodies)
                sat[mode] = burst / span
                print(f"saturation  {mode:<11} {burst} requests in {span:6.2f} s: {burst / span:7.2f} req/s, "
                      f"{tokens / span:8.1f} tokens/s, errors {errors}", flush=True)
            print(f"saturation throughput continuous / static: {sat['continuous'] / sat['static']:.2f}x")
            if args.mode == "simulated":
                base, per_row = (float(x) for x in args.cost.split(","))
                st, co = work_bound(lengths, algorithms, args.batch_size, base, per_row)
                print(f"work bound (ideal schedulers, no overhead): static {st:.2f} req/s, continuous {co:.2f} req/s, "
                      f"at most {co / st:.2f}x")
            print(f"{'load':>5} {'offered req/s':>13} {'mode':<11} {'p50 s':>7} {'p99 s':>7} {'errors':>6}")
            for k, load in enumerate(float(x) for x in args.loads.split(",")):
                rate = load * sat["static"]
                n = max(10, int(rate * args.duration))
                bodies = workload(n, rng, lengths, algorithms)
                t, arrivals = 0.0, []
                for _ in range(n):
                    t += rng.expovariate(rate)
                    arrivals.append(t)
                res = {}
                order = ("static", "continuous") if k % 2 == 0 else ("continuous", "static")
                for mode in order:
                    lat, span, errors = asyncio.run(fire(urls[mode], bodies, arrivals))
                    res[mode] = (pct(lat, 0.5), pct(lat, 0.99), errors)
                for mode in ("static", "continuous"):
                    p50, p99, errors = res[mode]
                    print(f"{load:>5.2f} {rate:>13.2f} {mode:<11} {p50:>7.3f} {p99:>7.3f} {errors:>6}", flush=True)
                print(f"{load:>5.2f} p99 continuous / static: {res['continuous'][1] / res['static'][1]:.2f}x; p50: "
                      f"{res['continuous'][0] / res['static'][0]:.2f}x")
            for mode, u in urls.items():
                import urllib.request
                st = json.loads(urllib.request.urlopen(u + "/batch/stats").read())
                print(f"{mode}: batches {st['batches_processed']}, rows {st['requests_processed']}, "
                      f"joined {st.get('rows_joined', 0)}")
        finally:
            procs.stop()


if __name__ == "__main__":
    main()
