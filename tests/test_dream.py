"""Dream beside LLaDA and Nemotron: the native model against the reference logits, the dream sampler against every
golden case of Fast-dLLM's dream/model/generation_utils.py (alone, batched with mixed lengths and parameters, through
`dllm-serve generate` and through a worker), the tokenizer without remote code, detection and parameter checks."""
import json

import pytest
import torch
from click.testing import CliRunner

from dllm_serve.cli import main as cli
from tests.conftest import TINY_DREAM, TINY_LLADA, TINY_NEMOTRON
from tests.helpers import get_json, post_json
from worker.engine import ALGORITHMS, GenerationParams, ParamError, Request
from worker.models import FAMILIES, detect_family, load_model

EXTRA = ("alg", "alg_temp", "top_p", "top_k")


def whole(golden):
    return [c for c in golden["cases"] if c["reference"] == "generation_utils.diffusion_generate"]


def params(c, **kw):
    return GenerationParams(gen_length=c["gen"], steps=c["steps"], algorithm="dream",
                            temperature=c.get("temperature", 0.0), seed=c.get("seed"),
                            extra={k: c[k] for k in EXTRA if c.get(k) is not None}, **kw)


def test_family_detection_and_registry():
    assert detect_family(TINY_DREAM) == "dream"
    assert detect_family(TINY_LLADA) == "llada" and detect_family(TINY_NEMOTRON) == "nemotron"
    f = FAMILIES["dream"]
    assert f.default_algorithm == "dream" and not f.scoring
    assert ALGORITHMS["dream"].families == ("dream",)


def test_forward_matches_reference_logits(dream_golden):
    m = load_model(TINY_DREAM, "cpu", "float32")
    ids = torch.tensor([dream_golden["logits_input"]])
    with torch.inference_mode():
        got = m.logits(m(ids, torch.arange(ids.shape[1])[None]))[0]
    want = torch.tensor(dream_golden["logits"])
    # float32 to a few dozen ulps: sums in another order (ATen's DEFAULT kernels, MKL's AVX2 ones) moved the largest
    # logits (up to 29) by 1.1-1.5e-5 from the reference's (its AVX-512 run: 1e-6)
    assert ((got - want).abs() <= 1e-5 + 4e-6 * want.abs()).all()


def test_every_golden_case_is_exact_alone(dream_engine, dream_golden):
    cases = whole(dream_golden)
    assert len(cases) == 56 and {c["alg"] for c in cases} == {"origin", "maskgit_plus", "topk_margin", "entropy"}
    for c in cases:
        r = dream_engine.generate([Request(c["prompt"], params(c))], early_exit=False)[0]
        assert r.canvas == c["output"] and r.nfe == c["nfe"], c


def test_batched_with_mixed_lengths_and_parameters(dream_engine, dream_golden):
    """Every case in one batch: prompts of 3 to 12 tokens, 16 to 32 new tokens, 8 to 24 steps, four algs, seeded
    rows (each draws from its own generator, so it matches the reference run alone after torch.manual_seed)."""
    cases = whole(dream_golden)
    together = dream_engine.generate([Request(c["prompt"], params(c)) for c in cases], early_exit=False)
    for c, r in zip(cases, together):
        assert r.canvas == c["output"] and r.nfe == c["nfe"], c
    # and in another order, with a LLaDA-only parameter set elsewhere failing nothing
    rev = dream_engine.generate([Request(c["prompt"], params(c)) for c in reversed(cases)], early_exit=False)
    assert [r.canvas for r in rev] == [c["output"] for c in reversed(cases)]


def test_early_exit_gives_the_same_answer_with_less_work(dream_engine, dream_golden):
    stops = set(dream_engine.stop_ids)
    for c in whole(dream_golden)[:20]:
        r = dream_engine.generate([Request(c["prompt"], params(c))])[0]
        cut = next((i for i, t in enumerate(c["output"]) if t in stops), len(c["output"]))
        assert r.token_ids == c["output"][:cut] and r.nfe <= c["nfe"]


