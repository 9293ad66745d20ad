"""Fine-grained failover with fault-injecting fake workers (tests/fakes.py: test doubles that crash or hang on cue)."""
import asyncio
import socket
import time

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from balancer.app import BalancerConfig, make_app
from balancer.batcher import BatchConfig
from balancer.pool import HealthConfig
from tests.fakes import READY, fake_worker, worker_app, workers
from tests.helpers import read_http_answer


async def _balancer(aiohttp_client, urls, **batch):
    cfg = BalancerConfig(worker_urls=urls, batch=BatchConfig(**{"batch_size": 8, "wait_time": 0.05, "idle_dispatch": False, **batch}),
                         health=HealthConfig(interval=0.05, timeout=1, stall_timeout=5))
    client = await aiohttp_client(make_app(cfg))
    for _ in range(200):
        if (await (await client.get("/health")).json())["healthy_workers"] == len(urls):
            return client
        await asyncio.sleep(0.02)
    raise TimeoutError


async def test_a_draining_balancer_says_so_in_its_system_status(aiohttp_client):
    """While it drains (SIGTERM: new requests get 503), /worker-status says `draining`, not `normal`."""
    from balancer.app import STATE
    async with workers(fake_worker("ok", [])) as urls:
        client = await _balancer(aiohttp_client, urls)
        ws = await (await client.get("/worker-status")).json()
        assert ws["system_status"] == "normal"
        client.server.app[STATE].draining = True
        ws = await (await client.get("/worker-status")).json()
        assert ws["system_status"] == "draining" and ws["healthy_workers"] == 1


async def test_crash_mid_batch_redispatches_unsent_and_errors_started_streams(aiohttp_client):
    log = []
    dying, good = TestServer(fake_worker("die", log)), TestServer(fake_worker("ok", log))
    await dying.start_server()
    await good.start_server()
    try:
        client = await _balancer(aiohttp_client, [str(dying.make_url("")), str(good.make_url(""))])
        stream_req = client.post("/v1/completions", json={"prompt": "a", "stream": True})
        plain_req = client.post("/v1/completions", json={"prompt": "b"})
        stream_resp, plain_resp = await asyncio.gather(stream_req, plain_req)
        # the non-streaming request had sent nothing: re-dispatched to the good worker, answered once
        assert plain_resp.status == 200
        assert (await plain_resp.json())["choices"][0]["text"] == "ok-completion"
        # the stream had already sent text from the dying worker: it ends with an error event, then [DONE]
        assert stream_resp.status == 200
        events = [line[6:] for line in (await stream_resp.text()).split("\n") if line.startswith("data: ")]
        assert orjson.loads(events[0])["choices"][0]["text"] == "die-text"
        assert "cannot be resumed" in orjson.loads(events[1])["error"]["message"]
        assert events[-1] == "[DONE]" and len(events) == 3
        served_by_good = [rid for mode, rid in log if mode == "ok"]
        assert len(served_by_good) == 1           # only the unsent request moved, and only once
        stats = await (await client.get("/stats")).json()
        assert stats["redispatched_requests"] == 1 and stats["failed_midstream"] == 1
    finally:
        await dying.close()
        await good.close()


async def test_no_healthy_worker_is_503_with_retry_after(aiohttp_client):
    cfg = BalancerConfig(worker_urls=["http://127.0.0.1:9"], health=HealthConfig(interval=0.05, timeout=0.2))
    client = await aiohttp_client(make_app(cfg))
    r = await client.post("/v1/completions", json={"prompt": "a"})
    assert r.status == 503 and r.headers["Retry-After"]
    assert (await r.json())["error"]["type"] == "service_unavailable"
    assert (await client.get("/health")).status == 503
    ws = await (await client.get("/worker-status")).json()
    assert ws["system_status"] == "down" and ws["workers"][0]["status"] == "starting"
    r = await client.post("/v1/completions", json={"prompt": "a", "frequency_penalty": 0.2})
    assert r.status == 400 and (await r.json())["error"]["param"] == "frequency_penalty"


async def test_retries_are_bounded(aiohttp_client):
    log = []
    servers = [TestServer(fake_worker("die", log)) for _ in range(2)]
    for s in servers:
        await s.start_server()
    try:
        client = await _balancer(aiohttp_client, [str(s.make_url("")) for s in servers], max_retries=2)
        r = await client.post("/v1/completions", json={"prompt": "b"})
        assert r.status == 502 and "failed 3 times (on 2 workers)" in (await r.json())["error"]["message"]
        assert len(log) == 3
    finally:
        for s in servers:
            await s.close()


async def test_request_timeout_is_504_and_the_worker_is_told(aiohttp_client):
    """A worker that never answers: after --request-timeout the client gets 504, the worker a cancel for that id,
    and the balancer keeps serving."""
    seen, cancelled = [], []
    hanging = TestServer(fake_worker("hang", seen, cancelled))
    await hanging.start_server()
    try:
        cfg = BalancerConfig(worker_urls=[str(hanging.make_url(""))], request_timeout=0.5,
                             batch=BatchConfig(batch_size=8, wait_time=0.01),
                             health=HealthConfig(interval=0.05, timeout=1, stall_timeout=60))
        client = await aiohttp_client(make_app(cfg))
        for _ in range(200):
            if (await (await client.get("/health")).json())["healthy_workers"] == 1:
                break
            await asyncio.sleep(0.02)
        t = asyncio.get_running_loop().time()
        plain, stream = await asyncio.gather(
            client.post("/v1/completions", json={"prompt": "a"}),
            client.post("/v1/completions", json={"prompt": "b", "stream": True}))
        took = asyncio.get_running_loop().time() - t
        assert plain.status == 504 and stream.status == 504      # the stream had sent nothing: a plain 504
        assert (await plain.json())["error"]["type"] == "timeout"
        assert "--request-timeout" in (await stream.json())["error"]["message"]
        assert 0.5 <= took < 2.0
        for _ in range(100):
            if len(cancelled) == 2:
                break
            await asyncio.sleep(0.02)
        assert sorted(cancelled) == sorted(rid for _, rid in seen) and len(seen) == 2
        stats = await (await client.get("/stats")).json()
        assert stats["last_minute"]["requests"] == 2 and stats["last_minute"]["ok"] == 0
        assert stats["queue_depth"] == 0
    finally:
        await hanging.close()


