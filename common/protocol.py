"""The wire protocol: pydantic models of the OpenAI requests we accept (with our diffusion fields), response and
stream-chunk builders, and the OpenAI error body. No torch.

Field policy (documented in docs/api.md):
- honoured: model, prompt/messages, max_tokens, max_completion_tokens, temperature, stop, seed, stream,
  stream_options.include_usage, n (1 to MAX_N), user, ignore_eos, and the diffusion fields;
- the sampling filters top_p, top_k, min_p: taken by an algorithm that has them, else accepted at temperature 0
  only (where they change nothing), by the worker (CommonFields.filters);
- null is accepted for every field, as OpenAI accepts it, and means the field's default;
- accepted only at their neutral value, else a 400 naming the field: frequency_penalty (0),
  presence_penalty (0), logprobs (null/false), top_logprobs (null/0), echo (false), best_of (1), logit_bias (empty),
  suffix (null), tools/functions (none), response_format ({"type": "text"});
- any other field is ignored (clients such as lm-eval and vllm bench send extras);
- /v1/completions with echo + logprobs (+ max_tokens 0 or 1) is a likelihood scoring request (ScoreFields).
"""
from __future__ import annotations

import itertools
import re
import secrets
import time
from typing import Annotated, Any, Literal, Union

import orjson
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator, model_validator


class APIError(Exception):
    """An error answered in the OpenAI shape."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                             404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
                             413: "invalid_request_error",
                             429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _is(number: float):
    """A neutral-value check for a numeric field: null, or a JSON number equal to ``number`` (``true`` and ``false``
    are not 1 and 0, as Python's ``True == 1`` would have it)."""
    return lambda v: v is None or (type(v) in (int, float) and v == number)


def _empty(kind: type):
    """A neutral-value check for an object (``dict``) or array (``list``) field: null, or an empty one of that kind
    (not ``false``, ``0`` or ``""``)."""
    return lambda v: v is None or (type(v) is kind and not v)


# Fields of the OpenAI API we accept only at their neutral value: name -> (is_neutral(value), what we accept).
NEUTRAL_ONLY = {
    "frequency_penalty": (_is(0), "0"),
    "presence_penalty": (_is(0), "0"),
    "repetition_penalty": (_is(1), "1"),
    "logprobs": (lambda v: v is None or v is False, "null or false"),
    "top_logprobs": (_is(0), "null or 0"),
    "echo": (lambda v: v is None or v is False, "false"),
    "best_of": (_is(1), "1"),
    "logit_bias": (_empty(dict), "empty"),
    "suffix": (lambda v: v is None, "null"),
    "tools": (_empty(list), "none"),
    "functions": (_empty(list), "none"),
    "tool_choice": (lambda v: v is None or v == "none", "none"),
    "response_format": (lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"), '{"type": "text"}'),
    # vLLM's extra sampling and output fields that would change the answer (a review: `guided_json` was ignored, a
    # 200 with the plain answer)
    "min_tokens": (_is(0), "0"),
    "length_penalty": (_is(1), "1"),
    "use_beam_search": (lambda v: v is None or v is False, "false"),
    "allowed_token_ids": (_empty(list), "none"),
    "bad_words": (_empty(list), "none"),
    "guided_json": (lambda v: v is None, "null"),
    "guided_regex": (lambda v: v is None, "null"),
    "guided_choice": (lambda v: v is None, "null"),
    "guided_grammar": (lambda v: v is None, "null"),
    "structured_outputs": (lambda v: v is None, "null"),
    "include_stop_str_in_output": (lambda v: v is None or v is False, "false"),
    "truncate_prompt_tokens": (lambda v: v is None, "null"),
    "prompt_logprobs": (lambda v: v is None, "null"),
    "return_tokens_as_token_ids": (lambda v: v is None or v is False, "false"),
    "chat_template": (lambda v: v is None, "null: the model's own chat template is used"),
    "documents": (_empty(list), "none"),
}


# /v1/completions takes echo + logprobs for likelihood scoring (ScoreFields) and logprobs alone for the generated
# tokens' log-probabilities; /v1/chat/completions takes logprobs + top_logprobs for the generated tokens.
COMPLETION_NEUTRAL = {k: v for k, v in NEUTRAL_ONLY.items() if k not in ("logprobs", "echo")}
CHAT_NEUTRAL = {k: v for k, v in NEUTRAL_ONLY.items() if k not in ("logprobs", "top_logprobs")}
MAX_LOGPROBS = 20            # top_logprobs (chat) / logprobs (completions) at most, as OpenAI's

MAX_N = 128                  # choices per prompt (n)
MAX_ROWS = 1024              # prompts x n in one request


def defaults_and_neutral(data, neutral: dict):
    """A body before validation: null means the field's default (as in OpenAI's API), and the fields of ``neutral``
    are refused unless at their neutral value."""
    if isinstance(data, dict):
        if None in data.values():
            data = {k: v for k, v in data.items() if v is not None}
        if not neutral.keys().isdisjoint(data):         # (a body's few keys, not the ~30 fields, on the hot path)
            for name, (ok, accepted) in neutral.items():
                if name in data and not ok(data[name]):
                    raise ValueError(f"{name} is not supported by this server (accepted: {accepted})")
    return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data):
        return defaults_and_neutral(data, {})      # {"include_usage": null} is the default here too (vLLM's too)


class DiffusionFields(BaseModel):
    """Our extension fields, at the top level of the body (the openai client's ``extra_body`` puts them there)."""
    model_config = ConfigDict(extra="ignore", strict=True)

    steps: int | None = Field(None, ge=1, le=1 << 20)
    block_length: int | None = Field(None, ge=1, le=1 << 20)
    remasking: Literal["low_confidence", "random"] | None = None
    generation_algorithm: str | None = Field(None, max_length=64)
    threshold: float | None = Field(None, gt=0, le=1)
    factor: float | None = Field(None, gt=0, le=1000)
    cfg_scale: float | None = Field(None, ge=0, le=100)
    return_token_ids: bool = False
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=1024)    # vLLM's: these tokens end a choice too
    algorithm_params: dict[str, Any] | None = None   # algorithm-specific parameters (see /generation/algorithms)
    # require these weights: a model_version hash (every answer's model_version.hash); 409 where none will serve it
    model_version: str | None = Field(None, min_length=1, max_length=128)


