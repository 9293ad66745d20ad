"""``nemotron``: NVIDIA's block-diffusion sampler for Nemotron-Diffusion (``generate_with_prefix_cache_block_diff``),
each row with its own prompt length and parameters at any batch size.

Per row: the prompt is prefilled into the KV cache (one forward among the prompt tokens only; not counted in nfe).
Then block by block: the block is appended as masks and denoised with up to ``steps_per_block`` steps, each a forward
of the block alone attending to the cache (positions before the block) plus the block's own fresh keys/values; the
fixed schedule or the threshold rule commits tokens (argmax over the whole vocabulary, confidence = probability of
the argmax); when the block has no mask (or its steps are used up) one more forward of the finished block, counted in
nfe, commits its keys/values to the cache. With ``shift_logits`` the logits of position j come from position j-1 (the
block's first position uses the last logit of the previous forward over the prefix: the prefill, then each commit).

Rows are laid out prompt-end aligned (prompts left-padded to a common end column, generations after it), so every
row's block sits at its own columns; a denoising step and a commit are the same kind of window forward and run
together in one batched forward. The cache is written in place; keys after a row's block are masked out, which is
the reference's attention. End-of-sequence: the engine's exact early exit (on in serving) ends a row once a stop
token has no mask before it, which is what the reference's EOS rules return, with less work; ``early_exit=False``
is the reference with its EOS rules off."""
from __future__ import annotations

import torch

from ..rows import Finisher, Row, record_logprobs, wants_logprobs, window_index
from ..sampling import Layout, Softmax, denoise, fast_dllm_rule
from . import Algorithm, ParamInfo, register


