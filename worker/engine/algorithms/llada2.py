"""``llada2``: LLaDA2's block diffusion (the checkpoint's ``modeling_llada2_moe.py`` ``LLaDA2MoeModelLM.generate``)
with an exact KV cache, each row with its own prompt length, block length and parameters at any batch size.

A row's sequence (prompt, then masks up to a multiple of ``block_length``) is cut into blocks counted from position 0;
attention is block-causal. Blocks are denoised in turn from the one holding the end of the prompt. Each step (while
the block has a masked position) forwards the block, samples a token and its probability at each of its positions
(``temperature`` 0: the softmax's argmax; else the logits divided by it, ``top_k`` / ``top_p`` filtering, one
multinomial draw per position from the row's generator), and commits every masked position whose probability
exceeds ``threshold`` when there are at least the step's scheduled count of them, else the scheduled count of the
most probable (at most the masks left). The schedule spreads ``block_length`` over ``denoising_steps`` (capped at
``gen_length // minimal_topk``; the remainder to the first steps).

The reference recomputes the whole prefix in every forward. Here the first forward of a block also covers the block
before it (or, for the first block, the prompt's whole blocks), writing their final keys/values into the row's cache
slot; the block's other steps forward the block alone against the cache. A finished block's keys/values never change
(no earlier position attends to it), so the cache is exact, and the forward count is the reference's: one per step.
``kv_cache: false`` recomputes the prefix as the reference does (the same tokens; for comparison). A block becomes
final when its masks are gone, so answers stream and end (early exit at a stop token, as the reference's ``eos_id``
check after each block) only at block boundaries; with ``ignore_eos`` every block is generated (``eos_id=None``)."""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ...models.layers import upload
from ..params import GenerationParams, ParamError, whole_block_positions
from ..rows import Finisher, Row, read_with, record_block_logprobs
from . import Algorithm, ParamInfo, register
from .block_causal import BlockBatch, block_positions, check_common, choose, subset
from .sdar import draw_rows, filtered_probs, sample as sample_filtered, sampling_key, transfer_schedule


def sample(logits: torch.Tensor, p: GenerationParams, g: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, their probabilities) at every position, as the reference's ``_sample_with_temperature_topk_topp``."""
    if p.temperature == 0:
        probs = F.softmax(logits, dim=-1)
        token = torch.argmax(probs, dim=-1, keepdim=True)
        return token[:, 0], torch.gather(probs, -1, token)[:, 0]
    return sample_filtered(logits, p, g)


def sample21(logits: torch.Tensor, p: GenerationParams, g: torch.Generator | None):
    """LLaDA2.1's sampler: greedy is the logits' argmax (2.0 takes the softmax's)."""
    if p.temperature == 0:
        token = torch.argmax(logits, dim=-1, keepdim=True)
        return token[:, 0], torch.gather(F.softmax(logits, dim=-1), -1, token)[:, 0]
    return sample_filtered(logits, p, g)


def edits21(cur: torch.Tensor, token: torch.Tensor, prob: torch.Tensor, p: GenerationParams, r: Row, start: int,
            mask_id: int) -> torch.Tensor:
    """LLaDA2.1's edits on a block (``cur``): every generated (not prompt, not masked) position whose new token
    differs with probability above ``editing_threshold`` (bool [block_length])."""
    generated = torch.arange(start, start + cur.shape[0], device=cur.device) >= r.plan.prompt_length
    return (cur != mask_id) & generated & (prob > p.extra["editing_threshold"]) & (token != cur)


