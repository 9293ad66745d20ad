"""LLaDA-MoE (issue 18): the native MoE model against the reference code's outputs on tests/fixtures/tiny-llada-moe
(tests/fixtures/README.md says how they were made): logits, every case alone and batched with mixed prompt lengths
and settings, the reference's own batches, through `dllm-serve generate` and through the balancer; every LLaDA
algorithm serves the family."""
import json
import random

import pytest
import torch
from click.testing import CliRunner

from dllm_serve.cli import main as cli
from tests.conftest import TINY_LLADA_MOE, bf16_golden
from tests.helpers import get_json, post_json
from tests.test_continuous import check_against_alone
from worker.engine import ALGORITHMS, Engine, GenerationParams, Request
from worker.models import FAMILIES, CheckpointError, detect_family, load_model
from worker.models.llada_moe import LLaDAMoEConfig


def params(c: dict) -> GenerationParams:
    return GenerationParams(gen_length=c["gen_length"], block_length=c["block_length"], steps=c["steps"],
                            algorithm=c["algorithm"], threshold=c.get("threshold"), cfg_scale=c.get("cfg_scale", 0.0))


def same(r, c) -> bool:
    return r.canvas == c["output"] and (c["nfe"] is None or r.nfe == c["nfe"])


def test_detection_ids_and_algorithms(moe_engine, tmp_path):
    assert detect_family(TINY_LLADA_MOE) == "llada_moe" and moe_engine.family == "llada_moe"
    assert FAMILIES["llada_moe"].default_algorithm == "basic"
    # the real checkpoints say model_type "llada": without "architectures" the tensor names decide
    cfg = json.loads((TINY_LLADA_MOE / "config.json").read_text())
    copy = tmp_path / "no-arch"
    copy.mkdir()
    for f in TINY_LLADA_MOE.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    (copy / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "architectures"}))
    assert detect_family(copy) == "llada_moe"
    vocab = moe_engine.tokenizer.get_vocab()
    assert moe_engine.mask_id == vocab["<|mask|>"] == 290                    # from the tokenizer: config names none
    assert moe_engine.stop_ids == sorted({vocab["<|endoftext|>"], vocab["<|role_end|>"]})
    llada_algorithms = {n for n, a in ALGORITHMS.items() if "llada" in a.families}
    assert llada_algorithms == {n for n, a in ALGORITHMS.items() if "llada_moe" in a.families}


def test_config_errors_are_clear():
    cfg = json.loads((TINY_LLADA_MOE / "config.json").read_text())
    with pytest.raises(CheckpointError, match="num_experts"):
        LLaDAMoEConfig.from_dict({k: v for k, v in cfg.items() if k != "num_experts"})
    with pytest.raises(CheckpointError, match="moe_layer_freq"):
        LLaDAMoEConfig.from_dict({**cfg, "moe_layer_freq": [1]})
    with pytest.raises(CheckpointError, match="num_experts_per_tok"):
        LLaDAMoEConfig.from_dict({**cfg, "num_experts_per_tok": 9})
    with pytest.raises(CheckpointError, match="clip_qkv"):
        LLaDAMoEConfig.from_dict({**cfg, "clip_qkv": 8.0})
    c = LLaDAMoEConfig.from_dict(cfg)
    assert c.moe_layers == (True, False) and c.rotary_dim == c.head_dim == 16 and not c.expert_bias


def test_forward_matches_reference_logits(moe_golden):
    m = load_model(TINY_LLADA_MOE, "cpu", "float32")
    ids = torch.tensor([moe_golden["logits_input"]])
    with torch.inference_mode():
        got = m.logits(m(ids, torch.arange(ids.shape[1])[None]))[0]
    assert (got - torch.tensor(moe_golden["logits"])).abs().max() < 1e-4


def test_every_golden_case_alone_batched_and_in_the_reference_batches(moe_engine, moe_golden):
    cases = moe_golden["cases"]
    assert len(cases) == 28 and any(c.get("cfg_scale") for c in cases) and any(c.get("threshold") for c in cases)
    wrong = [i for i, c in enumerate(cases)
             if not same(moe_engine.generate([Request(c["prompt"], params(c))], early_exit=False)[0], c)]
    assert wrong == []
    order = list(range(len(cases)))
    random.Random(5).shuffle(order)
    res = moe_engine.generate([Request(cases[i]["prompt"], params(cases[i])) for i in order], early_exit=False)
    assert [i for r, i in zip(res, order) if not same(r, cases[i])] == []
    for b in moe_golden["batched"]:
        assert b["reference_alone_equal"]
        res = moe_engine.generate([Request(p, params(b)) for p in b["prompts"]], early_exit=False)
        assert [r.canvas for r in res] == b["outputs"]


