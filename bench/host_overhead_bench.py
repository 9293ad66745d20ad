"""The host's share of a denoising step, for every algorithm (not a test: it prints numbers).

What a step costs besides the model: the wall time of ``Engine.generate`` minus the time spent inside the model's
forward and logits calls (timed around them), per step, at batch 1 and at batch ``--batch``; on a GPU this is what
stands between one forward and the next. Also counted, per step: the calls that wait for the device on CUDA
(``Tensor.item``, ``tolist``, ``cpu``, ``numpy``, ``__bool__``/``__int__``/``__float__``, ``nonzero``, and
indexing by a bool tensor, which counts the mask's True values on the device before it can index, and a copy from
pageable host memory to the device, ``torch.tensor(..., device=)`` or on CUDA a blocking ``Tensor.to``, which
synchronises the stream; ``worker.models.layers.upload`` is the copy that does not wait). Each
algorithm runs on its family's tiny fixture (tests/fixtures), float32 on CPU, the whole canvas (early exit off).
With ``--ops``, also the tensor operations made outside the model per step (ATen operations as a
``TorchDispatchMode`` sees them, views and allocations aside): on a GPU each is a kernel launch or a copy, the host
work a step costs whatever the device; and at ``--batch`` the calls into torch (a ``TorchFunctionMode`` count: views
and attribute reads too, each host time).

  python bench/host_overhead_bench.py --batch 32 [--ops]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import random
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.utils._python_dispatch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from worker.engine import Engine, GenerationParams, Request  # noqa: E402
from worker.engine import algorithms  # noqa: E402
from worker.models import layers  # noqa: E402

FIXTURES = {"llada": "tiny-llada", "nemotron": "tiny-nemotron", "dream": "tiny-dream", "sdar": "tiny-sdar",
            "llada2": "tiny-llada2", "diffusion_gemma": "tiny-diffusion-gemma"}
SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero")


@contextlib.contextmanager
def counting_syncs(counter: list, sites: collections.Counter | None = None):
    """Counts the calls that would wait for a GPU. On this CPU run every tensor is a host tensor, so reads of a
    tensor that a ``.cpu()`` call already brought over (one counted transfer, then free reads on the host) are told
    apart by their storage; the count is what a CUDA run of the same code would sync."""
    real = {name: getattr(torch.Tensor, name) for name in SYNCS}
    copied: set[int] = set()

    def counted_at(name: str) -> None:
        counter[0] += 1
        if sites is not None:         # the innermost frame in the project's worker/ code
            for f in reversed(traceback.extract_stack()[:-2]):
                if "/worker/" in f.filename:
                    sites[f"{name} at {Path(f.filename).name}:{f.lineno}"] += 1
                    break

    def wrap(name, fn):
        def counted(self, *a, **k):
            out = fn(self, *a, **k)
            if name == "cpu":
                counted_at(name)
                copied.add(out.untyped_storage().data_ptr())
                return out
            if self.untyped_storage().data_ptr() not in copied:
                counted_at(name)
            return out
        return counted
    def masked(index) -> bool:       # indexing by a bool tensor counts its True values on the device first
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool and i.dim() > 0 for i in parts)

    def listed(index) -> bool:       # indexing by a Python list copies it to the device from pageable memory
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(i, list) for i in parts)

    def wrap_index(name, fn):
        def counted(self, index, *a):
            if masked(index):
                counted_at(f"{name} by a bool mask")
            elif listed(index):
                counted_at(f"{name} by a list (pageable host-to-device copy)")
            return fn(self, index, *a)
        return counted
    indexing = {name: getattr(torch.Tensor, name) for name in ("__getitem__", "__setitem__")}
    # a copy from pageable host memory to a CUDA device synchronises the stream: torch.tensor(..., device=...) from
    # the engine's code (on this CPU run too: there it would be such a copy; worker.models.layers.upload is the
    # copy that does not wait) and, on CUDA, Tensor.to from a host tensor that is not pinned or not non_blocking
    real_tensor, real_to = torch.tensor, torch.Tensor.to

    def tensor_counted(*a, **k):
        if k.get("device") is not None:
            counted_at("torch.tensor(device=) (pageable host-to-device copy)")
        return real_tensor(*a, **k)

    def to_counted(self, *a, **k):
        out = real_to(self, *a, **k)
        if self.device.type == "cpu" and out.device.type == "cuda" and not (k.get("non_blocking") and self.is_pinned()):
            counted_at("to (pageable host-to-device copy)")
        return out
    try:
        for name, fn in real.items():
            setattr(torch.Tensor, name, wrap(name, fn))
        for name, fn in indexing.items():
            setattr(torch.Tensor, name, wrap_index(name, fn))
        torch.tensor, torch.Tensor.to = tensor_counted, to_counted
        yield
    finally:
        for name, fn in {**real, **indexing}.items():
            setattr(torch.Tensor, name, fn)
        torch.tensor, torch.Tensor.to = real_tensor, real_to


# ATen operations that launch nothing: views, metadata, allocations without a fill
NOT_LAUNCHES = {"as_strided", "reshape", "view", "transpose", "t", "select", "slice", "expand", "unsqueeze",
                "_unsafe_view", "detach", "alias", "split", "split_with_sizes", "chunk", "unbind", "squeeze", "permute",
                "_reshape_alias", "lift_fresh", "view_as_real", "empty", "empty_strided", "unfold", "narrow",
                "_local_scalar_dense", "resolve_conj", "resolve_neg"}


class CallCount(torch.overrides.TorchFunctionMode):
    """Counts the calls into torch (functions, methods, views, attribute reads such as ``.shape``) made while no model
    call runs: each is host time, a few microseconds for a CUDA tensor."""

    def __init__(self, clock: "ModelClock"):
        super().__init__()
        self.clock, self.n = clock, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.clock.depth == 0:
            self.n += 1
        return func(*args, **(kwargs or {}))


class OpCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ATen operations made while no model call runs (``clock.depth == 0``)."""

    def __init__(self, clock: "ModelClock"):
        super().__init__()
        self.clock, self.n = clock, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.clock.depth == 0 and func.__name__.split(".")[0] not in NOT_LAUNCHES:
            self.n += 1
        return func(*args, **(kwargs or {}))


