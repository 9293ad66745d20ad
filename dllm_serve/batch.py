"""``dllm-serve run-batch``: an OpenAI batch file (common/batchfile.py) sent to a running server, or to a model
served for the run, with a progress bar; results are appended as they come (an interruption loses nothing done),
and a rerun sends only the lines without a final result."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import orjson

from balancer.supervisor import die_with_parent
from common.batchfile import BUSY_STATUSES, read_lines, result_line, resume, server_refused

ROOT = Path(__file__).resolve().parent.parent
RETRY_WAIT_MAX = 10.0      # seconds at most between two tries of a line the server was too busy for (429, 503)


async def send(lines, out_path: Path, url: str, api_key: str | None, concurrency: int, timeout: float,
               progress, retry_wait_max: float = RETRY_WAIT_MAX) -> dict:
    """Send ``lines`` (common.batchfile.Line; an iterable taken as it is sent) to ``url``, at most ``concurrency`` at
    once, appending one result line
    each to ``out_path``; ``progress(n)`` after each. A 429 or 503 (the server busy) is sent again after its
    Retry-After (else a doubling wait), at most ``retry_wait_max`` s, until ``timeout`` s have passed since the first
    try.
    Returns the counts: ``ok`` (2xx), ``failed`` (an error answer that is final), ``retry`` (a 5xx, or still busy:
    a rerun sends it again), ``refused``, ``unsent``, and ``stopped``: the first answer that refused the run itself
    (common.batchfile.server_refused: the key, the URL), after which no other line is sent."""
    import aiohttp
    tally = {"ok": 0, "failed": 0, "retry": 0, "refused": 0, "unsent": 0, "stopped": None}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(concurrency)
    with open(out_path, "ab") as out:
        def write(data: bytes) -> None:
            out.write(data)
            out.flush()

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as s:
            async def one(line) -> None:
                if line.error is not None:
                    write(result_line(line.custom_id, error=line.error))
                    tally["refused"] += 1
                    progress(1)
                    return
                async with sem:
                    if tally["stopped"] is not None:
                        tally["unsent"] += 1
                        progress(1)
                        return
                    try:
                        deadline, wait = time.monotonic() + timeout, 0.5
                        while True:
                            async with s.post(url + line.url, json=line.body, headers=headers) as r:
                                raw = await r.read()
                            try:
                                pause = float(r.headers.get("Retry-After") or wait)
                            except ValueError:
                                pause = wait
                            pause = min(max(pause, 0.05), retry_wait_max)
                            if r.status not in BUSY_STATUSES or time.monotonic() + pause > deadline:
                                break
                            await asyncio.sleep(pause)
                            wait = min(2 * wait, retry_wait_max)
                        try:
                            body = orjson.loads(raw)
                        except orjson.JSONDecodeError:
                            body = raw.decode(errors="replace")
                        write(result_line(line.custom_id, r.status, body, r.headers.get("x-request-id")))
                        refused = server_refused(r.status, body)
                        if refused and tally["stopped"] is None:
                            message = body.get("error", body) if isinstance(body, dict) else body
                            if isinstance(message, dict):
                                message = message.get("message", message)
                            tally["stopped"] = f"{r.status} from {url + line.url}: {str(message)[:300]}"
                        tally["ok" if r.status < 300 else "retry" if r.status >= 500 or r.status in BUSY_STATUSES
                              or refused else "failed"] += 1
                    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                        code = "timeout" if isinstance(e, asyncio.TimeoutError) else "server_unreachable"
                        write(result_line(line.custom_id, error={"code": code, "message": f"{type(e).__name__}: "
                                                                                            f"{e}"}))
                        tally["unsent"] += 1
                progress(1)
            todo = iter(lines)

            async def lane() -> None:       # ``concurrency`` of these take the lines in order, as they are read
                for line in todo:
                    await one(line)
            await asyncio.gather(*(lane() for _ in range(concurrency)))
    return tally


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports."""
    import random
    import socket
    for _ in range(200):
        base = random.randrange(20000, 60000 - n)
        socks = []
        try:
            for p in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {n} free consecutive ports")


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server for the run exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if orjson.loads(r.read()).get("healthy_workers", 0) > 0:
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server for the run was not ready after {timeout:g} s")


