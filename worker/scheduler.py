"""The worker's row scheduler: its queue and its device thread (:class:`RowScheduler`, :class:`Job`). Requests arriving
within ``max_wait_time`` of the first request of a forming batch (or until ``batch_size`` are waiting) run together
in one engine call, whatever parameters they carry; rows of a batch formed upstream (the balancer's /worker/batch)
start without that wait; with continuous batching rows also join the running batch between denoising steps. The
engine runs on one dedicated thread, so the event loop stays free for /health, stats and streaming while a batch
runs. worker/serving.py turns requests into jobs and their events into OpenAI answers."""
from __future__ import annotations

import asyncio
import collections
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from worker.engine import Engine, GenerationParams, Request, Result, StepHooks
from worker.engine.algorithms import needs_rng
from worker.engine.likelihood import returned_memory
from worker.engine.params import Plan, held_tokens, with_seed

log = logging.getLogger("dllm.worker.scheduler")


# ---------------------------------------------------------------- the queue and the device thread
@dataclass(eq=False)      # a row is itself: identity, not field-by-field equality (queue and batch lookups)
class Job:
    """One row: a prompt with its parameters. Events go to ``sink(index, kind, payload)`` on the event loop:
    ("progress", final_ids) while decoding, then ("done", Result) or ("error", (status, message))."""
    prompt_ids: list[int]
    params: GenerationParams
    sink: object
    index: int = 0
    wants_progress: bool = True       # False: only the final result matters (non-streaming, no stop strings)
    wants_steps: bool = False         # ("step", (window, settled)) after every denoising step (stream_mode steps)
    cancelled: bool = False
    queued: bool = False              # waiting in the batcher (not yet in a batch)
    enqueued_at: float = field(default_factory=time.monotonic)
    start_by: float = 0.0             # the scheduler waits for more rows until then (at most)
    score: object = None              # a likelihood.ScoreRequest: a scoring row (params unused); "done" gives a
                                      # ScoreResult
    cost: int = 0                     # nominal token-forwards (Serving._check_cost); above long_row_cost: "long"
    plan: Plan | None = None          # the engine's plan of ``params`` when the caller made it (else the engine does)
    prefix_key: object = ...          # the keys of its reusable prompt blocks in the engine's prefix cache (None:
                                      # none; ...: not looked at yet): worker/engine/prefix_cache.py Admission
    prefix_waited: bool = False       # it waited a round for a row computing that block (once at most)


def _in_turns(pending, running=()) -> list[Job] | collections.deque:
    """The queued rows in the order they are taken: by how many rows of their request are ahead of them (running,
    or queued before them), fewest first, then in the order they came; so a request of many rows shares the free
    places in turn with every request queued behind it instead of taking them all first (a review: one completion
    of 1,024 short prompts held a 4-token request that came 2 s later for 48 s). A request's rows are those with its
    sink (one Run's ``on_row``)."""
    ahead: dict = {}
    for j in running:
        ahead[j.sink] = ahead.get(j.sink, 0) + 1
    ranks = []
    for j in pending:
        r = ahead.get(j.sink, 0)
        ahead[j.sink] = r + 1
        ranks.append(r)
    if all(a <= b for a, b in zip(ranks, ranks[1:])):     # already in that order (one request, one row each, ...)
        return pending
    return [j for _, _, j in sorted(zip(ranks, range(len(ranks)), pending), key=lambda t: (t[0], t[1]))]


def canvas_tokens(job: Job, engine) -> int:
    """A row's tokens in a forward (prompt + max_tokens in whole blocks by its algorithm's rule, twice with
    cfg_scale): what it holds of the device's memory (``params.held_tokens``)."""
    p = job.params
    if p is None:
        return len(job.prompt_ids)
    return held_tokens(engine.positions(p.algorithm, len(job.prompt_ids), p.gen_length, max(1, p.block_length)), p)


