"""The OpenAI batch file format, shared by ``dllm-serve run-batch`` (dllm_serve/batch.py) and the balancer's
``/v1/batches`` (balancer/batches.py): reading request lines, writing result lines, and resuming a run from the
results already written.

An input line: ``{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}``.
A result line: ``{"id": "batch_req_...", "custom_id": "r1", "response": {"status_code": 200, "request_id": "...",
"body": {...}}, "error": null}``: an HTTP answer, a 4xx or 5xx included, is a ``response``; a line that could not be
sent (not JSON, no custom_id, a custom_id seen before, another method or URL) or no answer at all (the server
unreachable) is an ``error`` ``{"code", "message"}`` with ``response`` null.

Resuming: a result is final when it has a response below 500 other than 429 and other than the server's refusal of
the run itself (401, 403, a 404 that is not about the model: a key or URL problem, :func:`server_refused`); lines
whose result is not final (5xx, 429, such refusals, no answer) are sent again, results of lines no longer in the input (a refused line since fixed) are dropped, and their old result lines are dropped from the results file first (rewritten atomically), so the file
ends with one line per request."""
from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import orjson

from common.http import MAX_BODY_BYTES
from common.protocol import MAX_DEPTH, _deeper_than

# the URLs a batch line may name, and the request kind each is (common/openai_http.py ENDPOINTS)
BATCH_URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/responses": "responses"}


@dataclass
class Line:
    number: int                       # 1-based line number in the input
    custom_id: str | None
    kind: str | None                  # "chat" | "completion" | "responses"; None when the line is refused
    url: str | None
    body: dict | None
    error: dict | None = None         # why the line cannot be sent ({"code", "message"})

    @property
    def key(self) -> str:
        """What a resumed run matches results by: the custom_id, or for a refused line its error (which names the
        line: a refused duplicate of a custom_id is not taken for the line it duplicates)."""
        return "error:" + self.error["message"] if self.error is not None else self.custom_id


def result_key(result: dict) -> str | None:
    """:attr:`Line.key` of the line a result answers."""
    err = result.get("error")
    if isinstance(err, dict) and result.get("response") is None and err.get("message", "").startswith("line "):
        return "error:" + err["message"]
    cid = result.get("custom_id")
    return cid if isinstance(cid, str) and cid else None


def read_lines(path: str | os.PathLike) -> Iterator[Line]:
    """The input file's request lines, checked one by one (blank lines skipped); custom_ids must be unique."""
    seen: set[str] = set()
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            yield parse_line(n, raw, seen)


# A line holds a request body (at most MAX_BODY_BYTES, as one sent to the door) and its envelope; a longer one is
# refused unread: a review's 300 MiB line took 1.3 GB of the balancer's memory to parse before the worker refused it.
MAX_LINE_BYTES = MAX_BODY_BYTES + (64 << 10)
_CUSTOM_ID = re.compile(rb'"custom_id"\s*:\s*("(?:[^"\\]|\\.){1,1024}")')