class CommonFields(DiffusionFields):
    model: str | None = Field(None, max_length=512)
    max_tokens: int | None = Field(None, ge=0)        # 0 only for scoring (echo + logprobs)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    # sampling filters (OpenAI's top_p, vLLM's top_k and min_p): an algorithm with that parameter of its own takes
    # it, else they change nothing at temperature 0 (greedy, as vLLM ignores them there) and are refused when
    # sampling (worker.engine.algorithms.Algorithm.take_filters)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=1 << 30)
    min_p: float | None = Field(None, ge=0, le=1)
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True       # vLLM's: false keeps the special tokens' text in the answer
    n: int = Field(1, ge=1, le=MAX_N)
    user: str | None = Field(None, max_length=512)
    # step streaming (ours): "steps" adds an event per denoising step (docs/api.md "Streaming the steps")
    stream_mode: Literal["text", "steps"] = "text"
    stream_canvas: bool = False

    @model_validator(mode="after")
    def _steps_stream(self):
        if self.stream_mode == "steps" and not self.stream:
            raise ValueError("stream_mode 'steps' streams: it needs stream true")
        if self.stream_canvas and self.stream_mode != "steps":
            raise ValueError("stream_canvas goes with stream_mode 'steps'")
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")     # (vLLM's rule: {} passes)
        return self

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return []
        v = [v] if isinstance(v, str) else v
        if len(v) > 16 or any(not s or len(s) > 512 for s in v):
            raise ValueError("stop must be up to 16 non-empty strings of at most 512 characters")
        return v

    @model_validator(mode="before")
    @classmethod
    def _neutral_only(cls, data):
        return defaults_and_neutral(data, NEUTRAL_ONLY)

    @property
    def filters(self) -> dict:
        """The sampling filters asked for, those not at their neutral value (top_p 1, top_k -1 or 0, min_p 0)."""
        out = {}
        if self.top_p is not None and self.top_p != 1:
            out["top_p"] = self.top_p
        if self.top_k is not None and self.top_k > 0:
            out["top_k"] = self.top_k
        if self.min_p:
            out["min_p"] = self.min_p
        return out

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


