"""worker/serving.py on its own: requests to rows (defaults, n, chat template, scoring splits) and rows' results to
OpenAI events (stop strings, token counts), on the tiny fixture's real tokenizer and engine; the batcher is built but
never started, so nothing is generated here (tests/test_worker_app.py and the end-to-end tests run the rows)."""
import asyncio
import random

import pytest

from common.protocol import APIError
from tests.conftest import TINY_LLADA, fixture_path
from worker.scheduler import RowScheduler
from worker.engine import Engine
from worker.engine.engine import Result
from worker.serving import Defaults, Serving, _Choice


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(str(TINY_LLADA), device="cpu")


@pytest.fixture
def serving(engine):
    return Serving(engine, RowScheduler(engine, loop=asyncio.new_event_loop()), "tiny-llada", Defaults(max_tokens=64))


def test_default_max_tokens_is_whole_blocks_that_fit(serving, engine):
    L = engine.max_sequence_length
    for prompt_len, block, expected in [(10, 32, 64),            # the default (64) fits
                                        (L - 40, 32, 32),       # 40 left: one whole block
                                        (L - 20, 32, 20),       # less than a block left: exactly what is left
                                        (L - 70, 16, 64)]:      # 70 left: four blocks of 16
        body = {"prompt": [5] * prompt_len, "block_length": block}
        p = serving.prepare("completion", body).params[0]
        # the requested block length goes to the engine as it is (its plan caps it at max_tokens for the families
        # whose blocks start at the generation; SDAR's count from position 0)
        assert (p.gen_length, p.block_length) == (expected, block), (prompt_len, block)
    with pytest.raises(APIError) as e:
        serving.prepare("completion", {"prompt": [5] * L})
    assert e.value.status == 400 and e.value.param == "prompt"


def test_sampling_filters_change_nothing_when_greedy_and_are_refused_when_sampling(serving):
    """NeMo-Skills sends ``top_p: 0.95`` with ``temperature: 0`` by default (and ``min_p: 0``, ``top_k`` -1): LLaDA's
    algorithms have no nucleus filter, and greedy decoding takes the argmax whatever it keeps, so the request is
    the same as without them (vLLM ignores them when greedy too). Sampling with one is a 400 naming it: the
    reference samples without it."""
    base = {"prompt": [5, 6, 7], "max_tokens": 8, "seed": 3}
    plain = serving.prepare("completion", base).params[0]
    for extra in ({"top_p": 0.95, "top_k": -1, "min_p": 0.0}, {"top_p": 0.5, "top_k": 3, "min_p": 0.2}):
        for greedy in (0, 1e-6):                        # (a temperature below 1e-5 is greedy, vLLM's rule)
            got = serving.prepare("completion", {**base, **extra, "temperature": greedy}).params[0]
            assert got == plain, (extra, greedy)
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, **extra}
        assert serving.prepare("chat", chat).params[0].extra == {}
    for field, value in (("top_p", 0.95), ("top_k", 3), ("min_p", 0.2)):
        for kind, body in (("completion", base), ("chat", {"messages": [{"role": "user", "content": "x"}]}),
                           ("responses", {"input": "x"})):
            if kind == "responses" and field != "top_p":
                continue
            with pytest.raises(APIError) as e:
                serving.prepare(kind, {**body, field: value, "temperature": 0.7})
            assert e.value.status == 400 and e.value.param == field and "temperature 0" in e.value.message
    # at their neutral values they are no filter at all, sampling or not
    assert serving.prepare("completion", {**base, "temperature": 0.7, "top_p": 1, "top_k": 0,
                                          "min_p": 0}).params[0].temperature == 0.7


