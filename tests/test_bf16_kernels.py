"""The `bf16` tests (bfloat16 goldens and tolerances on CPU), once per ATen CPU kernel set.

bfloat16 results on CPU depend on the arithmetic: ATen picks its vectorised kernels by ATEN_CPU_CAPABILITY (DEFAULT,
AVX2, AVX512; read once, when torch is imported) and oneDNN runs bfloat16 matmuls with the CPU's own instructions. The
`bf16` tests therefore run with oneDNN off (tests/conftest.py) and compare with the reference's result for the kernel
set torch reports (the goldens hold one per set, tests/fixtures/README.md). Each set needs its own process: this test
runs `pytest -m bf16` in a subprocess per set (the sets' processes at once, at the lowest CPU priority, started as soon
as the tests are collected; the test is marked `alone` and runs last, so scripts/test.sh runs it in its last stage,
where they use what the SLURM tests leave idle), with one thread as the goldens were made, checks that it passed and that the kernel set it ran is the one asked for
whenever this CPU has it. Elsewhere the `bf16` tests are skipped. MKL picks its own kernels by the CPU, whatever
ATen's set (on a Xeon with AMX it gives the reference itself other DiffusionGemma tokens than the goldens' AMD EPYC):
the processes cap it at the goldens' machine's instructions, `MKL_ENABLE_INSTRUCTIONS=AVX512`, and a CPU without AVX-512
(MKL's AVX2 kernels) is compared with the goldens of those where they differ (tests/fixtures/README.md).
By hand: `DLLM_SERVE_BF16_KERNELS=1 MKL_ENABLE_INSTRUCTIONS=AVX512 ATEN_CPU_CAPABILITY=avx2 .venv/bin/python -m pytest
-m bf16 tests/test_llada2.py`."""
import functools
import os
import re
import subprocess
import sys
import time

import pytest

from tests.conftest import BF16_ENV, BF16_MKL, ROOT

# the files with `bf16` tests (test_every_bf16_test_is_driven keeps this list complete)
FILES = ["tests/test_llada2.py", "tests/test_llada_moe.py", "tests/test_llada_model.py", "tests/test_diffusion_gemma.py"]
ORDER = ["DEFAULT", "AVX2", "AVX512"]


def _env(capability: str | None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATEN_CPU_CAPABILITY", BF16_ENV, "PYTEST_ADDOPTS", "MKL_ENABLE_INSTRUCTIONS")}
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    return env


@functools.lru_cache(maxsize=1)
def best_capability() -> str:
    """The kernel set torch picks on this CPU when nothing is asked."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         env=_env(None), capture_output=True, text=True, check=True, timeout=120)
    return out.stdout.strip()


# every `bf16` test under each kernel set, in one process per set (a process costs seconds to start; each needs ~20 s
# of one core), in the last stage only (the fast tier's AVX2 process took a core for 20 s of its 3 minutes; in the
# parallel slow tier, at the lowest priority, they once got under 63 s of CPU in 300 s and failed CI). The three
# processes run at once: each has one thread, and they are independent.
SETS = ["avx2", "default", "avx512"]
# how long the test waits for all of them (the processes started when collection ended)
WAIT_S = 270


def _start(capability: str) -> subprocess.Popen:
    """At the lowest CPU priority: the suite's tests (some timing a server's answers) go first."""
    env = {**_env(capability), BF16_ENV: "1", "OMP_NUM_THREADS": "1", "MKL_ENABLE_INSTRUCTIONS": BF16_MKL}
    return subprocess.Popen([sys.executable, "-m", "pytest", "-m", "bf16", "-p", "no:cacheprovider",
                             "-rs", *FILES], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=lambda: os.nice(19))


def _check(capability: str, proc: subprocess.Popen, deadline: float) -> None:
    try:
        out = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
        pytest.fail(f"[{capability}] not done in {WAIT_S} s:\n" + (out or "")[-4000:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and re.search(r"\b\d+ passed", out), f"[{capability}] " + out[-4000:]
    ran = re.search(r"^bf16 kernels: (\w+)", out, re.M)
    assert ran, f"[{capability}] " + out[-4000:]
    want, best = capability.upper(), best_capability()
    if best in ORDER and ORDER.index(want) <= ORDER.index(best):
        assert ran.group(1) == want, f"asked for {want} on a {best} CPU, torch ran {ran.group(1)}"


@pytest.mark.slow
@pytest.mark.alone
def test_bf16_tests_pass_under_each_cpu_kernel_set(pytestconfig):
    procs = getattr(pytestconfig, "dllm_bf16_early", None)     # started when collection ended (conftest.py)
    pytestconfig.dllm_bf16_early = None
    procs = procs or [(capability, _start(capability)) for capability in SETS]
    deadline = time.monotonic() + WAIT_S
    try:
        for capability, proc in procs:
            _check(capability, proc, deadline)
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_every_bf16_test_is_driven():
    """A `bf16` test outside FILES would never run."""
    marked = sorted(f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")
                    if "mark.bf16" in p.read_text() and p.name != "test_bf16_kernels.py")
    assert set(marked) <= set(FILES), marked
