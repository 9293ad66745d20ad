"""Token choice, confidence and transfer rules of one denoising step, with each reference's own arithmetic.

Every function works on the *candidate* positions of each row (its current block, plus any position of an earlier
block that still holds a mask where the reference ranks those too), padded to a common width ``K``; row b's
candidates are its first ``widths[b]`` columns.

Exactness depends on doing what the reference does, not something mathematically equal:

- **confidence** is ``softmax(logits)[x0]`` with the reference's dtype (:class:`Softmax`): near 1 the float32
  softmax still tells 0.99999988 from 0.99999964, where ``exp(l - logsumexp(l))`` rounds both to 1.0;
- **ties** (many confidences are exactly 1.0 on real models) are broken by ``torch.topk`` itself, called on a vector
  of the reference's shape (:class:`Layout`): the reference ranks the whole sequence (or window) with -inf outside
  the candidates, and ``topk``'s choice among equal values depends on that vector, not only on the values;
- **comparisons** with ``threshold`` are made between the reference's confidence dtype and a Python float, as the
  reference makes them.

The softmax runs only over the masked candidates (the other positions' confidences are -inf anyway); its result at a
position does not depend on which other positions are in the tensor (tests/test_sampling.py checks it)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")
SOFTMAX_CHUNK_BYTES = 256 << 20     # a float64 softmax over a 126k vocabulary takes 1 MB per position


class Softmax(enum.Enum):
    """How a reference computes the confidence of the proposed token ``x0``."""

    MODEL = "F.softmax(logits) in the logits' dtype, then gather at x0"              # LLaDA generate.py, Nemotron
    FLOAT64 = "F.softmax(logits.to(float64)), then gather at x0"                     # Fast-dLLM
    FLOAT32 = "F.softmax(logits.to(float32)), then gather at x0"                     # dInfer threshold decoders
    EXP_LOG_SOFTMAX = "F.log_softmax(logits) in the logits' dtype, gather at x0, exp"  # dInfer HierarchyDecoder

    def probability(self, logits: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        """``logits`` [N, V], ``x0`` [N] -> the confidence [N] (in the dtype the reference gets)."""
        if self is Softmax.EXP_LOG_SOFTMAX:
            return F.log_softmax(logits, dim=-1).gather(-1, x0[:, None]).squeeze(-1).exp()
        if self is Softmax.FLOAT64:
            logits = logits.to(torch.float64)
        elif self is Softmax.FLOAT32:
            logits = logits.to(torch.float32)
        return F.softmax(logits, dim=-1).gather(-1, x0[:, None]).squeeze(-1)

    def dtype(self, logits_dtype: torch.dtype) -> torch.dtype:
        return {Softmax.FLOAT64: torch.float64, Softmax.FLOAT32: torch.float32}.get(self, logits_dtype)


@dataclass(frozen=True)
class Layout:
    """Where a row's candidates sit in the confidence vector its reference passes to ``torch.topk``: the vector's
    ``length`` and the index ``at`` of candidate 0 (candidate j is element ``at + j``; every other element is -inf).
    E.g. LLaDA's ``generate``: the whole sequence, ``Layout(prompt + canvas, prompt + region start)``."""

    length: int
    at: int


def propose(logits: torch.Tensor, rows, widths: list[int]) -> torch.Tensor:
    """x0, the proposed token at every candidate ([B, K] long): the argmax of the logits (first index among equal
    maxima), or with ``temperature > 0`` the reference's float64 Gumbel-max ``argmax(exp(l) / (-log u) ** T)``.
    The noise comes from the row's own generator and only for its own candidates, so a seeded row draws the same
    numbers in any batch (the reference draws for the whole canvas from the global generator)."""
    x0 = logits.argmax(-1)
    for b, row in enumerate(rows):
        t = row.params.temperature
        if t > 0:
            lb = logits[b, : widths[b]].to(torch.float64)
            u = torch.rand(lb.shape, dtype=torch.float64, device=lb.device, generator=row.generator)
            x0[b, : widths[b]] = (lb.exp() / (-torch.log(u)) ** t).argmax(-1)
    return x0