async def test_requests_that_failed_on_the_least_loaded_worker_go_to_another(aiohttp_client):
    """Regression: after a failure, when every queued request excludes the least-loaded free worker, the batch goes
    to the next free worker (it used to wait for the excluded one forever)."""
    seen = []
    async with workers(fake_worker("die", seen, delay=0.3), fake_worker("ok", seen)) as urls:
        client = await _balancer(aiohttp_client, urls, batch_size=2)
        first = [asyncio.ensure_future(client.post("/v1/completions", json={"prompt": p})) for p in "ab"]
        await asyncio.sleep(0.1)              # a, b are on the dying worker (dispatched first) for 0.3 s
        second = [client.post("/v1/completions", json={"prompt": p}) for p in "cd"]
        async with asyncio.timeout(5):
            answers = await asyncio.gather(*first, *second)
        assert [r.status for r in answers] == [200] * 4
        assert [(await r.json())["choices"][0]["text"] for r in answers] == ["ok-completion"] * 4
        assert [m for m, _ in seen] == ["die", "die", "ok", "ok", "ok", "ok"]


async def test_a_malformed_batch_stream_fails_over_instead_of_hanging(aiohttp_client):
    seen = []
    async with workers(fake_worker("garbage", seen), fake_worker("ok", seen)) as urls:
        client = await _balancer(aiohttp_client, urls)
        async with asyncio.timeout(10):
            r = await client.post("/v1/completions", json={"prompt": "a"})
        assert r.status == 200 and (await r.json())["choices"][0]["text"] == "ok-completion"
        assert [m for m, _ in seen] == ["garbage", "ok"]
        stats = await (await client.get("/stats")).json()
        assert stats["redispatched_requests"] == 1 and stats["workers"][0]["errors"] == 1


async def test_a_dispatch_aborted_before_it_starts_loses_nothing(aiohttp_client):
    """The pool aborts a worker (connection refused) in the moment between a batch's dispatch task being created and
    its first step: the task never runs, so its requests go back to the queue and its counts are undone (they were
    lost, and the worker looked busy for ever, before)."""
    from balancer.app import STATE
    from balancer.batcher import Pending
    log = []
    async with workers(fake_worker("ok", log)) as urls:
        app = make_app(BalancerConfig(worker_urls=urls, health=HealthConfig(interval=0.05, timeout=1)))
        client = await aiohttp_client(app)
        while (await (await client.get("/health")).json())["healthy_workers"] != 1:
            await asyncio.sleep(0.02)
        state = app[STATE]
        w = state.pool.workers[0]
        p = Pending(id="early", kind="completion", body=b'{"prompt": "a"}', stream=False)
        state.batcher._start_dispatch(w, [p])
        state.pool.abort(w, "test")                 # cancels the task before its first step
        _, event, status, data, end = await asyncio.wait_for(p.next(), 10)
        assert (event, status, end) == ("response", 200, True) and data["choices"][0]["text"] == "ok-completion"
        assert log == [("ok", "early")]             # sent once, by the second dispatch
        await asyncio.sleep(0.05)
        assert w.inflight_batches == 0 and w.inflight_rows == 0


# ---------------------------------------------------------------- issue 29: request bytes in flight, bounded
MiB = 1024 ** 2


def holding_worker(hold: float):
    """A fake worker that takes large batches and answers each after ``hold`` seconds (the balancer holds the
    bodies meanwhile)."""
    async def health(request):
        return web.json_response({"status": "ready", "busy": False, "seconds_since_last_step": 0.0})

    async def batch(request):
        items = orjson.loads(await request.read())["requests"]
        await asyncio.sleep(hold)
        lines = [orjson.dumps({"id": it["id"], "event": "response", "end": True, "data": {
            "choices": [{"index": 0, "text": "held", "finish_reason": "length"}]}}) for it in items]
        return web.Response(body=b"\n".join(lines) + b"\n", content_type="application/x-ndjson")

    app = web.Application(client_max_size=1 << 30)
    app.router.add_get("/health", health)
    app.router.add_post("/worker/batch", batch)
    return app


