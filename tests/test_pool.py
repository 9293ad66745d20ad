"""The worker pool's state machine (balancer/pool.py), one probe at a time against an in-process /health server (a
test double whose answer the test sets), and what the batcher reports to it. No probe loop runs: each test calls
``pool.probe`` itself, so every transition is deterministic."""
import contextlib
import time

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from balancer.pool import HealthConfig, WorkerPool
from tests.helpers import free_port

READY = {"status": "ready", "busy": False, "seconds_since_last_step": 0.0}


@contextlib.asynccontextmanager
async def pool_with(answer: dict, urls: list[str] | None = None, **health):
    """A pool of one worker whose /health answers ``answer["body"]`` (a dict as JSON, a str as text), plus ``urls``;
    and the list of ``on_abort`` calls."""
    async def handler(request):
        body = answer["body"]
        return web.json_response(body) if isinstance(body, dict) else web.Response(text=body)
    app = web.Application()
    app.router.add_get("/health", handler)
    server = TestServer(app)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            pool = WorkerPool([str(server.make_url("")), *(urls or [])], lambda: session,
                              HealthConfig(**{"unhealthy_threshold": 3, "healthy_threshold": 2, **health}))
            aborts = []
            pool.on_abort = lambda w, why: aborts.append((w.index, why))
            pool.probe_once = lambda w=pool.workers[0]: pool.probe(w, session)
            yield pool, aborts
    finally:
        await server.close()


async def test_a_worker_is_starting_until_its_first_ready_probe():
    answer = {"body": {"status": "loading"}}
    async with pool_with(answer) as (pool, _):
        w = pool.workers[0]
        await pool.probe_once()
        assert w.status == "starting" and not w.healthy and not pool.any_healthy()
        answer["body"] = READY
        pool.changed.clear()
        await pool.probe_once()
        assert w.status == "idle" and w.ever_ready and pool.healthy() == [w]
        assert pool.changed.is_set()                 # the batcher's loop is woken after every probe


async def test_an_idle_worker_is_unhealthy_after_the_threshold_of_failed_probes_and_readmitted_after_good_ones():
    answer = {"body": READY}
    async with pool_with(answer) as (pool, aborts):
        w = pool.workers[0]
        await pool.probe_once()
        answer["body"] = "not json"
        for _ in range(2):
            await pool.probe_once()
            assert w.status == "idle"               # 1 and 2 failures: below unhealthy_threshold=3
        await pool.probe_once()
        assert w.status == "unhealthy" and w.down and w.consecutive_errors == 3 and not pool.any_healthy()
        assert aborts == []                          # it held no work
        answer["body"] = READY
        await pool.probe_once()
        assert w.status == "unhealthy"              # one good probe: below healthy_threshold=2
        answer["body"] = "not json"
        await pool.probe_once()                      # a failure in between starts the count again
        answer["body"] = READY
        await pool.probe_once()
        assert w.status == "unhealthy"
        await pool.probe_once()
        assert w.status == "idle" and not w.down and w.consecutive_errors == 0


async def test_failed_probes_do_not_mark_a_worker_holding_work_down():
    answer = {"body": READY}
    async with pool_with(answer) as (pool, aborts):
        w = pool.workers[0]
        await pool.probe_once()
        pool.batch_started(w, 3)
        answer["body"] = "not json"
        for _ in range(5):
            await pool.probe_once()
        assert w.status == "busy" and w.consecutive_errors == 5 and aborts == []
        pool.batch_ended(w, 3)
        await pool.probe_once()
        assert w.status == "unhealthy"


async def test_a_refused_connection_marks_a_ready_worker_down_at_once_and_aborts_its_work():
    dead = f"http://127.0.0.1:{free_port()}"
    async with pool_with({"body": READY}, [dead]) as (pool, aborts):
        w = pool.workers[1]
        await pool.probe_once(w)
        assert w.status == "starting" and not w.down and aborts == []    # never ready: nothing to abort
        w.ever_ready = True                          # as if it had answered before (the pool's own path is above)
        await pool.probe_once(w)
        assert w.status == "unhealthy" and aborts == [(1, "connection refused")]
        await pool.probe_once(w)
        assert aborts == [(1, "connection refused")]                   # once, not on every refused probe


async def test_another_server_on_the_port_counts_as_refused():
    answer = {"body": {**READY, "launch_id": "ours"}}
    async with pool_with(answer) as (pool, aborts):
        w = pool.workers[0]
        w.launch_id = "ours"
        await pool.probe_once()
        assert w.status == "idle"
        answer["body"] = {**READY, "launch_id": "someone else"}
        await pool.probe_once()
        assert w.status == "unhealthy" and aborts == [(0, "connection refused")]


