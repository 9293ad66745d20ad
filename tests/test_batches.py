"""Offline batch jobs (issue 35): `dllm-serve run-batch` (resumable, every line accounted for) and the OpenAI Files
and Batch APIs on the balancer, driven with the openai client. Workers on the simulated device (a test double: its
answers are the prompt's tokens cycled; the plumbing is what is tested) unless a real model is named."""
import json
import os
import signal
import subprocess
import time

import openai
import orjson
import pytest

from common.batchfile import result_key
from tests.conftest import TINY_LLADA
from tests.helpers import DLLM, ROOT, Cluster, Proc, free_port, get_json, post_json, start_worker

SLOW = ["--simulate-device", "0.15,0", "--batch-size", "4"]      # 0.15 s a batch of up to 4 rows


def _lines(n: int, extra: list[str] = ()) -> str:
    out = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": [5 + i % 50, 6, 7], "max_tokens": 4}}) for i in range(n)]
    return "\n".join(out + list(extra)) + "\n"


BAD = ["{not json", json.dumps({"custom_id": "r1", "url": "/v1/completions", "body": {"prompt": "x"}}),
       json.dumps({"custom_id": "top", "url": "/v1/completions", "body": {"prompt": "x", "frequency_penalty": 0.5}}),
       json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/models", "body": {}})]


def _results(path) -> dict:
    """Result lines by the request line they answer (common.batchfile.result_key); each request line once."""
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        key = result_key(r)
        assert key not in out, f"two results for {key}"
        out[key] = r
    return out


def _run_batch(tmp_path, *args, **kw):
    return subprocess.run([*DLLM, "run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=120, **kw)


def _ctrl_c_as_in_a_terminal() -> None:
    """SIGINT as a command typed in a terminal gets it: a test run started in the background (``cmd &`` in a
    script) passes SIGINT on ignored, and Python then ignores Ctrl-C, as it should for a backgrounded command."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_run_batch_resumes_and_accounts_for_every_line(tmp_path):
    (tmp_path / "in.jsonl").write_text(_lines(24, BAD))
    dead = f"http://127.0.0.1:{free_port()}"
    r = _run_batch(tmp_path, "--url", dead)
    assert r.returncode == 1 and "3 refused lines, 0 answered 5xx or still busy and 25 without an answer" in r.stderr, \
        r.stderr
    res = _results(tmp_path / "out.jsonl")
    assert len(res) == 28 and res["r3"]["error"]["code"] == "server_unreachable"
    # 0.3 s a batch of 4: the interruption below comes after the first batch, with 5 batches (1.5 s) to spare
    w = start_worker(tmp_path, TINY_LLADA, "--simulate-device", "0.3,0", "--batch-size", "4")
    try:
        w.wait_ready()
        p = subprocess.Popen([*DLLM, "run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                              "--url", w.url, "--concurrency", "4"], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_as_in_a_terminal)
        deadline = time.monotonic() + 30      # interrupted half-way (Ctrl-C)
        while sum(1 for r in _results(tmp_path / "out.jsonl").values() if r["response"]) < 4:
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.02)
        p.send_signal(signal.SIGINT)
        p.wait(30)
        answered = sum(1 for r in _results(tmp_path / "out.jsonl").values() if r["response"])
        assert 4 <= answered < 25
        r = _run_batch(tmp_path, "--url", w.url)
        assert r.returncode == 0, r.stderr
        assert f"{3 + answered} already done" in r.stderr and f"{25 - answered} to send" in r.stderr, r.stderr
    finally:
        w.stop()
    res = _results(tmp_path / "out.jsonl")
    refused = sorted(k for k in res if k.startswith("error:"))
    assert set(res) == {f"r{i}" for i in range(24)} | {"top"} | set(refused) and len(refused) == 3
    assert [res[k]["error"]["code"] for k in refused] == ["invalid_json", "duplicate_custom_id", "invalid_method"]
    for i in range(24):
        body = res[f"r{i}"]["response"]["body"]
        assert res[f"r{i}"]["response"]["status_code"] == 200 and body["choices"][0]["finish_reason"] == "length"
    assert res["top"]["response"]["status_code"] == 400 and res["top"]["response"]["body"]["error"]["param"] == "frequency_penalty"


def test_run_batch_retries_a_busy_server_and_exits_1_while_lines_lack_a_final_result(tmp_path):
    """A 429 was recorded as final (never sent again), a run whose lines were answered 5xx exited 0 (the docs: 0 only
    when every line has a final result), and a refused line fixed since kept its old error beside its new answer
    (three results for two requests). A local HTTP server (a test double) answers: 429 twice for "busy", 500 for
    "boom", else 200."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from dllm_serve.batch import run
    tries = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            p = body["prompt"]
            tries[p] = tries.get(p, 0) + 1
            status = 429 if p in ("busy", "patient") and tries[p] <= 2 else 500 if p == "boom" else 200
            data = json.dumps({"error": {"message": "x"}} if status != 200 else {"choices": [{"text": p}]}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Retry-After", "60" if p == "patient" else "0.1")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"

    def line(cid, prompt):
        return json.dumps({"custom_id": cid, "url": "/v1/completions", "body": {"prompt": prompt}})
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    try:
        inp.write_text("\n".join([line("a", "busy"), "{not json", line("c", "boom")]) + "\n")
        assert run(str(inp), str(out), url, None, [], None, 4, 30, 30, lambda m: None) == 1     # c: a 500
        res = _results(out)
        assert res["a"]["response"]["status_code"] == 200 and tries["busy"] == 3
        assert res["c"]["response"]["status_code"] == 500 and "error:line 2: not JSON" in "".join(res)
        inp.write_text("\n".join([line("a", "busy"), line("b", "fine"), line("c", "fine")]) + "\n")
        assert run(str(inp), str(out), url, None, [], None, 4, 30, 30, lambda m: None) == 0
        res = _results(out)
        assert set(res) == {"a", "b", "c"} and all(r["response"]["status_code"] == 200 for r in res.values())
        assert tries["busy"] == 3                                   # a's answer was final: not sent again
        inp.write_text(line("d", "patient") + "\n")                  # a Retry-After of 60 s, waited at most 0.2 s
        t0 = time.monotonic()
        assert run(str(inp), str(out), url, None, [], None, 4, 30, 30, lambda m: None, retry_wait_max=0.2) == 0
        assert tries["patient"] == 3 and time.monotonic() - t0 < 10
    finally:
        server.shutdown()


def test_run_batch_stops_at_a_refusal_of_the_run_and_resends_those_lines_later(tmp_path):
    """A wrong --url (the OpenAI base URL form, ending in /v1: every line posted to /v1/v1/...) or a missing key
    answered every line 404 or 401, and those answers were final: exit 0, and a rerun with the right settings sent
    nothing. They are not final now, the run stops at the first (no other line is sent) and exits 1; a 404 about
    the model stays a final answer of its line. A local HTTP server (a test double) answers like ours."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from dllm_serve.batch import run
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(self.path)
            if self.headers.get("Authorization") != "Bearer k":
                status, data = 401, {"error": {"message": "a missing or wrong API key", "code": "invalid_api_key"}}
            elif self.path != "/v1/completions":     # (as ours: the endpoints it serves named, /v1/models too)
                status, data = 404, {"error": {"message": f"no such endpoint: {self.path} (this server serves "
                                                          f"/v1/completions, /v1/models)", "code": "unknown_url"}}
            elif body.get("model") == "nope":
                status, data = 404, {"error": {"message": "The model `nope` does not exist.",
                                               "code": "model_not_found"}}
            else:
                status, data = 200, {"choices": [{"text": body["prompt"]}]}
            raw = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    lines = [{"custom_id": f"r{i}", "url": "/v1/completions", "body": {"prompt": f"p{i}", **(
        {"model": "nope"} if i == 0 else {})}} for i in range(5)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    said = []
    try:
        assert run(str(inp), str(out), url + "/v1", None, [], "k", 1, 30, 30, said.append) == 1
        assert seen == ["/v1/v1/completions"] and "stopped: the server refused the run" in said[-2]
        assert "404" in said[-2] and "without /v1" in said[-2]
        assert run(str(inp), str(out), url, None, [], None, 1, 30, 30, said.append) == 1
        assert len(seen) == 2 and "401" in said[-2]
        assert run(str(inp), str(out), url, None, [], "k", 1, 30, 30, said.append) == 0
        res = _results(out)
        assert [res[f"r{i}"]["response"]["status_code"] for i in range(5)] == [404, 200, 200, 200, 200]
        assert run(str(inp), str(out), url, None, [], "k", 1, 30, 30, said.append) == 0 and len(seen) == 7
        with pytest.raises(RuntimeError, match="no such directory"):
            run(str(inp), str(tmp_path / "none" / "out.jsonl"), url, None, [], "k", 1, 30, 30, said.append)
    finally:
        server.shutdown()


@pytest.mark.slow
def test_run_batch_serves_a_model_for_the_run(tmp_path):
    (tmp_path / "in.jsonl").write_text(_lines(6))
    (tmp_path / "t").mkdir()
    r = _run_batch(tmp_path, "--model-path", str(TINY_LLADA), env={**os.environ, "DLLM_CACHE": str(tmp_path / "c"),
                                                                   "TMPDIR": str(tmp_path / "t")})
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "c" / "batches").exists()       # the run's server kept no /v1/files folder there
    assert list((tmp_path / "t").iterdir()) == [], r.stderr      # nor its logs, once the run ended well
    res = _results(tmp_path / "out.jsonl")
    assert [res[f"r{i}"]["response"]["status_code"] for i in range(6)] == [200] * 6
    assert "serving" in r.stderr and "6 answered 2xx" in r.stderr


def _balancer(tmp_path, urls: list[str], port: int, *extra) -> Proc:
    b = Proc(["balancer", "--worker-urls", ",".join(urls), "--port", str(port), "--files-dir",
              str(tmp_path / "files"), "--batch-concurrency", "4", *extra], port, tmp_path / f"balancer{port}.log")
    deadline = time.monotonic() + 60
    while True:
        try:
            if get_json(b.url + "/health")[1].get("healthy_workers") == len(urls):
                return b
        except OSError:
            pass
        assert time.monotonic() < deadline, b.tail()
        time.sleep(0.1)


@pytest.mark.slow
def test_the_batch_api_with_the_openai_client_survives_a_balancer_restart(tmp_path):
    w = start_worker(tmp_path, TINY_LLADA, *SLOW)
    port = free_port()
    try:
        w.wait_ready()
        b = _balancer(tmp_path, [w.url], port)
        client = openai.OpenAI(base_url=b.url + "/v1", api_key="x", max_retries=0)
        (tmp_path / "in.jsonl").write_text(_lines(40, BAD[2:3]))
        f = client.files.create(file=open(tmp_path / "in.jsonl", "rb"), purpose="batch")
        assert f.purpose == "batch" and f.bytes == (tmp_path / "in.jsonl").stat().st_size
        assert client.files.content(f.id).read() == (tmp_path / "in.jsonl").read_bytes()
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                                      metadata={"run": "test"})
        deadline = time.monotonic() + 30        # the balancer stops half-way
        while (cur := client.batches.retrieve(batch.id)).request_counts.completed < 8:
            assert time.monotonic() < deadline and cur.status in ("validating", "in_progress")
            time.sleep(0.05)
        b.stop()
        b = _balancer(tmp_path, [w.url], port)          # the same --files-dir: the batch resumes
        deadline = time.monotonic() + 60
        while (cur := client.batches.retrieve(batch.id)).status != "completed":
            assert time.monotonic() < deadline, cur
            time.sleep(0.1)
        assert cur.request_counts.total == 41 and cur.request_counts.completed == 40 and cur.request_counts.failed == 1
        assert cur.metadata == {"run": "test"} and cur.id in [x.id for x in client.batches.list()]
        out = [json.loads(x) for x in client.files.content(cur.output_file_id).text.splitlines()]
        assert sorted(r["custom_id"] for r in out) == sorted(f"r{i}" for i in range(40))        # each once
        direct = post_json(w.url + "/v1/completions", {"prompt": [5 + 7, 6, 7], "max_tokens": 4})[1]
        assert next(r for r in out if r["custom_id"] == "r7")["response"]["body"]["choices"][0]["text"] == \
            direct["choices"][0]["text"]
        err = [json.loads(x) for x in client.files.content(cur.error_file_id).text.splitlines()]
        assert [(r["custom_id"], r["response"]["status_code"]) for r in err] == [("top", 400)]
        # a batch cancelled while it runs ends "cancelled", with the lines answered before it in its output
        slow = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        while client.batches.retrieve(slow.id).request_counts.completed < 4:
            time.sleep(0.05)
        assert client.batches.cancel(slow.id).status in ("cancelling", "cancelled")
        deadline = time.monotonic() + 30
        while (cur := client.batches.retrieve(slow.id)).status != "cancelled":
            assert time.monotonic() < deadline, cur
            time.sleep(0.05)
        assert 4 <= cur.request_counts.completed < 40
        with pytest.raises(openai.BadRequestError):
            client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
        with pytest.raises(openai.NotFoundError):
            client.batches.retrieve("batch_nope")
        assert client.files.delete(f.id).deleted
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(f.id)
    finally:
        w.stop()
        b.stop()


async def test_files_and_batches_refuse_bad_input_and_cancel_while_waiting(aiohttp_client, tmp_path):
    """Bad uploads and ids are 4xx, never a 500; a batch whose lines wait for a worker (none is healthy) is
    cancelled at once (it stayed "cancelling"); its result files show only once it has ended (as OpenAI's)."""
    import asyncio

    import aiohttp as _aiohttp
    from balancer.app import BalancerConfig, make_app
    from balancer.pool import HealthConfig
    cfg = BalancerConfig(worker_urls=["http://127.0.0.1:9"], files_dir=str(tmp_path / "files"),
                         health=HealthConfig(interval=0.05, timeout=0.2))
    client = await aiohttp_client(make_app(cfg))
    bad = [
        (b"x", {"Content-Type": "multipart/form-data"}),                                      # no boundary
        (b"garbage", {"Content-Type": "multipart/form-data; boundary=zz"}),
        (b'--zz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n\xff\xfe\r\n--zz--\r\n',
         {"Content-Type": "multipart/form-data; boundary=zz"}),                                # not UTF-8
        # each of these was a 500; the file name not UTF-8 also left its upload on disk, unlisted
        (b'--zz\r\nContent-Disposition: form-data; name="purpose"\r\nContent-Type: text/plain; charset=x-no\r\n'
         b'\r\nbatch\r\n--zz--\r\n', {"Content-Type": "multipart/form-data; boundary=zz"}),       # unknown charset
        (b'--zz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--zz\r\nContent-Disposition: '
         b'form-data; name="file"; filename="in\xff.jsonl"\r\n\r\n{}\r\n--zz--\r\n',
         {"Content-Type": "multipart/form-data; boundary=zz"}),                                # file name not UTF-8
        (b'--zz\r\nContent-Type: multipart/mixed; boundary=yy\r\n\r\n--yy--\r\n--zz--\r\n',
         {"Content-Type": "multipart/form-data; boundary=zz"}),                                # a nested multipart
        (b'--zz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n' + 2 * (
            b'--zz\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{}\r\n') + b'--zz--\r\n',
         {"Content-Type": "multipart/form-data; boundary=zz"}),                                # two files
    ]
    for body, headers in bad:
        r = await client.post("/v1/files", data=body, headers=headers)
        assert 400 <= r.status < 500 and "error" in await r.json(), (body, r.status)
    assert list((tmp_path / "files").rglob("file-*")) == []                   # nothing left behind
    for path in ("/v1/files/file-" + "a" * 300, "/v1/batches/batch_" + "a" * 300, "/v1/files/file-..%2f"):
        r = await client.get(path)
        assert r.status == 404 and "error" in await r.json(), path
    form = _aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", _lines(3).encode(), filename="in.jsonl")
    fid = (await (await client.post("/v1/files", data=form)).json())["id"]
    for body in ({"input_file_id": fid, "endpoint": ["/v1/completions"], "completion_window": "24h"},
                 {"input_file_id": "file-" + "0" * 300, "endpoint": "/v1/completions", "completion_window": "24h"}):
        r = await client.post("/v1/batches", json=body)
        assert 400 <= r.status < 500 and "error" in await r.json(), body
    b = await (await client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                                        "completion_window": "24h"})).json()
    for _ in range(100):
        cur = await (await client.get(f"/v1/batches/{b['id']}")).json()
        if cur["status"] == "in_progress":
            break
        await asyncio.sleep(0.02)
    assert cur["status"] == "in_progress" and cur["output_file_id"] is None and "_output_file_id" not in cur
    r = await client.post(f"/v1/batches/{b['id']}/cancel")
    assert (await r.json())["status"] == "cancelling"
    for _ in range(100):
        cur = await (await client.get(f"/v1/batches/{b['id']}")).json()
        if cur["status"] == "cancelled":
            break
        await asyncio.sleep(0.05)
    # no line was answered: as OpenAI's, no output or error file (empty ones were made)
    assert cur["status"] == "cancelled" and cur["output_file_id"] is None and cur["error_file_id"] is None
    assert cur["model"] is None and cur["usage"] is None


async def _upload(client, text: str) -> str:
    """POST /v1/files of ``text`` as a batch input; its file id."""
    import aiohttp as _aiohttp
    form = _aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", text.encode(), filename="in.jsonl")
    return (await (await client.post("/v1/files", data=form)).json())["id"]


async def _files_balancer(aiohttp_client, tmp_path, urls: list[str], **settings):
    """A balancer in this process over ``urls`` with its files under tmp_path (and these settings), once it sees
    every worker; a client that leaves cancels its handler, as under ``serve`` (handler_cancellation)."""
    import asyncio

    from balancer.app import BalancerConfig, make_app
    from balancer.pool import HealthConfig
    cfg = BalancerConfig(worker_urls=urls, files_dir=str(tmp_path / "files"), health=HealthConfig(interval=0.05),
                         **settings)
    client = await aiohttp_client(make_app(cfg), server_kwargs={"handler_cancellation": True})
    for _ in range(200):
        if (await (await client.get("/health")).json())["healthy_workers"] == len(urls):
            return client
        await asyncio.sleep(0.02)
    raise TimeoutError("the balancer never saw its workers")


async def test_files_pages_and_a_finished_batchs_files_model_and_usage(aiohttp_client, tmp_path):
    """Found by a review against OpenAI's objects: GET /v1/files took no `limit`, `order` or `after` (every file,
    always `has_more: false`); a batch whose lines all succeeded had an empty error file (OpenAI: null), and a
    batch's `model` and `usage` were always null. A fake worker (tests/fakes.py: a test double) answers each line
    with 3 prompt and 4 completion tokens."""
    import asyncio

    import aiohttp as _aiohttp
    from tests.fakes import fake_worker, workers
    async with workers(fake_worker("ok", [])) as urls:
        client = await _files_balancer(aiohttp_client, tmp_path, urls)
        ids = []
        for n in (3, 2, 1):
            form = _aiohttp.FormData()
            form.add_field("purpose", "batch")
            form.add_field("file", _lines(n).encode(), filename=f"in{n}.jsonl")
            ids.append((await (await client.post("/v1/files", data=form)).json())["id"])
            await asyncio.sleep(1.01)                   # created_at is in seconds
        page = await (await client.get("/v1/files?limit=2")).json()
        assert [f["id"] for f in page["data"]] == ids[::-1][:2] and page["has_more"] is True
        assert (page["first_id"], page["last_id"]) == (ids[2], ids[1])
        rest = await (await client.get(f"/v1/files?limit=2&after={page['last_id']}")).json()
        assert [f["id"] for f in rest["data"]] == [ids[0]] and rest["has_more"] is False
        asc = await (await client.get("/v1/files?order=asc")).json()
        assert [f["id"] for f in asc["data"]] == ids
        for bad in ("limit=0", "limit=x", "order=up"):
            r = await client.get("/v1/files?" + bad)
            assert r.status == 400 and (await r.json())["error"]["param"] == bad.split("=")[0]
        for bad in ("limit=0", "limit=101", "limit=x"):        # (they were clamped: a review)
            r = await client.get("/v1/batches?" + bad)
            assert r.status == 400 and (await r.json())["error"]["param"] == "limit"

        b = await (await client.post("/v1/batches", json={"input_file_id": ids[0], "endpoint": "/v1/completions",
                                                            "completion_window": "24h"})).json()
        assert b["model"] is None and b["usage"] is None
        for _ in range(200):
            cur = await (await client.get(f"/v1/batches/{b['id']}")).json()
            if cur["status"] == "completed":
                break
            await asyncio.sleep(0.05)
        assert cur["status"] == "completed" and cur["output_file_id"] and cur["error_file_id"] is None
        assert cur["model"] == "m" and cur["usage"] == {
            "input_tokens": 9, "output_tokens": 12, "total_tokens": 21, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}
        listed = [f["id"] for f in (await (await client.get("/v1/files")).json())["data"]]
        assert cur["output_file_id"] in listed and len(listed) == 4
        url = f"/v1/files/{ids[0]}/content"
        whole = await (await client.get(url)).read()
        r = await client.get(url, headers={"Range": "bytes=2-5"})
        assert r.status == 206 and await r.read() == whole[2:6]
        for rng in (f"bytes={len(whole)}-", "bytes=x"):        # past the end, malformed: 416 in the OpenAI shape
            r = await client.get(url, headers={"Range": rng})
            err = (await r.json())["error"]
            assert r.status == 416 and err["code"] == "range_not_satisfiable" and err["type"] == "invalid_request_error"
            assert r.headers["Content-Range"] == f"bytes */{len(whole)}"
        r = await client.get("/v1/batches/x/y")
        assert r.status == 404 and "/v1/files, /v1/batches" in (await r.json())["error"]["message"]
        assert "does not serve" not in (await r.json())["error"]["message"]


async def test_many_batches_hold_no_more_of_the_queue_than_batch_concurrency(aiohttp_client, tmp_path):
    """--batch-concurrency bounds the lines in the queue over all running batches, which take turns: five batches
    hold at most 4 rows on the worker at once, an interactive request is answered meanwhile, and every batch
    completes (a review started 70 batches of 64 lanes each: the 4,096-request queue filled, and every interactive
    request got 429). A fake worker (tests/fakes.py: a test double) holds each batch 0.1 s."""
    import asyncio

    from aiohttp import web
    from tests.fakes import worker_app, workers
    held, peak = [0], [0]

    async def batch(request):
        items = (await request.json())["requests"]
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        held[0] += len(items)
        peak[0] = max(peak[0], held[0])
        await asyncio.sleep(0.1)
        for item in items:
            held[0] -= 1
            data = {"object": "text_completion", "model": "m",
                    "choices": [{"index": 0, "text": "t", "finish_reason": "length"}]}
            await resp.write(orjson.dumps({"id": item["id"], "event": "response", "data": data, "end": True}) + b"\n")
        await resp.write_eof()
        return resp

    async with workers(worker_app(batch)) as urls:
        client = await _files_balancer(aiohttp_client, tmp_path, urls, batch_concurrency=4)
        fid = await _upload(client, _lines(30))
        bids = [(await (await client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                                                "completion_window": "24h"})).json())["id"]
                for _ in range(5)]
        await asyncio.sleep(0.2)
        r = await client.post("/v1/completions", json={"prompt": "x"})
        assert r.status == 200
        for _ in range(400):
            statuses = [(await (await client.get(f"/v1/batches/{b}")).json())["status"] for b in bids]
            if set(statuses) == {"completed"}:
                break
            await asyncio.sleep(0.05)
        assert set(statuses) == {"completed"}
        assert 2 <= peak[0] <= 4 + 1, peak            # (+1: the interactive request)


async def test_listing_reads_its_page_only_and_survives_deleting_what_it_listed(aiohttp_client, tmp_path,
                                                                                monkeypatch):
    """A review: every listing read and parsed every record on the event loop (20,000 files: seconds, every client
    stopped); and `for f in client.files.list(limit=3): client.files.delete(f.id)` stopped after the first page (the
    `after` id was gone, so the page after it was empty, has_more false). A fake worker (a test double)."""
    import aiohttp as _aiohttp
    from balancer import batches
    from tests.fakes import fake_worker, workers
    async with workers(fake_worker("ok", [])) as urls:
        client = await _files_balancer(aiohttp_client, tmp_path, urls)
        for n in range(7):
            form = _aiohttp.FormData()
            form.add_field("purpose", "batch")
            form.add_field("file", _lines(1).encode(), filename=f"in{n}.jsonl")
            assert (await client.post("/v1/files", data=form)).status == 200

        def every_record(*a):
            raise AssertionError("a listing read every record")
        monkeypatch.setattr(batches, "_load_all", every_record)
        api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
        deleted = [f.id async for f in api.files.list(limit=3) if (await api.files.delete(f.id)).deleted]
        assert len(deleted) == 7 and (await api.files.list()).data == []
        r = await client.get("/v1/files?after=file-000000000000000000000000")
        assert (await r.json())["data"] == []                    # an id never listed: nothing after it
        assert [b async for b in api.batches.list(limit=2)] == []
        clock = iter(range(2_000_000_000, 2_000_000_100))
        monkeypatch.setattr(batches, "_now", lambda: next(clock))
        fid = (await api.files.create(file=("in.jsonl", _lines(1).encode()), purpose="batch")).id
        made = [(await api.batches.create(input_file_id=fid, endpoint="/v1/completions",
                                          completion_window="24h")).id for _ in range(3)]
        page = (await client.get("/v1/batches?limit=3"))
        page = await page.json()
        assert [b["id"] for b in page["data"]] == made[::-1] and page["has_more"] is False   # newest first, listed
        page = await (await client.get("/v1/batches?limit=2")).json()                        # at once
        assert page["has_more"] is True and page["last_id"] == made[1]
        await api.close()


async def test_a_batchs_input_is_kept_lines_too_large_are_refused_unread_and_lines_count_in_metrics(
        aiohttp_client, tmp_path, monkeypatch):
    """A review: deleting the input file of a running batch made it fail if the balancer restarted (its resume reads
    the input again): now 409 while the batch runs. A line larger than a request body may be was parsed (a 300 MiB
    line: 1.3 GB) and sent, refused only by the worker's own limit; now refused unread, its custom_id kept. A cancel
    accepted while finalizing was overwritten by the run's last write ("cancelling", then "completed"): ignored now.
    And the lines were missing from /metrics and /stats' last minute. Small limits stand in for 64 MiB here; a
    fake worker (a test double) answers each batch after 0.2 s."""
    import asyncio

    import aiohttp as _aiohttp
    from aiohttp import web
    from balancer import batches
    from common import batchfile
    from tests.fakes import worker_app, workers
    monkeypatch.setattr(batchfile, "MAX_LINE_BYTES", 4096)
    monkeypatch.setattr(batches, "MAX_BODY_BYTES", 1024)

    async def batch(request):
        items = (await request.json())["requests"]
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(request)
        await asyncio.sleep(0.2)
        for item in items:
            data = {"object": "text_completion", "model": "m",
                    "choices": [{"index": 0, "text": "t", "finish_reason": "length"}]}
            await resp.write(orjson.dumps({"id": item["id"], "event": "response", "data": data, "end": True}) + b"\n")
        await resp.write_eof()
        return resp

    big = json.dumps({"custom_id": "big", "method": "POST", "url": "/v1/completions",
                      "body": {"prompt": "x" * 5000, "max_tokens": 1}})
    body_big = json.dumps({"custom_id": "body", "method": "POST", "url": "/v1/completions",
                           "body": {"prompt": "x" * 2000, "max_tokens": 1}})
    async with workers(worker_app(batch)) as urls:
        client = await _files_balancer(aiohttp_client, tmp_path, urls, batch_concurrency=2)
        form = _aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", _lines(6, [big, body_big]).encode(), filename="in.jsonl")
        fid = (await (await client.post("/v1/files", data=form)).json())["id"]
        b = await (await client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                                            "completion_window": "24h"})).json()
        await asyncio.sleep(0.1)
        r = await client.delete(f"/v1/files/{fid}")
        err = (await r.json())["error"]
        assert r.status == 409 and err["code"] == "file_in_use" and b["id"] in err["message"], err
        for _ in range(200):
            cur = await (await client.get(f"/v1/batches/{b['id']}")).json()
            if cur["status"] == "completed":
                break
            await asyncio.sleep(0.05)
        assert cur["request_counts"] == {"total": 8, "completed": 6, "failed": 2}, cur
        out = {}
        for fkey in ("output_file_id", "error_file_id"):
            for line in (await (await client.get(f"/v1/files/{cur[fkey]}/content")).read()).splitlines():
                r = json.loads(line)
                out[r["custom_id"]] = r
        assert out["big"]["error"]["code"] == "request_too_large" and out["big"]["response"] is None
        assert out["body"]["response"]["status_code"] == 413
        text = await (await client.get("/metrics")).text()
        assert 'dllm_balancer_requests_total{endpoint="/v1/completions",status="200"} 6.0' in text
        assert 'dllm_balancer_requests_total{endpoint="/v1/completions",status="413"} 1.0' in text
        assert (await (await client.get("/stats")).json())["last_minute"]["ok"] == 6
        assert (await client.delete(f"/v1/files/{fid}")).status == 200          # (the batch has ended)
        rec = tmp_path / "files" / "batches" / f"{b['id']}.json"                 # a batch caught finalizing
        rec.write_bytes(orjson.dumps({**orjson.loads(rec.read_bytes()), "status": "finalizing"}))
        cur = await (await client.post(f"/v1/batches/{b['id']}/cancel")).json()
        assert cur["status"] == "finalizing" and cur["cancelling_at"] is None