class RowScheduler:
    """The worker's queue and its device thread. With ``continuous`` (the default) rows also join the running batch
    between denoising steps (worker/engine/engine.py ``Feed``), in queue order, while they fit ``batch_size`` rows
    and ``max_batch_tokens`` canvas tokens; a row whose algorithm is not running starts its own group beside the
    others (the groups take their steps in turn). Likelihood-scoring rows join the same way and take their turns
    too, one forward (or mini-batch of random draws) a turn (worker/engine/engine.py ``_ScoreGroup``). On
    tensor-parallel ranks they run in batches of their own: one queued lets generation rows join ahead of it for at
    most ``switch_wait`` seconds, then the batch drains and it goes next; with static batching (``continuous``
    off) a batch's scoring rows run first, then its generation rows.
    Finished rows leave the batch and are answered at once.

    Fair share: rows whose nominal cost exceeds ``long_row_cost`` token-forwards hold at most ``long_row_share`` of
    the batch's ``batch_size`` rows (at least one); past that a long row waits in the queue while shorter rows behind
    it take the free places, so a short request is never held behind long ones (long rows keep their order)."""

    def __init__(self, engine: Engine, *, batch_size: int = 8, max_wait_time: float = 0.05, max_queue: int = 1024,
                 loop: asyncio.AbstractEventLoop | None = None, continuous: bool = True, max_batch_tokens: int = 0,
                 switch_wait: float = 1.0, long_row_cost: int = 1 << 20, long_row_share: float = 0.5):
        self.engine = engine
        self.batch_size = batch_size
        self.max_wait_time = max_wait_time
        self.max_queue = max_queue
        self.continuous = continuous
        self.max_batch_tokens = max_batch_tokens       # 0: no limit
        self.switch_wait = switch_wait                 # tensor-parallel: seconds a scoring row lets rows join ahead
        self.long_row_cost = long_row_cost             # 0: every row alike
        self.long_slots = max(1, int(batch_size * long_row_share))
        self.pending: collections.deque[Job] = collections.deque()
        self._lock = threading.Lock()     # ``pending`` is also taken from by the device thread (joining rows)
        self.running: list[Job] = []
        self._in_call = False             # a batch's engine call has not returned yet (its rows may all be answered)
        self.rows_joined = 0              # rows that joined a running batch
        self.rows_retired = 0             # rows that finished (every row, joined or not)
        self._per_second: collections.deque[list] = collections.deque()   # [second, joined, retired], last 60 s
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

    def submit(self, job: Job, wait: bool = True) -> None:
        """Queue a row (the caller checked that the request's rows fit ``max_queue``: Serving.submit answers 429
        otherwise). ``wait=False``: the row arrived as part of a batch formed upstream (the balancer's), so waiting
        ``max_wait_time`` for company would only add latency."""
        p = job.params
        if p is not None and p.seed is None and needs_rng(p):
            # A fixed seed per row makes a retried batch (after CUDA OOM) give the same tokens it already streamed.
            job.params = replace(p, seed=random.getrandbits(63))
            if job.plan is not None:
                job.plan = with_seed(job.plan, job.params.seed)
        job.enqueued_at = time.monotonic()
        job.start_by = job.enqueued_at + (self.max_wait_time if wait else 0.0)
        job.queued = True
        with self._lock:
            self.pending.append(job)
        self._wake.set()

    def cancel(self, job: Job) -> None:
        """Drop a row: one still queued leaves the queue at once and gets its terminal event (never computed, nfe
        0) on the next turn of the event loop, whatever the batch running does meanwhile; a running one stops at its
        next denoising step."""
        if job.cancelled:
            return
        job.cancelled = True
        if not job.queued:
            return
        with self._lock:                  # (the device thread may be taking it into the running batch right now)
            try:
                self.pending.remove(job)
            except ValueError:            # taken: it runs, and stops at its next step
                return
        job.queued = False
        self.dropped_before_start += 1
        self._loop.call_soon(job.sink, job.index, "done", Result([], "cancelled", 0, [], len(job.prompt_ids)))

    @property
    def queue_depth(self) -> int:
        return len(self.pending)

    def rates(self, window: int = 60) -> dict:
        """Rows running now, and rows joined / retired per second over the last ``window`` seconds (up to 60)."""
        now = int(time.monotonic())
        recent = [b for b in self._per_second if now - b[0] < window]
        return {"rows_running": len(self.running),
                "rows_joined_per_s": round(sum(b[1] for b in recent) / window, 3),
                "rows_retired_per_s": round(sum(b[2] for b in recent) / window, 3),
                "rows_joined": self.rows_joined, "rows_retired": self.rows_retired}

    def _count(self, which: int) -> None:
        """One row joined (1) or retired (2), in this second's bucket (60 buckets kept: O(1) per row)."""
        now = int(time.monotonic())
        buckets = self._per_second
        if not buckets or buckets[-1][0] != now:
            buckets.append([now, 0, 0])
            while now - buckets[0][0] >= 60:
                buckets.popleft()
        buckets[-1][which] += 1

    @property
    def busy(self) -> bool:
        return bool(self.running)

    async def idle(self) -> None:
        """Wait until nothing is queued or running, and the last batch's call has returned and been counted."""
        while self.pending or self.running or self._in_call:
            await asyncio.sleep(0.02)

    # ------------------------------------------------------------ scheduling
    async def _schedule(self) -> None:
        while True:
            while not self.pending:
                self._wake.clear()
                await self._wake.wait()
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
                if not self.pending:        # every row waiting was cancelled
                    break
            with self._lock:
                batch = self._take(0, 0, 0, first=True)
            if not batch:
                continue
            for j in batch:
                j.queued = False
            self.running = list(batch)
            self._in_call = True
            t = time.monotonic()
            try:
                outcome = await asyncio.get_running_loop().run_in_executor(self._executor, self._run, batch)
            except Exception as e:   # never lose the scheduler or a row
                log.exception("batch failed")
                # every row not answered yet, the rows that joined too (answers already given are not repeated:
                # the device thread's answers, posted before this exception, have run; a review)
                outcome = [(j, "error", (500, f"internal error: {type(e).__name__}")) for j in self.running]
            finally:
                self.running = []
                self._in_call = False       # (the statistics below are counted before any other task runs)
            self.batches_processed += 1
            self.rows_processed += len(batch)
            self.histogram[len(batch)] += 1
            if self.on_batch:
                self.on_batch(len(batch), time.monotonic() - t)
            self._answer(outcome)                   # after the statistics, so a client sees them counted

    def _answer(self, outcome: list[tuple[Job, str, object]]) -> None:       # on the event loop
        for job, kind, payload in outcome:
            self._retired(job)
            _call(job.sink, job.index, kind, payload)

    @property
    def scores_beside(self) -> bool:
        """Scoring rows take turns with generation rows in the running batch (continuous batching on one rank);
        otherwise they run in batches of their own (tensor-parallel ranks must take the same forwards)."""
        return self.continuous and getattr(self.engine, "ranks", None) is None

    def is_long(self, job: Job) -> bool:
        return bool(self.long_row_cost) and job.score is None and job.cost > self.long_row_cost

    def _take(self, rows: int, tokens: int, long: int, first: bool = False, busy=()) -> list[Job]:
        """Under the lock: queued rows, in turns (:func:`_in_turns`), that fit ``batch_size`` rows and ``max_batch_tokens`` beside
        ``rows`` / ``tokens`` running (``long`` of them long), removed from the queue. A long row past its share
        is passed over (shorter rows overtake it); a row past the token budget stops the taking (in order), except a
        long row while another long row runs (passed over, as the rows behind it would wait for that one's end).
        Scoring rows are taken alike where they are scored beside generation (``scores_beside``), except those of
        a kind whose group runs (``busy``: they wait for its end, holding no place meanwhile); otherwise only by
        a new batch (``first``: they run first, apart, ``_run``), and joining rows pass them for ``switch_wait``
        seconds, then the batch takes no more and drains."""
        taken, now = [], time.monotonic()
        share = None
        if self.continuous and getattr(self.engine, "prefix_cache", None) is not None:
            from worker.engine.prefix_cache import Admission
            share = Admission(self.engine)
        if rows >= self.batch_size or not self.pending:
            return []                     # (full: the queue is not even ordered, a step's cost stays O(1))
        for j in _in_turns(self.pending, list(self.running)):
            if rows + len(taken) >= self.batch_size:
                break
            if j.cancelled:
                continue
            if share is not None and j.score is None:
                if j.prefix_key is ...:
                    j.prefix_key = self._prefix_key(share, j)
                if share.waits(j.prefix_key, j.prefix_waited):
                    j.prefix_waited = True
                    continue   # a row of this round computes its first prompt block: it joins next round, from the cache
            if j.score is not None and not first:
                if not self.scores_beside:
                    if now - j.enqueued_at > self.switch_wait:
                        break
                    continue
                if busy and self.engine.score_group(j.score) in busy:
                    continue          # its kind's group runs: it starts the next one (with those queued beside it)
            long_row = self.is_long(j)
            if long_row and long >= self.long_slots:
                continue
            if self.max_batch_tokens:
                need = canvas_tokens(j, self.engine)
                if (taken or rows) and tokens + need > self.max_batch_tokens:
                    if long_row and long:
                        # it waits for room a long row running holds: the rows behind it go on meanwhile (they
                        # waited for the long row's end: a review); once no long row runs it stops the taking again
                        continue
                    break
                tokens += need
            if long_row:
                long += 1
            taken.append(j)
            if share is not None and j.score is None:
                share.take(j.prefix_key)
        if taken:
            ids = {id(j) for j in taken}
            self.pending = collections.deque(j for j in self.pending if id(j) not in ids)
        return taken

    def _prefix_key(self, share, job: Job):
        if job.plan is None:
            try:
                job.plan = self.engine.plan(job.prompt_ids, job.params)     # the engine's own, kept for its run
            except Exception:       # noqa: BLE001  (an invalid row: the engine reports it when it runs)
                return None
        return share.key(job.prompt_ids, job.plan)

    # ------------------------------------------------------------ device thread
    def _emit(self, job: Job, kind: str, payload) -> None:
        self._loop.call_soon_threadsafe(job.sink, job.index, kind, payload)

    def _run(self, jobs: list[Job], join: bool = True) -> list[tuple[Job, str, object]]:
        """Device thread: run one batch; progress goes to the loop as it happens, the terminal events are
        returned ((job, "done", Result) or (job, "error", (status, message))). ``join`` False: no row joins it
        (the halves of a batch retried after running out of memory: each must end, not take the queue's rows; its
        rows are still answered as they finish)."""
        import torch

        scoring = [j for j in jobs if j.score is not None]
        if scoring and not self.scores_beside:
            jobs = [j for j in jobs if j.score is None]
            out = self._score(scoring)
            if not jobs:
                return out
            # answered now: the batch's generation rows run on for as long as rows keep joining them
            self._loop.call_soon_threadsafe(self._answer, out)
            return self._run(jobs)

        if scoring:               # scored beside the generation rows (the feed's index: generation rows first)
            jobs = [j for j in jobs if j.score is None] + scoring
        feed = _Feed(self, jobs, joins=join) if self.continuous else None
        rows = feed.jobs if feed is not None else jobs        # grows as rows join
        generating = [j for j in jobs if j.score is None]
        scored = {"scoring": [(len(generating) + k, j.score) for k, j in enumerate(scoring)]} if scoring else {}

        def progress(i, ids):
            if rows[i].wants_progress:
                if feed is not None:      # in order with the batch's other events
                    feed.post(rows[i].sink, rows[i].index, "progress", ids)
                else:
                    self._emit(rows[i], "progress", ids)
        def step(i, window, settled):
            if feed is not None:
                feed.post(rows[i].sink, rows[i].index, "step", (window, settled))
            else:
                self._emit(rows[i], "step", (window, settled))
        hooks = StepHooks(on_progress=progress, is_cancelled=lambda i: rows[i].cancelled, on_step=step,
                          steps_for=lambda i: rows[i].wants_steps)
        try:
            results: list[Result] = self.engine.generate(
                [Request(j.prompt_ids, j.params, j.plan) for j in generating], hooks=hooks,
                **({"feed": feed} if feed is not None else {}), **scored)
        except torch.cuda.OutOfMemoryError:
            self._free_prefix_cache()
            torch.cuda.empty_cache()
            left = feed.unfinished() if feed is not None else jobs     # rows already answered keep their answer
            if len(left) == 1:
                log.error("CUDA out of memory on a single row (prompt %d tokens)", len(left[0].prompt_ids))
                if left[0].score is not None:
                    return [(left[0], "error", (503, "the GPU ran out of memory scoring this prompt alone"))]
                return [(left[0], "error", (503, "the GPU ran out of memory on this request alone; "
                                                 "try a shorter prompt or fewer max_tokens"))]
            half = len(left) // 2
            log.warning("CUDA out of memory on a batch of %d: retrying as %d + %d", len(left), half, len(left) - half)
            # (halves that take no rows: a first half that took rows from the queue would run on under steady load
            # while the second, taken from the queue already, waited)
            return self._run(left[:half], join=False) + self._run(left[half:], join=False) if left else []
        except Exception as e:  # a bug: report to every row of this batch not yet answered, keep serving
            log.exception("engine failure on a batch of %d", len(rows))
            left = feed.unfinished() if feed is not None else jobs
            return [(j, "error", (500, f"internal error during generation: {type(e).__name__}: {e}")) for j in left]
        if feed is not None:      # every row was answered as it finished; one that was not is a bug, never silent
            left = feed.unfinished()
            if left:
                log.error("%d joined rows were not answered by the engine", len(left))
            return [(j, "error", (500, "internal error: the engine ended without answering this row"))
                    for j in left]
        return [(j, "done", r) for j, r in zip(jobs, results)]

    def _free_prefix_cache(self) -> None:
        """Device thread, the GPU out of memory: the prefix cache's blocks give their memory back before the rows are
        retried (it fills again from later prompts). Not with tensor parallelism: every rank must keep the same
        blocks, and a rank's out-of-memory error is its own."""
        pc = getattr(self.engine, "prefix_cache", None)
        if pc is not None and pc.bytes and getattr(self.engine, "ranks", None) is None:
            log.warning("out of memory: the prefix cache's %.2f GiB are freed", pc.bytes / 2**30)
            pc.clear()

    def _joined(self, job: Job) -> None:        # on the event loop
        self.running.append(job)
        self.rows_joined += 1
        self.rows_processed += 1
        self._count(1)

    def _retired(self, job: Job) -> None:       # on the event loop
        if job in self.running:
            self.running.remove(job)
        self.rows_retired += 1
        self._count(2)

    def _score(self, jobs: list[Job]) -> list[tuple[Job, str, object]]:
        """Device thread: the scoring rows of a batch, their forwards shared (worker.engine.likelihood)."""
        import torch
        try:
            with returned_memory():
                results = self.engine.score([j.score for j in jobs], cancelled=lambda i: jobs[i].cancelled)
        except torch.cuda.OutOfMemoryError:
            self._free_prefix_cache()
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


