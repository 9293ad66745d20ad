"""Centralized batching: OpenAI requests accumulate into batches (the wait timer starts with a batch's first
request) while every free worker is busy, and go at once to a worker that is idle (--idle-dispatch); each whole
batch goes in one call to ``POST /worker/batch`` of a healthy worker with free capacity, the one the routing policy
prefers (balancer/policy.py; by default the least loaded). While every worker is busy, requests keep accumulating,
so batches grow under load. Worker state (load, errors, health) is the pool's: the batcher reports to it.

Failover: when a worker dies, stalls or its connection breaks mid-batch, every request of that batch that has not
yet sent bytes to its client goes back to the front of the queue (bounded retries, the failed worker excluded while
others are healthy); a streaming request that already sent bytes ends with an error event. A batch whose connection
the worker refused never reached it: its requests go back without using a retry (the worker is down from then on).
Events carry the attempt number they belong to, so a request is never answered twice.

Row isolation: a worker answers each row of a batch on its own (a row it rejects gets its own 4xx event). A 4xx for
the whole batch (a body the worker could not read: a balancer bug, since both parse with common/protocol.py) is
logged as an error and the batch's rows are re-sent one by one, each alone in its batch; a row that is rejected even
alone gets the worker's answer. Neither case counts against the worker's health or the request's retries."""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

import click

from balancer.policy import DEFAULT as DEFAULT_POLICY, POLICIES, make_policy
from balancer.pool import Worker, WorkerPool
from common.config import setting
from common.http import MAX_BATCH_BYTES
from common.openai_http import Event
from common.protocol import error_body

log = logging.getLogger("dllm.balancer.batcher")

# Statuses of a whole-batch answer that reject the batch's content (not a worker fault): 400 bad body, 413 too
# large, 422. A 401/403 (the worker's key differs), 429 and 503 (busy, loading, draining) fail over instead.
REJECTED = frozenset({400, 413, 415, 422})


def _hash(w: Worker) -> str | None:
    """The weights ``w`` holds (its last /health's model_version hash), if it named them."""
    return (w.last_health.get("model_version") or {}).get("hash")


def _code(ev: dict) -> str | None:
    """The OpenAI error code of a worker's error event for a row."""
    data = ev.get("data")
    err = data.get("error") if isinstance(data, dict) else None
    return err.get("code") if isinstance(err, dict) else None


@dataclass(slots=True, eq=False)
class Pending:
    """One client request while the balancer holds it. Its handler iterates it: events (common.openai_http.Event)
    of the current attempt (stale attempts' are skipped); ``attempt`` None means "whatever the current attempt"
    (timeouts)."""
    id: str
    kind: str                      # "chat" | "completion"
    body: bytes                    # the client's JSON body, validated, forwarded byte for byte
    stream: bool
    events: collections.deque = field(default_factory=collections.deque)   # of common.openai_http.Event
    attempt: int = 0
    tries: int = 0
    sent_bytes: bool = False       # set by the handler just before it writes anything to its client
    cancelled: bool = False
    done: bool = False
    excluded: set = field(default_factory=set)
    solo: bool = False             # goes alone in its batch (its batch was rejected as a whole)
    wire: str = ""                 # its id in the current dispatch: ``id``, with ".ATTEMPT" after the first (a
                                   # worker that still holds an abandoned attempt's row refuses a repeated id)
    version: str | None = None     # the weights it requires (its model_version): only workers holding them
    worker: Worker | None = None
    enqueued_at: float = field(default_factory=time.monotonic)
    started: float = field(default_factory=time.monotonic)
    ended: bool = False            # its handler has read the last event
    _waiter: asyncio.Future | None = None

    def deliver(self, attempt: int | None, event: str, status: int = 200, data=None, end: bool = False) -> None:
        self.events.append(Event(attempt, event, status, data, end))
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Event:
        """The next event of the current attempt (stale attempts' events are skipped), up to the one with ``end``
        (one waiter future at a time: no task or queue per request; the balancer's hot path)."""
        if self.ended:
            raise StopAsyncIteration
        events = self.events
        while True:
            while not events:
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            ev = events.popleft()
            if ev.attempt is None or ev.attempt == self.attempt:
                self.ended = ev.end
                return ev

    next = __anext__

    def fail(self, status: int, message: str, type_: str = "server_error", param: str | None = None,
             code: str | None = None) -> None:
        self.done = True
        self.deliver(self.attempt, "error", status, error_body(message, type_, param, code), end=True)


