"""Engine throughput and load memory. Not a test: it prints numbers.

  python bench/engine_bench.py --model-path ../shared/fixtures/tiny-llada --batch-sizes 1,4,8,16
  python bench/engine_bench.py --shape llada-1b --gen-length 16 --steps 8 --batch-sizes 1,4
  python bench/engine_bench.py --shape llada-8b --device cuda --gen-length 256 --block-length 32
  python bench/engine_bench.py --memory --shape llada-1b      # peak host RSS while loading a bf16 checkpoint
  python bench/engine_bench.py --memory --shape llada-moe-1b  # the same for a mixture-of-experts checkpoint
  python bench/engine_bench.py --memory --shape llada-1b --tensor-parallel-size 2   # each rank's shard alone
  python bench/engine_bench.py --memory --reload --shape llada-1b   # RSS while new weights load in place

Tokens/s counts generated tokens (gen_length per row, whole canvas, early exit off) over wall time; forward
passes/s counts denoising steps (one batched forward each) over wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

SHAPES = {
    # name: (d_model, n_layers, n_heads, n_kv_heads, mlp_hidden, vocab)
    "llada-8b": (4096, 32, 32, 32, 12288, 126464),
    "llada-1b": (2048, 10, 16, 16, 5632, 126464),   # ~1.03B parameters, LLaDA-shaped
    "llada-small": (256, 4, 4, 4, 704, 126464),     # 68M parameters, almost all in the real vocabulary's embedding
                                                    # and head: the per-step confidence work shows, as on LLaDA-8B
}

MOE_SHAPES = {
    # name: LLaDA-MoE config (the layout of inclusionAI/LLaDA-MoE-7B-A1B; 1.16B parameters: 64 experts of 512 in 8
    # layers, the real vocabulary)
    "llada-moe-1b": {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16, "num_experts": 64,
                     "num_experts_per_tok": 8, "expert_intermediate_size": 512, "vocab_size": 157184},
}


def moe_config(name: str) -> dict:
    c = MOE_SHAPES[name]
    return {"architectures": ["LLaDAMoEModelLM"], "model_type": "llada", **c, "num_key_value_heads":
            c["num_attention_heads"], "moe_layer_freq": [1] * c["num_hidden_layers"], "qk_layernorm": True,
            "rope_theta": 50000, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "partial_rotary_factor": 1,
            "eos_token_id": 156892, "pad_token_id": 156892, "mask_token_id": 156895}


def shape_config(name: str) -> dict:
    if name in MOE_SHAPES:
        return moe_config(name)
    d, L, h, kv, mlp, v = SHAPES[name]
    return {"architectures": ["LLaDAModelLM"], "model_type": "llada", "d_model": d, "n_layers": L, "n_heads": h,
            "n_kv_heads": kv, "mlp_hidden_size": mlp, "vocab_size": v, "embedding_size": v, "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5, "max_sequence_length": 4096, "weight_tying": False, "block_type": "llama",
            "mask_token_id": v - 128, "eos_token_id": v - 383, "pad_token_id": v - 383}


def random_engine(name: str, device: torch.device, dtype: torch.dtype):
    from worker.engine import Engine
    from worker.models.llada import LLaDAConfig, LLaDAModel
    cfg = LLaDAConfig.from_dict(shape_config(name))
    torch.manual_seed(0)
    with torch.device(device):
        model = LLaDAModel(cfg).to(dtype)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    model.init_rope()
    model.eval().requires_grad_(False)
    return Engine(model, mask_id=cfg.mask_token_id, stop_ids=[cfg.eos_token_id], pad_id=cfg.pad_token_id,
                  family="llada", name=name)


def write_checkpoint(name: str, dest: Path, seed: int = 0) -> int:
    """Random bf16 weights of a named shape, in its family's layout; returns the weights' size in bytes."""
    from safetensors.torch import save_file
    from worker.models.llada import PREFIX, LLaDAConfig, LLaDAModel
    from worker.models.llada_moe import LLaDAMoEConfig, LLaDAMoEModel
    cfg = shape_config(name)
    with torch.device("meta"):
        if name in MOE_SHAPES:
            shapes = {n: p.shape for n, p in LLaDAMoEModel(LLaDAMoEConfig.from_dict(cfg)).named_parameters()}
        else:
            shapes = {PREFIX + n: p.shape for n, p in LLaDAModel(LLaDAConfig.from_dict(cfg)).named_parameters()}
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(cfg))
    total, shard, shards, size = 0, {}, [], 0
    gen = torch.Generator().manual_seed(seed)
    names = sorted(shapes)
    for i, n in enumerate(names):
        t = (torch.randn(shapes[n], generator=gen) * 0.02).to(torch.bfloat16)
        shard[n] = t
        size += t.numel() * 2
        total += t.numel() * 2
        if size > 1 << 30 or i == len(names) - 1:
            shards.append(shard)
            save_file(shard, dest / f"part-{len(shards)}.safetensors", metadata={"format": "pt"})
            shard, size = {}, 0
    files = {}
    for k, s in enumerate(shards, 1):
        final = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        (dest / f"part-{k}.safetensors").rename(dest / final)
        files.update({n: final for n in s})
    (dest / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files}))
    return total


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_peak() -> int:
    """VmHWM: this process's peak RSS (unlike ru_maxrss, not inherited from the parent across exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure_load(path: str, device: str, dtype: str, rank: int = 0, size: int = 1) -> None:
    """Child process: load (rank ``rank`` of ``size``'s shard) and print baseline and peak RSS (bytes) as JSON."""
    import worker.models  # noqa: F401  (imports done before the baseline)
    from worker.models import load_model
    from worker.models.parallel import Layout
    base = rss_now()
    t = time.perf_counter()
    model = load_model(path, device, dtype, Layout(rank, size) if size > 1 else None)
    secs = time.perf_counter() - t
    peak = rss_peak()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"baseline_rss": base, "peak_rss": peak, "param_bytes": nbytes, "load_seconds": secs}))


