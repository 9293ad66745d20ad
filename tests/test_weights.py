"""New weights without a restart (issue 34): Engine.reload_weights in place, model_version on every answer, POST
/v1/load_weights on the balancer (rolling and paused), requests pinned to a version, refused and failed loads that
change nothing. The two versions are the fixtures tiny-llada and tiny-llada-peaky (the same architecture, config and
tokenizer, other weights), each with the reference code's goldens."""
import asyncio
import contextlib
import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY_LLADA, TINY_LLADA_PEAKY
from tests.helpers import DLLM, ROOT, Cluster, get_json, post_json
from tests.test_exactness import params_of
from worker.engine import Engine, Request
from worker.models import checkpoint
from worker.models.checkpoint import CheckpointError

A, B = TINY_LLADA.resolve(), TINY_LLADA_PEAKY.resolve()


def _cases(n: int = 3) -> list[dict]:
    """A few golden cases of each checkpoint (basic and a Fast-dLLM one), tagged with their checkpoint."""
    out = []
    for path in (A, B):
        cases = json.loads((path.parent / f"{path.name}-golden.json").read_text())["cases"]
        out += [dict(c, of=str(path)) for c in cases if c["algorithm"] == "basic" and not c.get("cfg_scale")][:n]
    return out


def _outputs(engine: Engine, cases: list[dict]) -> list[list[int]]:
    return [engine.generate([Request(c["prompt"], params_of(c))], early_exit=False)[0].canvas for c in cases]


@contextlib.asynccontextmanager
async def _balancer_over_one_worker(aiohttp_client, delay=None, worker_server=None, balancer_server=None, **cfg):
    """A real worker on A behind a balancer with --api-key k, both in this process: (the balancer's client, the
    worker's app). ``delay(path)``: seconds each reload waits before it runs (a test double for a slow load)."""
    from aiohttp.test_utils import TestServer
    from balancer.app import BalancerConfig, make_app as balancer_app
    from worker.app import STATE, WorkerConfig, make_app as worker_app
    worker = TestServer(worker_app(WorkerConfig(model_path=str(A), device="cpu")), **(worker_server or {}))
    await worker.start_server()
    try:
        client = await aiohttp_client(balancer_app(BalancerConfig(
            worker_urls=[str(worker.make_url("")).rstrip("/")], api_key="k", **cfg)),
            server_kwargs=balancer_server or {})
        for _ in range(600):
            if (await (await client.get("/health")).json()).get("healthy_workers") == 1:
                break
            await asyncio.sleep(0.05)
        if delay is not None:
            engine = worker.app[STATE].engine
            real = engine.reload_weights
            engine.reload_weights = lambda path: (time.sleep(delay(path)), real(path))[1]
        yield client, worker.app
    finally:
        await worker.close()


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(A, device="cpu")


def test_weights_load_in_place_and_give_each_checkpoints_goldens(engine):
    cases = _cases()
    ptrs = [p.data_ptr() for p in engine.model.parameters()]
    va = engine.version
    assert va["path"] == str(A) and len(va["hash"]) == 32
    vb = engine.reload_weights(B)
    assert vb["path"] == str(B) and vb["hash"] != va["hash"] and engine.version == vb
    assert [p.data_ptr() for p in engine.model.parameters()] == ptrs          # in place: no second model
    on_b = _outputs(engine, cases)
    assert [o for o, c in zip(on_b, cases) if c["of"] == str(B)] == [c["output"] for c in cases if c["of"] == str(B)]
    assert on_b == _outputs(Engine.from_pretrained(B, device="cpu"), cases)  # the same as a fresh load of B
    checkpoint.reload_native(engine.model, A, "LLaDA", chunk_bytes=256)      # slices of a few rows each
    assert _outputs(engine, cases)[:3] == [c["output"] for c in cases[:3]]
    assert engine.reload_weights(A) == va
    on_a = _outputs(engine, cases)
    assert [o for o, c in zip(on_a, cases) if c["of"] == str(A)] == [c["output"] for c in cases if c["of"] == str(A)]
    assert on_a != on_b


def _variant(tmp_path, name: str, change) -> str:
    d = tmp_path / name
    shutil.copytree(A, d)
    change(d)
    return str(d)


