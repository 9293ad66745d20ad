"""Worker app in-process (pytest-aiohttp) on the tiny fixture, and the batcher with a fault-injecting engine."""
import asyncio
import time

import orjson
import pytest
import torch

from tests.conftest import TINY_LLADA, TINY_SDAR
from worker.app import STATE, WorkerConfig, make_app
from worker.scheduler import Job, RowScheduler
from worker.engine import GenerationParams, Result


async def ready_client(aiohttp_client, **kw):
    client = await aiohttp_client(make_app(WorkerConfig(model_path=str(TINY_LLADA), device="cpu", **kw)))
    first = await (await client.get("/health")).json()
    await wait_ready(client)
    return client, first


async def running(client):
    """The worker app's state, once its scheduler runs a row (up to 4 s)."""
    state = client.server.app[STATE]
    for _ in range(400):
        if state.batcher.running:
            break
        await asyncio.sleep(0.01)
    return state


async def wait_ready(client) -> None:
    for _ in range(600):
        h = await (await client.get("/health")).json()
        if h["status"] == "ready":
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(h)


async def test_health_loading_then_ready_and_status_endpoints(aiohttp_client, monkeypatch):
    import threading
    from worker.engine import Engine
    gate, load = threading.Event(), Engine.from_pretrained
    monkeypatch.setattr(Engine, "from_pretrained", lambda *a, **k: (gate.wait(30), load(*a, **k))[1])
    client = await aiohttp_client(make_app(WorkerConfig(model_path=str(TINY_LLADA), device="cpu")))
    loading = await client.get("/health")     # the model is held back: /health answers at once, "loading"
    assert loading.status == 200 and (await loading.json())["status"] == "loading"
    r = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
    assert r.status == 503
    gate.set()
    await wait_ready(client)
    h = await (await client.get("/health")).json()
    assert h["model"] == str(TINY_LLADA.resolve()) and h["family"] == "llada" and h["device"] == "cpu"
    assert {"busy", "running_batch_size", "queue_depth", "seconds_since_last_step"} <= set(h)
    models = await (await client.get("/v1/models")).json()
    m = models["data"][0]
    assert m["id"] == str(TINY_LLADA.resolve()) and m["max_model_len"] == 4096
    assert {"object", "created", "owned_by", "root"} <= set(m)
    algos = await (await client.get("/generation/algorithms")).json()
    basic = next(a for a in algos["algorithms"] if a["name"] == "basic")
    assert basic["exact"] is True and "steps" in basic["parameters"]
    assert algos["defaults"]["block_length"] == 32
    r = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
    assert r.status == 200
    metrics = await (await client.get("/metrics")).text()
    assert "dllm_worker_batch_size_bucket" in metrics and "dllm_worker_queue_depth" in metrics
    # continuous batching answers a row as soon as it is done: its batch may still be finishing, so wait for it
    for _ in range(100):
        stats = await (await client.get("/batch/stats")).json()
        if stats["batches_processed"]:
            break
        await asyncio.sleep(0.05)
    assert stats["batches_processed"] >= 1 and stats["max_batch_size"] == 8


async def test_errors_have_the_openai_shape(aiohttp_client):
    client, _ = await ready_client(aiohttp_client)
    for method, path, body, status in [
        ("post", "/v1/completions", b"{not json", 400),
        ("post", "/v1/completions", b"[1, 2]", 400),
        ("post", "/v1/completions", orjson.dumps({"prompt": "x", "generation_algorithm": "warp"}), 400),
        ("post", "/v1/completions", orjson.dumps({"prompt": [1, 99999]}), 400),
        ("post", "/v1/completions", orjson.dumps({"prompt": "x", "model": "other"}), 404),
        ("post", "/v1/completions", orjson.dumps({"prompt": [1] * 4000, "max_tokens": 200}), 400),
        ("get", "/nope", None, 404),
        ("get", "/v1/completions", None, 405),
    ]:
        r = await getattr(client, method)(path, data=body)
        assert r.status == status, (path, body, await r.text())
        err = (await r.json())["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]


async def test_endpoints_not_served_say_so(aiohttp_client):
    """/v1/embeddings and the other OpenAI endpoints a diffusion LM server does not have: a 404 that says so."""
    client, _ = await ready_client(aiohttp_client)
    r = await client.post("/v1/embeddings", json={"input": "hi", "model": "tiny-llada"})
    err = (await r.json())["error"]
    assert r.status == 404 and err["code"] == "unsupported_endpoint" and "does not serve embeddings" in err["message"]
    r = await client.get("/v1/nonsense")
    err = (await r.json())["error"]
    assert r.status == 404 and err["code"] == "unknown_url" and "/v1/nonsense" in err["message"]


async def test_api_key(aiohttp_client):
    client, _ = await ready_client(aiohttp_client, api_key="sekret")
    r = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
    assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
    r = await client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2},
                          headers={"Authorization": "Bearer sekret"})
    assert r.status == 200
    assert (await client.get("/health")).status == 200


