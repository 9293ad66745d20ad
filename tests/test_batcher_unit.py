"""The central batcher (balancer/batcher.py) on its own: a pool and a batcher over fault-injecting fake workers
(tests/fakes.py), no balancer app and no probe loop (each worker is probed once, so it is ready)."""
import asyncio
import contextlib

import aiohttp
from aiohttp import web
import pytest

from balancer.batcher import BatchConfig, CentralBatcher, Pending
from balancer.policy import POLICIES, Policy
from balancer.pool import HealthConfig, WorkerPool
from tests.fakes import fake_worker, workers
from tests.helpers import free_port


@contextlib.asynccontextmanager
async def batcher_over(*apps, dead_first: bool = False, **cfg):
    """A started batcher over one fake worker per app (ready); ``dead_first``: worker 0 is a port nobody listens on,
    once ready (as if it died since)."""
    async with workers(*apps) as urls, aiohttp.ClientSession() as session:
        if dead_first:
            urls = [f"http://127.0.0.1:{free_port()}", *urls]
        pool = WorkerPool(urls, lambda: session, HealthConfig())
        for w in pool.workers:
            await pool.probe(w, session)
        if dead_first:
            pool.workers[0].ever_ready = True
        b = CentralBatcher(pool, lambda: session, BatchConfig(**{"batch_size": 8, "wait_time": 0.01, **cfg}))
        b.start()
        try:
            yield pool, b
        finally:
            await b.close()


def request(rid: str) -> Pending:
    return Pending(id=rid, kind="completion", body=b'{"prompt": "x"}', stream=False)


async def answer(p: Pending) -> tuple:
    _, event, status, data, end = await asyncio.wait_for(p.next(), 10)
    assert end
    return event, status, data["choices"][0]["text"] if status == 200 else data["error"]["message"]


def spy_on_failures(pool: WorkerPool, monkeypatch) -> list:
    """Records each ``pool.batch_failed`` call as (worker index, keyword arguments), then makes it."""
    reports, real = [], pool.batch_failed
    monkeypatch.setattr(pool, "batch_failed", lambda w, why, **kw: reports.append((w.index, kw)) or real(w, why, **kw))
    return reports


class Reverse(Policy):
    """Prefers the highest worker index; records what it was offered."""
    offered: list = []

    def rank(self, free):
        Reverse.offered.append(sorted(w.index for w in free))
        return sorted(free, key=lambda w: -w.index)


@pytest.fixture
def reverse(monkeypatch):
    monkeypatch.setitem(POLICIES, "reverse", Reverse)
    monkeypatch.setattr(Reverse, "offered", [])
    return Reverse


async def test_the_batch_goes_to_the_worker_the_policy_ranks_first(reverse):
    seen0, seen1 = [], []
    async with batcher_over(fake_worker("ok", seen0), fake_worker("ok", seen1), routing_policy="reverse") as (_, b):
        assert isinstance(b.policy, Reverse)
        p = request("a")
        b.submit(p)
        assert await answer(p) == ("response", 200, "ok-completion")
        assert seen1 == [("ok", "a")] and seen0 == []        # least_loaded would have taken worker 0
        assert reverse.offered == [[0, 1]]


async def test_by_default_the_least_loaded_worker_gets_the_batch():
    seen0, seen1 = [], []
    async with batcher_over(fake_worker("ok", seen0), fake_worker("ok", seen1)) as (pool, b):
        pool.batch_started(pool.workers[0], 1)           # worker 0 holds a row (a batch the test pretends is out)
        p = request("a")
        b.submit(p)
        assert await answer(p) == ("response", 200, "ok-completion")
        assert seen1 == [("ok", "a")] and seen0 == []
        pool.batch_ended(pool.workers[0], 1)