TokenIds = list[int]


def _prompt_form(v) -> str:
    """Which form of ``prompt`` a value is, from its first item: only that member of the union validates it. (A
    plain union validated a list of token ids against ``list[str]`` first, building an error for every id: 12x the
    time, 17 s for a 60 MiB body of ids, on the balancer's event loop.)"""
    if isinstance(v, list) and v:
        first = v[0]
        return "list[str]" if isinstance(first, str) else "list[list[int]]" if isinstance(first, list) else "list[int]"
    return "list[int]" if isinstance(v, list) else "str"


# (the tags are named as pydantic names union members, which _validate leaves out of an error's field path)
Prompt = Annotated[Union[Annotated[str, Tag("str")], Annotated[list[str], Tag("list[str]")],
                         Annotated[TokenIds, Tag("list[int]")], Annotated[list[TokenIds], Tag("list[list[int]]")]],
                   Discriminator(_prompt_form)]


class ScoreFields(BaseModel):
    """Likelihood scoring (``echo`` + ``logprobs`` + ``max_tokens`` 0 or 1 on /v1/completions, as lm-eval sends
    loglikelihood requests): LLaDA's Monte Carlo estimator; null fields take the server's defaults."""
    model_config = ConfigDict(extra="ignore", strict=True)

    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    mc_num: int | None = Field(None, ge=1, le=1 << 16)
    mc_batch_size: int | None = Field(None, ge=1, le=1 << 12)
    context_length: int | None = Field(None, ge=1)    # the prefix (context) in tokens: one split, the cheapest
    score_window: int | None = Field(None, ge=1, le=1 << 16)   # else: every split in the prompt's last N tokens
    check_greedy: bool = True


class CompletionRequest(ScoreFields, CommonFields):
    prompt: Prompt
    # vLLM's field (its default is true): a text prompt's tokens with the tokenizer's special tokens (a BOS) added.
    # Ours is false: the text's own tokens, as the reference evaluation code encodes prompts
    add_special_tokens: bool = False

    @model_validator(mode="before")
    @classmethod
    def _neutral_only(cls, data):
        if isinstance(data, dict) and data.get("logprobs") is False:
            data = {k: v for k, v in data.items() if k != "logprobs"}
        return defaults_and_neutral(data, COMPLETION_NEUTRAL)

    @model_validator(mode="after")
    def _scoring(self):
        if not self.echo and self.logprobs is None and self.max_tokens != 0:
            return self                     # the common case: a generation request
        if self.echo and self.logprobs is not None:
            if self.max_new_tokens is not None and self.max_new_tokens > 1:
                raise ValueError("max_tokens: a scoring request (echo with logprobs) generates at most 1 token "
                                 "(0 or 1)")
            if self.stream:
                raise ValueError("stream: scoring requests (echo with logprobs) are not streamed")
            if self.n != 1:
                raise ValueError("n: scoring requests (echo with logprobs) take n = 1")
        elif self.echo:
            raise ValueError("echo is supported only with logprobs, for likelihood scoring (docs/api.md)")
        elif self.max_tokens == 0:
            raise ValueError("max_tokens: 0 is only for scoring requests (echo with logprobs); otherwise at least 1")
        return self

    @property
    def scoring(self) -> bool:
        return self.echo and self.logprobs is not None

    @property
    def token_logprobs(self) -> int | None:
        """Generated tokens' log-probabilities asked: the number of alternatives (None: not asked)."""
        return None if self.echo else self.logprobs

    @field_validator("prompt")
    @classmethod
    def _prompt_nonempty(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt is an empty list")
            if isinstance(v[0], list) and any(not p for p in v):
                raise ValueError("prompt holds an empty token list")
            if len(v) > 1024 and not isinstance(v[0], int):
                raise ValueError("at most 1024 prompts per request")
        return v

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)


