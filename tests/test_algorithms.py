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


@pytest.mark.parametrize("params, param", [
    (dict(algorithm="dual_cache", cfg_scale=1.0), "cfg_scale"),
    (dict(algorithm="dinfer_credit", extra={"bogus": 1}), "algorithm_params"),
    (dict(algorithm="dinfer_hierarchy", extra={"low_threshold": -1}), "algorithm_params"),
    (dict(algorithm="dinfer_blockwise", extra={"prefix_look": 1.5}), "algorithm_params"),
    (dict(algorithm="dinfer_blockwise", factor=1.0), "factor"),      # no factor rule: was a 500 at the first step
    (dict(algorithm="dinfer_credit", factor=1.0), "factor"),
    (dict(algorithm="dinfer_hierarchy", factor=1.0), "factor"),    # (was silently ignored)
    # credit that grows (decay above 1) or a weight past float32: infinities, and answers of mask tokens with a 200
    (dict(algorithm="dinfer_credit", extra={"decay_beta": 2}), "algorithm_params"),
    (dict(algorithm="dinfer_credit", extra={"credit_alpha": 1e308}), "algorithm_params"),
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


def test_every_family_lists_registered_algorithms_its_default_first():
    from worker.engine.algorithms import REGISTRY
    from worker.models import FAMILIES
    for name, fam in FAMILIES.items():
        assert fam.algorithms and fam.algorithms[0] == fam.default_algorithm, name
        assert set(fam.algorithms) <= set(REGISTRY), name
        assert all(name in REGISTRY[a].families for a in fam.algorithms)
    assert all(a.families for a in REGISTRY.values())          # no algorithm without a family


def test_every_algorithm_of_the_dual_cache_loop_has_its_variant():
    """The dual-cache loop (cached.run_dual) decides each row by its algorithm's Variant: an algorithm registered
    with ``forward="dual_cache"`` but no variant would fail inside the device loop."""
    from worker.engine.algorithms import REGISTRY
    from worker.engine.algorithms.cached import DUAL_VARIANTS, run_dual
    shared = {n for n, a in REGISTRY.items() if a.forward == "dual_cache" or a.run is run_dual}
    assert shared == set(DUAL_VARIANTS) >= {"dual_cache", "dinfer_blockwise", "dinfer_hierarchy", "dinfer_credit"}


@pytest.mark.parametrize("names, fixture", [(("dinfer_blockwise", "dinfer_hierarchy", "dinfer_credit"), "llada_engine"),
                                            (("dual_cache", "dinfer_blockwise", "dinfer_credit"), "llada_engine"),
                                            (("llada2", "llada21"), "llada2_engine")])
def test_algorithms_sharing_a_forward_take_one_forward_a_round(names, fixture, request):
    """Rows of algorithms that name the same forward step (Algorithm.forward) run in one group: the model's forwards
    of a round serve all of them (not one per algorithm), each row with its own rule, its tokens and nfe those it has
    alone. (The cached loops' rows at different phases of their blocks may take an extra forward in a round: the
    merged group takes a few more forwards than its longest algorithm alone, far fewer than the algorithms apart.)"""
    engine = request.getfixturevalue(fixture)
    from worker.engine.algorithms import REGISTRY
    assert len({REGISTRY[n].group for n in names}) == 1
    block = 4 if fixture == "llada2_engine" else 8
    reqs = [Request([5 + i, 6, 7, 8, 9][: 3 + i % 3], GenerationParams(gen_length=16, block_length=block,
                                                                       algorithm=names[i % len(names)], threshold=0.9))
            for i in range(6)]
    alone = [engine.generate([r])[0] for r in reqs]

    def forwards(batch):
        calls = []
        hook = engine.model.register_forward_hook(lambda *a: calls.append(1))
        try:
            return engine.generate(batch), len(calls)
        finally:
            hook.remove()
    together, shared = forwards(reqs)
    apart = [forwards([r for r in reqs if r.params.algorithm == n])[1] for n in names]   # each algorithm's batch
    assert [(r.token_ids, r.nfe) for r in together] == [(r.token_ids, r.nfe) for r in alone]
    # dInfer: 19 against 16 + 17 + 16; dual_cache with two of them: 16 against 16 + 16 + 16; LLaDA2: 22 against 12 + 22
    assert max(apart) <= shared < sum(apart)


def test_a_temperature_below_the_sampling_epsilon_is_greedy(llada2_engine, dream_engine, sdar_engine):
    """1e-300 divided float32 logits into inf and nan (a 500 for the whole batch): below 1e-5 (vLLM's epsilon) a
    temperature is greedy, the same tokens as temperature 0."""
    for engine, alg in ((llada2_engine, "llada2"), (dream_engine, "dream"), (sdar_engine, "sdar")):
        ids = [5, 6, 7, 8]
        kw = dict(gen_length=8, block_length=4, algorithm=alg)
        greedy = engine.generate([Request(ids, GenerationParams(**kw))])[0]
        tiny = engine.generate([Request(ids, GenerationParams(**kw, temperature=1e-300, seed=1))])[0]
        assert tiny.token_ids == greedy.token_ids and tiny.nfe == greedy.nfe
        assert engine.plan(ids, GenerationParams(**kw, temperature=1e-6)).params.temperature == 0.0
        assert engine.plan(ids, GenerationParams(**kw, temperature=1e-5)).params.temperature == 1e-5


def test_dream_alg_temp_never_commits_an_unmasked_position(dream_engine):
    """A small alg_temp leaves fewer positions than a step commits with any probability: drawing without
    replacement then took unmasked ones (token -1: a 500, or an embedding out of range). Its limit, the top ones,
    is taken instead; alg_temp is bounded."""
    for alg in ("dream", "dream_cache", "dream_dual_cache"):
        for alg_temp in (1e-3, 1e-30):
            r = dream_engine.generate([Request([5, 6], GenerationParams(
                gen_length=16, block_length=4, steps=4, algorithm=alg, seed=1, extra={"alg_temp": alg_temp}))])[0]
            assert len(r.token_ids) <= 16 and all(0 <= t < len(dream_engine.tokenizer) for t in r.token_ids)
        with pytest.raises(ParamError) as e:
            dream_engine.plan([5, 6], GenerationParams(gen_length=8, algorithm=alg, extra={"alg_temp": 1e300}))
        assert e.value.param == "algorithm_params"


def test_llada21_num_to_transfer_is_at_most_the_block(llada2_engine):
    with pytest.raises(ParamError) as e:
        llada2_engine.plan([5, 6], GenerationParams(gen_length=8, block_length=32, algorithm="llada21",
                                                    extra={"num_to_transfer": 33}))
    assert e.value.param == "algorithm_params" and "block_length" in e.value.message


def test_a_top_k_past_the_vocabulary_keeps_every_token(llada2_engine, sdar_engine):
    """top_k 1,000 on a 295-token vocabulary was a 500 for the whole batch (topk's k out of range); it filters
    nothing, as top_k 0 does."""
    for engine, alg, extra in ((llada2_engine, "llada2", {}), (llada2_engine, "llada21", {}),
                               (sdar_engine, "sdar", {"remasking_strategy": "low_confidence_static"})):
        kw = dict(gen_length=8, block_length=4, algorithm=alg, temperature=1.0, seed=3)
        off = engine.generate([Request([5, 6], GenerationParams(**kw, extra={**extra, "top_k": 0}))])[0]
        wide = engine.generate([Request([5, 6], GenerationParams(**kw, extra={**extra, "top_k": 1000}))])[0]
        assert wide.token_ids == off.token_ids and wide.nfe == off.nfe
