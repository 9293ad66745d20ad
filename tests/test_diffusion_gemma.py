"""DiffusionGemma (issue 28): the tiny checkpoint in the family's real layout, our model against the reference's
logits, the diffusion_gemma algorithm against every golden of transformers' own `generate` (alone, in one batch mixing
settings, prompt and answer lengths, rows joining a running batch, bfloat16 per CPU kernel set, through
`dllm-serve generate --requests -`, a worker and the balancer), its parameter checks and defaults from
generation_config.json, streaming per canvas, and media parts refused."""
import json
import random

import pytest
import torch
from click.testing import CliRunner

from tests.conftest import bf16_golden, fixture_path
from tests.helpers import get_json, post_json
from tests.test_continuous import run_staggered
from worker.engine import ALGORITHMS, Engine, GenerationParams, ParamError, Request
from worker.models import FAMILIES, detect_family, load_model

TINY_DG = fixture_path("tiny-diffusion-gemma")


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(fixture_path("tiny-diffusion-gemma-golden.json").read_text())


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained(TINY_DG, device="cpu", dtype="float32")


def max_tokens(c: dict) -> int:
    return c["settings"].get("max_new_tokens", 32)        # generation_config.json's max_new_tokens


def settings(c: dict) -> dict:
    return {k: v for k, v in c["settings"].items() if k != "max_new_tokens"}


def params(c: dict) -> GenerationParams:
    return GenerationParams(gen_length=max_tokens(c), block_length=8, algorithm="diffusion_gemma", seed=c["seed"],
                            extra=settings(c))


def answer(ref: dict, n: int) -> list[int]:
    """The reference's answer as this server returns it: up to (not including) the first eos, cut to max_tokens (the
    reference returns whole canvases)."""
    return (ref["answer"][:-1] if ref["ends_with_eos"] else ref["answer"])[:n]


def same(r, ref: dict, n: int) -> bool:
    return r.token_ids == answer(ref, n) and r.nfe == ref["decoder_forwards"]


def test_the_fixture_is_a_real_diffusion_gemma_checkpoint():
    from safetensors import safe_open
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(TINY_DG)
    assert type(cfg).__name__ == "DiffusionGemmaConfig"
    with safe_open(TINY_DG / "model.safetensors", "pt") as f:
        names = list(f.keys())
    assert any(".vision_tower." in n for n in names) and any(".experts." in n for n in names)
    gen = json.loads((TINY_DG / "generation_config.json").read_text())
    assert len(gen["eos_token_id"]) == 2


def test_the_goldens_cover_what_the_family_must_reproduce(golden):
    cases = golden["cases"]
    assert len(cases) >= 20 and any(c["ends_with_eos"] for c in cases) and not all(c["ends_with_eos"] for c in cases)
    assert any(len(c["canvas_steps"]) > 1 for c in cases)               # answers spanning several canvases
    assert all(c["decoder_forwards"] == sum(c["canvas_steps"]) for c in cases)
    assert all(set(c["kernels"]) == {"DEFAULT", "AVX2", "AVX512"} for c in golden["bf16_cases"])


def test_detection_ids_defaults_and_text_only_loading(engine):
    assert detect_family(TINY_DG) == "diffusion_gemma" and FAMILIES["diffusion_gemma"].default_algorithm == \
        "diffusion_gemma"
    assert ALGORITHMS["diffusion_gemma"].families == ("diffusion_gemma",)
    assert engine.stop_ids == [1, 292] and engine.default_block_length == 8
    assert engine.algorithm_defaults["diffusion_gemma"] == {
        "max_denoising_steps": 48, "entropy_bound": 0.1, "t_min": 0.4, "t_max": 0.8, "stability_threshold": 1,
        "confidence_threshold": 0.005}
    names = [n for n, _ in engine.model.named_parameters()]
    assert not any("vision" in n for n in names)                        # the vision tower stays on disk
    assert "model.encoder.language_model.layers.0.layer_scalar" in names
    described = ALGORITHMS["diffusion_gemma"].describe({"max_denoising_steps": 7})
    assert described["algorithm_params"]["max_denoising_steps"]["default"] == 7
    assert described["algorithm_params"]["entropy_bound"]["default"] == 0.1


