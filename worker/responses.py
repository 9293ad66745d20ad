"""POST /v1/responses (text only) over the chat pipeline: a Responses request runs as the chat completion of its
``instructions`` + ``input`` (common/protocol.py, ``ResponsesRequest.chat_body``), and this adapter turns that chat
request's events into the Responses API's: one ``response`` object, or the stream of typed events the openai client's
``responses.stream`` expects (created, in_progress, output_item.added, content_part.added, output_text.delta...,
output_text.done, content_part.done, output_item.done, completed)."""
from __future__ import annotations

from common.protocol import ResponsesRequest


class ResponsesEvents:
    def __init__(self, req: ResponsesRequest, rid: str, model: str, created: int, emit):
        self.req, self.rid, self.model, self.created, self._emit = req, rid, model, created, emit
        self.item_id = "msg_" + rid.split("_", 1)[-1]
        self.seq = 0
        self.text = ""
        self.finish: str | None = None
        self.usage: dict | None = None
        self.opened = False

    # ------------------------------------------------------------ objects
    def response(self, status: str) -> dict:
        done = status != "in_progress"
        out = [self.message(status)] if done else []
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        r = self.req
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": out, "error": None, "incomplete_details": incomplete,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
                "temperature": r.temperature if r.temperature is not None else 0.0,
                "top_p": r.top_p if r.top_p is not None else 1.0,
                "parallel_tool_calls": False, "tool_choice": "none", "tools": [], "text": {"format": {"type": "text"}},
                "truncation": "disabled", "metadata": r.metadata or {}, "store": False, "user": r.user,
                "usage": self._usage() if done else None}

    def message(self, status: str) -> dict:
        """The output message; "incomplete" when max_output_tokens cut it, as OpenAI marks it (its text kept)."""
        content = [self.part()] if status != "in_progress" else []
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def part(self) -> dict:
        return {"type": "output_text", "text": self.text, "annotations": []}

    def _usage(self) -> dict:
        u = self.usage or {"prompt_tokens": 0, "completion_tokens": 0}
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)     # (the prefix cache's)
        return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
                "input_tokens_details": {"cached_tokens": cached}, "output_tokens_details": {"reasoning_tokens": 0}}

    def _status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    # ------------------------------------------------------------ events
    def _event(self, type_: str, last: bool = False, **fields) -> None:
        self._emit("chunk", {"type": type_, "sequence_number": self.seq, **fields}, last)
        self.seq += 1

    def __call__(self, kind: str, data, last: bool) -> None:
        if kind == "error":
            self._emit(kind, data, last)
            return
        if kind == "response":                 # not streaming: the whole chat completion
            choice = data["choices"][0]
            self.text, self.finish, self.usage = choice["message"]["content"], choice["finish_reason"], data["usage"]
            self._emit("response", self.response(self._status()), last)
            return
        ids = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        if not self.opened:
            self.opened = True
            self._event("response.created", response=self.response("in_progress"))
            self._event("response.in_progress", response=self.response("in_progress"))
            self._event("response.output_item.added", output_index=0, item=self.message("in_progress"))
            self._event("response.content_part.added", part={"type": "output_text", "text": "", "annotations": []},
                        **ids)
        for choice in data.get("choices", ()):
            delta = (choice.get("delta") or {}).get("content")
            if delta:
                self.text += delta
                self._event("response.output_text.delta", delta=delta, logprobs=[], **ids)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        if data.get("usage"):
            self.usage = data["usage"]
        if last:
            self._event("response.output_text.done", text=self.text, logprobs=[], **ids)
            self._event("response.content_part.done", part=self.part(), **ids)
            self._event("response.output_item.done", output_index=0, item=self.message(self._status()))
            # always response.completed (its response's status says "incomplete" when max_output_tokens cut it):
            # the openai client's responses.stream() finishes only on that event
            self._event("response.completed", last=True, response=self.response(self._status()))

