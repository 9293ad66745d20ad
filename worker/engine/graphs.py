"""A model's forward replayed from CUDA graphs: the same kernels, launched by the GPU instead of the host.

On a GPU a diffusion step's forward is launch-bound at small batches (docs/benchmarks.md, "On a GPU": the LLaDA-8B
window forward launches ~1,500 kernels, 16.6 ms eager against 7.8 ms replayed from a graph). :class:`GraphedForward`
takes the place of a model's ``forward`` (``model.forward = GraphedForward(model)``; every algorithm calls the model
as before) and keeps one captured graph per *signature* of a call: the shapes and dtypes of its tensors (ids,
positions, attention mask, cache slots, the window's index tensors), the window's key extent, and the cache it reads
and writes (the addresses and layout of its key/value tensors). A block's steps repeat their signature step after
step, so few graphs serve a whole decode. DiffusionGemma's decoder pass (``DiffusionGemmaModel.decoder_hidden``,
its canvas over the rows' cached contexts) is served the same way by :class:`GraphedDecoder`.

- The first call of a signature runs eagerly; the second runs eagerly on the capture stream (its result is the
  call's result) and captures the graph; later calls copy their inputs into the graph's input buffers, replay it and
  return a copy of its output (graphs share one memory pool, so an output is copied out before the next replay).
- Exact: a graph replays the kernels the eager forward launched, on the same shapes, so the numbers are the same
  (tests/test_graphs.py checks the plumbing with a simulated graph on the CPU; `bench/gpu_run.sh` compares tokens
  with graphs on and off on a GPU).
- Only calls of at most ``max_tokens`` tokens (rows x positions) are captured: a larger one keeps the device busy
  for longer than its launches take, and each graph holds its output (and the pool the largest intermediates) for as
  long as it lives. At most ``max_graphs`` graphs are kept (least recently replayed first out). A cache that grows
  or drops rows (continuous batching) has new tensors, hence new signatures; the old graphs age out.
- Only for models without host synchronisation in their forward (``cuda_graphs = True`` on the model class: the
  dense families; a mixture-of-experts forward that sizes its expert batches on the host cannot be captured). A
  capture that fails turns graphs off for the model, logged once, and it runs eagerly from then on.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch

log = logging.getLogger(__name__)


class CudaBackend:
    """Capture and replay with ``torch.cuda.CUDAGraph`` (one memory pool shared by every graph, one capture
    stream)."""

    def __init__(self, device: torch.device):
        self.device = device
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)
            self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn):
        """Run ``fn`` on the capture stream (its result is returned) and capture a second call of it. Returns
        (result, graph, the graph's output tensor)."""
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        try:
            with torch.cuda.stream(self.stream):     # on the graph's stream first: lazy initialisations (cuBLAS
                out = fn()                           # workspaces) happen outside the capture
        finally:
            main.wait_stream(self.stream)            # also when it failed: the main stream frees what it queued
        out.record_stream(main)
        g = torch.cuda.CUDAGraph()
        # capture_begin/end rather than torch.cuda.graph(), which also synchronises the device, runs the garbage
        # collector and empties the allocator's cache at every capture; "thread_local": the server's other threads
        # may touch CUDA meanwhile
        with torch.cuda.stream(self.stream):
            g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                static_out = fn()
            except BaseException:
                try:
                    g.capture_end()          # ends the capture; its own error must not hide the first one
                except Exception:            # noqa: BLE001
                    pass
                raise
            g.capture_end()
        return out, g, static_out

    @staticmethod
    def replay(graph) -> None:
        graph.replay()

    def reset(self) -> None:
        """A new memory pool, for graphs captured after every earlier one was dropped (a pool whose graphs are all
        gone cannot take new captures)."""
        with torch.cuda.device(self.device):
            self.pool = torch.cuda.graph_pool_handle()


class _CacheSlot:
    """The cache argument as a graph sees it: whichever cache the current call passes (its signature guarantees that
    its key/value tensors have the captured addresses and layout). A graph records addresses, not Python objects: a
    cache object that later drops rows has new tensors, and a call whose cache has the captured addresses may come
    from another object. Holding no cache between calls, it keeps none alive."""

    def __init__(self):
        self.__dict__["_target"] = None

    def __getattr__(self, name):
        return getattr(self.__dict__["_target"], name)


def cache_tensors(cache) -> list[torch.Tensor]:
    """The key/value tensors a cache holds: ``k``/``v`` tensors (KVCache) or lists of them (one per layer)."""
    out = []
    for t in (cache.k, cache.v):
        out.extend(t if isinstance(t, (list, tuple)) else [t])
    return out


class Graphs:
    """Graphs of one function of tensors, keyed by signature (module docstring). ``stats``: calls served by replays,
    captures and eager runs, graphs evicted."""

    def __init__(self, name: str, device, max_graphs: int = 32, backend=None, max_tokens: int = 2048):
        self.name = name
        self.backend = backend if backend is not None else CudaBackend(device)
        self.max_graphs = max(1, int(max_graphs))
        self.max_tokens = int(max_tokens)
        self.graphs: OrderedDict = OrderedDict()   # signature -> (graph, input buffers, output)
        self.seen: OrderedDict = OrderedDict()     # signatures met once (bounded)
        self.stats = {"replays": 0, "captures": 0, "eager": 0, "evicted": 0}
        self.failed: str | None = None
        self.slot = _CacheSlot()

    def __call__(self, fn, tensors: tuple, extra: tuple, cache, tokens: int):
        """``fn(*tensors, cache)``, replayed from a graph where one fits: ``tensors`` its tensor arguments (or None),
        ``extra`` every other value its kernels depend on (hashable), ``cache`` the cache it reads and writes (or
        None), ``tokens`` the call's rows x positions."""
        if self.failed is not None or torch.is_grad_enabled() or tokens > self.max_tokens:
            self.stats["eager"] += 1
            return fn(*tensors, cache)
        # inference mode is in the key: a graph's input buffers made under it (generation) cannot be written outside it
        # (likelihood scoring runs under no_grad)
        key = (tuple(None if t is None else (tuple(t.shape), t.dtype) for t in tensors), extra,
               torch.is_inference_mode_enabled(),
               None if cache is None else tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
                                                for t in cache_tensors(cache)))
        hit = self.graphs.get(key)
        if hit is not None:
            self.graphs.move_to_end(key)
            graph, buffers, out = hit
            for b, t in zip(buffers, tensors):
                if b is not None:
                    b.copy_(t)
            self.slot.__dict__["_target"] = cache
            try:
                self.backend.replay(graph)
            finally:
                self.slot.__dict__["_target"] = None
            self.stats["replays"] += 1
            return out.clone()
        if key not in self.seen:
            self.seen[key] = True
            if len(self.seen) > 4 * self.max_graphs:
                self.seen.popitem(last=False)
            self.stats["eager"] += 1
            return fn(*tensors, cache)
        del self.seen[key]
        buffers = tuple(None if t is None else t.clone(memory_format=torch.contiguous_format) for t in tensors)
        slot = None if cache is None else self.slot
        self.slot.__dict__["_target"] = cache
        try:
            result, graph, out = self.backend.capture(lambda: fn(*buffers, slot))
        except torch.OutOfMemoryError:
            raise
        except Exception as e:     # noqa: BLE001  (an op the capture refuses: eager from now on, once, loudly)
            self.failed = f"{type(e).__name__}: {str(e)[:300]}"
            log.warning("CUDA graph capture failed for %s, running eagerly from now on: %s", self.name, self.failed)
            self.graphs.clear()
            self.stats["eager"] += 1
            return fn(*tensors, cache)
        finally:
            self.slot.__dict__["_target"] = None
        self.graphs[key] = (graph, buffers, out)
        self.stats["captures"] += 1
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
            self.stats["evicted"] += 1
        return result

    def clear(self) -> None:
        """Drop every graph (the weights were replaced)."""
        self.graphs.clear()
        self.seen.clear()
        reset = getattr(self.backend, "reset", None)
        if reset is not None:
            reset()

    def report(self) -> dict:
        return {"graphs": len(self.graphs), "max_graphs": self.max_graphs, "max_tokens": self.max_tokens,
                **self.stats, "failed": self.failed}