def sync() -> None:
    """On CUDA, the model's time is its kernels' (each timed call waits for them): the rest is the host's."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def device_cycles(ms: float) -> int:
    """The argument of ``torch.cuda._sleep`` (a kernel that spins for that many GPU clock cycles) that keeps the
    device busy for ``ms`` milliseconds, measured."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(ms * 10_000_000 / start.elapsed_time(end))


class ModelClock:
    """Times every call into the model (forward, logits, encode, denoise) on the engine's model object. With
    ``cycles`` (CUDA), no call waits for the device: the forward, encode and denoise calls each queue a kernel that
    keeps the device busy that long instead (``slept`` counts them), a model of a real forward's device time."""

    def __init__(self, model, cycles: int = 0):
        self.model, self.seconds, self.calls = model, 0.0, 0
        self.cycles, self.slept = cycles, 0
        self.depth = 0          # > 0 while a model call runs
        cls = type(model)
        for name in ("logits", "encode", "denoise"):          # forward runs inside __call__, timed below
            fn = getattr(cls, name, None)
            if fn is not None:
                setattr(model, name, self._timed(getattr(model, name), name != "logits"))
        # nn.Module.__call__ dispatches to forward through the class: time the call itself too
        self._call = cls.__call__
        clock = self

        class Timed(cls):
            def __call__(self, *a, **k):
                t = time.perf_counter()
                clock.depth += 1
                try:
                    return clock._call(self, *a, **k)
                finally:
                    clock.depth -= 1
                    clock.done(True)
                    clock.seconds += time.perf_counter() - t
                    clock.calls += 1
        model.__class__ = Timed

    def done(self, forward: bool) -> None:
        if not self.cycles:
            sync()
        elif forward and self.depth == 0:
            torch.cuda._sleep(self.cycles)
            self.slept += 1

    def _timed(self, fn, forward: bool):
        def timed(*a, **k):
            t = time.perf_counter()
            self.depth += 1
            try:
                return fn(*a, **k)
            finally:
                self.depth -= 1
                self.done(forward)
                self.seconds += time.perf_counter() - t
        return timed


