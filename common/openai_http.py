"""The OpenAI endpoints, described once and answered by one handler in the balancer, its front processes and the
worker (aiohttp; never imports torch).

A request's life, the same in all three servers: :func:`handle` reads the body (the one JSON language,
common/protocol.py), validates it for its ``kind``, asks the server's :class:`Door` to ``open`` it (the balancer
queues it for a batch, a front hands it to the balancer process, the worker tokenises it and queues its rows), and
answers from the events that come back: one JSON response, or server-sent events. The door's ``close`` runs once the
answer is over or the client has gone (cancellation, metrics).

Events are :class:`Event` named tuples ``(attempt, kind, status, data, end)``: ``kind`` is "chunk" (a stream chunk),
"response" (the whole answer) or "error" (``status`` and an OpenAI error body); ``attempt`` numbers the balancer's
dispatches of the request (None elsewhere); the request's last event has ``end`` True. The same type from the
worker's Run to the balancer's Pending and its front processes (on the wire between processes: NDJSON lines and
frames with the same fields). A source of events is an async iterator of
them (an :class:`EventBox`, or any object with ``__anext__`` ending after the ``end`` event)."""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import time
from typing import Any, AsyncIterator, NamedTuple, Protocol

import orjson
from aiohttp import web

from common.http import json_response, read_body, retry_headers
from common.protocol import APIError, error_body, parse_request

# kind -> path: the endpoints this handler serves (request models and response builders: common/protocol.py)
ENDPOINTS = {"completion": "/v1/completions", "chat": "/v1/chat/completions", "responses": "/v1/responses"}

class Event(NamedTuple):
    """One event of a request's answer (see the module's docstring)."""
    attempt: int | None
    kind: str
    status: int
    data: Any
    end: bool


class EventBox:
    """A request's events in order, pushed by whoever produces them and read as an async iterator (up to the event
    with ``end``); one waiter future at a time (no task or queue per request)."""
    __slots__ = ("events", "sent_bytes", "_waiter", "_ended")

    def __init__(self):
        self.events: collections.deque = collections.deque()
        self.sent_bytes = False         # set when the client's stream has opened
        self._waiter: asyncio.Future | None = None
        self._ended = False

    def push(self, ev: Event) -> None:
        self.events.append(ev)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def next(self) -> Event:
        while not self.events:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.events.popleft()

    def __aiter__(self):
        return self

    async def __anext__(self) -> Event:
        if self._ended:
            raise StopAsyncIteration
        ev = await self.next()
        self._ended = ev.end
        return ev


class Door(Protocol):
    """How one server takes an OpenAI request in (see the module's docstring)."""

    timeout: float | None       # seconds before an unfinished answer becomes a 504 (None: the source times out)

    async def open(self, request: web.Request, kind: str, body: bytes, req) -> AsyncIterator[Event]: ...

    def close(self, request: web.Request, source, status: int, seconds: float) -> None: ...


# A body up to this size is parsed, validated and prepared on the event loop (a few milliseconds at most); a larger
# one (up to 64 MiB: a million chat messages or 30 million token ids, seconds of work) on the process's one
# large-body thread, large bodies one at a time. The event loop goes on while the thread runs Python (validators,
# chat templates, tokenizer calls: they share the GIL in 5 ms turns), not during one long call into C that holds
# the GIL: orjson's read and pydantic-core's validation of a 52 MiB body of token ids still stop it for ~0.8 s.
INLINE_BYTES = 256 * 1024
_large_bodies: concurrent.futures.ThreadPoolExecutor | None = None


async def off_loop(size: int, fn, *args):
    """``fn(*args)``, for a body of ``size`` bytes: on the event loop up to INLINE_BYTES, else on the large-body
    thread."""
    if size <= INLINE_BYTES:
        return fn(*args)
    global _large_bodies
    if _large_bodies is None:
        _large_bodies = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="large-body")
    return await asyncio.get_running_loop().run_in_executor(_large_bodies, fn, *args)


