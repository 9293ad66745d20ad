"""OpenAI semantics over the engine: request → rows (tokenisation, chat template, parameters) → events
(stream chunks or one response). Used by the worker's /v1 endpoints and by /worker/batch alike.

The worker's batching queue and its device thread are here too (:class:`Batcher`, :class:`Job`): requests arriving within ``max_wait_time`` of the first request of a forming batch (or until ``batch_size`` are
waiting) run together in one engine call, whatever parameters they carry; rows of a batch formed upstream (the
balancer's /worker/batch) start without that wait. The engine runs on one dedicated thread,
so the event loop stays free for /health, stats and streaming while a batch runs."""
from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import ctypes.util
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from common.protocol import (MAX_ROWS, APIError, DetokenizeRequest, ResponsesRequest, TokenizeRequest, parse_body, ChatCompletionRequest, CompletionRequest, chunk, completion_choice, new_id,
                             parse_request, response, usage, usage_chunk)
from common.openai_http import EventBox
from worker.engine import Engine, GenerationParams, ParamError, Request, Result, StepHooks
from worker.engine.algorithms import needs_rng
from worker.engine.likelihood import cost as score_cost
from worker.engine.params import row_cost
from worker.responses import ResponsesEvents
from worker.tokenizer import apply_chat_template, max_token_chars, text_decoder

log = logging.getLogger("dllm.worker.serving")


@dataclass
class Defaults:
    algorithm: str = "basic"
    max_tokens: int = 256
    block_length: int = 32
    # likelihood scoring (docs/api.md "Likelihood scoring"); mc_num, batch size and cfg as the reference's
    # eval_llada.py defaults, seed as lm-eval's
    score_mc_num: int = 128
    score_batch_size: int = 32
    score_cfg_scale: float = 0.0
    score_window: int = 32
    score_seed: int = 1234
    max_request_cost: int = 1 << 25     # token-forwards a request may imply (0: no limit; docs/reliability.md)


@dataclass
class Prepared:
    kind: str                       # "chat" | "completion"
    req: CompletionRequest | ChatCompletionRequest
    prompts: list[list[int]]        # one per choice: each prompt repeated n times (choice index = prompt * n + j)
    params: list[GenerationParams]
    rid: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    responses: ResponsesRequest | None = None     # a /v1/responses request, run as this chat request
    scores: list | None = None      # likelihood.ScoreRequest per prompt: a scoring request (no generation)
    costs: list[int] | None = None  # nominal token-forwards per row (admission: worker.engine.params.row_cost)


