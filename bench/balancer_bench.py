"""Balancer benchmarks (not tests): prints numbers. Workers are real `dllm-serve worker` processes with a simulated
device (`--simulate-device BASE,PER_ROW`: no model, each batch sleeps BASE + PER_ROW x rows seconds).

  # (a) the balancer's own throughput and added latency with instant workers, side by side with nginx
  python bench/balancer_bench.py proxy --workers 2 --connections 256 --duration 10 --rounds 4
  # (a') the same, with a second tree's workers and balancer in the same run (a before/after comparison)
  git worktree add /tmp/before <commit>
  python bench/balancer_bench.py proxy --compare-tree /tmp/before --http-processes 1 --nginx-processes 1 --rounds 6
  # (a'') the same balancer run by another interpreter too (a venv with the dependencies except torch)
  python bench/balancer_bench.py proxy --http-processes 1 --nginx-processes 1 --balancer-python /tmp/py312/bin/python
  # (a''') the same beside a bare batching proxy (bench/bare_balancer.py: the batching alone, a bound)
  python bench/balancer_bench.py proxy --http-processes 1 --nginx-processes 1 --bare --rounds 5
  # (b) scaling over 1, 2, 4, 8 workers at saturation on a simulated device (40 ms + 3 ms x rows)
  python bench/balancer_bench.py scaling --counts 1,2,4,8 --cost 0.04,0.003 --batch-size 16
  # (c) the latency the balancer adds (its default settings): open-loop arrivals at fixed rates over 256
  #     connections, through the balancer, through nginx, and straight to the workers (round robin)
  python bench/balancer_bench.py latency --rates 200,1000,3000 --duration 10
  #     (--bare: also the bare batching proxy, the latency an aiohttp hop of this design adds at least)
  # (d) /stats answer times while the balancer is loaded (its one-minute window fills)
  python bench/balancer_bench.py stats --duration 30 --every 2 --compare-tree /tmp/before
  # (e) memory over a long mixed run (plain, streamed, n=2, malformed, clients leaving mid-stream)
  python bench/balancer_bench.py soak --duration 300 --every 15 --warmup 60

Each proxy round also reads the CPU time (user + system, from psutil) that the front process (balancer or nginx,
with its child processes) and the workers spent during the round, divided by the round's requests: on a shared
machine that is a steadier figure than req/s.

Load comes from wrk (Debian package `wrk`) when installed, else from an aiohttp client in this process.
nginx (Debian `nginx-light`) is a plain reverse proxy (least_conn, keepalive) over the workers' /v1/completions.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from _local import free_port

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "fixtures" / "tiny-llada"
BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 8}


def wait_http(url: str, timeout: float = 120, check=lambda d: True) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if check(json.loads(r.read())):
                    return
        except Exception:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


class Procs:
    def __init__(self, logdir: Path):
        self.procs: list[subprocess.Popen] = []
        self.logdir = logdir

    def start(self, args: list[str], name: str, cwd: Path = ROOT) -> subprocess.Popen:
        f = open(self.logdir / f"{name}.log", "wb")
        p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        self.procs.clear()


def cli_module(tree: Path) -> str:
    """The command line's module in ``tree`` (``common.cli`` before it moved to ``dllm_serve``)."""
    return "dllm_serve" if (tree / "dllm_serve").is_dir() else "common.cli"


def start_workers(procs: Procs, n: int, cost: str | None, batch_size: int, max_wait: float, tree: Path = ROOT,
                  tag: str = "") -> list[str]:
    urls = []
    for i in range(n):
        port = free_port()
        device = ["--simulate-device", cost] if cost is not None else ["--device", "cpu"]    # None: the real model
        procs.start([sys.executable, "-m", cli_module(tree), "worker", "--model-path", str(MODEL), "--port", str(port),
                     *device, "--batch-size", str(batch_size), "--max-wait-time", str(max_wait),
                     "--max-queue", "100000", "--log-level", "warning"], f"worker{tag}{i}", tree)
        urls.append(f"http://127.0.0.1:{port}")
    for u in urls:
        wait_http(u + "/health", check=lambda d: d.get("status") == "ready")
    return urls


