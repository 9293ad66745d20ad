"""DiffusionGemma: our engine against the reference's own ``generate`` (transformers' DiffusionGemmaForBlockDiffusion)
on the same random weights, same prompts and seeds, in separate processes. Not a test: it prints numbers.

  python bench/diffusion_gemma_bench.py                       # CPU, one thread, the dg-small shape
  python bench/diffusion_gemma_bench.py --device cuda --dtype bfloat16 --shape dg-1b --batch 32
  python bench/diffusion_gemma_bench.py --reference-python /tmp/dg-ref/bin/python   # the reference in another venv
  python bench/diffusion_gemma_bench.py --memory --shape dg-1b --dtype bfloat16   # loading's host RSS only
  python bench/diffusion_gemma_bench.py --device cuda --cuda-graphs    # also ours with the decoder pass in graphs

The random checkpoint is made once (``--checkpoint``, default under the system temp folder) with transformers' own
classes and ``save_pretrained`` (vision tower included), by ``--reference-python`` (default: this interpreter; it
needs the transformers version that has ``models/diffusion_gemma``). Then, each in its own process:

- the reference: for each prompt, ``torch.manual_seed(seed)`` and ``generate`` at batch 1 (its draws come from the
  global generator, so its batches would change the tokens); tokens, decoder forwards and wall time;
- ours: the same prompts one at a time (batch 1), then all of them as one batch (``--batch``); each row's tokens and
  decoder forwards are compared with the reference's and the rows that agree are counted. These random weights are
  not the tests' goldens: they keep every canvas near-uniform for all its steps (no early stop), so a single
  last-bit difference in a logit (float32 kernels differ with shape and, for ``grouped_mm``, with buffer alignment)
  can flip one of the ~10^5 draws a row takes and the row goes its own way. One such difference is the reference's
  loader's: it keeps float32 weights where safetensors' mmap puts them (4-byte aligned), and CPU ``grouped_mm``
  rounds differently for weights not 64-byte aligned; so the reference process here copies its weights into fresh
  (aligned) storage first, as our loader has them: the same values, the same arithmetic as ours. Batched rows run
  other matrix shapes, so they may still diverge here. The exactness checks are the goldens'
  (tests/test_diffusion_gemma.py, fixture chosen so that the reference's float32 and float64 runs agree);
- loading: peak host RSS above the process's baseline while our loader reads the checkpoint, against the bytes of
  the weights it keeps (the vision tower is not loaded).

Tokens/s counts generated tokens (whole canvases, as the reference returns them, until the answer ends) over wall
time; tokens per forward = those tokens / decoder forwards (the reference's own ``tokens_per_forward``, counting pads
out). On CUDA the reference draws from CUDA's generator and ours from each row's own, so tokens are not compared
there (the CPU run is the exactness check); the figures still are.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = {
    # text_config fields (the layout of google/diffusiongemma-26B-A4B-it, scaled down) and the canvas length
    "dg-small": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=6,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=32, global_head_dim=64,
                     num_global_key_value_heads=2, num_experts=16, top_k_experts=4, vocab_size=4096,
                     sliding_window=128, max_position_embeddings=4096, canvas_length=32),
    "dg-1b": dict(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=12,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=128, global_head_dim=256,
                  num_global_key_value_heads=2, num_experts=32, top_k_experts=8, vocab_size=65536,
                  sliding_window=512, max_position_embeddings=8192, canvas_length=128),
}

MAKE = r"""
import json, sys, torch
from transformers import (DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DiffusionGemmaTextConfig,
                          Gemma4VisionConfig)
from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig
out, shape = sys.argv[1], json.loads(sys.argv[2])
canvas = shape.pop("canvas_length")
torch.manual_seed(0)
text = DiffusionGemmaTextConfig(**shape, eos_token_id=[1, 2], pad_token_id=0, bos_token_id=3)
vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
                            position_embedding_size=16)
cfg = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=canvas, image_token_id=4,
                           boi_token_id=5, eoi_token_id=6)
model = DiffusionGemmaForBlockDiffusion(cfg).eval()
with torch.no_grad():
    for name, p in model.named_parameters():       # random weights that give peaked, varied distributions
        if p.dim() >= 2:
            p.normal_(0, p.shape[-1] ** -0.5 * (2.0 if "router" in name else 1.0))
        elif name.endswith("scale") or "norm" in name:
            p.copy_(1 + 0.25 * torch.randn_like(p))
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_(1 + 0.1 * torch.randn_like(b))
    model.model.decoder.embed_tokens.weight.mul_(3.0)