def run(engine, rows: list[Row], fin: Finisher) -> None:
    model, mask_id, dev = engine.model, engine.mask_id, engine.model.device
    B0, P, G = 0, 0, 0
    x = torch.empty((0, 0), dtype=torch.long, device=dev)
    offsets: list[int] = []
    cache = model.new_cache(0, 0)
    shift, ctx, slot, commit = [], {}, {}, {}

    def place(new: list[Row]) -> None:
        """Lay rows out (prompt ends at column P, generations after it; a longer prompt or generation widens the
        layout and shifts the others, their cache with them), then prefill their prompts into their cache slots,
        each attending to its own prompt only (not counted in nfe)."""
        nonlocal B0, P, G, x, offsets, col, off, pos
        P2 = max([P] + [r.plan.prompt_length for r in new])
        G2 = max([G] + [r.plan.canvas_length for r in new])
        grow = P2 - P
        t = torch.full((len(new), P2 + G2), engine.pad_id, dtype=torch.long)
        for b, r in enumerate(new):
            t[b, P2 - r.plan.prompt_length:P2] = torch.tensor(r.prompt)
            t[b, P2:P2 + r.plan.canvas_length] = mask_id
        old = torch.full((B0, P2 + G2), engine.pad_id, dtype=torch.long, device=dev)
        old[:, grow:grow + P + G] = x
        x = torch.cat([old, t.to(dev)])
        cache.grow(len(new), grow, P2 + G2)
        offsets = [o + grow for o in offsets] + [P2 - r.plan.prompt_length for r in new]
        P, G = P2, G2
        col = torch.arange(P + G, device=dev)
        off = torch.tensor(offsets, device=dev)
        pos = (col[None, :] - off[:, None]).clamp(min=0)
        sl = torch.arange(B0, B0 + len(new), device=dev)
        noff = off[B0:]
        pmask = None if not any(offsets[B0:]) else (col[None, :P] >= noff[:, None])[:, None, None, :]
        hidden = model(x[sl, :P], pos[sl, :P], pmask, cache=cache, slots=None if B0 == 0 else sl)
        for i, r in enumerate(new):
            slot[r.index] = B0 + i
            shift.append(bool(r.params.extra.get("shift_logits")))
            if shift[-1]:
                ctx[r.index] = model.logits(hidden[i, P - 1])
            commit[r.index] = False
            r.block, r.step, r.block_masks = 0, 0, r.plan.block_length
            # the reference's softmax in the logits' dtype, topk over the block
            r.rule = fast_dllm_rule(r.params, Softmax.MODEL, Softmax.MODEL)
        B0 += len(new)

    col = off = pos = None
    place(rows)
    active = list(rows)
    while active:
        active = [r for r in active if not fin.cancelled(r)]
        if not active:
            break
        new = fin.admit(active)                # continuous batching: a joining row is prefilled, then steps along
        if new:
            place(new)
            active = active + new
        slots = [slot[r.index] for r in active]
        starts = [P + r.block * r.plan.block_length for r in active]
        ends = [s + r.plan.block_length for s, r in zip(starts, active)]
        E = max(ends)
        cols, valid = window_index(list(zip(starts, ends)), dev)
        sl = torch.tensor(slots, device=dev)
        ids = x[sl].gather(1, cols)
        p = pos[sl].gather(1, cols)
        kcol = col[None, :E]
        uniform = not any(offsets[b] for b in slots) and all(e == E for e in ends)
        if uniform:
            mask = None
        else:
            end = torch.tensor(ends, device=dev)[:, None]
            mask = ((kcol >= off[sl][:, None]) & (kcol < end))[:, None, None, :]
        bi, wi = valid.nonzero(as_tuple=True)
        view = _CacheView(cache, E)
        hidden = model(ids, p, mask, cache=view, slots=None if len(slots) == B0 and slots == list(range(B0))
                       else sl, window=(bi, wi, cols[bi, wi]))
        logits = model.logits(hidden)                      # [B, K, V]
        den = [i for i, r in enumerate(active) if not commit[r.index]]
        if den:
            lg = logits[den].clone()
            for j, i in enumerate(den):
                r = active[i]
                if shift[slot[r.index]]:
                    w = ends[i] - starts[i]
                    lg[j, 1:w] = logits[i, : w - 1]
                    lg[j, 0] = ctx[r.index]
            widths = [ends[i] - starts[i] for i in den]
            tokens = ids[den]
            drows = [active[i] for i in den]
            x0, chosen = denoise(lg, tokens, widths, drows, mask_id, [Layout(w, 0) for w in widths])
            rb, kb = chosen.nonzero(as_tuple=True)
            dt = torch.tensor(den, device=dev)
            rows_idx = sl[dt][rb]
            x[rows_idx, cols[dt][rb, kb]] = x0[rb, kb]
            if wants_logprobs(drows):     # generations start at column P
                record_logprobs(drows, rb, cols[dt][rb, kb] - P, x0[rb, kb], lg[rb, kb])
        xc = x.cpu()
        for i, r in enumerate(active):
            b = slot[r.index]
            r.nfe += 1
            gen = xc[b, P:P + r.plan.canvas_length].tolist()
            s, e = r.block_range()
            if commit[r.index]:                            # the block's keys/values are now in the cache
                if shift[b]:
                    ctx[r.index] = logits[i, ends[i] - starts[i] - 1]
                commit[r.index] = False
                last = r.block + 1 >= r.plan.num_blocks
                if not last:
                    r.block += 1
                    r.step, r.block_masks = 0, r.plan.block_length
                fin.update(r, gen, last)
            else:
                r.step += 1
                if mask_id not in gen[s:e] or r.step >= r.plan.steps_per_block:
                    commit[r.index] = True
                fin.update(r, gen, False)
        active = [r for r in active if not r.done]
        yield      # a step is done: the engine may run other groups' steps (continuous batching)


class _CacheView:
    """The first ``width`` columns of a KVCache (views: writes land in the cache itself)."""

    def __init__(self, cache, width: int):
        self.k = cache.k[:, :, :, :width]
        self.v = cache.v[:, :, :, :width]


register(Algorithm(
    name="nemotron",
    description="Nemotron-Diffusion block sampler: prompt prefilled into a KV cache, each block denoised against it "
                "(fixed schedule or threshold rule), then committed to the cache by one more counted forward",
    exact=True, run=run, cfg=False,
    extra_params=(ParamInfo("shift_logits", False, "position j uses the logit of position j-1 (the block's first "
                            "position: the last logit of the previous forward)"),),
))