# content parts that carry media: refused with a message that says so (this server generates from text; a model's
# vision tower, DiffusionGemma's for one, is not loaded)
MEDIA_PARTS = ("image_url", "input_image", "image", "video_url", "video", "input_video", "input_audio", "audio",
               "audio_url", "file", "input_file")


def text_parts_only(content):
    """A before-validator of a message's content: a media part gets a 400 naming it, not a type error about
    strings."""
    if isinstance(content, list):
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PARTS:
                raise ValueError(f"content part {i} is of type {kind!r}: this server generates from text only (images, "
                                 f"video, audio and files are not accepted; a model's vision tower is not loaded)")
    return content


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


# apply_chat_template's own parameters: not template variables (a request's chat_template_kwargs may not set them)
TEMPLATE_PARAMETERS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                 "add_generation_prompt", "continue_final_message", "tokenize", "padding", "truncation",
                                 "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
                                 "tokenizer_kwargs", "processor_kwargs"})


def template_kwargs(v: dict | None) -> dict | None:
    if v is not None:
        bad = sorted(set(v) & TEMPLATE_PARAMETERS)
        if bad:
            raise ValueError(f"{bad[0]} is a parameter of the chat template's call, not a template variable "
                             f"(give it as its own field where this server takes it)")
    return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # an assistant turn's reasoning, which templates with a thinking section render (vLLM passes it on)
    reasoning_content: str | None = None
    tool_calls: list | None = None        # refused unless empty: this server has no tools (as `tools`)

    _media = field_validator("content", mode="before")(classmethod(lambda cls, v: text_parts_only(v)))

    @model_validator(mode="after")
    def _some_content(self):
        # as OpenAI's: only an assistant message may have no content (it had tool calls); no message has no parts
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: a {self.role} message needs its content")
        if isinstance(self.content, list) and not self.content:
            raise ValueError("content: an empty list of parts")
        if self.tool_calls:
            raise ValueError("tool_calls: this server has no tools (tools, tool messages and tool calls are not "
                             "supported)")
        return self

    def text(self) -> str:
        """The content as one string: text parts joined by newlines (as vLLM and SGLang give a template that takes
        a string)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)

    def template_content(self, parts: bool) -> str | list[dict]:
        """The content as a chat template gets it: a list of text parts for a template that reads parts (``parts``,
        worker.tokenizer.takes_content_parts), else :meth:`text`."""
        if parts and isinstance(self.content, list):
            return [{"type": "text", "text": p.text} for p in self.content]
        return self.text()


class ChatCompletionRequest(CommonFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: the template's generation prompt, or the last (assistant) message continued instead of closed
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None      # vLLM's: more variables for the chat template

    @model_validator(mode="before")
    @classmethod
    def _neutral_only(cls, data):
        return defaults_and_neutral(data, CHAT_NEUTRAL)

    _template_kwargs = field_validator("chat_template_kwargs")(classmethod(lambda cls, v: template_kwargs(v)))

    @model_validator(mode="after")
    def _some_tokens(self):
        if self.max_tokens == 0:
            raise ValueError("max_tokens: must be at least 1")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: needs add_generation_prompt false (the last message is "
                             "continued, not followed by a new turn)")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message: the last message must be the assistant's")
        return self

    @property
    def token_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


MAX_DEPTH = 64      # nesting levels a request body may use (an OpenAI request needs about 6)


def loads(raw: bytes | bytearray | memoryview | str, max_depth: int = MAX_DEPTH) -> Any:
    """The one JSON language of every server here (the balancer, its fronts and the worker): strict RFC 8259 as
    orjson reads it: no NaN/Infinity, numbers that overflow a double rejected, invalid UTF-8 and lone surrogates
    rejected, no byte order mark; plus at most ``max_depth`` levels of nesting. Raises APIError(400)."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}")
    brackets = raw.count(b"[") + raw.count(b"{") if isinstance(raw, (bytes, bytearray)) else max_depth + 1
    if brackets > max_depth and isinstance(obj, (dict, list)) and _deeper_than(obj, max_depth):
        raise APIError(400, f"the request body nests deeper than {max_depth} levels")
    return obj


