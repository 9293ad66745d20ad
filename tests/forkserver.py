"""A fork server for the servers the tests start (tests/helpers.Proc).

Each test process starts one (lazily, at its first server): a process that has imported what `dllm-serve worker`
and `dllm-serve balancer` import (torch, transformers, aiohttp, the project) and then forks a child per server.
The child takes its own session, environment, working directory and log file and runs the command line as
``python -m dllm_serve ARGS`` does, ending as that process ends (its atexit handlers, its threads joined). A server
so started is the same code doing the same work; what it skips is the seconds of CPU its imports cost (about 4 s a
worker on the 2-core CI machine, where the suite starts some seventy servers). The launch itself (``python -m
dllm_serve``, the supervisor's spawns of workers, the tensor-parallel ranks) stays covered by the tests that start
`serve`, `generate` and the other commands as plain subprocesses, as every process those start is.

Proc uses it only where the environment asked for matches the fork server's in what the interpreter, torch and
OpenMP read when they start (``SAME_AT_START``); otherwise, or with ``DLLM_TEST_FORK=0``, it starts a plain
subprocess. A forked server is not the test process's child: its exit code comes from the fork server
(:class:`Forked`, which has the few ``subprocess.Popen`` methods the tests use).

Protocol: one JSON object a line, over the fork server's stdin and stdout: ``{"spawn": {args, env, cwd, log}}`` ->
``{"pid": N}``; ``{"status": N}`` -> ``{"returncode": CODE or null}``. The fork server ends when its stdin closes (its
test process ended)."""
from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import threading
import time

# what the interpreter, torch, OpenMP and the allocator read once, at start: a child forked from a server started
# with other values would not have the ones asked for
SAME_AT_START = re.compile(r"^(PYTHON|LD_|ATEN_|OMP_|MKL_|KMP_|GOMP_|TORCH|MALLOC|CUDA_|NCCL_|HF_|TRANSFORMERS_)")


def _start_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if SAME_AT_START.match(k)}


# ---------------------------------------------------------------- the fork server's side
def _serve() -> dict:
    """Answer requests until one forks: return that request in the child. The server itself never returns."""
    codes: dict[int, int] = {}
    buf = b""

    def reply(obj) -> None:
        os.write(1, json.dumps(obj).encode() + b"\n")

    while True:
        while True:                               # reap the servers that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            codes[pid] = os.waitstatus_to_exitcode(status)
        if b"\n" not in buf:
            if not select.select([0], [], [], 0.05)[0]:
                continue
            data = os.read(0, 65536)
            if not data:                          # the test process is gone
                os._exit(0)
            buf += data
            continue
        line, buf = buf.split(b"\n", 1)
        req = json.loads(line)
        if "status" in req:
            reply({"returncode": codes.get(req["status"])})
            continue
        pid = os.fork()
        if pid == 0:
            return req["spawn"]
        reply({"pid": pid})


def _child(spec: dict) -> None:
    """In the forked child: become the server ``python -m dllm_serve ARGS`` would be."""
    os.setsid()
    log = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.chdir(spec["cwd"])
    os.environ.clear()
    os.environ.update(spec["env"])
    sys.argv = [sys.argv[0], *spec["args"]]
    from dllm_serve.cli import main
    main(args=spec["args"], prog_name="python -m dllm_serve")


def _preload(kind: str) -> None:
    """What a server of ``kind`` imports: a worker's (torch, transformers, the engine), or the command line's alone
    (the balancer and the other commands, which never import torch). Then ``gc.freeze``: what was imported is left
    out of the child's garbage collections (as it would hold no more than its own objects)."""
    import gc
    import dllm_serve.cli  # noqa: F401  (the command line, the balancer)
    if kind == "worker":
        import transformers.models.auto.tokenization_auto  # noqa: F401
        import worker.app  # noqa: F401
        import worker.scheduler  # noqa: F401  (torch, the engine, the models, the tokenizer)
    gc.freeze()


# ---------------------------------------------------------------- the test process's side
class Forked:
    """A forked server, as far as the tests use a ``subprocess.Popen``: pid, returncode, poll, wait, send_signal."""

    def __init__(self, server: "ForkServer", pid: int):
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.status(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked server {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


class ForkServer:
    def __init__(self, kind: str):
        self.env = _start_env(os.environ)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver", kind], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(__file__)))
        self.lock = threading.Lock()

    def _ask(self, obj) -> dict:
        with self.lock:
            self.proc.stdin.write(json.dumps(obj).encode() + b"\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the tests' fork server ended (code {self.proc.poll()})")
        return json.loads(line)

    def spawn(self, args: list[str], env: dict, cwd: str, log: str) -> Forked:
        return Forked(self, self._ask({"spawn": {"args": args, "env": env, "cwd": str(cwd), "log": str(log)}})["pid"])

    def status(self, pid: int) -> int | None:
        return self._ask({"status": pid})["returncode"]

    def serves(self, env: dict) -> bool:
        return self.proc.poll() is None and _start_env(env) == self.env


_SERVERS: dict[str, ForkServer] = {}


def fork_server(args: list[str]) -> ForkServer | None:
    """This test process's fork server for the command ``args`` (started at its first use; one for workers, one
    for the other commands), or None where DLLM_TEST_FORK=0."""
    if os.environ.get("DLLM_TEST_FORK", "1") == "0":
        return None
    kind = "worker" if args[:1] == ["worker"] else "light"
    if kind not in _SERVERS or _SERVERS[kind].proc.poll() is not None:
        _SERVERS[kind] = ForkServer(kind)
    return _SERVERS[kind]


if __name__ == "__main__":
    _preload(sys.argv[1])
    _child(_serve())