class GraphedForward(Graphs):
    """``model.forward(ids, pos, mask, cache, slots, window)`` (the LLaDA and Qwen-style families) from graphs."""

    def __init__(self, model, max_graphs: int = 32, backend=None, max_tokens: int = 2048):
        super().__init__(type(model).__name__, model.device, max_graphs, backend, max_tokens)
        self.model = model
        self.eager = type(model).forward.__get__(model)        # the class's forward, not this wrapper

    def _run(self, ids, pos, mask, slots, bi, wi, cols, cache, tail=()):
        window = None if bi is None else (bi, wi, cols, *tail)
        return self.eager(ids, pos, mask, cache, slots, window)

    def __call__(self, ids, pos, mask=None, cache=None, slots=None, window=None):
        tail = () if window is None else tuple(window[3:])
        win = (None, None, None) if window is None else tuple(window[:3])
        return super().__call__(lambda *a: self._run(*a, tail=tail), (ids, pos, mask, slots, *win),
                                (None if window is None else len(window), tail), cache, ids.numel())


class GraphedDecoder(Graphs):
    """DiffusionGemma's decoder pass (``model.decoder_hidden``) from graphs; the cache is its ContextCache (every
    layer's key/value tensors in the signature) and the slice widths of the cached context are part of it."""

    def __init__(self, model, max_graphs: int = 32, backend=None, max_tokens: int = 2048):
        super().__init__(type(model).__name__, model.device, max_graphs, backend, max_tokens)
        self.model = model
        self.eager = type(model).decoder_hidden.__get__(model)

    def __call__(self, canvas, soft, st, slot_idx, full_mask, slide_mask, n_full: int, n_slide: int, cache):
        def run(canvas, soft, st, slot_idx, full_mask, slide_mask, cache):
            return self.eager(canvas, soft, st, slot_idx, full_mask, slide_mask, n_full, n_slide, cache)
        return super().__call__(run, (canvas, soft, st, slot_idx, full_mask, slide_mask), (n_full, n_slide), cache,
                                canvas.numel())