# every setting explicit: a null in generation_config.json switches the reference's schedule or stopping off
model.generation_config = DiffusionGemmaGenerationConfig(
    max_new_tokens=256, eos_token_id=[1, 2], pad_token_id=0, bos_token_id=3, max_denoising_steps=48, t_min=0.4,
    t_max=0.8, stability_threshold=1, confidence_threshold=0.005,
    sampler_config={"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1})
model.save_pretrained(out)
"""

REFERENCE = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[3]))
from transformers import DiffusionGemmaForBlockDiffusion
from transformers.utils import logging
logging.set_verbosity_error()
path, job = sys.argv[1], json.loads(sys.argv[2])
dtype = getattr(torch, job["dtype"])
model = DiffusionGemmaForBlockDiffusion.from_pretrained(path, dtype=dtype).to(job["device"]).eval()
with torch.no_grad():     # fresh, 64-byte aligned storage, as our loader gives (the values are the same)
    for t in list(model.parameters()) + list(model.buffers()):
        t.data = t.data.clone()
calls = {"n": 0}
model.model.decoder.register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))
out = []
for warm in (True, False):
    for prompt, seed in (job["rows"][:1] if warm else job["rows"]):
        calls["n"] = 0
        torch.manual_seed(seed)
        if job["device"] == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        seq = model.generate(torch.tensor([prompt], device=job["device"]), max_new_tokens=job["gen"]).sequences
        if job["device"] == "cuda":
            torch.cuda.synchronize()
        if not warm:
            out.append({"tokens": seq[0, len(prompt):].tolist(), "seconds": time.perf_counter() - t,
                        "forwards": calls["n"]})
print(json.dumps(out))
"""

OURS = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[3]))
sys.path.insert(0, sys.argv[4])
from worker.engine import Engine, GenerationParams, Request
path, job = sys.argv[1], json.loads(sys.argv[2])
engine = Engine.from_pretrained(path, device=job["device"], dtype=job["dtype"])
def req(prompt, seed):
    return Request(prompt, GenerationParams(gen_length=job["gen"], block_length=engine.default_block_length,
                                            algorithm="diffusion_gemma", seed=seed))
def sync():
    if job["device"] == "cuda":
        torch.cuda.synchronize()
def timed(reqs):
    sync(); t = time.perf_counter()
    res = engine.generate(reqs)
    sync()
    return res, time.perf_counter() - t
