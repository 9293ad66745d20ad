"""Workers that misbehave in ways a review found the balancer's batching did not handle (test doubles: fake workers
answering /health and /worker/batch as each test needs). Every request gets one answer, in time, from the right
attempt; a worker's places are freed."""
import asyncio
import contextlib
import time

import aiohttp
import orjson
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from balancer.app import STATE, BalancerConfig, make_app
from balancer.batcher import BatchConfig, CentralBatcher, Pending
from balancer.pool import HealthConfig, WorkerPool
from tests.fakes import CHUNK, worker_app, workers


def _line(rid: str, **ev) -> bytes:
    return orjson.dumps({"id": rid, **ev}) + b"\n"


def _answering(tag: str, seen: list):
    """A batch handler that answers every row at once (a stream's text, then its end), noting ``(tag, id)``."""
    async def batch(request):
        body = await request.json()
        resp = web.StreamResponse()
        await resp.prepare(request)
        for it in body["requests"]:
            seen.append((tag, it["id"]))
            c = dict(CHUNK, choices=[{"index": 0, "text": f"{tag}-text", "finish_reason": "length"}])
            await resp.write(_line(it["id"], event="chunk" if it["body"].get("stream") else "response", data=c,
                                   end=True))
        await resp.write_eof()
        return resp
    return batch


@contextlib.asynccontextmanager
async def _batching(urls, session, health: HealthConfig, batch: BatchConfig):
    """A worker pool over ``urls`` (probed once) and a batcher on it, running; closed after."""
    pool = WorkerPool(urls, lambda: session, health)
    for w in pool.workers:
        await pool.probe(w, session)
    b = CentralBatcher(pool, lambda: session, batch)
    pool.start()
    b.start()
    try:
        yield pool, b
    finally:
        await b.close()
        await pool.close()


async def _balancer(urls, request_timeout=1800.0) -> TestClient:
    cfg = BalancerConfig(worker_urls=urls, request_timeout=request_timeout,
                         batch=BatchConfig(batch_size=8, wait_time=0.01),
                         health=HealthConfig(interval=0.05, timeout=1, stall_timeout=5))
    client = TestClient(TestServer(make_app(cfg)))
    await client.start_server()
    for _ in range(200):
        if (await (await client.get("/health")).json())["healthy_workers"] == len(urls):
            return client
        await asyncio.sleep(0.02)
    raise TimeoutError("the fake workers never became healthy")


async def test_a_draining_worker_that_keeps_stepping_is_not_stalled():
    """SIGTERM while a worker runs a long non-streaming batch: its /health says draining, busy, stepping. Its steps
    were not counted as progress once it was not "ready", so after the stall allowance its batch was aborted and the
    request, with no other worker, got a 503 though the worker would have answered."""
    state = {"status": "ready"}
    cancels = []

    async def health(request):
        return web.json_response({"status": state["status"], "busy": True, "seconds_since_last_step": 0.05,
                                  "step_seconds_max": 0.1})

    async def batch(request):
        ids = [it["id"] for it in (await request.json())["requests"]]
        resp = web.StreamResponse()
        await resp.prepare(request)
        state["status"] = "draining"          # SIGTERM just after the batch started
        await asyncio.sleep(3)
        for rid in ids:
            await resp.write(_line(rid, event="response", data={"ok": True}, end=True))
        await resp.write_eof()
        return resp

    async def cancel(request):
        cancels.append(await request.json())
        return web.json_response({})
    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/worker/batch", batch)
    app.router.add_post("/worker/cancel", cancel)
    async with workers(app) as urls, aiohttp.ClientSession() as s, \
            _batching(urls, s, HealthConfig(interval=0.1, stall_floor=1.0), BatchConfig(no_worker_grace=2)) as (pool, b):
        p = Pending(id="r", kind="completion", body=b"{}", stream=False)
        b.submit(p)
        ev = await asyncio.wait_for(p.next(), 10)
        assert (ev.kind, ev.status, ev.data) == ("response", 200, {"ok": True}) and cancels == []
        assert not pool.workers[0].stalled