async def test_a_request_that_failed_on_the_first_ranked_worker_goes_to_the_next(reverse):
    seen0, seen1 = [], []
    async with batcher_over(fake_worker("ok", seen0), fake_worker("ok", seen1), routing_policy="reverse") as (_, b):
        p = request("a")
        p.excluded.add(1)
        b.submit(p)
        assert await answer(p) == ("response", 200, "ok-completion")
        assert seen0 == [("ok", "a")] and seen1 == []


def test_an_unknown_policy_fails_at_construction():
    with pytest.raises(ValueError, match="least_loaded"):
        CentralBatcher(WorkerPool([], lambda: None, HealthConfig()), lambda: None,
                       BatchConfig(routing_policy="nope"))


async def test_a_broken_batch_is_reported_to_the_pool_and_fails_over(monkeypatch):
    seen = []
    async with batcher_over(fake_worker("die", seen), fake_worker("ok", seen)) as (pool, b):
        reports = spy_on_failures(pool, monkeypatch)
        p = request("a")
        b.submit(p)
        assert await answer(p) == ("response", 200, "ok-completion")
        assert seen == [("die", "a"), ("ok", "a.3")]       # a dispatch after the first: "ID.ATTEMPT" on the wire
        assert reports == [(0, {"consecutive": True, "refused": False})]
        w0 = pool.workers[0]
        assert (w0.errors, w0.consecutive_errors, w0.status) == (1, 1, "idle")   # one broken stream: not down
        assert p.excluded == {0} and p.tries == 2 and b.retries == 1


async def dispatched(b, seen: list):
    """Submit one request and wait until a (fake) worker has it."""
    p = request("a")
    b.submit(p)
    async with asyncio.timeout(5):
        while not seen:
            await asyncio.sleep(0.01)
    return p


async def test_a_refused_dispatch_marks_the_worker_down_through_the_pool(monkeypatch):
    seen = []
    async with batcher_over(fake_worker("ok", seen), dead_first=True) as (pool, b):
        reports = spy_on_failures(pool, monkeypatch)
        p = request("a")
        b.submit(p)
        assert await answer(p) == ("response", 200, "ok-completion")
        assert reports == [(0, {"consecutive": True, "refused": True})]
        assert pool.workers[0].status == "unhealthy" and seen == [("ok", "a.3")]
        assert [w.inflight_batches for w in pool.workers] == [0, 0]


async def test_the_pools_abort_fails_an_in_flight_batch_over(caplog):
    seen = []
    async with batcher_over(fake_worker("hang", seen), fake_worker("ok", seen)) as (pool, b):
        p = await dispatched(b, seen)
        assert seen == [("hang", "a")] and pool.workers[0].inflight_rows == 1
        pool.abort(pool.workers[0], "stalled")
        assert await answer(p) == ("response", 200, "ok-completion")
        assert seen == [("hang", "a"), ("ok", "a.3")] and p.excluded == {0} and b.retries == 1
        assert "batch on worker 0 failed (worker stalled)" in caplog.text
        assert pool.workers[0].errors == 0                  # the pool judged the worker already; no double count


async def test_any_other_cancellation_of_a_dispatch_fails_over_too(caplog):
    seen = []
    async with batcher_over(fake_worker("hang", seen), fake_worker("ok", seen)) as (pool, b):
        p = await dispatched(b, seen)
        [d] = b._dispatches
        d.task.cancel()
        assert await answer(p) == ("response", 200, "ok-completion")
        assert "batch on worker 0 failed (dispatch cancelled)" in caplog.text


async def test_a_dispatch_aborted_before_its_first_step_goes_back_to_the_front_of_the_queue():
    seen = []
    async with batcher_over(fake_worker("ok", seen)) as (pool, b):
        b._task.cancel()                                # no loop: the queue stays as the test leaves it
        await asyncio.gather(b._task, return_exceptions=True)
        w = pool.workers[0]
        first, second, queued = request("first"), request("second"), request("queued")
        b.submit(queued)
        b._start_dispatch(w, [first, second])
        assert (w.inflight_batches, w.inflight_rows) == (1, 2)
        pool.abort(w, "connection refused")            # before the dispatch task's first step
        await asyncio.sleep(0.01)
        assert list(b.queue) == [first, second, queued]
        assert (w.inflight_batches, w.inflight_rows) == (0, 0) and not b._dispatches
        assert (first.attempt, first.tries, first.excluded) == (0, 0, set())   # not an attempt: no retry spent
        assert seen == [] and b.retries == 0


