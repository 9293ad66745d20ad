"""One request can never fail another (issue 14): one JSON language for the balancer, its fronts and the worker; a
worker rejects rows, not batches; a whole-batch rejection is split, never failed together; security defaults.

The poison tests run a real worker app (in-process, on the tiny fixture) behind a real balancer, with one HTTP process
and with a front process; the split test uses a fake worker (a test double that rejects whole batches on cue)."""
import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.app import BalancerConfig, make_app
from balancer.batcher import BatchConfig
from balancer.pool import HealthConfig
from common.protocol import MAX_DEPTH, APIError, loads, parse_request
from tests.conftest import ROOT, TINY_LLADA
from tests.fakes import fake_worker, workers
from tests.helpers import free_port, raw_http, read_http_answer
from tests.test_balancer_fronts import balancer as balancer_with_fronts
from tests.test_balancer_fronts import wait_ready
from worker.app import WorkerConfig
from worker.app import make_app as make_worker_app

GOOD = {"prompt": [5, 6, 7], "max_tokens": 8, "block_length": 8, "ignore_eos": True}
POISONS = [   # (raw body, status): each is rejected, alone, and must not touch the good requests batched with it
    (b'{"prompt": "hi", "max_tokens": 8, "x_extra": NaN}', 400),              # the case
    (b'{"prompt": "hi", "max_tokens": 8, "x_extra": Infinity}', 400),
    (b'{"prompt": "hi", "max_tokens": 8, "x_extra": -1e400}', 400),
    (b'{"prompt": "hi", "max_tokens": 8, "x_extra": "\\ud800"}', 400),        # a lone surrogate
    (b'{"prompt": "hi", "max_tokens": 8, "x_extra": "\xff"}', 400),          # invalid UTF-8
    (b'{"prompt": "hi", "x": ' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"}", 400),
    (orjson.dumps({"prompt": [1, 10 ** 6], "max_tokens": 8}), 400),           # passes the balancer; the worker's row
    (orjson.dumps({"prompt": "hi", "max_tokens": 10 ** 9}), 400),             # idem: longer than the context
    (orjson.dumps({"prompt": "hi", "model": "another-model"}), 404),          # idem
]


def test_one_json_language():
    """What the strict parser refuses, every server refuses; what it accepts, the worker's batch envelope carries."""
    for raw, _ in POISONS[:6]:
        with pytest.raises(APIError) as e:
            parse_request("completion", raw)
        assert e.value.status == 400
    ok = b'{"prompt": "hi", "x": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}"
    assert parse_request("completion", ok).prompt == "hi"
    # numbers: a huge integer reads as a float (so an int field refuses it), never as an exact big int on one
    # side and a float on the other
    with pytest.raises(APIError) as e:
        parse_request("completion", b'{"prompt": "hi", "max_tokens": 100000000000000000000000000000}')
    assert e.value.param == "max_tokens"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=10), json_values, max_size=6), st.sampled_from([b" ", b"\n", b""]))
def test_every_body_the_balancer_accepts_fits_the_worker_envelope(body, space):
    raw = json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass") + space
    try:
        value = loads(raw)
    except APIError:
        return
    envelope = b'{"requests":[{"id":"a","kind":"completion","body":' + raw + b"}]}"
    assert loads(envelope, MAX_DEPTH + 3)["requests"][0]["body"] == value


@contextlib.asynccontextmanager
async def real_worker(**kw):
    server = TestServer(make_worker_app(WorkerConfig(model_path=str(TINY_LLADA), device="cpu", **kw)))
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(600):
                async with s.get(url + "/health") as r:
                    if (await r.json())["status"] == "ready":
                        break
                await asyncio.sleep(0.05)
        yield url
    finally:
        await server.close()


async def _raw_post(session: aiohttp.ClientSession, url: str, body: bytes):
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        return r.status, orjson.loads(await r.read())


