"""The balancer: one OpenAI endpoint in front of N workers. Never imports torch.

Routes: POST /v1/completions, /v1/chat/completions, /v1/responses (batched); POST /tokenize, /detokenize and
GET /v1/models, /tokenizer_info, /generation/algorithms (answered by a worker); GET /health, /stats, /worker-status,
/metrics."""
from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import re
import secrets
import signal
import socket
import sys
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
import yarl
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily

import click

from balancer.batcher import BatchConfig, CentralBatcher, Pending
from balancer.batches import BatchJobs, FolderInUse, add_routes as add_batch_routes
from balancer.pool import HealthConfig, WorkerPool
from balancer.stats import Window
from balancer.weights import MODES, WeightUpdates
from common.config import PORT, FiniteFloatRange, setting
from common.http import (BODY_BUDGET, BODY_TIMEOUT_S, EXIT_PORT_IN_USE, EXTRA_SERVED,
                         HTTP_GC_THRESHOLD, KEEPALIVE_TIMEOUT, MAX_BODY_BYTES, MAX_BODY_BYTES_IN_FLIGHT,
                         AppRunner, BodyBudget, body_timeout_setting, json_response, middlewares, raise_open_files,
                         read_body, send_timeout_setting, settle_gc)
from common.metrics import RequestMetrics
from common.openai_http import add_routes, off_loop
from common.protocol import APIError, error_body, guarded_by_api_key, loads

log = logging.getLogger("dllm.balancer")

STATUSES = ("starting", "idle", "busy", "updating", "stalled", "unhealthy", "draining")


def worker_urls(value: str) -> list[str]:
    urls = [u.strip().rstrip("/") for u in value.split(",") if u.strip()]
    if not urls:
        raise click.BadParameter("no worker URL")
    for u in urls:
        if not re.fullmatch(r"https?://(\[[0-9A-Fa-f:.]+\]|[^/\s:\[\]]+)(:\d{1,5})?", u):
            raise click.BadParameter(f"{u!r}: expected a base URL like http://host:8001")
    return urls