def _deeper_than(obj: dict | list, limit: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        o, depth = stack.pop()
        if depth > limit:
            return True
        for child in (o.values() if isinstance(o, dict) else o):
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


class ResponsesContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["input_text", "output_text", "text"]
    text: str


class ResponsesInputItem(BaseModel):
    """A message of the Responses API ``input`` list (text only)."""
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ResponsesContentPart]

    _media = field_validator("content", mode="before")(classmethod(lambda cls, v: text_parts_only(v)))

    @field_validator("content")
    @classmethod
    def _some_parts(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("an empty list of parts")
        return v

    @model_validator(mode="before")
    @classmethod
    def _text_messages_only(cls, data):
        """An item this server cannot take (a function call's output, a reasoning item, a reference to a stored
        item, a tool message) is named as such (the union's first branch said "Input should be a valid string")."""
        if isinstance(data, dict):
            kind, role = data.get("type", "message"), data.get("role")
            if kind != "message":
                raise ValueError(f"input items of type {kind!r} are not supported by this server (messages of "
                                 f"text only)")
            if role not in (None, "system", "developer", "user", "assistant"):
                raise ValueError(f"input messages of role {role!r} are not supported by this server (system, "
                                 f"developer, user, assistant)")
        return data

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)

    def chat_content(self) -> str | list[dict]:
        """The content of the chat message it becomes: text, or its parts as chat text parts."""
        if isinstance(self.content, str):
            return self.content
        return [{"type": "text", "text": p.text} for p in self.content]


# Responses ``include`` values whose output this server never has (no reasoning items, tools or images)
INCLUDE_NOTHING_HERE = frozenset({
    "reasoning.encrypted_content", "code_interpreter_call.outputs", "computer_call_output.output.image_url",
    "file_search_call.results", "message.input_image.image_url", "web_search_call.action.sources",
    "web_search_call.results"})

# Responses fields accepted only at their neutral value (text in, text out, nothing stored or chained)
RESPONSES_NEUTRAL = {
    "tools": (_empty(list), "none"),
    "tool_choice": (lambda v: v is None or v in ("none", "auto"), "none"),
    "previous_response_id": (lambda v: v is None, "null (no stored conversations)"),
    "conversation": (lambda v: v is None, "null (no stored conversations)"),
    "top_logprobs": (_is(0), "null or 0"),
    "background": (lambda v: v is None or v is False, "false"),
    "text": (lambda v: v is None or (isinstance(v, dict) and v.get("format") in (None, {"type": "text"})),
             '{"format": {"type": "text"}}'),
    "reasoning": (lambda v: v is None or (isinstance(v, dict) and all(x is None for x in v.values())), "null"),
    "prompt": (lambda v: v is None, "null (no stored prompt templates)"),
    # OpenAI's include asks for extra output: logprobs would change the answer (not served here); the others name
    # output items this server never makes (reasoning, tool calls, images), so they add nothing (inspect-ai's openai
    # provider sends reasoning.encrypted_content with every request)
    "include": (lambda v: v is None or (type(v) is list and all(type(x) is str and x in INCLUDE_NOTHING_HERE
                                                                 for x in v)),
                "values that add nothing here: " + ", ".join(sorted(INCLUDE_NOTHING_HERE))),
}


