"""One engine over several processes: tensor parallelism (``--tensor-parallel-size N``).

Rank 0 is the worker (or the ``generate`` command): it owns the scheduler and HTTP, loads its shard of the model
and starts ranks 1..N-1 as child processes (``python -m worker.engine.ranks``), each loading its own shard
(worker/models/parallel.py) on its own device (``cuda:<first + rank>``; on CPU every rank on the CPU). The ranks form
one torch.distributed group (NCCL on CUDA, gloo on CPU) over a loopback rendezvous; the model's collectives run in it.

Every rank runs the same engine code on the same inputs, so the followers need no HTTP of their own, and every
decision (sampling, confidence, caches, continuous batching) is made identically everywhere: the logits are gathered
whole on every rank and every generator is seeded the same. What only rank 0 knows goes to the followers over a
pipe each, before it is used:

- the batch (``generate``: the requests with their plans and seeds; ``score``: the scoring requests);
- after every denoising round: the rows that joined the batch and the rows cancelled since the last round (a
  cancellation takes effect at the next round on every rank, never in between).

A follower says "joining" over its pipe before it joins the group and "ready" once it has loaded a checkpoint (at
start, "load", "reload"); rank 0 waits for each word, up to ``startup_timeout`` seconds, watching the process, so a
slow start is not mistaken for a hung collective and a follower that cannot start fails the load at once.

Faults (docs/operations.md "Tensor parallelism"): a follower that exits, or fails during a batch, exits; rank 0 sees
its process end (a watchdog thread) and exits too, so the supervisor restarts the whole worker and the balancer
re-dispatches its requests. A collective that waits longer than ``rank_timeout`` seconds (a hung rank) raises and
ends rank 0 the same way. A follower whose rank 0 is gone reads end-of-file on its pipe when idle, or has its
collective fail (the peer's connection closed, or ``rank_timeout``) when busy, and exits: no rank outlives its
worker or waits forever.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection

import torch

log = logging.getLogger("dllm.worker.ranks")

EXIT_RANK_LOST = 70           # rank 0's exit status when its group broke (a rank died, hung or failed)


def rank_device(device: torch.device, rank: int) -> torch.device:
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, size: int, port: int, device: torch.device, timeout: float, startup_timeout: float):
    """Join the worker's process group; returns the layout (worker/models/parallel.py). The rendezvous waits up to
    ``startup_timeout`` seconds for every rank (a follower first starts Python and imports torch); the group's
    collectives then wait up to ``timeout``."""
    import torch.distributed as dist

    from ..models.parallel import Layout
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0,
                          timeout=timedelta(seconds=startup_timeout), wait_for_workers=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timedelta(seconds=timeout))
    return Layout(rank, size, None)


@dataclass
class RankGroup:
    """Rank 0's handle on its followers: their processes and pipes."""
    size: int
    procs: list[subprocess.Popen]
    conns: list[Connection]
    devices: list[str]
    layout: object = None               # rank 0's place (worker/models/parallel.py Layout)
    startup_timeout: float = 600.0      # seconds the followers may take to join and to load a checkpoint
    started: float = field(default_factory=time.time)
    closing: bool = False

    def send(self, msg) -> None:
        for c in self.conns:
            try:
                c.send(msg)
            except OSError as e:
                fatal(f"tensor-parallel rank unreachable ({e})")

    def wait_ready(self, what: str, word: str = "ready", failures: bool = False) -> list[tuple[int, str]]:
        """Wait until every follower says ``word``: "joining" when it is about to join the group, "ready" when it
        has loaded ``what`` (its first checkpoint, another one, new weights), so that rank 0 serves only once every
        rank can (a slow follower would otherwise hold rank 0's first collective for up to --rank-timeout). A
        follower that exits meanwhile, or takes longer than ``startup_timeout`` seconds, fails the load
        (RuntimeError) at once. ``failures``: new weights a follower could not read (its old ones back) are
        returned, ``[(rank, message)]``, instead of raised."""
        deadline = time.monotonic() + self.startup_timeout
        failed = []
        for r, (c, p) in enumerate(zip(self.conns, self.procs), start=1):
            closed = False
            while True:
                if closed:                      # its end of the pipe closed: it is exiting
                    time.sleep(0.1)
                else:
                    try:
                        if c.poll(0.2):
                            msg = c.recv()
                            if msg == (word,):
                                break
                            if failures and isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "failed":
                                failed.append((r, str(msg[1])))
                                break
                            raise RuntimeError(f"tensor-parallel rank {r} is out of step: sent {msg!r}")
                    except (EOFError, OSError):
                        closed = True
                if p.poll() is not None:
                    doing = f"loading {what}" if word == "ready" else "starting"
                    raise RuntimeError(f"tensor-parallel rank {r} (pid {p.pid}) exited with status {p.returncode} "
                                       f"while {doing} (its output, if any, is above)")
                if time.monotonic() > deadline:
                    done = f"load {what}" if word == "ready" else "start"
                    raise RuntimeError(f"tensor-parallel rank {r} (pid {p.pid}) did not {done} within "
                                       f"--rank-startup-timeout ({self.startup_timeout:g} s)")
        return failed

    def describe(self) -> list[dict]:
        """/health and /worker-status: every rank, its device and process."""
        out = [{"rank": 0, "device": self.devices[0], "pid": os.getpid(), "alive": True}]
        for r, p in enumerate(self.procs, start=1):
            out.append({"rank": r, "device": self.devices[r], "pid": p.pid, "alive": p.poll() is None})
        return out

    def watch(self, interval: float = 0.5) -> None:
        """A daemon thread that ends rank 0 when a follower's process ends (unless closing)."""
        def loop():
            while not self.closing:
                for r, p in enumerate(self.procs, start=1):
                    if p.poll() is not None and not self.closing:
                        fatal(f"tensor-parallel rank {r} (pid {p.pid}) exited with status {p.returncode}")
                time.sleep(interval)
        threading.Thread(target=loop, name="rank-watchdog", daemon=True).start()

    def close(self, wait: float = 10.0) -> None:
        """Stop the followers (they leave their loop) and leave the process group."""
        if self.closing:
            return
        self.closing = True
        for c in self.conns:
            try:
                c.send(("exit",))
                c.close()
            except OSError:
                pass
        deadline = time.monotonic() + wait
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
        if self in _GROUPS:
            _GROUPS.remove(self)