def test_forward_matches_reference_logits(golden):
    """The prompt encoder plus one canvas step, then a self-conditioned step on that context, then a prompt longer
    than the sliding window (the decoder's sliding layers see only its last window-1 positions).

    The reference's float32 logits (up to ~27 in size, stored to 4 decimals) are matched to 4e-5 of their largest
    value: float32 GEMM kernels differ between CPUs (AVX2, AVX-512 with and without BF16, the default set), and the
    self-conditioned step, fed the first step's logits, differed by 3e-4 on an AVX-512 Xeon (1.1e-5 of the scale)."""
    lg = golden["logits"]

    def close(got, ref):
        ref = torch.tensor(ref)
        return (got - ref).abs().max() <= 4e-5 * ref.abs().max()

    m = load_model(TINY_DG, "cpu", "float32")
    cache = m.new_cache(1, 0)
    m.encode(torch.tensor([lg["prompt"]]), [len(lg["prompt"])], cache, [0])
    first = m.denoise(torch.tensor([lg["canvas"]]), None, [], cache, [0])
    assert close(first[0], lg["logits"])
    sc = m.denoise(torch.tensor([lg["sc_canvas"]]), first, [0], cache, [0])
    assert close(sc[0], lg["sc_logits"])
    cache = m.new_cache(1, 0)
    m.encode(torch.tensor([lg["long_prompt"]]), [len(lg["long_prompt"])], cache, [0])
    long = m.denoise(torch.tensor([lg["canvas"]]), None, [], cache, [0])
    assert close(long[0], lg["long_logits"])


def test_every_golden_case_in_one_batch_and_some_alone(engine, golden):
    """One batch of all 25 cases (settings, prompt lengths, answer lengths and canvas counts mixed), shuffled: every
    row the reference's tokens and decoder forwards at batch 1; and a few alone (all of them: the slow test)."""
    cases = golden["cases"]
    order = list(range(len(cases)))
    random.Random(28).shuffle(order)
    res = engine.generate([Request(cases[i]["prompt"], params(cases[i])) for i in order])
    assert [i for r, i in zip(res, order) if not same(r, cases[i], max_tokens(cases[i]))] == []
    for c in (cases[2], cases[14], cases[21]):
        r = engine.generate([Request(c["prompt"], params(c))])[0]
        assert same(r, c, max_tokens(c)), c
        assert r.finish_reason == ("stop" if c["ends_with_eos"] and len(c["answer"]) <= max_tokens(c) else "length")


@pytest.mark.slow
def test_the_odd_golden_cases_alone(engine, golden):
    """Every other case alone (of the even ones, 2, 14 and 21 run alone above; all 25 run batched above, through
    the worker and the balancer in the serve test and with the prefix cache in tests/test_prefix_cache.py): a
    decoder forward of this 4-layer model is ~1,700 small operations on the CPU, so all 25 alone took 22 s."""
    bad = [i for i, c in enumerate(golden["cases"]) if i % 2
           and not same(engine.generate([Request(c["prompt"], params(c))])[0], c, max_tokens(c))]
    assert bad == []


def test_rows_joining_a_running_batch_are_exact(engine, golden):
    cases = golden["cases"]
    reqs = [Request(c["prompt"], params(c)) for c in cases[:10]]
    # the goldens (tokens and decoder forwards) are each case alone in the reference: no second run alone here
    feed = run_staggered(engine, reqs[:3], [(1, reqs[3]), (2, reqs[4]), (5, reqs[5]), (5, reqs[6]),
                                            (20, reqs[7]), (40, reqs[8]), (41, reqs[9])], early_exit=True)
    assert not feed.arrivals and sorted(feed.results) == list(range(10))
    assert any(rows > 0 for _, _, rows in feed.joined)      # they joined a batch that was running
    for i, c in enumerate(cases[:10]):
        assert same(feed.results[i], c, max_tokens(c)), (i, c)


