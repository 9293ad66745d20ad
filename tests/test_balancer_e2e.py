"""End to end: a real balancer in front of real worker subprocesses on the fixture (kill -9, SIGSTOP, overload,
streaming, disconnects)."""
import asyncio
import os
import signal
import threading
import time
import urllib.request

import openai
import pytest

from tests.conftest import TINY_LLADA
from tests.helpers import Cluster, Tally, get_json, post_json

pytestmark = pytest.mark.slow
FAST_HEALTH = ["--health-check-interval", "0.3", "--health-timeout", "1", "--unhealthy-threshold", "2",
               "--healthy-threshold", "2"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("c"), TINY_LLADA, 2, worker_args=["--batch-size", "16"],
                balancer_args=["--batch-size", "16", "--batch-wait-time", "0.02", *FAST_HEALTH])
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


def aclient(url):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


async def _mixed_load(url, n, max_tokens=16, **extra):
    client = aclient(url)

    async def one(i):
        kw = dict(model="tiny-llada", max_tokens=max_tokens, extra_body={"block_length": 8, **extra})
        if i % 3 == 0:
            r = await client.chat.completions.create(messages=[{"role": "user", "content": "di vo"}], **kw)
            return r.choices[0].finish_reason
        if i % 3 == 1:
            r = await client.completions.create(prompt=[i % 200 + 1, 2, 3], **kw)
            return r.choices[0].finish_reason
        stream = await client.completions.create(prompt=[i % 200 + 1, 5], stream=True, **kw)   # HTTP 200 here
        chunks = []
        try:
            async for c in stream:
                chunks.append(c)
        except openai.APIError as e:          # an SSE error event: the stream's worker died after bytes were sent
            return "midstream-error" if chunks and "cannot be resumed" in str(e) else e
        return chunks[-1].choices[0].finish_reason

    return await asyncio.gather(*[one(i) for i in range(n)], return_exceptions=True)


def test_64_concurrent_clients_are_batched_over_both_workers(cluster):
    results = asyncio.run(_mixed_load(cluster.url, 64))
    assert [r for r in results if r not in ("stop", "length")] == []
    stats = get_json(cluster.url + "/stats")[1]
    cb = stats["centralized_batching"]
    assert cb["total_requests_batched"] >= 64 and cb["avg_batch_size"] > 1
    assert all(w["requests_served"] > 0 for w in stats["workers"])
    assert stats["last_minute"]["requests"] >= 64 and stats["last_minute"]["latency_p50"] is not None
    deadline = time.monotonic() + 8            # the workers' rows, as their next /health probes report them
    while stats["continuous_batching"]["rows_retired_per_s"] == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        stats = get_json(cluster.url + "/stats")[1]
    assert stats["continuous_batching"]["rows_retired_per_s"] > 0 and stats["continuous_batching"]["rows_running"] >= 0
    ws = get_json(cluster.url + "/worker-status")[1]
    assert ws["system_status"] == "normal" and ws["healthy_workers"] == 2
    assert {w["status"] for w in ws["workers"]} <= {"idle", "busy"}
    metrics = urllib.request.urlopen(cluster.url + "/metrics").read().decode()
    assert "dllm_balancer_batch_size_bucket" in metrics and 'dllm_balancer_workers{status="idle"}' in metrics