def measure_reload(paths: str, device: str, dtype: str) -> None:
    """Child process: load the first checkpoint, then reload the second's weights in place
    (checkpoint.reload_native, what POST /worker/load_weights does); RSS before, and the peak during, the reload."""
    from worker.models import load_model
    from worker.models.checkpoint import check_reload, reload_native
    first, second = paths.split(",")
    model = load_model(first, device, dtype)
    check_reload(model, second, "LLaDA")
    with open("/proc/self/clear_refs", "w") as f:        # VmHWM from here on
        f.write("5")
    base = rss_now()
    t = time.perf_counter()
    reload_native(model, second, "LLaDA")
    secs = time.perf_counter() - t
    peak = rss_peak()
    params = list(model.parameters())
    print(json.dumps({"baseline_rss": base, "peak_rss": peak, "reload_seconds": secs,
                      "param_bytes": sum(p.numel() * p.element_size() for p in params),
                      "largest_tensor": max(p.numel() * p.element_size() for p in params)}))


def reload_memory_bench(args) -> None:
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        a, b = Path(tmp) / "a", Path(tmp) / "b"
        weights = write_checkpoint(args.shape, a, seed=0)
        write_checkpoint(args.shape, b, seed=1)
        out = subprocess.run([sys.executable, __file__, "--_measure-reload", f"{a},{b}", "--device", args.device,
                              "--dtype", "bfloat16"], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
    grown = r["peak_rss"] - r["baseline_rss"]
    print(f"shape {args.shape}: {weights / 2**30:.2f} GiB of bf16 weights loaded on {args.device}, then another "
          f"checkpoint's weights reloaded in place")
    print(f"  RSS after the first load:            {r['baseline_rss'] / 2**30:.2f} GiB")
    print(f"  peak RSS while reloading:            {r['peak_rss'] / 2**30:.2f} GiB")
    print(f"  growth during the reload:            {grown / 2**20:.1f} MiB = {grown / weights:.3f} x the weights "
          f"(largest tensor {r['largest_tensor'] / 2**20:.1f} MiB)")
    print(f"  reload time:                         {r['reload_seconds']:.1f} s")


def memory_bench(args) -> None:
    if args.reload:
        return reload_memory_bench(args)
    if args.tensor_parallel_size > 1:
        return rank_memory_bench(args)
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        weights = write_checkpoint(args.shape, Path(tmp))
        out = subprocess.run([sys.executable, __file__, "--_measure-load", tmp, "--device", args.device,
                              "--dtype", "bfloat16"], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
    grown = r["peak_rss"] - r["baseline_rss"]
    print(f"shape {args.shape}: weights on disk {weights / 2**30:.2f} GiB (bf16), loaded as bf16 on {args.device}")
    print(f"  RSS before loading (python + torch): {r['baseline_rss'] / 2**30:.2f} GiB")
    print(f"  peak RSS while loading:              {r['peak_rss'] / 2**30:.2f} GiB")
    print(f"  growth during load:                  {grown / 2**30:.2f} GiB = {grown / weights:.3f} x the weights")
    print(f"  peak RSS / weights:                  {r['peak_rss'] / weights:.3f}")
    print(f"  load time:                           {r['load_seconds']:.1f} s")


def rank_memory_bench(args) -> None:
    """Each rank of --tensor-parallel-size N loads its shard alone (no process group needed to load): its peak RSS
    growth against the bytes of its shard."""
    n = args.tensor_parallel_size
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        weights = write_checkpoint(args.shape, Path(tmp))
        print(f"shape {args.shape}: weights on disk {weights / 2**30:.2f} GiB (bf16); --tensor-parallel-size {n}, "
              f"each rank loading its shard as bf16 on {args.device}")
        for rank in range(n):
            out = subprocess.run([sys.executable, __file__, "--_measure-load", tmp, "--device", args.device,
                                  "--dtype", "bfloat16", "--_rank", str(rank), "--tensor-parallel-size", str(n)],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            grown = r["peak_rss"] - r["baseline_rss"]
            print(f"  rank {rank}: shard {r['param_bytes'] / 2**30:.2f} GiB, RSS growth while loading "
                  f"{grown / 2**30:.2f} GiB = {grown / r['param_bytes']:.3f} x its shard, "
                  f"{r['load_seconds']:.1f} s")


def throughput_bench(args) -> None:
    from worker.engine import Engine, GenerationParams, Request
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    if args.model_path:
        engine = Engine.from_pretrained(args.model_path, device=device, dtype=dtype)
        label = args.model_path
    else:
        engine = random_engine(args.shape, device, dtype)
        label = f"{args.shape} (random weights)"
    if args.cuda_graphs:
        from worker.engine.graphs import install
        engine.graphs = install(engine.model)
        label += ", CUDA graphs" if engine.graphs is not None else ", CUDA graphs not applicable (eager)"
    vocab = engine.model.cfg.vocab_size
    special = set(engine.stop_ids) | {engine.mask_id}
    gen = torch.Generator().manual_seed(0)
    extra = json.loads(args.params) if args.params else {}
    params = GenerationParams(gen_length=args.gen_length, block_length=args.block_length, steps=args.steps,
                              algorithm=args.algorithm, threshold=args.threshold, **extra)

    def prompt():
        ids = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
        return [t if t not in special else 1 for t in ids]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    print(f"model {label} on {device} {dtype}; prompt {args.prompt_len}, gen {args.gen_length}, block "
          f"{args.block_length}, steps {args.steps}, algorithm {args.algorithm}"
          + (f", threshold {args.threshold}" if args.threshold else ""))
    print(f"{'batch':>5} {'wall s':>8} {'tokens/s':>10} {'fwd/s':>8} {'nfe/row':>8}")
    rows = []
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        reqs = [Request(prompt(), params) for _ in range(bs)]
        for _ in range(args.warmup):
            engine.generate(reqs[:1], early_exit=False)
        sync()
        steps = 0
        orig = engine.model.forward

        def counting_forward(*a, **k):
            nonlocal steps
            steps += 1
            return orig(*a, **k)
        engine.model.forward = counting_forward
        t = time.perf_counter()
        res = engine.generate(reqs, early_exit=False)
        sync()
        wall = time.perf_counter() - t
        engine.model.forward = orig
        toks = bs * args.gen_length
        nfe = sum(r.nfe for r in res) / bs
        rows.append({"batch": bs, "wall_s": wall, "tokens_per_s": toks / wall, "forwards_per_s": steps / wall,
                     "nfe_per_row": nfe})
        print(f"{bs:>5} {wall:>8.2f} {toks / wall:>10.1f} {steps / wall:>8.2f} {nfe:>8.1f}", flush=True)
    if engine.graphs is not None:
        print(f"graphs: {engine.graphs.report()}")
    if args.json:
        print(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path")
    ap.add_argument("--shape", choices=sorted(SHAPES) + sorted(MOE_SHAPES), default="llada-1b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--batch-sizes", default="1,4,8,16")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-length", type=int, default=128)
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--algorithm", default="basic")
    ap.add_argument("--threshold", type=float, default=None)
    ap.add_argument("--params", help="extra GenerationParams fields as JSON")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--cuda-graphs", action="store_true", help="replay the forward from CUDA graphs "
                                                               "(worker/engine/graphs.py)")
    ap.add_argument("--memory", action="store_true", help="measure peak host RSS while loading a bf16 checkpoint")
    ap.add_argument("--tmpdir", default=None, help="where --memory writes its temporary checkpoint")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--_measure-load", dest="measure_load", help=argparse.SUPPRESS)
    ap.add_argument("--_measure-reload", dest="measure_reload", help=argparse.SUPPRESS)
    ap.add_argument("--reload", action="store_true",
                    help="with --memory: RSS while another checkpoint's weights load in place (a weight update)")
    ap.add_argument("--_rank", dest="rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="with --memory: each rank's shard loaded alone (its RSS against its shard's bytes)")
    args = ap.parse_args()
    if args.measure_reload:
        measure_reload(args.measure_reload, args.device, args.dtype)
    elif args.measure_load:
        measure_load(args.measure_load, args.device, args.dtype, args.rank, args.tensor_parallel_size)
    elif args.memory:
        memory_bench(args)
    elif args.shape in MOE_SHAPES and not args.model_path:
        ap.error(f"--shape {args.shape} is for --memory (throughput: --model-path a checkpoint)")
    else:
        throughput_bench(args)


if __name__ == "__main__":
    main()