async def test_run_batch_takes_its_lines_as_it_sends_them(tmp_path):
    """A review: run-batch parsed every line and made a task for each at once, about 23x its input file (528 MB for
    200,000 lines, 23 MB); now at most --concurrency lines are taken ahead of their answers (resident 85 MB for that
    file). A URL nothing listens on answers every line at once (no answer)."""
    from common.batchfile import parse_line
    from dllm_serve.batch import send
    taken, answered, ahead = [0], [0], []
    seen: set = set()

    def lines():
        for i in range(300):
            taken[0] += 1
            ahead.append(taken[0] - answered[0])
            yield parse_line(i + 1, json.dumps({"custom_id": f"r{i}", "url": "/v1/completions",
                                                "body": {"prompt": "x"}}).encode(), seen)

    def progress(n):
        answered[0] += n
    tally = await send(lines(), tmp_path / "out.jsonl", f"http://127.0.0.1:{free_port()}", None, 4, 5, progress)
    assert tally["unsent"] == 300 and answered[0] == 300
    assert 4 <= max(ahead) <= 4 + 1, max(ahead)          # --concurrency lines at once, not more (nor fewer)


def test_a_line_too_large_keeps_its_custom_id_and_still_counts_for_duplicates(monkeypatch):
    from common import batchfile
    monkeypatch.setattr(batchfile, "MAX_LINE_BYTES", 100)
    seen: set = set()
    big = json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x" * 200}}).encode()
    first = batchfile.parse_line(1, big, seen)
    assert first.error["code"] == "request_too_large" and first.custom_id == "a"
    again = batchfile.parse_line(2, json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {}}).encode(), seen)
    assert again.error["code"] == "duplicate_custom_id"          # (a review: it was sent, two results for "a")
    assert batchfile.parse_line(3, json.dumps({"custom_id": "b", "url": "/v1/completions", "body": {}}).encode(),
                                seen).error is None
    assert batchfile.parse_line(4, big.replace(b'"a"', b'"b"'), seen).error["code"] == "duplicate_custom_id"