def batching(batch_size: int, wait: float, inflight: int, http_processes: int = 1) -> list[str]:
    """The balancer settings the proxy and scaling benches set (the latency and stats benches keep its defaults)."""
    return ["--batch-size", str(batch_size), "--batch-wait-time", str(wait), "--max-queue", "100000",
            "--max-inflight-per-worker", str(inflight), "--http-processes", str(http_processes)]


def start_balancer(procs: Procs, urls: list[str], settings: list[str] = (), tree: Path = ROOT, tag: str = "",
                   python: str = sys.executable) -> str:
    """A balancer over ``urls`` with these command-line ``settings`` (none: its defaults), run by ``python`` from
    ``tree``; returns its URL once it sees every worker and its HTTP processes are ready."""
    port = free_port()
    procs.start([python, "-m", cli_module(tree), "balancer", "--worker-urls", ",".join(urls), "--port", str(port),
                 "--log-level", "warning", *settings], f"balancer{tag}-{len(procs.procs)}", tree)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", check=lambda d: d.get("healthy_workers") == len(urls))
    wait_http(url + "/stats", check=lambda d: all(p["status"] == "ready" for p in d["http_processes"]))
    return url


def start_bare(procs: Procs, urls: list[str], batch_size: int = 16, wait: float = 0.02, inflight: int = 2) -> str:
    """bench/bare_balancer.py over ``urls`` (the batching alone: a bound; its defaults are the balancer's)."""
    port = free_port()
    procs.start([sys.executable, str(ROOT / "bench" / "bare_balancer.py"), "--worker-urls", ",".join(urls),
                 "--port", str(port), "--batch-size", str(batch_size), "--batch-wait-time", str(wait),
                 "--max-inflight-per-worker", str(inflight)], "bare")
    wait_http(f"http://127.0.0.1:{port}/health")
    return f"http://127.0.0.1:{port}"


def start_nginx(procs: Procs, urls: list[str], tmp: Path, processes: int = 1) -> str:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        raise SystemExit("nginx is not installed (apt-get install nginx-light)")
    port = free_port()
    servers = "\n".join(f"server {u.removeprefix('http://')};" for u in urls)
    tmp = tmp / f"nginx-{processes}"
    tmp.mkdir()
    conf = tmp / "nginx.conf"
    conf.write_text(f"""
worker_processes {processes};
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fcgi; uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
  upstream workers {{ least_conn; {servers} keepalive 512; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{ proxy_pass http://workers; proxy_http_version 1.1; proxy_set_header Connection "";
                 proxy_buffering off; proxy_read_timeout 600s; }}
  }}
}}
""")
    procs.start([nginx, "-c", str(conf), "-p", str(tmp), "-g", "daemon off;"], f"nginx-{processes}")
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health")
    return url


