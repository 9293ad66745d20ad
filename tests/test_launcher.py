"""Launcher and operations: model resolution, DCP conversion, the status command, GPU assignment, and
`dllm-serve serve --local` end to end (supervised workers, restart after kill -9, SIGTERM with nothing left)."""
import json
import re
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import click
import psutil
import pytest
from aiohttp import web
from click.testing import CliRunner

from dllm_serve.cli import _gpu_ids, main as cli
from common.resolve import DEMO_MODEL, ResolveError, resolve_model, served_names
from tests.conftest import TINY_LLADA
from tests.helpers import DLLM, ROOT, free_port, get_json, post_json


# ---------------------------------------------------------------- model resolution
def test_resolve_local_demo_and_errors(tmp_path):
    assert resolve_model(None) == DEMO_MODEL
    assert resolve_model(str(TINY_LLADA)) == TINY_LLADA.resolve()
    with pytest.raises(ResolveError, match="no such directory"):
        resolve_model(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ResolveError, match="no weights"):
        resolve_model(str(tmp_path))


def test_resolve_hub_id_through_the_local_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    import importlib

    import huggingface_hub.constants as c
    importlib.reload(c)
    with pytest.raises(ResolveError, match="not in the Hugging Face cache"):
        resolve_model("GSAI-ML/LLaDA-8B-Instruct")
    repo = tmp_path / "hf" / "hub" / "models--GSAI-ML--LLaDA-8B-Instruct"
    snap = repo / "snapshots" / "abc123"
    shutil.copytree(TINY_LLADA, snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    try:
        assert resolve_model("GSAI-ML/LLaDA-8B-Instruct") == snap
    finally:
        monkeypatch.undo()
        importlib.reload(c)


def test_served_names_are_what_a_client_resolves_to_the_tokenizer(monkeypatch, tmp_path):
    """Issue 27, as vLLM: a local checkpoint is served under its absolute path, a hub id under the hub id (not its
    cache snapshot's path); the last component stays accepted; --served-model-name still overrides."""
    monkeypatch.chdir(ROOT)
    assert served_names("worker/demo_model") == [str(DEMO_MODEL), "demo_model"]
    (tmp_path / "link").symlink_to(TINY_LLADA)
    assert served_names(tmp_path / "link") == [str(TINY_LLADA.resolve()), "tiny-llada"]
    assert served_names("GSAI-ML/LLaDA-8B-Instruct") == ["GSAI-ML/LLaDA-8B-Instruct", "LLaDA-8B-Instruct"]
    import balancer.supervisor
    import common.resolve
    seen = []
    monkeypatch.setattr(balancer.supervisor, "run", lambda cfg: seen.append(cfg) or 0)
    monkeypatch.setattr(common.resolve, "resolve_model", lambda spec: TINY_LLADA.resolve() if spec else DEMO_MODEL)
    for args, names in (([], f"{DEMO_MODEL},demo_model"),
                        (["--model-path", "GSAI-ML/LLaDA-8B-Instruct"], "GSAI-ML/LLaDA-8B-Instruct,LLaDA-8B-Instruct"),
                        (["--served-model-name", "llada"], "llada")):
        assert CliRunner().invoke(cli, ["serve", "--local", *args]).exit_code == 0
        command = seen.pop().worker_command()
        assert command[command.index("--served-model-name") + 1] == names


def test_gpu_ids(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert _gpu_ids(None, None) is None            # no GPU visible: one CPU worker
    assert _gpu_ids(None, None, workers=2) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert _gpu_ids(None, None) == ["1", "3"]      # every visible GPU by default
    assert _gpu_ids(None, None, workers=2) is None  # --workers asks for CPU workers
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")      # e.g. set by SLURM for the job
    assert _gpu_ids(2, None) == ["4", "5"]
    with pytest.raises(click.BadParameter, match="--gpus 5 but CUDA_VISIBLE_DEVICES lists 4"):
        _gpu_ids(5, None)
    # conflicting or impossible GPU flags were taken silently (a review): --workers or --gpus ignored, a GPU twice,
    # one not visible (its worker crash-looped), "," (no worker at all, yet "running")
    assert _gpu_ids(None, "6,4") == ["6", "4"]
    for args, words in (((2, "4"), "not both"), ((None, "4", 3), "--workers is for CPU workers"),
                        ((1, None, 3), "--workers is for CPU workers"), ((None, "4,4"), "names a GPU twice"),
                        ((None, "9"), "GPU 9 is not one of those CUDA_VISIBLE_DEVICES lists (4,5,6,7)"),
                        ((None, ","), "expected GPU ids"), ((None, ""), "expected GPU ids")):
        with pytest.raises(click.UsageError, match=re.escape(words)):
            _gpu_ids(*args)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr("shutil.which", lambda name: None)    # no nvidia-smi: no GPU, checked before launch
    for gpus, ids in ((2, None), (None, "0,1")):
        with pytest.raises(click.BadParameter, match="shows no GPU"):
            _gpu_ids(gpus, ids)
    r = CliRunner().invoke(cli, ["serve", "--local", "--gpus", "2"])
    assert r.exit_code == 2 and "shows no GPU" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(cli, ["serve", "--local", "--dtype", "half"])
    assert r.exit_code == 2 and "'half' is not one of" in r.output


# ---------------------------------------------------------------- DCP
def _write_dcp(dest: Path, layout: str):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    sd = load_file(TINY_LLADA / "model.safetensors")
    if layout == "structured":      # NeMo-RL: weights/ = DCP of {"model": state_dict}, plus tokenizer/
        dcp.save({"model": sd}, checkpoint_id=str(dest / "weights"))
        (dest / "tokenizer").mkdir()
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(TINY_LLADA / f, dest / "tokenizer" / f)
    else:                           # legacy: .metadata and *.distcp at the top, keys with the HF module prefix
        dcp.save({"model." + k: v for k, v in sd.items()}, checkpoint_id=str(dest))


# (each conversion is a subprocess importing torch, ~5 s: the fast tier keeps the structured layout and the errors
# found without one; the slow tier runs the rest)
@pytest.mark.parametrize("layout", ["structured", pytest.param("legacy", marks=pytest.mark.slow)])
def test_dcp_converts_once_and_generates_identically(tmp_path, layout, llada_golden, monkeypatch):
    monkeypatch.setenv("DLLM_CACHE", str(tmp_path / "cache"))
    _write_dcp(tmp_path / "ckpt", layout)
    runner = CliRunner()
    r = runner.invoke(cli, ["convert-dcp", "--dcp-path", str(tmp_path / "ckpt"), "--base-model", str(TINY_LLADA)])
    assert r.exit_code == 0, r.output
    out = Path(r.stdout.strip().splitlines()[-1])
    assert "converting" in r.stderr
    assert "auto_map" in json.loads((TINY_LLADA / "config.json").read_text())
    assert "auto_map" not in json.loads((out / "config.json").read_text())     # its .py files are not shipped
    again = runner.invoke(cli, ["convert-dcp", "--dcp-path", str(tmp_path / "ckpt"), "--base-model", str(TINY_LLADA)])
    assert "reusing" in again.stderr and Path(again.stdout.strip().splitlines()[-1]) == out
    case = next(c for c in llada_golden["cases"] if c["algorithm"] == "basic")
    args = ["generate", "--prompt-ids", ",".join(map(str, case["prompt"])), "--gen-length", str(case["gen_length"]),
            "--block-length", str(case["block_length"]), "--steps", str(case["steps"]), "--json", "--no-early-exit",
            "--device", "cpu"]
    converted = json.loads(runner.invoke(cli, args[:1] + ["--model-path", str(out)] + args[1:]).stdout)
    assert converted["canvas"] == case["output"]


@pytest.mark.slow
def test_dcp_relative_paths_and_an_output_that_is_not_a_conversion(tmp_path, monkeypatch):
    """Relative --dcp-path and --output were read in the project's directory (the conversion runs there): "not a DCP
    checkpoint", or a conversion written into the checkout. And an existing --output was replaced whole, whatever it
    held (notes.txt gone, exit 0)."""
    _write_dcp(tmp_path / "ckpt", "structured")
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("mine")
    r = runner.invoke(cli, ["convert-dcp", "--dcp-path", "ckpt", "--base-model", str(TINY_LLADA), "--output", "mine"])
    assert r.exit_code != 0 and "not a converted checkpoint" in r.output and (keep / "notes.txt").exists()
    r = runner.invoke(cli, ["convert-dcp", "--dcp-path", "ckpt", "--base-model", str(TINY_LLADA), "--output", "out"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out" / "config.json").is_file() and not list(ROOT.glob(".out.tmp-*"))
    again = runner.invoke(cli, ["convert-dcp", "--dcp-path", "ckpt", "--base-model", str(TINY_LLADA), "--output", "out"])
    assert again.exit_code == 0 and "reusing" in again.stderr


@pytest.mark.slow
def test_dcp_racing_launches_convert_once(tmp_path):
    _write_dcp(tmp_path / "ckpt", "structured")
    env = dict(os.environ, DLLM_CACHE=str(tmp_path / "cache"))
    cmd = DLLM + ["convert-dcp", "--dcp-path", str(tmp_path / "ckpt"), "--base-model", str(TINY_LLADA)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sum("converting" in err for _, err in outs) == 1
    assert len({out.strip() for out, _ in outs}) == 1


@pytest.mark.slow
def test_sigterm_while_converting_leaves_no_converter_and_the_next_launch_clears_its_directory(tmp_path, monkeypatch):
    """SIGTERM to a launch converting its DCP (before its supervisor runs) left the converter running, orphaned,
    and its temporary directory (a whole checkpoint) was never removed; a DCP still being written (an empty
    .metadata) failed with "Aborted!" and nothing else."""
    _write_dcp(tmp_path / "ckpt", "structured")
    env = dict(os.environ, DLLM_CACHE=str(tmp_path / "cache"))
    serve = subprocess.Popen(DLLM + ["serve", "--local", "--dcp-path", str(tmp_path / "ckpt"), "--base-model",
                                     str(TINY_LLADA), "--port", str(free_port()), "--log-dir", str(tmp_path / "logs")],
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        converter = None
        while converter is None and time.monotonic() < deadline and serve.poll() is None:
            converter = next((c for c in psutil.Process(serve.pid).children()
                              if "convert-dcp" in " ".join(c.cmdline())), None)
            time.sleep(0.05)
        assert converter is not None, "no converter seen"
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=30)
        gone, alive = psutil.wait_procs([converter], timeout=15)
        assert not alive, f"the converter outlived its launch: {converter.cmdline()}"
    finally:
        serve.kill()
        serve.wait()
    cache = tmp_path / "cache" / "converted"
    left = list(cache.glob(".*.tmp-*"))
    from common.dcp_cache import default_output
    monkeypatch.setenv("DLLM_CACHE", env["DLLM_CACHE"])
    out = default_output(tmp_path / "ckpt")
    stale = out.parent / f".{out.name}.tmp-1"        # (and one of a launch killed before)
    stale.mkdir(parents=True, exist_ok=True)
    (stale / "model.safetensors").write_bytes(b"x")
    r = subprocess.run(DLLM + ["convert-dcp", "--dcp-path", str(tmp_path / "ckpt"), "--base-model", str(TINY_LLADA)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not list(cache.glob(".*.tmp-*")), (left, list(cache.iterdir()))
    (tmp_path / "ckpt" / "weights" / ".metadata").write_bytes(b"")
    r = subprocess.run(DLLM + ["convert-dcp", "--dcp-path", str(tmp_path / "ckpt"), "--base-model", str(TINY_LLADA)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "cannot read the DCP checkpoint" in r.stderr and "EOFError" in r.stderr, r.stderr
    info = tmp_path / "info.env"             # a launch on it fails (exit 1), and its server-info file says so
    r = subprocess.run(DLLM + ["serve", "--local", "--dcp-path", str(tmp_path / "ckpt"), "--base-model",
                               str(TINY_LLADA), "--server-info-file", str(info), "--port", str(free_port())],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and 'SERVER_STATUS="failed"' in info.read_text(), (r.stderr, info.read_text())
    assert "EOFError" in info.read_text()


def test_serve_dcp_usage_errors_are_exit_2_as_model_path_ones(tmp_path):
    """`serve --dcp-path` without --base-model, or with a path that is not a directory, exited 1 ("error:") where
    the same mistakes with --model-path are usage errors (exit 2)."""
    (tmp_path / "d").mkdir()
    for args, words in ((["--dcp-path", str(tmp_path / "d")], "--dcp-path needs --base-model"),
                        (["--dcp-path", str(tmp_path / "none"), "--base-model", str(TINY_LLADA)], "not a directory"),
                        (["--dcp-path", str(tmp_path / "d"), "--base-model", str(TINY_LLADA), "--model-path",
                          str(TINY_LLADA)], "not both")):
        r = CliRunner().invoke(cli, ["serve", "--local", *args])
        assert r.exit_code == 2 and words in r.output, r.output


def test_dcp_with_wrong_names_is_a_clear_error(tmp_path, monkeypatch):
    import torch
    import torch.distributed.checkpoint as dcp
    monkeypatch.setenv("DLLM_CACHE", str(tmp_path / "cache"))
    dcp.save({"model": {"encoder.weight": torch.zeros(2)}}, checkpoint_id=str(tmp_path / "ckpt" / "weights"))
    r = CliRunner().invoke(cli, ["convert-dcp", "--dcp-path", str(tmp_path / "ckpt"), "--base-model", str(TINY_LLADA)])
    assert r.exit_code != 0 and "lacks" in r.output
    r = CliRunner().invoke(cli, ["convert-dcp", "--dcp-path", str(tmp_path), "--base-model", str(TINY_LLADA)])
    assert r.exit_code != 0 and "not a DCP checkpoint" in r.output


@pytest.mark.slow
def test_dcp_of_another_model_size_is_refused_before_converting(tmp_path, monkeypatch):
    """A DCP with the base model's names but other shapes (another size of the family) was converted, and failed only
    when a worker loaded it; it is refused at once, naming a tensor, and nothing is written."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    monkeypatch.setenv("DLLM_CACHE", str(tmp_path / "cache"))
    sd = load_file(TINY_LLADA / "model.safetensors")
    name = sorted(k for k in sd if sd[k].dim() == 2)[0]
    sd[name] = sd[name][:, :-1].contiguous()
    dcp.save({"model": sd}, checkpoint_id=str(tmp_path / "ckpt" / "weights"))
    r = CliRunner().invoke(cli, ["convert-dcp", "--dcp-path", str(tmp_path / "ckpt"), "--base-model", str(TINY_LLADA),
                                 "--output", str(tmp_path / "out")])
    rows, cols = sd[name].shape
    assert r.exit_code == 1 and "1 tensors of the DCP checkpoint differ in shape" in r.output, r.output
    assert f"{name}: [{rows}, {cols}] in the DCP, [{rows}, {cols + 1}] in the base model" in r.output
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- status command
def _fake_balancer(healthy: int, total: int, system: str | None = None):
    ws = {"timestamp": 0, "healthy_workers": healthy, "total_workers": total,
          "system_status": system or ("normal" if healthy == total else ("down" if not healthy else "degraded")),
          "workers": [{"worker_id": i, "url": f"http://w{i}", "status": "idle" if i < healthy else "unhealthy",
                       "in_flight": 0, "in_flight_batches": 0, "requests_served": 3, "errors": 0,
                       "last_activity_seconds_ago": 1.0, "worker_health": {}} for i in range(total)]}
    stats = {"queue_depth": 0, "in_flight": 0, "redispatched_requests": 0,
             "centralized_batching": {"max_batch_size": 16, "max_wait_time": 0.02, "total_batches_processed": 1,
                                      "avg_batch_size": 1.0},
             "last_minute": {"requests": 1, "requests_per_second": 0.1, "latency_p50": 0.1, "latency_p99": 0.1}}
    async def worker_status(request):
        return web.json_response(ws)

    async def get_stats(request):
        return web.json_response(stats)

    app = web.Application()
    app.router.add_get("/worker-status", worker_status)
    app.router.add_get("/stats", get_stats)
    return app


@pytest.mark.parametrize("healthy, code, system", [(2, 0, None), (1, 1, None), (0, 2, None), (2, 2, "draining")])
async def test_status_exit_codes(aiohttp_server, healthy, code, system):
    """0 all healthy, 1 degraded, 2 down or draining (shutting down: it takes no new request; a review found a
    draining server reported normal, exit 0)."""
    import asyncio
    server = await aiohttp_server(_fake_balancer(healthy, 2, system))
    url = str(server.make_url("")).rstrip("/")
    loop = asyncio.get_running_loop()
    res = await loop.run_in_executor(None, lambda: CliRunner().invoke(cli, ["status", "--url", url]))
    assert res.exit_code == code, res.output
    assert "unhealthy" in res.output if healthy < 2 else "idle" in res.output
    res = await loop.run_in_executor(None, lambda: CliRunner().invoke(cli, ["status", "--url", url, "--json"]))
    assert res.exit_code == code and json.loads(res.output)["worker_status"]["healthy_workers"] == healthy


def test_status_unreachable():
    res = CliRunner().invoke(cli, ["status", "--url", f"http://127.0.0.1:{free_port()}", "--json"])
    assert res.exit_code == 2 and "unreachable" in res.output


def test_status_of_something_that_is_not_a_balancer_is_exit_2(tmp_path):
    """A port that does not speak HTTP (BadStatusLine) or another JSON server (KeyError: 'system_status') were
    tracebacks with exit 1 (and ended --monitor); both are exit 2 with one line."""
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Other(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"status": "ok"}')

        def log_message(self, *a):
            pass
    other = ThreadingHTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    raw = socket.socket()
    raw.bind(("127.0.0.1", 0))
    raw.listen()

    def garbage():
        conn, _ = raw.accept()
        conn.recv(1024)
        conn.sendall(b"hello, not HTTP\r\n\r\n")
        conn.close()
    threading.Thread(target=garbage, daemon=True).start()
    try:
        for url, words in ((f"http://127.0.0.1:{other.server_address[1]}", "is not a dllm-serve balancer"),
                           (f"http://127.0.0.1:{raw.getsockname()[1]}", "unreachable: BadStatusLine")):
            res = CliRunner().invoke(cli, ["status", "--url", url])
            assert res.exit_code == 2 and words in res.output and "Traceback" not in res.output, res.output
    finally:
        other.shutdown()
        raw.close()


# ---------------------------------------------------------------- serve --local, end to end
def _info(path: Path) -> dict:
    if not path.exists():
        return {}
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


@pytest.mark.slow
def test_serve_local_restarts_a_killed_worker_and_stops_cleanly(tmp_path):
    """Two CPU workers (an equal share of the cores each) and a balancer with one front process (--http-processes
    2): nothing left after SIGTERM."""
    port, wport = free_port(), free_port(2)
    info = tmp_path / "server.env"
    log = open(tmp_path / "serve.log", "wb")
    p = subprocess.Popen([*DLLM, "serve", "--local", "--workers", "2", "--port", str(port), "--worker-base-port",
                          str(wport), "--stagger", "0.2", "--health-check-interval", "0.3", "--server-info-file",
                          str(info), "--log-dir", str(tmp_path / "logs"), "--http-processes", "2"], cwd=ROOT,
                         stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while _info(info).get("SERVER_STATUS") != '"running"':
            assert p.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.2)
        assert _info(info)["SERVER_BASE_URL"] == f'"http://127.0.0.1:{port}"'
        url = f"http://127.0.0.1:{port}"
        status, body = post_json(url + "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "di vo"}], "max_tokens": 8})
        assert status == 200 and body["model"] == str(ROOT / "worker" / "demo_model")
        while get_json(url + "/health")[1]["healthy_workers"] < 2:
            time.sleep(0.2)
        # the cores shared among the CPU workers (each taking all of them made both tens of times slower)
        from balancer.supervisor import cpu_share
        assert [get_json(f"http://127.0.0.1:{wport + i}/health")[1]["cpu_threads"] for i in range(2)] == \
            [cpu_share(2)] * 2
        children = psutil.Process(p.pid).children(recursive=True)
        assert sorted("balancer.front" in " ".join(c.cmdline()) for c in children) == [False, False, True]
        assert sorted(f.name for f in (tmp_path / "logs").iterdir()) == ["worker-0.log", "worker-1.log"]
        victim = next(c for c in children if str(wport) in " ".join(c.cmdline()))
        victim.kill()
        t0 = time.monotonic()
        seen_down = False
        while True:
            ws = get_json(url + "/worker-status")[1]
            st = ws["workers"][0]["status"]
            seen_down |= st != "idle"
            if seen_down and st == "idle":
                break
            assert time.monotonic() - t0 < 60, ws
            time.sleep(0.2)
        assert time.monotonic() - t0 < 30          # back within seconds (a fresh worker loads the model again)
        assert "exited with code -9; restarting" in (tmp_path / "serve.log").read_text()
        # its process as the supervisor sees it (crash loops showed nowhere but the supervisor's log before)
        procs = [w["process"] for w in get_json(url + "/worker-status")[1]["workers"]]
        assert (procs[0]["exits"], procs[0]["last_exit_code"], procs[0]["crash_loop"]) == (1, -9, False)
        assert procs[0]["pid"] not in (None, victim.pid) and procs[0]["restart_in_seconds"] is None
        assert (procs[1]["exits"], procs[1]["log"]) == (0, str(tmp_path / "logs" / "worker-1.log"))
        assert post_json(url + "/v1/completions", {"prompt": [1, 2], "max_tokens": 4})[0] == 200
        procs = psutil.Process(p.pid).children(recursive=True)
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
        gone, alive = psutil.wait_procs(procs, timeout=10)
        assert not alive, "orphan processes after SIGTERM"
        assert _info(info)["SERVER_STATUS"] == '"stopped"'
    finally:
        if p.poll() is None:
            p.kill()
        log.close()


@pytest.mark.slow
def test_serve_takes_a_nemotron_checkpoint(tmp_path):
    from tests.conftest import TINY_NEMOTRON
    port = free_port()
    info = tmp_path / "server.env"
    p = subprocess.Popen([*DLLM, "serve", "--local", "--model-path", str(TINY_NEMOTRON), "--port", str(port),
                          "--worker-base-port", str(free_port()), "--server-info-file", str(info), "--log-dir",
                          str(tmp_path / "logs")], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while _info(info).get("SERVER_STATUS") != '"running"':
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        status, body = post_json(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8})
        assert status == 200 and body["model"] == str(TINY_NEMOTRON.resolve())
        assert get_json(f"http://127.0.0.1:{port}/v1/models")[1]["data"][0]["family"] == "nemotron"
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0


@pytest.mark.slow
def test_serve_reports_a_crash_loop_and_gives_up(tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(TINY_LLADA, broken)
    size = (broken / "model.safetensors").stat().st_size
    with open(broken / "model.safetensors", "r+b") as f:
        f.truncate(size // 2)                         # loads start, then fail: every worker exits
    info = tmp_path / "server.env"
    r = subprocess.run([*DLLM, "serve", "--local", "--model-path", str(broken), "--port", str(free_port()),
                        "--worker-base-port", str(free_port()), "--server-info-file", str(info),
                        "--log-dir", str(tmp_path / "logs"), "--crash-loop", "2", "--restart-backoff", "0.1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 1
    assert "crash loop" in r.stderr and "truncated" in r.stderr     # the worker's own log tail is shown
    assert _info(info)["SERVER_STATUS"] == '"failed"' and "SERVER_ERROR" in _info(info)


def test_status_table_before_traffic_and_between_batches():
    from rich.console import Console

    from dllm_serve.status import render
    ws = {"healthy_workers": 1, "total_workers": 1, "system_status": "normal",
          "workers": [{"worker_id": 0, "url": "http://w0", "status": "busy", "in_flight": 4, "in_flight_batches": 1,
                       "requests_served": 0, "errors": 0, "last_activity_seconds_ago": None,
                       "worker_health": {"busy": False, "seconds_since_last_step": 0.2}}]}
    stats = {"queue_depth": 0, "in_flight": 4, "centralized_batching": {
        "max_batch_size": 16, "max_wait_time": 0.02, "total_batches_processed": 0, "avg_batch_size": 0.0},
        "last_minute": {"requests": 0, "requests_per_second": 0.0, "latency_p50": None, "latency_p99": None}}
    console = Console(width=200, record=True)
    console.print(render({"worker_status": ws, "stats": stats}, "http://x"))
    text = console.export_text()
    assert "p50 -," in text and "None" not in text
    row = next(line for line in text.splitlines() if "http://w0" in line)
    assert "busy" in row and "idle" not in row          # the step column never says idle for a busy worker
    # a crash loop its supervisor reports (serve --local): in the table and in the monitor's plain lines
    from dllm_serve.status import plain_line
    ws["workers"][0].update(status="unhealthy", process={"crash_loop": True, "restart_in_seconds": 8.0})
    console = Console(width=200, record=True)
    console.print(render({"worker_status": ws, "stats": stats}, "http://x"))
    assert "unhealthy crash loop, restart in 8s" in console.export_text()
    assert "w0=unhealthy_crash_loop,_restart_in_8s/" in plain_line({"worker_status": ws, "stats": stats}, "http://x")


def test_last_minute_rate_in_the_first_minute(monkeypatch):
    from balancer import stats
    now = [1000.0]
    monkeypatch.setattr(stats.time, "monotonic", lambda: now[0])
    w = stats.Window(60.0)
    now[0] += 10
    for _ in range(20):
        w.add(0.1, 200)
    assert w.summary()["requests_per_second"] == 2.0        # 20 requests in the first 10 s, not 20/60
    now[0] += 100
    w.add(0.1, 200)
    assert w.summary()["requests_per_second"] == round(1 / 60, 3)


async def test_the_supervisor_probes_its_workers_where_they_listen(tmp_path):
    """A multi-node job's other nodes run `serve --no-balancer --worker-host ADDR`: their supervisor must find its
    workers ready at ADDR (it probed 127.0.0.1 and gave them up after --startup-timeout)."""
    import aiohttp
    from aiohttp import web
    from balancer.supervisor import ServeConfig, Supervisor
    port = free_port()
    cfg = ServeConfig(model_path="x", worker_host="127.0.0.2", worker_base_port=port, no_balancer=True,
                      log_dir=tmp_path)
    sup = Supervisor(cfg)
    w = sup.workers[0]

    async def health(request):
        return web.json_response({"status": "ready", "launch_id": w.launch_id})
    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.2", port).start()
    try:
        async with aiohttp.ClientSession() as s:
            assert await sup._probe(s, w)
        assert sup.worker_urls() == [f"http://127.0.0.2:{port}"]
    finally:
        await runner.cleanup()
    assert Supervisor(ServeConfig(model_path="x", worker_host="::1", log_dir=tmp_path)).worker_urls()[0].startswith(
        "http://[::1]:")


def test_slurm_mode_reads_flags_written_with_an_equals_sign(tmp_path, monkeypatch, capsys):
    """`serve --gpus=8 --worker-base-port=9000 --nodes=2` asks sbatch for the GPUs and hands the job the same flags
    as `--gpus 8 ...` (with `=` the job had no GPUs and the balancer the wrong worker ports)."""
    import stat
    from dllm_serve.slurm import submit
    fake = tmp_path / "sbatch"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$0.args"\nprintf "%s" "$DLLM_SERVE_ARGS" > "$0.env"\n'
                    'echo 123\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("DLLM_SERVER_INFO_DIR", str(tmp_path / "info"))
    (tmp_path / "m").mkdir()
    assert submit(None, ["--gpus=8", "--worker-base-port=9000", "--nodes=2", "--model-path", str(tmp_path / "m")]) == 0
    args = (tmp_path / "sbatch.args").read_text().split("\n")
    assert "--nodes=2" in args and "--gres=gpu:8" in args and args[-2].endswith("serve_multi_node.sbatch")
    assert (tmp_path / "sbatch.env").read_text() == f"--gpus 8 --worker-base-port 9000 --model-path {tmp_path / 'm'}"
    # paths are the caller's: made absolute (the job runs in the project's root); a hub id is left as it is; a
    # local model path that does not exist is refused before anything is submitted (a review's findings)
    monkeypatch.chdir(tmp_path)
    assert submit(None, ["--model-path", "./m", "--log-dir", "logs", "--base-model", "org/name"]) == 0
    assert (tmp_path / "sbatch.env").read_text() == \
        f"--model-path {tmp_path / 'm'} --log-dir {tmp_path / 'logs'} --base-model org/name"
    (tmp_path / "sbatch.args").unlink()
    assert submit(None, ["--model-path", "./missing"]) == 2
    assert "--model-path ./missing: no such file or directory" in capsys.readouterr().err
    assert not (tmp_path / "sbatch.args").exists()


def test_load_weights_waits_at_most_its_answer_timeout(tmp_path):
    """A review: `dllm-serve load-weights` waited for ever on a server that took the connection and never answered
    (urlopen with no timeout); --answer-timeout bounds it (default an hour: an update loads every worker)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()                      # the kernel takes the connection; nothing ever answers
        t0 = time.monotonic()
        r = subprocess.run(DLLM + ["load-weights", "--url", f"http://127.0.0.1:{s.getsockname()[1]}", "--model-path",
                                   str(TINY_LLADA), "--answer-timeout", "1"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
    assert r.returncode == 1 and "within --answer-timeout (1 s)" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 30


def _supervisor(tmp_path, **kw):
    from balancer.supervisor import ServeConfig, Supervisor
    return Supervisor(ServeConfig(model_path="x", port=free_port(), worker_base_port=free_port(), log_dir=tmp_path,
                                  server_info_file=tmp_path / "server.env", **kw))


def test_crashes_in_a_row_before_ready_are_a_crash_loop_and_a_port_lost_later_is_not_fatal(tmp_path):
    """A review of the supervisor: a worker whose load outlasts --crash-window / --crash-loop and then crashes never
    made a crash loop, and the launch waited out --startup-timeout (30 min) to say only "fewer than 1 workers
    ready". --crash-loop exits in a row without becoming ready are a crash loop now, and the launch gives up naming
    the exit code and the log. And a worker whose restart found its port taken while the server was serving stopped
    the whole server: only at launch is that fatal now. (Processes are test doubles: exits are simulated.)"""
    from types import SimpleNamespace
    sup = _supervisor(tmp_path, crash_loop=3, crash_window=0.001)
    w = sup.workers[0]
    (tmp_path / "worker-0.log").write_text("RuntimeError: CUDA error at warmup\n")
    for i in range(3):
        w.proc, w.restart_at = SimpleNamespace(returncode=1, pid=0, poll=lambda: 1), None
        time.sleep(0.01)                          # (each exit outside the window: the window never counts 3)
        sup._on_exit(w)
        assert (sup.fatal is None) == (i < 2), (i, sup.fatal)
    assert "crashed 3 times in a row" in sup.fatal and "code 1" in sup.fatal and "CUDA error at warmup" in sup.fatal
    assert sup.process_info(w)["crash_loop"] is True
    assert os.path.isabs(sup.process_info(w)["log"])

    from balancer.supervisor import EXIT_PORT_IN_USE
    sup = _supervisor(tmp_path)
    w = sup.workers[0]
    sup.status, w.ever_ready, w.ready = "running", True, True
    w.proc, w.restart_at = SimpleNamespace(returncode=EXIT_PORT_IN_USE, pid=0), None
    sup._on_exit(w)
    assert sup.fatal is None and w.restart_at is not None          # it backs off and tries again


async def test_a_supervisor_failure_is_written_and_nohup_and_a_second_signal_are_honoured(tmp_path):
    """A review of the supervisor: an unexpected error in its loop (a foreign server answering `null` on a worker's
    port raised one) skipped the shutdown and left the server-info file "initializing", so a job waiting for
    running|failed waited for ever; under nohup a closing session (SIGHUP) still stopped the server; a second
    Ctrl-C did nothing while the drain and the stop ran (up to 90 s). Now the failure is written and everything
    stopped, an ignored SIGHUP stays ignored, and a second signal stops at once (a worker that ignores SIGTERM is
    killed without waiting --stop-timeout). The worker process is a test double."""
    import asyncio
    import signal
    import sys

    import aiohttp
    from aiohttp import web
    sup = _supervisor(tmp_path)
    w = sup.workers[0]

    async def null(request):
        return web.Response(text="null", content_type="application/json")
    app = web.Application()
    app.router.add_get("/health", null)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", w.port).start()
    try:
        async with aiohttp.ClientSession() as s:
            assert await sup._probe(s, w) is False                   # (it raised AttributeError)
    finally:
        await runner.cleanup()

    async def broken(session, stop):
        raise OSError("EAGAIN: no process could be started")
    sup._serve = broken
    before = signal.getsignal(signal.SIGHUP)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)                       # as nohup leaves it
    try:
        assert await sup.run() == 1
        loop = asyncio.get_running_loop()
        assert signal.SIGHUP not in getattr(loop, "_signal_handlers", {}) and signal.SIGTERM in loop._signal_handlers
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().remove_signal_handler(sig)
        signal.signal(signal.SIGHUP, before)
    info = (tmp_path / "server.env").read_text()
    assert 'SERVER_STATUS="failed"' in info and "EAGAIN" in info

    sup = _supervisor(tmp_path, stop_timeout=30)
    w = sup.workers[0]
    w.proc = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(15, signal.SIG_IGN); "
                               "time.sleep(60)"], start_new_session=True)
    stop = asyncio.Event()
    sup._signalled(stop)
    sup._signalled(stop)                                               # the second one
    t0 = time.monotonic()
    await sup._shutdown()
    assert w.proc.poll() is not None and time.monotonic() - t0 < 5
