"""New weights without a restart: ``POST /v1/load_weights`` on the balancer (docs/operations.md, "Weight updates").

An update names a checkpoint directory (or a DCP checkpoint and its base model, converted once here:
common/dcp_cache.py) and a mode:

- ``rolling`` (the default): one worker at a time leaves the routing (``Worker.updating``), its batches in flight
  finish, it loads the weights in place (``POST /worker/load_weights``: the worker itself also finishes every queued
  row first) and rejoins; the others serve meanwhile, so capacity never drops below N-1 workers.
- ``pause``: the queue stops (new requests wait in it), every batch in flight finishes on the old weights, every
  worker loads at once, the queue resumes.

A load the first worker refuses (a bad path, another family, config, shapes or tokenizer) changes nothing; a worker
that fails later has its predecessors put back on their old weights, so a failed update leaves the fleet as it was;
one that cannot be put back (its old checkpoint deleted since, a load past the wait) takes no batch until it holds
them again (the sync keeps trying), and the failure says so.
Only one update runs at a time. Workers report their weights (``model_version``: the checkpoint's path and content
hash) on /health and with every answer; once an update has succeeded, a worker that comes back on other weights (a
restarted process starts from its launch checkpoint) is brought to the update's weights before it gets requests; one
that cannot load them is tried again after --weight-sync-retry seconds, doubled for each failure in a row (up to
--weight-sync-retry-max), and listed under ``weights.sync_failures`` on /stats meanwhile.

A request may require weights (``model_version``: a hash): it goes only to workers that hold them, waits while an
update is bringing them, and gets 409 when no worker will (docs/api.md)."""
from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from balancer.pool import Worker, WorkerPool
from common.protocol import APIError

log = logging.getLogger("dllm.balancer.weights")

MODES = ("rolling", "pause")


def version_of(w: Worker) -> dict | None:
    v = w.last_health.get("model_version")
    return v if isinstance(v, dict) else None


def hash_of(w: Worker) -> str | None:
    v = version_of(w)
    return v.get("hash") if v else None


