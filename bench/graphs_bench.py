"""CUDA graphs (worker/engine/graphs.py, `--cuda-graphs`) against the eager forward, on a GPU. Not a test: it
prints numbers.

For each model (the dense families' tiny fixtures by default, or a random LLaDA-layout model of --shape) and each
algorithm that decodes it: one batch of requests with mixed prompt lengths and settings, decoded eagerly, then with
the forward replayed from graphs installed on the same engine (the same weights). Prints whether every row's
canvas and nfe are identical, the wall time of each (after one untimed run of each, which also captures the
graphs) and the graphs' counters.

  python bench/graphs_bench.py --device cuda
  python bench/graphs_bench.py --device cuda --shape llada-8b --algorithms basic,dual_cache --batch 1 \
      --gen-length 64 --block-length 32
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

FIXTURES = ("tiny-llada", "tiny-dream", "tiny-sdar", "tiny-nemotron")


def fixture(name: str) -> Path:
    for base in (ROOT.parent / "shared" / "fixtures", ROOT / "tests" / "fixtures"):
        if (base / name).is_dir():
            return base / name
    raise SystemExit(f"no fixture {name}")


def requests(engine, alg: str, batch: int, gen: int, block: int | None):
    from worker.engine import GenerationParams, Request
    from worker.engine.params import ParamError
    block = block or engine.default_block_length or 8
    special = set(engine.stop_ids) | {engine.mask_id}
    vocab = engine.model.cfg.vocab_size if hasattr(engine.model.cfg, "vocab_size") else 256
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(batch):
        n = 5 + 4 * i
        ids = [t if t not in special else 1 for t in torch.randint(3, min(vocab, 290), (n,), generator=g).tolist()]
        tries = [dict(steps=gen, threshold=0.9), dict(steps=gen), dict()] if i % 2 else [dict(steps=gen), dict()]
        for kw in tries:
            p = GenerationParams(gen_length=gen, block_length=block, algorithm=alg, seed=i, **kw)
            try:
                engine.plan(ids, p)
                break
            except ParamError:
                continue
        out.append(Request(ids, p))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--shape", help="a random LLaDA-layout model of engine_bench's shapes instead of the fixtures")
    ap.add_argument("--algorithms", help="comma-separated (default: every algorithm of the family)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--gen-length", type=int, default=32)
    ap.add_argument("--block-length", type=int, help="default: the checkpoint's block size, else 8")
    args = ap.parse_args()
    from worker.engine import Engine
    from worker.engine.graphs import install
    from worker.models import FAMILIES
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timed(engine, reqs):
        engine.generate(reqs, early_exit=False)
        sync()
        t = time.perf_counter()
        res = engine.generate(reqs, early_exit=False)
        sync()
        return time.perf_counter() - t, [(r.canvas, r.nfe) for r in res]

    models = [args.shape] if args.shape else list(FIXTURES)
    print(f"{dtype} on {device}; batch {args.batch}, gen {args.gen_length}")
    print(f"{'model':<16} {'algorithm':<18} {'eager s':>8} {'graphs s':>9} {'ratio':>6} {'tokens':>10}  graphs")
    for name in models:
        if args.shape:
            from engine_bench import random_engine
            engine = random_engine(name, device, dtype)
        else:
            engine = Engine.from_pretrained(fixture(name), device=device, dtype=dtype)
        algs = args.algorithms.split(",") if args.algorithms else FAMILIES[engine.family].algorithms
        eager_forward = engine.model.forward
        for alg in algs:
            reqs = requests(engine, alg, args.batch, args.gen_length, args.block_length)
            engine.model.forward = eager_forward
            t_eager, eager = timed(engine, reqs)
            graphs = install(engine.model, backend=None if device.type == "cuda" else _no_cuda())
            if graphs is None:
                print(f"{name:<16} {alg:<18} graphs do not apply")
                break
            t_graph, replayed = timed(engine, reqs)
            same = "identical" if eager == replayed else "DIFFER"
            print(f"{name:<16} {alg:<18} {t_eager:>8.3f} {t_graph:>9.3f} {t_eager / t_graph:>6.2f} {same:>10}  "
                  f"{graphs.report()}", flush=True)
        engine.model.forward = eager_forward
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _no_cuda():
    raise SystemExit("CUDA graphs need --device cuda")


if __name__ == "__main__":
    main()