async def test_a_worker_without_progress_while_holding_work_stalls_and_its_work_is_aborted():
    answer = {"body": READY}
    async with pool_with(answer, stall_timeout=5.0) as (pool, aborts):
        w = pool.workers[0]
        await pool.probe_once()
        pool.batch_started(w, 2)
        answer["body"] = {"status": "ready", "busy": True, "seconds_since_last_step": 1.0}
        await pool.probe_once()
        assert w.status == "busy" and aborts == []  # its last step was 1 s ago: progressing
        answer["body"] = {"status": "ready", "busy": True, "seconds_since_last_step": 30.0}
        w.last_progress = time.monotonic() - 30.0   # the last step the balancer knows of is as old
        await pool.probe_once()
        assert w.status == "stalled" and aborts == [(0, "stalled")] and not pool.any_healthy()
        pool.batch_ended(w, 2)                       # the batcher failed the batch over
        answer["body"] = READY                       # idle and answering: progress again
        await pool.probe_once()
        assert w.status == "stalled"
        await pool.probe_once()
        assert w.status == "idle" and not w.stalled


async def test_a_stalled_worker_whose_probes_then_fail_shows_unhealthy():
    """Stalled (it held work and made no progress), its work failed over, then its probes fail: the log says
    unhealthy and so does its status (a review found `stalled` shown until it was re-admitted)."""
    answer = {"body": READY}
    async with pool_with(answer, stall_timeout=5.0) as (pool, aborts):
        w = pool.workers[0]
        await pool.probe_once()
        pool.batch_started(w, 1)
        w.last_progress = time.monotonic() - 30.0
        answer["body"] = {"status": "ready", "busy": True, "seconds_since_last_step": 30.0}
        await pool.probe_once()
        assert w.status == "stalled"
        pool.batch_ended(w, 1)
        answer["body"] = "not json"
        for _ in range(3):
            await pool.probe_once()
        assert w.down and w.status == "unhealthy"


async def test_a_worker_whose_process_exited_is_down_at_once_and_its_work_fails_over():
    """Its launcher saw the process exit (balancer/supervisor.py): down at once, its dispatches aborted, where a probe
    took up to an interval (a review saw a killed worker shown idle for 1.4 s); a new process ready again is
    re-admitted by its probes."""
    answer = {"body": READY}
    async with pool_with(answer) as (pool, aborts):
        w = pool.workers[0]
        await pool.probe_once()
        pool.batch_started(w, 1)
        pool.process_exited(w, "its process exited (code -9)")
        assert w.status == "unhealthy" and not pool.any_healthy()
        assert aborts == [(0, "its process exited (code -9)")]
        pool.batch_ended(w, 1)
        for _ in range(2):                       # healthy_threshold 2
            await pool.probe_once()
        assert w.status == "idle" and pool.any_healthy()


async def test_without_a_listener_abort_does_nothing():
    async with pool_with({"body": READY}) as (pool, _):
        pool.on_abort = None
        pool.abort(pool.workers[0], "stalled")


async def test_load_the_batcher_reports():
    async with pool_with({"body": READY}) as (pool, _):
        w = pool.workers[0]
        await pool.probe_once()
        before = time.monotonic()
        pool.batch_started(w, 3)
        pool.batch_started(w, 2)
        assert (w.inflight_batches, w.inflight_rows, w.status) == (2, 5, "busy") and w.last_dispatch >= before
        pool.changed.clear()
        pool.batch_ended(w, 3)
        assert (w.inflight_batches, w.inflight_rows) == (1, 2) and pool.changed.is_set()
        w.last_progress = 0.0
        pool.batch_progress(w)
        assert w.last_progress >= before and w.last_activity == w.last_progress
        pool.row_served(w)              # one row of the batch answered: no longer in flight there
        assert w.inflight_rows == 1
        pool.batch_ended(w, 1)          # (the batch takes the rows left)
        snap = w.snapshot()
        assert (snap["status"], snap["in_flight"], snap["requests_served"]) == ("idle", 0, 1)


