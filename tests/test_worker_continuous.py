"""Continuous batching in the worker's queue (issue 19): rows join the running batch between steps, FIFO, and are
answered the moment they finish; static batching (--no-continuous-batching) for comparison. The simulated device
(worker/simulated.py, per-step cost model) is the test double for timing; the tiny checkpoints for exactness."""
import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import TINY_DREAM, TINY_LLADA
from tests.helpers import get_json, post_json, settled_batch_stats, start_worker
from worker.engine import Engine, GenerationParams
from worker.scheduler import Job, RowScheduler
from worker.simulated import SimulatedEngine


def job(prompt, gen, done, algorithm="basic", index=0):
    p = GenerationParams(gen_length=gen, block_length=min(8, gen), steps=gen, algorithm=algorithm)
    return Job(list(prompt), p, sink=lambda i, kind, payload: done.append((index, kind, time.monotonic())),
               index=index)


async def run_jobs(continuous, plan, step=0.002, switch_wait=1.0):
    """``plan``: [(delay after the previous submit, prompt, gen, algorithm)]; returns (finish order, batcher)."""
    engine = SimulatedEngine(str(TINY_LLADA), step, 0.0, per_step=True)
    b = RowScheduler(engine, batch_size=8, max_wait_time=0.0, continuous=continuous, switch_wait=switch_wait)
    b.start()
    done = []
    for i, (delay, prompt, gen, alg) in enumerate(plan):
        await asyncio.sleep(delay)
        b.submit(job(prompt, gen, done, alg, index=i), wait=False)
    for _ in range(500):
        if sum(kind == "done" for _, kind, _ in done) == len(plan):
            break
        await asyncio.sleep(0.01)
    await asyncio.wait_for(b.idle(), 30)     # the batch's call counted (rows are answered before it ends)
    await b.close()
    return [i for i, kind, _ in done if kind == "done"], b


async def test_short_rows_join_a_long_batch_and_leave_first():
    plan = [(0, [5, 6], 64, "basic"), (0.03, [7, 8], 8, "basic"), (0.0, [9], 8, "basic")]
    order, b = await run_jobs(True, plan)
    assert order[:2] == [1, 2] and order[2] == 0         # the short rows finished while the long one ran
    assert b.rows_joined == 2 and b.rows_retired == 3 and b.batches_processed == 1
    order, b = await run_jobs(False, plan)
    assert order[0] == 0 and b.rows_joined == 0 and b.batches_processed == 2    # static: they waited for it


async def test_rows_of_another_algorithm_join_beside_the_running_ones():
    """A dual_cache row sent while a long basic batch runs starts its own group at once and finishes first."""
    plan = [(0, [5, 6], 96, "basic"), (0.02, [7], 8, "dual_cache"), (0.0, [8], 8, "basic")]
    order, b = await run_jobs(True, plan)
    assert b.rows_joined == 2 and order[-1] == 0


async def test_batch_size_and_token_budget_bound_the_running_batch():
    engine = SimulatedEngine(str(TINY_LLADA), 0.002, 0.0, per_step=True)
    b = RowScheduler(engine, batch_size=3, max_wait_time=0.0, max_batch_tokens=40)
    b.start()
    done, seen = [], []
    orig = engine._steps

    def watch(requests, plans, hooks, feed):
        class Spy:
            def admit(self, rows, tokens):
                got = feed.admit(rows, tokens)
                seen.append((rows + len(got), tokens + sum(len(r.prompt_ids) + r.params.gen_length for _, r in got)))
                return got

            def done(self, i, res):
                feed.done(i, res)
        return orig(requests, plans, hooks, Spy())
    engine._steps = watch
    for i in range(6):
        b.submit(job([1, 2, 3, 4], 16, done, index=i), wait=False)      # 20 canvas tokens each
        await asyncio.sleep(0.01)
    for _ in range(500):
        if sum(kind == "done" for _, kind, _ in done) == 6:
            break
        await asyncio.sleep(0.01)
    await b.close()
    assert sum(kind == "done" for _, kind, _ in done) == 6
    assert max(r for r, _ in seen) <= 2 and max(t for _, t in seen) <= 40     # two rows of 20 tokens fit 40


def golden_bodies(golden):
    for c in golden["cases"]:
        if c["reference"] != "generation_utils.diffusion_generate":
            continue
        yield c, {"prompt": c["prompt"], "max_tokens": c["gen"], "steps": c["steps"], "return_token_ids": True,
                  "ignore_eos": True, "seed": c.get("seed"), "temperature": c.get("temperature", 0.0),
                  "algorithm_params": {k: c[k] for k in ("alg", "alg_temp", "top_p", "top_k") if c.get(k) is not None}}


@pytest.mark.slow
def test_staggered_requests_through_a_worker_are_exact(tmp_path, dream_golden):
    """Golden requests arriving one after another (a few milliseconds apart) at a worker whose batch runs while they
    arrive: each joins the running batch and still equals the reference's output; the stats and metrics count it."""
    w = start_worker(tmp_path, TINY_DREAM, "--batch-size", "6", "--max-wait-time", "0")
    try:
        w.wait_ready()
        cases = list(golden_bodies(dream_golden))

        def send(i):
            time.sleep(0.004 * i)
            return post_json(w.url + "/v1/completions", cases[i][1])
        with ThreadPoolExecutor(8) as ex:
            answers = list(ex.map(send, range(len(cases))))
        for (c, _), (status, r) in zip(cases, answers):
            assert status == 200 and r["choices"][0]["token_ids"] == c["output"], c
        stats = settled_batch_stats(w.url)
        assert stats["continuous_batching"] and stats["rows_joined"] > 0
        assert stats["rows_retired"] == len(cases) and stats["rows_running"] == 0
        assert get_json(w.url + "/health")[1]["rows_retired_per_s"] > 0
        import urllib.request
        text = urllib.request.urlopen(w.url + "/metrics").read().decode()
        assert f"dllm_worker_rows_retired_total {float(len(cases))}" in text
        assert "dllm_worker_rows_joined_total" in text
    finally:
        w.stop()