def test_a_load_that_cannot_replace_the_weights_changes_nothing(engine, tmp_path):
    cases = _cases(2)
    before, version = _outputs(engine, cases), engine.version

    def config(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg["rope_theta"] = cfg.get("rope_theta", 10000.0) * 2
        (d / "config.json").write_text(json.dumps(cfg))

    def shapes(d):
        from safetensors.torch import load_file, save_file
        sd = load_file(d / "model.safetensors")
        name = next(k for k in sd if k.endswith("wte.weight"))
        sd[name] = sd[name][:-1].clone()
        save_file(sd, d / "model.safetensors", metadata={"format": "pt"})

    def template(d):
        (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")

    bad = {"another family": (str(ROOT / "tests/fixtures/tiny-dream"), "family change"),
           "another config": (_variant(tmp_path, "cfg", config), "config.json differs"),
           "other shapes": (_variant(tmp_path, "shapes", shapes), "Mismatched shapes"),
           "another tokenizer": (_variant(tmp_path, "tok", template), "tokenizer"),
           "no checkpoint": (str(tmp_path / "nothing"), "not a directory"),
           # these two were a MemoryError and an AttributeError: a 500 from the worker, a 502 from the balancer
           "garbage weights": (_variant(tmp_path, "garbage", lambda d: (d / "model.safetensors").write_bytes(
               b"garbage\n")), "corrupt or truncated safetensors header"),
           "a config that is a list": (_variant(tmp_path, "list", lambda d: (d / "config.json").write_text("[1]")),
                                       "not a JSON object"),
           # (a copy still being written: it passed the check and failed half-way through the load, a chaos run)
           "a truncated file": (_variant(tmp_path, "cut", lambda d: (d / "model.safetensors").write_bytes(
               (d / "model.safetensors").read_bytes()[:-1])), "truncated")}
    for what, (path, says) in bad.items():
        with pytest.raises(CheckpointError, match=says):
            engine.check_weights(path)         # the check alone (the balancer's check_only) refuses it: nothing stops
        with pytest.raises(CheckpointError, match=says):
            engine.reload_weights(path)
        assert engine.version == version, what
    assert _outputs(engine, cases) == before


def _fourth_read_fails(monkeypatch) -> None:
    """The next reload's fourth read fails (an I/O error half-way through the new weights), once."""
    real, calls = checkpoint._read_into, []

    def broken(*a):
        calls.append(1)
        if len(calls) == 4:
            raise OSError("simulated read error")
        return real(*a)
    monkeypatch.setattr(checkpoint, "_read_into", broken)


def test_a_read_that_fails_half_way_puts_the_old_weights_back(engine, monkeypatch):
    cases = _cases(2)
    before, version = _outputs(engine, cases), engine.version
    _fourth_read_fails(monkeypatch)
    with pytest.raises(OSError, match="simulated"):
        engine.reload_weights(B)
    assert engine.version == version and _outputs(engine, cases) == before


def test_weights_put_back_from_a_directory_rewritten_since_their_load_carry_their_own_hash(tmp_path, monkeypatch):
    """An RL run writing each step into one directory: a failed update puts back what that directory holds now, so
    the worker must say so (it kept the old hash over other weights: a chaos run's same-hash workers answered
    differently)."""
    cases = _cases(2)
    latest = shutil.copytree(A, tmp_path / "latest")
    e = Engine.from_pretrained(latest, device="cpu")
    loaded = e.version
    for f in B.glob("*.safetensors"):       # the next step written over the served one
        shutil.copy(f, latest / f.name)
    _fourth_read_fails(monkeypatch)
    with pytest.raises(OSError, match="simulated"):
        e.reload_weights(shutil.copytree(A, tmp_path / "next"))
    assert e.version["hash"] != loaded["hash"]
    assert e.version == checkpoint.model_version(latest)
    assert e.version["hash"] == checkpoint.model_version(B)["hash"]      # (the hash is of the content)
    assert _outputs(e, cases) == _outputs(Engine.from_pretrained(B, device="cpu"), cases)


def test_the_served_checkpoint_may_be_deleted_before_the_next_update(tmp_path):
    """An RL run keeps only its last step: with the served directory gone, every later update was refused ("model
    path '.../step_1' is not a directory": the check read the served config again from disk). The served configs
    are kept from the load."""
    cases = _cases(2)
    base, s1, s2 = (shutil.copytree(src, tmp_path / n) for src, n in ((A, "base"), (B, "step_1"), (A, "step_2")))
    e = Engine.from_pretrained(base, device="cpu")
    e.reload_weights(s1)
    shutil.rmtree(s1)
    shutil.rmtree(base)
    assert e.reload_weights(s2)["path"] == str(s2.resolve())
    assert _outputs(e, cases) == _outputs(Engine.from_pretrained(A, device="cpu"), cases)


async def test_load_weights_needs_the_api_key(aiohttp_client):
    from balancer.app import BalancerConfig, make_app
    open_ = await aiohttp_client(make_app(BalancerConfig(worker_urls=["http://127.0.0.1:9"])))
    r = await open_.post("/v1/load_weights", json={"model_path": str(B)})
    assert r.status == 403 and (await r.json())["error"]["code"] == "api_key_required"
    keyed = await aiohttp_client(make_app(BalancerConfig(worker_urls=["http://127.0.0.1:9"], api_key="k")))
    assert (await keyed.post("/v1/load_weights", json={"model_path": str(B)})).status == 401
    auth = {"Authorization": "Bearer k"}
    for body, param in (({"model_path": str(B), "mode": "fast"}, "mode"), ({}, "model_path"),
                        ({"model_path": str(B), "dcp_path": "/x"}, "model_path"),
                        ({"model_path": str(B), "timeout": -1}, "timeout")):
        r = await keyed.post("/v1/load_weights", json=body, headers=auth)
        assert r.status == 400 and (await r.json())["error"]["param"] == param, body
    r = await keyed.post("/v1/load_weights", json={"model_path": str(B)}, headers=auth)
    assert r.status == 503                              # no healthy worker to load them


@pytest.mark.slow
def test_rolling_and_paused_updates_under_load_answer_each_version_exactly(tmp_path):
    """Two workers behind the balancer, clients sending golden cases all along (some pinned to a version): a rolling
    update to B (through `dllm-serve load-weights`), a refused update, a paused update back to A. Every answer
    equals what its reported version gives (the goldens of its own cases, a fresh engine's for the others), none is
    lost, a pinned client only ever gets its version (or 409 while no worker serves it)."""
    cases = _cases()
    expected = {}
    for path in (A, B):
        e = Engine.from_pretrained(path, device="cpu")
        expected[e.version["hash"]] = _outputs(e, cases)
    ha, hb = Engine.from_pretrained(A, device="cpu").version["hash"], None
    hb = next(h for h in expected if h != ha)
    c = Cluster(tmp_path, A, 2, worker_args=["--batch-size", "8"], balancer_args=["--api-key", "k"])
    auth = {"Authorization": "Bearer k"}
    got, stop = [], threading.Event()

    def client(k: int, pin: str | None):
        i = k
        while not stop.is_set():
            cs = cases[i % len(cases)]
            body = {"prompt": cs["prompt"], "max_tokens": cs["gen_length"], "block_length": cs["block_length"],
                    "steps": cs["steps"], "return_token_ids": True, "ignore_eos": True}
            if pin:
                body["model_version"] = pin
            t0 = time.monotonic()
            status, r = post_json(c.url + "/v1/completions", body, headers=auth, timeout=120)
            got.append((pin, i % len(cases), status, r, t0, time.monotonic()))
            i += 1
            if status == 409:
                time.sleep(0.05)
    try:
        c.wait_ready()
        threads = [threading.Thread(target=client, args=(k, None)) for k in range(4)]
        threads.append(threading.Thread(target=client, args=(0, ha)))
        for t in threads:
            t.start()
        time.sleep(1.0)
        out = subprocess.run([*DLLM, "load-weights", "--url", c.url, "--model-path", str(B), "--api-key", "k"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert json.loads(out.stdout)["model_version"]["hash"] == hb
        rolled = time.monotonic()
        # a worker that comes back on other weights (as a restarted process does) takes no unpinned request until
        # the balancer has brought it to the update's weights
        w0 = c.workers[0].url
        assert post_json(w0 + "/worker/load_weights", {"model_path": str(A)})[0] == 200
        deadline = time.monotonic() + 30
        while get_json(w0 + "/health")[1]["model_version"]["hash"] != hb:
            assert time.monotonic() < deadline, "the balancer did not bring worker 0 back to the update's weights"
            time.sleep(0.05)
        time.sleep(0.5)
        status, r = post_json(c.url + "/v1/load_weights", {"model_path": str(ROOT / "tests/fixtures/tiny-dream")},
                              headers=auth, timeout=120)
        assert status == 400 and "family change" in r["error"]["message"]
        assert {w["model_version"]["hash"] for w in get_json(c.url + "/worker-status")[1]["workers"]} == {hb}
        time.sleep(0.5)
        paused = time.monotonic()
        status, r = post_json(c.url + "/v1/load_weights", {"model_path": str(A), "mode": "pause"}, headers=auth,
                              timeout=120)
        assert status == 200 and r["model_version"]["hash"] == ha and r["mode"] == "pause"
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        stats = get_json(c.url + "/stats")[1]
        c.stop()
    assert stats["weights"]["target"]["hash"] == ha and stats["weights"]["last_update"]["ok"]
    assert {v["hash"] for v in stats["weights"]["versions"]} == {ha}
    answered = [(pin, i, r) for pin, i, status, r, _, _ in got if status == 200]
    assert all(status in (200, 409) for _, _, status, _, _, _ in got)
    assert all(pin is not None for pin, _, status, _, _, _ in got if status == 409)  # only pinned ones wait out
    between = [r["model_version"]["hash"] for pin, _, status, r, t0, t1 in got
               if not pin and status == 200 and rolled < t0 and t1 < paused]
    assert len(between) > 5 and set(between) == {hb}, between      # after the rolling update, unpinned answers are all B's
    seen = {r["model_version"]["hash"] for _, _, r in answered}
    assert seen == {ha, hb}, seen                                                      # both served meanwhile
    wrong = [(i, r["model_version"]["hash"]) for _, i, r in answered
             if r["choices"][0]["token_ids"] != expected[r["model_version"]["hash"]][i]]
    assert wrong == []
    assert all(r["model_version"]["hash"] == ha and r["system_fingerprint"] == ha for pin, _, r in answered if pin)
    pinned = [status for pin, _, status, _, _, _ in got if pin]
    assert 409 in pinned and pinned[-1] == 200          # refused while only B was served, served again after
    assert len(answered) > 40


@pytest.mark.slow
def test_load_weights_from_a_dcp_converts_it_once(tmp_path, monkeypatch):
    """A DCP checkpoint (NeMo-RL's structured layout, of tiny-llada's weights) as the new weights: the balancer
    converts it once (common/dcp_cache.py: a second update reuses the result), every worker then reports the
    converted directory's version. Workers on the simulated device (a test double: the conversion and the versions
    are what is tested here; the weights' effect is the test above's)."""
    from tests.test_launcher import _write_dcp
    monkeypatch.setenv("DLLM_CACHE", str(tmp_path / "cache"))
    _write_dcp(tmp_path / "ckpt", "structured")
    c = Cluster(tmp_path, A, 2, worker_args=["--simulate-device", "0"], balancer_args=["--api-key", "k"])
    auth = {"Authorization": "Bearer k"}
    try:
        c.wait_ready()
        body = {"dcp_path": str(tmp_path / "ckpt"), "base_model": str(A), "mode": "pause"}
        status, r = post_json(c.url + "/v1/load_weights", body, headers=auth, timeout=300)
        assert status == 200, r
        converted = r["model_version"]["path"]
        assert converted.startswith(str(tmp_path / "cache" / "converted"))
        assert [w["model_version"]["path"] for w in r["workers"]] == [converted] * 2
        stamp = (Path(converted) / "config.json").stat().st_mtime_ns
        status, again = post_json(c.url + "/v1/load_weights", body, headers=auth, timeout=300)
        assert status == 200 and again["model_version"] == r["model_version"]
        assert (Path(converted) / "config.json").stat().st_mtime_ns == stamp           # not converted again
        status, ans = post_json(c.url + "/v1/completions", {"prompt": [5, 6], "max_tokens": 4}, headers=auth)
        assert status == 200 and ans["model_version"] == r["model_version"]
        status, bad = post_json(c.url + "/v1/load_weights", {"dcp_path": str(tmp_path), "base_model": str(A)},
                                headers=auth, timeout=60)
        assert status == 400 and bad["error"]["param"] == "dcp_path"
    finally:
        c.stop()


@pytest.mark.slow          # (5 s: the fast tier stays under 3 minutes)
async def test_a_refused_update_stops_nothing_and_a_pinned_request_waits_for_the_incoming_weights(aiohttp_client):
    """The balancer has a worker check the checkpoint before any worker leaves the routing (a refused one answered
    400 only after the batches in flight had drained: seconds of a paused fleet), and knows the incoming weights'
    hash at once, so a request pinned to them waits for the update instead of a 409. The model is slowed (a test
    double: 25 ms a forward), so the long request runs for more than the refusal's 2 s."""
    from tests.conftest import TINY_DREAM
    from worker.app import STATE
    async with _balancer_over_one_worker(aiohttp_client) as (client, worker):
        model = worker[STATE].engine.model
        forward = model.forward
        model.forward = lambda *a, **k: (time.sleep(0.025), forward(*a, **k))[1]
        auth = {"Authorization": "Bearer k"}
        long = {"prompt": [5, 6], "max_tokens": 96, "block_length": 96, "ignore_eos": True}
        running = asyncio.ensure_future(client.post("/v1/completions", json=long, headers=auth))
        await asyncio.sleep(0.3)
        t = time.monotonic()
        r = await client.post("/v1/load_weights", json={"model_path": str(TINY_DREAM), "mode": "pause"}, headers=auth)
        assert r.status == 400 and time.monotonic() - t < 2 and not running.done()
        update = asyncio.ensure_future(client.post("/v1/load_weights", json={"model_path": str(B)}, headers=auth))
        await asyncio.sleep(0.3)
        pinned = await client.post("/v1/completions", headers=auth, json={
            "prompt": [5, 6], "max_tokens": 4, "model_version": checkpoint.model_version(B)["hash"]})
        assert pinned.status == 200, await pinned.text()
        assert (await pinned.json())["model_version"]["hash"] == checkpoint.model_version(B)["hash"]
        assert (await update).status == 200 and (await running).status == 200


async def test_one_load_at_a_time_and_a_client_that_leaves_does_not_end_it(aiohttp_client):
    """A review: two overlapping POST /worker/load_weights both ran (the first to end said "ready" while the other
    loaded on), and a client leaving mid-load set "ready" at once while the load went on in the device thread, so
    a request pinned to the old weights was answered by the new ones. The load here is slowed (a test double:
    1.5 s before the real reload)."""
    from common.worker_config import WorkerConfig
    from worker.app import STATE, make_app
    client = await aiohttp_client(make_app(WorkerConfig(model_path=str(A), device="cpu")),
                                  server_kwargs={"handler_cancellation": True})
    for _ in range(600):
        if (await (await client.get("/health")).json())["status"] == "ready":
            break
        await asyncio.sleep(0.05)
    engine = client.server.app[STATE].engine
    real = engine.reload_weights
    engine.reload_weights = lambda path: (time.sleep(1.5), real(path))[1]
    first = asyncio.create_task(client.post("/worker/load_weights", json={"model_path": str(B)}))
    await asyncio.sleep(0.3)
    second = await client.post("/worker/load_weights", json={"model_path": str(A)})
    assert second.status in (409, 503), await second.text()          # refused, never interleaved
    assert (await (await first).json())["model_version"]["path"] == str(B)
    health = await (await client.get("/health")).json()
    assert health["status"] == "ready" and health["model_version"]["path"] == str(B)

    with pytest.raises(asyncio.TimeoutError):                        # this client leaves mid-load
        await asyncio.wait_for(client.post("/worker/load_weights", json={"model_path": str(A)}), 0.5)
    await asyncio.sleep(0.3)
    health = await (await client.get("/health")).json()
    assert health["status"] == "updating" and health["model_version"]["path"] == str(B)
    r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert r.status == 503                                           # not admitted while the load goes on
    for _ in range(100):
        health = await (await client.get("/health")).json()
        if health["status"] == "ready":
            break
        await asyncio.sleep(0.05)
    assert health["status"] == "ready" and health["model_version"]["path"] == str(A)


async def test_an_update_whose_client_leaves_ends_as_it_would_have(aiohttp_client):
    """A review: Ctrl-C of `dllm-serve load-weights` (the balancer's handler cancelled) stopped the update half-way:
    workers on both weights, no put-back, nothing in last_update. The update is shielded from its client: it goes
    on, ends, and is recorded. The worker's load is slowed (a test double: 1.5 s before the real reload)."""
    from balancer.app import STATE as BALANCER
    async with _balancer_over_one_worker(aiohttp_client, delay=lambda path: 1.5,
                                         balancer_server={"handler_cancellation": True}) as (client, _):
        auth = {"Authorization": "Bearer k"}
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.post("/v1/load_weights", json={"model_path": str(B)}, headers=auth), 0.7)
        weights = client.server.app[BALANCER].weights
        for _ in range(100):
            if weights.last is not None:
                break
            await asyncio.sleep(0.05)
        assert weights.last and weights.last["ok"] and weights.target["path"] == str(B)
        r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, headers=auth)
        assert r.status == 200 and (await r.json())["model_version"]["path"] == str(B)


def test_a_pin_to_weights_no_routable_worker_holds_is_refused_not_kept_waiting():
    """A review: after an update, a worker that came back on its launch weights and could not be synced held them,
    so a request pinned to them was "servable" and waited (--request-timeout: 30 min), while no batch could ever go
    to that worker (routable: only the update's weights). servable() now agrees with routable()."""
    from types import SimpleNamespace

    from balancer.weights import WeightUpdates
    old, new = SimpleNamespace(healthy=True, updating=False, last_health={"model_version": {"hash": "OLD"}}), \
        SimpleNamespace(healthy=True, updating=False, last_health={"model_version": {"hash": "NEW"}})
    updates = WeightUpdates(SimpleNamespace(workers=[old, new]), None, None, {})
    assert updates.servable("OLD") and updates.servable("NEW") and not updates.servable("X")   # no update yet
    updates.target = {"hash": "NEW", "path": "/new"}
    assert not updates.routable(old) and updates.routable(new)
    assert not updates.servable("OLD") and updates.servable("NEW")
    updates.toward = "OLD"                   # an update bringing them back: worth waiting for
    assert updates.servable("OLD")


@pytest.mark.slow          # (5 s: the fast tier stays under 3 minutes)
async def test_a_worker_that_did_not_answer_its_load_in_time_is_put_back_once_it_has_loaded(aiohttp_client):
    """A review: past --weight-load-timeout the balancer answered 502 and left the worker to finish its load on the
    new weights (the fleet mixed, a failed update said to change nothing). It now waits for the worker to settle and
    puts it back. The worker's load is slowed (a test double: 3 s before the real reload)."""
    from worker.app import STATE
    async with _balancer_over_one_worker(aiohttp_client, delay=lambda path: 3 if Path(path) == B else 0,
                                         worker_server={"handler_cancellation": True},
                                         weight_load_timeout=1) as (client, worker):
        auth = {"Authorization": "Bearer k"}
        r = await client.post("/v1/load_weights", json={"model_path": str(B), "timeout": 0.5}, headers=auth)
        assert r.status == 502, await r.text()
        assert worker[STATE].engine.version["path"] == str(A)          # put back, not left on B
        r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, headers=auth)
        assert r.status == 200 and (await r.json())["model_version"]["path"] == str(A)


async def test_a_worker_the_sync_could_not_bring_onto_the_update_is_tried_again(aiohttp_client):
    """Once an update has succeeded, a worker that comes back on other weights (here: loaded behind the balancer's
    back) is brought onto the update's. Its first two loads fail (a test double: the reload raises OSError for B
    twice, as a checkpoint on a flaky file system would): it is listed in /stats weights.sync_failures with its
    error, tried again after --weight-sync-retry (doubled), and serves again on B once a load succeeds. (It was never
    tried again before its process changed.)"""
    from balancer.pool import HealthConfig
    from worker.app import STATE
    async with _balancer_over_one_worker(aiohttp_client, weight_sync_retry=0.2, weight_sync_retry_max=0.5,
                                         health=HealthConfig(interval=0.1)) as (client, worker):
        auth = {"Authorization": "Bearer k"}
        r = await client.post("/v1/load_weights", json={"model_path": str(B)}, headers=auth)
        assert r.status == 200, await r.text()
        hb = (await r.json())["model_version"]["hash"]
        engine = worker[STATE].engine
        real, fails = engine.reload_weights, [2]

        def flaky(path):
            if Path(path) == B and fails[0]:
                fails[0] -= 1
                raise OSError("the file system went away")
            return real(path)
        engine.reload_weights = flaky
        await asyncio.get_running_loop().run_in_executor(worker[STATE].batcher._executor, real, str(A))
        seen = []
        for _ in range(200):
            weights = (await (await client.get("/stats")).json())["weights"]
            seen += weights["sync_failures"]
            if engine.version["hash"] == hb and not weights["sync_failures"]:
                break
            await asyncio.sleep(0.05)
        assert engine.version["hash"] == hb and fails == [0]
        assert {f["failures"] for f in seen} == {1, 2}, seen
        assert all(f["worker"] == 0 and "the file system went away" in f["error"] for f in seen)
        r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, headers=auth)
        assert r.status == 200 and (await r.json())["model_version"]["hash"] == hb


