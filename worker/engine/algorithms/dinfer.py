"""dInfer's decoding strategies (inclusionAI/dInfer), on the dual KV cache, each row with its own parameters at any
batch size. Not token-exact to a published loop (``exact: false``); the vicinity refresh generalises the dual cache:

- ``prefix_look`` / ``after_look``: every cached step also recomputes that many positions before / after the block
  (their keys/values refreshed with the current tokens);
- ``warmup_steps``: the first steps of each block run full forwards (the whole cache refreshed), at least one.

Every row also stops as soon as its answer is final (a stop token with no mask before it): the engine's exact early
exit, which covers dInfer's early stop at end-of-sequence inside a block."""
from __future__ import annotations

from . import Algorithm, ParamInfo, register
from .cached import run_cached

VICINITY = (
    ParamInfo("prefix_look", 0, "positions before the block recomputed at every cached step"),
    ParamInfo("after_look", 0, "positions after the block recomputed at every cached step"),
    ParamInfo("warmup_steps", 1, "first steps of each block that run a full forward (cache refresh); at least 1"),
)


def _run(engine, rows, fin):
    run_cached(engine, rows, fin, dual=True)


register(Algorithm(
    name="dinfer_blockwise",
    description="dInfer block-wise threshold decoding on the dual cache: commit every masked token with confidence "
                ">= min(threshold, best confidence), so each step commits at least one",
    exact=False, run=_run, cfg=False, defaults={"threshold": 0.9}, extra_params=VICINITY,
))
register(Algorithm(
    name="dinfer_hierarchy",
    description="dInfer hierarchical decoding on the dual cache: in each contiguous masked segment the most "
                "confident token above low_threshold, plus every token above threshold, plus the best one",
    exact=False, run=_run, cfg=False, defaults={"threshold": 0.9},
    extra_params=(ParamInfo("low_threshold", 0.4, "a segment's best token is committed above this"),) + VICINITY,
))
register(Algorithm(
    name="dinfer_credit",
    description="dInfer credit decoding on the dual cache: credit accumulated across a block's steps for each "
                "position's top-1 token is fused into the logits (logits + credit_alpha * log(1 + credit)) before "
                "the threshold rule",
    exact=False, run=_run, cfg=False, defaults={"threshold": 0.9},
    extra_params=(ParamInfo("credit_alpha", 0.7, "weight of log(1 + credit) added to the logits"),
                  ParamInfo("boost_gamma", 0.2, "a step adds p_top1 ** boost_gamma to its top-1 token's credit"),
                  ParamInfo("decay_beta", 0.8, "credit decay per step")) + VICINITY,
))
