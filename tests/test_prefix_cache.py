"""The prefix cache across requests (worker/engine/prefix_cache.py) for the block-causal families and DiffusionGemma's
causal encoder: with the cache on, every golden of LLaDA2.0/2.1, SDAR and DiffusionGemma gives the tokens, canvases
and nfe of the cache off, batched, alone, with rows joining a running batch and with a budget so small that blocks
are evicted; the radix tree's LRU takes leaves before
their ancestors; the worker reports the cache on /health, /metrics and the balancer's /stats."""
import random

import pytest
import torch

from tests.test_continuous import run_staggered
from tests.test_tensor_parallel import cases, outcome
from worker.engine import Engine, GenerationParams, Request
from worker.engine.prefix_cache import PrefixCache


def engines(family: str, gb: float):
    path, todo = cases(family)
    off = Engine.from_pretrained(path, device="cpu", dtype="float32", prefix_cache_gb=0)
    on = Engine.from_pretrained(path, device="cpu", dtype="float32", prefix_cache_gb=gb)
    assert off.prefix_cache is None and on.prefix_cache is not None
    if family == "diffusion_gemma":         # the fixture's prompts are short: 4-token blocks instead of 16
        on.prefix_cache = PrefixCache(on.prefix_cache.budget, block=4)
    return off, on, [Request(p, params) for p, params in todo]


def shared_prefix_requests(engine, n: int, prefix: int, seed: int = 0) -> list[Request]:
    """``n`` prompts sharing their first ``prefix`` tokens, each with a distinct suffix, greedy and sampled."""
    rng = random.Random(seed)
    vocab = engine.model.cfg.vocab_size - 20
    head = [rng.randrange(1, vocab) for _ in range(prefix)]
    alg = engine.family if engine.family in ("sdar", "diffusion_gemma") else "llada2"
    out = []
    for i in range(n):
        extra = {"remasking_strategy": "low_confidence_static", "denoising_steps": 4} if alg == "sdar" else {}
        if alg == "diffusion_gemma":
            p = GenerationParams(gen_length=8, block_length=8, algorithm=alg, seed=i)
        else:
            p = GenerationParams(gen_length=8, block_length=4, algorithm=alg, temperature=0.0 if i % 2 else 1.0,
                                 seed=i, threshold=0.9 if i % 3 == 0 else None, extra=extra)
        out.append(Request(head + [rng.randrange(1, vocab) for _ in range(rng.randrange(1, 7))], p))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llada2", "sdar", "diffusion_gemma"])
def test_goldens_with_the_cache_equal_the_cache_off(family):
    off, on, reqs = engines(family, 0.01)
    want = outcome(off.generate(reqs, early_exit=False))
    assert outcome(on.generate(reqs, early_exit=False)) == want          # one batch: computed, then stored
    assert outcome(on.generate(reqs, early_exit=False)) == want          # again: from the cache
    alone = range(0, len(reqs), 4)           # a quarter alone (a row's result never depends on its batch)
    assert [i for i in alone if outcome(on.generate([reqs[i]], early_exit=False)) != [want[i]]] == []
    st = on.prefix_cache.stats()
    assert st["cached_tokens"] > 0 and st["blocks"] > 0 and st["blocks_evicted"] == 0