async def test_worker_batch_mixed_requests(aiohttp_client):
    client, _ = await ready_client(aiohttp_client)
    body = {"requests": [
        {"id": "s", "kind": "completion", "body": {"prompt": [1, 2, 3], "max_tokens": 16, "block_length": 4,
                                                   "stream": True, "stream_options": {"include_usage": True}}},
        {"id": "c", "kind": "chat", "body": {"messages": [{"role": "user", "content": "di vo"}], "max_tokens": 4}},
        {"id": "bad", "kind": "completion", "body": {"prompt": "x", "steps": 0}},
        {"id": "bad2", "kind": "embedding", "body": {}},
    ]}
    r = await client.post("/worker/batch", json=body)
    assert r.status == 200 and r.content_type == "application/x-ndjson"
    events = [orjson.loads(line) for line in (await r.read()).splitlines()]
    by = {}
    for ev in events:
        by.setdefault(ev["id"], []).append(ev)
    # every request ends with exactly one line marked "end", its last
    assert all(evs[-1].get("end") is True and not any(e.get("end") for e in evs[:-1]) for evs in by.values())
    assert by["bad"] == [{"id": "bad", "event": "error", "status": 400, "data": by["bad"][0]["data"], "end": True}]
    assert by["bad"][0]["data"]["error"]["param"] == "steps"
    assert by["bad2"][0]["status"] == 400
    # /metrics: each request under its endpoint with its own status and latency, the call under /worker/batch (it
    # counted one 200 per call, whatever its requests got, with no latency; a review's finding)
    r = await client.post("/worker/batch", json={"requests": []})
    assert r.status == 400
    from prometheus_client.parser import text_string_to_metric_families
    fams = {f.name: f for f in text_string_to_metric_families(await (await client.get("/metrics")).text())}
    counts = {(s.labels["endpoint"], s.labels["status"]): s.value for s in fams["dllm_worker_requests"].samples
              if s.name == "dllm_worker_requests_total"}
    assert counts[("/v1/completions", "200")] == 1 and counts[("/v1/completions", "400")] == 1
    assert counts[("unknown", "400")] == 1                # a row of no known kind
    assert counts[("/v1/chat/completions", "200")] == 1
    assert counts[("/worker/batch", "200")] == 1 and counts[("/worker/batch", "400")] == 1
    lat = {s.labels["endpoint"]: s.value for s in fams["dllm_worker_request_latency_seconds"].samples
           if s.name.endswith("_count")}
    assert lat["/v1/completions"] == 1 and lat["/worker/batch"] == 1     # the 200s (a 400 is counted, not timed)
    # a row whose kind is not even a string is its own 400 (a review found the call a 500)
    r = await client.post("/worker/batch", json={"requests": [{"id": "k", "kind": ["chat"], "body": {}}]})
    assert r.status == 200 and orjson.loads((await r.read()).splitlines()[0])["status"] == 400
    assert [e["event"] for e in by["c"]] == ["response"]
    assert by["c"][0]["data"]["object"] == "chat.completion"
    chunks = [e["data"] for e in by["s"]]
    assert all(e["event"] == "chunk" for e in by["s"])
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert sum(1 for t in texts if t) >= 2                       # streamed block by block, not at the end
    assert chunks[-1]["usage"]["completion_tokens"] <= 16
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finals[-1] in ("stop", "length") and all(f is None for f in finals[:-1])


async def test_worker_cancel_drops_a_running_row(aiohttp_client):
    client, _ = await ready_client(aiohttp_client)
    body = {"requests": [{"id": "long", "kind": "completion",
                          "body": {"prompt": [5, 6], "max_tokens": 2048, "block_length": 2048, "ignore_eos": True}}]}
    task = asyncio.create_task(client.post("/worker/batch", json=body))
    state = await running(client)
    # the balancer's /stats sums the rows running from the workers' /health answers (it read a key /health lacks)
    from types import SimpleNamespace
    from balancer.app import _rows_summary
    health = await (await client.get("/health")).json()
    assert _rows_summary([SimpleNamespace(last_health=health, healthy=True)] * 2)["rows_running"] == 2
    r = await client.post("/worker/cancel", json={"ids": [{}]})           # (was a 500: an unhashable id)
    assert r.status == 400 and (await r.json())["error"]["param"] == "ids"
    r = await client.post("/worker/cancel", json={"ids": ["long", "unknown"]})
    assert (await r.json()) == {"cancelled": 1}
    resp = await asyncio.wait_for(task, 30)
    events = [orjson.loads(line) for line in (await resp.read()).splitlines()]
    assert len(events) == 1 and events[0]["id"] == "long" and events[0]["end"] is True
    assert events[0]["data"]["choices"][0]["nfe"] < 2048


class FakeEngine:
    """Raises CUDA OOM for batches above ``limit`` rows; otherwise echoes the prompt."""

    def __init__(self, limit):
        self.limit, self.calls = limit, []

    def generate(self, reqs, hooks=None, feed=None):
        self.calls.append(len(reqs))
        if len(reqs) > self.limit:
            raise torch.cuda.OutOfMemoryError("simulated")
        out = [Result(list(r.prompt_ids), "length", 1, list(r.prompt_ids), len(r.prompt_ids)) for r in reqs]
        for i, r in enumerate(out if feed is not None else ()):     # continuous batching: answered as they end
            feed.done(i, r)
        return out


