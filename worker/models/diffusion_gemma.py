"""DiffusionGemma (google/diffusiongemma-26B-A4B-it, ``DiffusionGemmaForBlockDiffusion``): a Gemma 4 mixture-of-experts
text stack used twice. As a causal **encoder** it reads the prompt, then each finished canvas, into the KV cache; as a
bidirectional **decoder** it denoises the next ``canvas_length`` tokens, attending to the cached context and to the
canvas, without writing the cache. The two share every weight except the per-layer ``layer_scalar``, which the
checkpoint stores twice. The arithmetic below is the reference's (transformers' ``modeling_diffusion_gemma.py``) op
for op; docs/diffusion_gemma.md lists it with its pitfalls. The decoding loop is worker/engine/algorithms/
diffusion_gemma.py.

Per layer (``x``: the residual stream): ``a = post_attention_layernorm(attn(input_layernorm(x)))``, ``r = x + a``;
the feed-forward runs a dense GELU-tanh MLP on ``pre_feedforward_layernorm(r)`` and, in parallel, the experts on
``pre_feedforward_layernorm_2(r)`` routed from ``r`` itself (a scale-less RMSNorm, ``router.scale``, ``H ** -0.5``,
a float32 softmax, the top ``top_k_experts`` renormalised and times ``per_expert_scale``); each branch has its own
post-norm, their sum another; ``x = (r + ffn) * layer_scalar``. Attention: q/k per-head RMSNorm (the weight used as
is), values a scale-less RMSNorm of ``v_proj`` on sliding layers and of the *raw key projection* on full layers (they
have no ``v_proj``), rotate-half RoPE with tables cast to the model dtype (sliding layers: ``head_dim``, theta 1e4;
full layers: ``global_head_dim``, proportional: the first ``partial_rotary_factor`` of the frequencies rotate, their
exponent over the whole head dim), attention scale 1.0. Sliding layers see the last ``sliding_window - 1`` cached
positions (the encoder also masks its own keys to the window); the decoder sees them all at once, no window inside.
Logits: the final norm, the tied embedding, then ``30 * tanh(logits / 30)`` in float32. The decoder's input is
``post_norm(embed(canvas) + mlp(pre_norm(softmax(previous logits) @ E * sqrt(H))))`` (self-conditioning; zeros on a
canvas's first step). The vision tower is in the checkpoint and is not loaded: text only."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from . import parallel
from .checkpoint import CheckpointError, generation_defaults, load_native
from .family import Family
from .layers import SwiGLU, grouped_kv, rotate_half, upload

SOFTCAP_DEFAULT = 30.0


@dataclass(frozen=True)
class DiffusionGemmaConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    sliding: tuple[bool, ...]            # per layer: a sliding-window layer (else full attention)
    head_dims: tuple[int, ...]           # per layer
    kv_heads: tuple[int, ...]            # per layer
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k_experts: int
    vocab_size: int
    sliding_window: int
    sliding_theta: float
    full_theta: float
    full_rotary_factor: float
    softcap: float | None
    rms_norm_eps: float
    max_position_embeddings: int
    canvas_length: int

    @property
    def embedding_size(self) -> int:
        return self.vocab_size

    @property
    def block_size(self) -> int:
        """The canvas: what a request's ``block_length`` is for this family (Engine.default_block_length)."""
        return self.canvas_length

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "DiffusionGemmaConfig":
        """Through transformers' own config class (it resolves ``per_layer_config`` and ``global_head_dim``, the
        default layer pattern and the last layer forced to full attention)."""
        from transformers import AutoConfig
        try:
            c = AutoConfig.from_pretrained(str(path))
        except Exception as e:      # noqa: BLE001  (any parse failure is a bad checkpoint, in one line)
            raise CheckpointError(f"{str(path)!r}: config.json is not a DiffusionGemma config ({e})")
        t = getattr(c, "text_config", None)
        if t is None or getattr(c, "canvas_length", None) is None:
            raise CheckpointError(f"{str(path)!r}: config.json lacks DiffusionGemma's text_config or canvas_length")
        if t.use_bidirectional_attention == "all":
            raise CheckpointError("unsupported DiffusionGemma config: use_bidirectional_attention='all' (a "
                                  "bidirectional encoder); this server serves the causal prompt encoder")
        if t.hidden_activation != "gelu_pytorch_tanh":
            raise CheckpointError(f"unsupported DiffusionGemma config: hidden_activation={t.hidden_activation!r}")
        if t.attention_bias:
            raise CheckpointError("unsupported DiffusionGemma config: attention_bias=true")
        types = list(t.layer_types)
        rope = t.rope_parameters
        for kind, want in (("sliding_attention", "default"), ("full_attention", "proportional")):
            got = (rope.get(kind) or {}).get("rope_type")
            if kind in types and got != want:
                raise CheckpointError(f"unsupported DiffusionGemma config: rope_type {got!r} for {kind} layers")
            if kind in types and (rope.get(kind) or {}).get("factor", 1.0) != 1.0:
                raise CheckpointError(f"unsupported DiffusionGemma config: a RoPE factor for {kind} layers")
        n = int(t.num_hidden_layers)
        heads = int(t.num_attention_heads)
        dims = tuple(int(t.per_layer_config[i].head_dim) for i in range(n))
        kvh = tuple(int(t.per_layer_config[i].num_key_value_heads) for i in range(n))
        if any(heads % k for k in kvh):
            raise CheckpointError(f"num_attention_heads={heads} is not a multiple of every layer's kv heads {kvh}")
        full = rope.get("full_attention") or {}
        return cls(hidden_size=int(t.hidden_size), num_layers=n, num_heads=heads,
                   sliding=tuple(x == "sliding_attention" for x in types), head_dims=dims, kv_heads=kvh,
                   intermediate_size=int(t.intermediate_size), moe_intermediate_size=int(t.moe_intermediate_size),
                   num_experts=int(t.num_experts), top_k_experts=int(t.top_k_experts),
                   vocab_size=int(t.vocab_size), sliding_window=int(t.sliding_window),
                   sliding_theta=float((rope.get("sliding_attention") or {}).get("rope_theta", 10000.0)),
                   full_theta=float(full.get("rope_theta", 1e6)),
                   full_rotary_factor=float(full.get("partial_rotary_factor", 1.0)),
                   softcap=t.final_logit_softcapping, rms_norm_eps=float(t.rms_norm_eps),
                   max_position_embeddings=int(t.max_position_embeddings), canvas_length=int(c.canvas_length))


