"""A worker's memory while one heavy likelihood request runs (issue 29, item 1): the audit's request (a 300-token
prompt, mc_num 4096, mc_batch_size 4096 by default) with --max-request-cost 0 so that it is admitted; its client
leaves after --leave seconds; then an 8-token request is sent. Prints the worker's RSS at start, its peak while the
request ran, and how long the small request took.

    python bench/scoring_memory_bench.py                          # this checkout
    python bench/scoring_memory_bench.py --tree /tmp/before       # another checkout (e.g. a git worktree of an old
                                                                  # commit; its worker runs without the limit flag)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil

from _local import free_port, wait_ready

ROOT = Path(__file__).resolve().parent.parent


def post(url: str, body: dict, timeout: float) -> None:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()


def leave_after(url: str, body: dict, seconds: float) -> None:
    """Send ``body`` and give up (close the connection: the client leaves) after ``seconds``."""
    try:
        post(url, body, seconds)
    except OSError:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", default=str(ROOT), help="the checkout whose worker runs")
    ap.add_argument("--model-path", default=str(ROOT / "tests" / "fixtures" / "tiny-llada"))
    ap.add_argument("--leave", type=float, default=25.0, help="seconds before the heavy request's client leaves")
    ap.add_argument("--mc-num", type=int, default=4096)
    ap.add_argument("--mc-batch-size", type=int, default=4096)
    a = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    extra = ["--max-request-cost", "0"] if Path(a.tree).resolve() == ROOT else []
    p = subprocess.Popen([sys.executable, "-m", "dllm_serve", "worker", "--model-path", a.model_path, "--port",
                          str(port), "--device", "cpu", *extra], cwd=a.tree, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": a.tree})
    try:
        wait_ready(url)
        proc = psutil.Process(p.pid)
        start = peak = proc.memory_info().rss
        heavy = {"prompt": [5 + i % 280 for i in range(300)], "echo": True, "logprobs": 1, "max_tokens": 0,
                 "mc_num": a.mc_num, "mc_batch_size": a.mc_batch_size}
        threading.Thread(target=leave_after, args=(url + "/v1/completions", heavy, a.leave), daemon=True).start()
        t0 = time.monotonic()
        while time.monotonic() - t0 < a.leave:
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.2)
        t1 = time.monotonic()
        post(url + "/v1/completions", {"prompt": "di vo", "max_tokens": 8}, 120)
        small = time.monotonic() - t1
        print(f"{a.tree}: RSS {start / 2**20:.0f} MiB at start, peak {peak / 2**20:.0f} MiB in {a.leave:g} s; the "
              f"client left; an 8-token request then took {small:.1f} s")
    finally:
        p.kill()
        p.wait()


if __name__ == "__main__":
    main()