async def _poison_round(base: str, poison: bytes) -> tuple[list, tuple]:
    """7 good requests and one poison, sent together so they share a batch (batch wait 0.3 s)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        results = await asyncio.gather(*[_raw_post(s, base + "/v1/completions", orjson.dumps(GOOD))
                                         for _ in range(7)], _raw_post(s, base + "/v1/completions", poison))
    return list(results[:7]), results[7]


def _check_round(goods, bad, status, expected_text):
    assert bad[0] == status, bad
    assert set(bad[1]["error"]) == {"message", "type", "param", "code"}
    assert [s for s, _ in goods] == [200] * 7, goods
    assert {b["choices"][0]["text"] for _, b in goods} == {expected_text}


async def test_a_poison_request_fails_alone(aiohttp_client):
    async with real_worker() as url:
        cfg = BalancerConfig(worker_urls=[url], batch=BatchConfig(batch_size=8, wait_time=0.3, idle_dispatch=False),
                             health=HealthConfig(interval=0.05, timeout=2))
        client = await aiohttp_client(make_app(cfg))
        while (await (await client.get("/health")).json())["healthy_workers"] != 1:
            await asyncio.sleep(0.02)
        base = str(client.make_url("")).rstrip("/")
        async with aiohttp.ClientSession() as s:
            expected = (await _raw_post(s, base + "/v1/completions", orjson.dumps(GOOD)))[1]["choices"][0]["text"]
        for poison, status in POISONS:
            goods, bad = await _poison_round(base, poison)
            _check_round(goods, bad, status, expected)
        stats = await (await client.get("/stats")).json()
        assert stats["redispatched_requests"] == 0 and stats["split_batches"] == 0
        assert stats["workers"][0]["errors"] == 0 and stats["workers"][0]["status"] in ("idle", "busy")
        assert stats["centralized_batching"]["avg_batch_size"] > 1     # the poisons really shared batches


async def test_a_poison_request_fails_alone_through_a_front_process():
    async with real_worker() as url, balancer_with_fronts([url], processes=2,
                                                          batch=BatchConfig(batch_size=8, wait_time=0.3, idle_dispatch=False)) as base:
        async with aiohttp.ClientSession() as s:
            expected = (await _raw_post(s, base + "/v1/completions", orjson.dumps(GOOD)))[1]["choices"][0]["text"]
        for poison, status in POISONS[:2] + POISONS[6:7]:
            for _ in range(2):       # connections spread over both processes
                goods, bad = await _poison_round(base, poison)
                _check_round(goods, bad, status, expected)
        async with aiohttp.ClientSession() as s, s.get(base + "/stats") as r:
            stats = await r.json()
        assert stats["redispatched_requests"] == 0 and stats["workers"][0]["errors"] == 0
        assert all(p["requests"] > 0 for p in stats["http_processes"])


def rejecting_worker(seen: list):
    """A fake worker whose batch parser disagrees with the balancer's: a batch holding "poison" anywhere is
    rejected whole (400), as a worker with a stricter parser would; otherwise every row is answered."""
    async def health(request):
        return web.json_response({"status": "ready", "busy": False, "seconds_since_last_step": 0.0})

    async def batch(request):
        raw = await request.read()
        items = orjson.loads(raw)["requests"]
        seen.append(len(items))
        if b"poison" in raw:
            return web.json_response({"error": {"message": "poison refused", "type": "invalid_request_error",
                                                "param": "x", "code": None}}, status=400)
        lines = [orjson.dumps({"id": it["id"], "event": "response", "end": True, "data": {
            "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}}) for it in items]
        return web.Response(body=b"\n".join(lines) + b"\n", content_type="application/x-ndjson")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/worker/batch", batch)
    return app


async def test_a_whole_batch_rejection_is_split_not_failed(aiohttp_client):
    seen = []
    async with workers(rejecting_worker(seen)) as urls:
        cfg = BalancerConfig(worker_urls=urls, batch=BatchConfig(batch_size=8, wait_time=0.2, max_retries=0, idle_dispatch=False),
                             health=HealthConfig(interval=0.05, timeout=2))
        client = await aiohttp_client(make_app(cfg))
        while (await (await client.get("/health")).json())["healthy_workers"] != 1:
            await asyncio.sleep(0.02)
        rs = await asyncio.gather(*[client.post("/v1/completions", json={"prompt": "a"}) for _ in range(5)],
                                  client.post("/v1/completions", json={"prompt": "a", "x": "poison"}))
        assert [r.status for r in rs] == [200] * 5 + [400]
        assert (await rs[-1].json())["error"]["message"] == "poison refused"     # the worker's own answer
        assert seen[0] == 6 and sorted(seen[1:]) == [1] * 6                     # split, each row alone
        stats = await (await client.get("/stats")).json()
        assert stats["split_batches"] == 1 and stats["redispatched_requests"] == 0
        assert stats["workers"][0]["errors"] == 0 and stats["healthy_workers"] == 1


async def test_wrong_content_type_is_415(aiohttp_client):
    async with workers(rejecting_worker([])) as urls:
        client = await aiohttp_client(make_app(BalancerConfig(worker_urls=urls)))
        r = await client.post("/v1/completions", data=b'{"prompt": "a"}', headers={"Content-Type": "text/xml"})
        assert r.status == 415 and (await r.json())["error"]["type"] == "invalid_request_error"
        form = aiohttp.FormData({"prompt": "a"}, default_to_multipart=True)
        r = await client.post("/v1/chat/completions", data=form)
        assert r.status == 415


# ---------------------------------------------------------------- security defaults
async def test_api_key_guards_openai_endpoints_only(aiohttp_client):
    async with workers(rejecting_worker([])) as urls:
        client = await aiohttp_client(make_app(BalancerConfig(worker_urls=urls, api_key="k")))
        for path in ("/v1/completions", "/v1/chat/completions"):
            r = await client.post(path, json={"prompt": "a"})
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
        assert (await client.get("/v1/models")).status == 401
        for path in ("/generation/algorithms", "/tokenizer_info"):           # as on a worker (issue 29)
            r = await client.get(path)
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key", path
        for path in ("/health", "/stats", "/worker-status", "/metrics"):     # read-only status: open
            assert (await client.get(path)).status in (200, 503)


async def test_worker_key_guards_batch_and_cancel(aiohttp_client):
    client = await aiohttp_client(make_worker_app(WorkerConfig(model_path=str(TINY_LLADA), device="cpu",
                                                                api_key="wk")))
    for path, body in (("/worker/batch", {"requests": []}), ("/worker/cancel", {"ids": ["x"]}),
                       ("/v1/completions", {"prompt": "a"})):
        r = await client.post(path, json=body)
        assert r.status == 401, path
    r = await client.post("/worker/cancel", json={"ids": ["x"]}, headers={"Authorization": "Bearer wk"})
    assert r.status == 200 and (await r.json()) == {"cancelled": 0}
    assert (await client.get("/health")).status == 200 and (await client.get("/metrics")).status == 200


def test_supervisor_locks_worker_ports_when_clients_need_a_key(tmp_path, monkeypatch):
    from balancer.supervisor import ServeConfig, Supervisor
    monkeypatch.setenv("DLLM_API_KEY", "client-key")
    cfg = ServeConfig(model_path="m", cpu_workers=1, log_dir=tmp_path,
                      balancer=BalancerConfig(worker_urls=[], api_key="client-key"))
    sup = Supervisor(cfg)
    key = sup.cfg.worker_api_key
    assert key and key != "client-key" and len(key) >= 32
    open_ = Supervisor(ServeConfig(model_path="m", cpu_workers=1, log_dir=tmp_path, balancer=BalancerConfig([])))
    assert open_.cfg.worker_api_key is None
    shared = Supervisor(ServeConfig(model_path="m", cpu_workers=1, log_dir=tmp_path, worker_api_key="given",
                                    balancer=BalancerConfig(worker_urls=[], api_key="client-key")))
    assert shared.cfg.worker_api_key == "given"


# ---------------------------------------------------------------- issue 29: paths, the key, malformed HTTP
# GET targets sent as they are (curl --path-as-is): each reached the worker's /batch/stats, with the worker key, when
# the balancer forwarded the client's decoded path
TRAVERSALS = [
    b"/v1/models/%2e%2e/%2e%2e/batch/stats",                       # the case
    b"/v1/models/%2E%2E/%2E%2E/batch/stats",
    b"/v1/models/..%2f..%2fbatch%2fstats",                         # encoded separators
    b"/v1/models/%2e%2e%2F%2e%2e%2Fbatch%2Fstats",
    b"/v1/models/%252e%252e/%252e%252e/batch/stats",               # double encoding
    b"/v1/models/%252e%252e%252f%252e%252e%252fbatch%252fstats",
    b"/v1/models/..\\..\\batch\\stats",                            # backslashes
    b"/v1/models/%5c..%5c..%5cbatch%5cstats",
    b"/v1/models/.%2e/%2e./batch/stats",                           # mixed
    b"/v1/models/%2e%2e/%2e%2e%5cbatch/stats",
    b"/v1/models/x/../../../batch/stats",                          # plain dot segments
    b"/v1/models/./../../batch/stats",
    b"/v1/models/%2e%2e/%2e%2e/worker/batch",
    b"/generation/algorithms/../batch/stats",
    b"/health/%2e%2e/batch/stats",
]


def _get(port: int, target: bytes, key: str | None = "K") -> tuple[int, dict, bytes]:
    auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
    return raw_http(port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n" + auth + b"Connection: close\r\n\r\n")


def _openai_error(status: int, headers: dict, body: bytes) -> dict:
    assert headers.get("content-type", "").startswith("application/json"), (status, headers, body[:200])
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def recording_worker(seen: list):
    """A fake worker that records every path it is asked and answers any of them, /batch/stats included."""
    async def health(request):
        return web.json_response({"status": "ready", "busy": False, "seconds_since_last_step": 0.0})

    async def model(request):
        seen.append(request.raw_path)
        name = request.match_info["model"]
        if name in ("m", "org/name"):
            return web.json_response({"id": name, "object": "model"})
        return web.json_response({"error": {"message": "no", "type": "not_found_error", "param": "model",
                                            "code": "model_not_found"}}, status=404)

    async def anything(request):
        seen.append(request.raw_path)
        return web.json_response({"secret": request.path, "max_batch_size": 8})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models/{model:.+}", model)
    app.router.add_route("*", "/{tail:.*}", anything)
    return app


async def _no_traversal(port: int, seen: list) -> None:
    for target in TRAVERSALS:
        t0 = time.monotonic()
        status, headers, body = await asyncio.to_thread(_get, port, target)
        assert status == 404, (target, status, body[:300])
        assert _openai_error(status, headers, body)["code"] in ("model_not_found", "unknown_url"), target
        assert b"max_batch_size" not in body and b"secret" not in body, target
        status, _, body = await asyncio.to_thread(_get, port, b"/v1/models/m")      # a small request meanwhile
        assert status == 200 and json.loads(body)["id"] == "m" and time.monotonic() - t0 < 10
    assert all(p.startswith("/v1/models/") for p in seen), seen      # nothing else was ever asked of the worker
    status, _, body = await asyncio.to_thread(_get, port, b"/v1/models/org/name")    # ids may hold a '/'
    assert status == 200 and json.loads(body)["id"] == "org/name" and seen[-1] == "/v1/models/org%2Fname"


async def test_no_path_reaches_another_worker_route():
    """Issue 29 item 4: the balancer asks a worker only the routes it means to (the fixed route, the id as one
    encoded segment), whatever encoding of '..' or '/' the client uses, in the central and in a front process."""
    seen = []
    async with workers(recording_worker(seen)) as urls:
        async with balancer_with_fronts(urls, processes=1, api_key="K", worker_api_key="WK") as base:
            await _no_traversal(int(base.rsplit(":", 1)[1]), seen)
        seen.clear()
        async with balancer_with_fronts(urls, processes=2, api_key="K", worker_api_key="WK") as base:
            for _ in range(2):          # connections spread over both processes
                await _no_traversal(int(base.rsplit(":", 1)[1]), seen)


async def test_a_worker_answers_traversals_on_its_own_routes_only():
    async with real_worker() as url:
        port = int(url.rsplit(":", 1)[1])
        for target in TRAVERSALS:
            status, headers, body = await asyncio.to_thread(_get, port, target, None)
            assert status == 404 and b"max_batch_size" not in body, (target, status, body[:300])
            _openai_error(status, headers, body)


async def test_the_key_is_compared_in_constant_time(aiohttp_client, monkeypatch):
    """Issue 29 item 6: hmac.compare_digest, never ==; a key that is no text (invalid UTF-8) is a 401, not a 500."""
    import hmac
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    async with workers(recording_worker([])) as urls:
        client = await aiohttp_client(make_app(BalancerConfig(worker_urls=urls, api_key="secret-key")))
        port = client.server.port
        for key in (None, "secret-kez", "secret-ke", "secret-key2", "SECRET-KEY"):
            status, headers, body = await asyncio.to_thread(_get, port, b"/v1/models", key)
            assert status == 401 and _openai_error(status, headers, body)["code"] == "invalid_api_key", key
        status, headers, body = await asyncio.to_thread(
            raw_http, port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
                            b"Connection: close\r\n\r\n")
        assert status == 401, body
        status, _, _ = await asyncio.to_thread(_get, port, b"/v1/models", "secret-key")
        assert status != 401
        assert len(calls) == 7 and all(isinstance(a, bytes) and b == b"Bearer secret-key" for a, b in calls)


POST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
MALFORMED = [   # (what, parts sent 0.3 s apart): aiohttp's protocol layer refuses each, before or while reading
    ("a header line over 8,190 bytes", [b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n"]),
    ("a request line over 8,190 bytes", [b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"]),
    ("200 headers", [b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(200))
                     + b"\r\n"]),
    ("a bad request line", [b"GET /health HTTP/1.1 x\r\nHost: x\r\n\r\n"]),
    ("a bad Content-Length", [POST + b"Content-Length: abc\r\n\r\n{}"]),
    ("Content-Length and chunked", [POST + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n"
                                    b"0\r\n\r\n"]),
    ("a bad chunk size", [POST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"]),
    ("a bad chunk size once the body is being read", [POST + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n",
                                                       b"zz\r\n"]),
]


async def _malformed_is_openai_shaped(port: int, small: bytes) -> None:
    for what, parts in MALFORMED:
        t0 = time.monotonic()
        status, headers, body = await asyncio.to_thread(raw_http, port, *parts, gap=0.3, timeout=10)
        assert status == 400, (what, status, body[:300])
        err = _openai_error(status, headers, body)
        assert err["type"] == "invalid_request_error" and err["code"] == "malformed_http", what
        status, _, _ = await asyncio.to_thread(raw_http, port, small)       # a small request meanwhile
        assert status == 200 and time.monotonic() - t0 < 10, what


async def test_malformed_http_is_answered_in_the_openai_shape():
    """Issue 29 item 6: the balancer (through the runner every server uses) and a worker answer malformed HTTP with
    a JSON 400 in the OpenAI shape, not aiohttp's plain text; a bad chunk size after the handler began reading the
    body is answered too (aiohttp alone left that request waiting for ever)."""
    async with workers(fake_worker("ok", [])) as urls, balancer_with_fronts(urls, processes=1) as base:
        await _malformed_is_openai_shaped(int(base.rsplit(":", 1)[1]),
                                          POST + b'Content-Length: 15\r\nConnection: close\r\n\r\n{"prompt": "a"}')
    from common.http import AppRunner         # what every server runs its app with
    runner = AppRunner(make_worker_app(WorkerConfig(model_path=str(TINY_LLADA), device="cpu")))
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        await _malformed_is_openai_shaped(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    finally:
        await runner.cleanup()


async def test_a_large_body_is_parsed_off_the_event_loop(aiohttp_client, monkeypatch):
    """A 60 MiB body of token ids took 17 s of pydantic on the balancer's event loop (every client waited; the
    worker's too). Bodies over INLINE_BYTES are parsed on the large-body thread: here the parse of a large body
    is slowed (a test double: 1.5 s asleep inside it) and the balancer answers /health and a small request
    meanwhile; small bodies are still parsed on the loop. (A real parse's C parts hold the GIL: the loop waits for
    each of them, docs/reliability.md.)"""
    import threading

    from common import openai_http
    real, where = openai_http.parse_request, []

    def slowed(kind, body):
        where.append((len(body) > openai_http.INLINE_BYTES, threading.current_thread().name))
        if len(body) > openai_http.INLINE_BYTES:
            time.sleep(1.5)
        return real(kind, body)
    monkeypatch.setattr(openai_http, "parse_request", slowed)
    seen = []
    async with workers(fake_worker("ok", seen)) as urls:
        client = await aiohttp_client(make_app(BalancerConfig(worker_urls=urls, health=HealthConfig(interval=0.05))))
        while (await (await client.get("/health")).json())["healthy_workers"] != 1:
            await asyncio.sleep(0.02)
        big = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": [7] * 200_000, "max_tokens": 1}))
        while not where:
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        assert (await client.get("/health")).status == 200
        small = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert small.status == 200 and time.monotonic() - t0 < 1.0 and not big.done()
        assert (await big).status == 200
    loop_thread = threading.current_thread().name
    assert [(large, name == loop_thread) for large, name in where] == [(True, False), (False, True)]
    assert where[0][1].startswith("large-body")


def _stalled(port: int, head: bytes, sent: bytes, timeout: float = 10.0) -> tuple[int, dict, bytes, bool, float]:
    """Send ``head`` + ``sent`` of a body that promises more, then nothing: the answer, whether the server closed the
    connection after it, and the seconds it took."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head + sent)
        status, headers, body = read_http_answer(s)
        try:
            closed = s.recv(1) == b""
        except (socket.timeout, ConnectionResetError):
            closed = False
    return status, headers, body, closed, time.monotonic() - t0


