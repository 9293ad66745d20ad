"""``dream``: Dream's reference sampler (``DreamGenerationMixin.diffusion_generate`` / ``_sample`` in
NVlabs/Fast-dLLM ``dream/model/generation_utils.py``, the same as HKUNLP/Dream's), each row with its own prompt
length and parameters at any batch size.

The row is the prompt followed by ``max_tokens`` masks, decoded as one sequence (no blocks) in ``steps`` steps; every
step is one forward of the whole row and reads the token at position j from the logits of position j - 1 (Dream's
shifted logits; position 0 keeps its own). With ``timesteps = linspace(1, eps, steps + 1)`` and m the row's masked
positions, step i commits ``int(m * (1 - t[i+1] / t[i]))`` of them (all at the last step):

- ``alg: origin``: each masked position independently with probability ``1 - t[i+1] / t[i]`` (uniform draws), its
  token sampled from the step's distribution;
- ``maskgit_plus`` / ``topk_margin`` / ``entropy``: the ones with the highest confidence (the probability of the
  proposed token / the gap between the two most likely tokens / the negative entropy), by ``torch.topk`` over the
  row; with ``alg_temp > 0`` drawn instead from ``softmax(confidence / alg_temp)`` without replacement.

``temperature``, ``top_p`` and ``top_k`` shape the distribution as the reference's ``sample_tokens`` does (divide,
nucleus and top-k filtering with the dtype's lowest value, softmax, then the argmax or a categorical draw).
Randomness (``origin``, ``temperature > 0``, ``alg_temp > 0``) comes from the row's own generator, seeded by
``seed``: a seeded row draws exactly what the reference draws after ``torch.manual_seed(seed)`` at batch size 1.
Masks inside the prompt are decoded too, as the reference does (infilling)."""
from __future__ import annotations

import struct
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ...models.layers import upload
from ..params import GenerationParams, ParamError
from ..rows import Canvas, Finisher, Row, between_steps, nonzero_rows, record_row_logprobs
from ..sampling import check_probabilities, multinomial_rows
from . import Algorithm, ParamInfo, register

ALGS = ("origin", "maskgit_plus", "topk_margin", "entropy")


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering as the reference's ``top_p_logits``: keep the most likely tokens up to cumulative
    probability ``top_p`` (the first always), the rest set to the dtype's lowest value."""
    sorted_logits, order = torch.sort(logits, descending=True)
    over = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1) > top_p
    over[..., 1:] = over[..., :-1].clone()
    over[..., 0] = False
    drop = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, over)
    return logits.masked_fill(drop, torch.finfo(logits.dtype).min)


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The reference's ``top_k_logits``: below the k-th largest logit -> the dtype's lowest value."""
    kth = torch.topk(logits, min(top_k, logits.size(-1)))[0][..., -1, None]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def _probs(logits: torch.Tensor, p: GenerationParams) -> torch.Tensor:
    """The reference's ``sample_tokens`` up to its softmax: temperature, top-p, top-k (row-wise)."""
    top_p, top_k = p.extra["top_p"], p.extra["top_k"]
    if p.temperature > 0:
        logits = logits / p.temperature
    if top_p is not None and top_p < 1:
        logits = top_p_filter(logits, top_p)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    return torch.softmax(logits, dim=-1)


def _confidence(probs: torch.Tensor, conf: torch.Tensor, confidence: str) -> torch.Tensor:
    if confidence == "margin":
        top2 = torch.sort(probs, dim=-1, descending=True)[0]
        return top2[:, 0] - top2[:, 1]
    if confidence == "neg_entropy":
        return torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return conf


