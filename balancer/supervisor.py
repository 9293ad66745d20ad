"""The local supervisor (`dllm-serve serve --local`): one parent process that starts one worker per GPU (or CPU
workers), waits for their readiness through /health (never fixed sleeps), serves the balancer in-process as soon as
``min_workers`` are ready, restarts crashed workers with backoff, reports crash loops with the log tail, keeps a
server-info file of KEY="VAL" lines, and on SIGINT/SIGTERM drains and stops everything. Never imports torch."""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

import click

from balancer.app import STATE, BalancerConfig, drain, make_app, start_sites, worker_urls
from balancer.batches import FolderInUse
from balancer.batcher import BatchConfig
from common.config import PORT, setting, to_args
from common.http import EXIT_PORT_IN_USE, AppRunner, raise_open_files
from common.resolve import served_names
from common.worker_config import WorkerConfig

log = logging.getLogger("dllm.supervisor")


def _urls(value: str | None) -> list[str]:
    """--extra-worker-urls: checked as the balancer's --worker-urls are (a base URL each)."""
    return worker_urls(value) if value and value.strip(", ") else []


def _path(value):
    return None if value is None else Path(value)


@dataclass
class ServeConfig:
    model_path: str = setting(cli=False)  # resolved by the command (a hub id, the demo model, a converted DCP)
    gpu_ids: list[str] | None = setting(None, cli=False)   # one worker per id (CUDA_VISIBLE_DEVICES); None: CPU
    cpu_workers: int = setting(1, cli=False)
    host: str = setting("127.0.0.1", "Balancer address.")
    port: int = setting(8000, type=PORT)
    worker_host: str = setting("127.0.0.1")
    worker_base_port: int = setting(8001, type=PORT)
    worker: dict = setting(default_factory=dict, cli=False)  # WorkerConfig settings for every worker (serve's flags)
    worker_args: list[str] = setting(default_factory=list, cli=False)   # more `dllm-serve worker` arguments
    log_level: str = setting("info", cli=False)                         # the workers' --log-level
    worker_api_key: str | None = setting(None, "Key between balancer and workers (generated per SLURM job).",
                                         envvar="DLLM_WORKER_API_KEY")
    balancer: BalancerConfig | None = setting(None, cli=False)
    extra_worker_urls: list[str] = setting(default_factory=list, help="Workers started elsewhere (multi-node).",
                                           convert=_urls, cli_default=None)
    no_balancer: bool = setting(False, "Workers only (other nodes of a multi-node job).")
    log_dir: Path | None = setting(None, "Worker logs (default: logs/port-PORT, so two servers from one checkout "
                                         "never share one).", type=click.Path(file_okay=False), convert=_path)
    server_info_file: Path | None = setting(None, 'KEY="VAL" file eval jobs wait on (SERVER_STATUS=running).',
                                            type=click.Path(dir_okay=False), convert=_path)
    stagger: float = setting(2.0, "Seconds between worker starts.", type=click.FloatRange(0))
    min_workers: int = setting(1, "Ready workers needed before the balancer serves.", type=click.IntRange(1))
    startup_timeout: float = setting(1800.0, "Seconds for the first --min-workers to become ready.",
                                     type=click.FloatRange(1))
    worker_start_timeout: float = setting(1800.0, "Seconds a started worker has to become ready; one still "
                                                  "starting then is killed and restarted as a crashed one.",
                                          type=click.FloatRange(1))
    restart_backoff: float = setting(1.0, "Seconds before a crashed worker is restarted, doubled per crash in a row "
                                          "up to --restart-backoff-max.", type=click.FloatRange(0))
    restart_backoff_max: float = setting(60.0, "Longest wait before a crashed worker is restarted.",
                                         type=click.FloatRange(0))
    crash_loop: int = setting(3, "Crashes of one worker within --crash-window seconds, or in a row without "
                                 "becoming ready, that make a crash loop (logged with its log's last lines; restarts "
                                 "go on with the back-off, but while the launch waits for --min-workers, serve gives "
                                 "up once too few workers can still become ready).",
                              type=click.IntRange(1))
    crash_window: float = setting(120.0, "Seconds over which --crash-loop crashes are counted.",
                                  type=click.FloatRange(0, min_open=True))
    stop_timeout: float = setting(30.0, "Seconds workers get to exit after SIGTERM (after the balancer's drain) "
                                        "before SIGKILL.", type=click.FloatRange(0))

    def __post_init__(self):
        if self.log_dir is None:
            self.log_dir = Path(f"logs/port-{self.port}")

    def worker_command(self) -> list[str]:
        """The `dllm-serve worker` arguments every worker gets (but its host and port): the balancer's batches in
        flight (the worker takes --max-inflight-per-worker times its batch size, without its own wait), a queue for
        eight, the checkpoint directory's absolute path and name as the served names unless given
        (common.resolve.served_names), then the pass-through settings."""
        batch = self.balancer.batch if self.balancer is not None else BatchConfig()
        values = {"batch_size": batch.batch_size * batch.max_inflight_per_worker, "max_wait_time": 0,
                  "max_queue": max(1024, batch.batch_size * 8),
                  "served_model_name": ",".join(served_names(self.model_path)), **self.worker}
        return to_args(WorkerConfig, values) + ["--log-level", self.log_level] + self.worker_args