@pytest.mark.parametrize("limit", [2, 0])
async def test_oom_is_retried_in_smaller_pieces(limit):
    engine = FakeEngine(limit)
    b = RowScheduler(engine, batch_size=8, max_wait_time=0.01)
    b.start()
    got = {}
    jobs = [Job([i], GenerationParams(), sink=lambda i, kind, payload: got.setdefault(i, (kind, payload)), index=i)
            for i in range(8)]
    for j in jobs:
        b.submit(j)
    await b.idle()
    await asyncio.sleep(0.05)
    await b.close()
    assert engine.calls[0] == 8
    if limit:
        assert all(got[i] == ("done", Result([i], "length", 1, [i], 1)) for i in range(8))
        assert engine.calls == [8, 4, 2, 2, 4, 2, 2]
    else:   # not even one row fits: each row gets a 503, none is lost
        assert all(got[i][0] == "error" and got[i][1][0] == 503 for i in range(8))


async def test_a_row_cancelled_before_scheduling_is_not_computed():
    engine = FakeEngine(limit=100)
    b = RowScheduler(engine, batch_size=4, max_wait_time=0.05)
    b.start()
    got = {}
    jobs = [Job([i], GenerationParams(), sink=lambda i, kind, payload: got.setdefault(i, (kind, payload)), index=i)
            for i in range(3)]
    for j in jobs:
        b.submit(j)
    b.cancel(jobs[1])                 # its client went away while it waited
    await b.idle()
    await asyncio.sleep(0.05)
    await b.close()
    assert engine.calls == [2] and b.dropped_before_start == 1
    assert got[1] == ("done", Result([], "cancelled", 0, [], 1))    # still ends, so its request can finish
    assert got[0][1].nfe == got[2][1].nfe == 1


class SlowEngine(FakeEngine):
    """A FakeEngine whose batch takes ``seconds`` on the device thread."""

    def __init__(self, seconds):
        super().__init__(limit=100)
        self.seconds = seconds

    def generate(self, reqs, hooks=None, feed=None):
        import time
        time.sleep(self.seconds)
        return super().generate(reqs, hooks, feed)


@pytest.mark.parametrize("continuous", [True, False])
async def test_a_queued_row_cancelled_while_a_batch_runs_is_answered_at_once(continuous):
    """Its terminal event comes at once, not when the running batch ends (under steady load, never)."""
    import time
    b = RowScheduler(SlowEngine(1.5), batch_size=1, max_wait_time=0.0, continuous=continuous)
    b.start()
    got = {}
    jobs = [Job([i], GenerationParams(), sink=lambda i, kind, payload: got.setdefault(i, (kind, payload, time.monotonic())),
                index=i) for i in range(2)]
    for j in jobs:
        b.submit(j)
    while not b.running:
        await asyncio.sleep(0.01)
    t = time.monotonic()
    b.cancel(jobs[1])
    assert b.queue_depth == 0
    await asyncio.sleep(0.1)
    assert got[1][:2] == ("done", Result([], "cancelled", 0, [], 1)) and got[1][2] - t < 0.1
    assert 0 not in got                  # the running row is still running
    await b.idle()
    await b.close()
    assert got[0][0] == "done" and b.dropped_before_start == 1


async def test_a_batch_past_the_request_timeout_ends_its_stream_with_504_lines(aiohttp_client):
    """The requests still open get a 504 line each and the NDJSON stream ends properly (a second HTTP response was
    once written into it, and the connection left open)."""
    client, _ = await ready_client(aiohttp_client, request_timeout=0.5)
    body = {"requests": [{"id": "long", "kind": "completion",
                          "body": {"prompt": [5, 6], "max_tokens": 2048, "block_length": 2048, "ignore_eos": True}},
                         {"id": "short", "kind": "completion", "body": {"prompt": [5, 6], "max_tokens": 2}}]}
    r = await asyncio.wait_for(client.post("/worker/batch", json=body), 30)
    assert r.status == 200
    events = [orjson.loads(line) for line in (await asyncio.wait_for(r.read(), 30)).splitlines()]
    ends = {e["id"]: e for e in events if e.get("end")}
    assert set(ends) == {"long", "short"} and len(events) == 2
    assert ends["long"]["event"] == "error" and ends["long"]["status"] == 504
    assert "--request-timeout" in ends["long"]["data"]["error"]["message"]


