"""The worker's batching queue and its device thread.

Requests arriving within ``max_wait_time`` of the first request of a forming batch (or until ``batch_size`` are
waiting) run together in one engine call, whatever parameters they carry. The engine runs on one dedicated thread,
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


class QueueFull(Exception):
    pass


@dataclass
class Job:
    """One row: a prompt with its parameters. Events go to ``sink(index, kind, payload)`` on the event loop:
    ("progress", final_ids) while decoding, then ("done", Result) or ("error", (status, message))."""
    prompt_ids: list[int]
    params: GenerationParams
    sink: object
    index: int = 0
    cancelled: bool = False
    enqueued_at: float = field(default_factory=time.monotonic)


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

    def submit(self, job: Job, force: bool = False) -> None:
        """Queue a row; raises QueueFull beyond ``max_queue`` waiting rows unless ``force`` (the caller checked
        room for all rows of a request at once)."""
        if not force and self.queue_depth >= self.max_queue:
            raise QueueFull(f"the worker queue is full ({self.max_queue} requests waiting)")
        p = job.params
        if p.seed is None and (p.temperature > 0 or p.remasking == "random"):
            # A fixed seed per row makes a retried batch (after CUDA OOM) give the same tokens it already streamed.
            job.params = replace(p, seed=random.getrandbits(63))
        job.enqueued_at = time.monotonic()
        self.pending.append(job)
        self._wake.set()

    @property
    def queue_depth(self) -> int:
        return sum(1 for j in self.pending if not j.cancelled)

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
            deadline = self.pending[0].enqueued_at + self.max_wait_time
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
            self.running = batch
            t = time.monotonic()
            try:
                await asyncio.get_running_loop().run_in_executor(self._executor, self._run, batch)
            except Exception:   # never lose the scheduler; _run already reported to every job
                log.exception("batch failed")
            finally:
                self.running = []
            self.batches_processed += 1
            self.rows_processed += len(batch)
            self.histogram[len(batch)] += 1
            if self.on_batch:
                self.on_batch(len(batch), time.monotonic() - t)

    def _drop_cancelled(self) -> None:
        """Drop rows cancelled while waiting; each still gets its terminal event (never computed, nfe 0)."""
        if any(j.cancelled for j in self.pending):
            keep = []
            for j in self.pending:
                if j.cancelled:
                    self.dropped_before_start += 1
                    j.sink(j.index, "done", Result([], "cancelled", 0, [], len(j.prompt_ids)))
                else:
                    keep.append(j)
            self.pending = collections.deque(keep)

    # ------------------------------------------------------------ device thread
    def _emit(self, job: Job, kind: str, payload) -> None:
        self._loop.call_soon_threadsafe(job.sink, job.index, kind, payload)

    def _run(self, jobs: list[Job]) -> None:
        import torch
        hooks = StepHooks(on_progress=lambda i, ids: self._emit(jobs[i], "progress", ids),
                          is_cancelled=lambda i: jobs[i].cancelled)
        try:
            results: list[Result] = self.engine.generate([Request(j.prompt_ids, j.params) for j in jobs], hooks=hooks)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            if len(jobs) == 1:
                log.error("CUDA out of memory on a single row (prompt %d tokens)", len(jobs[0].prompt_ids))
                self._emit(jobs[0], "error", (503, "the GPU ran out of memory on this request alone; "
                                                  "try a shorter prompt or fewer max_tokens"))
                return
            half = len(jobs) // 2
            log.warning("CUDA out of memory on a batch of %d: retrying as %d + %d", len(jobs), half, len(jobs) - half)
            self._run(jobs[:half])
            self._run(jobs[half:])
            return
        except Exception as e:  # a bug: report to every row of this batch, keep serving
            log.exception("engine failure on a batch of %d", len(jobs))
            for j in jobs:
                self._emit(j, "error", (500, f"internal error during generation: {type(e).__name__}: {e}"))
            return
        for j, r in zip(jobs, results):
            self._emit(j, "done", r)