def cpu_share(workers: int) -> int:
    """Each of ``workers`` CPU workers' torch threads: an equal share of the cores this process may use. Workers
    that each take every core wait on one another's threads (OpenMP spins at its barriers): with two on two cores,
    requests took minutes instead of a second."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, workers))


def die_with_parent() -> None:
    """Child side (Linux): receive SIGTERM when the supervisor dies, however it dies: no orphan workers."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class WorkerProc:
    index: int
    port: int
    gpu: str | None
    log_path: Path
    proc: subprocess.Popen | None = None
    crashes: list[float] = field(default_factory=list)
    in_a_row: int = 0                   # exits since it was last ready (the restart back-off doubles with them)
    restart_at: float | None = None
    ready: bool = False
    ever_ready: bool = False
    killed: bool = False                # killed for --worker-start-timeout (its exit not yet seen)
    started_at: float = 0.0
    launch_id: str = field(default_factory=lambda: secrets.token_hex(8))   # this slot's workers show it on /health
    exits: int = 0                      # its processes' exits since the launch
    last_exit: int | None = None        # the last one's code


def write_info_file(path: Path, info: dict, error: str | None = None) -> None:
    """The server-info file (KEY="VALUE" lines a shell can source), replaced atomically; with the SLURM job's id and
    ``error`` (one line, at most 2,000 characters) as SERVER_ERROR."""
    info = dict(info)
    if os.environ.get("SLURM_JOB_ID"):
        info["SLURM_JOB_ID"] = os.environ["SLURM_JOB_ID"]
    if error:
        error = error.replace('"', "'").replace("\n", " ")
        info["SERVER_ERROR"] = error if len(error) <= 2000 else error[:600] + " ... " + error[-1390:]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f'{k}="{_sh_quoted(v)}"\n' for k, v in info.items()))
    os.replace(tmp, path)


