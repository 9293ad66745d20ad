"""The worker: one process, one device. aiohttp server over the engine with a local batching queue.

Routes: POST /v1/completions, /v1/chat/completions, /v1/responses, /tokenize, /detokenize, /worker/batch (the
balancer's door), /worker/cancel; GET /health, /v1/models, /tokenizer_info, /batch/stats, /generation/algorithms, /metrics."""
from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from common.http import (BODY_BUDGET, BODY_TIMEOUT_S, EXIT_PORT_IN_USE, MAX_BATCH_BYTES, SHUTDOWN_GRACE, AppRunner,
                         BodyBudget, json_response, middlewares, raise_open_files, read_body, read_bytes, settle_gc)
from common.metrics import RequestMetrics
from common.openai_http import ENDPOINTS, add_routes, off_loop
from common.protocol import MAX_DEPTH, APIError, error_body, loads
from common.worker_config import WorkerConfig

log = logging.getLogger("dllm.worker")


class WorkerMetrics:
    def __init__(self, state: "WorkerState"):
        r = self.registry = CollectorRegistry()
        self.requests = RequestMetrics("dllm_worker", (.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600))
        r.register(self.requests)
        self.batch_size = Histogram("dllm_worker_batch_size", "Rows per engine batch", registry=r,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.batch_seconds = Histogram("dllm_worker_batch_seconds", "Engine time per batch", registry=r,
                                       buckets=(.01, .05, .1, .5, 1, 2.5, 5, 10, 30, 60, 300))
        self.tokens = self.requests.counter("dllm_worker_completion_tokens", "Completion tokens returned")
        self.nfe = self.requests.counter("dllm_worker_forward_passes", "Row forward passes (nfe summed over rows)")
        self.joined = self.requests.counter("dllm_worker_rows_joined", "Rows that joined a running batch "
                                                                       "(continuous batching)")
        self.retired = self.requests.counter("dllm_worker_rows_retired", "Rows that finished")
        self.refused = self.requests.counter("dllm_worker_batch_rows_refused",
                                             "Requests of a balancer's batch refused 429 for a full queue (the "
                                             "balancer queues them again: not counted as answered)")
        self.prefix_looked_up = self.requests.counter("dllm_worker_prefix_cache_prompt_tokens",
                                                      "Prompt tokens in whole blocks looked up in the prefix cache")
        self.prefix_hit = self.requests.counter("dllm_worker_prefix_cache_cached_tokens",
                                                "Prompt tokens whose keys/values came from the prefix cache")
        Gauge("dllm_worker_prefix_cache_bytes", "Bytes of keys/values held by the prefix cache", registry=r
              ).set_function(lambda: state.engine.prefix_cache.bytes
                             if getattr(state.engine, "prefix_cache", None) is not None else 0)
        Gauge("dllm_worker_queue_depth", "Rows waiting", registry=r).set_function(
            lambda: state.batcher.queue_depth if state.batcher else 0)
        Gauge("dllm_worker_running_rows", "Rows in the running batch", registry=r).set_function(
            lambda: len(state.batcher.running) if state.batcher else 0)
        Gauge("dllm_worker_ready", "1 when the model is loaded and the worker admits requests", registry=r
              ).set_function(lambda: 1 if state.status == "ready" else 0)


@dataclass
class WorkerState:
    config: WorkerConfig
    status: str = "loading"          # loading | ready | updating (new weights: POST /worker/load_weights) | draining
                                     # | failed
    engine: object = None
    batcher: object = None
    serving: object = None
    started: float = field(default_factory=time.time)
    runs: dict = field(default_factory=dict)     # balancer request id -> Run (for /worker/cancel)
    active: int = 0                              # requests being answered
    streams: set = field(default_factory=set)    # the tasks answering them (a drain past its timeout cancels them)
    error: str | None = None
    metrics: WorkerMetrics | None = None
    steps: object = None                         # worker.stepclock.StepClock, once loaded (/health step_seconds_max)
    instance_id: str = field(default_factory=lambda: secrets.token_hex(8))      # this process, on /health
    tokens_generated: int = 0                    # completion tokens answered since the start (/health)
    cpu_threads: int | None = None              # torch intra-op threads (/health; --threads)
    launch_id: str | None = field(default_factory=lambda: os.environ.get("DLLM_LAUNCH_ID") or None)
    loading_weights: str | None = None           # the path a POST /worker/load_weights is loading (one at a time)

    @property
    def model_names(self) -> list[str]:
        """--served-model-name (comma-separated: several names, the first reported), else common.resolve's
        served_names: a checkpoint directory's absolute path, then its name."""
        from common.resolve import served_names
        names = [n.strip() for n in (self.config.served_model_name or "").split(",") if n.strip()]
        return names or served_names(self.config.model_path)

    @property
    def model_name(self) -> str:
        return self.model_names[0]


STATE = web.AppKey("state", WorkerState)
DOOR = web.AppKey("door", object)
LOAD_FAILED = web.AppKey("load_failed", asyncio.Event)


OPEN_PATHS = ("/health", "/metrics")


# ---------------------------------------------------------------- helpers
async def read_request(request: web.Request):
    """An OpenAI request body, read exactly as the balancer reads it (common/http.py, common/protocol.py)."""
    return loads(await read_body(request))


def require_ready(state: WorkerState) -> None:
    if state.status != "ready":
        msg = {"loading": "the model is still loading", "draining": "the worker is shutting down",
               "updating": "the worker is loading new weights",
               "failed": f"the model failed to load: {state.error}"}[state.status]
        raise APIError(503, msg, headers={"Retry-After": "5" if state.status in ("loading", "updating") else "30"})


# ---------------------------------------------------------------- OpenAI endpoints (common/openai_http.py)
class WorkerDoor:
    """The worker's way in for /v1/completions, /v1/chat/completions, /v1/responses: tokenise and queue the rows
    (Serving), answer from the Run's events, within --request-timeout."""

    def __init__(self, state: "WorkerState"):
        self.state = state

    @property
    def timeout(self) -> float:
        return self.state.config.request_timeout

    async def open(self, request: web.Request, kind: str, body: bytes, req):
        state = self.state
        require_ready(state)
        prep = await off_loop(len(body), state.serving.prepare, kind, body, req)
        require_ready(state)             # (the state may have changed while a large body was prepared)
        run = state.serving.submit(prep)
        state.active += 1
        state.streams.add(asyncio.current_task())
        return run

    def close(self, request: web.Request, run, status: int, seconds: float) -> None:
        if run is not None:
            run.cancel()
            self.state.active -= 1
            self.state.streams.discard(asyncio.current_task())
        self.state.metrics.requests.observe(request.path, status, seconds)


# ---------------------------------------------------------------- the balancer's door
def _other_weights(have: dict, allowed: list) -> web.Response:
    """The 409 of a batch for weights this worker does not hold (the balancer sends its rows elsewhere or again)."""
    return json_response({**APIError(409, f"this worker holds weights {have['hash']} ({have['path']}), not "
                                          f"{allowed}", code="model_version_unavailable").body(),
                          "model_version": have}, 409)


async def worker_batch(request: web.Request) -> web.StreamResponse:
    """One call carries a whole batch; per-request events come back as NDJSON lines (docs/api.md), written as they
    happen. Each request's last line carries ``"end": true``. Metrics: the call under ``/worker/batch`` with its
    own status, and each request under its endpoint with its own status and latency (499: its line never went)."""
    t0 = time.monotonic()
    status = 499                      # the balancer went away first (the handler is cancelled), unless set below
    try:
        resp = await _worker_batch(request, t0)
        status = resp.status
        return resp
    except APIError as e:
        status = e.status
        raise
    except Exception:
        status = 500
        raise
    finally:
        request.app[STATE].metrics.requests.observe("/worker/batch", status, time.monotonic() - t0)


async def _worker_batch(request: web.Request, t0: float) -> web.StreamResponse:
    state = request.app[STATE]
    require_ready(state)
    # each row's body nests as the balancer allowed, 3 levels down
    raw = await read_bytes(request, MAX_BATCH_BYTES)
    body = await off_loop(len(raw), loads, raw, MAX_DEPTH + 3)     # (60 MiB of token ids: a second)
    items = body.get("requests") if isinstance(body, dict) else None
    if not isinstance(items, list) or not items:
        raise APIError(400, "body must be {\"requests\": [{\"id\", \"kind\", \"body\"}, ...]}", param="requests")
    ids = [item.get("id") if isinstance(item, dict) else None for item in items]
    if not all(isinstance(rid, str) and rid for rid in ids):
        raise APIError(400, "every request needs a non-empty string id", param="requests.id")
    dup = [rid for rid in ids if rid in state.runs]
    if not dup and len(set(ids)) != len(ids):
        seen = set()
        dup = [rid for rid in ids if rid in seen or seen.add(rid)]
    if dup:
        raise APIError(400, f"duplicate request id {dup[0]!r}", param="requests.id")
    allowed = body.get("model_versions")      # the balancer's: the weights it may route these rows to
    have = getattr(state.engine, "version", None)
    if isinstance(allowed, list) and have is not None and have["hash"] not in allowed:
        return _other_weights(have, allowed)
    lines: list[bytes] = []           # NDJSON lines not yet written
    wake = asyncio.Event()
    unanswered = set(ids)             # requests without their last line yet
    metrics = state.metrics

    paths = {rid: ENDPOINTS.get(k, "unknown") if isinstance(k := item.get("kind"), str) else "unknown"
             for rid, item in zip(ids, items)}     # (metrics)

    def emitter(rid: str):
        def emit(kind: str, data, last: bool, answered: bool = True) -> None:
            if rid not in unanswered:     # (after the timeout's error line: nothing more for it)
                return
            if kind == "error":
                line = {"id": rid, "event": "error", "status": data[0], "data": data[1]}
            else:
                line = {"id": rid, "event": kind, "data": data}
            if last:
                line["end"] = True
                unanswered.discard(rid)
                if answered:
                    metrics.requests.observe(paths[rid], data[0] if kind == "error" else 200,
                                             time.monotonic() - t0)
            lines.append(orjson.dumps(line))
            wake.set()
        return emit

    def prepare_rows() -> list:
        out = []
        for item in items:
            kind = item.get("kind")
            try:
                if kind not in ("chat", "completion", "responses"):
                    raise APIError(400, "kind must be 'chat', 'completion' or 'responses'", param="kind")
                out.append(state.serving.prepare(kind, item.get("body")))
            except Exception as e:            # noqa: BLE001  (reported per row below)
                out.append(e)
        return out

    runs = {}
    preps = await off_loop(len(raw), prepare_rows)
    require_ready(state)
    now = getattr(state.engine, "version", None)
    if now is not None and (have is None or now["hash"] != have["hash"]):    # a load ended while a large body was
        # prepared: the rows were checked against the weights before it (a review); the balancer sends the batch
        # again, elsewhere or here (the same weights loaded again are the same: a second review)
        return _other_weights(now, allowed if isinstance(allowed, list) else [have["hash"]] if have else [])
    for rid, prep in zip(ids, preps):
        emit = emitter(rid)
        try:
            if isinstance(prep, Exception):
                raise prep
            runs[rid] = state.serving.submit(prep, emit, wait=False)   # the batch was formed upstream
        except APIError as e:                 # this row's own rejection: the other rows go on
            if e.status == 429:               # (a full queue: the balancer sends it again, here or elsewhere)
                metrics.refused.inc()
            emit("error", (e.status, e.body()), True, answered=e.status != 429)
        except Exception as e:                # a bug on one row must not fail the batch
            log.error("request %s: preparing the row failed", rid, exc_info=e)
            emit("error", (500, error_body(f"internal error: {type(e).__name__}", "server_error")), True)

    state.runs.update(runs)
    state.active += 1
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    task = asyncio.current_task()
    state.streams.add(task)           # a drain past --drain-timeout cancels it
    try:
        await resp.prepare(request)
        try:
            async with asyncio.timeout(state.config.request_timeout):
                while unanswered or lines:
                    if not lines:
                        wake.clear()
                        await wake.wait()
                        continue
                    out = b"\n".join(lines) + b"\n"        # whatever is ready, in one write
                    lines.clear()
                    await resp.write(out)
        except TimeoutError:          # the requests still open end with a 504 line each; the stream ends properly
            body = error_body(f"no answer within --request-timeout ({state.config.request_timeout:g} s)", "timeout")
            lines += [orjson.dumps({"id": rid, "event": "error", "status": 504, "data": body, "end": True})
                      for rid in ids if rid in unanswered]
            for rid in unanswered:
                metrics.requests.observe(paths[rid], 504, time.monotonic() - t0)
            unanswered.clear()
            await resp.write(b"\n".join(lines) + b"\n")
        await resp.write_eof()
        return resp
    finally:
        state.streams.discard(task)
        for rid, run in runs.items():
            run.cancel()
            state.runs.pop(rid, None)
        for rid in unanswered:            # the balancer went away (its client did, or it failed over)
            metrics.requests.observe(paths[rid], 499, time.monotonic() - t0)
        unanswered.clear()                # (a cancelled row's last event, later, is neither sent nor counted)
        state.active -= 1


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    require_ready(state)
    raw = await read_body(request)
    return json_response(await off_loop(len(raw), lambda: state.serving.tokenize(loads(raw))))


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    require_ready(state)
    raw = await read_body(request)
    return json_response(await off_loop(len(raw), lambda: state.serving.detokenize(loads(raw))))


async def tokenizer_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    require_ready(state)
    return json_response(state.serving.tokenizer_info())


async def worker_cancel(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = loads(await read_bytes(request))
    ids = body.get("ids") if isinstance(body, dict) else None
    if not isinstance(ids, list):
        raise APIError(400, "body must be {\"ids\": [...]}", param="ids")
    if not all(isinstance(rid, str) for rid in ids):
        raise APIError(400, "ids must be request id strings", param="ids")
    found = 0
    for rid in ids:
        run = state.runs.get(rid)
        if run is not None:
            run.cancel()
            found += 1
    return json_response({"cancelled": found})


async def worker_load_weights(request: web.Request) -> web.Response:
    """POST /worker/load_weights {"model_path": DIR}: new weights in place (Engine.reload_weights). The worker stops
    admitting (503, /health status "updating"), lets every queued and running row finish on the old weights (at
    most ``timeout`` seconds, default --load-timeout), loads, and admits again. A checkpoint that cannot replace the
    weights (another family, config, shapes or tokenizer; a bad path) is a 400 and changes nothing. One load at a
    time (409 for another meanwhile); a client that leaves does not end the load: the worker admits again only once
    it is over (it said "ready" while a load ran on, and a request pinned to the old weights got the new ones)."""
    state = request.app[STATE]
    require_ready(state)
    body = loads(await read_bytes(request))
    path = body.get("model_path") if isinstance(body, dict) else None
    if not isinstance(path, str) or not path:
        raise APIError(400, "body must be {\"model_path\": \"/checkpoint/dir\"}", param="model_path")
    timeout = body.get("timeout", state.config.load_timeout)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise APIError(400, "timeout must be a positive number of seconds", param="timeout")
    engine, loop = state.engine, asyncio.get_running_loop()
    if not hasattr(engine, "reload_weights"):
        raise APIError(400, "this worker cannot load new weights")
    check_only = body.get("check_only") is True      # the balancer asks before it stops any worker: which weights
    if not check_only:
        require_ready(state)              # (it may have changed while the body was read)
        if state.loading_weights is not None:
            raise APIError(409, f"new weights are already being loaded ({state.loading_weights})",
                           code="update_in_progress")
        state.loading_weights = path      # taken before any wait: a second load is refused, never interleaved
    handed_over = False
    try:
        try:
            await loop.run_in_executor(None, engine.check_weights, path)       # before anything stops
            if check_only:
                from worker.models.checkpoint import model_version
                version = await loop.run_in_executor(None, model_version, os.path.abspath(path))
                return json_response({"model_version": version, "checked": True})
        except (ValueError, OSError) as e:
            raise APIError(400, f"cannot load {path!r}: {e}", param="model_path")
        state.status = "updating"
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                while state.batcher.pending or state.batcher.running:
                    await asyncio.sleep(0.01)
        except TimeoutError:
            raise APIError(504, f"rows were still running after {timeout:g} s: the weights were not changed",
                           type="timeout")        # (a timeout, as the balancer's own drain wait says it)
        log.info("loading new weights from %s", path)
        # on the device thread, like every forward; shielded: a client that leaves does not end it
        load = loop.run_in_executor(state.batcher._executor, engine.reload_weights, path)
        try:
            version = await asyncio.shield(load)
        except asyncio.CancelledError:
            handed_over = True           # the load goes on: its end sets the status (_weights_loaded)
            load.add_done_callback(lambda f: _weights_loaded(request.app, path, t0, f))
            raise
        except (ValueError, OSError) as e:
            raise APIError(400, f"cannot load {path!r}: {e}", param="model_path")
        except RuntimeError as e:          # the old weights could not be put back: this process must not serve
            _load_failed(request.app, e)
            raise APIError(500, str(e))
        log.info("serving new weights %s (%s) after %.1f s", version["hash"], version["path"], time.monotonic() - t0)
        return json_response({"model_version": version, "seconds": round(time.monotonic() - t0, 3)})
    finally:
        if not handed_over:
            _load_over(state, check_only)


def _load_over(state: WorkerState, check_only: bool) -> None:
    if not check_only:
        state.loading_weights = None
    if state.status == "updating":
        state.status = "ready"


def _load_failed(app: web.Application, e: Exception) -> None:
    state = app[STATE]
    state.status, state.error = "failed", str(e)
    app[LOAD_FAILED].set()


def _weights_loaded(app: web.Application, path: str, t0: float, f: asyncio.Future) -> None:
    """The end of a load whose client left (worker_load_weights): the worker admits again now."""
    state = app[STATE]
    e = None if f.cancelled() else f.exception()
    if isinstance(e, RuntimeError):
        log.error("%s", e)
        _load_failed(app, e)
    elif e is not None:
        log.error("loading %s failed (its client had left): %s; the old weights are kept", path, e)
    else:
        v = f.result()
        log.info("serving new weights %s (%s) after %.1f s (its client had left)", v["hash"], v["path"],
                 time.monotonic() - t0)
    _load_over(state, False)


# ---------------------------------------------------------------- status endpoints
async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    b, e = state.batcher, state.engine
    data = {
        "status": state.status,
        "busy": bool(b and b.busy),
        "running_batch_size": len(b.running) if b else 0,
        "queue_depth": b.queue_depth if b else 0,
        **({k: v for k, v in b.rates().items() if k.endswith("_per_s")} if b else {}),
        "seconds_since_last_step": round(time.monotonic() - e.last_step_time, 3) if e else None,
        "step_seconds_max": state.steps.step_seconds_max if state.steps else None,
        "model": state.model_name,
        "model_version": getattr(e, "version", None),
        "family": e.family if e else None,
        "device": str(e.device) if e else state.config.device,
        "tensor_parallel_size": state.config.tensor_parallel_size,
        "cpu_threads": state.cpu_threads,
        **({"ranks": e.ranks.describe()} if getattr(e, "ranks", None) is not None else {}),
        "prefix_cache": e.prefix_cache.stats() if getattr(e, "prefix_cache", None) is not None else None,
        "cuda_graphs": e.graphs.report() if getattr(e, "graphs", None) is not None else None,
        "tokens_generated": state.tokens_generated,
        "gpu": gpu_stats(e.device) if e is not None else None,
        "uptime_seconds": round(time.time() - state.started, 1),
        "instance_id": state.instance_id,
        "launch_id": state.launch_id,
    }
    if state.error:
        data["error"] = state.error
    return json_response(data, 200 if state.status in ("ready", "loading", "updating", "draining") else 503)


def gpu_stats(device) -> dict | None:
    """The worker's GPU (a CUDA device): memory used and total (bytes, torch.cuda.mem_get_info) and utilisation (%,
    torch.cuda.utilization: NVML through nvidia-ml-py, mapped through CUDA_VISIBLE_DEVICES; null without it). None on
    CPU."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch
    try:
        free, total = torch.cuda.mem_get_info(device)
    except RuntimeError:
        return None
    try:
        util = torch.cuda.utilization(device)
    except Exception:                # no nvidia-ml-py or no NVML: memory only
        util = None
    return {"memory_used": total - free, "memory_total": total, "utilization": util}


def _model_card(state: WorkerState, name: str) -> dict:
    e = state.engine
    return {"id": name, "object": "model", "created": int(state.started), "owned_by": "dllm-serve",
            "root": state.config.model_path, "parent": None, "max_model_len": e.max_sequence_length,
            "family": e.family}


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    require_ready(state)
    return json_response({"object": "list", "data": [_model_card(state, state.model_name)]})


async def model(request: web.Request) -> web.Response:
    """GET /v1/models/{id} (the openai client's models.retrieve): the card under any of the served names."""
    state = request.app[STATE]
    require_ready(state)
    name = request.match_info["model"]
    if name not in state.serving.names:
        raise APIError(404, f"The model {name!r} does not exist; this server serves {state.model_name!r}",
                       param="model", code="model_not_found", type="invalid_request_error")
    return json_response(_model_card(state, name))


async def batch_stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    b, c = state.batcher, state.config
    n = b.batches_processed if b else 0
    return json_response({
        "max_batch_size": c.batch_size, "max_wait_time": c.max_wait_time, "max_queue": c.max_queue,
        "pending_requests": b.queue_depth if b else 0, "running_batch_size": len(b.running) if b else 0,
        "batches_processed": n, "requests_processed": b.rows_processed if b else 0,
        # the rows each batch started with (rows that joined a running batch are in requests_processed only)
        "avg_batch_size": round(sum(k * v for k, v in b.histogram.items()) / n, 3) if n else 0.0,
        "batch_size_histogram": {str(k): v for k, v in sorted(b.histogram.items())} if b else {},
        "dropped_before_start": b.dropped_before_start if b else 0,
        "continuous_batching": c.continuous_batching, "max_batch_tokens": c.max_batch_tokens,
        **(b.rates() if b else {}),
    })


async def generation_algorithms(request: web.Request) -> web.Response:
    from worker.engine import ALGORITHMS
    state = request.app[STATE]
    c = state.config
    engine = state.engine
    family = engine.family if engine else None
    # a request without block_length gets the checkpoint's block size (SDAR, DiffusionGemma), else the server's
    # (worker/serving.py Serving._params)
    block = (engine.default_block_length if engine is not None else None) or c.default_block_length
    return json_response({
        "family": family,
        "default_algorithm": c.default_algorithm,
        "defaults": {"max_tokens": c.default_max_tokens, "block_length": block,
                     "steps": "max_tokens (one step per token)", "temperature": 0.0, "remasking": "low_confidence",
                     "cfg_scale": 0.0, "threshold": None, "factor": None},
        "algorithms": [a.describe(None if engine is None else engine.algorithm_defaults.get(a.name),
                                  {"block_length": block})
                       for a in ALGORITHMS.values() if engine is None or engine.supports(a)],
    })


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.batcher is not None:       # the batcher counts on its own; the exported counters follow at scrape
        state.metrics.joined.value = state.batcher.rows_joined
        state.metrics.retired.value = state.batcher.rows_retired
    pc = getattr(state.engine, "prefix_cache", None)
    if pc is not None:
        state.metrics.prefix_looked_up.value = pc.tokens_looked_up
        state.metrics.prefix_hit.value = pc.tokens_hit
    body = generate_latest(state.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


# ---------------------------------------------------------------- app and lifecycle
async def _load(app: web.Application) -> None:
    """Load the model off the event loop; /health says 'loading' meanwhile. Any failure, an import's included (a
    broken torch install), is one line and ends the process (status 1): it stayed "loading" for ever."""
    state = app[STATE]
    try:
        await _start(app)
    except Exception as e:      # one line (the traceback at --log-level debug): the process then exits 1
        log.error("model load failed: %s: %s", type(e).__name__, e)
        log.debug("model load failed", exc_info=True)
        state.status, state.error = "failed", f"{type(e).__name__}: {e}"
        app[LOAD_FAILED].set()


async def _start(app: web.Application) -> None:
    state = app[STATE]
    c = state.config
    from worker.scheduler import RowScheduler
    from worker.engine import Engine, GenerationParams
    from worker.serving import Defaults, Serving
    import torch
    if c.threads:
        torch.set_num_threads(c.threads)
    state.cpu_threads = torch.get_num_threads()
    if c.simulate_device is not None:
        from worker.simulated import SimulatedEngine
        engine = await asyncio.get_running_loop().run_in_executor(
            None, lambda: SimulatedEngine(c.model_path, *c.simulate_device, per_step=c.simulate_per_step))
    else:
        engine = await asyncio.get_running_loop().run_in_executor(
            None, lambda: Engine.from_pretrained(c.model_path, device=c.device, dtype=c.dtype,
                                                  compile=c.compile, tensor_parallel=c.tensor_parallel_size,
                                                  rank_timeout=c.rank_timeout,
                                                  rank_startup_timeout=c.rank_startup_timeout,
                                                  prefix_cache_gb=c.prefix_cache_gb,
                                                  cuda_graphs=c.cuda_graphs, cuda_graph_max=c.cuda_graph_max,
                                                  cuda_graph_max_tokens=c.cuda_graph_max_tokens))
    engine.long_row_cost = c.long_row_cost          # fair share in the step loop (worker.engine.engine._Batch)
    state.cpu_threads = torch.get_num_threads()     # (CPU tensor parallelism shares them out among the ranks)
    from worker.models import DEFAULT_ALGORITHM
    from worker.models.checkpoint import default_max_new_tokens
    if c.default_max_tokens is None:
        c.default_max_tokens = default_max_new_tokens(c.model_path, 256)
    if c.default_algorithm is None:
        c.default_algorithm = DEFAULT_ALGORITHM.get(engine.family, "basic")
    engine.plan([1], GenerationParams(algorithm=c.default_algorithm,
                                      block_length=engine.default_block_length or c.default_block_length))
    batcher = RowScheduler(engine, batch_size=c.batch_size, max_wait_time=c.max_wait_time, max_queue=c.max_queue,
                      continuous=c.continuous_batching, max_batch_tokens=c.max_batch_tokens,
                      switch_wait=c.switch_wait, long_row_cost=c.long_row_cost, long_row_share=c.long_row_share)
    batcher.on_batch = lambda n, secs: (state.metrics.batch_size.observe(n), state.metrics.batch_seconds.observe(secs))
    batcher.start()
    state.engine, state.batcher = engine, batcher
    from worker.stepclock import StepClock
    state.steps = StepClock(engine, batcher)
    state.steps.start()
    aliases = (c.model_path, *state.model_names[1:])
    serving = Serving(engine, batcher, state.model_name,
                      Defaults(c.default_algorithm, c.default_max_tokens, c.default_block_length,
                               c.score_mc_num, c.score_batch_size, c.score_cfg_scale, c.score_window,
                               max_request_cost=c.max_request_cost), aliases)
    def on_tokens(tokens: int, nfe: int) -> None:
        state.metrics.tokens.inc(tokens)
        state.metrics.nfe.inc(nfe)
        state.tokens_generated += tokens
    serving.on_tokens = on_tokens
    state.serving = serving
    settle_gc()      # the model, tokenizer and libraries are permanent: keep them out of every GC pass
    state.status = "ready"
    log.info("ready: %s (%s) on %s", state.model_name, engine.family, engine.device)


async def _lifecycle(app: web.Application):
    task = asyncio.create_task(_load(app))
    yield
    task.cancel()
    state = app[STATE]
    if state.steps:
        state.steps.stop()
    if state.batcher:
        await state.batcher.close()
    if state.engine is not None and getattr(state.engine, "ranks", None) is not None:
        state.engine.close()          # the follower ranks leave with their worker


def make_app(config: WorkerConfig) -> web.Application:
    app = web.Application(middlewares=middlewares(config.api_key, lambda path: path not in OPEN_PATHS),
                          client_max_size=MAX_BATCH_BYTES)
    app[BODY_BUDGET] = BodyBudget(config.max_body_bytes_in_flight)
    app[BODY_TIMEOUT_S] = config.body_timeout
    state = WorkerState(config)
    state.metrics = WorkerMetrics(state)
    app[STATE] = state
    app[LOAD_FAILED] = asyncio.Event()
    app.cleanup_ctx.append(_lifecycle)
    app[DOOR] = WorkerDoor(app[STATE])
    add_routes(app, app[DOOR])
    app.router.add_post("/worker/batch", worker_batch)
    app.router.add_post("/worker/cancel", worker_cancel)
    app.router.add_post("/worker/load_weights", worker_load_weights)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model)
    app.router.add_get("/batch/stats", batch_stats)
    app.router.add_get("/generation/algorithms", generation_algorithms)
    app.router.add_get("/metrics", metrics)
    return app


async def serve(config: WorkerConfig) -> int:
    """Run until SIGTERM/SIGINT (drain: stop admitting, finish what is running, exit) or a failed model load."""
    raise_open_files()
    app = make_app(config)
    runner = AppRunner(app, handler_cancellation=True, access_log=None, keepalive_timeout=config.keepalive_timeout,
                       send_timeout=config.send_timeout)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        print(f"dllm-serve worker: cannot listen on {config.host}:{config.port}: {e.strerror or e}", file=sys.stderr)
        await runner.cleanup()
        return EXIT_PORT_IN_USE if e.errno == errno.EADDRINUSE else 1
    log.info("worker listening on http://%s:%d (model %s)", config.host, config.port, config.model_path)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):     # SIGHUP: its terminal or SSH session closed
        loop.add_signal_handler(sig, stop.set)
    failed = app[LOAD_FAILED]
    await asyncio.wait([asyncio.create_task(stop.wait()), asyncio.create_task(failed.wait())],
                       return_when=asyncio.FIRST_COMPLETED)
    state = app[STATE]
    code = 1 if failed.is_set() else 0
    # a bound on the whole exit: a thread stuck in the device or a read (a hung file system while loading) would
    # hold the executor's shutdown for ever, and an orphaned worker with it (its supervisor gone)
    limit = config.drain_timeout + 2 * SHUTDOWN_GRACE
    import threading
    timer = threading.Timer(limit, _exit_now, args=(limit,))
    timer.daemon = True
    timer.start()
    if not failed.is_set():
        state.status = "draining"
        log.info("draining (up to %.0f s)", config.drain_timeout)
        try:
            async with asyncio.timeout(config.drain_timeout):
                while state.active or (state.batcher and (state.batcher.pending or state.batcher.running)):
                    await asyncio.sleep(0.05)
        except TimeoutError:
            # what is left is dropped now, not after the shutdown's grace: its rows are cancelled and its
            # connections closed (a balancer re-dispatches the requests it had not streamed yet)
            log.warning("drain timeout: %d requests still open are dropped", len(state.streams))
            for task in list(state.streams):
                task.cancel()
            await asyncio.sleep(0)
    await runner.cleanup()
    return code


def _exit_now(limit: float) -> None:
    log.error("the worker did not end within %.0f s of its stop (--drain-timeout + %.0f s): exiting now", limit,
              2 * SHUTDOWN_GRACE)
    logging.shutdown()
    os._exit(1)


def run(config: WorkerConfig) -> int:
    try:
        import uvloop
        return uvloop.run(serve(config))
    except ImportError:
        return asyncio.run(serve(config))