async def test_batch_failures_count_against_the_worker_and_a_refused_one_marks_it_down():
    answer = {"body": READY}
    async with pool_with(answer) as (pool, aborts):
        w = pool.workers[0]
        pool.batch_failed(w, "ClientConnectorError: refused", consecutive=True, refused=True)
        assert not w.down and w.status == "starting"    # never ready: not "down"
        await pool.probe_once()
        assert (w.errors, w.consecutive_errors, w.status) == (1, 0, "idle")   # a good probe resets the run
        pool.batch_failed(w, "worker answered 500: boom")
        assert (w.errors, w.consecutive_errors, w.status) == (2, 0, "idle")
        pool.batch_failed(w, "ServerDisconnectedError", consecutive=True)
        assert (w.errors, w.consecutive_errors, w.status) == (3, 1, "idle")
        # broken batches count with failed probes toward unhealthy_threshold (3): two failed probes suffice now
        answer["body"] = "not json"
        await pool.probe_once()
        assert w.status == "idle"
        await pool.probe_once()
        assert w.status == "unhealthy"
        answer["body"] = READY
        await pool.probe_once()
        await pool.probe_once()
        assert w.status == "idle"
        pool.batch_failed(w, "ClientConnectorError: refused", consecutive=True, refused=True)
        assert w.status == "unhealthy" and w.errors == 4
        assert aborts == []                  # the batcher's own failure aborts nothing else (as before)


# ------------------------------------------------------------ the stall rule: no step for a few of its own step times
def busy(since: float, step: float | None) -> dict:
    return {"status": "ready", "busy": True, "seconds_since_last_step": since, "step_seconds_max": step}


async def test_a_worker_that_stops_answering_while_holding_work_stalls_after_a_few_of_its_own_steps():
    """A stopped process (SIGSTOP) answers nothing: its probes time out. It is stalled once it has shown no progress
    for max(stall_floor, stall_steps x its step time), long before stall_timeout, by the watcher (not the next
    probe); an idle worker whose probes fail is never 'stalled'."""
    answer = {"body": {**READY, "step_seconds_max": 0.05}}
    async with pool_with(answer, stall_timeout=60.0, stall_floor=2.0, stall_steps=5) as (pool, aborts):
        w = pool.workers[0]
        await pool.probe_once()
        assert w.snapshot()["stall_after_seconds"] == 2.0         # 5 x 0.05 s is under the floor
        pool.batch_started(w, 32)
        answer["body"] = busy(0.01, 0.05)
        await pool.probe_once()
        answer["body"] = "not json"                               # stands for a probe that timed out
        await pool.probe_once()
        pool.watch()
        assert w.status == "busy" and aborts == []               # no progress for ~0 s: within its allowance
        w.last_progress = time.monotonic() - 2.5
        pool.watch()
        assert w.status == "stalled" and aborts == [(0, "stalled")] and not pool.any_healthy()
        pool.watch()
        assert aborts == [(0, "stalled")]                         # once
        pool.batch_ended(w, 32)
        answer["body"] = {**READY, "step_seconds_max": 0.05}      # SIGCONT: it answers, idle, progressing
        await pool.probe_once()
        assert w.status == "stalled"
        await pool.probe_once()
        assert w.status == "idle"
        # an idle worker that stops answering is unhealthy after unhealthy_threshold probes, never stalled
        answer["body"] = "not json"
        w.last_progress = time.monotonic() - 100
        for _ in range(3):
            await pool.probe_once()
            pool.watch()
        assert w.status == "unhealthy" and aborts == [(0, "stalled")]


async def test_slow_steps_stretch_the_allowance_and_stall_timeout_caps_it():
    answer = {"body": {**READY, "step_seconds_max": 2.0}}
    async with pool_with(answer, stall_timeout=30.0, stall_floor=1.0, stall_steps=5) as (pool, aborts):
        w = pool.workers[0]
        await pool.probe_once()
        assert pool.stall_after(w) == 10.0                       # 5 steps of 2 s
        pool.batch_started(w, 4)
        answer["body"] = "not json"
        await pool.probe_once()
        w.last_progress = time.monotonic() - 8.0
        pool.watch()
        assert w.status == "busy"                                # 8 s without a step: within 5 of its 2 s steps
        w.last_progress = time.monotonic() - 11.0
        pool.watch()
        assert w.status == "stalled" and aborts == [(0, "stalled")]
        w.last_health = {**READY, "step_seconds_max": 100.0}
        assert pool.stall_after(w) == 30.0                       # capped by stall_timeout
        for step in (None, "x", True, -1):                       # no step time reported (yet): stall_timeout
            w.last_health = {**READY, "step_seconds_max": step}
            assert pool.stall_after(w) == 30.0