def test_the_sync_retry_waits_double_up_to_the_cap():
    """The wait doubles per failure in a row up to the cap, for as long as the failures go on (2 ** 1024 overflowed
    a float: a review); a failure is forgotten once the target changes, or its process is replaced."""
    from types import SimpleNamespace

    from balancer.weights import WeightUpdates
    w = SimpleNamespace(index=3, instance_id="p1", healthy=True, updating=False,
                        last_health={"model_version": {"hash": "OLD"}})
    updates = WeightUpdates(SimpleNamespace(workers=[w]), None, None, {}, sync_retry=(10.0, 35.0))
    updates.target = {"hash": "NEW", "path": "/new"}
    waits = []
    for _ in range(4):
        t0 = time.monotonic()
        updates._sync_failure((3, "p1"), 3, "no", "NEW")
        waits.append(round(updates._sync_failed[(3, "p1")]["next"] - t0))
        assert not updates._sync_due(w, time.monotonic())
    assert waits == [10, 20, 35, 35]
    assert updates._sync_due(w, time.monotonic() + 36)
    (listed,) = updates.snapshot()["sync_failures"]
    assert listed.pop("next_try_in") > 30 and listed == {"worker": 3, "failures": 4, "error": "no"}
    for _ in range(2000):
        updates._sync_failure((3, "p1"), 3, "no", "NEW")
    assert updates._sync_failed[(3, "p1")]["next"] - time.monotonic() <= 35

    async def rounds():
        await updates._sync_round()                     # same target, same process: still waiting
        assert (3, "p1") in updates._sync_failed
        updates.target = {"hash": "NEWER", "path": "/newer"}
        updates._sync_due = lambda w, now: False        # (no load in this unit test)
        await updates._sync_round()
        assert updates._sync_failed == {}
    asyncio.run(rounds())


