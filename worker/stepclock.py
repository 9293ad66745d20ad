"""How long this worker's denoising steps take, for /health ``step_seconds_max``: the balancer judges a worker that
holds work and has made no step for a few of its own step times stalled (balancer/pool.py, docs/balancer.md).

The device thread stamps ``engine.last_step_time`` after every denoising step (worker/engine/engine.py, ``_Batch.run``)
and between likelihood-scoring forwards. A sampler on the event loop reads the stamp every ``tick`` seconds; the time
from one stamp it saw to the next, while the batcher was busy all along, is one step (or a few, when several fit in
a tick or the loop was late: never less than one). Idle time never counts: a gap starts no earlier than the moment
the batcher was seen busy. The last ``keep`` gaps are kept (recent steps, not recent seconds: the figure survives an
idle spell); the longest is reported."""
from __future__ import annotations

import asyncio
import collections
import time


class StepClock:
    def __init__(self, engine, batcher, tick: float = 0.05, keep: int = 256):
        self.engine, self.batcher = engine, batcher
        self.tick = tick
        self.gaps: collections.deque[float] = collections.deque(maxlen=keep)
        self._stamp = engine.last_step_time      # the last stamp seen
        self._busy_since: float | None = None    # when the batcher was first seen busy, this busy spell
        self._task: asyncio.Task | None = None

    def sample(self, now: float | None = None) -> None:
        stamp = self.engine.last_step_time
        if not self.batcher.busy:
            self._busy_since = None
            self._stamp = stamp
            return
        if self._busy_since is None:
            self._busy_since = time.monotonic() if now is None else now
        if stamp != self._stamp:
            start = max(self._stamp, self._busy_since)
            if stamp > start:
                self.gaps.append(stamp - start)
            self._stamp = stamp

    @property
    def step_seconds_max(self) -> float | None:
        """The longest of the recent steps (seconds), None before the first one."""
        return round(max(self.gaps), 3) if self.gaps else None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="step-clock")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.tick)
