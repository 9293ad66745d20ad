"""The README's command blocks run as written (issue 15).

Run inside a fresh network namespace (``unshare -n``, root only; skipped elsewhere), so the README's fixed ports
(8000, 8001, 8002) are free whatever else runs on the machine. The blocks run: the first command of the top block
(``./scripts/start_server.sh --local``), "From another terminal", "Using the API", "Monitoring", the two-workers
"by hand" block of "Multi-GPU on one machine" and "Offline generation". Not run: ``./scripts/test.sh`` (this is it),
and the blocks that need GPUs, SLURM or a model directory under /models. Two things are added where a person would
do them: waiting for /health before the first request, and Ctrl-C (SIGINT) for ``--monitor``, which runs until
interrupted."""
import os
import re
import shutil
import subprocess

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow


def blocks() -> dict[str, list[tuple[str, str]]]:
    """Section title -> [(language, code)] of README.md; the text before the first section is ""."""
    out: dict[str, list[tuple[str, str]]] = {}
    section = ""
    for part in re.split(r"(^## .*$)", (ROOT / "README.md").read_text(), flags=re.M):
        if part.startswith("## "):
            section = part[3:].strip()
            continue
        out.setdefault(section, []).extend(re.findall(r"```(\w+)\n(.*?)```", part, flags=re.S))
    return out


def _can_unshare() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


WAIT = """for i in $(seq 1 240); do curl -sf localhost:8000/health >/dev/null && break; sleep 0.5; done
curl -sf localhost:8000/health >/dev/null || { echo "server not healthy"; exit 1; }
"""


def shell(code: str) -> str:
    """A README bash block, line-continued commands kept whole; --monitor gets a Ctrl-C after 4 s."""
    out = []
    for cmd in re.split(r"(?<!\\)\n", code.strip()):
        if "--monitor" in cmd and not cmd.lstrip().startswith("#"):
            cmd = f"timeout -s INT 4 {cmd.split('#')[0]} || [ $? = 124 ]"
        out.append(cmd)
    return "\n".join(out) + "\n"


@pytest.mark.skipif(not _can_unshare(), reason="needs root and `unshare -n` (a private network namespace)")
def test_readme_blocks_run_as_written(tmp_path):
    b = blocks()
    top = [code for lang, code in b[""] if lang == "bash"]
    start = top[0].splitlines()[0].split("#")[0].strip()
    assert start == "./scripts/start_server.sh --local"
    another, = top[1:2]
    api, = [code for lang, code in b["Using the API"] if lang == "python"]
    by_hand = [code for lang, code in b["Multi-GPU on one machine"] if lang == "bash"][1]
    monitoring, = [code for lang, code in b["Monitoring"] if lang == "bash"]
    offline, = [code for lang, code in b["Offline generation"] if lang == "bash"]
    assert "dllm-serve worker" in by_hand and "dllm-serve balancer" in by_hand
    first_curl = by_hand.index("curl")
    script = f"""set -euo pipefail
ip link set lo up
cd {ROOT}
echo "=== start"
{start} > {tmp_path}/serve.log 2>&1 &
SERVE=$!
{WAIT}
echo "=== another terminal"
{shell(another)}
echo "=== using the API"
.venv/bin/python - <<'PY'
{api}
PY
echo
echo "=== monitoring"
{shell(monitoring)}
kill -TERM $SERVE; wait $SERVE || true
echo "=== by hand"
{shell(by_hand[:first_curl])}
{WAIT}
{shell(by_hand[first_curl:])}
kill $(jobs -p) 2>/dev/null || true
wait || true
echo "=== offline"
{shell(offline)}
echo "=== all blocks ran"
"""
    (tmp_path / "readme.sh").write_text(script)
    r = subprocess.run(["unshare", "-n", "bash", str(tmp_path / "readme.sh")], capture_output=True, text=True,
                       timeout=600)
    log = r.stdout + r.stderr + "\n--- serve.log:\n" + (tmp_path / "serve.log").read_text()[-3000:]
    assert r.returncode == 0 and "=== all blocks ran" in r.stdout, log[-6000:]
    out = r.stdout
    assert '"content":"1 2 5 8"' in out and '"content":"5 7 9"' in out, log[-6000:]   # the demo's documented answers
    assert "dllm-serve" in out.split("=== monitoring")[0]            # the monitor's table (header line)
    assert '"healthy_workers": 1' in out.split("=== monitoring")[1]   # dllm-serve status --json
    assert "dllm_balancer_batch_size_bucket" in out                 # /metrics
    assert '"text"' in out.split("=== by hand")[1].split("=== offline")[0]
    assert '"finish_reason":"length","nfe":16' in out.split("=== offline")[1]
