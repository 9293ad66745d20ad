"""``basic``: the LLaDA reference loop (ML-GSAI/LLaDA ``generate.py``), and Fast-dLLM's ``generate`` when the row
carries ``threshold`` or ``factor``. Every step is one forward over each row's whole sequence (no cache)."""
from __future__ import annotations

import torch

from ...models.layers import upload
from ..rows import (Canvas, Finisher, Row, Window, between_steps, record_logprobs, wants_logprobs, window,
                    write_chosen)
from ..params import until_unmasked_cost
from ..sampling import Layout, Softmax, denoise, fast_dllm_rule
from . import Algorithm, register


def candidate_region(row: Row, gen: list[int], mask_id: int) -> tuple[int, int]:
    """[start, end) in generation coordinates of the positions this step may commit: the current block, extended
    back to any earlier position still masked (possible only when the model proposed the mask token itself; the
    reference ranks those together with the block)."""
    start, end = row.block_range()
    try:
        first = gen.index(mask_id)      # one scan up to the first mask, usually in the block: no exception raised
    except ValueError:
        first = start
    return min(first, start), end


def start_block(row: Row, gen: list[int], mask_id: int) -> None:
    s, e = row.block_range()
    row.step = 0
    row.rule.start_block()
    row.block_masks = sum(1 for t in gen[s:e] if t == mask_id)


def advance(row: Row, gen: list[int], mask_id: int) -> bool:
    """Account one step of ``row``; move to the next block when this one is done. True when the row's whole
    schedule is done."""
    row.nfe += 1
    row.step += 1
    s, e = row.block_range()
    if row.fixed_steps:
        block_done = row.step >= row.plan.steps_per_block
    else:   # until the block has no mask (a safety cap, never reached unless the model keeps proposing the mask)
        block_done = (mask_id not in gen[s:e] and row.step >= row.min_block_steps) \
            or row.step >= 4 * row.plan.block_length
    if not block_done:
        return False
    if row.block + 1 >= row.plan.num_blocks:
        return True
    row.block += 1
    start_block(row, gen, mask_id)
    return False


def whole_sequence(row: Row, region: tuple[int, int]) -> Layout:
    """The topk vector of a step that forwards the whole sequence (LLaDA's ``generate``, Fast-dLLM's ``generate`` and
    a cache's block-start step): prompt + canvas, the candidates from ``region``'s start."""
    return Layout(row.plan.prompt_length + row.plan.canvas_length, row.plan.prompt_length + region[0])


def commit(canvas: Canvas, logits: torch.Tensor, win: Window, widths: list[int], mask_id: int,
           layouts: list[Layout | None], counts: list[int] | None = None) -> None:
    """Decide this step for every row (candidates at the canvas columns of ``win``; ``counts``: how many of each
    row's are masked, when known on the host) and write the chosen tokens."""
    gidx = win.cols
    tokens = canvas.x.gather(1, gidx)
    x0, chosen = denoise(logits, tokens, widths, canvas.rows, mask_id, layouts, win.valid, counts)
    if wants_logprobs(canvas.rows):
        bi, ki = chosen.nonzero(as_tuple=True)
        canvas.x[bi, gidx[bi, ki]] = x0[bi, ki]
        starts = upload([canvas.gen_start(b) for b in range(len(canvas.rows))], gidx.device)
        record_logprobs(canvas.rows, bi, gidx[bi, ki] - starts[bi], x0[bi, ki], logits[bi, ki])
        return
    write_chosen(canvas.x, gidx, win.last, chosen, x0, tokens)


def mask_counts(rows: list[Row], gens: dict[int, list[int]], regions: list[tuple[int, int]], mask_id: int) -> list[int]:
    """How many of each row's candidates (its generated canvas's ``regions[b]``) are masked, from the host copy of the
    canvas (``gens``, read at the end of the last step): what a threshold rule's ranking needs, without a read."""
    return [gens[r.index][s:e].count(mask_id) for r, (s, e) in zip(rows, regions)]


def step_done(canvas: Canvas, fin: Finisher, mask_id: int) -> tuple[dict, tuple[list[int], int] | None]:
    """Account the step for every row, finish rows, drop finished ones from the canvas. Returns the rows' generated
    canvases and, when rows were dropped, (kept batch indices, columns trimmed) for a cache to follow."""
    gens = canvas.read_gens()
    done = []
    for b, r in enumerate(canvas.rows):
        gen = gens[r.index]
        fin.update(r, gen, advance(r, gen, mask_id))
        if r.done:
            done.append(b)
    if not done:
        return gens, None
    keep = [b for b in range(len(canvas.rows)) if b not in done]
    return gens, (keep, canvas.keep(keep))


def run(engine, rows: list[Row], fin: Finisher) -> None:
    model, mask_id = engine.model, engine.mask_id
    canvas = Canvas(rows, mask_id, engine.pad_id, model.device)
    gens = canvas.read_gens()
    for r in rows:
        # LLaDA generate.py takes the softmax in the logits' dtype; Fast-dLLM's generate (threshold/factor) in float64
        r.rule = fast_dllm_rule(r.params, Softmax.MODEL, Softmax.FLOAT64)
        start_block(r, gens[r.index], mask_id)
    while canvas.rows:
        new = between_steps(canvas, fin)
        if new is None:
            break
        if new:
            gens = canvas.read_gens()
            for r in new:
                r.rule = fast_dllm_rule(r.params, Softmax.MODEL, Softmax.FLOAT64)
                start_block(r, gens[r.index], mask_id)
        active = canvas.rows
        B = len(active)
        regions = [candidate_region(r, gens[r.index], mask_id) for r in active]
        win = window([(canvas.gen_start(b) + s, canvas.gen_start(b) + e) for b, (s, e) in enumerate(regions)],
                     model.device)
        gidx = win.cols

        cfg = [b for b, r in enumerate(active) if r.params.cfg_scale > 0]
        x, pos, mask = canvas.x, canvas.pos, canvas.mask
        if cfg:
            xu, pu, mu = canvas.uncond(cfg)
            x, pos = torch.cat([x, xu]), torch.cat([pos, pu])
            mask = None if mask is None else torch.cat([mask, mu])
        hidden = model(x, pos, mask)
        D = hidden.shape[-1]
        h = hidden[:B].gather(1, gidx[..., None].expand(-1, -1, D))
        logits = model.logits(h)
        if cfg:
            hu = hidden[B:].gather(1, gidx[cfg][..., None].expand(-1, -1, D))
            lu = model.logits(hu)
            for i, b in enumerate(cfg):   # the reference's order, with its Python-float scale
                logits[b] = lu[i] + (active[b].params.cfg_scale + 1) * (logits[b] - lu[i])

        commit(canvas, logits, win, [e - s for s, e in regions], mask_id,
               [whole_sequence(r, reg) for r, reg in zip(active, regions)], mask_counts(active, gens, regions, mask_id))
        gens, _ = step_done(canvas, fin, mask_id)
        yield      # a step is done: the engine may run other groups' steps (continuous batching)


register(Algorithm(
    name="basic",
    description="LLaDA reference sampler: semi-autoregressive blocks, linear transfer schedule, full forward each "
                "step; with threshold/factor, Fast-dLLM parallel decoding without cache",
    cost=until_unmasked_cost, exact=True,
    run=run,
))
