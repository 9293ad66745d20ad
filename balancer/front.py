"""Front processes: client HTTP spread over several processes in front of the one central queue.

With ``--http-processes N`` (N > 1) the balancer process (the *central*: queue, batcher, worker pool, health,
metrics) and N-1 front processes all accept client connections on the same port (``SO_REUSEPORT``: the kernel
spreads connections over the listening sockets). A front reads and validates each OpenAI request (the per-request
HTTP and JSON work) and hands it as one frame over a Unix socket pair to the central, which admits it exactly like
one of its own (503 while draining or with no healthy worker, 429 when the queue is full), batches it with the rest
and sends the request's events back over the same socket; the front answers its client (JSON or SSE) from them.
Every other path (/health, /stats, /metrics, /worker-status, /v1/models, 404s) is proxied over HTTP on a Unix
socket to the central, so those answers are the central's own.

Frames: 8 bytes (header length, body length; little-endian u32), an orjson header, raw body bytes. Front to
central: ``r`` (a request: n, kind, stream, the model_version it requires; body = the client's JSON), ``d`` (n's answer is over: path, status,
seconds; the central releases it and records the metrics), ``ready``. Central to front: one event per frame
(n, attempt, event, status, data, end). Frames written in one loop iteration go out in one write.

A front's client disconnect reaches the central as ``d`` with status 499 (the request is cancelled as usual); a
front that dies is restarted by the central, whose requests from it are cancelled; when the central goes away a
front stops listening at once, answers its open requests 502 and exits; while the central sends nothing (not even
its pings) for longer than --front-timeout, a front answers its open and new requests 503. On SIGTERM the central drains (fronts' new requests get 503 from
the central), then closes the fronts. Fronts ignore SIGTERM/SIGINT themselves: the central decides.

Run as ``python -m balancer.front`` by the central only (configuration in the ``DLLM_FRONT`` environment
variable). Never imports torch."""
from __future__ import annotations

import asyncio
import glob
import itertools
import json
import logging
import os
import shutil
import signal
import socket
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field

import aiohttp
import orjson
import yarl
from aiohttp import web

from balancer.batcher import Pending
from common.http import (BODY_BUDGET, BODY_TIMEOUT, BODY_TIMEOUT_S, HTTP_GC_THRESHOLD, KEEPALIVE_TIMEOUT,
                         MAX_BODY_BYTES, MAX_BODY_BYTES_IN_FLIGHT, SEND_TIMEOUT, SHUTDOWN_GRACE, AppRunner,
                         BodyBudget, close_once_answered, middlewares, raise_open_files, read_bytes, settle_gc)
from common.openai_http import ENDPOINTS, Event, EventBox, add_routes, meaningful
from common.protocol import APIError, error_body, guarded_by_api_key

log = logging.getLogger("dllm.balancer.front")

_LENGTHS = struct.Struct("<II")


def frame(header: dict, body: bytes = b"") -> bytes:
    h = orjson.dumps(header)
    return _LENGTHS.pack(len(h), len(body)) + h + body


def read_frames(buf: bytearray) -> list[tuple[dict, bytes]]:
    """Remove the complete frames at the start of ``buf`` and return them as (header, body)."""
    out, off, n = [], 0, len(buf)
    while n - off >= 8:
        hl, bl = _LENGTHS.unpack_from(buf, off)
        end = off + 8 + hl + bl
        if end > n:
            break
        out.append((orjson.loads(buf[off + 8:off + 8 + hl]), bytes(buf[off + 8 + hl:end])))
        off = end
    if off:
        del buf[:off]
    return out


class Link(asyncio.Protocol):
    """One end of a central-front socket pair: frames in, frames out (coalesced per loop iteration)."""

    def __init__(self):
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self._buf = bytearray()
        self._out: list[bytes] = []

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buf += data
        for header, body in read_frames(self._buf):
            try:
                self.on_frame(header, body)
            except Exception:           # a bug must not close the link (and fail every request on it)
                log.exception("frame %s failed", header)
                self.on_bad_frame(header)

    def connection_lost(self, exc) -> None:
        self.transport = None
        if not self.closed.done():
            self.closed.set_result(None)
        self.on_lost()

    def send(self, header: dict, body: bytes = b"") -> None:
        if self.transport is None:
            return
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(frame(header, body))

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))

    def close(self) -> None:
        if self.transport is not None:
            self._flush()
            self.transport.close()

    def on_frame(self, header: dict, body: bytes) -> None:
        raise NotImplementedError

    def on_lost(self) -> None:
        pass

    def on_bad_frame(self, header: dict) -> None:
        pass