async def test_a_request_pinned_to_the_incoming_weights_is_served_when_a_later_update_ends(aiohttp_client):
    """A review: when an update after the first ended, the queue heard it before the target changed, so a request
    pinned to the weights it brought was judged against the old target and got 409 `model_version_unavailable`.
    The load is slowed to 1 s (a test double) so the pinned request waits for it."""
    from worker.models import checkpoint
    auth = {"Authorization": "Bearer k"}
    async with _balancer_over_one_worker(aiohttp_client, delay=lambda path: 1.0) as (client, worker):
        r = await client.post("/v1/load_weights", json={"model_path": str(B)}, headers=auth)
        assert r.status == 200, await r.text()
        update = asyncio.ensure_future(client.post("/v1/load_weights", json={"model_path": str(A)}, headers=auth))
        await asyncio.sleep(0.5)
        pinned = await client.post("/v1/completions", headers=auth, json={
            "prompt": [5, 6], "max_tokens": 4, "model_version": checkpoint.model_version(A)["hash"]})
        assert (await update).status == 200
        assert pinned.status == 200, await pinned.text()
        assert (await pinned.json())["model_version"]["path"] == str(A)


async def test_a_worker_that_cannot_be_put_back_takes_no_requests_and_the_failure_says_so(aiohttp_client, tmp_path):
    """A review: worker 1 could not read the new weights (an I/O error half-way, a test double), and worker 0, already
    on them, could not be put back (its previous checkpoint deleted since its load, as RL runs do): the failure said
    "were put back", a 400 `model_path` (the client's fault, not to be retried), and unpinned requests were answered
    from both weights. Now a 502 saying worker 0 could not be put back; it takes no request until it holds its
    previous weights again (/stats weights.stranded), so every answer comes from the one version."""
    import shutil

    from aiohttp.test_utils import TestServer
    from balancer.app import BalancerConfig, make_app as balancer_app
    from worker.app import STATE, WorkerConfig, make_app as worker_app
    step = tmp_path / "step_1"
    shutil.copytree(A, step)
    servers = [TestServer(worker_app(WorkerConfig(model_path=str(step), device="cpu"))) for _ in range(2)]
    for s in servers:
        await s.start_server()
    try:
        client = await aiohttp_client(balancer_app(BalancerConfig(
            worker_urls=[str(s.make_url("")).rstrip("/") for s in servers], api_key="k")))
        for _ in range(600):
            if (await (await client.get("/health")).json()).get("healthy_workers") == 2:
                break
            await asyncio.sleep(0.05)
        second = servers[1].app[STATE].engine
        real = second.reload_weights
        second.reload_weights = lambda path: (_ for _ in ()).throw(OSError("Input/output error")) \
            if Path(path) == B else real(path)
        shutil.rmtree(step)
        auth = {"Authorization": "Bearer k"}
        r = await client.post("/v1/load_weights", json={"model_path": str(B)}, headers=auth)
        err = (await r.json())["error"]
        assert r.status == 502 and "worker 0 could not be put back" in err["message"], err
        assert "are on their previous weights again" not in err["message"]
        assert [s.app[STATE].engine.version["path"] for s in servers] == [str(B), str(step)]
        weights = (await (await client.get("/stats")).json())["weights"]
        assert [x["worker"] for x in weights["stranded"]] == [0]
        answered = set()
        for i in range(8):
            a = await client.post("/v1/completions", json={"prompt": [1, 2 + i], "max_tokens": 2}, headers=auth)
            answered.add((await a.json())["model_version"]["path"])
        assert answered == {str(step)}
        health = await (await client.get("/health")).json()
        assert len(health["model_versions"]) == 1          # what a request may get
    finally:
        for s in servers:
            await s.close()


