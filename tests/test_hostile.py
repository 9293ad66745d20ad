"""Hostile input (issue 14): generated malformed bodies (hypothesis, 1,000 per endpoint) and a fixed corpus of the
nasty cases, sent through a real balancer (two HTTP processes) over a real worker on the tiny fixture, while good
requests run beside them. Every good request gets its right answer, every bad one a 4xx in the OpenAI shape, nothing
gets a 5xx, and both servers are alive with bounded memory afterwards.

    ./scripts/test.sh tests/test_hostile.py -s      # prints the figures docs/reliability.md shows
"""
import asyncio
import concurrent.futures
import http.client
import json
import socket
import threading
import time
from pathlib import Path
from dataclasses import dataclass

import aiohttp
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import TINY_LLADA
from tests.helpers import Cluster, get_json, raw_http, read_http_answer
from tests.test_isolation import MALFORMED, TRAVERSALS

pytestmark = pytest.mark.slow
EXAMPLES = 1000          # generated bodies per endpoint


@dataclass(frozen=True)
class Raw:
    """A JSON token written as it is (NaN, Infinity, 1e400, a lone surrogate escape...)."""
    text: str


def encode(v) -> str:
    if isinstance(v, Raw):
        return v.text
    if isinstance(v, dict):
        return "{" + ",".join(json.dumps(k) + ":" + encode(x) for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ",".join(encode(x) for x in v) + "]"
    return json.dumps(v)


NASTY = st.sampled_from([
    Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400"), Raw("-1e400"), Raw('"\\ud800"'), Raw('"\\udfff x"'),
    Raw("123456789012345678901234567890"), 10 ** 9, -1, 0, 1, 3, 2 ** 31, 2 ** 63, 2 ** 64 - 1, 0.5, 1.5, -0.1,
    1e308, -0.0, "", "x", "x" * 5000, None, True, False, [], {}, [[]], [None], {"type": "text"},
    [-1, 5], [5, 10 ** 6], [5, 2 ** 40], [[1, 2], []], ["a", 1], [{"role": "user"}],
    [{"role": "robot", "content": "x"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": None}], {"include_usage": "yes"}, {"include_usage": True},
])
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "stop", "seed", "stream",
          "stream_options", "n", "steps", "block_length", "remasking", "generation_algorithm", "threshold", "factor",
          "cfg_scale", "algorithm_params", "model", "top_p", "top_k", "min_p", "logprobs", "echo", "best_of", "user", "ignore_eos",
          "return_token_ids", "x_extra", ""]
SMALL = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=5) | NASTY,
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(FIELDS), c, max_size=3),
                     max_leaves=8)
BASE = {"completion": {"prompt": [5, 6, 7], "max_tokens": 4, "block_length": 4},
        "chat": {"messages": [{"role": "user", "content": "di vo"}], "max_tokens": 4, "block_length": 4}}


@st.composite
def hostile_body(draw, kind: str) -> tuple[bytes, str]:
    """(body, content type): a good body mutated in 1 to 3 fields, or corrupted as bytes."""
    body = dict(BASE[kind])
    for _ in range(draw(st.integers(1, 3))):
        body[draw(st.sampled_from(FIELDS))] = draw(NASTY | SMALL)
    raw = encode(body).encode("utf-8", "surrogatepass")
    how = draw(st.sampled_from(["json"] * 6 + ["truncate", "bad-utf8", "binary", "wrap", "deep", "ctype"]))
    ctype = "application/json"
    if how == "truncate":
        raw = raw[:draw(st.integers(0, max(0, len(raw) - 1)))]
    elif how == "bad-utf8":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00"])) + raw[at:]
    elif how == "binary":
        raw = draw(st.binary(max_size=64))
    elif how == "wrap":
        raw = b"[" + raw + b"]"
    elif how == "deep":
        n = draw(st.sampled_from([65, 1000, 100000]))
        raw = raw[:-1] + b',"x":' + b"[" * n + b"]" * n + b"}"
    elif how == "ctype":
        ctype = draw(st.sampled_from(["multipart/form-data; boundary=x", "text/xml", "image/png"]))
    return raw, ctype