# ---------------------------------------------------------------- the central's side
def socket_dir() -> str:
    """A private directory for the central's Unix socket, named after this process; directories left by balancers
    that are gone (killed before they could remove theirs) are removed."""
    base = tempfile.gettempdir()
    if len(base) > 60:                   # a Unix socket path has ~100 bytes
        base = "/tmp"
    for old in glob.glob(os.path.join(base, "dllm-balancer-*-*")):
        try:
            os.kill(int(os.path.basename(old).split("-")[2]), 0)
        except ProcessLookupError:
            shutil.rmtree(old, ignore_errors=True)
        except (ValueError, PermissionError):
            pass
    return tempfile.mkdtemp(prefix=f"dllm-balancer-{os.getpid()}-", dir=base)


@dataclass(slots=True, eq=False)
class RemotePending(Pending):
    """A request a front process holds the client of: events go to the front instead of a local handler."""
    link: "FrontLink | None" = None
    n: int = 0

    def deliver(self, attempt, event, status=200, data=None, end=False) -> None:
        if attempt is not None and attempt != self.attempt:
            return                       # a failed attempt's late event
        try:
            if self.stream and event == "chunk" and not self.sent_bytes:
                # the front opens its client's stream at the first meaningful chunk: from then on a worker failure
                # ends the stream with an error event instead of a re-dispatch (as for a local request that has
                # written bytes; a local handler may still be behind, so it is re-dispatched a little more often)
                self.sent_bytes = isinstance(data, dict) and meaningful(data)
            self.link.send({"n": self.n, "a": attempt, "e": event, "st": status, "d": data, "end": end})
        except Exception:                # never into the batcher's dispatch task or the timeout sweep
            log.exception("request %s: event %s could not be forwarded", self.id, event)


class FrontLink(Link):
    def __init__(self, fronts: "Fronts", index: int):
        super().__init__()
        self.fronts = fronts
        self.index = index
        self.live: dict[int, RemotePending] = {}
        self.pid: int | None = None
        self.ready = False
        self.started = self.last_seen = time.monotonic()

    def on_frame(self, h: dict, body: bytes) -> None:
        t = h["t"]
        state = self.fronts.state
        self.last_seen = time.monotonic()
        if t == "r":
            n = h["n"]
            try:
                self.live[n] = state.admit(h["k"], body, h["s"], time.monotonic(), cls=RemotePending,
                                           version=h.get("v"), link=self, n=n)
            except APIError as e:
                self.send({"n": n, "a": None, "e": "error", "st": e.status, "d": e.body(), "end": True})
        elif t == "d":
            p = self.live.pop(h["n"], None)
            if p is not None:
                state.release(p)
            self.fronts.requests[self.index] += 1
            state.observe(h["p"], h["st"], h["s"])
        elif t == "ready":
            self.pid, self.ready = h["pid"], True
            log.info("front process %d (pid %d) accepting connections", self.index, self.pid)

    def on_bad_frame(self, h: dict) -> None:
        if h.get("t") == "r" and h.get("n") not in self.live:       # answer it rather than leave it waiting
            self.send({"n": h.get("n"), "a": None, "e": "error", "st": 500,
                       "d": error_body("internal error in the balancer", "server_error"), "end": True})

    def on_lost(self) -> None:
        state = self.fronts.state
        for p in self.live.values():
            state.release(p)
            state.observe(ENDPOINTS.get(p.kind, "/v1/completions"), 502, time.monotonic() - p.started)
        self.live.clear()


