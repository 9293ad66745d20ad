"""HTTP pieces shared by the worker and the balancer (aiohttp; no torch): JSON responses, the middleware that
answers every error in the OpenAI shape, and API-key checking."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import orjson
from aiohttp import web

from common.protocol import APIError, error_body

log = logging.getLogger("dllm.http")


EXIT_PORT_IN_USE = 98                  # a server's exit code when its port is taken (the supervisor gives up)
MAX_BODY_BYTES = 64 * 1024 ** 2        # one client request (balancer, fronts, worker /v1); larger: 413
MAX_BATCH_BYTES = 4 * MAX_BODY_BYTES   # one /worker/batch body; the balancer never forms a larger one

# Content types a JSON body may come with: none, JSON, and those HTTP clients send by default for raw bytes
# (``curl -d``: application/x-www-form-urlencoded; aiohttp: application/octet-stream). Anything else (multipart
# forms, XML, ...) is a 415.
JSON_CONTENT_TYPES = ("", "application/json", "text/plain", "application/x-www-form-urlencoded",
                      "application/octet-stream")


async def read_body(request: web.Request) -> bytes:
    """The raw body of an OpenAI request, after the Content-Type check (415 in the OpenAI shape)."""
    ctype = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
    if ctype not in JSON_CONTENT_TYPES and not ctype.endswith("+json"):
        raise APIError(415, f"unsupported Content-Type {ctype!r}: send the body as application/json",
                       type="invalid_request_error")
    return await request.read()


def json_response(data, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json", headers=headers)


def retry_headers(status: int) -> dict | None:
    """Retry-After for the statuses that invite a retry (429, 503)."""
    return {"Retry-After": "1" if status == 429 else "5"} if status in (429, 503) else None


# OpenAI endpoints this server does not have: a 404 that says so (a diffusion LM server generates and scores text)
NOT_SERVED = {"/v1/embeddings": "embeddings", "/v1/moderations": "moderations", "/v1/images": "images",
              "/v1/audio": "audio", "/v1/files": "files", "/v1/batches": "batches", "/v1/fine_tuning": "fine-tuning",
              "/v1/assistants": "assistants", "/v1/threads": "threads", "/v1/vector_stores": "vector stores",
              "/v1/realtime": "realtime sessions", "/v1/uploads": "uploads", "/v1/rerank": "reranking",
              "/v1/score": "scoring by a cross-encoder"}
SERVED = "/v1/completions, /v1/chat/completions, /v1/responses, /v1/models"


def _not_served(path: str) -> tuple[str, str]:
    for prefix, what in NOT_SERVED.items():
        if path == prefix or path.startswith(prefix + "/"):
            return (f"this server does not serve {what} ({path}): it serves diffusion language models for text "
                    f"generation and likelihood scoring ({SERVED}; docs/api.md)", "unsupported_endpoint")
    return f"no such endpoint: {path} (the OpenAI endpoints here: {SERVED})", "unknown_url"


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """Every 4xx/5xx body in the OpenAI shape; an unexpected exception is a logged 500, never a crash."""
    try:
        return await handler(request)
    except APIError as e:
        return json_response(e.body(), e.status, e.headers or retry_headers(e.status))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        typ = "not_found_error" if e.status == 404 else ("invalid_request_error" if e.status < 500 else "server_error")
        message, code = e.reason or str(e), None
        if isinstance(e, web.HTTPNotFound) and e.reason == "Not Found":       # the router found no route
            message, code = _not_served(request.path)
        return json_response(error_body(message, typ, code=code), e.status,
                             {k: v for k, v in e.headers.items() if k.lower() in ("allow", "retry-after")})
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return json_response(error_body(f"internal error: {type(e).__name__}", "server_error"), 500)


def auth_middleware(key: str, guarded: Callable[[str], bool]):
    """Require ``Authorization: Bearer KEY`` on the paths ``guarded`` accepts (installed only when a key is set)."""
    expected = f"Bearer {key}"

    @web.middleware
    async def middleware(request: web.Request, handler):
        if guarded(request.path) and request.headers.get("Authorization", "") != expected:
            raise APIError(401, "invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key")
        return await handler(request)
    return middleware


def middlewares(api_key: str | None, guarded: Callable[[str], bool]) -> list:
    """The middleware stack of both servers: OpenAI-shaped errors, plus the API-key check when a key is set."""
    return [errors_middleware] + ([auth_middleware(api_key, guarded)] if api_key else [])
