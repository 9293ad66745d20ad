"""Ours against the published reference code, same run, same weights (not a test: it prints numbers).

The reference is read from folders you fetched (never vendored here): ML-GSAI/LLaDA (its ``generate.py``: the
semi-autoregressive ``generate``) and NVlabs/Fast-dLLM (``llada/generate.py``: ``generate_with_dual_cache``,
``generate_with_prefix_cache``, and ``llada/model/modeling_llada.py``, the model class both are run with). It runs
in its own interpreter (``--reference-python``: a venv with torch and transformers 4.46, which that model code
needs); ours in this one. Each round runs the reference process, then ours (the order alternates between rounds),
each loading the same random LLaDA-layout checkpoint (5.4M parameters unless --shape says otherwise), float32 on CPU
with ``--threads`` threads; the table gives medians over the rounds and checks that every row's tokens are the
reference's (the whole canvas, early exit off, as the reference decodes).

  git clone https://github.com/ML-GSAI/LLaDA /tmp/LLaDA; git clone https://github.com/NVlabs/Fast-dLLM /tmp/Fast-dLLM
  python3 -m venv /tmp/refvenv && /tmp/refvenv/bin/pip install torch==2.13.0 transformers==4.46.3 safetensors einops
  python bench/reference_bench.py --llada /tmp/LLaDA --fast-dllm /tmp/Fast-dLLM --reference-python /tmp/refvenv/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "tiny-llada"

SHAPES = {"5m": dict(d_model=256, n_layers=5, n_heads=8, n_kv_heads=8, mlp_hidden_size=1024),
          "tiny": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden_size=128),
          # a GPU size: 0.8B parameters (the fixture's small vocabulary), where the forward's arithmetic counts
          "1b": dict(d_model=2048, n_layers=16, n_heads=16, n_kv_heads=16, mlp_hidden_size=5632)}

# (name, function, gen_length, block_length, steps, threshold, batch)
SETTINGS = [
    ("basic gen 128, block 32, 128 steps, batch 1", "basic", 128, 32, 128, None, 1),
    ("basic, same, batch 8", "basic", 128, 32, 128, None, 8),
    ("dual cache gen 256, block 32, 256 steps, batch 1", "dual_cache", 256, 32, 256, None, 1),
    ("dual cache + threshold 0.9, batch 1", "dual_cache", 256, 32, 256, 0.9, 1),
    ("dual cache + threshold 0.9, batch 8", "dual_cache", 256, 32, 256, 0.9, 8),
    ("prefix cache + threshold 0.9, batch 1", "prefix_cache", 256, 32, 256, 0.9, 1),
]

REFERENCE = r"""
import importlib.util, json, sys, time, torch
ckpt, job, llada_dir, fast_dir, threads = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
dev, dtype = sys.argv[6], getattr(torch, sys.argv[7])
torch.set_num_threads(threads)
sys.path.insert(0, fast_dir + "/llada")
from model.modeling_llada import LLaDAModelLM
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
fast = load("fast_generate", fast_dir + "/llada/generate.py")
ml = load("llada_generate", llada_dir + "/generate.py")
model = LLaDAModelLM.from_pretrained(ckpt, torch_dtype=dtype).to(dev).eval()
SDPA = {"math": dict(flash=False, mem_efficient=False, cudnn=False)}.get(sys.argv[8], {})
for name, on in SDPA.items():            # after the model's own init, which sets flash on, mem-efficient off
    getattr(torch.backends.cuda, f"enable_{name}_sdp")(on)
mask = job["mask_id"]
def run(s, prompts):
    name, fn, gen, block, steps, thr, batch = s
    outs = []
    if fn == "basic" and batch > 1:          # LLaDA's generate takes a batch (all prompts the same length)
        p = torch.tensor(prompts, device=dev)
        x = ml.generate(model, p, attention_mask=torch.ones_like(p), steps=steps, gen_length=gen,
                        block_length=block, mask_id=mask)
        return [r[p.shape[1]:].tolist() for r in x]
    for prompt in prompts:                    # Fast-dLLM's functions take one prompt
        p = torch.tensor([prompt], device=dev)
        if fn == "basic":
            x = ml.generate(model, p, attention_mask=torch.ones_like(p), steps=steps, gen_length=gen,
                            block_length=block, mask_id=mask)
        elif fn == "dual_cache":
            x, _ = fast.generate_with_dual_cache(model, p, steps=steps, gen_length=gen, block_length=block,
                                                 mask_id=mask, threshold=thr)
        else:
            x, _ = fast.generate_with_prefix_cache(model, p, steps=steps, gen_length=gen, block_length=block,
                                                   mask_id=mask, threshold=thr)
        outs.append(x[0, p.shape[1]:].tolist())
    return outs