class Fronts:
    """The central's front processes: started after the central listens, restarted when one dies, closed last."""

    def __init__(self, state, count: int, host: str, port: int, central_socket: str, api_key: str | None,
                 timeout: float = 10.0, restart_delay: float = 1.0, restart_delay_max: float = 30.0,
                 startup_timeout: float = 60.0):
        self.state = state
        self.count = count
        self.host, self.port = host, port
        self.central_socket = central_socket
        self.api_key = api_key
        self.timeout = timeout           # a ready front silent for this long (no pong) is killed and restarted
        self.restart_delay = restart_delay
        self.restart_delay_max = restart_delay_max
        self.startup_timeout = startup_timeout   # a starting front may take this long to its first frame (imports)
        self.links: list[FrontLink | None] = [None] * count
        self.procs: list[asyncio.subprocess.Process | None] = [None] * count
        self.requests = [0] * count      # OpenAI requests answered through each front (across restarts)
        self.restarts = [0] * count
        self._closing = False
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        for i in range(self.count):
            await self._spawn(i)
            self._tasks.append(asyncio.create_task(self._supervise(i), name=f"front-{i}"))
        self._tasks.append(asyncio.create_task(self._watch(), name="front-watch"))

    async def _spawn(self, i: int) -> None:
        ours, theirs = socket.socketpair()
        env = {**os.environ, "DLLM_FRONT": json.dumps({
            "fd": theirs.fileno(), "host": self.host, "port": self.port, "central": self.central_socket,
            "api_key": self.api_key, "index": i, "log_level": logging.getLogger().getEffectiveLevel(),
            "max_body_bytes_in_flight": self.state.cfg.max_body_bytes_in_flight, "connect_timeout": self.timeout,
            "body_timeout": self.state.cfg.body_timeout, "keepalive_timeout": self.state.cfg.keepalive_timeout,
            "send_timeout": self.state.cfg.send_timeout})}
        proc = None
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "balancer.front", pass_fds=(theirs.fileno(),), env=env)
            theirs.close()
            link = FrontLink(self, i)
            await asyncio.get_running_loop().create_connection(lambda: link, sock=ours)
        except BaseException:
            theirs.close()
            ours.close()                 # the front, if it started, sees the link closed and exits
            if proc is not None and proc.returncode is None:
                proc.kill()
            raise
        self.procs[i], self.links[i] = proc, link

    async def _watch(self) -> None:
        """Ping every front; one that answers nothing (a wedged loop, SIGSTOP) for ``timeout`` is killed, and
        restarted by its supervisor like one that crashed."""
        every = max(0.05, self.timeout / 4)
        last = time.monotonic()
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            # a round that came late (the central itself was paused: SIGSTOP, a long stall; more than twice the
            # interval) judges nothing: the fronts' answers to its pings may be waiting to be read, and healthy
            # fronts were killed for it
            late, last = now - last > 2 * every, now
            try:
                self._round(now, late)
            except Exception:        # noqa: BLE001  (the fronts need the pings: without them they answer 503s)
                log.exception("a round of the fronts' watch failed")

    def _round(self, now: float, late: bool) -> None:
        for link, proc in zip(self.links, self.procs):
            if link is None or proc is None or proc.returncode is not None:
                continue
            limit = self.timeout if link.ready else self.startup_timeout
            if now - link.last_seen > limit and not late:
                log.error("front process %d (pid %d) silent for %.1f s: killing it", link.index, proc.pid,
                          now - link.last_seen)
                proc.kill()
            elif link.ready:
                link.send({"t": "ping"})

    async def _supervise(self, i: int) -> None:
        quick = 0                                # exits within 10 s of a start in a row: the delay doubles
        while True:
            started = time.monotonic()
            code = await self.procs[i].wait()
            if self._closing:
                return
            quick = quick + 1 if time.monotonic() - started < 10 else 0
            delay = min(self.restart_delay_max, self.restart_delay * 2 ** max(0, quick - 1))
            log.error("front process %d exited with %s; restarting it in %g s", i, code, delay)
            link, self.links[i] = self.links[i], None
            if link is not None:
                link.close()
            await asyncio.sleep(delay)
            if self._closing:
                return
            self.restarts[i] += 1
            try:
                await self._spawn(i)
            except OSError as e:         # tried again after the (doubled) delay: procs[i] is still the dead one
                log.error("front process %d could not start: %s", i, e)

    def snapshot(self) -> list[dict]:
        out = []
        for i, (link, proc) in enumerate(zip(self.links, self.procs)):
            alive = proc is not None and proc.returncode is None
            out.append({"role": "front", "index": i, "pid": proc.pid if proc else None,
                        "status": "ready" if alive and link and link.ready else ("starting" if alive else "exited"),
                        "requests": self.requests[i], "open_requests": len(link.live) if link else 0,
                        "restarts": self.restarts[i]})
        return out

    async def close(self, timeout: float = SHUTDOWN_GRACE) -> None:
        """Close the fronts' links (each answers what it still holds and exits), wait ``timeout`` (the shutdown's
        grace: the balancer exits within it after its drain), then kill stragglers; remove the central's Unix
        socket."""
        self._closing = True
        for t in self._tasks:
            t.cancel()
        for link in self.links:
            if link is not None:
                link.close()
        procs = [p for p in self.procs if p is not None and p.returncode is None]
        try:
            async with asyncio.timeout(timeout):
                await asyncio.gather(*(p.wait() for p in procs))
        except TimeoutError:
            for p in procs:
                if p.returncode is None:
                    log.warning("front process %d did not exit: SIGKILL", p.pid)
                    p.kill()
            await asyncio.gather(*(p.wait() for p in procs))
        shutil.rmtree(os.path.dirname(self.central_socket), ignore_errors=True)


