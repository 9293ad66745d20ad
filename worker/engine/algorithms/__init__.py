"""The algorithm registry. An algorithm decodes a group of rows (each with its own parameters) to the end; the
engine picks it by the request's ``generation_algorithm``. Acceleration algorithms register here by name; a model
family lists the ones that decode it (``Family.algorithms``, worker/models/)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterator

from ...models import FAMILIES
from ..params import MIN_TEMPERATURE, GenerationParams, ParamError

if TYPE_CHECKING:
    from ..engine import Engine
    from ..rows import Finisher, Row


@dataclass(frozen=True)
class ParamInfo:
    name: str
    default: object
    description: str
    choices: tuple | None = None      # the accepted values (strings)
    kind: str | None = None           # "int" / "number" when the default (None) does not say; None is then accepted
    maximum: float | None = None      # a number's largest accepted value (beyond it the arithmetic breaks down)


def _bad_value(info: ParamInfo, value) -> str | None:
    """Why ``value`` is not acceptable for an ``algorithm_params`` entry, or None."""
    if info.choices is not None:
        return None if value in info.choices else f"one of {', '.join(map(str, info.choices))}"
    default = info.default
    if value is None and default is None:
        return None
    kind = info.kind or ("bool" if isinstance(default, bool) else "int" if isinstance(default, int) else "number")
    if kind == "bool":
        return None if isinstance(value, bool) else "a boolean"
    if kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1 << 16
        return None if ok else f"an integer from 0 to {1 << 16}"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    if ok and info.maximum is not None and value > info.maximum:
        return f"a number from 0 to {info.maximum:g}"
    return None if ok else "a non-negative number"


COMMON_PARAMS = (
    ParamInfo("steps", None, "denoising steps over the whole generation (default: one per token); spread evenly "
              "over the blocks, rounded up, capped at block_length per block"),
    ParamInfo("block_length", 32, "semi-autoregressive block size; capped at max_tokens; max_tokens is rounded up to "
              "a multiple of it internally and the output cut back"),
    ParamInfo("temperature", 0.0, "0 = greedy; > 0 samples with float64 Gumbel-max noise"),
    ParamInfo("remasking", "low_confidence", "which masked positions to commit: low_confidence or random"),
    ParamInfo("threshold", None, "Fast-dLLM parallel decoding: commit the most confident masked token of the block "
              "plus every other one with confidence >= threshold (steps is then ignored)"),
    ParamInfo("factor", None, "Fast-dLLM dynamic parallel decoding: commit the n most confident tokens while the "
              "n-th confidence >= 1 - factor/(n+1) (steps is then ignored)"),
    ParamInfo("seed", None, "per-request seed for temperature sampling and random remasking"),
)


@dataclass(frozen=True)
class Algorithm:
    name: str
    description: str
    exact: bool                     # token-identical to the published reference loop
    # a generator: decodes the rows, yielding after every step (the engine runs groups' steps in turn)
    run: Callable[["Engine", "list[Row]", "Finisher"], Iterator[None]]
    params: tuple[ParamInfo, ...] = COMMON_PARAMS
    extra_params: tuple[ParamInfo, ...] = field(default_factory=tuple)   # go in ``algorithm_params``
    defaults: dict = field(default_factory=dict)                         # common parameters' own defaults here
    cfg: bool = True                                                     # supports cfg_scale > 0
    check: Callable[[GenerationParams], GenerationParams] | None = None  # the algorithm's own rules, after defaults
    stochastic: Callable[[GenerationParams], bool] | None = None         # draws random numbers beyond temperature
    samples_always: bool = False     # samples its tokens whatever ``temperature`` says (its own temperature schedule)
    # (prompt length, max_tokens, block_length) -> (positions a row needs, how they are counted): its own length
    # rule, else worker.engine.params.canvas_positions
    positions: Callable | None = None
    check_model: Callable | None = None                                  # (plan, model): rules the checkpoint sets
    cost: Callable | None = None                                         # (plan) -> nominal token-forwards, if not
                                                                         # worker.engine.params.row_cost's rule
    # (plan, prefix cache) -> (tokens per cache entry, the prompt's leading entries a row reuses when cached), for
    # the algorithms that use the prefix cache (worker/engine/prefix_cache.py); None: they do not
    prefix_blocks: Callable | None = None
    forward: str | None = None      # algorithms naming the same forward step in one group, one forward a round: its
                                    # ``run`` decodes the rows of every one of them (each row by its own algorithm)

    @property
    def group(self) -> str:
        """The engine's group key for this algorithm's rows (worker/engine/engine.py ``_Batch``)."""
        return self.forward or self.name

    @property
    def families(self) -> tuple[str, ...]:
        """The families that list this algorithm (in worker/models' order)."""
        return tuple(name for name, f in FAMILIES.items() if self.name in f.algorithms)

    def take_filters(self, p: GenerationParams) -> GenerationParams:
        """The request's sampling filters (``top_p``, ``top_k``, ``min_p`` at the top level of the body): an
        ``algorithm_params`` entry of the same name takes each (the same value given there too is fine, another one
        is a 400). An algorithm without it that takes the argmax (temperature 0, unless it samples by a schedule of
        its own) gives the same tokens whatever a filter keeps, so it is ignored there (as vLLM ignores them when
        greedy); one that samples refuses it. Runs before the checkpoint's own defaults are merged, so only the
        request's own ``algorithm_params`` can conflict."""
        if not p.filters:
            return p
        known = {i.name: i for i in self.extra_params}
        extra = dict(p.extra)
        samples = p.temperature >= MIN_TEMPERATURE or self.samples_always      # (below it plan() makes it greedy)
        for name, value in p.filters.items():
            info = known.get(name)
            if info is None:
                if samples:
                    raise ParamError(name, f"{self.name} samples without {name} filtering (its reference has none): "
                                           f"leave {name} at its default" +
                                           (", or decode greedily (temperature 0)" if p.temperature else ""))
                continue
            why = _bad_value(info, value)
            if why is not None:
                raise ParamError(name, f"{self.name}: {name} must be {why}, got {value!r}")
            if name in extra and extra[name] != value:
                raise ParamError(name, f"{name} {value!r} and algorithm_params.{name} {extra[name]!r} differ: "
                                       f"give one")
            extra[name] = value
        return replace(p, extra=extra, filters={})

    def normalize(self, p: GenerationParams) -> GenerationParams:
        """Apply this algorithm's defaults and check its parameters (raises ParamError)."""
        if p.cfg_scale and not self.cfg:
            raise ParamError("cfg_scale", f"classifier-free guidance is not available with {self.name}")
        known = {i.name: i for i in self.extra_params}
        unknown = sorted(set(p.extra) - set(known))
        if unknown:
            raise ParamError("algorithm_params", f"{self.name} has no parameter {unknown[0]!r}; it takes "
                             f"{', '.join(sorted(known)) or 'none'}")
        extra = {name: p.extra.get(name, info.default) for name, info in known.items()}
        for name, value in extra.items():
            why = _bad_value(known[name], value)
            if why is not None:
                raise ParamError("algorithm_params", f"{self.name}: {name} must be {why}, got {value!r}")
        changes = {k: v for k, v in self.defaults.items() if getattr(p, k) is None and
                   not (k == "threshold" and p.factor is not None)}
        p = replace(p, extra=extra, **changes)
        p = self.check(p) if self.check is not None else p
        if p.factor is not None and "factor" not in {i.name for i in self.params}:
            raise ParamError("factor", f"{self.name} has no factor rule (its parameters: "
                                       f"{', '.join(i.name for i in self.params)})")
        return p

    def describe(self, defaults: dict | None = None, served: dict | None = None) -> dict:
        """For /generation/algorithms; ``defaults``: the checkpoint's own defaults for ``algorithm_params``;
        ``served``: the common parameters' defaults as this server applies them (its --default-block-length, or
        the checkpoint's block size), where this algorithm has none of its own."""
        defaults, served = defaults or {}, served or {}
        return {
            "name": self.name, "description": self.description, "exact": self.exact,
            "families": list(self.families),
            "parameters": {p.name: {"default": self.defaults.get(p.name, served.get(p.name, p.default)),
                                    "description": p.description}
                           for p in self.params},
            "algorithm_params": {p.name: {"default": defaults.get(p.name, p.default), "description": p.description,
                                          **({"choices": list(p.choices)} if p.choices else {}),
                                          **({"maximum": p.maximum} if p.maximum is not None else {})}
                                 for p in self.extra_params},
            "cfg_scale_supported": self.cfg,
        }


REGISTRY: dict[str, Algorithm] = {}


def register(alg: Algorithm) -> Algorithm:
    REGISTRY[alg.name] = alg
    return alg


def needs_rng(p: GenerationParams) -> bool:
    """Whether a row with these parameters draws random numbers (so it needs a seed to be reproducible)."""
    if p.temperature > 0 or p.remasking == "random":
        return True
    alg = REGISTRY.get(p.algorithm)
    return alg is not None and alg.stochastic is not None and alg.stochastic(p)


def get(name: str, family: str) -> Algorithm:
    alg = REGISTRY.get(name)
    if alg is None or family not in alg.families:
        names = sorted(n for n, a in REGISTRY.items() if family in a.families)
        raise ParamError("generation_algorithm",
                         f"unknown generation_algorithm {name!r} for this model; available: {', '.join(names)}")
    return alg


# the algorithm modules register themselves
from . import basic, cached, diffusion_gemma, dinfer, dream, dream_cache, llada2, nemotron, sdar  # noqa: E402,F401