def run(input_path: str, output_path: str, url: str | None, model_path: str | None, serve_args: list[str],
        api_key: str | None, concurrency: int, timeout: float, startup_timeout: float, echo,
        retry_wait_max: float = RETRY_WAIT_MAX) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
    out = Path(output_path)
    if not out.parent.is_dir():
        raise RuntimeError(f"--output {output_path}: no such directory {str(out.parent)!r}")
    # the input is read twice, a line at a time: once for the keys (what resuming needs), then as it is sent; every
    # line parsed at once, and a task for each, held about 23x the file (a review: 528 MB for 23 MB)
    keys, total = set(), 0
    for line in read_lines(input_path):
        keys.add(line.key)
        total += 1
    done = resume(out, keys)
    pending = total - len(done)
    del keys
    todo = (line for line in read_lines(input_path) if line.key not in done)
    echo(f"dllm-serve run-batch: {total} requests in {input_path}; {total - pending} already done in "
         f"{output_path}; {pending} to send")
    server = None
    tmp = None
    tally = None

    def stop(signum, frame):        # SIGTERM / SIGHUP: end as Ctrl-C does, through the finally that stops the server
        raise SystemExit(128 + signum)
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        if model_path is not None and pending:
            tmp = tempfile.mkdtemp(prefix="dllm-run-batch-")
            port = _free_ports(1)
            url = f"http://127.0.0.1:{port}"
            echo(f"serving {model_path} on {url} for the run (logs in {tmp}, removed if the run ends well)")
            with open(Path(tmp) / "serve.log", "wb") as log_file:
                server = subprocess.Popen([sys.executable, "-m", "dllm_serve", "serve", "--local", "--model-path",
                                           model_path, "--port", str(port), "--worker-base-port", str(_free_ports(16)),
                                           "--log-dir", tmp, "--stagger", "0",
                                           # its /v1/files folder in the run's (else a folder per port in $DLLM_CACHE)
                                           "--files-dir", str(Path(tmp) / "files"), *serve_args],
                                          stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
                                          env={**os.environ, "DLLM_API_KEY": ""},
                                          preexec_fn=die_with_parent)      # (SIGKILL of run-batch: SIGTERM to it)
            try:
                _wait_ready(url, server, startup_timeout)
            except RuntimeError as e:
                tail = (Path(tmp) / "serve.log").read_text(errors="replace").splitlines()[-15:]
                raise RuntimeError(f"{e}; the last lines of {Path(tmp) / 'serve.log'}:\n" + "\n".join(tail)) from None
        url = (url or "http://127.0.0.1:8000").rstrip("/")
        with Progress(TextColumn("[bold]run-batch"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      disable=not sys.stderr.isatty()) as bar:
            task = bar.add_task("requests", total=pending)
            tally = asyncio.run(send(todo, out, url, api_key, concurrency, timeout,
                                     lambda n: bar.advance(task, n), retry_wait_max))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if server is not None and server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
        if tmp is not None:        # the run's server logs: gone after a run that ended well, kept to read otherwise
            if server is not None and server.returncode == 0 and tally is not None and not (
                    tally["unsent"] or tally["retry"] or tally["stopped"]):
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                echo(f"dllm-serve run-batch: the run's server logs are kept in {tmp}")
    if tally["stopped"]:
        echo(f"dllm-serve run-batch: stopped: the server refused the run, not a request (a key or URL problem: "
             f"--url is the server's base URL, without /v1), so no further line was sent: {tally['stopped']}")
    echo(f"dllm-serve run-batch: {tally['ok']} answered 2xx, {tally['failed']} answered with an error, "
         f"{tally['refused']} refused lines, {tally['retry']} answered 5xx or still busy and {tally['unsent']} "
         f"without an answer (run again to resume those); results in {output_path}")
    return 1 if tally["unsent"] or tally["retry"] else 0