async def test_a_running_batch_holds_a_chunk_of_its_lines_not_its_input(aiohttp_client, tmp_path, monkeypatch):
    """A batch's lines are parsed as they are sent, a chunk at a time (32 lines here): while 800 lines run, the
    balancer holds at most a chunk of them and those in flight (a review: every line parsed at once, about 6x the input file, so a
    few batches of a large file took gigabytes). Every line is answered once, in the file's order of taking. A fake
    worker (tests/fakes.py: a test double)."""
    import asyncio
    import gc

    import aiohttp as _aiohttp
    from balancer import batches
    from common.batchfile import Line
    from tests.fakes import fake_worker, workers
    monkeypatch.setattr(batches._Lines, "CHUNK_LINES", 32)
    async with workers(fake_worker("ok", [])) as urls:
        client = await _files_balancer(aiohttp_client, tmp_path, urls, batch_concurrency=8)
        form = _aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", _lines(800).encode(), filename="in.jsonl")
        fid = (await (await client.post("/v1/files", data=form)).json())["id"]
        gc.collect()        # (lines an earlier test of this process left in reference cycles are not this batch's)
        b = await (await client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                                            "completion_window": "24h"})).json()
        held = []
        for _ in range(1200):
            cur = await (await client.get(f"/v1/batches/{b['id']}")).json()
            if cur["status"] in ("completed", "failed"):
                break
            held.append(sum(1 for o in gc.get_objects() if type(o) is Line))
            await asyncio.sleep(0.05)
        assert cur["status"] == "completed" and cur["request_counts"] == {"total": 800, "completed": 800,
                                                                            "failed": 0}, cur
        assert len(held) >= 3 and 0 < max(held) <= 32 + 8 * 2, held
        raw = await (await client.get(f"/v1/files/{cur['output_file_id']}/content")).read()
        assert sorted(orjson.loads(x)["custom_id"] for x in raw.splitlines()) == sorted(f"r{i}" for i in range(800))


