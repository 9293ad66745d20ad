"""No single request can take a worker (issue 29, items 1 and 2): a cost for every request checked at admission
(--max-request-cost), likelihood scoring in bounded chunks that stops when its client leaves, and a fair share of the
device between rows (long rows hold at most --long-row-share of a batch and step in a group of their own, charged
their forwards), so a small request is answered quickly while long ones run."""
import collections
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import TINY_LLADA
from tests.helpers import post_json, start_worker
from tests.test_worker_app import ready_client
from worker.engine import GenerationParams, Request
from worker.engine import likelihood

HOSTILE_SCORE = {"prompt": [5 + i % 280 for i in range(300)], "echo": True, "logprobs": 1, "max_tokens": 0, "mc_num": 4096,
                 "mc_batch_size": 4096}
LONG = {"prompt": "a", "max_tokens": 4000, "block_length": 1}
# a review's: copies of a two-token prompt cost 3 tokens each by their length, 4.7 M in all, and held a worker for
# four minutes (their random draws and bookkeeping); a copy costs at least MIN_FORWARD_TOKENS now
SHORT_SCORES = {"prompt": [[3, 8]] * 24, "echo": True, "logprobs": 0, "max_tokens": 0, "mc_num": 65536,
                "mc_batch_size": 4096, "context_length": 1}


async def test_costly_requests_are_refused_naming_the_limit(aiohttp_client):
    client, _ = await ready_client(aiohttp_client)
    for body in (HOSTILE_SCORE, SHORT_SCORES, {**LONG, "n": 3}, {**LONG, "temperature": 0.5, "n": 2, "cfg_scale": 1.0}):
        r = await client.post("/v1/completions", json=body)
        err = (await r.json())["error"]
        assert r.status == 400 and err["code"] == "request_too_costly", err
        assert "--max-request-cost 33,554,432" in err["message"] and "token-forwards" in err["message"]
    r = await client.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "echo": True, "logprobs": 1,
                                                   "max_tokens": 0, "mc_num": 8, "mc_batch_size": 8})
    assert r.status == 200
    # a review's: 128 choices of 256 tokens with 20 alternatives each (688,000 entries, 70 MB of JSON) cost 2% of the
    # limit and stopped the worker's event loop for tens of seconds; each entry now costs LOGPROB_ENTRY_COST
    many = {"messages": [{"role": "user", "content": "hi"}], "n": 128, "max_tokens": 256, "block_length": 256,
            "steps": 16, "logprobs": True, "top_logprobs": 20}
    r = await client.post("/v1/chat/completions", json=many)
    err = (await r.json())["error"]
    assert r.status == 400 and err["code"] == "request_too_costly" and err["param"] == "top_logprobs", err
    assert "top logprobs alternatives" in err["message"]
    r = await client.post("/v1/completions", json={"prompt": [5] * 8, "n": 128, "max_tokens": 256,
                                                   "block_length": 256, "steps": 16, "logprobs": 20})
    err = (await r.json())["error"]
    assert r.status == 400 and err["param"] == "logprobs", err          # (completions name their own field)
    r = await client.post("/v1/chat/completions", json={**many, "logprobs": False, "top_logprobs": None})
    assert r.status == 200          # (the same request without them: 553,000 token-forwards)
    from dataclasses import replace

    from worker.app import STATE
    from worker.engine.params import logprobs_cost     # the chosen tokens' own log-probabilities add nothing (RL)
    engine = client.server.app[STATE].serving.engine
    pl = engine.plan([5] * 8, GenerationParams(gen_length=64, block_length=64, logprobs=0))
    assert logprobs_cost(pl) == 0
    assert logprobs_cost(replace(pl, params=replace(pl.params, logprobs=2))) == 64 * 2 * 128
    client, _ = await ready_client(aiohttp_client, max_request_cost=1000)     # the limit is the operator's
    r = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 64})
    assert r.status == 400 and "--max-request-cost 1,000" in (await r.json())["error"]["message"]


