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

from .checkpoint import CheckpointError, load_native, read_config
from . import parallel
from .family import Family
from .layers import Decoder, DecoderLayer, DecoderLM, RMSNorm, apply_rope


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
        d = self.head_dim = cfg.head_dim
        self.scaling = d ** -0.5
        self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.n_heads, self.n_kv = \
            parallel.attention_projections(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, d, cfg.attention_bias)
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


class SDARModel(DecoderLM):
    """The :class:`~worker.models.family.DiffusionLM` interface; the caller's ``mask`` carries the block-causal
    attention."""
    family = "sdar"

    def __init__(self, cfg: SDARConfig):
        layers = [DecoderLayer(cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps, Attention(cfg))
                  for _ in range(cfg.num_layers)]
        super().__init__(cfg, Decoder(cfg.vocab_size, cfg.hidden_size, cfg.rms_norm_eps, layers),
                         None if cfg.tie_word_embeddings else parallel.head(cfg.hidden_size, cfg.vocab_size))


def load(path: str | Path, device: torch.device, dtype: torch.dtype) -> SDARModel:
    cfg = SDARConfig.from_dict(read_config(path))
    return load_native(path, lambda: SDARModel(cfg), "SDAR", device, dtype)


FAMILY = Family(name="sdar", title="SDAR (SDARForCausalLM)", architectures=("SDARForCausalLM",), model_types=("sdar",),
                tensors=("model.layers.0.self_attn.q_norm.weight", "lm_head.weight"), load=load,
                default_algorithm="sdar", algorithms=("sdar",), prefix_cache=True)