def params(alg: str, engine: Engine, gen: int) -> GenerationParams:
    block = engine.default_block_length or 8
    if alg == "diffusion_gemma":
        return GenerationParams(gen_length=gen, block_length=engine.model.cfg.canvas_length, algorithm=alg, seed=1,
                                extra={"max_denoising_steps": 8})
    if alg in ("llada2", "llada21", "sdar"):      # steps per block: their defaults (the block's length)
        return GenerationParams(gen_length=gen, block_length=block, algorithm=alg)
    thr = 0.9 if alg.startswith("dinfer") else None
    return GenerationParams(gen_length=gen, block_length=block, steps=gen, algorithm=alg, threshold=thr)


def measure(engine: Engine, alg: str, batch: int, gen: int, reps: int,
            sites: collections.Counter | None = None, ops: bool = False,
            tokens: list | None = None) -> tuple[float, float, int, float | None, float | None]:
    """(host microseconds per step, device-waiting calls per step, steps, with ``ops`` tensor operations and calls
    into torch outside the model per step from one more, untimed run) over ``reps`` runs; ``tokens``: a list that
    receives the last run's tokens and forwards, row by row."""
    rng = random.Random(0)
    vocab = min(engine.model.cfg.vocab_size if hasattr(engine.model.cfg, "vocab_size") else 250, 250)
    reqs = [Request([rng.randrange(5, vocab) for _ in range(16)], params(alg, engine, gen)) for _ in range(batch)]
    engine.generate(reqs[:1], early_exit=False)          # warm-up
    clock = ModelClock(engine.model)
    host, syncs, steps = [], [0], 0
    for _ in range(reps):
        clock.seconds = 0.0
        before = syncs[0]
        t = time.perf_counter()
        with counting_syncs(syncs, sites):
            res = engine.generate(reqs, early_exit=False)
        wall = time.perf_counter() - t
        n = max(r.nfe for r in res)                       # the batch's steps (its longest row's forwards)
        host.append((wall - clock.seconds) / n * 1e6)
        steps = n
        syncs_per_step = (syncs[0] - before) / n
    if tokens is not None:
        tokens[:] = [(r.token_ids, r.nfe) for r in res]
    ops_per_step = calls_per_step = None
    if ops:
        with CallCount(clock) as calls, OpCount(clock) as counted:
            res = engine.generate(reqs, early_exit=False)
        ops_per_step = counted.n / max(r.nfe for r in res)
        calls_per_step = calls.n / max(r.nfe for r in res)
    engine.model.__class__ = engine.model.__class__.__mro__[1]
    return min(host), syncs_per_step, steps, ops_per_step, calls_per_step


