"""The batch of a block-causal algorithm (``sdar``, ``llada2``, ``llada21``): each row's sequence (prompt, then masks
up to a whole number of its blocks, counted from position 0) left-aligned in ``x`` so that position = column, one KV
cache slot per row laid out the same way, rows leaving (cancelled, finished) and joining (continuous batching), and
the window forward with the block-causal mask."""
from __future__ import annotations

import functools

import numpy as np
import torch

from ...models.layers import upload
from ..params import GenerationParams, ParamError
from ..rows import Finisher, Row, window


def extent(r: Row) -> int:
    """Positions of the row's whole blocks (prompt + generation rounded up to its block length)."""
    bl = r.params.block_length
    return -(-(r.plan.prompt_length + r.plan.gen_length) // bl) * bl


@functools.lru_cache(maxsize=8)
def _block_mask(spans: tuple[tuple[int, int], ...], blocks: tuple[int, ...], extents: tuple[int, ...], keys: int,
                device: torch.device) -> torch.Tensor:
    """The block-causal attention mask of a window forward [B, 1, widest window, keys]: a query sees the keys of its
    own block and the blocks before it, within its row's extent. Kept for its arguments (read-only): inside a block a
    batch's windows, and so its mask, are the same step after step."""
    cols = window(spans, device).cols
    bl = upload(blocks, device)[:, None]
    tot = upload(extents, device)[:, None]
    kcol = torch.arange(keys, device=device)
    mask = ((kcol[None, None, :] // bl[:, :, None]) <= (cols // bl)[:, :, None]) & (kcol[None, None, :] <
                                                                                  tot[:, :, None])
    return mask[:, None]


def block_positions(at: list[int], widths: list[int], device) -> torch.Tensor:
    """The window indices [rows, widest block] of each row's block: row b's block starts at window index ``at[b]``
    and is ``widths[b]`` long; a narrower block's missing columns repeat its last position. Built on the host, kept
    (a block's windows repeat step after step)."""
    return _block_positions(tuple(at), tuple(widths), torch.device(device))


@functools.lru_cache(maxsize=32)
def _block_positions(at: tuple[int, ...], widths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    w = np.array(widths)
    j = np.minimum(np.arange(w.max())[None, :], (w - 1)[:, None])
    return upload(torch.from_numpy(np.array(at)[:, None] + j), device)


def check_common(p: GenerationParams, name: str, takes: str) -> None:
    """What every block-causal algorithm rejects (LLaDA's step count, factor and remasking do not apply) and its
    nucleus bound."""
    for field in ("factor", "steps"):
        if getattr(p, field) is not None:
            raise ParamError(field, f"{name} takes {takes}, not {field}")
    if p.remasking != "low_confidence":
        raise ParamError("remasking", f"{name} takes {takes}, not remasking")
    if not 0 < p.extra["top_p"] <= 1:
        raise ParamError("algorithm_params", f"{name}: top_p must be in (0, 1], got {p.extra['top_p']!r}")


def subset(rows: list[int], total: int, device) -> torch.Tensor | None:
    """The index tensor of ``rows`` (sorted) of ``total``, None when they are all of them (a slice: no copy)."""
    return None if len(rows) == total else upload(rows, device)


def _per_row(values: list, device, dtype=None):
    """One value for the rows when they agree (with ``dtype``, a kept tensor of it on the device), else a tensor
    [rows] of theirs."""
    if any(v != values[0] for v in values):
        return upload(values, device, dtype)
    return values[0] if dtype is None else _scalar(values[0], dtype, torch.device(device))


@functools.lru_cache(maxsize=64)
def _scalar(value, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return upload(value, device, dtype)


def choose(masked: torch.Tensor, prob: torch.Tensor, n: list[int], threshold: list[float | None],
           strategy: list[str], only_masked: bool) -> torch.Tensor:
    """Which positions of each row's block this step writes (bool [rows, block_length]), for rows whose blocks have
    the same length, all at once and without reading anything back from the device: ``masked`` / ``prob`` [rows,
    block_length], ``n`` each row's scheduled count. A row's rule, as its reference's: ``sequential``: the n positions
    from its first masked one; otherwise with a ``threshold`` the masked positions whose probability exceeds it when
    there are at least n of them, else (and without a threshold) the n most probable masked ones by ``torch.topk``
    over the block, masked positions ranked at ``-inf`` (``only_masked``: LLaDA2's ``min(n, masks left)``: the masked
    positions among them; SDAR writes all n). Rows with the same n are ranked by one 2-D topk, each row exactly as
    alone (ties included; tests/test_sampling.py)."""
    G, width = masked.shape
    dev = masked.device
    conf = torch.where(masked, prob, float("-inf"))
    top = None
    for k in sorted(set(n)):           # usually one count for all the rows
        rows = subset([j for j in range(G) if n[j] == k], G, dev)
        m, c = (masked, conf) if rows is None else (masked[rows], conf[rows])
        t = torch.zeros_like(m).scatter_(1, torch.topk(c, k, dim=-1)[1], True) if k else torch.zeros_like(m)
        if only_masked:
            t &= m
        if rows is None:
            top = t
        else:
            top = torch.zeros_like(masked) if top is None else top
            top[rows] = t
    seq = [j for j in range(G) if strategy[j] == "sequential"]
    if seq:             # the first masked position: argmax gives the first of the maxima
        rows = subset(seq, G, dev)
        first = (masked if rows is None else masked[rows]).to(torch.uint8).argmax(1, keepdim=True)
        k = _per_row([n[j] for j in seq], dev)
        k = k[:, None] if isinstance(k, torch.Tensor) else k
        col = torch.arange(width, device=dev)[None, :]
        val = (col >= first) & (col < first + k)
        if rows is None:
            top = val
        else:
            top[rows] = val
    dyn = [j for j in range(G) if threshold[j] is not None and strategy[j] != "sequential"]
    if dyn:
        rows = subset(dyn, G, dev)
        thr = _per_row([threshold[j] for j in dyn], dev, conf.dtype)
        high = (conf if rows is None else conf[rows]) > (thr[:, None] if thr.dim() else thr)
        k = _per_row([n[j] for j in dyn], dev)
        val = torch.where((high.sum(1) >= k)[:, None], high, top if rows is None else top[rows])
        if rows is None:
            top = val
        else:
            top[rows] = val
    return top


class BlockBatch:
    """``x`` [B, W] and ``cache`` for the ``active`` rows; ``setup(row)`` is called for every row as it arrives.

    Prefix cache (worker/engine/prefix_cache.py, when the engine has one): as a row arrives, the keys/values of its
    prompt's leading whole blocks that are cached are copied into its cache slot, at most ``reusable(row)`` blocks,
    and ``reused(row, positions)`` tells the algorithm where its own forwards start; once the algorithm has computed
    the row's prompt blocks it calls :meth:`share` to store them for later rows."""

    def __init__(self, engine, rows: list[Row], setup, reusable=None, reused=None):
        self.engine, self.setup = engine, setup
        self.dev = engine.model.device
        self.W = max(extent(r) for r in rows)
        self.x = self._layout(rows, self.W)
        self.cache = engine.model.new_cache(len(rows), self.W)
        self.active = list(rows)
        self.prefix = getattr(engine, "prefix_cache", None) if reusable is not None else None
        self.reusable, self.reused = reusable, reused
        self._reuse(0)

    def _reuse(self, first_slot: int) -> None:
        """Copy the cached prompt blocks of the rows from batch slot ``first_slot`` on into their cache slots."""
        if self.prefix is None:
            return
        for b in range(first_slot, len(self.active)):
            r = self.active[b]
            limit = self.reusable(r)
            if limit <= 0:
                continue
            bl = r.params.block_length
            found = self.prefix.lookup(r.prompt, bl, limit)
            if found:
                n = len(found) * bl
                self.cache.k[:, b, :, :n] = torch.cat([e.kv[0] for e in found], dim=2).to(self.dev)
                self.cache.v[:, b, :, :n] = torch.cat([e.kv[1] for e in found], dim=2).to(self.dev)
                r.cached_tokens = n
                self.reused(r, n)

    def share(self, b: int, first: int, blocks: int) -> None:
        """Active row ``b``'s prompt blocks ``first`` .. ``blocks - 1`` are final in its cache slot: store them."""
        if self.prefix is None or blocks <= first:
            return
        r = self.active[b]
        bl = r.params.block_length
        self.prefix.insert(r.prompt, bl, first, blocks,
                           lambda j: (self.cache.k[:, b, :, j * bl:(j + 1) * bl],
                                      self.cache.v[:, b, :, j * bl:(j + 1) * bl]))

    def _layout(self, new: list[Row], width: int) -> torch.Tensor:
        t = torch.full((len(new), width), self.engine.pad_id, dtype=torch.long)
        for b, r in enumerate(new):
            self.setup(r)
            t[b, :len(r.prompt)] = torch.tensor(r.prompt)
            t[b, len(r.prompt):extent(r)] = self.engine.mask_id
        return t.to(self.dev)

    def keep(self, keep: list[int]) -> None:
        """Keep only the active rows at these batch indices (their cache slots follow)."""
        if not keep:
            self.active = []
        elif len(keep) < len(self.active):
            self.x = self.x.index_select(0, upload(keep, self.dev, torch.long))
            self.cache.keep(keep, 0)
            self.active = [self.active[b] for b in keep]

    def between_steps(self, fin: Finisher) -> bool:
        """Drop the cancelled rows, add the joining ones (each starts with its own first block); False when no row
        is left."""
        self.keep([b for b, r in enumerate(self.active) if not fin.cancelled(r)])
        if not self.active:
            return False
        new = fin.admit(self.active)
        if new:
            width = max(self.W, max(extent(r) for r in new))
            if width > self.W:
                pad = torch.full((self.x.shape[0], width - self.W), self.engine.pad_id, dtype=torch.long,
                                 device=self.dev)
                self.x = torch.cat([self.x, pad], 1)
            self.x = torch.cat([self.x, self._layout(new, width)])
            self.cache.grow(len(new), 0, width)
            self.W = width
            first = len(self.active)
            self.active = self.active + new
            self._reuse(first)
        return True

    def forward(self, spans: list[tuple[int, int]]) -> torch.Tensor:
        """One forward of every active row's window ``[start, end)`` (its positions' keys/values written into its
        cache slot), block-causal: a query sees the keys of its own block and the blocks before it, none past the
        farthest window's end. Returns hidden states [B, widest window, D]."""
        win = window(spans, self.dev)
        keys = max(e for _, e in spans)
        mask = _block_mask(tuple((int(s), int(e)) for s, e in spans), tuple(r.params.block_length for r in self.active),
                           tuple(extent(r) for r in self.active), keys, torch.device(self.dev))
        return self.engine.model(self.x.gather(1, win.cols), win.cols, mask, cache=self.cache,
                                 window=(*win.flat, keys))

    def report(self, fin: Finisher, b: int, xc: list[list[int]], final: int, schedule_done: bool) -> None:
        """Hand active row ``b``'s generated part (from ``xc``, the host copy of ``x`` as lists) to the finisher:
        positions before ``final`` as they are, the rest as masks (the block being denoised may still change) until
        the schedule is done."""
        r = self.active[b]
        P, total = r.plan.prompt_length, extent(r)
        view = xc[b][P:total]
        gen = view if schedule_done else view[:max(0, final - P)] + [self.engine.mask_id] * (total - max(final, P))
        fin.update(r, gen, schedule_done)

    def retire(self) -> None:
        """Drop the rows that finished."""
        self.keep([b for b, r in enumerate(self.active) if not r.done])