@pytest.mark.slow          # (6 s: the fast tier stays under 3 minutes)
async def test_a_load_that_outlasts_the_wait_is_put_back_by_the_sync(aiohttp_client):
    """A review: a load past the balancer's whole wait (the worker's own load goes on) ended a "failed" update with
    the worker on the new weights, serving everyone. It is now stranded: no request until the sync has put it back.
    The load of B is slowed to 4 s (a test double)."""
    from worker.app import STATE
    auth = {"Authorization": "Bearer k"}
    async with _balancer_over_one_worker(aiohttp_client, delay=lambda p: 4 if Path(p) == B else 0,
                                         worker_server={"handler_cancellation": True}, weight_load_timeout=0.5,
                                         request_timeout=1, weight_sync_retry=0.5) as (client, worker):
        r = await client.post("/v1/load_weights", json={"model_path": str(B), "timeout": 0.2}, headers=auth)
        err = (await r.json())["error"]
        assert r.status == 502 and "could not be put back" in err["message"], err
        assert "no answer within" in err["message"]                     # (it said "TimeoutError: ")
        meanwhile = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, headers=auth)
        assert meanwhile.status in (503, 504)   # waited (--request-timeout 1 s) or refused: never an answer from B
        for _ in range(300):
            if (await (await client.get("/stats")).json())["weights"]["stranded"] == []:
                break
            await asyncio.sleep(0.1)
        assert worker[STATE].engine.version["path"] == str(A)        # put back by the sync once its load ended
        for _ in range(20):                     # (its backoff after the refusals of the load it was busy with)
            a = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, headers=auth)
            if a.status == 200:
                break
        assert a.status == 200 and (await a.json())["model_version"]["path"] == str(A)


