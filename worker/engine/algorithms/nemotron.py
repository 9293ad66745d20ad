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

from ...models.layers import upload
from ..rows import Finisher, Row, record_logprobs, wants_logprobs, window, write_chosen
from ..params import until_unmasked_cost
from ..sampling import Layout, Softmax, denoise, fast_dllm_rule
from . import Algorithm, ParamInfo, register


class _Batch:
    """The rows' layout (prompts left-padded to a common end column ``P``, generations after it), their cache slots
    and per-row state: ``shift`` (shift_logits, by slot), ``ctx`` (the logit before a row's block, when shifting),
    ``commit`` (the row's next forward stores its finished block)."""

    def __init__(self, engine):
        self.engine, self.model = engine, engine.model
        self.dev = self.model.device
        self.B0 = self.P = self.G = 0
        self.x = torch.empty((0, 0), dtype=torch.long, device=self.dev)
        self.offsets: list[int] = []
        self.cache = self.model.new_cache(0, 0)
        self.shift: list[bool] = []
        self.ctx, self.slot, self.commit = {}, {}, {}
        self.col = self.off = self.pos = None

    def place(self, new: list[Row]) -> None:
        """Lay rows out (a longer prompt or generation widens the layout and shifts the others, their cache with
        them), then prefill their prompts into their cache slots, each attending to its own prompt only (not counted
        in nfe)."""
        engine, model, dev = self.engine, self.model, self.dev
        P2 = max([self.P] + [r.plan.prompt_length for r in new])
        G2 = max([self.G] + [r.plan.canvas_length for r in new])
        grow = P2 - self.P
        t = torch.full((len(new), P2 + G2), engine.pad_id, dtype=torch.long)
        for b, r in enumerate(new):
            t[b, P2 - r.plan.prompt_length:P2] = torch.tensor(r.prompt)
            t[b, P2:P2 + r.plan.canvas_length] = engine.mask_id
        old = torch.full((self.B0, P2 + G2), engine.pad_id, dtype=torch.long, device=dev)
        old[:, grow:grow + self.P + self.G] = self.x
        self.x = torch.cat([old, t.to(dev)])
        self.cache.grow(len(new), grow, P2 + G2)
        self.offsets = [o + grow for o in self.offsets] + [P2 - r.plan.prompt_length for r in new]
        self.P, self.G = P2, G2
        P = P2
        self.col = torch.arange(P + G2, device=dev)
        self.off = upload(self.offsets, dev)
        self.pos = (self.col[None, :] - self.off[:, None]).clamp(min=0)
        B0 = self.B0
        sl = torch.arange(B0, B0 + len(new), device=dev)
        noff = self.off[B0:]
        pmask = None if not any(self.offsets[B0:]) else (self.col[None, :P] >= noff[:, None])[:, None, None, :]
        hidden = model(self.x[sl, :P], self.pos[sl, :P], pmask, cache=self.cache, slots=None if B0 == 0 else sl)
        for i, r in enumerate(new):
            self.slot[r.index] = B0 + i
            self.shift.append(bool(r.params.extra.get("shift_logits")))
            if self.shift[-1]:
                self.ctx[r.index] = model.logits(hidden[i, P - 1])
            self.commit[r.index] = False
            r.block, r.step, r.block_masks = 0, 0, r.plan.block_length
            # the reference's softmax in the logits' dtype, topk over the block
            r.rule = fast_dllm_rule(r.params, Softmax.MODEL, Softmax.MODEL)
        self.B0 += len(new)

    def keep(self, active: list[Row]) -> None:
        """Drop the slots of rows that left (finished or cancelled): their canvas rows, cache slots and state, so a
        batch that runs on under steady load holds only its running rows. The survivors keep their columns."""
        if len(active) == self.B0:
            return
        gone = set(self.slot) - {r.index for r in active}
        for i in gone:
            self.slot.pop(i)
            self.ctx.pop(i, None)
            self.commit.pop(i)
        order = sorted(active, key=lambda r: self.slot[r.index])
        kept = [self.slot[r.index] for r in order]
        self.x = self.x[upload(kept, self.dev)]
        self.cache.keep(kept, 0)
        self.offsets = [self.offsets[b] for b in kept]
        self.shift = [self.shift[b] for b in kept]
        for b, r in enumerate(order):
            self.slot[r.index] = b
        self.B0 = len(kept)
        self.off = upload(self.offsets, self.dev)
        self.pos = (self.col[None, :] - self.off[:, None]).clamp(min=0)

    def forward(self, active: list[Row]):
        """One window forward of every row's block (denoising it, or storing it when finished) against the cache;
        keys after a row's block are masked out, as in the reference. Returns the window layout and the logits."""
        dev, P = self.dev, self.P
        slots = [self.slot[r.index] for r in active]
        starts = [P + r.block * r.plan.block_length for r in active]
        ends = [s + r.plan.block_length for s, r in zip(starts, active)]
        E = max(ends)
        win = window(list(zip(starts, ends)), dev)
        cols = win.cols
        sl = upload(slots, dev)
        ids = self.x[sl].gather(1, cols)
        p = self.pos[sl].gather(1, cols)
        kcol = self.col[None, :E]
        if not any(self.offsets[b] for b in slots) and all(e == E for e in ends):
            mask = None
        else:
            end = upload(ends, dev)[:, None]
            mask = ((kcol >= self.off[sl][:, None]) & (kcol < end))[:, None, None, :]
        hidden = self.model(ids, p, mask, cache=_CacheView(self.cache, E),
                            slots=None if len(slots) == self.B0 and slots == list(range(self.B0)) else sl,
                            window=win.flat)
        return starts, ends, win, sl, ids, self.model.logits(hidden)        # logits [B, K, V]

    def denoise(self, active: list[Row], starts, ends, win, sl, ids, logits) -> None:
        """The rows denoising their block commit tokens by their rule (with ``shift_logits``, position j decides
        from the logit of j-1, the block's first from ``ctx``)."""
        mask_id, P = self.engine.mask_id, self.P
        den = [i for i, r in enumerate(active) if not self.commit[r.index]]
        if not den:
            return
        lg = logits.clone() if len(den) == len(active) else logits[upload(den, self.dev)]
        for j, i in enumerate(den):
            r = active[i]
            if self.shift[self.slot[r.index]]:
                w = ends[i] - starts[i]
                lg[j, 1:w] = logits[i, : w - 1]
                lg[j, 0] = self.ctx[r.index]
        widths = [ends[i] - starts[i] for i in den]
        drows = [active[i] for i in den]
        every = len(den) == len(active)
        dt = None if every else upload(den, self.dev)
        cols, tokens = (win.cols, ids) if every else (win.cols[dt], ids[dt])
        rows_at = sl if every else sl[dt]
        x0, chosen = denoise(lg, tokens, widths, drows, mask_id, [Layout(w, 0) for w in widths],
                             win.valid if every else win.valid[dt])
        if wants_logprobs(drows):     # generations start at column P
            rb, kb = chosen.nonzero(as_tuple=True)
            self.x[rows_at[rb], cols[rb, kb]] = x0[rb, kb]
            record_logprobs(drows, rb, cols[rb, kb] - P, x0[rb, kb], lg[rb, kb])
            return
        write_chosen(self.x, cols, win.last if every else win.last[dt], chosen, x0, tokens, rows_at)

    def account(self, active: list[Row], fin: Finisher, starts, ends, logits) -> None:
        """Every forward counts in nfe. A stored block moves the row to its next one (or ends it); a block with no
        mask left, or its steps used, is stored by the row's next forward."""
        mask_id, P = self.engine.mask_id, self.P
        xc = self.x.cpu().tolist()
        for i, r in enumerate(active):
            b = self.slot[r.index]
            r.nfe += 1
            gen = xc[b][P:P + r.plan.canvas_length]
            s, e = r.block_range()
            if self.commit[r.index]:                            # the block's keys/values are now in the cache
                if self.shift[b]:
                    self.ctx[r.index] = logits[i, ends[i] - starts[i] - 1]
                self.commit[r.index] = False
                last = r.block + 1 >= r.plan.num_blocks
                if not last:
                    r.block += 1
                    r.step, r.block_masks = 0, r.plan.block_length
                fin.update(r, gen, last)
            else:
                r.step += 1
                if mask_id not in gen[s:e] or r.step >= r.plan.steps_per_block:
                    self.commit[r.index] = True
                fin.update(r, gen, False)


def run(engine, rows: list[Row], fin: Finisher) -> None:
    """A step: rows joining are laid out and prefilled; one window forward for all; the denoising rows commit
    tokens; the accounting moves blocks on and ends rows."""
    batch = _Batch(engine)
    batch.place(rows)
    active = list(rows)
    while active:
        active = [r for r in active if not fin.cancelled(r)]
        if not active:
            break
        batch.keep(active)
        new = fin.admit(active)                # continuous batching: a joining row is prefilled, then steps along
        if new:
            batch.place(new)
            active = active + new
        starts, ends, win, sl, ids, logits = batch.forward(active)
        batch.denoise(active, starts, ends, win, sl, ids, logits)
        batch.account(active, fin, starts, ends, logits)
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
    cost=until_unmasked_cost, exact=True, run=run, cfg=False,
    extra_params=(ParamInfo("shift_logits", False, "position j uses the logit of position j-1 (the block's first "
                            "position: the last logit of the previous forward)"),),
))
