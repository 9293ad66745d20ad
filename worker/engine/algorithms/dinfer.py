"""dInfer's decoding strategies (inclusionAI/dInfer), on the dual KV cache, each row with its own parameters at any
batch size. Not token-exact to a published loop (``exact: false``); the vicinity refresh generalises the dual cache:

- ``prefix_look`` / ``after_look``: every cached step also recomputes that many positions before / after the block
  (their keys/values refreshed with the current tokens);
- ``warmup_steps``: the first steps of each block run full forwards (the whole cache refreshed), at least one.

Every row also stops as soon as its answer is final (a stop token with no mask before it): the engine's exact early
exit, which covers dInfer's early stop at end-of-sequence inside a block."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ...models.layers import upload
from ..params import until_unmasked_cost
from ..sampling import NEG_INF, Rule, Softmax
from . import COMMON_PARAMS, Algorithm, ParamInfo, register
from .cached import DUAL_VARIANTS, Variant, run_dual


def select_dinfer_threshold(conf: torch.Tensor, x0: torch.Tensor, masked: torch.Tensor, threshold: float,
                            mask_id: int) -> torch.Tensor:
    """dInfer's ``get_transfer_index_threshold`` for one row (float32 confidences): positions whose proposal is the
    mask token are left out; every other masked one with confidence >= (best - 1e-5) clamped to [-1000, threshold]
    is committed, so a step commits at least its most confident token. Bool over the candidates."""
    thr = torch.full((1, 1), threshold, dtype=conf.dtype, device=conf.device)
    return select_dinfer_threshold_rows(conf[None], x0[None], masked[None], thr, mask_id)[0]


def select_dinfer_threshold_rows(conf: torch.Tensor, x0: torch.Tensor, masked: torch.Tensor,
                                 threshold: torch.Tensor, mask_id: int) -> torch.Tensor:
    """:func:`select_dinfer_threshold` for rows [R, K] at once (``threshold`` [R, 1] in the confidences' dtype, as
    the reference compares): the best taken per row."""
    c = torch.where(masked & (x0 != mask_id), conf, torch.full_like(conf, NEG_INF))
    return (c >= torch.minimum((c.amax(1, keepdim=True) - 1e-5).clamp(min=-1000), threshold)) & masked


def select_hierarchy(conf: torch.Tensor, masked: torch.Tensor, threshold: float | None,
                     low: float | None) -> torch.Tensor:
    """dInfer's ``HierarchyDecoder`` for one row: non-masked positions get the dtype's lowest value; in each
    contiguous run of masked candidates every position equal to the run's best, if > ``low``; plus every position
    > ``threshold``; plus the first most confident position; then only masked ones. Bool over the candidates."""
    return select_hierarchy_rows(conf[None], masked[None], threshold, low)[0]


def select_hierarchy_rows(conf: torch.Tensor, masked: torch.Tensor, threshold: float | None,
                          low: float | None) -> torch.Tensor:
    """:func:`select_hierarchy` for rows [R, K] at once (the same ``threshold`` and ``low`` for all): the runs,
    their best and the first most confident position found per row."""
    lowest = torch.finfo(conf.dtype).min
    c = torch.where(masked, conf, torch.full_like(conf, lowest))
    prev = torch.cat([masked.new_zeros(masked.shape[0], 1), masked[:, :-1]], 1)
    seg = torch.cumsum((masked & ~prev).long(), 1) - 1
    seg = torch.where(masked, seg, torch.zeros_like(seg))
    seg_max = torch.full_like(c, lowest).scatter_reduce(1, seg, c, reduce="amax", include_self=True)
    pick = c == seg_max.gather(1, seg)
    if low is not None:
        pick &= torch.gt(c, low)
    if threshold is not None:
        pick |= torch.gt(c, threshold)
    pick.scatter_(1, torch.argmax(c, 1, keepdim=True), True)
    return pick & masked


def _own(row) -> None:
    """A Credit rule's matrix as its own tensor (it was row j of a batch's stacked matrix)."""
    if row.shared is not None:
        row.credit, row.shared = row.matrix(), None


def fuse_credit(logits: torch.Tensor, masked: torch.Tensor, row) -> torch.Tensor:  # row: a Credit rule
    """dInfer's credit fusion (``CreditThresholdParallelDecoder``) for one row's candidates ``logits`` [w, V]: a
    float32 credit matrix for the block, decayed by ``decay_beta`` from its second step on, gains
    ``p_top1 ** boost_gamma`` at each masked position's top-1 token (float32 softmax); returns the float32 logits
    ``logits + credit_alpha * log(credit + 1)`` the decision is made on."""
    e = row.extra
    _own(row)
    if row.credit is None or row.credit.shape != logits.shape:
        row.credit = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    else:
        row.credit.mul_(e["decay_beta"])
    top_p, top_i = F.softmax(logits.to(torch.float32), dim=-1).max(-1)
    gain = top_p.pow(e["boost_gamma"]).to(torch.float32) * masked.to(torch.float32)
    row.credit.scatter_add_(1, top_i[:, None], gain[:, None])
    return logits + e["credit_alpha"] * torch.log(row.credit + 1)


def fuse_credit_rows(logits: torch.Tensor, masked: torch.Tensor, rules, widths: list[int]) -> torch.Tensor:
    """:func:`fuse_credit` for rows [R, K, V] whose rules share their parameters: the softmax, its top-1 and the
    gains computed for all rows at once; each row's credit matrix (its own state, [w, V]) decayed and fed by its own
    ``scatter_add_``; the fused logits ``logits + alpha * log(credit + 1)`` for all rows at once where every row's
    width is the batch's (else row by row). The same operations on the same values as row by row."""
    e = rules[0].extra
    R, K, V = logits.shape
    top_p, top_i = F.softmax(logits.to(torch.float32), dim=-1).max(-1)
    gain = top_p.pow(e["boost_gamma"]).to(torch.float32) * masked.to(torch.float32)
    if all(w == K for w in widths):     # the rows' credit matrices stacked: decayed and fed at once
        base = next((r.shared[0] for r in rules if r.shared is not None), None)
        if base is not None and base.shape == (R, K, V) and all(
                (r.shared is not None and r.shared[0] is base and r.shared[1] == j)
                or (r.shared is None and r.credit is None) for j, r in enumerate(rules)):
            # the same rows as the last step, in order, each inside its block or at a new block's start (zeroed)
            credit = base
            credit.mul_(e["decay_beta"])
            fresh = [j for j, r in enumerate(rules) if r.shared is None]
            if fresh:
                credit[upload(fresh, logits.device)] = 0
        else:
            for r in rules:
                _own(r)
            fresh = [j for j, r in enumerate(rules) if r.credit is None or r.credit.shape != (K, V)]
            if len(fresh) == R:
                credit = torch.zeros((R, K, V), dtype=torch.float32, device=logits.device)
            else:
                zero = logits.new_zeros((), dtype=torch.float32).expand(K, V)
                new = set(fresh)
                credit = torch.stack([zero if j in new else r.credit for j, r in enumerate(rules)])
                credit.mul_(e["decay_beta"])
                if fresh:
                    credit[upload(fresh, logits.device)] = 0
        credit.scatter_add_(2, top_i[..., None], gain[..., None])
        for j, r in enumerate(rules):       # each row's own matrix: row j of this step's
            r.credit, r.shared = None, (credit, j)
        return logits + e["credit_alpha"] * torch.log(credit + 1)
    for r in rules:
        _own(r)
    kept = [r.credit for r, w in zip(rules, widths) if r.credit is not None and r.credit.shape == (w, V)]
    if kept:
        torch._foreach_mul_(kept, e["decay_beta"])
    for j, (r, w) in enumerate(zip(rules, widths)):
        if r.credit is None or r.credit.shape != (w, V):
            r.credit = torch.zeros((w, V), dtype=torch.float32, device=logits.device)
        r.credit.scatter_add_(1, top_i[j, :w, None], gain[j, :w, None])
    out = torch.zeros(logits.shape, dtype=torch.promote_types(logits.dtype, torch.float32), device=logits.device)
    for j, (r, w) in enumerate(zip(rules, widths)):
        out[j, :w] = logits[j, :w] + e["credit_alpha"] * torch.log(r.credit + 1)
    return out


