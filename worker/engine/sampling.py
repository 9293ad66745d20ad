"""Token choice and transfer rules of one denoising step, vectorised over the rows of a batch.

Every function here works on the *candidate* positions of each row (its current block, plus any position of an
earlier block that still holds a mask), padded to a common width ``K``; ``valid`` marks real candidates."""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def choose_tokens(logits: torch.Tensor, rows, widths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """x0 (the proposed token per position) and the softmax probability of x0 under the *un-noised* logits.

    ``logits``: [B, K, V]. Rows with ``temperature > 0`` sample with float64 Gumbel-max noise from their own
    generator: ``argmax(exp(l) / (-log u)^T)``, computed as ``argmax(l - T * log(-log u))`` (same argmax, no
    overflow). Noise is drawn for the row's own ``widths[b]`` candidates only, so a seeded row draws the same
    numbers whatever batch it is in. The probability is computed in float32 (``exp(l[x0] - logsumexp(l))``)."""
    x0 = logits.argmax(-1)
    for b, row in enumerate(rows):
        t = row.params.temperature
        if t > 0:
            lb = logits[b, : widths[b]].double()
            u = torch.rand(lb.shape, dtype=torch.float64, device=lb.device, generator=row.generator)
            x0[b, : widths[b]] = (lb - t * torch.log(-torch.log(u))).argmax(-1)
    lf = logits.float()
    prob = torch.exp(lf.gather(-1, x0.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(lf, -1))
    return x0, prob


def confidence(prob: torch.Tensor, masked: torch.Tensor, rows, widths: list[int]) -> torch.Tensor:
    """Confidence per candidate: x0's probability (``low_confidence``) or uniform noise (``random``);
    -inf where the position is not masked."""
    conf = prob
    if any(r.params.remasking == "random" for r in rows):
        conf = prob.clone()
        for b, row in enumerate(rows):
            if row.params.remasking == "random":
                conf[b, : widths[b]] = torch.rand(widths[b], device=prob.device, generator=row.generator,
                                                  dtype=prob.dtype)
    return torch.where(masked, conf, torch.full_like(conf, NEG_INF))


def transfer_counts(conf: torch.Tensor, masked: torch.Tensor, rows) -> torch.Tensor:
    """How many masked candidates each row commits this step ([B] long), by the row's rule:

    - ``fixed`` (default): ``row.scheduled_transfers()`` (LLaDA's linear schedule);
    - ``threshold`` (Fast-dLLM): the most confident one always, plus every other one with confidence >= threshold;
    - ``factor`` (Fast-dLLM dynamic): with confidences sorted descending ``c_0 >= c_1 >= ...``, the first ``n`` with
      ``c_n < 1 - factor / (n + 2)`` (n >= 1) gives ``n`` tokens, with Fast-dLLM's edge rules (1 or all ``m`` when
      the cut falls on the first or last masked position)."""
    m = masked.sum(-1)
    k = torch.zeros_like(m)
    for b, row in enumerate(rows):
        if row.rule == "fixed":
            k[b] = row.scheduled_transfers()
    thr_rows = [b for b, r in enumerate(rows) if r.rule == "threshold"]
    if thr_rows:
        thr = torch.tensor([rows[b].params.threshold for b in thr_rows], device=conf.device, dtype=torch.float64)
        above = (conf[thr_rows].double() >= thr[:, None]).sum(-1)
        k[thr_rows] = torch.minimum(torch.clamp(above, min=1), m[thr_rows])
    fac_rows = [b for b, r in enumerate(rows) if r.rule == "factor"]
    if fac_rows:
        sorted_conf = conf[fac_rows].sort(-1, descending=True).values.double()
        n = torch.arange(conf.shape[1], device=conf.device, dtype=torch.float64)
        fac = torch.tensor([rows[b].params.factor for b in fac_rows], device=conf.device, dtype=torch.float64)
        cut = 1.0 - fac[:, None] / (n[None, :] + 2.0)
        cut[:, 0] = -1.0
        mm = m[fac_rows]
        below = (sorted_conf < cut) & (n[None, :] < mm[:, None])
        first = torch.where(below.any(-1), below.float().argmax(-1), mm - 1)
        first = torch.where((first == 0) | (first == mm - 1), first + 1, first)
        k[fac_rows] = torch.minimum(first.long(), mm)
    return k


def select_top(conf: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Bool [B, K]: the ``k[b]`` most confident candidates of each row (never a -inf one)."""
    order = torch.sort(conf, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(conf.shape[1], device=conf.device).expand_as(order))
    return (rank < k[:, None]) & (conf > NEG_INF)


def select_dinfer_threshold(conf: torch.Tensor, threshold: float) -> torch.Tensor:
    """dInfer's threshold rule for one row: every candidate with confidence >= min(threshold, best - 1e-5), so a
    step commits at least its most confident token."""
    best = conf.max()
    if best == NEG_INF:
        return torch.zeros_like(conf, dtype=torch.bool)
    return conf >= torch.clamp(best - 1e-5, max=threshold)


def select_hierarchy(conf: torch.Tensor, masked: torch.Tensor, threshold: float, low: float) -> torch.Tensor:
    """dInfer's hierarchical rule for one row: in each contiguous run of masked candidates, its most confident token
    if above ``low``; plus every token above ``threshold``; plus the row's most confident token, so it progresses."""
    if not masked.any():
        return torch.zeros_like(masked)
    prev = torch.cat([masked.new_zeros(1), masked[:-1]])
    seg = torch.cumsum((masked & ~prev).long(), 0) - 1
    seg = torch.where(masked, seg, torch.zeros_like(seg))
    seg_max = torch.full_like(conf, NEG_INF).scatter_reduce(0, seg, conf, reduce="amax", include_self=True)
    pick = masked & (conf == seg_max.gather(0, seg)) & (conf > low)
    pick |= masked & (conf > threshold)
    pick[conf.argmax()] = True
    return pick & masked


def fuse_credit(logits: torch.Tensor, masked: torch.Tensor, row, width: int) -> torch.Tensor:
    """dInfer's credit decoding for one row: a per-block credit matrix (decayed by ``decay_beta`` every step) gains
    ``p_top1 ** boost_gamma`` at each masked position's top-1 token; the logits used to decide are
    ``logits + credit_alpha * log(1 + credit)``."""
    e = row.params.extra
    lf = logits[:width].float()
    if row.credit is None or row.credit.shape != lf.shape:
        row.credit = torch.zeros_like(lf)
    else:
        row.credit.mul_(e["decay_beta"])
    top_p, top_i = lf.softmax(-1).max(-1)
    gain = top_p.pow(e["boost_gamma"]) * masked[:width].float()
    row.credit.scatter_add_(1, top_i[:, None], gain[:, None])
    fused = logits.clone()
    fused[:width] = (lf + e["credit_alpha"] * torch.log1p(row.credit)).to(logits.dtype)
    return fused


def denoise(logits: torch.Tensor, tokens: torch.Tensor, widths: list[int], rows, mask_id: int):
    """One step's decision for a batch of rows: (x0 [B, K], transfer [B, K] bool). Row b's candidates are its
    first ``widths[b]`` columns."""
    valid = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < torch.tensor(widths, device=tokens.device)[:, None]
    masked = (tokens == mask_id) & valid
    if any(r.rule == "dinfer_credit" for r in rows):
        logits = torch.stack([fuse_credit(logits[b], masked[b], r, widths[b]) if r.rule == "dinfer_credit"
                              else logits[b] for b, r in enumerate(rows)])
    x0, prob = choose_tokens(logits, rows, widths)
    conf = confidence(prob, masked, rows, widths)
    chosen = torch.zeros_like(masked)
    top = [b for b, r in enumerate(rows) if r.rule in ("fixed", "threshold", "factor")]
    if top:
        sub = [rows[b] for b in top]
        chosen[top] = select_top(conf[top], transfer_counts(conf[top], masked[top], sub))
    for b, r in enumerate(rows):
        if r.rule in ("dinfer_threshold", "dinfer_credit", "dinfer_hierarchy"):
            c = torch.where(x0[b] != mask_id, conf[b], torch.full_like(conf[b], NEG_INF))   # never commit the mask
            if r.rule == "dinfer_hierarchy":
                chosen[b] = select_hierarchy(c, masked[b] & (c > NEG_INF), r.params.threshold,
                                             r.params.extra["low_threshold"])
            else:
                chosen[b] = select_dinfer_threshold(c, r.params.threshold) & masked[b]
    return x0, chosen