@pytest.mark.slow          # (5 s: the fast tier stays under 3 minutes)
async def test_a_responses_stream_past_the_timeout_ends_with_openais_error_event(aiohttp_client):
    """A Responses stream that fails once open ends with `event: error` and a typed error (it was an unnamed data
    line holding the chat streams' error body), then `response.failed`, as OpenAI's: the response the stream showed,
    its status "failed", its error set and its output the message written so far (a client reading the events, not the openai client, which raises at the
    error, ended without a terminal event). The model is slowed (a test double: 20 ms a forward), so the 4,000
    tokens cannot finish inside the 5 s while the first block (4 forwards) is streamed well inside it, even on a loaded
    machine (a 1 s timeout failed on one: the first block came later)."""
    import time
    from worker.app import STATE
    client, _ = await ready_client(aiohttp_client, request_timeout=5.0)
    model = client.server.app[STATE].engine.model
    forward = model.forward
    model.forward = lambda *a, **k: (time.sleep(0.02), forward(*a, **k))[1]
    r = await client.post("/v1/responses", json={"input": "di vo", "max_output_tokens": 4000, "block_length": 4,
                                                  "ignore_eos": True, "stream": True})
    text = (await asyncio.wait_for(r.read(), 30)).decode()
    assert r.status == 200 and "response.output_text.delta" in text, text[:300]
    events = text.strip().split("\n\n")
    err, failed = events[-2].split("\n"), events[-1].split("\n")
    before, created = orjson.loads(events[-3].split("\n")[1][6:]), orjson.loads(events[0].split("\n")[1][6:])
    assert err[0] == "event: error" and err[1].startswith("data: ")
    data = orjson.loads(err[1][6:])
    assert data["type"] == "error" and data["code"] == "timeout" and "--request-timeout" in data["message"]
    assert data["error"]["type"] == "timeout"
    assert data["sequence_number"] == before["sequence_number"] + 1       # (OpenAI's ResponseErrorEvent has one)
    assert failed[0] == "event: response.failed"
    end = orjson.loads(failed[1][6:])
    assert end["type"] == "response.failed" and end["sequence_number"] == data["sequence_number"] + 1
    r = end["response"]
    assert r["id"] == created["response"]["id"] and r["status"] == "failed"
    assert r["error"]["code"] == "timeout" and "--request-timeout" in r["error"]["message"]
    # its output is what the stream wrote (it repeated the created response's `output: []`: a review)
    streamed = "".join(orjson.loads(e.split("\n")[1][6:])["delta"] for e in events
                       if e.startswith("event: response.output_text.delta"))
    (item,) = r["output"]
    assert streamed and item["type"] == "message" and item["status"] == "incomplete" and item["role"] == "assistant"
    assert item["content"] == [{"type": "output_text", "text": streamed, "annotations": []}]
    added = next(orjson.loads(e.split("\n")[1][6:]) for e in events if e.startswith("event: response.output_item.added"))
    assert item["id"] == added["item"]["id"]


async def test_responses_objects_as_openai_writes_them(aiohttp_client):
    """A review against OpenAI's Responses objects: the message cut by max_output_tokens is "incomplete" (it said
    "completed" inside an incomplete response), ids are resp_... and msg_..., metadata is echoed (it came back {}),
    `reasoning: {"effort": null}` is taken (refused), a stored prompt template is refused (it was ignored), and an
    input item that is not a text message is named as such (it was "input: Input should be a valid string")."""
    client, _ = await ready_client(aiohttp_client)
    body = {"input": "di vo", "max_output_tokens": 8, "block_length": 8, "ignore_eos": True,
            "metadata": {"trace": "abc"}, "reasoning": {"effort": None}}
    r = await client.post("/v1/responses", json=body)
    assert r.status == 200, await r.text()
    resp = await r.json()
    assert resp["status"] == "incomplete" and resp["output"][0]["status"] == "incomplete"
    assert resp["output"][0]["content"][0]["text"] and resp["metadata"] == {"trace": "abc"}
    assert resp["id"].startswith("resp_") and resp["output"][0]["id"].startswith("msg_")
    assert resp["top_p"] == 1.0
    r = await client.post("/v1/responses", json={**body, "top_p": 0.9})      # greedy: the filter changes nothing
    assert r.status == 200 and (await r.json())["top_p"] == 0.9                # (it was echoed as 1.0)
    r = await client.post("/v1/responses", json={**body, "stream": True})
    events = [orjson.loads(e.split("\n")[1][6:]) for e in (await r.text()).strip().split("\n\n")]
    done = next(e for e in events if e["type"] == "response.output_item.done")
    assert done["item"]["status"] == "incomplete" and events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["status"] == "incomplete"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for bad, param, words in (
            ({"prompt": {"id": "pmpt_1"}}, "prompt", "no stored prompt templates"),
            ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input.0",
             "input items of type 'function_call_output' are not supported"),
            ({"input": [{"role": "tool", "content": "x"}]}, "input.0", "role 'tool' are not supported"),
            ({"metadata": {"k" * 65: "v"}}, "metadata", "at most 64 characters"),
            ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "")):
        r = await client.post("/v1/responses", json={**body, **bad})
        err = (await r.json())["error"]
        assert r.status == 400 and err["param"] == param and words in err["message"], (bad, err)


async def test_the_default_id_is_the_checkpoint_path_and_its_name_an_alias(aiohttp_client):
    """As vLLM: a client on this machine resolves the id to the tokenizer (AutoTokenizer.from_pretrained(id)) with
    its defaults, offline; the directory's name, the id before, still works in requests."""
    client, _ = await ready_client(aiohttp_client)
    path = str(TINY_LLADA.resolve())
    assert [m["id"] for m in (await (await client.get("/v1/models")).json())["data"]] == [path]
    for name in (path, "tiny-llada"):
        assert (await (await client.get("/v1/models/" + name)).json())["id"] == name    # /v1/models//abs/path too
        r = await client.post("/v1/completions", json={"model": name, "prompt": [1, 2], "max_tokens": 2})
        assert r.status == 200 and (await r.json())["model"] == path