async def test_a_worker_that_answers_but_makes_no_step_stalls_after_a_few_of_its_own_steps():
    """Its device loop hangs while its event loop answers: /health reports the time since its last step."""
    answer = {"body": {**READY, "step_seconds_max": 0.1}}
    async with pool_with(answer, stall_timeout=60.0, stall_floor=1.0, stall_steps=5) as (pool, aborts):
        w = pool.workers[0]
        await pool.probe_once()
        pool.batch_started(w, 8)
        answer["body"] = busy(0.9, 0.1)
        await pool.probe_once()
        assert w.status == "busy" and aborts == []               # one slow step, under the floor
        answer["body"] = busy(1.5, 0.1)
        w.last_progress = time.monotonic() - 1.5
        await pool.probe_once()
        assert w.status == "stalled" and aborts == [(0, "stalled")]


async def test_before_its_first_step_a_worker_gets_stall_timeout():
    """No step time yet (the first step after start, which may compile or warm up): only stall_timeout applies."""
    answer = {"body": READY}
    async with pool_with(answer, stall_timeout=60.0, stall_floor=1.0) as (pool, aborts):
        w = pool.workers[0]
        await pool.probe_once()
        pool.batch_started(w, 8)
        answer["body"] = busy(20.0, None)
        w.last_progress = time.monotonic() - 20.0
        await pool.probe_once()
        answer["body"] = "not json"
        await pool.probe_once()
        pool.watch()
        assert w.status == "busy" and aborts == []


async def test_a_dispatch_to_a_worker_without_work_starts_its_stall_clock():
    async with pool_with({"body": READY}) as (pool, _):
        w = pool.workers[0]
        w.last_progress = time.monotonic() - 50
        pool.batch_started(w, 1)
        assert time.monotonic() - w.last_progress < 1
        w.last_progress = time.monotonic() - 50
        pool.batch_started(w, 1)                                 # a second batch does not hide a stall
        assert time.monotonic() - w.last_progress >= 50


def test_the_step_clock_measures_steps_while_busy_and_never_idle_time():
    from types import SimpleNamespace
    from worker.stepclock import StepClock
    engine, batcher = SimpleNamespace(last_step_time=0.0), SimpleNamespace(busy=False)
    clock = StepClock(engine, batcher)
    assert clock.step_seconds_max is None
    clock.sample(100.0)                    # idle for 100 s: nothing
    batcher.busy = True
    clock.sample(100.0)                    # a batch starts
    engine.last_step_time = 100.3
    clock.sample(100.35)                   # its first step: 0.3 s from the start of the busy spell, not 100.3 s
    engine.last_step_time = 100.5
    clock.sample(100.55)
    assert list(clock.gaps) == [pytest.approx(0.3), pytest.approx(0.2)] and clock.step_seconds_max == 0.3
    batcher.busy = False
    engine.last_step_time = 101.0
    clock.sample(101.0)
    clock.sample(200.0)
    batcher.busy = True
    clock.sample(200.0)
    engine.last_step_time = 201.5          # one slow step
    clock.sample(201.5)
    assert clock.step_seconds_max == 1.5 and len(clock.gaps) == 3


async def test_tokens_generated_survive_a_worker_restart():
    """/stats tokens_generated adds up each place's worker processes: a restarted worker starts its own count from
    0, which made the total fall."""
    answer = {"body": {**READY, "instance_id": "a", "tokens_generated": 100}}
    async with pool_with(answer) as (pool, _):
        w = pool.workers[0]
        await pool.probe_once()
        assert w.tokens_generated == 100
        answer["body"] = {**READY, "instance_id": "b", "tokens_generated": 7}       # a new process
        await pool.probe_once()
        assert w.tokens_generated == 107
        answer["body"] = {**READY, "instance_id": "b", "tokens_generated": 9}
        await pool.probe_once()
        assert w.tokens_generated == 109


async def test_a_malformed_model_version_reads_as_none():
    """Routing reads ``model_version["hash"]`` of every worker's last /health (a request pinned to weights): a
    worker naming its weights with a string or a dict without a hash would raise there and stop the batching loop
    (a reviewer's finding); such an answer counts as naming none."""
    answer = {"body": {**READY, "model_version": "v1"}}
    async with pool_with(answer) as (pool, _):
        w = pool.workers[0]
        for bad in ("v1", {"path": "/x"}, {"hash": 3}, ["h"]):
            answer["body"] = {**READY, "model_version": bad}
            await pool.probe_once()
            assert w.last_health["model_version"] is None and w.last_health["status"] == "ready"
        answer["body"] = {**READY, "model_version": {"hash": "abc", "path": "/m"}}
        await pool.probe_once()
        assert w.last_health["model_version"] == {"hash": "abc", "path": "/m"}