class Serving:
    def __init__(self, engine: Engine, batcher: Batcher, model_name: str, defaults: Defaults,
                 aliases: tuple[str, ...] = ()):
        self.engine, self.batcher, self.model_name, self.defaults = engine, batcher, model_name, defaults
        self.names = {model_name, *aliases}
        self.tok = engine.tokenizer
        self.decode = text_decoder(self.tok)
        self._token_texts: dict[int, str] = {}      # id -> its text alone (logprobs)
        # A text longer than this cannot fit the context whatever it holds: refused before the tokenizer spends
        # seconds on it (4x margin for normalisation that merges characters).
        self.max_prompt_chars = 4 * max_token_chars(self.tok) * engine.max_sequence_length

    # ------------------------------------------------------------ request -> rows
    def prepare(self, kind: str, body, req=None) -> Prepared:
        """``req``: the body already validated by parse_request(kind, body), when the caller has it."""
        if kind == "responses":
            r = req or parse_request("responses", body)
            prep = self.prepare("chat", r.chat_body())
            prep.responses, prep.rid = r, new_id("resp")
            return prep
        req = req or parse_request(kind, body)
        if req.model is not None and req.model not in self.names:
            raise APIError(404, f"The model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        chars = (sum(len(m.text()) for m in req.messages) if kind == "chat"
                 else sum(len(p) for p in req.prompts() if isinstance(p, str)))
        if chars > self.max_prompt_chars:
            raise APIError(400, f"the prompt ({chars} characters) cannot fit the model's maximum sequence length "
                                f"({self.engine.max_sequence_length} tokens)",
                           param="messages" if kind == "chat" else "prompt")
        if kind == "chat":
            msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
            try:
                prompts = [apply_chat_template(self.tok, msgs)]
            except Exception as e:   # jinja errors from the template (e.g. role order)
                raise APIError(400, f"messages: the chat template rejected them: {e}", param="messages")
        else:
            prompts = []
            for p in req.prompts():
                ids = self.tok(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else list(p)
                if not ids:
                    raise APIError(400, "prompt: the prompt encodes to no tokens", param="prompt")
                prompts.append(ids)
        if kind == "completion" and req.scoring:
            return self._prepare_scoring(req, prompts)
        n = req.n
        if len(prompts) * n > MAX_ROWS:
            raise APIError(400, f"{len(prompts)} prompts x n={n} is more than {MAX_ROWS} choices in one request",
                           param="n")
        params, costs = [], []
        for ids in prompts:
            p, c = self._params(req, ids)
            costs += [c] * n
            # choice j of a seeded request uses seed + j: reproducible, and distinct when sampling
            params += [p if j == 0 or p.seed is None else replace(p, seed=(p.seed + j) % (1 << 63)) for j in range(n)]
        self._check_cost(sum(costs), "max_tokens", "prompt length + max_tokens, steps, n and cfg_scale")
        prompts = [ids for ids in prompts for _ in range(n)]
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return Prepared(kind, req, prompts, params, rid=new_id(prefix), costs=costs)

    def _prepare_scoring(self, req: CompletionRequest, prompts: list[list[int]]) -> Prepared:
        from worker.engine.likelihood import ScoreRequest, check
        why = self.engine.scoring
        if why:
            raise APIError(400, why, param="logprobs")
        d = self.defaults
        limit = self.engine.max_sequence_length
        vocab = len(self.tok)
        nxt = req.max_new_tokens == 1
        mc_num = req.mc_num or d.score_mc_num
        bs = req.mc_batch_size or min(d.score_batch_size, mc_num)
        scores = []
        for ids in prompts:
            n = len(ids)
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"prompt: {bad} is not a token id of this model (0 to {vocab - 1})",
                               param="prompt")
            if n < 2:
                raise APIError(400, "prompt: a scoring prompt needs at least 2 tokens (a context and a continuation)",
                               param="prompt")
            if n + nxt > limit:
                raise APIError(400, f"prompt: {n} tokens{' + 1 generated' if nxt else ''} exceed the model's maximum "
                                    f"sequence length ({limit} tokens)", param="prompt")
            if req.context_length is not None:
                if req.context_length >= n:
                    raise APIError(400, f"context_length ({req.context_length}) must be less than the prompt's "
                                        f"{n} tokens (the continuation needs at least one)", param="context_length")
                splits = [req.context_length]
            else:
                splits = list(range(max(1, n - (req.score_window or d.score_window)), n))
            seed = d.score_seed if req.seed is None else req.seed % (1 << 63)
            sr = ScoreRequest(ids, splits, mc_num, bs, d.score_cfg_scale if req.cfg_scale is None else req.cfg_scale,
                              seed, req.check_greedy, nxt)
            try:
                check(sr)
            except ValueError as e:
                raise APIError(400, f"mc_num: {e} (mc_num {mc_num}, mc_batch_size {bs})", param="mc_num")
            scores.append(sr)
        costs = [score_cost(sr) for sr in scores]
        self._check_cost(sum(costs), "mc_num", "prompt length, mc_num, score_window (or context_length) and cfg_scale")
        return Prepared("completion", req, prompts, [None] * len(prompts), rid=new_id("cmpl"), scores=scores,
                        costs=costs)

    def _params(self, req, ids: list[int]) -> GenerationParams:
        d = self.defaults
        limit = self.engine.max_sequence_length - len(ids)
        max_new = req.max_new_tokens
        # the request's, else the block size the checkpoint was trained with (SDAR), else the server's default
        block = req.block_length or self.engine.default_block_length or d.block_length
        if max_new is None:
            if limit < 1:
                raise APIError(400, f"the prompt ({len(ids)} tokens) fills the model's context "
                                    f"({self.engine.max_sequence_length} tokens)", param="messages" if isinstance(
                                        req, ChatCompletionRequest) else "prompt")
            # the default: as long as allowed and whole blocks that fit the context (a shorter single block when
            # not even one full block fits), never a length the context cannot hold
            max_new = min(d.max_tokens, limit)
            b = min(block, max_new)
            if -(-max_new // b) * b > limit:
                max_new = (limit // b) * b
        p = GenerationParams(
            gen_length=max_new, block_length=block, steps=req.steps,
            algorithm=req.generation_algorithm or d.algorithm,
            temperature=req.temperature or 0.0, remasking=req.remasking or "low_confidence",
            cfg_scale=req.cfg_scale or 0.0, threshold=req.threshold, factor=req.factor,
            seed=None if req.seed is None else req.seed % (1 << 63),
            ignore_eos=req.ignore_eos, extra=dict(req.algorithm_params or {}), logprobs=req.token_logprobs)
        try:
            pl = self.engine.plan(ids, p)
        except ParamError as e:
            param = e.param
            if param == "max_tokens" and req.max_completion_tokens is not None:
                param = "max_completion_tokens"
            raise APIError(400, e.message, param=param)
        return p, row_cost(pl)

    def _check_cost(self, cost: int, param: str, what: str) -> None:
        """Admission by cost: a request whose nominal token-forwards exceed --max-request-cost is refused, naming
        the limit and the value, before it takes any of the worker."""
        limit = self.defaults.max_request_cost
        if limit and cost > limit:
            raise APIError(400, f"this request implies {cost:,} token-forwards (from its {what}), more than this "
                                f"server's limit --max-request-cost {limit:,}: ask for less, or split it",
                           param=param, code="request_too_costly")

    # ------------------------------------------------------------ generated tokens' log-probabilities
    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tok.decode([token_id])
        return text

    def logprobs(self, kind: str, st: "_Choice") -> dict | None:
        """A choice's ``logprobs`` in the OpenAI shape of ``kind`` for its answer tokens (cut at a stop string as
        its text is): each token's log-probability at the denoising step that committed it, and the top
        alternatives of that same step (docs/api.md). None when the engine has none (a row cancelled unstarted)."""
        entries = st.logprobs
        if entries is None or len(entries) < len(st.token_ids):
            return None
        entries = entries[:len(st.token_ids)]
        text = self.token_text
        if kind == "chat":
            def item(t: int, lp: float) -> dict:
                s = text(t)
                return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", "replace"))}
            return {"content": [{**item(t, lp), "top_logprobs": [item(a, alp) for a, alp in top]}
                                for t, lp, top in entries], "refusal": None}
        tokens = [text(t) for t, _, _ in entries]
        offsets, at = [], 0
        for s in tokens:
            offsets.append(at)
            at += len(s)
        tops = [{text(t): lp, **{text(a): alp for a, alp in top}} for t, lp, top in entries]
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries], "top_logprobs": tops,
                "text_offset": offsets}

    # ------------------------------------------------------------ tokenizer endpoints (vLLM's shapes)
    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise APIError(404, f"The model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def tokenize(self, body) -> dict:
        req = parse_body(TokenizeRequest, body)
        self._check_model(req.model)
        text = req.prompt if req.prompt is not None else "".join(m.text() for m in req.messages)
        if len(text) > self.max_prompt_chars:
            raise APIError(400, f"the text ({len(text)} characters) is far longer than the model's maximum sequence "
                                f"length ({self.engine.max_sequence_length} tokens)", param="prompt")
        if req.prompt is not None:
            ids = self.tok(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        else:
            msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
            try:
                ids = apply_chat_template(self.tok, msgs, req.add_generation_prompt)
            except Exception as e:
                raise APIError(400, f"messages: the chat template rejected them: {e}", param="messages")
        return {"count": len(ids), "max_model_len": self.engine.max_sequence_length, "tokens": list(ids),
                "token_strs": self.tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}

    def detokenize(self, body) -> dict:
        req = parse_body(DetokenizeRequest, body)
        self._check_model(req.model)
        vocab = len(self.tok)
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens: {bad} is not a token id of this model (0 to {vocab - 1})", param="tokens")
        return {"prompt": self.tok.decode(req.tokens)}

    def tokenizer_info(self) -> dict:
        t = self.tok
        return {"tokenizer_class": type(t).__name__, "eos_token": t.eos_token, "bos_token": t.bos_token,
                "pad_token": t.pad_token, "unk_token": t.unk_token, "chat_template": t.chat_template,
                "model_max_length": self.engine.max_sequence_length, "vocab_size": len(t),
                "stop_token_ids": list(self.engine.stop_ids), "mask_token_id": self.engine.mask_id}

    # ------------------------------------------------------------ rows -> events
    on_tokens = None        # optional callback(completion tokens, nfe) per answered request (metrics)

    def _counted(self, emit):
        """``emit`` that also reports each answer's tokens (a response, or a stream's usage event) to on_tokens."""
        on_tokens = self.on_tokens
        if on_tokens is None:
            return emit

        def counted(kind: str, data, last: bool) -> None:
            if last or kind == "response":         # usage comes with a response or a stream's last events
                u = data.get("usage") if kind != "error" else None
                if u is None and kind == "chunk" and "response" in data:    # a Responses stream's completion
                    u = data["response"].get("usage")
                if u:
                    on_tokens(u.get("completion_tokens", u.get("output_tokens")) or 0,
                              sum(c.get("nfe", 0) for c in data.get("choices", ())))
            emit(kind, data, last)
        return counted

    def submit(self, prep: Prepared, emit=None, wait: bool = True) -> "Run":
        """Queue the request's rows; raises APIError(429) when the queue is full (nothing is queued then).
        ``wait=False``: part of a batch formed upstream, start without waiting for more rows (Batcher.submit).

        ``emit(kind, data, last)`` receives the request's events on the event loop as they happen (see :class:`Run`);
        without it, iterate the Run (common/openai_http.py events)."""
        run = Run(self, prep, emit)
        run.emit = self._counted(run.emit)
        if prep.responses is not None:
            run.emit = ResponsesEvents(prep.responses, prep.rid, self.model_name, prep.created, run.emit)
        progress = prep.req.stream or bool(prep.req.stop)
        run.jobs = [Job(ids, p, sink=run.on_row, index=i, wants_progress=progress,
                        score=prep.scores[i] if prep.scores else None, cost=prep.costs[i] if prep.costs else 0)
                    for i, (ids, p) in enumerate(zip(prep.prompts, prep.params))]
        if self.batcher.queue_depth + len(run.jobs) > self.batcher.max_queue:
            raise APIError(429, f"the worker queue is full ({self.batcher.max_queue} rows waiting)",
                           headers={"Retry-After": "1"})
        run.start()
        for j in run.jobs:
            self.batcher.submit(j, wait=wait)
        return run


class Run:
    """A submitted request: turns its rows' events into OpenAI events, synchronously, on the event loop (no task
    per request). Events are ``emit(kind, data, last)`` calls: ("chunk", dict) ... when streaming, else one
    ("response", dict), or ("error", (status, body)); ``last`` is True on the request's final event.
    Without an ``emit``, iterate the Run. :meth:`cancel` drops the rows that are still queued or running."""

    def __init__(self, serving: Serving, prep: Prepared, emit=None):
        self.serving, self.prep = serving, prep
        self.jobs: list[Job] = []
        self.finished = False
        self.sent_bytes = False
        self._box: EventBox | None = None
        if emit is None:
            self._box = EventBox()
            emit = self._push
        self.emit = emit

    def _push(self, kind: str, data, last: bool) -> None:
        if kind == "error":
            self._box.push((None, "error", data[0], data[1], last))
        else:
            self._box.push((None, kind, 200, data, last))

    def __aiter__(self):
        """The events of a Run made without ``emit``, as common/openai_http.py reads them."""
        return self._box

    def cancel(self) -> None:
        for j in self.jobs:
            self.serving.batcher.cancel(j)

    def start(self) -> None:
        prep = self.prep
        self.states = [_Choice(self.serving.decode, prep.req.stop) for _ in self.jobs]
        self.remaining = len(self.jobs)
        if prep.req.stream and prep.kind == "chat":
            for i in range(len(self.jobs)):
                self.emit("chunk", chunk("chat", prep.rid, self.serving.model_name, prep.created, i, "", first=True),
                          False)

    def on_row(self, i: int, what: str, payload) -> None:
        """A row's event from the batcher: ("progress", final_ids), ("done", Result) or ("error", (status, msg))."""
        if self.finished:
            return
        try:
            self._on_row(i, what, payload)
        except Exception as e:      # a bug must still answer the request, and never reach the batcher
            log.exception("request %s: event handling failed", self.prep.rid)
            self._finish_error(500, f"internal error: {type(e).__name__}")

    def _finish_error(self, status: int, message: str) -> None:
        self.finished = True
        self.cancel()
        self.emit("error", (status, APIError(status, message).body()), True)

    def _on_row(self, i: int, what: str, payload) -> None:
        prep, serving = self.prep, self.serving
        req, kind, stream = prep.req, prep.kind, prep.req.stream
        st = self.states[i]
        if what == "error":
            self._finish_error(*payload)
            return
        if prep.scores is not None:
            self._on_score(i, payload)
            return
        if what == "progress":
            if st.stopped:
                return
            delta = st.progress(payload)
            if st.stopped:      # a stop string appeared: the row can stop decoding
                serving.batcher.cancel(self.jobs[i])
        else:
            delta = st.finish(payload)
            self.remaining -= 1
        done = self.remaining == 0
        name = serving.model_name
        if stream:
            if delta:
                self.emit("chunk", chunk(kind, prep.rid, name, prep.created, i, delta), False)
            if what == "done":
                extra = {"nfe": st.nfe}
                if req.return_token_ids:
                    extra["token_ids"] = st.token_ids
                if req.token_logprobs is not None:     # all of the choice's tokens, with its last chunk
                    extra["logprobs"] = serving.logprobs(kind, st)
                last = done and not req.include_usage
                self.emit("chunk", chunk(kind, prep.rid, name, prep.created, i,
                                         "" if kind == "completion" else None, st.finish_reason, extra=extra), last)
        if not done:
            return
        self.finished = True
        states = self.states
        use = usage(sum(len(p) for p in prep.prompts[::prep.req.n]), sum(len(s.token_ids) for s in states))
        if stream:
            if req.include_usage:
                self.emit("chunk", usage_chunk(kind, prep.rid, name, prep.created, use), True)
            return
        choices = [completion_choice(kind, i, s.text, s.finish_reason, s.nfe,
                                     s.token_ids if req.return_token_ids else None) for i, s in enumerate(states)]
        if req.token_logprobs is not None:
            for c, s in zip(choices, states):
                c["logprobs"] = serving.logprobs(kind, s)
        self.emit("response", response(kind, prep.rid, name, choices, use, prep.created), True)


    def _on_score(self, i: int, result) -> None:
        from worker.engine.likelihood import ScoreResult
        if not isinstance(result, ScoreResult):       # cancelled before or while scoring
            self._finish_error(499, "the request was cancelled")
            return
        self.states[i] = result
        self.remaining -= 1
        if self.remaining:
            return
        self.finished = True
        prep, serving = self.prep, self.serving
        choices = [score_choice(serving, i, prep.req, prep.scores[i], r) for i, r in enumerate(self.states)]
        use = usage(sum(len(p) for p in prep.prompts), sum(1 for s in prep.scores if s.next_token))
        self.emit("response", response("completion", prep.rid, serving.model_name, choices, use, prep.created), True)


def score_choice(serving: Serving, index: int, req: CompletionRequest, sr, res) -> dict:
    """One choice of a scoring response, in the OpenAI completions ``logprobs`` shape (docs/api.md):
    ``token_logprobs`` hold the estimate spread over the positions so that the sum from any estimated split to the
    end of the prompt equals that split's estimate; ``top_logprobs`` hold one entry per position, the prompt's token,
    whose value is null where the reference's greedy check fails (lm-eval's is_greedy test reads exactly that)."""
    tok, ids = serving.tok, sr.ids
    n = len(ids)
    strs = tok.batch_decode([[t] for t in ids])
    values: list = [None] * n
    greedy: list = [None] * n
    bounds = sorted(sr.splits) + [n]
    est = dict(zip(sr.splits, res.log_likelihoods))
    est[n] = 0.0
    for a, b in zip(bounds, bounds[1:]):
        v = (est[a] - est[b]) / (b - a)
        g = bool(res.greedy[sr.splits.index(a)])      # unchecked: False, as the reference's is_check_greedy=False
        for p in range(a, b):
            values[p] = v
            greedy[p] = g if p == a else True
    top = [None if values[p] is None else {strs[p]: values[p] if greedy[p] else None} for p in range(n)]
    text = req.prompt if isinstance(req.prompt, str) else tok.decode(ids)
    tokens, token_logprobs = list(strs), values
    if sr.next_token:
        t = tok.decode([res.next_token])
        tokens.append(t)
        token_logprobs = values + [res.next_logprob]
        top.append({t: res.next_logprob})
        text += t
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"index": index, "text": text, "finish_reason": "length",
            "logprobs": {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
                         "text_offset": offsets},
            "score": {"splits": sr.splits, "log_likelihoods": res.log_likelihoods,
                      "is_greedy": [None if g is None else bool(g) for g in res.greedy], "mc_num": sr.mc_num,
                      "mc_batch_size": sr.batch_size, "cfg_scale": sr.cfg_scale, "seed": sr.seed,
                      "forward_rows": res.forward_rows}}


class _Choice:
    """Text state of one choice: incremental detokenisation, stop strings, and what was already streamed."""

    def __init__(self, decode, stops: list[str]):
        self._decode = decode       # ids -> text (special tokens skipped)
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = 0               # characters already streamed
        self.text = ""
        self.token_ids: list[int] = []
        self.stopped = False        # a stop string was found: text and token_ids are final
        self.finish_reason: str | None = None
        self.nfe = 0
        self.logprobs: list | None = None     # the engine's per-token entries (asked only)

    def _apply(self, ids: list[int]) -> None:
        text = self._decode(ids)
        hits = [h for h in (text.find(s) for s in self.stops) if h >= 0]
        if hits:
            cut = min(hits)
            self.text, self.token_ids, self.stopped = text[:cut], self._ids_for(ids, cut), True
        else:
            self.text, self.token_ids = text, list(ids)

    def _ids_for(self, ids: list[int], nchars: int) -> list[int]:
        """The longest prefix of ids whose text lies within the first nchars characters: the tokens of the text
        returned, never the token that holds (part of) the stop string."""
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self._decode(ids[:mid])) <= nchars:
                lo = mid
            else:
                hi = mid - 1
        return ids[:lo]

    def _delta(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        d = self.text[self.sent:upto]
        self.sent = upto
        return d

    def progress(self, ids: list[int]) -> str:
        """The final prefix grew to ``ids``: the text that can be streamed now."""
        self._apply(ids)
        if self.stopped:
            return self._delta(len(self.text))
        safe = len(self.text) - self.hold          # might be the start of a stop string
        while safe > self.sent and self.text[safe - 1] == "\ufffd":   # an incomplete multi-byte character
            safe -= 1
        return self._delta(safe)

    def finish(self, result) -> str:
        self.nfe = result.nfe
        self.logprobs = getattr(result, "logprobs", None)
        if not self.stopped:
            self._apply(result.token_ids)
        if self.stopped:
            self.finish_reason = "stop"
        else:
            self.finish_reason = "stop" if result.finish_reason in ("stop", "cancelled") else "length"
        return self._delta(len(self.text))


def _mmap_threshold(nbytes: int) -> None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, nbytes)        # M_MMAP_THRESHOLD (glibc); fixed from then on
    except (OSError, AttributeError):   # not glibc
        pass


