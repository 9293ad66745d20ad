"""The forward replayed from graphs (worker/engine/graphs.py), checked on the CPU with a simulated graph (a test
double of ``torch.cuda.CUDAGraph``): a capture records the call without producing its output, a replay reruns it on
the graph's own input buffers and writes the graph's own output tensor, which the next replay overwrites. So a
signature that mixes up two calls, an input not copied into its buffer, a cache read at the wrong place or an
output handed out without a copy all change tokens here. Every golden and every joining row stays exact, with the
same nfe. (That a real CUDA graph replays the same numbers as eager is checked on a GPU: bench/gpu_run.sh.)"""
import logging

import pytest
import torch

from tests.conftest import TINY_DREAM, TINY_LLADA, TINY_LLADA2, TINY_NEMOTRON, TINY_SDAR
from tests.test_continuous import mixed_llada, run_staggered
from worker.engine import Engine, GenerationParams, Request
from worker.engine.graphs import GraphedForward, cache_tensors, install


class SimulatedGraphs:
    """Also holds a replay to what a CUDA graph assumes: the cache it is given has the captured tensors' addresses
    and layout (a real graph would read and write the captured addresses whatever the call passes)."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.replays = 0
        self.graphs = None          # the Graphs this backend serves (set by ``graphed``)

    def _layout(self):
        cache = self.graphs.slot.__dict__["_target"] if self.graphs is not None else None
        return None if cache is None else [(t.data_ptr(), t.shape, t.stride()) for t in cache_tensors(cache)]

    def capture(self, fn):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        out = fn()                                   # the warm-up call on the capture stream: this call's result
        static = torch.full_like(out, float("nan"))     # captured, not run: the graph's output buffer is garbage
        return out, (fn, static, self._layout()), static

    def replay(self, graph):
        fn, static, layout = graph
        assert self._layout() == layout, "a graph replayed on a cache that is not where it was captured"
        self.replays += 1
        static.copy_(fn())

    def reset(self):
        self.resets = getattr(self, "resets", 0) + 1


def graphed(path, max_graphs=32, backend=None):
    engine = Engine.from_pretrained(path, device="cpu", dtype="float32")
    backend = backend or SimulatedGraphs()
    engine.graphs = install(engine.model, max_graphs, backend)
    assert engine.graphs is not None
    backend.graphs = engine.graphs
    return engine


def test_llada_goldens_alone_and_batched(llada_golden):
    engine = graphed(TINY_LLADA)
    cases = llada_golden["cases"]
    reqs = [Request(c["prompt"], GenerationParams(gen_length=c["gen_length"], block_length=c["block_length"],
                                                  steps=c["steps"], algorithm=c["algorithm"],
                                                  threshold=c.get("threshold"), cfg_scale=c.get("cfg_scale", 0.0)))
            for c in cases]
    batched = engine.generate(reqs, early_exit=False)
    alone = [engine.generate([r], early_exit=False)[0] for r in reqs[::3]]
    for c, r in list(zip(cases, batched)) + list(zip(cases[::3], alone)):
        assert r.canvas == c["output"], c
        assert r.nfe == (c["nfe"] or c["steps"]), c
    st = engine.graphs.report()
    assert st["replays"] > st["captures"] > 0 and st["failed"] is None


@pytest.mark.parametrize("alg", ["basic", "dual_cache", "prefix_cache", "dinfer_credit"])
def test_llada_rows_joining_are_exact(llada_engine, alg):
    """Joining rows grow the cache and change the batch: new signatures, new graphs; the same tokens as each row
    alone on the eager engine."""
    engine = graphed(TINY_LLADA)
    reqs = mixed_llada(alg, seed=3, n=7)
    feed = run_staggered(engine, reqs[:3], [(k, r) for k, r in zip((1, 2, 4, 7), reqs[3:])])
    for i, req in enumerate(reqs):
        alone = llada_engine.generate([req], early_exit=False)[0]
        got = feed.results[i]
        assert (got.token_ids, got.canvas, got.nfe) == (alone.token_ids, alone.canvas, alone.nfe), (i, req.params)
    assert engine.graphs.stats["replays"] > 0


@pytest.mark.parametrize("alg", ["basic", "prefix_cache", "dual_cache", "dinfer_blockwise", "dinfer_hierarchy",
                                 "dinfer_credit"])
def test_mixed_batches_match_eager(llada_engine, alg):
    """Rows of different prompt lengths, some with a threshold, finishing at different steps: the cache drops rows
    and a later call's cache can sit where an earlier one's did, with the same layout (a graph records addresses,
    not cache objects)."""
    engine = graphed(TINY_LLADA)
    reqs = [Request(list(range(3, 8 + 4 * i)), GenerationParams(
        gen_length=32, block_length=8, steps=32, algorithm=alg, **({"threshold": 0.9} if i % 2 else {})))
        for i in range(4)]
    for _ in range(2):
        got = engine.generate(reqs, early_exit=False)
        want = llada_engine.generate(reqs, early_exit=False)
        assert [(r.canvas, r.nfe) for r in got] == [(r.canvas, r.nfe) for r in want]
    assert engine.graphs.stats["replays"] > 0


def test_dense_families_goldens_with_rows_joining(dream_golden, sdar_golden, nemotron_golden):
    from tests.test_dream import cache_params, cached
    from tests.test_nemotron import cases as nemotron_cases, params as nemotron_params
    from tests.test_sdar import params as sdar_params
    dream = [c for c in dream_golden["cases"] if c["reference"] == "generation_utils.diffusion_generate"][::7]
    runs = [
        (TINY_DREAM, [(Request(c["prompt"], GenerationParams(
            gen_length=c["gen"], steps=c["steps"], algorithm="dream", temperature=c.get("temperature", 0.0),
            seed=c.get("seed"), extra={k: c[k] for k in ("alg", "alg_temp", "top_p", "top_k")
                                       if c.get(k) is not None})), c["output"]) for c in dream]),
        (TINY_DREAM, [(Request(c["prompt"], cache_params(c)), c["output"]) for c in cached(dream_golden)[::3]]),
        (TINY_SDAR, [(Request(c["prompt"], sdar_params(c)), c["output"]) for c in sdar_golden["cases"][::4]]),
        (TINY_NEMOTRON, [(Request(p, nemotron_params(st)), out["output_ids"])
                         for st, p, out in list(nemotron_cases(nemotron_golden))[::3]]),
    ]
    for path, pairs in runs:
        engine = graphed(path)
        reqs = [r for r, _ in pairs]
        feed = run_staggered(engine, reqs[:2], [(k, r) for k, r in zip(range(1, 60, 3), reqs[2:])])
        for i, (_, want) in enumerate(pairs):
            assert feed.results[i].canvas == want, (path.name, i)
        assert engine.graphs.stats["replays"] > 0, path.name


def test_diffusion_gemma_decoder_pass_goldens_batched_and_joining():
    """DiffusionGemma's decoder pass (canvas over the rows' cached contexts, whose slots and widths change canvas by
    canvas) from graphs: every golden in one batch, and rows joining, give the reference's tokens and forwards."""
    from tests.test_continuous import ScriptedFeed
    from tests.test_diffusion_gemma import TINY_DG, max_tokens, params, same
    import json
    from tests.conftest import fixture_path
    golden = json.loads(fixture_path("tiny-diffusion-gemma-golden.json").read_text())
    engine = graphed(TINY_DG)
    assert engine.model.decoder_hidden is engine.graphs
    cases = golden["cases"]
    res = engine.generate([Request(c["prompt"], params(c)) for c in cases])
    assert [i for i, (r, c) in enumerate(zip(res, cases)) if not same(r, c, max_tokens(c))] == []
    reqs = [Request(c["prompt"], params(c)) for c in cases[:8]]
    feed = ScriptedFeed([(k, r) for k, r in zip((1, 2, 5, 20, 40), reqs[3:])], 3)
    first = engine.generate(reqs[:3], feed=feed)
    got = dict(enumerate(first)) | feed.results
    assert [i for i, c in enumerate(cases[:8]) if not same(got[i], c, max_tokens(c))] == []
    st = engine.graphs.report()
    assert st["replays"] > st["captures"] > 0 and st["failed"] is None


