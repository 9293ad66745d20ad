"""The launcher's and the worker's lifecycle, as a review found it (2026-11-27): overlapping ports, the restart
back-off, a log directory removed while running, SIGHUP, a worker whose imports fail or whose load hangs, and
launch options checked before anything starts."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from balancer.supervisor import ServeConfig, Supervisor
from dllm_serve.cli import main as cli
from tests.conftest import TINY_LLADA
from tests.helpers import DLLM, ROOT, free_port, get_json


def _supervisor(tmp_path, **kw) -> Supervisor:
    return Supervisor(ServeConfig(model_path=str(TINY_LLADA), log_dir=tmp_path / "logs", **kw))


def test_ports_that_overlap_fail_the_launch_at_once(tmp_path):
    """--port inside the workers' ports: the balancer served, took worker 1's port and the launch failed 9 s later
    naming "another server"; it is refused before anything starts, naming both."""
    sup = _supervisor(tmp_path, port=44002, worker_base_port=44001, cpu_workers=2)
    assert sup.taken_ports() == ("worker 1's port (--worker-base-port 44001) is 44002, which is also the "
                                 "balancer's port (--port): choose ports that do not overlap")


def test_a_launch_holds_its_port_until_its_balancer_listens(tmp_path):
    """A second launch on the same --port while the first one's workers load was not refused: both passed the port
    check, the second served, and the first, loaded, died on its bind (a review). The first holds the port from its
    check until its balancer listens: the second's check fails at once; once released, the port is free again."""
    port = free_port()
    first = _supervisor(tmp_path, port=port, worker_base_port=free_port())
    assert first.taken_ports() is None
    second = _supervisor(tmp_path / "2", port=port, worker_base_port=free_port())
    taken = second.taken_ports()
    assert taken is not None and f"127.0.0.1:{port}, the balancer's port (--port), is not free" in taken
    first._release_port()
    assert second.taken_ports() is None
    second._release_port()


def test_the_restart_back_off_doubles_per_crash_in_a_row(tmp_path):
    """It doubled per crash within --crash-window, so a worker crashing every 8 s with a 15 s window waited 2, 4,
    4, 4, ... s for ever; now it doubles per crash since the worker was last ready, up to --restart-backoff-max."""
    sup = _supervisor(tmp_path, restart_backoff=1.0, restart_backoff_max=30.0, crash_window=0.001, crash_loop=100)
    w = sup.workers[0]
    w.proc = SimpleNamespace(returncode=1)
    delays = []
    for _ in range(7):
        t0 = time.monotonic()
        sup._on_exit(w)
        delays.append(round(w.restart_at - t0))
        time.sleep(0.002)                    # past the crash window: the window no longer resets the back-off
    assert delays == [1, 2, 4, 8, 16, 30, 30]
    w.in_a_row = 0                           # (what a ready worker does)
    sup._on_exit(w)
    assert round(w.restart_at - time.monotonic()) == 1


def test_a_worker_exit_reaches_the_balancer_at_once(tmp_path):
    """The supervisor tells the balancer's pool (same process) the moment it sees a worker's process exit."""
    from balancer.app import STATE
    sup = _supervisor(tmp_path, cpu_workers=2)
    seen = []
    pool = SimpleNamespace(workers=["w0", "w1"], process_exited=lambda w, why: seen.append((w, why)))
    sup.app = {STATE: SimpleNamespace(pool=pool)}
    w = sup.workers[1]
    w.proc = SimpleNamespace(returncode=-9)
    sup._on_exit(w)
    assert seen == [("w1", "its process exited (code -9)")]


def test_worker_status_shows_a_crash_loop(tmp_path):
    """A crash-looping worker showed only "unhealthy" in /worker-status; its exits, last code, crash loop and the
    seconds to its restart were in the supervisor's log alone (a reviewer's finding). Its process as the supervisor
    sees it (the `process` field of each worker there)."""
    sup = _supervisor(tmp_path, restart_backoff=5.0, crash_loop=2, crash_window=60.0)
    w = sup.workers[0]
    w.proc = SimpleNamespace(returncode=3, pid=7, poll=lambda: 3)
    sup._on_exit(w)
    info = sup.process_info(w)
    assert (info["exits"], info["last_exit_code"], info["crash_loop"], info["pid"]) == (1, 3, False, None)
    sup._on_exit(w)
    info = sup.process_info(w)
    assert (info["exits"], info["crash_loop"]) == (2, True) and 5 < info["restart_in_seconds"] <= 10
    assert info["log"] == str(tmp_path / "logs" / "worker-0.log")


