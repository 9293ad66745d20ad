"""Nemotron-Diffusion beside LLaDA: the native model against the reference logits, the nemotron sampler against
every golden case (alone, batched, through `dllm-serve generate` and through a worker), family detection."""
import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from dllm_serve.cli import main as cli
from tests.conftest import TINY_LLADA, TINY_NEMOTRON
from tests.helpers import get_json, post_json, start_worker
from worker.engine import ALGORITHMS, GenerationParams, Request
from worker.models import CheckpointError, detect_family, load_model


def cases(golden):
    for st in golden["settings"]:
        for i, prompt in enumerate(golden["prompts"]):
            yield st, prompt, golden["outputs"][st["name"]][i]


def params(st, **kw):
    return GenerationParams(gen_length=st["gen_length"], block_length=st["block_length"], steps=st["steps"],
                            algorithm="nemotron", threshold=st["threshold"],
                            extra={"shift_logits": bool(st.get("shift_logits", False))}, **kw)


def test_family_detection():
    assert detect_family(TINY_NEMOTRON) == "nemotron" and detect_family(TINY_LLADA) == "llada"


def test_forward_matches_reference_logits(nemotron_golden):
    m = load_model(TINY_NEMOTRON, "cpu", "float32")
    fc = nemotron_golden["forward_check"]
    ids = torch.tensor([fc["input_ids"]])
    with torch.inference_mode():
        got = m.logits(m(ids, torch.arange(ids.shape[1])[None]))[0]
    assert (got - torch.tensor(fc["logits_float32"])).abs().max() < 1e-4
    assert got.argmax(-1).tolist() == fc["argmax"]


def test_every_golden_case_is_exact_alone_and_batched(nemotron_engine, nemotron_golden):
    all_cases = list(cases(nemotron_golden))
    assert len(all_cases) == 12
    for st, prompt, out in all_cases:
        r = nemotron_engine.generate([Request(prompt, params(st))], early_exit=False)[0]
        assert r.canvas == out["output_ids"] and r.nfe == out["nfe"], st
    together = nemotron_engine.generate([Request(p, params(st)) for st, p, _ in all_cases], early_exit=False)
    for (st, _, out), r in zip(all_cases, together):
        assert r.canvas == out["output_ids"] and r.nfe == out["nfe"], st


def test_early_exit_gives_the_same_answer_with_less_work(nemotron_engine, nemotron_golden):
    stops = set(nemotron_engine.stop_ids)
    for st, prompt, out in cases(nemotron_golden):
        r = nemotron_engine.generate([Request(prompt, params(st))])[0]
        ref = out["output_ids"]
        cut = next((i for i, t in enumerate(ref) if t in stops), len(ref))
        assert r.token_ids == ref[:cut] and r.nfe <= out["nfe"]


def test_shift_logits_and_other_algorithms_run_on_the_family(nemotron_engine, nemotron_golden):
    prompt = nemotron_golden["prompts"][1]
    base = nemotron_engine.generate([Request(prompt, GenerationParams(
        gen_length=16, block_length=8, algorithm="nemotron"))], early_exit=False)[0]
    shifted = nemotron_engine.generate([Request(prompt, GenerationParams(
        gen_length=16, block_length=8, algorithm="nemotron", extra={"shift_logits": True}))], early_exit=False)[0]
    assert shifted.canvas != base.canvas and 290 not in shifted.canvas
    for alg in ("basic", "dual_cache", "dinfer_blockwise"):
        p = GenerationParams(gen_length=16, block_length=8, algorithm=alg, threshold=0.9)
        alone = nemotron_engine.generate([Request(prompt, p)], early_exit=False)[0]
        batched = nemotron_engine.generate([Request([5, 6, 7], p), Request(prompt, p)], early_exit=False)[1]
        assert alone.canvas == batched.canvas and 290 not in alone.canvas
    assert "nemotron" in ALGORITHMS and ALGORITHMS["nemotron"].families == ("nemotron",)


def test_stop_tokens_and_chat_template(nemotron_engine):
    vocab = nemotron_engine.tokenizer.get_vocab()
    assert nemotron_engine.stop_ids == sorted({vocab["<|endoftext|>"], vocab["<|im_end|>"]})
    assert nemotron_engine.mask_id == vocab["<|fim_pad|>"] == 290
    from worker.tokenizer import apply_chat_template
    ids = apply_chat_template(nemotron_engine.tokenizer, [{"role": "user", "content": "hi"}])
    assert ids[0] == vocab["<|im_start|>"]


def test_sharded_checkpoint_and_errors(tmp_path):
    sd = load_file(TINY_NEMOTRON / "model.safetensors")
    dest = tmp_path / "sharded"
    shutil.copytree(TINY_NEMOTRON, dest)
    (dest / "model.safetensors").unlink()
    names = sorted(sd)
    wm = {}
    for i in range(2):
        part = names[i::2]
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: sd[k] for k in part}, dest / fname, metadata={"format": "pt"})
        wm.update({k: fname for k in part})
    (dest / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    a, b = load_model(TINY_NEMOTRON, "cpu"), load_model(dest, "cpu")
    ids = torch.tensor([[1, 2, 3, 290]])
    pos = torch.arange(4)[None]
    with torch.inference_mode():
        assert torch.equal(a.logits(a(ids, pos)), b.logits(b(ids, pos)))
    (dest / "model-00002-of-00002.safetensors").unlink()
    save_file({k: sd[k] for k in names[1::2] if "q_norm" not in k}, dest / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="Missing tensors: .*q_norm"):
        load_model(dest, "cpu")


def test_cli_generate_reproduces_every_golden_case(nemotron_golden):
    runner = CliRunner()
    for st, prompt, out in cases(nemotron_golden):
        args = ["generate", "--model-path", str(TINY_NEMOTRON), "--prompt-ids", ",".join(map(str, prompt)),
                "--gen-length", str(st["gen_length"]), "--block-length", str(st["block_length"]), "--steps",
                str(st["steps"]), "--algorithm", "nemotron", "--device", "cpu", "--json", "--no-early-exit"]
        if st["threshold"] is not None:
            args += ["--threshold", str(st["threshold"])]
        res = runner.invoke(cli, args)
        assert res.exit_code == 0, res.output
        got = json.loads(res.stdout)
        assert got["canvas"] == out["output_ids"] and got["nfe"] == out["nfe"]


@pytest.mark.slow
def test_worker_serves_the_family(tmp_path, nemotron_golden):
    w = start_worker(tmp_path, TINY_NEMOTRON)
    try:
        w.wait_ready()
        models = get_json(w.url + "/v1/models")[1]["data"][0]
        assert models["family"] == "nemotron" and get_json(w.url + "/health")[1]["family"] == "nemotron"
        algos = get_json(w.url + "/generation/algorithms")[1]
        assert algos["default_algorithm"] == "nemotron" and "nemotron" in {a["name"] for a in algos["algorithms"]}
        for st, prompt, out in cases(nemotron_golden):
            body = {"prompt": prompt, "max_tokens": st["gen_length"], "block_length": st["block_length"],
                    "steps": st["steps"], "threshold": st["threshold"], "return_token_ids": True, "ignore_eos": True}
            status, r = post_json(w.url + "/v1/completions", body)
            assert status == 200 and r["choices"][0]["token_ids"] == out["output_ids"], (st, r)
        status, r = post_json(w.url + "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 16})
        assert status == 200 and r["model"] == str(TINY_NEMOTRON.resolve())
    finally:
        w.stop()
