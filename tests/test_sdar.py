"""SDAR (block diffusion, block-causal attention, exact KV cache): the native model against the reference logits,
the sdar algorithm against every golden case of JetAstra/SDAR's generate.py (alone, batched with mixed prompt
lengths, block sizes and strategies, through `dllm-serve generate` and through the balancer), the cache against
recomputing the prefix, the tokenizer, detection and parameter checks."""
import json

import pytest
import torch
from click.testing import CliRunner

from dllm_serve.cli import main as cli
from tests.conftest import TINY_SDAR
from tests.helpers import get_json, post_json
from worker.engine import ALGORITHMS, GenerationParams, ParamError, Request
from worker.models import FAMILIES, detect_family, load_model


def extra(c, **kw):
    e = {"remasking_strategy": c["strategy"], "denoising_steps": c["steps"], "top_p": c.get("top_p", 1.0)}
    if "seed" in c:
        e["top_k"] = c.get("top_k", 0)
    return {**e, **kw}


def params(c, **kw):
    """Seeded cases sample (temperature 1 unless given); the unseeded ones are the reference's greedy setting
    (top_k 1), which is temperature 0 here."""
    t = c.get("temperature", 1.0) if "seed" in c else 0.0
    return GenerationParams(gen_length=c["gen"], block_length=c["block"], algorithm="sdar", temperature=t,
                            threshold=c.get("threshold"), seed=c.get("seed"), extra=extra(c, **kw))


def test_family_detection_and_defaults(sdar_engine):
    assert detect_family(TINY_SDAR) == "sdar" and FAMILIES["sdar"].default_algorithm == "sdar"
    assert ALGORITHMS["sdar"].families == ("sdar",)
    assert sdar_engine.default_block_length == 4            # config.json block_size
    vocab = sdar_engine.tokenizer.get_vocab()
    assert sdar_engine.mask_id == vocab["<|MASK|>"] == 312
    assert sdar_engine.stop_ids == sorted({vocab["<|endoftext|>"], vocab["<|im_end|>"]})


def test_forward_matches_reference_logits(sdar_golden):
    m = load_model(TINY_SDAR, "cpu", "float32")
    ids = torch.tensor([sdar_golden["logits_input"]])
    with torch.inference_mode():
        got = m.logits(m(ids, torch.arange(ids.shape[1])[None]))[0]
    want = torch.tensor(sdar_golden["logits"])
    # float32 to a few dozen ulps: sums in another order (ATen's DEFAULT kernels, MKL's AVX2 ones) moved the largest
    # logits (up to 29) by 1.1-1.5e-5 from the reference's (its AVX-512 run: 1e-6)
    assert ((got - want).abs() <= 1e-5 + 4e-6 * want.abs()).all()


def test_every_golden_case_is_exact_alone_and_batched(sdar_engine, sdar_golden):
    cases = sdar_golden["cases"]
    assert len(cases) == 36
    assert {c["strategy"] for c in cases} == {"low_confidence_dynamic", "low_confidence_static", "sequential"}
    for c in cases:
        r = sdar_engine.generate([Request(c["prompt"], params(c))], early_exit=False)[0]
        assert r.canvas == c["output"] and r.nfe == c["nfe"], c
    together = sdar_engine.generate([Request(c["prompt"], params(c)) for c in cases], early_exit=False)
    for c, r in zip(cases, together):
        assert r.canvas == c["output"] and r.nfe == c["nfe"], c