L = engine.model.cfg.canvas_length
def row(r):          # the reference's output: whole canvases, eos kept, the rest of its canvas pads
    return {"answer": r.token_ids, "stopped": r.finish_reason == "stop", "forwards": r.nfe,
            "tokens": -(-(len(r.token_ids) + (r.finish_reason == "stop")) // L) * L}
timed([req(*job["rows"][0])])        # warm-up
alone = []
for prompt, seed in job["rows"]:
    (r,), s = timed([req(prompt, seed)])
    alone.append({**row(r), "seconds": s})
res, s = timed([req(p, sd) for p, sd in job["rows"]])
out = {"alone": alone, "batch": [row(r) for r in res], "batch_seconds": s}
if job["graphs"]:     # the same again with the decoder pass replayed from CUDA graphs (worker/engine/graphs.py)
    from worker.engine.graphs import install
    g = install(engine.model)
    timed([req(*job["rows"][0])])
    timed([req(p, sd) for p, sd in job["rows"]])          # captures the batch's signatures too
    galone = []
    for prompt, seed in job["rows"]:
        (r,), s = timed([req(prompt, seed)])
        galone.append({**row(r), "seconds": s})
    res, s = timed([req(p, sd) for p, sd in job["rows"]])
    out["graphs"] = {"alone": galone, "batch": [row(r) for r in res], "batch_seconds": s,
                     "report": g.report() if g is not None else None}
print(json.dumps(out))
"""

LOAD = r"""
import json, resource, sys, torch
sys.path.insert(0, sys.argv[2])
from worker.models import load_model
import transformers.models.diffusion_gemma.configuration_diffusion_gemma   # the config parser, as a worker has it
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
m = load_model(sys.argv[1], "cpu", sys.argv[3])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
kept = sum(p.numel() * p.element_size() for p in m.parameters())
print(json.dumps({"rss_before_kib": before, "rss_peak_kib": peak, "kept_bytes": kept}))
"""


def load_line(load: dict) -> str:
    grew = (load["rss_peak_kib"] - load["rss_before_kib"]) * 1024
    return (f"loading: peak host RSS +{grew / 2**20:.1f} MiB for {load['kept_bytes'] / 2**20:.1f} MiB of weights "
            f"({grew / load['kept_bytes']:.2f}x)")


def run_json(cmd: list[str], env=None) -> object:
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode:
        sys.exit(f"{' '.join(cmd[:3])} ... failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="dg-small")
    ap.add_argument("--checkpoint", help="folder of the random checkpoint (made if missing; default under the temp "
                    "folder, per shape)")
    ap.add_argument("--reference-python", default=sys.executable,
                    help="interpreter with transformers' diffusion_gemma (default: this one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16, help="rows (prompts) in all")
    ap.add_argument("--prompt-length", type=int, default=64)
    ap.add_argument("--gen", type=int, default=64, help="max_new_tokens (whole canvases)")
    ap.add_argument("--memory", action="store_true", help="only the loading figure")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="ours also with the decoder pass replayed from CUDA graphs (not yet on by default for this "
                         "family): its tokens against ours eager, and its speed")
    args = ap.parse_args()

    shape = SHAPES[args.shape]
    ckpt = Path(args.checkpoint or Path(tempfile.gettempdir()) / f"dllm-bench-{args.shape}")
    if not (ckpt / "model.safetensors").exists() and not (ckpt / "model.safetensors.index.json").exists():
        print(f"making the random checkpoint {ckpt} ...", flush=True)
        subprocess.run([args.reference_python, "-c", MAKE, str(ckpt), json.dumps(shape)], check=True)
        tok = ROOT / "tests/fixtures/tiny-diffusion-gemma"
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (ckpt / name).write_bytes((tok / name).read_bytes())   # a tokenizer for the loader (ids unused here)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    if args.memory:
        print(load_line(run_json([sys.executable, "-c", LOAD, str(ckpt), str(ROOT), args.dtype], env)))
        return
    import random
    rng = random.Random(28)
    V = shape["vocab_size"]
    rows = [([rng.randrange(7, V) for _ in range(args.prompt_length)], rng.randrange(1 << 30))
            for _ in range(args.batch)]
    job = {"rows": rows, "gen": args.gen, "device": args.device, "dtype": args.dtype, "graphs": args.cuda_graphs}
    print(f"shape {args.shape} ({shape}), {args.batch} prompts of {args.prompt_length} tokens, max_new_tokens "
          f"{args.gen}, {args.device} {args.dtype}, {args.threads} thread(s)", flush=True)
    ref = run_json([args.reference_python, "-c", REFERENCE, str(ckpt), json.dumps(job), str(args.threads)], env)
    ours = run_json([sys.executable, "-c", OURS, str(ckpt), json.dumps(job), str(args.threads), str(ROOT)], env)
    load = run_json([sys.executable, "-c", LOAD, str(ckpt), str(ROOT), args.dtype], env)

    def tokens(r):
        return len(r["tokens"])

    eos = {1, 2}
    same = {"alone": 0, "batch": 0}
    for r, a, b in zip(ref, ours["alone"], ours["batch"]):
        seq = r["tokens"]
        cut = next((j for j, t in enumerate(seq) if t in eos), len(seq))
        want = seq[:min(cut, args.gen)]
        for name, got in (("alone", a), ("batch", b)):
            same[name] += got["answer"] == want and got["forwards"] == r["forwards"]
    ref_tps = sum(tokens(r) for r in ref) / sum(r["seconds"] for r in ref)
    ours1 = sum(a["tokens"] for a in ours["alone"]) / sum(a["seconds"] for a in ours["alone"])
    oursb = sum(b["tokens"] for b in ours["batch"]) / ours["batch_seconds"]
    fw = sum(r["forwards"] for r in ref)
    print(f"{'':28} {'tokens/s':>10} {'x reference':>12}")
    print(f"{'reference, batch 1':28} {ref_tps:10.1f} {1.0:12.2f}")
    print(f"{'ours, batch 1':28} {ours1:10.1f} {ours1 / ref_tps:12.2f}")
    print(f"{'ours, batch ' + str(args.batch):28} {oursb:10.1f} {oursb / ref_tps:12.2f}")
    print(f"tokens per decoder forward: {sum(tokens(r) for r in ref) / fw:.3f} (reference), "
          f"{sum(a['tokens'] for a in ours['alone']) / sum(a['forwards'] for a in ours['alone']):.3f} (ours); "
          f"decoder forwards per row {fw / len(ref):.1f}")
    if "graphs" in ours:
        g = ours["graphs"]
        g1 = sum(a["tokens"] for a in g["alone"]) / sum(a["seconds"] for a in g["alone"])
        gb = sum(b["tokens"] for b in g["batch"]) / g["batch_seconds"]
        strip = [{k: v for k, v in a.items() if k != "seconds"} for a in ours["alone"]]
        gstrip = [{k: v for k, v in a.items() if k != "seconds"} for a in g["alone"]]
        print(f"{'ours + CUDA graphs, batch 1':28} {g1:10.1f} {g1 / ref_tps:12.2f}")
        print(f"{'ours + CUDA graphs, batch ' + str(args.batch):28} {gb:10.1f} {gb / ref_tps:12.2f}")
        print(f"with graphs, every row as ours eager (tokens, forwards): alone "
              f"{sum(a == b for a, b in zip(strip, gstrip))}/{len(strip)}, batched "
              f"{sum(a == b for a, b in zip(ours['batch'], g['batch']))}/{len(strip)}; graphs {g['report']}")
    print(load_line(load))
    if args.device == "cpu":
        print(f"rows with the reference's tokens and forwards: {same['alone']}/{len(ref)} alone, "
              f"{same['batch']}/{len(ref)} batched")


if __name__ == "__main__":
    main()