out = []
for s in job["settings"]:
    prompts = job["prompts"][:s[6]]
    run(s, prompts[:1])                       # warm-up
    t = time.perf_counter()
    toks = run(s, prompts)
    out.append({"seconds": time.perf_counter() - t, "tokens": toks})
print(json.dumps(out))
"""

OURS = r"""
import json, sys, time, torch
ckpt, job, threads, root, dev, dtype = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
torch.set_num_threads(threads)
sys.path.insert(0, root)
from worker.engine import Engine, GenerationParams, Request
engine = Engine.from_pretrained(ckpt, device=dev, dtype=dtype, cuda_graphs=sys.argv[8] == "1")
SDPA = {"math": dict(flash=False, mem_efficient=False, cudnn=False),
        "reference": dict(flash=True, mem_efficient=False)}.get(sys.argv[7], {})
for name, on in SDPA.items():
    getattr(torch.backends.cuda, f"enable_{name}_sdp")(on)
ALG = {"basic": "basic", "dual_cache": "dual_cache", "prefix_cache": "prefix_cache"}
def run(s, prompts):
    name, fn, gen, block, steps, thr, batch = s
    reqs = [Request(p, GenerationParams(gen_length=gen, block_length=block, steps=steps, algorithm=ALG[fn],
                                        threshold=thr)) for p in prompts]
    if batch > 1:
        return [r.canvas for r in engine.generate(reqs, early_exit=False)]
    return [engine.generate([r], early_exit=False)[0].canvas for r in reqs]
out = []
for s in job["settings"]:
    prompts = job["prompts"][:s[6]]
    run(s, prompts[:1])
    t = time.perf_counter()
    toks = run(s, prompts)
    out.append({"seconds": time.perf_counter() - t, "tokens": toks})
print(json.dumps(out))
"""


def make_checkpoint(dest: Path, shape: dict) -> int:
    """A random LLaDA-layout checkpoint of ``shape``: the fixture's config with these sizes, its tokenizer."""
    import torch
    from safetensors.torch import save_file
    sys.path.insert(0, str(ROOT))
    from worker.models.llada import PREFIX, LLaDAConfig, LLaDAModel
    cfg = json.loads((FIXTURE / "config.json").read_text())
    cfg.update(shape)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(FIXTURE / name, dest / name)
    with torch.device("meta"):
        shapes = {PREFIX + n: p.shape for n, p in LLaDAModel(LLaDAConfig.from_dict(cfg)).named_parameters()}
    gen = torch.Generator().manual_seed(0)
    sd = {n: (torch.randn(s, generator=gen) * (0.02 if len(s) > 1 else 0) + (1.0 if len(s) == 1 else 0.0))
          for n, s in sorted(shapes.items())}
    save_file(sd, dest / "model.safetensors", metadata={"format": "pt"})
    return sum(t.numel() for t in sd.values())