def test_the_cache_is_exact_and_cheaper_than_recomputing_the_prefix(sdar_engine, sdar_golden):
    """kv_cache false recomputes every earlier block in every forward: the same tokens, more forwarded tokens."""
    for c in sdar_golden["cases"]:
        r = sdar_engine.generate([Request(c["prompt"], params(c, kv_cache=False))], early_exit=False)[0]
        assert r.canvas == c["output"], c
    c = next(x for x in sdar_golden["cases"] if x["strategy"] == "sequential" and "seed" in x and len(x["prompt"]) == 3)
    bl, steps, P, G = c["block"], c["steps"], len(c["prompt"]), c["gen"]
    blocks = -(-(P + G) // bl)
    cached = (P // bl) * bl + sum(bl * (steps + 1) for _ in range(P // bl, blocks))       # windows only
    recomputed = (P // bl) * bl + sum((k + 1) * bl * steps for k in range(P // bl, blocks))
    assert cached < recomputed


def test_early_exit_ends_at_block_boundaries_with_the_same_answer(sdar_engine, sdar_golden):
    stops = set(sdar_engine.stop_ids)
    for c in sdar_golden["cases"]:
        r = sdar_engine.generate([Request(c["prompt"], params(c))])[0]
        ref = c["output"][:c["gen"]]
        cut = next((i for i, t in enumerate(ref) if t in stops), len(ref))
        assert r.token_ids == ref[:cut] and r.nfe <= c["nfe"], c


def test_invalid_probabilities_raise_as_multinomial_does(sdar_engine, monkeypatch):
    """The draws' validity check (multinomial's: no nan, inf or negative probability) is read with the step's canvas
    copy instead of on its own; a nan logit still fails the generation with multinomial's error."""
    real = sdar_engine.model.logits
    monkeypatch.setattr(sdar_engine.model, "logits", lambda h: real(h) * float("nan"))
    p = GenerationParams(gen_length=8, block_length=4, algorithm="sdar", temperature=0.7, seed=1)
    with pytest.raises(RuntimeError, match="probability tensor contains either"):
        sdar_engine.generate([Request([5, 6, 7, 8], p), Request([9, 10], p)])


def test_parameter_errors(sdar_engine):
    def err(**kw):
        with pytest.raises(ParamError) as e:
            sdar_engine.plan([1, 2, 3], GenerationParams(gen_length=8, block_length=4, algorithm="sdar", **kw))
        return e.value.param
    assert err(steps=4) == "steps"
    assert err(factor=1.0) == "factor"
    assert err(extra={"remasking_strategy": "entropy_bounded"}) == "algorithm_params"
    assert err(extra={"top_p": 0}) == "algorithm_params"
    assert err(cfg_scale=1.0) == "cfg_scale"
    with pytest.raises(ParamError, match="maximum context length") as e:      # 505 + 10 in whole blocks: 520
        sdar_engine.plan([1] * 505, GenerationParams(gen_length=10, block_length=8, algorithm="sdar"))
    assert "you requested 520 tokens (505 in the messages, 15 in the completion: max_tokens 10 in whole blocks of " \
           "8 counted from the prompt's first token)" in e.value.message
    pl = sdar_engine.plan([1, 2, 3], GenerationParams(gen_length=2, block_length=4, algorithm="sdar"))
    assert pl.params.threshold == 0.85 and pl.params.extra["denoising_steps"] == 4


def test_cli_generate_reproduces_golden_cases(sdar_golden, tmp_path):
    cases = sdar_golden["cases"]
    lines = [json.dumps({"prompt_ids": c["prompt"], "gen_length": c["gen"], "block_length": c["block"],
                         "temperature": params(c).temperature, "seed": c.get("seed"), "threshold": c.get("threshold"),
                         "algorithm_params": extra(c)}) for c in cases]
    f = tmp_path / "requests.jsonl"
    f.write_text("\n".join(lines) + "\n")
    res = CliRunner().invoke(cli, ["generate", "--model-path", str(TINY_SDAR), "--requests", str(f), "--device",
                                   "cpu", "--no-early-exit"])
    assert res.exit_code == 0, res.output
    got = [json.loads(line) for line in res.stdout.splitlines()]
    assert [g["canvas"] for g in got] == [c["output"] for c in cases]
    assert [g["nfe"] for g in got] == [c["nfe"] for c in cases]


@pytest.mark.slow
def test_worker_and_balancer_serve_the_family(tmp_path, sdar_golden):
    from concurrent.futures import ThreadPoolExecutor
    from tests.helpers import Cluster
    cl = Cluster(tmp_path, TINY_SDAR, n=2)
    try:
        cl.wait_ready()
        assert get_json(cl.workers[0].url + "/health")[1]["family"] == "sdar"
        algos = get_json(cl.url + "/generation/algorithms")[1]
        assert algos["default_algorithm"] == "sdar"

        def body(c):
            return {"prompt": c["prompt"], "max_tokens": c["gen"], "block_length": c["block"], "ignore_eos": True,
                    "temperature": params(c).temperature, "seed": c.get("seed"), "threshold": c.get("threshold"),
                    "algorithm_params": extra(c), "return_token_ids": True}
        cases = sdar_golden["cases"]
        with ThreadPoolExecutor(12) as ex:
            answers = list(ex.map(lambda c: post_json(cl.url + "/v1/completions", body(c)), cases))
        for c, (status, r) in zip(cases, answers):
            assert status == 200 and r["choices"][0]["token_ids"] == c["output"][:c["gen"]], (c, r)
        # no block_length: the checkpoint's block_size (4), not the server's default (32)
        c = cases[1]
        b = {k: v for k, v in body(c).items() if k != "block_length"}
        plain = post_json(cl.url + "/v1/completions", b)[1]["choices"][0]
        four = post_json(cl.url + "/v1/completions", {**b, "block_length": 4})[1]["choices"][0]
        wide = post_json(cl.url + "/v1/completions", {**b, "block_length": 32})[1]["choices"][0]
        assert plain["token_ids"] == four["token_ids"] and plain["nfe"] == four["nfe"] != wide["nfe"]
        status, r = post_json(cl.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                 "max_tokens": 8})
        assert status == 200 and r["model"] == str(TINY_SDAR.resolve())
    finally:
        cl.stop()


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_block_causal_rows_fill_the_context_in_whole_blocks_from_the_prompts_start(family, sdar_engine, llada2_engine):
    """The block-causal algorithms need prompt + max_tokens in whole blocks counted from position 0 (the prompt's last
    partial block and the generation share one); the generic rule (max_tokens in whole blocks of its own after the
    prompt) refused up to a block's worth of the context: 500 + 10 in blocks of 8 (512 positions here, all the
    model has) was a 400 (a review's finding). Such a row runs to its end, and a request without max_tokens gets
    everything that is left (507 + 5 in blocks of 4, where 4 were given)."""
    engine = sdar_engine if family == "sdar" else llada2_engine
    L = engine.max_sequence_length
    assert L == 512
    p = GenerationParams(gen_length=10, block_length=8, algorithm=family, ignore_eos=True)
    r = engine.generate([Request([5 + i % 7 for i in range(500)], p), Request([9, 10, 11], p)])
    assert [len(x.token_ids) for x in r] == [10, 10] and all(engine.mask_id not in x.token_ids for x in r)
    from worker.scheduler import RowScheduler
    from worker.serving import Defaults, Serving
    import asyncio
    serving = Serving(engine, RowScheduler(engine, loop=asyncio.new_event_loop()), family,
                      Defaults(max_tokens=64, algorithm=family, block_length=4))
    prep = serving.prepare("completion", {"prompt": [5] * 507})
    assert prep.plans[0].gen_length == 5
