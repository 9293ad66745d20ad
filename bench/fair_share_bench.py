"""A small request beside long ones (issue 29): its latency on a worker whose batch is full of long rows, with the
fair share on (the default --long-row-cost) and off (--long-row-cost 0: rows taken first come, first served, every
algorithm group stepping once per round), in one run on the same machine.

    python bench/fair_share_bench.py --model-path tests/fixtures/tiny-llada --long 10 --small 3

Prints one line per setting: the small requests' latencies (seconds, each sent alone while the long ones run)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _local import free_port, wait_ready

ROOT = Path(__file__).resolve().parent.parent


def post(url: str, body: dict, timeout: float) -> float:
    t0 = time.monotonic()
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
    except OSError:
        return float("inf")
    return time.monotonic() - t0


def run(model: str, flags: list[str], n_long: int, n_small: int, long_body: dict, wait: float) -> list[float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    p = subprocess.Popen([sys.executable, "-m", "dllm_serve", "worker", "--model-path", model, "--port", str(port),
                          "--device", "cpu", "--batch-size", "8", "--request-timeout", "120", *flags], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url)
        pool = ThreadPoolExecutor(n_long)
        for _ in range(n_long):
            pool.submit(post, url + "/v1/completions", long_body, 120)
        time.sleep(wait)
        out = [post(url + "/v1/completions", {"prompt": "di vo", "max_tokens": 8}, 60) for _ in range(n_small)]
        pool.shutdown(wait=False, cancel_futures=True)
        return out
    finally:
        p.kill()
        p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=str(ROOT / "tests" / "fixtures" / "tiny-llada"))
    ap.add_argument("--long", type=int, default=10, help="long requests running")
    ap.add_argument("--small", type=int, default=3, help="small requests, one after the other")
    ap.add_argument("--long-tokens", type=int, default=4000, help="max_tokens of a long request (block_length 1)")
    ap.add_argument("--wait", type=float, default=3.0, help="seconds between the long requests and the first small")
    a = ap.parse_args()
    long_body = {"prompt": "a", "max_tokens": a.long_tokens, "block_length": 1}
    for name, flags in (("fair share (defaults)", []), ("off (--long-row-cost 0)", ["--long-row-cost", "0"])):
        lat = run(a.model_path, flags, a.long, a.small, long_body, a.wait)
        print(f"{name:26s} small request latency: " + ", ".join(f"{x:.2f} s" for x in lat), flush=True)


if __name__ == "__main__":
    main()
