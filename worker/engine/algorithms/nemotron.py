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

from ..rows import Finisher, Row, window_index
from ..sampling import Layout, Softmax, denoise, fast_dllm_rule
from . import Algorithm, ParamInfo, register


def run(engine, rows: list[Row], fin: Finisher) -> None:
    model, mask_id, dev = engine.model, engine.mask_id, engine.model.device
    B0 = len(rows)
    P = max(r.plan.prompt_length for r in rows)
    G = max(r.plan.canvas_length for r in rows)
    W = P + G
    x = torch.full((B0, W), engine.pad_id, dtype=torch.long)
    offsets = []
    for b, r in enumerate(rows):
        o = P - r.plan.prompt_length
        x[b, o:P] = torch.tensor(r.prompt)
        x[b, P:P + r.plan.canvas_length] = mask_id
        offsets.append(o)
    x = x.to(dev)
    col = torch.arange(W, device=dev)
    off = torch.tensor(offsets, device=dev)
    pos = (col[None, :] - off[:, None]).clamp(min=0)
    cache = model.new_cache(B0, W)

    # Prefill: the prompts, each attending to its own prompt only (not counted in nfe).
    pmask = None if not any(offsets) else (col[None, :P] >= off[:, None])[:, None, None, :]
    hidden = model(x[:, :P], pos[:, :P], pmask, cache=cache)
    shift = [bool(r.params.extra.get("shift_logits")) for r in rows]
    ctx = {r.index: model.logits(hidden[b, P - 1]) for b, r in enumerate(rows) if shift[b]}
    slot = {r.index: b for b, r in enumerate(rows)}
    commit = {r.index: False for r in rows}
    for r in rows:
        r.block, r.step, r.block_masks = 0, 0, r.plan.block_length
        # the reference's softmax in the logits' dtype, topk over the block
        r.rule = fast_dllm_rule(r.params, Softmax.MODEL, Softmax.MODEL)

    active = list(rows)
    while active:
        active = [r for r in active if not fin.cancelled(r)]
        if not active:
            break
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
            x0, chosen = denoise(lg, tokens, widths, [active[i] for i in den], mask_id,
                                 [Layout(w, 0) for w in widths])
            rb, kb = chosen.nonzero(as_tuple=True)
            rows_idx = sl[torch.tensor(den, device=dev)][rb]
            x[rows_idx, cols[torch.tensor(den, device=dev)][rb, kb]] = x0[rb, kb]
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
    exact=True, run=run, families=("nemotron",), cfg=False,
    extra_params=(ParamInfo("shift_logits", False, "position j uses the logit of position j-1 (the block's first "
                            "position: the last logit of the previous forward)"),),
))
