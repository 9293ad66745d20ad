"""Generated tokens' log-probabilities (issue 27): each answer token's log-probability under the distribution of the
denoising step that committed it, with that step's top alternatives; the same alone and batched; the OpenAI shapes
of chat (`logprobs` + `top_logprobs`) and completions (`logprobs: N`), cut with the text at a stop string."""
import orjson
import pytest
import torch

from tests.conftest import TINY_DREAM, TINY_LLADA, TINY_LLADA2, TINY_NEMOTRON, TINY_SDAR
from tests.test_worker_app import ready_client
from worker.engine import GenerationParams, Request
from worker.models import DEFAULT_ALGORITHM

# (fixture, algorithm (None: the family's default), extra parameters): every family and every kind of step loop
SETTINGS = [(TINY_LLADA, "basic", {}), (TINY_LLADA, "dual_cache", {"threshold": 0.9}),
            (TINY_LLADA, "prefix_cache", {}), (TINY_LLADA, "dinfer_credit", {"threshold": 0.9}),
            (TINY_NEMOTRON, None, {}), (TINY_DREAM, "dream", {}), (TINY_DREAM, "dream_dual_cache", {"threshold": 0.9}),
            (TINY_SDAR, None, {}), (TINY_LLADA2, "llada2", {}), (TINY_LLADA2, "llada21", {})]


@pytest.fixture(scope="module")
def engines():
    from worker.engine import Engine
    cache = {}

    def get(path):
        if path not in cache:
            cache[path] = Engine.from_pretrained(path, device="cpu", dtype="float32")
        return cache[path]
    return get


def _requests(engine, alg, extra):
    alg = alg or DEFAULT_ALGORITHM[engine.family]
    return [Request(prompt, GenerationParams(gen_length=n, block_length=8, algorithm=alg, logprobs=3, **extra))
            for prompt, n in (([5, 6], 16), ([5, 6, 7, 8], 24), ([9, 10, 11], 12))]


@pytest.mark.parametrize("path, alg, extra", SETTINGS, ids=lambda v: getattr(v, "name", v))
def test_every_answer_token_has_its_steps_logprob_alone_and_batched(engines, path, alg, extra):
    engine = engines(path)
    reqs = _requests(engine, alg, extra)
    alone = [engine.generate([r])[0] for r in reqs]
    batched = engine.generate(reqs)
    for a, b in zip(alone, batched):
        assert a.token_ids == b.token_ids and len(a.logprobs) == len(a.token_ids) == len(b.logprobs)
        for t, (tok, lp, top) in zip(a.token_ids, a.logprobs):
            assert tok == t and lp <= 0 and len(top) == 3
            assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
            # greedy decoding commits the step's most likely token: the recorded distribution is the deciding one
            assert top[0][0] == tok and top[0][1] == lp
        # the same numbers batched, to float32 rounding (a padded batch sums in another order)
        for (t1, l1, top1), (t2, l2, top2) in zip(a.logprobs, b.logprobs):
            assert t1 == t2 and abs(l1 - l2) < 1e-4 and [i for i, _ in top1] == [i for i, _ in top2]
            assert all(abs(v1 - v2) < 1e-4 for (_, v1), (_, v2) in zip(top1, top2))


def test_the_first_committed_token_has_the_first_forwards_distribution(engines):
    """LLaDA, one token per step: the first step forwards prompt + masks and commits its most confident position;
    that token's entry is the log-softmax of that very forward's logits there."""
    engine = engines(TINY_LLADA)
    prompt, G = [5, 6, 7], 8
    res = engine.generate([Request(prompt, GenerationParams(gen_length=G, block_length=G, steps=G, logprobs=5,
                                                            ignore_eos=True))])[0]
    x = torch.tensor([prompt + [engine.mask_id] * G])
    with torch.inference_mode():
        logits = engine.model.logits(engine.model(x, torch.arange(x.shape[1])[None], None))[0, len(prompt):]
    lp = torch.log_softmax(logits.float(), -1)
    first = int(torch.softmax(logits, -1).max(-1).values.argmax())     # the step's most confident position
    tok, value, top = res.logprobs[first]
    # (within 1e-5: the engine's forward and this one may round differently, by the kernels the CPU picks for their
    # shapes: 1.4e-6 apart under ATen's and MKL's AVX2 kernels; the next step's distribution differs by far more)
    assert tok == int(lp[first].argmax()) and value == pytest.approx(float(lp[first, tok]), abs=1e-5)
    assert [i for i, _ in top] == lp[first].topk(5).indices.tolist()


def test_sampled_tokens_get_the_models_logprob_not_only_the_argmax(engines):
    engine = engines(TINY_LLADA)
    r = engine.generate([Request([5, 6], GenerationParams(gen_length=16, block_length=8, temperature=1.0, seed=3,
                                                          logprobs=0))])[0]
    assert len(r.logprobs) == len(r.token_ids) and all(top == [] for _, _, top in r.logprobs)
    assert all(lp <= 0 for _, lp, _ in r.logprobs)