def corpus(kind: str) -> list[tuple[bytes, str, int]]:
    """(body, content type, expected status) of the nasty cases issue 14 names, for one endpoint."""
    base = BASE[kind]
    key = "prompt" if kind == "completion" else "messages"

    def j(**kw):
        return encode({**base, **kw}).encode("utf-8", "surrogatepass")
    cases = [
        (j(x_extra=Raw("NaN")), 400), (j(x_extra=Raw("Infinity")), 400), (j(x_extra=Raw("1e400")), 400),
        (j(max_tokens=10 ** 9), 400), (j(max_tokens=-1), 400), (j(max_tokens=Raw("NaN")), 400),
        (j(temperature=Raw("-Infinity")), 400), (j(x=Raw('"\\ud800"')), 400), (j(seed=2 ** 64), 400),
        (j(n=0), 400), (j(n=10 ** 9), 400), (j(top_p=0.5, temperature=0.5), 400), (j(stream="yes"), 400),
        (j(top_p=True), 400), (j(best_of=True), 400), (j(frequency_penalty=False), 400),     # not 1 or 0 (issue 29)
        (j(model="another-model"), 404),
        (j(generation_algorithm="warp"), 400), (j(steps=0), 400), (j(block_length=2 ** 40), 400),
        (j(stop=[""] * 20), 400), (j(**{key: []}), 400), (j(**{key: None}), 400),
        (b"", 400), (b"null", 400), (b"[]", 400), (b"{", 400), (b"\xef\xbb\xbf" + j(), 400), (b"\xff\xfe", 400),
        (b'{"x": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400),
        (j()[:-1] + b', "x": "\xff"}', 400),
        (encode({**base, key: "x" * (10 * 1024 ** 2)}).encode(), 400),            # 10 MB of text
        (encode({**base, key: "x" * (65 * 1024 ** 2)}).encode(), 413),            # over the 64 MiB body limit
    ]
    if kind == "completion":
        cases += [(j(prompt=[5, 300000]), 400), (j(prompt=[-1]), 400), (j(prompt=[[5], []]), 400),
                  (j(prompt=list(range(5, 100005))), 400),                        # a 100k-token prompt
                  (encode({**base, "prompt": [7] * (2 * 1024 ** 2)}).encode(), 400)]   # 2M ids, ~4 MB of JSON
    else:
        cases += [(j(messages=[{}]), 400), (j(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400),
                  (j(messages=[{"role": "user", "content": "x"}] * 100000), 400)]
    out = [(raw, "application/json", status) for raw, status in cases]
    out.append((j(), "multipart/form-data; boundary=x", 415))
    return out


def post_raw(port: int, path: str, raw: bytes, ctype: str, timeout: float = 60) -> tuple[int, bytes, str]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", path, body=raw, headers={"Content-Type": ctype})
        r = c.getresponse()
        return r.status, r.read(), r.getheader("Content-Type", "")
    finally:
        c.close()


def check_answer(status: int, body: bytes, ctype: str) -> None:
    """No 5xx; a 4xx in the OpenAI error shape; a 200 a well-formed answer (JSON, or an SSE stream ending [DONE])."""
    assert status < 500, (status, body[:300])
    if status >= 400:
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], body[:300]
        if status in (400, 413, 415):            # OpenAI's type for a request it cannot take as sent
            assert err["type"] == "invalid_request_error", body[:300]
    elif ctype.startswith("text/event-stream"):
        assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
    else:
        assert json.loads(body)["choices"], body[:300]


class GoodTraffic:
    """Good requests (chat and completion, plain and streamed), 4 lanes at once, each pausing PAUSE s between its
    requests (as many as the hostile ones need beside them, without the suite's machine spending its time on them),
    for as long as the suite runs; each answer is compared with the one the same request got alone before the suite
    began."""

    PAUSE = 0.05

    def __init__(self, url: str):
        self.url, self.results, self.stop = url, [], threading.Event()
        self.requests = [("/v1/completions", {**BASE["completion"], "prompt": [i + 5, 6, 7], "ignore_eos": True,
                                              "stream": i % 2 == 1}) for i in range(4)]
        self.requests += [("/v1/chat/completions", {**BASE["chat"], "stream": i % 2 == 1}) for i in range(2)]
        self.expected = [asyncio.run(self._one(i)) for i in range(len(self.requests))]
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()))

    async def _one(self, i: int, session: aiohttp.ClientSession | None = None) -> tuple[int, str]:
        path, body = self.requests[i]
        own = session is None
        session = session or aiohttp.ClientSession()
        try:
            async with session.post(self.url + path, json=body) as r:
                text = await r.text()
                if body.get("stream"):
                    chunks = [json.loads(x[6:]) for x in text.split("\n") if x.startswith("data: {")]
                    text = "".join((c["choices"][0].get("text") or (c["choices"][0].get("delta") or {})
                                    .get("content") or "") for c in chunks if c.get("choices"))
                else:
                    c = json.loads(text)["choices"][0]
                    text = c.get("text") if "text" in c else c["message"]["content"]
                return r.status, text
        finally:
            if own:
                await session.close()

    async def _run(self) -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            async def lane(k):
                i = k
                while not self.stop.is_set():
                    idx = i % len(self.requests)
                    try:
                        self.results.append((idx, await self._one(idx, s)))
                    except Exception as e:        # noqa: BLE001  (recorded, then asserted on)
                        self.results.append((idx, (0, repr(e))))
                    i += 1
                    await asyncio.sleep(self.PAUSE)
            await asyncio.gather(*[lane(k) for k in range(4)])

    def check(self) -> int:
        wrong = [(i, got) for i, got in self.results if got != self.expected[i]]
        assert not wrong, wrong[:5]
        return len(self.results)