# ---------------------------------------------------------------- a front process
@dataclass
class FrontConfig:
    fd: int
    host: str
    port: int
    central: str                         # the central's Unix socket (HTTP) for every non-OpenAI path
    api_key: str | None = None
    index: int = 0
    log_level: int = logging.INFO
    connect_timeout: float = 10.0        # --front-timeout: seconds to open a connection to the central's socket, and of
                                         # the central's silence before this front answers 503 (watch_central)
    max_body_bytes_in_flight: int = MAX_BODY_BYTES_IN_FLIGHT     # this front's own bound (the balancer's setting)
    body_timeout: float = BODY_TIMEOUT                           # the balancer's --body-timeout
    keepalive_timeout: float = KEEPALIVE_TIMEOUT                 # the balancer's --keepalive-timeout (the central's too)
    send_timeout: float = SEND_TIMEOUT                           # the balancer's --send-timeout


@dataclass(eq=False)
class FrontState:
    cfg: FrontConfig
    link: "CentralLink | None" = None
    silent: float | None = None          # the central has sent nothing since then, past --front-timeout: 503s
    proxied: set = field(default_factory=set)       # the handler tasks of proxied requests waiting on the central
    cut: set = field(default_factory=set)           # those of them stopped by the central's silence
    live: dict[int, EventBox] = field(default_factory=dict)
    session: aiohttp.ClientSession | None = None
    ids: itertools.count = field(default_factory=itertools.count)


class CentralLink(Link):
    def __init__(self, front: FrontState):
        super().__init__()
        self.front = front
        self.heard = time.monotonic()    # the central's last frame

    def on_frame(self, h: dict, body: bytes) -> None:
        self.heard = time.monotonic()
        if self.front.silent is not None:
            log.warning("the central process answers again after %.1f s", self.heard - self.front.silent)
            self.front.silent = None
        if "t" in h:                     # the central's ping
            self.send({"t": "pong"})
            return
        box = self.front.live.get(h["n"])
        if box is not None:
            box.push(Event(h["a"], h["e"], h["st"], h["d"], h["end"]))

    def on_lost(self) -> None:
        for box in self.front.live.values():
            box.push(Event(None, "error", 502, error_body("the balancer's central process went away", "server_error"),
                           True))


FRONT = web.AppKey("front", FrontState)


def silence(front: FrontState) -> str:
    return (f"the balancer's central process has not answered for {time.monotonic() - front.silent:.0f} s "
            f"(--front-timeout {front.cfg.connect_timeout:g} s)")


