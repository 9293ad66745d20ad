"""--http-processes: front processes that share the balancer's port and hand requests to its one queue.

The balancer runs in the test's event loop (its front processes are real subprocesses); workers are fault-injecting
fakes (test doubles: in-process aiohttp servers speaking /health, /worker/batch and /worker/cancel). Every client
request opens its own connection, so the kernel spreads them over the listening processes (SO_REUSEPORT); the
per-request assertions hold whichever process took the connection, and /stats shows that every process took some."""
import asyncio
import contextlib
import os
import signal
import sys

import aiohttp
import orjson
import pytest

from balancer.app import BalancerConfig, serve
from balancer.batcher import BatchConfig
from balancer.pool import HealthConfig
from tests.fakes import fake_worker, workers
from tests.helpers import ROOT, free_port

async def get(url: str, **kw) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.get(url, **kw) as r:
        return r.status, await r.json(content_type=None)


async def wait_ready(base: str, processes: int, workers: int, timeout: float = 30.0) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        with contextlib.suppress(aiohttp.ClientError, ValueError):
            status, stats = await get(base + "/stats")
            procs = stats.get("http_processes", [])
            if (status == 200 and stats["healthy_workers"] == workers and len(procs) == processes
                    and all(p["status"] == "ready" for p in procs)):
                return stats
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"balancer at {base} not ready")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def balancer(urls: list[str], processes: int = 3, **kw):
    port = free_port()
    batch = kw.pop("batch", BatchConfig(batch_size=8, wait_time=0.05))
    cfg = BalancerConfig(worker_urls=urls, port=port, http_processes=processes, batch=batch,
                         health=HealthConfig(interval=0.05, timeout=1, stall_timeout=30), drain_timeout=10, **kw)
    stop = asyncio.Event()
    task = asyncio.create_task(serve(cfg, stop))
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_ready(base, processes, len(urls))
        yield base
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def post(base: str, path: str, body: dict, timeout: float = 30.0, headers: dict | None = None):
    """One request on its own connection: (status, JSON body or list of SSE data lines)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.post(base + path, json=body, headers=headers) as r:
            if r.headers.get("Content-Type", "").startswith("text/event-stream"):
                return r.status, [line[6:] for line in (await r.text()).split("\n") if line.startswith("data: ")]
            return r.status, await r.json(content_type=None)


async def test_fronts_share_the_port_and_the_one_queue():
    seen = []
    async with workers(fake_worker("ok", seen), fake_worker("ok", seen)) as urls, \
            balancer(urls, processes=3, api_key="k") as base:
        auth = {"Authorization": "Bearer k"}
        calls = []
        for i in range(48):
            if i % 3 == 0:
                calls.append(post(base, "/v1/completions", {"prompt": f"p{i}"}, headers=auth))
            elif i % 3 == 1:
                calls.append(post(base, "/v1/completions", {"prompt": f"p{i}", "stream": True}, headers=auth))
            else:
                calls.append(post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                                  headers=auth))
        results = await asyncio.gather(*calls)
        for i, (status, body) in enumerate(results):
            assert status == 200, body
            if i % 3 == 0:
                assert body["choices"][0]["text"] == "ok-completion"
            elif i % 3 == 1:
                assert orjson.loads(body[0])["choices"][0]["text"] == "ok-text" and body[-1] == "[DONE]"
            else:
                assert body["choices"][0]["text"] == "ok-chat"
        assert len(seen) == 48 and len({rid for _, rid in seen}) == 48       # each dispatched once

        # errors are answered where the request arrived, in the OpenAI shape, with the central's statuses
        bad = await asyncio.gather(*(post(base, "/v1/completions", {"prompt": "a", "presence_penalty": 0.5},
                                          headers=auth) for _ in range(12)))
        assert all(s == 400 and b["error"]["param"] == "presence_penalty" for s, b in bad)
        unauth = await asyncio.gather(*(post(base, "/v1/completions", {"prompt": "a"}) for _ in range(12)))
        assert all(s == 401 and b["error"]["code"] == "invalid_api_key" for s, b in unauth)
        missing = await asyncio.gather(*(post(base, "/v1/nothing", {}, headers=auth) for _ in range(12)))
        assert all(s == 404 and b["error"]["type"] == "not_found_error" and b["error"]["code"] == "unknown_url"
                   for s, b in missing)

        stats = (await get(base + "/stats"))[1]
        procs = stats["http_processes"]
        assert [p["role"] for p in procs] == ["central", "front", "front"]
        assert sum(p["requests"] for p in procs) == 48 + 12       # and the 400s (401s, 404s reach no handler)
        assert all(p["requests"] > 0 for p in procs), procs
        assert stats["total_requests"] == 48
        assert stats["centralized_batching"]["avg_batch_size"] > 1
        assert stats["last_minute"]["requests"] == 60 and stats["last_minute"]["ok"] == 48
        for _ in range(12):                # every status path answers through a front too, with the central's data
            status, health = await get(base + "/health")
            assert status == 200 and health["healthy_workers"] == 2
        async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
            text = await r.text()
        assert 'dllm_balancer_requests_total{endpoint="/v1/chat/completions",status="200"} 16.0' in text


async def test_model_version_pins_hold_through_fronts():
    """A request that requires weights (model_version) goes only to the worker holding them, or gets the central's
    409, whichever process took its connection (a front once dropped the pin)."""
    seen = []
    async with workers(fake_worker("ok", seen, version="aaa"), fake_worker("ok", seen, version="bbb")) as urls, \
            balancer(urls, processes=3) as base:
        pinned = await asyncio.gather(*(post(base, "/v1/completions", {"prompt": f"p{i}", "model_version": "bbb"})
                                        for i in range(24)))
        assert all(status == 200 and body["model_version"]["hash"] == "bbb" for status, body in pinned), pinned
        nowhere = await asyncio.gather(*(post(base, "/v1/completions", {"prompt": "p", "model_version": "zzz"})
                                         for _ in range(12)))
        assert all(status == 409 and body["error"]["code"] == "model_version_unavailable"
                   and "no worker serves" in body["error"]["message"] for status, body in nowhere), nowhere
        procs = (await get(base + "/stats"))[1]["http_processes"]
        assert all(p["requests"] > 0 for p in procs[1:]), procs       # the fronts took some of them


@pytest.mark.slow
async def test_failover_disconnects_and_timeouts_through_fronts():
    seen, cancelled = [], []
    async with workers(fake_worker("die", seen), fake_worker("ok", seen)) as urls, balancer(urls) as base:
        calls = [post(base, "/v1/completions", {"prompt": f"p{i}", "stream": i % 2 == 1}) for i in range(24)]
        for status, body in await asyncio.gather(*calls):
            assert status == 200
            if isinstance(body, dict):              # plain: re-dispatched from the dying worker if it was there
                assert body["choices"][0]["text"] == "ok-completion"
            else:                                   # stream: whole from the good worker, or an error event after
                first = orjson.loads(body[0])["choices"][0]["text"]   # the dying worker's first chunk
                assert body[-1] == "[DONE]"
                if first == "die-text":
                    assert "cannot be resumed" in orjson.loads(body[1])["error"]["message"] and len(body) == 3
                else:
                    assert first == "ok-text" and len(body) == 3
        died = [rid for mode, rid in seen if mode == "die"]
        assert died, "the dying worker got no batch"
        stats = (await get(base + "/stats"))[1]
        assert stats["total_requests"] == 24 and stats["in_flight"] == 0 and stats["queue_depth"] == 0

    # every request reaches the hanging worker (two batches; no idle dispatch of the first alone): each is cancelled there
    async with workers(fake_worker("hang", seen, cancelled)) as urls, balancer(
            urls, request_timeout=1.5, batch=BatchConfig(batch_size=8, wait_time=0.05, idle_dispatch=False)) as base:
        seen.clear()

        async def give_up(i):
            with contextlib.suppress(asyncio.TimeoutError):
                await post(base, "/v1/completions", {"prompt": f"p{i}"}, timeout=0.4)
                raise AssertionError("a hanging worker answered")
        timed = [post(base, "/v1/completions", {"prompt": f"t{i}", "stream": i % 2 == 1}) for i in range(6)]
        results = await asyncio.gather(*timed, *(give_up(i) for i in range(6)))
        for status, body in results[:6]:
            assert status == 504 and "--request-timeout" in body["error"]["message"]
        for _ in range(100):
            if len(cancelled) == 12:
                break
            await asyncio.sleep(0.05)
        assert sorted(cancelled) == sorted(rid for _, rid in seen) and len(seen) == 12
        stats = (await get(base + "/stats"))[1]
        assert stats["last_minute"]["requests"] == 12 and stats["last_minute"]["ok"] == 0
        assert sum(p["open_requests"] for p in stats["http_processes"][1:]) == 0


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "wedged"])
async def test_a_dead_or_wedged_front_is_restarted(sig):
    """A front that dies is restarted; one that stops answering the central's pings (SIGSTOP) is killed after
    --front-timeout, then restarted."""
    seen = []
    async with workers(fake_worker("ok", seen)) as urls, balancer(urls, processes=2, front_timeout=1.0) as base:
        front = (await get(base + "/stats"))[1]["http_processes"][1]
        os.kill(front["pid"], sig)
        for _ in range(600):
            procs = (await get(base + "/stats"))[1]["http_processes"]
            if procs[1]["status"] == "ready" and procs[1]["pid"] != front["pid"]:
                break
            await asyncio.sleep(0.05)
        assert procs[1]["restarts"] == 1 and procs[1]["status"] == "ready", procs
        state = f"/proc/{front['pid']}/stat"
        assert not os.path.exists(state) or open(state).read().split()[2] in ("Z", "X")       # gone
        results = await asyncio.gather(*(post(base, "/v1/completions", {"prompt": f"p{i}"}) for i in range(16)))
        assert all(s == 200 for s, _ in results)
        procs = (await get(base + "/stats"))[1]["http_processes"]
        assert procs[1]["requests"] > 0, procs


async def test_a_front_that_hangs_while_starting_is_restarted_after_its_startup_timeout(monkeypatch, tmp_path):
    """The first front process hangs before its first message (a stand-in for an import stuck on a network file
    system): it is killed after --front-startup-timeout and started again after --front-restart-backoff; the
    fixed 70 s before would have outlasted the balancer's 30 s start here."""
    mark, script = tmp_path / "hung-once", tmp_path / "python"
    script.write_text(f'#!/bin/sh\nif [ ! -e "{mark}" ]; then touch "{mark}"; exec sleep 120; fi\n'
                      f'exec "{sys.executable}" "$@"\n')
    script.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(script))
    seen = []
    async with workers(fake_worker("ok", seen)) as urls, balancer(
            urls, processes=2, front_startup_timeout=1.0, front_restart_backoff=0.1) as base:
        procs = (await get(base + "/stats"))[1]["http_processes"]
        assert mark.exists() and procs[1]["restarts"] == 1 and procs[1]["status"] == "ready", procs
        assert (await post(base, "/v1/completions", {"prompt": "p"}))[0] == 200