def _closed_after(port: int, trickle: bytes = b"", gap: float = 0.1, timeout: float = 10.0) -> float:
    """Seconds until the server closes a connection that sends nothing (or ``trickle`` a byte every ``gap`` s)."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.settimeout(gap if trickle else timeout)
        for i in range(int(timeout / gap)):
            if trickle:
                try:
                    s.sendall(trickle[i % len(trickle):i % len(trickle) + 1])
                except OSError:
                    return time.monotonic() - t0
            try:
                if s.recv(1) == b"":
                    return time.monotonic() - t0
            except socket.timeout:
                continue
            except ConnectionResetError:
                return time.monotonic() - t0
    return float("inf")


async def _slow_clients_are_let_go(port: int, body_timeout: float, keepalive: float, multipart: bool) -> None:
    head = POST + b"Content-Length: 100\r\n\r\n"
    status, headers, body, closed, took = await asyncio.to_thread(_stalled, port, head, b'{"prompt": "a", ')
    assert status == 408 and closed and body_timeout - 0.1 < took < body_timeout + 2, (status, body, took)
    assert headers.get("connection") == "close"
    err = _openai_error(status, headers, body)
    assert err["code"] == "body_timeout" and "--body-timeout" in err["message"]
    chunked = POST + b"Transfer-Encoding: chunked\r\n\r\n"
    status, _, _, closed, took = await asyncio.to_thread(_stalled, port, chunked, b"4\r\n{\"pr\r\n")
    assert status == 408 and closed, status
    # a body that keeps coming, each piece within the timeout, is read whole however long it takes
    pieces = [b'{"prompt": "a", ', b'"max_tokens": 1', b", ", b'"n": 1}']
    parts = [POST + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % sum(map(len, pieces))] + pieces
    status, _, body = await asyncio.to_thread(raw_http, port, *parts, gap=body_timeout / 2)
    assert status == 200, body
    if multipart:            # an upload to /v1/files that stops midway through its file
        head = (b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=B\r\n"
                b"Content-Length: 100000\r\n\r\n")
        sent = (b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--B\r\nContent-Disposition: '
                b'form-data; name="file"; filename="a.jsonl"\r\n\r\n' + b" " * 20000)
        status, headers, body, closed, took = await asyncio.to_thread(_stalled, port, head, sent)
        assert status == 408 and closed and took < body_timeout + 2 and headers.get("connection") == "close", body
        # a field that arrives slowly, each piece within the timeout, is read whole: the timeout is per byte
        field = b"x" * 600
        pieces = [field[i:i + 100] for i in range(0, len(field), 100)] + [
            b'\r\n--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--B\r\nContent-'
            b'Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{}\n\r\n--B--\r\n']
        start = b'--B\r\nContent-Disposition: form-data; name="expires_after"\r\n\r\n'
        length = len(start) + sum(map(len, pieces))
        parts = [b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=B\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n" % length + start] + pieces
        status, _, body = await asyncio.to_thread(raw_http, port, *parts, gap=body_timeout / 2)
        assert status == 200, body
    # idle connections, and one that trickles its headers, are closed after --keepalive-timeout
    idle, trickled = await asyncio.gather(asyncio.to_thread(_closed_after, port),
                                          asyncio.to_thread(_closed_after, port, b"GET /health HTTP/1.1\r\nX-A: "
                                                                                 + b"a" * 200))
    assert keepalive - 0.1 < idle < keepalive + 2 and keepalive - 0.1 < trickled < keepalive + 2, (idle, trickled)


@pytest.mark.slow          # (6 s): the fast tier stays under 3 minutes
async def test_slow_clients_get_408_and_idle_connections_are_closed(tmp_path):
    """A client that stops sending its body midway held its connection, its handler and its share of
    --max-body-bytes-in-flight until it disconnected; one that trickled its headers was kept for an hour (aiohttp's
    idle default outside run_app). Now a body that goes --body-timeout without a byte gets a 408 (OpenAI shape) and
    its connection is closed; a body whose pieces keep coming is read whole; a connection idle for
    --keepalive-timeout, or still sending its headers by then, is closed. Through the runner every server uses."""
    from balancer.app import serve
    from common.http import BODY_TIMEOUT_S
    async with workers(fake_worker("ok", [])) as urls:
        port = free_port()
        cfg = BalancerConfig(worker_urls=urls, port=port, body_timeout=0.6, keepalive_timeout=1.0,
                             files_dir=str(tmp_path), health=HealthConfig(interval=0.05))
        stop = asyncio.Event()
        task = asyncio.create_task(serve(cfg, stop))
        try:
            await wait_ready(f"http://127.0.0.1:{port}", 1, 1)
            await _slow_clients_are_let_go(port, 0.6, 1.0, multipart=True)
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
    assert make_worker_app(WorkerConfig(model_path=str(TINY_LLADA), body_timeout=7.0))[BODY_TIMEOUT_S] == 7.0


async def test_a_stalled_body_gives_back_its_share(aiohttp_client):
    """The 408's request gives its Content-Length back to the body budget at once."""
    from common.http import BODY_BUDGET
    async with workers(fake_worker("ok", [])) as urls:
        client = await aiohttp_client(make_app(BalancerConfig(worker_urls=urls, body_timeout=0.3)))
        budget = client.server.app[BODY_BUDGET]
        status, *_ = await asyncio.to_thread(_stalled, client.server.port, POST + b"Content-Length: 5000000\r\n\r\n",
                                             b"{")
        assert status == 408 and budget.used == 0 and budget.peak == 5_000_000


