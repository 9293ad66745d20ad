"""A worker serving on a GPU with its default settings (CUDA graphs on) against the same worker with
``--no-cuda-graphs``: the same tokens? Not a test (the suite has no GPU); it prints what it finds and exits 1 on a
difference.

  python bench/gpu_serve_check.py                                  # the tiny LLaDA fixture, bfloat16
  python bench/gpu_serve_check.py --model-path tests/fixtures/tiny-dream --algorithms dream,dream_cache

Each worker gets the same requests one at a time (a batch of one, so batching cannot change a bfloat16 token), of
every algorithm given, mixed prompt lengths, with and without a threshold; then, on the graphed worker, all of them
at once from as many client threads (rows joining a running batch; answered, not compared: bfloat16 rows batched
differently may differ). /health's ``cuda_graphs`` counters are printed. Needs the server's dependencies (orjson,
pydantic, aiohttp, uvloop) where it runs.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def post(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=timeout).read())


def get(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url, timeout=10).read())


def worker(model: str, port: int, extra: list[str], log: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "dllm_serve.cli", "worker", "--model-path", model, "--port",
                          str(port), *extra], cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if get(f"http://127.0.0.1:{port}/health").get("status") == "ready":
                return p
        except OSError:
            pass
        if p.poll() is not None:
            break
        time.sleep(0.5)
    p.kill()
    raise SystemExit(f"the worker did not start: {log.read_text()[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=str(ROOT / "tests/fixtures/tiny-llada"))
    ap.add_argument("--algorithms", default="basic,dual_cache,prefix_cache,dinfer_blockwise,dinfer_credit")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--log-dir", default="/tmp")
    args = ap.parse_args()
    algs = args.algorithms.split(",")
    bodies = [{"prompt": [3 + i, 7, 9, 11 + i, 13, 17, 19][: 2 + i % 6], "max_tokens": 24, "seed": i,
               "generation_algorithm": algs[i % len(algs)], "block_length": 8, "steps": 24,
               "return_token_ids": True, **({"threshold": 0.9} if i % 2 else {})} for i in range(args.requests)]
    runs = {}
    for name, extra in (("graphs", []), ("eager", ["--no-cuda-graphs"])):
        log = Path(args.log_dir) / f"gpu-serve-check-{name}.log"
        p = worker(args.model_path, args.port, ["--dtype", args.dtype, *extra], log)
        url = f"http://127.0.0.1:{args.port}"
        try:
            t = time.perf_counter()
            runs[name] = [post(url + "/v1/completions", b)["choices"][0]["token_ids"] for b in bodies]
            secs = time.perf_counter() - t
            health = get(url + "/health")
            print(f"{name}: {len(bodies)} requests one at a time in {secs:.2f} s on {health.get('device')}; "
                  f"cuda_graphs {health.get('cuda_graphs')}", flush=True)
            if name == "graphs":
                out: list = [None] * len(bodies)

                def go(i: int) -> None:
                    try:
                        out[i] = post(url + "/v1/completions", bodies[i])["choices"][0]["token_ids"]
                    except Exception as e:         # noqa: BLE001
                        out[i] = e
                threads = [threading.Thread(target=go, args=(i,)) for i in range(len(bodies))]
                t = time.perf_counter()
                [th.start() for th in threads]
                [th.join() for th in threads]
                bad = [i for i, o in enumerate(out) if not isinstance(o, list)]
                print(f"graphs, all at once: {len(bodies) - len(bad)}/{len(bodies)} answered in "
                      f"{time.perf_counter() - t:.2f} s ({sum(o == r for o, r in zip(out, runs[name]))} as one at "
                      f"a time); errors {[out[i] for i in bad][:3]}; cuda_graphs {get(url + '/health')['cuda_graphs']}",
                      flush=True)
        finally:
            p.terminate()
            p.wait(30)
    same = sum(a == b for a, b in zip(runs["graphs"], runs["eager"]))
    print(f"graphed worker == eager worker, one at a time: {same}/{len(bodies)} requests")
    sys.exit(0 if same == len(bodies) else 1)


if __name__ == "__main__":
    main()
