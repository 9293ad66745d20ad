"""The prefix cache across requests (not a test: it prints numbers). 64 requests sharing a 512-token prefix, each
with its own 32-token suffix, through one engine with continuous batching (rows join as others finish, at most
--batch-size at once), with the prefix cache off and on, side by side in one run (the rounds alternate which goes
first): identical answers, prompt tokens computed, wall time and requests/s.

  python bench/prefix_cache_bench.py                       # the LLaDA2, SDAR and DiffusionGemma fixtures, CPU
  python bench/prefix_cache_bench.py --families sdar --rounds 3 --device cuda --dtype bfloat16
  python bench/prefix_cache_bench.py --evictions 20000,100000   # host time of eviction in a full cache only

The fixtures hold 512 positions; the bench serves a copy whose config.json allows 1024 (the same weights: RoPE tables
are computed, not stored). Prompt tokens computed = whole prompt blocks forwarded by the rows themselves (the cache's
misses) plus each prompt's last partial block."""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class QueueFeed:
    """A worker's queue, every request arrived at once: admits waiting requests, in order, whenever fewer than
    ``size`` rows run; with a prefix cache, by the worker scheduler's rule (worker/engine/prefix_cache.py
    ``Admission``: a request whose first prompt block a request taken in the same round is about to compute waits one
    round). Feed indices start at ``base`` (past the first batch's own)."""

    def __init__(self, engine, reqs, size: int, base: int):
        self.engine = engine
        self.waiting = list(enumerate(reqs))
        self.size, self.base = size, base
        self.results = {}
        self.keys: dict[int, bytes | None] = {}
        self.waited: set[int] = set()

    def take(self, room: int) -> list:
        """Up to ``room`` waiting requests, by the rule: [(position in the workload, Request)]."""
        from worker.engine.prefix_cache import Admission
        share = Admission(self.engine) if self.engine.prefix_cache is not None else None
        out, i = [], 0
        while i < len(self.waiting) and len(out) < room:
            pos, req = self.waiting[i]
            key = None
            if share is not None:
                if pos not in self.keys:       # as the worker's scheduler does: once per request
                    self.keys[pos] = share.key(req.prompt_ids, self.engine.plan(req.prompt_ids, req.params))
                key = self.keys[pos]
            if share is not None and share.waits(key, pos in self.waited):
                self.waited.add(pos)
                i += 1
                continue
            out.append(self.waiting.pop(i))
            if share is not None:
                share.take(key)
        return out

    def admit(self, rows, tokens):
        return [(self.base + pos, req) for pos, req in self.take(self.size - rows)]

    def done(self, index, result):
        self.results[index - self.base] = result


def workload(engine, family: str, n: int, prefix: int, suffix: int, gen: int, seed: int = 0):
    from worker.engine import GenerationParams, Request
    rng = random.Random(seed)
    vocab = engine.model.cfg.vocab_size - 20
    head = [rng.randrange(1, vocab) for _ in range(prefix)]
    extra = {"remasking_strategy": "low_confidence_static", "denoising_steps": 4} if family == "sdar" else {}
    if family == "diffusion_gemma":       # its own sampler (seeded), the checkpoint's defaults, one 8-token canvas
        return [Request(head + [rng.randrange(1, vocab) for _ in range(suffix)],
                        GenerationParams(gen_length=gen, block_length=8, algorithm=family, seed=i))
                for i in range(n)]
    return [Request(head + [rng.randrange(1, vocab) for _ in range(suffix)],
                    GenerationParams(gen_length=gen, block_length=4, algorithm=family, temperature=0.0,
                                     threshold=0.9, extra=extra)) for _ in range(n)]


def run(engine, reqs, batch: int):
    feed = QueueFeed(engine, reqs, batch, base=len(reqs))
    first = feed.take(batch)                    # the first round, by the same rule
    t = time.perf_counter()
    out = engine.generate([r for _, r in first], feed=feed)
    secs = time.perf_counter() - t
    results = {pos: r for (pos, _), r in zip(first, out)} | feed.results
    return [results[i].token_ids for i in range(len(reqs))], secs