def test_a_log_directory_removed_while_running_is_made_again_at_a_restart(tmp_path, monkeypatch):
    """It raised FileNotFoundError out of the supervisor's loop: every worker and the balancer went down."""
    import shutil

    import balancer.supervisor as sv
    sup = _supervisor(tmp_path)
    started = []
    monkeypatch.setattr(sv.subprocess, "Popen", lambda args, **kw: started.append(args) or SimpleNamespace(pid=1))
    shutil.rmtree(tmp_path / "logs")
    sup._spawn(sup.workers[0])
    assert started and "starting worker 0" in (tmp_path / "logs" / "worker-0.log").read_text()


@pytest.mark.parametrize("flag, value, words", [
    ("--log-dir", "afile/x", "--log-dir"), ("--server-info-file", "afile/info", "--server-info-file"),
    ("--files-dir", "afile/f", "--files-dir"), ("--extra-worker-urls", "notaurl", "expected a base URL")])
def test_launch_options_that_cannot_work_are_one_line_before_anything_starts(tmp_path, flag, value, words):
    """An unwritable --log-dir or --server-info-file was a traceback; --extra-worker-urls took anything (a worker
    "notaurl" stayed "starting" for ever); an unusable --files-dir failed the launch once the workers had loaded,
    blaming the port (a review)."""
    (tmp_path / "afile").write_text("a file, not a directory")
    arg = str(tmp_path / value) if "/" in value else value
    r = CliRunner().invoke(cli, ["serve", "--local", "--model-path", str(TINY_LLADA), flag, arg,
                                 "--port", str(free_port()), "--worker-base-port", str(free_port())])
    assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output, r.output


def test_a_worker_whose_imports_fail_exits_with_one_line(tmp_path):
    """A broken torch install (a test double: a `torch` package that raises on import) left the worker "loading"
    for ever with nothing in its log, and serve waited --startup-timeout (30 min) for it."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('libtorch_cuda.so: cannot open (test double)')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    p = subprocess.run([*DLLM, "worker", "--model-path", str(TINY_LLADA), "--port", str(free_port()),
                        "--device", "cpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "model load failed: ImportError: libtorch_cuda.so" in p.stderr, p.stderr[-2000:]


@pytest.mark.slow
def test_a_worker_whose_load_hangs_still_ends_after_sigterm(tmp_path):
    """A read that never returns (a test double for a hung file system: every .safetensors open blocks) held the
    worker's exit for ever after SIGTERM, so it outlived its supervisor as an orphan. The exit is bounded:
    --drain-timeout + 10 s."""
    (tmp_path / "sitecustomize.py").write_text(
        "import builtins, io, time\n_open = io.open\n"
        "def blocking(f, *a, **k):\n"
        "    if str(f).endswith('.safetensors'):\n        time.sleep(10**6)\n"
        "    return _open(f, *a, **k)\n"
        "builtins.open = io.open = blocking\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    port = free_port()
    p = subprocess.Popen([*DLLM, "worker", "--model-path", str(TINY_LLADA), "--port", str(port), "--device", "cpu",
                          "--drain-timeout", "1"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if get_json(f"http://127.0.0.1:{port}/health")[1]["status"] == "loading":
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.2)
        time.sleep(1)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        assert p.wait(40) == 1 and time.monotonic() - t0 < 30
        assert "did not end within 11 s of its stop" in p.stdout.read()
    finally:
        if p.poll() is None:
            p.kill()


@pytest.mark.slow
def test_sighup_stops_serve_as_sigterm_does(tmp_path):
    """SIGHUP (its terminal or SSH session closed) killed the supervisor without a drain and left the server-info
    file saying "running" with a dead pid."""
    info = tmp_path / "info"
    p = subprocess.Popen([*DLLM, "serve", "--local", "--model-path", str(TINY_LLADA), "--port", str(free_port()),
                          "--worker-base-port", str(free_port()), "--stagger", "0", "--log-dir", str(tmp_path / "l"),
                          "--server-info-file", str(info)], cwd=ROOT, stdout=subprocess.DEVNULL,
                         stderr=subprocess.STDOUT,
                         # (SIGHUP as a terminal leaves it: a test run under nohup would hand its ignore on, which
                         # serve keeps on purpose)
                         preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 90
        while 'SERVER_STATUS="running"' not in (info.read_text() if info.exists() else ""):
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.2)
        p.send_signal(signal.SIGHUP)
        assert p.wait(60) == 0
        assert 'SERVER_STATUS="stopped"' in info.read_text()
    finally:
        if p.poll() is None:
            p.kill()


READY_DOUBLE = """
import http.server, json, os, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"status": "ready", "launch_id": os.environ["DLLM_LAUNCH_ID"]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