class WeightUpdates:
    def __init__(self, pool: WorkerPool, batcher, session_factory, headers: dict, load_timeout: float = 600.0,
                 drain_timeout: float = 1800.0, sync_retry: tuple[float, float] = (10.0, 600.0)):
        self.pool, self.batcher, self._session, self.headers = pool, batcher, session_factory, headers
        self.load_timeout = load_timeout      # seconds one worker may take to load, once drained (--weight-load-timeout)
        self.drain_timeout = drain_timeout    # a put-back's and a sync's wait for batches (--request-timeout)
        self.target: dict | None = None      # the weights of the last update that succeeded
        self.current: dict | None = None     # the update running: {"path", "mode", "started", "done": [...]}
        self.toward: str | None = None       # the hash a running update brings (known once its first load succeeds)
        self.last: dict | None = None        # how the last update ended
        self._lock = asyncio.Lock()
        self.updates: set = set()            # updates running on (balancer/app.py load_weights: shielded tasks)
        self._sync_task: asyncio.Task | None = None
        self.sync_retry, self.sync_retry_max = sync_retry       # --weight-sync-retry, --weight-sync-retry-max
        # the worker processes ((index, instance id): a process id alone may be unknown) the sync could not bring
        # onto the target: {"target": its hash, "failures" in a row, "next" try (monotonic), "error"}
        self._sync_failed: dict[tuple, dict] = {}
        # the worker processes a failed update could not put back on their previous weights (a checkpoint deleted
        # since, a load that outlasted the balancer's wait): the version each must hold again before it takes a
        # batch (the sync tries, as for the target); a later update that succeeds clears them
        self._stranded: dict[tuple, dict] = {}
        self.syncing: dict | None = None     # the sync's load running: {"worker", "path", "started"}

    # ------------------------------------------------------------ what the batcher asks
    def routable(self, w: Worker) -> bool:
        """May ``w`` take batches now: not while it loads, and, once an update has succeeded, only on that update's
        weights (or those of the update running), so no answer comes from weights an update has replaced."""
        if w.updating or self._astray(w):
            return False
        if self.target is None:
            return True
        h = hash_of(w)
        return h is None or h == self.target["hash"] or h == self.toward

    def _stranded_on(self, w: Worker) -> dict | None:
        """The weights a failed update could not put ``w`` back on, while they are what it must hold: with no
        update's target yet, or the target itself (a worker stranded off the target needs the target: a second
        review found the sync chasing weights that would not have made it routable)."""
        if not self._stranded:
            return None                  # (the batcher asks for every dispatch: none is the usual case)
        want = self._stranded.get(_process(w))
        if want is None or (self.target is not None and want["hash"] != self.target["hash"]):
            return None
        return want

    def _astray(self, w: Worker) -> bool:
        """A failed update left ``w`` on other weights (it could not be put back): it takes nothing until it is."""
        want = self._stranded_on(w)
        return want is not None and hash_of(w) != want["hash"]

    def _wanted(self, w: Worker) -> dict | None:
        """The weights ``w`` must hold to take batches: those it had before a failed update that could not put it
        back, else the last update's (None: any)."""
        return self._stranded_on(w) or self.target

    def stranded_fleet(self) -> str | None:
        """Why no healthy worker can take a batch for good, if so: every one is stranded (no update or sync runs
        to change it). Admission answers 503 with it and /health says so (a one-worker fleet waited its requests'
        --request-timeout and /health said "ok": a second review)."""
        if not self._stranded:
            return None                  # (asked at every admission: none is the usual case)
        healthy = [w for w in self.pool.workers if w.healthy]
        if not healthy or self._lock.locked() or not all(self._astray(w) for w in healthy):
            return None
        return ("no worker can take requests: a failed weight update left workers "
                f"{[w.index for w in healthy]} on other weights than they must hold, and they could not be put back "
                f"(/stats weights.stranded; the sync keeps trying; a weight update that succeeds ends it)")

    def allowed_versions(self) -> list[str] | None:
        """The hashes a worker must hold to answer rows that require no version (None: any), sent with each batch so
        a worker whose weights changed behind the balancer's back refuses it (409) instead of answering."""
        if self.target is None:
            return None
        return [self.target["hash"]] + ([self.toward] if self.toward else [])

    def servable(self, wanted: str) -> bool:
        """Some healthy worker holds these weights and may take batches (:meth:`routable`), or the running update is
        bringing them. Once an update has succeeded, a worker on other weights takes none: a request pinned to them
        (a worker that came back on its launch weights and could not be brought to the update's) waited for its
        --request-timeout instead of its 409."""
        if wanted == self.toward:
            return True
        if self.target is not None and wanted != self.target["hash"]:
            return False
        return any(hash_of(w) == wanted for w in self.pool.workers if w.healthy and not self._astray(w))

    def snapshot(self) -> dict:
        versions: dict[str, dict] = {}
        for w in self.pool.workers:
            v = version_of(w)
            if v:
                versions.setdefault(v["hash"], {**v, "workers": []})["workers"].append(w.index)
        now = time.monotonic()
        failed = [{"worker": w.index, "failures": f["failures"], "error": f["error"],
                   "next_try_in": round(max(0.0, f["next"] - now), 1)}
                  for w in self.pool.workers if (f := self._sync_failed.get(_process(w))) is not None]
        stranded = [{"worker": w.index, "must_hold": want} for w in self.pool.workers
                     if (want := self._stranded.get(_process(w))) is not None]
        return {"target": self.target, "versions": list(versions.values()),
                "update": self.current, "last_update": self.last, "sync_failures": failed, "sync": self.syncing,
                "stranded": stranded}

    # ------------------------------------------------------------ the update
    async def load(self, path: str, mode: str, timeout: float) -> dict:
        if self._lock.locked():
            if self.current is None and self.syncing is not None:
                raise APIError(409, f"worker {self.syncing['worker']} is being brought onto the weights it must hold "
                                    f"({self.syncing['path']}: the sync, /stats weights.sync); try again when it is "
                                    f"done", code="update_in_progress")
            raise APIError(409, f"a weight update is already running ({self.current})", code="update_in_progress")
        async with self._lock:
            workers = [w for w in self.pool.workers if w.healthy]
            if not workers:
                raise APIError(503, "no healthy worker to load the weights")
            t0 = time.monotonic()
            self.current = {"path": path, "mode": mode, "started": time.time(), "done": []}
            log.info("weight update (%s) to %s over %d workers", mode, path, len(workers))
            try:
                # checked by a worker before anything stops (a checkpoint the workers would refuse stops no worker
                # and pauses no queue), and what it brings is known at once: requests pinned to it wait for it
                self.toward = (await self._load_one(workers[0], path, timeout, check_only=True))["hash"]
                self.batcher.versions_changed()
                if mode == "pause":
                    version = await self._pause(workers, path, timeout)
                else:
                    version = await self._rolling(workers, path, timeout)
                # the target before the queue hears the update is over: requests pinned to the incoming weights
                # were judged against the old target then, and got 409 (a review)
                self.target = version
                self._stranded.clear()
            except APIError as e:
                self.last = {"path": path, "mode": mode, "ok": False, "error": e.message, "ended": time.time()}
                log.warning("weight update to %s failed: %s", path, e.message)
                raise
            finally:
                self.current, self.toward = None, None
                self.batcher.versions_changed()
            self.last = {"path": path, "mode": mode, "ok": True, "model_version": version, "ended": time.time(),
                         "seconds": round(time.monotonic() - t0, 3)}
            log.info("weight update done: %s (%s) in %.1f s", version["hash"], version["path"],
                     time.monotonic() - t0)
            return {"model_version": version, "mode": mode, "seconds": self.last["seconds"],
                    "workers": [{"index": w.index, "url": w.url, "model_version": version_of(w)}
                                for w in self.pool.workers]}

    async def _rolling(self, workers: list[Worker], path: str, timeout: float) -> dict:
        done: list[tuple[Worker, dict | None]] = []
        version = None
        for w in workers:
            if not w.healthy:               # it went away meanwhile: the sync brings it when it is back
                continue
            old = version_of(w)
            w.updating = True
            self.batcher.versions_changed()
            try:
                await self._drained([w], timeout)
                version = await self._load_one(w, path, timeout)
            except APIError as e:
                # a worker that did not answer in time may still be loading them (a client leaving does not stop
                # a worker's load): it goes back too, once it has settled
                moved = done + ([(w, old)] if e.status == 502 else [])
                stuck = await self._put_back(moved)
                raise APIError(_during_load(e.status), self._failure(w, e.message, moved, stuck), param=e.param,
                               code=e.code) from None
            finally:
                w.updating = False
            done.append((w, old))
            self.current["done"].append(w.index)
            self.toward = version["hash"]
            self.batcher.versions_changed()
        if version is None:
            raise APIError(503, "no healthy worker to load the weights")
        return version

    async def _pause(self, workers: list[Worker], path: str, timeout: float) -> dict:
        self.batcher.paused = True
        try:
            await self._drained(workers, timeout)
            olds = [version_of(w) for w in workers]
            for w in workers:
                w.updating = True             # (/worker-status says so while they load)
            try:
                results = await asyncio.gather(*(self._load_one(w, path, timeout) for w in workers),
                                               return_exceptions=True)
            finally:
                for w in workers:
                    w.updating = False
            failed = [(w, r) for w, r in zip(workers, results) if isinstance(r, BaseException)]
            if failed:
                ok = [(w, old) for w, old, r in zip(workers, olds, results) if not isinstance(r, BaseException)]
                unanswered = [(w, old) for w, old, r in zip(workers, olds, results)
                              if isinstance(r, APIError) and r.status == 502]      # (maybe loading on: back too)
                stuck = await self._put_back(ok + unanswered)
                w, e = failed[0]
                msg = e.message if isinstance(e, APIError) else f"{type(e).__name__}: {e}"
                raise APIError(_during_load(getattr(e, "status", 502)), self._failure(w, msg, ok + unanswered, stuck),
                               param=getattr(e, "param", None), code=getattr(e, "code", None))
            self.current["done"] = [w.index for w in workers]
            return results[0]
        finally:
            self.batcher.paused = False
            self.batcher.versions_changed()

    async def _drained(self, workers: list[Worker], timeout: float) -> None:
        """Wait until none of ``workers`` has a batch of ours in flight (they get no new one meanwhile)."""
        deadline = time.monotonic() + timeout
        while any(w.inflight_batches for w in workers):
            if time.monotonic() > deadline:
                raise APIError(504, f"batches were still running on the workers after {timeout:g} s: the weights "
                                    f"were not changed", type="timeout")
            await asyncio.sleep(0.01)

    async def _load_one(self, w: Worker, path: str, timeout: float, check_only: bool = False) -> dict:
        """``w`` loads the weights at ``path`` (its rows finishing first, up to ``timeout``); its new model_version.
        ``check_only``: it only checks that they can replace its own and says which they are (nothing stops)."""
        body = {"model_path": path, "timeout": timeout, **({"check_only": True} if check_only else {})}
        try:
            async with self._session().post(w.url + "/worker/load_weights", json=body, headers=self.headers,
                                            timeout=aiohttp.ClientTimeout(total=timeout + self.load_timeout)) as r:
                data = await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            why = str(e) or f"no answer within {timeout + self.load_timeout:g} s (timeout + --weight-load-timeout)"
            raise APIError(502, f"worker {w.index} ({w.url}) did not answer the load: {type(e).__name__}: {why}")
        if r.status != 200:
            err = data.get("error", {}) if isinstance(data, dict) else {}
            raise APIError(r.status if r.status in (400, 409, 503, 504) else 502,
                           f"worker {w.index} ({w.url}): {err.get('message', data)}", param=err.get("param"),
                           code=err.get("code"))
        version = data["model_version"]
        if not check_only:
            w.last_health = {**w.last_health, "model_version": version}
        return version

    async def _put_back(self, done: list[tuple[Worker, dict | None]]) -> list[tuple[Worker, str]]:
        """A failed update: the workers it already moved go back to their previous weights. Those that cannot (their
        previous checkpoint deleted since, a load still running past the wait) take no batch until they hold them
        again (``_stranded``: the sync keeps trying, as for an update's target): the workers and why."""
        stuck = []
        for w, old in done:
            process = _process(w)            # (a process restarted meanwhile starts from its launch weights)
            # a worker a failed update had already stranded goes back to what it must hold, not to the weights it
            # was stranded on (a second failure recorded those, and the sync then made it routable on them)
            old = self._stranded_on(w) or old
            if not old:
                continue
            w.updating = True
            try:
                if not await self._settled(w):
                    raise APIError(504, "it is still loading the new weights")
                if hash_of(w) == old.get("hash"):
                    continue                    # (a load that never happened: nothing to put back)
                await self._drained([w], self.drain_timeout)
                await self._load_one(w, old["path"], self.drain_timeout)
                log.info("worker %d put back on %s", w.index, old["path"])
            except APIError as e:
                log.error("worker %d could not be put back on %s: %s; it takes no requests until it holds them",
                          w.index, old["path"], e.message)
                self._stranded[process] = old
                stuck.append((w, e.message))
            finally:
                w.updating = False
        return stuck

    async def _settled(self, w: Worker) -> bool:
        """Wait until ``w``'s /health no longer says "updating" (a load it was asked for and did not answer in time
        goes on to its end; its model_version is then the one it holds), up to --request-timeout +
        --weight-load-timeout; False if it still says so then."""
        deadline = time.monotonic() + self.drain_timeout + self.load_timeout
        while time.monotonic() < deadline:
            try:
                async with self._session().get(w.url + "/health", headers=self.headers,
                                               timeout=aiohttp.ClientTimeout(total=5)) as r:
                    data = await r.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                return True                     # gone: its restart is the sync's business
            if not isinstance(data, dict) or data.get("status") != "updating":
                if isinstance(data, dict) and isinstance(data.get("model_version"), dict):
                    w.last_health = {**w.last_health, "model_version": data["model_version"]}
                return True
            await asyncio.sleep(0.2)
        return False

    @staticmethod
    def _failure(w: Worker, message: str, moved: list, stuck: list = ()) -> str:
        """The failed update's message: what failed, and what became of the workers it had moved (it said "put back"
        of workers that could not be: a review)."""
        out = f"the weight update failed on worker {w.index}: {message}"
        back = [x.index for x, _ in moved if all(x is not y for y, _ in stuck)]
        if back:
            out += f"; workers {back} are on their previous weights again"
        for x, why in stuck:
            out += (f"; worker {x.index} could not be put back ({why}): it takes no requests until it holds its "
                    f"previous weights again (/stats weights.stranded)")
        return out

    # ------------------------------------------------------------ workers that come back on other weights
    def start(self) -> None:
        self._sync_task = asyncio.create_task(self._sync_loop(), name="weights-sync")

    async def close(self) -> None:
        for task in [self._sync_task, *self.updates]:     # (an update whose client left, at shutdown)
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in [self._sync_task, *self.updates] if t is not None), return_exceptions=True)

    def _sync_due(self, w: Worker, now: float) -> bool:
        f = self._sync_failed.get(_process(w))
        return f is None or now >= f["next"]

    def _sync_failure(self, process: tuple, index: int, message: str, target: str) -> None:
        """Try the worker ``process`` again after --weight-sync-retry seconds, doubled for each failure in a row (up
        to --weight-sync-retry-max): a load that timed out or ran out of memory may succeed later; until then the
        worker takes no batch (:meth:`routable`)."""
        f = self._sync_failed.get(process) or {"failures": 0}
        f["failures"] += 1
        wait = min(self.sync_retry_max, self.sync_retry * 2.0 ** min(f["failures"] - 1, 60))
        f.update(target=target, error=message, next=time.monotonic() + wait)
        self._sync_failed[process] = f
        log.error("worker %d could not load the weights it must hold (failure %d in a row; next try in %.0f s): %s",
                  index, f["failures"], wait, message)

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            try:
                await self._sync_round()
            except asyncio.CancelledError:
                raise
            except Exception:               # (a bug here must not end the sync for good)
                log.exception("weights sync")

    async def _sync_round(self) -> None:
        if self._lock.locked():
            return
        now = time.monotonic()
        live = {_process(w) for w in self.pool.workers}
        for k in [k for k in self._stranded if k not in live]:
            del self._stranded[k]               # (a process replaced since starts from its launch weights)
        # forget processes replaced since, those that reached the weights after all (a load that answered too
        # late), and failures to reach weights they no longer must hold
        pending = {_process(w): want["hash"] for w in self.pool.workers
                   if (want := self._wanted(w)) is not None and hash_of(w) != want["hash"]}
        for gone in [k for k, f in self._sync_failed.items() if pending.get(k) != f["target"]]:
            del self._sync_failed[gone]
        for w in self.pool.workers:
            want = self._wanted(w)
            if want is None or not (w.healthy and not w.updating and hash_of(w) not in (None, want["hash"])
                                    and self._sync_due(w, now)):
                continue
            async with self._lock:
                want = self._wanted(w)
                if want is None or not w.healthy or hash_of(w) in (None, want["hash"]):
                    continue                    # (an update ran while this round waited for the lock)
                process = _process(w)           # the process asked (health may show its successor by the end)
                log.info("worker %d serves %s, not the %s it must hold: loading %s", w.index, hash_of(w),
                         want["hash"], want["path"])
                w.updating = True
                self.syncing = {"worker": w.index, "path": want["path"], "started": time.time()}
                self.batcher.versions_changed()
                error = None
                try:
                    await self._drained([w], self.drain_timeout)
                    got = await self._load_one(w, want["path"], self.drain_timeout)
                    if got["hash"] != want["hash"]:        # (rewritten in place since: loaded every round before)
                        raise APIError(409, f"{want['path']} now holds other weights ({got['hash']}), not "
                                            f"{want['hash']}")
                except APIError as e:
                    error = e.message
                except Exception as e:
                    log.exception("weights sync of worker %d", w.index)
                    error = f"{type(e).__name__}: {e}"
                finally:
                    w.updating = False
                    self.syncing = None
                    self.batcher.versions_changed()
                if error is None:
                    self._sync_failed.pop(process, None)
                    self._stranded.pop(process, None)
                elif _process(w) == process:    # (a process replaced meanwhile starts with a clean slate)
                    self._sync_failure(process, w.index, error, want["hash"])


def _process(w: Worker) -> tuple:
    return (w.index, w.instance_id)


def _during_load(status: int) -> int:
    """A worker's refusal of a load it was asked to make after the checkpoint was checked (a read error half-way, a
    file gone): the update failed on the server's side (502), not the client's (400: it would not try again)."""
    return 502 if status == 400 else status