def test_stale_socket_directories_are_removed(monkeypatch):
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    from balancer.front import socket_dir
    base = Path(tempfile.mkdtemp(prefix="t-", dir="/tmp"))        # short: a Unix socket path has ~100 bytes
    try:
        gone = subprocess.Popen(["true"])
        gone.wait()                                               # a pid that no longer runs
        (base / f"dllm-balancer-{gone.pid}-abc").mkdir()
        (base / f"dllm-balancer-{os.getpid()}-def").mkdir()       # a live balancer's: kept
        monkeypatch.setattr(tempfile, "gettempdir", lambda: str(base))
        new = socket_dir()
        names = sorted(p.name for p in base.iterdir())
        assert f"dllm-balancer-{gone.pid}-abc" not in names and f"dllm-balancer-{os.getpid()}-def" in names
        assert os.path.dirname(new) == str(base)
        assert os.path.basename(new).startswith(f"dllm-balancer-{os.getpid()}-")
    finally:
        shutil.rmtree(base)


@pytest.mark.parametrize("how", ["sigterm", "sighup to the group"])
async def test_sigterm_drains_through_fronts_then_stops_them(how):
    """The real command: SIGTERM while requests wait on a slow worker; every one is answered, then the
    balancer and its fronts exit. The same for SIGHUP to the whole process group (a terminal or SSH session
    closing): the fronts ignored only SIGTERM and SIGINT, died at once and dropped their clients' requests (a
    reviewer's finding), and the balancer alone died without a drain."""
    seen = []
    async with workers(fake_worker("ok", seen, delay=1.5)) as urls:
        port = free_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dllm_serve", "balancer", "--worker-urls", urls[0], "--port", str(port),
            "--http-processes", "3", "--batch-size", "4", "--batch-wait-time", "0.01",
            "--health-check-interval", "0.1", cwd=ROOT, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            stats = await wait_ready(base, 3, 1)
            pids = [p["pid"] for p in stats["http_processes"]]
            calls = asyncio.gather(*(post(base, "/v1/completions", {"prompt": f"p{i}"}) for i in range(12)))
            await asyncio.sleep(0.5)
            if how == "sigterm":
                proc.send_signal(signal.SIGTERM)
            else:
                os.killpg(proc.pid, signal.SIGHUP)
            await asyncio.sleep(0.2)
            late = await asyncio.gather(*(post(base, "/v1/completions", {"prompt": "late"}) for _ in range(6)))
            assert all(s == 503 for s, _ in late), late
            assert all(s == 200 for s, _ in await calls)
            assert await asyncio.wait_for(proc.wait(), 30) == 0
            for pid in pids:
                assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
            assert len(seen) == 12
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


