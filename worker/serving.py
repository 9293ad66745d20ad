"""OpenAI semantics over the engine: request → rows (tokenisation, chat template, parameters) → jobs for the row
scheduler (worker/scheduler.py) → events (stream chunks or one response). Used by the worker's /v1 endpoints and by
/worker/batch alike."""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field, replace

from common.protocol import (MAX_ROWS, APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                             ResponsesRequest, TokenizeRequest, as_responses_error, chunk, completion_choice, new_id,
                             parse_body, parse_request, response, usage, usage_chunk)
from common.openai_http import Event, EventBox
from worker.engine import Engine, GenerationParams, ParamError
from worker.engine.likelihood import cost as score_cost
from worker.engine.params import LOGPROB_ENTRY_COST, Plan, context_exceeded, logprobs_cost, row_cost, with_seed
from worker.responses import ResponsesEvents
from worker.scheduler import Job, RowScheduler
from worker.tokenizer import apply_chat_template, max_token_chars, takes_content_parts, text_decoder, token_pieces

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
    plans: list[Plan] | None = None # per row, the engine's plan (made once, here: validation and the schedule)


class Serving:
    def __init__(self, engine: Engine, batcher: RowScheduler, model_name: str, defaults: Defaults,
                 aliases: tuple[str, ...] = ()):
        self.engine, self.batcher, self.model_name, self.defaults = engine, batcher, model_name, defaults
        self.names = {model_name, *aliases}
        self.tok = engine.tokenizer
        self.decode = text_decoder(self.tok)
        self.decode_special = text_decoder(self.tok, skip_special_tokens=False)   # skip_special_tokens: false
        self._token_texts: dict[int, str] = {}      # id -> its text alone (logprobs)
        # A text longer than this cannot fit the context whatever it holds: refused before the tokenizer spends
        # seconds on it (4x margin for normalisation that merges characters).
        self.chars_per_token = 4 * max_token_chars(self.tok)      # (at most, margin included)
        self.max_prompt_chars = self.chars_per_token * engine.max_sequence_length

    def _messages(self, messages) -> list[dict]:
        """Chat messages as the template gets them: developer as system; text parts as a list for a template that
        reads parts, else joined by newlines (vLLM's and SGLang's rule)."""
        parts = takes_content_parts(self.tok)
        out = []
        for m in messages:
            d = {"role": "system" if m.role == "developer" else m.role, "content": m.template_content(parts)}
            if m.name is not None:
                d["name"] = m.name
            if m.reasoning_content is not None:       # (a template with a thinking section renders it)
                d["reasoning_content"] = m.reasoning_content
            out.append(d)
        return out

    def check_version(self, wanted: str | None) -> None:
        """A request that requires weights (``model_version``: a hash) this worker does not hold: 409."""
        have = getattr(self.engine, "version", None) or {}
        if wanted is not None and wanted != have.get("hash"):
            raise APIError(409, f"model_version {wanted!r} is not what this worker serves ({have.get('hash')!r}, "
                                f"from {have.get('path')!r})", param="model_version",
                           code="model_version_unavailable")

    def _versioned(self, emit):
        """``emit`` that stamps every answer object with the weights that produced it: ``model_version``
        ({"path", "hash"}) and ``system_fingerprint`` (the hash; OpenAI's field for the backend's configuration).
        Weights change only while no row runs (Engine.reload_weights), so the version at emit time is the one that
        computed the answer."""
        def versioned(kind: str, data, last: bool) -> None:
            v = getattr(self.engine, "version", None)
            if v is not None and kind != "error":
                data["model_version"] = v
                data["system_fingerprint"] = v["hash"]
            emit(kind, data, last)
        return versioned

    # ------------------------------------------------------------ request -> rows
    def prepare(self, kind: str, body, req=None) -> Prepared:
        """``req``: the body already validated by parse_request(kind, body), when the caller has it."""
        if kind == "responses":
            r = req or parse_request("responses", body)
            try:
                prep = self.prepare("chat", r.chat_body())
            except APIError as e:
                raise as_responses_error(e) from None
            prep.responses, prep.rid = r, new_id("resp", "_")
            return prep
        req = req or parse_request(kind, body)
        self.check_version(req.model_version)
        if req.model is not None and req.model not in self.names:
            raise APIError(404, f"The model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found", type="invalid_request_error")
        # chat: the messages make one prompt; completions: each prompt is its own row
        chars = (sum(len(m.text()) for m in req.messages) if kind == "chat"
                 else max((len(p) for p in req.prompts() if isinstance(p, str)), default=0))
        if chars > self.max_prompt_chars:
            # (its tokens are not counted: at least this many, which is past the context)
            raise APIError(400, context_exceeded(self.engine.max_sequence_length, chars // self.chars_per_token,
                                                 note=f" or more ({chars} characters)"),
                           param="messages" if kind == "chat" else "prompt", code="context_length_exceeded")
        if kind == "chat":
            self._check_message_count(len(req.messages), "messages")
            msgs = self._messages(req.messages)
            try:
                prompts = [apply_chat_template(self.tok, msgs, req.add_generation_prompt, req.continue_final_message,
                                               req.chat_template_kwargs)]
            except Exception as e:   # jinja errors from the template (e.g. role order)
                raise APIError(400, f"messages: the chat template rejected them: {e}", param="messages")
        else:
            given = req.prompts()
            if not req.scoring and len(given) * req.n > MAX_ROWS:
                raise APIError(400, f"{len(given)} prompts x n={req.n} is more than {MAX_ROWS} choices in one "
                                    f"request", param="n")
            prompts = []
            for p in given:     # each checked as it is encoded: a request of many long prompts fails at the first
                ids = (self.tok(p, add_special_tokens=req.add_special_tokens)["input_ids"] if isinstance(p, str)
                       else list(p))
                if not ids:
                    raise APIError(400, "prompt: the prompt encodes to no tokens", param="prompt")
                if len(ids) > self.engine.max_sequence_length:
                    raise APIError(400, context_exceeded(self.engine.max_sequence_length, len(ids)), param="prompt",
                                   code="context_length_exceeded")
                prompts.append(ids)
        if kind == "completion" and req.scoring:
            return self._prepare_scoring(req, prompts)
        n = req.n
        plans, costs, entries = [], [], 0
        for ids in prompts:
            pl = self._params(req, ids)
            costs += [row_cost(pl)] * n
            entries += logprobs_cost(pl) * n
            # choice j of a seeded request uses seed + j: reproducible, and distinct when sampling
            plans += [pl if j == 0 or pl.params.seed is None else with_seed(pl, (pl.params.seed + j) % (1 << 63))
                      for j in range(n)]
        if entries and sum(costs) <= self.defaults.max_request_cost < sum(costs) + entries:
            self._check_cost(sum(costs) + entries, "top_logprobs" if kind == "chat" else "logprobs",
                             f"max_tokens x n x top logprobs alternatives at {LOGPROB_ENTRY_COST} each, with its "
                             f"prompt length + max_tokens, steps, n and cfg_scale")
        self._check_cost(sum(costs) + entries, "max_tokens", "prompt length + max_tokens, steps, n, cfg_scale and "
                                                             "logprobs")
        prompts = [ids for ids in prompts for _ in range(n)]
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return Prepared(kind, req, prompts, [pl.params for pl in plans], rid=new_id(prefix), costs=costs,
                        plans=plans)

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
                raise APIError(400, context_exceeded(limit, n, int(nxt) or None), param="prompt",
                               code="context_length_exceeded")
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

    def _params(self, req, ids: list[int]) -> Plan:
        """The row's plan from the request's fields and the server's defaults (400 naming the field if invalid)."""
        d = self.defaults
        limit = self.engine.max_sequence_length - len(ids)
        max_new = req.max_new_tokens
        # the request's, else the block size the checkpoint was trained with (SDAR), else the server's default
        block = req.block_length or self.engine.default_block_length or d.block_length
        prompt_param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        stops = frozenset(req.stop_token_ids or ())
        if stops:
            vocab = len(self.tok)
            bad = next((t for t in stops if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"stop_token_ids: {bad} is not a token id of this model (0 to {vocab - 1})",
                               param="stop_token_ids")
        if max_new is None:
            if limit < 1:
                raise APIError(400, context_exceeded(self.engine.max_sequence_length, len(ids)), param=prompt_param,
                               code="context_length_exceeded")
            # the default: as long as allowed and whole blocks that fit the context by the algorithm's length rule
            # (a shorter single block when not even one full block fits), never a length the context cannot hold:
            # at most a block shorter than what is left
            max_new = min(d.max_tokens, limit)
            algorithm = req.generation_algorithm or d.algorithm
            for _ in range(min(block, max_new) - 1 if block <= self.engine.max_sequence_length else 0):
                if self.engine.positions(algorithm, len(ids), max_new, block) <= self.engine.max_sequence_length:
                    break
                max_new -= 1
        p = GenerationParams(
            gen_length=max_new, block_length=block, steps=req.steps,
            algorithm=req.generation_algorithm or d.algorithm,
            temperature=req.temperature or 0.0, remasking=req.remasking or "low_confidence",
            cfg_scale=req.cfg_scale or 0.0, threshold=req.threshold, factor=req.factor,
            seed=None if req.seed is None else req.seed % (1 << 63),
            ignore_eos=req.ignore_eos, stop_token_ids=stops, extra=dict(req.algorithm_params or {}),
            filters=req.filters,
            logprobs=req.token_logprobs)
        try:
            pl = self.engine.plan(ids, p)
        except ParamError as e:
            param = e.param
            if param == "max_tokens" and req.max_new_tokens is None:
                # the default's shorter single block does not suit a family that takes whole blocks only
                # (DiffusionGemma's canvases): whole blocks that fit, else the prompt leaves no room
                whole = (limit // block) * block
                if 0 < whole < max_new:
                    try:
                        return self.engine.plan(ids, replace(p, gen_length=whole))
                    except ParamError:
                        pass
                raise APIError(400, context_exceeded(self.engine.max_sequence_length, len(ids),
                                                     note=f", which leave no room for a whole block of {block} "
                                                          f"tokens to generate"),
                               param=prompt_param, code="context_length_exceeded")
            if param == "max_tokens" and req.max_completion_tokens is not None:
                param = "max_completion_tokens"
            raise APIError(400, e.message, param=param, code=e.code)
        return pl

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
        alternatives of that same step (docs/api.md). Each token's string is its text in context
        (:func:`worker.tokenizer.token_pieces`), so the tokens join to the answer's text, ``text_offset`` points into
        it and a chat token's ``bytes`` join to its UTF-8; an alternative's string is its text in the same place (a
        special token's, its own name). None when the engine has none (a row cancelled unstarted)."""
        entries = st.logprobs
        if entries is None or len(entries) < len(st.token_ids):
            return None
        entries = entries[:len(st.token_ids)]
        pieces, alts = token_pieces(st.decode, [t for t, _, _ in entries], [[a for a, _ in top]
                                                                             for _, _, top in entries])
        # the chosen token among its alternatives has its own string (a byte that only begins a character: "",
        # where its text alone would be U+FFFD: a review found it listed twice, under two strings)
        alts = [[s if a == t else p or self.token_text(a) for p, (a, _) in zip(row, top)]
                for s, row, (t, _, top) in zip(pieces, alts, entries)]
        if kind == "chat":
            def item(s: str, lp: float) -> dict:
                return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8", "replace"))}
            return {"content": [{**item(s, lp), "top_logprobs": [item(a, alp) for a, (_, alp) in zip(row, top)]}
                                for s, (_, lp, top), row in zip(pieces, entries, alts)], "refusal": None}
        offsets, at = [], 0
        for s in pieces:
            offsets.append(at)
            at += len(s)
        # the chosen token last: another id whose text is the same never hides its value
        tops = [{**{a: alp for a, (_, alp) in zip(row, top)}, s: lp}
                for s, (_, lp, top), row in zip(pieces, entries, alts)]
        return {"tokens": pieces, "token_logprobs": [lp for _, lp, _ in entries], "top_logprobs": tops,
                "text_offset": offsets}

    # ------------------------------------------------------------ tokenizer endpoints (vLLM's shapes)
    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise APIError(404, f"The model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found", type="invalid_request_error")

    def _check_message_count(self, n: int, param: str, limit: int | None = None) -> None:
        """Every chat template renders each message with at least one token (its role's markers), so more messages
        than the model's context cannot fit it: refused before the template runs (100,000 one-letter messages, a 3 MB
        body, took 6.5 s of the worker's CPU to template and tokenize before the length check refused them).
        ``limit``: another bound (/tokenize counts prompts past the context, up to 4 times it, as its text guard)."""
        limit = self.engine.max_sequence_length if limit is None else limit
        if n > limit:
            raise APIError(400, f"{param}: {n} of them is more than this server takes ({limit}: each message takes "
                                f"at least one token; the model's maximum sequence length is "
                                f"{self.engine.max_sequence_length} tokens)", param=param)

    def tokenize(self, body) -> dict:
        req = parse_body(TokenizeRequest, body)
        self._check_model(req.model)
        text = req.prompt if req.prompt is not None else "".join(m.text() for m in req.messages)   # (its length)
        if len(text) > self.max_prompt_chars:
            raise APIError(400, f"the text ({len(text)} characters) is far longer than the model's maximum sequence "
                                f"length ({self.engine.max_sequence_length} tokens)", param="prompt")
        if req.prompt is not None:
            ids = self.tok(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        else:
            self._check_message_count(len(req.messages), "messages", 4 * self.engine.max_sequence_length)
            msgs = self._messages(req.messages)
            try:
                ids = apply_chat_template(self.tok, msgs, req.add_generation_prompt, req.continue_final_message,
                                          req.chat_template_kwargs)
            except Exception as e:
                raise APIError(400, f"messages: the chat template rejected them: {e}", param="messages")
        return {"count": len(ids), "max_model_len": self.engine.max_sequence_length, "tokens": list(ids),
                "token_strs": self.tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}

    def detokenize(self, body) -> dict:
        req = parse_body(DetokenizeRequest, body)
        self._check_model(req.model)
        limit = self.engine.max_sequence_length      # (a million ids took 2.7 s of the worker's GIL each: a review)
        if len(req.tokens) > limit:
            raise APIError(400, f"tokens: at most the model's context length ({limit}) ids, got {len(req.tokens)}",
                           param="tokens")
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
    on_tokens = None        # optional callback(completion tokens, nfe) per answered request (metrics), streamed
                            # or not, whether or not its client asked for usage

    def submit(self, prep: Prepared, emit=None, wait: bool = True) -> "Run":
        """Queue the request's rows; raises APIError(429) when the queue is full (nothing is queued then).
        ``wait=False``: part of a batch formed upstream, start without waiting for more rows (RowScheduler.submit).

        ``emit(kind, data, last)`` receives the request's events on the event loop as they happen (see :class:`Run`);
        without it, iterate the Run (common/openai_http.py events)."""
        run = Run(self, prep, emit)
        run.emit = self._versioned(run.emit)
        if prep.responses is not None:
            run.emit = ResponsesEvents(prep.responses, prep.rid, self.model_name, prep.created, run.emit)
        progress = prep.req.stream or bool(prep.req.stop)
        steps = getattr(prep.req, "stream_mode", "text") == "steps"
        run.jobs = [Job(ids, p, sink=run.on_row, index=i, wants_progress=progress, wants_steps=steps,
                        score=prep.scores[i] if prep.scores else None, cost=prep.costs[i] if prep.costs else 0,
                        plan=prep.plans[i] if prep.plans else None)
                    for i, (ids, p) in enumerate(zip(prep.prompts, prep.params))]
        if len(run.jobs) > self.batcher.max_queue:      # it could never be queued: a 429 would be retried forever
            raise APIError(400, f"the request has {len(run.jobs)} rows (prompts x n) and this worker queues at most "
                                f"{self.batcher.max_queue} (--max-queue)", param="n")
        if self.batcher.queue_depth + len(run.jobs) > self.batcher.max_queue:
            raise APIError(429, f"the worker queue is full ({self.batcher.max_queue} rows waiting)",
                           headers={"Retry-After": "1"})
        run.start()
        for j in run.jobs:
            self.batcher.submit(j, wait=wait)
        return run


def _push(box: EventBox, kind: str, data, last: bool) -> None:
    """A Run's event into its EventBox (a Run made without ``emit``)."""
    if kind == "error":
        box.push(Event(None, "error", data[0], data[1], last))
    else:
        box.push(Event(None, kind, 200, data, last))


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
            emit = functools.partial(_push, self._box)      # (not a method: no reference back to this Run)
        self.emit = emit

    def _answered(self) -> None:
        """The request has its answer (or its error): later row events are ignored, and the rows are let go. Each
        row holds this Run as its sink, so keeping them would make a reference cycle per request that only a full
        garbage collection frees, and such a pass holds the GIL for 0.1-0.5 s under load (docs/engine.md)."""
        self.finished = True
        self.jobs = []

    def __aiter__(self):
        """The events of a Run made without ``emit``, as common/openai_http.py reads them."""
        return self._box

    def cancel(self) -> None:
        for j in self.jobs:
            self.serving.batcher.cancel(j)

    def start(self) -> None:
        prep = self.prep
        decode = self.serving.decode if prep.req.skip_special_tokens else self.serving.decode_special
        self.states = [_Choice(decode, prep.req.stop) for _ in self.jobs]
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
        self.finished = True        # (first: a row that the cancel answers at once is ignored)
        self.cancel()
        self._answered()
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
        if what == "step":
            self._on_step(i, *payload)
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
        self._answered()
        states = self.states
        use = usage(sum(len(p) for p in prep.prompts[::prep.req.n]), sum(len(s.token_ids) for s in states))
        if getattr(serving.engine, "prefix_cache", None) is not None:
            # each prompt's tokens that came from the cache for every one of its n choices (the first computes
            # what the others then find): vLLM's and OpenAI's prompt_tokens_details
            n = prep.req.n
            use["prompt_tokens_details"] = {"cached_tokens": sum(min(s.cached_tokens for s in states[i:i + n])
                                                                 for i in range(0, len(states), n))}
        if serving.on_tokens is not None:
            serving.on_tokens(use["completion_tokens"], sum(s.nfe for s in states))
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


    def _on_step(self, i: int, window: list[int], settled: int) -> None:
        """Step streaming: a chunk with no text carrying ``diffusion_step``: the step's number, the positions of the
        generation window committed in it (settled positions that were masked, changed, or were a canvas's guesses
        the step before) with their tokens, and the window itself when ``stream_canvas`` asks (docs/api.md)."""
        st, prep, serving = self.states[i], self.prep, self.serving
        if st.stopped:
            return
        mask, prev, before = serving.engine.mask_id, st.window, st.settled
        committed = [{"position": p, "token_id": t, "text": serving.token_text(t)}
                     for p, t in enumerate(window[:settled])
                     if t != mask and (prev is None or p >= before or p >= len(prev) or prev[p] != t)]
        st.steps += 1
        st.window, st.settled = window, settled
        step = {"step": st.steps, "committed": committed}
        if prep.req.stream_canvas:
            step["canvas"] = [None if t == mask else t for t in window]
            step["settled"] = settled
        self.emit("chunk", chunk(prep.kind, prep.rid, serving.model_name, prep.created, i,
                                 "" if prep.kind == "completion" else None, extra={"diffusion_step": step}), False)

    def _on_score(self, i: int, result) -> None:
        from worker.engine.likelihood import ScoreResult
        if not isinstance(result, ScoreResult):       # cancelled before or while scoring
            self._finish_error(499, "the request was cancelled")
            return
        self.states[i] = result
        self.remaining -= 1
        if self.remaining:
            return
        self._answered()
        prep, serving = self.prep, self.serving
        choices = [score_choice(serving, i, prep.req, prep.scores[i], r) for i, r in enumerate(self.states)]
        use = usage(sum(len(p) for p in prep.prompts), sum(1 for s in prep.scores if s.next_token))
        if serving.on_tokens is not None:
            serving.on_tokens(use["completion_tokens"], 0)
        self.emit("response", response("completion", prep.rid, serving.model_name, choices, use, prep.created), True)


def score_choice(serving: Serving, index: int, req: CompletionRequest, sr, res) -> dict:
    """One choice of a scoring response, in the OpenAI completions ``logprobs`` shape (docs/api.md):
    ``token_logprobs`` hold the estimate spread over the positions so that the sum from any estimated split to the
    end of the prompt equals that split's estimate; ``top_logprobs`` hold one entry per position, the prompt's token,
    whose value is null where the reference's greedy check fails (lm-eval's is_greedy test reads exactly that)."""
    tok, ids = serving.tok, sr.ids
    n = len(ids)
    every = ids + [res.next_token] if sr.next_token else ids
    strs = token_pieces(tok.decode, every)[0]       # each token's text in context: they join to tok.decode(ids)
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
    tokens, token_logprobs = strs[:n], values
    if sr.next_token:
        t = strs[n]
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
        self.decode = decode        # ids -> text (special tokens skipped unless the request keeps them)
        self.cleans_up = getattr(decode, "cleans_up", False)     # worker.tokenizer.text_decoder says
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = 0               # characters already streamed
        self.text = ""
        self.token_ids: list[int] = []
        self.stopped = False        # a stop string was found: text and token_ids are final
        self.finish_reason: str | None = None
        self.nfe = 0
        self.cached_tokens = 0      # of its prompt, served from the prefix cache
        self.logprobs: list | None = None     # the engine's per-token entries (asked only)
        self.steps = 0                          # step streaming: steps reported, the last window and its settled part
        self.window: list[int] | None = None
        self.settled = 0

    def _settled(self, text: str, words: bool = True) -> int:
        """How much of ``text`` (the final prefix's, while tokens still come) no later token can change: not a
        trailing incomplete multi-byte character (U+FFFD until its last byte comes), and with a clean-up tokenizer
        (unless ``words`` is False) not the last word and the space before it (after a lone quote, the word before
        it too)."""
        n = len(text)
        while n and text[n - 1] == "\ufffd":
            n -= 1
        if words and self.cleans_up:
            # transformers' clean_up_tokenization_spaces rewrites the whole text: " ' " becomes "'" once a word
            # follows the quote, a space before ".", ",", "n't", "'s"... goes, and one rewrite may make another
            # ("do n ' t" -> "do n't" -> "don't"): each removes the space before a token, so the last word and
            # the space before it may still change, and after a lone quote the word before it too
            cut = text.rfind(" ", 0, n)
            if cut > 0 and text.endswith(" '", 0, n):
                cut = text.rfind(" ", 0, cut)
            n = max(0, min(n, cut))
        return n

    def _apply(self, ids: list[int], final: bool = True) -> None:
        text = self.decode(ids)
        # while tokens still come, a stop string counts only where the text is settled (a review: a stop string
        # matched two U+FFFD that the next token turned into one character, and the answer was cut there); the
        # clean-up only removes spaces, so a stop string without one counts before the last word settles too
        plain = worded = len(text)
        if not final:
            plain, worded = self._settled(text, words=False), self._settled(text)
        hits = [h for stop in self.stops
                if 0 <= (h := text.find(stop)) <= (worded if " " in stop else plain) - len(stop)]
        if hits:
            cut = min(hits)
            self.text, self.token_ids, self.stopped = text[:cut], self._ids_for(ids, cut), True
        else:
            self.text, self.token_ids = text, list(ids)

    def _ids_for(self, ids: list[int], nchars: int) -> list[int]:
        """The shortest prefix of ids whose text covers the first nchars characters: the tokens of the text returned,
        with the token a stop string begins inside (part of its text is returned), never a token that lies wholly
        in the stop string or after it."""
        if nchars <= 0:
            return []
        lo, hi = 1, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.decode(ids[:mid])) >= nchars:
                hi = mid
            else:
                lo = mid + 1
        return ids[:lo]

    def _delta(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        d = self.text[self.sent:upto]
        self.sent = upto
        return d

    def progress(self, ids: list[int]) -> str:
        """The final prefix grew to ``ids``: the text that can be streamed now."""
        self._apply(ids, final=False)
        if self.stopped:
            return self._delta(len(self.text))
        # a stop string not found yet ends after the settled text: not what might be its start, nor what may change
        return self._delta(self._settled(self.text) - self.hold)

    def finish(self, result) -> str:
        self.nfe = result.nfe
        self.cached_tokens = getattr(result, "cached_tokens", 0)
        self.logprobs = getattr(result, "logprobs", None)
        if not self.stopped:
            self._apply(result.token_ids)
        if self.stopped:
            self.finish_reason = "stop"
        else:
            self.finish_reason = "stop" if result.finish_reason in ("stop", "cancelled") else "length"
        return self._delta(len(self.text))
