"""Building blocks shared by the model families: RMSNorm in float32, rotate-half RoPE from float32 tables,
and bidirectional grouped-query attention through torch SDPA with an optional boolean key mask."""
from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from . import parallel

log = logging.getLogger(__name__)


# False: upload makes the plain, waiting copy every time (bench/host_overhead_bench.py --compare-uploads measures both
# and checks that the tokens are the same)
NON_BLOCKING_UPLOADS = True


def upload(data, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype, device=device)`` (``data``: numbers, nested lists, or a host tensor) without
    waiting for a CUDA device: a plain copy from pageable host memory synchronises the stream (it waits for every
    kernel queued before it), so a step's small index and threshold tensors are built in pinned memory and copied with
    ``non_blocking``, queued like a kernel (PyTorch's caching host allocator keeps the pinned block until the copy has
    run). Elsewhere the plain tensor. A flat list of Python ints (row and column indices, mostly the same step after
    step) is kept per value, device and dtype and not copied again: the result is shared, read it only."""
    if type(device) is not torch.device:
        device = torch.device(device)
    if not NON_BLOCKING_UPLOADS:
        return _upload(data, device, dtype)
    if type(data) is list and len(data) <= 4096 and all(type(v) is int for v in data):
        return _kept(tuple(data), device, dtype)
    return _upload(data, device, dtype)


@functools.lru_cache(maxsize=1024)
def _kept(data: tuple[int, ...], device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    return _upload(list(data), device, dtype)


def _upload(data, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    if device.type != "cuda" or not NON_BLOCKING_UPLOADS:
        if isinstance(data, torch.Tensor):
            return data.to(device=device, dtype=dtype)
        return torch.tensor(data, dtype=dtype) if device.type == "cpu" else torch.tensor(data, dtype=dtype,
                                                                                          device=device)
    if isinstance(data, torch.Tensor):
        host = data.to(dtype=dtype).pin_memory() if dtype is not None else data.pin_memory()
    else:
        host = torch.tensor(data, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)


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


def dense_tail_parallel(tp, x, a, w_out, w_norm, eps, w_gate, w_up, w_down):
    """:func:`dense_tail` over tensor-parallel shards: the row-parallel products summed over the ranks."""
    x = x + tp.reduce(F.linear(a, w_out))
    h = rms_norm(x, w_norm, eps)
    return x + tp.reduce(F.linear(F.silu(F.linear(h, w_gate)) * F.linear(h, w_up), w_down))


def no_compile_when_parallel(model) -> bool:
    """torch.compile is not applied to a tensor-parallel model (its collectives run eagerly): logs it, True."""
    if parallel.current().parallel or getattr(model, "tp", parallel.Layout()).parallel:
        log.info("--compile is ignored with tensor parallelism: the layers run eagerly")
        return True
    return False


class Compiled:
    """``fn`` through ``torch.compile`` (dynamic shapes: batch, window and cache widths vary), with ``fn`` itself as
    the fallback: if compiling or running the compiled code fails (no compiler for the backend, an unsupported op),
    a warning is logged once and the eager function is used from then on. Out-of-memory errors are not swallowed.

    The compiled code's first :attr:`CHECKS` results for each kind of shape (its inputs' sizes, 0, 1 or more:
    what a dynamic-shape graph specialises on, so each graph the compiler makes is checked) are also compared with
    ``fn``'s (a pure function) on the same arguments. ``fn`` is a residual step (its first argument plus an update),
    so the difference is measured against the update: a result that is not finite, or whose distance from ``fn``'s
    (Frobenius norm) passes :attr:`TOLERANCE` of the update's plus the dtype's rounding of the whole result (float
    sums reassociated and bfloat16 rounding stay below it), means a miscompiled kernel, and ``fn`` serves from then
    on, starting with that call. Seen with torch 2.13's inductor under ATen's AVX2 kernels on an AVX-512 CPU: NaNs,
    then values off by a third (docs/reliability.md)."""
    CHECKS = 3
    TOLERANCE = 0.05
    INPUTS = 2          # ``fn``'s leading arguments whose shapes vary (tensors); the others are weights, fixed

    def __init__(self, fn, **options):
        self.fn = fn
        self.compiled = torch.compile(fn, dynamic=True, **options)
        self.failed: str | None = None
        self.checks_left: dict[tuple, int] = {}      # shape kind -> checks still to make

    def __call__(self, *args):
        if self.failed is None:
            try:
                out = self.compiled(*args)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:     # noqa: BLE001  (any compiler failure: fall back, once, loudly)
                self.failed = f"{type(e).__name__}: {str(e)[:300]}"
                log.warning("torch.compile failed for %s, using the eager path: %s", self.fn.__name__, self.failed)
            else:
                kind = tuple(tuple(min(n, 2) for n in a.shape) for a in args[:self.INPUTS])
                left = self.checks_left.get(kind, self.CHECKS)
                if not left:
                    return out
                self.checks_left[kind] = left - 1
                want = self.fn(*args)
                if self._close(out, want, args[0]):
                    return out
                log.warning("torch.compile gave wrong results for %s, using the eager path: %s", self.fn.__name__,
                            self.failed)
                return want
        return self.fn(*args)

    def _close(self, out: torch.Tensor, want: torch.Tensor, x) -> bool:
        """Whether ``out`` is ``want`` to float tolerance (see the class); else :attr:`failed` says why."""
        got, want_ = out.float(), want.float()
        update = want_ - x.float() if isinstance(x, torch.Tensor) and x.shape == want.shape else want_
        err = torch.linalg.vector_norm(got - want_)
        bound = (self.TOLERANCE * torch.linalg.vector_norm(update)
                 + torch.finfo(want.dtype).eps * torch.linalg.vector_norm(want_))
        if bool(err <= bound):            # (NaN compares false)
            return True
        self.failed = (f"compiled results differ from eager: {err:.3g} apart (Frobenius norm) where the update "
                       f"measures {torch.linalg.vector_norm(update):.3g}")
        return False


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
    """(cos, signed sin) of shape [max_positions, head_dim], float32, rotate-half layout (each frequency twice); the
    sin table's first half is negated, the sign of ``rotate_half`` folded in (see :func:`apply_rope`)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    pos = torch.arange(max_positions, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), torch.cat((-freqs.sin(), freqs.sin()), dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fp32: bool = True) -> torch.Tensor:
    """x: [B, H, L, D]; cos / signed sin (:func:`rope_tables`): [B, L, D] (float32) gathered at each token's position.

    The references' ``x * cos + rotate_half(x) * sin`` with ``rotate_half([x1, x2]) = [-x2, x1]``, computed as
    ``x * cos + [x2, x1] * [-sin1, sin2]`` (one ``roll`` instead of a negation and a concatenation): the same numbers,
    as ``(-a) * b == a * (-b)`` exactly in floating point.

    ``fp32=True`` rotates in float32 (LLaDA's ``rope_full_precision``); otherwise the tables are cast to x's dtype
    first, as Hugging Face's Qwen3 code does (a cast commutes with the sign)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    if fp32:
        xf = x.float()
        return (xf * cos + xf.roll(half, -1) * sin).to(x.dtype)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + x.roll(half, -1) * sin


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """RoPE on the first ``rotary_dim`` channels of each head (the tables are ``rotary_dim`` wide), the rest passed
    through, concatenated back as Hugging Face's ``partial_rotary_factor`` models do (tables cast to x's dtype)."""
    return torch.cat((apply_rope(x[..., :rotary_dim], cos, sin, fp32=False), x[..., rotary_dim:]), dim=-1)


def grouped_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Keys and values of fewer heads than ``q`` ([B, Hkv, L, D], kv head j serving query heads j*g .. j*g+g-1) made
    ready for SDPA, and its ``enable_gqa``: on a GPU each kv head is repeated g times, as Hugging Face's SDPA
    attention does (the CUDA kernels that take a mask do not take grouped heads); on the CPU they go as they are with
    ``enable_gqa``, whose kernel gives the same results to the bit with or without a mask (every kernel set:
    tests/test_layers.py) without copying every cached key and value g times a step."""
    g = q.shape[1] // k.shape[1]
    if g == 1:
        return k, v, False
    if q.device.type == "cpu":
        return k, v, True
    return k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), False


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Bidirectional attention. q: [B, Hq, Lq, D]; k, v: [B, Hkv, Lk, D] with Hq a multiple of Hkv (kv head j
    serves query heads j*g .. j*g+g-1: :func:`grouped_kv`); mask: bool [B, 1, 1 or Lq, Lk], True where a key may be
    attended, or None."""
    k, v, gqa = grouped_kv(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


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
        idx = upload(rows, self.k.device, torch.long)
        self.k = self.k.index_select(1, idx)[:, :, :, trim:].contiguous()
        self.v = self.v.index_select(1, idx)[:, :, :, trim:].contiguous()


class LayerKV:
    """How one layer's forward uses the cache: ``fill`` stores the keys/values of whole rows (a full forward at a block
    start) and attends to them as a plain forward would; ``window`` writes the fresh keys/values of the window's valid
    positions (batch row ``bi``, window index ``wi`` -> cache column ``cols[bi, wi]``) and attends to the whole cache
    row (prefix, the fresh window and, for the dual cache, the cached suffix), or to its first ``window[3]`` columns
    when the window tuple has a fourth entry (block-causal loops: no key past the farthest window is visible, and
    leaving them out keeps the keys the reference's own forward has, which bfloat16 attention is sensitive to)."""

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
        bi, wi, cols = self.window[:3]
        rows = bi if self.slots is None else self.slots[bi]
        ck[rows, :, cols] = k[bi, :, wi]
        cv[rows, :, cols] = v[bi, :, wi]
        if len(self.window) > 3:        # attend to the first ``window[3]`` cache columns only
            ck, cv = ck.narrow(2, 0, self.window[3]), cv.narrow(2, 0, self.window[3])
        if self.slots is None:
            return ck, cv
        return ck.index_select(0, self.slots), cv.index_select(0, self.slots)


# ---------------------------------------------------------------- the Qwen-style decoder (Nemotron, Dream, SDAR)
class QKNormAttention(nn.Module):
    """Qwen3-style attention (Nemotron-Diffusion, LLaDA-MoE): q/k/v/o projections (``bias`` on all four), with
    ``qk_norm`` a per-head RMSNorm of q and k before RoPE, rotate-half RoPE with the tables cast to the model dtype on
    the first ``rotary_dim`` channels of each head (default all), bidirectional grouped-query SDPA. Returns the heads'
    output before ``o_proj`` (the layer applies it)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, qk_norm: bool,
                 bias: bool = False, rotary_dim: int | None = None):
        super().__init__()
        d = self.head_dim = head_dim
        self.rotary_dim = rotary_dim if rotary_dim and rotary_dim < d else None
        self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.n_heads, self.n_kv = \
            parallel.attention_projections(hidden, heads, kv_heads, d, bias, bias)      # this rank's heads
        self.q_norm = RMSNorm(d, eps) if qk_norm else None
        self.k_norm = RMSNorm(d, eps) if qk_norm else None

    def rope(self, x, cos, sin):
        if self.rotary_dim is None:
            return apply_rope(x, cos, sin, fp32=False)
        return apply_partial_rope(x, cos, sin, self.rotary_dim)

    def forward(self, x, cos, sin, mask, kv):
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, L, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(B, L, self.n_kv, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q.transpose(1, 2), cos, sin), self.rope(k.transpose(1, 2), cos, sin)
        if kv is not None:
            k, v = kv(k, v)
        return attention(q, k, v, mask).transpose(1, 2).reshape(B, L, -1)


class SwiGLU(nn.Module):
    """The MLP weights ``gate_proj``, ``up_proj``, ``down_proj`` (the layer's dense tail computes it). ``split``:
    the intermediate channels split over tensor-parallel ranks (an MoE expert is whole on its rank instead)."""

    def __init__(self, hidden: int, intermediate: int, split: bool = True):
        super().__init__()
        tp = parallel.current() if split else parallel.Layout()
        local = tp.split(intermediate, "MLP intermediate size")
        self.gate_proj = nn.Linear(hidden, local, bias=False)
        self.up_proj = nn.Linear(hidden, local, bias=False)
        self.down_proj = nn.Linear(local, hidden, bias=False)
        if tp.parallel:
            parallel.swiglu_shards(tp, self.gate_proj, self.up_proj, self.down_proj, intermediate)


class DecoderLayer(nn.Module):
    """``x + o_proj(attn(input_layernorm(x)))``, then ``x + down(silu(gate(h)) * up(h))`` with
    ``h = post_attention_layernorm(x)``; ``attn`` is the family's attention module (it returns the heads' output
    before ``o_proj``, which the dense tail applies)."""

    def __init__(self, hidden: int, intermediate: int, eps: float, attn: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = SwiGLU(hidden, intermediate)
        self.dense = dense_tail          # or a Compiled one (compile_dense)
        self.tp = parallel.current()

    def forward(self, x, cos, sin, mask, kv=None):
        a = self.self_attn(self.input_layernorm(x), cos, sin, mask, kv)
        n, m = self.post_attention_layernorm, self.mlp
        if self.tp.parallel:
            return dense_tail_parallel(self.tp, x, a, self.self_attn.o_proj.weight, n.weight, n.eps,
                                       m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight)
        return self.dense(x, a, self.self_attn.o_proj.weight, n.weight, n.eps, m.gate_proj.weight, m.up_proj.weight,
                          m.down_proj.weight)


class Decoder(nn.Module):
    """``embed_tokens``, the layers, the final ``norm``."""

    def __init__(self, vocab: int, hidden: int, eps: float, layers: list[nn.Module]):
        super().__init__()
        self.embed_tokens = parallel.VocabEmbedding(vocab, hidden)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden, eps)


class DecoderLM(nn.Module):
    """The DiffusionLM interface (worker/models/family.py) over a :class:`Decoder` and a head. A family sets the
    checkpoint's names: ``decoder`` (the Decoder's attribute: "model", or "encoder" for Nemotron) and ``head`` (the
    head's: "lm_head", "diffusion_head"; None when tied to ``embed_tokens``); its ``cfg`` has ``num_layers``,
    ``num_kv_heads``, ``head_dim``, ``rope_theta``, ``max_position_embeddings``."""

    decoder_name = "model"
    head_name: str | None = "lm_head"
    cuda_graphs = True      # no host synchronisation in the forward (worker/engine/graphs.py); False for MoE

    def __init__(self, cfg, decoder: Decoder, head: nn.Linear | None):
        super().__init__()
        self.cfg = cfg
        self.tp = parallel.current()
        self.local_kv_heads = self.tp.kv_heads(cfg.num_kv_heads, cfg.num_heads)[0]
        setattr(self, self.decoder_name, decoder)
        self.head_name = self.head_name if head is not None else None
        if head is not None:
            setattr(self, self.head_name, head)
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None

    @property
    def decoder(self) -> Decoder:
        return getattr(self, self.decoder_name)

    @property
    def max_sequence_length(self) -> int:
        return self.cfg.max_position_embeddings

    @property
    def device(self) -> torch.device:
        return self.decoder.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.decoder.embed_tokens.weight.dtype

    def init_rope(self) -> None:
        dim = getattr(self.cfg, "rotary_dim", None) or self.cfg.head_dim
        self.rope_cos, self.rope_sin = rope_tables(dim, self.cfg.max_position_embeddings, self.cfg.rope_theta,
                                                   self.device)

    def forward(self, ids, pos, mask=None, cache: "KVCache | None" = None, slots=None, window=None):
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        d = self.decoder
        x = d.embed_tokens(ids)
        for i, layer in enumerate(d.layers):
            kv = None if cache is None else LayerKV(cache, i, slots, window)
            x = layer(x, cos, sin, mask, kv)
        return d.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        w = self.decoder.embed_tokens.weight if self.head_name is None else getattr(self, self.head_name).weight
        return parallel.vocab_logits(self.tp, h, w, self.cfg.embedding_size)

    def compile_dense(self):
        """torch.compile the dense half of every layer (eager fallback): see :class:`Compiled`."""
        if no_compile_when_parallel(self):
            return None
        return compile_dense(self.decoder.layers)

    def new_cache(self, slots: int, width: int) -> "KVCache":
        c = self.cfg
        return KVCache(c.num_layers, slots, self.local_kv_heads, width, c.head_dim, self.dtype, self.device)