# ---------------------------------------------------------------- building blocks
def rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """DiffusionGemma's RMSNorm: in float32 with ``pow(mean + eps, -0.5)``, the weight (if any) as is, cast back."""
    xf = x.float()
    y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        y = y * weight.float()
    return y.type_as(x)


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float, scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms(x, self.weight, self.eps)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def rope(inv_freq: torch.Tensor, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, T, 2 * len(inv_freq)] at positions ``pos`` [B, T], computed per call as the reference does
    (float32, then cast): a precomputed table would give the same products but not always the same cos/sin, whose
    vectorised and scalar paths differ in the last bit depending on the tensor's length."""
    freqs = pos.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def inv_freq_default(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def inv_freq_proportional(dim: int, theta: float, factor: float) -> torch.Tensor:
    angles = int(factor * dim // 2)
    rotated = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / dim))
    rest = dim // 2 - angles
    return torch.cat((rotated, torch.zeros(rest, dtype=torch.float32))) if rest > 0 else rotated


class Attention(nn.Module):
    """``q_proj``, ``k_proj``, ``v_proj`` (sliding layers only), ``o_proj``, ``q_norm``, ``k_norm``."""

    def __init__(self, cfg: DiffusionGemmaConfig, i: int):
        super().__init__()
        d = self.d = cfg.head_dims[i]
        self.tp, self.eps = parallel.current(), cfg.rms_norm_eps
        self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.heads, self.kv = parallel.attention_projections(
            cfg.hidden_size, cfg.num_heads, cfg.kv_heads[i], d, values=cfg.sliding[i])      # this rank's heads
        self.q_norm = Norm(d, cfg.rms_norm_eps)
        self.k_norm = Norm(d, cfg.rms_norm_eps)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [B, heads, T, d], k and v [B, kv, T, d] (rotated keys, normalised values); cos/sin [B, T, d]."""
        B, T, _ = x.shape
        c, s = cos[:, :, None], sin[:, :, None]
        q = self.q_norm(self.q_proj(x).view(B, T, -1, self.d))
        q = (q * c + rotate_half(q) * s).transpose(1, 2)
        k_raw = self.k_proj(x).view(B, T, -1, self.d)
        v = k_raw if self.v_proj is None else self.v_proj(x).view(B, T, -1, self.d)
        k = self.k_norm(k_raw)
        k = (k * c + rotate_half(k) * s).transpose(1, 2)
        v = rms(v, None, self.eps).transpose(1, 2)
        return q, k, v

    def attend(self, q, k, v, mask: torch.Tensor | None) -> torch.Tensor:
        """SDPA with scale 1.0 as the reference calls it: grouped-query by ``enable_gqa`` without a mask, by repeating
        the kv heads with one (transformers' sdpa_attention_forward; on the CPU by ``enable_gqa`` too, the same
        results: :func:`~worker.models.layers.grouped_kv`); then ``o_proj``."""
        B, _, T, _ = q.shape
        if mask is None:
            a = F.scaled_dot_product_attention(q, k, v, scale=1.0, enable_gqa=self.heads > self.kv)
        else:
            k, v, gqa = grouped_kv(q, k, v)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=gqa)
        return parallel.row_linear(self.tp, a.transpose(1, 2).reshape(B, T, -1), self.o_proj)


class MLP(SwiGLU):
    """The gated MLP's weights with GELU-tanh; with tensor parallelism its channels split and :meth:`forward` this
    rank's share."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """``router.proj.weight`` [E, H], ``router.scale`` [H], ``router.per_expert_scale`` [E]."""

    def __init__(self, cfg: DiffusionGemmaConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))
        self.k, self.eps, self.root = cfg.top_k_experts, cfg.rms_norm_eps, cfg.hidden_size ** -0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 weights [T, k], expert ids [T, k]) for tokens x [T, H]."""
        z = rms(x, None, self.eps) * self.scale * self.root
        p = F.softmax(self.proj(z), dim=-1, dtype=torch.float32)
        w, idx = torch.topk(p, k=self.k, dim=-1)
        w /= w.sum(dim=-1, keepdim=True)
        return w * self.per_expert_scale[idx], idx


class Experts(nn.Module):
    """``experts.gate_up_proj`` [E, 2 I, H] (gate rows first) and ``experts.down_proj`` [E, H, I]. The (token,
    expert) pairs are sorted by expert and run through ``torch.nn.functional.grouped_mm`` (each expert's rows against
    its weights, in one call and with no host sync, as transformers' default ``grouped_mm`` experts do; its numbers
    differ in the last bits from one matmul per expert), the weighted outputs summed over each token's choices in
    float32, in top-k order. Where the torch build has no ``grouped_mm``: one matmul per expert."""

    def __init__(self, cfg: DiffusionGemmaConfig):
        super().__init__()
        E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        tp = parallel.current()
        local = tp.split(E, "experts")         # expert parallelism: this rank's experts, whole
        self.first, self.total = tp.rank * local, E
        self.gate_up_proj = nn.Parameter(torch.empty(local, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(local, H, I))
        if tp.parallel:
            parallel.mark(self.gate_up_proj, 0, E, [(self.first, local)])
            parallel.mark(self.down_proj, 0, E, [(self.first, local)])

    def forward(self, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The weighted sum over each token's experts; with expert parallelism over this rank's experts only."""
        T, k = idx.shape
        E = self.gate_up_proj.shape[0]
        ids, perm = torch.sort(idx.reshape(-1))
        if E != self.total:       # the pairs of this rank's experts: a contiguous run of the sorted pairs
            a, b = torch.searchsorted(ids, upload([self.first, self.first + E], ids.device)).tolist()
            out = x.new_zeros((T * k, x.shape[-1]))
            out[a:b] = self.run(x[perm[a:b] // k], ids[a:b] - self.first)
        else:
            out = self.run(x[perm // k], ids)
        weighted = out * w.reshape(-1)[perm][:, None]
        back = torch.empty_like(weighted)
        back[perm] = weighted
        return back.view(T, k, -1).sum(dim=1).to(x.dtype)

    def run(self, xs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``xs`` through experts ``ids`` (ascending, this rank's numbering)."""
        E = self.gate_up_proj.shape[0]
        if hasattr(F, "grouped_mm"):
            # histc, as the reference: fixed bins, so no device-to-host sync (bincount sizes its output on the host)
            counts = torch.histc(ids.float() if ids.device.type == "cpu" else ids.int(), bins=E, min=0, max=E - 1)
            offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
            gate, up = F.grouped_mm(xs, self.gate_up_proj.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
            out = F.grouped_mm(gelu_tanh(gate) * up, self.down_proj.transpose(-2, -1), offs=offs)
        else:
            out = torch.empty_like(xs)
            start = 0
            for e, n in enumerate(torch.bincount(ids, minlength=E).tolist()):
                if n:
                    gate, up = F.linear(xs[start:start + n], self.gate_up_proj[e]).chunk(2, dim=-1)
                    out[start:start + n] = F.linear(gelu_tanh(gate) * up, self.down_proj[e])
                    start += n
        return out


class Layer(nn.Module):
    def __init__(self, cfg: DiffusionGemmaConfig, i: int):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, i)
        self.mlp = MLP(H, cfg.intermediate_size)
        self.input_layernorm = Norm(H, eps)
        self.post_attention_layernorm = Norm(H, eps)
        self.pre_feedforward_layernorm = Norm(H, eps)
        self.post_feedforward_layernorm = Norm(H, eps)
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        self.post_feedforward_layernorm_1 = Norm(H, eps)
        self.post_feedforward_layernorm_2 = Norm(H, eps)
        self.pre_feedforward_layernorm_2 = Norm(H, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))      # the decoder's; the encoder's is apart (Scalars)
        self.tp = parallel.current()

    def feed_forward(self, r: torch.Tensor, scalar: torch.Tensor) -> torch.Tensor:
        h1 = self.mlp(self.pre_feedforward_layernorm(r))
        flat = r.reshape(-1, r.shape[-1])
        w, idx = self.router(flat)
        h2 = self.experts(self.pre_feedforward_layernorm_2(flat), w, idx).reshape(r.shape)
        if self.tp.parallel:        # both branches' shares summed over the ranks in one all-reduce
            h1, h2 = self.tp.reduce(torch.stack([h1, h2])).unbind(0)
        h1 = self.post_feedforward_layernorm_1(h1)
        h2 = self.post_feedforward_layernorm_2(h2)
        return (r + self.post_feedforward_layernorm(h1 + h2)) * scalar


class SelfConditioning(nn.Module):
    def __init__(self, cfg: DiffusionGemmaConfig):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_norm = Norm(H, eps)
        self.post_norm = Norm(H, eps, scale=False)
        mlp = MLP(H, cfg.intermediate_size)          # (its weights are this module's own in the checkpoint)
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.tp = parallel.current()

    def forward(self, e: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
        n = self.pre_norm(soft)
        return self.post_norm(e + self.tp.reduce(self.down_proj(gelu_tanh(self.gate_proj(n)) * self.up_proj(n))))


class Stack(nn.Module):
    """``model.decoder``: the shared weights (embeddings, layers, final norm) and self-conditioning."""

    def __init__(self, cfg: DiffusionGemmaConfig):
        super().__init__()
        self.embed_tokens = parallel.VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = Norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_conditioning = SelfConditioning(cfg)


class Scalars(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_scalar = nn.Parameter(torch.ones(1))


class EncoderLM(nn.Module):
    """``model.encoder.language_model``: only its ``layer_scalar`` copies are its own."""

    def __init__(self, cfg: DiffusionGemmaConfig):
        super().__init__()
        self.layers = nn.ModuleList(Scalars() for _ in range(cfg.num_layers))


class Encoder(nn.Module):
    def __init__(self, cfg: DiffusionGemmaConfig):
        super().__init__()
        self.language_model = EncoderLM(cfg)


class Inner(nn.Module):
    def __init__(self, cfg: DiffusionGemmaConfig):
        super().__init__()
        self.decoder = Stack(cfg)
        self.encoder = Encoder(cfg)


# ---------------------------------------------------------------- the KV cache
class ContextCache:
    """Every row's encoded context, per layer, in batch slots. Full-attention layers keep every position,
    left-aligned (row ``s`` holds ``length[s]`` columns); sliding layers keep the last ``sliding_window - 1``
    positions right-aligned in a buffer of that width (what the reference's sliding cache keeps), so a step reads
    contiguous keys in position order, as the reference's concatenation does."""

    def __init__(self, cfg: DiffusionGemmaConfig, slots: int, width: int, dtype, device, kv_heads: list[int]):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.window = cfg.sliding_window - 1
        self.length = [0] * slots
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for i in range(cfg.num_layers):
            w = self.window if cfg.sliding[i] else width
            shape = (slots, kv_heads[i], w, cfg.head_dims[i])      # this rank's kv heads
            self.k.append(torch.zeros(shape, dtype=dtype, device=device))
            self.v.append(torch.zeros(shape, dtype=dtype, device=device))

    @property
    def slots(self) -> int:
        return len(self.length)

    def ensure(self, width: int) -> None:
        """Full layers at least ``width`` columns wide (grown by half again at least, so growth is rare)."""
        for i in range(self.cfg.num_layers):
            if self.cfg.sliding[i] or self.k[i].shape[2] >= width:
                continue
            S, h, W, d = self.k[i].shape
            new = max(width, W + W // 2)
            for store in (self.k, self.v):
                t = store[i].new_zeros((S, h, new, d))
                t[:, :, :W] = store[i]
                store[i] = t

    def add_slots(self, n: int) -> None:
        self.length += [0] * n
        for store in (self.k, self.v):
            for i, t in enumerate(store):
                store[i] = torch.cat([t, t.new_zeros((n,) + tuple(t.shape[1:]))])

    def with_new(self, i: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int):
        """Layer ``i``'s keys and values for rows ``slots``: their last ``n`` cached columns (sliding layers) or first
        ``n`` (full layers), then the new ``k``/``v``, concatenated as the reference does. ``slots`` None: every slot,
        in order (no gather: the one copy is the concatenation's)."""
        ck, cv = (self.k[i], self.v[i]) if slots is None else (self.k[i][slots], self.v[i][slots])
        if self.cfg.sliding[i]:
            ck, cv = ck[:, :, self.window - n:], cv[:, :, self.window - n:]
        else:
            ck, cv = ck[:, :, :n], cv[:, :, :n]
        return torch.cat([ck, k], dim=2), torch.cat([cv, v], dim=2)

    def seed(self, slot: int, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> None:
        """Give an empty slot the context whose every layer's keys/values are ``ks[i]``/``vs[i]`` [kv heads, n,
        head dim] (positions 0..n-1, the prefix cache's blocks): full layers keep them all, sliding layers the last
        ``sliding_window - 1``, as encoding those positions would have left them."""
        n = ks[0].shape[1]
        self.ensure(n)
        for i in range(self.cfg.num_layers):
            if self.cfg.sliding[i]:
                m = min(n, self.window)
                self.k[i][slot, :, self.window - m:] = ks[i][:, n - m:]
                self.v[i][slot, :, self.window - m:] = vs[i][:, n - m:]
            else:
                self.k[i][slot, :, :n] = ks[i]
                self.v[i][slot, :, :n] = vs[i]
        self.length[slot] = n

    def keep(self, rows: list[int]) -> None:
        idx = upload(rows, self.device, torch.long)
        self.length = [self.length[r] for r in rows]
        for store in (self.k, self.v):
            for i, t in enumerate(store):
                store[i] = t.index_select(0, idx)


# ---------------------------------------------------------------- the model
class DiffusionGemmaModel(nn.Module):
    """:meth:`encode` appends tokens to rows' contexts; :meth:`denoise` gives a canvas's float32 soft-capped logits
    (worker/engine/algorithms/diffusion_gemma.py drives them)."""
    family = "diffusion_gemma"

    @property
    def cuda_graphs(self) -> bool:
        """Whether :meth:`decoder_hidden` can be replayed from CUDA graphs (worker/engine/graphs.py): its experts'
        ``grouped_mm`` counts their tokens on the device in bfloat16 on CUDA (compared with the eager pass on an
        H100: the same tokens, docs/engine.md) and on the CPU (the tests' simulated graphs); in float32 on CUDA
        torch's ``grouped_mm`` fallback reads the group offsets on the host."""
        return hasattr(F, "grouped_mm") and (self.device.type != "cuda" or self.dtype == torch.bfloat16)

    def __init__(self, cfg: DiffusionGemmaConfig):
        super().__init__()
        self.cfg = cfg
        self.tp = parallel.current()
        self.model = Inner(cfg)
        self.inv_freq: dict[bool, torch.Tensor] = {}      # per layer kind (sliding or not)
        self._scale = None                                  # embed_scale's ((dtype, device), tensor)

    @property
    def stack(self) -> Stack:
        return self.model.decoder

    @property
    def max_sequence_length(self) -> int:
        return self.cfg.max_position_embeddings

    @property
    def device(self) -> torch.device:
        return self.stack.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.stack.embed_tokens.weight.dtype

    def init_rope(self) -> None:
        c = self.cfg
        if any(c.sliding):
            self.inv_freq[True] = inv_freq_default(c.head_dims[c.sliding.index(True)], c.sliding_theta)
        if not all(c.sliding):
            d = c.head_dims[c.sliding.index(False)]
            self.inv_freq[False] = inv_freq_proportional(d, c.full_theta, c.full_rotary_factor)
        self.inv_freq = {k: v.to(self.device) for k, v in self.inv_freq.items()}

    def compile_dense(self):
        """Nothing to compile: every layer routes tokens to experts data-dependently (eager)."""
        return None

    def new_cache(self, slots: int, width: int) -> ContextCache:
        return ContextCache(self.cfg, slots, width, self.dtype, self.device,
                            [layer.self_attn.kv for layer in self.stack.layers])

    @property
    def embed_scale(self) -> torch.Tensor:
        """sqrt(H) as the reference's float32 buffer, cast to the weights' dtype (53.066 -> 53.0 in bfloat16), on
        the weights' device; made once per dtype and device (no host-to-device copy in a step)."""
        key = (self.dtype, self.device)
        if self._scale is None or self._scale[0] != key:
            self._scale = (key, torch.tensor(self.cfg.hidden_size ** 0.5, dtype=torch.float32).to(self.dtype)
                           .to(self.device))
        return self._scale[1]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.stack.embed_tokens(ids) * self.embed_scale

    def _cos_sin(self, pos: torch.Tensor) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        return {k: rope(f, pos, self.dtype) for k, f in self.inv_freq.items()}

    @torch.inference_mode()
    def encode(self, ids: torch.Tensor, lengths: list[int], cache: ContextCache, slots: list[int],
               capture: list | None = None) -> None:
        """Append each row's ``ids[b, :lengths[b]]`` (right-padded [B, T]) to its context in cache slot
        ``slots[b]``: the causal encoder (sliding layers within the window), keys/values stored, nothing returned.
        ``capture``: a list that receives every layer's new keys and values ([B, kv heads, T, head dim] each, layer
        by layer: the prefix cache stores prompt blocks from them)."""
        B, T = ids.shape
        dev = ids.device
        cfg = self.cfg
        start = [cache.length[s] for s in slots]
        ar = torch.arange(T, device=dev)
        st = upload(start, dev)
        ln = upload(lengths, dev)
        # padding repeats the row's last position
        pos = torch.minimum(st[:, None] + ar[None, :], (st + ln - 1)[:, None])
        rope = self._cos_sin(pos)
        slot_idx = upload(slots, dev)
        every = None if slots == list(range(cache.slots)) else slot_idx     # with_new's rows (None: all, in order)
        n_full = max(start)
        m = [min(s, cache.window) for s in start]
        n_slide = max(m)
        cache.ensure(max(s + n for s, n in zip(start, lengths)))
        qpos = pos                                                  # [B, T]
        new_valid = ar[None, :] < ln[:, None]                       # [B, T]
        causal = (ar[None, :, None] >= ar[None, None, :]) & new_valid[:, None, :]      # [B, Tq, Tk]
        # full layers: [cached 0..n_full) ; new]
        if n_full:
            old_valid = torch.arange(n_full, device=dev)[None, :] < st[:, None]        # [B, n_full]
            full_mask = torch.cat([old_valid[:, None, :].expand(B, T, n_full), causal], dim=2)[:, None]
        else:
            full_mask = causal[:, None]
        # sliding layers: [last n_slide cached ; new], window on absolute positions
        if n_slide:
            mt = upload(m, dev)
            j = torch.arange(n_slide, device=dev)
            old_pos = st[:, None] - n_slide + j[None, :]                               # [B, n_slide]
            old_ok = j[None, :] >= (n_slide - mt)[:, None]
            old_win = old_ok[:, None, :] & (old_pos[:, None, :] > qpos[:, :, None] - cfg.sliding_window)
            slide_mask = torch.cat([old_win, causal & (qpos[:, None, :] > qpos[:, :, None] - cfg.sliding_window)],
                                   dim=2)[:, None]
        else:
            slide_mask = (causal & (qpos[:, None, :] > qpos[:, :, None] - cfg.sliding_window))[:, None]
        x = self.embed(ids)
        scalars = self.model.encoder.language_model.layers
        # the new valid positions (row, index) and where full layers keep them (slot, column): known on the host
        bi, ti, to_slot, to_col = upload([[b for b, n in enumerate(lengths) for _ in range(n)],
                                          [t for n in lengths for t in range(n)],
                                          [slots[b] for b, n in enumerate(lengths) for _ in range(n)],
                                          [start[b] + t for b, n in enumerate(lengths) for t in range(n)]], dev)
        for i, layer in enumerate(self.stack.layers):
            sl = cfg.sliding[i]
            cos, sin = rope[sl]
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(x), cos, sin)
            if capture is not None:
                capture.append((k, v))
            ck, cv = cache.k[i], cache.v[i]
            kk, vv = cache.with_new(i, every, k, v, n_slide if sl else n_full)
            a = attn.attend(q, kk, vv, slide_mask if sl else full_mask)
            if sl:
                # keep the last window-1 positions of [cached ; new valid]
                both_k = torch.cat([ck[slot_idx], k], dim=2)
                both_v = torch.cat([cv[slot_idx], v], dim=2)
                if all(n == lengths[0] for n in lengths):
                    ck[slot_idx] = both_k[:, :, lengths[0]:lengths[0] + cache.window]
                    cv[slot_idx] = both_v[:, :, lengths[0]:lengths[0] + cache.window]
                else:
                    cols = (ln[:, None] + torch.arange(cache.window, device=dev)[None, :])           # [B, W-1]
                    gi = cols[:, None, :, None].expand(B, k.shape[1], cache.window, k.shape[3])
                    ck[slot_idx] = both_k.gather(2, gi)
                    cv[slot_idx] = both_v.gather(2, gi)
            else:
                ck[to_slot, :, to_col] = k[bi, :, ti]
                cv[to_slot, :, to_col] = v[bi, :, ti]
            r = x + layer.post_attention_layernorm(a)
            if i + 1 < cfg.num_layers:          # the last layer's FFN feeds nothing the cache keeps
                x = layer.feed_forward(r, scalars[i].layer_scalar)
        for s, n in zip(slots, lengths):
            cache.length[s] += n

    @torch.inference_mode()
    def denoise(self, canvas: torch.Tensor, sc_logits: torch.Tensor | None, sc_rows: list[int], cache: ContextCache,
                slots: list[int]) -> torch.Tensor:
        """Float32 soft-capped logits [B, L, V] of canvases [B, L] over rows' contexts (read, not written).
        Self-conditioning: ``sc_logits`` [len(sc_rows), L, V], the previous step's logits of the rows ``sc_rows`` (batch
        indices) in the embedding dtype (temperature-scaled, as the reference passes them); the other rows are at a
        canvas's first step and get zeros."""
        B, L = canvas.shape
        dev = canvas.device
        cfg = self.cfg
        start = [cache.length[s] for s in slots]
        st = upload(start, dev)
        slot_idx = None if slots == list(range(cache.slots)) else upload(slots, dev)    # None: every slot, in order
        n_full = max(start)
        m = [min(s, cache.window) for s in start]
        n_slide = max(m)
        full_mask = slide_mask = None
        if len(set(start)) > 1:
            ok = torch.arange(n_full, device=dev)[None, :] < st[:, None]
            full_mask = torch.cat([ok, ok.new_ones(B, L)], dim=1)[:, None, None, :]
        if len(set(m)) > 1:
            mt = upload(m, dev)
            ok = torch.arange(n_slide, device=dev)[None, :] >= (n_slide - mt)[:, None]
            slide_mask = torch.cat([ok, ok.new_ones(B, L)], dim=1)[:, None, None, :]
        W = self.stack.embed_tokens.weight
        soft = torch.zeros((B, L, cfg.hidden_size), dtype=self.dtype, device=dev)     # embed(canvas)'s shape
        if sc_rows:
            p = sc_logits.softmax(dim=-1, dtype=torch.float32).to(W.dtype)
            if W.shape[0] != cfg.vocab_size:       # a vocabulary shard: this rank's rows, summed over the ranks
                first = self.stack.embed_tokens.first
                p = p[..., first:first + W.shape[0]]
            s = self.tp.reduce(torch.matmul(p, W)) * self.embed_scale
            if len(sc_rows) == B:
                soft = s
            else:
                soft[upload(sc_rows, dev)] = s
        h = self.decoder_hidden(canvas, soft, st, slot_idx, full_mask, slide_mask, n_full, n_slide, cache)
        logits = parallel.vocab_logits(self.tp, h, W, cfg.vocab_size).to(torch.float32)
        if cfg.softcap:
            logits = logits.div_(cfg.softcap).tanh_().mul_(cfg.softcap)     # tanh(l / c) * c, in place
        return logits


    def decoder_hidden(self, canvas: torch.Tensor, soft: torch.Tensor, st: torch.Tensor, slot_idx: torch.Tensor | None,
                       full_mask: torch.Tensor | None, slide_mask: torch.Tensor | None, n_full: int, n_slide: int,
                       cache: ContextCache) -> torch.Tensor:
        """:meth:`denoise`'s decoder pass: hidden states [B, L, H] after the final norm, of canvases [B, L] with
        self-conditioning input ``soft`` [B, L, H], over the contexts of cache slots ``slot_idx`` (``st``: their
        lengths; the last ``n_slide`` / first ``n_full`` cached columns, with key masks where rows differ). A function
        of these tensors and ints only, with no host synchronisation: what a CUDA graph replays
        (worker/engine/graphs.py GraphedDecoder)."""
        cfg = self.cfg
        pos = st[:, None] + torch.arange(canvas.shape[1], device=canvas.device)[None, :]
        rope = self._cos_sin(pos)
        x = self.stack.self_conditioning(self.embed(canvas), soft)
        for i, layer in enumerate(self.stack.layers):
            sl = cfg.sliding[i]
            cos, sin = rope[sl]
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(x), cos, sin)
            kk, vv = cache.with_new(i, slot_idx, k, v, n_slide if sl else n_full)
            a = attn.attend(q, kk, vv, slide_mask if sl else full_mask)
            x = layer.feed_forward(x + layer.post_attention_layernorm(a), layer.layer_scalar)
        return self.stack.norm(x)


def algorithm_defaults(path: str | Path) -> dict[str, dict]:
    """The checkpoint's generation_config.json settings of the ``diffusion_gemma`` algorithm (as the reference's
    ``generate`` takes them, over its global defaults): max_denoising_steps, t_min, t_max, stability_threshold,
    confidence_threshold and ``sampler_config.entropy_bound``."""
    g = generation_defaults(path)
    out = {k: g[k] for k in ("max_denoising_steps", "t_min", "t_max", "stability_threshold", "confidence_threshold")
           if g.get(k) is not None}
    sampler = g.get("sampler_config")
    if isinstance(sampler, dict) and sampler.get("entropy_bound") is not None:
        out["entropy_bound"] = sampler["entropy_bound"]
    return {"diffusion_gemma": out}


def load(path: str | Path, device: torch.device, dtype: torch.dtype) -> DiffusionGemmaModel:
    cfg = DiffusionGemmaConfig.from_pretrained(path)
    return load_native(path, lambda: DiffusionGemmaModel(cfg), "DiffusionGemma", device, dtype)


FAMILY = Family(name="diffusion_gemma", title="DiffusionGemma (DiffusionGemmaForBlockDiffusion)",
                architectures=("DiffusionGemmaForBlockDiffusion",), model_types=("diffusion_gemma",),
                tensors=("model.decoder.self_conditioning.gate_proj.weight",
                         "model.decoder.layers.0.router.per_expert_scale"),
                load=load, default_algorithm="diffusion_gemma", algorithms=("diffusion_gemma",), mask_token=False,
                algorithm_defaults=algorithm_defaults, prefix_cache=True)