def test_diffusion_gemma_graphs_only_where_its_experts_do_not_sync(caplog, monkeypatch):
    """DiffusionGemma's decoder pass is replayed from graphs in bfloat16 on CUDA (its experts' grouped_mm counts on
    the device; compared with eager on an H100) and on the CPU (simulated); in float32 on CUDA grouped_mm's fallback
    reads its offsets on the host, so the pass stays eager. (The device is faked: no GPU here.)"""
    from tests.test_diffusion_gemma import TINY_DG
    engine = Engine.from_pretrained(TINY_DG, device="cpu", dtype="float32")
    model = engine.model
    assert model.cuda_graphs is True
    cls = type(model)
    monkeypatch.setattr(cls, "device", property(lambda self: torch.device("cuda")))
    assert model.cuda_graphs is False
    with caplog.at_level(logging.INFO):
        assert install(model, backend=SimulatedGraphs()) is None
    assert "synchronises with the host" in caplog.text
    monkeypatch.setattr(cls, "dtype", property(lambda self: torch.bfloat16))
    assert model.cuda_graphs is True


def test_each_call_reads_its_own_inputs_and_gets_its_own_output():
    """Three calls of one signature (eager, capture, replay) and a replay after another signature's replay: each
    returns the eager forward of its own inputs, and a returned output is not overwritten by the next replay."""
    engine = graphed(TINY_LLADA)
    m, g = engine.model, engine.graphs
    V = m.cfg.embedding_size
    torch.manual_seed(0)
    calls = [(torch.randint(0, V, (2, L)), torch.arange(L).expand(2, L)) for L in (9, 9, 9, 5, 5, 5, 9, 5)]
    with torch.inference_mode():
        outs = [m(ids, pos) for ids, pos in calls]
        for (ids, pos), out in zip(calls, outs):
            assert torch.equal(out, g.eager(ids, pos))
    assert g.stats == {"replays": 4, "captures": 2, "eager": 2, "evicted": 0}