async def parse(kind: str, body: bytes):
    """parse_request(kind, body), off the event loop for a large body."""
    return await off_loop(len(body), parse_request, kind, body)


async def handle(request: web.Request, kind: str, door: Door) -> web.StreamResponse:
    t0 = time.monotonic()
    status = 499          # the client went away before an answer (nginx's convention), unless set below
    source = None
    try:
        body = await read_body(request)
        req = await parse(kind, body)      # the one JSON language; the body is passed on as it is
        source = await door.open(request, kind, body, req)
        stream, req = req.stream, None      # the parsed body (as large as the body) is not kept while answering
        opened: dict = {}
        answer = (answer_stream(request, source, kind == "responses", opened) if stream
                  else answer_single(source))
        timed_out = False
        if door.timeout is None:
            resp, status = await answer
        else:
            try:
                async with asyncio.timeout(door.timeout):
                    resp, status = await answer
            except TimeoutError:
                status, timed_out = 504, True
                resp = await _timed_out(opened, door.timeout, kind == "responses")
        if stream and not timed_out and opened.get("stream") is resp:
            # the stream's end, outside the timeout: a slow reader's last bytes are --send-timeout's to bound (a
            # timeout that fell on them wrote an error and a second [DONE] after the stream's end: a review)
            await _end_stream(resp, kind == "responses")
        return resp
    except APIError as e:
        status = e.status
        raise
    finally:
        door.close(request, source, status, time.monotonic() - t0)


async def _timed_out(opened: dict, limit: float, responses: bool) -> web.StreamResponse:
    """The 504 of a request past its timeout: a JSON error, or an error event ending a stream already open
    (``opened``: answer_stream's record of it)."""
    body = error_body(f"the request took longer than --request-timeout ({limit:g} s)", "timeout")
    resp = opened.get("stream")
    if resp is None:
        return json_response(body, 504)
    await resp.write(_event(body, responses, opened))
    if not responses:
        await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def meaningful(chunk: dict) -> bool:
    """A chunk worth opening the client's stream for (the chat role-only chunk is held back, so a request whose
    worker fails before any text can still be re-dispatched by the balancer)."""
    if chunk.get("usage"):
        return True
    kind = chunk.get("type")               # a Responses stream event
    if kind is not None:
        return (kind == "response.output_text.delta" and bool(chunk.get("delta"))) or kind in (
            "response.completed", "response.incomplete", "response.failed")
    for c in chunk.get("choices", ()):
        if (c.get("finish_reason") or c.get("text") or (c.get("delta") or {}).get("content")
                or c.get("diffusion_step")):
            return True
    return False


async def answer_single(source) -> tuple[web.Response, int]:
    """A non-streaming answer: the source's "response" (or "error") event."""
    result = None
    async for _, event, status, data, end in source:
        if event in ("response", "error"):
            result = (data, status)
        if end:
            break           # no StopAsyncIteration round trip on the hot path
    if result is None:
        return json_response(error_body("the worker ended the request without an answer", "server_error"), 502), 502
    data, status = result
    return json_response(data, status, retry_headers(status)), status


def sse(data: dict, responses: bool, seq: int = 0) -> bytes:
    """One SSE event; a Responses stream names its events (``event: TYPE``), as OpenAI's does, an error among them
    (OpenAI's ``error`` event: ``type``, ``sequence_number`` (``seq``: the one after the stream's last event),
    ``code``, ``message``, ``param``; the error object kept beside them, so the openai client raises it as it does
    on chat streams)."""
    if responses and "type" not in data and isinstance(data.get("error"), dict):
        e = data["error"]
        data = {"type": "error", "sequence_number": seq, "code": e.get("code") or e.get("type"),
                "message": e.get("message"), "param": e.get("param"), "error": e}
    head = b"event: " + data["type"].encode() + b"\n" if responses and isinstance(data.get("type"), str) else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


