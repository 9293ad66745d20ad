"""LLaDA-MoE (inclusionAI/LLaDA-MoE-7B-A1B-Base/-Instruct, ``LLaDAMoEModelLM``): LLaDA's masked-diffusion recipe on
an OLMoE-style mixture-of-experts decoder, used bidirectionally. Every LLaDA algorithm applies; the mask id (156895 in
the real checkpoints) and eos come from the checkpoint like any family's.

Per layer, as the checkpoint's ``modeling_lladamoe.py`` computes it: ``h = input_layernorm(x)``; q/k/v projections
(``attention_bias``); with ``qk_layernorm`` a per-head RMSNorm of q and k (over head_dim, before RoPE); rotate-half
RoPE with float32 tables cast to the model dtype (on the first ``partial_rotary_factor`` of each head); SDPA without a
mask; ``x + o_proj``; then with ``h = post_attention_layernorm(x)`` the feed-forward: in MoE layers
(``moe_layer_freq[i] != 0``) the router ``gate`` (no bias) gives logits, a float32 softmax (plus ``expert_bias`` when
the config enables it) picks the top ``num_experts_per_tok`` experts whose weights are used as they are (the
reference does not renormalise them), cast to the model dtype; each expert ``down(silu(gate(h)) * up(h))`` times its
weight is added into a zero tensor expert by expert in index order; a ``shared_expert`` when configured is added to
that; dense layers use one SwiGLU MLP of ``dense_intermediate_size``. ``x + ffn``. Final ``norm`` and ``lm_head``."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import CheckpointError, load_native, read_config
from . import parallel
from .family import LLADA_ALGORITHMS, Family
from .layers import Decoder, DecoderLM, QKNormAttention, RMSNorm, SwiGLU


@dataclass(frozen=True)
class LLaDAMoEConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    dense_intermediate_size: int | None
    expert_intermediate_size: int
    shared_expert_intermediate_size: int | None
    num_experts: int
    num_experts_per_tok: int
    moe_layers: tuple[bool, ...]
    expert_bias: bool
    qk_norm: bool
    attention_bias: bool
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    @property
    def embedding_size(self) -> int:
        return self.vocab_size

    @classmethod
    def from_dict(cls, c: dict) -> "LLaDAMoEConfig":
        need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "expert_intermediate_size", "num_experts",
                "num_experts_per_tok", "vocab_size")
        missing = [k for k in need if k not in c or c[k] in (None, -1)]
        if missing:
            raise CheckpointError(f"config.json lacks LLaDA-MoE fields: {', '.join(missing)}")
        for key, ok in [("rope_scaling", lambda v: not v), ("clip_qkv", lambda v: v is None),
                        ("hidden_act", lambda v: v in (None, "silu"))]:
            if key in c and not ok(c[key]):
                raise CheckpointError(f"unsupported LLaDA-MoE config: {key}={c[key]!r}")
        layers = int(c["num_hidden_layers"])
        freq = c.get("moe_layer_freq") or [1] * layers
        if len(freq) != layers:
            raise CheckpointError(f"moe_layer_freq has {len(freq)} entries for {layers} layers")
        moe = tuple(bool(f) for f in freq)
        dense = c.get("dense_intermediate_size")
        if not all(moe) and (dense is None or int(dense) <= 0):
            raise CheckpointError("config.json has dense layers but no dense_intermediate_size")
        heads = int(c["num_attention_heads"])
        kv = int(c.get("num_key_value_heads") or heads)
        hidden = int(c["hidden_size"])
        if heads % kv or hidden % heads:
            raise CheckpointError(f"unsupported LLaDA-MoE head layout: hidden_size={hidden}, "
                                  f"num_attention_heads={heads}, num_key_value_heads={kv}")
        head_dim = hidden // heads
        partial = float(c.get("partial_rotary_factor") if c.get("partial_rotary_factor") not in (None, -1) else 1.0)
        rotary = int(head_dim * partial)
        if not 0 < rotary <= head_dim or rotary % 2:
            raise CheckpointError(f"unsupported partial_rotary_factor={partial} for head_dim {head_dim}")
        k = int(c["num_experts_per_tok"])
        experts = int(c["num_experts"])
        if not 0 < k <= experts:
            raise CheckpointError(f"num_experts_per_tok={k} must be between 1 and num_experts={experts}")
        shared = c.get("shared_expert_intermediate_size")
        return cls(hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                   rotary_dim=rotary, dense_intermediate_size=int(dense) if dense not in (None, -1) else None,
                   expert_intermediate_size=int(c["expert_intermediate_size"]),
                   shared_expert_intermediate_size=int(shared) if shared not in (None, -1, 0) else None,
                   num_experts=experts, num_experts_per_tok=k, moe_layers=moe,
                   expert_bias=bool(c.get("moe_router_enable_expert_bias")), qk_norm=bool(c.get("qk_layernorm")),
                   attention_bias=bool(c.get("attention_bias", False)), vocab_size=int(c["vocab_size"]),
                   rope_theta=float(c.get("rope_theta", 10000.0)), rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)),
                   max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
                   tie_word_embeddings=bool(c.get("tie_word_embeddings", False)))


def expert_mlp(m: SwiGLU, x: torch.Tensor) -> torch.Tensor:
    return m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))


def local_experts(count: int, make) -> nn.ModuleDict:
    """The experts this rank holds (all of them on one rank; an even share of them with tensor parallelism: expert
    parallelism), keyed by their index in the checkpoint (``experts.{e}``)."""
    tp = parallel.current()
    n = tp.split(count, "experts")
    return nn.ModuleDict({str(e): make() for e in range(tp.rank * n, (tp.rank + 1) * n)})


def run_experts(experts: nn.ModuleDict, x: torch.Tensor, chosen: torch.Tensor, count: int) -> torch.Tensor:
    """Every token's chosen experts applied to it: [T, k, D] for ``chosen`` [T, k] of ``count`` experts. The (token,
    expert) pairs are sorted by expert so that each expert runs once on its tokens (one host sync for the counts, not
    one per expert); a row's result does not depend on the other rows of its expert's batch. With expert parallelism
    the pairs of experts another rank holds are zeros here (the ranks' results are summed)."""
    k = chosen.shape[1]
    flat = chosen.reshape(-1)
    order = flat.argsort()
    counts = torch.bincount(flat, minlength=count).tolist()
    xs = x[order // k]
    ys = torch.empty_like(xs) if len(experts) == count else torch.zeros_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            m = experts[str(e)] if str(e) in experts else None
            if m is not None:
                ys[start:start + n] = expert_mlp(m, xs[start:start + n])
            start += n
    out = torch.empty_like(ys)
    out[order] = ys
    return out.view(x.shape[0], k, -1)


class SparseMoE(nn.Module):
    """The router ``gate`` and the ``experts`` (checkpoint names ``mlp.gate.weight``,
    ``mlp.experts.{e}.{gate,up,down}_proj.weight``, ``mlp.expert_bias`` when enabled)."""

    def __init__(self, cfg: LLaDAMoEConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.num_experts = cfg.num_experts
        self.experts = local_experts(cfg.num_experts, lambda: SwiGLU(cfg.hidden_size, cfg.expert_intermediate_size,
                                                                     split=False))
        self.expert_bias = nn.Parameter(torch.zeros(cfg.num_experts)) if cfg.expert_bias else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape
        x = h.reshape(-1, shape[-1])
        weights = F.softmax(self.gate(x), dim=1, dtype=torch.float)
        if self.expert_bias is not None:
            weights = weights + self.expert_bias
        weights, chosen = torch.topk(weights, self.top_k, dim=-1)
        weights = weights.to(x.dtype)
        # the reference adds each expert's weighted output into zeros expert by expert, in index order: the same
        # sums, token by token, over its experts sorted by index
        chosen, slot = chosen.sort(dim=1)
        y = run_experts(self.experts, x, chosen, self.num_experts) * weights.gather(1, slot)[..., None]
        out = torch.zeros_like(x)
        for j in range(self.top_k):
            out = out + y[:, j]
        return out.view(shape)


class Layer(nn.Module):
    """``x + self_attn(input_layernorm(x))``, then ``x + (mlp(h) [+ shared_expert(h)])`` with
    ``h = post_attention_layernorm(x)``."""

    def __init__(self, cfg: LLaDAMoEConfig, moe: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = QKNormAttention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                         cfg.rms_norm_eps, cfg.qk_norm, cfg.attention_bias, cfg.rotary_dim)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if moe else SwiGLU(cfg.hidden_size, cfg.dense_intermediate_size)
        self.shared_expert = (SwiGLU(cfg.hidden_size, cfg.shared_expert_intermediate_size)
                              if moe and cfg.shared_expert_intermediate_size else None)
        self.tp = parallel.current()

    def forward(self, x, cos, sin, mask, kv=None):
        x = x + parallel.row_linear(self.tp, self.self_attn(self.input_layernorm(x), cos, sin, mask, kv),
                                    self.self_attn.o_proj)
        h = self.post_attention_layernorm(x)
        y = self.mlp(h) if isinstance(self.mlp, SparseMoE) else expert_mlp(self.mlp, h)
        if self.shared_expert is not None:
            y = y + expert_mlp(self.shared_expert, h)
        return x + self.tp.reduce(y)       # with tensor parallelism: each rank's experts' and channels' share


class LLaDAMoEModel(DecoderLM):
    """The :class:`~worker.models.family.DiffusionLM` interface over the MoE decoder (names ``model.*``,
    ``lm_head``)."""
    family = "llada_moe"
    cuda_graphs = False     # the experts' token counts are read on the host (worker/engine/graphs.py)

    def __init__(self, cfg: LLaDAMoEConfig):
        layers = [Layer(cfg, moe) for moe in cfg.moe_layers]
        super().__init__(cfg, Decoder(cfg.vocab_size, cfg.hidden_size, cfg.rms_norm_eps, layers),
                         None if cfg.tie_word_embeddings else parallel.head(cfg.hidden_size, cfg.vocab_size))

    def compile_dense(self):
        """Nothing to compile: the MoE layers route tokens data-dependently (eager)."""
        return None


def load(path: str | Path, device: torch.device, dtype: torch.dtype) -> LLaDAMoEModel:
    cfg = LLaDAMoEConfig.from_dict(read_config(path))
    return load_native(path, lambda: LLaDAMoEModel(cfg), "LLaDA-MoE", device, dtype)


FAMILY = Family(name="llada_moe", title="LLaDA-MoE (LLaDAMoEModelLM)", architectures=("LLaDAMoEModelLM",),
                model_types=("lladamoe", "llada"),
                tensors=("model.embed_tokens.weight", "model.layers.0.mlp.gate.weight",
                         "model.layers.0.mlp.experts.0.gate_proj.weight"),
                load=load, default_algorithm="basic", algorithms=LLADA_ALGORITHMS)
