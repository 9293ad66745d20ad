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
