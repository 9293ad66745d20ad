"""prefix_cache and dual_cache (worker/engine/algorithms/cached.py): Fast-dLLM's cached loops against the reference
goldens (tests/fixtures/tiny-llada-golden.json), alone and batched, with the forwards they save."""
from tests.test_algorithms import CACHE_ALGOS, golden_cases, params_of
from worker.engine import GenerationParams, Request


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

def test_caches_save_forwards_and_dinfer_commits_in_parallel(llada_engine, llada_golden):
    c = golden_cases(llada_golden, ("dual_cache",))[0]
    fixed = llada_engine.generate([Request(c["prompt"], GenerationParams(
        gen_length=32, block_length=8, steps=32, algorithm="dual_cache"))], early_exit=False)[0]
    assert fixed.nfe == 32
    fast = llada_engine.generate([Request(c["prompt"], GenerationParams(
        gen_length=32, block_length=8, algorithm="dinfer_blockwise", threshold=0.5))], early_exit=False)[0]
    assert fast.nfe < 32 and 292 not in fast.canvas