async def test_a_deeply_nested_line_is_its_own_error_and_the_input_is_read_off_the_event_loop(aiohttp_client, tmp_path,
                                                                                            monkeypatch):
    """A line nested 300 levels deep was read (orjson reads 1,024) but could not be written again for its request
    (orjson writes 254): the error ended the whole batch "failed", its other lines' answers thrown away and its
    result files left unlisted (a reviewer's finding). Lines now take a request body's nesting limit (its own
    `invalid_json` error), a line that fails for any other reason is its own 500, and the input file is read and
    parsed on a thread (a 59 MB file held the balancer's event loop 1.2 s). A fake worker (tests/fakes.py)."""
    import asyncio
    import threading

    import aiohttp as _aiohttp
    from balancer import batches
    from tests.fakes import fake_worker, workers
    threads = []
    real = batches.BatchJobs._read_lines

    def spy(self, *a):
        threads.append(threading.current_thread() is threading.main_thread())
        return real(self, *a)
    monkeypatch.setattr(batches.BatchJobs, "_read_lines", spy)
    chunk = batches._Lines._chunk

    def spy_chunk(self):
        threads.append(threading.current_thread() is threading.main_thread())
        return chunk(self)
    monkeypatch.setattr(batches._Lines, "_chunk", spy_chunk)
    async with workers(fake_worker("ok", [])) as urls:
        client = await _files_balancer(aiohttp_client, tmp_path, urls)
        deep = '{"a":' * 300 + '1' + '}' * 300
        text = _lines(4, ['{"custom_id": "deep", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", '
                          f'"x": {deep}}}}}'])
        form = _aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", text.encode(), filename="in.jsonl")
        fid = (await (await client.post("/v1/files", data=form)).json())["id"]
        b = await (await client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                                            "completion_window": "24h"})).json()
        for _ in range(200):
            cur = await (await client.get(f"/v1/batches/{b['id']}")).json()
            if cur["status"] in ("completed", "failed"):
                break
            await asyncio.sleep(0.05)
        assert cur["status"] == "completed", cur
        assert cur["request_counts"] == {"total": 5, "completed": 4, "failed": 1}
        raw = await (await client.get(f"/v1/files/{cur['error_file_id']}/content")).read()
        err = [orjson.loads(x) for x in raw.splitlines()]
        assert [(e["custom_id"], e["error"]["code"]) for e in err] == [(None, "invalid_json")]
        assert "nests deeper than" in err[0]["error"]["message"]
        assert threads and not any(threads)       # the count and every chunk of lines read on a thread


