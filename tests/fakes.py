"""Fault-injecting fake workers (test doubles): in-process aiohttp servers that speak /health, /worker/batch and
/worker/cancel like a worker, and crash or hang on cue."""
import asyncio
import contextlib

import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer

CHUNK = {"id": "c", "object": "text_completion", "created": 1, "model": "m"}
READY = {"status": "ready", "busy": False, "seconds_since_last_step": 0.0}


def worker_app(batch, cancel=None, health: dict | None = None) -> web.Application:
    """A fake worker's routes: GET /health answering ``health`` (default: ready), POST /worker/batch by ``batch``,
    POST /worker/cancel by ``cancel`` (default: one that cancels nothing)."""
    async def answer_health(request):
        return web.json_response(health or READY)

    async def no_cancel(request):
        return web.json_response({"cancelled": 0})

    app = web.Application()
    app.router.add_get("/health", answer_health)
    app.router.add_post("/worker/batch", batch)
    app.router.add_post("/worker/cancel", cancel or no_cancel)
    return app


def fake_worker(mode: str, seen: list, cancelled: list | None = None, delay: float = 0.0,
                version: str | None = None):
    """mode: ok (answers), die (drops the connection after a stream's first chunk / before a plain answer),
    hang (never answers), garbage (a well-formed HTTP stream of lines that are JSON but not events).
    ``version``: the hash of the weights it says it holds (/health's model_version, stamped on its answers; a batch
    that allows other weights gets the worker's 409, as a real worker's)."""
    held = {"hash": version, "path": f"/weights/{version}"} if version else None

    async def health(request):
        return web.json_response({"status": "ready", "busy": False, "seconds_since_last_step": 0.0,
                                  "model_version": held})

    async def batch(request):
        body = await request.json()
        allowed = body.get("model_versions")
        if held and isinstance(allowed, list) and version not in allowed:
            return web.json_response({"error": {"message": "other weights", "type": "conflict_error", "param": None,
                                                "code": "model_version_unavailable"}, "model_version": held},
                                     status=409)
        seen.extend((mode, item["id"]) for item in body["requests"])
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        if mode == "hang":
            await asyncio.sleep(60)
        if mode == "garbage":
            await resp.write(b'[1, 2]\n{"id": null}\n')
            await resp.write_eof()
            return resp
        await asyncio.sleep(delay)
        for item in body["requests"]:
            rid, stream = item["id"], item["body"].get("stream", False)
            if stream:
                chunk = dict(CHUNK, choices=[{"index": 0, "text": f"{mode}-text", "finish_reason": None}])
                await resp.write(orjson.dumps({"id": rid, "event": "chunk", "data": chunk}) + b"\n")
                if mode == "die":
                    request.transport.abort()
                    return resp
                final = dict(CHUNK, choices=[{"index": 0, "text": "", "finish_reason": "length"}])
                await resp.write(orjson.dumps({"id": rid, "event": "chunk", "data": final, "end": True}) + b"\n")
            else:
                if mode == "die":
                    request.transport.abort()
                    return resp
                data = dict(CHUNK, choices=[{"index": 0, "text": f"{mode}-{item['kind']}", "finish_reason": "length"}],
                            usage={"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7})
                if held:
                    data["model_version"] = held
                await resp.write(orjson.dumps({"id": rid, "event": "response", "data": data, "end": True}) + b"\n")
        await resp.write_eof()
        return resp

    async def cancel(request):
        if cancelled is not None:
            cancelled.extend((await request.json())["ids"])
        return web.json_response({"cancelled": 1})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/worker/batch", batch)
    app.router.add_post("/worker/cancel", cancel)
    return app


@contextlib.asynccontextmanager
async def workers(*apps):
    servers = [TestServer(a) for a in apps]
    for s in servers:
        await s.start_server()
    try:
        yield [str(s.make_url("")).rstrip("/") for s in servers]
    finally:
        for s in servers:
            await s.close()