def stalled_upload(port: int, path: str, length: int, sent: int) -> socket.socket:
    """A client that announces ``length`` bytes, sends ``sent`` of them and stops (it holds its connection)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
              .encode() + b'{"prompt": "' + b"x" * (sent - 12))
    return s


def answered(s: socket.socket, timeout: float) -> tuple[int, dict, bytes]:
    s.settimeout(timeout)
    return read_http_answer(s)


async def _body_bytes(client) -> dict:
    return (await (await client.get("/stats")).json())["request_body_bytes"]


async def test_a_body_over_the_limit_gets_413_without_content_length(aiohttp_client):
    """One body is at most --max-body-bytes (64 MiB; 1,000 bytes here): announced by Content-Length it is refused
    before it is read, and sent in chunks with no length it is refused once its bytes pass the limit (a review found
    no test of the second); in the OpenAI shape either way, and a body at the limit is read whole."""
    from common.http import errors_middleware, read_body

    async def echo(request):
        return web.json_response({"bytes": len(await read_body(request, max_bytes=1000))})

    app = web.Application(middlewares=[errors_middleware])
    app.router.add_post("/echo", echo)
    client = await aiohttp_client(app)
    headers = {"Content-Type": "application/json"}

    async def chunks(n: int, size: int = 300):
        for _ in range(n):
            yield b"x" * size
            await asyncio.sleep(0)

    for data in (b"x" * 1001, chunks(4)):          # 1,001 bytes announced; 1,200 bytes chunked
        r = await client.post("/echo", data=data, headers=headers)
        err = (await r.json())["error"]
        assert r.status == 413 and err["type"] == "invalid_request_error" and "1000 bytes" in err["message"]
    r = await client.post("/echo", data=b"x" * 1000, headers=headers)
    assert r.status == 200 and (await r.json())["bytes"] == 1000
    r = await client.post("/echo", data=chunks(3), headers=headers)
    assert r.status == 200 and (await r.json())["bytes"] == 900


async def test_a_compressed_body_counts_what_it_decodes_to(aiohttp_client):
    """A review: aiohttp decodes a gzip body (Content-Encoding), and the bound on bodies in flight counted only its
    Content-Length: twelve 60 KiB bodies of 60 MiB each passed --max-body-bytes-in-flight at once (1.4 GB). The
    decoded bytes count now, as a chunked body's do."""
    import gzip

    from common.http import BODY_BUDGET, BodyBudget, errors_middleware, read_body

    async def echo(request):
        return web.json_response({"bytes": len(await read_body(request))})

    app = web.Application(middlewares=[errors_middleware])
    app[BODY_BUDGET] = budget = BodyBudget(400_000)
    app.router.add_post("/echo", echo)
    client = await aiohttp_client(app)
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    small = orjson.dumps({"prompt": "x" * 100_000})
    r = await client.post("/echo", data=gzip.compress(small), headers=headers)
    assert r.status == 200 and (await r.json())["bytes"] == len(small) and budget.peak == len(small)
    big = gzip.compress(orjson.dumps({"prompt": "x" * 1_000_000}))      # 1 MB that arrives as 1 KB
    assert len(big) < 5000
    r = await client.post("/echo", data=big, headers=headers)
    err = (await r.json())["error"]
    assert r.status == 413 and "--max-body-bytes-in-flight" in err["message"], err
    assert budget.used == 0


@pytest.mark.slow          # (8 s): the fast tier stays under 3 minutes
async def test_request_body_bytes_in_flight_are_bounded(aiohttp_client):
    """Issue 29 item 3: bodies held at once (until their requests are answered) stay within
    --max-body-bytes-in-flight (8 MiB here: 6 MiB for bodies over 1 MiB); past it a body gets 503 + Retry-After in
    the OpenAI shape: announced by Content-Length (refused before it is read, a stalled upload included) or counted
    chunk by chunk; a small request is answered meanwhile, and everything held is given back."""
    async with workers(holding_worker(2.0)) as urls:
        cfg = BalancerConfig(worker_urls=urls, max_body_bytes_in_flight=8 * MiB,
                             batch=BatchConfig(batch_size=8, wait_time=0.02),
                             health=HealthConfig(interval=0.05, timeout=1, stall_timeout=30))
        client = await aiohttp_client(make_app(cfg))
        while (await (await client.get("/health")).json())["healthy_workers"] != 1:
            await asyncio.sleep(0.02)
        big = orjson.dumps({"prompt": "x" * (2 * MiB)})           # 2 MiB + 14 bytes: two fit in 6 MiB, not three
        headers = {"Content-Type": "application/json"}

        async def chunked():
            yield big[:MiB]
            await asyncio.sleep(0.1)
            yield big[MiB:]

        held = [asyncio.ensure_future(client.post("/v1/completions", data=big, headers=headers)) for _ in range(2)]
        while (await _body_bytes(client))["bytes"] < 2 * len(big):
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        staller = await asyncio.to_thread(stalled_upload, client.server.port, "/v1/completions", len(big), 100_000)
        refused = await asyncio.gather(*[client.post("/v1/completions", data=big, headers=headers) for _ in range(2)],
                                       *[client.post("/v1/completions", data=chunked(), headers=headers)
                                         for _ in range(2)])
        small = await client.post("/v1/completions", json={"prompt": "small"})
        assert small.status == 200 and time.monotonic() - t0 < 10
        status, hdrs, body = await asyncio.to_thread(answered, staller, 5)       # refused before it was read
        staller.close()
        for st, retry, err in [(r.status, r.headers.get("Retry-After"), (await r.json())["error"]) for r in refused] \
                + [(status, hdrs.get("retry-after"), orjson.loads(body)["error"])]:
            assert st == 503 and retry == "1" and err["type"] == "service_unavailable", (st, err)
            assert "--max-body-bytes-in-flight" in err["message"]
        assert [r.status for r in await asyncio.gather(*held)] == [200, 200]
        stats = await _body_bytes(client)
        assert stats["peak"] <= 8 * MiB and stats["refused"] == 5 and stats["limit"] == 8 * MiB
        assert stats["bytes"] == 0                     # every held byte given back once answered
        r = await client.post("/v1/completions", data=big, headers=headers)
        assert r.status == 200

        # stalled uploads hold what they announce until they leave, but never the last quarter: small requests pass
        stallers = []
        for i in range(2):
            stallers.append(await asyncio.to_thread(stalled_upload, client.server.port, "/v1/completions", len(big),
                                                    50_000))
            while (await _body_bytes(client))["bytes"] < (i + 1) * len(big):
                await asyncio.sleep(0.01)
        stallers.append(await asyncio.to_thread(stalled_upload, client.server.port, "/v1/completions", len(big),
                                                50_000))
        status, hdrs, _ = await asyncio.to_thread(answered, stallers[2], 5)
        assert status == 503 and hdrs["retry-after"] == "1"
        t0 = time.monotonic()
        small = await client.post("/v1/completions", json={"prompt": "small"})
        assert small.status == 200 and time.monotonic() - t0 < 10
        assert (await _body_bytes(client))["bytes"] == 2 * len(big)
        for s in stallers:
            s.close()
        for _ in range(200):
            if (await _body_bytes(client))["bytes"] == 0:
                break
            await asyncio.sleep(0.02)
        assert (await _body_bytes(client))["bytes"] == 0
        r = await client.post("/v1/completions", data=orjson.dumps({"prompt": "x" * (7 * MiB)}), headers=headers)
        assert r.status == 413                         # more than it could ever hold: no retry helps