def exposed(engine: Engine, alg: str, batch: int, gen: int, reps: int, ms: float, cycles: int) -> float:
    """On CUDA: microseconds per step that the host adds to a device whose every forward takes ``ms``
    (:class:`ModelClock` with ``cycles``; nothing waits for the device but the engine's own reads): wall time per
    step minus the device's forward time per step, the minimum over ``reps`` runs. What a non-blocking copy or a
    launch queued behind a running forward saves shows here, not in the host time (which waits after every call)."""
    rng = random.Random(0)
    vocab = min(engine.model.cfg.vocab_size if hasattr(engine.model.cfg, "vocab_size") else 250, 250)
    reqs = [Request([rng.randrange(5, vocab) for _ in range(16)], params(alg, engine, gen)) for _ in range(batch)]
    engine.generate(reqs[:1], early_exit=False)
    clock = ModelClock(engine.model, cycles)
    best = float("inf")
    try:
        for _ in range(reps):
            clock.slept = 0
            torch.cuda.synchronize()
            t = time.perf_counter()
            res = engine.generate(reqs, early_exit=False)
            torch.cuda.synchronize()
            n = max(r.nfe for r in res)
            best = min(best, ((time.perf_counter() - t) - clock.slept * ms / 1000) / n * 1e6)
    finally:
        engine.model.__class__ = engine.model.__class__.__mro__[1]
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", help="comma-separated algorithm names")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (bfloat16 there, float32 on the CPU)")
    ap.add_argument("--where", action="store_true", help="also print where the device-waiting calls are, per step "
                    "at --batch (slower: a stack per call)")
    ap.add_argument("--ops", action="store_true", help="also count the tensor operations and the calls into torch "
                    "outside the model per step (one more, untimed run per batch size)")
    ap.add_argument("--compare-uploads", action="store_true",
                    help="on CUDA, also at --batch with the plain, waiting host-to-device copies instead of "
                    "worker.models.layers.upload's non-blocking ones: the host time, and whether the tokens are the same")
    ap.add_argument("--device-ms", type=float, default=0.0,
                    help="on CUDA, also at --batch: the host time a step adds to a device whose every forward takes "
                    "this long (a sleeping kernel for the forward; nothing waits after it), with --compare-uploads "
                    "for the waiting copies too")
    args = ap.parse_args()
    torch.set_num_threads(1)
    compare = args.compare_uploads          # (on the CPU both copies are the plain one)
    if args.device_ms and args.device == "cpu":
        ap.error("--device-ms needs a CUDA device")
    cycles = device_cycles(args.device_ms) if args.device_ms else 0
    only = set(args.only.split(",")) if args.only else None
    engines: dict[str, Engine] = {}
    print(f"host time per step = wall - time inside the model, minimum of {args.reps} runs; prompts of 16 tokens, "
          f"{args.gen} generated, {'float32 CPU, 1 thread' if args.device == 'cpu' else args.device + ', bfloat16'}")
    print(f"{'algorithm':<18} {'family':<16} {'us/step b=1':>12} {'us/step b=' + str(args.batch):>13} "
          f"{'us/row':>8} {'syncs/step b=1':>15} {'b=' + str(args.batch):>7}"
          + (f" {'ops/step b=1':>13} {'b=' + str(args.batch):>7} {'calls b=' + str(args.batch):>9}" if args.ops
             else "")
          + (f" {'waiting copies b=' + str(args.batch):>19} {'syncs':>6} {'tokens':>10}" if compare else "")
          + (f" {'added at ' + str(args.device_ms) + ' ms':>16}" + (f" {'waiting':>8}" if compare else "")
             if cycles else ""))
    for name in sorted(algorithms.REGISTRY):
        if only and name not in only:
            continue
        family = algorithms.REGISTRY[name].families[0]
        if family not in engines:
            engines[family] = Engine.from_pretrained(ROOT / "tests" / "fixtures" / FIXTURES[family],
                                                     device=args.device, dtype="auto")
        e = engines[family]
        one, s1, _, o1, _ = measure(e, name, 1, args.gen, args.reps, ops=args.ops)
        toks: list = []
        many, sn, _, on, cn = measure(e, name, args.batch, args.gen, args.reps, ops=args.ops, tokens=toks)
        extra = ""
        if compare:
            layers.NON_BLOCKING_UPLOADS = False
            try:
                plain: list = []
                waiting, sw, _, _, _ = measure(e, name, args.batch, args.gen, args.reps, tokens=plain)
            finally:
                layers.NON_BLOCKING_UPLOADS = True
            extra = f" {waiting:>19.0f} {sw:>6.1f} {'identical' if plain == toks else 'DIFFER':>10}"
        if cycles:
            extra += f" {exposed(e, name, args.batch, args.gen, args.reps, args.device_ms, cycles):>16.0f}"
            if compare:
                layers.NON_BLOCKING_UPLOADS = False
                try:
                    extra += f" {exposed(e, name, args.batch, args.gen, args.reps, args.device_ms, cycles):>8.0f}"
                finally:
                    layers.NON_BLOCKING_UPLOADS = True
        print(f"{name:<18} {family:<16} {one:>12.0f} {many:>13.0f} {(many - one) / (args.batch - 1):>8.1f} "
              f"{s1:>15.1f} {sn:>7.1f}" + (f" {o1:>13.1f} {on:>7.1f} {cn:>9.1f}" if args.ops else "") + extra,
              flush=True)
        if args.where:
            sites: collections.Counter = collections.Counter()
            _, _, steps, _, _ = measure(e, name, args.batch, args.gen, 1, sites)
            for site, n in sites.most_common(8):
                print(f"    {n / steps:6.1f}/step  {site}")


if __name__ == "__main__":
    main()
