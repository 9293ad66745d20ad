"""Per-row generation state, and the batch canvas that holds the rows of a full-sequence (no cache) forward.

Rows are right-aligned in the batch tensor (left padding), each with its own absolute positions starting at 0 and a
key-padding mask, so a row's logits do not depend on which rows share its batch."""
from __future__ import annotations

import functools

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np
import torch

from ..models.layers import upload
from .params import GenerationParams, Plan


NO_LOGPROB = -9999.0      # the log-probability of a token no step decided (OpenAI's and vLLM's stand-in for none)


class TokenLogprobs:
    """A row's generated tokens' log-probabilities (``logprobs`` asked): for every position of the generated canvas,
    the token written there, the log-softmax (float32) of the logits that step decided it from, and the ``k`` most
    likely tokens of that same distribution. A position written again (LLaDA2.1's editing) keeps the last write."""
    __slots__ = ("k", "at")

    def __init__(self, k: int):
        self.k = k
        self.at: dict[int, tuple[int, float, list[tuple[int, float]]]] = {}

    def record(self, positions: torch.Tensor, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """``positions`` [n] (generation coordinates), ``tokens`` [n] written there, ``logits`` [n, V]."""
        if positions.numel() == 0:
            return
        lp = torch.log_softmax(logits.float(), dim=-1)
        chosen = lp.gather(1, tokens.reshape(-1, 1).long())[:, 0].tolist()
        tops = [[]] * len(chosen)
        if self.k:
            v, i = lp.topk(self.k, dim=-1)
            tops = [list(zip(ii, vv)) for ii, vv in zip(i.tolist(), v.tolist())]
        for p, t, c, top in zip(positions.tolist(), tokens.tolist(), chosen, tops):
            self.at[p] = (t, c, top)

    def prefix(self, n: int | None = None, tokens: list[int] | None = None) \
            -> list[tuple[int, float, list[tuple[int, float]]]]:
        """The entries of the generated canvas's first ``n`` positions (None: as many as are written from the
        first on: a row cancelled once its stop string appeared). A position no step decided (still the mask: a
        model that keeps proposing the mask until the algorithm's safety cap, as random weights do) has no
        distribution: its entry is ``tokens[i]`` with :data:`NO_LOGPROB` and no alternatives."""
        if n is None:
            n = 0
            while n in self.at:
                n += 1
        return [self.at[i] if i in self.at else (tokens[i], NO_LOGPROB, []) for i in range(n)]


def wants_logprobs(rows) -> bool:
    return any(r.logprobs is not None for r in rows)


def record_row_logprobs(row: Row, where: torch.Tensor, picked: torch.Tensor, positions: torch.Tensor,
                        tokens: torch.Tensor, logits: torch.Tensor) -> None:
    """The same for one row whose step decided from ``logits`` [m, V] at the ascending positions ``where`` (in any
    coordinates) and wrote ``tokens`` at ``picked`` (a subset of ``where``), generation positions ``positions``."""
    if row.logprobs is None or picked.numel() == 0:
        return
    at = torch.searchsorted(where, picked)
    row.logprobs.record(positions, tokens, logits[at])


def record_block_logprobs(row: Row, old: torch.Tensor, new: torch.Tensor, start: int, logits: torch.Tensor) -> None:
    """The same for a block-causal step that turned the block ``old`` (sequence positions ``start``...) into ``new``
    from ``logits`` [block, V]: every position that changed was written (unmasked, or edited by LLaDA2.1)."""
    j = (new != old).nonzero(as_tuple=True)[0]
    row.logprobs.record(j + (start - row.plan.prompt_length), new[j], logits[j])


def record_logprobs(rows, b: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor,
                    logits: torch.Tensor) -> None:
    """Record a step's writes for the rows that asked for logprobs: write j went to ``rows[b[j]]`` at generation
    position ``positions[j]`` with ``tokens[j]``, decided from ``logits[j]``."""
    want = [i for i, r in enumerate(rows) if r.logprobs is not None]
    if not want:
        return
    bl = b.tolist()
    for i in want:
        sel = [j for j, x in enumerate(bl) if x == i]
        if sel:
            s = upload(sel, logits.device)
            rows[i].logprobs.record(positions[s], tokens[s], logits[s])


@dataclass
class Row:
    index: int                    # position in the caller's request list
    prompt: list[int]
    plan: Plan
    generator: torch.Generator | None
    block: int = 0                # current block
    step: int = 0                 # step within the block
    block_masks: int = 0          # masks in the block when it started (the schedule's m)
    nfe: int = 0
    done: bool = False
    finish_reason: str | None = None
    tokens: list[int] = field(default_factory=list)   # final answer: ids up to the first stop token
    canvas: list[int] = field(default_factory=list)   # the whole generated canvas when the row ended
    reported: int = 0             # length of the final prefix already reported to on_progress
    min_block_steps: int = 1      # steps a block takes at least under a rule without a fixed schedule (cached.py)
    rule: object = None           # sampling.Rule: how this row's steps commit tokens (set by its algorithm)
    logprobs: TokenLogprobs | None = None     # set when the request asks for its tokens' log-probabilities
    cached_tokens: int = 0        # prompt tokens the prefix cache gave it (usage's cached_tokens)
    state: object = None          # its algorithm's own per-row state: kept on the row, so it goes when the row
    #                               goes (a batch under steady load runs for ever: nothing per row may outlive it)
    held: int = 0                 # tokens it holds in a forward (params.held_tokens: --max-batch-tokens), set once

    def __post_init__(self):
        # a plain attribute, not a property: the steps read it for every row, many times a step
        self.params: GenerationParams = self.plan.params

    @property
    def fixed_steps(self) -> bool:
        return self.rule.fixed_schedule

    def block_range(self, block: int | None = None) -> tuple[int, int]:
        """[start, end) of a block, in generation coordinates (0 = first generated token)."""
        b = self.block if block is None else block
        bl = self.plan.block_length
        return b * bl, (b + 1) * bl

    def scheduled_transfers(self) -> int:
        """LLaDA's linear schedule: the block's m masks spread over its steps, the remainder to the first steps."""
        m, s = self.block_masks, self.plan.steps_per_block
        return m // s + (1 if self.step < m % s else 0)


@dataclass
class StepHooks:
    """Callbacks from the device loop: ``on_progress(index, final_ids)`` when a row's final prefix grows;
    ``is_cancelled(index)`` to drop a row whose client has gone; ``on_step(index, window, settled)`` after every
    denoising step of a row for which ``steps_for(index)`` is true (step streaming): its generation window (token
    ids, the mask id where still masked) and how many of its positions are settled (the others are a canvas's
    current guesses: DiffusionGemma's canvas is never masked)."""
    on_progress: Callable[[int, list[int]], None] | None = None
    is_cancelled: Callable[[int], bool] | None = None
    on_step: Callable[[int, list[int], int], None] | None = None
    steps_for: Callable[[int], bool] = lambda index: False


_NO_STOPS: frozenset[int] = frozenset()


class Finisher:
    """Decides, after every step, which rows are finished, and reports streamed prefixes.

    A row is finished when its visible window (the first ``gen_length`` generated tokens) holds a stop token with
    no mask before it, or holds no mask at all (early exit, exact: committed tokens never change), or when its last
    block's schedule is done. With ``early_exit=False`` only the last rule applies (the reference's full canvas)."""

    def __init__(self, mask_id: int, stop_ids: list[int], early_exit: bool, hooks: StepHooks | None):
        self.mask_id = mask_id
        self.stop_ids = frozenset(stop_ids)
        self._with_extra: dict[frozenset, frozenset] = {}     # the model's stop ids with a request's own
        self.early_exit = early_exit
        self.hooks = hooks or StepHooks()

    def stops(self, row: Row) -> frozenset[int]:
        extra = row.params.stop_token_ids
        if extra:                 # the request's own, which ignore_eos does not silence (as vLLM's)
            if row.params.ignore_eos:
                return extra
            both = self._with_extra.get(extra)
            if both is None:
                both = self._with_extra[extra] = self.stop_ids | extra
            return both
        return _NO_STOPS if row.params.ignore_eos else self.stop_ids

    def final_prefix(self, row: Row, gen: list[int]) -> tuple[list[int], bool]:
        """(the final visible prefix, whether it ends at a stop token): the window up to its first mask or first stop
        token, whichever comes first. A row and a step each, so each list is scanned once, up to the first mask, and
        no exception is raised in the usual case (a mask left, no stop token yet)."""
        window = gen[: row.plan.gen_length]
        try:
            head = window[: window.index(self.mask_id)]
        except ValueError:          # no mask left: once, as the row completes
            head = window
        cut = len(head)
        stops = self.stops(row)
        if len(stops) <= 8:       # the model's few: one scan in C each
            for s in stops:
                if s in head:
                    cut = min(cut, head.index(s))
        else:                     # a request's many (up to 1,024): one scan of the window
            cut = next((i for i, t in enumerate(head) if t in stops), cut)
        return (head if cut == len(head) else head[:cut]), cut < len(head)

    def update(self, row: Row, gen: list[int], schedule_done: bool, settled: int | None = None) -> None:
        """``gen``: the row's generated canvas after this step. Marks the row done when it is finished.
        ``settled``: for step streaming, how many leading positions are decided (default: all, masks aside)."""
        prefix, stopped = self.final_prefix(row, gen)
        if self.hooks.on_step is not None and self.hooks.steps_for(row.index):
            window = gen[: row.plan.gen_length]
            self.hooks.on_step(row.index, window, len(window) if settled is None else min(settled, len(window)))
        if self.hooks.on_progress is not None and len(prefix) > row.reported:
            row.reported = len(prefix)
            self.hooks.on_progress(row.index, prefix)
        complete = stopped or len(prefix) == row.plan.gen_length
        if schedule_done or (self.early_exit and complete):
            window = gen[: row.plan.gen_length]
            stops = self.stops(row)
            cut = next((i for i, t in enumerate(window) if t in stops), None)
            row.done = True
            row.tokens = window if cut is None else window[:cut]
            row.finish_reason = "length" if cut is None else "stop"
            row.canvas = list(gen)
            self.retired(row)

    def cancelled(self, row: Row) -> bool:
        """Whether ``row``'s client has gone; the first time it is found so, the row ends as "cancelled" (answered at
        once). A row already ended is not ended again: cancelled or not, as it ended."""
        if row.done:
            return row.finish_reason == "cancelled"
        if self.hooks.is_cancelled is not None and self.hooks.is_cancelled(row.index):
            row.done, row.finish_reason = True, "cancelled"
            self.retired(row)
            return True
        return False

    def retired(self, row: Row) -> None:
        """A row has finished (or was cancelled): with continuous batching its result leaves at once."""

    def admit(self, running: list[Row]) -> list[Row]:
        """Rows that join the running batch now (continuous batching; see worker/engine/engine.py), given the rows
        running; none without a feed. Algorithms call it between steps, before building the step's forward."""
        return []


class Canvas:
    """Batch tensor of rows for the full-sequence forward: ``x`` [B, L] right-aligned, with positions and mask."""

    def __init__(self, rows: list[Row], mask_id: int, pad_id: int, device: torch.device):
        self.mask_id, self.pad_id, self.device = mask_id, pad_id, device
        self.rows = list(rows)
        lengths = [r.plan.prompt_length + r.plan.canvas_length for r in self.rows]
        width = max(lengths)
        x = torch.full((len(rows), width), pad_id, dtype=torch.long)
        for b, (r, n) in enumerate(zip(self.rows, lengths)):
            x[b, width - n: width - n + r.plan.prompt_length] = torch.tensor(r.prompt, dtype=torch.long)
            x[b, width - n + r.plan.prompt_length:] = mask_id
        self.x = x.to(device)
        self.offsets = [width - n for n in lengths]
        self._index()

    def _index(self) -> None:
        B, L = self.x.shape
        off = upload(self.offsets, self.device)
        col = torch.arange(L, device=self.device)
        self.pos = (col[None, :] - off[:, None]).clamp(min=0)
        # No mask at all when no row is padded: the same kernel path as the reference at batch size 1.
        self.mask = None if not any(self.offsets) else (col[None, :] >= off[:, None])[:, None, None, :]

    def gen_start(self, b: int) -> int:
        return self.offsets[b] + self.rows[b].plan.prompt_length

    def read_gens(self) -> dict[int, list[int]]:
        """Each row's generated canvas (row index -> ids), read back from the device in one transfer."""
        xc = self.x.cpu().tolist()
        out = {}
        for b, r in enumerate(self.rows):
            s = self.gen_start(b)
            out[r.index] = xc[b][s: s + r.plan.canvas_length]
        return out

    def keep(self, keep: list[int]) -> int:
        """Compact to the rows at batch indices ``keep``, trimming the left padding no longer needed; returns how
        many columns were trimmed (a KV cache laid out like the canvas follows with ``KVCache.keep``)."""
        self.rows = [self.rows[b] for b in keep]
        if not self.rows:
            return 0
        trim = min(self.offsets[b] for b in keep)
        self.x = self.x.index_select(0, upload(keep, self.x.device))[:, trim:].contiguous()
        self.offsets = [self.offsets[b] - trim for b in keep]
        self._index()
        return trim

    def add(self, rows: list[Row]) -> int:
        """Append rows (continuous batching); widens the canvas on the left when a new row is longer. Returns how
        many columns were prepended (a KV cache laid out like the canvas follows with ``KVCache.grow``)."""
        lengths = [r.plan.prompt_length + r.plan.canvas_length for r in rows]
        old = self.x.shape[1]
        width = max(old, max(lengths))
        grow = width - old
        x = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        for b, (r, n) in enumerate(zip(rows, lengths)):
            x[b, width - n: width - n + r.plan.prompt_length] = torch.tensor(r.prompt, dtype=torch.long)
            x[b, width - n + r.plan.prompt_length:] = self.mask_id
        if grow:
            pad = torch.full((self.x.shape[0], grow), self.pad_id, dtype=torch.long, device=self.device)
            self.x = torch.cat([pad, self.x], 1)
            self.offsets = [o + grow for o in self.offsets]
        self.x = torch.cat([self.x, x.to(self.device)])
        self.rows += rows
        self.offsets += [width - n for n in lengths]
        self._index()
        return grow

    def uncond(self, which: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Unconditional copies of rows ``which`` for classifier-free guidance: the prompt replaced by masks."""
        x = self.x[which].clone()
        for i, b in enumerate(which):
            s = self.offsets[b]
            x[i, s: s + self.rows[b].plan.prompt_length] = self.mask_id
        mask = None if self.mask is None else self.mask[which]
        return x, self.pos[which], mask


class Window(NamedTuple):
    """The index tensors of a batch of windows (:func:`window`), all read-only."""
    cols: torch.Tensor      # [B, W] the canvas columns of each row's window [start, end), padded with its last column
    valid: torch.Tensor     # [B, W] which of them are real
    last: torch.Tensor      # [B, W] each column's own index, a padded one's the row's last real column's
    flat: tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # (b, w, cols[b, w]) of the real columns, row by row


def window(spans: list[tuple[int, int]], device) -> Window:
    """The index tensors of windows [start, end) of canvas columns, one per row (W = the widest window). They are
    built on the host and kept for the spans and device: inside a block the windows are the same step after step,
    so a step reuses them instead of building and copying them again, and needs no device read to find the real
    columns (``flat``)."""
    return _window(tuple((int(s), int(e)) for s, e in spans), torch.device(device))


@functools.lru_cache(maxsize=32)
def _window(spans: tuple[tuple[int, int], ...], device: torch.device) -> Window:
    # built with numpy (a microsecond an operation on the host, where torch's small CPU operations take several:
    # a batch's windows change whenever one of its rows moves to its next block), copied to the device at once,
    # without waiting for it (upload)
    B = len(spans)
    se = np.array(spans, dtype=np.int64)
    s, e = se[:, 0], se[:, 1]
    n = e - s
    W = int(n.max())
    if int(n.min()) == W:         # windows of one width (the usual case): only the columns are new
        cols = upload(torch.from_numpy(s[:, None] + np.arange(W)), device)
        valid, last, bi, wi = _uniform(B, W, device)
        return Window(cols, valid, last, (bi, wi, cols.view(-1)))
    j = np.arange(W)
    cols = np.minimum(s[:, None] + j, (e - 1)[:, None])
    valid = j[None, :] < n[:, None]
    last = np.minimum(j[None, :], (n - 1)[:, None])
    bi = np.repeat(np.arange(B), n)               # the real columns, row by row
    wi = np.arange(len(bi)) - np.repeat(np.cumsum(n) - n, n)
    packed = torch.from_numpy(np.concatenate([cols.ravel(), valid.ravel(), last.ravel(), bi, wi, s[bi] + wi]))
    part = upload(packed, device).split([B * W] * 3 + [len(bi)] * 3)
    return Window(part[0].view(B, W), part[1].view(B, W).bool(), part[2].view(B, W), (part[3], part[4], part[5]))


def read_with(x: torch.Tensor, extra: torch.Tensor | None) -> tuple[list[list[int]], list | None]:
    """The host copy of an integer matrix ``x`` as lists, and ``extra`` (a matrix of its dtype, or None) as lists,
    in one transfer (each read waits for the device)."""
    if extra is None:
        return x.cpu().tolist(), None
    flat = torch.cat([x.reshape(-1), extra.reshape(-1)]).cpu().tolist()
    B, W = x.shape
    n = B * W
    w = extra.shape[-1]
    return [flat[i * W:(i + 1) * W] for i in range(B)], [flat[n + i * w:n + (i + 1) * w] for i in range(extra.shape[0])]


def nonzero_rows(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The (row, column) indices of a bool matrix's True entries, row by row as ``nonzero`` gives them (device
    tensors), and each row's count: one read of the mask (``nonzero`` and a count would be a wait for the device
    each), the indices found on the host and copied back in one transfer that does not wait."""
    m = mask.cpu().numpy()
    bi, ci = np.nonzero(m)
    both = upload(torch.from_numpy(np.concatenate([bi, ci]).astype(np.int64)), mask.device)
    return both[:len(bi)], both[len(bi):], np.count_nonzero(m, axis=1).tolist()


@functools.lru_cache(maxsize=32)
def _uniform(B: int, W: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """:class:`Window`'s parts that do not depend on where B windows of width W start."""
    j = torch.arange(W)
    return (upload(torch.ones(B, W, dtype=torch.bool), device), upload(j.expand(B, W).contiguous(), device),
            upload(torch.arange(B).repeat_interleave(W), device), upload(j.repeat(B), device))


def write_chosen(x: torch.Tensor, cols: torch.Tensor, last: torch.Tensor, chosen: torch.Tensor, x0: torch.Tensor,
                 tokens: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Write a step's choices into ``x`` without reading the device to find them: every candidate column ``cols``
    [B, K] (of ``x``'s rows ``rows``, default all) gets ``x0`` where ``chosen``, else its current ``tokens``. A
    padded column repeats its row's last real column (:class:`Window`), so through ``last`` it writes that column's
    own new value: the duplicate writes agree."""
    new = torch.where(chosen, x0, tokens).gather(1, last)
    if rows is None:
        x.scatter_(1, cols, new)
    else:
        x.index_put_((rows[:, None].expand_as(cols), cols), new)


def between_steps(canvas: Canvas, fin: Finisher, cache=None) -> list[Row] | None:
    """The top of a step: drop the rows whose client has gone and add the rows joining the batch (continuous
    batching), a KV cache laid out like the canvas following (``KVCache.keep`` / ``grow``). Returns the joining rows
    (the caller sets them up), or None when no row is left."""
    keep = [b for b, r in enumerate(canvas.rows) if not fin.cancelled(r)]
    if len(keep) < len(canvas.rows):
        trim = canvas.keep(keep)
        if not canvas.rows:
            return None
        if cache is not None:
            cache.keep(keep, trim)
    new = fin.admit(canvas.rows)
    if new:
        prepend = canvas.add(new)
        if cache is not None:
            cache.grow(len(new), prepend, canvas.x.shape[1])
    return new