@pytest.mark.slow
def test_run_batch_stopped_by_sigterm_stops_the_server_it_started(tmp_path):
    """run-batch --model-path starts `serve` in a session of its own; SIGTERM or a closing terminal's SIGHUP ended
    run-batch without its clean-up, and the server and its workers stayed up for good, listening (a reviewer's
    finding). Both now end run-batch as Ctrl-C does, stopping the server (and its death alone sends it SIGTERM)."""
    import re
    import urllib.request
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps({"custom_id": f"r{i}", "method": "POST",
                                                             "url": "/v1/completions",
                                                             "body": {"prompt": [5, 6, 7], "max_tokens": 512}})
                                                 for i in range(40)) + "\n")
    p = subprocess.Popen([*DLLM, "run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"),
                          "--model-path", str(TINY_LLADA), "--concurrency", "2"], cwd=ROOT, stderr=subprocess.PIPE,
                         text=True, env={**os.environ, "DLLM_CACHE": str(tmp_path / "c"),
                                                      "TMPDIR": str(tmp_path)})   # the logs it keeps
    try:
        url = None
        for line in p.stderr:
            m = re.search(r"serving .* on (http://127\.0\.0\.1:\d+)", line)
            if m:
                url = m.group(1)
                break
        assert url, "run-batch never said where it serves"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not (tmp_path / "out.jsonl").exists():
            time.sleep(0.2)                      # the server is up and answering
        p.send_signal(signal.SIGTERM)
        assert p.wait(90) == 128 + signal.SIGTERM
        for _ in range(300):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
            except OSError:
                break                            # nothing listens there any more
            time.sleep(0.2)
        else:
            raise AssertionError(f"the server run-batch started still answers on {url}")
        assert list(tmp_path.glob("dllm-run-batch-*/serve.log"))     # a stopped run's server logs are kept to read
    finally:
        if p.poll() is None:
            p.kill()


