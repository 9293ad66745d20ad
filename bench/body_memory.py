"""Balancer memory under concurrent large request bodies (issue 29, docs/reliability.md).

Starts a balancer (``dllm-serve balancer``, a subprocess, one HTTP process) over a fake worker in this process that
holds every batch for --hold seconds (so the balancer keeps the bodies it admitted), sends --bodies concurrent
completion requests of --mb MB each (a prompt of that many bytes of text, valid JSON), and one small request half a
second later; prints the statuses, the small request's latency, and the balancer's RSS before, at its peak (VmHWM)
and after.

    .venv/bin/python bench/body_memory.py --bodies 8 --mb 60
    .venv/bin/python bench/body_memory.py --bodies 8 --mb 60 --max-body-bytes-in-flight 0    # 0: no bound
    .venv/bin/python bench/body_memory.py --bodies 8 --mb 60 --repo /tmp/old                # another checkout
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from aiohttp import web

from _local import free_port

ROOT = Path(__file__).resolve().parent.parent


def fake_worker(port: int, hold: float) -> None:
    """A worker double on its own thread: /health ready; /worker/batch answers each request after ``hold`` s."""
    async def health(request):
        return web.json_response({"status": "ready", "busy": False, "seconds_since_last_step": 0.0})

    async def batch(request):
        items = json.loads(await request.read())["requests"]
        await asyncio.sleep(hold)
        lines = [json.dumps({"id": it["id"], "event": "response", "end": True, "data": {
            "id": "c", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}}) for it in items]
        return web.Response(text="\n".join(lines) + "\n", content_type="application/x-ndjson")

    app = web.Application(client_max_size=1 << 30)
    app.router.add_get("/health", health)
    app.router.add_post("/worker/batch", batch)
    threading.Thread(target=lambda: web.run_app(app, host="127.0.0.1", port=port, print=None,
                                                handle_signals=False), daemon=True).start()


def status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def post(port: int, body: bytes, out: list, timeout: float = 120) -> None:
    t0 = time.monotonic()
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        out.append((r.status, r.getheader("Retry-After"), time.monotonic() - t0))
        c.close()
    except OSError as e:
        out.append((type(e).__name__, None, time.monotonic() - t0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bodies", type=int, default=8)
    ap.add_argument("--mb", type=float, default=60.0, help="size of each body, in 10^6 bytes")
    ap.add_argument("--hold", type=float, default=3.0, help="seconds the fake worker holds each batch")
    ap.add_argument("--max-body-bytes-in-flight", type=int, default=None,
                    help="the balancer's setting (default: its default; 0: no bound, 2^50)")
    ap.add_argument("--repo", default=str(ROOT), help="checkout whose balancer runs (default: this one)")
    args = ap.parse_args()

    wport, bport = free_port(), free_port()
    fake_worker(wport, args.hold)
    cmd = [sys.executable, "-m", "dllm_serve", "balancer", "--worker-urls", f"http://127.0.0.1:{wport}",
           "--port", str(bport), "--log-level", "warning"]
    if args.max_body_bytes_in_flight is not None:
        cmd += ["--max-body-bytes-in-flight", str(args.max_body_bytes_in_flight or 1 << 50)]
    proc = subprocess.Popen(cmd, cwd=args.repo, env={**os.environ, "PYTHONPATH": args.repo})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                c = http.client.HTTPConnection("127.0.0.1", bport, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the balancer did not start")
            time.sleep(0.2)
        small = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
        warm: list = []
        post(bport, small, warm)
        rss0 = status_kb(proc.pid, "VmRSS")
        big = b'{"max_tokens": 1, "prompt": "' + b"x" * int(args.mb * 1e6) + b'"}'
        results: list = []
        threads = [threading.Thread(target=post, args=(bport, big, results)) for _ in range(args.bodies)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(0.5)
        small_result: list = []
        post(bport, small, small_result)
        for t in threads:
            t.join()
        took = time.monotonic() - t0
        peak = status_kb(proc.pid, "VmHWM")
        time.sleep(1)
        rss1 = status_kb(proc.pid, "VmRSS")
        statuses: dict = {}
        for st, retry, _ in results:
            key = f"{st}" + (f" (Retry-After {retry})" if retry else "")
            statuses[key] = statuses.get(key, 0) + 1
        print(f"{args.bodies} concurrent bodies of {args.mb:g} MB, budget "
              f"{args.max_body_bytes_in_flight if args.max_body_bytes_in_flight is not None else 'default'}, "
              f"repo {args.repo}: statuses {statuses} in {took:.1f} s; small request "
              f"{small_result[0][0]} in {small_result[0][2]:.2f} s; balancer RSS {rss0 / 1024:.0f} MB before, "
              f"peak {peak / 1024:.0f} MB, {rss1 / 1024:.0f} MB after")
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
