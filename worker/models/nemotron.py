"""Nemotron-Diffusion (NVIDIA's Qwen3-based ``DiffEncoderModel``): a Qwen3 decoder stack used as a bidirectional
encoder, then an untied ``diffusion_head``. Layout, config fields and math: tests/fixtures/tiny-nemotron.md.

Per layer: ``h = input_layernorm(x)``; q/k/v projections; per-head RMSNorm of q and k (``q_norm``/``k_norm``, over
head_dim, before RoPE); rotate-half RoPE with float32 tables cast to the model dtype (Hugging Face's Qwen3 convention);
grouped-query attention with no mask between real tokens; ``x + o_proj``; then ``x + down(silu(gate(h)) * up(h))``
with ``h = post_attention_layernorm(x)``. Final ``norm`` and ``diffusion_head``."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import CheckpointError, load_native, read_config
from . import parallel
from .family import LLADA_ALGORITHMS, Family
from .layers import Decoder, DecoderLayer, DecoderLM, QKNormAttention


@dataclass(frozen=True)
class NemotronConfig:
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
    qk_norm: bool
    mask_token_id: int | None
    eos_token_id: int | None

    @property
    def embedding_size(self) -> int:
        return self.vocab_size

    @classmethod
    def from_dict(cls, c: dict) -> "NemotronConfig":
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                               "vocab_size") if k not in c]
        if missing:
            raise CheckpointError(f"config.json lacks Nemotron-Diffusion fields: {', '.join(missing)}")
        if c.get("attention_bias"):
            raise CheckpointError("unsupported Nemotron-Diffusion config: attention_bias=true")
        if c.get("use_sliding_window"):
            raise CheckpointError("unsupported Nemotron-Diffusion config: use_sliding_window=true")
        if c.get("rope_scaling"):
            raise CheckpointError(f"unsupported Nemotron-Diffusion config: rope_scaling={c['rope_scaling']!r}")
        if c.get("tie_word_embeddings"):
            raise CheckpointError("unsupported Nemotron-Diffusion config: tie_word_embeddings=true")
        heads = int(c["num_attention_heads"])
        kv = int(c.get("num_key_value_heads") or heads)
        if heads % kv:
            raise CheckpointError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
        hidden = int(c["hidden_size"])
        return cls(hidden_size=hidden, num_layers=int(c["num_hidden_layers"]), num_heads=heads, num_kv_heads=kv,
                   head_dim=int(c.get("head_dim") or hidden // heads),
                   intermediate_size=int(c["intermediate_size"]), vocab_size=int(c["vocab_size"]),
                   rope_theta=float(c.get("rope_theta", 1e6)), rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                   max_position_embeddings=int(c.get("max_position_embeddings", 40960)),
                   qk_norm=not c.get("disable_qk_norm", False), mask_token_id=c.get("mask_token_id"),
                   eos_token_id=c.get("eos_token_id") if not isinstance(c.get("eos_token_id"), list)
                   else c["eos_token_id"][0])


def Attention(cfg: NemotronConfig) -> QKNormAttention:
    return QKNormAttention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                           cfg.qk_norm)


class NemotronDiffusionModel(DecoderLM):
    """Same interface as the LLaDA model: ``forward`` gives final hidden states, ``logits`` applies the head."""
    family = "nemotron"
    decoder_name, head_name = "encoder", "diffusion_head"

    def __init__(self, cfg: NemotronConfig):
        layers = [DecoderLayer(cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps, Attention(cfg))
                  for _ in range(cfg.num_layers)]
        super().__init__(cfg, Decoder(cfg.vocab_size, cfg.hidden_size, cfg.rms_norm_eps, layers),
                         parallel.head(cfg.hidden_size, cfg.vocab_size))


def load(path: str | Path, device: torch.device, dtype: torch.dtype) -> NemotronDiffusionModel:
    cfg = NemotronConfig.from_dict(read_config(path))
    return load_native(path, lambda: NemotronDiffusionModel(cfg), "Nemotron-Diffusion", device, dtype)


FAMILY = Family(name="nemotron", title="Nemotron-Diffusion (DiffEncoderModel)", architectures=("DiffEncoderModel",),
                model_types=("nvrdiff",), tensors=("diffusion_head.weight", "encoder.embed_tokens.weight"), load=load,
                default_algorithm="nemotron", algorithms=("nemotron",) + LLADA_ALGORITHMS)
