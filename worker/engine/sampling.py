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
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.layers import upload

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


def multinomial_rows(probs: torch.Tensor, gens: list, sizes: list[int] | None = None) -> torch.Tensor:
    """``torch.multinomial(part, 1, generator=g)`` for consecutive parts of ``probs`` (each ``probs[j]``, or with
    ``sizes`` runs of ``sizes[j]`` of its rows), part j from ``gens[j]``, at once: the same draws and results.
    Multinomial's one-sample path divides the probabilities by Exp(1) numbers that ``exponential_`` draws from the
    generator on a tensor like them and takes the argmax; here each part's numbers fill its place in one buffer and
    the division and argmax run once. Multinomial's validity check (two host syncs per call) is the caller's to make,
    once for all the parts (:func:`check_probabilities`) or folded into a read it makes anyway. Returns the drawn
    indices, ``probs.shape[:-1]``."""
    q = torch.empty_like(probs)
    if sizes is None:
        for part, g in zip(q.unbind(0), gens):       # (the views in one call)
            part.exponential_(generator=g)
    else:
        for part, g in zip(q.split(sizes), gens):
            part.exponential_(generator=g)
    return torch.div(probs, q, out=q).argmax(dim=-1)


PROBABILITIES_INVALID = "probability tensor contains either `inf`, `nan` or element < 0"


def probabilities_ok(probs: torch.Tensor) -> torch.Tensor:
    """Multinomial's check (no inf, nan or negative value) of a whole tensor, on the device (0-dim bool)."""
    return ((probs >= 0) & (probs < float("inf"))).all()


def check_probabilities(probs: torch.Tensor) -> None:
    """:func:`probabilities_ok`, read: one host sync; raises as multinomial does."""
    if not bool(probabilities_ok(probs)):
        raise RuntimeError(PROBABILITIES_INVALID)


def propose(logits: torch.Tensor, rows, widths: list[int], only: list[int] | None = None) -> torch.Tensor:
    """x0, the proposed token at every candidate ([B, K] long): the argmax of the logits (first index among equal
    maxima), or with ``temperature > 0`` the reference's float64 Gumbel-max ``argmax(exp(l) / (-log u) ** T)``.
    The noise comes from the row's own generator and only for its own candidates, so a seeded row draws the same
    numbers in any batch (the reference draws for the whole canvas from the global generator). ``only``: the rows
    proposed for (the others' x0 is the argmax, and they draw nothing)."""
    x0 = logits.argmax(-1)
    for b in range(len(rows)) if only is None else only:
        row = rows[b]
        t = row.params.temperature
        if t > 0:
            lb = logits[b, : widths[b]].to(torch.float64)
            u = torch.rand(lb.shape, dtype=torch.float64, device=lb.device, generator=row.generator)
            x0[b, : widths[b]] = (lb.exp() / (-torch.log(u)) ** t).argmax(-1)
    return x0