def install(model, max_graphs: int = 32, backend=None, max_tokens: int = 2048) -> Graphs | None:
    """Replay ``model``'s forward (or DiffusionGemma's decoder pass) from graphs (``max_graphs``, ``max_tokens``: see
    :class:`Graphs`) where that is sound: the model says its forward has no host synchronisation (``cuda_graphs``),
    it runs on CUDA (unless a ``backend`` is given: tests) and unsharded, and it is not already going through
    ``torch.compile``. Returns the wrapper, or None (logged) when graphs do not apply."""
    name = type(model).__name__
    if not getattr(model, "cuda_graphs", False):
        log.info("CUDA graphs: %s's forward synchronises with the host here (mixture of experts: the experts' token "
                 "counts are read on the host); it runs eagerly", name)
        return None
    if backend is None and model.device.type != "cuda":
        log.info("CUDA graphs apply on a CUDA device only (%s is on %s)", name, model.device)
        return None
    tp = getattr(model, "tp", None)
    if tp is not None and tp.parallel:
        log.info("CUDA graphs are not used with tensor parallelism (collectives run eagerly)")
        return None
    from ..models.layers import Compiled
    if any(isinstance(getattr(m, "dense", None), Compiled) for m in model.modules()):
        log.info("CUDA graphs are not used together with --compile")
        return None
    if hasattr(type(model), "decoder_hidden"):
        g = GraphedDecoder(model, max_graphs, backend, max_tokens)
        model.decoder_hidden = g
    else:
        g = GraphedForward(model, max_graphs, backend, max_tokens)
        model.forward = g
    return g