@pytest.mark.slow
@pytest.mark.bf16
def test_bfloat16_cases_alone_are_exact(moe_golden):
    """The reference run in bfloat16 on CPU with oneDNN off, on this ATen kernel set: the same tokens (and Fast-dLLM's
    forward counts) alone."""
    e = Engine.from_pretrained(TINY_LLADA_MOE, device="cpu", dtype="bfloat16")
    cases = [{**c, **bf16_golden(c)} for c in moe_golden["bf16_cases"]]
    assert len(cases) == 12
    assert [i for i, c in enumerate(cases)
            if not same(e.generate([Request(c["prompt"], params(c))], early_exit=False)[0], c)] == []


@pytest.mark.parametrize("alg", ["prefix_cache", "dual_cache", "dinfer_blockwise", "dinfer_credit",
                                 "dinfer_hierarchy"])
def test_the_other_llada_algorithms_serve_the_family_and_rows_join_exactly(moe_engine, moe_golden, alg):
    """No reference runs them on LLaDA-MoE (Fast-dLLM's caches and dInfer's decoders need their own model classes),
    so: they run, each row equals itself alone, and rows joining a running batch change nothing (issue 19)."""
    cases = moe_golden["cases"][:8]
    first = [Request(c["prompt"], params({**c, "algorithm": alg, "threshold": 0.9, "cfg_scale": 0.0})) for c in cases[:3]]
    later = [(1 + i, Request(c["prompt"], params({**c, "algorithm": alg, "threshold": 0.9, "cfg_scale": 0.0})))
             for i, c in enumerate(cases[3:])]
    feed = check_against_alone(moe_engine, first, later)
    assert all(0 <= t < 320 and t != moe_engine.mask_id for r in feed.results.values() for t in r.canvas)


def test_cli_generate_reproduces_the_golden_cases(moe_golden, tmp_path):
    cases = moe_golden["cases"]
    f = tmp_path / "requests.jsonl"
    f.write_text("".join(json.dumps({"prompt_ids": c["prompt"], "gen_length": c["gen_length"],
                                     "block_length": c["block_length"], "steps": c["steps"],
                                     "threshold": c.get("threshold"), "cfg_scale": c.get("cfg_scale", 0.0)}) + "\n"
                         for c in cases))
    res = CliRunner().invoke(cli, ["generate", "--model-path", str(TINY_LLADA_MOE), "--requests", str(f), "--device",
                                   "cpu", "--no-early-exit"])
    assert res.exit_code == 0, res.output
    got = [json.loads(line) for line in res.stdout.splitlines()]
    assert [g["canvas"] for g in got] == [c["output"] for c in cases]


@pytest.mark.slow
def test_worker_and_balancer_serve_the_family(tmp_path, moe_golden):
    from concurrent.futures import ThreadPoolExecutor
    from tests.helpers import Cluster
    cl = Cluster(tmp_path, TINY_LLADA_MOE, n=2)
    try:
        cl.wait_ready()
        assert get_json(cl.workers[0].url + "/health")[1]["family"] == "llada_moe"
        assert get_json(cl.url + "/generation/algorithms")[1]["default_algorithm"] == "basic"

        def body(c):
            return {"prompt": c["prompt"], "max_tokens": c["gen_length"], "block_length": c["block_length"],
                    "steps": c["steps"], "threshold": c.get("threshold"), "cfg_scale": c.get("cfg_scale", 0.0),
                    "ignore_eos": True, "temperature": 0, "return_token_ids": True}
        cases = moe_golden["cases"]
        with ThreadPoolExecutor(12) as ex:
            answers = list(ex.map(lambda c: post_json(cl.url + "/v1/completions", body(c)), cases))
        for c, (status, r) in zip(cases, answers):
            assert status == 200 and r["choices"][0]["token_ids"] == c["output"], (c, r)
        status, r = post_json(cl.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                 "max_tokens": 8})
        assert status == 200 and r["model"] == str(TINY_LLADA_MOE.resolve())
    finally:
        cl.stop()