async def test_several_served_names_and_models_retrieve(aiohttp_client):
    client, _ = await ready_client(aiohttp_client, served_model_name="tiny-llada,llada-8b-instruct")
    listed = (await (await client.get("/v1/models")).json())["data"]
    assert [m["id"] for m in listed] == ["tiny-llada"]                     # the first name is reported
    card = await (await client.get("/v1/models/llada-8b-instruct")).json()
    assert card["id"] == "llada-8b-instruct" and card["object"] == "model"
    r = await client.post("/v1/completions", json={"model": "llada-8b-instruct", "prompt": [1, 2], "max_tokens": 2})
    assert r.status == 200 and (await r.json())["model"] == "tiny-llada"
    r = await client.get("/v1/models/gpt-4")
    assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
    r = await client.post("/v1/completions", json={"model": "gpt-4", "prompt": [1, 2], "max_tokens": 2})
    err = (await r.json())["error"]          # OpenAI's shape for it: 404, invalid_request_error, model_not_found
    assert r.status == 404 and (err["type"], err["code"], err["param"]) == ("invalid_request_error",
                                                                           "model_not_found", "model")


def test_the_demo_model_ships_no_custom_code_reference():
    import json

    from common.resolve import DEMO_MODEL
    assert "auto_map" not in json.loads((DEMO_MODEL / "config.json").read_text())


@pytest.mark.parametrize("stop, text, ids", [("8", "1 2 5 ", [1, 2, 3, 4]), (" 8", "1 2 5", [1, 2, 3]),
                                             ("2 5", "1 ", [1, 2]), ("1", "", []), ("5 8", "1 2 ", [1, 2, 3])])
def test_stop_strings_count_the_tokens_of_the_text_returned(stop, text, ids):
    """The fewest tokens whose text covers the text returned: a token the stop string begins inside counts (part of
    its text is returned: it once had text returned and no token), one wholly in the stop string does not."""
    from types import SimpleNamespace

    from worker.serving import _Choice
    pieces = {1: "1", 2: " 2", 3: " 5", 4: " 8", 5: " 9"}
    c = _Choice(lambda toks: "".join(pieces[t] for t in toks), [stop])
    c.finish(SimpleNamespace(nfe=5, token_ids=[1, 2, 3, 4, 5], finish_reason="length"))
    assert (c.text, c.token_ids, c.finish_reason) == (text, ids, "stop")


async def test_streamed_answers_count_their_tokens(aiohttp_client):
    """/health tokens_generated and the completion-tokens counter count every answer, a stream whose client did not
    ask for usage too (they counted only answers that carried usage)."""
    client, _ = await ready_client(aiohttp_client)
    r = await client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 4, "stream": True,
                                                    "return_token_ids": True, "ignore_eos": True})
    chunks = [orjson.loads(line[6:]) for line in (await r.text()).split("\n")
              if line.startswith("data: {")]
    ids = [c["choices"][0]["token_ids"] for c in chunks if c["choices"] and "token_ids" in c["choices"][0]]
    assert ids and len(ids[0]) == 4
    assert (await (await client.get("/health")).json())["tokens_generated"] == 4
    text = await (await client.get("/metrics")).text()
    assert "dllm_worker_completion_tokens_total 4.0" in text


