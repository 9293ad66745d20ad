"""The fault suite (issue 14), end to end with real processes on the tiny fixture: the launcher killed (-9) or stopped
(SIGTERM) under load, clients that disconnect mid-stream, slow clients (trickled headers, streams nobody reads).
Each test prints what it sent and what became of it: answered (a complete 200), errored (a definite error: a 4xx/5xx,
an SSE error event, or a refused/reset connection the client sees at once) and lost (no answer at all: a client
left waiting until its own timeout). Nothing may be lost. The worker faults (kill -9, SIGSTOP) and 10x overload are
in tests/test_balancer_e2e.py and print the same tally.

    ./scripts/test.sh tests/test_faults_e2e.py tests/test_balancer_e2e.py -s     # the figures of docs/reliability.md
"""
import asyncio
import signal
import socket
import subprocess
import threading
import time

import aiohttp
import psutil
import pytest

from tests.conftest import TINY_LLADA
from tests.helpers import DLLM, ROOT, Cluster, Tally, free_port, get_json, post_json

pytestmark = pytest.mark.slow
LONG = {"prompt": [5, 6, 7], "max_tokens": 64, "block_length": 16, "steps": 64, "ignore_eos": True}


async def _one(session: aiohttp.ClientSession, url: str, body: dict, tally: Tally, timeout: float) -> None:
    tally.sent += 1
    try:
        async with session.post(url + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            text = await r.text()
            if r.status == 200 and (not body.get("stream") or ("data: [DONE]" in text and '"error"' not in text)):
                tally.answered += 1
            else:
                tally.errored += 1
    except asyncio.TimeoutError:
        tally.lost += 1
    except aiohttp.ClientError:
        tally.errored += 1


def load(url: str, n: int, tally: Tally, timeout: float = 120.0, **extra) -> threading.Thread:
    """n requests (every other one streamed), all at once, in a thread; the tally fills as they end."""
    async def run():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            await asyncio.gather(*[_one(s, url, {**LONG, "prompt": [i % 200 + 5, 6], "stream": i % 2 == 1, **extra},
                                        tally, timeout) for i in range(n)])
    t = threading.Thread(target=lambda: asyncio.run(run()))
    t.start()
    return t


def launcher(tmp_path, port: int, workers: int = 2) -> subprocess.Popen:
    p = subprocess.Popen([*DLLM, "serve", "--local", "--model-path", str(TINY_LLADA), "--workers", str(workers),
                          "--port", str(port), "--worker-base-port", str(free_port(workers)), "--stagger", "0",
                          "--health-check-interval", "0.3", "--http-processes", "2", "--drain-timeout", "60",
                          "--log-dir", str(tmp_path / "logs")], cwd=ROOT,
                         stdout=open(tmp_path / "serve.log", "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while True:
        assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
        try:
            if get_json(f"http://127.0.0.1:{port}/health", timeout=2)[1].get("healthy_workers") == workers:
                return p
        except OSError:
            pass
        time.sleep(0.2)


def wait_in_flight(url: str, at_least: int = 1) -> None:
    deadline = time.monotonic() + 60
    while get_json(url + "/stats")[1]["in_flight"] < at_least:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_sigterm_of_the_launcher_under_load_answers_every_request(tmp_path):
    port = free_port()
    p = launcher(tmp_path, port)
    url = f"http://127.0.0.1:{port}"
    try:
        procs = psutil.Process(p.pid).children(recursive=True)
        tally = Tally("SIGTERM to the launcher (serve --local, 2 workers, 2 HTTP processes) under load")
        t = load(url, 32, tally)
        wait_in_flight(url, 8)
        p.send_signal(signal.SIGTERM)
        t.join(180)
        assert p.wait(90) == 0
        tally.report()
        assert tally.sent == tally.answered == 32, tally     # admitted work drains to its end
        gone, alive = psutil.wait_procs(procs, timeout=15)
        assert not alive, f"orphans: {[q.cmdline() for q in alive]}"
    finally:
        if p.poll() is None:
            p.kill()


def test_kill_9_of_the_launcher_under_load_leaves_no_client_hanging_and_no_orphan(tmp_path):
    """The balancer runs in the launcher's process: kill -9 takes both. Every client learns it at once (a reset
    connection: errored, not lost), and the workers and the front process exit by themselves."""
    port = free_port()
    p = launcher(tmp_path, port)
    url = f"http://127.0.0.1:{port}"
    try:
        procs = psutil.Process(p.pid).children(recursive=True)
        tally = Tally("kill -9 of the launcher (balancer inside it) under load")
        t = load(url, 32, tally, timeout=60)
        wait_in_flight(url, 8)
        p.kill()
        t.join(90)
        tally.report()
        assert tally.lost == 0 and tally.sent == tally.answered + tally.errored == 32, tally
        gone, alive = psutil.wait_procs(procs, timeout=15)
        assert not alive, f"orphans: {[q.cmdline() for q in alive]}"
        with socket.socket() as s:                 # nothing listens on the port any more (TIME_WAIT aside)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
    finally:
        if p.poll() is None:
            p.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("faults"), TINY_LLADA, 1, worker_args=["--batch-size", "16"],
                balancer_args=["--batch-size", "8", "--batch-wait-time", "0.01"])
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


def _busy(c: Cluster) -> bool:
    return get_json(c.workers[0].url + "/health")[1]["running_batch_size"] > 0


def test_clients_leaving_mid_stream_free_their_rows(cluster):
    tally = Tally("clients that disconnect mid-stream (8 of 16 streams), 16 others alongside")
    others = Tally("")
    body = {**LONG, "max_tokens": 2048, "block_length": 8, "steps": 2048, "stream": True}   # runs long unless dropped

    async def leave_early(session):
        tally.sent += 1
        async with session.post(cluster.url + "/v1/completions", json=body) as r:
            async for _ in r.content:          # the first line of the stream, then go away
                break
        tally.left += 1                         # the client chose to leave: neither answered nor lost

    async def run():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as s:
            await asyncio.gather(*[leave_early(s) for _ in range(8)],
                                 *[_one(s, cluster.url, {**LONG, "prompt": [i + 5, 6]}, others, 120)
                                   for i in range(16)])
    asyncio.run(run())
    deadline = time.monotonic() + 5
    while _busy(cluster):                       # the left streams' rows are dropped at their next step
        assert time.monotonic() < deadline, "rows of disconnected streams still run"
        time.sleep(0.05)
    tally.answered, tally.lost = others.answered, others.lost
    tally.sent += others.sent
    tally.report()
    assert others.answered == others.sent == 16 and tally.left == 8


def _trickle_headers(port: int, stop: threading.Event, opened: list) -> None:
    """A slowloris client: sends its request line and headers one byte at a time, 5 bytes a second."""
    s = socket.create_connection(("127.0.0.1", port))
    opened.append(s)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Pad: " + b"a" * 10000
    for byte in head:
        if stop.is_set():
            break
        try:
            s.send(bytes([byte]))
        except OSError:
            break
        time.sleep(0.2)


def _stream_nobody_reads(port: int, opened: list) -> None:
    """A client that asks for a long stream and never reads it (a 4 KB receive buffer that fills)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    opened.append(s)
    body = b'{"prompt": [5, 6], "max_tokens": 256, "block_length": 8, "steps": 256, "ignore_eos": true, "stream": true}'
    s.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
           + str(len(body)).encode() + b"\r\n\r\n" + body)


def test_slow_clients_never_delay_others(cluster):
    """20 clients trickling their headers and 4 streams nobody reads stay open while 16 ordinary requests are all
    answered; the server is healthy afterwards. The same 16 requests alone first, for comparison."""
    quick = {"max_tokens": 32, "steps": 32}
    alone = Tally("")
    t0 = time.monotonic()
    load(cluster.url, 16, alone, **quick).join(120)
    baseline = time.monotonic() - t0
    stop, opened = threading.Event(), []
    port = cluster.balancer.port
    threads = [threading.Thread(target=_trickle_headers, args=(port, stop, opened), daemon=True) for _ in range(20)]
    for t in threads:
        t.start()
    for _ in range(4):
        _stream_nobody_reads(port, opened)
    time.sleep(1.0)
    tally = Tally("16 requests beside 20 slowloris clients and 4 unread streams")
    t0 = time.monotonic()
    load(cluster.url, 16, tally, **quick).join(120)
    took = time.monotonic() - t0
    still_open = sum(1 for t in threads if t.is_alive())
    stop.set()
    for s in opened:
        s.close()
    tally.report(f"; answered in {took:.1f} s (alone: {baseline:.1f} s; the unread streams' rows share the "
                 f"worker) while {still_open} slowloris clients were still sending")
    assert alone.answered == 16 and tally.answered == tally.sent == 16 and still_open == 20, tally
    assert get_json(cluster.url + "/health")[0] == 200
    assert post_json(cluster.url + "/v1/completions", {"prompt": [1, 2], "max_tokens": 4})[0] == 200