async def test_a_worker_bounds_its_request_body_bytes(aiohttp_client):
    """The worker holds at most its own --max-body-bytes-in-flight (4 MiB here: 3 MiB for large bodies),
    /worker/batch included."""
    from common.http import BODY_BUDGET
    from tests.conftest import TINY_LLADA
    from worker.app import WorkerConfig
    from worker.app import make_app as make_worker_app
    client = await aiohttp_client(make_worker_app(WorkerConfig(model_path=str(TINY_LLADA), device="cpu",
                                                               max_body_bytes_in_flight=4 * MiB)))
    for _ in range(600):
        if (await (await client.get("/health")).json())["status"] == "ready":
            break
        await asyncio.sleep(0.05)
    headers = {"Content-Type": "application/json"}
    r = await client.post("/v1/completions", data=orjson.dumps({"prompt": "x" * (3 * MiB + 100)}), headers=headers)
    assert r.status == 413
    staller = await asyncio.to_thread(stalled_upload, client.server.port, "/worker/batch", 2 * MiB, 10_000)
    budget = client.server.app[BODY_BUDGET]
    while budget.used < 2 * MiB:
        await asyncio.sleep(0.01)
    pad = orjson.dumps({"requests": [], "pad": "x" * (2 * MiB)})
    t0 = time.monotonic()
    r = await client.post("/worker/batch", data=pad, headers=headers)
    assert r.status == 503 and r.headers["Retry-After"] == "1"
    small = await client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "block_length": 2})
    assert small.status == 200 and time.monotonic() - t0 < 10
    staller.close()
    for _ in range(200):
        r = await client.post("/worker/batch", data=pad, headers=headers)
        if r.status != 503:
            break
        await asyncio.sleep(0.02)
    assert r.status == 400          # read, then refused for what it says (no requests), not for its size


def _scripted_worker(answers: list, seen: list, cancelled: list | None = None, read_delay: float = 0.0,
                     run_for: float = 0.0):
    """A fake worker (test double) whose /worker/batch answers come from ``answers`` in turn: (status, headers, body)
    for a whole-batch answer, or "ok" to answer every row (after ``run_for`` seconds unless all its rows were
    cancelled). ``read_delay``: seconds before it reads a batch (a large body on its way); ``seen``: (time, ids)."""
    runs = {}

    async def batch(request):
        await asyncio.sleep(read_delay)
        ids = [item["id"] for item in (await request.json())["requests"]]
        seen.append((time.monotonic(), ids))
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if answer != "ok":
            status, headers, body = answer
            return web.json_response(body, status=status, headers=headers)
        for rid in ids:
            runs[rid] = False
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        t = time.monotonic()
        while time.monotonic() - t < run_for and not all(runs[rid] for rid in ids):
            await asyncio.sleep(0.01)
        for rid in ids:
            data = {"object": "text_completion", "choices": [{"index": 0, "text": "cancelled" if runs[rid] else "done",
                                                               "finish_reason": "length"}]}
            await resp.write(orjson.dumps({"id": rid, "event": "response", "data": data, "end": True}) + b"\n")
        await resp.write_eof()
        return resp

    async def cancel(request):
        for rid in (await request.json())["ids"]:
            if rid in runs:           # as a real worker: an id it does not hold (yet) is ignored
                runs[rid] = True
                if cancelled is not None:
                    cancelled.append(rid)
        return web.json_response({"cancelled": 1})

    return worker_app(batch, cancel)


BUSY = {"error": {"message": "the worker is draining", "type": "service_unavailable", "param": None, "code": None}}


async def test_a_busy_or_draining_worker_backs_off_without_using_retries(aiohttp_client):
    """A whole batch answered 429 or 503 did nothing: it goes back to the queue without using a retry, and that
    worker takes no batch for its Retry-After (a reviewer found a 503 used up every retry within milliseconds)."""
    seen = []
    answers = [(503, {"Retry-After": "0.3"}, BUSY), (429, {"Retry-After": "0.2"}, BUSY), (503, {}, BUSY), "ok"]
    async with workers(_scripted_worker(answers, seen)) as urls:
        client = await _balancer(aiohttp_client, urls, max_retries=0, idle_dispatch=True, busy_backoff_max=0.5)
        t = time.monotonic()
        r = await client.post("/v1/completions", json={"prompt": "a"})
        assert r.status == 200 and (await r.json())["choices"][0]["text"] == "done"
        times = [when for when, _ in seen]
        assert len(times) == 4
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert gaps[0] >= 0.3 and gaps[1] >= 0.2 and gaps[2] >= 0.5       # Retry-After, then the 1 s default cut
        assert time.monotonic() - t < 3                                       # to --busy-backoff-max (0.5 s)
        stats = await (await client.get("/stats")).json()
        assert stats["redispatched_requests"] == 0


async def test_a_409_without_the_workers_weights_is_a_failure_not_a_loop(aiohttp_client):
    seen = []
    conflict = (409, {}, {"error": {"message": "no", "type": "conflict_error", "param": None, "code": None}})
    async with workers(_scripted_worker([conflict], seen)) as urls:
        client = await _balancer(aiohttp_client, urls, max_retries=2, idle_dispatch=True)
        r = await client.post("/v1/completions", json={"prompt": "a"})
        assert r.status == 502 and "failed 3 times (on 1 worker)" in (await r.json())["error"]["message"]
        assert len(seen) == 3


