import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The fixtures are committed (byte-identical copies of ../shared/fixtures); prefer the shared ones when present.
SHARED = ROOT.parent / "shared" / "fixtures"
LOCAL = ROOT / "tests" / "fixtures"


def fixture_path(name: str) -> Path:
    shared = SHARED / name
    return shared if shared.exists() else LOCAL / name


TINY_LLADA = fixture_path("tiny-llada")
TINY_NEMOTRON = fixture_path("tiny-nemotron")
TINY_LLADA_PEAKY = fixture_path("tiny-llada-peaky")
TINY_DREAM = fixture_path("tiny-dream")
TINY_SDAR = fixture_path("tiny-sdar")
TINY_LLADA_MOE = fixture_path("tiny-llada-moe")
TINY_LLADA2 = fixture_path("tiny-llada2")


@pytest.fixture(scope="session")
def llada_golden() -> dict:
    with open(fixture_path("tiny-llada-golden.json")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def nemotron_golden() -> dict:
    with open(fixture_path("tiny-nemotron-golden.json")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def dream_golden() -> dict:
    with open(fixture_path("tiny-dream-golden.json")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def dream_engine():
    from worker.engine import Engine
    return Engine.from_pretrained(TINY_DREAM, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def sdar_golden() -> dict:
    with open(fixture_path("tiny-sdar-golden.json")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def sdar_engine():
    from worker.engine import Engine
    return Engine.from_pretrained(TINY_SDAR, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def peaky_golden() -> dict:
    with open(fixture_path("tiny-llada-peaky-golden.json")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def peaky_engine():
    from worker.engine import Engine
    return Engine.from_pretrained(TINY_LLADA_PEAKY, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def nemotron_engine():
    from worker.engine import Engine
    return Engine.from_pretrained(TINY_NEMOTRON, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def llada_engine():
    from worker.engine import Engine
    return Engine.from_pretrained(TINY_LLADA, device="cpu", dtype="float32")


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def moe_golden() -> dict:
    with open(fixture_path("tiny-llada-moe-golden.json")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def moe_engine():
    from worker.engine import Engine
    return Engine.from_pretrained(TINY_LLADA_MOE, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def llada2_golden() -> dict:
    with open(fixture_path("tiny-llada2-golden.json")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def llada2_engine():
    from worker.engine import Engine
    return Engine.from_pretrained(TINY_LLADA2, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def llada21_golden() -> dict:
    with open(fixture_path("tiny-llada21-golden.json")) as f:
        return json.load(f)
