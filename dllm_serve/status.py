"""``dllm-serve status`` / ``scripts/check_worker_status.py``: the balancer's /worker-status and /stats as a table,
a live view (``--monitor``), or JSON. Exit code: 0 all workers healthy, 1 degraded, 2 down, draining or unreachable."""
from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

COLOURS = {"idle": "green", "busy": "cyan", "starting": "yellow", "stalled": "magenta", "unhealthy": "red",
           "draining": "blue", "updating": "bright_blue"}


def fetch(url: str, timeout: float = 5.0) -> dict:
    """{"worker_status": ..., "stats": ...} or {"error": "..."}."""
    out = {}
    try:
        for key, path in (("worker_status", "/worker-status"), ("stats", "/stats")):
            with urllib.request.urlopen(url.rstrip("/") + path, timeout=timeout) as r:
                out[key] = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as e:
        return {"error": f"{url} unreachable: {getattr(e, 'reason', None) or type(e).__name__ + ': ' + str(e)}"}
    ws = out.get("worker_status")
    if not (isinstance(ws, dict) and isinstance(ws.get("workers"), list) and "healthy_workers" in ws
            and "total_workers" in ws and isinstance(out.get("stats"), dict)):
        return {"error": f"{url} is not a dllm-serve balancer (its /worker-status is not one)"}
    return out


def exit_code(data: dict) -> int:
    if "error" in data:
        return 2
    ws = data["worker_status"]
    if ws["healthy_workers"] == 0 or ws.get("system_status") == "draining":      # taking no new request
        return 2
    return 0 if ws["healthy_workers"] == ws["total_workers"] else 1


def _ago(v) -> str:
    return "-" if v is None else f"{v:.1f}s"


def _secs(v) -> str:
    return "-" if v is None else f"{v}s"


def _device(h: dict) -> str:
    """The worker's device, or its ranks' devices (tensor parallelism: "cuda:0,cuda:1"; a dead rank marked !)."""
    ranks = h.get("ranks")
    if ranks:
        return ",".join(r["device"] + ("" if r.get("alive", True) else "!") for r in ranks)
    return str(h.get("device") or "-")


def _status(w: dict) -> str:
    """A worker's status, with its process's crash loop where its supervisor reports one (serve --local)."""
    proc = w.get("process") or {}
    if not proc.get("crash_loop"):
        return w["status"]
    wait = proc.get("restart_in_seconds")
    return f"{w['status']} crash loop" + (f", restart in {wait:g}s" if wait is not None else "")


def render(data: dict, url: str):
    if "error" in data:
        return Text(data["error"], style="bold red")
    ws, st = data["worker_status"], data["stats"]
    sys_style = {"normal": "green", "overloaded": "yellow", "degraded": "yellow", "down": "bold red",
                 "draining": "bold blue"}
    head = Text.assemble(("dllm-serve ", "bold"), (url, "dim"), "  system: ",
                         (ws["system_status"], sys_style.get(ws["system_status"], "")),
                         f"  workers {ws['healthy_workers']}/{ws['total_workers']} healthy",
                         f"  queue {st['queue_depth']}  in flight {st['in_flight']}")
    t = Table(show_edge=False, header_style="bold", pad_edge=False)
    for col in ("id", "url", "status", "device", "weights", "requests", "batches", "served", "errors", "active",
                "step"):
        t.add_column(col, justify="right" if col not in ("url", "status") else "left", no_wrap=True,
                     min_width=9 if col == "status" else None)
    for w in ws["workers"]:
        h = w.get("worker_health") or {}
        v = w.get("model_version") or h.get("model_version") or {}
        t.add_row(str(w["worker_id"]), w["url"], Text(_status(w), style=COLOURS.get(w["status"], "")), _device(h),
                  (v.get("hash") or "-")[:8], str(w["in_flight"]), str(w.get("in_flight_batches", 0)), str(w["requests_served"]),
                  str(w["errors"]), _ago(w.get("last_activity_seconds_ago")),
                  # the balancer's own clock of the worker's progress (a /health answer is not aged: a dead or
                  # stopped worker's last one still says "0 s")
                  _ago(w.get("seconds_since_progress")) if w["status"] in ("busy", "stalled") else "-")
    cb, lm = st["centralized_batching"], st["last_minute"]
    legend = Text("weights: the start of its model_version hash; requests/batches: in flight; active: since the last "
                  "event; step: since the balancer last saw its device make progress (- unless busy or stalled)", style="dim")
    foot = Text(f"batching: max {cb['max_batch_size']}, wait {cb['max_wait_time']}s, batches "
                f"{cb['total_batches_processed']}, avg size {cb['avg_batch_size']}  |  last minute: "
                f"{lm['requests']} answers ({lm.get('ok', '?')} ok), {lm['requests_per_second']} answers/s, ok p50 "
                f"{_secs(lm['latency_p50'])}, "
                f"p99 {_secs(lm['latency_p99'])}  |  re-dispatched {st.get('redispatched_requests', 0)}")
    return Group(head, t, foot, legend)


def plain_line(data: dict, url: str) -> str:
    """One line of the monitor where stdout is not a terminal (a pipe, a log file): a timestamp, the system, each
    worker's status and load, and the last minute's throughput and latency."""
    now = time.strftime("%Y-%m-%dT%H:%M:%S")
    if "error" in data:
        return f"{now} dllm-serve {data['error']}"
    ws, st = data["worker_status"], data["stats"]
    lm = st["last_minute"]
    workers = " ".join(f"w{w['worker_id']}={_status(w).replace(' ', '_')}/requests:{w['in_flight']}"
                       f"/served:{w['requests_served']}/errors:{w['errors']}" for w in ws["workers"])
    return (f"{now} dllm-serve {url} system={ws['system_status']} healthy={ws['healthy_workers']}/{ws['total_workers']} "
            f"queue={st['queue_depth']} in_flight={st['in_flight']} req/s={lm['requests_per_second']} "
            f"p50={_secs(lm['latency_p50'])} p99={_secs(lm['latency_p99'])} {workers}")


def main(url: str, monitor: bool, interval: float, as_json: bool) -> int:
    import sys
    tty = sys.stdout.isatty()
    console = Console() if tty else Console(width=140)
    if monitor and not tty:         # rich's live view draws nothing without a terminal: one plain line per poll
        data = {"error": "interrupted before the first answer"}
        try:
            while True:
                data = fetch(url)
                print(plain_line(data, url), flush=True)
                time.sleep(interval)
        except (KeyboardInterrupt, BrokenPipeError):
            pass
        return exit_code(data)
    if as_json:
        data = fetch(url)
        print(json.dumps(data, indent=2))
        return exit_code(data)
    if not monitor:
        data = fetch(url)
        console.print(render(data, url))
        return exit_code(data)
    data = fetch(url)
    try:
        with Live(render(data, url), console=console, refresh_per_second=4, screen=False) as live:
            while True:
                time.sleep(interval)
                data = fetch(url)
                live.update(render(data, url))
    except KeyboardInterrupt:
        pass
    return exit_code(data)
