"""Building blocks shared by the model families: RMSNorm in float32, rotate-half RoPE from float32 tables,
and bidirectional grouped-query attention through torch SDPA with an optional boolean key mask."""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn


log = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:class:`RMSNorm` as a function (the same arithmetic)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def dense_tail(x: torch.Tensor, a: torch.Tensor, w_out: torch.Tensor, w_norm: torch.Tensor, eps: float,
               w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The second half of a block, after attention (``a``: [B, L, heads * head_dim]): the output projection and
    residual, then RMSNorm and the SwiGLU MLP with its residual. A free function of its weights, so one
    ``torch.compile`` serves every layer (see :class:`Compiled`)."""
    x = x + F.linear(a, w_out)
    h = rms_norm(x, w_norm, eps)
    return x + F.linear(F.silu(F.linear(h, w_gate)) * F.linear(h, w_up), w_down)


class Compiled:
    """``fn`` through ``torch.compile`` (dynamic shapes: batch, window and cache widths vary), with ``fn`` itself as
    the fallback: if compiling or running the compiled code fails (no compiler for the backend, an unsupported op),
    a warning is logged once and the eager function is used from then on. Out-of-memory errors are not swallowed."""

    def __init__(self, fn, **options):
        self.fn = fn
        self.compiled = torch.compile(fn, dynamic=True, **options)
        self.failed: str | None = None

    def __call__(self, *args):
        if self.failed is None:
            try:
                return self.compiled(*args)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:     # noqa: BLE001  (any compiler failure: fall back, once, loudly)
                self.failed = f"{type(e).__name__}: {str(e)[:300]}"
                log.warning("torch.compile failed for %s, using the eager path: %s", self.fn.__name__, self.failed)
        return self.fn(*args)


def compile_dense(blocks) -> Compiled:
    """Route every block's :func:`dense_tail` through one :class:`Compiled` (blocks call ``self.dense``)."""
    c = Compiled(dense_tail)
    for b in blocks:
        b.dense = c
    return c


class RMSNorm(nn.Module):
    """``weight * (x / rms(x))`` with the normalisation in float32 and the result cast back before the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(head_dim: int, max_positions: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of shape [max_positions, head_dim], float32, rotate-half layout (each frequency twice)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    pos = torch.arange(max_positions, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fp32: bool = True) -> torch.Tensor:
    """x: [B, H, L, D]; cos/sin: [B, L, D] (float32) gathered at each token's position.

    ``fp32=True`` rotates in float32 (LLaDA's ``rope_full_precision``); otherwise the tables are cast to x's dtype
    first, as Hugging Face's Qwen3 code does."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if fp32:
        xf = x.float()
        return (xf * cos + rotate_half(xf) * sin).to(x.dtype)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Bidirectional attention. q: [B, Hq, Lq, D]; k, v: [B, Hkv, Lk, D] with Hq a multiple of Hkv (kv head j
    serves query heads j*g .. j*g+g-1); mask: bool [B, 1, 1 or Lq, Lk], True where a key may be attended, or None."""
    if k.shape[1] != q.shape[1]:
        g = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(g, dim=1)
        v = v.repeat_interleave(g, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class KVCache:
    """One preallocated key/value cache per batch slot: ``k``/``v`` of shape [layers, slots, kv_heads, width, head_dim]
    holding keys already rotated at their absolute positions. Rows are laid out like the batch canvas (right-aligned),
    so cache column j is canvas column j. Nothing is concatenated per step: a window's fresh keys are written in place.
    """

    def __init__(self, layers: int, slots: int, kv_heads: int, width: int, head_dim: int, dtype, device):
        shape = (layers, slots, kv_heads, width, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def grow(self, slots: int, prepend: int, width: int) -> None:
        """Add ``slots`` empty slots after the others and widen every row to ``width`` columns, ``prepend`` of them
        on the left (continuous batching: rows join a running batch)."""
        L, S, H, W, D = self.k.shape
        for name in ("k", "v"):
            t = getattr(self, name)
            out = t.new_zeros((L, S + slots, H, width, D))
            out[:, :S, :, prepend:prepend + W] = t
            setattr(self, name, out)

    def keep(self, rows: list[int], trim: int) -> None:
        """Follow the canvas when it drops rows and trims ``trim`` columns of left padding."""
        idx = torch.tensor(rows, device=self.k.device)
        self.k = self.k.index_select(1, idx)[:, :, :, trim:].contiguous()
        self.v = self.v.index_select(1, idx)[:, :, :, trim:].contiguous()


class LayerKV:
    """How one layer's forward uses the cache: ``fill`` stores the keys/values of whole rows (a full forward at a block
    start) and attends to them as a plain forward would; ``window`` writes the fresh keys/values of the window's valid
    positions (batch row ``bi``, window index ``wi`` -> cache column ``cols[bi, wi]``) and attends to the whole cache
    row (prefix, the fresh window and, for the dual cache, the cached suffix)."""

    def __init__(self, cache: KVCache, layer: int, slots: torch.Tensor | None, window=None):
        self.cache, self.layer, self.slots, self.window = cache, layer, slots, window

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ck, cv = self.cache.k[self.layer], self.cache.v[self.layer]
        if self.window is None:       # whole rows, from column 0 (the canvas, or a prompt-only prefill)
            ck, cv = ck.narrow(2, 0, k.shape[2]), cv.narrow(2, 0, k.shape[2])
            if self.slots is None:
                ck.copy_(k)
                cv.copy_(v)
            else:
                ck.index_copy_(0, self.slots, k)
                cv.index_copy_(0, self.slots, v)
            return k, v
        bi, wi, cols = self.window
        rows = bi if self.slots is None else self.slots[bi]
        ck[rows, :, cols] = k[bi, :, wi]
        cv[rows, :, cols] = v[bi, :, wi]
        if self.slots is None:
            return ck, cv
        return ck.index_select(0, self.slots), cv.index_select(0, self.slots)
