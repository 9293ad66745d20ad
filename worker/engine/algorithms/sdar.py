"""``sdar``: SDAR's block diffusion (JetAstra/SDAR ``generate.py`` ``block_diffusion_generate``) with an exact KV
cache, each row with its own prompt length, block length and parameters at any batch size.

A row's sequence (prompt, then masks up to a multiple of ``block_length``) is cut into blocks counted from position 0.
Attention is block-causal. The prompt's whole blocks are prefilled into the row's cache slot in one forward; then
each block from the one holding the end of the prompt is denoised: every step forwards the block alone, attending to
the cached blocks before it and to itself, samples a token and its probability at each of the block's positions, and
commits positions by ``remasking_strategy``:

- ``low_confidence_dynamic`` (the default): every masked position whose probability exceeds ``threshold`` when there
  are at least the step's scheduled count of them, else the scheduled count of the most probable;
- ``low_confidence_static``: the scheduled count of the most probable masked positions;
- ``sequential``: the scheduled count of positions from the first masked one.

The schedule spreads ``block_length`` over ``denoising_steps`` (the remainder to the first steps). When the block has
no mask, one more forward stores its keys/values in the cache (counted in nfe, as every forward). A stored block
never changes again (later blocks never attend back into it differently), so the cache is exact, not an
approximation. Tokens come from ``torch.multinomial`` over the softmax after ``temperature``, ``top_k``, ``top_p``
(the reference always samples; ``temperature: 0`` means its greedy setting, ``top_k: 1``), drawn from the row's own
generator for all of the block's positions each step, so a seeded row reproduces the reference run alone after
``torch.manual_seed(seed)``. As in the reference, a step whose scheduled count exceeds the block's masked positions
also rewrites some unmasked positions of the block (prompt tokens in the first block included); a block becomes final
when stored, so answers stream and end (early exit) only at block boundaries."""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from ...models.layers import upload
from ..params import GenerationParams, ParamError, whole_block_positions
from ..rows import Finisher, Row, read_with, record_block_logprobs
from ..sampling import PROBABILITIES_INVALID, check_probabilities, multinomial_rows, probabilities_ok
from . import Algorithm, ParamInfo, register
from .block_causal import BlockBatch, block_positions, check_common, choose, subset

STRATEGIES = ("low_confidence_dynamic", "low_confidence_static", "sequential")


def transfer_schedule(block_length: int, steps: int) -> list[int]:
    base, rem = divmod(block_length, steps)
    return [base + (1 if i < rem else 0) for i in range(steps)]


def sample(logits: torch.Tensor, p: GenerationParams, g: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, their probabilities) at every position, as the reference's ``sample_with_temperature_topk_topp``."""
    return draw(filtered_probs(logits, p), g)