def load_wrk(url: str, connections: int, duration: float, tmp: Path, body: dict = BODY) -> dict:
    script = tmp / "post.lua"
    script.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                      f"wrk.body = '{json.dumps(body)}'\n"
                      "done = function(summary, latency, requests)\n"
                      "  io.write(string.format('JSON {\"requests\": %d, \"errors\": %d, \"p50\": %f, \"p99\": %f}\\n',"
                      " summary.requests, summary.errors.status + summary.errors.connect + summary.errors.read"
                      " + summary.errors.write + summary.errors.timeout,"
                      " latency:percentile(50) / 1e6, latency:percentile(99) / 1e6))\nend\n")
    out = subprocess.run(["wrk", f"-t{min(2, connections)}", f"-c{connections}", f"-d{max(1, round(duration))}s", "--timeout", "60s", "-s", str(script),
                          url + "/v1/completions"], capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    stats = json.loads(out[out.index("JSON ") + 5:].splitlines()[0])
    return {"rps": rps, "errors": stats["errors"], "p50_ms": stats["p50"] * 1e3, "p99_ms": stats["p99"] * 1e3}


def load_python(url: str, connections: int, duration: float, body: dict = BODY) -> dict:
    import aiohttp

    async def main():
        lat, errors = [], 0
        stop = time.monotonic() + duration
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            async def client():
                nonlocal errors
                while time.monotonic() < stop:
                    t = time.perf_counter()
                    async with s.post(url + "/v1/completions", json=body) as r:
                        await r.read()
                        if r.status != 200:
                            errors += 1
                    lat.append(time.perf_counter() - t)
            t0 = time.monotonic()
            await asyncio.gather(*[client() for _ in range(connections)])
            wall = time.monotonic() - t0
        lat.sort()
        return {"rps": len(lat) / wall, "errors": errors, "p50_ms": lat[len(lat) // 2] * 1e3,
                "p99_ms": lat[int(len(lat) * 0.99)] * 1e3}
    return asyncio.run(main())


def load(url: str, connections: int, duration: float, tmp: Path) -> dict:
    if shutil.which("wrk"):
        load_wrk(url, connections, min(2.0, duration), tmp)      # warm-up
        return load_wrk(url, connections, duration, tmp)
    load_python(url, connections, min(2.0, duration))
    return load_python(url, connections, duration)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes and their children so far."""
    import psutil
    total = 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            for q in [proc] + proc.children(recursive=True):
                t = q.cpu_times()
                total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def proxy_bench(args) -> None:
    nginx_counts = [int(c) for c in args.nginx_processes.split(",")]
    http_counts = [int(c) for c in args.http_processes.split(",")]
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        procs = Procs(tmp)
        try:
            def pid() -> int:
                return procs.procs[-1].pid
            urls = start_workers(procs, args.workers, "0", args.worker_batch_size, args.worker_wait)
            wpids = [p.pid for p in procs.procs]
            rows = []   # (name, url, front pids, worker pids)
            for n in nginx_counts:
                url = start_nginx(procs, urls, tmp, n)
                rows.append((f"nginx, {n} process{'es' if n > 1 else ''}", url, [pid()], wpids))
            for n in http_counts:
                url = start_balancer(procs, urls, batching(args.batch_size, args.batch_wait, args.inflight, n))
                rows.append((f"balancer, --http-processes {n}", url, [pid()], wpids))
            for a in args.also:
                url = start_balancer(procs, urls, batching(args.batch_size, args.batch_wait, args.inflight)
                                     + shlex.split(a))
                rows.append((f"balancer {a}", url, [pid()], wpids))
            if args.bare:
                rows.append(("bare batching proxy (bound)", start_bare(procs, urls, args.batch_size, args.batch_wait,
                                                                       args.inflight), [pid()], wpids))
            for py in args.balancer_python:
                version = subprocess.run([py, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                         capture_output=True, text=True, check=True).stdout.strip()
                url = start_balancer(procs, urls, batching(args.batch_size, args.batch_wait, args.inflight),
                                     python=py)
                rows.append((f"balancer, Python {version}", url, [pid()], wpids))
            if args.compare_tree:
                tree = Path(args.compare_tree).resolve()
                first = len(procs.procs)
                other = start_workers(procs, args.workers, "0", args.worker_batch_size, args.worker_wait, tree, "-b")
                opids = [p.pid for p in procs.procs[first:]]
                for n in http_counts:
                    url = start_balancer(procs, other, batching(args.batch_size, args.batch_wait, args.inflight, n),
                                         tree, "-b")
                    rows.append((f"{tree.name}: balancer, -h-p {n}", url, [pid()], opids))
            print(f"{args.workers} instant workers (--simulate-device 0, worker batch {args.worker_batch_size}, "
                  f"wait {args.worker_wait}); balancer batch {args.batch_size}, wait {args.batch_wait}, in-flight/"
                  f"worker {args.inflight}; {args.connections} connections, {args.duration:g} s each; "
                  f"load: {'wrk' if shutil.which('wrk') else 'python aiohttp'}; {args.rounds} interleaved rounds "
                  f"(the order rotates, so drift on a shared machine hits every target)")
            print(f"{'round':<6} {'target':<30} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7} "
                  f"{'front us/req':>13} {'workers us/req':>15}")
            r = load(urls[0], args.connections, args.duration, tmp)
            print(f"{'-':<6} {'worker 0 direct':<30} {r['rps']:>9.0f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} "
                  f"{r['errors']:>7}", flush=True)
            rps = {row[0]: [] for row in rows}
            cpu = {row[0]: [] for row in rows}
            for i in range(args.rounds):
                k = i % len(rows)
                for name, url, fpids, wp in rows[k:] + rows[:k]:
                    if shutil.which("wrk"):
                        load_wrk(url, args.connections, min(2.0, args.duration), tmp)      # warm-up
                    f0, w0 = cpu_seconds(fpids), cpu_seconds(wp)
                    r = load_wrk(url, args.connections, args.duration, tmp) if shutil.which("wrk") else load(
                        url, args.connections, args.duration, tmp)
                    n_req = max(1.0, r["rps"] * args.duration)
                    fu, wu = (cpu_seconds(fpids) - f0) / n_req * 1e6, (cpu_seconds(wp) - w0) / n_req * 1e6
                    rps[name].append(r["rps"])
                    cpu[name].append(fu)
                    print(f"{i + 1:<6} {name:<30} {r['rps']:>9.0f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} "
                          f"{r['errors']:>7} {fu:>13.0f} {wu:>15.0f}", flush=True)
            print("median req/s: " + ", ".join(f"{name} {statistics.median(v):.0f}" for name, v in rps.items()))
            print("median front CPU us/request: " + ", ".join(f"{name} {statistics.median(v):.0f}"
                                                             for name, v in cpu.items()))
            for b in rows[len(nginx_counts):]:      # every balancer against every nginx
                for n in rows[:len(nginx_counts)]:
                    ratios = [x / y for x, y in zip(rps[b[0]], rps[n[0]])]
                    print(f"{b[0]} / {n[0]} per round: {', '.join(f'{x:.2f}' for x in ratios)} "
                          f"(median {statistics.median(ratios):.2f})")
        finally:
            procs.stop()


def open_loop(urls: list[str], rate: float, duration: float, connections: int, seed: int) -> dict:
    """Poisson arrivals at ``rate`` requests/s for ``duration`` s over at most ``connections`` connections, each
    request to the next of ``urls`` in turn; latency from each request's scheduled start (so a late client does not
    hide queueing)."""
    import random
    import aiohttp

    async def main():
        rng = random.Random(seed)
        lat, errors = [], 0
        sem = asyncio.Semaphore(connections)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections)) as s:
            async def one(url, t_sched):
                nonlocal errors
                async with sem:
                    async with s.post(url + "/v1/completions", json=BODY) as r:
                        await r.read()
                        errors += r.status != 200
                lat.append(time.perf_counter() - t_sched)
            tasks, t0, t, i = [], time.perf_counter(), 0.0, 0
            while t < duration:
                t += rng.expovariate(rate)
                delay = t0 + t - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(urls[i % len(urls)], t0 + t)))
                i += 1
            await asyncio.gather(*tasks)
        lat.sort()
        return {"n": len(lat), "errors": errors, "p50_ms": lat[len(lat) // 2] * 1e3,
                "p99_ms": lat[int(len(lat) * 0.99)] * 1e3}
    return asyncio.run(main())


def latency_bench(args) -> None:
    rates = [float(r) for r in args.rates.split(",")]
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        procs = Procs(tmp)
        try:
            urls = start_workers(procs, args.workers, "0", 32, 0.0)     # the workers `serve` starts: 2x batch, no wait
            targets = [("workers direct", urls)]
            for name, extra in [("balancer (defaults)", [])] + [(f"balancer {a}", shlex.split(a)) for a in args.also]:
                targets.append((name, [start_balancer(procs, urls, extra)]))
            if args.bare:
                targets.append(("bare batching proxy (bound)", [start_bare(procs, urls)]))
            if shutil.which("nginx") or Path("/usr/sbin/nginx").exists():
                targets.append(("nginx, 1 process", [start_nginx(procs, urls, tmp, 1)]))
            print(f"{args.workers} instant workers (--simulate-device 0, batch 32, no wait); balancer with its default "
                  f"settings; open-loop Poisson arrivals, {args.connections} connections at most, {args.duration:g} s "
                  f"per point; load: python aiohttp in this process")
            print(f"{'rate/s':>7} {'target':<32} {'n':>6} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7} "
                  f"{'added p50':>10} {'added p99':>10}")
            for rate in rates:
                base = None
                for k, (name, us) in enumerate(targets):
                    open_loop(us, rate, min(2.0, args.duration), args.connections, 0)      # warm-up
                    r = open_loop(us, rate, args.duration, args.connections, k + 1)
                    base = base or r
                    print(f"{rate:>7.0f} {name:<32} {r['n']:>6} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
                          f"{r['errors']:>7} {r['p50_ms'] - base['p50_ms']:>+10.2f} "
                          f"{r['p99_ms'] - base['p99_ms']:>+10.2f}", flush=True)
        finally:
            procs.stop()


def scaling_bench(args) -> None:
    counts = [int(c) for c in args.counts.split(",")]
    base = None
    print(f"simulated device {args.cost} (s base, s per row); balancer batch {args.batch_size}, wait "
          f"{args.batch_wait}, in-flight/worker {args.inflight}; {args.per_worker_connections} connections per "
          f"worker, {args.duration:g} s; load: {'wrk' if shutil.which('wrk') else 'python aiohttp'}")
    print(f"{'workers':>7} {'req/s':>9} {'speedup':>8} {'p50 ms':>8} {'p99 ms':>8} {'avg batch':>9} {'errors':>7}")
    for n in counts:
        with tempfile.TemporaryDirectory() as tmpd:
            tmp = Path(tmpd)
            procs = Procs(tmp)
            try:
                urls = start_workers(procs, n, args.cost, args.batch_size * args.inflight, 0.0)
                bal = start_balancer(procs, urls, batching(args.batch_size, args.batch_wait, args.inflight))
                r = load(bal, args.per_worker_connections * n, args.duration, tmp)
                with urllib.request.urlopen(bal + "/stats") as s:
                    avg = json.loads(s.read())["centralized_batching"]["avg_batch_size"]
                base = base or r["rps"]
                print(f"{n:>7} {r['rps']:>9.1f} {r['rps'] / base:>7.2f}x {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} "
                      f"{avg:>9.1f} {r['errors']:>7}", flush=True)
            finally:
                procs.stop()


def stats_bench(args) -> None:
    """/stats read every ``--every`` s while wrk keeps the balancer busy: its answer times and the load's latency
    (the balancer's one-minute window must not cost more as it fills)."""
    import threading
    trees = [("this tree", ROOT)] + ([("compare", Path(args.compare_tree).resolve())] if args.compare_tree else [])
    print(f"2 instant workers, the balancer with its default settings; wrk {args.connections} connections for "
          f"{args.duration:g} s, /stats read every {args.every:g} s")
    for name, tree in trees:
        with tempfile.TemporaryDirectory() as tmpd:
            tmp = Path(tmpd)
            procs = Procs(tmp)
            try:
                urls = start_workers(procs, 2, "0", 32, 0.0, tree)
                bal = start_balancer(procs, urls, tree=tree)
                res: dict = {}
                load_thread = threading.Thread(target=lambda: res.update(
                    load_wrk(bal, args.connections, args.duration, tmp) if shutil.which("wrk")
                    else load_python(bal, args.connections, args.duration)))
                load_thread.start()
                times, window, t_end = [], None, time.monotonic() + args.duration - args.every
                while time.monotonic() < t_end:
                    time.sleep(args.every)
                    t = time.perf_counter()
                    with urllib.request.urlopen(bal + "/stats") as r:
                        window = json.loads(r.read())["last_minute"]["requests"]
                    times.append(f"{(time.perf_counter() - t) * 1e3:.1f}")
                load_thread.join()
                print(f"{name}: {res['rps']:.0f} req/s, p99 {res['p99_ms']:.1f} ms; window {window} requests; "
                      f"/stats ms: {', '.join(times)}", flush=True)
            finally:
                procs.stop()


SOAK_MIX = [   # (share, what): the soak's requests, drawn in turn by weight
    (50, "plain"), (20, "stream"), (10, "n2"), (10, "bad"), (10, "gone")]     # gone: the client leaves 2 ms in


def soak_bench(args) -> None:
    """Memory over a long run: a mix of requests (plain, streamed, n=2, malformed, clients that leave 2 ms in)
    from ``--connections`` clients for ``--duration`` s through a balancer with its defaults over 2 simulated
    workers (5 ms a batch); the balancer's and the workers' resident memory every ``--every`` s, and its growth per 10,000
    requests after the first ``--warmup`` s (a leak grows with the requests; caches and pools level off).
    ``--real-workers``: the workers run the tiny model on the CPU."""
    import aiohttp
    import psutil
    bodies = {"plain": BODY, "stream": {**BODY, "stream": True}, "n2": {**BODY, "n": 2},
              "bad": {"prompt": [5, 6], "max_tokens": -1}, "gone": {**BODY, "stream": True, "max_tokens": 64}}
    order = [what for share, what in SOAK_MIX for _ in range(share)]
    with tempfile.TemporaryDirectory() as tmpd:
        procs = Procs(Path(tmpd))
        try:
            # simulated workers: 5 ms a batch, so a client can leave while its request is in flight
            urls = start_workers(procs, 2, None if args.real_workers else "0.005", 32, 0.0)
            bal = start_balancer(procs, urls)
            watched = {"balancer": psutil.Process(procs.procs[-1].pid)}
            watched.update({f"worker{i}": psutil.Process(p.pid) for i, p in enumerate(procs.procs[:2])})
            counts = {"sent": 0, "status": {}}

            async def run():
                stop = time.monotonic() + args.duration
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                    async def client(k: int):
                        i = k
                        while time.monotonic() < stop:
                            what = order[i % len(order)]
                            i += 7
                            try:
                                async with asyncio.timeout(0.002 if what == "gone" else None):   # "gone": leave
                                    async with s.post(bal + "/v1/completions", json=bodies[what]) as r:  # midway
                                        await r.read()
                                        counts["status"][r.status] = counts["status"].get(r.status, 0) + 1
                            except TimeoutError:
                                counts["status"]["left"] = counts["status"].get("left", 0) + 1
                            except aiohttp.ClientError as e:
                                counts["status"][type(e).__name__] = counts["status"].get(type(e).__name__, 0) + 1
                            counts["sent"] += 1

                    async def sample():
                        t0 = time.monotonic()
                        while time.monotonic() < stop:
                            rss = {n: q.memory_info().rss / 2**20 for n, q in watched.items()}
                            rows.append((time.monotonic() - t0, counts["sent"], rss))
                            print(f"{rows[-1][0]:7.0f} s {counts['sent']:9d} requests  "
                                  + "  ".join(f"{n} {v:7.1f} MiB" for n, v in rss.items()), flush=True)
                            await asyncio.sleep(args.every)
                    await asyncio.gather(sample(), *(client(k) for k in range(args.connections)))
                rss = {n: q.memory_info().rss / 2**20 for n, q in watched.items()}
                rows.append((args.duration, counts["sent"], rss))
                print(f"{args.duration:7.0f} s {counts['sent']:9d} requests  "
                      + "  ".join(f"{n} {v:7.1f} MiB" for n, v in rss.items()) + "  (the end)", flush=True)
            rows: list = []
            print(f"soak: {args.connections} clients for {args.duration:g} s, "
                  f"{'tiny-llada on the CPU' if args.real_workers else 'simulated (5 ms a batch)'} workers, mix "
                  + ", ".join(f"{w} {p}%" for p, w in SOAK_MIX) + "; resident memory:", flush=True)
            asyncio.run(run())
            after = [r for r in rows if r[0] >= args.warmup]
            with urllib.request.urlopen(bal + "/metrics") as r:
                left = sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                           if line.startswith("dllm_balancer_requests_total{") and 'status="499"' in line)
            print(f"statuses seen by the clients: {counts['status']}; the balancer's 499s (clients that left): "
                  f"{left:.0f}")
            if len(after) >= 2:
                (_, n0, m0), (_, n1, m1) = after[0], after[-1]
                print(f"growth after {args.warmup:g} s, per 10,000 requests ({n1 - n0} requests): "
                      + ", ".join(f"{n} {(m1[n] - m0[n]) / max(1, n1 - n0) * 1e4:+.2f} MiB" for n in m0))
        finally:
            procs.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("proxy")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--connections", type=int, default=256)
    p.add_argument("--duration", type=float, default=10)
    p.add_argument("--rounds", type=int, default=3)
    # the defaults are `dllm-serve serve`'s: the balancer's own, workers at twice its batch size with no wait
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--batch-wait", type=float, default=0.02)
    p.add_argument("--inflight", type=int, default=2)
    p.add_argument("--worker-batch-size", type=int, default=32)
    p.add_argument("--worker-wait", type=float, default=0.0)
    p.add_argument("--http-processes", default="1,2", help="balancer --http-processes values to compare")
    p.add_argument("--nginx-processes", default="1,2", help="nginx worker_processes values to compare")
    p.add_argument("--also", action="append", default=[], metavar="ARGS",
                   help="another balancer (one HTTP process) with these options added (e.g. --also=--no-idle-dispatch)")
    p.add_argument("--compare-tree", help="another checkout of this project (e.g. a git worktree of an older commit): "
                   "its own workers and balancer join the same interleaved rounds")
    p.add_argument("--bare", action="store_true", help="also bench/bare_balancer.py: a batching proxy with nothing "
                   "but the batching (no validation, statistics, timeouts or failover), the most one aiohttp process "
                   "of this design could reach")
    p.add_argument("--balancer-python", action="append", default=[], metavar="PYTHON",
                   help="another balancer (one HTTP process) run by this interpreter, e.g. a venv of Python 3.12 with "
                        "the project's dependencies except torch (the balancer never imports it)")
    s = sub.add_parser("scaling")
    s.add_argument("--counts", default="1,2,4,8")
    s.add_argument("--cost", default="0.04,0.003")
    s.add_argument("--batch-size", type=int, default=16)
    s.add_argument("--batch-wait", type=float, default=0.02)
    s.add_argument("--inflight", type=int, default=2)
    s.add_argument("--per-worker-connections", type=int, default=64)
    s.add_argument("--duration", type=float, default=15)
    lt = sub.add_parser("latency")
    lt.add_argument("--workers", type=int, default=2)
    lt.add_argument("--rates", default="200,1000,3000", help="offered requests/s, one point each")
    lt.add_argument("--connections", type=int, default=256)
    lt.add_argument("--duration", type=float, default=10)
    lt.add_argument("--also", action="append", default=[], metavar="ARGS",
                    help="another balancer with these options beside the default one (e.g. --also=--no-idle-dispatch)")
    lt.add_argument("--bare", action="store_true", help="also bench/bare_balancer.py with the balancer's default "
                    "batching: the latency one aiohttp hop of this design adds with nothing else (a bound)")
    st = sub.add_parser("stats")
    st.add_argument("--connections", type=int, default=256)
    st.add_argument("--duration", type=float, default=30)
    st.add_argument("--every", type=float, default=2.0)
    st.add_argument("--compare-tree", help="another checkout of this project, run after this one")
    sk = sub.add_parser("soak")
    sk.add_argument("--connections", type=int, default=64)
    sk.add_argument("--duration", type=float, default=300)
    sk.add_argument("--every", type=float, default=15.0)
    sk.add_argument("--warmup", type=float, default=60.0, help="seconds before the growth is counted")
    sk.add_argument("--real-workers", action="store_true", help="workers run the tiny model on the CPU (real "
                    "forwards, the engine's caches) instead of an instant simulated device")
    args = ap.parse_args()
    {"proxy": proxy_bench, "scaling": scaling_bench, "latency": latency_bench, "stats": stats_bench,
     "soak": soak_bench}[args.mode](args)


if __name__ == "__main__":
    main()