@dataclass
class BatchConfig:
    batch_size: int = setting(16, "Most requests per dispatched batch.", type=click.IntRange(1))
    wait_time: float = setting(0.02, "Seconds a forming batch waits for more requests, from its first request.",
                               flag="--batch-wait-time", type=click.FloatRange(0))
    max_inflight_per_worker: int = setting(2, "Batches in flight per worker (2: the next batch is queued on the "
                                              "worker while one runs).", type=click.IntRange(1))
    idle_dispatch: bool = setting(True, "A request that finds a worker idle (no batch in flight) goes to it at once, "
                                        "without --batch-wait-time: the wait forms batches only while every free "
                                        "worker is busy, so a lone client pays no batching latency.")
    max_queue: int = setting(4096, "Queued requests beyond which new ones get 429.", type=click.IntRange(1))
    max_retries: int = setting(2, "Re-dispatches of a request after worker failures.", type=click.IntRange(0))
    connect_timeout: float = setting(5.0, "Seconds to open a connection to a worker.", type=click.FloatRange(0.1))
    no_worker_grace: float = setting(30.0, "Seconds queued requests wait for a healthy worker before 503.",
                                     type=click.FloatRange(0))
    busy_backoff_max: float = setting(5.0, "Most seconds a worker that answered a batch 429 or 503 (its queue full, "
                                           "draining, loading) is left out of the routing: its Retry-After, else 1 s. "
                                           "The batch goes back to the queue without using a retry.",
                                      type=click.FloatRange(0))
    call_timeout: float = setting(30.0, "Seconds one of the balancer's own short calls to a worker may take: "
                                        "/worker/cancel, /tokenize, /detokenize, /v1/models, /generation/algorithms, "
                                        "/tokenizer_info; and a batch's stream may stay open once every request of "
                                        "it is answered (then its place is freed).", flag="--worker-call-timeout",
                                  type=click.FloatRange(0.1))
    max_batch_bytes: int = setting(MAX_BATCH_BYTES // 2, cli=False)   # well under the worker's body limit
    routing_policy: str = setting(DEFAULT_POLICY, "Which free worker gets the next batch (balancer/policy.py): "
                                                  "least_loaded = fewest requests in flight, then fewest batches, "
                                                  "then the longest idle.", type=click.Choice(sorted(POLICIES)))


@dataclass(slots=True, eq=False)
class Dispatch:
    """One batch sent (or about to be sent) to a worker by its own task."""
    worker: Worker
    batch: list[Pending]
    task: asyncio.Task | None = None
    started: bool = False          # the task ran its first step (it does its own accounting from there)
    aborted: str | None = None     # why the pool aborted the worker ("stalled", ...); None: not aborted
    ended_early: bool = False      # closed because none of its requests waits for an answer any more
    answered: int = 0              # its rows answered so far (each left the worker's rows in flight as it ended)


class CentralBatcher:
    def __init__(self, pool: WorkerPool, session_factory, cfg: BatchConfig, headers: dict | None = None):
        self.pool = pool
        self.cfg = cfg
        self.policy = make_policy(cfg.routing_policy)
        pool.on_abort = self._abort
        self.headers = headers or {}
        self._session_factory = session_factory
        self.queue: collections.deque[Pending] = collections.deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.batches = 0
        self.rows = 0
        self.histogram: collections.Counter[int] = collections.Counter()
        self.retries = 0
        self.failed_midstream = 0
        self.split_batches = 0         # batches a worker rejected as a whole, re-sent one request at a time
        self.on_batch = None           # callback(batch_size) for metrics
        self._closing = False
        self._no_worker_since: float | None = None
        self._dispatches: set[Dispatch] = set()      # in flight, on every worker
        self._cancels: set[asyncio.Task] = set()      # /worker/cancel calls under way (held until they end)
        # weight updates (balancer/weights.py): which workers may take batches, which required weights (a request's
        # model_version) can still be served, and a pause that holds the queue
        self.routable = lambda w: not w.updating
        self.servable = lambda wanted: True
        self.allowed_versions = lambda: None     # hashes a worker must hold for the rows that require none
        self.paused = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="central-batcher")

    async def close(self) -> None:
        self._closing = True
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        tasks = [d.task for d in self._dispatches]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------ admission
    @property
    def queue_depth(self) -> int:
        """Queued requests (O(1): a cancelled one counts until the dispatch loop drops it, within one wake-up)."""
        return len(self.queue)

    @property
    def in_flight(self) -> int:
        return sum(w.inflight_rows for w in self.pool.workers)

    def submit(self, p: Pending) -> None:
        p.enqueued_at = time.monotonic()
        if (self.cfg.idle_dispatch and not self.queue and not (p.excluded or p.solo or p.version or self.paused)
                and self._task is not None and not self._task.done()):
            now = time.monotonic()
            idle = [w for w in self.pool.workers
                    if w.healthy and w.inflight_batches == 0 and w.busy_until <= now and self.routable(w)]
            if idle:               # straight to an idle worker: no hop through the batching loop
                self._start_dispatch(self.policy.rank(idle)[0], [p])
                return
        self.queue.append(p)
        if len(self.queue) == self.cfg.batch_size:
            self._dispatch_ready()          # a batch just filled up: it goes now (a longer queue found no place)
        self._wake.set()

    def cancel(self, p: Pending) -> None:
        """The client is gone: drop a queued request, or tell its worker to drop the row."""
        if p.done:
            return
        p.cancelled = True
        p.done = True
        if p.worker is not None:
            self._send_cancel(p.worker, [p.wire])
            self._end_answered_dispatch(p)
        self._wake.set()

    def _send_cancel(self, w: Worker, ids: list[str]) -> None:
        t = asyncio.create_task(self._cancel_on_worker(w, ids))
        self._cancels.add(t)
        t.add_done_callback(self._cancels.discard)

    async def _cancel_on_worker(self, w: Worker, ids: list[str]) -> None:
        try:
            async with self._session_factory().post(w.url + "/worker/cancel", json={"ids": ids},
                                                    headers=self.headers,
                                                    timeout=aiohttp.ClientTimeout(total=self.cfg.call_timeout)) as r:
                await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass

    def _end_answered_dispatch(self, p: Pending) -> None:
        """When ``p``'s cancellation leaves its batch with no request waiting for an answer (every other one answered
        or cancelled too: a --request-timeout sweep, clients gone), close that batch's stream: its place on the
        worker is free at once, whatever the worker does with the stream (the worker drops the cancelled rows)."""
        for d in self._dispatches:
            if d.started and d.task is not None and not d.task.done() and p in d.batch:
                if all(q.done for q in d.batch):
                    d.aborted = "closed: every request of the batch is answered or cancelled"
                    d.ended_early = True
                    d.task.cancel()

    # ------------------------------------------------------------ forming and dispatching batches
    def _free_workers(self) -> list[Worker]:
        now = time.monotonic()
        return [w for w in self.pool.healthy()
                if w.inflight_batches < self.cfg.max_inflight_per_worker and w.busy_until <= now
                and self.routable(w)]

    def _backoff_left(self) -> float:
        """Seconds until the first healthy worker backing off (it answered 429/503) may take batches again, at most
        1 (the loop's wait when no worker is free)."""
        now = time.monotonic()
        left = [w.busy_until - now for w in self.pool.healthy() if w.busy_until > now]
        return min([1.0] + left)

    def versions_changed(self) -> None:
        """Workers' weights changed (or an update started or ended): queued requests that require weights no worker
        will serve any more get 409; the others may now fit other workers."""
        if any(p.version is not None and not p.cancelled and not self.servable(p.version) for p in self.queue):
            keep = collections.deque()
            for p in self.queue:
                if p.version is not None and not p.cancelled and not self.servable(p.version):
                    p.fail(409, f"no worker serves model_version {p.version!r} any more", "conflict_error",
                           "model_version", "model_version_unavailable")
                else:
                    keep.append(p)
            self.queue = keep
        self._wake.set()
        self.pool.notify()

    def _drop_cancelled(self) -> None:
        if any(p.cancelled for p in self.queue):
            self.queue = collections.deque(p for p in self.queue if not p.cancelled)

    async def _wait(self, timeout: float | None) -> None:
        self._wake.clear()
        self.pool.changed.clear()
        waits = [asyncio.create_task(self._wake.wait()), asyncio.create_task(self.pool.changed.wait())]
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in waits:
                t.cancel()

    async def _loop(self) -> None:
        while True:
            self._drop_cancelled()
            if not self.queue:
                self._no_worker_since = None        # the grace is counted for requests that wait
                await self._wait(None)
                continue
            free = [] if self.paused else self._free_workers()
            if not free:
                self._check_no_workers()
                await self._wait(self._backoff_left())
                continue
            self._no_worker_since = None
            if not self._ready(free):
                await self._wait(self.queue[0].enqueued_at + self.cfg.wait_time - time.monotonic())
                continue
            if not self._dispatch_one(free):
                # every queued request excludes every free worker (it failed there): wait for another to free up
                await self._wait(0.05)

    def _ready(self, free: list[Worker]) -> bool:
        """Whether the queue makes a batch now for one of ``free``: full, past its first request's wait, or a free
        worker is idle (--idle-dispatch)."""
        return (len(self.queue) >= self.cfg.batch_size
                or time.monotonic() >= self.queue[0].enqueued_at + self.cfg.wait_time
                or (self.cfg.idle_dispatch and any(w.inflight_batches == 0 for w in free)))

    def _dispatch_ready(self) -> None:
        """Start every batch that is ready and has a free worker, from the code that filled the batch or freed the
        worker, instead of waking the loop: under load the loop's wake-up waits behind every ready callback of the
        event loop, a few turns a batch while the worker idles. What is not ready is left to the loop's timer."""
        if self._task is None or self._task.done() or self._closing:
            return
        while self.queue and not self.paused:
            free = self._free_workers()
            if not free or not self._ready(free) or not self._dispatch_one(free):
                return

    def _dispatch_one(self, free: list[Worker]) -> bool:
        """Send a batch to the first worker of ``free`` in the policy's order that the queue has one for; False
        when it has none (every queued request excludes every free worker)."""
        for worker in self.policy.rank(free):
            batch = self._take(worker)
            if batch:
                self._start_dispatch(worker, batch)
                return True
        return False

    def _start_dispatch(self, worker: Worker, batch: list[Pending]) -> asyncio.Task:
        self.pool.batch_started(worker, len(batch))     # counted now, before the task runs: capacity is exact
        d = Dispatch(worker, batch)
        d.task = asyncio.create_task(self._dispatch(d))
        self._dispatches.add(d)
        d.task.add_done_callback(lambda _: self._dispatch_ended(d))
        return d.task

    def _abort(self, w: Worker, why: str) -> None:
        """The pool's ``on_abort``: it gave up on ``w`` (``why``); break every dispatch to it, which fails over."""
        for d in list(self._dispatches):
            if d.worker is w:
                d.aborted = why
                d.task.cancel()

    def _dispatch_ended(self, d: Dispatch) -> None:
        """A dispatch cancelled before its first step (the pool aborted the worker at once: it died) never ran its
        own accounting: undo the counts and put its requests back at the front of the queue, not lost."""
        self._dispatches.discard(d)
        if d.started:
            return
        self.pool.batch_ended(d.worker, len(d.batch))
        if not self._closing:
            back = [p for p in d.batch if not (p.cancelled or p.done)]
            if back:
                log.warning("batch for worker %d aborted before it was sent: %d requests back in the queue",
                            d.worker.index, len(back))
                self.queue.extendleft(reversed(back))
            self._wake.set()

    def _take(self, worker: Worker) -> list[Pending]:
        # a request goes back to a worker it failed on only when no other could take it: healthy, taking batches
        # (routable) and, for a request pinned to weights, holding them (it waited for its timeout beside an idle
        # worker it had failed on while a worker on other weights was healthy: a review)
        able = [(w.index, _hash(w)) for w in self.pool.healthy() if self.routable(w)]
        batch, keep = [], collections.deque()
        size = 0
        while self.queue and len(batch) < self.cfg.batch_size:
            p = self.queue.popleft()
            if p.cancelled:
                continue
            if (worker.index in p.excluded and any(i not in p.excluded and (p.version is None or h == p.version)
                                                   for i, h in able)) or (
                    batch and (p.solo or size + len(p.body) > self.cfg.max_batch_bytes)) or (
                    p.version is not None and p.version != _hash(worker)):
                keep.append(p)
                continue
            batch.append(p)
            size += len(p.body)
            if p.solo:
                break
        keep.extend(self.queue)
        self.queue = keep
        return batch

    def _check_no_workers(self) -> None:
        if self.pool.healthy():
            self._no_worker_since = None
            return
        now = time.monotonic()
        if self._no_worker_since is None:
            self._no_worker_since = now
        elif now - self._no_worker_since > self.cfg.no_worker_grace:
            for p in self.queue:
                if not p.cancelled:
                    p.fail(503, f"no healthy worker for {self.cfg.no_worker_grace:g} s", "service_unavailable")
            self.queue.clear()
            self._no_worker_since = None            # the next outage has its own grace

    async def _dispatch(self, d: Dispatch) -> None:
        d.started = True
        w = d.worker
        batch = [p for p in d.batch if not p.done]     # a request cancelled before this step is not sent
        attempts = {}
        for p in batch:
            p.attempt += 1
            p.tries += 1
            p.worker = w
            p.wire = p.id if p.attempt == 1 else f"{p.id}.{p.attempt}"
            attempts[p.wire] = p.attempt
        open_ = {p.wire: p for p in batch}
        failure, delivered = None, True
        try:
            if batch:
                failure = await self._send(d, batch, open_, attempts)
        except asyncio.CancelledError:
            if self._closing:
                raise
            failure = f"worker {d.aborted}" if d.aborted else "dispatch cancelled"
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, ValueError) as e:
            failure = f"{type(e).__name__}: {e}"
            # a connection that could not be made (refused: the worker died since its last probe) carried nothing
            delivered = not isinstance(e, aiohttp.ClientConnectorError)
            self.pool.batch_failed(w, failure, consecutive=True, refused=not delivered)
        except Exception as e:           # a malformed stream (or a bug) must fail over, not leave rows hanging
            log.exception("batch on worker %d: unexpected error", w.index)
            failure = f"bad batch stream: {type(e).__name__}: {e}"
            self.pool.batch_failed(w, failure)
        finally:
            self.pool.batch_ended(w, len(d.batch) - d.answered)
        if failure and open_ and not d.ended_early:
            if delivered:
                self._failover(w, list(open_.values()), attempts, failure)
            else:      # the worker never got them: not a failure of the requests, no retry used (it is down now)
                log.warning("batch for worker %d not delivered (%s): %d requests back in the queue", w.index,
                            failure, len(open_))
                self._put_back(list(open_.values()))
        self._dispatch_ready()              # the freed place takes the next batch now
        self._wake.set()

    async def _send(self, d: Dispatch, batch: list[Pending], open_: dict, attempts: dict) -> str | None:
        """POST the batch to its worker and deliver its events; the failure that leaves ``open_``'s requests to fail
        over, or None."""
        w = d.worker
        self.batches += 1
        self.rows += len(batch)
        self.histogram[len(batch)] += 1
        if self.on_batch:
            self.on_batch(len(batch))
        allowed = self.allowed_versions()
        parts = [b'{"model_versions":' + orjson.dumps(allowed) + b',"requests":[' if allowed else b'{"requests":[']
        # one join: no intermediate copy of any body (they may be 64 MiB each)
        for i, p in enumerate(batch):
            parts += (b',{"id":"' if i else b'{"id":"', p.wire.encode(), b'","kind":"', p.kind.encode(), b'","body":',
                      p.body, b"}")
        parts.append(b"]}")
        payload = b"".join(parts)
        async with self._session_factory().post(
                w.url + "/worker/batch", data=payload,
                headers={**self.headers, "Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout)) as r:
            # the worker answers once it holds every row: a cancel sent while the batch was on its way may have
            # found none of them, so the requests cancelled by now are cancelled again
            late = [p.wire for p in batch if p.cancelled]
            if late:
                self._send_cancel(w, late)
            if r.status in REJECTED:
                self._rejected(w, batch, r.status, await r.read())
                open_.clear()
            elif r.status == 409 and self._wrong_weights(w, batch, await r.read()):
                open_.clear()           # its weights are not the ones we took it for: it did nothing
            elif r.status in (429, 503):
                self._busy(w, batch, r.status, r.headers.get("Retry-After"), await r.read())
                open_.clear()
            elif r.status != 200:
                failure = f"worker answered {r.status}: {(await r.read())[:300].decode(errors='replace')}"
                self.pool.batch_failed(w, failure)
                return failure
            else:
                buf = b""
                chunks = r.content.iter_any().__aiter__()
                while True:
                    try:
                        if open_:
                            data = await chunks.__anext__()
                        else:       # every row answered: the stream's end is due now; one held open past
                            async with asyncio.timeout(self.cfg.call_timeout):   # --worker-call-timeout must
                                data = await chunks.__anext__()                  # not keep the place (a review)
                    except StopAsyncIteration:
                        break
                    except TimeoutError:
                        log.warning("worker %d kept a batch's stream open %g s after its last answer: closed",
                                    w.index, self.cfg.call_timeout)
                        return None
                    buf += data
                    if b"\n" in data:
                        *lines, buf = buf.split(b"\n")
                        self.pool.batch_progress(w)
                        self._lines(d, lines, open_, attempts)
                self._lines(d, [buf], open_, attempts)        # a last line without its newline
                if open_:
                    failure = "the worker closed the batch stream early"
                    self.pool.batch_failed(w, failure)        # (a worker's error, as a broken stream is)
                    return failure
        return None

    def _lines(self, d: Dispatch, lines: list[bytes], open_: dict, attempts: dict) -> None:
        w = d.worker
        refused, stale = [], []
        for line in lines:
            if not line or line.isspace():
                continue
            ev = orjson.loads(line)
            wire = ev.get("id")
            p = open_.get(wire)
            if p is None:
                continue
            kind = ev.get("event")
            end = ev.get("end", False) or kind == "end"
            if end and kind == "error" and not p.sent_bytes and (ev.get("status") == 429 or (
                    ev.get("status") == 409 and p.version is not None and _code(ev) == "model_version_unavailable")):
                # the worker's queue had no room for this request's rows (a batch is counted in requests, a
                # worker's queue in rows: prompts x n), or the request requires weights the worker no longer holds
                # (changed since its last /health): not an answer, the request waits for a worker again
                del open_[wire]
                self.pool.row_refused(w)
                d.batch.remove(p)         # no longer this dispatch's (a cancel looks for it in its next one)
                (refused if ev["status"] == 429 else stale).append(p)
                continue
            if end:
                del open_[wire]
                self.pool.row_served(w)         # (no longer in flight there: the worker answers rows as they end)
                d.answered += 1
                p.done = True
                p.worker = None
            p.deliver(attempts[wire], kind, ev.get("status", 200), ev.get("data"), end)
        if refused:
            self._busy(w, refused, 429, None, b"rows refused: the worker queue is full")
        if stale:
            log.warning("worker %d refused %d requests pinned to weights it no longer holds: its weights are unknown "
                        "until its next /health; re-queued", w.index, len(stale))
            w.last_health = {**w.last_health, "model_version": None}
            self._put_back(stale)
            self.versions_changed()     # (a 409 now if no worker is known to hold them)

    def _wrong_weights(self, w: Worker, batch: list[Pending], body: bytes) -> bool:
        """A 409 for the batch: the worker holds other weights than the batch allows (changed since its last /health:
        a load the balancer did not make). Learn them and put the batch back at the front of the queue (not a
        failure of anyone); True. A 409 that does not say which weights it holds is a failure of the worker (False:
        the caller fails the batch over), so a confused worker cannot send the batch round without end."""
        try:
            actual = orjson.loads(body).get("model_version")
        except (ValueError, AttributeError):
            actual = None
        believed = (w.last_health.get("model_version") or {}).get("hash")
        if not (isinstance(actual, dict) and isinstance(actual.get("hash"), str)) or actual["hash"] == believed:
            return False
        log.warning("worker %d holds other weights (%s) than the batch allows: re-queued", w.index, actual)
        w.last_health = {**w.last_health, "model_version": actual}
        self._put_back(batch)
        self.versions_changed()
        return True

    def _busy(self, w: Worker, batch: list[Pending], status: int, retry_after: str | None, body: bytes) -> None:
        """The worker refused the whole batch with 429 (its queue is full) or 503 (draining, loading, updating): it did
        nothing. It takes no batch for its Retry-After (else 1 s, at most --busy-backoff-max) and the batch goes back
        to the front of the queue, without using a retry (the requests wait for a worker up to --request-timeout)."""
        try:
            delay = float(retry_after) if retry_after is not None else 1.0
        except ValueError:
            delay = 1.0
        delay = min(max(delay, 0.0), self.cfg.busy_backoff_max)
        w.busy_until = time.monotonic() + delay
        log.info("worker %d answered a batch %d (%s): no batches for %.2f s, %d requests back in the queue", w.index,
                 status, body[:200].decode(errors="replace"), delay, len(batch))
        self._put_back(batch)
        self.pool.notify()

    def _rejected(self, w: Worker, batch: list[Pending], status: int, body: bytes) -> None:
        """The worker rejected the whole batch (a 4xx for the batch, not for a row): split it, or answer the row."""
        if len(batch) == 1:
            p = batch[0]
            log.warning("worker %d rejected request %s sent alone: %d %s", w.index, p.id, status,
                        body[:300].decode(errors="replace"))
            try:
                data = orjson.loads(body)
                if not isinstance(data, dict) or not isinstance(data.get("error"), dict):
                    raise ValueError
            except ValueError:
                data = error_body(f"the worker rejected the request: {body[:300].decode(errors='replace')}",
                                  "invalid_request_error")
            p.worker = None
            p.done = True
            p.deliver(p.attempt, "error", status, data, True)
            return
        log.error("BUG: worker %d rejected a whole batch of %d requests (%d: %s); re-sending each alone", w.index,
                  len(batch), status, body[:300].decode(errors="replace"))
        self.split_batches += 1
        for p in batch:
            p.solo = True
        self._put_back(batch)

    def _put_back(self, batch: list[Pending]) -> None:
        """Requests a worker did not take (refused, busy, other weights): back to the front of the queue, in order,
        without using a retry (not a failure of the request); whatever the attempt queued is stale from now on."""
        for p in batch:
            p.worker = None
            p.tries -= 1
            p.attempt += 1
        self.queue.extendleft(reversed([p for p in batch if not p.done]))      # (a cancelled one is done)

    def _failover(self, w: Worker, unfinished: list[Pending], attempts: dict, why: str) -> None:
        unfinished = [p for p in unfinished if not (p.cancelled or p.done)]
        if not unfinished:
            return
        log.warning("batch on worker %d failed (%s): %d requests unfinished", w.index, why, len(unfinished))
        self._send_cancel(w, [p.wire for p in unfinished])     # a worker still alive drops the abandoned rows
        requeue = []
        for p in unfinished:
            p.worker = None
            if p.cancelled or p.done:
                continue
            if p.sent_bytes:
                self.failed_midstream += 1
                p.fail(502, f"the worker serving this stream failed ({why}); the stream cannot be resumed")
            elif p.tries > self.cfg.max_retries:
                n = len(p.excluded | {w.index})
                p.fail(502, f"failed {p.tries} times (on {n} worker{'s' if n > 1 else ''}); last failure: {why}")
            else:
                p.excluded.add(w.index)
                p.attempt += 1          # whatever the failed attempt already queued for the handler is now stale
                requeue.append(p)
        if requeue:
            self.retries += len(requeue)
            self.queue.extendleft(reversed(requeue))
