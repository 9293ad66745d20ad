"""Per-request generation parameters, their validation and the documented rounding rules."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace


class ParamError(ValueError):
    """A request parameter is invalid. ``param`` names it (OpenAI error body's ``param``)."""

    def __init__(self, param: str | None, message: str, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.message = message
        self.code = code            # the OpenAI error body's ``code`` (``context_length_exceeded``)


def context_exceeded(max_sequence_length: int, prompt_tokens: int, completion_tokens: int | None = None,
                     note: str = "") -> str:
    """The message of a request longer than the model's context, in OpenAI's and vLLM's words, which clients parse
    to retry with fewer tokens (litellm's ContextWindowExceededError, NeMo-Skills' soft fail): the prompt's and the
    generation's tokens, or the prompt alone when it leaves no room."""
    if completion_tokens is None:
        return (f"This model's maximum context length is {max_sequence_length} tokens. However, your request has "
                f"{prompt_tokens} input tokens{note}. Please reduce the length of the input messages.")
    return (f"This model's maximum context length is {max_sequence_length} tokens. However, you requested "
            f"{prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the messages, {completion_tokens} in the "
            f"completion{note}). Please reduce the length of the messages or completion.")


REMASKING = ("low_confidence", "random")
MIN_TEMPERATURE = 1e-5      # a temperature below it is greedy (vLLM's _SAMPLING_EPS): logits / 1e-300 is inf


@dataclass(frozen=True)
class GenerationParams:
    """What one row asks for. ``gen_length`` is the number of new tokens wanted (``max_tokens``)."""

    gen_length: int = 128
    block_length: int = 32
    steps: int | None = None          # None: one step per token (steps = gen_length)
    algorithm: str = "basic"
    temperature: float = 0.0
    remasking: str = "low_confidence"
    cfg_scale: float = 0.0
    threshold: float | None = None    # Fast-dLLM confidence-threshold parallel decoding
    factor: float | None = None       # Fast-dLLM dynamic (factor) parallel decoding
    seed: int | None = None
    ignore_eos: bool = False          # decode the whole window; the model's stop tokens do not end the row
    stop_token_ids: frozenset = frozenset()   # the request's own stop tokens (vLLM's), beside the model's
    logprobs: int | None = None       # None: none; k >= 0: each generated token's log-probability and the top k
    extra: dict = field(default_factory=dict)  # algorithm-specific parameters
    # the request's sampling filters (top_p, top_k, min_p) not at their neutral value, before its algorithm takes
    # them (Algorithm.take_filters)
    filters: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """The schedule a row actually runs, after rounding.

    - ``block_length`` is capped at ``gen_length``;
    - the canvas (``canvas_length``) is ``gen_length`` rounded up to a multiple of ``block_length``; only the first
      ``gen_length`` tokens are returned;
    - ``steps`` is spread evenly over the blocks, rounding up (``steps_per_block = ceil(steps / num_blocks)``), and
      capped at ``block_length`` (extra steps would commit nothing and change no token).
    """

    params: GenerationParams
    prompt_length: int
    gen_length: int
    block_length: int
    canvas_length: int
    num_blocks: int
    steps_per_block: int


def canvas_positions(prompt_length: int, gen_length: int, block_length: int) -> tuple[int, str]:
    """The positions a row needs (and how it counts them, for the 400's message): the prompt, then ``max_tokens``
    rounded up to whole blocks from the generation's first token (a block no longer than ``max_tokens``)."""
    block = min(block_length, gen_length)
    canvas = -(-gen_length // block) * block
    note = f": max_tokens {gen_length} rounded up to a multiple of block_length {block}" if canvas != gen_length else ""
    return prompt_length + canvas, note


def whole_block_positions(prompt_length: int, gen_length: int, block_length: int) -> tuple[int, str]:
    """The block-causal algorithms' rule (SDAR, LLaDA2.x): prompt + ``max_tokens`` in whole blocks counted from the
    prompt's first token, so the prompt's last partial block and the generation share a block."""
    total = -(-(prompt_length + gen_length) // block_length) * block_length
    note = (f": max_tokens {gen_length} in whole blocks of {block_length} counted from the prompt's first token"
            if total != prompt_length + gen_length else "")
    return total, note


def plan(params: GenerationParams, prompt_length: int, max_sequence_length: int,
         positions=canvas_positions) -> Plan:
    """The row's schedule; ``positions`` is its algorithm's length rule (:func:`canvas_positions` unless it has
    its own): a row needing more positions than the model has is a 400 ``context_length_exceeded``."""
    p = params
    if prompt_length < 1:
        raise ParamError("prompt", "the prompt is empty")
    if not isinstance(p.gen_length, int) or p.gen_length < 1:
        raise ParamError("max_tokens", f"max_tokens must be a positive integer, got {p.gen_length!r}")
    if not isinstance(p.block_length, int) or p.block_length < 1:
        raise ParamError("block_length", f"block_length must be a positive integer, got {p.block_length!r}")
    if p.steps is not None and (not isinstance(p.steps, int) or p.steps < 1):
        raise ParamError("steps", f"steps must be a positive integer, got {p.steps!r}")
    if not (isinstance(p.temperature, (int, float)) and 0 <= p.temperature <= 100 and math.isfinite(p.temperature)):
        raise ParamError("temperature", f"temperature must be between 0 and 100, got {p.temperature!r}")
    if 0 < p.temperature < MIN_TEMPERATURE:     # logits / 1e-300 overflow to inf and nan: greedy, as vLLM's rule
        p = replace(p, temperature=0.0)
    if p.remasking not in REMASKING:
        raise ParamError("remasking", f"remasking must be one of {', '.join(REMASKING)}, got {p.remasking!r}")
    if not (isinstance(p.cfg_scale, (int, float)) and 0 <= p.cfg_scale <= 100 and math.isfinite(p.cfg_scale)):
        raise ParamError("cfg_scale", f"cfg_scale must be between 0 and 100, got {p.cfg_scale!r}")
    if p.threshold is not None and not (isinstance(p.threshold, (int, float)) and 0 < p.threshold <= 1):
        raise ParamError("threshold", f"threshold must be in (0, 1], got {p.threshold!r}")
    if p.factor is not None and not (isinstance(p.factor, (int, float)) and 0 < p.factor <= 1000):
        raise ParamError("factor", f"factor must be in (0, 1000], got {p.factor!r}")
    if p.threshold is not None and p.factor is not None:
        raise ParamError("factor", "threshold and factor are two different parallel-decoding rules: give one")
    block = min(p.block_length, p.gen_length)
    num_blocks = -(-p.gen_length // block)
    canvas = num_blocks * block
    needed, note = positions(prompt_length, p.gen_length, p.block_length)
    if needed > max_sequence_length:
        raise ParamError("max_tokens", context_exceeded(max_sequence_length, prompt_length, needed - prompt_length,
                                                        note), code="context_length_exceeded")
    steps = p.gen_length if p.steps is None else p.steps
    spb = min(max(1, -(-steps // num_blocks)), block)
    return Plan(p, prompt_length, p.gen_length, block, canvas, num_blocks, spb)


# A forward's fixed cost (its launches, every layer's weights read once) in tokens: a forward of a few tokens costs
# about what one of this many does, so a row of many forwards over a tiny canvas is not nearly free (Dream's uncapped
# steps: a million forwards of 4 tokens cost 4 M without it, under the default --max-request-cost, and ran ~25 min).
MIN_FORWARD_TOKENS = 64


def row_cost(pl: Plan) -> int:
    """A row's nominal cost in token-forwards: the forwards of its schedule (blocks x steps per block, or ``steps``
    where an algorithm runs them uncapped) x the tokens a full forward holds (prompt + canvas, at least
    MIN_FORWARD_TOKENS), doubled with
    classifier-free guidance. An upper bound for the cached algorithms, which forward fewer tokens per step, and
    for the threshold rules, which often take fewer steps; what admission limits and orders by (docs/reliability.md)."""
    from .algorithms import REGISTRY       # (late: the algorithms import this module)
    alg = REGISTRY.get(pl.params.algorithm)
    if alg is not None and alg.cost is not None:
        return alg.cost(pl)
    return schedule_cost(pl, pl.steps_per_block)


def held_tokens(positions: int, params: GenerationParams) -> int:
    """The tokens a row holds in a forward, what ``--max-batch-tokens`` counts: its positions (prompt + canvas by its
    algorithm's length rule), twice with classifier-free guidance (the unconditional copy runs beside it)."""
    return positions * (2 if params.cfg_scale > 0 else 1)


def schedule_cost(pl: Plan, steps_per_block: int) -> int:
    """:func:`row_cost`'s formula with ``steps_per_block`` forwards a block."""
    forwards = max(pl.num_blocks * steps_per_block, pl.params.steps or 0)
    tokens = max(MIN_FORWARD_TOKENS, pl.prompt_length + pl.canvas_length)
    return forwards * tokens * (2 if pl.params.cfg_scale > 0 else 1)


def until_unmasked_cost(pl: Plan) -> int:
    """The cost of the LLaDA-family loops (basic, the Fast-dLLM caches, Nemotron, dInfer): with a threshold or factor
    rule a block runs until it has no mask, a token at least a step, whatever ``steps`` says, so its blocks count
    ``block_length`` forwards each (``steps: 1`` with ``threshold: 1.0`` was admitted at 1/256 of what it ran: a
    review). The rule's safety cap of 4x, reached only by a model that keeps proposing the mask token, is not
    counted."""
    unmasked = pl.params.threshold is not None or pl.params.factor is not None
    return schedule_cost(pl, pl.block_length if unmasked else pl.steps_per_block)


# One top alternative of a generated token's log-probability, in token-forwards: the worker finds its text in
# context and writes it out, the balancer reads and writes it again, host work of a few microseconds that a GPU's
# forward of a token does not come near. Without it a request of n=128 choices of 256 tokens with top_logprobs 20
# (655,000 alternatives, 70 MB of JSON) cost 553,000 token-forwards, 2% of the default limit, and stopped its
# worker's event loop for tens of seconds (a review): now 84 M, refused. The chosen token's own entry costs nothing
# more: its text is decoded for the answer anyway (an RL rollout's logprobs of 16 x 1,024 tokens cost what they did).
LOGPROB_ENTRY_COST = 128


def logprobs_cost(pl: Plan) -> int:
    """A row's top log-probability alternatives (max_tokens x top_logprobs, when it asks for logprobs) at
    LOGPROB_ENTRY_COST token-forwards each: added to its cost at admission (--max-request-cost)."""
    k = pl.params.logprobs
    return 0 if not k else pl.gen_length * k * LOGPROB_ENTRY_COST


def with_seed(pl: Plan, seed: int) -> Plan:
    """The same plan for a row with another seed (the n choices of a request; a seed given to an unseeded row)."""
    return replace(pl, params=replace(pl.params, seed=seed))