def test_scoring_holds_one_chunk_of_rows_and_stops_when_cancelled(llada_engine, monkeypatch):
    """The Monte Carlo copies are drawn and forwarded a chunk of splits at a time (each forward's logits reduced to
    cross entropies at once), and a cancelled request stops after the chunk running, not after all of them."""
    monkeypatch.setattr(likelihood, "MAX_CHUNK_ROWS", 64)
    seen, forward = [], likelihood._forward_rows

    def spy(model, mask_id, cfg, items, *a, **k):
        seen.append(len(items))
        return forward(model, mask_id, cfg, items, *a, **k)
    monkeypatch.setattr(likelihood, "_forward_rows", spy)
    req = likelihood.ScoreRequest(list(range(5, 45)), list(range(20, 40)), mc_num=64, batch_size=64,
                                  check_greedy=False)
    full = likelihood.score(llada_engine.model, llada_engine.mask_id, [req])[0]
    # a chunk closes once it holds 64 rows (a split, at most 64 distinct rows here, is never cut)
    assert len(seen) > 5 and max(seen) < 64 + 64 and all(v < 0 for v in full.log_likelihoods)
    chunks = len(seen)
    # the same estimates as one chunk holding every split (the chunking changes no number beyond rounding)
    monkeypatch.setattr(likelihood, "MAX_CHUNK_ROWS", 1 << 20)
    one = likelihood.score(llada_engine.model, llada_engine.mask_id, [req])[0]
    assert one.log_likelihoods == pytest.approx(full.log_likelihoods, rel=1e-5, abs=1e-5)
    monkeypatch.setattr(likelihood, "MAX_CHUNK_ROWS", 64)
    seen.clear()
    gone = threading.Event()
    res = likelihood.score(llada_engine.model, llada_engine.mask_id, [req],
                           cancelled=lambda i: (len(seen) >= 2 and gone.set()) or gone.is_set())
    assert res == [None] and len(seen) == 2 < chunks


def test_long_rows_step_apart_and_short_rows_overtake_them(llada_engine):
    """Engine: with long_row_cost set, a short row joining beside long ones steps in a group of its own (its forwards
    hold it alone), takes several steps per step of theirs and finishes first; every row equals itself alone
    (exactness is kept). (A review found this test's "long" rows under the long-row cost it set: one group.)"""
    from tests.test_continuous import check_against_alone, run_staggered
    from worker.engine.params import row_cost
    llada_engine.long_row_cost = 1_000
    long = [Request([5, 6], GenerationParams(gen_length=64, block_length=8)) for _ in range(2)]
    short = Request([7, 8, 9], GenerationParams(gen_length=8, block_length=8))
    plan = lambda r: llada_engine.plan(r.prompt_ids, r.params)
    assert row_cost(plan(long[0])) > 1_000 >= row_cost(plan(short))
    model, rows_per_forward = llada_engine.model, []
    real = model.forward
    model.forward = lambda x, *a, **k: rows_per_forward.append(x.shape[0]) or real(x, *a, **k)
    try:
        feed = run_staggered(llada_engine, long, [(1, short)])
        del model.forward                                   # (the instance's override; the class's forward again)
        (i, _, _), = feed.joined
        assert list(feed.results)[0] == i      # the short row, joined after the first step, finished first
        # its 8 steps in forwards of its own, the long rows' forwards (2 rows) no more than 2 meanwhile
        assert rows_per_forward.count(1) == 8 and 3 not in rows_per_forward, rows_per_forward
        assert rows_per_forward[1:].index(1) < 3, rows_per_forward
        check_against_alone(llada_engine, long, [(1, short)])
    finally:
        if "forward" in vars(model):
            del model.forward
        llada_engine.long_row_cost = 0


@pytest.mark.slow
def test_a_small_request_is_answered_within_10s_while_long_ones_run(tmp_path):
    """The audit's case: ten 4000-step requests on a worker of batch size 8, then an 8-token request. Before: the
    long rows filled the batch and the small one waited past 30 s. Now it is answered within 10 s."""
    w = start_worker(tmp_path, TINY_LLADA, "--batch-size", "8", "--request-timeout", "60")
    pool = ThreadPoolExecutor(10)
    try:
        w.wait_ready(90)
        longs = [pool.submit(post_json, w.url + "/v1/completions", LONG, 40.0) for _ in range(10)]
        time.sleep(3)                                  # the long rows are running
        t0 = time.monotonic()
        status, body = post_json(w.url + "/v1/completions", {"prompt": "di vo", "max_tokens": 8}, timeout=30)
        took = time.monotonic() - t0
        assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
        print(f"\nFAIR SHARE: 8-token request beside 10 long rows answered in {took:.2f} s")
        assert took < 10, took
        assert not any(f.done() for f in longs)        # the long ones were still running
    finally:
        w.signal(signal.SIGKILL)       # not a drain: the long rows would take ~40 s more
        w.stop()
        pool.shutdown(wait=False, cancel_futures=True)


