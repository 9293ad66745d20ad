"""LLaDA2.x (issue 18): the native BailingMoeV2 model and the ``llada2`` block-diffusion loop against the reference
code's outputs on tests/fixtures/tiny-llada2 (tests/fixtures/README.md says how they were made): logits, every case
alone and batched (mixed prompt lengths, block sizes, thresholds, seeded sampling), in float32 and bfloat16, with and
without the KV cache, the answers with early exit at eos, through `dllm-serve generate` and through the balancer."""
import json
import random

import pytest
import torch
from click.testing import CliRunner

from dllm_serve.cli import main as cli
from tests.conftest import TINY_LLADA2, bf16_golden
from tests.helpers import get_json, post_json
from tests.test_continuous import check_against_alone
from worker.engine import ALGORITHMS, Engine, GenerationParams, ParamError, Request
from worker.models import FAMILIES, CheckpointError, detect_family, load_model
from worker.models.llada2 import LLaDA2Config


def extra(c: dict, **kw) -> dict:
    return {"denoising_steps": c["steps"], "top_k": c.get("top_k", 0), "top_p": c.get("top_p", 1.0), **kw}


def params(c: dict, **kw) -> GenerationParams:
    return GenerationParams(gen_length=c["gen"], block_length=c["block"], algorithm="llada2",
                            threshold=c["threshold"], temperature=c.get("temperature", 0.0), seed=c.get("seed"),
                            extra=extra(c, **kw))


def same(r, c) -> bool:
    return r.canvas[:c["gen"]] == c["output"] and r.nfe == c["nfe"]


def bf16_cache_is_exact() -> bool:
    """Whether a cached bfloat16 forward is bitwise the reference's whole-prefix forward. Only under the DEFAULT
    kernels: with AVX2/AVX512 ones, ATen's CPU flash attention takes exp() of the scores with a vectorised
    approximation over the keys that fill whole vectors (8 floats with AVX2, 16 with AVX512) and with std::exp over
    the rest, so a position's attention output depends on how many keys the forward has, masked ones included; the
    reference recomputes the earlier blocks in every forward (its keys end at the current block), the cache keeps
    them as they were when they were stored (docs/models.md, "bfloat16 on CPU")."""
    return torch.backends.cpu.get_cpu_capability() == "DEFAULT"


def bf16_mismatches(engine, cases, make_params) -> dict[bool, list[int]]:
    """The bfloat16 cases (alone) whose tokens or forward count differ from the reference on this kernel set:
    without the cache (the reference's own forwards) and, where that is exact, with it."""
    gold = [{**c, **bf16_golden(c)} for c in cases]
    return {kv: [i for i, c in enumerate(gold) if not same(
        engine.generate([Request(c["prompt"], make_params(c, kv_cache=kv))], early_exit=False)[0], c)]
        for kv in ((False, True) if bf16_cache_is_exact() else (False,))}


def params21(c: dict, **kw) -> GenerationParams:
    return GenerationParams(gen_length=c["gen"], block_length=c["block"], algorithm="llada21",
                            threshold=c["threshold"], temperature=c.get("temperature", 0.0), seed=c.get("seed"),
                            extra=extra21(c, **kw))


def extra21(c: dict, **kw) -> dict:
    return {"editing_threshold": c["editing_threshold"], "max_post_steps": c.get("max_post_steps", 16),
            "num_to_transfer": c.get("num_to_transfer", 1), "top_k": c.get("top_k", 0), "top_p": c.get("top_p", 1.0),
            **kw}


def test_detection_ids_and_algorithms(llada2_engine):
    assert detect_family(TINY_LLADA2) == "llada2" and llada2_engine.family == "llada2"
    assert FAMILIES["llada2"].default_algorithm == "llada2" and ALGORITHMS["llada2"].families == ("llada2",)
    assert sorted(n for n, a in ALGORITHMS.items() if "llada2" in a.families) == ["llada2", "llada21"]
    vocab = llada2_engine.tokenizer.get_vocab()
    assert llada2_engine.mask_id == vocab["<|mask|>"] == 290
    assert llada2_engine.stop_ids == sorted({vocab["<|endoftext|>"], vocab["<|role_end|>"]})


