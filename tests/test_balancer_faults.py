"""Fine-grained failover with fault-injecting fake workers (test doubles: in-process aiohttp servers that speak
/health and /worker/batch and crash on cue)."""
import asyncio

import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer

from balancer.app import BalancerConfig, make_app
from balancer.batcher import BatchConfig
from balancer.pool import HealthConfig


def fake_worker(mode: str, log: list):
    async def health(request):
        return web.json_response({"status": "ready", "busy": False, "seconds_since_last_step": 0.0})

    async def batch(request):
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        for item in body["requests"]:
            log.append((mode, item["id"]))
        for item in body["requests"]:
            rid, stream = item["id"], item["body"].get("stream", False)
            if stream:
                chunk = {"id": "c", "object": "text_completion", "created": 1, "model": "m",
                         "choices": [{"index": 0, "text": f"{mode}-text", "finish_reason": None}]}
                await resp.write(orjson.dumps({"id": rid, "event": "chunk", "data": chunk}) + b"\n")
                if mode == "die":
                    request.transport.abort()          # crash mid-stream: bytes already went to the client
                    return resp
                final = dict(chunk, choices=[{"index": 0, "text": "", "finish_reason": "length"}])
                await resp.write(orjson.dumps({"id": rid, "event": "chunk", "data": final}) + b"\n")
            else:
                if mode == "die":
                    request.transport.abort()
                    return resp
                data = {"id": "x", "object": "text_completion", "created": 1, "model": "m",
                        "choices": [{"index": 0, "text": f"{mode}-answer", "finish_reason": "length"}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
                await resp.write(orjson.dumps({"id": rid, "event": "response", "data": data}) + b"\n")
            await resp.write(orjson.dumps({"id": rid, "event": "end"}) + b"\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/worker/batch", batch)
    return app


async def _balancer(aiohttp_client, urls, **batch):
    cfg = BalancerConfig(worker_urls=urls, batch=BatchConfig(batch_size=8, wait_time=0.05, **batch),
                         health=HealthConfig(interval=0.05, timeout=1, stall_timeout=5))
    client = await aiohttp_client(make_app(cfg))
    for _ in range(200):
        if (await (await client.get("/health")).json())["healthy_workers"] == len(urls):
            return client
        await asyncio.sleep(0.02)
    raise TimeoutError


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
        assert (await plain_resp.json())["choices"][0]["text"] == "ok-answer"
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
    r = await client.post("/v1/completions", json={"prompt": "a", "top_p": 0.2})
    assert r.status == 400 and (await r.json())["error"]["param"] == "top_p"


async def test_retries_are_bounded(aiohttp_client):
    log = []
    servers = [TestServer(fake_worker("die", log)) for _ in range(2)]
    for s in servers:
        await s.start_server()
    try:
        client = await _balancer(aiohttp_client, [str(s.make_url("")) for s in servers], max_retries=2)
        r = await client.post("/v1/completions", json={"prompt": "b"})
        assert r.status == 502 and "failed on 3 workers" in (await r.json())["error"]["message"]
        assert len(log) == 3
    finally:
        for s in servers:
            await s.close()


async def test_request_timeout_is_504_and_the_worker_is_told(aiohttp_client):
    """A worker that never answers: after --request-timeout the client gets 504, the worker a cancel for that id,
    and the balancer keeps serving."""
    seen, cancelled = [], []

    async def health(request):
        return web.json_response({"status": "ready", "busy": True, "seconds_since_last_step": 0.0})

    async def batch(request):
        body = await request.json()
        seen.extend(item["id"] for item in body["requests"])
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        await asyncio.sleep(30)                 # hangs (progress is reported by /health, so it is not stalled)
        return resp

    async def cancel(request):
        cancelled.extend((await request.json())["ids"])
        return web.json_response({"cancelled": 1})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/worker/batch", batch)
    app.router.add_post("/worker/cancel", cancel)
    hanging = TestServer(app)
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
        assert sorted(cancelled) == sorted(seen) and len(seen) == 2
        stats = await (await client.get("/stats")).json()
        assert stats["last_minute"]["requests"] == 2 and stats["last_minute"]["ok"] == 0
        assert stats["queue_depth"] == 0
    finally:
        await hanging.close()