@dataclass
class BalancerConfig:
    worker_urls: list[str] = setting(help="Comma-separated worker base URLs (http://h:8001,http://h:8002).",
                                     convert=worker_urls)
    host: str = setting("127.0.0.1")
    port: int = setting(8000, type=PORT)
    batch: BatchConfig = setting(default_factory=BatchConfig, cli=False)     # its own settings
    health: HealthConfig = setting(default_factory=HealthConfig, cli=False)
    request_timeout: float = setting(1800.0, "Seconds before a request is answered 504.",
                                     type=click.FloatRange(0, min_open=True))
    drain_timeout: float = setting(60.0, "Seconds SIGTERM waits for queued and in-flight requests; then those left "
                                         "get 503 and the process exits within 5 s.",
                                   type=click.FloatRange(0))
    weight_load_timeout: float = setting(600.0, "Seconds one worker may take to load new weights (POST "
                                                "/v1/load_weights, or a worker brought onto them when it comes back) "
                                                "once its batches have finished.", type=click.FloatRange(1))
    weight_sync_retry: float = setting(10.0, "Seconds before the balancer tries again to bring a worker onto the last "
                                             "update's weights when it could not (a worker that came back on other "
                                             "weights takes no requests until then); doubled after each failure "
                                             "of that process in a row.", type=FiniteFloatRange(0.1))
    weight_sync_retry_max: float = setting(600.0, "Longest wait between two such tries.", type=FiniteFloatRange(0.1))
    http_processes: int = setting(1, "Processes accepting client connections on --port (SO_REUSEPORT): the balancer "
                                     "itself plus N-1 front processes that read and validate requests and hand them "
                                     "to its one queue over a Unix socket. Raise it when one core of HTTP work is "
                                     "the limit (thousands of requests/s) and cores are free: a front's request "
                                     "costs more CPU in all (docs/balancer.md).", type=click.IntRange(1))
    front_timeout: float = setting(10.0, "With --http-processes > 1: seconds a front process may leave pings "
                                         "unanswered before it is killed and restarted; and seconds the balancer "
                                         "may send a front nothing (it pings four times as often) before that "
                                         "front answers its open and new requests 503.",
                                   type=click.FloatRange(0.1))
    front_startup_timeout: float = setting(60.0, "With --http-processes > 1: seconds a starting front process may "
                                                 "take to report (its imports) before it is killed and restarted.",
                                           type=click.FloatRange(0.1))
    front_restart_backoff: float = setting(1.0, "With --http-processes > 1: seconds before a front process that "
                                                "exited is restarted; doubled for each exit within 10 s of its "
                                                "start in a row.", type=click.FloatRange(0))
    front_restart_backoff_max: float = setting(30.0, "Longest wait before a front process is restarted.",
                                               type=click.FloatRange(0))
    max_body_bytes_in_flight: int = setting(
        MAX_BODY_BYTES_IN_FLIGHT, "Bytes of request bodies held at once over all requests, per HTTP process (a "
                                  "body counts from the start of its reading until its request is answered; "
                                  "bodies over 1 MiB may fill three quarters); past it a request gets 503 + "
                                  "Retry-After (one body is at most 64 MiB: 413).",
        type=click.IntRange(1))
    body_timeout: float = body_timeout_setting()
    send_timeout: float = send_timeout_setting()
    keepalive_timeout: float = setting(KEEPALIVE_TIMEOUT, "Seconds a client connection may stay idle between "
                                                          "requests (one whose next request's headers have not all "
                                                          "arrived counts as idle) before it is closed.",
                                       type=click.FloatRange(1))
    api_key: str | None = setting(None, "Require 'Authorization: Bearer KEY' on /v1.", envvar="DLLM_API_KEY")
    worker_api_key: str | None = setting(None, "Bearer key the balancer sends to workers.",
                                         envvar="DLLM_WORKER_API_KEY")
    worker_launch_ids: list[str | None] | None = setting(None, cli=False)   # per URL: accept only this /health id
    files_dir: str | None = setting(None, "Where /v1/files and /v1/batches keep their files and batches [default: "
                                          "$DLLM_CACHE/batches/port-PORT]; batches left running resume from there.")
    max_file_bytes: int = setting(512 * 2**20, "Largest file POST /v1/files takes (413 beyond).",
                                  type=click.IntRange(1))
    batch_concurrency: int = setting(64, "Lines of /v1/batches batches in the queue at once, over all "
                                           "running batches (they take turns).",
                                     type=click.IntRange(1))
    max_running_batches: int = setting(16, "/v1/batches batches running at once (each holds its files open and a "
                                           "chunk of its input parsed); later ones wait, in the order they came.",
                                       type=click.IntRange(1))
    min_free_disk_bytes: int = setting(2**30, "Free bytes /v1/files uploads and new /v1/batches batches leave on "
                                              "the disk of --files-dir (507 insufficient_storage otherwise); a "
                                              "running batch that brings the disk under it stops, failed.",
                                       type=click.IntRange(0))
    batch_retry_max: float = setting(5.0, "Longest wait between two tries of a /v1/batches line the balancer "
                                          "cannot take now (queue full, no healthy worker); the wait starts at "
                                          "0.1 s and doubles.", type=FiniteFloatRange(0.1))
    models_cache_ttl: float = setting(30.0, "Seconds the balancer reuses a worker's answer to GET /v1/models, "
                                            "/v1/models/{id}, /generation/algorithms and /tokenizer_info before "
                                            "asking again; 0: ask every time.",
                                      type=FiniteFloatRange(0))



class _BatcherCounters:
    """The batcher's failure counters, read when /metrics is scraped (Prometheus counters: ``..._total``)."""

    def __init__(self):
        self.batcher = None

    def collect(self):
        b = self.batcher
        for name, doc, value in (
                ("dllm_balancer_redispatched", "Requests re-dispatched after a worker failure", "retries"),
                ("dllm_balancer_failed_midstream", "Streams ended with an error event after their worker failed",
                 "failed_midstream"),
                ("dllm_balancer_split_batches", "Batches a worker rejected as a whole, re-sent one request at a time",
                 "split_batches")):
            yield CounterMetricFamily(name, doc, value=getattr(b, value, 0) if b is not None else 0)


class BalancerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = RequestMetrics("dllm_balancer", (.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
        r.register(self.requests)
        self.batch_size = Histogram("dllm_balancer_batch_size", "Requests per dispatched batch", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        self.queue_depth = Gauge("dllm_balancer_queue_depth", "Requests waiting for a batch", registry=r)
        self.in_flight = Gauge("dllm_balancer_in_flight", "Requests on workers", registry=r)
        self.workers = Gauge("dllm_balancer_workers", "Workers by status", ["status"], registry=r)
        self.failures = _BatcherCounters()          # its batcher is set by BalancerState
        r.register(self.failures)


class BalancerState:
    def __init__(self, cfg: BalancerConfig):
        self.cfg = cfg
        self.session: aiohttp.ClientSession | None = None
        headers = {"Authorization": f"Bearer {cfg.worker_api_key}"} if cfg.worker_api_key else {}
        self.pool = WorkerPool(cfg.worker_urls, lambda: self.session, cfg.health, headers, cfg.worker_launch_ids)
        self.batcher = CentralBatcher(self.pool, lambda: self.session, cfg.batch, headers)
        self.metrics = BalancerMetrics()
        self.metrics.failures.batcher = self.batcher
        self.batcher.on_batch = self.metrics.batch_size.observe
        self.weights = WeightUpdates(self.pool, self.batcher, lambda: self.session, headers, cfg.weight_load_timeout,
                                     cfg.request_timeout, (cfg.weight_sync_retry, cfg.weight_sync_retry_max))
        self.batcher.routable, self.batcher.servable = self.weights.routable, self.weights.servable
        self.batcher.allowed_versions = self.weights.allowed_versions
        self.window = Window(60.0)
        self.total_requests = 0
        self.live: dict[str, Pending] = {}       # requests being answered, by id
        self.local_requests = 0                  # OpenAI requests this process answered itself (not via a front)
        self.fronts = None                       # balancer.front.Fronts when --http-processes > 1
        self.draining = False
        self.started = time.time()
        self._from_workers: dict[str, tuple[float, dict]] = {}   # path -> (when, a worker's answer)
        self._ids = itertools.count()
        self._id_prefix = f"{os.getpid():x}{secrets.token_hex(4)}-"    # unique across balancers sharing a worker

    def new_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids)}"

    def admit(self, kind: str, body: bytes, stream: bool, t0: float, cls=Pending, version: str | None = None,
              **extra) -> Pending:
        """Queue a validated request for batching, or raise 503 (draining, no healthy worker) / 429 (queue full) /
        409 (it requires weights, ``version``, that no worker will serve). The caller answers from the returned
        request's events and calls :meth:`release` when it is done."""
        if self.draining:
            raise APIError(503, "the balancer is shutting down")
        if not self.pool.any_healthy():
            raise APIError(503, "no healthy worker", type="service_unavailable")
        if (why := self.weights.stranded_fleet()) is not None:
            raise APIError(503, why, type="service_unavailable")
        if version is not None and not self.weights.servable(version):
            served = sorted({v["hash"] for v in self.weights.snapshot()["versions"]})
            raise APIError(409, f"no worker serves model_version {version!r} (served: {served})",
                           param="model_version", code="model_version_unavailable")
        if self.batcher.queue_depth >= self.cfg.batch.max_queue:
            raise APIError(429, f"the balancer queue is full ({self.cfg.batch.max_queue} requests waiting)")
        self.total_requests += 1
        p = cls(id=self.new_id(), kind=kind, body=body, stream=stream, started=t0, version=version, **extra)
        self.live[p.id] = p
        self.batcher.submit(p)
        return p

    def release(self, p: Pending) -> None:
        """The request's answer is over (or its client gone): forget it; an unfinished one is cancelled."""
        del self.live[p.id]
        if not p.done:
            self.batcher.cancel(p)

    def observe(self, path: str, status: int, seconds: float) -> None:
        self.metrics.requests.observe(path, status, seconds)
        self.window.add(seconds, status)

    def expire(self, now: float) -> None:
        """Answer 504 to every request older than --request-timeout (its worker is told to drop it)."""
        limit = self.cfg.request_timeout
        for p in self.live.values():
            if not p.done and now - p.started > limit:
                self.batcher.cancel(p)
                p.deliver(None, "error", 504, error_body(f"no answer within --request-timeout ({limit:g} s)",
                                                         "timeout"), end=True)


STATE = web.AppKey("state", BalancerState)


# ---------------------------------------------------------------- OpenAI endpoints (common/openai_http.py)
class BalancerDoor:
    """The balancer's way in for /v1/completions, /v1/chat/completions, /v1/responses: queue the request for a batch
    (503 while draining or with no healthy worker, 429 when the queue is full) and answer from its events
    (--request-timeout is the expiry sweep's, which ends the request with a 504 event)."""
    timeout = None

    def __init__(self, state: BalancerState):
        self.state = state

    async def open(self, request: web.Request, kind: str, body: bytes, req) -> Pending:
        return self.state.admit(kind, body, req.stream, time.monotonic(), version=req.model_version)

    def close(self, request: web.Request, p: Pending | None, status: int, seconds: float) -> None:
        state = self.state
        if p is not None:
            state.release(p)
        state.local_requests += 1
        state.observe(request.path, status, seconds)


DOOR = web.AppKey("door", BalancerDoor)
JOBS = web.AppKey("jobs", BatchJobs)


async def to_a_worker(request: web.Request) -> web.Response:
    """POST /tokenize, /detokenize: not batched; the body (read in the one JSON language) goes to the least-loaded
    healthy worker, whose answer is returned as it is (another worker is tried if the connection fails, the call
    takes longer than --worker-call-timeout, or the worker refuses the balancer's --worker-api-key)."""
    state = request.app[STATE]
    body = await read_body(request)
    await off_loop(len(body), loads, body)
    path = request.match_info.route.resource.canonical      # the route's own path, never the client's
    tried = []
    for w in sorted(state.pool.healthy(), key=lambda w: (w.inflight_rows, w.index)):
        try:
            async with state.session.post(w.url + path, data=body,
                                          headers={**state.pool.headers, "Content-Type": "application/json"},
                                          timeout=aiohttp.ClientTimeout(total=state.cfg.batch.call_timeout)) as r:
                if r.status in (401, 403):      # the balancer's key, not the client's: never the client's 401
                    tried.append(f"worker {w.index}: refused the balancer's --worker-api-key ({r.status})")
                    continue
                return web.Response(body=await r.read(), status=r.status, content_type="application/json")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            tried.append(f"worker {w.index}: {type(e).__name__}")
    raise APIError(503, "no healthy worker" + (f" answered ({'; '.join(tried)})" if tried else ""),
                   type="service_unavailable")


async def load_weights(request: web.Request) -> web.Response:
    """POST /v1/load_weights {"model_path": DIR} or {"dcp_path": DIR, "base_model": DIR}, optional "mode" ("rolling",
    the default, or "pause") and "timeout" (seconds for the batches in flight to finish, per step; default
    --request-timeout): new weights on every worker without a restart (balancer/weights.py). Needs the balancer's
    API key; without --api-key the endpoint is refused (403), since anyone who can reach the port could swap the
    model."""
    state = request.app[STATE]
    if not state.cfg.api_key:
        raise APIError(403, "POST /v1/load_weights needs the balancer to run with --api-key (DLLM_API_KEY): it "
                            "changes the model every client gets", code="api_key_required")
    body = loads(await read_body(request))
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    mode = body.get("mode", "rolling")
    if mode not in MODES:
        raise APIError(400, f"mode must be one of {list(MODES)}, got {mode!r}", param="mode")
    timeout = body.get("timeout", state.cfg.request_timeout)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise APIError(400, "timeout must be a positive number of seconds", param="timeout")
    model_path, dcp_path, base = body.get("model_path"), body.get("dcp_path"), body.get("base_model")
    if (model_path is None) == (dcp_path is None):
        raise APIError(400, "give either model_path (a checkpoint directory or hub id) or dcp_path with base_model",
                       param="model_path")
    for name, v in (("model_path", model_path), ("dcp_path", dcp_path), ("base_model", base)):
        if v is not None and (not isinstance(v, str) or not v):
            raise APIError(400, f"{name} must be a non-empty string", param=name)
    from common.resolve import ResolveError, resolve_model
    try:
        if dcp_path is not None:
            from common.dcp_cache import ensure_converted
            path = await asyncio.to_thread(ensure_converted, dcp_path, base, None, log.info)
        else:
            path = await asyncio.to_thread(resolve_model, model_path, False)
    except (ResolveError, RuntimeError, OSError) as e:
        raise APIError(400, str(e), param="dcp_path" if dcp_path is not None else "model_path")
    # shielded: a client that leaves (Ctrl-C of `dllm-serve load-weights`) does not stop an update half-way (workers
    # on both weights, the failed update's put-back skipped and nothing recorded); it ends as it would have
    update = asyncio.ensure_future(state.weights.load(str(path), mode, float(timeout)))
    state.weights.updates.add(update)
    update.add_done_callback(state.weights.updates.discard)
    update.add_done_callback(lambda f: f.cancelled() or f.exception())      # (retrieved: no "never retrieved")
    return json_response(await asyncio.shield(update))


# ---------------------------------------------------------------- status endpoints
async def from_a_worker(request: web.Request) -> web.Response:
    """A read-only worker endpoint the balancer answers for its workers (GET /v1/models, /generation/algorithms,
    /tokenizer_info): the same path on a worker, the route's own (never the client's)."""
    return await _ask_workers(request.app[STATE], request.match_info.route.resource.canonical)


def model_id(name: str) -> str:
    """GET /v1/models/{id}'s id, decoded once by the router, checked before it goes to a worker: a model id may hold
    '/' (a hub id, a checkpoint's absolute path), but no '.' or '..' segment, backslash, control character or
    percent-escape (a doubly encoded one); anything else cannot be a served model (404)."""
    if ("\\" in name or re.search(r"%[0-9A-Fa-f]{2}|[\x00-\x1f\x7f]", name)
            or any(seg in (".", "..") for seg in name.split("/"))):
        raise APIError(404, f"The model {name[:200]!r} does not exist: not a model id", param="model",
                       code="model_not_found", type="invalid_request_error")
    return name


async def model_from_a_worker(request: web.Request) -> web.Response:
    """GET /v1/models/{id}: a worker's answer for the checked id, sent as one percent-encoded path segment of the
    fixed route (whatever it holds, the worker sees /v1/models/{that id} and nothing else)."""
    name = model_id(request.match_info["model"])
    return await _ask_workers(request.app[STATE], "/v1/models/" + urllib.parse.quote(name, safe=""))


async def _ask_workers(state: BalancerState, path: str) -> web.Response:
    """The first healthy worker's answer to GET ``path`` (already percent-encoded; sent as it is, never normalised),
    cached --models-cache-ttl s (every worker serves the same model); each worker asked may take
    --worker-call-timeout."""
    now = time.monotonic()
    hit = state._from_workers.get(path)
    if hit and now - hit[0] < state.cfg.models_cache_ttl:
        return json_response(hit[1])
    for w in state.pool.healthy() + [w for w in state.pool.workers if not w.healthy]:
        try:
            async with state.session.get(yarl.URL(w.url + path, encoded=True), headers=state.pool.headers,
                                         timeout=aiohttp.ClientTimeout(total=state.cfg.batch.call_timeout)) as r:
                if r.status == 200:
                    data = await r.json(content_type=None)
                    state._from_workers[path] = (now, data)
                    return json_response(data)
                if r.status == 404:             # the worker's own answer (e.g. an unknown model id), if it is one
                    data = await r.json(content_type=None)
                    if isinstance(data, dict) and isinstance(data.get("error"), dict):
                        return json_response(data, 404)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            continue
    raise APIError(503, f"no worker could answer {path}")


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    healthy = len(state.pool.healthy())
    stranded = state.weights.stranded_fleet() if healthy and not state.draining else None
    status = "draining" if state.draining else ("ok" if healthy and not stranded else
                                                "no_routable_workers" if healthy else "no_healthy_workers")
    versions = sorted({h for w in state.pool.workers if w.healthy and state.batcher.routable(w)
                       and (h := (w.last_health.get("model_version") or {}).get("hash"))})   # (what a request may get)
    return json_response({"status": status, "healthy_workers": healthy, "total_workers": len(state.pool.workers),
                          "model_versions": versions, **({"reason": stranded} if stranded else {})},
                         200 if healthy and not state.draining and not stranded else 503)


def _system_status(state: BalancerState) -> str:
    if state.draining:            # shutting down: new requests get 503 (a review found it shown "normal")
        return "draining"
    healthy = len(state.pool.healthy())
    if not healthy:
        return "down"
    if healthy < len(state.pool.workers):
        return "degraded"
    cfg = state.cfg.batch
    full = all(w.inflight_batches >= cfg.max_inflight_per_worker for w in state.pool.workers)
    if full and state.batcher.queue_depth >= cfg.batch_size:
        return "overloaded"
    return "normal"


def _rows_summary(workers) -> dict:
    """Rows running, joining and retiring per second over the healthy workers, from each one's last /health
    (workers report these over their last minute; a worker not yet heard from counts zero, and one that is down,
    stalled or draining is left out: a dead worker's last figures counted for ever)."""
    def total(key):
        return round(sum(float((w.last_health or {}).get(key) or 0) for w in workers if w.healthy), 3)
    # a worker's /health names its running rows running_batch_size
    return {"rows_running": int(total("running_batch_size")), "rows_joined_per_s": total("rows_joined_per_s"),
            "rows_retired_per_s": total("rows_retired_per_s")}


def _prefix_cache(workers) -> dict | None:
    """The healthy workers' prefix caches summed (from their last /health): cached and looked-up prompt tokens, hit
    rate."""
    caches = [(w.last_health or {}).get("prefix_cache") for w in workers if w.healthy]
    caches = [c for c in caches if c]
    if not caches:
        return None
    hit, asked = sum(c["cached_tokens"] for c in caches), sum(c["prompt_tokens_looked_up"] for c in caches)
    return {"workers": len(caches), "cached_tokens": hit, "prompt_tokens_looked_up": asked,
            "hit_rate": round(hit / asked, 4) if asked else 0.0, "bytes": sum(c["bytes"] for c in caches)}


async def stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    b, cfg = state.batcher, state.cfg.batch
    return json_response({
        "total_workers": len(state.pool.workers),
        "healthy_workers": len(state.pool.healthy()),
        "system_status": _system_status(state),
        "total_requests": state.total_requests,
        "in_flight": b.in_flight,
        "queue_depth": b.queue_depth,
        "redispatched_requests": b.retries,
        "failed_midstream": b.failed_midstream,
        "split_batches": b.split_batches,
        "request_body_bytes": request.app[BODY_BUDGET].snapshot(),     # this process's (each front has its own)
        "workers": [w.snapshot() for w in state.pool.workers],
        "prefix_cache": _prefix_cache(state.pool.workers),
        "weights": state.weights.snapshot(),
        "centralized_batching": {
            "enabled": True, "max_batch_size": cfg.batch_size, "max_wait_time": cfg.wait_time,
            "max_inflight_per_worker": cfg.max_inflight_per_worker,
            "pending_requests": b.queue_depth, "total_batches_processed": b.batches,
            "total_requests_batched": b.rows,
            "avg_batch_size": round(b.rows / b.batches, 3) if b.batches else 0.0,
            "batch_size_histogram": {str(k): v for k, v in sorted(b.histogram.items())},
        },
        "continuous_batching": _rows_summary(state.pool.workers),
        "tokens_generated": sum(w.tokens_generated for w in state.pool.workers),     # across worker restarts
        "http_processes": [{"role": "central", "pid": os.getpid(), "status": "ready",
                            "requests": state.local_requests}] + (state.fronts.snapshot() if state.fronts else []),
        "last_minute": state.window.summary(),
        "uptime_seconds": round(time.time() - state.started, 1),
    })


DASHBOARD = Path(__file__).with_name("dashboard.html")


async def dashboard(request: web.Request) -> web.Response:
    """GET /dashboard: one self-contained page (balancer/dashboard.html: no CDN, no library) that polls /stats and
    /worker-status and draws the last five minutes (docs/balancer.md)."""
    return web.Response(body=DASHBOARD.read_bytes(), content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-cache",
                                 "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; script-src 'unsafe-inline'; "
                                                            "style-src 'unsafe-inline'"})


