"""The worker pool: live load the balancer tracks itself, and health from periodic /health probes.

Statuses: ``starting`` (never ready yet, or loading), ``idle`` / ``busy`` (healthy, by the balancer's own in-flight
work), ``stalled`` (holds work but has shown no denoising progress for longer than its stall allowance:
:meth:`WorkerPool.stall_after`), ``unhealthy`` (refused a connection, or ``unhealthy_threshold`` probes failed in a
row while it held no work), ``draining`` (says so). A down or stalled worker is re-admitted after
``healthy_threshold`` good probes in a row.

Progress is what the balancer last saw of the worker's device loop: a step its ``/health`` reports
(``seconds_since_last_step``), a line on one of its batch streams, or a ``/health`` saying it is not busy. A worker
that answers ``/health`` is judged from its fresh answers; one whose last probe failed (a stopped or frozen process
answers nothing: the probe times out) is judged by a watcher every quarter second, so it is found stalled as soon as
its allowance has passed.

The pool owns every worker's state: the batcher reports its dispatches (``batch_*`` methods) and the pool counts the
load and decides health. When the pool gives up on a worker that holds work (its connection is refused, it stalled),
:meth:`WorkerPool.abort` calls ``on_abort(worker, why)``, which the batcher registers to break those dispatches."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import aiohttp
import click

from common.config import setting

log = logging.getLogger("dllm.balancer.pool")


@dataclass
class HealthConfig:
    interval: float = setting(2.0, "Seconds between /health probes of one worker.", flag="--health-check-interval",
                              type=click.FloatRange(0.05))
    timeout: float = setting(5.0, "Seconds one /health probe may take.", flag="--health-timeout",
                             type=click.FloatRange(0.05))
    unhealthy_threshold: int = setting(3, "Failed probes in a row that mark an idle worker unhealthy.",
                                       type=click.IntRange(1))
    healthy_threshold: int = setting(2, "Good probes in a row that re-admit a worker.", type=click.IntRange(1))
    stall_timeout: float = setting(60.0, "Seconds without denoising progress while holding work after which a worker "
                                         "is 'stalled' and its work re-dispatched, whatever its step time; also the "
                                         "allowance of a worker that has reported no step time yet.",
                                   type=click.FloatRange(0.1))
    stall_steps: float = setting(5.0, "A worker holding work is 'stalled' sooner when it has made no denoising step "
                                      "for this many of its own step times (its /health step_seconds_max, the "
                                      "longest of its last 256 steps), but never before --stall-floor.",
                                 type=click.FloatRange(1))
    stall_floor: float = setting(5.0, "Seconds without a denoising step that never make a worker 'stalled' (unless "
                                      "--stall-timeout is shorter).", type=click.FloatRange(0.1))


@dataclass
class Worker:
    index: int
    url: str
    ever_ready: bool = False
    down: bool = False
    stalled: bool = False
    draining: bool = False
    consecutive_errors: int = 0
    consecutive_ok: int = 0
    requests_served: int = 0
    errors: int = 0
    inflight_batches: int = 0
    inflight_rows: int = 0
    last_progress: float = field(default_factory=time.monotonic)   # last sign the device loop moves
    last_activity: float | None = None                               # last event received from it
    last_health: dict = field(default_factory=dict)
    last_dispatch: float = 0.0
    stall_after: float | None = None    # seconds without progress, holding work, before it is stalled (the pool's)
    launch_id: str | None = None     # when set, only a worker whose /health shows it is ours (the supervisor's)
    instance_id: str | None = None   # the worker process last seen on /health
    updating: bool = False           # out of the routing while it loads new weights (balancer/weights.py)
    busy_until: float = 0.0          # no batches before this (monotonic): it answered one 429/503 (the batcher's)
    tokens_before: int = 0           # tokens_generated of the earlier processes in this place (restarts)
    process: Callable[[], dict] | None = None    # its process as its supervisor sees it (serve --local), or None

    @property
    def tokens_generated(self) -> int:
        """Completion tokens this place's worker processes have answered, as far as their last /health said."""
        return self.tokens_before + int(self.last_health.get("tokens_generated") or 0)

    @property
    def status(self) -> str:
        if self.draining:
            return "draining"
        if self.updating and self.ever_ready and not (self.down or self.stalled):
            return "updating"
        if not self.ever_ready:
            return "starting"
        if self.down:             # (before stalled: a stalled worker whose probes then failed is unhealthy)
            return "unhealthy"
        if self.stalled:
            return "stalled"
        return "busy" if self.inflight_batches else "idle"

    @property
    def healthy(self) -> bool:
        """Idle or busy (the same as ``status in ("idle", "busy")``, without building the string)."""
        return self.ever_ready and not (self.draining or self.stalled or self.down)

    def snapshot(self) -> dict:
        now = time.monotonic()
        return {
            "index": self.index, "worker_id": self.index, "url": self.url, "status": self.status,
            "requests_served": self.requests_served, "errors": self.errors,
            "consecutive_errors": self.consecutive_errors, "in_flight": self.inflight_rows,
            "in_flight_batches": self.inflight_batches,
            "last_activity_seconds_ago": None if self.last_activity is None else round(now - self.last_activity, 3),
            "seconds_since_progress": round(now - self.last_progress, 3),
            "stall_after_seconds": None if self.stall_after is None else round(self.stall_after, 3),
            "backoff_seconds": round(max(0.0, self.busy_until - now), 3),
            "model_version": self.last_health.get("model_version"),
            "worker_health": self.last_health,
            "process": self.process() if self.process is not None else None,
        }


