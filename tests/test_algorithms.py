"""Acceleration algorithms: Fast-dLLM caches and parallel decoding against the reference outputs, dInfer strategies,
and the batched-equals-single property for every algorithm."""
import random

import pytest

from worker.engine import ALGORITHMS, GenerationParams, ParamError, Request

CACHE_ALGOS = ("prefix_cache", "dual_cache")
ALL = ("basic", "prefix_cache", "dual_cache", "dinfer_blockwise", "dinfer_hierarchy", "dinfer_credit")


def golden_cases(golden, algos):
    return [c for c in golden["cases"] if c["algorithm"] in algos]


def params_of(c, **kw):
    return GenerationParams(gen_length=c["gen_length"], block_length=c["block_length"], steps=c["steps"],
                            algorithm=c["algorithm"], threshold=c.get("threshold"), **kw)


def test_every_cache_golden_case_is_exact_with_the_same_nfe(llada_engine, llada_golden):
    cases = golden_cases(llada_golden, CACHE_ALGOS)
    assert len(cases) == 16 and any(c.get("threshold") for c in cases)
    for c in cases:
        r = llada_engine.generate([Request(c["prompt"], params_of(c))], early_exit=False)[0]
        assert r.canvas == c["output"], c
        assert r.nfe == c["nfe"], c


def test_cache_golden_cases_batched_equal_single(llada_engine, llada_golden):
    reqs = [Request(c["prompt"], params_of(c)) for c in golden_cases(llada_golden, CACHE_ALGOS)]
    together = llada_engine.generate(reqs, early_exit=False)
    for c, r in zip(golden_cases(llada_golden, CACHE_ALGOS), together):
        assert r.canvas == c["output"] and r.nfe == c["nfe"]


def _mixed(n=30, seed=0):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        alg = ALL[i % len(ALL)]
        extra = {}
        if alg.startswith("dinfer") and rng.random() < 0.5:
            extra = {"prefix_look": rng.choice([0, 2]), "after_look": rng.choice([0, 3]),
                     "warmup_steps": rng.choice([1, 2])}
        if alg == "dinfer_hierarchy" and rng.random() < 0.5:
            extra["low_threshold"] = 0.2
        rule = rng.choice(["fixed", "threshold", "factor"]) if not alg.startswith("dinfer") else "threshold"
        p = GenerationParams(
            gen_length=rng.choice([6, 8, 16, 24]), block_length=rng.choice([4, 8]), steps=rng.choice([None, 6]),
            algorithm=alg, temperature=rng.choice([0.0, 0.0, 0.9]), seed=100 + i,
            remasking="random" if alg == "basic" and i % 4 == 0 else "low_confidence",
            threshold=rng.choice([0.5, 0.8]) if rule == "threshold" else None,
            factor=1.0 if rule == "factor" else None,
            cfg_scale=0.5 if alg == "basic" and i % 5 == 0 else 0.0, extra=extra)
        reqs.append(Request([rng.randrange(0, 287) for _ in range(rng.randrange(1, 14))], p))
    return reqs


@pytest.mark.parametrize("early_exit", [True, False])
def test_every_algorithm_batched_equals_single(llada_engine, early_exit):
    reqs = _mixed()
    assert {r.params.algorithm for r in reqs} == set(ALL)
    alone = [llada_engine.generate([r], early_exit=early_exit)[0] for r in reqs]
    order = list(range(len(reqs)))
    random.Random(3).shuffle(order)
    together = llada_engine.generate([reqs[i] for i in order], early_exit=early_exit)
    for j, i in enumerate(order):
        assert together[j].token_ids == alone[i].token_ids, reqs[i]
        assert together[j].nfe == alone[i].nfe, reqs[i]