@contextlib.contextmanager
def freed_memory_returned():
    """While likelihood scoring runs (thousands of forwards whose activations are freed and allocated again on the
    device thread), glibc mmaps blocks of 1 MiB and more and gives them back when freed. Otherwise glibc raises its
    mmap threshold as such blocks are freed and the device thread's arena keeps their memory: a long scoring request
    grew a worker by 1.8 GB in 25 s (docs/reliability.md). Afterwards the threshold is 32 MiB (glibc's own ceiling),
    so generation allocates as before (a low threshold for everything cost CPU generation 10-60%)."""
    _mmap_threshold(1 << 20)
    try:
        yield
    finally:
        _mmap_threshold(32 << 20)


# ---------------------------------------------------------------- the queue and the device thread
@dataclass(eq=False)      # a row is itself: identity, not field-by-field equality (queue and batch lookups)
class Job:
    """One row: a prompt with its parameters. Events go to ``sink(index, kind, payload)`` on the event loop:
    ("progress", final_ids) while decoding, then ("done", Result) or ("error", (status, message))."""
    prompt_ids: list[int]
    params: GenerationParams
    sink: object
    index: int = 0
    wants_progress: bool = True       # False: only the final result matters (non-streaming, no stop strings)
    cancelled: bool = False
    queued: bool = False              # waiting in the batcher (not yet in a batch)
    enqueued_at: float = field(default_factory=time.monotonic)
    start_by: float = 0.0             # the scheduler waits for more rows until then (at most)
    score: object = None              # a likelihood.ScoreRequest: a scoring row (params unused); "done" gives a
                                      # ScoreResult
    cost: int = 0                     # nominal token-forwards (Serving._check_cost); above long_row_cost: "long"