@pytest.mark.bf16
@pytest.mark.slow          # 10 s under AVX2 alone: the slow tier's AVX2 process runs it (tests/test_bf16_kernels.py)
def test_bfloat16_cases_alone_are_exact(golden):
    """The reference in bfloat16 on CPU with oneDNN off, on this ATen kernel set: the same tokens and decoder
    forwards, alone and together."""
    e = Engine.from_pretrained(TINY_DG, device="cpu", dtype="bfloat16")
    cases = [{**c, **bf16_golden(c)} for c in golden["bf16_cases"]]
    assert len(cases) == 8
    assert [i for i, c in enumerate(cases)
            if not same(e.generate([Request(c["prompt"], params(c))])[0], c, max_tokens(c))] == []


def test_temperature_schedule_is_the_references_float32_arithmetic():
    """_State.schedule (numpy float32, host floats) gives exactly the reference's per-step torch float32 values,
    ``t_min + (t_max - t_min) * (int32 step / N)``, over random settings."""
    from worker.engine.algorithms.diffusion_gemma import _State
    rng = random.Random(5)
    for _ in range(500):
        s = _State.__new__(_State)
        s.N, s.t_min, s.t_max = rng.randrange(1, 100), rng.uniform(0, 1.5), rng.uniform(0.2, 3)
        want = [float(s.t_min + ((s.t_max - s.t_min) * (torch.tensor(t, dtype=torch.int32) / s.N)))
                for t in range(s.N, 0, -1)]
        assert s.schedule() == want


def test_parameter_errors_name_the_field(engine):
    def err(**kw):
        extra = kw.pop("extra", {})
        with pytest.raises(ParamError) as e:
            engine.plan([5, 6, 7], GenerationParams(gen_length=16, block_length=kw.pop("block_length", 8),
                                                    algorithm="diffusion_gemma", extra=extra, **kw))
        return e.value.param, e.value.message
    assert err(extra={"t_min": 0.8, "t_max": 0.8})[0] == "algorithm_params"
    assert "t_max" in err(extra={"t_min": 0.9})[1]
    assert "entropy_bound" in err(extra={"entropy_bound": 0})[1]
    assert "max_denoising_steps" in err(extra={"max_denoising_steps": 0})[1]
    assert "confidence_threshold" in err(extra={"confidence_threshold": 0.0})[1]
    assert "stability_threshold" in err(extra={"stability_threshold": -1})[1]
    assert "nope" in err(extra={"nope": 1})[1]
    assert err(temperature=0.7)[0] == "temperature"
    assert err(steps=4)[0] == "steps"
    assert err(threshold=0.9)[0] == "threshold"
    assert err(cfg_scale=1.0)[0] == "cfg_scale"
    assert err(block_length=16)[0] == "block_length"
    # it always samples (its own temperature schedule), without nucleus or top-k filtering: a filter is refused
    # even at temperature 0, where a greedy algorithm ignores it
    for name, value in (("top_p", 0.95), ("top_k", 5), ("min_p", 0.1)):
        param, message = err(filters={name: value})
        assert param == name and "samples without" in message and "temperature 0" not in message
    with pytest.raises(ParamError, match="maximum context length"):       # 500 + whole canvases > 512 positions
        engine.plan([5] * 500, GenerationParams(gen_length=9, block_length=8, algorithm="diffusion_gemma"))
    pl = engine.plan([5, 6], GenerationParams(gen_length=3, block_length=8, algorithm="diffusion_gemma",
                                              extra={"t_max": 2}))
    assert pl.params.extra == {"max_denoising_steps": 48, "entropy_bound": 0.1, "t_min": 0.4, "t_max": 2.0,
                               "stability_threshold": 1, "confidence_threshold": 0.005}


def test_logprobs_streaming_per_canvas_and_ignore_eos(engine, golden):
    """Each finished canvas is reported (streamed) at once, never a partial one; logprobs cover the answer; with
    ignore_eos every canvas up to max_tokens is generated."""
    from worker.engine import StepHooks
    c = golden["cases"][10]                        # 7 canvases, ends with an eos
    seen = []
    hooks = StepHooks(on_progress=lambda i, ids: seen.append(len(ids)))
    p = params(c)
    r = engine.generate([Request(c["prompt"], GenerationParams(**{**p.__dict__, "logprobs": 2}))], hooks=hooks)[0]
    assert same(r, c, 64) and seen == [8, 16, 24, 32, 40, 48, 51]
    assert len(r.logprobs) == len(r.token_ids) and all(len(top) == 2 for _, _, top in r.logprobs)
    assert all(t == e[0] and e[1] <= 0 for t, e in zip(r.token_ids, r.logprobs))
    long = engine.generate([Request(c["prompt"], GenerationParams(**{**p.__dict__, "gen_length": 70,
                                                                      "ignore_eos": True}))])[0]
    assert len(long.token_ids) == 70 and long.finish_reason == "length" and long.token_ids[:51] == r.token_ids