async def test_an_update_refused_while_the_sync_runs_names_the_sync():
    """A review: while the sync brought a worker onto the update's weights it held the update lock, and a new update
    was refused "a weight update is already running (None)", /stats showing none. It names the sync now, and /stats
    shows it (`weights.sync`)."""
    from types import SimpleNamespace

    from balancer.weights import WeightUpdates
    from common.protocol import APIError
    updates = WeightUpdates(SimpleNamespace(workers=[]), None, None, {})
    async with updates._lock:
        updates.syncing = {"worker": 2, "path": "/ckpt/step_9", "started": 0.0}
        with pytest.raises(APIError) as refused:
            await updates.load("/ckpt/step_10", "rolling", 1.0)
    e = refused.value
    assert e.status == 409 and e.code == "update_in_progress" and "worker 2 is being brought" in e.message
    assert "/ckpt/step_9" in e.message and updates.snapshot()["sync"]["worker"] == 2


async def test_a_batch_whose_rows_were_checked_against_weights_replaced_meanwhile_is_refused(aiohttp_client):
    """A review: /worker/batch checked the batch's allowed weights, then prepared its rows (on a thread for a large
    body), and a load that ended meanwhile let the rows run on weights never checked. The weights are compared again
    after the rows are prepared: a 409 naming the new ones (the balancer re-queues it). The load is a test double:
    the engine's version replaced while the rows are prepared."""
    from tests.test_worker_app import ready_client
    from worker.app import STATE
    client, _ = await ready_client(aiohttp_client)
    state = client.server.app[STATE]
    have, prepare = state.engine.version, state.serving.prepare

    def prepare_as_a_load_ends(kind, body):
        state.engine.version = replaced
        return prepare(kind, body)
    state.serving.prepare = prepare_as_a_load_ends
    batch = {"model_versions": [have["hash"]], "requests": [
        {"id": "r1", "kind": "completion", "body": {"prompt": [5, 6], "max_tokens": 4}}]}
    try:
        replaced = {"path": "/ckpt/new", "hash": "f" * 32}
        r = await client.post("/worker/batch", json=batch)
        body = await r.json()
        assert r.status == 409 and body["model_version"]["hash"] == "f" * 32, body
        assert body["error"]["code"] == "model_version_unavailable"
        state.engine.version = have
        replaced = dict(have)          # the same weights loaded again (a new object): served (a second review)
        batch["requests"][0]["id"] = "r2"
        r = await client.post("/worker/batch", json=batch)
        assert r.status == 200 and b'"end":true' in await r.read()
    finally:
        state.serving.prepare, state.engine.version = prepare, have


