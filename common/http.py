"""HTTP pieces shared by the worker and the balancer (aiohttp; no torch): JSON responses, the middleware that
answers every error in the OpenAI shape, API-key checking, the bound on request bytes in flight, and the runner whose
connections answer malformed HTTP in the OpenAI shape too."""
from __future__ import annotations

import asyncio
import functools
import gc
import hmac
import logging
import socket
import sys
from typing import Callable

import click
import orjson
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, HttpProcessingError
from aiohttp.http_parser import RawRequestMessage
from aiohttp.web_protocol import RequestPayloadError

from common.config import setting
from common.protocol import APIError, error_body

log = logging.getLogger("dllm.http")


EXIT_PORT_IN_USE = 98                  # a server's exit code when its port is taken (the supervisor gives up)
MAX_BODY_BYTES = 64 * 1024 ** 2        # one client request (balancer, fronts, worker /v1); larger: 413
MAX_BATCH_BYTES = 4 * MAX_BODY_BYTES   # one /worker/batch body; the balancer never forms a larger one
# Request-body bytes one process holds at once, over all its requests (--max-body-bytes-in-flight): the balancer and
# each of its front processes, and a worker (which takes the balancer's batches: 2 in flight of up to 128 MiB each)
MAX_BODY_BYTES_IN_FLIGHT = 4 * MAX_BODY_BYTES
WORKER_BODY_BYTES_IN_FLIGHT = 2 * MAX_BATCH_BYTES

# Content types a JSON body may come with: none, JSON, and those HTTP clients send by default for raw bytes
# (``curl -d``: application/x-www-form-urlencoded; aiohttp: application/octet-stream). Anything else (multipart
# forms, XML, ...) is a 415.
JSON_CONTENT_TYPES = ("", "application/json", "text/plain", "application/x-www-form-urlencoded",
                      "application/octet-stream")


SMALL_BODY_BYTES = 1024 ** 2             # a body up to this size may use the budget's last quarter (BodyBudget)

# Slow clients (--body-timeout, --keepalive-timeout; nginx's client_body_timeout and keepalive_timeout): seconds a
# request body may go without a byte arriving (then 408 and the connection closed), and seconds a connection may sit
# idle between requests before it is closed; a request whose headers have not all arrived counts as idle, so this
# bounds a client that trickles its headers too. aiohttp's own idle default, without run_app, is an hour.
BODY_TIMEOUT = 60.0
KEEPALIVE_TIMEOUT = 75.0
# --send-timeout (nginx's send_timeout): seconds an answer may wait, its buffers full, with the client taking no byte
# of it; then the connection is dropped (the request counts as the client's disconnect: cancelled at its worker).
SEND_TIMEOUT = 60.0


def body_timeout_setting():
    """The --body-timeout setting of the balancer's and the worker's configs."""
    return setting(BODY_TIMEOUT, "Seconds a request body may go without a byte arriving; then the request gets 408 "
                                 "and its connection is closed.", type=click.FloatRange(0, min_open=True))


def send_timeout_setting():
    """The --send-timeout setting of the balancer's and the worker's configs."""
    return setting(SEND_TIMEOUT, "Seconds an answer may wait, its buffers full, while the client takes no byte of it; "
                                 "then the connection is dropped (its request counts as the client's disconnect).",
                   type=click.FloatRange(0, min_open=True))


