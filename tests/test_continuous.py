"""Continuous batching in the engine (issue 19): rows join a running batch between steps and leave it when done;
every row's tokens and nfe equal its output alone, whatever joins or leaves around it. A scripted feed (a test
double of the worker's queue) releases rows at given steps of the running group."""
import random
import zlib

import pytest

from worker.engine import GenerationParams, Request


class ScriptedFeed:
    """Releases ``(at, request)`` pairs once the engine has asked ``at`` times (one ask per round of steps)."""

    def __init__(self, arrivals, first_index):
        self.arrivals = sorted(arrivals, key=lambda a: a[0])
        self.next_index = first_index
        self.asks = 0
        self.results = {}
        self.joined = []

    def admit(self, rows, tokens):
        self.asks += 1
        out = []
        while self.arrivals and self.arrivals[0][0] <= self.asks:
            _, req = self.arrivals.pop(0)
            out.append((self.next_index, req))
            self.joined.append((self.next_index, req, rows))
            self.next_index += 1
        return out

    def done(self, index, result):
        assert index not in self.results
        self.results[index] = result


def run_staggered(engine, first, later, early_exit=False):
    """``first`` start the batch; ``later`` = [(step, Request)] join it. Returns {index: Result} and the feed."""
    feed = ScriptedFeed(later, len(first))
    engine.generate(first, early_exit=early_exit, feed=feed)
    return feed


def check_against_alone(engine, first, later, early_exit=False):
    feed = run_staggered(engine, first, later, early_exit)
    assert not feed.arrivals, "every row joined"
    reqs = {i: r for i, r in enumerate(first)} | {i: r for i, r, _ in feed.joined}
    assert sorted(feed.results) == sorted(reqs)
    for i, req in reqs.items():
        alone = engine.generate([req], early_exit=early_exit)[0]
        got = feed.results[i]
        assert (got.token_ids, got.canvas, got.nfe) == (alone.token_ids, alone.canvas, alone.nfe), (i, req.params)
    return feed


def mixed_llada(alg, seed, n=6):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        gen = rng.choice([8, 16, 24])
        kw = {"threshold": 0.9} if rng.random() < 0.4 else {}
        if alg == "basic" and not kw and rng.random() < 0.3:
            kw = {"cfg_scale": 0.5}
        p = GenerationParams(gen_length=gen, block_length=rng.choice([4, 8]), algorithm=alg,
                             temperature=rng.choice([0.0, 0.0, 0.7]), seed=rng.randrange(1000), **kw)
        out.append(Request([rng.randrange(1, 280) for _ in range(rng.randrange(2, 14))], p))
    return out


@pytest.mark.parametrize("alg", ["basic", "prefix_cache", "dual_cache", "dinfer_blockwise", "dinfer_hierarchy",
                                 "dinfer_credit"])
def test_llada_rows_joining_a_running_batch_are_exact(llada_engine, alg):
    reqs = mixed_llada(alg, seed=zlib.crc32(alg.encode()) % 1000)   # (hash() of a str differs between runs)
    feed = check_against_alone(llada_engine, reqs[:2], [(1, reqs[2]), (3, reqs[3]), (3, reqs[4]), (9, reqs[5])])
    assert any(rows > 0 for _, _, rows in feed.joined)      # they joined a batch that was running


@pytest.mark.parametrize("alg", ["basic", "dual_cache", "dream"])
@pytest.mark.parametrize("at", [7, 8, 9])
def test_a_row_arriving_as_the_batch_ends_is_not_lost(llada_engine, dream_engine, alg, at):
    """The only row takes 8 steps; a row arriving right after its last step (ask 8) lands in a group that is about to
    end, and must start the next one."""
    engine = dream_engine if alg == "dream" else llada_engine
    p = GenerationParams(gen_length=8, block_length=8, steps=8, algorithm=alg)
    feed = check_against_alone(engine, [Request([3, 4, 5], p)], [(at, Request([6, 7], p))])
    assert len(feed.results) == 2


def test_joining_with_early_exit_and_leaving_rows(llada_engine):
    reqs = mixed_llada("basic", seed=5, n=8)
    check_against_alone(llada_engine, reqs[:3], [(k, r) for k, r in zip((1, 2, 2, 4, 6), reqs[3:])],
                        early_exit=True)


