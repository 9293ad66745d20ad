"""LLaDA2.x (inclusionAI/LLaDA2.0-mini/-flash, LLaDA2.1, ``LLaDA2MoeModelLM``): a BailingMoeV2 mixture-of-experts
decoder trained for block diffusion. Attention is block-causal (a position sees its own block and the blocks before
it), so a finished block's keys/values never change and the KV cache is exact; the algorithm
(worker/engine/algorithms/llada2.py) passes that mask, the model applies what it is given.

Per layer, as the checkpoint's ``modeling_llada2_moe.py`` computes it: ``h = input_layernorm(x)``; one fused
``query_key_value`` projection split into q, k, v heads; with ``use_qk_norm`` a per-head RMSNorm of q and k
(``query_layernorm`` / ``key_layernorm``); rotate-half RoPE on the first ``partial_rotary_factor`` of each head (float32
tables cast to the model dtype); SDPA with scale ``head_dim ** -0.5`` (kv heads repeated for the query heads);
``x + dense(...)``; then with ``h = post_attention_layernorm(x)`` the feed-forward: the first ``first_k_dense_replace``
layers a SwiGLU MLP of ``intermediate_size``, the others a MoE: the router ``gate`` computes float32 logits and
sigmoid scores, picks ``topk_group`` of ``n_group`` expert groups by the sum of each group's two best
``scores + expert_bias``, then the ``num_experts_per_tok`` best experts of those groups; the chosen experts'
(unbiased) scores, normalised to sum 1 (when more than one) and times ``routed_scaling_factor``, weight the experts'
outputs in float32, summed over the chosen experts, cast back; plus the ``shared_experts`` MLP. ``x + ffn``. Final
``norm`` and ``lm_head``."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import CheckpointError, load_native, read_config, tensor_shapes
from . import parallel
from .family import Family
from .layers import DecoderLM, RMSNorm, SwiGLU, apply_partial_rope, grouped_kv
from .llada_moe import expert_mlp, local_experts, run_experts


@dataclass(frozen=True)
class LLaDA2Config:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    intermediate_size: int | None
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int | None
    first_k_dense_replace: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    qk_norm: bool
    qkv_bias: bool
    dense_bias: bool
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    expert_bias: bool = True          # the checkpoint stores mlp.gate.expert_bias (else zeros, as the reference's buffer)

    @property
    def embedding_size(self) -> int:
        return self.vocab_size

    @classmethod
    def from_dict(cls, c: dict) -> "LLaDA2Config":
        need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_experts",
                "moe_intermediate_size")
        missing = [k for k in need if c.get(k) is None]
        if missing:
            raise CheckpointError(f"config.json lacks LLaDA2 fields: {', '.join(missing)}")
        for key, ok in [("rope_scaling", lambda v: not v), ("use_sliding_window", lambda v: not v),
                        ("hidden_act", lambda v: v in (None, "silu")), ("norm_head", lambda v: not v),
                        ("score_function", lambda v: v in (None, "sigmoid"))]:
            if key in c and not ok(c[key]):
                raise CheckpointError(f"unsupported LLaDA2 config: {key}={c[key]!r}")
        heads = int(c["num_attention_heads"])
        kv = int(c.get("num_key_value_heads") or heads)
        hidden = int(c["hidden_size"])
        head_dim = int(c.get("head_dim") or hidden // heads)
        if heads % kv:
            raise CheckpointError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
        rotary = int(head_dim * float(c.get("partial_rotary_factor", 0.5)))
        if not 0 < rotary <= head_dim or rotary % 2:
            raise CheckpointError(f"unsupported partial_rotary_factor={c.get('partial_rotary_factor')} for head_dim "
                                  f"{head_dim}")
        experts, k = int(c["num_experts"]), int(c.get("num_experts_per_tok", 2))
        groups, topk_group = int(c.get("n_group", 1)), int(c.get("topk_group", 1))
        if experts % groups or not 0 < topk_group <= groups or experts // groups < 2 or \
                not 0 < k <= topk_group * (experts // groups):
            raise CheckpointError(f"unsupported LLaDA2 routing: num_experts={experts}, n_group={groups}, "
                                  f"topk_group={topk_group}, num_experts_per_tok={k}")
        dense = int(c.get("first_k_dense_replace", 0))
        if dense and not c.get("intermediate_size"):
            raise CheckpointError("config.json has dense layers (first_k_dense_replace) but no intermediate_size")
        shared = c.get("num_shared_experts")
        return cls(hidden_size=hidden, num_layers=int(c["num_hidden_layers"]), num_heads=heads, num_kv_heads=kv,
                   head_dim=head_dim, rotary_dim=rotary,
                   intermediate_size=int(c["intermediate_size"]) if c.get("intermediate_size") else None,
                   moe_intermediate_size=int(c["moe_intermediate_size"]), num_experts=experts, num_experts_per_tok=k,
                   num_shared_experts=int(shared) if shared else None, first_k_dense_replace=dense, n_group=groups,
                   topk_group=topk_group, routed_scaling_factor=float(c.get("routed_scaling_factor", 2.5)),
                   qk_norm=bool(c.get("use_qk_norm", True)), qkv_bias=bool(c.get("use_qkv_bias", False)),
                   dense_bias=bool(c.get("use_bias", True)), vocab_size=int(c["vocab_size"]),
                   rope_theta=float(c.get("rope_theta", 10000.0)), rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                   max_position_embeddings=int(c.get("max_position_embeddings", 16384)),
                   tie_word_embeddings=bool(c.get("tie_word_embeddings", False)))


class Router(nn.Module):
    """``mlp.gate.weight`` [experts, hidden] and ``mlp.gate.expert_bias`` [experts]."""

    def __init__(self, cfg: LLaDA2Config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        if cfg.expert_bias:
            self.expert_bias = nn.Parameter(torch.zeros(cfg.num_experts))
        else:
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts), persistent=False)
        self.k, self.groups, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.scale = cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen experts [T, k], their float32 weights [T, k]) for tokens x [T, hidden]."""
        logits = F.linear(x.float(), self.weight.float())
        scores = torch.sigmoid(logits)
        biased = scores + self.expert_bias
        T = x.shape[0]
        group_best = biased.view(T, self.groups, -1).topk(2, dim=-1)[0].sum(dim=-1)
        groups = torch.topk(group_best, k=self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_best).scatter_(1, groups, 1).bool()
        keep = keep[:, :, None].expand(T, self.groups, biased.shape[1] // self.groups).reshape(T, -1)
        chosen = torch.topk(biased.masked_fill(~keep, float("-inf")), k=self.k, dim=-1)[1]
        w = torch.gather(scores, 1, chosen)
        if self.k > 1:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return chosen, w * self.scale


class SparseMoE(nn.Module):
    """``gate`` (the router), ``experts.{e}`` and ``shared_experts``."""

    def __init__(self, cfg: LLaDA2Config):
        super().__init__()
        self.gate = Router(cfg)
        self.num_experts = cfg.num_experts
        self.experts = local_experts(cfg.num_experts, lambda: SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size,
                                                                     split=False))
        self.shared_experts = (SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size * cfg.num_shared_experts)
                               if cfg.num_shared_experts else None)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape
        x = h.reshape(-1, shape[-1])
        chosen, w = self.gate(x)
        y = (run_experts(self.experts, x, chosen, self.num_experts).float() * w[..., None]).sum(dim=1).to(x.dtype).view(shape)
        if self.shared_experts is not None:
            y = y + expert_mlp(self.shared_experts, h)
        return y