async def test_large_bodies_are_prepared_off_the_event_loop_and_long_prompts_fail_at_the_first(aiohttp_client):
    """A 60 MB request of 300 prompts, each too long for the context, held the event loop for 41 s (every prompt
    was encoded before any was checked): /health went unanswered and the balancer took the worker out. Now a body
    over INLINE_BYTES is prepared on the large-body thread (common/openai_http.py), and the first prompt past the
    context ends the request."""
    import threading

    from common.openai_http import INLINE_BYTES
    client, _ = await ready_client(aiohttp_client)
    serving = client.server.app[STATE].serving
    where, encoded = [], []
    prepare, tok = serving.prepare, serving.tok

    class Counting:
        def __call__(self, text, **kw):
            encoded.append(len(text))
            return tok(text, **kw)

        def __getattr__(self, name):
            return getattr(tok, name)

    def recording(*a, **kw):
        where.append(threading.current_thread().name)
        return prepare(*a, **kw)
    serving.prepare, serving.tok = recording, Counting()
    try:
        r = await client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 1})
        assert r.status == 200 and where == [threading.current_thread().name]       # small: on the loop
        long = "di vo " * (serving.max_prompt_chars // 6 - 1)       # under the character guard, over the context
        assert len(long) * 4 > INLINE_BYTES
        r = await client.post("/v1/completions", json={"prompt": [long] * 4, "max_tokens": 1})
        err = (await r.json())["error"]
        assert r.status == 400 and err["param"] == "prompt" and "your request has" in err["message"]
        assert where[-1].startswith("large-body") and len(encoded) == 1
        body = {"requests": [{"id": f"r{i}", "kind": "completion", "body": {"prompt": [long, "x"], "max_tokens": 1}}
                             for i in range(2)] + [{"id": "ok", "kind": "completion",
                                                    "body": {"prompt": [5, 6], "max_tokens": 1}}]}
        r = await client.post("/worker/batch", json=body)
        events = {e["id"]: e for e in map(orjson.loads, (await r.read()).splitlines())}
        assert where[-1].startswith("large-body") and len(encoded) == 3
        assert events["r0"]["status"] == events["r1"]["status"] == 400 and events["ok"]["event"] == "response"
    finally:
        serving.prepare, serving.tok = prepare, tok


async def test_a_request_larger_than_the_queue_is_a_400_not_a_429_forever(aiohttp_client):
    """5 rows on a worker that queues 4 got 429 "queue full" on an idle worker, which a client retries forever."""
    client, _ = await ready_client(aiohttp_client, max_queue=4)
    r = await client.post("/v1/completions", json={"prompt": [[5, 6]] * 5, "max_tokens": 2})
    err = (await r.json())["error"]
    assert r.status == 400 and err["param"] == "n" and "--max-queue" in err["message"]
    r = await client.post("/v1/completions", json={"prompt": [5, 6], "n": 4, "max_tokens": 2})
    assert r.status == 200 and len((await r.json())["choices"]) == 4


async def test_rows_a_full_queue_refuses_in_a_batch_are_not_counted_as_answered(aiohttp_client):
    """A review: a worker counted every row of a balancer's batch it refused 429 for a full queue (which the balancer
    sends again) as a request answered 429: 25 "failures" for 12 requests that all succeeded."""
    client, _ = await ready_client(aiohttp_client, max_queue=4)
    body = {"requests": [{"id": f"r{i}", "kind": "completion", "body": {"prompt": [5, 6], "max_tokens": 2}}
                         for i in range(6)]}
    r = await client.post("/worker/batch", json=body)
    events = [orjson.loads(x) for x in (await r.read()).splitlines()]
    refused = sum(1 for e in events if e.get("status") == 429)
    assert refused == 2, events
    text = await (await client.get("/metrics")).text()
    assert 'dllm_worker_requests_total{endpoint="/v1/completions",status="200"} 4.0' in text
    assert 'status="429"' not in text and "dllm_worker_batch_rows_refused_total 2.0" in text


async def test_after_running_out_of_memory_both_halves_end_under_steady_load():
    """A continuous batch that runs out of memory is retried as two halves. The first half used to run as a new
    continuous batch, taking rows from the queue; under steady load it never ended, and the second half (already out
    of the queue, counted as running, not cancellable there) was never answered while later requests were (a
    reviewer's finding: 560 of 563 later rows answered, two of the first four never). The halves now run as static
    batches. (A simulated device; the out-of-memory error is a test double.)"""
    from worker.simulated import SimulatedEngine
    from tests.conftest import TINY_LLADA
    eng = SimulatedEngine(TINY_LLADA, 0.002, 0.0, per_step=True)
    real, oom = eng.generate, [True]

    def generate(requests, **kw):
        if oom[0] and len(requests) >= 4:
            oom[0] = False
            raise torch.cuda.OutOfMemoryError("simulated")
        return real(requests, **kw)
    eng.generate = generate
    b = RowScheduler(eng, batch_size=4, max_wait_time=0.05)
    b.start()
    done = {}
    p = GenerationParams(gen_length=8, block_length=8, steps=8)

    def sink(i, kind, payload):
        if kind in ("done", "error"):
            done[i] = kind
    try:
        for i in range(4):               # one batch of 4: it runs out of memory, halves [0, 1] and [2, 3]
            b.submit(Job([5, 6, 7], p, sink, index=i))
        k, t0 = 100, time.monotonic()
        while time.monotonic() - t0 < 1.5:  # steady load: a row every 5 ms
            b.submit(Job([5, 6, 7], p, sink, index=k), wait=False)
            k += 1
            await asyncio.sleep(0.005)
        assert not oom[0]
        assert {i: done.get(i) for i in range(4)} == {i: "done" for i in range(4)}
        await b.idle()
        assert b.rates()["rows_running"] == 0 and b.queue_depth == 0
    finally:
        await b.close()


@pytest.mark.parametrize("continuous", [True, False])
async def test_a_failing_event_handler_costs_only_its_own_row(continuous):
    """The scheduler hands a batch's events to the rows' handlers one after the other; a handler that raised (a
    bug) dropped the events after it in the same hand-over, other rows' answers among them, or ended the
    scheduler's loop (a reviewer's suspicion). It is logged and the other rows are answered."""
    engine = FakeEngine(limit=100)
    b = RowScheduler(engine, batch_size=4, max_wait_time=0.05, continuous=continuous)
    b.start()
    got = {}

    def sink(i, kind, payload):
        if i == 0:
            raise RuntimeError("a broken handler (test double)")
        got[i] = kind
    try:
        for i in range(4):
            b.submit(Job([i], GenerationParams(), sink=sink, index=i))
        await b.idle()
        await asyncio.sleep(0.05)
        assert got == {1: "done", 2: "done", 3: "done"}
        b.submit(Job([9], GenerationParams(), sink=sink, index=9))      # the scheduler goes on
        await b.idle()
        await asyncio.sleep(0.05)
        assert got[9] == "done"
    finally:
        await b.close()


async def test_a_requests_own_stop_token_ids_end_its_choice(aiohttp_client):
    """vLLM's stop_token_ids were ignored without a word (a reviewer's finding): they end a choice as the model's
    stop tokens do, also with ignore_eos (which silences only the model's); an id outside the vocabulary is a 400."""
    client, _ = await ready_client(aiohttp_client)
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 16, "ignore_eos": True, "return_token_ids": True, "seed": 1}
    full = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]
    ids = full["token_ids"]
    k = len(ids) // 2
    stop = ids[k]
    r = await client.post("/v1/completions", json={**body, "stop_token_ids": [stop]})
    got = (await r.json())["choices"][0]
    assert r.status == 200 and got["finish_reason"] == "stop" and got["token_ids"] == ids[:ids.index(stop)]
    many = [stop] + [t for t in range(290) if t not in ids]          # many ids (a scan of the window, not of them)
    r = await client.post("/v1/completions", json={**body, "stop_token_ids": many})
    assert (await r.json())["choices"][0]["token_ids"] == got["token_ids"]
    r = await client.post("/v1/completions", json={**body, "stop_token_ids": [10 ** 6]})
    assert r.status == 400 and (await r.json())["error"]["param"] == "stop_token_ids"