async def test_a_batch_stopped_by_a_drain_keeps_its_input_and_a_cancel_keeps_its_answers(aiohttp_client, tmp_path,
                                                                                            monkeypatch):
    """SIGTERM's drain stops a batch's lines and leaves it running (the next balancer resumes it). Meanwhile its
    input could be deleted (its task had ended: the check looked at the task, not the batch; the restart then
    failed the batch), and a cancel ended it at once with no output file, orphaning the answers it had (a review).
    Now the input is refused 409 while the batch says it runs, and a cancel keeps the answers as its output, and
    counts them as the drain left them (the note of its counts, older, counted fewer: a second review)."""
    import asyncio

    from aiohttp import web

    from balancer.app import JOBS, STATE
    from tests.fakes import CHUNK, worker_app, workers

    async def slow(request):               # each line's answer takes 0.1 s
        body = await request.json()
        resp = web.StreamResponse()
        await resp.prepare(request)
        for it in body["requests"]:
            await asyncio.sleep(0.1)
            d = dict(CHUNK, choices=[{"index": 0, "text": "x", "finish_reason": "length"}])
            await resp.write(orjson.dumps({"id": it["id"], "event": "response", "data": d, "end": True}) + b"\n")
        await resp.write_eof()
        return resp
    async with workers(worker_app(slow)) as urls:
        client = await _files_balancer(aiohttp_client, tmp_path, urls, batch_concurrency=1)
        fid = await _upload(client, _lines(40))
        b = await (await client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                                            "completion_window": "24h"})).json()
        for _ in range(200):
            cur = await (await client.get(f"/v1/batches/{b['id']}")).json()
            if cur["request_counts"]["completed"] >= 8:       # (past 0.5 s: its counts were noted beside it)
                break
            await asyncio.sleep(0.05)
        import pathlib
        import time
        unlink = pathlib.Path.unlink                       # the note's removal, slow (a test double): it must not
        monkeypatch.setattr(pathlib.Path, "unlink", lambda p, **k: (   # be read while its removal waits (a CI run)
            time.sleep(0.3) if p.name.endswith(".counts") else None, unlink(p, **k))[1])
        state = client.server.app[STATE]
        state.draining = True                              # as SIGTERM's drain: the batch's lines stop
        jobs = client.server.app[JOBS]
        await asyncio.wait_for(asyncio.gather(*jobs.tasks.values(), return_exceptions=True), 10)
        assert (await (await client.get(f"/v1/batches/{b['id']}")).json())["status"] == "in_progress"
        r = await client.delete(f"/v1/files/{fid}")
        assert r.status == 409 and (await r.json())["error"]["code"] == "file_in_use"
        state.draining = False
        cur = await (await client.post(f"/v1/batches/{b['id']}/cancel")).json()
        assert cur["status"] == "cancelled" and cur["output_file_id"], cur
        out = await (await client.get(f"/v1/files/{cur['output_file_id']}/content")).read()
        assert len(out.splitlines()) == cur["request_counts"]["completed"] >= 8