def rss_mb(pid: int) -> float:
    p = psutil.Process(pid)
    return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)]) / 2 ** 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("hostile"), TINY_LLADA, 1, worker_args=["--batch-size", "16"],
                balancer_args=["--batch-size", "8", "--batch-wait-time", "0.01", "--http-processes", "2"])
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def traffic(cluster):
    g = GoodTraffic(cluster.url)
    assert all(s == 200 for s, _ in g.expected)
    mem0 = {"balancer": rss_mb(cluster.balancer.p.pid), "worker": rss_mb(cluster.workers[0].p.pid)}
    g.thread.start()
    yield g
    g.stop.set()
    g.thread.join(60)
    n = g.check()
    for name, proc in (("balancer", cluster.balancer), ("worker", cluster.workers[0])):
        assert proc.p.poll() is None, f"the {name} died:\n{proc.tail()}"
        grew = rss_mb(proc.p.pid) - mem0[name]
        print(f"\n{name}: RSS {mem0[name]:.0f} MB before, grew {grew:+.0f} MB")
        assert grew < 512, f"{name} memory grew by {grew:.0f} MB"
    assert get_json(cluster.url + "/health")[0] == 200
    stats = get_json(cluster.url + "/stats")[1]
    print(f"good requests beside the hostile ones: {n}, all answered right; balancer stats: redispatched "
          f"{stats['redispatched_requests']}, split batches {stats['split_batches']}, "
          f"worker errors {stats['workers'][0]['errors']}")
    assert stats["workers"][0]["errors"] == 0 and stats["split_batches"] == 0


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_fixed_corpus(cluster, traffic, kind):
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    t0 = time.monotonic()
    cases = corpus(kind)
    for raw, ctype, want in cases:
        status, body, rtype = post_raw(cluster.balancer.port, path, raw, ctype)
        check_answer(status, body, rtype)
        assert status == want, (raw[:120], status, body[:300])
    print(f"\n{kind}: {len(cases)} corpus cases, each its expected 4xx, in {time.monotonic() - t0:.1f} s")


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_generated_bodies(cluster, traffic, kind):
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    counts = {}

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(hostile_body(kind))
    def run(case):
        raw, ctype = case
        status, body, rtype = post_raw(cluster.balancer.port, path, raw, ctype)
        check_answer(status, body, rtype)
        counts[status] = counts.get(status, 0) + 1

    t0 = time.monotonic()
    run()
    print(f"\n{kind}: {sum(counts.values())} generated bodies in {time.monotonic() - t0:.1f} s; "
          f"statuses {dict(sorted(counts.items()))}")
    assert sum(counts.values()) >= EXAMPLES


# ---------------------------------------------------------------- issue 29: paths, malformed HTTP, bytes in flight
def small_request(port: int) -> float:
    """A small completion through ``port``: its seconds (asserted 200)."""
    t0 = time.monotonic()
    status, body, _ = post_raw(port, "/v1/completions", json.dumps(BASE["completion"]).encode(), "application/json")
    assert status == 200, body[:300]
    return time.monotonic() - t0