async def test_a_batch_whose_balancer_left_counts_each_request_once(aiohttp_client):
    """/metrics counted each row of a /worker/batch call the balancer left as 499, and again as 200 when its
    cancelled run ended (a reviewer's finding)."""
    from prometheus_client.parser import text_string_to_metric_families
    client = await aiohttp_client(make_app(WorkerConfig(model_path=str(TINY_LLADA), device="cpu")),
                                  server_kwargs={"handler_cancellation": True})       # as the worker serves
    await wait_ready(client)
    body = {"requests": [{"id": f"r{i}", "kind": "completion", "body": {"prompt": [5, 6], "max_tokens": 1024,
                                                                         "block_length": 1024, "ignore_eos": True}}
                         for i in range(2)]}
    task = asyncio.create_task(client.post("/worker/batch", json=body))
    state = await running(client)
    (await task).close()                            # the balancer goes away (its connection closed)
    for _ in range(400):
        if not state.batcher.running and not state.runs:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    fams = {f.name: f for f in text_string_to_metric_families(await (await client.get("/metrics")).text())}
    counts = {(s.labels["endpoint"], s.labels["status"]): s.value for s in fams["dllm_worker_requests"].samples
              if s.name == "dllm_worker_requests_total" and s.labels["endpoint"] == "/v1/completions"}
    assert counts == {("/v1/completions", "499"): 2}


@pytest.mark.parametrize("kw, block", [
    ({"model_path": str(TINY_LLADA), "default_block_length": 16}, 16),   # the server's flag, not the registry's 32
    ({"model_path": str(TINY_SDAR)}, 4),                                 # the checkpoint's block_size first
    ({"model_path": str(TINY_LLADA), "simulate_device": (0.0, 0.0)}, 32),   # a simulated device answers too
])
async def test_generation_algorithms_shows_the_block_length_requests_get(aiohttp_client, kw, block):
    """/generation/algorithms says which block_length a request without one gets: the checkpoint's block size
    (SDAR), else --default-block-length, at the top and in every algorithm's parameters; the request's tokens are
    those of one that names it."""
    client = await aiohttp_client(make_app(WorkerConfig(device="cpu", **kw)))
    await wait_ready(client)
    r = await client.get("/generation/algorithms")
    assert r.status == 200, await r.text()
    algos = await r.json()
    assert algos["defaults"]["block_length"] == block
    assert algos["algorithms"] and all(a["parameters"]["block_length"]["default"] == block
                                       for a in algos["algorithms"] if "block_length" in a["parameters"])
    if "simulate_device" in kw:
        return
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 16, "return_token_ids": True}
    plain = await (await client.post("/v1/completions", json=body)).json()
    named = await (await client.post("/v1/completions", json={**body, "block_length": block})).json()
    assert plain["choices"][0]["token_ids"] == named["choices"][0]["token_ids"]
    assert plain["choices"][0]["nfe"] == named["choices"][0]["nfe"]


async def test_detokenize_takes_at_most_the_models_context(aiohttp_client):
    """/detokenize decodes at most max_model_len ids (4096 here): a million (the body's limit) held the worker's GIL
    2.7 s each, and eight at once slowed every other request by seconds (a review)."""
    client, _ = await ready_client(aiohttp_client)
    r = await client.post("/detokenize", json={"tokens": [5] * 4096})
    assert r.status == 200 and (await r.json())["prompt"]
    r = await client.post("/detokenize", json={"tokens": [5] * 4097})
    err = (await r.json())["error"]
    assert r.status == 400 and err["param"] == "tokens" and "4096" in err["message"], err