def test_long_rows_hold_at_most_their_share_of_a_batch_and_short_ones_overtake_them(llada_engine):
    import asyncio

    from worker.scheduler import Job, RowScheduler
    b = RowScheduler(llada_engine, batch_size=4, loop=asyncio.new_event_loop(), long_row_cost=100, long_row_share=0.5)
    p = GenerationParams(gen_length=8, block_length=8)
    jobs = [Job([5], p, sink=None, index=i, cost=1000 if i < 5 else 10) for i in range(7)]   # 5 long, 2 short
    b.pending.extend(jobs)
    taken = b._take(0, 0, 0, first=True)
    assert taken == [jobs[0], jobs[1], jobs[5], jobs[6]]          # two long (half of 4), then the short ones
    assert list(b.pending) == jobs[2:5]                            # the long ones wait, in order
    assert b._take(3, 0, 2) == [] and b._take(3, 0, 1) == [jobs[2]]


def test_a_request_of_many_rows_takes_the_free_places_in_turn_with_later_requests(llada_engine):
    """A review: one completion of 1,024 short prompts (well under every limit) held a 4-token request that came 2 s
    later for 48 s, as the queue was taken in order, row by row. Rows are taken in turns now: each request's first
    row, then each one's second, ..."""
    import asyncio

    from worker.scheduler import Job, RowScheduler
    b = RowScheduler(llada_engine, batch_size=3, loop=asyncio.new_event_loop())
    p = GenerationParams(gen_length=8, block_length=8)

    class Run:                        # a request: its rows share its sink
        def on_row(self, *a):
            pass
    big, small, other = Run(), Run(), Run()
    rows = [Job([5], p, sink=big.on_row, index=i) for i in range(6)]
    late = Job([5], p, sink=small.on_row, index=0)
    pair = [Job([5], p, sink=other.on_row, index=i) for i in range(2)]
    b.pending.extend(rows + [late] + pair)
    first = b._take(0, 0, 0, first=True)
    assert first == [rows[0], late, pair[0]]
    b.running = list(first)
    b.running.remove(late)                           # the small request is answered: a place is free
    assert b._take(2, 0, 0) == [rows[1]]             # one row running each: the request that came first
    b.running.append(rows[1])
    b.running.remove(pair[0])
    assert b._take(2, 0, 0) == [pair[1]]             # the request with fewer rows running goes first
    assert list(b.pending) == rows[2:]                 # the big one's remaining rows, in their order
    single = [Job([5], p, sink=Run().on_row) for _ in range(3)]
    b.pending = collections.deque(single)            # requests of one row each: the order they came in
    assert b._take(0, 0, 0, first=True) == single


def test_many_forwards_over_a_tiny_canvas_are_not_nearly_free():
    """Dream runs `steps` uncapped: a million forwards over a 4-token sequence cost 4 M token-forwards, under the
    default limit, and ran for about 25 minutes. Each forward costs at least MIN_FORWARD_TOKENS now."""
    from tests.conftest import TINY_DREAM
    from worker.engine import Engine
    from worker.engine.params import MIN_FORWARD_TOKENS, row_cost
    engine = Engine.from_pretrained(TINY_DREAM, device="cpu")
    pl = engine.plan([5], GenerationParams(gen_length=3, steps=1 << 20, algorithm="dream"))
    assert row_cost(pl) == (1 << 20) * MIN_FORWARD_TOKENS > 1 << 25        # over the default --max-request-cost
    pl = engine.plan([5] * 100, GenerationParams(gen_length=28, algorithm="dream"))
    assert row_cost(pl) == 28 * 128                                          # a real forward counts its tokens