def parse_line(n: int, raw: bytes, seen: set[str]) -> Line:
    def bad(code: str, message: str, cid=None) -> Line:
        return Line(n, cid, None, None, None, {"code": code, "message": f"line {n}: {message}"})
    if len(raw) > MAX_LINE_BYTES:       # its custom_id, when the line begins with it, names its result
        found = _CUSTOM_ID.search(raw, 0, 1 << 16)
        try:
            cid = orjson.loads(found.group(1)) if found else None
        except orjson.JSONDecodeError:
            cid = None
        cid = cid if isinstance(cid, str) and cid else None
        if cid is not None and cid in seen:
            return bad("duplicate_custom_id", f"custom_id {cid!r} was used by an earlier line", cid)
        if cid is not None:
            seen.add(cid)
        return bad("request_too_large", f"the line is {len(raw)} bytes; a request body may be at most "
                                        f"{MAX_BODY_BYTES}", cid)
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return bad("invalid_json", f"not JSON: {e}")
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH + 1 and _deeper_than(obj, MAX_DEPTH + 1):
        return bad("invalid_json", f"the line nests deeper than a request body may ({MAX_DEPTH} levels)")
    if not isinstance(obj, dict):
        return bad("invalid_request", "a line must be a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return bad("missing_custom_id", "custom_id must be a non-empty string")
    if cid in seen:
        return bad("duplicate_custom_id", f"custom_id {cid!r} was used by an earlier line", cid)
    seen.add(cid)
    method, url, body = obj.get("method", "POST"), obj.get("url"), obj.get("body")
    if method != "POST":
        return bad("invalid_method", f"method must be POST, got {method!r}", cid)
    if url not in BATCH_URLS:
        return bad("invalid_url", f"url must be one of {sorted(BATCH_URLS)}, got {url!r}", cid)
    if not isinstance(body, dict):
        return bad("invalid_body", "body must be a JSON object", cid)
    if body.get("stream"):
        return bad("invalid_body", "a batch line cannot stream (stream must be false)", cid)
    return Line(n, cid, BATCH_URLS[url], url, body)


def new_request_id() -> str:
    return "batch_req_" + secrets.token_hex(12)


def result_line(custom_id: str | None, status: int | None = None, body=None, request_id: str | None = None,
                error: dict | None = None) -> bytes:
    """One result line (with its newline): an HTTP answer (``status``, ``body``) or an ``error``."""
    response = None
    if status is not None:
        rid = request_id or (body.get("id") if isinstance(body, dict) else None) or new_request_id()
        response = {"status_code": status, "request_id": rid, "body": body}
    return orjson.dumps({"id": new_request_id(), "custom_id": custom_id, "response": response,
                         "error": error}) + b"\n"


BUSY_STATUSES = (429, 503)       # the server too busy for the line now: sent again (later, or by a resumed run)


def server_refused(status: int, body) -> bool:
    """An answer that refuses the run, not the line: a missing or wrong key (401, 403), or a 404 that is not about
    the model (the URL: a base URL ending in /v1 posts to /v1/v1/...). Every line would get it."""
    if status in (401, 403):
        return True
    if status != 404:
        return False
    err = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(err, dict):           # an OpenAI-shaped error says which (ours, vLLM's by its param or message)
        if err.get("code") == "model_not_found" or err.get("param") == "model":
            return False
        if err.get("code") in ("unknown_url", "unsupported_endpoint"):
            return True                 # (its message lists the endpoints served, /v1/models among them)
    about = orjson.dumps(err).decode().lower() if isinstance(err, (dict, list)) else str(err).lower()
    return "model" not in about


def is_final(result: dict) -> bool:
    """A result that a resumed run keeps: an answer below 500 but 429 (the server busy) and the server's refusals
    of the run (:func:`server_refused`), or a line that can never be sent."""
    r = result.get("response")
    if isinstance(r, dict) and isinstance(r.get("status_code"), int):
        return (r["status_code"] < 500 and r["status_code"] not in BUSY_STATUSES
                and not server_refused(r["status_code"], r.get("body")))
    err = result.get("error") or {}
    return err.get("code") not in ("server_unreachable", "server_error", "timeout")


def resume(path: str | os.PathLike, keys: set[str] | None = None) -> set[str]:
    """The keys (:attr:`Line.key`) of the lines whose results in ``path`` are final; rewrites ``path``
    (atomically) without the others, without results of lines whose keys are not in ``keys`` (the input's lines,
    when given: a refused line fixed since, its old error) and without a last line cut short by an interruption. A
    missing file: none."""
    path = Path(path)
    if not path.exists():
        return set()
    done, keep = set(), []
    for raw in path.read_bytes().splitlines():
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue                  # a line cut short: sent again
        if isinstance(obj, dict) and is_final(obj) and result_key(obj) is not None \
                and (keys is None or result_key(obj) in keys):
            done.add(result_key(obj))
            keep.append(raw + b"\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(keep))
    os.replace(tmp, path)
    return done


def counts(path: str | os.PathLike) -> dict:
    """{"total", "completed", "failed"} of a results file (completed: a 2xx answer)."""
    total = ok = 0
    path = Path(path)
    if path.exists():
        for raw in path.read_bytes().splitlines():
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            total += 1
            r = obj.get("response") if isinstance(obj, dict) else None
            ok += isinstance(r, dict) and 200 <= (r.get("status_code") or 0) < 300
    return {"total": total, "completed": ok, "failed": total - ok}