def _output_so_far(opened: dict) -> list:
    """A failed Responses stream's output: the message it was writing, with the text its deltas carried, marked
    "incomplete" (its own, whole, when its ``output_item.done`` came); none if no message had started."""
    item = opened.get("item")
    if item is None:
        return []
    if item.get("status") != "in_progress":
        return [item]
    text = "".join(opened.get("text", ()))
    return [{**item, "status": "incomplete", "content": [{"type": "output_text", "text": text, "annotations": []}]}]


def _event(data: dict, responses: bool, opened: dict) -> bytes:
    """:func:`sse` of one event of a stream, numbering an error event after the stream's last (``opened["seq"]``).
    In a Responses stream an error is followed, as on OpenAI's, by ``response.failed``: the response the stream
    last showed (``opened["response"]``), its status "failed", its ``error`` set and its ``output`` what the stream
    had written (``_output_so_far``: it repeated the created response's empty output)."""
    if not responses:
        return sse(data, False)
    if isinstance(data.get("sequence_number"), int):
        opened["seq"] = data["sequence_number"] + 1
    if isinstance(data.get("response"), dict):
        opened["response"] = data["response"]
    kind = data.get("type")
    if kind == "response.output_text.delta":
        opened.setdefault("text", []).append(data.get("delta") or "")
    elif kind in ("response.output_item.added", "response.output_item.done") and isinstance(data.get("item"), dict):
        opened["item"] = data["item"]
    out = sse(data, True, opened.get("seq", 0))
    if kind is None and isinstance(data.get("error"), dict):
        seq = opened["seq"] = opened.get("seq", 0) + 1
        last = opened.get("response")
        if last is not None:
            e = data["error"]
            failed = {**last, "status": "failed", "output": _output_so_far(opened),
                      "error": {"code": e.get("code") or e.get("type") or "server_error",
                                "message": e.get("message") or ""}}
            out += sse({"type": "response.failed", "sequence_number": seq, "response": failed}, True)
            opened["seq"] = seq + 1
    return out


async def answer_stream(request: web.Request, source, responses: bool = False,
                        opened: dict | None = None) -> tuple[web.StreamResponse, int]:
    """An SSE answer; the stream opens at the first chunk worth sending (before it an error is a plain JSON error,
    and the balancer may still re-dispatch). A Responses stream (``responses``) ends without ``data: [DONE]``, as
    OpenAI's. ``opened["stream"]`` is set to the response once it has started."""
    resp = None
    held: list[tuple[int, dict]] = []
    status = 200
    opened = {} if opened is None else opened
    async for attempt, event, st, data, end in source:
        if held and attempt is not None and held[0][0] != attempt:
            held = []       # a re-dispatch: what the failed attempt held back is void
        if event == "error":
            if resp is None:
                return json_response(data, st, retry_headers(st)), st
            await resp.write(_event(data, responses, opened))
            status = st
        elif event == "chunk":
            if resp is None and not meaningful(data):
                held.append((attempt, data))
            else:
                if resp is None:
                    resp = await _open_stream(request, source, held, responses, opened)
                    held = []
                await resp.write(_event(data, responses, opened))
        if end:
            break
    if resp is None:
        resp = await _open_stream(request, source, held, responses, opened)
    return resp, status         # (its end: handle's _end_stream)


async def _end_stream(resp: web.StreamResponse, responses: bool) -> None:
    """A stream's last bytes: ``data: [DONE]`` (not on a Responses stream, as OpenAI's), then its end."""
    if not responses:
        await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()


async def _open_stream(request: web.Request, source, held: list, responses: bool = False,
                       opened: dict | None = None) -> web.StreamResponse:
    source.sent_bytes = True
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    opened = {} if opened is None else opened
    opened["stream"] = resp
    for _, h in held:
        await resp.write(_event(h, responses, opened))
    return resp


def add_routes(app: web.Application, door: Door) -> None:
    """The OpenAI POST routes, each answered by :func:`handle` through ``door``."""
    for kind, path in ENDPOINTS.items():
        app.router.add_post(path, functools.partial(handle, kind=kind, door=door))
