"""Tensor and expert parallelism (worker/models/parallel.py, worker/engine/ranks.py) on CPU with gloo: two ranks give
the tokens, canvases and forward counts of one rank on every golden case of every family, batched and alone; each
rank reads only its slices of the checkpoint; a rank that dies takes its worker down; the worker serves through the
balancer with continuous batching and shows its ranks."""
import json
from pathlib import Path
import signal
import time

import pytest
import torch

from tests import test_diffusion_gemma as dg, test_dream as dream, test_exactness as llada
from tests import test_llada2 as llada2, test_llada_moe as moe, test_nemotron as nemotron, test_sdar as sdar
from tests.conftest import (TINY_DREAM, TINY_LLADA, TINY_LLADA2, TINY_LLADA_MOE, TINY_LLADA_PEAKY, TINY_NEMOTRON,
                            TINY_SDAR, fixture_path)
from worker.engine import Engine, GenerationParams, Request
from worker.engine.likelihood import ScoreRequest
from worker.models import parallel
from worker.models.checkpoint import iter_tensors, sliced

TINY_DG = dg.TINY_DG


def golden(name: str) -> dict:
    with open(fixture_path(name)) as f:
        return json.load(f)


def cases(family: str) -> tuple:
    """(checkpoint, [(prompt, params)]) of every golden case of a family's fixtures."""
    if family == "llada":      # the goldens, and dInfer's decoders (no reference goldens) on their prompts
        g = golden("tiny-llada-golden.json")
        dinfer = [(c["prompt"], GenerationParams(gen_length=32, block_length=8, algorithm=alg, threshold=0.9))
                  for c in g["cases"][:4] for alg in ("dinfer_blockwise", "dinfer_hierarchy", "dinfer_credit")]
        return TINY_LLADA, [(c["prompt"], llada.params_of(c)) for c in g["cases"]] + dinfer
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


FAMILIES = ["llada", "nemotron", "dream", "sdar", "llada_moe", "llada2", "diffusion_gemma"]


def outcome(results) -> list[tuple]:
    return [(r.token_ids, r.canvas, r.nfe, r.finish_reason) for r in results]


@pytest.fixture(scope="module")
def ranks():
    """Follower processes shared by the families' tests: each test's engine loads its checkpoint on them and hands
    them on (Engine.hand_over_ranks): starting a rank costs seconds."""
    box = {"group": None}
    yield box
    if box["group"] is not None:
        box["group"].close()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_give_one_ranks_tokens_and_nfe_on_every_golden(family, ranks, monkeypatch, tmp_path):
    path, todo = cases(family)
    one = Engine.from_pretrained(path, device="cpu", dtype="float32")
    two = Engine.from_pretrained(path, device="cpu", dtype="float32", tensor_parallel=2, ranks=ranks["group"])
    ranks["group"] = two.ranks
    try:
        assert two.tensor_parallel == 2 and [r["alive"] for r in two.ranks.describe()] == [True, True]
        reqs = [Request(p, params) for p, params in todo]
        # every golden case of the family in one batch (settings, algorithms and lengths mixed), as the goldens
        # were made (the whole canvas); then the last alone with early exit. A collective takes ~1.3 ms on this
        # 2-core machine's loopback, so every case alone would cost minutes: a row's result does not depend on
        # its batch (tests/test_continuous.py), and the serve test below sends the LLaDA2 goldens joining.
        want = outcome(one.generate(reqs, early_exit=False))
        got = outcome(two.generate(reqs, early_exit=False))
        assert [i for i, (a, b) in enumerate(zip(want, got)) if a != b] == []
        assert outcome(two.generate(reqs[-1:])) == outcome(one.generate(reqs[-1:]))
        if family == "llada":      # likelihood scoring: the same greedy checks, estimates equal to float tolerance
            lg = golden("tiny-llada-likelihood-golden.json")["cases"]
            score = [ScoreRequest(c["prefix"] + c["target"], [len(c["prefix"])], c["mc_num"], c["batch_size"],
                                  c["cfg_scale"], c["seed"]) for c in lg]
            a, b = one.score(score), two.score(score)
            assert [x.greedy for x in a] == [x.greedy for x in b]
            assert [x.log_likelihoods for x in b] == [pytest.approx(x.log_likelihoods, rel=1e-5) for x in a]
            # new weights in place on both ranks (issue 34): the other checkpoint's tokens, as one rank gives them
            peaky, later = cases("llada_peaky")
            later = [Request(p, params) for p, params in later[:6]]
            assert two.reload_weights(peaky)["path"] == str(peaky.resolve())
            want = outcome(Engine.from_pretrained(peaky, device="cpu", dtype="float32").generate(later))
            assert outcome(two.generate(later)) == want
            # a read that fails half-way on rank 0 only (a test double in this process): rank 0 puts its weights
            # back, and so must the follower, which had read the new ones (the ranks were left out of step)
            from worker.engine import engine as engine_module
            real, failed = engine_module.reload_native, []

            def flaky(model, path, title):
                if Path(path) == path_back and not failed:
                    failed.append(path)
                    raise OSError("a read error half-way (test double)")
                return real(model, path, title)
            path_back = path.resolve()
            monkeypatch.setattr(engine_module, "reload_native", flaky)
            with pytest.raises(OSError, match="half-way"):
                two.reload_weights(path)
            assert failed and two.version["path"] == str(peaky.resolve())
            assert outcome(two.generate(later)) == want
            monkeypatch.undo()
            # a weights file cut short (its header whole): the follower's read fails too; it put its old weights
            # back and answered so (it exited, which ended the worker, where one rank answered 400)
            import shutil
            cut = shutil.copytree(path, tmp_path / "cut")
            with open(cut / "model.safetensors", "r+b") as f:
                f.truncate(f.seek(0, 2) - 1000)
            with pytest.raises((OSError, ValueError)):
                two.reload_weights(cut)
            assert [r["alive"] for r in two.ranks.describe()] == [True, True]
            assert two.version["path"] == str(peaky.resolve()) and outcome(two.generate(later)) == want
    finally:
        ranks["group"] = two.hand_over_ranks()


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