def test_a_request_past_the_context_says_so_in_openais_words(serving, engine):
    """Clients retry a request longer than the context with fewer tokens by parsing OpenAI's / vLLM's message
    (litellm maps "This model's maximum context length is" to its ContextWindowExceededError; NeMo-Skills' soft
    fail reads the numbers with these patterns): prompt + max_tokens, and a prompt that fills the context alone."""
    import re
    L = engine.max_sequence_length
    with pytest.raises(APIError) as e:
        serving.prepare("completion", {"prompt": [5] * (L - 20), "max_tokens": 64})
    m = re.search(r"maximum context length is (\d+) tokens.*?you requested (\d+) tokens.*?(\d+) in the messages, "
                  r"(\d+) in the completion", e.value.message, re.DOTALL)
    assert e.value.status == 400 and e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"
    assert m and [int(g) for g in m.groups()] == [L, L + 44, L - 20, 64], e.value.message
    assert e.value.message.startswith("This model's maximum context length is")
    with pytest.raises(APIError) as e:          # the canvas is whole blocks: the message counts what it needs
        serving.prepare("completion", {"prompt": [5] * (L - 12), "max_tokens": 10, "block_length": 8})
    assert "16 in the completion: max_tokens 10 rounded up to a multiple of block_length 8" in e.value.message
    for n in (L, L + 5):            # a prompt that fills the context, or is longer than it
        with pytest.raises(APIError) as e:
            serving.prepare("completion", {"prompt": [5] * n})
        m = re.search(r"maximum context length is (\d+) tokens.*?request has (\d+) input tokens", e.value.message)
        assert e.value.param == "prompt" and e.value.code == "context_length_exceeded" and m
        assert [int(g) for g in m.groups()] == [L, n]
    # a text so long it is refused before its tokens are counted, and a scoring request (echo) past the context:
    # the same code and words (they said "cannot fit the model's maximum sequence length", with no code: a review)
    for kind, body, param in [("completion", {"prompt": "x" * (serving.max_prompt_chars + 1)}, "prompt"),
                              ("chat", {"messages": [{"role": "user", "content": "x" * (serving.max_prompt_chars + 1)}]},
                               "messages"),
                              ("completion", {"prompt": [5] * L, "echo": True, "logprobs": 1, "max_tokens": 1},
                               "prompt")]:
        with pytest.raises(APIError) as e:
            serving.prepare(kind, body)
        m = re.search(r"maximum context length is (\d+) tokens.*?(request has|you requested) (\d+)", e.value.message)
        assert e.value.param == param and e.value.code == "context_length_exceeded" and m, e.value.message
        assert int(m.group(1)) == L and int(m.group(3)) >= L
        assert re.search(r"\(\d+ in the messages, \d+ in the completion\)|\d+ input tokens", e.value.message)


def test_n_choices_are_rows_with_their_own_seeds(serving):
    prep = serving.prepare("completion", {"prompt": [[5, 6], [7]], "n": 3, "seed": 10, "max_tokens": 4})
    assert len(prep.prompts) == len(prep.params) == 6
    assert [p.seed for p in prep.params] == [10, 11, 12, 10, 11, 12]
    assert prep.prompts[0] == prep.prompts[2] != prep.prompts[3]
    unseeded = serving.prepare("completion", {"prompt": "a", "n": 2, "max_tokens": 4})
    assert [p.seed for p in unseeded.params] == [None, None]     # the batcher draws one per row


def test_chat_requests_use_the_template_and_system_for_developer(serving, engine):
    from worker.tokenizer import apply_chat_template
    prep = serving.prepare("chat", {"messages": [{"role": "developer", "content": "be brief"},
                                                 {"role": "user", "content": "sort 3 1"}], "max_tokens": 4})
    assert prep.prompts[0] == apply_chat_template(engine.tokenizer, [{"role": "system", "content": "be brief"},
                                                                      {"role": "user", "content": "sort 3 1"}])
    assert prep.rid.startswith("chatcmpl-")


def test_scoring_requests_become_score_rows(serving):
    base = {"prompt": [5, 6, 7, 8, 9], "echo": True, "logprobs": 1, "max_tokens": 1, "mc_num": 8,
            "mc_batch_size": 4}
    prep = serving.prepare("completion", base)
    s = prep.scores[0]
    assert s.splits == [1, 2, 3, 4] and s.next_token and (s.mc_num, s.batch_size, s.seed) == (8, 4, 1234)
    assert serving.prepare("completion", {**base, "context_length": 3}).scores[0].splits == [3]
    assert serving.prepare("completion", {**base, "score_window": 2}).scores[0].splits == [3, 4]
    assert serving.prepare("completion", {**base, "max_tokens": 0}).scores[0].next_token is False
    for body, param in [({**base, "context_length": 5}, "context_length"), ({**base, "mc_num": 6}, "mc_num"),
                        ({**base, "prompt": [99999, 1]}, "prompt")]:
        with pytest.raises(APIError) as e:
            serving.prepare("completion", body)
        assert e.value.status == 400 and e.value.param == param, body