async def test_closing_cancels_dispatches_without_failing_them_over():
    seen = []
    async with batcher_over(fake_worker("hang", seen), fake_worker("ok", seen)) as (pool, b):
        p = await dispatched(b, seen)
        await b.close()
        assert not b.queue and not p.events and b.retries == 0 and seen == [("hang", "a")]
        assert pool.workers[0].inflight_batches == 0


async def test_an_idle_worker_takes_a_request_at_once_a_busy_one_lets_a_batch_form():
    """--idle-dispatch (the default): a request that finds a worker with nothing in flight goes at once, whatever
    --batch-wait-time; while the worker is busy the next requests wait and go together. Without it, a lone request
    waits for --batch-wait-time."""
    batches = []

    def sizes(app):           # records each /worker/batch call's size
        @web.middleware
        async def spy(request, handler):
            if request.path == "/worker/batch":
                batches.append(len((await request.json())["requests"]))
            return await handler(request)
        app.middlewares.append(spy)
        return app

    async with batcher_over(sizes(fake_worker("ok", [], delay=0.4)), wait_time=0.25) as (_, b):
        loop = asyncio.get_running_loop()
        t = loop.time()
        first = request("a")
        b.submit(first)
        await asyncio.sleep(0.05)          # "a" is on the worker (0.4 s): the worker is busy, not idle
        later = [request(r) for r in "bc"]
        for p in later:
            b.submit(p)
        assert await answer(first) == ("response", 200, "ok-completion")
        assert loop.time() - t < 0.45      # sent at once (0.4 s on the worker), not after the 0.25 s wait first
        for p in later:
            assert (await answer(p))[1] == 200
        assert batches == [1, 2]           # b and c waited while the worker was busy, then went together
    async with batcher_over(fake_worker("ok", []), wait_time=0.25, idle_dispatch=False) as (_, b):
        t = asyncio.get_running_loop().time()
        p = request("a")
        b.submit(p)
        assert (await answer(p))[1] == 200
        assert asyncio.get_running_loop().time() - t >= 0.25


async def test_a_full_batch_and_a_freed_place_dispatch_without_waiting_for_the_loop():
    """Under load the batching loop's wake-up waits behind every ready callback of the event loop: a batch that
    fills up, and the place a finished batch frees, start their dispatch in the same turn instead (the code that
    filled the batch or ended the dispatch starts the next one)."""
    seen = []
    async with batcher_over(fake_worker("ok", seen, delay=0.05), batch_size=2, wait_time=5.0, idle_dispatch=False,
                            max_inflight_per_worker=1) as (pool, b):
        ps = [request(r) for r in "abcd"]
        b.submit(ps[0])
        assert not b._dispatches                    # half a batch waits (5 s) for its second request
        b.submit(ps[1])
        [first] = b._dispatches                     # full: dispatched by submit itself
        assert first.batch == ps[:2]
        b.submit(ps[2])
        b.submit(ps[3])                              # a full batch, but the only place is taken
        assert [d.batch for d in b._dispatches] == [ps[:2]] and list(b.queue) == ps[2:]
        await first.task
        [second] = b._dispatches                    # started as the first ended, before the loop's next turn
        assert second.batch == ps[2:] and not b.queue
        for p in ps:
            assert (await answer(p))[:2] == ("response", 200)
        assert [rid for _, rid in seen] == list("abcd")
        assert pool.workers[0].inflight_batches == 0