def canvas_tokens(job: Job) -> int:
    """A row's canvas in tokens (prompt + max_tokens in whole blocks): what it holds of the device's memory."""
    p = job.params
    if p is None:
        return len(job.prompt_ids)
    block = max(1, min(p.block_length, p.gen_length))
    return len(job.prompt_ids) + -(-p.gen_length // block) * block


class Batcher:
    """The worker's queue and its device thread. With ``continuous`` (the default) rows also join the running batch
    between denoising steps (worker/engine/engine.py ``Feed``), in queue order, while they fit ``batch_size`` rows
    and ``max_batch_tokens`` canvas tokens; a row whose algorithm is not running starts its own group beside the
    others (the groups take their steps in turn). Scoring rows run in batches of their own: one queued lets
    generation rows join ahead of it for at most ``switch_wait`` seconds, then the batch drains and it goes next.
    Finished rows leave the batch and are answered at once.

    Fair share: rows whose nominal cost exceeds ``long_row_cost`` token-forwards hold at most ``long_row_share`` of
    the batch's ``batch_size`` rows (at least one); past that a long row waits in the queue while shorter rows behind
    it take the free places, so a short request is never held behind long ones (long rows keep their order)."""

    def __init__(self, engine: Engine, *, batch_size: int = 8, max_wait_time: float = 0.05, max_queue: int = 1024,
                 loop: asyncio.AbstractEventLoop | None = None, continuous: bool = True, max_batch_tokens: int = 0,
                 switch_wait: float = 1.0, long_row_cost: int = 1 << 20, long_row_share: float = 0.5):
        self.engine = engine
        self.batch_size = batch_size
        self.max_wait_time = max_wait_time
        self.max_queue = max_queue
        self.continuous = continuous
        self.max_batch_tokens = max_batch_tokens       # 0: no limit
        self.switch_wait = switch_wait                 # seconds a row of another algorithm lets rows join ahead of it
        self.long_row_cost = long_row_cost             # 0: every row alike
        self.long_slots = max(1, int(batch_size * long_row_share))
        self.pending: collections.deque[Job] = collections.deque()
        self._lock = threading.Lock()     # ``pending`` is also taken from by the device thread (joining rows)
        self.running: list[Job] = []
        self.rows_joined = 0              # rows that joined a running batch
        self.rows_retired = 0             # rows that finished (every row, joined or not)
        self._per_second: collections.deque[list] = collections.deque()   # [second, joined, retired], last 60 s
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="device")
        self._task: asyncio.Task | None = None
        self._loop = loop
        # statistics
        self.batches_processed = 0
        self.rows_processed = 0
        self.dropped_before_start = 0
        self.histogram: collections.Counter[int] = collections.Counter()
        self._cancelled_queued = 0      # cancelled rows still in ``pending`` (dropped at the next scheduling)
        self.on_batch = None    # optional callback(batch_size, seconds) for metrics

    # ------------------------------------------------------------ public
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._schedule(), name="batcher")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True, cancel_futures=True)

    def submit(self, job: Job, wait: bool = True) -> None:
        """Queue a row (the caller checked that the request's rows fit ``max_queue``: Serving.submit answers 429
        otherwise). ``wait=False``: the row arrived as part of a batch formed upstream (the balancer's), so waiting
        ``max_wait_time`` for company would only add latency."""
        p = job.params
        if p is not None and p.seed is None and needs_rng(p):
            # A fixed seed per row makes a retried batch (after CUDA OOM) give the same tokens it already streamed.
            job.params = replace(p, seed=random.getrandbits(63))
        job.enqueued_at = time.monotonic()
        job.start_by = job.enqueued_at + (self.max_wait_time if wait else 0.0)
        job.queued = True
        with self._lock:
            self.pending.append(job)
        self._wake.set()

    def cancel(self, job: Job) -> None:
        """Drop a row: before it is scheduled it is never computed; while running, at the next denoising step."""
        if job.cancelled:
            return
        job.cancelled = True
        if job.queued:
            self._cancelled_queued += 1
            self._wake.set()

    @property
    def queue_depth(self) -> int:
        return len(self.pending) - self._cancelled_queued

    def rates(self, window: int = 60) -> dict:
        """Rows running now, and rows joined / retired per second over the last ``window`` seconds (up to 60)."""
        now = int(time.monotonic())
        recent = [b for b in self._per_second if now - b[0] < window]
        return {"rows_running": len(self.running),
                "rows_joined_per_s": round(sum(b[1] for b in recent) / window, 3),
                "rows_retired_per_s": round(sum(b[2] for b in recent) / window, 3),
                "rows_joined": self.rows_joined, "rows_retired": self.rows_retired}

    def _count(self, which: int) -> None:
        """One row joined (1) or retired (2), in this second's bucket (60 buckets kept: O(1) per row)."""
        now = int(time.monotonic())
        buckets = self._per_second
        if not buckets or buckets[-1][0] != now:
            buckets.append([now, 0, 0])
            while now - buckets[0][0] >= 60:
                buckets.popleft()
        buckets[-1][which] += 1

    @property
    def busy(self) -> bool:
        return bool(self.running)

    async def idle(self) -> None:
        """Wait until nothing is queued or running."""
        while self.pending or self.running:
            await asyncio.sleep(0.02)

    # ------------------------------------------------------------ scheduling
    async def _schedule(self) -> None:
        while True:
            while not self.pending:
                self._wake.clear()
                await self._wake.wait()
            self._drop_cancelled()
            if not self.pending:
                continue
            deadline = self.pending[0].start_by
            while len(self.pending) < self.batch_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except asyncio.TimeoutError:
                    break
                self._drop_cancelled()
            self._drop_cancelled()
            with self._lock:
                batch = self._take(0, 0, 0, first=True)
            if not batch:
                continue
            for j in batch:
                j.queued = False
            self.running = list(batch)
            t = time.monotonic()
            try:
                outcome = await asyncio.get_running_loop().run_in_executor(self._executor, self._run, batch)
            except Exception as e:   # never lose the scheduler or a row
                log.exception("batch failed")
                outcome = [(j, "error", (500, f"internal error: {type(e).__name__}")) for j in batch]
            finally:
                self.running = []
            self.batches_processed += 1
            self.rows_processed += len(batch)
            self.histogram[len(batch)] += 1
            if self.on_batch:
                self.on_batch(len(batch), time.monotonic() - t)
            for job, kind, payload in outcome:      # after the statistics, so a client sees them counted
                self._retired(job)
                job.sink(job.index, kind, payload)

    def is_long(self, job: Job) -> bool:
        return bool(self.long_row_cost) and job.score is None and job.cost > self.long_row_cost

    def _take(self, rows: int, tokens: int, long: int, first: bool = False) -> list[Job]:
        """Under the lock: queued rows, in order, that fit ``batch_size`` rows and ``max_batch_tokens`` beside
        ``rows`` / ``tokens`` running (``long`` of them long), removed from the queue. A long row past its share
        is passed over (shorter rows overtake it); a row past the token budget stops the taking (in order).
        A new batch (``first``) takes scoring rows too (they run first, apart: ``_run``); joining rows pass them
        for ``switch_wait`` seconds, then the batch takes no more and drains."""
        taken, now = [], time.monotonic()
        for j in self.pending:
            if rows + len(taken) >= self.batch_size:
                break
            if j.cancelled:
                continue
            if j.score is not None and not first:
                if now - j.enqueued_at > self.switch_wait:
                    break
                continue
            if self.is_long(j):
                if long >= self.long_slots:
                    continue
                long += 1
            if self.max_batch_tokens:
                need = canvas_tokens(j)
                if (taken or rows) and tokens + need > self.max_batch_tokens:
                    break
                tokens += need
            taken.append(j)
        if taken:
            ids = {id(j) for j in taken}
            self.pending = collections.deque(j for j in self.pending if id(j) not in ids)
        return taken

    def _drop_cancelled(self) -> None:
        """Drop rows cancelled while waiting; each still gets its terminal event (never computed, nfe 0)."""
        if self._cancelled_queued:
            with self._lock:
                dropped = [j for j in self.pending if j.cancelled]
                self.pending = collections.deque(j for j in self.pending if not j.cancelled)
                self._cancelled_queued = 0
            for j in dropped:
                j.queued = False
                self.dropped_before_start += 1
                j.sink(j.index, "done", Result([], "cancelled", 0, [], len(j.prompt_ids)))

    # ------------------------------------------------------------ device thread
    def _emit(self, job: Job, kind: str, payload) -> None:
        self._loop.call_soon_threadsafe(job.sink, job.index, kind, payload)

    def _run(self, jobs: list[Job]) -> list[tuple[Job, str, object]]:
        """Device thread: run one batch; progress goes to the loop as it happens, the terminal events are
        returned ((job, "done", Result) or (job, "error", (status, message)))."""
        import torch

        scoring = [j for j in jobs if j.score is not None]
        if scoring:
            jobs = [j for j in jobs if j.score is None]
            out = self._score(scoring)
            return out + (self._run(jobs) if jobs else [])

        feed = _Feed(self, jobs) if self.continuous else None
        rows = feed.jobs if feed is not None else jobs        # grows as rows join

        def progress(i, ids):
            if rows[i].wants_progress:
                if feed is not None:      # in order with the batch's other events
                    feed.post(rows[i].sink, rows[i].index, "progress", ids)
                else:
                    self._emit(rows[i], "progress", ids)
        hooks = StepHooks(on_progress=progress, is_cancelled=lambda i: rows[i].cancelled)
        try:
            results: list[Result] = self.engine.generate([Request(j.prompt_ids, j.params) for j in jobs], hooks=hooks,
                                                         **({"feed": feed} if feed is not None else {}))
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            left = feed.unfinished() if feed is not None else jobs     # rows already answered keep their answer
            if len(left) == 1:
                log.error("CUDA out of memory on a single row (prompt %d tokens)", len(left[0].prompt_ids))
                return [(left[0], "error", (503, "the GPU ran out of memory on this request alone; "
                                                 "try a shorter prompt or fewer max_tokens"))]
            half = len(left) // 2
            log.warning("CUDA out of memory on a batch of %d: retrying as %d + %d", len(left), half, len(left) - half)
            return self._run(left[:half]) + self._run(left[half:]) if left else []
        except Exception as e:  # a bug: report to every row of this batch not yet answered, keep serving
            log.exception("engine failure on a batch of %d", len(rows))
            left = feed.unfinished() if feed is not None else jobs
            return [(j, "error", (500, f"internal error during generation: {type(e).__name__}: {e}")) for j in left]
        if feed is not None:      # every row was answered as it finished; one that was not is a bug, never silent
            left = feed.unfinished()
            if left:
                log.error("%d joined rows were not answered by the engine", len(left))
            return [(j, "error", (500, "internal error: the engine ended without answering this row"))
                    for j in left]
        return [(j, "done", r) for j, r in zip(jobs, results)]

    def _joined(self, job: Job) -> None:        # on the event loop
        self.running.append(job)
        self.rows_joined += 1
        self.rows_processed += 1
        self._count(1)

    def _retired(self, job: Job) -> None:       # on the event loop
        if job in self.running:
            self.running.remove(job)
        self.rows_retired += 1
        self._count(2)

    def _score(self, jobs: list[Job]) -> list[tuple[Job, str, object]]:
        """Device thread: the scoring rows of a batch, their forwards shared (worker.engine.likelihood)."""
        import torch
        try:
            with freed_memory_returned():
                results = self.engine.score([j.score for j in jobs], cancelled=lambda i: jobs[i].cancelled)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            if len(jobs) == 1:
                return [(jobs[0], "error", (503, "the GPU ran out of memory scoring this prompt alone"))]
            half = len(jobs) // 2
            return self._score(jobs[:half]) + self._score(jobs[half:])
        except Exception as e:
            log.exception("scoring failure on %d rows", len(jobs))
            return [(j, "error", (500, f"internal error during scoring: {type(e).__name__}: {e}")) for j in jobs]
        return [(j, "done", r if r is not None else Result([], "cancelled", 0, [], len(j.prompt_ids)))
                for j, r in zip(jobs, results)]