def run_json(cmd: list[str], env: dict | None = None) -> list:
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llada", required=True, help="a checkout of ML-GSAI/LLaDA (its generate.py)")
    ap.add_argument("--fast-dllm", required=True, help="a checkout of NVlabs/Fast-dLLM (llada/generate.py, "
                                                       "llada/model/modeling_llada.py)")
    ap.add_argument("--reference-python", default=sys.executable,
                    help="interpreter with torch and transformers 4.46 for the reference (default: this one)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="5m")
    ap.add_argument("--checkpoint", help="use this LLaDA-layout checkpoint instead of a random one")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-length", type=int, default=32)
    ap.add_argument("--only", help="comma-separated setting numbers (1-6) to run")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (both sides)")
    ap.add_argument("--reference-eager", action="store_true",
                    help="run the reference with TORCHDYNAMO_DISABLE=1: Fast-dLLM's model wraps its attention in "
                         "torch.compile, which on a GPU compiles (and recompiles for new shapes) for minutes inside "
                         "the timed runs; eager is the same arithmetic without that")
    ap.add_argument("--sdpa", default="default", choices=("default", "reference", "math"),
                    help="CUDA attention kernels: default (each side as it runs: Fast-dLLM's model turns flash on and "
                         "the memory-efficient kernel off for its process), reference (ours as the reference's "
                         "process), math (both sides the math kernel only)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="ours replays its forward from CUDA graphs (worker/engine/graphs.py; cuda only)")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                    help="default: float32 on the CPU, bfloat16 on cuda")
    args = ap.parse_args()
    for name, d in (("--llada", args.llada), ("--fast-dllm", args.fast_dllm)):
        if not Path(d).is_dir():
            raise SystemExit(f"{name} {d!r} is not a directory")
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    settings = SETTINGS if not args.only else [SETTINGS[int(i) - 1] for i in args.only.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        if args.checkpoint:
            ckpt, nparams = Path(args.checkpoint), None
        else:
            ckpt = Path(tmp) / "ckpt"
            nparams = make_checkpoint(ckpt, SHAPES[args.shape])
        cfg = json.loads((ckpt / "config.json").read_text())
        import random
        rng = random.Random(36)
        prompts = [[rng.randrange(5, 280) for _ in range(args.prompt_length)] for _ in range(8)]
        job = json.dumps({"settings": settings, "prompts": prompts, "mask_id": cfg["mask_token_id"]})
        ref_cmd = [args.reference_python, "-c", REFERENCE, str(ckpt), job, str(Path(args.llada).resolve()),
                   str(Path(args.fast_dllm).resolve()), str(args.threads), args.device, dtype, args.sdpa]
        ours_cmd = [sys.executable, "-c", OURS, str(ckpt), job, str(args.threads), str(ROOT), args.device, dtype,
                    args.sdpa, "1" if args.cuda_graphs else "0"]
        ref_env = dict(os.environ, TORCHDYNAMO_DISABLE="1") if args.reference_eager else None
        times = {"ref": [[] for _ in settings], "ours": [[] for _ in settings]}
        tokens = {"ref": [], "ours": []}
        for r in range(args.rounds):
            order = [("ref", ref_cmd), ("ours", ours_cmd)]
            for who, cmd in (order if r % 2 == 0 else order[::-1]):
                res = run_json(cmd, ref_env if who == "ref" else None)
                tokens[who].append([x["tokens"] for x in res])
                for i, x in enumerate(res):
                    times[who][i].append(x["seconds"])
        same = [all(run[i] == tokens["ref"][0][i] for run in tokens["ours"] + tokens["ref"])
                for i in range(len(settings))]
        print(f"checkpoint {ckpt if args.checkpoint else f'random LLaDA-layout, {nparams / 1e6:.1f}M parameters'}; "
              f"prompts of {args.prompt_length} tokens; {dtype}, {args.device}, {args.threads} thread(s); medians of "
              f"{args.rounds} interleaved rounds" + ("; reference eager (TORCHDYNAMO_DISABLE=1)" if args.reference_eager else "")
              + (f"; CUDA attention: {args.sdpa}" if args.sdpa != "default" else "")
              + ("; ours with CUDA graphs" if args.cuda_graphs else ""))
        print(f"{'setting':<52} {'ref tok/s':>10} {'ours tok/s':>11} {'ours/ref':>9} {'tokens':>10}")
        for i, s in enumerate(settings):
            toks = s[2] * s[6]
            ref, ours = statistics.median(times["ref"][i]), statistics.median(times["ours"][i])
            print(f"{s[0]:<52} {toks / ref:>10.1f} {toks / ours:>11.1f} {ref / ours:>9.2f} "
                  f"{'identical' if same[i] else 'DIFFER':>10}")


if __name__ == "__main__":
    main()
