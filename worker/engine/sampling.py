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
        for j, g in enumerate(gens):
            q[j].exponential_(generator=g)
    else:
        at = 0
        for n, g in zip(sizes, gens):
            q[at:at + n].exponential_(generator=g)
            at += n
    return torch.div(probs, q, out=q).argmax(dim=-1)


def check_probabilities(probs: torch.Tensor) -> None:
    """Multinomial's check (no inf, nan or negative value), once for a whole tensor: one host sync."""
    if not bool(((probs >= 0) & (probs < float("inf"))).all()):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")


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
            layouts: list[Layout | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's decision for a batch of rows: (x0 [B, K], transfer [B, K] bool). ``tokens``: the candidates'
    current ids; ``layouts[b]``: row b's topk vector (rows with a topk rule). Each row decides by its ``row.rule``."""
    B, K = tokens.shape
    valid = torch.arange(K, device=tokens.device)[None, :] < torch.tensor(widths, device=tokens.device)[:, None]
    masked = (tokens == mask_id) & valid
    x0 = propose(logits, rows, widths)
    chosen = torch.zeros_like(masked)
    plain = [b for b, r in enumerate(rows) if not r.rule.transforms_logits]
    conf: list[torch.Tensor | None] = [None] * B
    if plain:
        sub = confidences(logits[plain], x0[plain], masked[plain], [rows[b] for b in plain],
                          [widths[b] for b in plain], [rows[b].rule.softmax for b in plain])
        for b, c in zip(plain, sub):
            conf[b] = c
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
            idx = torch.tensor(bs, device=logits.device)
            out = kind.transform_rows([rows[b].rule for b in bs], logits[idx], masked[idx], [widths[b] for b in bs])
            for j, i in enumerate(members):
                parts[i] = out[j:j + 1]
        lg = parts[0] if len(parts) == 1 else torch.cat(parts)
        fr, fw = [rows[b] for b in fused], [widths[b] for b in fused]
        fx = propose(lg, fr, fw)
        for i, b in enumerate(fused):
            x0[b, :fw[i]] = fx[i, :fw[i]]
        for b, c in zip(fused, confidences(lg, fx, masked[fused], fr, fw, [r.rule.softmax for r in fr])):
            conf[b] = c
    grouped: dict[tuple, list[tuple[int, int]]] = {}     # (length, k) -> [(row, at)]: rows ranked together
    together: dict[tuple, list[int]] = {}                 # (rule type, batch key) -> rows chosen together
    counts = None
    for b, r in enumerate(rows):
        kind = type(r.rule)
        if kind is FixedRule:
            grouped.setdefault((layouts[b].length, r.scheduled_transfers(), None), []).append((b, layouts[b].at))
        elif kind is ThresholdRule:
            if counts is None:
                counts = masked.sum(1).tolist()      # one transfer for the batch, not one per row
            grouped.setdefault((layouts[b].length, int(counts[b]), r.rule.threshold), []).append((b, layouts[b].at))
        elif r.rule.select_rows is not None:
            together.setdefault((kind, r.rule.batch_key()), []).append(b)
        else:
            w = widths[b]
            chosen[b, :w] = r.rule.select(conf[b], x0[b, :w], masked[b, :w], layouts[b], r, mask_id)
    if grouped:
        _select_grouped(grouped, conf, widths, chosen)
    for (kind, _), members in together.items():
        c = torch.nn.utils.rnn.pad_sequence([conf[b] for b in members], batch_first=True, padding_value=NEG_INF)
        if c.shape[1] < K:
            c = F.pad(c, (0, K - c.shape[1]), value=NEG_INF)
        idx = torch.tensor(members, device=tokens.device)
        chosen[idx] = kind.select_rows([rows[b].rule for b in members], c, x0[idx], masked[idx], mask_id)
    return x0, chosen & masked


def _select_grouped(groups: dict, conf: list[torch.Tensor], widths: list[int], chosen: torch.Tensor) -> None:
    """FixedRule / ThresholdRule rows, ranked with one ``torch.topk`` per group of rows whose reference vectors have
    the same length and whose ``k`` is the same: each row of a 2-D topk is ranked exactly as the same vector alone
    (ties included; tests/test_sampling.py checks it), so this is ``select_fixed`` / ``select_threshold`` per row,
    without a dozen small tensor operations per row."""
    device = chosen.device
    K = chosen.shape[1]
    for (length, k, threshold), members in groups.items():
        idx_rows = [b for b, _ in members]
        c = torch.nn.utils.rnn.pad_sequence([conf[b] for b in idx_rows], batch_first=True, padding_value=NEG_INF)
        if all(a == 0 for _, a in members) and all(widths[b] == length for b in idx_rows):
            # the reference vector is the candidates themselves (a cached window): rank them as they are
            values, cand = torch.topk(c, k, dim=-1)
            keep = None
        else:
            at = torch.tensor([a for _, a in members], device=device)
            w = torch.tensor([widths[b] for b in idx_rows], device=device)
            if c.shape[1] < K:
                c = F.pad(c, (0, K - c.shape[1]), value=NEG_INF)
            j = torch.arange(length, device=device)[None, :] - at[:, None]          # vector element -> candidate
            inside = (j >= 0) & (j < w[:, None])
            vec = torch.where(inside, c.gather(1, j.clamp(0, K - 1)), torch.full((), NEG_INF, dtype=c.dtype,
                                                                                 device=device))
            values, top = torch.topk(vec, k, dim=-1)
            cand = top - at[:, None]
            keep = (cand >= 0) & (cand < w[:, None])
        if threshold is not None:               # Fast-dLLM: the first always, each other one unless < threshold
            ok = ~(values < threshold)
            ok[:, :1] = True
            keep = ok if keep is None else keep & ok
        # written by a scatter, not by boolean indexing (which would wait for the device to count the picks)
        hits = torch.zeros((len(idx_rows), K), dtype=torch.int32, device=device)
        hits.scatter_add_(1, cand.clamp(0, K - 1), torch.ones_like(cand, dtype=torch.int32) if keep is None
                          else keep.to(torch.int32))
        chosen[torch.tensor(idx_rows, device=device)] = hits > 0