async def worker_status(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return json_response({
        "timestamp": time.time(),
        "healthy_workers": len(state.pool.healthy()),
        "total_workers": len(state.pool.workers),
        "system_status": _system_status(state),
        "queue_depth": state.batcher.queue_depth,
        "weights": state.weights.snapshot(),
        "workers": [w.snapshot() for w in state.pool.workers],
    })


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    m = state.metrics
    m.queue_depth.set(state.batcher.queue_depth)
    m.in_flight.set(state.batcher.in_flight)
    counts = {s: 0 for s in STATUSES}
    for w in state.pool.workers:
        counts[w.status] += 1
    for s, n in counts.items():
        m.workers.labels(s).set(n)
    return web.Response(body=generate_latest(m.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


# ---------------------------------------------------------------- app and lifecycle
async def _expire_loop(state: BalancerState) -> None:
    """One timer for every request's --request-timeout (checked every second, or a tenth of the timeout)."""
    tick = max(0.01, min(1.0, state.cfg.request_timeout / 10))
    while True:
        await asyncio.sleep(tick)
        try:
            state.expire(time.monotonic())
        except Exception:                # the sweep must outlive any bug
            log.exception("request-timeout sweep failed")


async def _lifecycle(app: web.Application):
    state = app[STATE]
    # idle connections to workers go after 30 s, before a worker's own --keepalive-timeout (75 s) closes them
    app[JOBS].start()             # (first: a files folder it cannot make fails the start before anything runs)
    state.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
                                          json_serialize=lambda o: orjson.dumps(o).decode())
    state.pool.start()
    state.batcher.start()
    state.weights.start()
    expiry = asyncio.create_task(_expire_loop(state), name="request-timeouts")
    yield
    if state.fronts is not None:
        await state.fronts.close()
    expiry.cancel()
    await app[JOBS].close()
    await state.weights.close()
    await state.batcher.close()
    await state.pool.close()
    await state.session.close()


def make_app(cfg: BalancerConfig) -> web.Application:
    app = web.Application(middlewares=middlewares(cfg.api_key, guarded_by_api_key),
                          client_max_size=MAX_BODY_BYTES)
    app[STATE] = BalancerState(cfg)
    app[BODY_BUDGET] = BodyBudget(cfg.max_body_bytes_in_flight)
    app[BODY_TIMEOUT_S] = cfg.body_timeout
    app[EXTRA_SERVED] = ("/v1/files", "/v1/batches")
    app.cleanup_ctx.append(_lifecycle)
    app[DOOR] = BalancerDoor(app[STATE])
    add_routes(app, app[DOOR])
    app.router.add_get("/v1/models", from_a_worker)
    app.router.add_get("/v1/models/{model:.+}", model_from_a_worker)
    app.router.add_get("/generation/algorithms", from_a_worker)
    app.router.add_get("/tokenizer_info", from_a_worker)
    app.router.add_post("/tokenize", to_a_worker)
    app.router.add_post("/detokenize", to_a_worker)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    app.router.add_get("/worker-status", worker_status)
    app.router.add_get("/dashboard", dashboard)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/load_weights", load_weights)
    app[JOBS] = BatchJobs(app[STATE], files_root(cfg), cfg.max_file_bytes, cfg.batch_concurrency,
                          cfg.max_running_batches, cfg.min_free_disk_bytes)
    add_batch_routes(app, app[JOBS])
    return app


def files_root(cfg: BalancerConfig) -> Path:
    """Where /v1/files and /v1/batches keep their data: --files-dir, else a folder per port under $DLLM_CACHE."""
    return Path(cfg.files_dir) if cfg.files_dir else Path(
        os.environ.get("DLLM_CACHE", Path.home() / ".cache" / "dllm-serve")) / "batches" / f"port-{cfg.port}"


def check_port_free(host: str, port: int) -> None:
    """Raise OSError (EADDRINUSE) if a socket listens on ``host``:``port``. SO_REUSEPORT, which a balancer with
    front processes listens with, lets any process of this user bind the port beside another: a second balancer
    would share it silently (the kernel splitting connections between the two). A plain bind of every address the
    server would bind (as asyncio binds them: IPv6 sockets IPv6 only) fails where anything listens."""
    for family, kind, proto, _, addr in socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE):
        try:
            probe = socket.socket(family, kind, proto)
        except OSError:               # a family this host lacks (asyncio's server skips it too)
            continue
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind(addr)
        finally:
            probe.close()


async def start_sites(runner: web.AppRunner, cfg: BalancerConfig) -> None:
    """Listen on cfg.host:cfg.port; with --http-processes N > 1 also start the N-1 front processes (balancer/front.py),
    which listen on the same port (SO_REUSEPORT) and hand their requests to this process's queue."""
    many = cfg.http_processes > 1
    if many and cfg.port:
        check_port_free(cfg.host, cfg.port)
    site = web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True, reuse_port=many or None)
    await site.start()
    if not many:
        return
    from balancer.front import Fronts, socket_dir
    port = site._server.sockets[0].getsockname()[1]       # the real port when cfg.port is 0
    path = os.path.join(socket_dir(), "central.sock")
    await web.UnixSite(runner, path).start()
    state = runner.app[STATE]
    state.fronts = Fronts(state, cfg.http_processes - 1, cfg.host, port, path, cfg.api_key, cfg.front_timeout,
                          restart_delay=cfg.front_restart_backoff, restart_delay_max=cfg.front_restart_backoff_max,
                          startup_timeout=cfg.front_startup_timeout)
    await state.fronts.start()