@pytest.fixture(scope="module")
def demo_tokenizer():
    """The demo model's tokenizer knows digits and words (the tiny fixture's maps text to one unknown token)."""
    from pathlib import Path
    from worker.tokenizer import load_tokenizer
    return load_tokenizer(str(Path(__file__).resolve().parent.parent / "worker" / "demo_model"))


def test_stop_strings_cut_text_and_count_only_its_tokens(demo_tokenizer):
    tok = demo_tokenizer
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
    ids = tok("sort 1 2 8 4", add_special_tokens=False)["input_ids"]
    c = _Choice(decode, ["8"])
    c.finish(Result(ids, "length", 3, ids, 1))
    assert c.text == decode(ids)[:decode(ids).index("8")] and c.finish_reason == "stop"
    # the tokens of the text returned: the shortest prefix of ids that covers it (" 8" holds the stop string's "8"
    # and the returned text's last space)
    n = len(c.token_ids)
    assert c.token_ids == ids[:n] and decode(c.token_ids).startswith(c.text) and len(decode(ids[:n - 1])) < len(c.text)
    assert decode(c.token_ids) == "sort 1 2 8"
    plain = _Choice(decode, [])
    plain.finish(Result(ids, "length", 3, ids, 1))
    assert plain.text == decode(ids) and plain.token_ids == ids and plain.finish_reason == "length"


def test_streamed_text_holds_back_a_possible_stop_string(demo_tokenizer):
    tok = demo_tokenizer
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
    ids = tok("sort 1 2", add_special_tokens=False)["input_ids"]
    c = _Choice(decode, ["2!"])            # the final "2" might be the start of the stop string: not streamed yet
    first = c.progress(ids)
    assert decode(ids).endswith("2") and first == decode(ids)[:-1]
    assert first + c.finish(Result(ids, "length", 1, ids, 1)) == decode(ids)


def test_a_stop_string_counts_only_in_text_no_later_token_changes():
    """While tokens still come, a stop string is looked for only in the settled text: two byte tokens decode to
    two U+FFFD until the token completing the second character comes (a review's Dream answer matched the stop
    string "\\ufffd\\ufffd" there and was cut to nothing); a stop in settled text stops at once."""
    from worker.tokenizer import load_tokenizer
    tok = load_tokenizer(fixture_path("tiny-dream"))
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
    head, whole = [136, 216], [136, 216, 131, 131]
    assert decode(head) == "\ufffd\ufffd" and decode(whole) == "\ufffd\u0603\ufffd"
    c = _Choice(decode, ["\ufffd\ufffd"])
    out = c.progress(head)
    assert not c.stopped
    out += c.progress(whole[:3]) + c.finish(Result(whole, "length", 1, whole, 1))
    assert out == c.text == decode(whole) and c.finish_reason == "length"
    c = _Choice(decode, ["\u0603"])
    assert c.progress(whole[:3]) == "\ufffd" and c.stopped and c.token_ids == whole[:1]


def test_with_a_clean_up_tokenizer_stop_strings_stop_early_and_stream_nothing_they_cut():
    """A tokenizer whose text a later word may still rewrite (clean_up_tokenization_spaces): a stop string without a
    space stops the row as soon as it appears (the clean-up only removes spaces; a review found such a stop found
    only at the end, the row never cancelled), and one with a space is never streamed in part before the final text
    cuts it."""
    def decoder(pieces):
        def decode(ids):
            return "".join(pieces[i] for i in ids)
        decode.cleans_up = True
        return decode
    decode = decoder(["你", "好", "。", "再", "见"])
    c = _Choice(decode, ["。"])
    out = "".join(c.progress(list(range(k))) for k in range(1, 4))
    assert c.stopped and out == c.text == "你好"
    decode = decoder(["a", " b", " c", "d", " e", " f"])
    c = _Choice(decode, ["b c"])
    out = "".join(c.progress(list(range(k))) for k in range(1, 5))
    out += c.finish(Result(list(range(6)), "length", 1, list(range(6)), 1))
    assert c.text == "a " and c.finish_reason == "stop" and out == "a "


def test_the_simulated_device_prepares_and_runs_rows_like_a_model():
    """worker/simulated.py (the test double of the benchmarks) goes through the same request path."""
    from worker.engine import Request
    from worker.simulated import SimulatedEngine
    sim = SimulatedEngine(str(TINY_LLADA), 0.0, 0.0)
    s = Serving(sim, RowScheduler(sim, loop=asyncio.new_event_loop()), "tiny-llada", Defaults(max_tokens=16))
    prep = s.prepare("completion", {"prompt": [5, 6, 7], "max_tokens": 8})
    assert prep.params[0].block_length == 32 and prep.params[0].gen_length == 8
    res = sim.generate([Request(ids, p) for ids, p in zip(prep.prompts, prep.params)])
    assert len(res) == 1 and len(res[0].token_ids) <= 8