def evictions(sizes: list[int], requests: int = 20, blocks: int = 100) -> None:
    """Host time of the cache's bookkeeping when it is full: a cache of ``n`` blocks (512 bytes each, 4 tokens),
    filled by prompts of ``blocks`` distinct blocks, then ``requests`` more such prompts looked up and stored, each
    evicting ``blocks`` entries."""
    import torch
    from worker.engine.prefix_cache import PrefixCache
    t = torch.zeros(64)
    for n in sizes:
        pc = PrefixCache(512 * n, block=4)
        rng = random.Random(0)
        while pc.bytes < pc.budget:
            pc.insert([rng.randrange(50000) for _ in range(4 * blocks)], 4, 0, blocks, lambda j: (t, t))
        before, start = pc.blocks_evicted, time.perf_counter()
        for _ in range(requests):
            p = [rng.randrange(50000) for _ in range(4 * blocks)]
            pc.lookup(p, 4, blocks)
            pc.insert(p, 4, 0, blocks, lambda j: (t, t))
        secs = time.perf_counter() - start
        print(f"full cache of {len(pc.entries)} blocks: {requests} prompts of {blocks} new blocks each, "
              f"{pc.blocks_evicted - before} evictions: {1e3 * secs / requests:.2f} ms a prompt "
              f"({1e6 * secs / (pc.blocks_evicted - before):.1f} us an eviction, lookup and copy included)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="llada2,sdar,diffusion_gemma")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--evictions", default=None, metavar="N,N",
                    help="only time the bookkeeping of a full cache of N blocks (no model)")
    a = ap.parse_args()
    if a.evictions:
        evictions([int(x) for x in a.evictions.split(",")])
        return
    import torch
    torch.set_num_threads(a.threads)
    from worker.engine import Engine
    fixtures = {"llada2": ROOT / "tests/fixtures/tiny-llada2", "sdar": ROOT / "tests/fixtures/tiny-sdar",
                "diffusion_gemma": ROOT / "tests/fixtures/tiny-diffusion-gemma"}
    print(f"{a.requests} requests: a shared {a.prefix}-token prefix + {a.suffix} distinct tokens, {a.gen} generated; "
          f"batch {a.batch_size} (continuous); {a.device} {a.dtype}, {a.threads} thread(s); median of {a.rounds}")
    for family in a.families.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / family
            shutil.copytree(fixtures[family], path)
            cfg = json.loads((path / "config.json").read_text())
            c = cfg.get("text_config", cfg)
            c["max_position_embeddings"] = max(c["max_position_embeddings"], 1024)
            (path / "config.json").write_text(json.dumps(cfg))
            off = Engine.from_pretrained(path, device=a.device, dtype=a.dtype, prefix_cache_gb=0)
            on = Engine.from_pretrained(path, device=a.device, dtype=a.dtype, prefix_cache_gb=1)
            reqs = workload(off, family, a.requests, a.prefix, a.suffix, a.gen)
            run(off, reqs[:2], a.batch_size)                     # warm up
            times = {"off": [], "on": []}
            answers = {}
            computed = None
            for k in range(a.rounds):
                for name in (("off", "on") if k % 2 == 0 else ("on", "off")):
                    e = off if name == "off" else on
                    if name == "on":
                        e.use_prefix_cache(1)                   # a fresh, empty cache every round
                    answers[name], secs = run(e, reqs, a.batch_size)
                    times[name].append(secs)
                    if name == "on":
                        st = e.prefix_cache.stats()
                        computed = st["prompt_tokens_looked_up"] - st["cached_tokens"]
            # the bound of any prefix cache on this workload: every prompt block cached before the run (the cache
            # of the last "on" run kept: suffix blocks too), so only the prompts' last partial blocks, the forwards
            # every algorithm keeps, and the denoising steps are left
            warm = []
            for _ in range(a.rounds):
                warm.append(run(on, reqs, a.batch_size)[1])
            total_prompt = sum(len(r.prompt_ids) for r in reqs)
            g = on.prefix_cache.block if family == "diffusion_gemma" else 4
            whole = sum(len(r.prompt_ids) // g * g for r in reqs)
            on_computed = computed + (total_prompt - whole)
            t_off, t_on = statistics.median(times["off"]), statistics.median(times["on"])
            print(f"{family}: answers identical: {answers['on'] == answers['off']}; prompt tokens computed "
                  f"{total_prompt} off, {on_computed} on ({on_computed / total_prompt:.3f}); "
                  f"{t_off:.2f} s off, {t_on:.2f} s on; {a.requests / t_off:.1f} vs {a.requests / t_on:.1f} req/s "
                  f"({t_off / t_on:.2f}x); bound (every prompt block cached beforehand): "
                  f"{statistics.median(warm):.2f} s ({t_off / statistics.median(warm):.2f}x)")


if __name__ == "__main__":
    main()