class WorkerPool:
    def __init__(self, urls: list[str], session_factory, health: HealthConfig, headers: dict | None = None,
                 launch_ids: list[str | None] | None = None):
        self.workers = [Worker(i, u.rstrip("/")) for i, u in enumerate(urls)]
        for w, lid in zip(self.workers, launch_ids or ()):
            w.launch_id = lid
        self.health = health
        self.headers = headers or {}
        self._session_factory = session_factory
        self._tasks: list[asyncio.Task] = []
        self.changed = asyncio.Event()        # set whenever capacity or health may have changed
        self.on_abort: Callable[[Worker, str], None] | None = None   # the batcher's: break the worker's dispatches

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._probe_loop(w), name=f"health-{w.index}") for w in self.workers]
        self._tasks.append(asyncio.create_task(self._watch_loop(), name="stall-watch"))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers if w.healthy]

    def any_healthy(self) -> bool:
        return any(w.healthy for w in self.workers)

    def notify(self) -> None:
        self.changed.set()

    # ------------------------------------------------------------ probing
    async def _probe_loop(self, w: Worker) -> None:
        session = self._session_factory()
        while True:
            await self.probe(w, session)
            await asyncio.sleep(self.health.interval)

    async def _watch_loop(self) -> None:
        """Judges every worker whose last probe failed (it answers nothing: stopped, frozen, its loop wedged) as soon
        as its stall allowance has passed, rather than when its next probe times out."""
        while True:
            await asyncio.sleep(min(0.25, self.health.interval))
            self.watch()

    def watch(self) -> None:
        stalled = False
        for w in self.workers:
            if w.consecutive_errors and w.ever_ready:
                stalled |= self._check_stall(w)
        if stalled:
            self.notify()

    def stall_after(self, w: Worker) -> float:
        """Seconds without progress, while holding work, after which ``w`` is stalled: ``stall_steps`` of its own
        step times (the longest of its recent steps, as its last /health reported), at least ``stall_floor``, at
        most ``stall_timeout``; ``stall_timeout`` while it has reported no step time (before its first step, or a
        worker that does not report one)."""
        hc = self.health
        step = w.last_health.get("step_seconds_max")
        if isinstance(step, bool) or not isinstance(step, (int, float)) or step < 0:
            return hc.stall_timeout
        return min(hc.stall_timeout, max(hc.stall_floor, hc.stall_steps * step))

    async def probe(self, w: Worker, session: aiohttp.ClientSession) -> None:
        hc = self.health
        now = time.monotonic()
        try:
            async with session.get(w.url + "/health", headers=self.headers,
                                   timeout=aiohttp.ClientTimeout(total=hc.timeout)) as r:
                data = await r.json(content_type=None)
            if not isinstance(data, dict):
                raise ValueError("bad /health body")
        except (aiohttp.ClientConnectorError, ConnectionRefusedError) as e:
            self._failed(w, f"connection refused: {e}", refused=True)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            self._failed(w, f"{type(e).__name__}: {e}")
        else:
            self._answered(w, data, now)
        self._check_stall(w)
        self.notify()

    def _failed(self, w: Worker, why: str, refused: bool = False) -> None:
        w.consecutive_errors += 1
        w.consecutive_ok = 0
        if refused and w.ever_ready and not w.down:
            log.warning("worker %d (%s) is down: %s", w.index, w.url, why)
            w.down = True
            self.abort(w, "connection refused")
        elif not w.inflight_batches and w.consecutive_errors >= self.health.unhealthy_threshold and not w.down \
                and w.ever_ready:
            log.warning("worker %d (%s) is unhealthy after %d failed probes: %s", w.index, w.url,
                        w.consecutive_errors, why)
            w.down = True

    def _answered(self, w: Worker, data: dict, now: float) -> None:
        if w.launch_id is not None and data.get("launch_id") != w.launch_id:
            self._failed(w, f"another server answers on {w.url} (launch id {data.get('launch_id')!r}, not ours)",
                         refused=True)
            if not w.ever_ready and w.consecutive_errors == 1:
                log.error("worker %d: another server answers on %s; it is not used", w.index, w.url)
            return
        inst = data.get("instance_id")
        if inst != w.instance_id:
            if w.instance_id is not None:
                log.warning("worker %d (%s) is a new process (instance %s, was %s)", w.index, w.url, inst,
                            w.instance_id)
                w.tokens_before = w.tokens_generated      # the old process's count, which the new one restarts
            w.instance_id = inst
        v = data.get("model_version")
        if v is not None and not (isinstance(v, dict) and isinstance(v.get("hash"), str)):
            data = {**data, "model_version": None}      # malformed: as if it named none (routing reads its hash)
        w.last_health = data
        status = data.get("status")
        w.draining = status == "draining"
        # its steps count as progress whatever its status: a draining worker (SIGTERM) finishes the batches it
        # holds, and a non-streaming row sends nothing until it ends (they were aborted as stalled: a review)
        since = data.get("seconds_since_last_step")
        busy = bool(data.get("busy"))
        if busy and isinstance(since, (int, float)):
            w.last_progress = max(w.last_progress, now - since)
        elif not busy:
            w.last_progress = now
        w.stall_after = self.stall_after(w)
        w.consecutive_errors = 0                # it answers
        if status != "ready":
            w.consecutive_ok = 0
            if status in ("failed",):
                w.down = w.ever_ready
            return
        progressing = (now - w.last_progress) < w.stall_after
        w.consecutive_ok += 1
        if not w.ever_ready:
            w.ever_ready = True
            log.info("worker %d (%s) is ready", w.index, w.url)
        if (w.down or w.stalled) and progressing and w.consecutive_ok >= self.health.healthy_threshold:
            log.info("worker %d (%s) re-admitted", w.index, w.url)
            w.down = w.stalled = False

    def _check_stall(self, w: Worker) -> bool:
        """Marks ``w`` stalled (and aborts its work) when it holds work and has shown no progress for longer than
        :meth:`stall_after`; says whether it did."""
        if not w.inflight_batches or w.stalled:
            return False
        idle_for, allowed = time.monotonic() - w.last_progress, self.stall_after(w)
        if idle_for <= allowed:
            return False
        log.warning("worker %d (%s) stalled: no progress for %.1f s (allowed %.1f s; its /health %s) with %d batches "
                    "in flight; re-dispatching", w.index, w.url, idle_for, allowed,
                    f"failed {w.consecutive_errors} times in a row" if w.consecutive_errors else "answers",
                    w.inflight_batches)
        w.stalled = True
        w.consecutive_ok = 0
        self.abort(w, "stalled")
        return True

    def process_exited(self, w: Worker, why: str) -> None:
        """``w``'s launcher (balancer/supervisor.py, same process) saw its process exit: down at once, not at the
        next failed probe or dispatch (a review saw a killed worker shown idle for 1.4 s), its work failed over."""
        w.consecutive_ok = 0
        if w.ever_ready and not w.down:
            log.warning("worker %d (%s) is down: %s", w.index, w.url, why)
            w.down = True
        if w.inflight_batches:
            self.abort(w, why)
        self.notify()

    def abort(self, w: Worker, why: str) -> None:
        """Break every in-flight dispatch to ``w`` (``why``: "stalled", "connection refused"); their unsent requests
        go back to the queue."""
        if self.on_abort is not None:
            self.on_abort(w, why)

    # ------------------------------------------------------------ what the batcher reports
    def batch_started(self, w: Worker, rows: int) -> None:
        w.last_dispatch = time.monotonic()
        if not w.inflight_batches:       # it had no work of ours: its stall clock starts now, not at its last probe
            w.last_progress = max(w.last_progress, w.last_dispatch)
        w.inflight_batches += 1
        w.inflight_rows += rows

    def batch_ended(self, w: Worker, rows: int) -> None:
        """A batch counted by :meth:`batch_started` is over, however it went (or never went)."""
        w.inflight_batches -= 1
        w.inflight_rows -= rows
        self.notify()

    @staticmethod
    def batch_progress(w: Worker) -> None:
        w.last_activity = w.last_progress = time.monotonic()

    def row_served(self, w: Worker) -> None:
        """One row of a batch in flight on ``w`` is answered: it no longer counts in ``inflight_rows`` (its batch's
        :meth:`batch_ended` takes only the rows left)."""
        w.requests_served += 1
        w.inflight_rows -= 1

    def row_refused(self, w: Worker) -> None:
        """One row of a batch in flight on ``w`` was refused (its queue full): no longer in flight there."""
        w.inflight_rows -= 1

    def batch_failed(self, w: Worker, why: str, consecutive: bool = False, refused: bool = False) -> None:
        """A batch failed by ``w``'s fault (an error status, a broken connection, a malformed stream).
        ``consecutive``: it counts, with failed probes in a row, toward ``unhealthy_threshold`` (a good probe resets
        the count); ``refused``: the connection was refused, so a worker once ready is down at once."""
        w.errors += 1
        if consecutive:
            w.consecutive_errors += 1
        if refused and w.ever_ready and not w.down:
            w.down = True
            log.warning("worker %d (%s) is down: %s", w.index, w.url, why)
