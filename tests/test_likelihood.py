"""LLaDA's Monte Carlo log-likelihood estimator and greedy check against goldens from the reference code
(ML-GSAI/LLaDA get_log_likelihood.py / eval_llada.py on tests/fixtures/tiny-llada; settings in
tests/fixtures/README.md): equal to float tolerance, with and without classifier-free guidance."""
import json

import orjson
import pytest
from click.testing import CliRunner

from dllm_serve.cli import main as cli
from tests.conftest import TINY_LLADA, fixture_path
from worker.engine.likelihood import greedy_suffix, log_likelihood

GOLDEN = json.loads(fixture_path("tiny-llada-likelihood-golden.json").read_text())


@pytest.fixture(scope="module")
def engine():
    from worker.engine import Engine
    return Engine.from_pretrained(str(TINY_LLADA), device="cpu")


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: f"p{len(c['prefix'])}-t{len(c['target'])}-cfg"
                                                                   f"{c['cfg_scale']}")
def test_matches_the_reference(engine, case):
    ll = log_likelihood(engine.model, case["prefix"], case["target"], engine.mask_id, case["mc_num"],
                        case["batch_size"], case["cfg_scale"], case["seed"])
    assert ll == pytest.approx(case["log_likelihood"], rel=1e-6, abs=1e-5)
    assert greedy_suffix(engine.model, case["prefix"], case["target"], engine.mask_id,
                         case["cfg_scale"]) == case["is_greedy"]


def test_goldens_cover_both_greedy_outcomes():
    assert {c["is_greedy"] for c in GOLDEN["cases"]} == {True, False}


def test_cli_score(engine):
    case = GOLDEN["cases"][1]
    r = CliRunner().invoke(cli, ["score", "--model-path", str(TINY_LLADA), "--device", "cpu",
                                 "--prefix-ids", ",".join(map(str, case["prefix"])),
                                 "--target-ids", ",".join(map(str, case["target"])), "--mc-num", str(case["mc_num"]),
                                 "--batch-size", str(case["batch_size"]), "--seed", str(case["seed"])])
    assert r.exit_code == 0, r.output
    out = orjson.loads(r.stdout)
    assert out["log_likelihood"] == pytest.approx(case["log_likelihood"], rel=1e-6)
    bad = CliRunner().invoke(cli, ["score", "--model-path", str(TINY_LLADA), "--device", "cpu", "--prefix-ids", "1",
                                   "--target-ids", "2", "--mc-num", "10", "--batch-size", "4"])
    assert bad.exit_code == 2 and "multiple of batch_size" in bad.output