def _softmax_rows(kind: Softmax, logits: torch.Tensor, x0: torch.Tensor, bi: torch.Tensor,
                  ki: torch.Tensor) -> torch.Tensor:
    """Confidences at the candidates (bi, ki) of one Softmax kind, in chunks that bound the float64 temporary."""
    V = logits.shape[-1]
    chunk = max(1, SOFTMAX_CHUNK_BYTES // (V * 8))
    out = [kind.probability(logits[bi[i:i + chunk], ki[i:i + chunk]], x0[bi[i:i + chunk], ki[i:i + chunk]])
           for i in range(0, len(bi), chunk)]
    return torch.cat(out) if out else logits.new_empty(0, dtype=kind.dtype(logits.dtype))


def confidences(logits: torch.Tensor, x0: torch.Tensor, masked: torch.Tensor, rows, widths: list[int],
                kinds: list[Softmax]) -> list[torch.Tensor]:
    """Per row, its candidates' confidences (1-D, ``widths[b]`` long, in the reference's dtype; -inf where the
    position is not masked). ``remasking: random`` rows get uniform float32 noise, as the references draw it."""
    out: list[torch.Tensor | None] = [None] * len(rows)
    for kind in dict.fromkeys(kinds):
        members = [b for b, k in enumerate(kinds) if k is kind and rows[b].params.remasking != "random"]
        if not members:
            continue
        sel = torch.zeros_like(masked)
        sel[members] = masked[members]
        bi, ki = sel.nonzero(as_tuple=True)
        c = _softmax_rows(kind, logits, x0, bi, ki)
        full = torch.full(masked.shape, NEG_INF, dtype=c.dtype, device=c.device)
        full[bi, ki] = c
        for b in members:
            out[b] = full[b, : widths[b]]
    for b, row in enumerate(rows):
        if row.params.remasking == "random":
            u = torch.rand(widths[b], device=logits.device, generator=row.generator)
            out[b] = torch.where(masked[b, : widths[b]], u, torch.full_like(u, NEG_INF))
    return out


def ranked(conf: torch.Tensor, layout: Layout, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(vector, k)`` on the reference's confidence vector: (values, candidate indices), sorted."""
    vec = torch.full((layout.length,), NEG_INF, dtype=conf.dtype, device=conf.device)
    vec[layout.at: layout.at + conf.shape[0]] = conf
    values, idx = torch.topk(vec, k)
    return values, idx - layout.at


def select_fixed(conf: torch.Tensor, layout: Layout, k: int) -> torch.Tensor:
    """LLaDA's schedule: the ``k`` most confident candidates, as ``torch.topk`` ranks them."""
    return ranked(conf, layout, k)[1]


def select_threshold(conf: torch.Tensor, layout: Layout, masked: int, threshold: float) -> torch.Tensor:
    """Fast-dLLM's threshold rule (and Nemotron's): rank every masked candidate with ``topk``; the first is
    committed, each other one unless its confidence ``< threshold`` (compared in the confidence's dtype)."""
    values, idx = ranked(conf, layout, masked)
    keep = ~(values < threshold)
    keep[:1] = True
    return idx[keep]


def select_factor(conf: torch.Tensor, layout: Layout, masked: torch.Tensor, factor: float) -> torch.Tensor:
    """Fast-dLLM's dynamic rule (``get_transfer_index_dynamic``): with the masked confidences sorted descending,
    ``n`` = the first index whose confidence is below ``1 - factor / (n + 1)`` (counting from 1; the first never
    is), moved up by one when it falls on the first or last masked position; then the top ``n`` by ``topk``."""
    ranked_conf = torch.sort(conf[masked], descending=True).values.tolist()
    m = len(ranked_conf)
    if m == 0:
        return ranked(conf, layout, 0)[1]
    cuts = [1 - factor / (n + 1) for n in range(1, m + 1)]
    cuts[0] = -1
    top = m - 1
    for i in range(m):
        if ranked_conf[i] < cuts[i]:
            top = i
            break
    if top == 0 or top == m - 1:
        top += 1
    return ranked(conf, layout, top)[1]


def select_dinfer_threshold(conf: torch.Tensor, x0: torch.Tensor, masked: torch.Tensor, threshold: float,
                            mask_id: int) -> torch.Tensor:
    """dInfer's ``get_transfer_index_threshold`` for one row (float32 confidences): positions whose proposal is the
    mask token are left out; every other masked one with confidence >= (best - 1e-5) clamped to [-1000, threshold]
    is committed, so a step commits at least its most confident token. Bool over the candidates."""
    eligible = masked & (x0 != mask_id)
    c = torch.where(eligible, conf, torch.full_like(conf, NEG_INF))
    return (c >= (c.max() - 1e-5).clamp(-1000, threshold)) & masked


def select_hierarchy(conf: torch.Tensor, masked: torch.Tensor, threshold: float | None,
                     low: float | None) -> torch.Tensor:
    """dInfer's ``HierarchyDecoder`` for one row: non-masked positions get the dtype's lowest value; in each
    contiguous run of masked candidates every position equal to the run's best, if > ``low``; plus every position
    > ``threshold``; plus the first most confident position; then only masked ones. Bool over the candidates."""
    lowest = torch.finfo(conf.dtype).min
    c = torch.where(masked, conf, torch.full_like(conf, lowest))
    prev = torch.cat([masked.new_zeros(1), masked[:-1]])
    seg = torch.cumsum((masked & ~prev).long(), 0) - 1
    seg = torch.where(masked, seg, torch.zeros_like(seg))
    seg_max = torch.full_like(c, lowest).scatter_reduce(0, seg, c, reduce="amax", include_self=True)
    pick = c == seg_max.gather(0, seg)
    if low is not None:
        pick &= torch.gt(c, low)
    if threshold is not None:
        pick |= torch.gt(c, threshold)
    pick[torch.argmax(c)] = True
    return pick & masked


def fuse_credit(logits: torch.Tensor, masked: torch.Tensor, row) -> torch.Tensor:
    """dInfer's credit fusion (``CreditThresholdParallelDecoder``) for one row's candidates ``logits`` [w, V]: a
    float32 credit matrix for the block, decayed by ``decay_beta`` from its second step on, gains
    ``p_top1 ** boost_gamma`` at each masked position's top-1 token (float32 softmax); returns the float32 logits
    ``logits + credit_alpha * log(credit + 1)`` the decision is made on."""
    e = row.params.extra
    if row.credit is None or row.credit.shape != logits.shape:
        row.credit = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    else:
        row.credit.mul_(e["decay_beta"])
    top_p, top_i = F.softmax(logits.to(torch.float32), dim=-1).max(-1)
    gain = top_p.pow(e["boost_gamma"]).to(torch.float32) * masked.to(torch.float32)
    row.credit.scatter_add_(1, top_i[:, None], gain[:, None])
    return logits + e["credit_alpha"] * torch.log(row.credit + 1)


TOPK_RULES = ("fixed", "threshold", "factor")


def denoise(logits: torch.Tensor, tokens: torch.Tensor, widths: list[int], rows, mask_id: int,
            layouts: list[Layout | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's decision for a batch of rows: (x0 [B, K], transfer [B, K] bool). ``tokens``: the candidates'
    current ids; ``layouts[b]``: row b's topk vector (rows with a topk rule). Each row's confidence arithmetic is
    ``row.softmax`` (set by its algorithm), its rule ``row.rule``."""
    B, K = tokens.shape
    valid = torch.arange(K, device=tokens.device)[None, :] < torch.tensor(widths, device=tokens.device)[:, None]
    masked = (tokens == mask_id) & valid
    x0 = propose(logits, rows, widths)
    chosen = torch.zeros_like(masked)
    credit = [b for b, r in enumerate(rows) if r.rule == "dinfer_credit"]
    plain = [b for b, r in enumerate(rows) if r.rule != "dinfer_credit"]
    conf: list[torch.Tensor | None] = [None] * B
    if plain:
        sub = confidences(logits[plain], x0[plain], masked[plain], [rows[b] for b in plain],
                          [widths[b] for b in plain], [rows[b].softmax for b in plain])
        for b, c in zip(plain, sub):
            conf[b] = c
    for b in credit:   # the decision is made on the fused (float32) logits
        w = widths[b]
        fused = fuse_credit(logits[b, :w], masked[b, :w], rows[b])
        x0[b, :w] = propose(fused[None], [rows[b]], [w])[0]
        conf[b] = confidences(fused[None], x0[b:b + 1, :w], masked[b:b + 1, :w], [rows[b]], [w],
                              [Softmax.FLOAT32])[0]
    for b, r in enumerate(rows):
        w, rule, m = widths[b], r.rule, masked[b, : widths[b]]
        if rule == "fixed":
            idx = select_fixed(conf[b], layouts[b], r.scheduled_transfers())
        elif rule == "threshold":
            idx = select_threshold(conf[b], layouts[b], int(m.sum()), r.params.threshold)
        elif rule == "factor":
            idx = select_factor(conf[b], layouts[b], m, r.params.factor)
        elif rule == "dinfer_hierarchy":
            chosen[b, :w] = select_hierarchy(conf[b], m, r.params.threshold, r.params.extra["low_threshold"])
            continue
        else:   # dinfer_threshold, dinfer_credit
            chosen[b, :w] = select_dinfer_threshold(conf[b], x0[b, :w], m, r.params.threshold, mask_id)
            continue
        # topk never reaches past the candidates (there are always at least k of them with a finite confidence);
        # a non-masked candidate's x0 is its own token in the reference, so committing it would change nothing.
        idx = idx[(idx >= 0) & (idx < w)]
        chosen[b, idx] = True
    return x0, chosen & masked