def test_at_most_max_graphs_are_kept(llada_golden):
    engine = graphed(TINY_LLADA, max_graphs=1)
    c = next(c for c in llada_golden["cases"] if c["algorithm"] == "dual_cache")
    reqs = [Request(c["prompt"], GenerationParams(gen_length=c["gen_length"], block_length=c["block_length"],
                                                  steps=c["steps"], algorithm=a)) for a in ("dual_cache", "basic")]
    for r in engine.generate(reqs + reqs, early_exit=False)[:1]:
        assert r.canvas == c["output"]
    st = engine.graphs.report()
    assert st["graphs"] == 1 and st["evicted"] > 0


def test_a_failed_capture_falls_back_to_eager_once(llada_golden, caplog):
    engine = graphed(TINY_LLADA, backend=SimulatedGraphs(fail=True))
    c = llada_golden["cases"][0]
    req = Request(c["prompt"], GenerationParams(gen_length=c["gen_length"], block_length=c["block_length"],
                                                steps=c["steps"], algorithm=c["algorithm"]))
    with caplog.at_level(logging.WARNING):
        out = engine.generate([req], early_exit=False)[0]
    assert out.canvas == c["output"]
    assert "CUDA graph capture failed" in caplog.text and caplog.text.count("capture failed") == 1
    assert engine.graphs.failed and engine.graphs.stats["replays"] == engine.graphs.stats["captures"] == 0


def test_where_graphs_do_not_apply(caplog):
    """A mixture-of-experts forward (host-sized expert batches), a CPU model without a simulated backend and a
    compiled model keep their eager forward."""
    with caplog.at_level(logging.INFO):
        moe = Engine.from_pretrained(TINY_LLADA2, device="cpu", dtype="float32")
        assert install(moe.model, backend=SimulatedGraphs()) is None
        cpu = Engine.from_pretrained(TINY_LLADA, device="cpu", dtype="float32", cuda_graphs=True)
        assert cpu.graphs is None and not isinstance(cpu.model.forward, GraphedForward)
        compiled = Engine.from_pretrained(TINY_LLADA, device="cpu", dtype="float32", compile=True)
        assert install(compiled.model, backend=SimulatedGraphs()) is None
    assert "mixture of experts" in caplog.text and "CUDA device only" in caplog.text and "--compile" in caplog.text