def _call(fn, *args) -> None:
    """One row's event on the event loop: a handler that fails (a bug) is logged and costs only its own row, not
    the other rows' events of the same flush, nor the scheduler's loop."""
    try:
        fn(*args)
    except Exception:       # noqa: BLE001
        log.exception("an event handler failed (%s)", getattr(fn, "__qualname__", fn))


class _Feed:
    """The engine's Feed for one batch (device thread): rows join from the head of the queue, finished rows are
    answered at once. Index i names ``jobs[i]``: the batch's rows first (0, 1, ...), then the joined ones, numbered
    on. Only unanswered rows are kept: under steady load a batch never ends, and a row it kept after answering would
    keep its request's objects alive for as long as the batch runs."""

    def __init__(self, batcher: RowScheduler, jobs: list[Job], joins: bool = True):
        self.b = batcher
        self.joins = joins                 # False: rows finish and leave, none joins (an out-of-memory retry)
        self.jobs: dict[int, Job] = dict(enumerate(jobs))
        self.next_index = len(jobs)
        self.long = sum(1 for j in jobs if batcher.is_long(j))     # long rows running (fair share)
        self._events: list = []            # (function, args) for the event loop, in order
        self._posted = False               # a flush is scheduled
        self._lock = threading.Lock()

    def post(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the event loop, in order with the batch's other events; one wake-up of the loop
        carries every event posted until it runs (not one per row)."""
        with self._lock:
            self._events.append((fn, args))
            if self._posted:
                return
            self._posted = True
        self.b._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            events, self._events, self._posted = self._events, [], False
        for fn, args in events:
            _call(fn, *args)

    def admit(self, rows: int, tokens: int, busy=()) -> list[tuple[int, Request]]:
        """Queued rows, in turns, that fit ``batch_size`` rows and ``max_batch_tokens`` with the ``rows`` /
        ``tokens`` running: (index, Request), or (index, ScoreRequest) for a scoring row (``_take``)."""
        b = self.b
        out = []
        if not self.joins:
            return out
        with b._lock:
            taken = b._take(rows, tokens, self.long, busy=busy)
            for j in taken:
                self.long += b.is_long(j)
                j.queued = False
                out.append((self.next_index, j.score if j.score is not None else
                            Request(j.prompt_ids, j.params, j.plan)))
                self.jobs[self.next_index] = j
                self.next_index += 1
        for j in taken:
            self.post(b._joined, j)
        return out

    def done(self, index: int, result) -> None:
        j = self.jobs.pop(index)
        if result is None:        # a scoring row whose client went (worker/engine/engine.py _ScoreGroup)
            result = Result([], "cancelled", 0, [], len(j.prompt_ids))
        self.long -= self.b.is_long(j)
        self.post(self._answer, j, result)

    def _answer(self, j: Job, result: Result) -> None:      # on the event loop
        self.b._retired(j)
        j.sink(j.index, "done", result)

    def fail(self, index: int, message: str) -> None:
        """A row whose algorithm group raised (a bug): a 500 for it, the batch's other rows go on."""
        j = self.jobs.pop(index)
        self.long -= self.b.is_long(j)
        self.post(self._fail, j, message)

    def _fail(self, j: Job, message: str) -> None:          # on the event loop
        self.b._retired(j)
        j.sink(j.index, "error", (500, message))

    def unfinished(self) -> list[Job]:
        return list(self.jobs.values())

