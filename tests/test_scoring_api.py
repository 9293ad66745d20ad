"""Likelihood scoring through /v1/completions (echo + logprobs + max_tokens 0/1), as lm-eval's local-completions
sends loglikelihood requests, checked against the reference goldens (tests/fixtures/tiny-llada-likelihood-golden.json,
made by ML-GSAI/LLaDA's code; settings in tests/fixtures/README.md). lm-eval's own parsing is reproduced below
(lm_eval/models/openai_completions.py, LocalCompletionsAPI.parse_logprobs, 0.4.x): the sum of token_logprobs over
[ctxlen:-1] and is_greedy from top_logprobs."""
import json

import openai
import pytest

from tests.conftest import TINY_NEMOTRON, fixture_path
from tests.test_worker_app import ready_client, wait_ready
from worker.app import WorkerConfig, make_app

GOLDEN = json.loads(fixture_path("tiny-llada-likelihood-golden.json").read_text())
CASES = GOLDEN["cases"]


def lm_eval_parse(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """What lm-eval does with a choice (parse_logprobs)."""
    lp = choice["logprobs"]
    tokens_logprobs = lp["token_logprobs"][ctxlen:-1]
    top_logprobs = lp["top_logprobs"][ctxlen:-1]
    is_greedy = True
    for tok, top in zip(tokens_logprobs, top_logprobs):
        if tok != max(top.values()):
            is_greedy = False
            break
    return sum(tokens_logprobs), is_greedy


def lm_eval_body(case: dict, **extra) -> dict:
    """The body lm-eval's local-completions sends for a loglikelihood request (_create_payload, generate=False),
    with the golden's Monte Carlo settings as our extension fields."""
    return {"model": "tiny-llada", "prompt": case["prefix"] + case["target"], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": case["seed"], "echo": True, "mc_num": case["mc_num"],
            "mc_batch_size": case["batch_size"], "cfg_scale": case["cfg_scale"], **extra}


@pytest.mark.parametrize("mode", ["window", "context_length"])
async def test_lm_eval_shaped_requests_match_the_reference(aiohttp_client, mode):
    client, _ = await ready_client(aiohttp_client)
    for case in CASES:
        extra = {"context_length": len(case["prefix"])} if mode == "context_length" else {}
        r = await client.post("/v1/completions", json=lm_eval_body(case, **extra))
        assert r.status == 200, await r.text()
        out = await r.json()
        choice = out["choices"][0]
        ll, greedy = lm_eval_parse(choice, len(case["prefix"]))
        assert ll == pytest.approx(case["log_likelihood"], rel=1e-5, abs=1e-4)
        s = choice["score"]
        k = s["splits"].index(len(case["prefix"]))
        assert s["is_greedy"][k] == case["is_greedy"]
        # lm-eval's is_greedy is the reference's check at its split and (window mode) at every later split: exact
        # with context_length, and in window mode whenever the later splits pass (docs/api.md)
        assert greedy == all(s["is_greedy"][k:])
        if mode == "context_length" or all(s["is_greedy"][k + 1:]):
            assert greedy == case["is_greedy"]
        n = len(case["prefix"]) + len(case["target"])
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 1
        assert lp["token_logprobs"][0] is None and lp["text_offset"][0] == 0
        assert out["usage"] == {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1}
        assert s["log_likelihoods"][k] == pytest.approx(case["log_likelihood"], rel=1e-5, abs=1e-4)
        if mode == "context_length":
            assert s["splits"] == [len(case["prefix"])]
            assert lp["token_logprobs"][len(case["prefix"]) - 1] is None


async def test_window_sums_give_every_split_its_own_estimate(aiohttp_client):
    """Without context_length the prompt's last score_window splits are estimated: lm-eval's sum from any of them
    is that split's estimate (telescoping), equal to the estimate made for that split alone."""
    client, _ = await ready_client(aiohttp_client)
    case = CASES[2]
    ids = case["prefix"] + case["target"]
    body = {"prompt": ids, "max_tokens": 1, "logprobs": 1, "echo": True, "seed": 7, "mc_num": 16,
            "mc_batch_size": 4, "score_window": 5}
    whole = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]
    assert whole["score"]["splits"] == list(range(len(ids) - 5, len(ids)))
    assert all(v is None for v in whole["logprobs"]["token_logprobs"][:len(ids) - 5])
    for ctx in range(len(ids) - 5, len(ids)):
        alone = (await (await client.post("/v1/completions", json={**body, "context_length": ctx})).json())
        alone = alone["choices"][0]
        assert lm_eval_parse(whole, ctx)[0] == pytest.approx(alone["score"]["log_likelihoods"][0], rel=1e-5, abs=1e-4)
        assert lm_eval_parse(alone, ctx)[0] == pytest.approx(alone["score"]["log_likelihoods"][0], rel=1e-5,
                                                            abs=1e-4)


