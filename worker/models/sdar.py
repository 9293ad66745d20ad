"""SDAR (JetLM/SDAR-1.7B/4B/8B-Chat, ``SDARForCausalLM``): a Qwen3 decoder trained for block diffusion. Attention is
block-causal: a position sees every position of its own block and of the blocks before it, never a later block, so
a finished block's keys/values never change and the KV cache is exact, as in autoregressive serving. The algorithm
(worker/engine/algorithms/sdar.py) passes that mask; the model applies what it is given.

Per layer, as the checkpoint's ``modeling_sdar.py`` computes it: ``h = input_layernorm(x)``; q/k/v projections;
per-head RMSNorm of q and k (``q_norm``/``k_norm``, over head_dim, before RoPE); rotate-half RoPE with float32 tables
cast to the model dtype; grouped-query SDPA with scale ``head_dim ** -0.5``; ``x + o_proj``; then
``x + down(silu(gate(h)) * up(h))`` with ``h = post_attention_layernorm(x)``. Final ``norm`` and ``lm_head`` (logits
read in place: no shift)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import CheckpointError, check_shapes, load_state_dict, read_config
from .family import Family
from .layers import KVCache, LayerKV, RMSNorm, apply_rope, compile_dense, dense_tail, rope_tables


@dataclass(frozen=True)
class SDARConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    attention_bias: bool
    tie_word_embeddings: bool
    block_size: int | None            # the block size it was trained with (the default block_length)

    @property
    def embedding_size(self) -> int:
        return self.vocab_size

    @classmethod
    def from_dict(cls, c: dict) -> "SDARConfig":
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                               "vocab_size") if k not in c]
        if missing:
            raise CheckpointError(f"config.json lacks SDAR fields: {', '.join(missing)}")
        for key in ("use_sliding_window", "rope_scaling"):
            if c.get(key):
                raise CheckpointError(f"unsupported SDAR config: {key}={c[key]!r}")
        if c.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"unsupported SDAR config: hidden_act={c['hidden_act']!r}")
        if c.get("num_experts") or c.get("moe_intermediate_size"):
            raise CheckpointError("SDAR mixture-of-experts checkpoints are not supported yet (dense SDAR only)")
        heads = int(c["num_attention_heads"])
        kv = int(c.get("num_key_value_heads") or heads)
        if heads % kv:
            raise CheckpointError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
        hidden = int(c["hidden_size"])
        return cls(hidden_size=hidden, num_layers=int(c["num_hidden_layers"]), num_heads=heads, num_kv_heads=kv,
                   head_dim=int(c.get("head_dim") or hidden // heads), intermediate_size=int(c["intermediate_size"]),
                   vocab_size=int(c["vocab_size"]), rope_theta=float(c.get("rope_theta", 1e6)),
                   rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                   max_position_embeddings=int(c.get("max_position_embeddings", 32768)),
                   attention_bias=bool(c.get("attention_bias", False)),
                   tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                   block_size=int(c["block_size"]) if c.get("block_size") else None)


class Attention(nn.Module):
    def __init__(self, cfg: SDARConfig):
        super().__init__()
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.scaling = d ** -0.5
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, kv):
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, L, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, L, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin, fp32=False), apply_rope(k, cos, sin, fp32=False)
        if kv is not None:
            k, v = kv(k, v)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=True)
        return a.transpose(1, 2).reshape(B, L, -1)      # o_proj: in the layer's dense tail


class MLP(nn.Module):
    """The SwiGLU weights (the layer's dense tail computes it)."""

    def __init__(self, cfg: SDARConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class Layer(nn.Module):
    def __init__(self, cfg: SDARConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.dense = dense_tail          # or a Compiled one (SDARModel.compile_dense)

    def forward(self, x, cos, sin, mask, kv=None):
        a = self.self_attn(self.input_layernorm(x), cos, sin, mask, kv)
        n, m = self.post_attention_layernorm, self.mlp
        return self.dense(x, a, self.self_attn.o_proj.weight, n.weight, n.eps, m.gate_proj.weight, m.up_proj.weight,
                          m.down_proj.weight)


class Decoder(nn.Module):
    def __init__(self, cfg: SDARConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class SDARModel(nn.Module):
    """The :class:`~worker.models.family.DiffusionLM` interface; the caller's ``mask`` carries the block-causal
    attention."""
    family = "sdar"

    def __init__(self, cfg: SDARConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None

    @property
    def max_sequence_length(self) -> int:
        return self.cfg.max_position_embeddings

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def init_rope(self) -> None:
        self.rope_cos, self.rope_sin = rope_tables(self.cfg.head_dim, self.cfg.max_position_embeddings,
                                                   self.cfg.rope_theta, self.device)

    def forward(self, ids, pos, mask=None, cache: KVCache | None = None, slots=None, window=None):
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        x = self.model.embed_tokens(ids)
        for i, layer in enumerate(self.model.layers):
            kv = None if cache is None else LayerKV(cache, i, slots, window)
            x = layer(x, cos, sin, mask, kv)
        return self.model.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, w)

    def compile_dense(self):
        """torch.compile the dense half of every layer (eager fallback): see layers.Compiled."""
        return compile_dense(self.model.layers)

    def new_cache(self, slots: int, width: int) -> KVCache:
        c = self.cfg
        return KVCache(c.num_layers, slots, c.num_kv_heads, width, c.head_dim, self.dtype, self.device)


def load(path: str | Path, device: torch.device, dtype: torch.dtype) -> SDARModel:
    cfg = SDARConfig.from_dict(read_config(path))
    with torch.device("meta"):
        model = SDARModel(cfg)
    names = dict(model.named_parameters())
    check_shapes(path, {n: tuple(p.shape) for n, p in names.items()}, "SDAR")
    sd = load_state_dict(path, {n: n for n in names}, dtype, device)
    model.load_state_dict(sd, strict=True, assign=True)
    model.init_rope()
    return model.eval().requires_grad_(False)


FAMILY = Family(name="sdar", title="SDAR (SDARForCausalLM)", architectures=("SDARForCausalLM",), model_types=("sdar",),
                tensors=("model.layers.0.self_attn.q_norm.weight", "lm_head.weight"), load=load,
                default_algorithm="sdar")