def _generate_with_followers(tmp_path, code: str, *flags: str, cases: list | None = None):
    """`dllm-serve generate --tensor-parallel-size 2` on tiny-LLaDA golden ``cases`` where ``code`` runs at the start
    of the follower rank's Python (a test double: a sitecustomize module that acts only in `python -m
    worker.engine.ranks`) to make it slow or make it fail. Returns the finished process."""
    import os
    import subprocess
    import sys

    from tests.helpers import DLLM, ROOT
    (tmp_path / "sitecustomize.py").write_text(
        "import sys, time, os\nif 'worker.engine.ranks' in sys.orig_argv:\n" + code + "\n")
    lines = [{"prompt_ids": c["prompt"], "gen_length": c["gen_length"], "block_length": c["block_length"],
              "steps": c["steps"], "algorithm": c["algorithm"], "threshold": c.get("threshold"),
              "cfg_scale": c.get("cfg_scale") or 0.0} for c in cases or []]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    return subprocess.run([*DLLM, "generate", "--model-path", str(TINY_LLADA), "--device", "cpu", "--dtype",
                           "float32", "--no-early-exit", "--tensor-parallel-size", "2", "--requests", "-", *flags],
                          input="\n".join(json.dumps(x) for x in lines), capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)


@pytest.mark.slow
def test_a_follower_slower_than_the_rank_timeout_to_start_and_to_load_joins_and_is_waited_for(tmp_path):
    """--rank-timeout bounds a collective, not a follower's start (Python, torch) or its loading: a follower 3 s
    late to join (on a loaded CI machine the rendezvous failed with `DistStoreError: Timed out after 4 seconds
    waiting for clients`, which made a crash loop of the serve test below) and 3 s more before loading its shard,
    under --rank-timeout 1, gives the goldens (rank 0 waits for its "ready" before the first collective)."""
    cases = golden("tiny-llada-golden.json")["cases"][:3]
    code = ("    time.sleep(3)\n    import torch.distributed as d\n    join = d.init_process_group\n"
            "    d.init_process_group = lambda *a, **k: (join(*a, **k), time.sleep(3))[0]")
    p = _generate_with_followers(tmp_path, code, "--rank-timeout", "1", "--rank-startup-timeout", "60",
                                 cases=cases)
    assert p.returncode == 0, p.stderr[-3000:]
    outs = [json.loads(line) for line in p.stdout.splitlines()]
    assert len(outs) == 3 and all(o["canvas"] == c["output"] and c["nfe"] in (None, o["nfe"])
                                  for o, c in zip(outs, cases))


