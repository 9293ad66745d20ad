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

    - fixed schedule (default): ``row.scheduled_transfers()`` (LLaDA's linear schedule);
    - ``threshold`` (Fast-dLLM): the most confident one always, plus every other one with confidence >= threshold;
    - ``factor`` (Fast-dLLM dynamic): with confidences sorted descending ``c_0 >= c_1 >= ...``, the first ``n`` with
      ``c_n < 1 - factor / (n + 2)`` (n >= 1) gives ``n`` tokens, with Fast-dLLM's edge rules (1 or all ``m`` when
      the cut falls on the first or last masked position)."""
    m = masked.sum(-1)
    k = torch.zeros_like(m)
    sorted_conf = None
    for b, row in enumerate(rows):
        p = row.params
        if p.threshold is None and p.factor is None:
            k[b] = row.scheduled_transfers()
    thr_rows = [b for b, r in enumerate(rows) if r.params.threshold is not None]
    if thr_rows:
        thr = torch.tensor([rows[b].params.threshold for b in thr_rows], device=conf.device, dtype=torch.float64)
        above = (conf[thr_rows].double() >= thr[:, None]).sum(-1)
        k[thr_rows] = torch.minimum(torch.clamp(above, min=1), m[thr_rows])
    fac_rows = [b for b, r in enumerate(rows) if r.params.factor is not None]
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


def select(conf: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Bool [B, K]: the ``k[b]`` most confident candidates of each row (never a -inf one)."""
    order = torch.sort(conf, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(conf.shape[1], device=conf.device).expand_as(order))
    return (rank < k[:, None]) & (conf > NEG_INF)


def denoise(logits: torch.Tensor, tokens: torch.Tensor, widths: list[int], rows, mask_id: int):
    """One step's decision for a batch of rows: (x0 [B, K], transfer [B, K] bool). Row b's candidates are its
    first ``widths[b]`` columns."""
    valid = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < torch.tensor(widths, device=tokens.device)[:, None]
    masked = (tokens == mask_id) & valid
    x0, prob = choose_tokens(logits, rows, widths)
    conf = confidence(prob, masked, rows, widths)
    k = transfer_counts(conf, masked, rows)
    return x0, select(conf, k)
