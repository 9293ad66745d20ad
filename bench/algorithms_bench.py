"""Per-algorithm speed (not a test): tokens/s, nfe and tokens per forward at batch 1 and 16.

  python bench/algorithms_bench.py --model-path tests/fixtures/tiny-llada            # CPU, the fixture
  python bench/algorithms_bench.py --shape llada-8b --device cuda --gen-length 256 --block-length 32
  python bench/algorithms_bench.py --model-path tests/fixtures/tiny-nemotron --only nemotron,basic,dual_cache
  python bench/algorithms_bench.py --model-path tests/fixtures/tiny-sdar --block-length 4    # kv_cache on / off
  python bench/algorithms_bench.py --model-path tests/fixtures/tiny-llada2 --block-length 8  # kv_cache on / off
  python bench/algorithms_bench.py --model-path tests/fixtures/tiny-llada --mix dual_cache,dinfer_blockwise \\
      --batch-sizes 24 --gen-length 64 --block-length 8     # rows of two algorithms in one batch / apart

Early exit is off (the whole canvas is decoded, as the reference does), so random-weight models measure the full
work. ``tok/fwd`` = generated tokens per forward pass of a row (gen_length / nfe); ``fwd tok/row`` = the tokens a
row put through the model in all its forwards (padding included), the measure of forward FLOPs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from engine_bench import random_engine  # noqa: E402

SETTINGS = [
    ("basic", {}),
    ("basic", {"threshold": 0.9}),
    ("prefix_cache", {}),
    ("dual_cache", {}),
    ("dual_cache", {"threshold": 0.9}),
    ("dinfer_blockwise", {}),
    ("dinfer_hierarchy", {}),
    ("dinfer_credit", {}),
    ("nemotron", {}),
    ("nemotron", {"threshold": 0.9}),
    ("dream", {}),
    ("dream_cache", {"threshold": 0.9}),
    ("dream_dual_cache", {"threshold": 0.9}),
    ("sdar", {}),
    ("sdar", {"extra": {"kv_cache": False}}),
    ("llada2", {}),
    ("llada2", {"extra": {"kv_cache": False}}),
]


def main() -> None:
    from worker.engine import Engine, GenerationParams, Request
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path")
    ap.add_argument("--shape", default="llada-8b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-length", type=int, default=128)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--steps", type=int, default=None, help="fixed-step algorithms (default: gen-length)")
    ap.add_argument("--only", default=None, help="comma-separated algorithm names")
    ap.add_argument("--compile", action="store_true", help="torch.compile the dense half of every block (a warm-up "
                    "run per batch size pays the compile before timing)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--mix", default=None, help="comma-separated algorithms: instead of the table, one batch of the "
                    "largest --batch-sizes with their rows in turn (threshold 0.9), together and each algorithm's "
                    "rows apart: forwards, wall time, tokens identical (Algorithm.forward: algorithms that share a "
                    "forward step take one forward a round together)")
    args = ap.parse_args()
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16}[args.dtype]
    engine = (Engine.from_pretrained(args.model_path, device=device, dtype=dtype) if args.model_path
              else random_engine(args.shape, device, dtype))
    if args.compile:
        engine.model.compile_dense()
    vocab = engine.model.cfg.vocab_size
    special = set(engine.stop_ids) | {engine.mask_id}
    gen = torch.Generator().manual_seed(0)
    prompts = [[t if t not in special else 1 for t in torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()]
               for _ in range(max(int(b) for b in args.batch_sizes.split(",")))]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    label = args.model_path or f"{args.shape} (random weights)"
    label += " [compiled dense path]" if args.compile else ""
    print(f"{label} on {device} {dtype}; prompt {args.prompt_len}, gen {args.gen_length}, block {args.block_length}, "
          f"steps {args.steps or args.gen_length} for fixed-step algorithms; early exit off")
    if args.mix:
        return mix(engine, args, prompts, sync)
    print(f"{'algorithm':<18} {'setting':<16} {'batch':>5} {'tokens/s':>10} {'nfe/row':>8} {'tok/fwd':>8} {'wall s':>8} "
          f"{'fwd tok/row':>11}")
    forwarded = [0]
    engine.model.register_forward_pre_hook(lambda m, a: forwarded.__setitem__(0, forwarded[0] + a[0].numel()))
    rows = []
    only = set(args.only.split(",")) if args.only else None
    from worker.engine import ALGORITHMS
    for alg, kw in SETTINGS:
        if (only and alg not in only) or engine.family not in ALGORITHMS[alg].families:
            continue
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            p = GenerationParams(gen_length=args.gen_length, block_length=args.block_length, steps=args.steps,
                                 algorithm=alg, **kw)
            reqs = [Request(prompts[i], p) for i in range(bs)]
            engine.generate(reqs if args.compile else reqs[:1], early_exit=False)   # warm-up (compile: this shape)
            sync()
            forwarded[0] = 0
            t = time.perf_counter()
            res = engine.generate(reqs, early_exit=False)
            sync()
            wall = time.perf_counter() - t
            nfe = sum(r.nfe for r in res) / bs
            flat = {**{k: v for k, v in kw.items() if k != "extra"}, **kw.get("extra", {})}
            setting = ",".join(f"{k}={v}" for k, v in flat.items()) or "-"
            row = {"algorithm": alg, "setting": setting, "batch": bs, "tokens_per_s": bs * args.gen_length / wall,
                   "nfe_per_row": nfe, "tokens_per_forward": args.gen_length / nfe, "wall_s": wall,
                   "forward_tokens_per_row": forwarded[0] / bs}
            rows.append(row)
            print(f"{alg:<18} {setting:<16} {bs:>5} {row['tokens_per_s']:>10.1f} {nfe:>8.1f} "
                  f"{row['tokens_per_forward']:>8.2f} {wall:>8.2f} {forwarded[0] / bs:>11.0f}", flush=True)
    if args.json:
        print(json.dumps(rows))


def mix(engine, args, prompts, sync, rounds: int = 3) -> None:
    """``--mix``: rows of several algorithms in one batch against each algorithm's rows in a batch of their own, one
    after the other (the engine's groups, before algorithms shared a forward step); the faster of ``rounds``."""
    from worker.engine import GenerationParams, Request
    names = args.mix.split(",")
    bs = max(int(b) for b in args.batch_sizes.split(","))
    reqs = [Request(prompts[i], GenerationParams(gen_length=args.gen_length, block_length=args.block_length,
                                                 algorithm=names[i % len(names)], threshold=0.9)) for i in range(bs)]
    calls = [0]
    engine.model.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))

    def timed(batches):        # -> (each request's result by id, forwards, the best wall time)
        best = None
        for _ in range(rounds):
            calls[0] = 0
            sync()
            t = time.perf_counter()
            out = {id(r): x for b in batches for r, x in zip(b, engine.generate(b, early_exit=False))}
            sync()
            wall = time.perf_counter() - t
            best = wall if best is None else min(best, wall)
        return out, calls[0] // rounds, best

    engine.generate(reqs[:len(names)], early_exit=False)      # warm-up
    together, f_t, w_t = timed([reqs])
    apart, f_a, w_a = timed([[r for r in reqs if r.params.algorithm == n] for n in names])
    same = all((together[id(r)].token_ids, together[id(r)].nfe) == (apart[id(r)].token_ids, apart[id(r)].nfe)
               for r in reqs)
    print(f"mix {','.join(names)}: {bs} rows in turn, threshold 0.9, the faster of {rounds} runs")
    print(f"{'':<26} {'forwards':>8} {'wall s':>8} {'tokens/s':>10}")
    for what, f, w in ((f"apart ({len(names)} batches)", f_a, w_a), ("together (1 batch)", f_t, w_t)):
        print(f"{what:<26} {f:>8} {w:>8.2f} {bs * args.gen_length / w:>10.1f}")
    print(f"together / apart: {w_a / w_t:.2f}x tokens/s, {f_t / f_a:.2f}x forwards; tokens and nfe "
          f"{'identical' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
