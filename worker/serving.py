"""OpenAI semantics over the engine: request → rows (tokenisation, chat template, parameters) → events
(stream chunks or one response). Used by the worker's /v1 endpoints and by /worker/batch alike."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from common.protocol import (APIError, ChatCompletionRequest, CompletionRequest, chunk, completion_choice, new_id,
                             parse_request, response, usage, usage_chunk)
from worker.batcher import Batcher, Job
from worker.engine import Engine, GenerationParams, ParamError
from worker.tokenizer import apply_chat_template


@dataclass
class Defaults:
    algorithm: str = "basic"
    max_tokens: int = 256
    block_length: int = 32


@dataclass
class Prepared:
    kind: str                       # "chat" | "completion"
    req: CompletionRequest | ChatCompletionRequest
    prompts: list[list[int]]
    params: list[GenerationParams]
    rid: str = ""
    created: int = field(default_factory=lambda: int(time.time()))


class Serving:
    def __init__(self, engine: Engine, batcher: Batcher, model_name: str, defaults: Defaults,
                 aliases: tuple[str, ...] = ()):
        self.engine, self.batcher, self.model_name, self.defaults = engine, batcher, model_name, defaults
        self.names = {model_name, *aliases}
        self.tok = engine.tokenizer

    # ------------------------------------------------------------ request -> rows
    def prepare(self, kind: str, body) -> Prepared:
        req = parse_request(kind, body)
        if req.model is not None and req.model not in self.names:
            raise APIError(404, f"The model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
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
        params = [self._params(req, ids) for ids in prompts]
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return Prepared(kind, req, prompts, params, rid=new_id(prefix))

    def _params(self, req, ids: list[int]) -> GenerationParams:
        d = self.defaults
        limit = self.engine.max_sequence_length - len(ids)
        max_new = req.max_new_tokens
        if max_new is None:
            if limit < 1:
                raise APIError(400, f"the prompt ({len(ids)} tokens) fills the model's context "
                                    f"({self.engine.max_sequence_length} tokens)", param="messages" if isinstance(
                                        req, ChatCompletionRequest) else "prompt")
            max_new = min(d.max_tokens, limit)
        block = req.block_length or d.block_length
        p = GenerationParams(
            gen_length=max_new, block_length=min(block, max_new), steps=req.steps,
            algorithm=req.generation_algorithm or d.algorithm,
            temperature=req.temperature or 0.0, remasking=req.remasking or "low_confidence",
            cfg_scale=req.cfg_scale or 0.0, threshold=req.threshold, factor=req.factor,
            seed=None if req.seed is None else req.seed % (1 << 63),
            ignore_eos=req.ignore_eos, extra=dict(req.algorithm_params or {}))
        try:
            self.engine.plan(ids, p)
        except ParamError as e:
            param = e.param
            if param == "max_tokens" and req.max_completion_tokens is not None:
                param = "max_completion_tokens"
            raise APIError(400, e.message, param=param)
        return p

    # ------------------------------------------------------------ rows -> events
    def submit(self, prep: Prepared) -> "Run":
        """Queue the request's rows; raises APIError(429) when the queue is full (nothing is queued then)."""
        q: asyncio.Queue = asyncio.Queue()
        progress = prep.req.stream or bool(prep.req.stop)
        jobs = [Job(ids, p, sink=lambda i, kind, payload: q.put_nowait((i, kind, payload)), index=i,
                    wants_progress=progress) for i, (ids, p) in enumerate(zip(prep.prompts, prep.params))]
        if self.batcher.queue_depth + len(jobs) > self.batcher.max_queue:
            raise APIError(429, f"the worker queue is full ({self.batcher.max_queue} rows waiting)",
                           headers={"Retry-After": "1"})
        for j in jobs:
            self.batcher.submit(j, force=True)
        return Run(self, prep, jobs, q)


