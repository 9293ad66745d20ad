"""``diffusion_gemma``: DiffusionGemma's multi-canvas decoding (transformers'
``DiffusionGemmaGenerationMixin.generate``), each row with its own prompt, length and settings, at any batch size,
rows joining and leaving between steps.

A row's prompt is encoded once into its slot of the model's context cache. Then canvas after canvas: the canvas starts
as ``canvas_length`` uniformly random tokens (the whole vocabulary); every step runs the bidirectional denoiser over
the canvas (self-conditioned on the previous step's logits), divides the logits by the step's temperature (linear
from ``t_max`` at the first step towards ``t_min``, ``max_denoising_steps`` steps at most), samples every position,
accepts the lowest-entropy positions while their entropies (but the largest) sum to at most ``entropy_bound``, and
renoises the others with fresh random tokens; it stops early once the argmax canvas has not changed for
``stability_threshold`` steps and the mean entropy is below ``confidence_threshold``. The canvas kept is the last
step's argmax; the encoder appends it to the context, and the next canvas starts, until an eos id appears anywhere in
a canvas or ``max_tokens`` are covered (whole canvases: the answer is cut back to ``max_tokens``).

Random draws, per row from the row's own generator (seeded with the request's ``seed``), in the reference's order: the
canvas (``randint`` over the vocabulary), then per step ``multinomial`` over the [canvas_length, vocab] probabilities
and the renoising ``randint``, every step. On CPU these are the reference's own draws, so a seeded row reproduces the
reference run alone after ``torch.manual_seed(seed)``, whatever batch it runs in (the reference's own batches draw for
all rows at once, so its rows depend on their batch). On CUDA they come from the row's CUDA generator (the reference
on CUDA draws from CUDA's global generator). The step's acceptance needs no host sync beyond the ones the rule
implies: the stopping test of every row (one transfer per step for the batch)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from ...models.layers import upload
from ..params import MIN_FORWARD_TOKENS, GenerationParams, ParamError, Plan, context_exceeded
from ..rows import Finisher, Row, read_with
from ..sampling import PROBABILITIES_INVALID, multinomial_rows
from . import Algorithm, ParamInfo, register

# The reference's global defaults (DiffusionGemmaGenerationConfig._get_default_generation_params); a checkpoint's
# generation_config.json overrides them (worker/models/diffusion_gemma.py ``generation_defaults``).
PARAMS = (
    ParamInfo("max_denoising_steps", 48, "denoising steps per canvas at most (the temperature schedule's length)"),
    ParamInfo("entropy_bound", 0.1, "a step accepts the lowest-entropy positions while the sum of their entropies "
              "minus the largest stays <= this (more: more tokens per step)"),
    ParamInfo("t_min", 0.4, "temperature the linear schedule tends to (reached after the last step)"),
    ParamInfo("t_max", 0.8, "temperature of the first step"),
    ParamInfo("stability_threshold", 1, "adaptive stopping: steps the argmax canvas must stay unchanged (0: always "
              "stable)"),
    ParamInfo("confidence_threshold", 0.005, "adaptive stopping: the canvas's mean entropy must be below it"),
)


class _State:
    """A row's progress: its CPU-side settings, its canvas, its self-conditioning logits and stopping history."""
    __slots__ = ("N", "t_min", "t_max", "S", "limits", "temps", "left", "encode", "canvas", "at", "hist", "out",
                 "gen", "reused")

    def __init__(self, row: Row, gen: torch.Generator, device: torch.device):
        e = row.params.extra
        self.N, self.t_min, self.t_max = e["max_denoising_steps"], e["t_min"], e["t_max"]
        self.S = e["stability_threshold"]
        # (entropy_bound, confidence_threshold), copied to the device as float32 with the step's temperatures: the
        # reference compares float32 with them
        self.limits = [e["entropy_bound"], e["confidence_threshold"]]
        self.temps = None                  # the canvas's temperatures, step by step (float32 values)
        self.left = 0                      # steps remaining in this canvas (the reference's cur_step)
        self.encode: list[int] = list(row.prompt)          # tokens the encoder must append before the next canvas
        self.canvas = None                 # [L] on the device: a canvas's first step's
        self.at = None                     # after that: its row in the last step's (canvases, scaled logits)
        self.hist = None                   # the last S argmaxes [S, L] (a ring: step i at i % S), as (the rings of
        #                                    its group of rows, its row there)
        self.out: list[int] = []           # finished canvases (argmax)
        self.gen = gen
        self.reused = -1                   # prompt tokens from the prefix cache, once its prompt is encoding

    def schedule(self) -> list[float]:
        """The temperatures of a canvas's steps (N steps remaining down to 1) with the reference's float32
        arithmetic: an int32 step over a Python int (float32), times a Python float, plus a Python float, each
        rounded to float32 as torch's float32 tensor arithmetic does with a Python number (numpy's float32 operations
        are the same IEEE ones; tests/test_diffusion_gemma.py checks them against torch's). Python floats, exact."""
        t = np.arange(self.N, 0, -1).astype(np.float32) / np.float32(self.N)
        return (np.float32(self.t_min) + np.float32(self.t_max - self.t_min) * t).tolist()