def test_streaming_and_models_through_the_balancer(cluster):
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model="tiny-llada", prompt=[7, 8, 9], max_tokens=32, extra_body={"block_length": 8, "ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 3
    assert chunks[-1].usage.completion_tokens == 32
    assert client.models.list().data[0].id == str(TINY_LLADA.resolve())   # as vLLM: the path
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-llada", prompt="x", max_tokens=5, extra_body={"steps": 0})
    with pytest.raises(openai.BadRequestError) as e:   # caught by the worker (needs the tokenizer): still a 400
        client.completions.create(model="tiny-llada", prompt=[1] * 4090, max_tokens=64)
    assert "maximum context length is" in str(e.value) and e.value.code == "context_length_exceeded"


def test_step_streaming_through_the_balancer_with_the_openai_client(cluster):
    """stream_mode "steps" (issue 35) through the balancer: the openai client streams the step chunks (their
    diffusion_step in model_extra) with the text, which equals the non-streamed answer."""
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model="tiny-llada", prompt=[7, 8, 9], max_tokens=16, extra_body={"block_length": 8, "steps": 16,
                                                                                "ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    kw["extra_body"] = {**kw["extra_body"], "stream_mode": "steps"}
    chunks = list(client.completions.create(stream=True, **kw))
    steps = [c.choices[0].model_extra["diffusion_step"] for c in chunks
             if c.choices and "diffusion_step" in (c.choices[0].model_extra or {})]
    assert [s["step"] for s in steps] == list(range(1, 17)) and all("canvas" not in s for s in steps)
    assert sum(len(s["committed"]) for s in steps) == 16
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full


def test_responses_api_through_the_balancer(cluster):
    """POST /v1/responses with the openai client: plain, streamed (responses.stream) and a refused feature."""
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model="tiny-llada", max_output_tokens=16, extra_body={"block_length": 8, "ignore_eos": True})
    chat = client.chat.completions.create(model="tiny-llada", max_tokens=16, messages=[
        {"role": "system", "content": "vo"}, {"role": "user", "content": "di refo"}],
        extra_body={"block_length": 8, "ignore_eos": True})
    r = client.responses.create(instructions="vo", input="di refo", **kw)
    assert r.object == "response" and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == chat.choices[0].message.content                  # the same chat completion
    assert r.usage.output_tokens == 16 and r.usage.input_tokens == chat.usage.prompt_tokens
    with client.responses.stream(instructions="vo", input=[{"role": "user", "content": "di refo"}], **kw) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == r.output_text and len(deltas) >= 2
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input="x", tools=[{"type": "web_search"}], model="tiny-llada")
    assert "tools" in str(e.value)


def test_tokenizer_endpoints_through_the_balancer(cluster):
    status, info = get_json(cluster.url + "/tokenizer_info")
    assert status == 200 and info["eos_token"]
    status, r = post_json(cluster.url + "/tokenize", {"prompt": "di vo", "add_special_tokens": False})
    assert status == 200 and r["count"] == len(r["tokens"]) > 0
    status, back = post_json(cluster.url + "/detokenize", {"tokens": r["tokens"]})
    assert status == 200 and back["prompt"] == "di vo"
    assert post_json(cluster.url + "/tokenize", b'{"prompt": NaN}')[0] == 400      # the one JSON language


def test_busy_worker_is_never_marked_unhealthy(cluster):
    body = {"prompt": [5, 6, 7], "max_tokens": 1536, "block_length": 1536, "steps": 300, "ignore_eos": True}
    t = threading.Thread(target=post_json, args=(cluster.url + "/v1/completions", body, 300))
    t.start()
    seen = set()
    while t.is_alive():
        ws = get_json(cluster.url + "/worker-status")[1]
        seen |= {w["status"] for w in ws["workers"]}
        time.sleep(0.1)
    t.join()
    assert "busy" in seen and seen <= {"idle", "busy"}