@pytest.mark.slow
async def test_slow_clients_are_let_go_by_front_processes_too():
    """The same through --http-processes 2: the fronts take the balancer's --body-timeout and --keepalive-timeout
    (connections spread over both processes by the kernel)."""
    async with workers(fake_worker("ok", [])) as urls, \
            balancer_with_fronts(urls, processes=2, body_timeout=0.6, keepalive_timeout=1.0) as base:
        port = int(base.rsplit(":", 1)[1])
        await asyncio.gather(*(_slow_clients_are_let_go(port, 0.6, 1.0, multipart=True) for _ in range(4)))


async def _send_timeout_cases(timeout: float) -> dict:
    """Three clients at once against a server run by common.http.AppRunner with --send-timeout ``timeout``, each
    answered up to 64 MiB: one reads nothing; one reads ~400 KB/s for 2.5 s (default socket buffers: the kernel's
    on loopback hold MiBs, so the transport's own buffer moves only after a third of them empties, and TCP
    acknowledges a reader's progress in steps of two segments, 128 KiB on loopback); one reads nothing
    while its handler's write is cancelled by a timeout of its own, then writes again. What each handler saw."""
    from common.http import AppRunner
    ends: dict = {}

    async def big(request):
        case = request.query["case"]
        resp = web.StreamResponse()
        await resp.prepare(request)
        last = time.monotonic()
        try:
            try:
                async with asyncio.timeout(0.5 if case == "cancelled" else None):
                    for _ in range(1024):
                        await resp.write(b"x" * 65536)
                        last = time.monotonic()
            except TimeoutError:
                last = time.monotonic()
                await resp.write(b"x")        # writes after a cancelled wait (a 504 after --request-timeout)
                await resp.write_eof()
            ends[case] = ("done", time.monotonic() - last)
        except BaseException as e:
            ends[case] = (type(e).__name__, time.monotonic() - last)
            raise
        return resp

    app = web.Application()
    app.router.add_get("/big", big)
    runner = AppRunner(app, handler_cancellation=True, access_log=None, send_timeout=timeout)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]

    def client(case: str) -> dict:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET /big?case=%s HTTP/1.1\r\nHost: x\r\n\r\n" % case.encode())
            if case != "steady":
                time.sleep(3.0)
                return dict(ends)
            t0, got = time.monotonic(), 0
            while time.monotonic() - t0 < 2.5:
                time.sleep(0.02)
                got += len(s.recv(8192))
            return {"got": got, "ended_while_reading": dict(ends).get("steady")}

    try:
        assert runner.server.send_timeout == timeout
        seen = await asyncio.gather(*(asyncio.to_thread(client, c) for c in ("nothing", "steady", "cancelled")))
        return {**ends, "steady_client": seen[1]}
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("loop", [pytest.param("asyncio", marks=pytest.mark.slow), "uvloop"])
async def test_a_client_that_takes_nothing_of_its_answer_is_dropped_after_the_send_timeout(loop):
    """A client that sent its request and reads nothing held its handler (and at a balancer, its request) for ever:
    an answer's writes wait for the client once the buffers are full, with no timeout. Now, --send-timeout passed
    with no byte taken by the client, the connection is dropped and the write fails as on a client's disconnect,
    also for a write after a wait cancelled by another timeout; a client reading slowly but steadily is not
    dropped. On the servers' loop (uvloop) and asyncio's."""
    if loop == "uvloop":
        import uvloop
        seen = await asyncio.to_thread(uvloop.run, _send_timeout_cases(0.8))
    else:
        seen = await _send_timeout_cases(0.8)
    assert seen["nothing"][0] in ("ConnectionResetError", "CancelledError") and seen["nothing"][1] < 2.8, seen
    assert seen["cancelled"][0] in ("ConnectionResetError", "CancelledError"), seen
    assert 0.7 < seen["cancelled"][1] < 2.8, seen                # failed after the send timeout, not at once
    assert seen["steady_client"]["ended_while_reading"] is None and seen["steady_client"]["got"] > 400_000, seen