def write_failed_info(path: Path, error: str) -> None:
    """The server-info file of a launch that failed before it started anything (a bad model path, GPU flags, a DCP
    that does not convert): SERVER_STATUS="failed" and SERVER_ERROR, so a job waiting on the file stops waiting."""
    try:
        write_info_file(path, {"SERVER_STATUS": "failed", "SERVER_PID": str(os.getpid()),
                               "UPDATED": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, error)
    except OSError:
        pass                        # (its directory is not writable: the error itself says so on stderr)


def _sh_quoted(value: str) -> str:
    """``value`` inside double quotes as a shell reads it back (``source FILE``): \\, ", $ and ` escaped, a newline
    a space."""
    for ch in ("\\", '"', "$", "`"):
        value = value.replace(ch, "\\" + ch)
    return value.replace("\n", " ")


def log_tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


class Supervisor:
    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        if cfg.balancer is not None and cfg.balancer.api_key and not cfg.worker_api_key:
            if cfg.extra_worker_urls or cfg.no_balancer:
                log.warning("--api-key without --worker-api-key on a multi-node job: the workers' ports are open "
                            "to anyone who can reach them; give every node the same --worker-api-key")
            else:      # the workers are all ours: lock their ports with a key only this process knows
                cfg.worker_api_key = secrets.token_urlsafe(32)
        ids = cfg.gpu_ids if cfg.gpu_ids is not None else [None] * cfg.cpu_workers
        self.workers = [WorkerProc(i, cfg.worker_base_port + i, gpu, cfg.log_dir / f"worker-{i}.log")
                        for i, gpu in enumerate(ids)]
        self.stopping = False
        self.status = "initializing"
        self.runner: web.AppRunner | None = None
        self.app: web.Application | None = None
        self.fatal: str | None = None
        self._held_port: socket.socket | None = None      # the balancer's port until it listens (_reserve)
        self._hurry = asyncio.Event()   # a second signal: the shutdown stops waiting (_signalled)
        self._stop_asked = False        # a first signal came

    # ------------------------------------------------------------ server-info file
    @property
    def base_url(self) -> str:
        host = self.cfg.host if self.cfg.host not in ("0.0.0.0", "::") else os.uname().nodename
        return f"http://{host}:{self.cfg.port}"

    def write_info(self) -> None:
        if not self.cfg.server_info_file:
            return
        info = {
            "SERVER_STATUS": self.status,
            "SERVER_BASE_URL": self.base_url,
            "SERVER_HEALTH_URL": self.base_url + "/health",
            "SERVER_STATS_URL": self.base_url + "/stats",
            "SERVER_HOST": self.cfg.host,
            "SERVER_PORT": str(self.cfg.port),
            "SERVER_PID": str(os.getpid()),
            "MODEL_PATH": self.cfg.model_path,
            "NUM_WORKERS": str(len(self.workers) + len(self.cfg.extra_worker_urls)),
            "WORKER_URLS": ",".join(self.worker_urls()),
            "LOG_DIR": str(Path(self.cfg.log_dir).resolve()),     # (read from anywhere: absolute)
            "UPDATED": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        write_info_file(self.cfg.server_info_file, info, self.fatal)

    def worker_address(self) -> str:
        """Where this machine reaches its own workers (``--worker-host``; loopback when they listen on every
        address), in URL form (an IPv6 address bracketed)."""
        host = self.cfg.worker_host if self.cfg.worker_host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        return f"[{host}]" if ":" in host and not host.startswith("[") else host

    def worker_urls(self) -> list[str]:
        host = self.worker_address()
        return [f"http://{host}:{w.port}" for w in self.workers] + self.cfg.extra_worker_urls

    # ------------------------------------------------------------ workers
    def _spawn(self, w: WorkerProc) -> None:
        args, env = self._command(w)
        try:
            w.log_path.parent.mkdir(parents=True, exist_ok=True)      # (removed while running: made again)
            logf = open(w.log_path, "ab")
        except OSError as e:
            log.error("worker %d: cannot write its log %s (%s): its output is discarded", w.index, w.log_path, e)
            logf = open(os.devnull, "ab")
        logf.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} starting worker {w.index} on "
                   f"{'GPU ' + w.gpu if w.gpu is not None else 'CPU'}: {' '.join(args)}\n".encode())
        logf.flush()
        w.proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                  preexec_fn=die_with_parent, cwd=Path(__file__).resolve().parent.parent)
        logf.close()
        w.ready = w.killed = False
        w.started_at = time.monotonic()
        w.restart_at = None
        log.info("worker %d started (pid %d, port %d, %s)", w.index, w.proc.pid, w.port,
                 f"GPU {w.gpu}" if w.gpu is not None else "CPU")

    def _command(self, w: WorkerProc) -> tuple[list[str], dict]:
        """Worker ``w``'s command line and environment."""
        c = self.cfg
        args = [sys.executable, "-m", "dllm_serve", "worker", "--model-path", c.model_path,
                "--host", c.worker_host, "--port", str(w.port), *c.worker_command()]
        env = dict(os.environ)
        env.pop("DLLM_API_KEY", None)
        env["DLLM_LAUNCH_ID"] = w.launch_id          # the clients' key (if it came from the environment) is not theirs
        if c.worker_api_key:
            env["DLLM_API_KEY"] = c.worker_api_key
        if w.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = w.gpu
            args += ["--device", "cuda"]
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""
            args += ["--device", "cpu"]
            if not c.worker.get("threads"):
                args += ["--threads", str(cpu_share(c.cpu_workers))]
        return args, env

    def _kill_unready(self, w: WorkerProc, now: float) -> None:
        """A worker still not ready --worker-start-timeout after its start (a load hung on a file system, a
        rendezvous that never came): killed, so that it is restarted as a crashed one."""
        log.error("worker %d not ready %.0f s after its start (--worker-start-timeout): killing it. Last lines of "
                  "%s:\n%s", w.index, now - w.started_at, w.log_path, log_tail(w.log_path, 10))
        w.killed = True                  # once: its exit (next rounds) restarts it
        try:
            os.killpg(w.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    async def _probe(self, session: aiohttp.ClientSession, w: WorkerProc) -> bool:
        try:
            headers = {"Authorization": f"Bearer {self.cfg.worker_api_key}"} if self.cfg.worker_api_key else {}
            async with session.get(f"http://{self.worker_address()}:{w.port}/health", headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=2)) as r:
                data = await r.json(content_type=None)
            if not isinstance(data, dict) or data.get("launch_id") != w.launch_id:   # another server on our port
                return False
            return r.status == 200 and data.get("status") == "ready"
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return False

    def _on_exit(self, w: WorkerProc) -> None:
        code = w.proc.returncode
        if code == EXIT_PORT_IN_USE and self.status == "initializing" and not w.ever_ready:
            self.fatal = (f"worker {w.index} cannot listen on {self.cfg.worker_host}:{w.port}: address already in "
                          f"use (another server?); choose other ports with --worker-base-port")
            return
        if code == EXIT_PORT_IN_USE:    # serving already: its restart backs off and tries again (the whole server
            log.error("worker %d cannot listen on %s:%d again: address already in use (another server took it?)",
                      w.index, self.cfg.worker_host, w.port)      # was stopped for it: a review)
        if self.app is not None:       # the balancer's view follows at once
            self.app[STATE].pool.process_exited(self.app[STATE].pool.workers[w.index],
                                                f"its process exited (code {code})")
        now = time.monotonic()
        w.exits += 1
        w.last_exit = code
        w.crashes = [t for t in w.crashes if now - t < self.cfg.crash_window] + [now]
        w.ready = False
        w.in_a_row += 1
        delay = min(self.cfg.restart_backoff * 2 ** min(w.in_a_row - 1, 62), self.cfg.restart_backoff_max)
        w.restart_at = now + delay
        tail = log_tail(w.log_path)
        if self._looping(w):
            log.error("worker %d is in a crash loop (%d exits in %.0f s, %d since it was last ready, last code %s); "
                      "restarting in %.1f s. Last lines of %s:\n%s", w.index, len(w.crashes),
                      self.cfg.crash_window, w.in_a_row, code, delay, w.log_path, tail)
        else:
            log.warning("worker %d exited with code %s; restarting in %.1f s. Last lines of %s:\n%s",
                        w.index, code, delay, w.log_path, log_tail(w.log_path, 10))
        # at startup: give up once too few workers can still become ready (a worker that crashes after a load longer
        # than --crash-window / --crash-loop never made a crash loop, and the launch waited out --startup-timeout:
        # a review)
        if self.status == "initializing":
            need = min(self.cfg.min_workers, len(self.workers))
            hopeful = sum(1 for x in self.workers if x.ready or not self._looping(x))
            if hopeful < need:
                self.fatal = (f"{len(self.workers) - hopeful} of {len(self.workers)} workers crashed "
                              f"{self.cfg.crash_loop} times in a row without becoming ready (--crash-loop), fewer "
                              f"than --min-workers {need} can start; worker {w.index} last exited with code {code}; "
                              f"last lines of {w.log_path}:\n{tail}")

    def _looping(self, w: WorkerProc) -> bool:
        """In a crash loop: --crash-loop exits within --crash-window, or as many in a row without becoming ready."""
        now = time.monotonic()
        recent = [t for t in w.crashes if now - t < self.cfg.crash_window]
        return not w.ready and (len(recent) >= self.cfg.crash_loop or w.in_a_row >= self.cfg.crash_loop)

    def taken_ports(self) -> str | None:
        """One line naming the first port this launch needs that something else already holds, else None."""
        c = self.cfg
        wanted = [] if c.no_balancer else [(c.host, c.port, "the balancer's port (--port)")]
        wanted += [(c.worker_host, w.port, f"worker {w.index}'s port (--worker-base-port {c.worker_base_port})")
                   for w in self.workers]
        seen: dict[int, str] = {}
        for host, port, what in wanted:
            if port in seen:
                return f"{what} is {port}, which is also {seen[port]}: choose ports that do not overlap"
            seen[port] = what
        for host, port, what in wanted:
            try:
                with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind((host, port))
            except OSError as e:
                return f"{host}:{port}, {what}, is not free: {e.strerror or e}"
        if not c.no_balancer:
            self._reserve(c.host, c.port)
        return None

    def _reserve(self, host: str, port: int) -> None:
        """Hold the balancer's port until the balancer listens on it (the workers load meanwhile, minutes on GPUs):
        a socket bound without SO_REUSEADDR makes any other server's bind of it fail, this check's too, so a second
        launch on the same --port is refused at once instead of taking the port from the first as it finished
        loading (a review). Not listening: a client meanwhile is refused, as before. Best effort: a port with
        connections of a server just stopped (TIME_WAIT) cannot be held so; the check above still passed."""
        if not port:
            return
        s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            s.bind((host, port))
        except OSError:
            s.close()
            return
        self._held_port = s

    def _release_port(self) -> None:
        if self._held_port is not None:
            self._held_port.close()
            self._held_port = None

    # ------------------------------------------------------------ main loop
    async def run(self, stop: asyncio.Event | None = None) -> int:
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):   # SIGHUP: its terminal or SSH session closed
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue                # started under nohup: a session that closes leaves it serving (a review)
            loop.add_signal_handler(sig, self._signalled, stop)
        taken = self.taken_ports()
        if taken:                       # before anything starts: one line, no worker, never "ready"
            self.fatal, self.status = taken, "failed"
            log.error("cannot start: %s", taken)
            self.write_info()
            return 1
        self.write_info()
        async with aiohttp.ClientSession() as session:
            try:
                await self._serve(session, stop)
            except Exception as e:      # noqa: BLE001  (a bug, the system: never a stale "initializing" left behind)
                log.exception("the supervisor failed")
                self.fatal, self.status = f"the supervisor failed: {type(e).__name__}: {e}", "failed"
            await self._shutdown()
        return 1 if self.fatal else 0

    async def _seen_ready(self, ready: int) -> None:
        """Until the balancer's own probes have found the workers this supervisor found ready (its first ones take a
        moment), at most 10 s: "running" in the server-info file means a request is taken (an eval job that sent
        one at once got 503 "no healthy worker": a fresh-clone CI run of the SLURM test)."""
        if self.app is None:
            return
        pool = self.app[STATE].pool
        deadline = time.monotonic() + 10
        while (sum(w.healthy for w in pool.workers) < min(ready, 1) and time.monotonic() < deadline
               and not self._hurry.is_set() and not self.stopping and not self._stop_asked):
            await asyncio.sleep(0.02)

    def _signalled(self, stop: asyncio.Event) -> None:
        """SIGINT/SIGTERM/SIGHUP: drain and stop; a second one: stop now (the workers killed, no more drain)."""
        if stop.is_set():
            log.warning("a second signal: stopping now")
            self._hurry.set()
        self._stop_asked = True
        stop.set()

    async def _serve(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        next_start = time.monotonic()
        pending_start = list(self.workers)
        t0 = time.monotonic()
        while not stop.is_set():
            now = time.monotonic()
            if pending_start and now >= next_start:         # staggered starts
                self._spawn(pending_start.pop(0))
                next_start = now + self.cfg.stagger
            for w in self.workers:
                if w.proc is None:
                    continue
                if w.proc.poll() is not None and w.restart_at is None:
                    self._on_exit(w)
                elif w.restart_at is not None and now >= w.restart_at:
                    self._spawn(w)
                elif w.proc.poll() is None and not w.ready and await self._probe(session, w):
                    w.ready = w.ever_ready = True
                    w.in_a_row = 0
                    log.info("worker %d ready after %.1f s", w.index, time.monotonic() - w.started_at)
                elif (w.proc.poll() is None and not w.ready and not w.killed
                      and now - w.started_at > self.cfg.worker_start_timeout):
                    self._kill_unready(w, now)
            if self.fatal:
                log.error("giving up: %s", self.fatal)
                self.status = "failed"
                break
            ready = sum(w.ready for w in self.workers)
            if self.status == "initializing":
                if ready >= min(self.cfg.min_workers, len(self.workers)) or (not self.workers and not
                                                                              self.cfg.no_balancer):
                    try:
                        await self._start_balancer()
                    except OSError as e:
                        self.fatal = f"the balancer cannot listen on {self.cfg.host}:{self.cfg.port}: " \
                                     f"{e.strerror or e}"
                        log.error("giving up: %s", self.fatal)
                        self.status = "failed"
                        break
                    except FolderInUse as e:
                        self.fatal = str(e)
                        log.error("giving up: %s", self.fatal)
                        self.status = "failed"
                        break
                    await self._seen_ready(ready)
                    self.status = "running"
                    self.write_info()
                    log.info("serving on %s (%d/%d workers ready)", self.base_url, ready, len(self.workers))
                elif now - t0 > self.cfg.startup_timeout:
                    unready = [f"worker {w.index}: " + (f"{w.exits} exits, the last with code {w.last_exit}"
                                                        if w.exits else "no answer yet") + f" ({w.log_path})"
                               for w in self.workers if not w.ready]
                    self.fatal = f"fewer than {self.cfg.min_workers} workers ready after " \
                                 f"{self.cfg.startup_timeout:g} s; " + "; ".join(unready)
                    self.status = "failed"
                    log.error(self.fatal)
                    break
            try:
                await asyncio.wait_for(stop.wait(), 0.25)
            except asyncio.TimeoutError:
                pass

    def process_info(self, w: WorkerProc) -> dict:
        """Worker ``w``'s process as /worker-status shows it: its pid, exits since the launch and the last one's code,
        whether it is in a crash loop (``_looping``), the seconds to its restart (None while it runs) and its log."""
        now = time.monotonic()
        running = w.proc is not None and w.proc.poll() is None
        wait = None if running or w.restart_at is None else round(max(0.0, w.restart_at - now), 1)
        return {"pid": w.proc.pid if running else None, "exits": w.exits, "last_exit_code": w.last_exit,
                "crash_loop": self._looping(w), "restart_in_seconds": wait,
                "log": os.path.abspath(w.log_path)}

    async def _start_balancer(self) -> None:
        if self.cfg.no_balancer:
            return
        bcfg = self.cfg.balancer or BalancerConfig(worker_urls=[])
        bcfg.worker_urls = self.worker_urls()
        bcfg.worker_launch_ids = [w.launch_id for w in self.workers] + [None] * len(self.cfg.extra_worker_urls)
        bcfg.host, bcfg.port = self.cfg.host, self.cfg.port
        if self.cfg.worker_api_key:
            bcfg.worker_api_key = self.cfg.worker_api_key
        self._release_port()           # (held since the launch's port check)
        self.app = make_app(bcfg)
        for w, pw in zip(self.workers, self.app[STATE].pool.workers):     # /worker-status shows its process too
            pw.process = lambda w=w: self.process_info(w)
        self.runner = AppRunner(self.app, handler_cancellation=True, access_log=None,
                                keepalive_timeout=bcfg.keepalive_timeout, send_timeout=bcfg.send_timeout)
        await self.runner.setup()
        await start_sites(self.runner, bcfg)

    async def _shutdown(self) -> None:
        self._release_port()
        self.stopping = True
        if self.status != "failed":
            self.status = "stopping"
            self.write_info()
        log.info("stopping: draining the balancer, then the workers (a second Ctrl-C or signal: at once)")
        if self.app is not None:
            draining = asyncio.ensure_future(drain(self.app))
            hurry = asyncio.ensure_future(self._hurry.wait())
            await asyncio.wait([draining, hurry], return_when=asyncio.FIRST_COMPLETED)
            hurry.cancel()
            if not draining.done():     # (a second signal: the requests still open are answered 503 at once, as a
                draining.cancel()       # drain timeout does: their handlers held the cleanup 10 s: a review)
                await asyncio.gather(draining, return_exceptions=True)
                state = self.app[STATE]
                for p in [p for p in state.live.values() if not p.done]:
                    state.batcher.cancel(p)
                    p.fail(503, "the balancer is stopping at once (a second signal)", "service_unavailable")
            await self.runner.cleanup()
        live = [w for w in self.workers if w.proc is not None and w.proc.poll() is None]
        for w in live:
            w.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.stop_timeout
        while any(w.proc.poll() is None for w in live):     # (the loop goes on: a second signal is heard)
            if time.monotonic() > deadline or self._hurry.is_set():
                for w in live:
                    if w.proc.poll() is None:
                        log.warning("worker %d did not stop %s: SIGKILL", w.index, "at once" if self._hurry.is_set()
                                    else f"in {self.cfg.stop_timeout:.0f} s")
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(w.proc.pid, signal.SIGKILL)
                for w in live:
                    w.proc.wait()
                break
            await asyncio.sleep(0.05)
        if self.status != "failed":
            self.status = "stopped"
        self.write_info()
        log.info("stopped")


def run(cfg: ServeConfig) -> int:
    async def main():
        raise_open_files()          # (the workers it starts inherit it)
        return await Supervisor(cfg).run()
    try:
        import uvloop
        return uvloop.run(main())
    except ImportError:
        return asyncio.run(main())
