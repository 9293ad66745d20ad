"""Dream (Dream-org/Dream-v0-Instruct-7B / -Base-7B, apple/DiffuCoder-7B: ``DreamModel``): a Qwen2.5 decoder stack
used as a bidirectional mask predictor whose logits are *shifted*: the token at position j is read from the logits
of position j - 1 (the decoding algorithms do the shift: worker/engine/algorithms/dream.py). Layout and settings of
the test checkpoint: tests/fixtures/README.md (tiny-dream).

Per layer, as Fast-dLLM's ``dream/model/modeling_dream.py`` computes it: ``h = input_layernorm(x)``; q/k/v
projections with biases; rotate-half RoPE with float32 tables cast to the model dtype; grouped-query attention (SDPA,
no mask between real tokens); ``x + o_proj``; then ``x + down(silu(gate(h)) * up(h))`` with
``h = post_attention_layernorm(x)``. Final ``norm`` and ``lm_head`` (tied to ``embed_tokens`` when
``tie_word_embeddings``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .checkpoint import CheckpointError, load_native, read_config, tensor_shapes
from . import parallel
from .family import Family
from .layers import Decoder, DecoderLayer, DecoderLM, apply_rope, attention


@dataclass(frozen=True)
class DreamConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    mask_token_id: int | None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def embedding_size(self) -> int:
        return self.vocab_size

    @classmethod
    def from_dict(cls, c: dict) -> "DreamConfig":
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                               "vocab_size") if k not in c]
        if missing:
            raise CheckpointError(f"config.json lacks Dream fields: {', '.join(missing)}")
        if c.get("use_sliding_window"):
            raise CheckpointError("unsupported Dream config: use_sliding_window=true")
        if c.get("rope_scaling"):
            raise CheckpointError(f"unsupported Dream config: rope_scaling={c['rope_scaling']!r}")
        if c.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"unsupported Dream config: hidden_act={c['hidden_act']!r}")
        heads = int(c["num_attention_heads"])
        kv = int(c.get("num_key_value_heads") or heads)
        hidden = int(c["hidden_size"])
        if heads % kv or hidden % heads:
            raise CheckpointError(f"unsupported Dream head layout: hidden_size={hidden}, num_attention_heads={heads}, "
                                  f"num_key_value_heads={kv}")
        return cls(hidden_size=hidden, num_layers=int(c["num_hidden_layers"]), num_heads=heads, num_kv_heads=kv,
                   intermediate_size=int(c["intermediate_size"]), vocab_size=int(c["vocab_size"]),
                   rope_theta=float(c.get("rope_theta", 10000.0)), rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                   max_position_embeddings=int(c.get("max_position_embeddings", 32768)),
                   tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                   mask_token_id=c.get("mask_token_id"))


class Attention(nn.Module):
    def __init__(self, cfg: DreamConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.n_heads, self.n_kv = \
            parallel.attention_projections(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, True)

    def forward(self, x, cos, sin, mask, kv):
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin, fp32=False), apply_rope(k, cos, sin, fp32=False)
        if kv is not None:
            k, v = kv(k, v)
        return attention(q, k, v, mask).transpose(1, 2).reshape(B, L, -1)     # o_proj: in the layer's dense tail


class DreamModel(DecoderLM):
    """The :class:`~worker.models.family.DiffusionLM` interface: ``forward`` gives final hidden states (unshifted),
    ``logits`` applies the head."""
    family = "dream"

    def __init__(self, cfg: DreamConfig):
        layers = [DecoderLayer(cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps, Attention(cfg))
                  for _ in range(cfg.num_layers)]
        super().__init__(cfg, Decoder(cfg.vocab_size, cfg.hidden_size, cfg.rms_norm_eps, layers),
                         None if cfg.tie_word_embeddings else parallel.head(cfg.hidden_size, cfg.vocab_size))


def load(path: str | Path, device: torch.device, dtype: torch.dtype) -> DreamModel:
    cfg = DreamConfig.from_dict(read_config(path))
    if not cfg.tie_word_embeddings and "lm_head.weight" not in tensor_shapes(path):
        raise CheckpointError("the Dream checkpoint has no lm_head.weight and config.json does not set "
                              "tie_word_embeddings")
    return load_native(path, lambda: DreamModel(cfg), "Dream", device, dtype)


FAMILY = Family(name="dream", title="Dream (DreamModel; also DiffuCoder)", architectures=("DreamModel",),
                model_types=("Dream", "dream"),
                tensors=("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.bias"), load=load,
                default_algorithm="dream", algorithms=("dream", "dream_cache", "dream_dual_cache"))
