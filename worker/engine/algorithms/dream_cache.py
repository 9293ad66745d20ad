"""``dream_cache`` and ``dream_dual_cache``: Fast-dLLM's Dream caches (``dream/model/generation_utils_block.py``
``_sample`` with ``dual_cache`` False / True), each row with its own prompt length and parameters at any batch size.

The generation is split into blocks of ``block_length``. Each block starts with one full forward of the row, which
stores every position's keys/values in the row's cache slot and commits the block's first position (the proposal
from the shifted logits, whatever its confidence). The block's other steps forward a window and attend to the cached
row with the window's fresh keys/values: ``dream_cache`` forwards the block and everything after it (the prefix is
cached), ``dream_dual_cache`` the block only (prefix and suffix cached). Inside a window the logits are shifted
within the window, as the reference does (the window's first position keeps its own). A step commits:

- with ``threshold``: the most confident masked position of the block and every other one whose confidence
  (probability of the proposal, softmax in the model's dtype) is at least the threshold, until the block has no mask;
- otherwise the reference's entropy schedule: ``steps / blocks`` steps per block (the full forward is step 0),
  step i committing ``int(m * (1 - t[i+1] / t[i]))`` of the block's m masked positions by lowest entropy (all at the
  last step), ``alg_temp`` as in ``dream``.

nfe counts every forward, the full ones included. Exact at temperature 0; with ``temperature > 0`` each row samples
from its own generator only at the positions it decides (the reference draws for every position of every forward from
the global generator), so seeded rows reproduce themselves, not the reference's draws."""
from __future__ import annotations

import torch

from ...models.layers import upload
from ..params import GenerationParams, ParamError
from ..rows import Canvas, Finisher, Row, between_steps, nonzero_rows, record_row_logprobs, window
from . import Algorithm, ParamInfo, register
from .dream import (CONFIDENCE, DREAM_PARAMS, Choice, check_sampling, decide, decide_together, ratios,
                    sample_tokens, together, transfer_count)