def test_config_errors_are_clear():
    cfg = json.loads((TINY_LLADA2 / "config.json").read_text())
    with pytest.raises(CheckpointError, match="moe_intermediate_size"):
        LLaDA2Config.from_dict({k: v for k, v in cfg.items() if k != "moe_intermediate_size"})
    with pytest.raises(CheckpointError, match="routing"):
        LLaDA2Config.from_dict({**cfg, "n_group": 3})
    with pytest.raises(CheckpointError, match="score_function"):
        LLaDA2Config.from_dict({**cfg, "score_function": "softmax"})
    c = LLaDA2Config.from_dict(cfg)
    assert (c.rotary_dim, c.head_dim, c.first_k_dense_replace, c.num_shared_experts) == (8, 16, 1, 1)


def test_a_checkpoint_without_expert_bias_routes_with_zeros(tmp_path):
    """The reference keeps expert_bias as a buffer of zeros when the checkpoint has none."""
    from safetensors.torch import load_file, save_file
    for f in TINY_LLADA2.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    t = load_file(TINY_LLADA2 / "model.safetensors")
    t.pop("model.layers.1.mlp.gate.expert_bias")
    save_file(t, tmp_path / "model.safetensors", metadata={"format": "pt"})
    m = load_model(tmp_path, "cpu", "float32")
    gate = m.model.layers[1].mlp.gate
    assert torch.equal(gate.expert_bias, torch.zeros(8)) and not gate.expert_bias.is_meta
    ids = torch.tensor([[5, 6, 7, 290]])
    with torch.inference_mode():
        assert torch.isfinite(m.logits(m(ids, torch.arange(4)[None]))).all()