def test_a_request_is_planned_once_and_its_choices_keep_their_seeds(engine):
    """Serving validates a row by planning it; the plan travels with the job, so the engine does not plan it again
    (each of n choices with its own seed, in the plan too)."""
    calls = []
    plan = engine.plan

    def counted(ids, p):
        calls.append(p.seed)
        return plan(ids, p)
    engine.plan = counted
    try:
        s = Serving(engine, RowScheduler(engine, loop=asyncio.new_event_loop()), "tiny-llada", Defaults(max_tokens=8))
        prep = s.prepare("completion", {"prompt": [5, 6, 7], "n": 2, "seed": 3, "max_tokens": 8, "temperature": 1.0})
        assert calls == [3] and [pl.params.seed for pl in prep.plans] == [3, 4]
        from worker.engine import Request
        res = engine.generate([Request(ids, pl.params, pl) for ids, pl in zip(prep.prompts, prep.plans)])
        assert calls == [3] and len(res) == 2                          # the engine used the plans it was given
        alone = [engine.generate([Request(ids, pl.params)])[0] for ids, pl in zip(prep.prompts, prep.plans)]
        assert [r.token_ids for r in res] == [r.token_ids for r in alone]
    finally:
        engine.plan = plan


@pytest.mark.parametrize("emit", [False, True], ids=["events", "emit"])
def test_an_answered_request_is_freed_at_once_not_by_the_garbage_collector(serving, emit):
    """A request's objects (its Run, rows, parsed body) go as soon as it is answered, by reference counting: no
    reference cycle waits for a full garbage collection, a pass that holds the GIL for 0.1-0.5 s in a busy worker
    (the device thread waits meanwhile; docs/engine.md). The door's way (events, no ``emit``) and the balancer's
    batch way (``emit``)."""
    import gc
    import weakref
    got = []
    gc.disable()
    try:
        run = serving.submit(serving.prepare("completion", {"prompt": [5, 6], "max_tokens": 4, "n": 2}),
                             (lambda kind, data, last: got.append((kind, last))) if emit else None, wait=False)
        assert len(serving.batcher.pending) == 2
        serving.batcher.pending.clear()          # (the batcher never runs here: its rows are taken by hand)
        for i in range(2):
            run.on_row(i, "done", Result([7, 8, 9, 10], "length", 4, [7, 8, 9, 10], 2))
        if emit:
            assert got == [("response", True)]
        else:
            events = list(run._box.events)
            assert [(e.kind, e.end) for e in events] == [("response", True)]
        run.cancel()                             # (what the door does once the answer is sent: nothing left to drop)
        ref = weakref.ref(run)
        del run
        assert ref() is None, "the answered request is still referenced: " + repr(
            [type(r).__name__ for r in gc.get_referrers(ref())])
    finally:
        gc.enable()