def test_dream_rows_join_exactly(dream_engine, dream_golden):
    cases = [c for c in dream_golden["cases"] if c["reference"] == "generation_utils.diffusion_generate"]
    reqs = [Request(c["prompt"], GenerationParams(
        gen_length=c["gen"], steps=c["steps"], algorithm="dream", temperature=c.get("temperature", 0.0),
        seed=c.get("seed"), extra={k: c[k] for k in ("alg", "alg_temp", "top_p", "top_k") if c.get(k) is not None}))
        for c in cases[::5]]
    feed = check_against_alone(dream_engine, reqs[:2], [(k, r) for k, r in zip((1, 2, 5, 5, 9, 12, 14), reqs[2:])])
    for (i, _, _), c in zip(feed.joined, cases[::5][2:]):
        assert feed.results[i].canvas == c["output"]


def test_sdar_rows_join_exactly(sdar_engine, sdar_golden):
    from tests.test_sdar import params
    cases = sdar_golden["cases"][::3]
    reqs = [Request(c["prompt"], params(c)) for c in cases]
    feed = check_against_alone(sdar_engine, reqs[:2], [(k, r) for k, r in zip((1, 2, 2, 4, 7, 8, 11, 13, 20, 21),
                                                                                  reqs[2:])])
    for (i, _, _), c in zip(feed.joined, cases[2:]):
        assert feed.results[i].canvas == c["output"]


def test_rows_of_several_algorithms_join_and_run_in_turn(llada_engine):
    """Rows of another algorithm start their own group beside the running one; both groups step in turn."""
    reqs = mixed_llada("basic", seed=11, n=3) + mixed_llada("dual_cache", seed=12, n=3) + mixed_llada("prefix_cache", 13, 2)
    later = [(k, r) for k, r in zip((1, 1, 2, 3, 5, 8), reqs[2:])]
    check_against_alone(llada_engine, reqs[:2], later)


def test_nemotron_rows_join_exactly(nemotron_engine, nemotron_golden):
    """Nemotron's layout aligns prompt ends: a joining row with a longer prompt shifts the running rows (and their
    cache) right, and is prefilled into its own slot."""
    from tests.test_nemotron import cases, params
    all_cases = list(cases(nemotron_golden))
    reqs = [Request(prompt, params(st)) for st, prompt, _ in all_cases]
    feed = check_against_alone(nemotron_engine, reqs[:1], [(k, r) for k, r in zip(range(1, 40, 3), reqs[1:])])
    for (i, _, _), (_, _, out) in zip(feed.joined, all_cases[1:]):
        assert feed.results[i].canvas == out["output_ids"]


def test_dream_cache_rows_join_exactly(dream_engine, dream_golden):
    from tests.test_dream import cache_params, cached
    cases = cached(dream_golden)
    reqs = [Request(c["prompt"], cache_params(c)) for c in cases]
    feed = check_against_alone(dream_engine, reqs[:2], [(k, r) for k, r in zip(range(1, 60, 3), reqs[2:])])
    for (i, _, _), c in zip(feed.joined, cases[2:]):
        assert feed.results[i].canvas == c["output"]


@pytest.mark.parametrize("alg", ["basic", "dual_cache", "prefix_cache", "dinfer_blockwise"])
def test_cancelling_every_row_ends_the_batch_cleanly(llada_engine, alg):
    """All clients gone at once: every row ends "cancelled" (the cached loops used to fail on an empty cache)."""
    from worker.engine.rows import StepHooks
    p = GenerationParams(gen_length=16, block_length=8, algorithm=alg)
    gone = set()
    hooks = StepHooks(is_cancelled=lambda i: i in gone, on_progress=lambda i, ids: gone.update({0, 1}))
    out = llada_engine.generate([Request([1, 2, 3], p), Request([4, 5], p)], hooks=hooks, early_exit=False)
    assert [r.finish_reason for r in out] == ["cancelled", "cancelled"]


def test_dream_cache_rows_cancelled_together(dream_engine):
    from worker.engine.rows import StepHooks
    p = GenerationParams(gen_length=16, block_length=8, algorithm="dream_cache", threshold=0.9)
    out = dream_engine.generate([Request([1, 2, 3], p), Request([4, 5], p)],
                                hooks=StepHooks(is_cancelled=lambda i: True))
    assert [r.finish_reason for r in out] == ["cancelled", "cancelled"]