class ResponsesRequest(DiffusionFields):
    """POST /v1/responses, text only: answered as a chat completion of ``instructions`` + ``input``."""
    model: str | None = Field(None, max_length=512)
    input: str | list[ResponsesInputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)          # as a chat completion's
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    stream: bool = False
    user: str | None = Field(None, max_length=512)
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)  # echoed back

    @field_validator("metadata")
    @classmethod
    def _metadata_keys(cls, v):
        if v is not None and any(len(k) > 64 for k in v):
            raise ValueError("metadata keys are at most 64 characters")
        return v

    @field_validator("input")
    @classmethod
    def _input_nonempty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("input is an empty list")
        return v

    @model_validator(mode="before")
    @classmethod
    def _neutral_only(cls, data):
        return defaults_and_neutral(data, RESPONSES_NEUTRAL)

    def chat_body(self) -> dict:
        """The equivalent chat completion request (with usage in the stream, which response.completed needs)."""
        msgs = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            msgs.append({"role": "user", "content": self.input})
        else:
            msgs += [{"role": m.role, "content": m.chat_content()} for m in self.input]
        body = self.model_dump(include=set(DiffusionFields.model_fields), exclude_none=True)
        body.update(messages=msgs, stream=self.stream, stream_options={"include_usage": True} if self.stream else None)
        for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                             ("seed", "seed"), ("model", "model"), ("user", "user")):
            if getattr(self, ours) is not None:
                body[theirs] = getattr(self, ours)
        return {k: v for k, v in body.items() if v is not None}


class TokenizeRequest(BaseModel):
    """POST /tokenize, as vLLM serves it: a ``prompt`` text, or chat ``messages`` rendered by the chat template."""
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = Field(None, max_length=512)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_template(cls, data):
        return defaults_and_neutral(data, {"chat_template": NEUTRAL_ONLY["chat_template"]})

    _template_kwargs = field_validator("chat_template_kwargs")(classmethod(lambda cls, v: template_kwargs(v)))

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.continue_final_message:           # as a chat request checks it
            if self.add_generation_prompt:
                raise ValueError("continue_final_message: needs add_generation_prompt false (the last message is "
                                 "continued, not followed by a new turn)")
            if self.messages is None or self.messages[-1].role != "assistant":
                raise ValueError("continue_final_message: the last message must be the assistant's")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = Field(None, max_length=512)
    tokens: list[int] = Field(max_length=1 << 20)


# Routes that share the OpenAI endpoints' key (--api-key): /v1/*, the tokenizer endpoints and
# /generation/algorithms (as on a worker); the read-only status endpoints stay open.
def guarded_by_api_key(path: str) -> bool:
    return path.startswith("/v1/") or path in ("/tokenize", "/detokenize", "/tokenizer_info", "/generation/algorithms")


def parse_body(cls: type[BaseModel], data: Any):
    """Validate a body for ``cls`` (raw bytes through :func:`loads`); raises APIError(400) naming the field."""
    if isinstance(data, (bytes, bytearray, memoryview, str)):
        data = loads(data)
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return cls.model_validate(defaults_and_neutral(data, {}))
    except ValidationError as e:
        errors = e.errors()
        # a rule's own message (value_error) says more than a union member's type error
        err = next((x for x in errors if x.get("type") == "value_error"), errors[0])
        param = ".".join(str(x) for x in err.get("loc", ()) if not str(x).startswith("list[")) or None
        msg = err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param or 'body'}: {msg}", param=param)


