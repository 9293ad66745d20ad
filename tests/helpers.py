"""Starting real server subprocesses for end-to-end tests."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import json
import urllib.error
from dataclasses import dataclass
import urllib.request

ROOT = Path(__file__).resolve().parent.parent
DLLM = [sys.executable, "-m", "dllm_serve"]


def get_json(url: str, timeout: float = 10.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def settled_batch_stats(worker_url: str, timeout: float = 10.0) -> dict:
    """A worker's /batch/stats once no batch is running: with continuous batching a client has its answer as soon as
    its row is done, while the batch (and its counters) may still be finishing."""
    deadline = time.monotonic() + timeout
    while True:
        stats = get_json(worker_url + "/batch/stats")[1]
        if stats["running_batch_size"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def post_json(url: str, body, timeout: float = 60.0, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


_GIVEN: set[int] = set()      # ports this process has handed out: a server may not have bound its port yet


def free_port(n: int = 1) -> int:
    """A port p with p .. p+n-1 free (a supervisor's workers take consecutive ports), below the kernel's ephemeral
    range (32768-60999 here), so that no outgoing connection of another test takes one of them in the meantime; never
    one handed out before in this process (two workers of one cluster once drew the same port: the second could not
    bind, and the first answered for both). Under pytest-xdist each test process draws from its own share of that
    range, so that two processes never hand out the same port."""
    rng = random.Random()
    share, count = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0), \
        int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    width = 12000 // count
    low = 20000 + share * width
    for _ in range(2000):
        base = rng.randrange(low, low + width - n)
        if _GIVEN.intersection(range(base, base + n)):
            continue
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            _GIVEN.update(range(base, base + n))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


class Proc:
    """A server (`dllm-serve ARGS`), its output in ``log``: forked from this test process's fork server
    (tests/forkserver.py: the same server without the seconds its imports cost) where the environment allows,
    else a plain subprocess."""

    def __init__(self, args: list[str], port: int, log: Path, env: dict | None = None):
        from tests.forkserver import fork_server
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self._f = None
        env = {**os.environ, **(env or {})}
        server = fork_server(args)
        if server is not None and server.serves(env):
            self.p = server.spawn(args, env, ROOT, log)
        else:
            self._f = open(log, "wb")
            self.p = subprocess.Popen(DLLM + args, stdout=self._f, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                      start_new_session=True)

    def wait_ready(self, timeout: float = 90.0, path: str = "/health", want: str | None = "ready") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"process exited with {self.p.returncode}:\n{self.tail()}")
            try:
                status, body = get_json(self.url + path, timeout=2)
                if want is None or (status == 200 and body.get("status") == want):
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.url} not {want} after {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        if self._f is not None:
            self._f.flush()
        return self.log.read_bytes()[-n:].decode(errors="replace")

    def signal(self, sig: int) -> None:
        self.p.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
        if self._f is not None:
            self._f.close()
        return self.p.returncode


def start_worker(tmp: Path, model: Path, *extra: str, port: int | None = None, name: str = "worker") -> Proc:
    port = port or free_port()
    return Proc(["worker", "--model-path", str(model), "--port", str(port), "--device", "cpu", *extra],
                port, tmp / f"{name}-{port}.log")


class Cluster:
    """N real workers on the fixture plus a balancer, as subprocesses."""

    def __init__(self, tmp: Path, model: Path, n: int = 2, worker_args=(), balancer_args=()):
        if "--threads" not in worker_args:      # as `serve` does: an equal share of the cores each
            from balancer.supervisor import cpu_share
            worker_args = (*worker_args, "--threads", str(cpu_share(n)))
        self.workers = [start_worker(tmp, model, *worker_args, name=f"worker{i}") for i in range(n)]
        port = free_port()
        urls = ",".join(w.url for w in self.workers)
        self.balancer = Proc(["balancer", "--worker-urls", urls, "--port", str(port), *balancer_args], port,
                             tmp / "balancer.log")
        self.url = self.balancer.url

    def wait_ready(self, n: int | None = None, timeout: float = 90) -> None:
        for w in self.workers:
            w.wait_ready(timeout)
        want = len(self.workers) if n is None else n
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                status, body = get_json(self.url + "/health", timeout=2)
                if body.get("healthy_workers", 0) >= want:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(self.balancer.tail())

    def stop(self) -> None:
        self.balancer.stop()
        for w in self.workers:
            w.stop()


@dataclass
class Tally:
    """What became of the requests a fault test sent (printed for docs/reliability.md)."""
    name: str
    sent: int = 0
    answered: int = 0        # a complete 200
    errored: int = 0         # a definite error the client saw at once (4xx/5xx, SSE error event, reset connection)
    lost: int = 0            # no answer at all before the client's own timeout
    left: int = 0            # the client went away on purpose

    def report(self, extra: str = "") -> None:
        left = f", left by their clients {self.left}" if self.left else ""
        print(f"\nFAULT {self.name}: sent {self.sent}, answered {self.answered}, errored {self.errored}, "
              f"lost {self.lost}{left}{extra}")


def raw_http(port: int, *parts: bytes, gap: float = 0.0, timeout: float = 10.0) -> tuple[int, dict, bytes]:
    """Send ``parts`` as they are, ``gap`` seconds apart (no client normalising the path, as ``curl --path-as-is``;
    malformed HTTP on purpose); the answer's status, headers (lower-case names) and body. Status 0: no answer within
    ``timeout`` (or the connection closed without one)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            for i, part in enumerate(parts):
                if i and gap:
                    time.sleep(gap)
                s.sendall(part)
        except OSError:          # the server answered and closed before taking everything: read its answer
            pass
        return read_http_answer(s)


def read_http_answer(s: socket.socket) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 answer read from ``s`` (headers, then Content-Length bytes or up to the close)."""
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        if b"\r\n\r\n" not in data:
            return 0, {}, data
        head, body = data.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)}
        want = int(headers.get("content-length", -1))
        while want < 0 or len(body) < want:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
        return int(lines[0].split()[1]), headers, body
    except (socket.timeout, ConnectionResetError):
        return 0, {}, data
