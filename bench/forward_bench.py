"""One model forward, alone: is it the device's arithmetic or the host's launches? (not a test: it prints numbers)

For a LLaDA-shaped model with random weights (engine_bench's shapes) at a few (tokens, rows) sizes: the wall time of
an eager forward, of a forward plus the logits, the device's busy time inside one forward and the number of kernels
it launched (``torch.profiler``, CUDA only), and the time of the same forward replayed from a CUDA graph (the same
kernels with the launches taken off the host). Where the eager wall time is well above the busy time, a step waits
on the host's launches, not on the GPU.

  python bench/forward_bench.py --shape llada-8b --device cuda
  python bench/forward_bench.py --shape llada-small --device cpu      # wall times and op counts only
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine_bench import SHAPES, random_engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llada-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sizes", default="32x1,32x16,288x1", help="comma-separated TOKENSxROWS")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn) -> float:
        fn()
        sync()
        t = time.perf_counter()
        for _ in range(args.reps):
            fn()
        sync()
        return (time.perf_counter() - t) / args.reps * 1e3

    t = time.perf_counter()
    model = random_engine(args.shape, device, dtype).model
    sync()
    print(f"{args.shape} (random weights), {dtype} on {device}, built in {time.perf_counter() - t:.1f} s; "
          f"milliseconds per forward, mean of {args.reps}")
    print(f"{'tokens':>6} {'rows':>5} {'eager':>8} {'+logits':>8} {'busy':>8} {'kernels':>8} {'graph':>8}")
    from torch.profiler import ProfilerActivity, profile
    for size in args.sizes.split(","):
        L, B = (int(x) for x in size.split("x"))
        ids = torch.randint(0, 1000, (B, L), device=device)
        pos = torch.arange(L, device=device).expand(B, L).contiguous()
        with torch.no_grad():
            def fwd():
                return model(ids, pos)
            eager = timed(fwd)
            logits = timed(lambda: model.logits(model(ids, pos)))
            busy = kernels = graph = float("nan")
            activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
            with profile(activities=activities) as prof:
                fwd()
                sync()
            ev = prof.key_averages()
            if cuda:
                dev_us = [getattr(k, "self_device_time_total", getattr(k, "self_cuda_time_total", 0)) for k in ev]
                busy = sum(dev_us) / 1e3
                kernels = sum(k.count for k, us in zip(ev, dev_us) if us > 0)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        fwd()
                torch.cuda.current_stream().wait_stream(stream)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fwd()
                graph = timed(g.replay)
            else:      # on the CPU, the outermost ops that do work (no views): about what a GPU would launch
                views = ("view", "reshape", "transpose", "select", "slice", "expand", "unsqueeze", "as_strided",
                         "t", "detach", "alias", "empty", "empty_strided", "permute", "split", "chunk", "unbind",
                         "matmul", "linear", "to", "_unsafe_view", "contiguous", "squeeze", "_reshape_alias")
                def work(e) -> bool:
                    return e is not None and e.name.startswith("aten::") and e.name[6:] not in views

                def outer(e) -> bool:
                    p = e.cpu_parent
                    while p is not None:
                        if work(p):
                            return False
                        p = p.cpu_parent
                    return True
                kernels = sum(1 for e in prof.events() if work(e) and outer(e))
        print(f"{L:>6} {B:>5} {eager:>8.2f} {logits:>8.2f} {busy:>8.2f} {kernels:>8} {graph:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