def test_per_request_threshold_is_honoured_in_one_batch(llada_engine, llada_golden):
    c = golden_cases(llada_golden, ("dual_cache",))[0]
    reqs = [Request(c["prompt"], GenerationParams(gen_length=32, block_length=8, algorithm=alg, threshold=t))
            for alg in ("dual_cache", "dinfer_blockwise", "dinfer_credit", "dinfer_hierarchy") for t in (0.3, 0.99)]
    res = llada_engine.generate(reqs, early_exit=False)
    for lo, hi in zip(res[::2], res[1::2]):
        assert lo.nfe < hi.nfe          # a lower threshold commits more per step: fewer forwards
        assert lo.nfe < 32 and hi.nfe <= 32 * 4


def test_caches_save_forwards_and_dinfer_commits_in_parallel(llada_engine, llada_golden):
    c = golden_cases(llada_golden, ("dual_cache",))[0]
    fixed = llada_engine.generate([Request(c["prompt"], GenerationParams(
        gen_length=32, block_length=8, steps=32, algorithm="dual_cache"))], early_exit=False)[0]
    assert fixed.nfe == 32
    fast = llada_engine.generate([Request(c["prompt"], GenerationParams(
        gen_length=32, block_length=8, algorithm="dinfer_blockwise", threshold=0.5))], early_exit=False)[0]
    assert fast.nfe < 32 and 292 not in fast.canvas


def test_vicinity_refresh_and_warmup_change_the_work_done(llada_engine, llada_golden):
    c = golden_cases(llada_golden, ("dual_cache",))[1]
    forwarded = []      # tokens per forward pass
    hook = llada_engine.model.register_forward_pre_hook(lambda m, args: forwarded.append(args[0].numel()))

    def run(**extra):
        forwarded.clear()
        r = llada_engine.generate([Request(c["prompt"], GenerationParams(
            gen_length=32, block_length=8, algorithm="dinfer_blockwise", threshold=0.99, extra=extra))],
            early_exit=False)[0]
        return r, list(forwarded)
    try:
        (plain, plain_fw), (look, look_fw) = run(), run(prefix_look=4, after_look=4)
        (warm, warm_fw), (no_cache, no_cache_fw) = run(warmup_steps=8), run(warmup_steps=1000)
    finally:
        hook.remove()
    full = len(c["prompt"]) + 32
    # plain dual cache: one full forward per block, then block-only windows (8 tokens)
    assert sorted(set(plain_fw)) == [8, full] and plain_fw.count(full) == 4
    # the vicinity refresh widens every cached window by 4 + 4 (clipped at the canvas end for the last block)
    assert look_fw.count(full) == 4 and set(look_fw) - {full} <= {16, 12} and 16 in look_fw
    assert sum(look_fw) > sum(plain_fw)
    # warm-up for the whole block (8 steps of 8 tokens) = full forwards every step = the cache never used
    assert set(warm_fw) == {full} and set(no_cache_fw) == {full}
    assert (warm.canvas, warm.nfe) == (no_cache.canvas, no_cache.nfe) and warm.nfe == len(warm_fw)


@pytest.mark.parametrize("params, param", [
    (dict(algorithm="dual_cache", cfg_scale=1.0), "cfg_scale"),
    (dict(algorithm="dinfer_credit", extra={"bogus": 1}), "algorithm_params"),
    (dict(algorithm="dinfer_hierarchy", extra={"low_threshold": -1}), "algorithm_params"),
    (dict(algorithm="dinfer_blockwise", extra={"prefix_look": 1.5}), "algorithm_params"),
])
def test_algorithm_parameter_errors(llada_engine, params, param):
    with pytest.raises(ParamError) as e:
        llada_engine.plan([1, 2, 3], GenerationParams(**params))
    assert e.value.param == param


def test_registry_describes_every_algorithm():
    assert set(ALGORITHMS) >= set(ALL)
    d = {n: a.describe() for n, a in ALGORITHMS.items()}
    assert d["basic"]["exact"] and d["prefix_cache"]["exact"] and d["dual_cache"]["exact"]
    assert not d["dinfer_blockwise"]["exact"]
    assert d["dinfer_blockwise"]["parameters"]["threshold"]["default"] == 0.9
    assert d["dinfer_hierarchy"]["algorithm_params"]["low_threshold"]["default"] == 0.4
    assert d["dual_cache"]["cfg_scale_supported"] is False