def test_unseeded_random_rows_get_a_seed_and_seeds_reproduce(dream_engine, dream_golden):
    prompt = dream_golden["cases"][0]["prompt"]
    p = GenerationParams(gen_length=16, steps=8, algorithm="dream", temperature=1.5, extra={"alg": "origin"})
    a = dream_engine.generate([Request(prompt, p) for _ in range(4)], early_exit=False)
    assert len({tuple(r.canvas) for r in a}) > 1          # unseeded rows draw differently
    s = GenerationParams(gen_length=16, steps=8, algorithm="dream", temperature=1.5, seed=9, extra={"alg": "origin"})
    b = dream_engine.generate([Request(prompt, s), Request([1, 2, 3, 4], p), Request(prompt, s)], early_exit=False)
    assert b[0].canvas == b[2].canvas


def test_parameter_errors_name_the_parameter(dream_engine):
    def err(**kw):
        extra = kw.pop("extra", {})
        with pytest.raises(ParamError) as e:
            dream_engine.plan([1, 2, 3], GenerationParams(gen_length=8, algorithm="dream", extra=extra, **kw))
        return e.value
    assert err(extra={"alg": "greedy"}).param == "algorithm_params"
    assert "one of origin, maskgit_plus" in err(extra={"alg": "greedy"}).message
    assert err(extra={"top_p": 1.5}).param == "algorithm_params"
    assert err(extra={"top_k": 0}).param == "algorithm_params"
    assert err(extra={"eps": 0}).param == "algorithm_params"
    assert err(extra={"block_size": 4}).param == "algorithm_params"
    assert err(threshold=0.9).param == "threshold"
    assert err(cfg_scale=1.0).param == "cfg_scale"
    assert err(remasking="random").param == "remasking"
    with pytest.raises(ParamError, match="generation_algorithm"):
        dream_engine.plan([1, 2, 3], GenerationParams(gen_length=8, algorithm="basic"))
    # steps are not capped at the generation length, and blocks do not apply
    pl = dream_engine.plan([1, 2, 3], GenerationParams(gen_length=8, steps=24, algorithm="dream"))
    assert pl.params.steps == 24 and pl.block_length == 8 and pl.canvas_length == 8