class _State:
    """The block a row is denoising, its step, and how far its sequence is final."""
    __slots__ = ("block", "step", "total", "final", "stored", "post", "idle", "fresh", "reused")

    def __init__(self, row: Row, bl: int):
        P = row.plan.prompt_length
        self.total = -(-(P + row.plan.gen_length) // bl) * bl         # positions, whole blocks
        self.block = P // bl
        self.step = 0
        self.final = self.block * bl            # positions before it never change again
        self.stored = 0                          # positions whose final keys/values are in the cache
        self.post = 0                            # llada21: forwards of this block after its masks were gone
        self.idle = False                        # llada21: the last step neither unmasked nor edited a position
        self.fresh = True                        # its first forward (which computes its prompt blocks) is to come
        self.reused = 0                          # prompt blocks taken from the prefix cache


def run(engine, rows: list[Row], fin: Finisher) -> None:
    model, mask_id, dev = engine.model, engine.mask_id, engine.model.device

    def reused(r: Row, n: int) -> None:        # the prefix cache gave the row its first n positions
        s = r.state
        s.stored, s.reused = n, n // r.params.block_length
    batch = BlockBatch(engine, rows, lambda r: setattr(r, "state", _State(r, r.params.block_length)),
                       reusable=lambda r: prefix_blocks(r.plan, None)[1], reused=reused)

    while batch.between_steps(fin):
        active = batch.active
        spans, at = [], []
        for r in active:
            s, bl = r.state, r.params.block_length
            start = s.stored if r.params.extra["kv_cache"] else 0
            spans.append((start, (s.block + 1) * bl))
            at.append(s.block * bl - start)          # window index of the block's first position
        hidden = batch.forward(spans)
        B = len(active)
        logits = model.logits(hidden.gather(1, block_positions(at, [r.params.block_length for r in active], dev)[
            :, :, None].expand(-1, -1, hidden.shape[-1]))).float()
        x = batch.x
        counts = [r.params.extra["num_to_transfer"] if r.params.algorithm == "llada21"
                  else transfer_schedule(r.params.block_length, r.params.extra["denoising_steps"])[r.state.step]
                  for r in active]
        groups: dict[tuple, list[int]] = {}        # rows without logprobs: sampled, chosen and written together
        singles = []
        for b, r in enumerate(active):
            p = r.params
            if r.logprobs is None:
                groups.setdefault((p.algorithm, p.block_length, sampling_key(p) if p.temperature else None),
                                  []).append(b)
            else:
                singles.append(b)
        flag_rows, flag_values = [], []          # LLaDA2.1's end rule: whether each block had masks, and was edited
        for (alg, bl, sampled), members in groups.items():
            rows = [active[b] for b in members]
            idx = subset(members, B, dev)       # None: every row, in order
            cols = upload([r.state.block * bl for r in rows], dev)[:, None] + torch.arange(bl, device=dev)
            cur = x.gather(1, cols) if idx is None else x[idx[:, None], cols]
            lg = logits[:, :bl] if idx is None else logits[idx, :bl]
            if sampled is None:          # greedy: one sampler call for the group
                token, prob = (sample21 if alg == "llada21" else sample)(lg.reshape(-1, lg.shape[-1]),
                                                                       rows[0].params, None)
                token, prob = token.view(len(members), bl), prob.view(len(members), bl)
            else:                        # each row draws from its own generator, the draws made together
                probs = filtered_probs(lg.reshape(-1, lg.shape[-1]), rows[0].params).view(lg.shape)
                token, prob = draw_rows(probs, [r.generator for r in rows])
            masked = cur == mask_id
            # unmasking by threshold (at least the row's count, at most the masks left), every row of the group in
            # one pass: no read of the device per row (a block without masks unmasks nothing)
            write = choose(masked, prob, [counts[b] for b in members], [r.params.threshold for r in rows],
                           ["threshold"] * len(members), True)
            if alg == "llada21":         # edits21 for every row of the group
                prompt = upload([r.plan.prompt_length for r in rows], dev)[:, None]
                edit_thr = upload([r.params.extra["editing_threshold"] for r in rows], dev, prob.dtype)[:, None]
                edit = (cur != mask_id) & (cols >= prompt) & (prob > edit_thr) & (token != cur)
                flag_rows.append(members)
                flag_values.append(torch.stack([masked.any(1), edit.any(1)], 1))
                write = write | edit
            new = torch.where(write, token, cur)
            if idx is None:
                x.scatter_(1, cols, new)
            else:
                x[idx[:, None], cols] = new
        for b in singles:                # rows with logprobs, one by one
            r = active[b]
            s, bl, p = r.state, r.params.block_length, r.params
            start = s.block * bl
            cur = x[b, start:start + bl]
            token, prob = (sample21 if p.algorithm == "llada21" else sample)(logits[b, :bl], p, r.generator)
            masked = cur == mask_id
            write = choose(masked[None], prob[None], [counts[b]], [p.threshold], ["threshold"], True)[0]
            if p.algorithm == "llada21":
                edit = edits21(cur, token, prob, p, r, start, mask_id)
                flag_rows.append([b])
                flag_values.append(torch.stack([masked.any(), edit.any()])[None])
                write = write | edit
            new = torch.where(write, token, cur)
            record_block_logprobs(r, cur, new, start, logits[b, :bl])
            x[b, start:start + bl] = new
        # the host copy, read once (with every row's flags)
        xc, read = read_with(x, torch.cat(flag_values).to(x.dtype) if flag_rows else None)
        if flag_rows:
            for b, (had_masks, edited) in zip((b for rows in flag_rows for b in rows), read):
                s = active[b].state
                s.post += not had_masks
                s.idle = not had_masks and not edited
        for b, r in enumerate(active):
            s, bl = r.state, r.params.block_length
            r.nfe += 1
            if s.fresh and r.params.extra["kv_cache"]:   # its prompt's whole blocks are final in the cache: share
                batch.share(b, s.reused, r.plan.prompt_length // bl)
            s.fresh = False
            s.stored = s.block * bl                   # the blocks before this one are in the cache now
            s.step += 1
            start = s.block * bl
            schedule_done = False
            masks_left = mask_id in xc[b][start:start + bl]      # the host copy: no device read
            if r.params.algorithm == "llada21":
                # the reference's loop ends when a step after the masks neither unmasks nor edits, or before the
                # forward that would exceed max_post_steps
                block_done = s.idle or (not masks_left and s.post + 1 > r.params.extra["max_post_steps"])
            else:
                # the reference checks for masks before each forward and runs at most denoising_steps of them
                block_done = not masks_left or s.step >= r.params.extra["denoising_steps"]
            if block_done:
                s.final = start + bl
                if s.final >= s.total:
                    schedule_done = True
                else:
                    s.block, s.step, s.post, s.idle = s.block + 1, 0, 0, False
            batch.report(fin, b, xc, s.final, schedule_done)
        batch.retire()
        yield      # a step is done: the engine may run other groups' steps (continuous batching)


def check(p: GenerationParams) -> GenerationParams:
    check_common(p, "llada2", "threshold and algorithm_params.denoising_steps (steps per block)")
    e = p.extra
    if e["minimal_topk"] < 1:
        raise ParamError("algorithm_params", f"llada2: minimal_topk must be at least 1, got {e['minimal_topk']!r}")
    steps = e["denoising_steps"] or p.block_length
    if steps < 1:
        raise ParamError("algorithm_params", f"llada2: denoising_steps must be at least 1, got {steps!r}")
    steps = min(steps, p.gen_length // e["minimal_topk"])
    if steps < 1:
        raise ParamError("algorithm_params", "llada2: max_tokens // minimal_topk must be at least 1")
    threshold = 0.95 if p.threshold is None else p.threshold
    return replace(p, threshold=threshold, extra={**e, "denoising_steps": steps})


BLOCK = ParamInfo("block_length", 32, "block size")
SEED = ParamInfo("seed", None, "per-request seed for the sampling")
SAMPLING_AND_CACHE = (
    ParamInfo("top_k", 0, "top-k filtering (0: off)"),
    ParamInfo("top_p", 1.0, "nucleus filtering (1: off)"),
    ParamInfo("kv_cache", True, "false: recompute the prefix in every forward as the reference does (the same "
              "tokens at a higher cost; for comparison)"),
)

def prefix_blocks(plan, cache) -> tuple[int, int]:
    """Every whole prompt block (the first forward covers the uncached ones and the first block to denoise); none
    without the KV cache."""
    bl = plan.params.block_length
    return bl, plan.prompt_length // bl if plan.params.extra["kv_cache"] else 0


register(Algorithm(
    name="llada2",
    description="LLaDA2 block diffusion (LLaDA2MoeModelLM.generate): block-causal attention with an exact KV cache, "
                "threshold decoding within each block",
    exact=True, run=run, forward="llada2", cfg=False, check=check, positions=whole_block_positions,
    stochastic=lambda p: p.temperature > 0, prefix_blocks=prefix_blocks,
    params=(
        BLOCK,
        ParamInfo("threshold", 0.95, "commit every masked position of the block whose probability exceeds it (at "
                  "least the step's scheduled count)"),
        ParamInfo("temperature", 0.0, "0 = greedy (argmax); > 0 divides the logits before top_k / top_p"),
        SEED,
    ),
    extra_params=(
        ParamInfo("denoising_steps", None, "steps per block (default: block_length), capped at "
                  "max_tokens // minimal_topk", kind="int"),
        ParamInfo("minimal_topk", 1, "caps denoising_steps at max_tokens // minimal_topk"),
    ) + SAMPLING_AND_CACHE,
))


def check21(p: GenerationParams) -> GenerationParams:
    check_common(p, "llada21", "threshold, algorithm_params.num_to_transfer and editing_threshold")
    e = p.extra
    if e["num_to_transfer"] < 1:
        raise ParamError("algorithm_params", f"llada21: num_to_transfer must be at least 1, got {e['num_to_transfer']!r}")
    if e["num_to_transfer"] > p.block_length:
        raise ParamError("algorithm_params", f"llada21: num_to_transfer ({e['num_to_transfer']}) cannot be more than "
                                             f"block_length ({p.block_length}): a step commits within its block")
    return replace(p, threshold=0.95 if p.threshold is None else p.threshold)


register(Algorithm(
    name="llada21",
    description="LLaDA2.1 block diffusion with token editing (its generate): each block unmasked by threshold, then "
                "generated tokens re-predicted and edited until a step changes nothing; exact KV cache",
    exact=True, run=run, forward="llada2", cfg=False, check=check21, positions=whole_block_positions,
    stochastic=lambda p: p.temperature > 0, prefix_blocks=prefix_blocks,
    params=(
        BLOCK,
        ParamInfo("threshold", 0.95, "unmask every masked position of the block whose probability exceeds it (at "
                  "least num_to_transfer)"),
        ParamInfo("temperature", 0.0, "0 = greedy (argmax of the logits); > 0 divides the logits before top_k / "
                  "top_p"),
        SEED,
    ),
    extra_params=(
        ParamInfo("editing_threshold", 0.9, "replace a generated token of the block by a different prediction whose "
                  "probability exceeds it"),
        ParamInfo("max_post_steps", 16, "at most this many editing steps after a block's masks are gone"),
        ParamInfo("num_to_transfer", 1, "positions unmasked per step when none is above threshold"),
    ) + SAMPLING_AND_CACHE,
))