def test_forwards_over_max_tokens_run_eagerly():
    engine = Engine.from_pretrained(TINY_LLADA, device="cpu", dtype="float32")
    g = install(engine.model, backend=SimulatedGraphs(), max_tokens=20)
    with torch.inference_mode():
        for L in (10, 10, 10, 11, 11, 11):               # 2 rows: 20 tokens, then 22
            ids = torch.arange(2 * L).view(2, L) % 50 + 3
            assert torch.equal(engine.model(ids, torch.arange(L).expand(2, L)),
                               g.eager(ids, torch.arange(L).expand(2, L)))
    assert g.report() | {"failed": None} == {"graphs": 1, "max_graphs": 32, "max_tokens": 20, "replays": 1,
                                             "captures": 1, "eager": 4, "evicted": 0, "failed": None}


def test_scoring_after_generation_of_the_same_shape_and_graphs_after_a_clear():
    """A graph captured in generation (inference mode: its input buffers are inference tensors) is not replayed for
    likelihood scoring (no_grad: it could not write them): the mode is part of the signature. After ``clear`` (new
    weights) the backend gets a new pool and graphs are captured again."""
    from worker.engine.likelihood import ScoreRequest
    engine = graphed(TINY_LLADA)
    eager = Engine.from_pretrained(TINY_LLADA, device="cpu", dtype="float32")
    req = Request(list(range(3, 11)), GenerationParams(gen_length=16, block_length=16, steps=16, algorithm="basic"))
    assert engine.generate([req])[0].canvas == eager.generate([req])[0].canvas
    sr = ScoreRequest(ids=list(range(3, 27)), splits=[8], mc_num=1, batch_size=1, check_greedy=False)  # [1, 24]
    for _ in range(3):                              # eager, capture, replay of the scoring signature
        assert engine.score([sr]) == eager.score([sr])
    engine.graphs.clear()
    assert engine.graphs.backend.resets == 1 and engine.graphs.report()["graphs"] == 0
    assert engine.generate([req])[0].canvas == eager.generate([req])[0].canvas
    assert engine.graphs.report()["graphs"] == 1 and engine.graphs.failed is None


def test_a_row_waits_for_a_shared_prefix_once_at_most():
    """Of the rows whose first prompt block a row of the same round computes, each waits one round; a block that
    never lands in the cache (here a cache with no room) does not hold them back again."""
    from types import SimpleNamespace

    from worker.engine.prefix_cache import Admission, PrefixCache
    share = Admission(SimpleNamespace(prefix_cache=PrefixCache(0)))
    key = tuple(PrefixCache.keys([5, 6, 7, 8], 4, 1))
    share.take(key)                                  # the first row of the round
    assert share.waits(key) and not share.waits(None)
    assert not share.waits(key, waited=True)         # it waited once: taken now, with or without the block
    again = Admission(SimpleNamespace(prefix_cache=PrefixCache(1 << 20)))
    assert not again.waits(key)                      # a new round: nobody took that block yet


def test_rows_sharing_more_than_a_cached_head_wait_on_their_first_uncached_block():
    """A head that every prompt shares (a chat template) is cached after the first request: rows that share more
    than it still wait for the row computing the rest, and rows that part after the head do not."""
    from types import SimpleNamespace

    import torch

    from worker.engine.prefix_cache import Admission, PrefixCache
    pc = PrefixCache(1 << 20)
    a, b, c = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 99], [1, 2, 3, 4, 50, 6, 7, 8]
    pc.insert(a, 4, 0, 1, lambda j: [torch.zeros(4)])    # the head's block, from an earlier request
    share = Admission(SimpleNamespace(prefix_cache=pc))
    ka, kb, kc = (tuple(PrefixCache.keys(p, 4, len(p) // 4)) for p in (a, b, c))
    share.take(ka)
    assert share.waits(kb)                           # a's second block is b's too: computed by a this round
    assert not share.waits(kc)                       # c parts from a after the head: nothing to wait for
    pc.insert(a, 4, 1, 3, lambda j: [torch.zeros(4)])    # the next round: a's blocks are stored
    assert Admission(SimpleNamespace(prefix_cache=pc)).missing(kb) == kb[2] and not share.waits(kb)