@pytest.mark.parametrize("family", ["llada2", "sdar", "diffusion_gemma"])
def test_shared_prefixes_hit_join_and_survive_evictions(family):
    """Prompts sharing 24 tokens (6 blocks): later rows and rows joining a running batch take the shared blocks
    from the cache; under a budget of 5 blocks, with two groups of prompts whose shared heads compete for it, blocks
    are evicted and answers stay those of the cache off.

    A row's result can change with its batch at a near-tie (a matmul's rounding depends on its row count and on the
    kernels the CPU picks: docs/engine.md "Batching"): with seed 0, one sampled LLaDA2 row did so under ATen's AVX2
    kernels, with the cache off too (batched against alone). Seeds 10 and 11 have no such row for any family under
    ATen's DEFAULT, AVX2 and AVX512 kernels each with MKL at AVX2, AVX-512 and the CPU's own (AMX) instructions."""
    off, on, _ = engines(family, 0.01)
    reqs = shared_prefix_requests(off, 10, 24, seed=10)
    want = outcome(off.generate(reqs))
    assert outcome(on.generate(reqs[:2])) == want[:2]
    before = on.prefix_cache.tokens_hit
    feed = run_staggered(on, reqs[2:4], [(k, r) for k, r in zip((1, 2, 2, 4, 5, 7), reqs[4:])], early_exit=True)
    got = [feed.results[i] for i in range(8)]
    assert outcome(got) == want[2:]
    # every row found (at least) the shared blocks: five of 4 tokens (DiffusionGemma: one of 16)
    assert on.prefix_cache.tokens_hit - before >= 8 * (16 if family == "diffusion_gemma" else 20)
    per_block = on.prefix_cache.entries[next(iter(on.prefix_cache.entries))].nbytes
    tiny = Engine.from_pretrained(cases(family)[0], device="cpu", dtype="float32", prefix_cache_gb=0)
    tiny.prefix_cache = PrefixCache(5 * per_block, block=on.prefix_cache.block)
    other = shared_prefix_requests(off, 4, 24, seed=11)         # another shared head: the two chains compete
    want_other = outcome(off.generate(other))
    for _ in range(2):
        assert outcome(tiny.generate(reqs)) == want
        assert outcome(tiny.generate(other)) == want_other
        for r, w in zip(reqs[::3], want[::3]):
            assert outcome(tiny.generate([r])) == [w]
    st = tiny.prefix_cache.stats()
    assert st["blocks_evicted"] > 0 and st["bytes"] <= st["budget_bytes"] and st["cached_tokens"] > 0


def test_lru_evicts_leaves_before_their_ancestors_and_keys_hold_the_block_length():
    kv = lambda j: (torch.full((1, 1, 2, 1), float(j)), torch.zeros(1, 1, 2, 1))     # 16 bytes a block
    c = PrefixCache(16 * 4)
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 9, 9, 9, 9]
    c.insert(a, 2, 0, 3, kv)                               # a's 3 blocks
    c.insert(b, 2, 1, 3, kv)                               # b shares a's first block: 2 more -> 5 > budget of 4
    assert c.blocks_evicted == 1 and c.bytes <= c.budget
    assert [e.kv[0][0, 0, 0, 0].item() for e in c.lookup(b, 2, 3)] == [0.0, 1.0, 2.0]
    assert len(c.lookup(a, 2, 3)) == 2                     # a's leaf went (least recently used), its ancestors stay
    assert c.lookup(a, 3, 2) == []                          # another block length: other keys
    assert len(c.lookup(a, 2, 1)) == 1 and c.stats()["hit_rate"] > 0
    assert PrefixCache(0).lookup(a, 2, 3) == []


def test_a_block_is_reused_only_when_every_token_of_it_matches():
    """A cached block serves a prompt only if the prompt equals it in every token up to the block's end: prompts
    that agree with a cached one at each block's first token but differ inside a block find the blocks before that
    one only, and their answers are those of the cache off (a review found no prompt in these tests that differs
    from a cached one inside a block: keys made of each block's first token passed them all)."""
    kv = lambda j: (torch.full((1, 1, 4, 1), float(j)), torch.zeros(1, 1, 4, 1))
    c = PrefixCache(1 << 20)
    a = list(range(1, 13))                                  # 3 blocks of 4
    c.insert(a, 4, 0, 3, kv)
    inside = lambda i: a[:i] + [99] + a[i + 1:]
    assert len(c.lookup(a, 4, 3)) == 3
    assert len(c.lookup(inside(6), 4, 3)) == 1              # block 1's third token differs
    assert len(c.lookup(inside(11), 4, 3)) == 2             # block 2's last token differs
    assert len(c.lookup(inside(1), 4, 3)) == 0
    off, on, _ = engines("llada2", 0.01)
    prompt = shared_prefix_requests(off, 1, 24)[0]
    changed = Request(prompt.prompt_ids[:9] + [prompt.prompt_ids[9] % 50 + 1] + prompt.prompt_ids[10:], prompt.params)
    assert changed.prompt_ids[8] == prompt.prompt_ids[8] and changed.prompt_ids[9] != prompt.prompt_ids[9]
    want = outcome(off.generate([prompt, changed]))
    assert outcome(on.generate([prompt])) == want[:1]
    before = on.prefix_cache.tokens_hit
    assert outcome(on.generate([changed])) == want[1:]
    assert on.prefix_cache.tokens_hit - before == 8           # blocks 0 and 1 only (token 9 is in block 2)