def sample_tokens(logits: torch.Tensor, p: GenerationParams, generator: torch.Generator | None,
                  confidence: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(confidence, x0) for logits [N, V], as the reference's ``sample_tokens``; ``confidence``: "probability",
    "margin" or "neg_entropy"."""
    probs = _probs(logits, p)
    if p.temperature > 0:
        # torch.distributions.Categorical(probs).sample(): the normalised probabilities through multinomial
        x0 = torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, True, generator=generator)[:, 0]
        conf = torch.gather(probs, -1, x0[:, None])[:, 0]
    else:
        conf, x0 = probs.max(dim=-1)
    return _confidence(probs, conf, confidence), x0


def sample_tokens_rows(logits: torch.Tensor, p: GenerationParams, gens: list, sizes: list[int],
                       confidence: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_tokens` at a temperature for consecutive runs of ``sizes[j]`` rows of ``logits``, run j drawn
    from ``gens[j]``: the same draws and results as one call per run (the reference's ``Categorical.sample`` is
    multinomial's one-sample path: :func:`~worker.engine.sampling.multinomial_rows`), with one validity check for
    all the runs."""
    probs = _probs(logits, p)
    norm = probs / probs.sum(-1, keepdim=True)
    check_probabilities(norm)
    x0 = multinomial_rows(norm, gens, sizes)
    return _confidence(probs, torch.gather(probs, -1, x0[:, None])[:, 0], confidence), x0


CONFIDENCE = {"maskgit_plus": "probability", "topk_margin": "margin", "entropy": "neg_entropy"}


def total_steps(row: Row) -> int:
    return row.params.steps or row.plan.gen_length


def ratios(p: GenerationParams, total: int, device) -> list[float]:
    """The schedule's ``1 - t[i+1] / t[i]`` for every step i of ``timesteps = linspace(1, eps, total + 1)``: the
    reference's float32 arithmetic on the device, read once per row (not once per step: each read waits for the
    device). Each is a float32 value, exact as a Python float."""
    t = torch.linspace(1, p.extra["eps"], total + 1, device=device)
    return (1 - t[1:] / t[:-1]).tolist()


def _float32(x: float) -> float:
    """``x`` rounded to the nearest float32 (a float32 multiplication's result: the product of two float32 values
    is exact in a Python float, then rounded once, as the device rounds it)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def transfer_count(m: int, ratio: float, last: bool) -> int:
    """The reference's ``int(num_mask_token * (1 - s / t))`` (``int(num_mask_token)`` at the last step), with
    ``num_mask_token = mask_index.sum() / 1`` the float32 count ``m`` (exact below 2**24) and ``ratio`` from
    :func:`ratios`: the same float32 product and truncation, computed on the host."""
    return m if last else int(_float32(float(m) * ratio))


def decide(p: GenerationParams, g: torch.Generator | None, logits: torch.Tensor, where: torch.Tensor, length: int,
           ratio: float, last: bool, alg: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A step of the schedule (``ratio``: its ``1 - t[i+1] / t[i]`` from :func:`ratios`; ``last``: the schedule's
    last step): ``logits`` [m, V] at the masked positions ``where`` (ascending indices into the reference's vector
    of ``length`` positions: the row, or a cached step's window). Returns (positions to write, their tokens)."""
    if alg == "origin":      # a float32 tensor against the float32 value: the reference's comparison
        draw = torch.rand(where.shape[0], device=logits.device, generator=g) < (1 if last else ratio)
        _, x0 = sample_tokens(logits[draw], p, g, "probability")
        return where[draw], x0
    conf, x0 = sample_tokens(logits, p, g, CONFIDENCE[alg])
    n = transfer_count(where.shape[0], ratio, last)
    if n <= 0:
        return where[:0], x0[:0]
    full = torch.full((1, length), float("-inf"), dtype=conf.dtype, device=conf.device)
    full[0, where] = conf
    alg_temp = p.extra["alg_temp"]
    probs = None
    if alg_temp:
        probs = F.softmax(full / alg_temp, dim=-1)
        if int((probs > 0).sum()) < n:      # a small alg_temp leaves fewer than n positions any probability:
            probs = None                    # its limit, the top ones (drawing would take unmasked positions)
    if probs is None:
        pick = torch.topk(full, n)[1][0]
    else:
        pick = torch.multinomial(probs, num_samples=n, generator=g)[0]
    token = torch.full((length,), -1, dtype=torch.long, device=x0.device)
    token[where] = x0
    return pick, token[pick]


@dataclass
class Choice:
    """One row's decision this step, made together with other rows' by :func:`decide_together`: its masked
    positions are the step's logits rows ``lo:hi``, in a reference vector of ``length`` positions whose position 0 is
    column ``base`` of canvas row ``b``; ``slot`` is its row in the step's ``rowid`` numbering. ``n``: how many the
    schedule commits, or with ``threshold`` the Dream caches' threshold rule (``dream_cache.threshold_step``) over all
    its ``n`` masked positions."""
    b: int
    slot: int
    lo: int
    hi: int
    length: int
    base: int
    n: int
    threshold: float | None
    confidence: str
    p: GenerationParams
    generator: object = None      # the row's, for its draws at a temperature


def together(p: GenerationParams, logprobs) -> bool:
    """Whether a row's step can be decided with other rows' (:func:`decide_together`): tokens drawn at any
    temperature (each row from its own generator), but no random choice of positions (``alg_temp``, ``origin``:
    row by row) and no logprobs to record."""
    return not p.extra.get("alg_temp") and p.extra.get("alg") != "origin" and logprobs is None


def decide_together(choices: list[Choice], logits: torch.Tensor, rowid: torch.Tensor, local: torch.Tensor,
                    x: torch.Tensor) -> None:
    """Every choice's step at once, written into ``x``, with no read from the device (but for one validity check of
    the probabilities where rows draw at a temperature): ``logits`` [N, V] the step's candidates, ``rowid`` /
    ``local`` [N] each one's slot and position in its row's reference vector. The same arithmetic and draws as
    :func:`decide` / the threshold rule row by row: ``sample_tokens`` on the rows' candidates (one call per group of
    equal sampling settings; row-wise operations; at a temperature :func:`sample_tokens_rows`, each row's draws from
    its own generator), and one ``torch.topk`` per group of rows with equal vector length and count, each row of a
    2-D topk ranked as the vector alone (ties included; tests/test_dream.py)."""
    if not choices:
        return
    dev = logits.device
    slots = max(c.slot for c in choices) + 1
    width = max(c.length for c in choices)
    by_sampling: dict[tuple, list[Choice]] = {}
    for c in choices:
        by_sampling.setdefault((c.p.temperature, c.p.extra["top_p"], c.p.extra["top_k"], c.confidence),
                               []).append(c)
    full = tok = None
    for group in by_sampling.values():
        if len(by_sampling) == 1 and sum(c.hi - c.lo for c in group) == logits.shape[0]:
            sel = None
        else:
            sel = upload([i for c in group for i in range(c.lo, c.hi)], dev)
        lg = logits if sel is None else logits[sel]
        if group[0].p.temperature > 0:
            conf, x0 = sample_tokens_rows(lg, group[0].p, [c.generator for c in group], [c.hi - c.lo for c in group],
                                          group[0].confidence)
        else:
            conf, x0 = sample_tokens(lg, group[0].p, None, group[0].confidence)
        if full is None:
            full = torch.full((slots, width), float("-inf"), dtype=conf.dtype, device=dev)
            tok = torch.full((slots, width), -1, dtype=torch.long, device=dev)
        r, col = (rowid, local) if sel is None else (rowid[sel], local[sel])
        full[r, col] = conf
        tok[r, col] = x0
    rows, cols, values = [], [], []
    by_shape: dict[tuple, list[Choice]] = {}
    for c in choices:
        if c.n > 0:
            by_shape.setdefault((c.length, c.n, c.threshold is None), []).append(c)
    for (length, n, schedule), group in by_shape.items():
        idx = upload([c.slot for c in group], dev)
        score, pick = torch.topk(full[idx, :length], n, dim=-1)
        new = tok[idx, :length].gather(1, pick)
        b = upload([c.b for c in group], dev)[:, None].expand(-1, n)
        col = pick + upload([c.base for c in group], dev)[:, None]
        if not schedule:         # the threshold rule: the first, and every other one not below the threshold
            thr = upload([c.threshold for c in group], dev, score.dtype)[:, None]
            keep = ~(score < thr)
            keep[:, 0] = True
            new = torch.where(keep, new, x[b, col])
        rows.append(b.reshape(-1))
        cols.append(col.reshape(-1))
        values.append(new.reshape(-1))
    if rows:
        x[torch.cat(rows), torch.cat(cols)] = torch.cat(values)


def run(engine, rows: list[Row], fin: Finisher) -> None:
    model, mask_id, dev = engine.model, engine.mask_id, engine.model.device
    canvas = Canvas(rows, mask_id, engine.pad_id, dev)
    for r in rows:
        r.state = ratios(r.params, total_steps(r), dev)        # its schedule
    while canvas.rows:
        new = between_steps(canvas, fin)
        if new is None:
            break
        for r in new:
            r.state = ratios(r.params, total_steps(r), dev)
        x, W = canvas.x, canvas.x.shape[1]
        hidden = model(x, canvas.pos, canvas.mask)
        off = upload(canvas.offsets, dev)
        col = torch.arange(W, device=dev)
        masked = (x == mask_id) & (col[None, :] >= off[:, None])
        bi, ci, counts = nonzero_rows(masked)
        src = torch.where(ci > off[bi], ci - 1, ci)        # shifted logits: position j reads position j - 1
        logits = model.logits(hidden[bi, src])
        start, choices = 0, []
        for b, r in enumerate(canvas.rows):
            n = counts[b]
            if n:
                o, p = canvas.offsets[b], r.params
                ratio, last = r.state[r.step], r.step >= total_steps(r) - 1
                if together(p, r.logprobs):
                    choices.append(Choice(b, b, start, start + n, W - o, o, transfer_count(n, ratio, last), None,
                                          CONFIDENCE[p.extra["alg"]], p, r.generator))
                else:
                    cols, tokens = decide(p, r.generator, logits[start:start + n], ci[start:start + n] - o, W - o,
                                          ratio, last, p.extra["alg"])
                    x[b, cols + o] = tokens
                    record_row_logprobs(r, ci[start:start + n] - o, cols, cols - r.plan.prompt_length, tokens,
                                        logits[start:start + n])
            start += n
        if choices:
            decide_together(choices, logits, bi, ci - off[bi], x)
        gens = canvas.read_gens()
        done = []
        for b, r in enumerate(canvas.rows):
            r.nfe += 1
            r.step += 1
            fin.update(r, gens[r.index], r.step >= total_steps(r))
            if r.done:
                done.append(b)
        if done:
            canvas.keep([b for b in range(len(canvas.rows)) if b not in done])
        yield      # a step is done: the engine may run other groups' steps (continuous batching)


MAX_ALG_TEMP = 1e4      # beyond it confidence / alg_temp is 0 and -inf / alg_temp nan in float32 (1e300 is inf)


def check_sampling(p: GenerationParams) -> None:
    """``top_p``, ``top_k`` and ``eps`` of the Dream algorithms (after the generic algorithm_params checks)."""
    e = p.extra
    if e["top_p"] is not None and not 0 < e["top_p"] <= 1:
        raise ParamError("algorithm_params", f"{p.algorithm}: top_p must be in (0, 1], got {e['top_p']!r}")
    if e["top_k"] is not None and e["top_k"] < 1:
        raise ParamError("algorithm_params", f"{p.algorithm}: top_k must be at least 1, got {e['top_k']!r}")
    if not 0 < e["eps"] < 1:
        raise ParamError("algorithm_params", f"{p.algorithm}: eps must be in (0, 1), got {e['eps']!r}")
    if e["alg_temp"] is not None and not 0 <= e["alg_temp"] <= MAX_ALG_TEMP:
        raise ParamError("algorithm_params", f"{p.algorithm}: alg_temp must be in [0, {MAX_ALG_TEMP:g}], got "
                                             f"{e['alg_temp']!r}")


def check(p: GenerationParams) -> GenerationParams:
    """Dream's own parameter rules (after the generic algorithm_params checks)."""
    if p.threshold is not None or p.factor is not None:
        raise ParamError("threshold" if p.threshold is not None else "factor",
                         "dream decodes with its alg schedule; for parallel decoding with a threshold use "
                         "generation_algorithm dream_cache (Fast-dLLM's Dream caches)")
    if p.remasking != "low_confidence":
        raise ParamError("remasking", "dream has no remasking option: algorithm_params.alg chooses the positions")
    check_sampling(p)
    # one sequence, no blocks: the whole generation is the block, and steps are not capped at its length
    return replace(p, block_length=p.gen_length)


def stochastic(p: GenerationParams) -> bool:
    return p.extra.get("alg", "entropy") == "origin" or bool(p.extra.get("alg_temp"))


DREAM_PARAMS = (
    ParamInfo("alg", "entropy", "which masked positions each step commits: origin (each with the schedule's "
              "probability, random), maskgit_plus (most probable token), topk_margin (largest gap between the two "
              "most likely tokens), entropy (lowest entropy; the Dream README's setting)", choices=ALGS),
    ParamInfo("alg_temp", 0.0, "> 0: draw the committed positions from softmax(confidence / alg_temp) instead of "
              "taking the top ones"),
    ParamInfo("top_p", None, "nucleus filtering before the softmax (null: off)", kind="number"),
    ParamInfo("top_k", None, "top-k filtering before the softmax (null: off)", kind="int"),
    ParamInfo("eps", 1e-3, "the schedule's last timestep (timesteps = linspace(1, eps, steps + 1))"),
)

register(Algorithm(
    name="dream",
    description="Dream reference sampler (diffusion_generate): the whole generation as one sequence, shifted "
                "logits, steps committing int(m * (1 - s/t)) masked positions chosen by alg (origin, maskgit_plus, "
                "topk_margin, entropy), with temperature, top_p, top_k and alg_temp as the reference applies them",
    exact=True, run=run, cfg=False,
    params=(
        ParamInfo("steps", None, "denoising steps (default: one per token; not capped: each step is one forward)"),
        ParamInfo("temperature", 0.0, "0 = the most likely token; > 0 divides the logits and samples"),
        ParamInfo("seed", None, "per-request seed for every random draw (origin, temperature, alg_temp)"),
    ),
    extra_params=DREAM_PARAMS, check=check, stochastic=stochastic,
))