class Attention(nn.Module):
    def __init__(self, cfg: LLaDA2Config):
        super().__init__()
        tp = self.tp = parallel.current()
        (hq, q0), (hk, k0) = tp.heads(cfg.num_heads), tp.kv_heads(cfg.num_kv_heads, cfg.num_heads)  # this rank's
        d = cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim, self.rotary_dim = hq, hk, d, cfg.rotary_dim
        self.scaling = cfg.head_dim ** -0.5
        self.query_key_value = nn.Linear(cfg.hidden_size, (hq + 2 * hk) * d, bias=cfg.qkv_bias)
        self.query_layernorm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.key_layernorm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.dense = nn.Linear(hq * d, cfg.hidden_size, bias=cfg.dense_bias)
        if tp.parallel:     # the fused projection: this rank's q heads, then its k and its v heads
            hq_all, hk_all = cfg.num_heads * d, cfg.num_kv_heads * d
            tp.column(self.query_key_value, hq_all + 2 * hk_all,
                      [(q0 * d, hq * d), (hq_all + k0 * d, hk * d), (hq_all + hk_all + k0 * d, hk * d)])
            tp.row(self.dense, hq_all, [(q0 * d, hq * d)])

    def forward(self, x, cos, sin, mask, kv):
        B, L, _ = x.shape
        qkv = self.query_key_value(x).view(B, L, self.n_heads + 2 * self.n_kv, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.split([self.n_heads, self.n_kv, self.n_kv], dim=-2))
        if self.query_layernorm is not None:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q = apply_partial_rope(q, cos, sin, self.rotary_dim)
        k = apply_partial_rope(k, cos, sin, self.rotary_dim)
        if kv is not None:
            k, v = kv(k, v)
        k, v, gqa = grouped_kv(q, k, v)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=gqa)
        return parallel.row_linear(self.tp, a.transpose(1, 2).reshape(B, L, -1), self.dense)


