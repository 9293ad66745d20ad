"""LLaDA (GSAI-ML/LLaDA-8B-Instruct/-Base, LLaDA-1.5): a Llama-style transformer used as a bidirectional
mask predictor. Loads the published checkpoint layout (``model.transformer.*`` tensor names) without
``trust_remote_code``.

Per block: ``x = x + attn_out(SDPA(rope(q), rope(k), v))`` over ``attn_norm(x)`` with no causal mask, then
``x = x + ff_out(silu(ff_proj(h)) * up_proj(h))`` with ``h = ff_norm(x)``; ``ln_f`` then ``ff_out`` (the LM head,
tied to ``wte`` when ``weight_tying``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .checkpoint import CheckpointError, load_native, read_config
from . import parallel
from .family import LLADA_ALGORITHMS, Family
from .layers import (KVCache, LayerKV, RMSNorm, apply_rope, attention, compile_dense, dense_tail, dense_tail_parallel,
                     no_compile_when_parallel, rope_tables)

PREFIX = "model.transformer."


@dataclass(frozen=True)
class LLaDAConfig:
    d_model: int
    n_heads: int
    n_kv_heads: int
    n_layers: int
    mlp_hidden_size: int
    vocab_size: int
    embedding_size: int
    rope_theta: float
    rms_norm_eps: float
    max_sequence_length: int
    weight_tying: bool
    mask_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @classmethod
    def from_dict(cls, c: dict) -> "LLaDAConfig":
        unsupported = []
        for key, ok in [("block_type", lambda v: v in (None, "llama")), ("alibi", lambda v: not v),
                        ("rope", lambda v: v in (None, True)), ("include_bias", lambda v: not v),
                        ("include_qkv_bias", lambda v: not v), ("layer_norm_type", lambda v: v in (None, "rms")),
                        ("activation_type", lambda v: v in (None, "silu", "swiglu")),
                        ("attention_layer_norm", lambda v: not v), ("input_emb_norm", lambda v: not v),
                        ("scale_logits", lambda v: not v), ("clip_qkv", lambda v: v is None)]:
            if key in c and not ok(c[key]):
                unsupported.append(f"{key}={c[key]!r}")
        if unsupported:
            raise CheckpointError(f"unsupported LLaDA config settings: {', '.join(unsupported)}")
        missing = [k for k in ("d_model", "n_heads", "n_layers") if k not in c]
        if missing:
            raise CheckpointError(f"config.json lacks LLaDA fields: {', '.join(missing)}")
        n_heads = int(c["n_heads"])
        n_kv = c.get("n_kv_heads")
        if c.get("multi_query_attention"):
            n_kv = 1
        n_kv = int(n_kv or n_heads)
        if n_heads % n_kv:
            raise CheckpointError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv}")
        d_model = int(c["d_model"])
        mlp = c.get("mlp_hidden_size") or int(c.get("mlp_ratio", 4)) * d_model
        vocab = int(c.get("vocab_size", 0))
        return cls(
            d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv, n_layers=int(c["n_layers"]),
            mlp_hidden_size=int(mlp), vocab_size=vocab, embedding_size=int(c.get("embedding_size") or vocab),
            rope_theta=float(c.get("rope_theta", 10000.0)), rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)),
            max_sequence_length=int(c.get("max_sequence_length", 4096)),
            weight_tying=bool(c.get("weight_tying", False)),
            mask_token_id=c.get("mask_token_id"), eos_token_id=c.get("eos_token_id"),
            pad_token_id=c.get("pad_token_id"),
        )


class LLaDABlock(nn.Module):
    def __init__(self, cfg: LLaDAConfig):
        super().__init__()
        d, hd = cfg.d_model, cfg.head_dim
        tp = self.tp = parallel.current()
        mlp = tp.split(cfg.mlp_hidden_size, "mlp_hidden_size")
        self.head_dim = hd
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ff_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q_proj, self.k_proj, self.v_proj, self.attn_out, self.n_heads, self.n_kv_heads = \
            parallel.attention_projections(d, cfg.n_heads, cfg.n_kv_heads, hd)          # this rank's heads
        self.ff_proj = nn.Linear(d, mlp, bias=False)
        self.up_proj = nn.Linear(d, mlp, bias=False)
        self.ff_out = nn.Linear(mlp, d, bias=False)
        if tp.parallel:
            parallel.swiglu_shards(tp, self.ff_proj, self.up_proj, self.ff_out, cfg.mlp_hidden_size)
        self.dense = dense_tail          # or a Compiled one (LLaDAModel.compile_dense)

    def forward(self, x, cos, sin, mask, kv: LayerKV | None = None):
        B, L, _ = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:
            k, v = kv(k, v)
        a = attention(q, k, v, mask).transpose(1, 2).reshape(B, L, -1)
        if self.tp.parallel:
            return dense_tail_parallel(self.tp, x, a, self.attn_out.weight, self.ff_norm.weight, self.ff_norm.eps,
                                       self.ff_proj.weight, self.up_proj.weight, self.ff_out.weight)
        return self.dense(x, a, self.attn_out.weight, self.ff_norm.weight, self.ff_norm.eps, self.ff_proj.weight,
                          self.up_proj.weight, self.ff_out.weight)


class LLaDAModel(nn.Module):
    family = "llada"
    cuda_graphs = True      # no host synchronisation in the forward (worker/engine/graphs.py)

    def __init__(self, cfg: LLaDAConfig):
        super().__init__()
        self.cfg = cfg
        self.tp = parallel.current()
        self.wte = parallel.VocabEmbedding(cfg.embedding_size, cfg.d_model)
        self.blocks = nn.ModuleList(LLaDABlock(cfg) for _ in range(cfg.n_layers))
        self.ln_f = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.ff_out = None if cfg.weight_tying else parallel.head(cfg.d_model, cfg.embedding_size)
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None

    @property
    def max_sequence_length(self) -> int:
        return self.cfg.max_sequence_length

    @property
    def device(self) -> torch.device:
        return self.wte.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.wte.weight.dtype

    def init_rope(self) -> None:
        self.rope_cos, self.rope_sin = rope_tables(self.cfg.head_dim, self.cfg.max_sequence_length,
                                                   self.cfg.rope_theta, self.device)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None = None,
                cache: KVCache | None = None, slots: torch.Tensor | None = None, window=None) -> torch.Tensor:
        """Hidden states after ``ln_f``. ids, pos: [B, L] long; mask: bool [B, 1, 1|L, keys] (True = may attend) or
        None for no masking. Call :meth:`logits` on the rows you need.

        With ``cache`` (rows ``slots`` of it, or all): without ``window`` the rows are whole canvas rows and their
        keys/values are stored (a full forward); with ``window = (bi, wi, cols)`` the ids are windows of the rows,
        whose valid positions' keys/values are written at cache columns ``cols`` and which attend to the whole cached
        row."""
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        x = self.wte(ids)
        for i, block in enumerate(self.blocks):
            kv = None if cache is None else LayerKV(cache, i, slots, window)
            x = block(x, cos, sin, mask, kv)
        return self.ln_f(x)

    def compile_dense(self):
        """torch.compile the dense half of every block (eager fallback): see layers.Compiled."""
        if no_compile_when_parallel(self):
            return None
        return compile_dense(self.blocks)

    def new_cache(self, slots: int, width: int) -> KVCache:
        c = self.cfg
        return KVCache(c.n_layers, slots, self.blocks[0].n_kv_heads, width, c.head_dim, self.dtype, self.device)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        w = self.wte.weight if self.ff_out is None else self.ff_out.weight
        return parallel.vocab_logits(self.tp, h, w, self.cfg.embedding_size)


def load(path: str | Path, device: torch.device, dtype: torch.dtype) -> LLaDAModel:
    cfg = LLaDAConfig.from_dict(read_config(path))
    return load_native(path, lambda: LLaDAModel(cfg), "LLaDA", device, dtype, prefix=PREFIX)


FAMILY = Family(name="llada", title="LLaDA (LLaDAModelLM)", architectures=("LLaDAModelLM",), model_types=("llada",),
                tensors=("model.transformer.wte.weight",), load=load, default_algorithm="basic", scoring=True,
                algorithms=LLADA_ALGORITHMS)
