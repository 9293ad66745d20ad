"""A bare batching proxy (not a product: a bound for `balancer_bench.py proxy --bare`). What any balancer of this
design must do for a request, and nothing more: read the body, check it is a JSON object (it is spliced into the
batch), queue it, send batches (up to --batch-size, --batch-wait-time, --max-inflight-per-worker, an idle worker
served at once: the balancer's batching) to the least-loaded worker's /worker/batch, and answer each request from
its last NDJSON line. No validation of the OpenAI fields, no statistics or metrics, no body budget, timeouts,
cancellation, retries or failover, no streaming; aiohttp's low-level server on uvloop, the collector settled as the
balancer's. Its requests per second over nginx's is the most the balancer's one process could reach on the same
machine with aiohttp (docs/benchmarks.md, balancer (a)).

  python bench/bare_balancer.py --worker-urls http://127.0.0.1:8001,http://127.0.0.1:8002 --port 8000
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import itertools

import aiohttp
import orjson
from aiohttp import web


class Bare:
    def __init__(self, urls: list[str], batch_size: int, wait: float, inflight: int):
        self.urls, self.batch_size, self.wait, self.inflight = urls, batch_size, wait, inflight
        self.busy = dict.fromkeys(urls, 0)          # batches in flight per worker
        self.queue: list[tuple[bytes, asyncio.Future, float]] = []     # (body, answer, queued at)
        self.ids = itertools.count()
        self.timer: asyncio.TimerHandle | None = None
        self.session: aiohttp.ClientSession | None = None

    def dispatch_ready(self) -> None:
        """Send what the queue holds while a worker has a place: a full batch, or any batch once a worker is idle
        or the first queued request has waited ``--batch-wait-time``."""
        while self.queue:
            w = min(self.urls, key=self.busy.__getitem__)
            if self.busy[w] >= self.inflight:
                return
            if len(self.queue) < self.batch_size and self.busy[w]:
                first = self.queue[0][2]          # (a request that has waited its time goes at the next place)
                left = first + self.wait - asyncio.get_running_loop().time()
                if left > 0:
                    if self.timer is None:
                        self.timer = asyncio.get_running_loop().call_later(left, self.waited)
                    return
            batch, self.queue = self.queue[:self.batch_size], self.queue[self.batch_size:]
            self.busy[w] += 1
            asyncio.ensure_future(self.send(w, batch))

    def waited(self) -> None:
        self.timer = None
        self.dispatch_ready()

    async def send(self, worker: str, batch: list) -> None:
        futures, parts = {}, [b'{"requests":[']
        for i, (body, fut, _) in enumerate(batch):
            rid = str(next(self.ids))
            futures[rid] = fut
            parts += (b',{"id":"' if i else b'{"id":"', rid.encode(), b'","kind":"completion","body":', body, b"}")
        parts.append(b"]}")
        try:
            async with self.session.post(worker + "/worker/batch", data=b"".join(parts),
                                         headers={"Content-Type": "application/json"}) as r:
                buf = b""
                async for data in r.content.iter_any():
                    buf += data
                    if b"\n" in data:
                        *lines, buf = buf.split(b"\n")
                        for line in lines:
                            if line:
                                ev = orjson.loads(line)
                                if ev.get("end"):
                                    fut = futures.pop(ev["id"])
                                    if not fut.done():
                                        fut.set_result((ev.get("status", 200), ev.get("data")))
        finally:
            self.busy[worker] -= 1
            for fut in futures.values():
                if not fut.done():
                    fut.set_result((502, {"error": {"message": "lost"}}))
            self.dispatch_ready()

    async def handle(self, request: web.BaseRequest) -> web.Response:
        if request.method == "GET":             # what the bench polls before it starts
            data = {"healthy_workers": len(self.urls), "http_processes": [{"status": "ready"}]}
            return web.Response(body=orjson.dumps(data), content_type="application/json")
        body = await request.read()
        try:
            if not isinstance(orjson.loads(body), dict):
                raise ValueError
        except ValueError:
            return web.Response(status=400)
        fut = asyncio.get_running_loop().create_future()
        self.queue.append((body, fut, asyncio.get_running_loop().time()))
        self.dispatch_ready()
        status, data = await fut
        return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


async def serve(a) -> None:
    bare = Bare(a.worker_urls.split(","), a.batch_size, a.batch_wait_time, a.max_inflight_per_worker)
    bare.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30))
    runner = web.ServerRunner(web.Server(bare.handle, access_log=None))
    await runner.setup()
    await web.TCPSite(runner, a.host, a.port).start()
    gc.freeze()
    gc.set_threshold(20_000, *gc.get_threshold()[1:])      # as the balancer's HTTP processes (common.http)
    await asyncio.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker-urls", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--batch-wait-time", type=float, default=0.02)
    ap.add_argument("--max-inflight-per-worker", type=int, default=2)
    a = ap.parse_args()
    import uvloop
    uvloop.run(serve(a))


if __name__ == "__main__":
    main()