class BodyBudget:
    """The bytes of request bodies one server process holds at once, over all its requests
    (``--max-body-bytes-in-flight``). A body counts from the start of its reading (its whole Content-Length at once,
    or each chunk of a chunked body as it arrives) until its request is answered; a body that would pass the limit
    is refused with 503 + Retry-After (before it is read, when its Content-Length says so), so N concurrent large
    bodies cost at most the limit, never N times the per-request cap. Bodies over SMALL_BODY_BYTES may only fill
    three quarters of it: the last quarter stays for small requests, which large ones never crowd out."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0           # bytes held now
        self.peak = 0
        self.refused = 0        # requests refused with 503
        self.held: dict[int, int] = {}      # id(request) -> its bytes held (a plain dict: the hot path's)

    def take(self, request: web.Request, n: int) -> None:
        held = self.held.get(id(request), 0) + n
        room = self.limit if held <= SMALL_BODY_BYTES else self.limit - self.limit // 4
        if held > room:                       # over what it could ever hold: no retry can help
            raise APIError(413, f"the request body is larger than {room} bytes (--max-body-bytes-in-flight)")
        if self.used + n > room:
            self.refused += 1
            raise APIError(503, f"the server is holding its limit of request-body bytes ({self.limit}, "
                                "--max-body-bytes-in-flight): retry shortly", headers={"Retry-After": "1"})
        self.used += n
        self.peak = max(self.peak, self.used)
        self.held[id(request)] = held

    def release(self, request: web.Request) -> None:
        """Give back what ``request`` holds (its answer is over); called once per request by errors_middleware,
        while the request is alive (so its id is still its own)."""
        if self.held:
            self.used -= self.held.pop(id(request), 0)

    def snapshot(self) -> dict:
        return {"bytes": self.used, "limit": self.limit, "peak": self.peak, "refused": self.refused}


BODY_BUDGET = web.AppKey("body_budget", BodyBudget)
BODY_TIMEOUT_S = web.AppKey("body_timeout", float)       # the app's --body-timeout (default BODY_TIMEOUT)


async def body_read(request: web.Request, aw):
    """Await ``aw``, a read of ``request``'s body, while its bytes keep arriving: once the app's --body-timeout
    passes with no new byte of the body (the read may need many: a multipart field), a 408, and the request's
    connection is closed once answered (:func:`close_once_answered`). For every read that waits on the client."""
    timeout, content = request.app.get(BODY_TIMEOUT_S, BODY_TIMEOUT), request.content
    task = asyncio.ensure_future(aw)
    try:
        while True:
            seen = content.total_bytes
            done, _ = await asyncio.wait((task,), timeout=timeout)
            if done:
                return task.result()
            if content.total_bytes == seen:
                raise APIError(408, f"no byte of the request body arrived for {timeout:g} s (--body-timeout)",
                               type="invalid_request_error", code="body_timeout")
    finally:
        task.cancel()


def close_once_answered(request: web.Request, resp: web.StreamResponse) -> None:
    """``request``'s connection closes as soon as ``resp`` is written, with no wait for the rest of its body
    (aiohttp would read and drop it for 10 s, "lingering"): for a body that stopped arriving (408)."""
    resp.force_close()
    if hasattr(request.protocol, "_lingering_time"):
        request.protocol._lingering_time = 0.0


async def read_bytes(request: web.Request, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """A request's whole body: at most ``max_bytes`` (else 413, before reading when the Content-Length says so),
    its bytes held against the app's :class:`BodyBudget` (when it has one) until the request is answered. Read
    once per request (it consumes the body)."""
    budget = request.app.get(BODY_BUDGET)
    length = request.content_length
    if length is not None and length > max_bytes:
        raise APIError(413, f"the request body is larger than {max_bytes} bytes")
    taken = 0                 # of the budget: the Content-Length at once, then what the body decodes to beyond it
    if budget is not None and length:
        budget.take(request, length)
        taken = length
    buf, content = bytearray(), request.content
    while True:
        chunk = content.read_nowait()                  # what has arrived: usually a small body's whole
        if not chunk:
            if content.at_eof():
                break
            chunk = await body_read(request, content.readany())
            if not chunk:
                break
        if len(buf) + len(chunk) > max_bytes:
            raise APIError(413, f"the request body is larger than {max_bytes} bytes")
        # a chunked body chunk by chunk, and a compressed one (Content-Encoding: aiohttp decodes it) as it grows
        # past its Content-Length: a review's 60 KiB of gzip were 60 MiB each, twelve at once past the bound
        if budget is not None and len(buf) + len(chunk) > taken:
            budget.take(request, len(buf) + len(chunk) - taken)
            taken = len(buf) + len(chunk)
        buf += chunk
    return bytes(buf)


async def read_body(request: web.Request, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The raw body of an OpenAI request, after the Content-Type check (415 in the OpenAI shape); see
    :func:`read_bytes`."""
    ctype = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
    if ctype not in JSON_CONTENT_TYPES and not ctype.endswith("+json"):
        raise APIError(415, f"unsupported Content-Type {ctype!r}: send the body as application/json",
                       type="invalid_request_error")
    return await read_bytes(request, max_bytes)