class _Feed:
    """The engine's Feed for one batch (device thread): rows join from the head of the queue, finished rows are
    answered at once. Index i names ``jobs[i]``: the batch's rows first, then the joined ones."""

    def __init__(self, batcher: Batcher, jobs: list[Job]):
        self.b = batcher
        self.jobs = list(jobs)
        self.answered: set[int] = set()
        self.long = sum(1 for j in jobs if batcher.is_long(j))     # long rows running (fair share)
        self._events: list = []            # (function, args) for the event loop, in order
        self._posted = False               # a flush is scheduled
        self._lock = threading.Lock()

    def post(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the event loop, in order with the batch's other events; one wake-up of the loop
        carries every event posted until it runs (not one per row)."""
        with self._lock:
            self._events.append((fn, args))
            if self._posted:
                return
            self._posted = True
        self.b._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            events, self._events, self._posted = self._events, [], False
        for fn, args in events:
            fn(*args)

    def admit(self, rows: int, tokens: int) -> list[tuple[int, Request]]:
        """Queued rows, in order, that fit ``batch_size`` rows and ``max_batch_tokens`` with the ``rows`` /
        ``tokens`` running. Scoring rows never join (they run in batches of their own): they let generation rows
        join ahead of them for ``switch_wait`` seconds, then the batch takes no more and drains."""
        b = self.b
        out = []
        with b._lock:
            taken = b._take(rows, tokens, self.long)
            for j in taken:
                self.long += b.is_long(j)
                j.queued = False
                out.append((len(self.jobs), Request(j.prompt_ids, j.params)))
                self.jobs.append(j)
        for j in taken:
            self.post(b._joined, j)
        return out

    def done(self, index: int, result: Result) -> None:
        j = self.jobs[index]
        self.answered.add(index)
        self.long -= self.b.is_long(j)
        self.post(self._answer, j, result)

    def _answer(self, j: Job, result: Result) -> None:      # on the event loop
        self.b._retired(j)
        j.sink(j.index, "done", result)

    def unfinished(self) -> list[Job]:
        return [j for i, j in enumerate(self.jobs) if i not in self.answered]