def test_a_cancelled_row_leaves_at_once_even_when_its_group_waits_for_its_turn(llada_engine, monkeypatch):
    """Cancellation used to be checked only at the top of a row's own group's step. A long row's group steps only
    when its charged device time is the lowest, so a cancelled long row held its place in the batch, its tokens in
    the admission count and its answer for 50 of the short rows' steps (a reviewer's finding). It is now answered
    "cancelled" after the step during which its client left, whichever group took it."""
    from worker.engine import StepHooks
    monkeypatch.setattr(llada_engine, "long_row_cost", 10_000)
    cancelled, log = set(), []

    class Feed:
        asks, nxt, cancel_ask, done_at = 0, 1, None, None

        def admit(self, rows, tokens):
            self.asks += 1
            log.append((self.asks, tokens))
            if self.asks == 3:
                cancelled.add(0)                # the long row's client goes away
                self.cancel_ask = self.asks
            if self.asks < 40:                  # a steady stream of short rows
                self.nxt += 1
                return [(self.nxt - 1, Request([7, 8, 9], GenerationParams(gen_length=4, block_length=4, steps=4)))]
            return []

        def done(self, i, r):
            if i == 0:
                assert r.finish_reason == "cancelled"
                self.done_at = self.asks

    f = Feed()
    llada_engine.generate([Request([5, 6] * 50, GenerationParams(gen_length=256, block_length=32, steps=256))],
                          hooks=StepHooks(is_cancelled=lambda i: i in cancelled), feed=f)
    assert f.done_at == f.cancel_ask          # answered before the next admission
    assert all(t < 100 for a, t in log if a > f.cancel_ask)      # its 358 tokens no longer counted


def test_a_row_cancelled_after_the_feed_gave_it_never_runs(llada_engine):
    """A row the feed handed over waits in its group's inbox until the group's next step; a client that left in
    between got a forward, step and progress events, and could be answered "length" with tokens (a reviewer's
    finding). It is answered "cancelled" with no forward and no event."""
    from worker.engine import StepHooks
    cancelled, events = set(), []

    class Feed:
        asks = 0

        def admit(self, rows, tokens):
            self.asks += 1
            if self.asks == 1:
                cancelled.add(1)       # gone right after the scheduler took its row
                return [(1, Request([7, 8, 9], GenerationParams(gen_length=8, block_length=8, steps=1,
                                                                threshold=0.01)))]
            return []

        def done(self, i, r):
            events.append((i, "done", r.finish_reason, r.nfe, r.token_ids))

    hooks = StepHooks(on_progress=lambda i, ids: events.append((i, "progress")), is_cancelled=lambda i: i in cancelled,
                      on_step=lambda i, w, s: events.append((i, "step")), steps_for=lambda i: True)
    llada_engine.generate([Request([5, 6], GenerationParams(gen_length=16, block_length=8, steps=16))], hooks=hooks,
                          feed=Feed())
    assert [e for e in events if e[0] == 1] == [(1, "done", "cancelled", 0, [])]


def test_a_threshold_rows_blocks_count_every_step_they_may_take(llada_engine):
    """Under a threshold or factor rule a LLaDA-family block runs until it has no mask, whatever ``steps`` says:
    ``steps: 1`` with ``threshold: 1.0`` was counted one forward a block and ran a block's length of them (a
    review: 128 choices of a 4,088-token canvas admitted at 523,000 token-forwards, about 2.1 billion run). Each
    block now counts ``block_length`` forwards for those rules, in every algorithm of that loop."""
    from worker.engine.params import row_cost
    for alg in ("basic", "prefix_cache", "dual_cache", "dinfer_blockwise"):
        for rule in ({"threshold": 1.0}, {"factor": 1.0}, {}):
            if alg.startswith("dinfer") and "threshold" not in rule:
                continue                                  # (dInfer's decoders: a threshold, always)
            p = GenerationParams(gen_length=256, block_length=64, steps=1, algorithm=alg, **rule)
            pl = llada_engine.plan([5] * 32, p)
            forwards = 4 * 64 if rule else 4 * 1
            assert row_cost(pl) == forwards * (32 + 256), (alg, rule)
    r = llada_engine.generate([Request([5] * 32, GenerationParams(gen_length=64, block_length=64, steps=1,
                                                                  threshold=1.0, ignore_eos=True))])[0]
    assert r.nfe > 1 and r.nfe <= 64                 # what it ran: more than its steps, at most what it was counted