async def test_a_cancel_reaches_the_worker_however_early_it_comes():
    """A request cancelled before its batch's dispatch has begun is not sent; one cancelled while its batch is on
    its way is cancelled again once the worker holds the batch (a cancel that arrives first finds nothing there)."""
    import aiohttp
    from balancer.batcher import CentralBatcher, Pending
    from balancer.pool import WorkerPool
    for read_delay in (0.0, 0.3):
        seen, cancelled = [], []
        async with workers(_scripted_worker(["ok"], seen, cancelled, read_delay=read_delay, run_for=0.5)) as urls:
            async with aiohttp.ClientSession() as session:
                pool = WorkerPool(urls, lambda: session, HealthConfig(interval=0.05))
                b = CentralBatcher(pool, lambda: session, BatchConfig(idle_dispatch=not read_delay, wait_time=0.05))
                pool.start()
                b.start()
                try:
                    while not pool.any_healthy():
                        await asyncio.sleep(0.01)
                    gone = Pending(id="gone", kind="completion", body=b'{"prompt":"a"}', stream=False)
                    kept = Pending(id="kept", kind="completion", body=b'{"prompt":"b"}', stream=False)
                    b.submit(gone)           # idle dispatch: its dispatch task exists now, not yet begun
                    if read_delay:           # one batch, on its way to the worker, which reads it at 0.35 s
                        b.submit(kept)
                        await asyncio.sleep(0.15)
                        assert gone.worker is not None
                    b.cancel(gone)
                    if not read_delay:
                        b.submit(kept)
                    async with asyncio.timeout(5):
                        ev = await kept.__anext__()
                    assert ev.data["choices"][0]["text"] == "done"
                    if read_delay:
                        assert [ids for _, ids in seen] == [["gone", "kept"]] and cancelled == ["gone"]
                    else:
                        assert [ids for _, ids in seen] == [["kept"]] and not cancelled
                    assert pool.workers[0].inflight_batches == 0
                finally:
                    await b.close()
                    await pool.close()


async def test_a_batch_whose_requests_all_ended_frees_its_place(aiohttp_client):
    """After --request-timeout every request of a batch on a worker that holds its stream open: the batch's place on
    the worker is free at once (it used to stay taken until the worker closed the stream)."""
    seen, cancelled = [], []
    async with workers(fake_worker("hang", seen, cancelled)) as urls:
        cfg = BalancerConfig(worker_urls=urls, request_timeout=0.4,
                             batch=BatchConfig(batch_size=8, wait_time=0.01, max_inflight_per_worker=1),
                             health=HealthConfig(interval=0.05, timeout=1, stall_timeout=60))
        client = await aiohttp_client(make_app(cfg))
        for _ in range(200):
            if (await (await client.get("/health")).json())["healthy_workers"] == 1:
                break
            await asyncio.sleep(0.02)
        r = await client.post("/v1/completions", json={"prompt": "a"})
        assert r.status == 504
        for _ in range(100):
            stats = await (await client.get("/stats")).json()
            if stats["workers"][0]["in_flight_batches"] == 0:
                break
            await asyncio.sleep(0.02)
        assert stats["workers"][0]["in_flight_batches"] == 0 and stats["in_flight"] == 0
        r = await client.post("/v1/completions", json={"prompt": "b"})       # dispatched, not left in the queue
        assert r.status == 504 and len(seen) == 2


async def test_the_no_worker_grace_starts_anew_for_each_outage(aiohttp_client):
    """Requests that wait for a healthy worker get 503 after --no-worker-grace, in every outage (the grace's clock
    was left running after the first one, so in the next outage they got 503 at once)."""
    state = {"health": "ready", "hang": True}
    drop = asyncio.Event()

    async def health(request):
        return web.json_response({"status": state["health"], "busy": False, "seconds_since_last_step": 0.0})

    async def batch(request):
        body = await request.json()
        if state["hang"]:                     # held until the test drops the connection (the worker "dies")
            await drop.wait()
            request.transport.abort()
            return web.Response()
        resp = web.StreamResponse()
        await resp.prepare(request)
        for item in body["requests"]:
            await resp.write(orjson.dumps({"id": item["id"], "event": "response", "data": {"choices": []},
                                           "end": True}) + b"\n")
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/worker/batch", batch)
    async with workers(app) as urls:
        cfg = BalancerConfig(worker_urls=urls, batch=BatchConfig(no_worker_grace=0.5, max_inflight_per_worker=1),
                             health=HealthConfig(interval=0.05, timeout=1, healthy_threshold=1))
        client = await aiohttp_client(make_app(cfg))

        async def healthy(n):
            while (await (await client.get("/health")).json())["healthy_workers"] != n:
                await asyncio.sleep(0.02)
        for outage in range(2):
            await healthy(1)
            state["hang"] = True
            held = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "a"}))
            await asyncio.sleep(0.1)
            state["health"] = "failed"         # a worker once ready that says "failed" is down
            await healthy(0)
            t = time.monotonic()
            drop.set()                         # its batch breaks: the request goes back to wait for a worker
            r = await held
            assert r.status == 503 and "no healthy worker for" in (await r.json())["error"]["message"]
            assert time.monotonic() - t >= 0.5, f"outage {outage}: no grace"
            drop.clear()
            state.update(health="ready", hang=False)
            await healthy(1)
            await asyncio.sleep(0.6)           # served meanwhile, straight to the idle worker (never queued)
            assert (await client.post("/v1/completions", json={"prompt": "b"})).status == 200