@pytest.mark.slow
async def test_a_server_raises_its_open_files_limit_and_serves_past_the_usual_1024():
    """Each client connection takes an open file. Linux's usual soft limit is 1,024: a balancer serving a few
    hundred evaluation clients ran out, and every new connection was reset (uvloop) until some closed. Every
    server now raises its soft limit towards 65,536 as far as the hard limit allows. Here the balancer starts with a
    soft limit of 256, keeps 600 idle client connections open and still answers a new one."""
    import resource

    from common.http import raise_open_files
    raise_open_files()                        # this process holds the 600 client ends
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and min(soft, hard) < 1024:
        pytest.skip(f"limit on open files {soft} (hard {hard})")
    async with workers(fake_worker("ok", [])) as urls:
        port = free_port()
        code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit("
                "resource.RLIMIT_NOFILE)[1])); from balancer.app import BalancerConfig, run; "
                f"run(BalancerConfig(worker_urls={urls!r}, port={port}))")
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT)
        socks: list[socket.socket] = []
        try:
            await wait_ready(f"http://127.0.0.1:{port}", 1, 1)
            limits = Path(f"/proc/{proc.pid}/limits").read_text().splitlines()
            soft = int(next(line for line in limits if line.startswith("Max open files")).split()[3])
            assert soft >= 1024, limits
            for _ in range(600):
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            body = b'{"prompt": "a", "max_tokens": 1}'
            status, _, body = await asyncio.to_thread(
                raw_http, port, POST + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
            assert status == 200, body
        finally:
            for s in socks:
                s.close()
            proc.terminate()
            proc.wait(30)


async def test_generation_routes_taken_directly_behave_as_through_the_router():
    """The generation endpoints skip aiohttp's router (common.http.direct_routes): the same handler inside the same
    middlewares (an error in the OpenAI shape, the API key), ``request.app`` and ``request.match_info`` as the
    router gives them; a query string, an ``Expect`` header, another method or another path goes through the router
    (405, 404, 100-continue) as before."""
    from common.http import AppRunner, middlewares
    seen, routed = [], []

    async def completions(request):
        seen.append((request.app is app, request.match_info.route.resource.canonical))
        body = loads(await request.read())
        if "bad" in body:
            raise APIError(400, "bad", param="bad")
        return web.json_response({"ok": True})

    app = web.Application(middlewares=middlewares("k", lambda path: path.startswith("/v1/")))
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/other", completions)
    real = app.router.resolve

    async def resolve(request):
        routed.append(request.raw_path)
        return await real(request)
    app.router.resolve = resolve
    runner = AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer k"}) as s:
            url = f"http://127.0.0.1:{port}"
            r = await s.post(url + "/v1/completions", json={})
            assert r.status == 200 and seen[-1] == (True, "/v1/completions")
            r = await s.post(url + "/v1/completions", json={"bad": 1})
            assert r.status == 400 and (await r.json())["error"]["param"] == "bad"
            r = await s.post(url + "/v1/completions", json={}, headers={"Authorization": "Bearer wrong"})
            assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
            assert routed == []                               # the router saw none of these
            r = await s.post(url + "/v1/completions?x=1", json={})
            assert r.status == 200 and seen[-1] == (True, "/v1/completions")
            r = await s.post(url + "/v1/completions", json={}, expect100=True)
            assert r.status == 200
            r = await s.get(url + "/v1/completions")
            assert r.status == 405 and "error" in await r.json()
            r = await s.post(url + "/v1/nothing", json={})
            assert r.status == 404
            r = await s.post(url + "/v1/other", json={})
            assert r.status == 200 and seen[-1] == (True, "/v1/other")
            assert routed == ["/v1/completions?x=1", "/v1/completions", "/v1/completions", "/v1/nothing", "/v1/other"]
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("where", ["done", "eof"])
async def test_a_timeout_on_a_streams_last_bytes_does_not_write_after_its_end(where, monkeypatch):
    """The worker's --request-timeout covered a stream's `data: [DONE]` and its end too: for a slow reader it could
    fire while they drained, and the 504's error event and a second [DONE] followed the stream's end (after the
    chunked terminator: a broken connection for keep-alive; a review). The end is outside the timeout now. (The slow
    reader is a test double: the drains of the last writes wait 1 s past the door's 0.5 s timeout.)"""
    import asyncio

    from aiohttp import http_writer, web

    from common.http import AppRunner, middlewares
    from common.openai_http import Event, EventBox, add_routes
    from common.protocol import guarded_by_api_key

    class Door:
        timeout = 0.5

        async def open(self, request, kind, body, req):
            box = EventBox()
            box.push(Event(None, "chunk", 200, {"id": "c", "object": "text_completion", "choices": [
                {"index": 0, "text": "hello", "finish_reason": "stop"}]}, True))
            return box

        def close(self, *a):
            pass
    write, write_eof, drain = web.StreamResponse.write, http_writer.StreamWriter.write_eof, http_writer.StreamWriter.drain

    async def slow_write(self, data):
        await write(self, data)
        if where == "done" and data == b"data: [DONE]\n\n":
            await asyncio.sleep(1)

    async def marked_eof(self, chunk=b""):
        self._in_eof = True
        return await write_eof(self, chunk)

    async def slow_drain(self):
        if where == "eof" and getattr(self, "_in_eof", False):
            self._in_eof = False
            await asyncio.sleep(1)
        return await drain(self)
    monkeypatch.setattr(web.StreamResponse, "write", slow_write)
    monkeypatch.setattr(http_writer.StreamWriter, "write_eof", marked_eof)
    monkeypatch.setattr(http_writer.StreamWriter, "drain", slow_drain)
    app = web.Application(middlewares=middlewares(None, guarded_by_api_key))
    add_routes(app, Door())
    runner = AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]
        r, w = await asyncio.open_connection("127.0.0.1", port)
        body = b'{"prompt":"hi","stream":true}'
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        out = b""
        try:
            async with asyncio.timeout(3):
                while d := await r.read(65536):
                    out += d
        except TimeoutError:
            pass
        w.close()
        events = out.split(b"\r\n\r\n", 1)[1]
        assert events.count(b"[DONE]") == 1 and b"error" not in events, events
        assert events.endswith(b"0\r\n\r\n"), events                  # nothing after the stream's end
    finally:
        await runner.cleanup()
