"""Tensor and expert parallelism (worker/models/parallel.py, worker/engine/ranks.py) on CPU with gloo: two ranks give
the tokens, canvases and forward counts of one rank on every golden case of every family, batched and alone; each
rank reads only its slices of the checkpoint; a rank that dies takes its worker down; the worker serves through the
balancer with continuous batching and shows its ranks."""
import json
import os
import signal
import time

import pytest
import torch

from tests import test_diffusion_gemma as dg, test_dream as dream, test_exactness as llada
from tests import test_llada2 as llada2, test_llada_moe as moe, test_nemotron as nemotron, test_sdar as sdar
from tests.conftest import (TINY_DREAM, TINY_LLADA, TINY_LLADA2, TINY_LLADA_MOE, TINY_LLADA_PEAKY, TINY_NEMOTRON,
                            TINY_SDAR, fixture_path)
from worker.engine import Engine, Request
from worker.models import parallel
from worker.models.checkpoint import iter_tensors, sliced

TINY_DG = dg.TINY_DG


def golden(name: str) -> dict:
    with open(fixture_path(name)) as f:
        return json.load(f)


def cases(family: str) -> tuple:
    """(checkpoint, [(prompt, params)]) of every golden case of a family's fixtures."""
    if family == "llada":
        g = golden("tiny-llada-golden.json")
        return TINY_LLADA, [(c["prompt"], llada.params_of(c)) for c in g["cases"]]
    if family == "llada_peaky":
        g = golden("tiny-llada-peaky-golden.json")
        return TINY_LLADA_PEAKY, [(c["prompt"], llada.params_of(c)) for c in g["cases"]]
    if family == "nemotron":
        g = golden("tiny-nemotron-golden.json")
        return TINY_NEMOTRON, [(p, nemotron.params(st)) for st, p, _ in nemotron.cases(g)]
    if family == "dream":
        g = golden("tiny-dream-golden.json")
        return TINY_DREAM, ([(c["prompt"], dream.params(c)) for c in dream.whole(g)]
                            + [(c["prompt"], dream.cache_params(c)) for c in dream.cached(g)])
    if family == "sdar":
        g = golden("tiny-sdar-golden.json")
        return TINY_SDAR, [(c["prompt"], sdar.params(c)) for c in g["cases"]]
    if family == "llada_moe":
        g = golden("tiny-llada-moe-golden.json")
        return TINY_LLADA_MOE, [(c["prompt"], moe.params(c)) for c in g["cases"]]
    if family == "llada2":
        g, g21 = golden("tiny-llada2-golden.json"), golden("tiny-llada21-golden.json")
        return TINY_LLADA2, ([(c["prompt"], llada2.params(c)) for c in g["cases"]]
                             + [(c["prompt"], llada2.params21(c)) for c in g21["cases"]])
    if family == "diffusion_gemma":
        g = golden("tiny-diffusion-gemma-golden.json")
        return TINY_DG, [(c["prompt"], dg.params(c)) for c in g["cases"]]
    raise KeyError(family)


FAMILIES = ["llada", "llada_peaky", "nemotron", "dream", "sdar", "llada_moe", "llada2", "diffusion_gemma"]


def outcome(results) -> list[tuple]:
    return [(r.token_ids, r.canvas, r.nfe, r.finish_reason) for r in results]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_give_one_ranks_tokens_and_nfe_on_every_golden(family):
    path, todo = cases(family)
    one = Engine.from_pretrained(path, device="cpu", dtype="float32")
    two = Engine.from_pretrained(path, device="cpu", dtype="float32", tensor_parallel=2)
    try:
        assert two.tensor_parallel == 2 and [r["alive"] for r in two.ranks.describe()] == [True, True]
        reqs = [Request(p, params) for p, params in todo]
        # batched: every golden case of the family in one batch (settings, algorithms and lengths mixed), as the
        # goldens were made (the whole canvas); then the first and last alone. A collective takes ~1 ms on this
        # 2-core machine's loopback, so each case alone would cost minutes in all: the worker test below and
        # test_a_follower_that_dies... cover the rest of the paths.
        want = outcome(one.generate(reqs, early_exit=False))
        got = outcome(two.generate(reqs, early_exit=False))
        assert [i for i, (a, b) in enumerate(zip(want, got)) if a != b] == []
        for r in (reqs[0], reqs[-1]):
            assert outcome(two.generate([r])) == outcome(one.generate([r]))
    finally:
        two.close()


def test_a_rank_holds_only_its_slices():
    """The layout of a rank's shard: heads, kv heads (replicated when fewer than the ranks), MLP channels, experts,
    vocabulary rows; the loader reads exactly those slices (parallel.Shard) from the safetensors file."""
    from worker.models import load_model
    full = load_model(TINY_DG, "cpu", "float32")
    whole = dict(iter_tensors(TINY_DG))
    for rank in (0, 1):
        m = load_model(TINY_DG, "cpu", "float32", parallel.Layout(rank, 2))     # (loading needs no collective)
        layer = m.stack.layers[1]                      # a full-attention layer: one kv head, 4 query heads
        assert layer.self_attn.heads == 2 and layer.self_attn.kv == 1
        assert layer.experts.gate_up_proj.shape[0] == 4 and layer.mlp.gate_proj.weight.shape[0] == 32
        assert m.stack.embed_tokens.weight.shape[0] == 150 and m.stack.embed_tokens.first == 150 * rank
        name = "model.decoder.layers.1.self_attn.o_proj.weight"
        assert torch.equal(layer.self_attn.o_proj.weight, whole[name][:, 64 * rank:64 * (rank + 1)])
        assert torch.equal(layer.self_attn.k_proj.weight, full.stack.layers[1].self_attn.k_proj.weight)
        assert torch.equal(layer.experts.down_proj, full.stack.layers[1].experts.down_proj[4 * rank:4 * rank + 4])
    shard = parallel.Shard(0, 16, ((0, 2), (8, 3)))
    t = torch.arange(16 * 3).reshape(16, 3)
    assert torch.equal(sliced(t, shard), torch.cat([t[0:2], t[8:11]]))


def test_uneven_splits_are_one_line_errors():
    from worker.models import CheckpointError, load_model
    with pytest.raises(CheckpointError, match="cannot be split evenly over --tensor-parallel-size 3"):
        load_model(TINY_LLADA, "cpu", "float32", parallel.Layout(0, 3))


@pytest.mark.slow
def test_a_follower_that_dies_ends_its_worker(tmp_path):
    """Rank 0 (here a `generate` command reading prompts from stdin) exits with status 70 within a second of its
    follower being killed, and no rank is left behind."""
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "dllm_serve", "generate", "--model-path", str(TINY_LLADA),
                             "--tensor-parallel-size", "2", "--stdin"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        follower = None
        while follower is None and time.monotonic() < deadline:
            out = subprocess.run(["pgrep", "-f", f"worker.engine.ranks .*--model-path {TINY_LLADA}"],
                                 capture_output=True, text=True).stdout.split()
            kids = [int(p) for p in out if _parent(int(p)) == proc.pid]
            follower = kids[0] if kids else None
            time.sleep(0.2)
        assert follower is not None, "no follower rank started"
        time.sleep(2.0)
        os.kill(follower, signal.SIGKILL)
        assert proc.wait(timeout=30) == 70
        assert "tensor-parallel rank 1" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1