def test_cli_generate_from_stdin_reproduces_goldens(golden):
    from dllm_serve.cli import main as cli
    cases = golden["cases"][::3]
    lines = [json.dumps({"prompt_ids": c["prompt"], "gen_length": max_tokens(c), "seed": c["seed"],
                         "algorithm_params": settings(c)}) for c in cases]
    res = CliRunner().invoke(cli, ["generate", "--model-path", str(TINY_DG), "--requests", "-", "--device", "cpu"],
                             input="\n".join(lines) + "\n")
    assert res.exit_code == 0, res.output
    got = [json.loads(line) for line in res.stdout.splitlines()]
    assert [(g["token_ids"], g["nfe"]) for g in got] == [(answer(c, max_tokens(c)), c["decoder_forwards"])
                                                          for c in cases]


@pytest.mark.slow
def test_worker_and_balancer_serve_the_family(tmp_path, golden):
    """Two workers behind the balancer: seeded completions equal the goldens (concurrently, so batched), streamed
    chunks come a canvas at a time and add up to the same text, chat works on the checkpoint's template, the
    defaults are listed, an image part is a 400 that says so, impossible settings a 400 naming the field."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from tests.helpers import Cluster
    cl = Cluster(tmp_path, TINY_DG, n=2)
    try:
        cl.wait_ready()
        assert get_json(cl.workers[0].url + "/health")[1]["family"] == "diffusion_gemma"
        algos = get_json(cl.url + "/generation/algorithms")[1]
        assert algos["default_algorithm"] == "diffusion_gemma"
        dg = next(a for a in algos["algorithms"] if a["name"] == "diffusion_gemma")
        assert dg["algorithm_params"]["t_max"]["default"] == 0.8

        def body(c):
            return {"prompt": c["prompt"], "max_tokens": max_tokens(c), "seed": c["seed"],
                    "algorithm_params": settings(c), "return_token_ids": True}
        cases = golden["cases"]
        with ThreadPoolExecutor(8) as ex:
            answers = list(ex.map(lambda c: post_json(cl.url + "/v1/completions", body(c)), cases))
        for c, (status, r) in zip(cases, answers):
            assert status == 200, r
            ch = r["choices"][0]
            assert ch["token_ids"] == answer(c, max_tokens(c)) and ch["nfe"] == c["decoder_forwards"], (c, r)

        client = openai.OpenAI(base_url=cl.url + "/v1", api_key="none", max_retries=0)
        c = cases[10]
        whole = client.completions.create(model=str(TINY_DG.resolve()), prompt=c["prompt"], max_tokens=64,
                                          seed=c["seed"]).choices[0].text
        chunks = [ch.choices[0].text for ch in client.completions.create(
            model=str(TINY_DG.resolve()), prompt=c["prompt"], max_tokens=64, seed=c["seed"], stream=True)
            if ch.choices and ch.choices[0].text]
        assert "".join(chunks) == whole and len(chunks) >= 5          # seven canvases, some decode to nothing
        chat = client.chat.completions.create(model=str(TINY_DG.resolve()), max_tokens=16, seed=0,
                                              messages=[{"role": "user", "content": "Why is the sky blue?"}])
        assert chat.choices[0].finish_reason in ("stop", "length")

        status, r = post_json(cl.url + "/v1/chat/completions", {"max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]})
        assert status == 400 and "image_url" in r["error"]["message"] and "text only" in r["error"]["message"]
        status, r = post_json(cl.url + "/v1/completions", {"prompt": "hi", "max_tokens": 8,
                                                           "algorithm_params": {"t_min": 0.9, "t_max": 0.5}})
        assert status == 400 and r["error"]["param"] == "algorithm_params" and "t_max" in r["error"]["message"]
        status, r = post_json(cl.url + "/v1/completions", {"prompt": "hi", "max_tokens": 8, "temperature": 0.7})
        assert status == 400 and r["error"]["param"] == "temperature"
    finally:
        cl.stop()


def test_a_cancelled_row_leaves_the_others_exact(engine, golden):
    """A row dropped mid-canvas (its client gone) leaves the batch and its cache slot; the others keep the reference's
    tokens and forwards."""
    from worker.engine import StepHooks
    cases = golden["cases"][:6]
    steps = {"n": 0}

    def gone(i):
        steps["n"] += 1
        return i == 2 and steps["n"] > 40            # row 2 leaves after a few steps
    res = engine.generate([Request(c["prompt"], params(c)) for c in cases], hooks=StepHooks(is_cancelled=gone))
    assert res[2].finish_reason == "cancelled"
    assert [i for i, (r, c) in enumerate(zip(res, cases)) if i != 2 and not same(r, c, max_tokens(c))] == []


def test_every_denoising_step_is_progress_for_health(engine, golden, monkeypatch):
    """The worker's /health reports the time since the last step (the balancer's stall rule reads it): every
    denoising step must stamp it, not only a canvas's end (a canvas runs up to max_denoising_steps steps; a worker
    was judged stalled mid-canvas under load before)."""
    stamps = []
    cls = type(engine)

    class Watched(cls):
        def __setattr__(self, name, value):
            if name == "last_step_time":
                stamps.append(value)
            super().__setattr__(name, value)
    monkeypatch.setattr(engine, "__class__", Watched)
    c = max(golden["cases"], key=lambda c: c["decoder_forwards"])
    r = engine.generate([Request(c["prompt"], params(c))])[0]
    assert r.nfe == c["decoder_forwards"] and len(stamps) >= r.nfe


def test_a_schedule_below_the_sampling_epsilon_is_refused(engine):
    """t_max 1e-40 divided the float32 logits into inf (a 500 for every row of the batch): the lowest step
    temperature must be at least 1e-5."""
    for extra in ({"t_min": 0, "t_max": 1e-40}, {"t_min": 1e-45, "t_max": 2e-45}, {"t_min": 0, "t_max": 1e-4}):
        with pytest.raises(ParamError) as e:
            engine.plan([5, 6], GenerationParams(gen_length=8, block_length=8, algorithm="diffusion_gemma",
                                                 extra=extra))
        assert e.value.param == "algorithm_params" and "t_min" in e.value.message
    engine.plan([5, 6], GenerationParams(gen_length=8, block_length=8, algorithm="diffusion_gemma",
                                         extra={"t_min": 0, "t_max": 1e-3}))       # 1e-3 / 48 is above it


def test_step_streaming_sends_the_whole_window_every_step(engine, golden):
    """Each step's window is the whole generation (undecided positions as masks), on every step (it was the
    canvases so far, its length jumping)."""
    from worker.engine import StepHooks
    c = golden["cases"][10]
    windows = []
    hooks = StepHooks(on_step=lambda i, window, settled: windows.append(len(window)), steps_for=lambda i: True)
    engine.generate([Request(c["prompt"], params(c))], hooks=hooks)
    assert windows and set(windows) == {max_tokens(c)}


def test_the_default_length_is_whole_canvases_that_fit(engine):
    """Without max_tokens a prompt that leaves less than a canvas is a 400 naming the prompt (not max_tokens,
    which the client did not send); one that leaves 1.5 canvases gets one."""
    import asyncio
    from common.protocol import APIError
    from worker.scheduler import RowScheduler
    from worker.serving import Defaults, Serving
    s = Serving(engine, RowScheduler(engine, loop=asyncio.new_event_loop()), "dg", Defaults(algorithm="diffusion_gemma"))
    L = engine.max_sequence_length
    with pytest.raises(APIError) as e:
        s.prepare("completion", {"prompt": [5] * (L - 7), "seed": 1})
    assert e.value.status == 400 and e.value.param == "prompt"
    assert s.prepare("completion", {"prompt": [5] * (L - 12), "seed": 1}).params[0].gen_length == 8
