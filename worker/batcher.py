"""The worker's batching queue and its device thread.

Requests arriving within ``max_wait_time`` of the first request of a forming batch (or until ``batch_size`` are
waiting) run together in one engine call, whatever parameters they carry; rows of a batch formed upstream (the
balancer's /worker/batch) start without that wait. The engine runs on one dedicated thread,
so the event loop stays free for /health, stats and streaming while a batch runs."""
from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from worker.engine import Engine, GenerationParams, Request, Result, StepHooks

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One row: a prompt with its parameters. Events go to ``sink(index, kind, payload)`` on the event loop:
    ("progress", final_ids) while decoding, then ("done", Result) or ("error", (status, message))."""
    prompt_ids: list[int]
    params: GenerationParams
    sink: object
    index: int = 0
    wants_progress: bool = True       # False: only the final result matters (non-streaming, no stop strings)
    cancelled: bool = False
    queued: bool = False              # waiting in the batcher (not yet in a batch)
    enqueued_at: float = field(default_factory=time.monotonic)
    start_by: float = 0.0             # the scheduler waits for more rows until then (at most)
    score: object = None              # a likelihood.ScoreRequest: a scoring row (params unused); "done" gives a
                                      # ScoreResult


class Batcher:
    def __init__(self, engine: Engine, *, batch_size: int = 8, max_wait_time: float = 0.05, max_queue: int = 1024,
                 loop: asyncio.AbstractEventLoop | None = None):
        self.engine = engine
        self.batch_size = batch_size
        self.max_wait_time = max_wait_time
        self.max_queue = max_queue
        self.pending: collections.deque[Job] = collections.deque()
        self.running: list[Job] = []
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="device")
        self._task: asyncio.Task | None = None
        self._loop = loop
        # statistics
        self.batches_processed = 0
        self.rows_processed = 0
        self.dropped_before_start = 0
        self.histogram: collections.Counter[int] = collections.Counter()
        self._cancelled_queued = 0      # cancelled rows still in ``pending`` (dropped at the next scheduling)
        self.on_batch = None    # optional callback(batch_size, seconds) for metrics

    # ------------------------------------------------------------ public
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._schedule(), name="batcher")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True, cancel_futures=True)

    def submit(self, job: Job, wait: bool = True) -> None:
        """Queue a row (the caller checked that the request's rows fit ``max_queue``: Serving.submit answers 429
        otherwise). ``wait=False``: the row arrived as part of a batch formed upstream (the balancer's), so waiting
        ``max_wait_time`` for company would only add latency."""
        p = job.params
        if p is not None and p.seed is None and (p.temperature > 0 or p.remasking == "random"):
            # A fixed seed per row makes a retried batch (after CUDA OOM) give the same tokens it already streamed.
            job.params = replace(p, seed=random.getrandbits(63))
        job.enqueued_at = time.monotonic()
        job.start_by = job.enqueued_at + (self.max_wait_time if wait else 0.0)
        job.queued = True
        self.pending.append(job)
        self._wake.set()

    def cancel(self, job: Job) -> None:
        """Drop a row: before it is scheduled it is never computed; while running, at the next denoising step."""
        if job.cancelled:
            return
        job.cancelled = True
        if job.queued:
            self._cancelled_queued += 1
            self._wake.set()

    @property
    def queue_depth(self) -> int:
        return len(self.pending) - self._cancelled_queued

    @property
    def busy(self) -> bool:
        return bool(self.running)

    async def idle(self) -> None:
        """Wait until nothing is queued or running."""
        while self.pending or self.running:
            await asyncio.sleep(0.02)

    # ------------------------------------------------------------ scheduling
    async def _schedule(self) -> None:
        while True:
            while not self.pending:
                self._wake.clear()
                await self._wake.wait()
            self._drop_cancelled()
            if not self.pending:
                continue
            deadline = self.pending[0].start_by
            while len(self.pending) < self.batch_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except asyncio.TimeoutError:
                    break
                self._drop_cancelled()
            self._drop_cancelled()
            batch = [self.pending.popleft() for _ in range(min(self.batch_size, len(self.pending)))]
            if not batch:
                continue
            for j in batch:
                j.queued = False
            self.running = batch
            t = time.monotonic()
            try:
                outcome = await asyncio.get_running_loop().run_in_executor(self._executor, self._run, batch)
            except Exception as e:   # never lose the scheduler or a row
                log.exception("batch failed")
                outcome = [(j, "error", (500, f"internal error: {type(e).__name__}")) for j in batch]
            finally:
                self.running = []
            self.batches_processed += 1
            self.rows_processed += len(batch)
            self.histogram[len(batch)] += 1
            if self.on_batch:
                self.on_batch(len(batch), time.monotonic() - t)
            for job, kind, payload in outcome:      # after the statistics, so a client sees them counted
                job.sink(job.index, kind, payload)

    def _drop_cancelled(self) -> None:
        """Drop rows cancelled while waiting; each still gets its terminal event (never computed, nfe 0)."""
        if self._cancelled_queued:
            keep = []
            for j in self.pending:
                if j.cancelled:
                    j.queued = False
                    self.dropped_before_start += 1
                    j.sink(j.index, "done", Result([], "cancelled", 0, [], len(j.prompt_ids)))
                else:
                    keep.append(j)
            self._cancelled_queued = 0
            self.pending = collections.deque(keep)

    # ------------------------------------------------------------ device thread
    def _emit(self, job: Job, kind: str, payload) -> None:
        self._loop.call_soon_threadsafe(job.sink, job.index, kind, payload)

    def _run(self, jobs: list[Job]) -> list[tuple[Job, str, object]]:
        """Device thread: run one batch; progress goes to the loop as it happens, the terminal events are
        returned ((job, "done", Result) or (job, "error", (status, message)))."""
        import torch

        scoring = [j for j in jobs if j.score is not None]
        if scoring:
            jobs = [j for j in jobs if j.score is None]
            out = self._score(scoring)
            return out + (self._run(jobs) if jobs else [])

        def progress(i, ids):
            if jobs[i].wants_progress:
                self._emit(jobs[i], "progress", ids)
        hooks = StepHooks(on_progress=progress, is_cancelled=lambda i: jobs[i].cancelled)
        try:
            results: list[Result] = self.engine.generate([Request(j.prompt_ids, j.params) for j in jobs], hooks=hooks)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            if len(jobs) == 1:
                log.error("CUDA out of memory on a single row (prompt %d tokens)", len(jobs[0].prompt_ids))
                return [(jobs[0], "error", (503, "the GPU ran out of memory on this request alone; "
                                                 "try a shorter prompt or fewer max_tokens"))]
            half = len(jobs) // 2
            log.warning("CUDA out of memory on a batch of %d: retrying as %d + %d", len(jobs), half, len(jobs) - half)
            return self._run(jobs[:half]) + self._run(jobs[half:])
        except Exception as e:  # a bug: report to every row of this batch, keep serving
            log.exception("engine failure on a batch of %d", len(jobs))
            return [(j, "error", (500, f"internal error during generation: {type(e).__name__}: {e}")) for j in jobs]
        return [(j, "done", r) for j, r in zip(jobs, results)]

    def _score(self, jobs: list[Job]) -> list[tuple[Job, str, object]]:
        """Device thread: the scoring rows of a batch, their forwards shared (worker.engine.likelihood)."""
        import torch
        try:
            results = self.engine.score([j.score for j in jobs], cancelled=lambda i: jobs[i].cancelled)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            if len(jobs) == 1:
                return [(jobs[0], "error", (503, "the GPU ran out of memory scoring this prompt alone"))]
            half = len(jobs) // 2
            return self._score(jobs[:half]) + self._score(jobs[half:])
        except Exception as e:
            log.exception("scoring failure on %d rows", len(jobs))
            return [(j, "error", (500, f"internal error during scoring: {type(e).__name__}: {e}")) for j in jobs]
        return [(j, "done", r if r is not None else Result([], "cancelled", 0, [], len(j.prompt_ids)))
                for j, r in zip(jobs, results)]