def _generator(row: Row, device: torch.device) -> torch.Generator:
    g = row.generator
    if g is None or g.device.type != device.type:
        seed = row.params.seed if row.params.seed is not None else (g.initial_seed() if g is not None else 0)
        g = torch.Generator(device=device)
        g.manual_seed(seed)
    return g


def entropy(x: torch.Tensor) -> torch.Tensor:
    """``Categorical(logits=x).entropy()``, op for op: normalised logits, their softmax, ``-(clamp(l) * p).sum``
    (the clamp and the product in place: the same values without two more [B, L, V] tensors)."""
    lg = x - x.logsumexp(dim=-1, keepdim=True)
    p = torch.softmax(lg, dim=-1)
    return -lg.clamp_(min=torch.finfo(lg.dtype).min).mul_(p).sum(-1)


def run(engine, rows: list[Row], fin: Finisher):
    model = engine.model
    dev = model.device
    L, V = model.cfg.canvas_length, model.cfg.vocab_size
    emb_dtype = model.dtype
    active: list[Row] = []
    cache = model.new_cache(0, 0)

    pc = engine.prefix_cache
    G = pc.block if pc is not None else 0

    def join(new: list[Row]) -> None:
        for r in new:
            r.state = _State(r, _generator(r, dev), dev)
        cache.add_slots(len(new))
        first = len(active)
        active.extend(new)
        for b in range(first, len(active)):      # the prefix cache: the prompt's cached blocks, not re-encoded
            r, s = active[b], active[b].state
            s.reused = 0
            limit = prefix_blocks(r.plan, pc)[1] if pc is not None else 0
            found = pc.lookup(r.prompt, G, limit) if limit > 0 else []
            if found:
                n = len(model.stack.layers)
                cache.seed(b, [torch.cat([e.kv[i] for e in found], dim=1).to(dev) for i in range(n)],
                           [torch.cat([e.kv[n + i] for e in found], dim=1).to(dev) for i in range(n)])
                s.reused = r.cached_tokens = len(found) * G
                s.encode = list(r.prompt[s.reused:])

    def share(b: int, i: int, capture: list) -> None:
        """Row ``active[b]``'s prompt was just encoded (as row i of the encoder call): store its whole blocks."""
        r, s = active[b], active[b].state
        first, blocks = s.reused // G, len(r.prompt) // G
        pc.insert(r.prompt, G, first, blocks,
                  lambda j: tuple(t[i, :, j * G - s.reused:(j + 1) * G - s.reused] for t in
                                  [k for k, _ in capture] + [v for _, v in capture]))

    def keep(idx: list[int]) -> None:
        if len(idx) < len(active):
            cache.keep(idx)
            active[:] = [active[b] for b in idx]

    join(rows)
    last = None                 # the last step's (canvases, scaled logits) [B, L], [B, L, V]: the rows going on
    while True:
        keep([b for b, r in enumerate(active) if not fin.cancelled(r)])
        new = fin.admit(active)
        if new:
            join(new)
        if not active:
            return
        # 1. the encoder: prompts of new rows and the canvases finished last step, in one call
        enc = [b for b, r in enumerate(active) if r.state.encode]
        if enc:
            toks = [active[b].state.encode for b in enc]
            lengths = [len(t) for t in toks]
            width = max(lengths)
            ids = upload([t + [0] * (width - len(t)) for t in toks], dev, torch.long)     # zero-padded, one copy
            capture = [] if pc is not None and any(active[b].state.reused >= 0 for b in enc) else None
            model.encode(ids, lengths, cache, enc, capture)
            for i, b in enumerate(enc):
                s = active[b].state
                if capture is not None and s.reused >= 0:        # its prompt: store its whole blocks
                    share(b, i, capture)
                s.reused = -1
                s.encode = []
                s.canvas = torch.randint(0, V, (1, L), generator=s.gen, device=dev)[0]
                s.at, s.hist, s.left = None, None, s.N
                if s.temps is None:
                    s.temps = s.schedule()
            capture = None          # (every layer's new keys/values of the call: not held through the steps)
        # 2. one denoiser forward for every row
        sts = [r.state for r in active]
        if last is not None and last[0].shape[0] == len(sts) and all(s.at == b for b, s in enumerate(sts)):
            canvas, sc = last                # every row goes on from the last step, in its place
            sc_rows = list(range(len(sts)))
        else:                                # self-conditioning from the last step's logits for the rows going on
            sc_rows = [b for b, s in enumerate(sts) if s.at is not None]
            at = upload([sts[b].at for b in sc_rows], dev) if sc_rows else None
            sc = last[1][at] if sc_rows else None
            fresh = [b for b, s in enumerate(sts) if s.at is None]       # a canvas's first step: its own canvas
            if not sc_rows:
                canvas = torch.stack([sts[b].canvas for b in fresh])
            elif not fresh:
                canvas = last[0][at]
            else:                            # (copies, in one operation per kind of row)
                canvas = torch.empty((len(sts), L), dtype=torch.long, device=dev)
                canvas[upload(sc_rows, dev)] = last[0][at]
                canvas[upload(fresh, dev)] = torch.stack([sts[b].canvas for b in fresh])
        raw = model.denoise(canvas, sc, sc_rows, cache, list(range(len(active))))
        # every row's temperature and limits in one copy (float32, as the reference's tensors hold them)
        tl = upload([[s.temps[s.N - s.left], *s.limits] for s in sts], dev, torch.float32)
        temps, limits = tl[:, 0], tl[:, 1:]
        x = raw.div_(temps[:, None, None])          # raw is this step's own tensor: divided in place
        probs = torch.softmax(x, dim=-1, dtype=torch.float32)
        # each row's multinomial, from its own generator, drawn together; multinomial's validity check is the
        # entropies' finiteness, read with the step's one transfer
        drawn = multinomial_rows(probs, [s.gen for s in sts])
        del probs
        argmax = torch.argmax(x, dim=-1)
        ent = entropy(x)
        order_ent, order = torch.sort(ent, dim=-1)
        over = torch.cumsum(order_ent, dim=-1) - order_ent
        accept = torch.zeros_like(over, dtype=torch.bool).scatter(-1, order, over <= limits[:, :1])
        accepted = torch.where(accept, drawn, canvas)
        noise = torch.empty((len(sts), L), dtype=torch.long, device=dev)
        for part, s in zip(noise.unbind(0), sts):     # each row's own draw, as randint makes it (random_ on [L])
            part.random_(0, V, generator=s.gen)
        nxt = torch.where(accept, accepted, noise)
        # adaptive stopping: stable (argmax unchanged for S steps) and confident (mean entropy below the threshold)
        # (the history is a ring of the last S argmaxes, -1 before there are S: "all equal to this one" does not
        # depend on their order; rows with the same S are compared in one operation)
        stable_t = torch.ones(len(sts), dtype=torch.bool, device=dev)
        by_s: dict[int, list[int]] = {}
        for b, s in enumerate(sts):
            if s.S:
                by_s.setdefault(s.S, []).append(b)
        for S, members in by_s.items():
            every = len(members) == len(sts)
            idx = None if every else upload(members, dev)
            got = [sts[b].hist for b in members]      # (the group's rings of the last step, its row there) or None
            if all(h is not None and h[0] is got[0][0] and h[1] == j for j, h in enumerate(got)) \
                    and got[0][0].shape[0] == len(members):
                hist = got[0][0]                       # the same rows as the last step, in order: its rings
            else:                   # -1 for rows without a ring yet; the others' rings, one copy per source
                hist = torch.full((len(members), S, L), -1, dtype=torch.long, device=dev)
                sources: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
                for j, h in enumerate(got):
                    if h is not None:
                        src = sources.setdefault(id(h[0]), (h[0], [], []))
                        src[1].append(j)
                        src[2].append(h[1])
                for src, to, frm in sources.values():
                    hist[upload(to, dev)] = src[upload(frm, dev)]
            now = argmax if every else argmax[idx]
            same = (hist == now[:, None]).flatten(1).all(-1)
            if every:
                stable_t = same
            else:
                stable_t[idx] = same
            if len(members) == 1:
                s = sts[members[0]]
                hist[0, (s.N - s.left) % S] = now[0]
            else:                   # each row's oldest slot, in one write
                ring = upload([(sts[b].N - sts[b].left) % S for b in members], dev)
                hist[torch.arange(len(members), device=dev), ring] = now
            for j, b in enumerate(members):
                sts[b].hist = (hist, j)
        mean_ent = ent.mean(dim=-1)
        confident = mean_ent < limits[:, 1]
        # the step's one transfer: the stopping test; multinomial's check of the probabilities (finite entropies
        # exactly when the softmax is finite and sums to 1: no nan, no +inf, not every logit -inf); the argmaxes
        # (the canvases that finish, step streaming)
        amax, (stop, ok) = read_with(argmax, torch.stack([stable_t & confident,
                                                          torch.isfinite(ent).all(dim=-1)]).to(argmax.dtype))
        if not all(ok):
            raise RuntimeError(PROBABILITIES_INVALID)
        sc_next = x.to(emb_dtype)
        hooks = fin.hooks
        watched = [b for b, r in enumerate(active) if hooks.on_step is not None and hooks.steps_for(r.index)
                   and not (stop[b] or sts[b].left == 1)]       # step streaming: rows whose canvas goes on
        for b in watched:
            s = sts[b]
            gl = active[b].plan.gen_length
            window = (s.out + amax[b])[:gl]       # the whole window: undecided positions as masks (null)
            hooks.on_step(active[b].index, window + [engine.mask_id] * (gl - len(window)), len(s.out))
        finished_canvas = []
        for b, (r, s) in enumerate(zip(active, sts)):
            r.nfe += 1
            s.left -= 1
            if stop[b] or s.left == 0:
                finished_canvas.append(b)
                s.at = None
            else:
                s.at = b
        last = (nxt, sc_next)
        if finished_canvas:
            am = [amax[b] for b in finished_canvas]
            for i, b in enumerate(finished_canvas):
                r, s = active[b], sts[b]
                if r.logprobs is not None:
                    pos = torch.arange(len(s.out), len(s.out) + L)
                    r.logprobs.record(pos, argmax[b].cpu(), x[b].cpu())
                s.out += am[i]
                s.canvas = None
                stops = fin.stops(r)
                done = len(s.out) >= r.plan.gen_length or any(t in stops for t in am[i])
                view = s.out + [engine.mask_id] * max(0, r.plan.gen_length - len(s.out))
                fin.update(r, view, done, settled=len(s.out))
                if not r.done:
                    s.encode = am[i]
        keep([b for b, r in enumerate(active) if not r.done])
        yield


