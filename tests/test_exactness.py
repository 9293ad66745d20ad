"""Exactness where confidences saturate: tiny-llada-peaky, whose confidences are often exactly 1.0 or a few float32
ulps below it, against the reference code's outputs (tests/fixtures/README.md says how they were made). Every case
must be token-identical over the whole canvas with the reference's nfe: alone, all in one batch, in the reference's
own batches, and through ``dllm-serve generate --no-early-exit``."""
import random

import orjson
import pytest
from click.testing import CliRunner

from dllm_serve.cli import main as cli
from tests.conftest import TINY_LLADA, TINY_LLADA_PEAKY, TINY_NEMOTRON
from worker.engine import GenerationParams, Request

SETTINGS = ("basic", "cfg", "threshold", "prefix_cache", "dual_cache")


def params_of(c: dict) -> GenerationParams:
    return GenerationParams(gen_length=c["gen_length"], block_length=c["block_length"], steps=c["steps"],
                            algorithm=c["algorithm"], threshold=c.get("threshold"), cfg_scale=c.get("cfg_scale", 0.0))


def same(result, case) -> bool:
    return result.canvas == case["output"] and (case["nfe"] is None or result.nfe == case["nfe"])


def test_fixture_covers_every_setting_and_saturates(peaky_golden):
    cases = peaky_golden["cases"]
    kinds = {"cfg" if c.get("cfg_scale") else "threshold" if c.get("threshold") and c["algorithm"] == "basic"
             else c["algorithm"] for c in cases}
    assert kinds == set(SETTINGS)
    assert any(c.get("threshold") for c in cases if c["algorithm"] != "basic")
    assert len(peaky_golden["batched"]) == 2 and all(b["reference_alone_equal"] for b in peaky_golden["batched"])
    assert peaky_golden["max_prob_saturated_fraction"] > 0


def test_every_peaky_case_alone_is_exact_with_the_same_nfe(peaky_engine, peaky_golden):
    wrong = [i for i, c in enumerate(peaky_golden["cases"])
             if not same(peaky_engine.generate([Request(c["prompt"], params_of(c))], early_exit=False)[0], c)]
    assert wrong == []


def test_every_peaky_case_batched_is_exact(peaky_engine, peaky_golden):
    cases = peaky_golden["cases"]
    order = list(range(len(cases)))
    random.Random(5).shuffle(order)
    res = peaky_engine.generate([Request(cases[i]["prompt"], params_of(cases[i])) for i in order], early_exit=False)
    assert [i for r, i in zip(res, order) if not same(r, cases[i])] == []


@pytest.mark.parametrize("fixture", ["peaky", "llada"])
def test_dual_cache_cases_sharing_forwards_with_dinfer_rows_are_exact(fixture, request):
    """dual_cache rows and the dInfer decoders' rows share one loop and its forwards (Algorithm.forward): every
    dual_cache case, batched with dInfer rows of every kind and phase, still gives the reference's canvas and nfe."""
    engine = request.getfixturevalue(f"{fixture}_engine")
    cases = [c for c in request.getfixturevalue(f"{fixture}_golden")["cases"] if c["algorithm"] == "dual_cache"]
    rng = random.Random(7)
    reqs, where = [], []
    for i, c in enumerate(cases):          # a dInfer row first: the group's loop must not take its rule for all
        alg = ("dinfer_blockwise", "dinfer_hierarchy", "dinfer_credit")[i % 3]
        reqs.append(Request(c["prompt"][: rng.randrange(1, len(c["prompt"]) + 1)],
                            GenerationParams(gen_length=rng.choice([8, 16, 24]), block_length=rng.choice([4, 8]),
                                             algorithm=alg, threshold=0.9)))
        where.append(len(reqs))
        reqs.append(Request(c["prompt"], params_of(c)))
    res = engine.generate(reqs, early_exit=False)
    assert [i for i, c in enumerate(cases) if not same(res[where[i]], c)] == []


def test_reference_batches_are_exact(peaky_engine, peaky_golden):
    for b in peaky_golden["batched"]:
        res = peaky_engine.generate([Request(p, params_of(b)) for p in b["prompts"]], early_exit=False)
        assert [r.canvas for r in res] == b["outputs"], b["algorithm"]