@dataclass
class DInferThreshold(Rule):
    """dInfer's threshold decoder (float32 confidences)."""
    threshold: float
    softmax: Softmax = Softmax.FLOAT32

    def select(self, conf, x0, masked, layout, row, mask_id):
        return select_dinfer_threshold(conf, x0, masked, self.threshold, mask_id)

    @staticmethod
    def select_rows(rules, conf, x0, masked, mask_id):
        thr = upload([r.threshold for r in rules], conf.device, conf.dtype)[:, None]
        return select_dinfer_threshold_rows(conf, x0, masked, thr, mask_id)


@dataclass
class Hierarchy(Rule):
    """dInfer's HierarchyDecoder (confidence = exp(log_softmax))."""
    threshold: float | None
    low: float | None
    softmax: Softmax = Softmax.EXP_LOG_SOFTMAX

    def select(self, conf, x0, masked, layout, row, mask_id):
        return select_hierarchy(conf, masked, self.threshold, self.low)

    def batch_key(self):
        return self.threshold, self.low

    @staticmethod
    def select_rows(rules, conf, x0, masked, mask_id):
        return select_hierarchy_rows(conf, masked, rules[0].threshold, rules[0].low)


@dataclass
class Credit(DInferThreshold):
    """dInfer's credit decoder: the threshold rule on logits fused with a per-block credit matrix (this row's)."""
    extra: dict = field(default_factory=dict)
    credit: torch.Tensor | None = None       # this row's credit matrix [w, V], or
    shared: tuple | None = None              # (a batch's stacked matrices [R, K, V], its row there)
    transforms_logits = True

    def start_block(self) -> None:
        self.credit = self.shared = None

    def matrix(self) -> torch.Tensor | None:
        """This row's credit matrix."""
        return self.credit if self.shared is None else self.shared[0][self.shared[1]]

    def transform(self, logits, masked):
        return fuse_credit(logits, masked, self)

    def batch_key(self):
        return self.extra["decay_beta"], self.extra["boost_gamma"], self.extra["credit_alpha"]

    @staticmethod
    def transform_rows(rules, logits, masked, widths):
        return fuse_credit_rows(logits, masked, rules, widths)