def test_families_whose_prompts_see_the_answer_get_no_cache():
    from tests.conftest import TINY_DREAM, TINY_LLADA
    for path in (TINY_LLADA, TINY_DREAM):
        assert Engine.from_pretrained(path, device="cpu", prefix_cache_gb=1).prefix_cache is None


@pytest.mark.parametrize("family", ["llada2", "sdar", "diffusion_gemma"])
async def test_distinct_requests_taken_together_compute_a_shared_prefix_once(family):
    """Six requests with one 24-token prefix and their own suffixes, all queued at once (a few-shot evaluation): the
    scheduler takes the first, the other five wait one round and reuse its stored blocks instead of computing them in
    the same forward. Answers equal the cache-off run."""
    import asyncio

    from tests.conftest import TINY_LLADA2, TINY_SDAR, fixture_path
    from worker.scheduler import Job, RowScheduler
    path = {"llada2": TINY_LLADA2, "sdar": TINY_SDAR, "diffusion_gemma": fixture_path("tiny-diffusion-gemma")}[family]
    off = Engine.from_pretrained(path, device="cpu", dtype="float32", prefix_cache_gb=0)
    on = Engine.from_pretrained(path, device="cpu", dtype="float32", prefix_cache_gb=0.01)
    if family == "diffusion_gemma":
        on.prefix_cache.block = 4
    head = list(range(10, 34))
    prompts = [head + [40 + i, 50 + i, 60 + i] for i in range(6)] + [list(range(100, 127))]
    extra = {"sdar": dict(block_length=4, extra={"remasking_strategy": "low_confidence_static",
                                                 "denoising_steps": 4}),
             "llada2": dict(block_length=4, threshold=0.9), "diffusion_gemma": dict(block_length=8)}[family]
    params = [GenerationParams(gen_length=8, algorithm=family, seed=i, **extra) for i in range(len(prompts))]
    want = outcome(off.generate([Request(p, q) for p, q in zip(prompts, params)]))
    b = RowScheduler(on, batch_size=8, max_wait_time=0.0)
    b.start()
    got = {}
    jobs = [Job(list(p), q, sink=lambda i, kind, payload: got.__setitem__(i, payload) if kind == "done" else 0,
                index=i) for i, (p, q) in enumerate(zip(prompts, params))]
    for j in jobs:
        b.submit(j, wait=False)
    for _ in range(1000):
        if len(got) == len(jobs):
            break
        await asyncio.sleep(0.01)
    # a row is answered as it finishes, before its batch's call ends and is counted (the histogram): wait for that
    await asyncio.wait_for(b.idle(), 30)
    await b.close()
    assert outcome([got[i] for i in range(len(jobs))]) == want
    st = on.prefix_cache.stats()
    unit, reused = {"llada2": (4, 6), "sdar": (4, 5), "diffusion_gemma": (4, 6)}[family]
    assert st["cached_tokens"] >= 5 * reused * unit        # the five waiting rows took the shared blocks
    assert b.histogram[8] == 0 and sum(b.histogram.values()) == 1        # one batch, rows joining it