def draw(probs: torch.Tensor, g: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One multinomial draw per position of ``probs`` [N, V] from ``g`` (also at temperature 0, as the reference
    draws: ties at the top survive its top-1 filter), and the drawn tokens' probabilities."""
    token = torch.multinomial(probs, num_samples=1, generator=g)
    return token[:, 0], torch.gather(probs, -1, token)[:, 0]


def draw_rows(probs: torch.Tensor, gens: list, checks: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`draw` for rows ``probs[j]`` ([n, K, V]), each from its own generator ``gens[j]``, at once
    (:func:`~worker.engine.sampling.multinomial_rows`: the same draws and results as row by row), with one validity
    check for all the rows instead of multinomial's two host syncs per row and step; with ``checks``, the check is
    appended there for the caller to read with a read it makes anyway (``sampling.read_checked``)."""
    if checks is None:
        check_probabilities(probs)
    else:
        checks.append(probabilities_ok(probs))
    token = multinomial_rows(probs, gens)
    return token, torch.gather(probs, -1, token[..., None])[..., 0]


def sampling_key(p: GenerationParams) -> tuple:
    """Rows with equal keys have their probabilities computed together (:func:`filtered_probs` is row-wise)."""
    return (p.temperature, p.extra["top_k"], p.extra["top_p"]) if p.temperature else (0.0, 1, p.extra["top_p"])


def filtered_probs(logits: torch.Tensor, p: GenerationParams) -> torch.Tensor:
    """The reference's temperature, top-k and top-p filtering and softmax, for logits [N, V] (row-wise)."""
    temperature, top_k = (1.0, 1) if p.temperature == 0 else (p.temperature, p.extra["top_k"])
    top_p = p.extra["top_p"]
    if temperature != 1.0:
        logits = logits / temperature
    if top_k > 0:        # (a k past the vocabulary keeps every token, as filtering off does)
        kth = torch.topk(logits, min(top_k, logits.shape[-1]))[0][..., -1, None]
        logits = torch.where(logits < kth, torch.full_like(logits, float("-inf")), logits)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        over = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1) > top_p
        over[..., 1:] = over[..., :-1].clone()
        over[..., 0] = False
        drop = torch.scatter(torch.full_like(logits, False, dtype=torch.bool), -1, order, over)
        logits = logits.masked_fill(drop, float("-inf"))
    return F.softmax(logits, dim=-1)


class _State:
    """Where a row is: prefilling, denoising block ``block`` at ``step``, or storing it."""
    __slots__ = ("phase", "block", "step", "total", "final", "reused")

    def __init__(self, row: Row, bl: int):
        P = row.plan.prompt_length
        self.total = -(-(P + row.plan.gen_length) // bl) * bl         # positions, whole blocks
        self.block = P // bl
        self.phase = "prefill" if self.block > 0 else "denoise"
        self.step = 0
        self.final = self.block * bl                                    # positions before it never change again
        self.reused = 0                         # prompt blocks taken from the prefix cache (the prefill starts after)


def run(engine, rows: list[Row], fin: Finisher) -> None:
    model, mask_id, dev = engine.model, engine.mask_id, engine.model.device

    def reused(r: Row, n: int) -> None:        # the prefix cache gave the row its first n positions
        r.state.reused = n // r.params.block_length
    # the prefill forward keeps at least the prompt's last whole block, so the row's forwards (nfe) are the same
    batch = BlockBatch(engine, rows, lambda r: setattr(r, "state", _State(r, r.params.block_length)),
                       reusable=lambda r: prefix_blocks(r.plan, None)[1], reused=reused)

    while batch.between_steps(fin):       # a joining row starts with its prefill
        active = batch.active
        spans, at = [], []
        for r in active:
            s, bl = r.state, r.params.block_length
            if s.phase == "prefill":
                spans.append((s.reused * bl, s.block * bl))
            elif r.params.extra["kv_cache"]:
                spans.append((s.block * bl, (s.block + 1) * bl))
            else:          # the comparison without a cache: every forward recomputes the prefix
                spans.append((0, (s.block + 1) * bl))
            at.append(spans[-1][1] - bl - spans[-1][0])    # window index of the block's first position
        hidden = batch.forward(spans)
        den = [b for b, r in enumerate(active) if r.state.phase == "denoise"]
        x, xc = batch.x, None
        if den:
            pos = block_positions([at[b] for b in den], [active[b].params.block_length for b in den], dev)
            h = hidden if len(den) == len(active) else hidden[upload(den, dev)]
            logits = model.logits(h.gather(1, pos[:, :, None].expand(-1, -1, h.shape[-1])))
        groups: dict[tuple, list[int]] = {}       # rows (indices into den) sampled, chosen and written together
        checks: list[torch.Tensor] = []           # multinomial's validity checks, read with the canvas
        for i, b in enumerate(den):
            p = active[b].params
            groups.setdefault((p.block_length, sampling_key(p), active[b].logprobs is None), []).append(i)
        for (bl, _, plain), members in groups.items():
            rows = [active[den[i]] for i in members]
            mi = subset(members, len(den), dev)                       # None: every row, in order
            bi = subset([den[i] for i in members], len(active), dev)
            every = bi is None
            cols = upload([r.state.block * bl for r in rows], dev)[:, None] + torch.arange(bl, device=dev)
            cur = x.gather(1, cols) if every else x[bi[:, None], cols]
            lg = logits[:, :bl] if mi is None else logits[mi, :bl]
            probs = filtered_probs(lg.reshape(-1, lg.shape[-1]), rows[0].params).view(lg.shape)
            masked = cur == mask_id
            tokens, chosen_p = draw_rows(probs, [r.generator for r in rows], checks)   # each row from its generator
            ps = [r.params for r in rows]
            # the rows choose together (no per-row read of the device)
            write = choose(masked, chosen_p,
                           [transfer_schedule(p.block_length, p.extra["denoising_steps"])[r.state.step]
                            for r, p in zip(rows, ps)],
                           [p.threshold if p.extra["remasking_strategy"] == "low_confidence_dynamic" else None
                            for p in ps], [p.extra["remasking_strategy"] for p in ps], False)
            new = torch.where(write, tokens, cur)
            if plain and every:
                x.scatter_(1, cols, new)
            elif plain:
                x[bi[:, None], cols] = new
            else:                 # rows with logprobs, recorded one by one
                for j, i in enumerate(members):
                    b, r = den[i], rows[j]
                    start = r.state.block * bl
                    record_block_logprobs(r, cur[j], new[j], start, lg[j])
                    x[b, start:start + bl] = new[j]
        for b in den:
            active[b].state.step += 1
        if den:
            # the host copy, read once, with the draws' validity checks
            xc, ok = read_with(x, torch.stack(checks).all().to(x.dtype)[None, None] if checks else None)
            if ok is not None and not ok[0][0]:
                raise RuntimeError(PROBABILITIES_INVALID)
        for b, r in enumerate(active):
            s, bl = r.state, r.params.block_length
            r.nfe += 1
            schedule_done = False
            if s.phase == "prefill":
                s.phase = "denoise"
                if r.params.extra["kv_cache"]:         # its prompt's whole blocks are final in the cache: share
                    batch.share(b, s.reused, s.block)
            elif s.phase == "store":
                if (s.block + 1) * bl >= s.total:
                    schedule_done = True
                else:
                    s.block, s.step, s.phase = s.block + 1, 0, "denoise"
            else:
                start = s.block * bl
                left = mask_id in xc[b][start:start + bl]      # the host copy: no device read
                # the reference has no step left for a block still masked (it would fail): store it as it is
                if not left or s.step >= r.params.extra["denoising_steps"]:
                    s.phase, s.final = "store", start + bl
                    if not r.params.extra["kv_cache"]:       # nothing to store: on to the next block
                        if (s.block + 1) * bl >= s.total:
                            schedule_done = True
                        else:
                            s.block, s.step, s.phase = s.block + 1, 0, "denoise"
            if xc is None:
                xc = x.cpu().tolist()
            batch.report(fin, b, xc, s.final, schedule_done)
        batch.retire()
        yield      # a step is done: the engine may run other groups' steps (continuous batching)


def check(p: GenerationParams) -> GenerationParams:
    check_common(p, "sdar", "algorithm_params.remasking_strategy and denoising_steps (steps per block)")
    e = p.extra
    steps = e["denoising_steps"] or p.block_length
    if steps < 1:
        raise ParamError("algorithm_params", f"sdar: denoising_steps must be at least 1, got {steps!r}")
    threshold = 0.85 if p.threshold is None else p.threshold
    return replace(p, threshold=threshold, extra={**e, "denoising_steps": steps})


def prefix_blocks(plan, cache) -> tuple[int, int]:
    """The prompt's whole blocks but its last (the prefill keeps at least one block, so a row takes the same forwards,
    nfe, as without the cache); none without the KV cache."""
    bl = plan.params.block_length
    return bl, plan.prompt_length // bl - 1 if plan.params.extra["kv_cache"] else 0


register(Algorithm(
    name="sdar",
    description="SDAR block diffusion (block_diffusion_generate): block-causal attention with an exact KV cache, "
                "prompt blocks prefilled once, each block denoised by remasking_strategy then stored",
    exact=True, run=run, cfg=False, check=check, positions=whole_block_positions,
    stochastic=lambda p: True, prefix_blocks=prefix_blocks,
    params=(
        ParamInfo("block_length", None, "block size (default: the checkpoint's block_size, else the server's)"),
        ParamInfo("threshold", 0.85, "low_confidence_dynamic: commit every masked position above it"),
        ParamInfo("temperature", 0.0, "0 = SDAR's greedy setting (top_k 1); > 0 divides the logits"),
        ParamInfo("seed", None, "per-request seed for the sampling"),
    ),
    extra_params=(
        ParamInfo("remasking_strategy", "low_confidence_dynamic", "how a step chooses the positions to commit",
                  choices=STRATEGIES),
        ParamInfo("denoising_steps", None, "steps per block (default: block_length)", kind="int"),
        ParamInfo("top_k", 0, "top-k filtering (0: off)"),
        ParamInfo("top_p", 1.0, "nucleus filtering (1: off)"),
        ParamInfo("kv_cache", True, "false: recompute the prefix in every forward instead of caching it (the same "
                  "tokens at a higher cost; for comparison)"),
    ),
))
