"""Accuracy versus forward passes for every algorithm, on the trained demo model (not a test): prints a table and
writes docs/quality.md and docs/quality.png.

  python bench/quality.py                       # starts a worker on worker/demo_model, 600 held-out problems
  python bench/quality.py --url http://127.0.0.1:8000 --problems 1000 --concurrency 64

Problems come from the training script's generator with a fresh seed, minus every problem the training run saw
(replayed from its seed), so the set is held out. Requests go through the real HTTP API (chat completions,
max_tokens 16, block_length 16, unless the setting says otherwise) with concurrency; the answer must equal the expected
digits exactly. The last setting is what a client sends with lm-eval's default max_gen_toks (max_tokens 256, the
server's default block_length 32 and steps = max_tokens): a canvas 16 times longer than the answers the model was
trained on.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import aiohttp  # noqa: E402

from _local import wait_ready  # noqa: E402
from train_toy_model import TASKS, make_problem  # noqa: E402

SETTINGS = [   # (label, request fields)
    ("basic, steps 16", {"generation_algorithm": "basic", "steps": 16}),
    ("basic, steps 8", {"generation_algorithm": "basic", "steps": 8}),
    ("basic, threshold 0.9", {"generation_algorithm": "basic", "threshold": 0.9}),
    ("basic, threshold 0.7", {"generation_algorithm": "basic", "threshold": 0.7}),
    ("basic, factor 1.0", {"generation_algorithm": "basic", "factor": 1.0}),
    ("prefix_cache, steps 16", {"generation_algorithm": "prefix_cache", "steps": 16}),
    ("dual_cache, steps 16", {"generation_algorithm": "dual_cache", "steps": 16}),
    ("dual_cache, threshold 0.9", {"generation_algorithm": "dual_cache", "threshold": 0.9}),
    ("dual_cache, threshold 0.7", {"generation_algorithm": "dual_cache", "threshold": 0.7}),
    ("dinfer_blockwise (0.9)", {"generation_algorithm": "dinfer_blockwise"}),
    ("dinfer_hierarchy (0.9, 0.4)", {"generation_algorithm": "dinfer_hierarchy"}),
    ("dinfer_credit (0.9)", {"generation_algorithm": "dinfer_credit"}),
    ("basic, max_tokens 256 (block 32, steps 256)", {"generation_algorithm": "basic", "max_tokens": 256,
                                                     "block_length": 32}),
]


def training_problems(model: Path) -> set[str]:
    """Every prompt the training run drew (its generator replayed from the recorded seed and batch count)."""
    info = json.loads((model / "training.json").read_text())
    rng = random.Random(info["seed"])
    n = info["steps"] * info["args"]["batch_size"]
    if "task_weights" not in info["args"]:        # runs before --task-weights existed drew tasks uniformly
        return {make_problem(rng)[1] for _ in range(n)}
    weights = [float(w) for w in info["args"]["task_weights"].split(",")]
    return {make_problem(rng, rng.choices(TASKS, weights)[0])[1] for _ in range(n)}


def held_out(n: int, seed: int, seen: set[str]) -> list[tuple[str, str, str]]:
    rng = random.Random(seed)
    out, tasks = [], ["sort", "reverse", "add"]
    while len(out) < n:
        p = make_problem(rng, tasks[len(out) % 3])
        if p[1] not in seen:
            out.append(p)
    return out


async def evaluate(url: str, problems, fields: dict, concurrency: int) -> list[tuple[str, bool, int]]:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as s:
        async def one(task, prompt, answer):
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "block_length": 16, **fields}
            async with sem, s.post(url + "/v1/chat/completions", json=body) as r:
                data = await r.json()
            if r.status != 200:
                raise RuntimeError(data)
            c = data["choices"][0]
            return task, c["message"]["content"].strip() == answer, c["nfe"]
        return await asyncio.gather(*[one(*p) for p in problems])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=str(ROOT / "worker" / "demo_model"))
    ap.add_argument("--url", default=None, help="an already running server (else a worker is started)")
    ap.add_argument("--problems", type=int, default=600)
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "docs"))
    args = ap.parse_args()
    model = Path(args.model_path)
    problems = held_out(args.problems, args.seed, training_problems(model))
    proc = None
    url = args.url
    if url is None:
        port = 8791
        proc = subprocess.Popen([sys.executable, "-m", "dllm_serve", "worker", "--model-path", str(model), "--port",
                                 str(port), "--batch-size", "64", "--max-wait-time", "0.01", "--device", "cpu",
                                 "--log-level", "warning"], cwd=ROOT)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url)
    rows = []
    try:
        print(f"{len(problems)} held-out problems ({args.problems // 3} per task, seed {args.seed}, none seen in "
              f"training); max_tokens 16, block_length 16; concurrency {args.concurrency}")
        print(f"{'setting':<44} {'acc':>6} {'sort':>6} {'reverse':>7} {'add':>6} {'nfe':>6} {'wall s':>7}")
        for label, fields in SETTINGS:
            t = time.perf_counter()
            res = asyncio.run(evaluate(url, problems, fields, args.concurrency))
            wall = time.perf_counter() - t
            acc = {k: sum(ok for task, ok, _ in res if task == k) / sum(1 for task, _, _ in res if task == k)
                   for k in ("sort", "reverse", "add")}
            row = {"setting": label, "accuracy": sum(ok for _, ok, _ in res) / len(res), **acc,
                   "nfe": sum(n for _, _, n in res) / len(res), "wall_s": wall}
            rows.append(row)
            print(f"{label:<44} {row['accuracy']:>6.3f} {acc['sort']:>6.3f} {acc['reverse']:>7.3f} {acc['add']:>6.3f} "
                  f"{row['nfe']:>6.2f} {wall:>7.1f}", flush=True)
    finally:
        if proc:
            proc.terminate()
            proc.wait()
    out = Path(args.out)
    info = json.loads((model / "training.json").read_text())
    lines = ["# Quality of the demo model: accuracy versus forward passes\n",
             f"Generated by `python bench/quality.py` ({len(problems)} held-out problems, seed {args.seed}; "
             "none appeared in training). Model: `worker/demo_model` "
             f"({info['params'] / 1e6:.2f}M parameters, {info['steps']} training steps, {info['minutes']} min on "
             "2 CPU cores" + (f", then {ft['steps']} fine-tuning steps, {ft['minutes']} min" if (ft := info.get(
                 "fine_tune")) else "") + "). Requests: chat completions through a worker's HTTP API, max_tokens 16, block_length 16 "
             "unless the setting says otherwise (the model answers in 16 tokens, padding included), "
             f"concurrency {args.concurrency}. nfe: forward passes per request (mean; a row stops once its "
             "end-of-text is decoded).\n",
             "| setting | accuracy | sort | reverse | add | nfe |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['setting']} | {r['accuracy']:.3f} | {r['sort']:.3f} | {r['reverse']:.3f} | {r['add']:.3f} | "
              f"{r['nfe']:.2f} |" for r in rows]
    if any(r["setting"].startswith("basic, max_tokens 256") for r in rows):
        lines.append("\nThe last row is what a client sends with lm-eval's default `max_gen_toks` (max_tokens 256, the "
                     "server's default block_length 32, one step per token): the model was fine-tuned on answers "
                     "padded to 16, 32, 64, 128 and 256 tokens (worker/demo_model/README.md), so it ends its answer "
                     "with padding on canvases up to 256 tokens. Its context is 4,096 tokens (RoPE, no learned "
                     "positions).")
    lines.append("\n![accuracy versus nfe](quality.png)\n")
    (out / "quality.md").write_text("\n".join(lines))
    keys = {"basic, steps 16": "basic_steps16", "dual_cache, threshold 0.9": "dual_cache_threshold0.9",
            "basic, max_tokens 256 (block 32, steps 256)": "basic_max_tokens256"}
    summary = {keys[r["setting"]]: {k: round(r[k], 4) for k in ("accuracy", "sort", "reverse", "add", "nfe")}
               for r in rows if r["setting"] in keys}
    summary["problems"], summary["seed"] = len(problems), args.seed
    (model / "accuracy.json").write_text(json.dumps(summary, indent=2) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 5))
        for r in rows:     # the algorithms at the trained answer length (the max_tokens 256 row is in the table)
            if r["setting"].startswith("basic, max_tokens 256"):
                continue
            ax.scatter(r["nfe"], 100 * r["accuracy"])
            ax.annotate(r["setting"], (r["nfe"], 100 * r["accuracy"]), fontsize=7, xytext=(4, 2),
                        textcoords="offset points")
        ax.set_xlabel("forward passes per request (nfe)")
        ax.set_ylabel("accuracy (%)")
        ax.set_title("demo model: accuracy vs forward passes (held-out sort / reverse / add)")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "quality.png", dpi=120)
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")


if __name__ == "__main__":
    main()
