"""What serving costs the device: the time between one forward and the next on a worker under HTTP load (not a test:
it prints numbers).

A worker runs its engine on a device thread and its HTTP server, validation and answers on the event loop, in one
process with one GIL. When a forward ends (on a GPU: the step's one read returns), the device thread needs the GIL
back to build the next step; while the event loop is busy with requests it waits for it, up to the interpreter's
switch interval (5 ms by default), and the device idles meanwhile. This bench measures that gap with the simulated
device (a test double: ``--simulate-device STEP,0 --simulate-per-step``, each denoising round a sleep that releases
the GIL, as a device wait does): from the end of one round's sleep to the start of the next, in a worker process
whose simulated device is timed here, under load from ``wrk`` (Debian package; else an aiohttp client in this
process) at each connection count. The gap holds the engine's own host work per round too (small for the simulated
device); the lightest load is the reference.

  python bench/serving_gap_bench.py [--step-ms 15] [--connections 1,64,256] [--switch-interval 0.005,0.001]
"""
from __future__ import annotations

import argparse
import atexit
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _local import free_port, wait_ready
from balancer_bench import load_python, load_wrk

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "fixtures" / "tiny-llada"


def child(out: str, switch: float, argv: list[str]) -> None:
    """The worker process: the command line's ``worker`` with the simulated device's sleeps timed; the gaps go to
    ``out`` (JSON) when it exits."""
    sys.path.insert(0, str(ROOT))
    if switch:
        sys.setswitchinterval(switch)
    import worker.simulated as sim
    gaps: list[float] = []
    last = [None]

    class Timed:        # the module's ``time``, with its sleep (the simulated forward) timed
        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def sleep(seconds: float) -> None:
            t = time.perf_counter()
            if last[0] is not None:
                gaps.append(t - last[0])
            time.sleep(seconds)
            last[0] = time.perf_counter()

    sim.time = Timed
    steps = sim.SimulatedEngine._steps

    def timed_steps(self, *a, **k):     # a gap is counted within one engine call only (not idle time between them)
        last[0] = None
        return steps(self, *a, **k)
    sim.SimulatedEngine._steps = timed_steps
    signal.signal(signal.SIGUSR1, lambda *_: gaps.clear())       # the warm-up's gaps are not counted

    atexit.register(lambda: Path(out).write_text(json.dumps(gaps)))      # (the worker drains and exits on SIGTERM)
    from dllm_serve.cli import main
    sys.argv = ["dllm-serve", *argv]
    main()


def load(url: str, connections: int, duration: float, body: dict, tmp: Path) -> float:
    """Requests per second of ``connections`` closed-loop clients for ``duration`` seconds."""
    if shutil.which("wrk"):
        return load_wrk(url, connections, duration, tmp, body)["rps"]
    return load_python(url, connections, duration, body)["rps"]


def measure(step_ms: float, batch: int, connections: int, duration: float, switch: float, body: dict,
            tmp: Path) -> tuple[float, list[float]]:
    port = free_port()
    out = tmp / f"gaps-{connections}-{switch}.json"
    argv = ["worker", "--model-path", str(MODEL), "--port", str(port), "--simulate-device", f"{step_ms / 1000},0",
            "--simulate-per-step", "--batch-size", str(batch), "--max-wait-time", "0", "--max-queue", "100000",
            "--log-level", "warning"]
    log = open(tmp / "worker.log", "ab")
    p = subprocess.Popen([sys.executable, __file__, "--child", str(out), "--switch", str(switch), "--", *argv],
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url)
        load(url, connections, 2, body, tmp)            # warm-up
        p.send_signal(signal.SIGUSR1)
        rps = load(url, connections, duration, body, tmp)
    finally:
        p.terminate()
        p.wait(30)
    gaps = json.loads(out.read_text())
    return rps, gaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-ms", type=float, default=15.0, help="the simulated forward (a LLaDA-8B step on a GPU)")
    ap.add_argument("--batch-size", type=int, default=128, help="the worker's --batch-size")
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens (and steps) per request: short answers "
                    "make many requests per forward")
    ap.add_argument("--connections", default="1,64,256")
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--switch-interval", default="0", help="the worker's sys.setswitchinterval values to compare "
                    "(0: the interpreter's default, 0.005 s)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--switch", type=float, default=0.0, help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args.child:
        child(args.child, args.switch, rest[1:] if rest[:1] == ["--"] else rest)
        return
    body = {"prompt": [5, 6, 7, 8], "max_tokens": args.max_tokens}
    print(f"simulated forward {args.step_ms:g} ms per round; worker --batch-size {args.batch_size}; requests of "
          f"{args.max_tokens} tokens; {args.duration:g} s per point; load: {'wrk' if shutil.which('wrk') else 'aiohttp'}")
    print(f"{'switch s':>9} {'conns':>6} {'req/s':>8} {'rounds':>7} {'gap mean ms':>12} {'p50':>7} {'p90':>7} "
          f"{'p99':>7} {'max':>7} {'device idle':>12}")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for switch in [float(s) for s in args.switch_interval.split(",")]:
            for c in [int(c) for c in args.connections.split(",")]:
                rps, gaps = measure(args.step_ms, args.batch_size, c, args.duration, switch, body, tmp)
                g = sorted(x * 1000 for x in gaps)
                q = lambda f: g[min(len(g) - 1, int(f * len(g)))]
                mean = statistics.mean(g)
                print(f"{switch or 0.005:>9g} {c:>6} {rps:>8.0f} {len(g):>7} {mean:>12.3f} {q(.5):>7.3f} "
                      f"{q(.9):>7.3f} {q(.99):>7.3f} {g[-1]:>7.3f} {100 * mean / (mean + args.step_ms):>11.1f}%",
                      flush=True)


if __name__ == "__main__":
    main()