@pytest.mark.parametrize("warm_head", [False, True])
async def test_the_n_choices_of_a_request_share_its_prompt(warm_head):
    """Four choices of one 26-token prompt through the worker's scheduler (continuous batching, prefix cache on): the
    first computes the prompt's six blocks, the other three start a round later and take them from the cache; every
    choice's answer is the one it gets alone with the cache off. ``warm_head``: an earlier request shared the first
    block only (a chat template's head): the choices still compute the other five once (they computed them side by
    side when the rule looked at the first block alone)."""
    import asyncio

    from tests.conftest import TINY_LLADA2
    from worker.scheduler import Job, RowScheduler
    off = Engine.from_pretrained(TINY_LLADA2, device="cpu", dtype="float32", prefix_cache_gb=0)
    on = Engine.from_pretrained(TINY_LLADA2, device="cpu", dtype="float32", prefix_cache_gb=0.01)
    prompt = list(range(10, 36))
    params = [GenerationParams(gen_length=8, block_length=4, algorithm="llada2", temperature=1.0, seed=s)
              for s in range(4)]
    want = outcome(off.generate([Request(prompt, p) for p in params]))
    if warm_head:
        on.generate([Request(prompt[:4] + list(range(200, 222)), GenerationParams(gen_length=4, block_length=4,
                                                                                  algorithm="llada2"))])
    before = on.prefix_cache.stats()
    b = RowScheduler(on, batch_size=8, max_wait_time=0.0)
    b.start()
    got = {}
    jobs = [Job(list(prompt), p, sink=lambda i, kind, payload: got.__setitem__(i, payload) if kind == "done" else 0,
                index=i) for i, p in enumerate(params)]
    for j in jobs:
        b.submit(j, wait=False)
    for _ in range(500):
        if len(got) == 4:
            break
        await asyncio.sleep(0.01)
    await b.close()
    assert outcome([got[i] for i in range(4)]) == want
    st = on.prefix_cache.stats()
    stored, cached = (st[k] - before[k] for k in ("blocks_stored", "cached_tokens"))
    assert (stored, cached) == ((5, 4 + 3 * 24) if warm_head else (6, 3 * 24))