async def test_a_long_row_waiting_for_token_room_does_not_hold_the_short_rows_behind_it():
    """--max-batch-tokens 600: a long row runs (260 tokens), a second long row (516) waits for its room, then a
    short row (12) comes. The second one stopped the taking, so the short row waited for the first long row's end
    (a review: 0.09 s alone, 1.09 s behind it). A long row that waits for room a long row running holds is passed
    over now; the short row joins at once. (A simulated device: a test double.)"""
    import asyncio
    from worker.scheduler import Job, RowScheduler
    from worker.simulated import SimulatedEngine
    eng = SimulatedEngine(str(TINY_LLADA), 0.004, 0.0, per_step=True)
    b = RowScheduler(eng, batch_size=8, max_wait_time=0.0, max_batch_tokens=600, long_row_cost=10_000,
                     long_row_share=0.5)
    b.start()
    done = {}

    def job(prompt, gen, name):
        p = GenerationParams(gen_length=gen, block_length=gen, steps=gen)
        return Job(list(prompt), p, sink=lambda i, k, payload: done.setdefault(name, time.monotonic())
                   if k == "done" else None, cost=gen * max(64, len(prompt) + gen))
    try:
        b.submit(job([5] * 4, 256, "L1"), wait=False)        # 260 tokens, 66,560 token-forwards: long
        await asyncio.sleep(0.05)
        b.submit(job([5] * 4, 512, "L2"), wait=False)        # 516 tokens: not beside L1 under 600
        b.submit(job([6] * 4, 8, "S"), wait=False)           # 12 tokens: short
        for _ in range(1000):
            if len(done) == 3:
                break
            await asyncio.sleep(0.01)
        assert sorted(done, key=done.get) == ["S", "L1", "L2"], done
    finally:
        await b.close()


async def test_a_failure_outside_the_engines_call_answers_the_rows_that_joined_too(monkeypatch):
    """The scheduler's last resort (an error the batch's own handling did not catch, here the out-of-memory clean-up
    failing) answered the rows the batch started with: a row that had joined was never answered until its
    --request-timeout, and one already answered was answered again (a review). Now every row not answered yet gets
    the 500, once. (A simulated device and a simulated out-of-memory error: test doubles.)"""
    import asyncio

    import torch
    from worker.scheduler import Job, RowScheduler
    from worker.simulated import SimulatedEngine
    eng = SimulatedEngine(str(TINY_LLADA), 0.002, 0.0, per_step=True)
    real = eng.generate

    def generate(requests, feed=None, **kw):
        admit, joined = feed.admit, []

        def admit_then_fail(rows, tokens):
            if joined:
                raise torch.cuda.OutOfMemoryError("simulated")
            got = admit(rows, tokens)
            joined.extend(got)
            return got
        feed.admit = admit_then_fail
        return real(requests, feed=feed, **kw)
    eng.generate = generate
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: (_ for _ in ()).throw(RuntimeError("driver gone")))
    b = RowScheduler(eng, batch_size=4, max_wait_time=0.0)
    b.start()
    answers = []

    def sink(i, kind, payload):
        if kind in ("done", "error"):
            answers.append((i, kind))
    p = GenerationParams(gen_length=64, block_length=64, steps=64)
    try:
        b.submit(Job([5, 6], p, sink, index=0), wait=False)
        await asyncio.sleep(0.03)
        b.submit(Job([7, 8], p, sink, index=1), wait=False)      # joins the running batch
        for _ in range(500):
            if len(answers) == 2:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert sorted(answers) == [(0, "error"), (1, "error")], answers
    finally:
        await b.close()


def test_the_token_budget_counts_what_a_row_holds(llada_engine, sdar_engine):
    """--max-batch-tokens counted prompt + canvas for every row: a row with classifier-free guidance holds twice that
    (its unconditional copy), and a block-causal row whole blocks from its prompt's first token (a review)."""
    from worker.scheduler import Job, canvas_tokens
    assert canvas_tokens(Job([5] * 10, GenerationParams(gen_length=20, block_length=8), None), llada_engine) == 34
    cfg = GenerationParams(gen_length=20, block_length=8, cfg_scale=1.0)
    assert canvas_tokens(Job([5] * 10, cfg, None), llada_engine) == 68
    sdar = GenerationParams(gen_length=1, block_length=32, algorithm="sdar")
    assert canvas_tokens(Job([5] * 1000, sdar, None), sdar_engine) == 1024