def _stub_updates(workers, answers=None):
    """WeightUpdates over test doubles of workers, its loads recorded; a path loads as the weights ``answers`` names
    (else its name in capitals)."""
    from types import SimpleNamespace

    from balancer.weights import WeightUpdates
    updates = WeightUpdates(SimpleNamespace(workers=workers), SimpleNamespace(versions_changed=lambda: None), None,
                            {})
    loads = []

    async def load_one(w, path, timeout, check_only=False):
        loads.append((w.index, path))
        v = {"hash": (answers or {}).get(path, path.upper()), "path": path}
        w.last_health = {**w.last_health, "model_version": v}
        return v

    async def settled(w):
        return True

    async def drained(ws, timeout):
        return None
    updates._load_one, updates._settled, updates._drained = load_one, settled, drained
    return updates, loads


def _stub_worker(index, hash_, path=None):
    from types import SimpleNamespace
    return SimpleNamespace(index=index, instance_id=f"p{index}", healthy=True, updating=False, inflight_batches=0,
                           last_health={"model_version": {"hash": hash_, "path": path or hash_.lower()}})


async def test_stranded_workers_keep_what_they_must_hold_and_the_sync_neither_loops_nor_chases_moot_weights():
    """A second review of the stranded workers (test doubles for workers and their loads):
    - a second failed update recorded the weights a stranded worker had been left on (its put-back target was
      those too), and once the sync loaded them it took requests on weights no other worker held;
    - a stranded checkpoint rewritten in place (it loads under another hash) was loaded again every 0.5 s, forever;
    - a worker stranded on weights other than a later update's target was chased to them by the sync, never to the
      target (on them it would not have been routable either)."""
    from common.protocol import APIError
    w = _stub_worker(0, "B1")                             # stranded on B1 by a first failed update; must hold STEP
    updates, loads = _stub_updates([w], answers={"step": "STEP2"})     # (step rewritten in place since)
    updates._stranded[(0, "p0")] = {"hash": "STEP", "path": "step"}
    assert not updates.routable(w) and updates.stranded_fleet() is not None

    async def refuse(w_, path, timeout, check_only=False):
        loads.append((w_.index, path))
        raise APIError(400, "not a directory")
    real, updates._load_one = updates._load_one, refuse
    stuck = await updates._put_back([(w, {"hash": "B1", "path": "b1"})])     # a second update's put-back fails
    assert loads == [(0, "step")] and [x.index for x, _ in stuck] == [0]
    assert updates._stranded[(0, "p0")]["hash"] == "STEP"                     # still what it must hold

    # the stranded checkpoint now holds other weights: a failure, with its backoff, not a load every round
    updates._load_one = real
    loads.clear()
    await updates._sync_round()
    assert loads == [(0, "step")] and (0, "p0") in updates._sync_failed
    assert "now holds other weights" in updates._sync_failed[(0, "p0")]["error"]
    await updates._sync_round()
    assert loads == [(0, "step")]                                             # waiting for its next try

    # a later update's target makes the stranded weights moot: the sync brings the worker to the target
    updates._sync_failed.clear()
    updates.target = {"hash": "T", "path": "t"}
    w.last_health = {"model_version": {"hash": "L", "path": "l"}}
    updates._stranded[(0, "p0")] = {"hash": "L", "path": "l"}
    assert updates._wanted(w) == updates.target and updates.stranded_fleet() is None
    loads.clear()
    await updates._sync_round()
    assert loads == [(0, "t")] and updates.routable(w)