def steps_per_block(row: Row) -> int:
    """The reference's ``steps // num_blocks``, rounded up when it does not divide (the reference asserts it does);
    not capped at the block length."""
    steps = row.params.steps or row.plan.gen_length
    return max(1, -(-steps // row.plan.num_blocks))


def threshold_step(p: GenerationParams, g, logits: torch.Tensor, where: torch.Tensor, length: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fast-dLLM's Dream threshold rule over the ``length`` positions of the window: rank the block's masked
    positions ``where`` by confidence with ``torch.topk``; keep the first and every other one not below the
    threshold."""
    conf, x0 = sample_tokens(logits, p, g, "probability")
    full = torch.full((1, length), float("-inf"), dtype=conf.dtype, device=conf.device)
    full[0, where] = conf
    values, idx = torch.topk(full, where.shape[0])
    keep = ~(values[0] < p.threshold)
    keep[:1] = True
    token = torch.full((length,), -1, dtype=torch.long, device=x0.device)
    token[where] = x0
    pick = idx[0][keep]
    return pick, token[pick]


def _block_starts(model, canvas: Canvas, cache, full: list[int], starts: list[int]) -> None:
    """Rows ``full`` at a block start: one full forward into their cache slots, then each commits the block's first
    position from the (shifted) logit before it."""
    active, x, dev = canvas.rows, canvas.x, model.device
    slots = None if len(full) == len(active) else upload(full, dev)
    sel = slice(None) if slots is None else slots
    mask = None if canvas.mask is None else canvas.mask[sel]
    hidden = model(x[sel], canvas.pos[sel], mask, cache=cache, slots=slots)
    src = upload([starts[b] - 1 for b in full], dev)      # shifted logits
    logits = model.logits(hidden[torch.arange(len(full), device=dev), src])
    for i, b in enumerate(full):
        r = active[b]
        _, x0 = sample_tokens(logits[i:i + 1], r.params, r.generator, "probability")
        x[b, starts[b]] = x0[0]
        if r.logprobs is not None:
            r.logprobs.record(torch.tensor([r.block * r.plan.block_length]), x0, logits[i:i + 1])
        r.step = 1


def _block_steps(model, canvas: Canvas, cache, part: list[int], starts: list[int], dual: bool,
                 mask_id: int) -> None:
    """Rows ``part`` inside a block: a window forward against the cached row (the block for ``dual``, the block and
    everything after it otherwise), then each row's rule commits some of the block's masked positions (threshold, or
    the entropy schedule: ``step`` -1 once its steps are used)."""
    active, x, dev, W = canvas.rows, canvas.x, model.device, canvas.x.shape[1]
    wins = [(starts[b], starts[b] + active[b].plan.block_length if dual else W) for b in part]
    win = window(wins, dev)
    cols = win.cols
    slots = None if len(part) == len(active) else upload(part, dev)
    sel = slice(None) if slots is None else slots
    ids = x[sel].gather(1, cols)
    mask = None if canvas.mask is None else canvas.mask[sel]
    hidden = model(ids, canvas.pos[sel].gather(1, cols), mask, cache=cache, slots=slots, window=win.flat)
    bl = [active[b].plan.block_length for b in part]
    top = max(bl)          # each row's block: the first bl[i] positions of its window; one read for all rows
    in_block = ids[:, :top] == mask_id
    if min(bl) < top:
        in_block &= torch.arange(top, device=dev)[None, :] < upload(bl, dev)[:, None]
    src_b, where_all, counts = nonzero_rows(in_block)
    src_w = (where_all - 1).clamp(min=0)           # shifted within the window
    logits = model.logits(hidden[src_b, src_w]) if len(src_b) else None
    at, choices = 0, []
    for i, b in enumerate(part):
        r = active[b]
        n, length = counts[i], wins[i][1] - wins[i][0]
        spb = steps_per_block(r)
        thr = r.params.threshold
        if n and together(r.params, r.logprobs):      # decided below with the other rows
            count = n if thr is not None else transfer_count(n, r.state[r.step], r.step >= spb - 1)
            choices.append(Choice(b, i, at, at + n, length, starts[b], count, thr,
                                  "probability" if thr is not None else CONFIDENCE["entropy"], r.params,
                                  r.generator))
        elif n:
            lg, where = logits[at:at + n], where_all[at:at + n]
            if thr is not None:
                pick, tokens = threshold_step(r.params, r.generator, lg, where, length)
            else:
                pick, tokens = decide(r.params, r.generator, lg, where, length, r.state[r.step],
                                      r.step >= spb - 1, "entropy")
            x[b, starts[b] + pick] = tokens
            record_row_logprobs(r, where, pick, r.block * r.plan.block_length + pick, tokens, lg)
        at += n
        if thr is None:
            r.step += 1
        r.nfe += 1
        if thr is None and r.step == spb:
            r.step = -1        # the schedule is over: the block ends below, masks or not
    if choices:
        decide_together(choices, logits, src_b, where_all, x)


def _finish_block(r: Row) -> bool:
    """Move to the next block; True when the row has none left."""
    if r.block + 1 >= r.plan.num_blocks:
        return True
    r.block, r.step = r.block + 1, 0
    return False


def _account(canvas: Canvas, cache, fin: Finisher, full: list[int], part: list[int], mask_id: int) -> None:
    """After the step: a block-start forward counts in nfe; a block ends when clear (checked after each cached step,
    and, with the entropy schedule, before one) or when its schedule is over; finished rows leave."""
    active = canvas.rows
    gens = canvas.read_gens()
    done = []
    for b, r in enumerate(active):
        if b in full:
            r.nfe += 1
        s, e = r.block_range()
        block_clear = mask_id not in gens[r.index][s:e]
        schedule_done = False
        if (b in part and (block_clear or r.step == -1)) or (
                b in full and r.params.threshold is None and steps_per_block(r) == 1):
            schedule_done = _finish_block(r)
        fin.update(r, gens[r.index], schedule_done)
        if r.done:
            done.append(b)
    if done:
        keep = [b for b in range(len(active)) if b not in done]
        trim = canvas.keep(keep)
        if canvas.rows:
            cache.keep(keep, trim)


def run_dream_cache(engine, rows: list[Row], fin: Finisher, dual: bool) -> None:
    """A step: the block-start forward of the rows beginning a block, the window forward of the others, then the
    accounting (block ends, finished rows)."""
    model, mask_id, dev = engine.model, engine.mask_id, engine.model.device
    canvas = Canvas(rows, mask_id, engine.pad_id, dev)
    cache = model.new_cache(len(rows), canvas.x.shape[1])

    def setup(new: list[Row]) -> None:
        for r in new:
            if r.params.threshold is None:
                r.state = ratios(r.params, steps_per_block(r), dev)       # its schedule
            r.block, r.step = 0, 0      # step 0 = the block's full forward; then i = 1, 2, ... as the reference's

    setup(rows)
    while canvas.rows:
        new = between_steps(canvas, fin, cache)     # joining rows start with a full forward
        if new is None:
            break
        if new:
            setup(new)
        active = canvas.rows
        starts = [canvas.gen_start(b) + r.block * r.plan.block_length for b, r in enumerate(active)]
        full = [b for b, r in enumerate(active) if r.step == 0]
        part = [b for b, r in enumerate(active) if r.step > 0]
        if full:
            _block_starts(model, canvas, cache, full, starts)
        if part:
            _block_steps(model, canvas, cache, part, starts, dual, mask_id)
        _account(canvas, cache, fin, full, part, mask_id)
        yield      # a step is done: the engine may run other groups' steps (continuous batching)


def check(p: GenerationParams) -> GenerationParams:
    if p.factor is not None:
        raise ParamError("factor", "the Dream caches take threshold (parallel decoding) or steps, not factor")
    if p.remasking != "low_confidence":
        raise ParamError("remasking", "the Dream caches have no remasking option")
    check_sampling(p)
    return p


CACHE_PARAMS = tuple(i for i in DREAM_PARAMS if i.name != "alg")
COMMON = (
    ParamInfo("steps", None, "without threshold: the entropy schedule's steps over the whole generation (default: one "
              "per token), steps / blocks per block, the block's full forward included"),
    ParamInfo("block_length", 32, "block size; max_tokens is rounded up to a multiple of it internally"),
    ParamInfo("threshold", None, "parallel decoding: commit the most confident masked token of the block plus every "
              "other one with confidence >= threshold (steps is then ignored)"),
    ParamInfo("temperature", 0.0, "0 = the most likely token; > 0 divides the logits and samples"),
    ParamInfo("seed", None, "per-request seed for temperature sampling and alg_temp"),
)


def stochastic(p: GenerationParams) -> bool:
    return bool(p.extra.get("alg_temp"))


for _name, _dual, _what in (("dream_cache", False, "block + suffix forwards against the cached prefix"),
                            ("dream_dual_cache", True, "block-only forwards against the cached prefix and suffix")):
    register(Algorithm(
        name=_name,
        description=f"Fast-dLLM's Dream cache: one full forward per block (committing its first token), then {_what}; "
                    f"threshold parallel decoding, or the entropy schedule",
        exact=True, run=(lambda dual: lambda engine, rows, fin: run_dream_cache(engine, rows, fin, dual))(_dual),
        cfg=False, params=COMMON, extra_params=CACHE_PARAMS, check=check, stochastic=stochastic,
        ))