def json_response(data, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json", headers=headers)


def retry_headers(status: int) -> dict | None:
    """Retry-After for the statuses that invite a retry (429, 503)."""
    return {"Retry-After": "1" if status == 429 else "5"} if status in (429, 503) else None


# OpenAI endpoints this server does not have: a 404 that says so (a diffusion LM server generates and scores text)
NOT_SERVED = {"/v1/embeddings": "embeddings", "/v1/moderations": "moderations", "/v1/images": "images",
              "/v1/audio": "audio", "/v1/files": "files", "/v1/batches": "batches", "/v1/fine_tuning": "fine-tuning",
              "/v1/assistants": "assistants", "/v1/threads": "threads", "/v1/vector_stores": "vector stores",
              "/v1/realtime": "realtime sessions", "/v1/uploads": "uploads", "/v1/rerank": "reranking",
              "/v1/score": "scoring by a cross-encoder"}
SERVED = "/v1/completions, /v1/chat/completions, /v1/responses, /v1/models"
# OpenAI endpoints an app serves beyond SERVED (the balancer: /v1/files, /v1/batches), named in its 404s
EXTRA_SERVED = web.AppKey("extra_served", tuple)


def _not_served(path: str, extra: tuple = ()) -> tuple[str, str]:
    served = ", ".join([SERVED, *extra])
    for prefix, what in NOT_SERVED.items():
        if prefix not in extra and (path == prefix or path.startswith(prefix + "/")):
            return (f"this server does not serve {what} ({path}): it serves diffusion language models for text "
                    f"generation and likelihood scoring ({served}; docs/api.md)", "unsupported_endpoint")
    return f"no such endpoint: {path} (the OpenAI endpoints here: {served})", "unknown_url"


def malformed_http(message: str | None, status: int = 400) -> web.Response:
    """The answer to a request whose HTTP itself is broken (a header line over 8,190 bytes, a bad chunk size...):
    the OpenAI error shape, and the connection closed (its byte stream cannot be trusted any more)."""
    detail = (message or "").strip().split("\n", 1)[0][:200]
    resp = json_response(error_body(f"malformed HTTP request: {detail or 'unparseable'}", "invalid_request_error",
                                    code="malformed_http"), status)
    resp.force_close()
    return resp


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """Every 4xx/5xx body in the OpenAI shape; an unexpected exception is a logged 500, never a crash. Also where a
    request's body bytes go back to the :class:`BodyBudget` once its answer is over. An error once the handler's
    own answer has begun (a stream) is not answered again: aiohttp closes the connection (a second HTTP response
    inside the first would corrupt it)."""
    try:
        return await handler(request)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        if getattr(request.writer, "output_size", 0):
            raise
        return _error_answer(request)
    finally:
        budget = request.app.get(BODY_BUDGET)
        if budget is not None:
            budget.release(request)


def _error_answer(request: web.Request) -> web.StreamResponse:
    """The OpenAI-shaped answer to the exception being handled (errors_middleware)."""
    try:
        raise
    except APIError as e:
        resp = json_response(e.body(), e.status, e.headers or retry_headers(e.status))
        if e.status == 408:          # the body stopped midway
            close_once_answered(request, resp)
        return resp
    except web.HTTPException as e:
        if e.status < 400:
            raise
        typ = "not_found_error" if e.status == 404 else ("invalid_request_error" if e.status < 500 else "server_error")
        message, code = e.reason or str(e), None
        if isinstance(e, web.HTTPNotFound) and e.reason == "Not Found":       # the router found no route
            message, code = _not_served(request.path, request.app.get(EXTRA_SERVED, ()))
        return json_response(error_body(message, typ, code=code), e.status,
                             {k: v for k, v in e.headers.items() if k.lower() in ("allow", "retry-after")})
    except (HttpProcessingError, RequestPayloadError) as e:      # the body's HTTP framing broke while it was read
        return malformed_http(getattr(e, "message", None) or str(e))
    except Exception as e:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return json_response(error_body(f"internal error: {type(e).__name__}", "server_error"), 500)


def auth_middleware(key: str, guarded: Callable[[str], bool]):
    """Require ``Authorization: Bearer KEY`` on the paths ``guarded`` accepts (installed only when a key is set).
    The key is compared in constant time (hmac.compare_digest), so answer times say nothing about it."""
    expected = f"Bearer {key}".encode("utf-8", "surrogatepass")

    @web.middleware
    async def middleware(request: web.Request, handler):
        if guarded(request.path):
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogatepass")
            if not hmac.compare_digest(given, expected):
                raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key")
        return await handler(request)
    return middleware


def middlewares(api_key: str | None, guarded: Callable[[str], bool]) -> list:
    """The middleware stack of both servers: OpenAI-shaped errors, plus the API-key check when a key is set."""
    return [errors_middleware] + ([auth_middleware(api_key, guarded)] if api_key else [])


# ---------------------------------------------------------------- malformed HTTP in the OpenAI shape
class _Connection(web.RequestHandler):
    """aiohttp's connection protocol, with what it answers itself in the OpenAI error shape: a request it cannot
    parse (a header line over 8,190 bytes, too many headers, a bad request line, a bad chunk size or Content-Length
    before the handler runs) gets a JSON 400, not aiohttp's plain text; an unexpected error a JSON 500. And a body
    whose chunk framing breaks after its handler began reading it fails that read (a JSON 400 from
    errors_middleware) instead of leaving it waiting for bytes that never come: aiohttp's C parser drops such a
    payload without telling its reader."""
    __slots__ = ()

    def data_received(self, data: bytes) -> None:
        messages = getattr(self, "_messages", None)         # requests parsed, not yet handled (aiohttp's)
        queued = len(messages) if messages is not None else 0
        super().data_received(data)
        if messages is None or len(messages) <= queued:
            return
        try:
            if not isinstance(messages[-1][0], RawRequestMessage):        # the parser failed: an error entry
                error = getattr(messages[-1][0], "exc", None)
                if not isinstance(error, Exception):
                    error = BadHttpMessage("malformed HTTP")
                payloads = [p for _, p in messages]
                current = getattr(self, "_current_request", None)         # the request being handled
                if current is not None:
                    payloads.append(current.content)
                for payload in payloads:
                    if not payload.is_eof():
                        payload.set_exception(error)
                        payload.feed_eof()
        except Exception:          # an aiohttp whose internals moved: its own behaviour stays
            log.debug("could not fail a broken request body", exc_info=True)

    async def _drain_helper(self) -> None:
        """aiohttp's wait for the client to take what is written (every answer's writes wait here once the
        transport's buffer is full), given up once --send-timeout (the server's ``send_timeout``) passes with no
        byte taken by the client (:func:`_taken`): the connection is dropped and the write fails as on a client's
        disconnect."""
        if not self._paused and self.transport is not None:         # the usual case (each answer's end)
            return
        timeout = getattr(self._manager, "send_timeout", None)
        if self.transport is None or timeout is None:
            return await super()._drain_helper()
        drain = asyncio.ensure_future(super()._drain_helper())
        try:
            while True:
                before = _taken(self.transport)
                done, _ = await asyncio.wait((drain,), timeout=timeout)
                if done:
                    return drain.result()
                if self.transport is not None and _taken(self.transport) <= before:
                    log.info("client %s took nothing of its answer for %g s (--send-timeout): connection dropped",
                             self.transport.get_extra_info("peername"), timeout)
                    self.transport.abort()
                    raise ConnectionResetError(f"the client took nothing for {timeout:g} s (--send-timeout)")
        finally:
            drain.cancel()         # (its waiter too, at once: a cancelled waiter left in place would fail the
            waiter = self._drain_waiter                             # connection's next drain straight away)
            if waiter is not None and waiter.cancelled():
                self._drain_waiter = None

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if isinstance(exc, ConnectionResetError) and (self.transport is None or self.transport.is_closing()):
            log.debug("%s %s: %s", request.method, request.path, exc)     # the client is gone: no one to answer
            return web.Response(status=499)
        if status >= 500:
            super().handle_error(request, status, exc, message)      # aiohttp's log line and checks
            resp = json_response(error_body("the request timed out", "timeout") if status == 504
                                 else error_body("internal error", "server_error"), status)
            resp.force_close()
            return resp
        log.info("malformed HTTP from %s: %s", request.remote, (message or str(exc))[:200].replace("\n", " "))
        if request.writer.output_size > 0:
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        return malformed_http(message or (str(exc) if exc else None), status)


def _taken(transport) -> int:
    """A count that grows whenever the client takes bytes of what is sent to it: TCP's bytes acknowledged by the
    peer (Linux's TCP_INFO ``tcpi_bytes_acked``), else (another system, a Unix socket) minus the bytes still
    unsent in the transport. The first sees a slow reader's progress at once; with the second, the kernel's send
    buffer (up to 4 MiB) must empty by a third before the transport's count moves."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 128)
            if len(info) >= 128:
                return int.from_bytes(info[120:128], sys.byteorder)
        except (OSError, AttributeError):
            pass
    return -transport.get_write_buffer_size()


class _Server(web.Server):
    send_timeout: float | None = None          # --send-timeout (set by AppRunner): read by _Connection._drain_helper

    def __call__(self) -> web.RequestHandler:
        handler = super().__call__()
        handler.__class__ = _Connection            # the same object layout (no slots of its own)
        return handler


# The balancer's processes allocate tracked objects for every request (its task, request, response, Pending,
# events), and under load most of them are alive, waiting for a batch, when Python's collector looks at them. With
# Python's default first threshold (700 allocations) a young-generation pass ran every few requests and each walked
# the in-flight requests' objects again: 6.6% of a loaded balancer's CPU (perf). At this threshold a pass runs every
# few hundred requests; cyclic garbage still goes within that many allocations, and a pass takes a few milliseconds
# at most (docs/benchmarks.md, section (c)).
HTTP_GC_THRESHOLD = 20_000


def settle_gc(young_threshold: int | None = None) -> None:
    """Once a server is set up: what exists now lives as long as the process, so it leaves every collector pass
    (``gc.freeze``); ``young_threshold`` (the balancer's HTTP processes: :data:`HTTP_GC_THRESHOLD`) replaces the
    first generation's threshold."""
    gc.freeze()
    if young_threshold is not None:
        gc.set_threshold(young_threshold, *gc.get_threshold()[1:])


# Open files a server process asks for: each client connection takes one, and so do its connections to workers and
# its files. Linux's usual soft limit (1,024) is below a few hundred evaluation clients plus those; the hard limit
# (usually 524,288 or more) is what an administrator allows. vLLM and SGLang raise theirs the same way.
OPEN_FILES_WANTED = 65536


def raise_open_files(wanted: int = OPEN_FILES_WANTED) -> tuple[int, int]:
    """Raise this process's soft limit on open files towards ``wanted``, as far as the hard limit allows (never
    lowering it); the limit before and after. Called once by every server process as it starts."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return 0, 0
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    now = soft
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            log.debug("open files limit raised from %d to %d", soft, target)
            now = target
        except (OSError, ValueError) as e:
            log.warning("could not raise the open files limit from %d: %s", soft, e)
    if now != resource.RLIM_INFINITY and now < 4096:
        log.warning("open files limit %d (hard limit %d): each client connection takes one; raise the hard limit "
                    "(ulimit -Hn) to serve more than a few hundred clients at once", now, hard)
    return soft, now


# Seconds a server's shutdown gives its handlers, once its drain is over (answered, or past --drain-timeout), to
# finish writing before they are cancelled (aiohttp's own default is 60 s, which --drain-timeout would not bound).
SHUTDOWN_GRACE = 5.0


# The generation endpoints, most of every server's requests: their route is found by one dict lookup of the
# request line's path (see direct_routes).
DIRECT_PATHS = ("/v1/completions", "/v1/chat/completions")


def direct_routes(app: web.Application, slow, paths=DIRECT_PATHS):
    """A request handler for ``app`` (frozen) that takes a POST to one of ``paths`` (exactly, no query string, no
    ``Expect``) straight to its route's handler inside the app's middlewares, and every other request to ``slow``
    (aiohttp's ``Application._handle``). The same handler and middlewares, without the router's lookup, its
    per-request match object and aiohttp's own middleware layer: 15-25 us a request on the development VM, about a
    tenth of a loaded balancer's CPU (docs/benchmarks.md). ``request.app`` and ``request.match_info`` read as
    aiohttp's would (one frozen match object per route: these routes have no variables)."""
    from aiohttp.web_urldispatcher import UrlMappingMatchInfo
    routes = {}
    for route in app.router.routes():
        path = route.resource.get_info().get("path") if route.resource is not None else None
        if route.method == "POST" and path in paths:
            info = UrlMappingMatchInfo({}, route)
            info.add_app(app)
            info.freeze()
            handler = route.handler
            for m in reversed(app.middlewares):
                handler = functools.partial(m, handler=handler)
            routes[path] = (info, handler)
    if not routes:
        return slow

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        hit = routes.get(request.raw_path) if request.method == "POST" else None
        if hit is None or "Expect" in request.headers:
            return await slow(request)
        request._match_info = hit[0]
        return await hit[1](request)
    return handle


class AppRunner(web.AppRunner):
    """aiohttp's AppRunner whose connections answer malformed HTTP in the OpenAI error shape (:class:`_Connection`);
    every server here (balancer, front processes, worker, supervisor) runs its app with it. Its cleanup waits at
    most :data:`SHUTDOWN_GRACE` for the handlers still running; an idle connection is closed after
    ``keepalive_timeout`` (default :data:`KEEPALIVE_TIMEOUT`), one whose client takes no byte of its answer for
    ``send_timeout`` (default :data:`SEND_TIMEOUT`) is dropped; the generation endpoints skip the router
    (:func:`direct_routes`)."""

    def __init__(self, app: web.Application, *, send_timeout: float = SEND_TIMEOUT, **kwargs):
        kwargs.setdefault("shutdown_timeout", SHUTDOWN_GRACE)
        kwargs.setdefault("keepalive_timeout", KEEPALIVE_TIMEOUT)
        super().__init__(app, **kwargs)
        self._send_timeout = send_timeout

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server
        server.send_timeout = self._send_timeout
        server.request_handler = direct_routes(self.app, server.request_handler)
        return server