_GROUPS: list[RankGroup] = []        # this process's live rank groups (fatal kills their followers)


def fatal(message: str) -> None:
    """The worker's rank group is broken: say so, kill the followers (a hung one would never leave by itself) and
    end this process (the supervisor restarts the worker whole)."""
    log.critical("%s: ending this worker (status %d) so that it is restarted whole", message, EXIT_RANK_LOST)
    for g in _GROUPS:
        for p in g.procs:
            if p.poll() is None:
                p.kill()
    logging.shutdown()
    os._exit(EXIT_RANK_LOST)


def start(path, size: int, device: torch.device, dtype: str | None, compile: bool, timeout: float,
          prefix_cache_gb: float = 0.0, startup_timeout: float = 600.0):
    """On rank 0: start ranks 1..size-1 and join the group with them (``startup_timeout``: seconds they may take
    to join, and later to load a checkpoint; RankGroup.wait_ready). Returns (layout, RankGroup)."""
    port = _free_port()
    procs, conns = [], []
    if device.type == "cpu":        # the ranks share this machine's cores: each its share (rank 0 included)
        torch.set_num_threads(max(1, torch.get_num_threads() // size))
    for rank in range(1, size):
        mine, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "worker.engine.ranks", "--rank", str(rank), "--size", str(size),
               "--port", str(port), "--model-path", str(path), "--device", str(device),
               "--dtype", str(dtype or "auto"), "--timeout", str(timeout),
               "--startup-timeout", str(startup_timeout), "--fd", str(theirs.fileno()),
               "--threads", str(torch.get_num_threads()), "--prefix-cache-gb", str(prefix_cache_gb)] + (
                   ["--compile"] if compile else [])
        procs.append(subprocess.Popen(cmd, pass_fds=(theirs.fileno(),)))
        theirs.close()
        conns.append(Connection(mine.detach()))
    group = RankGroup(size, procs, conns, [str(rank_device(device, r)) for r in range(size)], None, startup_timeout)
    try:
        group.wait_ready(str(path), "joining")       # (a follower that cannot start fails here, not at a timeout)
        group.layout = init_group(0, size, port, device, timeout, startup_timeout)
    except Exception:
        for p in procs:
            p.kill()
        raise
    _GROUPS.append(group)
    return group.layout, group


# ---------------------------------------------------------------- what the ranks share during a batch
class LeaderRounds:
    """Rank 0's side of a tensor-parallel batch: the feed and the hooks the engine sees. After every round it sends
    the followers the rows cancelled since the last one and the rows that joined, and answers ``is_cancelled`` from
    that same snapshot, so every rank sees the same cancellations at the same step."""

    def __init__(self, group: RankGroup, engine, hooks, feed, indices):
        from .rows import StepHooks
        self.group, self.engine, self.inner_hooks, self.inner = group, engine, hooks, feed
        self.live = set(indices)
        self.cancelled: set[int] = set()
        self.hooks = StepHooks(on_progress=hooks.on_progress if hooks else None, is_cancelled=self.is_cancelled,
                               **({"on_step": hooks.on_step, "steps_for": hooks.steps_for} if hooks else {}))

    def is_cancelled(self, i: int) -> bool:
        return i in self.cancelled

    def poll(self) -> set[int]:
        asked = self.inner_hooks.is_cancelled if self.inner_hooks else None
        if asked is None:
            return set()
        new = {i for i in self.live - self.cancelled if asked(i)}
        self.cancelled |= new
        return new

    def admit(self, rows: int, tokens: int):
        new = self.poll()
        joined = self.inner.admit(rows, tokens) if self.inner is not None else []
        joined = [(i, self.engine.seeded(req)) for i, req in joined]
        self.live.update(i for i, _ in joined)
        self.group.send(("round", new, joined))
        return joined

    def done(self, index: int, result) -> None:
        self.live.discard(index)
        self.cancelled.discard(index)         # (a batch under steady load runs on: nothing per row stays)
        if self.inner is not None:
            self.inner.done(index, result)


class FollowerRounds:
    """A follower's side: the same feed and hooks, answered from rank 0's messages."""

    def __init__(self, conn: Connection, cancelled: set[int]):
        from .rows import StepHooks
        self.conn = conn
        self.cancelled = set(cancelled)
        self.hooks = StepHooks(is_cancelled=self.is_cancelled)

    def is_cancelled(self, i: int) -> bool:
        return i in self.cancelled

    def admit(self, rows: int, tokens: int):
        msg = self.conn.recv()
        if msg[0] != "round":
            raise RuntimeError(f"tensor-parallel follower out of step: expected a round, got {msg[0]!r}")
        self.cancelled |= msg[1]
        return msg[2]

    def done(self, index: int, result) -> None:
        self.cancelled.discard(index)


# ---------------------------------------------------------------- a follower
def follow(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="a tensor-parallel follower rank (started by rank 0; not for people)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--timeout", type=float, required=True)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--prefix-cache-gb", type=float, default=0.0)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {a.rank} %(levelname)s %(name)s: %(message)s")
    if a.threads:
        torch.set_num_threads(a.threads)
    conn = Connection(a.fd)
    from ..models.checkpoint import resolve_device
    from .engine import Engine
    device = rank_device(resolve_device(a.device), a.rank)
    conn.send(("joining",))
    layout = init_group(a.rank, a.size, a.port, device, a.timeout, a.startup_timeout)
    engine = Engine.from_pretrained(a.model_path, device=device, dtype=None if a.dtype == "auto" else a.dtype,
                                    compile=a.compile, layout=layout, prefix_cache_gb=a.prefix_cache_gb)
    log.info("rank %d of %d ready on %s", a.rank, a.size, device)
    conn.send(("ready",))                  # rank 0 serves only once every rank has loaded (RankGroup.wait_ready)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            log.info("rank 0 is gone: exiting")
            return 0
        try:
            if msg[0] == "exit":
                import torch.distributed as dist
                dist.destroy_process_group()
                return 0
            if msg[0] == "load":           # another checkpoint on the same ranks (Engine.from_pretrained(ranks=))
                _, path, dtype, prefix_cache_gb = msg
                engine = Engine.from_pretrained(path, device=device, dtype=dtype, compile=a.compile, layout=layout,
                                                prefix_cache_gb=prefix_cache_gb)
                log.info("rank %d loaded %s", a.rank, path)
                conn.send(("ready",))
            elif msg[0] == "reload":       # new weights in place (Engine.reload_weights on rank 0, checked there)
                try:
                    engine.reload_weights(msg[1])
                except (ValueError, OSError) as e:     # its old weights are back: rank 0 puts every rank back
                    log.error("rank %d could not read the weights of %s (%s): its old weights are back", a.rank,
                              msg[1], e)
                    conn.send(("failed", f"{type(e).__name__}: {e}"))
                else:
                    log.info("rank %d reloaded the weights of %s", a.rank, msg[1])
                    conn.send(("ready",))
            elif msg[0] == "generate":
                _, requests, early_exit, cancelled, long_row_cost = msg
                engine.long_row_cost = long_row_cost
                rounds = FollowerRounds(conn, cancelled)
                engine.generate(requests, early_exit=early_exit, hooks=rounds.hooks, feed=rounds)
            elif msg[0] == "score":
                engine.score(msg[1])
            else:
                raise RuntimeError(f"unknown message {msg[0]!r}")
        except Exception:       # noqa: BLE001  (out of step with rank 0 from here: end, so the worker restarts)
            log.exception("tensor-parallel rank %d failed during a batch: exiting", a.rank)
            logging.shutdown()
            os._exit(EXIT_RANK_LOST)


if __name__ == "__main__":
    sys.exit(follow())
