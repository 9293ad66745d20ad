"""Likelihood scoring for masked diffusion models: LLaDA's Monte Carlo estimator of log p(target | prefix) and its
greedy check, with the arithmetic of the reference (ML-GSAI/LLaDA ``get_log_likelihood.py`` / ``eval_llada.py``).

Estimator: ``mc_num // batch_size`` mini-batches of ``batch_size`` copies of prefix + target. In each, a random count
``k`` in [1, n] (n = target length) sets evenly spread mask counts ``x_i`` for the copies; each copy masks ``x_i``
target positions chosen by a random permutation; the loss is the cross entropy of the masked positions divided by
their mask ratio ``x_i / n``, summed over the mini-batch and divided by ``batch_size``. The estimate is minus the mean
loss. The random draws come from one generator seeded with ``seed``, in the reference's order (``randint`` then one
``randperm`` per copy), so a seed gives the reference's value (the reference calls ``torch.manual_seed(seed)``).
With ``cfg_scale`` > 0 each copy is also run with the prefix masked and the logits mixed as the reference does."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _logits(model, batch: torch.Tensor, prefix_len: int, cfg_scale: float, mask_id: int) -> torch.Tensor:
    if cfg_scale > 0:
        un = batch.clone()
        un[:, :prefix_len] = mask_id
        batch = torch.cat([batch, un])
    pos = torch.arange(batch.shape[1], device=batch.device).expand(batch.shape[0], -1)
    logits = model.logits(model(batch, pos))
    if cfg_scale > 0:
        logits, un_logits = torch.chunk(logits, 2, dim=0)
        logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
    return logits


@torch.no_grad()
def log_likelihood(model, prefix: list[int], target: list[int], mask_id: int, mc_num: int = 128,
                   batch_size: int = 16, cfg_scale: float = 0.0, seed: int = 0) -> float:
    n, p = len(target), len(prefix)
    if n < 1 or p < 1:
        raise ValueError("the prefix and the target need at least one token each")
    if mc_num < batch_size or mc_num % batch_size:
        raise ValueError("mc_num must be a positive multiple of batch_size")
    dev = model.device
    g = torch.Generator().manual_seed(seed)
    seq = torch.tensor(prefix + target, device=dev)[None, :].repeat(batch_size, 1)
    losses = []
    for _ in range(mc_num // batch_size):
        k = torch.randint(1, n + 1, (), generator=g)
        x = torch.round(torch.linspace(float(k), k + (batch_size - 1) * (n / batch_size), steps=batch_size)).long()
        x = ((x - 1) % n) + 1
        is_mask = torch.arange(n).repeat(batch_size, 1) < x.unsqueeze(1)
        for i in range(batch_size):
            is_mask[i] = is_mask[i][torch.randperm(n, generator=g)]
        is_mask = torch.cat((torch.zeros(batch_size, p, dtype=torch.bool), is_mask), dim=1).to(dev)
        noisy = torch.where(is_mask, mask_id, seq)
        p_mask = (x / n).unsqueeze(1).repeat(1, p + n).to(dev)
        where = noisy == mask_id
        logits = _logits(model, noisy, p, cfg_scale, mask_id)
        loss = F.cross_entropy(logits[where], seq[where], reduction="none") / p_mask[where]
        losses.append((loss.sum() / batch_size).item())
    return -sum(losses) / len(losses)


@torch.no_grad()
def greedy_suffix(model, prefix: list[int], target: list[int], mask_id: int, cfg_scale: float = 0.0) -> bool:
    """Whether decoding the target's positions one at a time, most confident first (float32 softmax, as the
    reference's ``suffix_greedy_prediction``), reproduces the target."""
    p, n = len(prefix), len(target)
    seq = torch.full((1, p + n), mask_id, device=model.device)
    seq[0, :p] = torch.tensor(prefix, device=model.device)
    for _ in range(n):
        where = seq == mask_id
        logits = _logits(model, seq, p, cfg_scale, mask_id)[where]
        x0 = torch.argmax(logits, dim=-1)
        conf = torch.gather(torch.softmax(logits.to(torch.float32), dim=-1), -1, x0[:, None]).squeeze(-1)
        _, order = torch.sort(conf, descending=True)
        x0[order[1:]] = mask_id
        seq[where] = x0.clone()
    return bool(torch.all(seq[0, p:] == torch.tensor(target, device=model.device)))