def test_a_second_balancer_on_the_same_files_folder_refuses_to_start(tmp_path):
    """A second balancer given the same --files-dir (another port) resumed the first one's running batches too,
    rewriting their result files under the first one's open handles (a review: 13 of 60 answers left on disk; the
    same from a second balancer on the same port, which read the folder before it found the port taken). The folder
    is locked now: the second one exits 1 saying so, and touches nothing."""
    w = start_worker(tmp_path, TINY_LLADA, "--simulate-device", "0.001,0")
    port = free_port()
    try:
        w.wait_ready()
        b = _balancer(tmp_path, [w.url], port)
        r = subprocess.run([*DLLM, "balancer", "--worker-urls", w.url, "--port", str(free_port()), "--files-dir",
                            str(tmp_path / "files")], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "is in use by another balancer (pid" in r.stderr, r.stderr
        r = subprocess.run([*DLLM, "balancer", "--worker-urls", w.url, "--port", str(port), "--files-dir",
                            str(tmp_path / "files")], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 98 and "cannot listen" in r.stderr, r.stderr      # its port: said as before
        assert get_json(b.url + "/health")[0] == 200
    finally:
        for p in (locals().get("b"), w):
            if p is not None:
                p.stop()


async def test_batches_beyond_max_running_wait_validating_and_a_full_disk_refuses_uploads(aiohttp_client, tmp_path,
                                                                                          monkeypatch):
    """--max-running-batches: a running batch holds its files open and a chunk of its parsed input (up to 8 MiB of
    lines), and any number of them ran at once (a review). Past the limit a batch waits "validating", in order,
    then runs; counts shown while one runs come from memory (its record is written at each change of status only).
    --min-free-disk-bytes: an upload or a new batch that would leave less free gets 507 insufficient_storage (the
    folder filled its disk). A fake worker (tests/fakes.py: a test double) holds each batch 0.3 s."""
    import asyncio
    import shutil

    from tests.fakes import fake_worker, workers
    async with workers(fake_worker("ok", [], delay=0.3)) as urls:
        client = await _files_balancer(aiohttp_client, tmp_path, urls, max_running_batches=1, batch_concurrency=1)
        fid = await _upload(client, _lines(3))
        bids = [(await (await client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                                                "completion_window": "24h"})).json())["id"]
                for _ in range(2)]
        seen = set()
        for _ in range(400):
            got = [await (await client.get(f"/v1/batches/{b}")).json() for b in bids]
            seen.add(tuple(g["status"] for g in got))
            if got[0]["status"] == "in_progress" and got[0]["request_counts"]["completed"] == 1:
                on_disk = orjson.loads((tmp_path / "files" / "batches" / f"{bids[0]}.json").read_bytes())
                assert on_disk["request_counts"]["completed"] == 0        # (written at its changes of status)
            if {g["status"] for g in got} == {"completed"}:
                break
            await asyncio.sleep(0.02)
        assert {g["status"] for g in got} == {"completed"}, seen
        assert ("in_progress", "validating") in seen and ("in_progress", "in_progress") not in seen, seen
        assert all(g["request_counts"] == {"total": 3, "completed": 3, "failed": 0} for g in got)

        real = shutil.disk_usage
        free = real(tmp_path).free
        monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=(1 << 30) + 100))
        import aiohttp as _aiohttp
        form = _aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", _lines(20).encode(), filename="in.jsonl")         # > 100 bytes
        r = await client.post("/v1/files", data=form)
        err = (await r.json())["error"]
        assert r.status == 507 and err["code"] == "insufficient_storage" and "--min-free-disk-bytes" in err["message"]
        assert r.headers["x-should-retry"] == "false"          # (the openai client would upload it twice more)
        assert len(list((tmp_path / "files" / "files").glob("*.data"))) == 3       # (its bytes removed)
        monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 29))
        r = await client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                                   "completion_window": "24h"})
        assert r.status == 507 and (await r.json())["error"]["code"] == "insufficient_storage"
        assert free > 1 << 29


def test_resuming_and_finishing_a_batch_read_its_output_a_line_at_a_time_and_records_are_durable(tmp_path,
                                                                                                 monkeypatch):
    """Resuming a batch and finishing one read its whole output file into memory (+600 MB for a 193 MB output: a
    review): a line at a time now (tracemalloc's peak under a third of a 28 MiB output, the answered keys being
    kept; 68 MB before). Nothing was fsynced, so after a power loss a record could be empty and its batch skipped:
    a record's bytes reach the disk before it replaces the old one, and the rename before the write returns (the
    folder is synced); the rewritten output too."""
    import os
    import tracemalloc

    from balancer import batches
    out, err = tmp_path / "out.data", tmp_path / "err.data"
    line = orjson.dumps({"id": "r", "custom_id": "c", "response": {"status_code": 200, "request_id": "x", "body": {
        "model": "m", "usage": {"prompt_tokens": 3, "completion_tokens": 4}, "text": "y" * 400}}, "error": None})
    with open(out, "wb") as f:
        for i in range(50_000):
            f.write(line.replace(b'"c"', b'"c%d"' % i) + b"\n")
    f_in = tmp_path / "in.data"
    f_in.write_bytes(b"{}\n" * 10)
    size = out.stat().st_size
    assert size > 24 << 20
    synced, order = [], []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                  real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (order.append((str(a), list(synced))), real_replace(a, b))[1])
    jobs = batches.BatchJobs(None, tmp_path, 1 << 30, 4)
    tracemalloc.start()
    try:
        total, done, counts = jobs._read_lines(f_in, out, err)
        model, usage = batches._model_and_usage(out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (total, counts, len(done)) == (10, {"completed": 50_000, "failed": 0}, 50_000)
    assert model == "m" and usage["input_tokens"] == 150_000 and out.stat().st_size == size
    assert peak < size / 3, (peak, size)       # (the answered keys are kept: 50,000 short strings)
    (tmp, before), = order
    assert tmp.endswith("out.data.tmp") and before == [tmp]         # synced, then renamed
    assert synced[-1] == str(tmp_path)                              # then the folder
    synced.clear(), order.clear()
    batches._write(tmp_path / "rec.json", orjson.dumps({"a": 1}), durable=True)
    (tmp, before), = order
    assert before == [tmp] and synced == [tmp, str(tmp_path)]


async def test_a_waiting_batch_cancels_at_once_a_filling_disk_fails_a_batch_and_syncs_stay_off_the_loop(
        aiohttp_client, tmp_path, monkeypatch):
    """A review of the batch storage: a batch waiting for a running place (--max-running-batches) that was cancelled
    stayed "cancelling" until a place came, hours maybe, then showed an `in_progress_at`; a disk that filled as
    batches ran failed their last record writes, so they stayed in_progress with no counts; every record write
    synced the disk on the event loop (2-12 ms each). Now the cancel ends it at once; a running batch stops while
    --min-free-disk-bytes is left and ends failed `insufficient_storage` with its answers as its output; records
    are synced on a thread of their own, in order (none on the event loop's thread; each takes 0.05 s more here). A fake
    worker (tests/fakes.py: a test double) answers each request after 0.05 s."""
    import asyncio
    import os
    import shutil
    import time

    from tests.fakes import fake_worker, workers
    import threading
    real_fsync, loop_thread, on_loop = os.fsync, threading.current_thread(), []
    monkeypatch.setattr(os, "fsync", lambda fd: (on_loop.append(threading.current_thread() is loop_thread),
                                                 time.sleep(0.05), real_fsync(fd))[2])
    async with workers(fake_worker("ok", [], delay=0.05)) as urls:
        client = await _files_balancer(aiohttp_client, tmp_path, urls, max_running_batches=1, batch_concurrency=1)
        fid = await _upload(client, _lines(30))
        body = {"input_file_id": fid, "endpoint": "/v1/completions", "completion_window": "24h"}
        first = (await (await client.post("/v1/batches", json=body)).json())["id"]
        waiting = (await (await client.post("/v1/batches", json=body)).json())["id"]
        for _ in range(200):
            if (await (await client.get(f"/v1/batches/{first}")).json())["request_counts"]["completed"] >= 1:
                break
            await asyncio.sleep(0.02)
        real = shutil.disk_usage
        monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 29))    # under the floor
        b = await (await client.post(f"/v1/batches/{waiting}/cancel")).json()
        assert b["status"] == "cancelled" and b["in_progress_at"] is None and b["output_file_id"] is None, b
        for _ in range(400):
            cur = await (await client.get(f"/v1/batches/{first}")).json()
            if cur["status"] not in ("validating", "in_progress"):
                break
            await asyncio.sleep(0.02)
        assert cur["status"] == "failed" and cur["errors"]["data"][0]["code"] == "insufficient_storage", cur
        done = cur["request_counts"]["completed"]
        assert 1 <= done < 30 and cur["output_file_id"], cur
        out = await (await client.get(f"/v1/files/{cur['output_file_id']}/content")).read()
        assert len(out.splitlines()) == done                   # its answers kept
        assert len(on_loop) >= 8 and not any(on_loop), on_loop    # every disk sync off the event loop
    again = (await (await client.get(f"/v1/batches/{waiting}")).json())
    assert again["status"] == "cancelled"