class Run:
    """A submitted request. Iterate :meth:`events` for ("chunk", dict) ... when streaming, else one
    ("response", dict), or ("error", (status, body)). :meth:`cancel` drops its rows (also when the iteration
    is abandoned)."""

    def __init__(self, serving: Serving, prep: Prepared, jobs: list[Job], q: asyncio.Queue):
        self.serving, self.prep, self.jobs, self.q = serving, prep, jobs, q

    def cancel(self) -> None:
        for j in self.jobs:
            self.serving.batcher.cancel(j)

    async def events(self):
        try:
            async for ev in self._collect():
                yield ev
        finally:
            self.cancel()

    async def _collect(self):
        prep, jobs, q = self.prep, self.jobs, self.q
        tok, model_name = self.serving.tok, self.serving.model_name
        req, kind, stream = prep.req, prep.kind, prep.req.stream
        states = [_Choice(tok, req.stop) for _ in jobs]
        remaining = len(jobs)
        if stream:
            for i in range(len(jobs)):
                if kind == "chat":
                    yield "chunk", chunk(kind, prep.rid, model_name, prep.created, i, "", first=True)
        while remaining:
            i, what, payload = await q.get()
            st = states[i]
            if what == "error":
                status, message = payload
                self.cancel()
                yield "error", (status, APIError(status, message).body())
                return
            if what == "progress":
                if st.stopped:
                    continue
                delta = st.progress(payload)
                if st.stopped:      # a stop string appeared: the row can stop decoding
                    self.serving.batcher.cancel(jobs[i])
            else:
                delta = st.finish(payload)
                remaining -= 1
            if stream and delta:
                yield "chunk", chunk(kind, prep.rid, model_name, prep.created, i, delta)
            if what == "done" and stream:
                extra = {"nfe": st.nfe}
                if req.return_token_ids:
                    extra["token_ids"] = st.token_ids
                yield "chunk", chunk(kind, prep.rid, model_name, prep.created, i,
                                     "" if kind == "completion" else None, st.finish_reason, extra=extra)
        use = usage(sum(len(p) for p in prep.prompts), sum(len(s.token_ids) for s in states))
        if stream:
            if req.include_usage:
                yield "chunk", usage_chunk(kind, prep.rid, model_name, prep.created, use)
            return
        choices = [completion_choice(kind, i, s.text, s.finish_reason, s.nfe,
                                     s.token_ids if req.return_token_ids else None) for i, s in enumerate(states)]
        yield "response", response(kind, prep.rid, model_name, choices, use, prep.created)


class _Choice:
    """Text state of one choice: incremental detokenisation, stop strings, and what was already streamed."""

    def __init__(self, tok, stops: list[str]):
        self.tok = tok
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = 0               # characters already streamed
        self.text = ""
        self.token_ids: list[int] = []
        self.stopped = False        # a stop string was found: text and token_ids are final
        self.finish_reason: str | None = None
        self.nfe = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def _apply(self, ids: list[int]) -> None:
        text = self._decode(ids)
        hits = [h for h in (text.find(s) for s in self.stops) if h >= 0]
        if hits:
            cut = min(hits)
            self.text, self.token_ids, self.stopped = text[:cut], self._ids_for(ids, cut), True
        else:
            self.text, self.token_ids = text, list(ids)

    def _ids_for(self, ids: list[int], nchars: int) -> list[int]:
        """The shortest prefix of ids whose text covers the first nchars characters."""
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self._decode(ids[:mid])) >= nchars:
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
        self._apply(ids)
        if self.stopped:
            return self._delta(len(self.text))
        safe = len(self.text) - self.hold          # might be the start of a stop string
        while safe > self.sent and self.text[safe - 1] == "\ufffd":   # an incomplete multi-byte character
            safe -= 1
        return self._delta(safe)

    def finish(self, result) -> str:
        self.nfe = result.nfe
        if not self.stopped:
            self._apply(result.token_ids)
        if self.stopped:
            self.finish_reason = "stop"
        else:
            self.finish_reason = "stop" if result.finish_reason in ("stop", "cancelled") else "length"
        return self._delta(len(self.text))