def _confidence_matrix(kind: Softmax, logits: torch.Tensor, x0: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """Confidences [R, K] of one Softmax kind at every candidate (-inf where not ``masked``), in chunks of rows that
    bound the float64 temporary. Every candidate is computed, masked or not: a softmax row does not depend on the
    other rows in its tensor, and finding the masked ones first would wait for the device."""
    R, K, V = logits.shape
    chunk = max(1, SOFTMAX_CHUNK_BYTES // (K * V * 8))
    parts = [kind.probability(logits[i:i + chunk].reshape(-1, V), x0[i:i + chunk].reshape(-1))
             for i in range(0, R, chunk)]
    c = (parts[0] if len(parts) == 1 else torch.cat(parts)).view(R, K)
    return c.masked_fill_(~masked, NEG_INF)


class Confidences:
    """A step's confidences: row b's are ``row(b)`` (its ``K`` candidates, -inf where a candidate is not masked, in
    its reference's dtype), kept as one matrix per group of rows computed together (:func:`confidences`)."""

    def __init__(self, B: int):
        self.at: list[tuple[torch.Tensor, int, torch.dtype] | None] = [None] * B   # row -> (matrix, its row, dtype)

    def put(self, rows: list[int], matrix: torch.Tensor) -> None:
        dtype = matrix.dtype
        for i, b in enumerate(rows):
            self.at[b] = (matrix, i, dtype)

    def row(self, b: int) -> torch.Tensor:
        m, i, _ = self.at[b]
        return m[i]

    def dtype(self, b: int) -> torch.dtype:
        return self.at[b][2]

    def rows(self, bs: list[int]) -> torch.Tensor:
        """[len(bs), K]: the matrix itself when ``bs`` are its rows in order (no copy)."""
        m = self.at[bs[0]][0]
        if all(self.at[b][0] is m for b in bs):
            idx = [self.at[b][1] for b in bs]
            if idx == list(range(m.shape[0])):
                return m
            return m[upload(idx, m.device)]
        return torch.stack([self.row(b) for b in bs])


def confidences(logits: torch.Tensor, x0: torch.Tensor, masked: torch.Tensor, rows, widths: list[int],
                kinds: list[Softmax], out: Confidences, which: list[int]) -> None:
    """The confidences of rows ``which`` (their logits, x0 and masks are ``logits``, ``x0``, ``masked`` [n, K...],
    in that order) into ``out``: one matrix per Softmax kind; ``remasking: random`` rows get uniform float32 noise
    over their own candidates, as the references draw it."""
    n = len(which)
    for kind in dict.fromkeys(kinds):
        members = [i for i, k in enumerate(kinds) if k is kind and rows[i].params.remasking != "random"]
        if not members:
            continue
        if len(members) == n:
            m = _confidence_matrix(kind, logits, x0, masked)
        else:
            idx = upload(members, logits.device)
            m = _confidence_matrix(kind, logits[idx], x0[idx], masked[idx])
        out.put([which[i] for i in members], m)
    for i, row in enumerate(rows):
        if row.params.remasking == "random":
            w = widths[i]
            u = torch.rand(w, device=logits.device, generator=row.generator)
            c = torch.full((1, masked.shape[1]), NEG_INF, dtype=u.dtype, device=u.device)
            c[0, :w] = torch.where(masked[i, :w], u, torch.full_like(u, NEG_INF))
            out.put([which[i]], c)


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


class Rule:
    """A transfer rule: how one row's denoising step picks the masked candidates to commit. An algorithm gives each of
    its rows a Rule instance (``row.rule``), which may hold per-row state (reset by :meth:`start_block`). Subclasses
    are dataclasses with a ``softmax`` field.

    ``softmax``: the reference's confidence arithmetic; ``fixed_schedule``: the block takes LLaDA's scheduled number
    of steps (else it runs until it has no mask); :meth:`transform`: the logits the decision is made on (None: the
    model's, with the confidences of all such rows computed together); :meth:`select`: the chosen candidates."""

    fixed_schedule = False
    transforms_logits = False

    def start_block(self) -> None:
        pass

    def transform(self, logits: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        return logits

    # A rule that transforms logits may also do it for many rows at once: ``transform_rows(rules, logits, masked,
    # widths)`` on [R, K, V] / [R, K] returns [R, K, V], row r's first ``widths[r]`` rows what ``rules[r].transform``
    # returns for it alone (the rest unused); rows whose rules have the same type and ``batch_key()`` go together.
    transform_rows = None

    def select(self, conf: torch.Tensor, x0: torch.Tensor, masked: torch.Tensor, layout: Layout | None, row,
               mask_id: int) -> torch.Tensor:
        """Bool over the row's candidates (``conf``, ``x0``, ``masked`` are its ``w`` candidates)."""
        raise NotImplementedError

    # A rule whose choice needs no layout can also choose for many rows at once: ``select_rows(rules, conf, x0,
    # masked, mask_id)`` on [R, K] matrices (a row's columns past its width: -inf confidence, not masked) returns
    # bool [R, K], row r exactly what ``rules[r].select`` returns for it alone; rows whose rules have the same type
    # and ``batch_key()`` are chosen together (sampling.denoise).
    select_rows = None

    def batch_key(self):
        return None


def _as_bool(idx: torch.Tensor, w: int, device) -> torch.Tensor:
    # topk never reaches past the candidates (there are always at least k of them with a finite confidence); a
    # non-masked candidate's x0 is its own token in the reference, so committing it would change nothing.
    out = torch.zeros(w, dtype=torch.bool, device=device)
    out[idx[(idx >= 0) & (idx < w)]] = True
    return out


@dataclass
class FixedRule(Rule):
    """LLaDA's linear schedule: the row's scheduled count of the most confident candidates."""
    softmax: Softmax = Softmax.MODEL
    fixed_schedule = True

    def select(self, conf, x0, masked, layout, row, mask_id):
        return _as_bool(select_fixed(conf, layout, row.scheduled_transfers()), conf.shape[0], conf.device)


@dataclass
class ThresholdRule(Rule):
    """Fast-dLLM's confidence threshold (and Nemotron's)."""
    softmax: Softmax
    threshold: float

    def select(self, conf, x0, masked, layout, row, mask_id):
        idx = select_threshold(conf, layout, int(masked.sum()), self.threshold)
        return _as_bool(idx, conf.shape[0], conf.device)


@dataclass
class FactorRule(Rule):
    """Fast-dLLM's dynamic (factor) rule."""
    softmax: Softmax
    factor: float

    def select(self, conf, x0, masked, layout, row, mask_id):
        return _as_bool(select_factor(conf, layout, masked, self.factor), conf.shape[0], conf.device)


def fast_dllm_rule(params, fixed: Softmax, parallel: Softmax) -> Rule:
    """LLaDA's schedule, or Fast-dLLM's threshold / factor rule when the request sets one; ``fixed`` / ``parallel``:
    the confidence arithmetic of the calling algorithm's reference for each."""
    if params.threshold is not None:
        return ThresholdRule(parallel, params.threshold)
    if params.factor is not None:
        return FactorRule(parallel, params.factor)
    return FixedRule(fixed)


def denoise(logits: torch.Tensor, tokens: torch.Tensor, widths: list[int], rows, mask_id: int,
            layouts: list[Layout | None], valid: torch.Tensor | None = None,
            counts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's decision for a batch of rows: (x0 [B, K], transfer [B, K] bool). ``tokens``: the candidates'
    current ids; ``layouts[b]``: row b's topk vector (rows with a topk rule); ``valid`` [B, K]: which candidates are
    real (row b's first ``widths[b]``; built when not given). Each row decides by its ``row.rule``; rows whose rules
    allow it decide together. Nothing here waits for the device but the mask counts of threshold rows (topk's
    ``k``, one read for the batch, unless the caller knows them from its host copy of the canvas: ``counts``, each
    row's masked candidates) and the rules that decide row by row (the factor rule)."""
    B, K = tokens.shape
    dev = tokens.device
    if valid is None:
        valid = torch.arange(K, device=dev)[None, :] < upload(widths, dev)[:, None]
    masked = (tokens == mask_id) & valid
    plain = [b for b, r in enumerate(rows) if not r.rule.transforms_logits]
    # rows whose rule transforms the logits propose from their own logits below (and draw there only)
    x0 = (propose(logits, rows, widths) if len(plain) == B else propose(logits, rows, widths, plain)) if plain \
        else None
    conf = Confidences(B)
    if plain:
        if len(plain) == B:
            confidences(logits, x0, masked, rows, widths, [r.rule.softmax for r in rows], conf, plain)
        else:
            idx = upload(plain, dev)
            confidences(logits[idx], x0[idx], masked[idx], [rows[b] for b in plain], [widths[b] for b in plain],
                        [rows[b].rule.softmax for b in plain], conf, plain)
    fused = [b for b, r in enumerate(rows) if r.rule.transforms_logits]
    if fused:       # the decision is made on each rule's own logits: proposed and rated together, as the plain rows
        batches: dict[tuple, list[int]] = {}
        for i, b in enumerate(fused):
            rule = rows[b].rule
            key = (type(rule), rule.batch_key()) if rule.transform_rows is not None else (None, i)
            batches.setdefault(key, []).append(i)
        parts: list[torch.Tensor | None] = [None] * len(fused)
        for (kind, _), members in batches.items():
            bs = [fused[i] for i in members]
            if kind is None:
                b = bs[0]
                t = rows[b].rule.transform(logits[b, :widths[b]], masked[b, :widths[b]])
                parts[members[0]] = F.pad(t, (0, 0, 0, K - t.shape[0]))[None]
                continue
            every = len(bs) == B           # every row, in order: no index, no copy
            out = kind.transform_rows([rows[b].rule for b in bs], logits if every else logits[upload(bs, dev)],
                                      masked if every else masked[upload(bs, dev)], [widths[b] for b in bs])
            if len(members) == len(fused):
                parts = [out]
                break
            for j, i in enumerate(members):
                parts[i] = out[j:j + 1]
        lg = parts[0] if len(parts) == 1 else torch.cat(parts)
        fr, fw = [rows[b] for b in fused], [widths[b] for b in fused]
        fx = propose(lg, fr, fw)
        if x0 is None:              # every row is fused (x0 past a row's width is never used)
            x0 = fx
            confidences(lg, fx, masked, fr, fw, [r.rule.softmax for r in fr], conf, fused)
        else:
            fidx = upload(fused, dev)
            x0[fidx] = fx
            confidences(lg, fx, masked[fidx], fr, fw, [r.rule.softmax for r in fr], conf, fused)
    grouped: dict[tuple, list[tuple[int, int]]] = {}     # (length, k, threshold, dtype) -> [(row, at)]: ranked together
    together: dict[tuple, list[int]] = {}                 # (rule type, batch key) -> rows chosen together
    alone: list[int] = []
    for b, r in enumerate(rows):
        kind = type(r.rule)
        if kind is FixedRule:
            grouped.setdefault((layouts[b].length, r.scheduled_transfers(), None, conf.dtype(b)), []).append(
                (b, layouts[b].at))
        elif kind is ThresholdRule:
            if counts is None:
                counts = masked.sum(1).tolist()      # one transfer for the batch, not one per row
            grouped.setdefault((layouts[b].length, int(counts[b]), r.rule.threshold, conf.dtype(b)), []).append(
                (b, layouts[b].at))
        elif r.rule.select_rows is not None:
            together.setdefault((kind, r.rule.batch_key()), []).append(b)
        else:
            alone.append(b)
    picks: list[tuple[list[int], torch.Tensor]] = []      # (rows, their choices [len(rows), K])
    for (length, k, threshold, _), members in grouped.items():
        bs = [b for b, _ in members]
        picks.append((bs, _select_grouped(conf.rows(bs), length, k, threshold, tuple(a for _, a in members),
                                          tuple(widths[b] for b in bs))))
    for (kind, _), bs in together.items():
        picks.append((bs, kind.select_rows([rows[b].rule for b in bs], conf.rows(bs), x0[bs] if len(bs) < B else x0,
                                           masked[bs] if len(bs) < B else masked, mask_id)))
    for b in alone:
        w = widths[b]
        one = torch.zeros((1, K), dtype=torch.bool, device=dev)
        one[0, :w] = rows[b].rule.select(conf.row(b)[:w], x0[b, :w], masked[b, :w], layouts[b], rows[b], mask_id)
        picks.append(([b], one))
    if len(picks) == 1 and picks[0][0] == list(range(B)):
        chosen = picks[0][1]                # the usual step: one group of rows, in order
    else:
        chosen = torch.zeros_like(masked)
        for bs, c in picks:
            chosen[upload(bs, dev)] = c
    return x0, chosen & masked


@functools.lru_cache(maxsize=64)
def _grouped_index(length: int, ats: tuple[int, ...], widths: tuple[int, ...], K: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For :func:`_select_grouped`: (the candidate column of each element of the rows' reference vectors, clamped;
    which elements are outside the candidates; each row's ``at``), built on the host and kept: a block's layouts
    repeat step after step."""
    at = torch.tensor(ats)
    j = torch.arange(length)[None, :] - at[:, None]          # vector element -> candidate
    outside = (j < 0) | (j >= torch.tensor(widths)[:, None])
    return upload(j.clamp(0, K - 1), device), upload(outside, device), upload(at[:, None], device)


def _select_grouped(conf: torch.Tensor, length: int, k: int, threshold: float | None, ats: tuple[int, ...],
                    widths: tuple[int, ...]) -> torch.Tensor:
    """FixedRule / ThresholdRule rows (``select_fixed`` / ``select_threshold``) ranked with one ``torch.topk``:
    each row of a 2-D topk is ranked exactly as the same vector alone (ties included; tests/test_sampling.py checks
    it). ``conf`` [R, K]: the rows' confidences (-inf where a candidate is not masked); ``length``, ``ats``: their
    reference vectors' length and where each row's candidates sit in it (:class:`Layout`). Returns bool [R, K]:
    the picks with a finite confidence (a pick of -inf is never masked: committing it would change nothing)."""
    R, K = conf.shape
    if all(a == 0 for a in ats) and all(w == length for w in widths):
        # the reference vector is the candidates themselves (a cached window): rank them as they are
        values, cand = torch.topk(conf[:, :length] if length < K else conf, k, dim=-1)
    else:
        jc, outside, at = _grouped_index(length, ats, widths, K, conf.device)
        values, top = torch.topk(conf.gather(1, jc).masked_fill_(outside, NEG_INF), k, dim=-1)
        cand = top - at
    keep = values > NEG_INF
    if threshold is not None:               # Fast-dLLM: the first always, each other one unless < threshold
        ok = ~(values < threshold)
        ok[:, :1] = True
        keep &= ok
    # written by a scatter, not by boolean indexing (which would wait for the device to count the picks): the picks
    # not kept go to a spare column K
    out = torch.zeros((R, K + 1), dtype=torch.bool, device=conf.device)
    out.scatter_(1, torch.where(keep, cand, K), True)
    return out[:, :K]
