"""The generation engine: a loaded model, its token ids, and batched generation over the algorithm registry.

Pure tensor code with no HTTP. ``Engine.generate`` takes a list of requests, each with its own prompt and
parameters, and returns one result per request; a row's result never depends on the other rows of the batch."""
from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..models import detect_family, load_model
from ..models.checkpoint import read_config
from ..tokenizer import load_tokenizer, mask_token_id, stop_token_ids
from . import algorithms
from .params import GenerationParams, ParamError, Plan, plan
from .rows import Finisher, Row, StepHooks

log = logging.getLogger(__name__)


@dataclass
class Request:
    prompt_ids: list[int]
    params: GenerationParams = field(default_factory=GenerationParams)


@dataclass
class Result:
    token_ids: list[int]          # generated ids up to (not including) the first stop token
    finish_reason: str            # "stop" | "length" | "cancelled"
    nfe: int                      # forward passes (denoising steps) this row took part in
    canvas: list[int]             # the whole generated canvas when the row ended (masks where undecided)
    prompt_tokens: int


class Engine:
    def __init__(self, model, *, mask_id: int, stop_ids: list[int], pad_id: int | None = None,
                 tokenizer=None, family: str = "llada", name: str = "model"):
        self.model = model
        self.mask_id = int(mask_id)
        self.stop_ids = sorted(set(int(i) for i in stop_ids))
        self.pad_id = int(pad_id if pad_id is not None else (self.stop_ids[0] if self.stop_ids else 0))
        self.tokenizer = tokenizer
        self.family = family
        self.name = name
        self.last_step_time = time.monotonic()   # the worker's /health reads this (progress of the device loop)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, device=None, dtype=None, compile: bool = False) -> "Engine":
        """``compile``: run the dense half of every block (output projection, RMSNorm, SwiGLU MLP) through
        ``torch.compile``, falling back to eager if compiling fails (see models.layers.Compiled)."""
        path = Path(path)
        family = detect_family(path)
        config = read_config(path)
        tokenizer = load_tokenizer(path)
        model = load_model(path, device, dtype)
        if compile:
            model.compile_dense()
        return cls(model, mask_id=mask_token_id(tokenizer, config), stop_ids=stop_token_ids(path, tokenizer, config),
                   pad_id=config.get("pad_token_id"), tokenizer=tokenizer, family=family, name=path.name)

    @property
    def max_sequence_length(self) -> int:
        return self.model.max_sequence_length

    @property
    def device(self) -> torch.device:
        return self.model.device

    def plan(self, prompt_ids: list[int], params: GenerationParams) -> Plan:
        """Validate a request and apply its algorithm's defaults; raises ParamError naming the parameter."""
        alg = algorithms.get(params.algorithm, self.family)
        params = alg.normalize(params)
        vocab = self.model.cfg.embedding_size
        bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ParamError("prompt", f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        pl = plan(params, len(prompt_ids), self.max_sequence_length)
        if alg.check_plan is not None:
            alg.check_plan(pl, self.max_sequence_length)
        return pl

    @property
    def default_block_length(self) -> int | None:
        """The block size the checkpoint was trained with (config.json ``block_size``: SDAR), if it names one."""
        return getattr(self.model.cfg, "block_size", None)

    def _generator(self, seed: int | None) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed if seed is not None else random.getrandbits(63))
        return g

    def supports(self, algorithm) -> bool:
        """Whether an algorithm (worker.engine.algorithms.Algorithm) decodes this engine's family."""
        return self.family in algorithm.families

    @property
    def scoring(self) -> str | None:
        """Why likelihood scoring is unavailable for this family, or None when it is available."""
        from ..models import FAMILIES
        if FAMILIES[self.family].scoring:
            return None
        return (f"likelihood scoring (echo with logprobs) uses LLaDA's Monte Carlo estimator, which is defined for "
                f"bidirectional masked diffusion models predicting each masked position in place; the {self.family} "
                f"family's reference code has no likelihood estimator, so this server does not invent one")

    def score(self, requests: list, cancelled=lambda i: False) -> list:
        """Likelihood estimates (worker.engine.likelihood.score) for many prompts and splits in shared forwards."""
        from .likelihood import score

        def asked(i: int) -> bool:      # asked between forwards: also the progress /health reports
            self.last_step_time = time.monotonic()
            return cancelled(i)
        out = score(self.model, self.mask_id, requests, cancelled=asked)
        self.last_step_time = time.monotonic()
        return out

    @torch.inference_mode()
    def generate(self, requests: list[Request], *, early_exit: bool = True,
                 hooks: StepHooks | None = None) -> list[Result]:
        """Generate for every request in one batch (grouped by algorithm). Raises ParamError before any work if
        a request is invalid; callers that must not fail the others validate with :meth:`plan` first."""
        plans = [self.plan(r.prompt_ids, r.params) for r in requests]
        rows = []
        for i, (req, pl) in enumerate(zip(requests, plans)):
            needs_rng = algorithms.needs_rng(pl.params)
            rows.append(Row(index=i, prompt=list(req.prompt_ids), plan=pl,
                            generator=self._generator(req.params.seed) if needs_rng else None))
        fin = _TimedFinisher(self, self.mask_id, self.stop_ids, early_exit, hooks)
        groups: dict[str, list[Row]] = {}
        for r in rows:
            groups.setdefault(r.params.algorithm, []).append(r)
        for name, group in groups.items():
            algorithms.get(name, self.family).run(self, group, fin)
        return [Result(r.tokens, r.finish_reason or "length", r.nfe, r.canvas, r.plan.prompt_length) for r in rows]


class _TimedFinisher(Finisher):
    """Finisher that also stamps the engine's last-progress time (one update per row per step)."""

    def __init__(self, engine: Engine, *args):
        super().__init__(*args)
        self.engine = engine

    def update(self, row, gen, schedule_done):
        self.engine.last_step_time = time.monotonic()
        super().update(row, gen, schedule_done)