def test_tokenizer_without_remote_code(dream_engine):
    """tokenizer_config.json names tokenization_dream.DreamTokenizer (remote code); it is Qwen2's byte-level BPE,
    loaded as transformers' Qwen2Tokenizer (ids checked against DreamTokenizer itself: tests/fixtures/README.md)."""
    tok = dream_engine.tokenizer
    vocab = tok.get_vocab()
    assert dream_engine.mask_id == vocab["<|mask|>"] == 290
    assert dream_engine.stop_ids == sorted({vocab["<|endoftext|>"], vocab["<|im_end|>"]}) == [286, 288]
    assert tok("hello the world").input_ids == [257, 280, 111, 258, 266, 278, 108, 100]
    from worker.tokenizer import apply_chat_template
    ids = apply_chat_template(tok, [{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi"
                               "<|im_end|>\n<|im_start|>assistant\n")


def test_cli_generate_reproduces_golden_cases(dream_golden, tmp_path):
    cases = whole(dream_golden)
    lines = [json.dumps({"prompt_ids": c["prompt"], "gen_length": c["gen"], "steps": c["steps"],
                         "temperature": c.get("temperature", 0.0), "seed": c.get("seed"),
                         "algorithm_params": {k: c[k] for k in EXTRA if c.get(k) is not None}}) for c in cases]
    f = tmp_path / "requests.jsonl"
    f.write_text("\n".join(lines) + "\n")
    res = CliRunner().invoke(cli, ["generate", "--model-path", str(TINY_DREAM), "--requests", str(f), "--device",
                                   "cpu", "--no-early-exit"])
    assert res.exit_code == 0, res.output
    got = [json.loads(line) for line in res.stdout.splitlines()]
    assert [g["canvas"] for g in got] == [c["output"] for c in cases]
    assert [g["nfe"] for g in got] == [c["nfe"] for c in cases]


def cached(golden):
    return [c for c in golden["cases"] if c["reference"] == "generation_utils_block.diffusion_generate"]


def cache_params(c, **kw):
    return GenerationParams(gen_length=c["gen"], block_length=c["block"], steps=c["steps"],
                            algorithm="dream_dual_cache" if c["dual_cache"] else "dream_cache",
                            threshold=c.get("threshold") if c["alg"] == "confidence_threshold" else None, **kw)


def test_fast_dllm_dream_caches_are_exact_alone_and_batched(dream_engine, dream_golden):
    cases = cached(dream_golden)
    assert len(cases) == 20 and {c["dual_cache"] for c in cases} == {True, False}
    for c in cases:
        r = dream_engine.generate([Request(c["prompt"], cache_params(c))], early_exit=False)[0]
        assert r.canvas == c["output"] and r.nfe == c["nfe"], c
    # batched with each other and with whole-sequence dream rows (grouped by algorithm inside one engine batch)
    mixed = cases + whole(dream_golden)[:8]
    reqs = [Request(c["prompt"], cache_params(c) if "block" in c else params(c)) for c in mixed]
    for c, r in zip(mixed, dream_engine.generate(reqs, early_exit=False)):
        assert r.canvas == c["output"] and r.nfe == c["nfe"], c


def test_caches_take_fewer_forward_tokens_than_the_whole_sequence(dream_engine, dream_golden):
    """The threshold caches decode the same prompts with far fewer forwards than one-per-token, and their cached
    steps forward a window, not the row (the token counts of the forwards are what a GPU pays for)."""
    c = next(x for x in cached(dream_golden) if x["dual_cache"] and x["alg"] == "confidence_threshold")
    r = dream_engine.generate([Request(c["prompt"], cache_params(c))], early_exit=False)[0]
    blocks = c["gen"] // c["block"]
    full_tokens = blocks * (len(c["prompt"]) + c["gen"])
    window_tokens = (r.nfe - blocks) * c["block"]
    assert r.nfe < c["gen"] and full_tokens + window_tokens < c["gen"] * (len(c["prompt"]) + c["gen"]) / 2


def test_cache_early_exit_and_parameter_errors(dream_engine, dream_golden):
    stops = set(dream_engine.stop_ids)
    for c in cached(dream_golden):
        r = dream_engine.generate([Request(c["prompt"], cache_params(c))])[0]
        cut = next((i for i, t in enumerate(c["output"]) if t in stops), len(c["output"]))
        assert r.token_ids == c["output"][:cut] and r.nfe <= c["nfe"]
    for kw, param in (({"factor": 2.0}, "factor"), ({"remasking": "random"}, "remasking"),
                      ({"extra": {"alg": "entropy"}}, "algorithm_params"), ({"cfg_scale": 1.0}, "cfg_scale")):
        with pytest.raises(ParamError) as e:
            dream_engine.plan([1, 2], GenerationParams(gen_length=8, algorithm="dream_cache", **kw))
        assert e.value.param == param


@pytest.mark.slow
def test_worker_and_balancer_serve_the_family(tmp_path, dream_golden):
    """Two workers on tiny-dream behind the balancer: every golden case (both references) sent at once through the
    balancer's /v1/completions, so rows with different algorithms and parameters share batches."""
    from concurrent.futures import ThreadPoolExecutor
    from tests.helpers import Cluster
    cl = Cluster(tmp_path, TINY_DREAM, n=2)
    try:
        cl.wait_ready()
        w = cl.workers[0]
        models = get_json(w.url + "/v1/models")[1]["data"][0]
        assert models["family"] == "dream" and get_json(cl.url + "/health")[1]["healthy_workers"] == 2
        algos = get_json(cl.url + "/generation/algorithms")[1]
        assert algos["default_algorithm"] == "dream"
        assert {"dream", "dream_cache", "dream_dual_cache"} <= {a["name"] for a in algos["algorithms"]}

        def body(c):
            b = {"prompt": c["prompt"], "max_tokens": c["gen"], "steps": c["steps"], "return_token_ids": True,
                 "ignore_eos": True, "seed": c.get("seed"), "temperature": c.get("temperature", 0.0)}
            if "block" in c:
                b.update(block_length=c["block"], generation_algorithm="dream_dual_cache" if c["dual_cache"]
                         else "dream_cache", threshold=c.get("threshold") if c["alg"] == "confidence_threshold"
                         else None)
            else:
                b.update(generation_algorithm="dream",
                         algorithm_params={k: c[k] for k in EXTRA if c.get(k) is not None})
                if c["steps"] % 2:           # half of them send top_p / top_k at the top level, as OpenAI / vLLM
                    b.update({k: b["algorithm_params"].pop(k) for k in ("top_p", "top_k")
                              if k in b["algorithm_params"]})
            return b
        cases = dream_golden["cases"]
        with ThreadPoolExecutor(16) as ex:
            answers = list(ex.map(lambda c: post_json(cl.url + "/v1/completions", body(c)), cases))
        for c, (status, r) in zip(cases, answers):
            assert status == 200 and r["choices"][0]["token_ids"] == c["output"], (c, r)
        status, r = post_json(cl.url + "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 16})
        assert status == 200 and r["model"] == str(TINY_DREAM.resolve())
        status, r = post_json(cl.url + "/v1/completions", {"prompt": "hi", "max_tokens": 4,
                                                           "algorithm_params": {"alg": "nope"}})
        assert status == 400 and r["error"]["param"] == "algorithm_params"
        status, r = post_json(cl.url + "/v1/completions", {"prompt": "hi", "max_tokens": 0, "echo": True,
                                                           "logprobs": 1})
        assert status == 400 and "dream" in r["error"]["message"]
    finally:
        cl.stop()


def test_top_level_top_p_and_top_k_are_dreams_own(dream_engine, dream_golden):
    """OpenAI's ``top_p`` and vLLM's ``top_k`` at the top level of a body are Dream's own parameters: every golden
    case that sets them, sent that way, gives the reference's tokens (greedy ones too: Dream's reference filters
    before its confidences at temperature 0 as well). The same value in ``algorithm_params`` too is fine; another
    one is a 400 naming the field."""
    cases = [c for c in whole(dream_golden) if c.get("top_p") is not None or c.get("top_k") is not None]
    assert len(cases) == 16 and any(not c.get("temperature") and c.get("top_p") for c in cases)
    for c in cases:
        filters = {k: c[k] for k in ("top_p", "top_k") if c.get(k) is not None}
        p = GenerationParams(gen_length=c["gen"], steps=c["steps"], algorithm="dream",
                             temperature=c.get("temperature", 0.0), seed=c.get("seed"),
                             extra={k: c[k] for k in ("alg", "alg_temp") if c.get(k) is not None}, filters=filters)
        r = dream_engine.generate([Request(c["prompt"], p)], early_exit=False)[0]
        assert r.canvas == c["output"] and r.nfe == c["nfe"], c
        assert dream_engine.plan(c["prompt"], p) == dream_engine.plan(c["prompt"], params(c))
    p = GenerationParams(gen_length=8, steps=8, algorithm="dream", extra={"top_p": 0.9}, filters={"top_p": 0.9})
    assert dream_engine.plan([5, 6], p).params.extra["top_p"] == 0.9
    with pytest.raises(ParamError) as e:
        dream_engine.plan([5, 6], GenerationParams(gen_length=8, steps=8, algorithm="dream", extra={"top_p": 0.8},
                                                   filters={"top_p": 0.9}))
    assert e.value.param == "top_p" and "algorithm_params" in e.value.message
    with pytest.raises(ParamError) as e:        # no min_p in Dream's reference: refused when sampling
        dream_engine.plan([5, 6], GenerationParams(gen_length=8, steps=8, algorithm="dream", temperature=0.5,
                                                   filters={"min_p": 0.1}))
    assert e.value.param == "min_p"


def test_the_schedules_transfer_counts_computed_on_the_host_are_the_references():
    """``int(m * (1 - t[i+1] / t[i]))`` is computed on the host from ratios read once per row (a read per step and
    row would each wait for a GPU): it must equal the reference's float32 tensor arithmetic for every count."""
    from worker.engine.algorithms.dream import ratios, transfer_count
    from worker.engine.params import GenerationParams
    counts = torch.arange(0, 4097)
    for total in (2, 3, 7, 16, 100, 256, 999):
        for eps in (1e-3, 0.1, 0.5):
            t = torch.linspace(1, eps, total + 1)
            got = ratios(GenerationParams(extra={"eps": eps}), total, "cpu")
            for i in sorted({0, 1, total // 2, total - 2}):
                want = (counts / 1 * (1 - t[i + 1] / t[i])).long().tolist()      # the reference's, per count
                assert [transfer_count(m, got[i], False) for m in range(4097)] == want, (total, eps, i)
    assert transfer_count(37, 0.25, True) == 37


def test_rows_decided_together_match_each_row_alone():
    """dream.decide_together (every row's step in a few whole-batch operations) writes what decide / the Dream
    caches' threshold rule write row by row: schedule counts and thresholds, three confidence kinds, top_k / top_p
    groups, rows of different vector lengths, logits full of ties, and rows drawing at a temperature, each from its
    own generator (the same draws as its own multinomial)."""
    from worker.engine.algorithms.dream import Choice, decide, decide_together, transfer_count
    from worker.engine.algorithms.dream_cache import threshold_step
    g = torch.Generator().manual_seed(5)
    V = 6
    for trial in range(40):
        rows, choices, pieces, rowid, local = [], [], [], [], []
        at = 0
        for b in range(int(torch.randint(1, 7, (1,), generator=g))):
            length = int(torch.randint(3, 10, (1,), generator=g))
            m = int(torch.randint(1, length + 1, (1,), generator=g))
            where = torch.randperm(length, generator=g)[:m].sort().values
            lg = torch.randint(0, 3, (m, V), generator=g).float()          # few distinct values: ties everywhere
            alg = ["maskgit_plus", "topk_margin", "entropy"][trial % 3]
            extra = {"alg": alg, "alg_temp": 0.0, "top_p": [None, 0.7][b % 2], "top_k": [None, 3][trial % 2],
                     "eps": 1e-3}
            temperature = [0.0, 0.7, 1.0][(trial // 3) % 3]      # a trial's rows share it: groups of several
            p = GenerationParams(gen_length=8, algorithm="dream", extra=extra, temperature=temperature)
            thr = [None, 0.3, 0.95][(trial + b) % 3]
            seed = int(torch.randint(0, 1 << 30, (1,), generator=g))
            ratio, last = [0.25, 0.5, 0.125][b % 3], (trial + b) % 5 == 0
            conf = {"maskgit_plus": "probability", "topk_margin": "margin", "entropy": "neg_entropy"}[alg]
            n = m if thr is not None else transfer_count(m, ratio, last)
            base = int(torch.randint(0, 4, (1,), generator=g))
            choices.append(Choice(b, b, at, at + m, length, base, n, thr, "probability" if thr else conf,
                                  GenerationParams(gen_length=8, algorithm="dream", extra=extra, threshold=thr,
                                                   temperature=temperature),
                                  torch.Generator().manual_seed(seed)))
            rows.append((p, lg, where, length, ratio, last, alg, thr, base, seed))
            pieces.append(lg)
            rowid += [b] * m
            local += where.tolist()
            at += m
        x = torch.full((len(rows), 16), -7, dtype=torch.long)
        alone = x.clone()
        for b, (p, lg, where, length, ratio, last, alg, thr, base, seed) in enumerate(rows):
            own = torch.Generator().manual_seed(seed)
            if thr is None:
                pick, tok = decide(p, own, lg, where, length, ratio, last, alg)
            else:
                pick, tok = threshold_step(GenerationParams(gen_length=8, algorithm="dream", extra=p.extra,
                                                            threshold=thr, temperature=p.temperature), own, lg,
                                           where, length)
            alone[b, pick + base] = tok
        decide_together(choices, torch.cat(pieces), torch.tensor(rowid), torch.tensor(local), x)
        assert torch.equal(x, alone), trial