async def test_the_drain_timeout_bounds_shutdown():
    """SIGTERM with a request on a worker that never answers: after --drain-timeout the request gets 503 (it is not
    dropped) and the balancer exits within SHUTDOWN_GRACE (aiohttp's own shutdown waited 60 s)."""
    import aiohttp
    from balancer.app import serve
    from common.http import SHUTDOWN_GRACE
    from tests.helpers import free_port
    seen, cancelled = [], []
    async with workers(fake_worker("hang", seen, cancelled)) as urls:
        port = free_port()
        cfg = BalancerConfig(worker_urls=urls, port=port, drain_timeout=0.5,
                             health=HealthConfig(interval=0.05, timeout=1, stall_timeout=60))
        stop = asyncio.Event()
        server = asyncio.create_task(serve(cfg, stop))
        async with aiohttp.ClientSession() as s:
            for _ in range(200):
                try:
                    async with s.get(f"http://127.0.0.1:{port}/health") as r:
                        if (await r.json())["healthy_workers"] == 1:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.02)
            waiting = asyncio.ensure_future(s.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "a"}))
            while not seen:
                await asyncio.sleep(0.01)
            t = time.monotonic()
            stop.set()
            r = await waiting
            assert r.status == 503 and r.headers["Retry-After"]
            assert "--drain-timeout" in (await r.json())["error"]["message"]
            await asyncio.wait_for(server, SHUTDOWN_GRACE + 5)
            assert 0.5 <= time.monotonic() - t < SHUTDOWN_GRACE + 2
        assert cancelled == [seen[0][1]]            # and its worker was told


async def test_rows_answered_leave_the_in_flight_count_before_their_batch_ends(aiohttp_client):
    """A worker answers each row as it ends: /stats in_flight (and the least-loaded routing) counts the rows still
    to come, not the whole batch until its stream closes; the failure counters are Prometheus counters."""
    release = asyncio.Event()

    async def batch(request):
        items = (await request.json())["requests"]
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i, item in enumerate(items):
            if i == 1:
                await release.wait()       # the first row is answered, the others wait
            await resp.write(orjson.dumps({"id": item["id"], "event": "response", "end": True,
                                           "data": {"choices": [{"index": 0, "text": "x"}]}}) + b"\n")
        return resp

    async with workers(worker_app(batch)) as urls:
        client = await _balancer(aiohttp_client, urls, batch_size=3, wait_time=0.05)
        calls = [asyncio.ensure_future(client.post("/v1/completions", json={"prompt": p})) for p in "abc"]
        for _ in range(200):
            stats = await (await client.get("/stats")).json()
            if stats["workers"][0]["requests_served"] == 1:
                break
            await asyncio.sleep(0.02)
        assert stats["in_flight"] == 2 and stats["workers"][0]["in_flight"] == 2
        assert stats["workers"][0]["in_flight_batches"] == 1
        release.set()
        assert [r.status for r in await asyncio.gather(*calls)] == [200] * 3
        stats = await (await client.get("/stats")).json()
        assert stats["in_flight"] == 0 and stats["workers"][0]["requests_served"] == 3
        text = await (await client.get("/metrics")).text()
        assert "# TYPE dllm_balancer_redispatched_total counter" in text and "dllm_balancer_in_flight 0.0" in text


async def test_the_workers_models_answer_is_reused_for_models_cache_ttl_seconds(aiohttp_client):
    """GET /v1/models is answered from a worker's answer kept --models-cache-ttl seconds (it was a fixed 30 s); 0
    asks the worker every time."""
    asked = []
    app = fake_worker("ok", [])

    async def models(request):
        asked.append(request.path)
        return web.json_response({"object": "list", "data": [{"id": f"m{len(asked)}", "object": "model"}]})
    app.router.add_get("/v1/models", models)
    async with workers(app) as urls:
        for ttl, want in ((30.0, ["m1", "m1"]), (0.0, ["m2", "m3"])):
            cfg = BalancerConfig(worker_urls=urls, models_cache_ttl=ttl, health=HealthConfig(interval=0.05))
            client = await aiohttp_client(make_app(cfg))
            for _ in range(200):
                if (await (await client.get("/health")).json())["healthy_workers"] == 1:
                    break
                await asyncio.sleep(0.02)
            got = [(await (await client.get("/v1/models")).json())["data"][0]["id"] for _ in range(2)]
            assert got == want
            await client.close()


def _holding_worker(capacity: int, held: set, seen: list, cancelled: list, break_first: bool = False,
                    run_for: float = 0.1):
    """A fake worker (test double) that holds rows as the real one does: a row id it holds already makes the whole
    batch a 400 ("duplicate request id"); rows past ``capacity`` held at once get their own 429 line (its queue is
    full), the others are answered after ``run_for`` s. ``break_first``: the first batch's connection is cut before
    any answer while its rows stay held (the balancer's side of the connection reset, the worker unaware)."""
    state = {"batches": 0}

    async def batch(request):
        ids = [item["id"] for item in (await request.json())["requests"]]
        seen.append(ids)
        if any(rid in held for rid in ids):
            return web.json_response({"error": {"message": f"duplicate request id {ids[0]!r}",
                                                "type": "invalid_request_error", "param": "requests.id",
                                                "code": None}}, status=400)
        state["batches"] += 1
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        taken = []
        for rid in ids:
            if len(held) >= capacity:
                body = {"error": {"message": "the worker queue is full", "type": "rate_limit_error", "param": None,
                                  "code": None}}
                await resp.write(orjson.dumps({"id": rid, "event": "error", "status": 429, "data": body,
                                               "end": True}) + b"\n")
            else:
                held.add(rid)
                taken.append(rid)
        if break_first and state["batches"] == 1:
            request.transport.abort()          # the rows stay held: this worker never learns the batch is gone
            return resp
        await asyncio.sleep(run_for)
        for rid in taken:
            held.discard(rid)
            data = {"object": "text_completion", "choices": [{"index": 0, "text": rid, "finish_reason": "length"}]}
            await resp.write(orjson.dumps({"id": rid, "event": "response", "data": data, "end": True}) + b"\n")
        await resp.write_eof()
        return resp

    async def cancel(request):
        for rid in (await request.json())["ids"]:
            cancelled.append(rid)
            held.discard(rid)
        return web.json_response({"cancelled": 1})

    return worker_app(batch, cancel)