def test_the_prompt_size_limit_is_per_prompt(serving):
    """Each prompt of a list is its own row: many prompts that each fit are not refused together."""
    one = "a" * (serving.max_prompt_chars // 8 + 1)         # a few tokens on this tokenizer; 9 of them pass the
    prep = serving.prepare("completion", {"prompt": [one] * 9, "max_tokens": 1})      # limit together
    assert len(prep.prompts) == 9
    with pytest.raises(APIError) as e:
        serving.prepare("completion", {"prompt": ["a", "a" * (serving.max_prompt_chars + 1)], "max_tokens": 1})
    assert e.value.status == 400 and e.value.param == "prompt"


def test_more_messages_than_the_context_are_refused_before_the_template_runs(serving, monkeypatch):
    """Each message takes at least one token: more messages than the context's tokens are refused without
    templating them (100,000 one-letter messages took 6.5 s of the worker's CPU before), on chat and Responses; as
    many as the context still reach the template (its length check refuses them later). /tokenize counts prompts
    past the context, up to 4 times it (as its text guard)."""
    import worker.serving as serving_module
    n = serving.engine.max_sequence_length
    templated = []
    monkeypatch.setattr(serving_module, "apply_chat_template", lambda tok, msgs, *a: templated.append(msgs) or [5])
    many = [{"role": "user", "content": "x"}] * (n + 1)
    for kind, body, param in [("chat", {"messages": many, "max_tokens": 1}, "messages"),
                              ("responses", {"input": many, "max_output_tokens": 1}, "input")]:
        with pytest.raises(APIError) as e:
            serving.prepare(kind, body)
        assert e.value.status == 400 and e.value.param == param and f"{param}: {n + 1} of them" in e.value.message
    assert templated == []
    assert serving.tokenize({"messages": many})["count"] == 1 and len(templated.pop()) == n + 1
    with pytest.raises(APIError) as e:
        serving.tokenize({"messages": [{"role": "user", "content": "x"}] * (4 * n + 1)})
    assert e.value.status == 400 and e.value.param == "messages"
    assert templated == []
    serving.prepare("chat", {"messages": many[:n], "max_tokens": 1})
    assert len(templated) == 1 and len(templated[0]) == n


def test_responses_errors_name_the_responses_fields(serving, engine):
    for body, param in [({"input": "x", "max_output_tokens": 10 ** 6}, "max_output_tokens"),
                        ({"input": "x" * (serving.max_prompt_chars + 1)}, "input")]:
        with pytest.raises(APIError) as e:
            serving.prepare("responses", body)
        assert e.value.status == 400 and e.value.param == param, (body, e.value.body())
        assert "max_tokens" not in e.value.message and "messages" not in e.value.message
        assert "input input" not in e.value.message and e.value.code == "context_length_exceeded"


@pytest.mark.parametrize("fixture", ["demo", "tiny-llada2"])
def test_logprob_tokens_are_their_text_in_context(fixture, demo_tokenizer):
    """Each token's string is its share of the answer's text: they join to it, text_offset points into it, and a
    character split over byte tokens has its bytes on the token that completes it (a byte-level vocabulary,
    tiny-llada2's; the demo model's is SentencePiece-like, words with their leading space)."""
    from pathlib import Path
    from types import SimpleNamespace
    from worker.tokenizer import load_tokenizer, text_decoder, token_pieces
    tok = demo_tokenizer if fixture == "demo" else load_tokenizer(str(Path(__file__).parent / "fixtures" / fixture))
    decode = text_decoder(tok)
    text = "sort 1 2 8 4" if fixture == "demo" else "h\u00e9llo w\u00f6rld \u4e2d\u6587 ok"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pieces, alts = token_pieces(decode, ids, [[t] for t in ids])
    assert "".join(pieces) == decode(ids)
    assert [a for [a], p in zip(alts, pieces) if p] == [p for p in pieces if p]    # the same text in the same place
    if fixture != "demo":
        assert any(p == "" for p in pieces)          # a byte that only begins a character
        assert b"".join(p.encode() for p in pieces) == decode(ids).encode()
    # through Serving.logprobs, both shapes
    srv = SimpleNamespace(decode=decode, token_text=lambda t: tok.decode([t]), tok=tok)
    st = SimpleNamespace(decode=decode, token_ids=ids, logprobs=[(t, -0.5, [(t, -0.5), (ids[0], -2.0)]) for t in ids])
    out = Serving.logprobs(srv, "completion", st)
    assert "".join(out["tokens"]) == decode(ids)
    assert [decode(ids)[o:o + len(s)] for o, s in zip(out["text_offset"], out["tokens"])] == out["tokens"]
    assert all(top[s] == -0.5 for s, top in zip(out["tokens"], out["top_logprobs"]))    # the chosen one's value
    chat = Serving.logprobs(srv, "chat", st)["content"]
    assert bytes(b for e in chat for b in e["bytes"]) == decode(ids).encode()


def test_streamed_text_equals_the_answer_with_a_decoder_that_cleans_up_spaces():
    """transformers' clean_up_tokenization_spaces (a tokenizer_config.json setting) turns " ' " into "'" in the
    whole text, so the text of a longer prefix is not always the shorter one's text extended: "i don '" then
    "i don't". Streaming sends each prefix's new text, so the answer "i don't" was streamed as "i don '" and then
    nothing (a reviewer's suspicion, confirmed). Every split of the tokens into steps now streams the answer's text
    exactly."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    from worker.tokenizer import text_decoder
    words = ["[UNK]", "i", "don", "'", "t", "know", ",", "it", "s", "fine", ".", "n't", "do", "not", "you", "are",
             "n"]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece(cleanup=False)
    decode = text_decoder(PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=True,
                                                  unk_token="[UNK]"))
    for sentence in ("i don ' t know , it ' s fine .", "you are n't fine , i do not know . it ' s",
                     "i do n ' t know , you are n ' t ."):      # one rewrite making another (a review's case)
        ids = [words.index(w) for w in sentence.split()]
        answer = decode(ids)
        assert answer != sentence and "'" in answer         # the clean-up happened
        rng = random.Random(0)
        for _ in range(30):
            c, out, upto = _Choice(decode, []), "", 0
            while upto < len(ids):
                upto = min(len(ids), upto + rng.randint(1, 3))
                out += c.progress(ids[:upto])
            out += c.finish(Result(ids, "length", 1, ids, 1))
            assert out == answer == c.text
    rng = random.Random(1)
    for _ in range(300):                     # any words, any steps
        ids = [rng.randrange(1, len(words)) for _ in range(rng.randint(1, 12))]
        c, out, upto = _Choice(decode, []), "", 0
        while upto < len(ids):
            upto = min(len(ids), upto + rng.randint(1, 3))
            out += c.progress(ids[:upto])
        out += c.finish(Result(ids, "length", 1, ids, 1))
        assert out == decode(ids), [words[i] for i in ids]


def test_text_parts_reach_the_template_as_vllm_gives_them():
    """A message of several text parts had them glued together ("Translate to French:Good morning"), words running
    into one another (a reviewer's finding). A template that takes a string gets them joined by newlines, as vLLM
    and SGLang give them; a template that reads parts (DiffusionGemma's) gets the parts. The same through
    /v1/responses. (Simulated devices: the prompt is what is checked.)"""
    from tests.conftest import fixture_path
    from worker.simulated import SimulatedEngine
    from worker.tokenizer import apply_chat_template
    parts = [{"type": "text", "text": "Translate to French:"}, {"type": "text", "text": "Good morning"}]
    for fixture, want in (("tiny-llada", "Translate to French:\nGood morning"), ("tiny-diffusion-gemma", parts)):
        sim = SimulatedEngine(str(fixture_path(fixture)), 0.0, 0.0)
        s = Serving(sim, RowScheduler(sim, loop=asyncio.new_event_loop()), fixture, Defaults(max_tokens=8))
        expected = apply_chat_template(sim.tokenizer, [{"role": "user", "content": want}])
        chat = s.prepare("chat", {"messages": [{"role": "user", "content": parts}]})
        assert chat.prompts == [expected], fixture
        resp = s.prepare("responses", {"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "Translate to French:"}, {"type": "input_text", "text": "Good morning"}]}]})
        assert resp.prompts == [expected], fixture


def test_an_assistant_prefill_is_continued_when_asked(engine, serving):
    """vLLM's add_generation_prompt and continue_final_message: a chat ending with the assistant's own start
    ("Sure, the answer is") was closed and followed by a new turn, silently (a reviewer's finding); now, when asked,
    the last message is continued as the template renders it. Both together, or a last message not the
    assistant's, are a 400."""
    from worker.tokenizer import apply_chat_template
    s = serving
    msgs = [{"role": "user", "content": "di vo"}, {"role": "assistant", "content": "vo di"}]
    prep = s.prepare("chat", {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True})
    want = apply_chat_template(engine.tokenizer, msgs, add_generation_prompt=False, continue_final_message=True)
    text = engine.tokenizer.decode(want)
    assert text.rstrip().endswith("vo di") and text != engine.tokenizer.decode(
        apply_chat_template(engine.tokenizer, msgs, add_generation_prompt=False))     # the turn left open
    assert prep.prompts == [want] and prep.prompts != [apply_chat_template(engine.tokenizer, msgs)]
    prep = s.prepare("chat", {"messages": msgs, "add_generation_prompt": False})
    assert prep.prompts == [apply_chat_template(engine.tokenizer, msgs, add_generation_prompt=False)]
    # /tokenize renders it the same way (a review found the field dropped there)
    tok = s.tokenize({"messages": msgs, "add_generation_prompt": False, "continue_final_message": True})
    assert tok["tokens"] == want
    with pytest.raises(APIError):
        s.tokenize({"messages": msgs, "continue_final_message": True})
    for body in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": False,
                                                    "messages": msgs[:1]}):
        with pytest.raises(APIError) as e:
            s.prepare("chat", {"messages": msgs, **body})
        assert e.value.status == 400 and "continue_final_message" in e.value.message