def test_forward_matches_reference_logits(llada2_golden):
    m = load_model(TINY_LLADA2, "cpu", "float32")
    ids = torch.tensor([llada2_golden["logits_input"]])
    n, bl = ids.shape[1], llada2_golden["logits_block_length"]
    k = torch.arange(n)
    mask = (k[None, :] // bl <= k[:, None] // bl)[None, None]
    with torch.inference_mode():
        got = m.logits(m(ids, k[None], mask))[0]
    assert (got - torch.tensor(llada2_golden["logits"])).abs().max() < 1e-4


def test_every_golden_case_alone_batched_and_without_the_cache(llada2_engine, llada2_golden):
    """Every case alone and batched; every other one without the cache (the CLI test runs the rest)."""
    cases = llada2_golden["cases"]
    assert len(cases) == 57 and any("seed" in c for c in cases) and any(c["gen"] % c["block"] for c in cases)
    assert [i for i, c in enumerate(cases)
            if not same(llada2_engine.generate([Request(c["prompt"], params(c))], early_exit=False)[0], c)] == []
    assert [i for i, c in enumerate(cases[::2]) if not same(llada2_engine.generate(
        [Request(c["prompt"], params(c, kv_cache=False))], early_exit=False)[0], c)] == []
    order = list(range(len(cases)))
    random.Random(5).shuffle(order)
    res = llada2_engine.generate([Request(cases[i]["prompt"], params(cases[i])) for i in order], early_exit=False)
    assert [i for r, i in zip(res, order) if not same(r, cases[i])] == []


@pytest.mark.bf16
def test_bfloat16_cases_alone_are_exact(llada2_golden):
    """The reference run in bfloat16 on CPU (its own bfloat16 block mask) with oneDNN off, on this ATen kernel set:
    the same tokens and forwards alone, without the cache and (DEFAULT kernels) with it."""
    e = Engine.from_pretrained(TINY_LLADA2, device="cpu", dtype="bfloat16")
    cases = llada2_golden["bf16_cases"]
    assert len(cases) == 16
    bad = bf16_mismatches(e, cases, params)
    assert not any(bad.values()), bad          # {kv_cache: [case indices]}


def test_early_exit_gives_the_reference_answer(llada2_engine, llada2_golden):
    """The reference stops after the block in which eos appears and returns the answer through it; here the answer
    ends at the first stop token (eos or <|role_end|>), with the reference's forward count when it is eos."""
    stops = set(llada2_engine.stop_ids)
    ended = 0
    for c in llada2_golden["cases"]:
        r = llada2_engine.generate([Request(c["prompt"], params(c))])[0]
        ans = c["answer"]
        cut = next((i for i, t in enumerate(ans) if t in stops), len(ans))
        assert r.token_ids == ans[:cut], c
        if cut == len(ans) - 1 and ans[-1] == 287:
            ended += 1
            assert r.finish_reason == "stop" and r.nfe == c["answer_nfe"] <= c["nfe"], c
    assert ended >= 10


def test_the_cache_forwards_fewer_tokens_for_the_same_answer(llada2_golden):
    e = Engine.from_pretrained(TINY_LLADA2, device="cpu", dtype="float32")
    counted = {"n": 0}
    forward = e.model.forward

    def count(ids, pos, *a, **k):
        window = k.get("window")
        counted["n"] += int(window[0].numel()) if window is not None else ids.numel()
        return forward(ids, pos, *a, **k)
    e.model.forward = count
    c = next(x for x in llada2_golden["cases"] if x["gen"] == 32 and x["block"] == 8 and x["steps"] == 8)
    tokens = {}
    for kv in (True, False):
        counted["n"] = 0
        r = e.generate([Request(c["prompt"], params(c, kv_cache=kv))], early_exit=False)[0]
        assert same(r, c)
        tokens[kv] = counted["n"]
    assert tokens[True] * 2 < tokens[False]


def test_rows_join_a_running_batch_exactly(llada2_engine, llada2_golden):
    cases = llada2_golden["cases"][::4]
    reqs = [Request(c["prompt"], params(c)) for c in cases]
    feed = check_against_alone(llada2_engine, reqs[:2], [(k, r) for k, r in zip((1, 2, 2, 3, 5, 8, 9, 11, 13, 20, 21,
                                                                                  22, 30), reqs[2:])])
    for (i, _, _), c in zip(feed.joined, cases[2:]):
        assert same(feed.results[i], c)


def test_parameter_errors(llada2_engine):
    def err(**kw):
        with pytest.raises(ParamError) as e:
            llada2_engine.plan([1, 2, 3], GenerationParams(gen_length=8, block_length=4, algorithm="llada2", **kw))
        return e.value.param
    assert err(steps=4) == "steps"
    assert err(factor=1.0) == "factor"
    assert err(remasking="random") == "remasking"
    assert err(extra={"top_p": 0}) == "algorithm_params"
    assert err(extra={"minimal_topk": 0}) == "algorithm_params"
    assert err(extra={"remasking_strategy": "sequential"}) == "algorithm_params"
    assert err(cfg_scale=1.0) == "cfg_scale"
    with pytest.raises(ParamError, match="maximum context length"):      # 505 + 10 in whole blocks of 8: 520
        llada2_engine.plan([1] * 505, GenerationParams(gen_length=10, block_length=8, algorithm="llada2"))
    pl = llada2_engine.plan([1, 2, 3], GenerationParams(gen_length=6, block_length=8, algorithm="llada2"))
    assert pl.params.threshold == 0.95 and pl.params.extra["denoising_steps"] == 6      # min(block, gen // 1)


def test_cli_generate_reproduces_the_golden_cases(llada2_golden, tmp_path):
    cases = llada2_golden["cases"]
    f = tmp_path / "requests.jsonl"
    f.write_text("".join(json.dumps({"prompt_ids": c["prompt"], "gen_length": c["gen"], "block_length": c["block"],
                                     "threshold": c["threshold"], "temperature": c.get("temperature", 0.0),
                                     "seed": c.get("seed"), "algorithm_params": extra(c, kv_cache=i % 2 == 0)})
                         + "\n" for i, c in enumerate(cases)))          # the odd cases without the cache
    res = CliRunner().invoke(cli, ["generate", "--model-path", str(TINY_LLADA2), "--requests", str(f), "--device",
                                   "cpu", "--no-early-exit"])
    assert res.exit_code == 0, res.output
    got = [json.loads(line) for line in res.stdout.splitlines()]
    assert [g["canvas"][:c["gen"]] for g, c in zip(got, cases)] == [c["output"] for c in cases]
    assert [g["nfe"] for g in got] == [c["nfe"] for c in cases]


def test_llada21_editing_cases_are_exact_alone_and_batched(llada2_engine, llada21_golden):
    """LLaDA2.1's generate (token editing) on the same checkpoint."""
    cases = llada21_golden["cases"]
    assert len(cases) == 53 and any(c.get("max_post_steps") == 0 for c in cases)
    assert [i for i, c in enumerate(cases[::3])
            if not same(llada2_engine.generate([Request(c["prompt"], params21(c))], early_exit=False)[0], c)] == []
    order = list(range(len(cases)))
    random.Random(6).shuffle(order)
    res = llada2_engine.generate([Request(cases[i]["prompt"], params21(cases[i])) for i in order], early_exit=False)
    assert [i for r, i in zip(res, order) if not same(r, cases[i])] == []
    with pytest.raises(ParamError) as err:
        llada2_engine.plan([1, 2], GenerationParams(gen_length=8, block_length=4, algorithm="llada21",
                                                    extra={"denoising_steps": 4}))
    assert err.value.param == "algorithm_params"


@pytest.mark.bf16
def test_llada21_bfloat16_cases_alone_are_exact(llada21_golden):
    """LLaDA2.1's bfloat16 goldens as llada2's (oneDNN off, this ATen kernel set)."""
    e = Engine.from_pretrained(TINY_LLADA2, device="cpu", dtype="bfloat16")
    cases = llada21_golden["bf16_cases"]
    assert len(cases) == 16
    bad = bf16_mismatches(e, cases, params21)
    assert not any(bad.values()), bad          # {kv_cache: [case indices]}


@pytest.mark.slow
def test_llada21_without_cache_early_exit_and_joining(llada2_engine, llada21_golden):
    """The same goldens without the cache, with early exit (the reference's eos_early_stop) and joining a running
    batch."""
    cases = llada21_golden["cases"]
    res = llada2_engine.generate([Request(c["prompt"], params21(c, kv_cache=False)) for c in cases],
                                 early_exit=False)
    assert [i for i, (r, c) in enumerate(zip(res, cases)) if not same(r, c)] == []
    stops = set(llada2_engine.stop_ids)
    for r, c in zip(llada2_engine.generate([Request(c["prompt"], params21(c)) for c in cases]), cases):
        cut = next((i for i, t in enumerate(c["answer"]) if t in stops), len(c["answer"]))
        assert r.token_ids == c["answer"][:cut], c
    reqs = [Request(c["prompt"], params21(c)) for c in cases[::4]]
    feed = check_against_alone(llada2_engine, reqs[:2], [(k, r) for k, r in zip((1, 3, 3, 6, 9, 12, 16, 20, 25, 31,
                                                                                  40), reqs[2:])])
    for (i, _, _), c in zip(feed.joined, cases[::4][2:]):
        assert same(feed.results[i], c)


@pytest.mark.slow
def test_worker_and_balancer_serve_the_family(tmp_path, llada2_golden, llada21_golden):
    from concurrent.futures import ThreadPoolExecutor
    from tests.helpers import Cluster
    cl = Cluster(tmp_path, TINY_LLADA2, n=2)
    try:
        cl.wait_ready()
        assert get_json(cl.workers[0].url + "/health")[1]["family"] == "llada2"
        assert get_json(cl.url + "/generation/algorithms")[1]["default_algorithm"] == "llada2"

        def body(c):
            return {"prompt": c["prompt"], "max_tokens": c["gen"], "block_length": c["block"], "ignore_eos": True,
                    "temperature": c.get("temperature", 0.0), "seed": c.get("seed"), "threshold": c["threshold"],
                    "algorithm_params": extra(c), "return_token_ids": True}
        cases = llada2_golden["cases"]
        with ThreadPoolExecutor(12) as ex:
            answers = list(ex.map(lambda c: post_json(cl.url + "/v1/completions", body(c)), cases))
        for c, (status, r) in zip(cases, answers):
            assert status == 200 and r["choices"][0]["token_ids"] == c["output"], (c, r)
            assert r["choices"][0]["nfe"] == c["nfe"]
        status, r = post_json(cl.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                 "max_tokens": 8})
        assert status == 200 and r["model"] == str(TINY_LLADA2.resolve())
        c = llada21_golden["cases"][7]
        status, r = post_json(cl.url + "/v1/completions", {
            "prompt": c["prompt"], "max_tokens": c["gen"], "block_length": c["block"], "ignore_eos": True,
            "threshold": c["threshold"], "generation_algorithm": "llada21", "algorithm_params": extra21(c),
            "return_token_ids": True, "temperature": 0})
        assert status == 200 and r["choices"][0]["token_ids"] == c["output"] and r["choices"][0]["nfe"] == c["nfe"]
    finally:
        cl.stop()