async def watch_central(front: FrontState, link: CentralLink) -> None:
    """The central pings every front at least four times per --front-timeout (``Fronts._watch``). Silent for longer
    (stopped, wedged, or gone without closing its socket), it can answer nothing: this front answers its open
    requests, proxied ones among them, and new ones 503 (never a client left waiting on it) until the central speaks
    again. A round that came late (this front was paused itself: more than twice the rounds' interval since the
    last) judges nothing: the central's frames may be waiting to be read; a round on time judges a silence that
    had lasted at most 3/4 of --front-timeout at its previous round, a quarter's margin for the central's pace."""
    timeout = front.cfg.connect_timeout
    every = max(0.05, timeout / 4)
    last = time.monotonic()
    while not link.closed.done():
        await asyncio.sleep(every)
        now = time.monotonic()
        late, last = now - last > 2 * every, now
        if late or front.silent is not None or now - link.heard <= timeout:
            continue
        front.silent = link.heard
        log.error("%s: its %d open requests (%d proxied) are answered 503", silence(front),
                  len(front.live) + len(front.proxied), len(front.proxied))
        err = error_body(silence(front), "service_unavailable")
        for box in list(front.live.values()):
            box.push(Event(None, "error", 503, err, True))
        for task in list(front.proxied):
            front.cut.add(task)
            task.cancel()


class FrontDoor:
    """A front's way in for the OpenAI endpoints (common/openai_http.py): validated here, handed to the central as
    one frame, answered from the events the central sends back (its queue, batching and --request-timeout)."""
    timeout = None

    def __init__(self, front: FrontState):
        self.front = front

    async def open(self, request: web.Request, kind: str, body: bytes, req) -> EventBox:
        front = self.front
        link = front.link
        if link is None or link.transport is None:
            raise APIError(503, "the balancer is shutting down or restarting")
        if front.silent is not None:
            raise APIError(503, silence(front))
        n = request["n"] = next(front.ids)
        box = front.live[n] = EventBox()
        link.send({"t": "r", "n": n, "k": kind, "s": req.stream, "v": req.model_version}, body)
        return box

    def close(self, request: web.Request, box, status: int, seconds: float) -> None:
        n = request.get("n", -1)
        self.front.live.pop(n, None)
        if n == -1 and self.front.silent is not None:
            return          # (a request refused here while the central is silent: nothing for it to release, and
                            # its frames would pile up unread)
        if self.front.link is not None:     # the central records the request (and releases it when it holds it)
            self.front.link.send({"t": "d", "n": n, "p": request.path, "st": status, "s": seconds})


DOOR = web.AppKey("door", FrontDoor)
PROXY_CHUNK = 1 << 16       # bytes: a proxied answer up to this size is read whole, a larger one streamed in these
# the headers a proxied request takes to the central and its answer brings back: with the content's, a file
# download's range and validators (a front answered a Range request 200 with the whole file, the central 206 with
# the range: a review), and what a 405 or a 503 says
FORWARDED = ("authorization", "content-type", "accept", "range", "if-range", "if-none-match", "if-modified-since",
             "if-match", "if-unmodified-since")
RETURNED = ("content-type", "retry-after", "allow", "content-range", "accept-ranges", "etag", "last-modified",
            "content-disposition")


async def proxy(request: web.Request) -> web.Response:
    """Any other path: the central's own answer, over its Unix socket, to the path exactly as the client sent it
    (never decoded or normalised here: the central routes, checks the key and refuses what it would refuse)."""
    front = request.app[FRONT]
    if front.silent is not None:
        raise APIError(503, silence(front))
    task = asyncio.current_task()
    front.proxied.add(task)
    try:
        return await _proxy(request, front)
    except asyncio.CancelledError:
        if task not in front.cut:
            raise                        # (its client went away)
        task.uncancel()                  # the central fell silent (watch_central): answered, not dropped
        if request.get("proxy_started"):
            raise ConnectionResetError("the balancer's central process stopped answering mid-answer") from None
        raise APIError(503, silence(front)) from None
    finally:
        front.proxied.discard(task)
        front.cut.discard(task)