MIN_STEP_TEMPERATURE = 1e-5     # vLLM's sampling epsilon; 1e-40 overflowed the float32 logits (a 500 for the batch)


def check(p: GenerationParams) -> GenerationParams:
    for field in ("steps", "factor", "threshold"):
        if getattr(p, field) is not None:
            raise ParamError(field, f"diffusion_gemma takes algorithm_params max_denoising_steps, entropy_bound, "
                                    f"t_min, t_max, stability_threshold and confidence_threshold, not {field}")
    if p.remasking != "low_confidence":
        raise ParamError("remasking", "diffusion_gemma accepts by entropy (algorithm_params entropy_bound), not "
                                      "remasking")
    if p.temperature:
        raise ParamError("temperature", "DiffusionGemma samples with its own temperature schedule, from t_max at a "
                                        "canvas's first step towards t_min: set algorithm_params t_min and t_max (0 "
                                        "or no temperature uses them)")
    e = p.extra
    if not isinstance(e["max_denoising_steps"], int) or e["max_denoising_steps"] < 1:
        raise ParamError("algorithm_params", f"diffusion_gemma: max_denoising_steps must be a positive integer, got "
                                             f"{e['max_denoising_steps']!r}")
    for name in ("entropy_bound", "confidence_threshold"):
        if not e[name] > 0:
            raise ParamError("algorithm_params", f"diffusion_gemma: {name} must be > 0, got {e[name]!r}")
    if not e["t_max"] > e["t_min"]:
        raise ParamError("algorithm_params", f"diffusion_gemma: t_max ({e['t_max']!r}) must be greater than t_min "
                                             f"({e['t_min']!r})")
    if e["t_max"] > 100:
        raise ParamError("algorithm_params", f"diffusion_gemma: t_max must be at most 100, got {e['t_max']!r}")
    # the lowest temperature of the schedule (its last step, in its float32 arithmetic: _State.schedule): logits
    # divided by less than MIN_STEP_TEMPERATURE overflow to inf and the step's entropies are nan
    N = e["max_denoising_steps"]
    lowest = float(np.float32(e["t_min"]) + np.float32(e["t_max"] - e["t_min"]) * (np.float32(1) / np.float32(N)))
    if not lowest >= MIN_STEP_TEMPERATURE:
        raise ParamError("algorithm_params", f"diffusion_gemma: t_min and t_max give a step temperature of {lowest:g}, "
                                             f"below {MIN_STEP_TEMPERATURE:g}: raise t_min or t_max")
    return replace(p, extra={**e, "entropy_bound": float(e["entropy_bound"]), "t_min": float(e["t_min"]),
                             "t_max": float(e["t_max"]), "confidence_threshold": float(e["confidence_threshold"])})