def test_frames_survive_any_split():
    from balancer.front import frame, read_frames
    sent = [({"t": "r", "n": i, "k": "chat"}, bytes(range(i % 256)) * (i + 1)) for i in range(40)]
    wire = b"".join(frame(h, b) for h, b in sent)
    for step in (1, 7, 64, 1000, len(wire)):
        buf, got = bytearray(), []
        for k in range(0, len(wire), step):
            buf += wire[k:k + step]
            got += read_frames(buf)
        assert got == sent and not buf


def test_settle_gc_freezes_the_heap_and_sets_the_young_threshold_only_when_asked():
    """The worker freezes what it set up; the balancer's HTTP processes also collect their young generation every
    HTTP_GC_THRESHOLD allocations instead of Python's 700 (docs/benchmarks.md). In a child: it changes its process."""
    import subprocess
    code = ("import gc; from common.http import settle_gc, HTTP_GC_THRESHOLD as T; t = gc.get_threshold(); "
            "settle_gc(); a = (gc.get_threshold() == t, gc.get_freeze_count() > 0); settle_gc(T); "
            "print(a, gc.get_threshold() == (T,) + t[1:], T > t[0])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["(True,", "True)", "True", "True"]


async def test_the_balancer_process_collects_its_young_generation_less_often():
    import gc
    from common.http import HTTP_GC_THRESHOLD
    before = gc.get_threshold()
    try:
        async with workers(fake_worker("ok", [])) as urls, balancer(urls, processes=1):
            assert gc.get_threshold() == (HTTP_GC_THRESHOLD,) + before[1:]
    finally:
        gc.set_threshold(*before)


def test_a_second_balancer_with_fronts_cannot_share_a_port_already_listened_on():
    """With --http-processes > 1 the balancer listens with SO_REUSEPORT (its fronts share the port), which the kernel
    grants to any process of the same user beside another listener: a second balancer on the same port shared it
    silently, each answering a part of the connections (a reviewer's finding). It now refuses to start (exit 98),
    as a single-process balancer does. The other listener here is a plain socket with SO_REUSEPORT."""
    import socket
    import subprocess
    from common.http import EXIT_PORT_IN_USE
    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    other.bind(("127.0.0.1", 0))
    other.listen()
    port = other.getsockname()[1]
    try:
        r = subprocess.run([sys.executable, "-m", "dllm_serve", "balancer", "--worker-urls", "http://127.0.0.1:9",
                            "--port", str(port), "--http-processes", "2"], cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == EXIT_PORT_IN_USE and "cannot listen on" in r.stderr, r.stderr[-2000:]
    finally:
        other.close()


def test_the_port_check_binds_as_the_server_does():
    """The check before SO_REUSEPORT fails where something listens on an address the server would bind, and only
    there: an IPv6 host is bound IPv6 only, as asyncio binds it, so an IPv4 server on the port does not refuse it
    (a review found `--host ::` refused beside an unrelated IPv4 server)."""
    import errno
    import socket
    from balancer.app import check_port_free
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen()
    port = other.getsockname()[1]
    try:
        with pytest.raises(OSError) as e:
            check_port_free("127.0.0.1", port)
        assert e.value.errno == errno.EADDRINUSE
        if socket.has_ipv6:
            try:
                socket.socket(socket.AF_INET6).close()
            except OSError:
                return                                    # no IPv6 on this host
            check_port_free("::1", port)                  # nothing listens on IPv6 there
    finally:
        other.close()


async def test_a_file_download_through_a_front_keeps_its_range_and_validators(tmp_path):
    """A front forwarded three request headers and returned three: a Range request answered 206 with the range by
    the central got 200 and the whole file through a front, without Content-Range, ETag or Last-Modified (a review).
    Every connection now gets the central's answer, whichever process the kernel gives it."""
    seen = []
    async with workers(fake_worker("ok", seen)) as urls, \
            balancer(urls, processes=2, files_dir=str(tmp_path / "files")) as base:
        data = b"".join(b'{"custom_id": "r%d", "method": "POST", "url": "/v1/completions", "body": {}}\n' % i
                        for i in range(20))
        async with aiohttp.ClientSession() as s:
            form = aiohttp.FormData()
            form.add_field("purpose", "batch")
            form.add_field("file", data, filename="in.jsonl")
            async with s.post(base + "/v1/files", data=form) as r:
                fid = (await r.json())["id"]
        answers = set()
        for _ in range(24):                       # a connection each: the kernel spreads them over both processes
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                async with s.get(f"{base}/v1/files/{fid}/content", headers={"Range": "bytes=2-11"}) as r:
                    body = await r.read()
                    answers.add((r.status, body, r.headers.get("Content-Range"), bool(r.headers.get("ETag"))))
                    etag = r.headers.get("ETag")
                async with s.get(f"{base}/v1/files/{fid}/content", headers={"If-None-Match": etag}) as r:
                    answers.add((r.status,))
        assert answers == {(206, data[2:12], f"bytes 2-11/{len(data)}", True), (304,)}, answers


async def test_a_front_answers_503_while_the_central_is_silent_and_neither_side_is_killed_for_a_pause():
    """The central stops answering (its event loop held for 3 s: a stopped or wedged central, a test double for
    SIGSTOP, which would stop this test too): a front waited with its clients for as long as the central did (a
    review). Now a front that hears nothing, not even the central's pings, for --front-timeout answers its open
    requests (proxied ones too: /health here) and new ones 503 naming it, and serves again once the central speaks. And the central, whose own pause made
    every front look silent, killed them all when it resumed: a late round of its watch judges nothing now."""
    import threading
    import time
    import urllib.error
    import urllib.request
    seen = []
    async with workers(fake_worker("ok", seen)) as urls, balancer(urls, processes=3, front_timeout=1.0) as base:
        time.sleep(2.0)                         # a pause with no traffic: every front looks silent for 2 s
        await asyncio.sleep(0.6)
        procs = (await get(base + "/stats"))[1]["http_processes"]
        assert [(p["restarts"], p["status"]) for p in procs[1:]] == [(0, "ready")] * 2, procs
        results = []

        def one(path="/v1/completions"):
            t0 = time.monotonic()
            req = urllib.request.Request(base + path, orjson.dumps({"prompt": "p"}) if path != "/health" else None,
                                         {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=20) as r:
                    results.append((r.status, time.monotonic() - t0, "", path))
            except urllib.error.HTTPError as e:
                err = orjson.loads(e.read())["error"]
                results.append((e.code, time.monotonic() - t0, err["message"] + " " + err["type"], path))

        def clients():
            time.sleep(0.1)
            threads = [threading.Thread(target=one) for _ in range(8)]
            threads += [threading.Thread(target=one, args=("/health",)) for _ in range(8)]    # proxied
            for t in threads:                   # each on its own connection: the kernel spreads them
                t.start()
            time.sleep(1.4)                     # and more once the fronts have noticed the silence
            threads += [threading.Thread(target=one) for _ in range(8)]
            for t in threads[16:]:
                t.start()
            for t in threads:
                t.join()
        sender = threading.Thread(target=clients)
        sender.start()
        time.sleep(3.0)                         # the central (this event loop) answers nothing, pings nobody
        while sender.is_alive():
            await asyncio.sleep(0.05)
        assert len(results) == 24 and {s for s, _, _, _ in results} <= {200, 503}, results
        refused = [(t, m, path) for s, t, m, path in results if s == 503]
        assert refused and all("central process has not answered" in m and "--front-timeout 1 s" in m
                               and m.endswith(" service_unavailable") for _, m, _ in refused), results
        # answered while the central was still held; proxied requests open when the silence began too (a review:
        # they waited for the central)
        assert {path for t, _, path in refused if t < 2.5} == {"/v1/completions", "/health"}, results
        await asyncio.sleep(0.5)
        after = await asyncio.gather(*(post(base, "/v1/completions", {"prompt": f"q{i}"}) for i in range(16)))
        assert all(s == 200 for s, _ in after), after              # the fronts serve again
        procs = (await get(base + "/stats"))[1]["http_processes"]
        assert [p["restarts"] for p in procs[1:]] == [0, 0] and procs[1]["requests"] > 0, procs