def test_early_exit_keeps_the_answer(peaky_engine, peaky_golden):
    stops = set(peaky_engine.stop_ids)
    for c in peaky_golden["cases"][::3]:
        r = peaky_engine.generate([Request(c["prompt"], params_of(c))])[0]
        cut = next((i for i, t in enumerate(c["output"]) if t in stops), len(c["output"]))
        assert r.token_ids == c["output"][:cut]


def _cli_case(c: dict) -> list[str]:
    args = ["--gen-length", str(c["gen_length"]), "--block-length", str(c["block_length"]), "--steps", str(c["steps"]),
            "--algorithm", c["algorithm"]]
    if c.get("threshold") is not None:
        args += ["--threshold", str(c["threshold"])]
    if c.get("cfg_scale"):
        args += ["--cfg-scale", str(c["cfg_scale"])]
    return args


def test_cli_generate_alone_and_batched(peaky_golden):
    common = ["generate", "--model-path", str(TINY_LLADA_PEAKY), "--device", "cpu", "--dtype", "float32",
              "--no-early-exit", "--json"]
    runner = CliRunner()
    cases = peaky_golden["cases"]
    for c in cases[::4]:   # alone (one of each setting and prompt length; every case is checked batched below)
        res = runner.invoke(cli, common + ["--prompt-ids", ",".join(map(str, c["prompt"]))] + _cli_case(c))
        assert res.exit_code == 0, res.output
        out = orjson.loads(res.stdout)
        assert out["canvas"] == c["output"] and (c["nfe"] is None or out["nfe"] == c["nfe"]), c
    lines = [orjson.dumps({"prompt_ids": c["prompt"], "gen_length": c["gen_length"], "block_length": c["block_length"],
                           "steps": c["steps"], "algorithm": c["algorithm"], "threshold": c.get("threshold"),
                           "cfg_scale": c.get("cfg_scale", 0.0)}) for c in cases]
    res = runner.invoke(cli, common + ["--requests", "-"], input=b"\n".join(lines))
    assert res.exit_code == 0, res.output
    outs = [orjson.loads(line) for line in res.stdout.splitlines()]
    assert len(outs) == len(cases)
    for o, c in zip(outs, cases):
        assert o["canvas"] == c["output"] and (c["nfe"] is None or o["nfe"] == c["nfe"]), c


def _cli_batch(model, lines: list[dict], extra: tuple = ()) -> list[dict]:
    res = CliRunner().invoke(cli, ["generate", "--model-path", str(model), "--device", "cpu", "--dtype", "float32",
                                   "--no-early-exit", "--requests", "-", *extra],
                             input=b"\n".join(orjson.dumps(x) for x in lines))
    assert res.exit_code == 0, res.output
    return [orjson.loads(line) for line in res.stdout.splitlines()]


@pytest.mark.parametrize("ranks", [pytest.param(1, id="one-rank"),
                                   pytest.param(2, id="two-ranks", marks=pytest.mark.slow)])
def test_every_tiny_llada_case_batched_through_the_cli(llada_golden, ranks):
    """Also with --tensor-parallel-size 2 (worker/engine/ranks.py: a follower process beside this one)."""
    cases = llada_golden["cases"]
    outs = _cli_batch(TINY_LLADA, [{"prompt_ids": c["prompt"], "gen_length": c["gen_length"],
                                    "block_length": c["block_length"], "steps": c["steps"],
                                    "algorithm": c["algorithm"], "threshold": c.get("threshold"),
                                    "cfg_scale": c.get("cfg_scale") or 0.0} for c in cases],
                      ("--tensor-parallel-size", str(ranks)))
    assert [i for i, (o, c) in enumerate(zip(outs, cases))
            if o["canvas"] != c["output"] or (c["nfe"] is not None and o["nfe"] != c["nfe"])] == []


def test_every_tiny_nemotron_case_batched_through_the_cli(nemotron_golden):
    lines, want = [], []
    for st in nemotron_golden["settings"]:
        for out in nemotron_golden["outputs"][st["name"]]:
            lines.append({"prompt_ids": nemotron_golden["prompts"][out["prompt_index"]], "gen_length": st["gen_length"],
                          "block_length": st["block_length"], "steps": st["steps"], "threshold": st["threshold"],
                          "algorithm": "nemotron"})
            want.append(out)
    outs = _cli_batch(TINY_NEMOTRON, lines)
    assert [(o["canvas"], o["nfe"]) for o in outs] == [(w["output_ids"], w["nfe"]) for w in want]
