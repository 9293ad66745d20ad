"""A newcomer's first ten minutes (issue 15): taken ports fail at once in one line and never report ready; only the
worker a supervisor started counts as its worker; concurrent first runs share one .venv build; the Python scripts
run with the project's .venv whatever python3 starts them; the balancer answers /generation/algorithms."""
import asyncio
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiohttp import web

from balancer.app import BalancerConfig, make_app
from balancer.pool import HealthConfig
from tests.fakes import workers
from tests.helpers import DLLM, ROOT, free_port


def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize("which", ["worker", "balancer"])
def test_serve_on_a_taken_port_fails_at_once_in_one_line(tmp_path, which):
    taken = _listener()
    port = taken.getsockname()[1]
    args = ["--port", str(port), "--worker-base-port", str(free_port())] if which == "balancer" else \
        ["--port", str(free_port()), "--worker-base-port", str(port)]
    info = tmp_path / "server.env"
    t0 = time.monotonic()
    r = subprocess.run([*DLLM, "serve", "--local", *args, "--server-info-file", str(info), "--log-dir",
                        str(tmp_path / "logs")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    taken.close()
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if "ERROR" in line or "Error" in line]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0] and "is not free" in errors[0], r.stderr
    assert "Traceback" not in r.stderr and not re.search(r"\bready\b", r.stderr)
    assert 'SERVER_STATUS="failed"' in info.read_text() and "SERVER_ERROR" in info.read_text()
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir())    # no worker started
    assert took < 5           # the launch fails before anything starts (0.7 s here: the CLI's imports)


