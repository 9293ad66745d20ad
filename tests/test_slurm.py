"""`dllm-serve serve` in SLURM mode against a real single-node SLURM (Debian's slurmctld, slurmd and munge, two fake
GPUs declared as gres over plain files): sbatch, wait for SERVER_STATUS=running, a chat request, scancel.

The test installs nothing unless asked: with DLLM_SERVE_SLURM_TEST=install (what .ci/run sets) it apt-gets the
packages when they are missing (as root); otherwise it runs only where they are already installed, and skips, saying
why, elsewhere (or where the daemons cannot start). Every daemon and job it started is stopped, and the test checks
that no SLURM or munge process it started is left."""
import os
import subprocess
import time

import psutil
import pytest

from tests.helpers import DLLM, ROOT, free_port, post_json

pytestmark = pytest.mark.slow
SCRIPT = ROOT / "tests" / "slurm" / "local_slurm.sh"


SLURM_PROCESSES = ("slurmctld", "slurmd", "slurmstepd", "munged")


def _slurm_pids() -> set[int]:
    return {p.pid for p in psutil.process_iter(["name"]) if (p.info["name"] or "").startswith(SLURM_PROCESSES)}


@pytest.fixture
def slurm(tmp_path):
    installed = subprocess.run(["bash", str(SCRIPT), "installed"]).returncode == 0
    if not installed:
        if os.environ.get("DLLM_SERVE_SLURM_TEST") != "install":
            pytest.skip("SLURM test skipped: slurmctld/slurmd/munge are not installed; DLLM_SERVE_SLURM_TEST=install "
                        "lets the test apt-get them (as root)")
        r = subprocess.run(["bash", str(SCRIPT), "install"], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"SLURM test skipped: the packages could not be installed ({r.stdout.strip()} "
                        f"{r.stderr.strip()})")
    before = _slurm_pids()
    env = dict(os.environ, SLURMCTLD_PORT=str(free_port()), SLURMD_PORT=str(free_port()))
    r = subprocess.run(["bash", str(SCRIPT), "start", str(tmp_path / "slurm")], capture_output=True, text=True, env=env)
    try:
        if r.returncode != 0:
            pytest.skip(f"SLURM test skipped: the local cluster did not start: {r.stdout[-1500:]} {r.stderr[-500:]}")
        yield dict(os.environ, SLURM_CONF=str(tmp_path / "slurm" / "slurm.conf"))
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(tmp_path / "slurm")],
                       env=dict(os.environ, SLURM_CONF=str(tmp_path / "slurm" / "slurm.conf")))
        left = []
        for pid in _slurm_pids() - before:
            try:
                p = psutil.Process(pid)
                left.append(" ".join(p.cmdline()) or p.name())
                p.kill()
            except psutil.NoSuchProcess:
                pass
        assert not left, f"the SLURM test left processes behind (now killed): {left}"


def _info(path):
    if not path.exists():
        return {}
    return {k: v.strip('"') for k, v in (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)}


def test_sbatch_single_node_serves_and_scancel_stops(slurm, tmp_path):
    env = dict(slurm, DLLM_SERVER_INFO_DIR=str(tmp_path / "info"))
    port = free_port()
    out = subprocess.run([*DLLM, "serve", "--workers", "1", "--port", str(port), "--worker-base-port",
                          str(free_port()), "--stagger", "0"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    job = out.stdout.split("submitted SLURM job ")[1].split()[0]
    assert f"scancel {job}" in out.stdout and "ssh -N -L" in out.stdout
    info_file = tmp_path / "info" / f"server-info-{job}"
    try:
        deadline = time.monotonic() + 180
        while _info(info_file).get("SERVER_STATUS") != "running":
            assert time.monotonic() < deadline, (tmp_path / "info" / f"dllm-serve-{job}.out").read_text()
            time.sleep(0.5)
        info = _info(info_file)
        assert info["SLURM_JOB_ID"] == job and info["SERVER_PORT"] == str(port)
        status, body = post_json(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "di vo"}], "max_tokens": 8})
        assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        subprocess.run(["scancel", job], env=env)
    deadline = time.monotonic() + 60
    while _info(info_file).get("SERVER_STATUS") != "stopped":
        assert time.monotonic() < deadline, _info(info_file)
        time.sleep(0.5)
    while True:      # the job leaves the queue (it may show CG, completing, for a moment)
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%t"], env=env, capture_output=True,
                               text=True).stdout.strip()
        if state in ("", "CG"):
            break
        assert time.monotonic() < deadline, state
        time.sleep(0.5)
