"""What the benchmark scripts share: a free loopback port, and waiting for a server's /health to say ready."""
from __future__ import annotations

import json
import socket
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = 120.0) -> None:
    """Until ``url``/health answers with status "ready" (a worker) or at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if json.loads(r.read())["status"] == "ready":
                    return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