async def test_chat_and_completions_shapes(aiohttp_client):
    client, _ = await ready_client(aiohttp_client)
    msgs = [{"role": "user", "content": "di vo"}]
    r = await client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 8, "logprobs": True,
                                                        "top_logprobs": 2, "return_token_ids": True, "ignore_eos": True})
    choice = (await r.json())["choices"][0]
    content = choice["logprobs"]["content"]
    assert r.status == 200 and len(content) == len(choice["token_ids"]) == 8
    assert all(set(c) == {"token", "logprob", "bytes", "top_logprobs"} and len(c["top_logprobs"]) == 2
               and bytes(c["bytes"]).decode() == c["token"] for c in content)
    # without logprobs: null, as before
    r = await client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4})
    assert (await r.json())["choices"][0]["logprobs"] is None

    r = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8, "logprobs": 3,
                                                   "ignore_eos": True, "n": 2, "temperature": 1, "seed": 1})
    for choice in (await r.json())["choices"]:
        lp = choice["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 8
        assert all(len(t) in (3, 4) and lp["tokens"][i] in t for i, t in enumerate(lp["top_logprobs"]))
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


async def test_logprobs_follow_the_text_at_a_stop_string_and_in_a_stream(aiohttp_client):
    client, _ = await ready_client(aiohttp_client)
    body = {"prompt": [5, 6, 7], "max_tokens": 12, "logprobs": 1, "ignore_eos": True, "return_token_ids": True}
    full = (await (await client.post("/v1/completions", json=body)).json())["choices"][0]
    stop = full["text"][len(full["text"]) // 2:][:2]
    cut = (await (await client.post("/v1/completions", json={**body, "stop": [stop]})).json())["choices"][0]
    assert len(cut["logprobs"]["tokens"]) == len(cut["token_ids"]) < len(full["token_ids"])
    assert cut["logprobs"]["token_logprobs"] == full["logprobs"]["token_logprobs"][:len(cut["token_ids"])]

    r = await client.post("/v1/completions", json={**body, "stream": True})
    chunks = [orjson.loads(line[6:]) for line in (await r.read()).split(b"\n")
              if line.startswith(b"data: {")]
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert len(streamed) == 1 and streamed[0] == full["logprobs"]         # all of them, with the last chunk


@pytest.mark.parametrize("path, alg, extra", SETTINGS, ids=lambda v: getattr(v, "name", v))
def test_a_row_with_logprobs_batches_with_rows_without(engines, path, alg, extra):
    """A row asking for logprobs is decided row by row where the others are decided together (dream, the Dream
    caches, LLaDA2.x, SDAR): in one batch every row still gets the tokens it gets alone."""
    from dataclasses import replace
    engine = engines(path)
    reqs = _requests(engine, alg, extra)
    mixed = [Request(r.prompt_ids, replace(r.params, logprobs=3 if i == 1 else None)) for i, r in enumerate(reqs)]
    alone = [engine.generate([r])[0] for r in mixed]
    got = engine.generate(mixed)
    assert [g.token_ids for g in got] == [a.token_ids for a in alone]
    assert [g.nfe for g in got] == [a.nfe for a in alone]
    assert got[1].logprobs and not got[0].logprobs and not got[2].logprobs


async def test_tokens_no_step_decided_get_a_stand_in_and_fail_nothing(aiohttp_client):
    """A random-weight model that keeps proposing the mask token leaves positions no step ever decided (this prompt:
    15 of 16). Their entries carry the mask token with OpenAI's stand-in -9999.0 and no alternatives; they were a
    KeyError that failed every row of the batch with a 500."""
    import asyncio
    client, _ = await ready_client(aiohttp_client)
    body = {"prompt": [121, 210, 266, 179, 183], "max_tokens": 16, "block_length": 16, "return_token_ids": True}
    other = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 16})
    r, r2 = await asyncio.gather(client.post("/v1/completions", json={**body, "logprobs": 2}), other)
    assert r.status == 200 and r2.status == 200, await r.text()
    choice = (await r.json())["choices"][0]
    lp = choice["logprobs"]
    undecided = [i for i, v in enumerate(lp["token_logprobs"]) if v == -9999.0]
    assert len(undecided) >= 8 and all(choice["token_ids"][i] == 292 for i in undecided)
    assert all(lp["top_logprobs"][i] == {lp["tokens"][i]: -9999.0} for i in undecided)


def test_a_token_that_begins_a_character_has_one_string_among_its_alternatives():
    """A byte-level token that only begins a character has the text "" in context (its character comes with the
    next token); listed among its own step's alternatives it has that same string, not U+FFFD (a review found the
    chosen token twice in a completions map, and a chat top entry other than the token). Dream's tokenizer."""
    from worker.serving import Serving, _Choice
    from worker.tokenizer import load_tokenizer, text_decoder
    s = Serving.__new__(Serving)             # only its tokenizer parts: logprobs() reads nothing else
    s.tok = load_tokenizer(TINY_DREAM)
    s.decode, s._token_texts = text_decoder(s.tok), {}
    st = _Choice(s.decode, [])
    st.token_ids = [136, 216, 131]            # "\ufffd", then two bytes of one character
    st.logprobs = [(136, -0.1, [(136, -0.1), (5, -3.0)]), (216, -0.2, [(216, -0.2), (7, -4.0)]),
                   (131, -0.3, [(131, -0.3)])]
    comp = s.logprobs("completion", st)
    assert comp["tokens"][1] == "" and "".join(comp["tokens"]) == s.decode(st.token_ids)
    assert len(comp["top_logprobs"][1]) == 2 and comp["top_logprobs"][1][""] == -0.2
    chat = s.logprobs("chat", st)["content"]
    assert [c["top_logprobs"][0]["token"] for c in chat] == [c["token"] for c in chat]
    assert chat[1]["top_logprobs"][0]["bytes"] == chat[1]["bytes"] == []