async def test_several_prompts_in_one_request_and_max_tokens_0(aiohttp_client):
    client, _ = await ready_client(aiohttp_client)
    cases = [c for c in CASES if c["cfg_scale"] == 0 and c["mc_num"] == 32 and c["batch_size"] == 8]
    assert cases
    body = {"prompt": [c["prefix"] + c["target"] for c in cases], "max_tokens": 0, "logprobs": 0, "echo": True,
            "seed": cases[0]["seed"], "mc_num": 32, "mc_batch_size": 8}
    out = await (await client.post("/v1/completions", json=body)).json()
    for c, choice in zip([x for x in cases if x["seed"] == cases[0]["seed"]], out["choices"]):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(c["prefix"]) + len(c["target"])     # nothing generated
        s = choice["score"]
        assert s["log_likelihoods"][s["splits"].index(len(c["prefix"]))] == pytest.approx(c["log_likelihood"],
                                                                                       rel=1e-5, abs=1e-4)
    assert out["usage"]["completion_tokens"] == 0


async def test_with_the_openai_client(aiohttp_client):
    client, _ = await ready_client(aiohttp_client)
    case = CASES[1]
    oc = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    r = await oc.completions.create(model="tiny-llada", prompt=case["prefix"] + case["target"], max_tokens=1,
                                    echo=True, logprobs=1, seed=case["seed"], temperature=0,
                                    extra_body={"mc_num": case["mc_num"], "mc_batch_size": case["batch_size"]})
    lp = r.choices[0].logprobs
    ctx = len(case["prefix"])
    assert sum(lp.token_logprobs[ctx:-1]) == pytest.approx(case["log_likelihood"], rel=1e-5, abs=1e-4)
    assert r.choices[0].text.startswith(r.choices[0].text[:lp.text_offset[-1]])
    await oc.close()


async def test_scoring_refusals(aiohttp_client):
    client, _ = await ready_client(aiohttp_client)
    base = {"prompt": [5, 6, 7, 8], "echo": True, "logprobs": 1, "max_tokens": 1}
    for body, param in [({**base, "max_tokens": 2}, "max_tokens"), ({**base, "n": 2}, "n"),
                        ({**base, "stream": True}, "stream"), ({**base, "mc_num": 10, "mc_batch_size": 4}, "mc_num"),
                        ({**base, "context_length": 4}, "context_length"), ({**base, "prompt": [5]}, "prompt"),
                        ({"prompt": "x", "echo": True}, "echo"), ({"prompt": "x", "logprobs": 21}, "logprobs"),
                        ({"prompt": "x", "max_tokens": 0}, "max_tokens")]:
        r = await client.post("/v1/completions", json=body)
        assert r.status == 400, (body, await r.text())
        assert (await r.json())["error"]["param"] == param, body
    ok = await client.post("/v1/completions", json={"prompt": "x y", "max_tokens": 2})    # others unaffected
    assert ok.status == 200


async def test_nemotron_refuses_scoring_with_the_reason(aiohttp_client):
    client = await aiohttp_client(make_app(WorkerConfig(model_path=str(TINY_NEMOTRON), device="cpu")))
    await wait_ready(client)
    r = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "echo": True, "logprobs": 1, "max_tokens": 1})
    assert r.status == 400
    assert "no likelihood estimator" in (await r.json())["error"]["message"]
