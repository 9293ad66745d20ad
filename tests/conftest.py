import atexit
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Each test process has a cache folder of its own ($DLLM_CACHE: balancers' /v1/files folders, DCP conversions, weight
# hashes), removed at its exit: tests never write the user's, and two processes (xdist workers) never share a
# balancer's files folder, which one balancer process holds locked (balancer/batches.py).
os.environ["DLLM_CACHE"] = _CACHE = tempfile.mkdtemp(prefix="dllm-test-cache-")
atexit.register(shutil.rmtree, _CACHE, True)

ROOT = Path(__file__).resolve().parent.parent
# The fixtures are committed (byte-identical copies of ../shared/fixtures); prefer the shared ones when present.
SHARED = ROOT.parent / "shared" / "fixtures"
LOCAL = ROOT / "tests" / "fixtures"


def fixture_path(name: str) -> Path:
    shared = SHARED / name
    return shared if shared.exists() else LOCAL / name


# bfloat16 on CPU: the rounding depends on the arithmetic, so the `bf16` tests compare with the reference's result for
# the ATen kernel set this process runs (ATEN_CPU_CAPABILITY; torch.backends.cpu.get_cpu_capability()) with oneDNN
# off, whose bfloat16 matmuls would otherwise use the CPU's own instructions (docs/models.md, "bfloat16 on CPU").
# They run only where tests/test_bf16_kernels.py runs them, once per kernel set, with this variable set.
BF16_ENV = "DLLM_SERVE_BF16_KERNELS"
# ... and with MKL held to the instructions of the machine that made the goldens (an AMD EPYC with AVX-512): MKL picks
# its kernels by the CPU itself, whatever ATen's set, and on a Xeon with AMX the reference's own bfloat16
# DiffusionGemma tokens differ from the goldens without this (tests/fixtures/README.md)
BF16_MKL = "AVX512"
BF16_DRIVER = "tests/test_bf16_kernels.py"


def pytest_collection_modifyitems(config, items):
    if os.environ.get(BF16_ENV):
        return
    # the `bf16` driver last: its processes (started when collection ends) use what the tests before it leave idle
    items.sort(key=lambda item: item.nodeid.startswith(f"{BF16_DRIVER}::test_bf16_tests_pass"))
    skip = pytest.mark.skip(reason=f"bfloat16: run once per CPU kernel set by {BF16_DRIVER} (or set {BF16_ENV}=1)")
    for item in items:
        if item.get_closest_marker("bf16"):
            item.add_marker(skip)


def pytest_collection_finish(session):
    """The `bf16` subprocesses (tests/test_bf16_kernels.py) start as soon as the run's tests are known, instead of
    waiting in their turn, at the lowest CPU priority, so that they take only what the tests leave idle (the driver
    runs last; scripts/test.sh runs it in its last stage, one process, with the SLURM tests). The test takes them from
    ``config.dllm_bf16_early``. Not in pytest-xdist processes: each collects every test, and only one runs the driver;
    there the driver starts them itself."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    ids = {item.nodeid for item in session.items}
    if f"{BF16_DRIVER}::test_bf16_tests_pass_under_each_cpu_kernel_set" in ids:
        from tests.test_bf16_kernels import SETS, _start
        session.config.dllm_bf16_early = [(capability, _start(capability)) for capability in SETS]


def pytest_sessionfinish(session):
    for _, proc in getattr(session.config, "dllm_bf16_early", None) or []:
        if proc.poll() is None:     # a run that ended before the test (-x, Ctrl-C)
            proc.kill()
            proc.wait()


def pytest_report_header(config):
    if os.environ.get(BF16_ENV):
        import torch
        return (f"bf16 kernels: {torch.backends.cpu.get_cpu_capability()} "
                f"(ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '')}, "
                f"MKL_ENABLE_INSTRUCTIONS={os.environ.get('MKL_ENABLE_INSTRUCTIONS', '')})")


@pytest.fixture(autouse=True)
def _bf16_without_onednn(request):
    """Every `bf16` test runs with oneDNN off: ATen's own kernels only, the arithmetic its goldens were made in."""
    if request.node.get_closest_marker("bf16") is None:
        yield
        return
    import torch
    was = torch.backends.mkldnn.enabled            # (mkldnn.flags() would also set oneDNN's TF32 flag, and warn)
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = was


def mkl_instructions() -> str:
    """The instructions MKL runs in this process: those of MKL_ENABLE_INSTRUCTIONS (AVX512 or AVX2: the latter, by
    hand, as on a CPU without AVX-512) that the CPU has."""
    import torch
    asked = os.environ.get("MKL_ENABLE_INSTRUCTIONS")
    assert asked in ("AVX512", "AVX2"), \
        f"bfloat16 goldens hold MKL_ENABLE_INSTRUCTIONS={BF16_MKL} results: set it before the process starts"
    return "AVX512" if asked == "AVX512" and torch.cpu._is_avx512_supported() else "AVX2"


def bf16_golden(case: dict) -> dict:
    """A `bf16_cases` entry's reference result (``output``, ``nfe``) for this process's ATen CPU kernel set, and
    for MKL's instructions where the case holds results for both (``kernels_mkl_avx2``: DiffusionGemma's, whose
    tokens depend on them; the other families' are the same under either)."""
    import torch
    assert not torch.backends.mkldnn.enabled, "bfloat16 goldens hold oneDNN-off results: mark the test bf16"
    table = case["kernels"]
    if mkl_instructions() == "AVX2" and "kernels_mkl_avx2" in case:
        table = case["kernels_mkl_avx2"]
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in table:
        pytest.skip(f"no bfloat16 golden for the CPU kernel set {cap} (goldens: {', '.join(table)})")
    return table[cap]


TINY_LLADA = fixture_path("tiny-llada")
TINY_NEMOTRON = fixture_path("tiny-nemotron")
TINY_LLADA_PEAKY = fixture_path("tiny-llada-peaky")
TINY_DREAM = fixture_path("tiny-dream")
TINY_SDAR = fixture_path("tiny-sdar")
TINY_LLADA_MOE = fixture_path("tiny-llada-moe")
TINY_LLADA2 = fixture_path("tiny-llada2")


def _golden(name: str):
    """A session fixture with the parsed golden file ``name``."""
    @pytest.fixture(scope="session")
    def load() -> dict:
        with open(fixture_path(name)) as f:
            return json.load(f)
    return load


def _engine(path: Path):
    """A session fixture with a float32 CPU engine on the checkpoint at ``path``."""
    @pytest.fixture(scope="session")
    def load():
        from worker.engine import Engine
        return Engine.from_pretrained(path, device="cpu", dtype="float32")
    return load


llada_golden = _golden("tiny-llada-golden.json")
peaky_golden = _golden("tiny-llada-peaky-golden.json")
nemotron_golden = _golden("tiny-nemotron-golden.json")
dream_golden = _golden("tiny-dream-golden.json")
sdar_golden = _golden("tiny-sdar-golden.json")
moe_golden = _golden("tiny-llada-moe-golden.json")
llada2_golden = _golden("tiny-llada2-golden.json")
llada21_golden = _golden("tiny-llada21-golden.json")

llada_engine = _engine(TINY_LLADA)
peaky_engine = _engine(TINY_LLADA_PEAKY)
nemotron_engine = _engine(TINY_NEMOTRON)
dream_engine = _engine(TINY_DREAM)
sdar_engine = _engine(TINY_SDAR)
moe_engine = _engine(TINY_LLADA_MOE)
llada2_engine = _engine(TINY_LLADA2)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