@pytest.mark.parametrize("command", ["worker", "balancer"])
def test_a_server_on_a_taken_port_exits_98_in_one_line(command):
    taken = _listener()
    port = taken.getsockname()[1]
    args = (["worker", "--model-path", str(ROOT / "tests" / "fixtures" / "tiny-llada"), "--device", "cpu"]
            if command == "worker" else ["balancer", "--worker-urls", "http://127.0.0.1:9"])
    r = subprocess.run([*DLLM, *args, "--port", str(port)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    taken.close()
    assert r.returncode == 98, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr


def impostor(launch_id):
    async def health(request):
        return web.json_response({"status": "ready", "busy": False, "seconds_since_last_step": 0.0,
                                  "instance_id": "x", "launch_id": launch_id})
    app = web.Application()
    app.router.add_get("/health", health)
    return app


async def test_the_balancer_uses_only_the_workers_it_was_given(aiohttp_client):
    async with workers(impostor("theirs"), impostor("ours")) as urls:
        cfg = BalancerConfig(worker_urls=urls, worker_launch_ids=["ours", "ours"],
                             health=HealthConfig(interval=0.05, timeout=1))
        client = await aiohttp_client(make_app(cfg))
        await asyncio.sleep(0.5)
        ws = await (await client.get("/worker-status")).json()
        assert [w["status"] for w in ws["workers"]] == ["starting", "idle"]
        assert ws["healthy_workers"] == 1


async def test_the_supervisor_calls_ready_only_its_own_worker(tmp_path):
    import aiohttp

    from balancer.supervisor import ServeConfig, Supervisor, WorkerProc
    async with workers(impostor("someone-else")) as urls:
        port = int(urls[0].rsplit(":", 1)[1])
        sup = Supervisor(ServeConfig(model_path="m", cpu_workers=1, log_dir=tmp_path))
        w = WorkerProc(0, port, None, tmp_path / "w.log")
        async with aiohttp.ClientSession() as s:
            assert not await sup._probe(s, w)
            w.launch_id = "someone-else"
            assert await sup._probe(s, w)


async def test_generation_algorithms_through_the_balancer(aiohttp_client):
    async def algorithms(request):
        return web.json_response({"family": "llada", "algorithms": [{"name": "basic"}]})

    async def health(request):
        return web.json_response({"status": "ready", "busy": False, "seconds_since_last_step": 0.0})
    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/generation/algorithms", algorithms)
    async with workers(app) as urls:
        client = await aiohttp_client(make_app(BalancerConfig(worker_urls=urls,
                                                              health=HealthConfig(interval=0.05, timeout=1))))
        await asyncio.sleep(0.2)
        r = await client.get("/generation/algorithms")
        assert r.status == 200 and (await r.json())["algorithms"][0]["name"] == "basic"


def test_concurrent_first_runs_build_the_venv_once(tmp_path):
    """Two setup_venv.sh runs at once on a fresh checkout (python3 and pip are fakes that log and take a second):
    one builds, the other waits on the lock and then finds .venv current."""
    proj = tmp_path / "proj"
    (proj / "scripts").mkdir(parents=True)
    (proj / "scripts" / "setup_venv.sh").write_text((ROOT / "scripts" / "setup_venv.sh").read_text())
    (proj / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    log = tmp_path / "calls.log"
    fake_python = f"""#!/bin/sh
echo "start $*" >> {log}; sleep 1; echo "end $*" >> {log}
"""
    (bin_ / "python3").write_text(f"""#!/bin/sh
# python3 -m venv .venv: make a .venv whose python is a fake that logs its pip calls
mkdir -p .venv/bin
cat > .venv/bin/python <<'PY'
{fake_python}PY
chmod +x .venv/bin/python
echo "venv" >> {log}
""")
    (bin_ / "python3").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}")
    procs = [subprocess.Popen(["bash", str(proj / "scripts" / "setup_venv.sh")], env=env, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=60)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    calls = log.read_text().splitlines()
    assert calls.count("venv") == 1, calls                           # built once
    starts = [i for i, c in enumerate(calls) if c.startswith("start")]
    ends = [i for i, c in enumerate(calls) if c.startswith("end")]
    assert len(starts) == 3 and all(e == s + 1 for s, e in zip(starts, ends)), calls   # pip runs never overlap
    assert any("waiting for another setup" in o for o in outs)


def test_scripts_run_with_the_project_venv_from_any_python(tmp_path):
    """scripts/check_worker_status.py started by a python3 without the project's packages still runs (exit 2:
    unreachable, not 1 from an ImportError)."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    r = subprocess.run([str(bare / "bin" / "python3"), str(ROOT / "scripts" / "check_worker_status.py"), "--url",
                        "http://127.0.0.1:9", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unreachable" in r.stdout, r.stdout + r.stderr
    # its usage errors are one line naming it (a review: its usage named `check_worker_status.py status`, a command
    # it does not take)
    r = subprocess.run([str(ROOT / "scripts" / "check_worker_status.py"), "--bogus"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == ("check_worker_status.py: error: No such option '--bogus'. "
                                                      "(see 'check_worker_status.py --help')"), r.stderr


def test_version():
    r = subprocess.run([*DLLM, "--version"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("dllm-serve, version ")
    assert Path(ROOT / "pyproject.toml").read_text().count(r.stdout.split()[-1]) >= 1


# ---- issue 27: every missing or invalid option is one line and exit 2; the monitor prints lines into a pipe
@pytest.mark.parametrize("args, option", [
    (["worker"], "--model-path"),
    (["worker", "--model-path", "/nonexistent"], "--model-path"),
    (["worker", "--model-path", "tests/fixtures/tiny-llada", "--device", "gpu"], "--device"),
    (["worker", "--model-path", "tests/fixtures/tiny-llada", "--device", "cuda:3"], "--device"),
    (["worker", "--model-path", "tests/fixtures/tiny-llada", "--batch-size", "0"], "--batch-size"),
    (["worker", "--model-path", "tests/fixtures/tiny-llada", "--port", "70000"], "--port"),
    (["balancer"], "--worker-urls"),
    (["balancer", "--worker-urls", "localhost:8001"], "--worker-urls"),
    (["serve", "--local", "--model-path", "/nonexistent"], "--model-path"),
    (["serve", "--local", "--port", "0"], "--port"),
    (["serve", "--local", "--gpus", "2"], "--gpus"),
    (["generate", "--model-path", "/nonexistent", "--prompt", "x"], "--model-path"),
    (["generate", "--prompt-ids", "1,x"], "--prompt-ids"),
    (["generate", "--prompt", "x", "--dtype", "int4"], "--dtype"),
    (["generate", "--prompt", "x", "--gen-length", "0"], "--gen-length"),
    (["generate", "--prompt", "x", "--algorithm", "warp", "--device", "cpu"], "--algorithm"),
    (["score", "--prefix-ids", "1"], "--target-ids"),
    (["score", "--prefix-ids", "1", "--target-ids", "a"], "--target-ids"),
    (["convert-dcp", "--base-model", "x"], "--dcp-path"),
    (["status", "--interval", "0"], "--interval"),
])
def test_a_missing_or_invalid_option_is_one_line_and_exit_2(args, option, monkeypatch):
    from click.testing import CliRunner

    from dllm_serve.cli import main as cli
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    r = CliRunner().invoke(cli, args, prog_name="dllm-serve")
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and option in lines[0], (r.exit_code, r.stderr, r.exception)
    assert lines[0].startswith(f"dllm-serve {args[0]}: error: ") and "Traceback" not in r.output


def test_a_worker_without_its_model_exits_2_and_leaves_nothing_listening():
    port = free_port()
    r = subprocess.run([*DLLM, "worker", "--port", str(port)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--model-path" in r.stderr, r.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))           # the port is free: nothing was ever listening


async def test_the_monitor_prints_plain_lines_into_a_pipe(aiohttp_server):
    """`--monitor` with stdout a pipe (`| tee`, a log file): one plain line per poll, not rich's live view, which
    draws nothing there."""
    ws = {"healthy_workers": 1, "total_workers": 2, "system_status": "degraded", "workers": [
        {"worker_id": 0, "url": "http://w0", "status": "busy", "in_flight": 4, "requests_served": 7, "errors": 0},
        {"worker_id": 1, "url": "http://w1", "status": "unhealthy", "in_flight": 0, "requests_served": 0,
         "errors": 3}]}
    stats = {"queue_depth": 2, "in_flight": 4, "last_minute": {"requests": 7, "requests_per_second": 0.117,
                                                               "latency_p50": 0.4, "latency_p99": 1.2}}
    app = web.Application()
    async def worker_status(request):
        return web.json_response(ws)

    async def stats_page(request):
        return web.json_response(stats)
    app.router.add_get("/worker-status", worker_status)
    app.router.add_get("/stats", stats_page)
    server = await aiohttp_server(app)
    proc = await asyncio.create_subprocess_exec(
        *DLLM, "status", "--monitor", "--interval", "0.2", "--url", str(server.make_url("")).rstrip("/"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        lines = [(await asyncio.wait_for(proc.stdout.readline(), 30)).decode() for _ in range(2)]
    finally:
        proc.terminate()
        await proc.wait()
    for line in lines:
        assert "system=degraded healthy=1/2 queue=2 in_flight=4" in line and "p99=1.2s" in line, line
        assert "w0=busy/requests:4/served:7/errors:0 w1=unhealthy/requests:0/served:0/errors:3" in line, line


def _fake_sbatch(tmp_path) -> dict:
    """An environment whose `sbatch` records its arguments (tmp_path/args) and the job's flags (args.env) and
    answers job id 42."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "sbatch").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$SBATCH_ARGS"\n'
                                   'printf "%s" "$DLLM_SERVE_ARGS" > "$SBATCH_ARGS.env"\necho 42\n')
    (bindir / "sbatch").chmod(0o755)
    return dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", SBATCH_ARGS=str(tmp_path / "args"),
                DLLM_SERVER_INFO_DIR=str(tmp_path / "info"))


def test_serve_nodes_submits_the_multi_node_script_and_is_refused_with_local(tmp_path):
    """`serve --nodes N` (SLURM mode) submits slurm/serve_multi_node.sbatch with sbatch --nodes=N and
    --gres=gpu:G from --gpus, and --nodes is not passed on to the job's `serve --local`; a fake sbatch records the
    call. With --local, --nodes is a one-line usage error."""
    env = _fake_sbatch(tmp_path)
    model = tmp_path / "models" / "x"          # (a local model path must exist: refused before submitting if not)
    model.mkdir(parents=True)
    r = subprocess.run([*DLLM, "serve", "--nodes", "2", "--gpus", "4", "--model-path", str(model)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    args = (tmp_path / "args").read_text().split("\n")
    assert "--nodes=2" in args and "--gres=gpu:4" in args and args[-2].endswith("slurm/serve_multi_node.sbatch")
    assert (tmp_path / "args.env").read_text() == f"--gpus 4 --model-path {model}"
    assert "submitted SLURM job 42 (serve_multi_node.sbatch)" in r.stdout
    r = subprocess.run([*DLLM, "serve", "--gpus", "4"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    args = (tmp_path / "args").read_text().split("\n")
    assert "--nodes=1" in args and args[-2].endswith("slurm/serve_single_node.sbatch")
    r = subprocess.run([*DLLM, "serve", "--local", "--nodes", "2"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--nodes is for SLURM mode" in r.stderr
    assert len([line for line in r.stderr.splitlines() if line.strip()]) <= 3


def test_slurm_mode_asks_for_cores_refuses_gpu_ids_and_prints_the_users_info_file(tmp_path):
    """A job asked SLURM for nothing but GPUs: one core for the balancer and every worker where cgroups confine a
    job to its cores (now 4 a worker plus 2, or --slurm-cpus, which the job's serve never sees); --gpu-ids (this
    machine's GPUs) was passed to a job whose node numbers its own, where serve refused it; and the server-info
    file printed was the default one where --server-info-file named another."""
    env = _fake_sbatch(tmp_path)

    def submit(*flags):
        r = subprocess.run([*DLLM, "serve", *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        return r, (tmp_path / "args").read_text().split("\n"), (tmp_path / "args.env").read_text()

    r, args, job = submit("--gpus", "8")
    assert r.returncode == 0 and "--cpus-per-task=34" in args and "--gres=gpu:8" in args, (r.stderr, args)
    r, args, job = submit("--workers", "4")
    assert "--cpus-per-task=18" in args and not any(a.startswith("--gres") for a in args), args
    r, args, job = submit("--workers", "2", "--nodes", "2", "--slurm-cpus=5")
    assert r.returncode == 0 and "--cpus-per-task=5" in args and "--nodes=2" in args, (r.stderr, args)
    assert job == "--workers 2"
    r, args, job = submit("--server-info-file", "mine.env")
    assert "--cpus-per-task=6" in args and f"server info: {ROOT / 'mine.env'}" in r.stdout, r.stdout
    (tmp_path / "args").unlink()
    r = subprocess.run([*DLLM, "serve", "--gpu-ids", "0,2"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "give --gpus N" in r.stderr and not (tmp_path / "args").exists(), r.stderr
    r = subprocess.run([*DLLM, "serve", "--local", "--slurm-cpus", "4"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--slurm-cpus is for SLURM mode" in r.stderr


def test_a_launch_that_fails_before_starting_says_failed_in_its_server_info_file(tmp_path):
    """A SLURM job whose serve failed its checks (no GPU on the node, a model path the node lacks, a DCP that does
    not convert) exited without writing its server-info file, so the documented wait loop never ended."""
    info = tmp_path / "info.env"
    info.write_text('SERVER_STATUS="initializing"\n')     # (an earlier launch's file is replaced)
    r = subprocess.run([*DLLM, "serve", "--local", "--gpus", "2", "--server-info-file", str(info)], cwd=ROOT,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES="", SLURM_JOB_ID="42"), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "shows no GPU" in r.stderr, r.stderr
    text = info.read_text()
    assert 'SERVER_STATUS="failed"' in text and 'SLURM_JOB_ID="42"' in text and "shows no GPU" in text, text
    assert subprocess.run(["bash", "-c", f'. {info} && [ "$SERVER_STATUS" = failed ] && [ -n "$SERVER_ERROR" ]'],
                          timeout=10).returncode == 0