async def test_rows_a_full_worker_queue_refuses_wait_for_a_worker_again(aiohttp_client):
    """A worker queues rows (prompts x n), the balancer counts requests: a worker whose queue fills answers the rows
    that do not fit a 429 each. Those requests go back to the front of the queue (no retry used) and the worker backs
    off; no client sees the 429 (a reviewer found 16 of 40 requests with n=64 answered 429, the balancer's queue
    empty)."""
    held, seen, cancelled = set(), [], []
    async with workers(_holding_worker(4, held, seen, cancelled)) as urls:
        client = await _balancer(aiohttp_client, urls, max_retries=0, batch_size=8, busy_backoff_max=0.2,
                                 max_inflight_per_worker=2)
        rs = await asyncio.gather(*(client.post("/v1/completions", json={"prompt": f"p{i}"}) for i in range(12)))
        assert [r.status for r in rs] == [200] * 12, [await r.text() for r in rs]
        texts = [(await r.json())["choices"][0]["text"] for r in rs]
        assert len(set(t.split(".")[0] for t in texts)) == 12       # every request answered once, as itself
        assert any("." in t for t in texts)                          # some were sent again, under a new id
        stats = await (await client.get("/stats")).json()
        assert stats["redispatched_requests"] == 0 and stats["queue_depth"] == 0
        assert stats["in_flight"] == 0


async def test_refusals_use_no_retry_a_later_failure_still_has_its_retries(aiohttp_client):
    """A request refused by row 429s keeps every retry for real failures: refused three times, then its batch's
    connection cut, it is sent again (--max-retries 1) and answered (a review found the refusals' bookkeeping
    unchecked: a refusal that used a retry left such a request a 502 "failed on N workers")."""
    state = {"dispatches": 0}

    async def batch(request):
        ids = [item["id"] for item in (await request.json())["requests"]]
        state["dispatches"] += 1
        n = state["dispatches"]
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        if n == 4:
            request.transport.abort()                     # a failure: the request's one retry
            return resp
        for rid in ids:
            if n <= 3:
                line = {"id": rid, "event": "error", "status": 429, "end": True,
                        "data": {"error": {"message": "the worker queue is full", "type": "rate_limit_error",
                                           "param": None, "code": None}}}
            else:
                line = {"id": rid, "event": "response", "end": True, "data": {
                    "object": "text_completion", "choices": [{"index": 0, "text": rid, "finish_reason": "length"}]}}
            await resp.write(orjson.dumps(line) + b"\n")
        await resp.write_eof()
        return resp

    async with workers(worker_app(batch), worker_app(batch)) as urls:
        client = await _balancer(aiohttp_client, urls, max_retries=1, busy_backoff_max=0.05)
        r = await client.post("/v1/completions", json={"prompt": "p"})
        assert r.status == 200, await r.text()
        assert state["dispatches"] == 5
        stats = await (await client.get("/stats")).json()
        assert stats["redispatched_requests"] == 1


async def test_a_request_sent_again_to_a_worker_that_still_holds_it_is_not_refused_as_a_duplicate(aiohttp_client):
    """A batch's connection breaks while the worker goes on holding its rows; with no other worker the requests go
    back to the same one. Each dispatch of a request has its own id on the wire, so the worker takes them (a reviewer
    found the second dispatch refused whole as "duplicate request id", and the request answered that 400), and the
    abandoned rows are cancelled on the worker."""
    held, seen, cancelled = set(), [], []
    async with workers(_holding_worker(100, held, seen, cancelled, break_first=True)) as urls:
        client = await _balancer(aiohttp_client, urls, max_retries=2)
        rs = await asyncio.gather(*(client.post("/v1/completions", json={"prompt": f"p{i}"}) for i in range(3)))
        assert [r.status for r in rs] == [200] * 3, [await r.text() for r in rs]
        first = seen[0]
        later = [rid for ids in seen[1:] for rid in ids]
        assert not set(first) & set(later)                  # new ids on the wire
        for _ in range(100):
            if set(first) <= set(cancelled):
                break
            await asyncio.sleep(0.02)
        assert set(first) <= set(cancelled)                 # the abandoned rows dropped on the worker
        stats = await (await client.get("/stats")).json()
        assert stats["split_batches"] == 0


def _versioned_worker(health_hash: str, holds: str, seen: list):
    """A fake worker (test double) whose /health names weights ``health_hash`` while it holds ``holds`` (its weights
    changed behind the balancer's back since its last probe); rows pinned to other weights get their own 409, as a
    real worker's."""
    async def batch(request):
        items = (await request.json())["requests"]
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for item in items:
            seen.append((holds, item["id"]))
            wanted = orjson.loads(orjson.dumps(item["body"])).get("model_version")
            if wanted is not None and wanted != holds:
                err = {"error": {"message": f"model_version {wanted!r} is not what this worker serves",
                                 "type": "conflict_error", "param": "model_version",
                                 "code": "model_version_unavailable"}}
                line = {"id": item["id"], "event": "error", "status": 409, "data": err, "end": True}
            else:
                data = {"object": "text_completion", "model_version": {"hash": holds},
                        "choices": [{"index": 0, "text": holds, "finish_reason": "length"}]}
                line = {"id": item["id"], "event": "response", "data": data, "end": True}
            await resp.write(orjson.dumps(line) + b"\n")
        await resp.write_eof()
        return resp

    return worker_app(batch, health={**READY, "model_version": {"hash": health_hash, "path": "/m"}})