def parse_request(kind: Literal["chat", "completion", "responses"], data: Any
                  ) -> CompletionRequest | ChatCompletionRequest | ResponsesRequest:
    """Validate a body (raw JSON bytes, read by :func:`loads`, or an object already read by it); raises
    APIError(400) naming the first offending field. The balancer, its fronts and the worker all validate here, so a
    body one of them accepts, every other accepts too. A ``responses`` body is also checked as the chat request it
    becomes (:meth:`ResponsesRequest.chat_body`)."""
    if isinstance(data, (bytes, bytearray, memoryview, str)):
        data = loads(data)
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    if kind == "responses":
        r = _validate(ResponsesRequest, data, RESPONSES_NEUTRAL)
        try:
            _validate(ChatCompletionRequest, r.chat_body(), CHAT_NEUTRAL)
        except APIError as e:
            raise as_responses_error(e) from None
        return r
    if kind == "chat":
        return _validate(ChatCompletionRequest, data, CHAT_NEUTRAL)
    return _validate(CompletionRequest, data, COMPLETION_NEUTRAL)


# a Responses request is answered as the chat completion it becomes: an error about that request names the Responses
# fields the client sent
_RESPONSES_NAMES = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                    "messages": "input"}


def as_responses_error(e: APIError) -> APIError:
    """``e`` (about the chat request a Responses request becomes) with the Responses fields' names."""
    if e.param is None:
        return e
    head, _, rest = e.param.partition(".")
    if head not in _RESPONSES_NAMES:
        return e
    new = _RESPONSES_NAMES[head] + ("." + rest if rest and head != "messages" else "")
    message = e.message
    message = re.sub(r"\binput messages\b", "input", message)      # (the context's words: not "input input")
    for old, name in _RESPONSES_NAMES.items():
        message = re.sub(rf"\b{old}\b", name, message)
    return APIError(e.status, message, param=new, type=e.type, code=e.code, headers=e.headers)


def _validate(cls, data: dict, neutral: dict):
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        # a union's members each report an error; the deepest names what the client sent (a list's bad item, not
        # "should be a valid string" for a list given where a string would also do: a review)
        deepest = max(errors, key=lambda x: len(x.get("loc", ())))
        err = next((x for x in errors if x.get("type") == "value_error" and x.get("loc")), deepest)
        loc = [str(x) for x in err.get("loc", ())]
        # union members appear in loc (e.g. prompt.str): keep the field path only
        param = ".".join(x for x in loc if x not in ("str", "int", "TextPart") and not x.startswith("list[")) or None
        if err.get("type") == "value_error" and not loc:
            msg = str(err.get("ctx", {}).get("error", err["msg"]))
            first = msg.split(" ", 1)[0].rstrip(":")
            name = next((n for n in neutral if msg.startswith(n + " ")), first if first in cls.model_fields else None)
            raise APIError(400, msg, param=name)
        msg = err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param or 'body'}: {msg}", param=param)


# ---------------------------------------------------------------- responses

_ID_BASE = secrets.token_hex(8)      # per process: ids are unique without a random draw per response
_ID_COUNT = itertools.count()


def new_id(prefix: str, sep: str = "-") -> str:
    """A unique id, as OpenAI writes them: ``chatcmpl-...``, ``cmpl-...``; ``resp_...`` (``sep="_"``)."""
    return f"{prefix}{sep}{_ID_BASE}{next(_ID_COUNT):08x}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_choice(kind: str, index: int, text: str, finish_reason: str | None, nfe: int | None = None,
                      token_ids: list[int] | None = None) -> dict:
    if kind == "chat":
        choice = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if nfe is not None:
        choice["nfe"] = nfe
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def response(kind: str, rid: str, model: str, choices: list[dict], use: dict, created: int | None = None) -> dict:
    return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": created or int(time.time()), "model": model, "choices": choices, "usage": use}


def chunk(kind: str, rid: str, model: str, created: int, index: int, text: str | None,
          finish_reason: str | None = None, *, first: bool = False, extra: dict | None = None) -> dict:
    if kind == "chat":
        delta: dict = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    if extra:
        choice.update(extra)
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(kind: str, rid: str, model: str, created: int, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created, "model": model, "choices": [], "usage": use}