async def test_a_failed_request_goes_back_to_its_worker_when_no_other_could_take_it():
    """A request pinned to weights h0 fails once on worker 0 (a broken connection); the other healthy worker holds
    h1 and can never take it. The request was kept from worker 0 while any other worker was healthy, and waited for
    its --request-timeout (a 504 after 4 s) beside an idle worker 0."""
    seen, calls = [], []
    ok = _answering("w0", seen)

    async def flaky(request):
        calls.append(1)
        if len(calls) == 1:
            await request.json()
            request.transport.abort()
            return web.Response()
        return await ok(request)
    held = [{"status": "ready", "busy": False, "seconds_since_last_step": 0.0,
             "model_version": {"hash": h, "path": f"/w/{h}"}} for h in ("h0", "h1")]
    async with workers(worker_app(flaky, health=held[0]), worker_app(_answering("w1", seen), health=held[1])) as urls:
        c = await _balancer(urls, request_timeout=4)
        try:
            t = time.monotonic()
            r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "model_version": "h0"})
            assert r.status == 200, await r.text()
            assert time.monotonic() - t < 3 and len(calls) == 2 and [w for w, _ in seen] == ["w0"]
        finally:
            await c.close()


async def test_a_stream_that_sent_text_is_not_sent_again_after_a_refusal():
    """A row refused (429) after its text went to the client was put back in the queue and run again elsewhere: the
    client's one stream held two attempts' text. (A real worker refuses only before any text; a faulty one may not.)
    Now the refusal ends that stream, as an error."""
    seen = []

    async def refusing_late(request):
        body = await request.json()
        resp = web.StreamResponse()
        await resp.prepare(request)
        for it in body["requests"]:
            seen.append(("bad", it["id"]))
            c = dict(CHUNK, choices=[{"index": 0, "text": "BAD-text", "finish_reason": None}])
            await resp.write(_line(it["id"], event="chunk", data=c))
            await asyncio.sleep(0.2)                    # the client's stream opens
            err = {"error": {"message": "queue full", "type": "x", "param": None, "code": None}}
            await resp.write(_line(it["id"], event="error", status=429, data=err, end=True))
        await resp.write_eof()
        return resp
    async with workers(worker_app(refusing_late), worker_app(_answering("ok", seen))) as urls:
        c = await _balancer(urls[:1] + urls[1:])
        try:
            c.server.app[STATE].pool.workers[1].busy_until = time.monotonic() + 0.5    # the first batch: worker 0
            r = await c.post("/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 4})
            text = (await r.read()).decode()
            assert "BAD-text" in text and "ok-text" not in text and "queue full" in text, text
            assert [w for w, _ in seen] == ["bad"]
        finally:
            await c.close()


async def test_a_stream_held_open_after_its_last_answer_frees_the_workers_place():
    """A worker that answers every row of a batch but leaves the stream open kept the batch's place for ever
    (in-flight batches at the limit, the worker busy, never stalled: its /health said idle). Now the stream may stay
    open --worker-call-timeout after the last answer; then the place is freed. A stream that ends before every
    row's answer counts as the worker's error."""
    async def lingering(request):
        ids = [it["id"] for it in (await request.json())["requests"]]
        resp = web.StreamResponse()
        await resp.prepare(request)
        for rid in ids:
            await resp.write(_line(rid, event="response", data={}, end=True))
        await asyncio.sleep(30)
        return resp

    async def short(request):
        await request.json()
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write_eof()                          # a 200 with no line at all
        return resp
    async with workers(worker_app(lingering), worker_app(short)) as urls, aiohttp.ClientSession() as s:
        async with _batching(urls[:1], s, HealthConfig(interval=0.1, stall_floor=0.5),
                             BatchConfig(call_timeout=1.0)) as (pool, b):
            for i in range(2):
                p = Pending(id=f"r{i}", kind="completion", body=b"{}", stream=False)
                b.submit(p)
                await asyncio.wait_for(p.next(), 5)
            await asyncio.sleep(2)
            w = pool.workers[0]
            assert (w.inflight_batches, w.inflight_rows, w.status) == (0, 0, "idle")
        async with _batching(urls[1:], s, HealthConfig(interval=0.1), BatchConfig(max_retries=0)) as (pool, b):
            p = Pending(id="r", kind="completion", body=b"{}", stream=False)
            b.submit(p)
            ev = await asyncio.wait_for(p.next(), 5)
            assert ev.kind == "error" and pool.workers[0].errors == 1