def test_client_disconnect_cancels_queued_and_running_work(tmp_path):
    c = Cluster(tmp_path, TINY_LLADA, 1, worker_args=["--batch-size", "1"],
                balancer_args=["--batch-size", "1", "--max-inflight-per-worker", "1", *FAST_HEALTH])
    try:
        c.wait_ready()
        long = {"prompt": [5, 6], "max_tokens": 2048, "block_length": 2048, "steps": 600, "ignore_eos": True}

        def give_up_after(seconds):
            req = urllib.request.Request(c.url + "/v1/completions", data=post_body(long))
            with pytest.raises(OSError):
                urllib.request.urlopen(req, timeout=seconds)

        running = threading.Thread(target=give_up_after, args=(4.0,))
        running.start()
        while not get_json(c.workers[0].url + "/health")[1]["busy"]:
            time.sleep(0.02)
        give_up_after(0.5)                  # queued at the balancer behind the running one, then gone
        time.sleep(0.5)
        st = get_json(c.url + "/stats")[1]
        assert st["queue_depth"] == 0 and st["centralized_batching"]["total_requests_batched"] == 1
        running.join()
        deadline = time.monotonic() + 5
        while get_json(c.workers[0].url + "/health")[1]["busy"]:
            assert time.monotonic() < deadline, "the running row was not dropped on the worker"
            time.sleep(0.05)
        assert get_json(c.url + "/stats")[1]["centralized_batching"]["total_requests_batched"] == 1
        assert post_json(c.url + "/v1/completions", {"prompt": [1], "max_tokens": 4})[0] == 200
    finally:
        c.stop()


def post_body(d):
    import json
    return json.dumps(d).encode()