class Layer(nn.Module):
    def __init__(self, cfg: LLaDA2Config, moe: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if moe else SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, mask, kv=None):
        x = x + self.attention(self.input_layernorm(x), cos, sin, mask, kv)
        h = self.post_attention_layernorm(x)
        y = self.mlp(h) if isinstance(self.mlp, SparseMoE) else expert_mlp(self.mlp, h)
        return x + self.attention.tp.reduce(y)     # with tensor parallelism: each rank's experts' and channels' share


class Backbone(nn.Module):
    """``word_embeddings``, the layers, the final ``norm`` (checkpoint prefix ``model.``)."""

    def __init__(self, cfg: LLaDA2Config):
        super().__init__()
        self.word_embeddings = parallel.VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, i >= cfg.first_k_dense_replace) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.word_embeddings


class LLaDA2Model(DecoderLM):
    """The :class:`~worker.models.family.DiffusionLM` interface; the caller's ``mask`` carries the block-causal
    attention."""
    family = "llada2"
    cuda_graphs = False     # the experts' token counts are read on the host (worker/engine/graphs.py)

    def __init__(self, cfg: LLaDA2Config):
        super().__init__(cfg, Backbone(cfg),
                         None if cfg.tie_word_embeddings else parallel.head(cfg.hidden_size, cfg.vocab_size))

    def compile_dense(self):
        """Nothing to compile: the MoE layers route tokens data-dependently (eager)."""
        return None


def load(path: str | Path, device: torch.device, dtype: torch.dtype) -> LLaDA2Model:
    cfg = LLaDA2Config.from_dict(read_config(path))
    if cfg.first_k_dense_replace < cfg.num_layers:
        bias = f"model.layers.{cfg.first_k_dense_replace}.mlp.gate.expert_bias"
        cfg = replace(cfg, expert_bias=bias in tensor_shapes(path))
    model = load_native(path, lambda: LLaDA2Model(cfg), "LLaDA2", device, dtype)
    if not cfg.expert_bias:           # built on the meta device: real zeros now
        for layer in model.model.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.gate.expert_bias = torch.zeros(cfg.num_experts, device=device, dtype=dtype)
    return model


FAMILY = Family(name="llada2", title="LLaDA2 (LLaDA2MoeModelLM)", architectures=("LLaDA2MoeModelLM",),
                model_types=("llada2_moe",),
                tensors=("model.word_embeddings.weight", "model.layers.0.attention.query_key_value.weight"),
                load=load, default_algorithm="llada2", algorithms=("llada2", "llada21"), prefix_cache=True)