async def test_a_batch_that_never_drains_keeps_only_its_running_rows(monkeypatch):
    """Under steady load the running batch's call never ends: it holds the rows it is running, not every row that
    ever passed through it (each would keep its request's objects alive for as long as the batch runs)."""
    import worker.scheduler as scheduler
    held = []

    class Watched(scheduler._Feed):
        def admit(self, rows, tokens):
            held.append(len(self.jobs))
            return super().admit(rows, tokens)
    monkeypatch.setattr(scheduler, "_Feed", Watched)
    engine = SimulatedEngine(str(TINY_LLADA), 0.001, 0.0, per_step=True)
    b = RowScheduler(engine, batch_size=3, max_wait_time=0.0, continuous=True)
    b.start()
    done = []
    b.submit(job([5, 6], 256, done, index=0), wait=False)           # runs throughout
    for i in range(1, 31):
        while sum(kind == "done" for _, kind, _ in done) < i - 2:   # two short rows at a time beside it
            await asyncio.sleep(0.001)
        b.submit(job([7], 8, done, index=i), wait=False)
    for _ in range(1000):
        if sum(kind == "done" for _, kind, _ in done) == 31:
            break
        await asyncio.sleep(0.01)
    await asyncio.wait_for(b.idle(), 30)     # the batch's call counted (rows are answered before it ends)
    await b.close()
    assert sum(kind == "done" for _, kind, _ in done) == 31
    assert b.batches_processed == 1 and b.rows_joined >= 25        # one batch, the short rows joined it
    assert max(held) <= 3, f"the running batch held up to {max(held)} rows"


async def test_a_scoring_row_is_answered_before_its_batchs_generation_rows_end(llada_engine):
    """A batch that starts with a scoring row and a generation row scores first, then generates; the scoring answer
    waited for the generation to end, which under steady load (rows joining) was never: a direct scoring request
    timed out after 60 s while 10 clients generated."""
    from worker.engine.likelihood import ScoreRequest
    got = {}
    b = RowScheduler(llada_engine, batch_size=8, max_wait_time=0.3)
    b.start()
    try:
        long = Job([5, 6], GenerationParams(gen_length=2048, block_length=2048), sink=lambda i, k, p: got.setdefault(
            "long", k) if k in ("done", "error") else 0, index=0)
        score = Job(list(range(5, 15)), None, sink=lambda i, k, p: got.setdefault("score", (k, p)), index=1,
                    score=ScoreRequest(list(range(5, 15)), [5], mc_num=2, batch_size=2, check_greedy=False))
        b.submit(long, wait=True)
        b.submit(score, wait=True)
        for _ in range(1000):
            if "score" in got:
                break
            await asyncio.sleep(0.01)
        assert got.get("score", ("?",))[0] == "done" and "long" not in got       # the generation runs on
        long.cancelled = True
        await asyncio.wait_for(b.idle(), 30)
    finally:
        await b.close()


async def test_an_algorithm_that_fails_costs_only_its_own_groups_rows(monkeypatch):
    """A bug in one algorithm's step (a test double raising on its third step) gave a 500 to every unanswered row
    of the batch, other algorithms' rows mid-stream among them (a reviewer's finding). Its group's rows get the 500,
    the other groups run on to their answers, and the scheduler goes on with counters back to zero."""
    from dataclasses import replace as dc_replace
    from worker.engine import algorithms
    eng = Engine.from_pretrained(TINY_LLADA, device="cpu", dtype="float32")
    real = algorithms.REGISTRY["prefix_cache"]

    def failing(engine, rows, fin):
        for k, _ in enumerate(real.run(engine, rows, fin)):
            if k == 2:
                raise ValueError("a bug (test double)")
            yield
    monkeypatch.setitem(algorithms.REGISTRY, "prefix_cache", dc_replace(real, run=failing))
    b = RowScheduler(eng, batch_size=8, max_wait_time=0.01)
    b.start()
    got = {}

    def sink(i, kind, payload):
        if kind in ("done", "error"):
            got[i] = (kind, payload[0] if kind == "error" else payload.finish_reason)

    def job(i, alg, gen=32):
        p = eng.plan([5, 6, 7], GenerationParams(gen_length=gen, block_length=8, algorithm=alg, ignore_eos=True))
        return Job([5, 6, 7], p.params, sink, index=i)
    try:
        b.submit(job(0, "basic", 256))
        b.submit(job(1, "basic"))
        await asyncio.sleep(0.1)
        b.submit(job(2, "prefix_cache"), wait=False)
        for _ in range(1500):
            if len(got) == 3:
                break
            await asyncio.sleep(0.02)
        assert got == {0: ("done", "length"), 1: ("done", "length"), 2: ("error", 500)}
        b.submit(job(3, "basic", 8))
        await asyncio.wait_for(b.idle(), 60)
        await asyncio.sleep(0.05)
        assert got[3] == ("done", "length") and b.rates()["rows_running"] == 0 and b.queue_depth == 0
    finally:
        await b.close()