@pytest.mark.slow
def test_a_follower_that_cannot_start_or_is_too_slow_fails_the_load_with_one_line(tmp_path):
    """A follower that exits before joining fails rank 0's load at once (it waited --rank-timeout for the
    rendezvous, 300 s by default, then printed a traceback); one slower than --rank-startup-timeout fails it then,
    naming the setting; no follower is left behind."""
    import re

    import psutil
    t0 = time.monotonic()
    p = _generate_with_followers(tmp_path, "    os._exit(3)")
    assert p.returncode == 1 and time.monotonic() - t0 < 60
    err = p.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"dllm-serve: error: tensor-parallel rank 1 \(pid \d+\) exited with status 3 while starting .*", err)

    p = _generate_with_followers(tmp_path, "    time.sleep(100)", "--rank-startup-timeout", "2")
    err = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and "did not start within --rank-startup-timeout (2 s)" in err, p.stderr[-3000:]
    pid = int(re.search(r"\(pid (\d+)\)", err)[1])
    time.sleep(0.5)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
def test_serve_two_rank_worker_through_the_balancer_survives_a_dead_rank(tmp_path):
    """`serve --local --workers 1 --tensor-parallel-size 2` on the LLaDA2 MoE fixture (expert parallelism, the
    block-causal cache): a third of the golden cases sent at once (rows join the running batch) is exact through the balancer;
    /health and /worker-status show both ranks; killing the follower rank ends the worker (status 70), the supervisor
    restarts it and requests are served again; a follower stopped (SIGSTOP) in the middle of a batch makes rank 0's
    collective give up after --rank-timeout: the worker ends and kills the hung rank; SIGTERM while it restarts
    leaves no process behind."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    import psutil

    from tests.helpers import DLLM, ROOT, free_port, get_json, post_json
    port, wport = free_port(), free_port()
    import shutil
    model = shutil.copytree(TINY_LLADA2, tmp_path / "tiny-llada2")   # its own path: the orphan check below looks
    #                                   for it, and another test process may run ranks of the fixture meanwhile
    log = open(tmp_path / "serve.log", "wb")
    p = subprocess.Popen([*DLLM, "serve", "--local", "--workers", "1", "--tensor-parallel-size", "2",
                          "--model-path", str(model), "--port", str(port), "--worker-base-port", str(wport),
                          "--health-check-interval", "0.3", "--log-dir", str(tmp_path / "logs"), "--stagger", "0",
                          "--rank-timeout", "3"],
                         cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return get_json(url + "/health")[1].get("healthy_workers") == 1
        except OSError:
            return False

    def wait(cond, what: str, limit: float = 120):
        deadline = time.monotonic() + limit
        while not cond():
            assert p.poll() is None and time.monotonic() < deadline, \
                f"waiting for {what}; the end of serve.log:\n" + "\n".join(
                    (tmp_path / "serve.log").read_text().splitlines()[-80:])
            time.sleep(0.3)
    try:
        wait(ready, "ready")
        health = get_json(f"http://127.0.0.1:{wport}/health")[1]
        assert health["tensor_parallel_size"] == 2
        assert [(r["rank"], r["device"], r["alive"]) for r in health["ranks"]] == [(0, "cpu", True), (1, "cpu", True)]
        ws = get_json(url + "/worker-status")[1]
        assert len(ws["workers"][0]["worker_health"]["ranks"]) == 2

        cases = golden("tiny-llada2-golden.json")["cases"][::3]

        def body(c):
            return {"prompt": c["prompt"], "max_tokens": c["gen"], "block_length": c["block"], "ignore_eos": True,
                    "temperature": c.get("temperature", 0.0), "seed": c.get("seed"), "threshold": c["threshold"],
                    "algorithm_params": llada2.extra(c), "return_token_ids": True}
        with ThreadPoolExecutor(12) as ex:
            answers = list(ex.map(lambda c: post_json(url + "/v1/completions", body(c)), cases))
        wrong = [i for i, (c, (status, r)) in enumerate(zip(cases, answers))
                 if status != 200 or r["choices"][0]["token_ids"] != c["output"] or r["choices"][0]["nfe"] != c["nfe"]]
        assert wrong == []

        worker = next(c for c in psutil.Process(p.pid).children(recursive=True)
                      if f"--port {wport}" in " ".join(c.cmdline()))
        follower = next(c for c in worker.children() if "worker.engine.ranks" in " ".join(c.cmdline()))
        follower.kill()
        worker.wait(30)                        # rank 0 ends itself when its follower is gone (status 70)
        wait(lambda: "exited with code 70; restarting" in (tmp_path / "serve.log").read_text(), "restart", 30)
        text = (tmp_path / "logs" / "worker-0.log").read_text()
        assert "tensor-parallel rank 1 (pid" in text and "exited" in text
        time.sleep(0.5)
        wait(ready, "restarted")
        status, r = post_json(url + "/v1/completions", body(cases[0]))
        assert status == 200 and r["choices"][0]["token_ids"] == cases[0]["output"]

        worker = next(c for c in psutil.Process(p.pid).children(recursive=True)
                      if f"--port {wport}" in " ".join(c.cmdline()))
        hung = next(c for c in worker.children() if "worker.engine.ranks" in " ".join(c.cmdline()))
        with ThreadPoolExecutor(1) as ex:       # straight to the worker: its connection ends with it
            long = ex.submit(_post_or_error, f"http://127.0.0.1:{wport}/v1/completions", {
                "prompt": [5, 6, 7], "max_tokens": 160, "block_length": 4, "ignore_eos": True, "temperature": 0,
                "algorithm_params": {"denoising_steps": 4}, "threshold": 1.0, "return_token_ids": True})
            time.sleep(1.0)
            hung.suspend()
            worker.wait(30)
            wait(lambda: (tmp_path / "serve.log").read_text().count("exited with code 70; restarting") == 2,
                 "second restart", 30)
            assert not hung.is_running() or hung.status() == psutil.STATUS_ZOMBIE     # killed by its rank 0
            assert isinstance(long.result(60), OSError)      # (through the balancer: re-dispatched, as any crash)
        assert "a tensor-parallel batch failed on rank 0" in (tmp_path / "logs" / "worker-0.log").read_text()
        p.send_signal(signal.SIGTERM)          # while the worker restarts: its ranks go too
        assert p.wait(60) == 0
        deadline = time.monotonic() + 15
        while True:
            left = [c for c in psutil.process_iter(["cmdline"])
                    if f"--port {wport}" in " ".join(c.info["cmdline"] or ())
                    or f"--model-path {model}" in " ".join(c.info["cmdline"] or ())]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert not left, "orphan processes after SIGTERM"
    finally:
        if p.poll() is None:
            p.kill()
        log.close()



def _post_or_error(url: str, body: dict):
    from tests.helpers import post_json
    try:
        return post_json(url, body)
    except OSError as e:
        return e


@pytest.mark.slow
def test_a_failed_reload_leaves_every_ranks_prefix_cache_empty(ranks, monkeypatch):
    """Each rank decides from its own prefix cache which prompt blocks to reuse, so the caches must stay alike. A
    reload that failed half-way on rank 0 left rank 0's blocks in place while the follower, which had read the new
    weights and then the old ones back, had emptied its own: the next request with a cached prompt ran forwards of
    other shapes on the two ranks and the worker died (a collective mismatch; a reviewer's finding)."""
    from worker.engine import engine as engine_module
    one = Engine.from_pretrained(TINY_LLADA2, device="cpu", dtype="float32")
    two = Engine.from_pretrained(TINY_LLADA2, device="cpu", dtype="float32", tensor_parallel=2, ranks=ranks["group"],
                                 prefix_cache_gb=0.01)
    ranks["group"] = two.ranks
    try:
        req = Request(list(range(10, 36)), GenerationParams(gen_length=8, block_length=4, algorithm="llada2"))
        want = outcome(one.generate([req]))
        assert outcome(two.generate([req])) == want and two.prefix_cache.stats()["blocks"] > 0
        real, failed = engine_module.reload_native, []

        def flaky(model, path, title):        # rank 0's read fails half-way (a test double in this process)
            if not failed:
                failed.append(path)
                raise OSError("a read error half-way (test double)")
            return real(model, path, title)
        monkeypatch.setattr(engine_module, "reload_native", flaky)
        with pytest.raises(OSError, match="half-way"):
            two.reload_weights(TINY_LLADA2)
        monkeypatch.undo()
        assert failed and two.prefix_cache.stats()["blocks"] == 0
        assert outcome(two.generate([req])) == want          # the ranks agree (a mismatch killed the follower)
        assert outcome(two.generate([req])) == want and two.prefix_cache.stats()["cached_tokens"] > 0
        assert [r["alive"] for r in two.ranks.describe()] == [True, True]
    finally:
        ranks["group"] = two.hand_over_ranks()