async def test_batches_left_running_resume_in_the_order_they_came(tmp_path):
    """After a restart the batches left running resumed in the order of their random ids, not the order they came
    (a review: 0, 1, 2, 5, 4, 3 with --max-running-batches 1), then in random order within a second."""
    from types import SimpleNamespace

    from balancer.batches import BatchJobs
    root = tmp_path / "files"
    (root / "batches").mkdir(parents=True)
    # (one made within the same second as another: its creation time in ns, kept in the record, orders them: a
    # second review found them resumed in random order then)
    made = {"batch_" + "f" * 24: (1, 0), "batch_" + "0" * 24: (3, 0), "batch_" + "8" * 24: (2, 7),
            "batch_" + "1" * 24: (4, 0), "batch_" + "2" * 24: (2, 5)}
    for bid, (created, seq) in made.items():
        (root / "batches" / f"{bid}.json").write_bytes(orjson.dumps(
            {"id": bid, "created_at": created, "_seq": seq, "status": "in_progress", "request_counts": {}}))
    jobs = BatchJobs(SimpleNamespace(draining=True), root, 1 << 20, 4, max_running=1)
    jobs.start()
    try:
        assert list(jobs.tasks) == sorted(made, key=made.get)
    finally:
        await jobs.close()


async def test_a_client_that_leaves_loses_no_record_write_and_a_create_protects_its_input_at_once(
        aiohttp_client, tmp_path, monkeypatch):
    """A second review of the records' thread: a handler cancelled by its client leaving (``serve`` cancels them)
    cancelled its record write still queued: a cancel answered and never written (the batch ended "completed"), a
    create written but neither listed nor run. And a create waiting for its record let a delete of its input
    through (the batch failed). Writes are done once queued; a batch is known before its record is written. The
    records' thread is slowed to 0.3 s a write (a test double for a slow disk); a fake worker (tests/fakes.py: a
    test double) answers each request after 0.05 s."""
    import asyncio

    import aiohttp as _aiohttp
    from balancer import batches
    from tests.fakes import fake_worker, workers
    real = batches._write
    monkeypatch.setattr(batches, "_write", lambda *a: (__import__("time").sleep(0.3), real(*a))[1])
    async with workers(fake_worker("ok", [], delay=0.05)) as urls:
        client = await _files_balancer(aiohttp_client, tmp_path, urls, batch_concurrency=1)
        fid = await _upload(client, _lines(30))
        body = {"input_file_id": fid, "endpoint": "/v1/completions", "completion_window": "24h"}
        quick = _aiohttp.ClientTimeout(total=0.1)
        creating = asyncio.create_task(client.post("/v1/batches", json=body))
        await asyncio.sleep(0.05)
        r = await client.delete(f"/v1/files/{fid}")                 # while the create waits for its record
        assert r.status == 409 and (await r.json())["error"]["code"] == "file_in_use"
        first = (await (await creating).json())["id"]
        with pytest.raises(asyncio.TimeoutError):                   # a client that leaves at once
            await client.post("/v1/batches", json=body, timeout=quick)
        listed = (await (await client.get("/v1/batches")).json())["data"]
        assert len(listed) == 2                                      # listed (and running) all the same
        second = next(b["id"] for b in listed if b["id"] != first)
        with pytest.raises(asyncio.TimeoutError):
            await client.post(f"/v1/batches/{first}/cancel", timeout=quick)
        for _ in range(600):
            got = [await (await client.get(f"/v1/batches/{b}")).json() for b in (first, second)]
            if all(g["status"] in ("cancelled", "completed", "failed") for g in got):
                break
            await asyncio.sleep(0.05)
        assert [g["status"] for g in got] == ["cancelled", "completed"], got
        assert got[0]["request_counts"]["completed"] < 30 == got[1]["request_counts"]["completed"]


async def test_a_cancel_while_a_batch_writes_its_failure_is_answered_as_the_batch_is(aiohttp_client, tmp_path,
                                                                                     monkeypatch):
    """A cancel that came while a batch wrote its failure (the disk full) was answered "cancelling", and the batch
    then ended "failed" (a second review). It is answered as the batch is, which ends as it was ending. The
    records' thread is slowed to 0.3 s a write and the disk's free space is a test double; a fake worker
    (tests/fakes.py: a test double) answers each request after 0.05 s."""
    import asyncio
    import shutil

    from balancer import batches
    from balancer.app import JOBS
    from tests.fakes import fake_worker, workers
    async with workers(fake_worker("ok", [], delay=0.05)) as urls:
        client = await _files_balancer(aiohttp_client, tmp_path, urls, batch_concurrency=1)
        fid = await _upload(client, _lines(30))
        bid = (await (await client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/completions",
                                                              "completion_window": "24h"})).json())["id"]
        for _ in range(200):
            if (await (await client.get(f"/v1/batches/{bid}")).json())["request_counts"]["completed"] >= 2:
                break
            await asyncio.sleep(0.02)
        real_write, real_usage = batches._write, shutil.disk_usage
        monkeypatch.setattr(batches, "_write", lambda *a: (__import__("time").sleep(0.3), real_write(*a))[1])
        monkeypatch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=1 << 29))
        jobs = client.server.app[JOBS]
        for _ in range(200):
            if bid in jobs._ending:
                break
            await asyncio.sleep(0.01)
        answer = await (await client.post(f"/v1/batches/{bid}/cancel")).json()
        assert answer["status"] == "in_progress" and answer["cancelling_at"] is None, answer
        await asyncio.wait_for(jobs.tasks[bid], 10)
        end = await (await client.get(f"/v1/batches/{bid}")).json()
        assert end["status"] == "failed" and end["errors"]["data"][0]["code"] == "insufficient_storage", end