async def _proxy(request: web.Request, front: FrontState) -> web.Response:
    headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
    # the body goes through as it arrives, never held here: the central applies its own limits to it (a
    # /v1/files upload may be far larger than an OpenAI request)
    body = request.content if request.can_read_body else None
    try:
        async with front.session.request(request.method, yarl.URL("http://central" + request.path_qs, encoded=True),
                                         headers=headers, data=body) as r:
            keep = {k: v for k, v in r.headers.items() if k.lower() in RETURNED}
            if r.content_length is not None and r.content_length <= PROXY_CHUNK:
                resp = web.Response(body=await r.read(), status=r.status, headers=keep)
                if r.status == 408:          # the central gave up on the body (--body-timeout): so does this end
                    close_once_answered(request, resp)
                return resp
            resp = web.StreamResponse(status=r.status, headers=keep)    # a large answer (a file) goes through too
            if r.content_length is not None:
                resp.content_length = r.content_length
            request["proxy_started"] = True
            await resp.prepare(request)
            try:
                async for chunk in r.content.iter_chunked(PROXY_CHUNK):
                    await resp.write(chunk)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:      # cut off: the client must see it is
                raise ConnectionResetError(f"the central's answer broke off: {type(e).__name__}") from e
            await resp.write_eof()
            return resp
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise APIError(503, f"the balancer's central process did not answer: {type(e).__name__}")


async def serve_front(cfg: FrontConfig) -> int:
    raise_open_files()
    front = FrontState(cfg)
    app = web.Application(middlewares=middlewares(cfg.api_key, guarded_by_api_key),
                          client_max_size=MAX_BODY_BYTES)
    app[FRONT] = front
    app[BODY_BUDGET] = BodyBudget(cfg.max_body_bytes_in_flight)
    app[BODY_TIMEOUT_S] = cfg.body_timeout
    app[DOOR] = FrontDoor(front)
    add_routes(app, app[DOOR])
    app.router.add_route("*", "/{tail:.*}", proxy)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):   # (SIGHUP: a terminal closing signals the group)
        loop.add_signal_handler(sig, lambda: None)          # the central decides when fronts stop
    # no total: a proxied call takes as long as the central takes, and the central bounds its own work (its calls
    # to workers, a weight update); an upload goes at its client's pace. Idle connections to the central are let go
    # well before the central's own --keepalive-timeout closes them (no request sent on a connection being closed).
    front.session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(
                                              path=cfg.central, keepalive_timeout=min(15.0, cfg.keepalive_timeout / 2)),
                                          timeout=aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout))
    link = front.link = CentralLink(front)
    await loop.create_connection(lambda: link, sock=socket.socket(fileno=cfg.fd))
    runner = AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=4.0,
                       keepalive_timeout=cfg.keepalive_timeout, send_timeout=cfg.send_timeout)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True, reuse_port=True)
    try:
        await site.start()
    except OSError as e:
        log.error("front process %d cannot listen on %s:%d: %s", cfg.index, cfg.host, cfg.port, e)
        return 1
    settle_gc(HTTP_GC_THRESHOLD)
    link.heard = time.monotonic()
    link.send({"t": "ready", "pid": os.getpid()})
    watch = asyncio.create_task(watch_central(front, link), name="watch-central")
    await link.closed                                       # the central closed the link (or died)
    watch.cancel()
    await site.stop()       # the port at once (a central restarted by an outside manager binds it); open requests go on
    try:
        async with asyncio.timeout(5):                      # let handlers write what the central sent last
            while front.live:
                await asyncio.sleep(0.02)
    except TimeoutError:
        pass
    await runner.cleanup()
    await front.session.close()
    return 0


def main() -> int:
    raw = json.loads(os.environ["DLLM_FRONT"])
    cfg = FrontConfig(**raw)
    logging.basicConfig(level=cfg.log_level, format=f"%(asctime)s front{cfg.index} %(levelname)s %(name)s: "
                                                    "%(message)s")
    try:
        import uvloop
        return uvloop.run(serve_front(cfg))
    except ImportError:
        return asyncio.run(serve_front(cfg))


if __name__ == "__main__":
    sys.exit(main())
