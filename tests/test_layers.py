"""Shared model layers (worker/models/layers.py) against the arithmetic they stand for."""
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

from tests.conftest import ROOT
from worker.models.layers import grouped_kv

# (batch, query heads, kv heads, queries, keys, head dim): a denoising window over a long cached context, one query,
# a prefill, a head dim of 128
SHAPES = [(2, 4, 1, 16, 560, 32), (8, 8, 2, 16, 544, 64), (1, 4, 2, 1, 37, 16), (3, 8, 4, 33, 600, 128)]


def _grouped_equals_repeated() -> list[str]:
    """Every case where SDPA over grouped kv heads (as :func:`grouped_kv` prepares them on this device) differs
    from SDPA over the kv heads repeated, as Hugging Face's SDPA attention and the references compute it."""
    torch.manual_seed(0)
    bad = []
    for dtype in (torch.float32, torch.bfloat16):
        for B, H, KV, T, S, d in SHAPES:
            q, k, v = (torch.randn(B, h, n, d, dtype=dtype) for h, n in ((H, T), (KV, S), (KV, S)))
            allowed = torch.rand(B, 1, T, S) > 0.2
            allowed[..., 0] = True
            for mask in (None, allowed, torch.where(allowed, 0.0, float("-inf")).to(dtype)):
                g = H // KV
                want = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                                      attn_mask=mask, scale=1.0)
                k2, v2, gqa = grouped_kv(q, k, v)
                got = F.scaled_dot_product_attention(q, k2, v2, attn_mask=mask, scale=1.0, enable_gqa=gqa)
                if not torch.equal(got, want):
                    bad.append(f"{dtype} {(B, H, KV, T, S, d)} mask {None if mask is None else mask.dtype}: "
                               f"{(got - want).abs().max().item():.3g}")
    return bad


def test_grouped_kv_heads_on_the_cpu_give_the_repeated_heads_results_to_the_bit_in_every_kernel_set():
    """On the CPU the kv heads go to SDPA as they are (enable_gqa), not repeated: the same bits, float32 and
    bfloat16, with a boolean, an additive or no mask, under each ATen kernel set (one process each)."""
    k, v = torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8)
    assert grouped_kv(torch.zeros(1, 4, 3, 8), k, v) == (k, v, True)
    assert grouped_kv(torch.zeros(1, 2, 3, 8), k, v) == (k, v, False)
    assert _grouped_equals_repeated() == []
    code = "from tests.test_layers import _grouped_equals_repeated as f; print(f())"
    procs = {cap: subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT,
                                   env={**os.environ, "ATEN_CPU_CAPABILITY": cap, "OMP_NUM_THREADS": "1"})
             for cap in ("default", "avx2", "avx512")}
    for cap, p in procs.items():
        out = p.communicate(timeout=300)[0]
        assert p.returncode == 0 and out.strip().splitlines()[-1] == "[]", f"{cap}: {out[-2000:]}"
