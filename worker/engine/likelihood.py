"""Likelihood scoring for masked diffusion models: LLaDA's Monte Carlo estimator of log p(target | prefix) and its
greedy check, with the arithmetic of the reference (ML-GSAI/LLaDA ``get_log_likelihood.py`` / ``eval_llada.py``).

Estimator: ``mc_num // batch_size`` mini-batches of ``batch_size`` copies of prefix + target. In each, a random count
``k`` in [1, n] (n = target length) sets evenly spread mask counts ``x_i`` for the copies; each copy masks ``x_i``
target positions chosen by a random permutation; the loss is the cross entropy of the masked positions divided by
their mask ratio ``x_i / n``, summed over the mini-batch and divided by ``batch_size``. The estimate is minus the mean
loss. The random draws come from one generator seeded with ``seed``, in the reference's order (``randint`` then one
``randperm`` per copy), so a seed gives the reference's value (the reference calls ``torch.manual_seed(seed)``).
With ``cfg_scale`` > 0 each copy is also run with the prefix masked and the logits mixed as the reference does.

:func:`score` runs many estimates at once: several prompts, and for each several splits of the prompt into prefix and
target (each split draws its own masks from a generator seeded with the prompt's seed, so each equals the reference run
alone). Identical noisy copies are forwarded once (a one-token target masks the same position in every copy), the
forwards of all prompts share batches of at most ``max_rows`` rows (shorter rows right-padded, padding masked out of
attention), and only the masked positions' logits are computed. The greedy check (the reference's
``suffix_greedy_prediction``: fill the target one position per step, the most confident first) runs for every split
in lockstep, and stops a split at its first wrong token (a committed token is never changed, so the answer is known)."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import ctypes.util
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .params import MIN_FORWARD_TOKENS


@dataclass
class ScoreRequest:
    ids: list[int]                  # prefix + target, for every split
    splits: list[int]               # prefix lengths to estimate, each in [1, len(ids) - 1]
    mc_num: int = 128
    batch_size: int = 32
    cfg_scale: float = 0.0
    seed: int = 0
    check_greedy: bool = True
    next_token: bool = False        # also predict one token after ids (one masked position, argmax)


@dataclass
class ScoreResult:
    log_likelihoods: list[float]            # one per split
    greedy: list[bool | None]               # one per split (None: not checked)
    next_token: int | None = None
    next_logprob: float | None = None
    forward_rows: int = 0                   # rows forwarded (after merging identical copies)


class Cancelled(Exception):
    pass


def cost(req: ScoreRequest) -> int:
    """A scoring request's nominal cost in token-forwards (as params.row_cost): ``mc_num`` copies per split, the
    greedy check's one forward per target token, the next-token forward, each of at least MIN_FORWARD_TOKENS
    tokens (a copy of a short prompt costs its random draws and bookkeeping whatever its length: a review's 24
    two-token prompts at mc_num 65,536 passed the limit at 3 tokens a copy and held a worker for four minutes);
    doubled with classifier-free guidance."""
    n = len(req.ids)
    copies = len(req.splits) * req.mc_num
    greedy = sum(n - s for s in req.splits) if req.check_greedy else 0
    return (copies + greedy + int(req.next_token)) * max(MIN_FORWARD_TOKENS, n + 1) * (2 if req.cfg_scale > 0 else 1)


def check(req: ScoreRequest) -> None:
    n = len(req.ids)
    if not req.splits or any(not 1 <= s < n for s in req.splits):
        raise ValueError("the prefix and the target need at least one token each")
    if req.batch_size < 1 or req.mc_num < req.batch_size or req.mc_num % req.batch_size:
        raise ValueError("mc_num must be a positive multiple of batch_size")


@dataclass
class _Estimate:
    """One (prompt, split): its mini-batches' copies as indices into the prompt's distinct noisy rows."""
    req: int
    prefix: int
    batches: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)   # (row per copy, ratio per copy)


def _draw(req: ScoreRequest, split: int, mask_id: int, seq: torch.Tensor, rows: dict, est: _Estimate):
    """The reference's random draws for one split, in its order; each copy's noisy row is numbered in ``rows``
    ((prefix length, row bytes) -> (index, prefix length, row)), identical rows once. A generator: it yields the
    tokens of each mini-batch's copies once drawn (a chunk's draws took 1.5 s of one turn beside generation rows:
    a review), as a forward over them would be charged."""
    p, n, bs = split, len(req.ids) - split, req.batch_size
    g = torch.Generator().manual_seed(req.seed)
    for _ in range(req.mc_num // bs):
        k = torch.randint(1, n + 1, (), generator=g)
        x = torch.round(torch.linspace(float(k), k + (bs - 1) * (n / bs), steps=bs)).long()
        x = ((x - 1) % n) + 1
        is_mask = torch.arange(n).repeat(bs, 1) < x.unsqueeze(1)
        for i in range(bs):
            is_mask[i] = is_mask[i][torch.randperm(n, generator=g)]
        is_mask = torch.cat((torch.zeros(bs, p, dtype=torch.bool), is_mask), dim=1)
        noisy = torch.where(is_mask, mask_id, seq)
        which = []
        for i in range(bs):
            key = (p, noisy[i].numpy().tobytes())
            if key not in rows:
                rows[key] = (len(rows), p, noisy[i])
            which.append(rows[key][0])
        est.batches.append((which, x))
        yield noisy.numel()


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")    # (find_library may run ldconfig: once)
    except OSError:
        return None


def _mmap_threshold(nbytes: int) -> None:
    try:
        _libc().mallopt(-3, nbytes)     # M_MMAP_THRESHOLD (glibc); fixed from then on
    except AttributeError:              # not glibc
        pass


@contextlib.contextmanager
def returned_memory():
    """Around each scoring forward (a scoring group's step, beside generation steps): while likelihood scoring runs (thousands of forwards whose activations are freed and allocated again on the
    device thread), glibc mmaps blocks of 1 MiB and more and gives them back when freed. Otherwise glibc raises its
    mmap threshold as such blocks are freed and the device thread's arena keeps their memory: a long scoring request
    grew a worker by 1.8 GB in 25 s (docs/reliability.md). Afterwards the threshold is 32 MiB (glibc's own ceiling),
    so generation allocates as before (a low threshold for everything cost CPU generation 10-60%)."""
    _mmap_threshold(1 << 20)
    try:
        yield
    finally:
        _mmap_threshold(32 << 20)


MAX_FORWARD_TOKENS = 32768     # canvas tokens per scoring forward (bounds activation memory on long prompts)


MAX_CHUNK_ROWS = 4096         # distinct noisy rows drawn and held at once (bounds host memory for any mc_num)


def _forward_rows(model, mask_id: int, cfg_scale: float, items: list, max_rows: int, cancelled,
                  max_tokens: int = MAX_FORWARD_TOKENS, reduce=None):
    """items: (prefix_len, noisy row [L] long, needed positions [m] long). Returns (a generator's value: it yields
    each forward's token count after the forward), per item, the logits at its needed positions (with
    classifier-free guidance mixed in when cfg_scale > 0), or ``reduce(i, logits)`` of them (kept instead of the
    logits: memory), in batches of at most ``max_rows`` forward rows and ``max_tokens`` tokens, right-padded to the
    longest row of the batch."""
    out: list = [None] * len(items)
    per = 2 if cfg_scale > 0 else 1
    order = sorted(range(len(items)), key=lambda i: -len(items[i][1]))
    dev = model.device
    b = 0
    while b < len(order):
        if cancelled():
            raise Cancelled()
        width = len(items[order[b]][1])
        step = max(1, min(max_rows, max_tokens // width) // per)
        chunk = order[b:b + step]
        b += step
        ids = torch.full((len(chunk) * per, width), mask_id, dtype=torch.long)
        keys = torch.zeros(len(chunk) * per, width, dtype=torch.bool)
        for j, i in enumerate(chunk):
            p, row, _ = items[i]
            ids[j, :len(row)] = row
            keys[j, :len(row)] = True
            if per == 2:
                un = row.clone()
                un[:p] = mask_id
                ids[len(chunk) + j, :len(row)] = un
                keys[len(chunk) + j, :len(row)] = True
        padded = not bool(keys.all())
        ids, keys = ids.to(dev), keys.to(dev)
        pos = torch.arange(width, device=dev).expand(ids.shape[0], -1)
        h = model(ids, pos, keys[:, None, None, :] if padded else None)
        for j, i in enumerate(chunk):
            need = items[i][2].to(dev)
            logits = model.logits(h[j, need])
            if per == 2:
                un_logits = model.logits(h[len(chunk) + j, need])
                logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
            out[i] = logits if reduce is None else reduce(i, logits)
        forwarded = ids.numel()
        # (nothing of the forward stays alive while generation rows take their turn: its activations held the
        # device's memory beside theirs, a review)
        del ids, keys, pos, h, logits, need
        if per == 2:
            del un_logits
        yield forwarded
    return out


def _monte_carlo(model, mask_id: int, requests: list[ScoreRequest], results: list, live, cancelled,
                 max_rows: int):
    """The estimates (see the module's docstring); a request cancelled meanwhile gets None."""
    # --- Monte Carlo estimates: distinct noisy rows, forwarded together (one cfg scale per forward), in chunks of
    # at most MAX_CHUNK_ROWS rows (whole splits), each row's logits reduced to its cross entropies at once: host and
    # device memory are bounded whatever mc_num asks, and a cancelled request stops between chunks and forwards
    for cfg in sorted({r.cfg_scale for r in requests}):
        group = [i for i, r in enumerate(requests) if r.cfg_scale == cfg]
        work = [(i, s) for i in group for s in requests[i].splits]
        while work:
            if not any(live(i) for i in group):
                break
            items, owners, ests = [], [], []
            while work and (not items or len(items) < MAX_CHUNK_ROWS):
                i, s = work.pop(0)
                if not live(i):
                    continue
                r = requests[i]
                e = _Estimate(i, s)
                rows: dict = {}
                yield from _draw(r, s, mask_id, torch.tensor(r.ids)[None, :].repeat(r.batch_size, 1), rows, e)
                base = len(items)
                for _, p, row in rows.values():
                    items.append((p, row, (row == mask_id).nonzero().squeeze(1)))
                    owners.append(i)
                e.batches = [([base + w for w in which], x) for which, x in e.batches]
                ests.append(e)
            targets = {i: torch.tensor(requests[i].ids, device=model.device) for i in set(owners)}
            # the reference's arithmetic per mini-batch: cross entropy of every masked position of every copy
            # (row-major, as logits[mask_index] orders them) divided by the copy's ratio, summed, / batch_size
            ce = lambda k, lg: F.cross_entropy(lg, targets[owners[k]][items[k][2].to(model.device)], reduction="none")
            try:
                ces = yield from _forward_rows(model, mask_id, cfg, items, max_rows,
                                               lambda: not any(live(i) for i in group), reduce=ce)
            except Cancelled:
                break
            for i in set(owners):
                if results[i] is not None:
                    results[i].forward_rows += sum(1 for o in owners if o == i) * (2 if cfg > 0 else 1)
            for e in ests:
                res, r = results[e.req], requests[e.req]
                if res is None:
                    continue
                n = len(r.ids) - e.prefix
                losses = []
                for which, x in e.batches:
                    parts = [ces[w] / torch.full((len(items[w][2]),), xi / n, dtype=torch.float32,
                                                 device=model.device) for w, xi in zip(which, x.tolist())]
                    losses.append((torch.cat(parts).sum() / r.batch_size).item())
                res.log_likelihoods[r.splits.index(e.prefix)] = -sum(losses) / len(losses)
            del items, ces
        for i in group:
            if cancelled(i):
                results[i] = None


def _greedy_checks(model, mask_id: int, requests: list[ScoreRequest], results: list, live, cancelled,
                   max_rows: int):
    """``check_greedy``: is the continuation what greedy decoding of its positions gives?"""
    # --- greedy checks, all splits in lockstep: [request, split index, canvas, steps left]
    states = []
    for i, r in enumerate(requests):
        if results[i] is None or not r.check_greedy:
            continue
        for k, s in enumerate(r.splits):
            canvas = torch.tensor(r.ids)
            canvas[s:] = mask_id
            states.append([i, k, canvas, len(r.ids) - s])
    for cfg in sorted({requests[st[0]].cfg_scale for st in states}):
        active = [st for st in states if requests[st[0]].cfg_scale == cfg]
        while active:
            active = [st for st in active if live(st[0])]
            if not active:
                break
            items = [(requests[i].splits[k], canvas, (canvas == mask_id).nonzero().squeeze(1))
                     for i, k, canvas, _ in active]
            logits = yield from _forward_rows(model, mask_id, cfg, items, max_rows, lambda: False)
            going = []
            for st, item, lg in zip(active, items, logits):
                i, k, canvas, left = st
                r, s = requests[i], requests[i].splits[k]
                results[i].forward_rows += 2 if cfg > 0 else 1
                x0 = torch.argmax(lg, dim=-1).cpu()
                conf = torch.gather(torch.softmax(lg.to(torch.float32), dim=-1), -1, x0[:, None].to(lg.device))
                _, order = torch.sort(conf.squeeze(-1), descending=True)
                pos = int(item[2][order[0]])
                canvas[pos] = x0[order[0]]
                st[3] = left = left - 1
                if pos >= s and int(canvas[pos]) != r.ids[pos]:
                    results[i].greedy[k] = False        # committed tokens never change: the check has failed
                elif left == 0:
                    results[i].greedy[k] = canvas[s:].tolist() == r.ids[s:]
                else:
                    going.append(st)
            active = going


def _next_tokens(model, mask_id: int, requests: list[ScoreRequest], results: list, live, cancelled,
                 max_rows: int):
    """``max_tokens`` 1: the token after the prompt and its log-probability."""
    # --- the token after the prompt (max_tokens 1): one masked position, argmax, its log-probability
    nxt = [i for i, r in enumerate(requests) if r.next_token and live(i)]
    for cfg in sorted({requests[i].cfg_scale for i in nxt}):
        group = [i for i in nxt if requests[i].cfg_scale == cfg]
        items = [(len(requests[i].ids), torch.tensor(requests[i].ids + [mask_id]),
                  torch.tensor([len(requests[i].ids)])) for i in group]
        logits = yield from _forward_rows(model, mask_id, cfg, items, max_rows, lambda: False)
        for i, lg in zip(group, logits):
            lp = torch.log_softmax(lg[0].to(torch.float32), dim=-1)
            t = int(torch.argmax(lg[0]))
            results[i].next_token, results[i].next_logprob = t, float(lp[t])
            results[i].forward_rows += 2 if cfg > 0 else 1


@torch.no_grad()          # (on a generator function: around each of its resumptions)
def score_steps(model, mask_id: int, requests: list[ScoreRequest], *, max_rows: int = 64,
                cancelled=lambda i: False):
    """:func:`score` one forward at a time: a generator that yields each forward's token count after the forward,
    and the drawn tokens after each mini-batch of random draws (the worker's batch gives generation rows their steps
    between them: worker/engine/engine.py ``_ScoreGroup``), and returns the results."""
    for r in requests:
        check(r)
    results: list[ScoreResult | None] = [ScoreResult([0.0] * len(r.splits), [None] * len(r.splits))
                                         for r in requests]
    live = lambda i: results[i] is not None and not cancelled(i)

    for part in (_monte_carlo, _greedy_checks, _next_tokens):
        yield from part(model, mask_id, requests, results, live, cancelled, max_rows)
    for i in range(len(requests)):
        if results[i] is not None and cancelled(i):
            results[i] = None
    return results


def score(model, mask_id: int, requests: list[ScoreRequest], *, max_rows: int = 64,
          cancelled=lambda i: False) -> list[ScoreResult | None]:
    """Estimates for every request and split (see the module's docstring). ``cancelled(i)`` is asked between
    forwards; a cancelled request's result is None."""
    steps = score_steps(model, mask_id, requests, max_rows=max_rows, cancelled=cancelled)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def log_likelihood(model, prefix: list[int], target: list[int], mask_id: int, mc_num: int = 128,
                   batch_size: int = 16, cfg_scale: float = 0.0, seed: int = 0, max_rows: int = 64) -> float:
    """The reference's ``get_log_likelihood`` for one prefix and target."""
    req = ScoreRequest(list(prefix) + list(target), [len(prefix)], mc_num, batch_size, cfg_scale, seed,
                       check_greedy=False)
    return score(model, mask_id, [req], max_rows=max_rows)[0].log_likelihoods[0]


def greedy_suffix(model, prefix: list[int], target: list[int], mask_id: int, cfg_scale: float = 0.0) -> bool:
    """The reference's ``suffix_greedy_prediction``: whether decoding the target's positions one at a time, most
    confident first (float32 softmax), reproduces the target."""
    req = ScoreRequest(list(prefix) + list(target), [len(prefix)], 1, 1, cfg_scale, 0)
    return bool(score(model, mask_id, [req])[0].greedy[0])