def test_new_weights_empty_the_cache_and_its_counts_go_on(tmp_path):
    """/worker/load_weights: no block of the old weights is served after new ones (the answers are the new weights'
    with the cache off), and the cache's counts since the start go on (the exported counters never go back)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.conftest import TINY_LLADA2
    other = tmp_path / "llada2-b"
    shutil.copytree(TINY_LLADA2, other)
    tensors = load_file(other / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    tensors = {k: v + 0.05 * torch.randn(v.shape, generator=g).to(v.dtype) if v.is_floating_point() else v
               for k, v in tensors.items()}
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    on = Engine.from_pretrained(TINY_LLADA2, device="cpu", dtype="float32", prefix_cache_gb=0.01)
    fresh = Engine.from_pretrained(other, device="cpu", dtype="float32", prefix_cache_gb=0)
    prompt = list(range(10, 36))
    req = Request(prompt, GenerationParams(gen_length=8, block_length=4, algorithm="llada2"))
    old = on.generate([req])[0].canvas
    before = on.prefix_cache.stats()
    assert before["blocks"] == 6 and before["prompt_tokens_looked_up"] == 24
    on.reload_weights(other)
    st = on.prefix_cache.stats()
    assert st["blocks"] == 0 and st["bytes"] == 0
    assert {k: st[k] for k in ("lookups", "prompt_tokens_looked_up", "cached_tokens", "blocks_stored")} == \
        {k: before[k] for k in ("lookups", "prompt_tokens_looked_up", "cached_tokens", "blocks_stored")}
    new = on.generate([req])[0].canvas
    assert new == fresh.generate([req])[0].canvas and new != old
    assert on.prefix_cache.stats()["prompt_tokens_looked_up"] == 48


def test_a_budget_that_rounds_to_no_byte_is_off():
    """--prefix-cache-gb 1e-10 is 0 bytes: no cache (a reviewer found a cache that stored nothing, reported itself on
    and held rows sharing a prefix back a round for blocks that could never arrive)."""
    from tests.conftest import TINY_LLADA2
    e = Engine.from_pretrained(TINY_LLADA2, device="cpu", dtype="float32", prefix_cache_gb=1e-10)
    assert e.prefix_cache is None
    e.use_prefix_cache(2000 / 2**30)
    assert e.prefix_cache is not None and e.prefix_cache.budget == 2000


def test_eviction_takes_the_least_recently_used_leaf_as_a_scan_of_every_entry_would():
    """Eviction keeps a heap of candidate leaves (stale items skipped, rebuilt when mostly stale) instead of scanning
    every entry (milliseconds an eviction in a full cache of 100,000 blocks). Its choices must be the scan's: the least
    recently used entry without children, never the parent of the block being stored. Random lookups, inserts and
    clears over shared heads, under small budgets, against that rule applied by brute force."""
    class Scan(PrefixCache):
        def _make_room(self, need, keep):
            while self.bytes + need > self.budget and self.entries:
                leaves = [(e.used, k) for k, e in self.entries.items() if e.children == 0 and k != keep]
                if not leaves:
                    return
                e = self.entries.pop(min(leaves)[1])
                self.bytes -= e.nbytes
                self.blocks_evicted += 1
                if e.parent in self.entries:
                    self.entries[e.parent].children -= 1

    evicted = 0
    for seed in range(40):
        rng = random.Random(seed)
        budget = rng.choice([600, 2048, 5000])
        heap, scan = PrefixCache(budget, 4), Scan(budget, 4)
        heads = [[rng.randrange(50) for _ in range(rng.randrange(4, 40))] for _ in range(4)]
        for _ in range(150):
            p = rng.choice(heads) + [rng.randrange(50) for _ in range(rng.randrange(0, 30))]
            t = torch.zeros(rng.choice([16, 32, 64]))
            op = rng.random()
            if op < 0.5:
                heap.lookup(p, 4, len(p) // 4)
                scan.lookup(p, 4, len(p) // 4)
            elif op < 0.98:
                first = len(heap.lookup(p, 4, len(p) // 4))
                assert len(scan.lookup(p, 4, len(p) // 4)) == first
                for c in (heap, scan):
                    c.insert(p, 4, first, len(p) // 4, lambda j: (t, t))
            else:
                heap.clear()
                scan.clear()
            assert {k: (e.used, e.children) for k, e in heap.entries.items()} == \
                {k: (e.used, e.children) for k, e in scan.entries.items()}
            assert heap.bytes == scan.bytes <= budget
        evicted += heap.blocks_evicted
    assert evicted > 1000


def test_a_budget_over_the_devices_memory_is_refused_at_load():
    """A budget the device could never hold is a clear error when the worker starts, not an out-of-memory error in
    the middle of serving once the cache has grown."""
    from tests.conftest import TINY_LLADA2
    with pytest.raises(ValueError, match="prefix-cache-gb 1e\\+06 is more than 90% of the cpu memory"):
        Engine.from_pretrained(TINY_LLADA2, device="cpu", dtype="float32", prefix_cache_gb=1e6)


def test_the_eviction_heap_stays_bounded_when_nothing_new_is_stored():
    """Every touch of a leaf adds a heap item and leaves its old one stale; stale items were dropped only when an
    eviction ran. Requests whose whole blocks are all cached (one few-shot prefix, n choices, rollouts) store
    nothing and evict nothing, so the heap grew by two items a request for ever (a reviewer's finding: 400,000
    items for 10 entries after 200,000 requests)."""
    pc = PrefixCache(1 << 30, block=4)
    t = torch.zeros(8)
    head = list(range(100, 140))                 # ten shared blocks
    for i in range(3000):
        prompt = head + [i, 7]                   # a tail shorter than a block
        found = pc.lookup(prompt, 4, 10)
        pc.insert(prompt, 4, len(found), 10, lambda j: (t, t))
    assert len(pc.entries) == 10 and len(pc._leaves) <= 2 * 10 + 64 + 1


@pytest.mark.slow          # (two models): the fast tier stays under 3 minutes
async def test_usage_reports_the_prompt_tokens_the_cache_served(aiohttp_client):
    """A review: /v1/responses always said input_tokens_details.cached_tokens 0 (hard-coded) while the cache served
    the prompt, and chat and completions said nothing. Now each prompt's tokens served from the cache for every one
    of its choices: 0 the first time (its first choice computes them), every whole reusable block the next."""
    from tests.conftest import TINY_LLADA, TINY_LLADA2
    from tests.test_worker_app import wait_ready
    from worker.app import WorkerConfig, make_app
    client = await aiohttp_client(make_app(WorkerConfig(model_path=str(TINY_LLADA2), device="cpu",
                                                        prefix_cache_gb=0.01)))
    await wait_ready(client)
    body = {"prompt": list(range(10, 36)), "max_tokens": 4, "block_length": 4, "n": 2}
    seen = []
    for _ in range(2):
        r = await client.post("/v1/completions", json=body)
        seen.append((await r.json())["usage"])
    assert seen[0]["prompt_tokens"] == 26 and seen[0]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert seen[1]["prompt_tokens_details"] == {"cached_tokens": 24}, seen
    text = {"input": "di vo sopopa nerici " * 8, "max_output_tokens": 4}
    got = []
    for _ in range(2):
        r = await client.post("/v1/responses", json=text)
        got.append((await r.json())["usage"])
    assert got[0]["input_tokens_details"]["cached_tokens"] == 0
    assert 0 < got[1]["input_tokens_details"]["cached_tokens"] < got[1]["input_tokens"], got
    plain = await aiohttp_client(make_app(WorkerConfig(model_path=str(TINY_LLADA), device="cpu")))
    await wait_ready(plain)
    use = (await (await plain.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})).json())["usage"]
    assert "prompt_tokens_details" not in use          # no prefix cache (LLaDA's prompt sees its answer)


def test_diffusion_gemmas_captured_keys_and_values_are_not_held_through_the_steps():
    """DiffusionGemma's encoder hands every layer's new keys and values of a call to the prefix cache (which copies
    the whole blocks it stores); the list was a local of the decoding loop, so all of it stayed alive through every
    denoising step until the next encoder call, outside the cache's budget (a review's finding)."""
    import weakref
    from tests.conftest import fixture_path
    e = Engine.from_pretrained(fixture_path("tiny-diffusion-gemma"), device="cpu", dtype="float32",
                               prefix_cache_gb=0.01)
    refs, alive = [], []
    encode, denoise = e.model.encode, e.model.denoise

    def enc(ids, lengths, cache, slots, capture=None):
        encode(ids, lengths, cache, slots, capture)
        if capture:
            refs.append(weakref.ref(capture[0][0]))

    def den(*a, **k):
        alive.append(sum(r() is not None for r in refs))
        return denoise(*a, **k)
    e.model.encode, e.model.denoise = enc, den
    p = GenerationParams(gen_length=8, block_length=8, algorithm="diffusion_gemma", seed=1)
    e.generate([Request(list(range(5, 45)), p)])
    assert refs and e.prefix_cache.stats()["blocks"] > 0 and len(alive) > 1
    assert alive == [0] * len(alive)


async def test_running_out_of_memory_frees_the_prefix_cache_before_the_retry():
    """The GPU out of memory: the batch is retried in halves; the prefix cache (1 GiB by default) kept its blocks
    meanwhile (a review's finding). It is emptied first now, on one rank (tensor-parallel ranks must keep the same
    blocks). (The out-of-memory error is a test double.)"""
    import asyncio
    from worker.scheduler import Job, RowScheduler
    from tests.conftest import TINY_LLADA2
    e = Engine.from_pretrained(TINY_LLADA2, device="cpu", dtype="float32", prefix_cache_gb=0.01)
    p = GenerationParams(gen_length=4, block_length=4, algorithm="llada2")
    e.generate([Request(list(range(5, 45)), p)])
    assert e.prefix_cache.bytes > 0
    real, oom, held = e.generate, [True], []

    def generate(requests, **kw):
        if oom[0]:
            oom[0] = False
            raise torch.cuda.OutOfMemoryError("simulated")
        held.append(e.prefix_cache.bytes)          # what the cache holds as a retried half starts
        return real(requests, **kw)
    e.generate = generate
    b = RowScheduler(e, batch_size=4, max_wait_time=0.01)
    b.start()
    done = asyncio.Event()
    results = {}

    def sink(i, kind, payload):
        if kind in ("done", "error"):
            results[i] = kind
            if len(results) == 2:
                done.set()
    try:
        for i in range(2):
            b.submit(Job(list(range(5, 45)), p, sink, index=i))
        await asyncio.wait_for(done.wait(), 60)
        assert results == {0: "done", 1: "done"} and not oom[0]
        assert held[0] == 0                                  # emptied before the retry
        assert e.prefix_cache.stats()["blocks"] > 0         # and filled again by the retried rows
    finally:
        await b.close()