async def test_a_worker_still_starting_after_its_start_timeout_is_killed_and_restarted(tmp_path, caplog):
    """Once --min-workers were ready, a worker whose start hung (a load blocked on a file system, a rendezvous
    that never came) stayed "starting" for ever. After --worker-start-timeout it is killed and restarted as a
    crashed one (the back-off, the crash-loop count), once per start. The workers are test doubles: worker 0 a
    process answering /health "ready", worker 1 one that sleeps."""
    import asyncio
    import logging

    class Doubles(Supervisor):
        def _command(self, w):
            args, env = super()._command(w)
            code = READY_DOUBLE if w.index == 0 else "import time; time.sleep(600)"
            return [sys.executable, "-c", code, str(w.port)], env

    sup = Doubles(ServeConfig(model_path="x", log_dir=tmp_path / "logs", cpu_workers=2, no_balancer=True,
                              worker_base_port=free_port(2), stagger=0, worker_start_timeout=1, restart_backoff=0.1,
                              crash_loop=100))
    caplog.set_level(logging.INFO, "dllm.supervisor")
    stop = asyncio.Event()
    run = asyncio.create_task(sup.run(stop))
    pids = set()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 4.5:
        if sup.workers[1].proc is not None:
            pids.add(sup.workers[1].proc.pid)
        await asyncio.sleep(0.05)
    assert sup.status == "running" and sup.workers[0].ready and not sup.workers[1].ready
    stop.set()
    assert await asyncio.wait_for(run, 30) == 0
    kills = [r.getMessage() for r in caplog.records if "--worker-start-timeout" in r.getMessage()]
    assert 2 <= len(kills) <= 4 and all(k.startswith("worker 1 not ready") for k in kills), kills
    assert len(pids) >= len(kills)              # each kill was followed by a new process
    assert sup.workers[0].proc.returncode is not None and sup.workers[1].proc.returncode is not None


def test_serve_takes_the_worker_start_timeout(monkeypatch):
    import balancer.supervisor
    seen = []
    monkeypatch.setattr(balancer.supervisor, "run", lambda cfg: seen.append(cfg) or 0)
    r = CliRunner().invoke(cli, ["serve", "--local", "--model-path", str(TINY_LLADA), "--worker-start-timeout", "7"])
    assert r.exit_code == 0, r.output
    assert seen[0].worker_start_timeout == 7 and ServeConfig(model_path="x").worker_start_timeout == 1800


def test_the_server_info_file_reads_back_as_written_by_the_shell(tmp_path):
    """The file is meant for `source FILE`: a model path or log folder with ", $ or a backtick broke it, or was
    expanded by the shell (a reviewer's finding); LOG_DIR was relative, so a reader elsewhere could not find it."""
    import subprocess
    odd = str(tmp_path / 'm "q" $HOME `id` \\x')
    sup = _supervisor(tmp_path, server_info_file=tmp_path / "info")
    sup.cfg.model_path, sup.cfg.log_dir = odd, Path("rel-logs")
    sup.write_info()
    out = subprocess.run(["bash", "-c", 'source "$1"; printf "%s\\n%s" "$MODEL_PATH" "$LOG_DIR"', "-",
                          str(tmp_path / "info")], capture_output=True, text=True, check=True).stdout
    assert out.split("\n") == [odd, str(Path("rel-logs").resolve())]