def check_model(pl: Plan, model) -> None:
    """The canvas is the checkpoint's (``block_length`` can only be it); whole canvases must fit the positions."""
    L = model.cfg.canvas_length
    if pl.params.block_length != L:
        raise ParamError("block_length", f"DiffusionGemma denoises canvases of {L} tokens (the checkpoint's "
                                         f"canvas_length); block_length cannot be {pl.params.block_length}")
    total = pl.prompt_length + -(-pl.gen_length // L) * L
    if total > model.max_sequence_length:
        raise ParamError("max_tokens", context_exceeded(
            model.max_sequence_length, pl.prompt_length, total - pl.prompt_length,
            f": max_tokens {pl.gen_length} in whole canvases of {L}"), code="context_length_exceeded")


def cost(pl: Plan) -> int:
    """Nominal token-forwards: every canvas's steps at most, each over the canvas and the context."""
    L = pl.block_length
    canvases = -(-pl.gen_length // L)
    return canvases * pl.params.extra["max_denoising_steps"] * max(MIN_FORWARD_TOKENS, pl.prompt_length + canvases * L)


def prefix_blocks(plan, cache) -> tuple[int, int]:
    """Entries of ``cache.block`` prompt tokens, all but the last token's (at least one token is left to encode)."""
    return cache.block, (plan.prompt_length - 1) // cache.block


register(Algorithm(
    name="diffusion_gemma",
    description="DiffusionGemma's multi-canvas decoding (DiffusionGemmaGenerationMixin.generate): the prompt encoded "
                "once into an exact KV cache, each canvas denoised from random tokens with a linear temperature "
                "schedule, entropy-bound acceptance, renoising and adaptive stopping, its argmax appended to the "
                "cache",
    exact=True, run=run, cfg=False, check=check, check_model=check_model,
    stochastic=lambda p: True, samples_always=True, cost=cost, prefix_blocks=prefix_blocks,
    params=(
        ParamInfo("block_length", None, "the checkpoint's canvas_length (fixed)"),
        ParamInfo("seed", None, "per-request seed for the canvases, sampling and renoising"),
    ),
    extra_params=PARAMS,
))