def test_overload_gives_429_and_no_crash(tmp_path):
    c = Cluster(tmp_path, TINY_LLADA, 1, balancer_args=["--batch-size", "1", "--max-inflight-per-worker", "1",
                                                        "--max-queue", "3", *FAST_HEALTH])
    try:
        c.wait_ready()
        body = {"prompt": [5, 6], "max_tokens": 256, "block_length": 256, "steps": 128, "ignore_eos": True}
        results = []
        threads = [threading.Thread(target=lambda: results.append(post_json(c.url + "/v1/completions", body, 120)))
                   for _ in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        codes = sorted(s for s, _ in results)
        Tally("10x overload (20 clients, 1 worker, 1 row at a time, --max-queue 3)", sent=20,
              answered=codes.count(200), errored=len(codes) - codes.count(200), lost=20 - len(codes)).report(
            f"; {codes.count(429)} of the errors are 429 + Retry-After")
        assert codes.count(429) >= 10 and codes.count(200) >= 4 and set(codes) <= {200, 429}, codes
        assert get_json(c.url + "/health")[0] == 200
    finally:
        c.stop()


def _report(name, results, sent):
    ok = sum(r in ("stop", "length") for r in results)
    mid = results.count("midstream-error")
    timed_out = sum(isinstance(r, openai.APITimeoutError) for r in results)
    Tally(name, sent=sent, answered=ok, errored=len(results) - ok - timed_out,
          lost=sent - len(results) + timed_out).report(
        f"; {mid} of the errors are streams whose worker died after sending text (an SSE error event)")


def _load_in_thread(url, n, max_tokens, out):
    out.extend(asyncio.run(_mixed_load(url, n, max_tokens=max_tokens, steps=max_tokens)))


def test_kill_9_of_a_worker_under_load_loses_no_request(tmp_path):
    c = Cluster(tmp_path, TINY_LLADA, 2, worker_args=["--batch-size", "8"],
                balancer_args=["--batch-size", "8", *FAST_HEALTH])
    try:
        c.wait_ready()
        results = []
        t = threading.Thread(target=_load_in_thread, args=(c.url, 64, 128, results))
        t.start()
        victim = c.workers[0]
        while get_json(c.url + "/stats")[1]["workers"][0]["in_flight"] == 0:
            time.sleep(0.02)
        time.sleep(0.3)
        os.kill(victim.p.pid, signal.SIGKILL)
        t.join(300)
        # every request answered 200: complete, or (streams that had already sent text) ended with an SSE error
        _report("kill -9 of 1 of 2 workers under load (64 requests)", results, 64)
        assert len(results) == 64
        assert [r for r in results if r not in ("stop", "length", "midstream-error")] == []
        stats = get_json(c.url + "/stats")[1]
        assert results.count("midstream-error") == stats["failed_midstream"]
        assert stats["redispatched_requests"] > 0
        minute = stats["last_minute"]
        assert minute["requests"] >= 64 and minute["ok"] + stats["failed_midstream"] == minute["requests"]
        assert stats["workers"][0]["status"] == "unhealthy" and stats["workers"][1]["status"] in ("idle", "busy")
    finally:
        c.stop()


def test_likelihood_scoring_through_the_balancer_beside_generation(cluster):
    """lm-eval-shaped loglikelihood requests through the balancer, concurrent with generation requests (they share
    the balancer's and the workers' batches): every score equals the reference golden, every generation answers."""
    from tests.test_scoring_api import CASES, lm_eval_body, lm_eval_parse

    async def go():
        client = aclient(cluster.url)
        scores = [client.completions.create(**{k: v for k, v in lm_eval_body(c).items() if k in (
            "model", "prompt", "temperature", "max_tokens", "logprobs", "seed", "echo")},
            extra_body={"mc_num": c["mc_num"], "mc_batch_size": c["batch_size"], "cfg_scale": c["cfg_scale"]})
            for c in CASES]
        gens = [client.completions.create(model="tiny-llada", prompt=f"p {i}", max_tokens=8) for i in range(8)]
        out = await asyncio.gather(*scores, *gens)
        await client.close()
        return out[:len(CASES)], out[len(CASES):]

    scored, generated = asyncio.run(go())
    for c, r in zip(CASES, scored):
        ll, _ = lm_eval_parse(r.choices[0].model_dump(), len(c["prefix"]))
        assert ll == pytest.approx(c["log_likelihood"], rel=1e-5, abs=1e-4)
    assert all(g.choices[0].finish_reason for g in generated)


def test_a_frozen_worker_is_stalled_in_seconds_and_its_rows_answered_elsewhere(tmp_path):
    """Issue 29, item 5: SIGSTOP a worker holding 32 rows, with the default health settings (probe every 2 s, 5 s
    timeout, --stall-timeout 60). It is `stalled` within 10 s (no step for max(--stall-floor 5 s, 5 x its own step
    time)), its rows are answered by the other worker (none lost, none twice), a small request sent meanwhile is
    answered within 10 s; after SIGCONT it rejoins. Simulated devices (0.02 s a step) so the timing is the
    balancer's, not the CPU's."""
    import json
    import aiohttp
    c = Cluster(tmp_path, TINY_LLADA, 2,
                worker_args=["--simulate-device", "0.02,0", "--simulate-per-step", "--batch-size", "64"],
                balancer_args=["--batch-size", "16", "--batch-wait-time", "0.5", "--no-idle-dispatch"])
    body = {"max_tokens": 128, "block_length": 32, "steps": 128, "ignore_eos": True}    # 128 steps: ~2.6 s
    small = {"prompt": [9, 10], "max_tokens": 4, "steps": 4}

    async def one(s, b, t0=None, url=None):
        async with s.post((url or c.url) + "/v1/completions", json=b, timeout=aiohttp.ClientTimeout(total=90)) as r:
            raw = await r.text()
        done = time.monotonic() - (t0 or 0)
        if not b.get("stream"):
            return r.status, raw and json.loads(raw)["choices"][0]["text"], done
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in raw.splitlines()
                       if line.startswith("data: {") and '"choices"' in line)
        return (r.status if "[DONE]" in raw and '"error"' not in raw else 502), text, done

    try:
        c.wait_ready()
        want = {}

        async def reference():            # each prompt's answer, before any fault, from each worker at once (both
            async with aiohttp.ClientSession() as s:     # then know their step time, which the stall rule needs)
                got = await asyncio.gather(*(one(s, {**body, "prompt": [k + 5, 6]}, url=w.url)
                                             for w in c.workers for k in range(4)))
                assert [g[1] for g in got[:4]] == [g[1] for g in got[4:]]
                want.update((k, g[1]) for k, g in enumerate(got[:4]))
        asyncio.run(reference())
        served0 = sum(w["requests_served"] for w in get_json(c.url + "/stats")[1]["workers"])
        results, small_result, t0 = [], [], []

        async def load():
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                tasks = [asyncio.create_task(one(s, {**body, "prompt": [i % 4 + 5, 6], "stream": i % 2 == 1}))
                         for i in range(48)]
                while not t0:
                    await asyncio.sleep(0.01)
                small_result.append(await one(s, small, t0[0]))
                for i, t in enumerate(tasks):
                    results.append((i, *(await t)))
        loader = threading.Thread(target=lambda: asyncio.run(load()))
        loader.start()
        deadline = time.monotonic() + 30
        while True:                       # 48 rows in flight: 3 batches of 16, 2 on one worker (the victim)
            ws = get_json(c.url + "/stats")[1]["workers"]
            if sum(w["in_flight"] for w in ws) == 48:
                break
            assert time.monotonic() < deadline, ws
            time.sleep(0.02)
        vi = max(range(2), key=lambda i: ws[i]["in_flight"])
        victim = c.workers[vi]
        served_by_other = ws[1 - vi]["requests_served"]
        assert ws[vi]["in_flight"] == 32
        time.sleep(0.3)                   # its rows are running
        os.kill(victim.p.pid, signal.SIGSTOP)
        t0.append(time.monotonic())
        try:
            stalled_after = None
            while stalled_after is None and time.monotonic() - t0[0] < 20:
                if get_json(c.url + "/worker-status")[1]["workers"][vi]["status"] == "stalled":
                    stalled_after = time.monotonic() - t0[0]
                time.sleep(0.05)
            loader.join(60)
            frozen_for = time.monotonic() - t0[0]
        finally:
            os.kill(victim.p.pid, signal.SIGCONT)
        assert stalled_after is not None and stalled_after < 10, stalled_after
        assert not loader.is_alive() and len(results) == 48
        wrong = [(i, s, t) for i, s, t, _ in results if s != 200 or t != want[i % 4]]
        assert wrong == [], wrong                 # every row answered once, its own text (a stream's text once)
        last = max(d for *_, d in results) - t0[0]
        status, text, small_after = small_result[0]
        assert status == 200 and text and small_after < 10, small_result
        stats = get_json(c.url + "/stats")[1]
        assert stats["redispatched_requests"] >= 32
        assert sum(w["requests_served"] for w in stats["workers"]) - served0 == 49          # nothing answered twice
        assert stats["workers"][1 - vi]["requests_served"] - served_by_other >= 16 + 32 + 1  # its own, the victim's
        print(f"\nSTALL SIGSTOP of a worker holding 32 of 48 rows: stalled after {stalled_after:.1f} s; its rows "
              f"answered by the other worker, the last {last:.1f} s after SIGSTOP; a small request sent meanwhile "
              f"answered in {small_after:.1f} s; redispatched {stats['redispatched_requests']}; SIGCONT after "
              f"{frozen_for:.1f} s")
        t1 = time.monotonic()
        while get_json(c.url + "/worker-status")[1]["workers"][vi]["status"] != "idle":
            assert time.monotonic() - t1 < 20, "SIGCONT did not re-admit the worker"
            time.sleep(0.1)
        assert get_json(victim.url + "/health")[1]["running_batch_size"] == 0     # the abandoned rows were dropped
        before = get_json(c.url + "/stats")[1]["workers"][vi]["requests_served"]
        for _ in range(4):                # idle and the longest since a dispatch: it gets work again
            assert post_json(c.url + "/v1/completions", small)[0] == 200
        assert get_json(c.url + "/stats")[1]["workers"][vi]["requests_served"] > before
        print(f"STALL re-admitted {time.monotonic() - t1:.1f} s after SIGCONT")
    finally:
        c.stop()