@pytest.mark.slow          # (SDAR): the fast tier stays under 3 minutes
async def test_vllms_template_variables_reasoning_and_answer_changing_extras(aiohttp_client):
    """A review, against vLLM: `chat_template_kwargs` (SDAR's template has `enable_thinking`) and a request's
    `chat_template` were ignored; an assistant message's `reasoning_content` and `tool_calls` were dropped before the
    template (a tool-call turn became an empty one); vLLM's `top_k: 1`, `guided_json`, `min_tokens`, ... gave the
    plain answer with a 200; and a completion's `add_special_tokens` was ignored. Now the template gets the
    variables and the reasoning (the tokens are the model's own apply_chat_template's), and the rest is a 400."""
    from transformers import AutoTokenizer
    from tests.conftest import TINY_SDAR
    client = await aiohttp_client(make_app(WorkerConfig(model_path=str(TINY_SDAR), device="cpu")))
    await wait_ready(client)
    tok = AutoTokenizer.from_pretrained(TINY_SDAR)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes", "reasoning_content": "think hard"},
            {"role": "user", "content": "and?"}]
    want = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, enable_thinking=False,
                                        return_dict=False))
    plain = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert want != plain
    body = {"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}}
    r = await client.post("/tokenize", json=body)
    assert r.status == 200 and (await r.json())["tokens"] == want
    r = await client.post("/v1/chat/completions", json={**body, "max_tokens": 2})
    assert r.status == 200 and (await r.json())["usage"]["prompt_tokens"] == len(want)
    r = await client.post("/tokenize", json={"messages": msgs})
    assert (await r.json())["tokens"] == plain               # the reasoning is rendered either way
    for extra, param in (({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
                         ({"chat_template_kwargs": "x"}, "chat_template_kwargs"), ({"chat_template": "{{ 'X' }}"}, None),
                         ({"min_p": 0.1, "temperature": 0.5}, "min_p"), ({"guided_json": {"type": "object"}}, None),
                         ({"min_tokens": 3}, None),
                         ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]},
                                        {"role": "user", "content": "x"}]}, None)):
        r = await client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, **extra})
        err = (await r.json())["error"]
        assert r.status == 400 and err["type"] == "invalid_request_error", (extra, err)
        assert param is None or param in (err["param"] or ""), (extra, err)
        word = next(iter(extra))
        assert word in err["message"] or "tool_calls" in err["message"], (extra, err)
    for extra in ({"top_k": -1}, {"top_k": 0}, {"min_p": 0}, {"skip_special_tokens": True}, {"top_k": 1},
                  {"top_p": 0.5, "min_p": 0.1}, {"skip_special_tokens": False}):      # (greedy: no filter matters)
        r = await client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, **extra})
        assert r.status == 200, extra
    r = await client.post("/tokenize", json={"messages": msgs, "chat_template": "{{ 'X' }}"})
    assert r.status == 400
    from tests.conftest import fixture_path              # a tokenizer that adds a <bos>: DiffusionGemma's
    dg = await aiohttp_client(make_app(WorkerConfig(model_path=str(fixture_path("tiny-diffusion-gemma")),
                                                    device="cpu")))
    await wait_ready(dg)
    for extra, n in (({"add_special_tokens": True}, 6), ({"add_special_tokens": False}, 5), ({}, 5)):
        r = await dg.post("/v1/completions", json={"prompt": "di vo", "max_tokens": 2, **extra})
        assert (await r.json())["usage"]["prompt_tokens"] == n, extra


async def test_skip_special_tokens_false_keeps_their_text(aiohttp_client):
    """vLLM's skip_special_tokens (NeMo-Skills sends false with every text completion; it was a 400): false keeps
    the special tokens' text in the answer, streamed or not; the default skips it. (A simulated device, whose answer
    repeats the prompt's tokens: one of them the tiny tokenizer's special <|start_header_id|>.)"""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(TINY_LLADA))
    special = tok.convert_tokens_to_ids("<|start_header_id|>")
    client = await aiohttp_client(make_app(WorkerConfig(model_path=str(TINY_LLADA), device="cpu",
                                                        simulate_device=(0.0, 0.0))))
    await wait_ready(client)
    body = {"prompt": [special, 5, 6], "max_tokens": 3, "return_token_ids": True}
    texts = {}
    for keep in (None, True, False):
        extra = {} if keep is None else {"skip_special_tokens": keep}
        r = await client.post("/v1/completions", json={**body, **extra})
        choice = (await r.json())["choices"][0]
        assert r.status == 200 and choice["token_ids"] == [special, 5, 6]
        texts[keep] = choice["text"]
        r = await client.post("/v1/completions", json={**body, **extra, "stream": True})
        streamed = "".join(orjson.loads(line[6:])["choices"][0]["text"] for line in (await r.text()).splitlines()
                           if line.startswith("data: {"))
        assert streamed == texts[keep]
    assert texts[None] == texts[True] == tok.decode([special, 5, 6], skip_special_tokens=True)
    assert texts[False] == tok.decode([special, 5, 6], skip_special_tokens=False) and "<|start_header_id|>" in texts[False]
    r = await client.post("/v1/completions", json={**body, "skip_special_tokens": "no"})
    assert r.status == 400 and (await r.json())["error"]["param"] == "skip_special_tokens"