async def test_a_fleet_left_stranded_says_so_at_admission_and_on_health(aiohttp_client):
    """A second review: a one-worker fleet whose worker a failed update could not put back took requests that waited
    their whole --request-timeout (30 min by default), and /health said "ok". Admission now answers 503 naming
    the stranded workers and /health says `no_routable_workers`. A fake worker (tests/fakes.py: a test double)
    reports weights other than those it must hold."""
    from balancer.app import STATE, BalancerConfig, make_app
    from balancer.pool import HealthConfig
    from tests.fakes import fake_worker, workers
    async with workers(fake_worker("ok", [], version="bbb")) as urls:
        client = await aiohttp_client(make_app(BalancerConfig(worker_urls=urls,
                                                              health=HealthConfig(interval=0.05))))
        for _ in range(200):
            if (await (await client.get("/health")).json())["healthy_workers"] == 1:
                break
            await asyncio.sleep(0.02)
        state = client.server.app[STATE]
        w = state.pool.workers[0]
        state.weights._stranded[(w.index, w.instance_id)] = {"hash": "aaa", "path": "/weights/aaa"}
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        err = (await r.json())["error"]
        assert r.status == 503 and "could not be put back" in err["message"] and "[0]" in err["message"], err
        r = await client.get("/health")
        health = await r.json()
        assert r.status == 503 and health["status"] == "no_routable_workers" and health["model_versions"] == []
        state.weights._stranded.clear()
        assert (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})).status == 200