def test_traversals_reach_no_other_worker_route(cluster, traffic):
    """Every encoding of '..', '/' and '\\' (raw, as curl --path-as-is) through the balancer (both HTTP processes)
    and on the worker's own port: a 404 in the OpenAI shape, never another worker route's answer."""
    for port in (cluster.balancer.port, cluster.workers[0].port):
        for target in TRAVERSALS * (3 if port == cluster.balancer.port else 1):
            status, headers, body = raw_http(port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n"
                                                   b"Connection: close\r\n\r\n")
            assert status == 404 and b"max_batch_size" not in body, (port, target, status, body[:300])
            check_answer(status, body, headers.get("content-type", ""))
        assert small_request(cluster.balancer.port) < 10
    print(f"\n{len(TRAVERSALS)} traversal forms: 404 on the balancer (x3) and the worker")


def test_malformed_http_is_openai_shaped(cluster, traffic):
    for port in (cluster.balancer.port, cluster.workers[0].port):
        for what, parts in MALFORMED * (3 if port == cluster.balancer.port else 1):
            status, headers, body = raw_http(port, *parts, gap=0.3)
            assert status == 400 and headers.get("content-type", "").startswith("application/json"), (what, body)
            assert json.loads(body)["error"]["code"] == "malformed_http", what
            assert small_request(cluster.balancer.port) < 10
    print(f"\n{len(MALFORMED)} kinds of malformed HTTP: a JSON 400 from the balancer (x3) and the worker")


def _peak_mb(pid: int) -> float:
    """VmHWM: the process's peak RSS so far."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _stall(port: int, length: int, sent: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {length}\r\n\r\n".encode() + b'{"prompt": "' + b"x" * (sent - 12))
    return s


def _answer(s: socket.socket, timeout: float) -> int:
    s.settimeout(timeout)
    return read_http_answer(s)[0]


def test_large_bodies_in_flight_are_bounded(cluster, traffic):
    """12 clients announce 60 MB bodies and stall (each process holds at most 3: three quarters of 256 MiB), then 8
    send whole 60 MB bodies at once: past the bound each gets 503 + Retry-After at once, small requests are answered
    meanwhile, and what was held is given back."""
    port = cluster.balancer.port
    pids = [cluster.balancer.p.pid] + [c.pid for c in psutil.Process(cluster.balancer.p.pid).children()]
    size = 60 * 10 ** 6
    stallers = [_stall(port, size, 1024 ** 2) for _ in range(12)]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        statuses = list(pool.map(lambda s: _answer(s, 3), stallers))
    refused = statuses.count(503)
    assert refused >= 6 and set(statuses) <= {0, 503}, statuses           # 0: held (no answer yet)
    small = small_request(port)
    assert small < 10
    for s in stallers:
        s.close()
    body = b'{"max_tokens": 4, "n": 0, "prompt": "' + b"x" * (size - 40) + b'"}'      # read whole, then a 400
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(9) as pool:
        bigs = [pool.submit(post_raw, port, "/v1/completions", body, "application/json", 120) for _ in range(8)]
        time.sleep(0.5)
        small2 = small_request(port)
        answers = [f.result() for f in bigs]
    took = time.monotonic() - t0
    assert small2 < 10
    codes = sorted(code for code, _, _ in answers)
    assert set(codes) <= {400, 503}, codes
    for code, raw, ctype in answers:
        if code == 400:
            check_answer(code, raw, ctype)
        else:
            assert json.loads(raw)["error"]["type"] == "service_unavailable"
    peaks = [round(_peak_mb(p)) for p in pids]
    print(f"\n12 stalled 60 MB uploads: {refused} refused at once (503), the rest held; a small request "
          f"{small:.2f} s; then 8 whole 60 MB bodies at once: {codes} in {took:.1f} s, a small request meanwhile "
          f"{small2:.2f} s; peak RSS of the balancer's processes {peaks} MB")
    time.sleep(1)
    for _ in range(3):         # all given back: a whole large body is read again (its 400), not refused
        code, raw, _ = post_raw(port, "/v1/completions", body, "application/json", 120)
        assert code == 400, raw[:300]
