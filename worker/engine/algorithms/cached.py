"""``prefix_cache`` and ``dual_cache``: Fast-dLLM's ``generate_with_prefix_cache`` / ``generate_with_dual_cache``,
each row with its own positions, padding and schedule, at any batch size.

At the start of each of its blocks a row takes one full forward, which stores every position's keys/values in the
row's cache slot and gives the block's first step. Its other steps of the block forward only a window and attend to
the cached row: ``prefix_cache`` forwards the block and everything after it (the prefix is cached), ``dual_cache``
only the block (prefix and suffix cached). Fresh window keys/values are written into the cache in place, so the
attention sees exactly the reference's keys: the cached prefix (and suffix) plus the fresh window. Transfer rules are
those of ``basic`` (fixed schedule, ``threshold`` or ``factor``); nfe counts every forward, the full one included.

Rows at a block start and rows in the middle of a block run as two forwards of the same iteration, so a row's
tokens never depend on where the others are."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ...models.layers import upload
from ..rows import Canvas, Finisher, Row, between_steps, window
from . import Algorithm, register
from ..params import until_unmasked_cost
from ..sampling import Layout, Softmax, fast_dllm_rule
from .basic import candidate_region, commit, mask_counts, start_block, step_done, whole_sequence


def _gather_logits(model, hidden: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """Logits at each row's hidden-state columns [start, end) ([B, K, V], rows padded with their last column)."""
    cols = window(spans, hidden.device).cols
    return model.logits(hidden.gather(1, cols[..., None].expand(-1, -1, hidden.shape[-1])))


def _full_step(row: Row) -> bool:
    """A block's first step (and its first ``warmup_steps``) runs a full forward that refreshes the whole cache."""
    return row.step < max(1, row.params.extra.get("warmup_steps", 0))


def fast_dllm(params):
    """Fast-dLLM's cached loops: its schedule or threshold/factor rule, confidences by a float64 softmax."""
    return fast_dllm_rule(params, Softmax.FLOAT64, Softmax.FLOAT64)


def _full_forward(model, canvas: Canvas, cache, gens, full: list[int], mask_id: int, out) -> None:
    """Rows ``full`` (batch indices) at a block start or warm-up: one full forward that refreshes their cache slots;
    ``out[b]`` = (region, layout, logits) to decide from (Fast-dLLM ranks the whole sequence here). A row's
    candidates are its block's positions only when its variant says so (dInfer), else the block extended back to any
    earlier masked position (Fast-dLLM)."""
    active = canvas.rows
    slots = None if len(full) == len(active) else upload(full, model.device)
    sel = slice(None) if slots is None else slots
    mask = None if canvas.mask is None else canvas.mask[sel]
    hidden = model(canvas.x[sel], canvas.pos[sel], mask, cache=cache, slots=slots)
    regions, spans = [], []
    for b in full:
        r = active[b]
        s, e = r.block_range() if r.state.block_only else candidate_region(r, gens[r.index], mask_id)
        regions.append((s, e))
        spans.append((canvas.gen_start(b) + s, canvas.gen_start(b) + e))
    lg = _gather_logits(model, hidden, spans)
    for i, b in enumerate(full):
        out[b] = (regions[i], whole_sequence(active[b], regions[i]), (lg, i, regions[i][1] - regions[i][0]))


def _window_forward(model, canvas: Canvas, cache, part: list[int], dual: bool, out) -> None:
    """Rows ``part`` inside a block: forward a window only (the block, widened by dInfer's vicinity refresh, for
    ``dual``; the block and everything after it otherwise), attending to the cached row; ``out[b]`` as above
    (Fast-dLLM ranks what it forwarded)."""
    active = canvas.rows
    wins, at, regions, layouts = [], [], [], []
    for b in part:
        r = active[b]
        s, e = r.block_range()
        g0 = canvas.gen_start(b)
        if dual:
            ws = max(s - r.params.extra.get("prefix_look", 0), -r.plan.prompt_length)
            we = min(e + r.params.extra.get("after_look", 0), r.plan.canvas_length)
        else:
            ws, we = s, r.plan.canvas_length
        wins.append((g0 + ws, g0 + we))
        at.append(s - ws)
        regions.append((s, e))
        layouts.append(Layout(e - s if dual else r.plan.canvas_length - s, 0))
    win = window(wins, model.device)
    cols = win.cols
    slots = None if len(part) == len(active) else upload(part, model.device)
    sel = slice(None) if slots is None else slots
    ids = canvas.x[sel].gather(1, cols)
    pos = canvas.pos[sel].gather(1, cols)
    mask = None if canvas.mask is None else canvas.mask[sel]
    hidden = model(ids, pos, mask, cache=cache, slots=slots, window=win.flat)
    lg = _gather_logits(model, hidden, [(a, a + active[b].plan.block_length) for a, b in zip(at, part)])
    for i, b in enumerate(part):
        out[b] = (regions[i], layouts[i], (lg, i, active[b].plan.block_length))


