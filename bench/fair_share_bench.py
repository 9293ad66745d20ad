"""A small request beside long ones (issue 29): its latency on a worker whose batch is full of long rows, with the
fair share on (the default --long-row-cost) and off (--long-row-cost 0: rows taken first come, first served, every
algorithm group stepping once per round), in one run on the same machine.

    python bench/fair_share_bench.py --model-path tests/fixtures/tiny-llada --long 10 --small 3

``--scoring``: the long requests are likelihood-scoring requests instead (``--score-tokens`` prompt tokens, ``mc_num``
``--mc-num``), which take turns with generation rows; ``--tree`` runs another checkout's worker as well (e.g. a git
worktree of an older commit), in the same run:

    python bench/fair_share_bench.py --scoring --long 1 --small 3 --tree /tmp/before

Prints one line per setting: the small requests' latencies (seconds, each sent alone while the long ones run),
and with ``--scoring`` the slowest scoring request's (inf: past 120 s)."""
from __future__ import annotations

import argparse
import json
import os
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


def run(model: str, flags: list[str], n_long: int, n_small: int, long_body: dict, wait: float,
        tree: Path = ROOT, wait_long: bool = False) -> list[float]:
    """The small requests' latencies, then (``wait_long``) the slowest long request's."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    p = subprocess.Popen([sys.executable, "-m", "dllm_serve", "worker", "--model-path", model, "--port", str(port),
                          "--device", "cpu", "--batch-size", "8", "--request-timeout", "120", *flags], cwd=tree,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(tree)})
    try:
        wait_ready(url)
        pool = ThreadPoolExecutor(n_long)
        longs = [pool.submit(post, url + "/v1/completions", long_body, 120) for _ in range(n_long)]
        time.sleep(wait)
        out = [post(url + "/v1/completions", {"prompt": "di vo", "max_tokens": 8}, 60) for _ in range(n_small)]
        if wait_long:
            out.append(max(f.result() for f in longs))
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
    ap.add_argument("--scoring", action="store_true", help="the long requests score a prompt's likelihood instead")
    ap.add_argument("--score-tokens", type=int, default=200, help="--scoring: prompt tokens of a scoring request")
    ap.add_argument("--mc-num", type=int, default=4096, help="--scoring: its Monte Carlo copies")
    ap.add_argument("--tree", type=Path, action="append", default=[],
                    help="another checkout whose worker runs too, with the defaults (repeatable)")
    a = ap.parse_args()
    long_body = {"prompt": "a", "max_tokens": a.long_tokens, "block_length": 1}
    settings = [("fair share (defaults)", [], ROOT), ("off (--long-row-cost 0)", ["--long-row-cost", "0"], ROOT)]
    if a.scoring:
        long_body = {"prompt": [5 + i % 280 for i in range(a.score_tokens)], "echo": True, "logprobs": 0,
                     "max_tokens": 0, "mc_num": a.mc_num, "mc_batch_size": 64}
        settings = [("this tree", [], ROOT)]
    settings += [(str(t), [], t.resolve()) for t in a.tree]
    for name, flags, tree in settings:
        lat = run(a.model_path, flags, a.long, a.small, long_body, a.wait, tree, wait_long=a.scoring)
        print(f"{name:26s} small request latency: " + ", ".join(f"{x:.2f} s" for x in lat[:a.small])
              + (f"; scoring: {lat[-1]:.2f} s" if a.scoring else ""), flush=True)


if __name__ == "__main__":
    main()