async def test_a_scoring_request_takes_turns_with_generation_rows(llada_engine):
    """A scoring request ran apart and to its end: a generation request that came meanwhile waited for all of it (a
    review: a 4-token request waited 3.5 s behind one costing 1.2% of --max-request-cost). Now its forwards take
    turns with the generation rows' steps in the fair share (each charged its share of the forward's tokens): the
    8-token request joins, takes its steps and is answered while the scoring request has forwards left, and both
    equal their runs alone. Scoring requests queued while the first runs wait in the queue for its end (they share
    the next group's forwards) and hold no place meanwhile: with two places, the second goes to the generation
    request queued behind them (taken into the running group's inbox, they held it: a review); one cancelled
    there is answered at once, never scored."""
    import asyncio
    from worker.scheduler import Job, RowScheduler
    model, mask = llada_engine.model, llada_engine.mask_id
    big = likelihood.ScoreRequest(list(range(5, 45)), [20, 30], mc_num=2048, batch_size=64, check_greedy=False)
    small = likelihood.ScoreRequest(list(range(7, 19)), [6], mc_num=8, batch_size=8)
    alone = likelihood.score(model, mask, [big])[0], likelihood.score(model, mask, [small])[0]
    gen = GenerationParams(gen_length=8, block_length=8)
    gen_alone = llada_engine.generate([Request([7, 8, 9], gen)])[0]
    rows, real = [], model.forward
    model.forward = lambda x, *a, **k: rows.append(x.shape[0]) or real(x, *a, **k)
    b = RowScheduler(llada_engine, batch_size=2, max_wait_time=0.0)
    got = {}

    def sink(name):
        return lambda i, kind, payload: got.setdefault(name, (kind, payload, len(rows))) if kind != "progress" else 0
    b.start()
    try:
        b.submit(Job(big.ids, None, sink("big"), score=big), wait=False)
        while not rows:
            await asyncio.sleep(0.001)
        b.submit(Job(small.ids, None, sink("small"), score=small), wait=False)
        gone = Job(small.ids, None, sink("gone"), score=small)
        b.submit(gone, wait=False)
        b.submit(Job([7, 8, 9], gen, sink("gen")), wait=False)
        while "gen" not in got:
            await asyncio.sleep(0.001)
        b.cancel(gone)
        await asyncio.wait_for(b.idle(), 60)
    finally:
        await b.close()
        del model.forward
    kind, res, at = got["gen"]
    assert kind == "done" and (res.token_ids, res.nfe) == (gen_alone.token_ids, gen_alone.nfe)
    forwards_left = rows[at:].count(64)
    assert forwards_left >= 10 and rows[:at].count(1) == gen_alone.nfe, (at, rows)   # answered amid the scoring
    assert got["big"][0] == "done" and got["big"][1].log_likelihoods == alone[0].log_likelihoods
    assert got["small"][0] == "done" and got["small"][2] >= got["big"][2]          # the next group's
    assert (got["small"][1].log_likelihoods, got["small"][1].greedy) == (alone[1].log_likelihoods, alone[1].greedy)
    assert got["gone"][0] == "done" and got["gone"][1].finish_reason == "cancelled" and got["gone"][2] < len(rows)
    assert b.running == [] and (b.rows_retired, b.dropped_before_start) == (3, 1)


def test_a_scoring_turn_is_one_forward_or_one_mini_batch_of_draws_and_keeps_no_activations(llada_engine):
    """Beside generation rows a scoring request's turn was a forward plus every random draw of its next chunk (1.5
    s for one chunk of a 200-token request at mc_num 4,096) and it kept the forward's activations alive while the
    generation rows took their turns (a review). A turn is now one forward, or one mini-batch of draws, and no
    forward's hidden states outlive it; the scores are unchanged."""
    import weakref
    model, mask = llada_engine.model, llada_engine.mask_id
    req = likelihood.ScoreRequest(list(range(5, 45)), [20, 30], mc_num=256, batch_size=32, check_greedy=True)
    alone = likelihood.score(model, mask, [req])[0]
    hidden, real = [], model.forward
    model.forward = lambda x, *a, **k: (lambda h: hidden.append(weakref.ref(h)) or h)(real(x, *a, **k))
    try:
        steps, turns, results = likelihood.score_steps(model, mask, [req]), 0, None
        while results is None:
            seen = len(hidden)
            try:
                next(steps)
            except StopIteration as end:
                results = end.value
                break
            turns += 1
            assert len(hidden) - seen <= 1                          # at most one forward a turn
            assert all(h() is None for h in hidden), turns          # its activations gone before the next turn
    finally:
        del model.forward
    assert turns >= len(hidden) + 2 * 256 // 32                     # and a turn for each mini-batch's draws
    assert (results[0].log_likelihoods, results[0].greedy) == (alone.log_likelihoods, alone.greedy)