def _commit_all(canvas: Canvas, decided: list, mask_id: int, device, gens: dict[int, list[int]]) -> None:
    """One commit for every row from its (region, layout, logits): the regions padded to the widest with their last
    column. A row's logits are ``(batch logits, its row there, its first n columns)``: when every row is row b of one
    forward's logits with K columns (the usual step), those logits are the commit's as they are."""
    regions = [d[0] for d in decided]
    widths = [e - s for s, e in regions]
    K = max(widths)
    sources: dict[int, tuple[torch.Tensor, list[int], list[int], list[int]]] = {}   # forward -> its rows
    for b, (_, _, (lg, i, n)) in enumerate(decided):
        got = sources.setdefault(id(lg), (lg, [], [], []))
        got[1].append(b)
        got[2].append(i)
        got[3].append(n)
    B = len(decided)
    if len(sources) == 1:
        src, bs, is_, ns = next(iter(sources.values()))
        whole = src.shape[1] == K and src.shape[0] == B and is_ == bs == list(range(B)) and min(ns) == K
    if len(sources) == 1 and whole:
        logits = src
    else:                   # rows from two forwards (block starts beside windows), or narrower rows
        first = next(iter(sources.values()))[0]
        logits = torch.empty((B, K, first.shape[-1]), dtype=first.dtype, device=first.device)
        for src, bs, is_, ns in sources.values():
            if src.shape[1] == K and min(ns) == K:
                logits[upload(bs, device)] = src if is_ == list(range(src.shape[0])) else src[upload(is_, device)]
                continue
            for b, i, n in zip(bs, is_, ns):
                lg = src[i, :n]
                logits[b] = lg if n == K else torch.cat([lg, lg[-1:].expand(K - n, -1)])
    g0 = [canvas.gen_start(b) for b in range(len(decided))]
    win = window([(g + s, g + e) for g, (s, e) in zip(g0, regions)], device)    # [B, K]
    commit(canvas, logits, win, widths, mask_id, [d[1] for d in decided],
           mask_counts(canvas.rows, gens, regions, mask_id))


class Variant(NamedTuple):
    """How a row of a cached loop decides, by its algorithm (rows of several variants share one loop and its
    forwards when their windows are of one kind: ``dual_cache`` and the dInfer decoders)."""
    rule: Callable         # (params) -> the row's transfer rule
    block_only: bool       # a step's candidates are the block's positions only (dInfer), else the block extended
    #                        back to any earlier masked position (Fast-dLLM)
    extra_cached_step: bool    # the reference runs at least one cached step per block (Fast-dLLM, below)


FAST_DLLM = Variant(fast_dllm, block_only=False, extra_cached_step=True)


def run_cached(engine, rows: list[Row], fin: Finisher, dual: bool,
               variant: Callable[[Row], Variant] = lambda r: FAST_DLLM) -> None:
    """``variant(row)``: how the row decides (:class:`Variant`). A step: the full forward of the rows at a block
    start, the window forward of the others (the block alone for ``dual``, the block and everything after it
    otherwise), one commit for all, the finisher."""
    model, mask_id = engine.model, engine.mask_id
    canvas = Canvas(rows, mask_id, engine.pad_id, model.device)
    cache = model.new_cache(len(rows), canvas.x.shape[1])
    gens = canvas.read_gens()

    def setup(new: list[Row]) -> None:
        for r in new:
            v = r.state = variant(r)       # the row's own state in these loops: its variant
            r.rule = v.rule(r.params)
            start_block(r, gens[r.index], mask_id)
            # Fast-dLLM's loops run at least one cached step per block, even when the block-start step committed the
            # whole block (that step commits nothing but counts in nfe). Replicated for the reference's nfe without
            # early exit; with early exit a finished block moves on at once (the tokens are the same).
            r.min_block_steps = 2 if v.extra_cached_step and not fin.early_exit else 1

    setup(rows)
    while canvas.rows:
        new = between_steps(canvas, fin, cache)     # joining rows start with a full forward
        if new is None:
            break
        if new:
            gens = canvas.read_gens()
            setup(new)
        active = canvas.rows
        full, part = [], []
        for b, r in enumerate(active):
            (full if _full_step(r) else part).append(b)
        decided = [None] * len(active)
        if full:
            _full_forward(model, canvas, cache, gens, full, mask_id, decided)
        if part:
            _window_forward(model, canvas, cache, part, dual, decided)
        _commit_all(canvas, decided, mask_id, model.device, gens)
        gens, dropped = step_done(canvas, fin, mask_id)
        if dropped and dropped[0]:
            cache.keep(*dropped)
        yield      # a step is done: the engine may run other groups' steps (continuous batching)


register(Algorithm(
    name="prefix_cache",
    description="Fast-dLLM prefix KV cache: one full forward per block, then block+suffix forwards against the "
                "cached prefix; with threshold/factor, Fast-dLLM parallel decoding",
    cost=until_unmasked_cost, exact=True,
    run=lambda engine, rows, fin: run_cached(engine, rows, fin, dual=False),
    cfg=False,
))
DUAL_VARIANTS: dict[str, Variant] = {"dual_cache": FAST_DLLM}    # the dInfer decoders add theirs (dinfer.py)


def run_dual(engine, rows: list[Row], fin: Finisher) -> None:
    """The dual-cache loop of ``dual_cache`` and the dInfer decoders (``forward="dual_cache"``: one group, one
    forward of each kind a round), each row deciding by its own algorithm's variant."""
    return run_cached(engine, rows, fin, dual=True, variant=lambda r: DUAL_VARIANTS[r.params.algorithm])


register(Algorithm(
    name="dual_cache",
    description="Fast-dLLM dual KV cache: one full forward per block, then block-only forwards against the cached "
                "prefix and suffix; with threshold/factor, Fast-dLLM parallel decoding",
    cost=until_unmasked_cost, exact=True,
    run=run_dual, forward="dual_cache",
    cfg=False,
))