async def test_a_pinned_request_a_worker_refuses_for_its_changed_weights_goes_to_one_that_holds_them(aiohttp_client):
    """Requests pinned to weights A are routed by the workers' last /health; a worker whose weights changed since
    then refuses each such row with a 409. That 409 reached the client although another worker held A (a
    reviewer's finding: 12 of 16 pinned requests answered 409). The request now waits for a worker again, the
    refusing worker's weights counted unknown until its next probe."""
    seen = []
    async with workers(_versioned_worker("A", "B", seen), _versioned_worker("A", "A", seen)) as urls:
        client = await _balancer(aiohttp_client, urls, max_retries=0, idle_dispatch=True)
        rs = await asyncio.gather(*(client.post("/v1/completions", json={"prompt": f"p{i}", "model_version": "A"})
                                    for i in range(8)))
        assert [r.status for r in rs] == [200] * 8, [await r.text() for r in rs]
        assert {(await r.json())["choices"][0]["text"] for r in rs} == {"A"}
        assert "B" in {h for h, _ in seen}                   # the changed worker was tried, and refused
        stats = await (await client.get("/stats")).json()
        assert stats["redispatched_requests"] == 0 and stats["queue_depth"] == 0 and stats["in_flight"] == 0


def _refusing_worker(refuse: set, hold: float):
    """A fake worker (test double): rows of requests in ``refuse`` get a 429 line at once (its queue full), the
    others are answered after ``hold`` seconds."""
    async def batch(request):
        ids = [it["id"] for it in (await request.json())["requests"]]
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for rid in ids:
            if rid.split(".")[0] in refuse:
                err = {"error": {"message": "full", "type": "rate_limit_error", "param": None, "code": None}}
                await resp.write(orjson.dumps({"id": rid, "event": "error", "status": 429, "end": True,
                                               "data": err}) + b"\n")
        await asyncio.sleep(hold)
        for rid in ids:
            if rid.split(".")[0] not in refuse:
                data = {"choices": [{"index": 0, "text": rid, "finish_reason": "length"}]}
                await resp.write(orjson.dumps({"id": rid, "event": "response", "end": True, "data": data}) + b"\n")
        await resp.write_eof()
        return resp

    return worker_app(batch)


async def test_a_cancel_closes_the_dispatch_a_refused_request_was_sent_again_in():
    """A request refused by a row 429 stayed in its first dispatch (which went on with its other rows) while it was
    sent again; a cancel then checked whichever of the two dispatches came first, so the second one, holding only
    the cancelled request, kept its place on the worker until the worker answered (a reviewer's finding: half the
    trials). The refused request leaves its first dispatch."""
    import aiohttp
    from balancer.batcher import CentralBatcher, Pending
    from balancer.pool import WorkerPool
    for _ in range(3):
        async with workers(_refusing_worker({"a"}, 1.0), _refusing_worker(set(), 1.0)) as urls:
            async with aiohttp.ClientSession() as session:
                pool = WorkerPool(urls, lambda: session, HealthConfig())
                for w in pool.workers:
                    await pool.probe(w, session)
                b = CentralBatcher(pool, lambda: session, BatchConfig(batch_size=8, wait_time=0.01,
                                                                      idle_dispatch=False, busy_backoff_max=5))
                pool.workers[1].busy_until = time.monotonic() + 60           # the first batch goes to worker 0
                b.start()
                try:
                    a = Pending(id="a", kind="completion", body=b'{"prompt":"x"}', stream=False)
                    c = Pending(id="c", kind="completion", body=b'{"prompt":"x"}', stream=False)
                    b.submit(a)
                    b.submit(c)
                    for _ in range(250):                # (not a fixed time: a slow machine forms it later)
                        await asyncio.sleep(0.02)
                        if a.attempt >= 2:              # refused by worker 0 (c still held there)
                            break
                    assert a.attempt >= 2 and c.worker is pool.workers[0]
                    pool.workers[1].busy_until = 0.0            # worker 1 may take it now
                    for _ in range(250):
                        await asyncio.sleep(0.02)
                        if a.worker is pool.workers[1]:
                            break
                    assert a.worker is pool.workers[1]       # refused by worker 0, sent again to worker 1
                    on_1 = [d.batch for d in b._dispatches if d.worker is pool.workers[1]]
                    assert [[p.id for p in batch] for batch in on_1] == [["a"]], on_1
                    await asyncio.sleep(0.1)
                    t = time.monotonic()
                    b.cancel(a)
                    while pool.workers[1].inflight_batches:
                        await asyncio.sleep(0.01)
                    assert time.monotonic() - t < 0.5        # closed at once, not when the worker answered
                finally:
                    await b.close()


async def test_a_refused_connection_uses_no_retry_the_request_goes_to_a_live_worker(aiohttp_client):
    """A worker that died between its last probe and a dispatch refuses the connection: the batch never reached it,
    so its requests go back to the queue without using a retry (with max_retries 0 they got a 502 "failed on 1
    workers"; a chaos run saw killed workers burn all three tries in milliseconds while another was healthy)."""
    seen = []
    dead, live = TestServer(fake_worker("ok", seen)), TestServer(fake_worker("ok", seen))
    await dead.start_server()
    await live.start_server()
    try:
        urls = [str(dead.make_url("")).rstrip("/"), str(live.make_url("")).rstrip("/")]
        cfg = BalancerConfig(worker_urls=urls, batch=BatchConfig(batch_size=8, wait_time=0.01, max_retries=0),
                             health=HealthConfig(interval=30, timeout=1))       # no probe after the first
        client = await aiohttp_client(make_app(cfg))
        for _ in range(200):
            if (await (await client.get("/health")).json())["healthy_workers"] == 2:
                break
            await asyncio.sleep(0.02)
        await dead.close()                        # the first in the ranking, still healthy to the balancer
        r = await client.post("/v1/completions", json={"prompt": "a"})
        assert r.status == 200, await r.text()
        assert (await r.json())["choices"][0]["text"] == "ok-completion" and len(seen) == 1
        ws = await (await client.get("/worker-status")).json()
        assert [w["status"] for w in ws["workers"]] == ["unhealthy", "idle"]
        stats = await (await client.get("/stats")).json()
        assert stats["redispatched_requests"] == 0
    finally:
        await live.close()