async def serve(cfg: BalancerConfig, stop: asyncio.Event | None = None) -> int:
    """Serve until SIGTERM/SIGINT/SIGHUP (or, when given, until ``stop`` is set): then stop admitting (503), finish what is
    queued and in flight (up to ``drain_timeout``), stop the front processes, exit."""
    raise_open_files()
    app = make_app(cfg)
    runner = AppRunner(app, handler_cancellation=True, access_log=None, keepalive_timeout=cfg.keepalive_timeout,
                       send_timeout=cfg.send_timeout)
    try:
        await runner.setup()
    except FolderInUse as e:      # (another balancer: on this port, if the folder is the port's own, say that)
        await runner.cleanup()
        try:
            if cfg.port:
                check_port_free(cfg.host, cfg.port)
        except OSError as pe:
            print(f"dllm-serve balancer: cannot listen on {cfg.host}:{cfg.port}: {pe.strerror or pe}", file=sys.stderr)
            return EXIT_PORT_IN_USE if pe.errno == errno.EADDRINUSE else 1
        print(f"dllm-serve balancer: {e}", file=sys.stderr)
        return 1
    try:
        await start_sites(runner, cfg)
    except OSError as e:
        print(f"dllm-serve balancer: cannot listen on {cfg.host}:{cfg.port}: {e.strerror or e}", file=sys.stderr)
        await runner.cleanup()
        return EXIT_PORT_IN_USE if e.errno == errno.EADDRINUSE else 1
    settle_gc(HTTP_GC_THRESHOLD)      # what is set up lives as long as the process; fewer young passes
    log.info("balancer on http://%s:%d over %d workers (%d HTTP processes)", cfg.host, cfg.port,
             len(cfg.worker_urls), cfg.http_processes)
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):     # SIGHUP: its terminal or SSH session closed
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await drain(app)
    await runner.cleanup()
    return 0


async def drain(app: web.Application) -> None:
    """Stop admitting (503) and wait, up to ``drain_timeout``, for queued and in-flight requests to finish."""
    state = app[STATE]
    state.draining = True
    log.info("draining (up to %.0f s)", state.cfg.drain_timeout)
    try:
        async with asyncio.timeout(state.cfg.drain_timeout):
            while state.live or state.batcher.queue_depth or state.batcher.in_flight:
                await asyncio.sleep(0.05)
    except TimeoutError:
        unfinished = [p for p in state.live.values() if not p.done]
        log.warning("drain timeout: %d requests unfinished get 503", len(unfinished))
        for p in unfinished:            # answered, not dropped: a client can retry on another server
            state.batcher.cancel(p)     # (its worker is told)
            p.fail(503, f"the balancer is shutting down: --drain-timeout ({state.cfg.drain_timeout:g} s) passed "
                        "before this request was answered", "service_unavailable")


def run(cfg: BalancerConfig) -> int:
    try:
        import uvloop
        return uvloop.run(serve(cfg))
    except ImportError:
        return asyncio.run(serve(cfg))