RULES = {"dinfer_blockwise": lambda p: DInferThreshold(p.threshold),
         "dinfer_hierarchy": lambda p: Hierarchy(p.threshold, p.extra["low_threshold"]),
         "dinfer_credit": lambda p: Credit(p.threshold, extra=p.extra)}
# the dual-cache loop (cached.run_dual), shared with dual_cache: block-only candidates, no extra cached step
DUAL_VARIANTS.update({name: Variant(rule, block_only=True, extra_cached_step=False) for name, rule in RULES.items()})

# dInfer's rules decide by threshold: no factor (Fast-dLLM's dynamic rule)
DINFER_PARAMS = tuple(p for p in COMMON_PARAMS if p.name != "factor")
VICINITY = (
    ParamInfo("prefix_look", 0, "positions before the block recomputed at every cached step"),
    ParamInfo("after_look", 0, "positions after the block recomputed at every cached step"),
    ParamInfo("warmup_steps", 1, "first steps of each block that run a full forward (cache refresh); at least 1"),
)


register(Algorithm(
    name="dinfer_blockwise",
    description="dInfer block-wise threshold decoding on the dual cache: commit every masked token with confidence "
                ">= min(threshold, best confidence), so each step commits at least one",
    cost=until_unmasked_cost,
    exact=False, run=run_dual, forward="dual_cache", cfg=False, defaults={"threshold": 0.9},
    params=DINFER_PARAMS, extra_params=VICINITY,
))
register(Algorithm(
    name="dinfer_hierarchy",
    description="dInfer hierarchical decoding on the dual cache: in each contiguous masked segment the most "
                "confident token above low_threshold, plus every token above threshold, plus the best one",
    cost=until_unmasked_cost,
    exact=False, run=run_dual, forward="dual_cache", cfg=False,
    defaults={"threshold": 0.9}, params=DINFER_PARAMS,
    extra_params=(ParamInfo("low_threshold", 0.4, "a segment's best token is committed above this"),) + VICINITY,
))
register(Algorithm(
    name="dinfer_credit",
    description="dInfer credit decoding on the dual cache: credit accumulated across a block's steps for each "
                "position's top-1 token is fused into the logits (logits + credit_alpha * log(1 + credit)) before "
                "the threshold rule",
    cost=until_unmasked_cost,
    exact=False, run=run_dual, forward="dual_cache", cfg=False, defaults={"threshold": 0.9},
    params=DINFER_PARAMS,
    # a decay above 1 grows the credit without bound, and a weight past a few thousand carries the logits past
    # float32: either makes infinities, and rows that never commit
    extra_params=(ParamInfo("credit_alpha", 0.7, "weight of log(1 + credit) added to the logits", maximum=1000),
                  ParamInfo("boost_gamma", 0.2, "a step adds p_top1 ** boost_gamma to its top-1 token's credit"),
                  ParamInfo("decay_beta", 0.8, "credit decay per step (at most 1)", maximum=1)) + VICINITY,
))
