"""The generation engine: a loaded model, its token ids, and batched generation over the algorithm registry.

Pure tensor code with no HTTP. ``Engine.generate`` takes a list of requests, each with its own prompt and
parameters, and returns one result per request; a row's result never depends on the other rows of the batch."""
from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import torch

from ..models import FAMILIES, detect_family, load_model
from ..models.checkpoint import (CheckpointError, check_reload, generation_defaults, model_version, read_config,
                                reload_native)
from ..tokenizer import load_tokenizer, mask_token_id, stop_token_ids
from . import algorithms
from .likelihood import ScoreRequest, returned_memory, score_steps
from .params import GenerationParams, ParamError, Plan, canvas_positions, held_tokens, plan, row_cost, with_seed
from .rows import Finisher, Row, StepHooks, TokenLogprobs

log = logging.getLogger(__name__)


@dataclass
class Request:
    prompt_ids: list[int]
    params: GenerationParams = field(default_factory=GenerationParams)
    plan: Plan | None = None      # its plan when the caller already validated it (:meth:`Engine.plan`), else made here


@dataclass
class Result:
    token_ids: list[int]          # generated ids up to (not including) the first stop token
    finish_reason: str            # "stop" | "length" | "cancelled"
    nfe: int                      # forward passes (denoising steps) this row took part in
    canvas: list[int]             # the whole generated canvas when the row ended (masks where undecided)
    prompt_tokens: int
    cached_tokens: int = 0        # prompt tokens served from the prefix cache (not computed for this row)
    logprobs: list | None = None  # per answer token (id, log-probability, [(id, log-probability)] top k): asked only


class Engine:
    def __init__(self, model, *, mask_id: int, stop_ids: list[int], pad_id: int | None = None,
                 tokenizer=None, family: str = "llada", name: str = "model"):
        self.model = model
        self.mask_id = int(mask_id)
        self.stop_ids = sorted(set(int(i) for i in stop_ids))
        self.pad_id = int(pad_id if pad_id is not None else (self.stop_ids[0] if self.stop_ids else 0))
        self.tokenizer = tokenizer
        self.family = family
        self.long_row_cost = 0      # rows above this nominal cost step in groups of their own (fair share; 0: off)
        self.name = name
        self.last_step_time = time.monotonic()   # the worker's /health reads this (progress of the device loop)
        self.algorithm_defaults: dict[str, dict] = {}   # the checkpoint's algorithm_params defaults, per algorithm
        self.ranks = None           # rank 0 of a tensor-parallel worker: its followers (worker/engine/ranks.py)
        self.prefix_cache = None    # worker/engine/prefix_cache.py, where it is exact (use_prefix_cache)
        self.path: Path | None = None       # the checkpoint the weights came from (from_pretrained, reload_weights)
        self.version: dict | None = None    # its model_version: {"path", "hash"} (worker/models/checkpoint.py)
        # the served checkpoint's config.json and generation_config.json, read once (check_weights compares a new
        # checkpoint with them: the served directory may be gone by then, as an RL run keeps only its last step)
        self.served_configs: tuple[dict, dict] | None = None
        self.graphs = None          # worker/engine/graphs.py GraphedForward, when the forward replays CUDA graphs

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, device=None, dtype=None, compile: bool = False,
                        tensor_parallel: int = 1, rank_timeout: float = 300.0, rank_startup_timeout: float = 600.0,
                        layout=None,
                        prefix_cache_gb: float = 0.0, ranks=None, cuda_graphs: bool = False,
                        cuda_graph_max: int = 32, cuda_graph_max_tokens: int = 2048) -> "Engine":
        """``compile``: run the dense half of every block (output projection, RMSNorm, SwiGLU MLP) through
        ``torch.compile``, falling back to eager if compiling fails (see models.layers.Compiled).

        ``tensor_parallel`` > 1: this process is rank 0 of that many (worker/engine/ranks.py starts the others;
        ``rank_timeout``: seconds any collective may wait for a rank; ``rank_startup_timeout``: seconds the others
        may take to start, join and load, here and at every new checkpoint). ``layout``: a follower rank's place (ranks.py
        passes it). ``prefix_cache_gb``: the prefix cache's budget (:meth:`use_prefix_cache`). ``ranks``: the
        follower ranks of an engine that handed them over (:meth:`hand_over_ranks`), which load this checkpoint
        instead of new processes starting. ``cuda_graphs``: replay the forward from CUDA graphs, at most
        ``cuda_graph_max`` of them kept, for forwards of at most ``cuda_graph_max_tokens`` tokens
        (worker/engine/graphs.py: CUDA, dense families, not with tensor parallelism or ``compile``)."""
        path = Path(path)
        family = detect_family(path)
        config = read_config(path)
        tokenizer = load_tokenizer(path)
        group = None
        if ranks is not None:
            group, layout = ranks, ranks.layout
            device = ranks.devices[0]
            group.send(("load", str(path), None if dtype is None else str(dtype).replace("torch.", ""),
                        prefix_cache_gb))
        elif tensor_parallel > 1:
            from ..models.checkpoint import resolve_device
            from . import ranks
            dev = ranks.rank_device(resolve_device(device), 0)
            layout, group = ranks.start(path, tensor_parallel, dev, None if dtype is None else str(dtype).replace(
                "torch.", ""), compile, rank_timeout, prefix_cache_gb, rank_startup_timeout)
            device = dev
        try:
            model = load_model(path, device, dtype, layout)
            if group is not None:
                group.wait_ready(f"{path}")
        except BaseException:
            if group is not None:
                group.close(wait=1.0)
            raise
        if compile:
            model.compile_dense()
        graphs = None
        if cuda_graphs:
            from .graphs import install
            graphs = install(model, cuda_graph_max, max_tokens=cuda_graph_max_tokens)
        fam = FAMILIES[family]
        engine = cls(model, mask_id=mask_token_id(tokenizer, config) if fam.mask_token else -1,
                     stop_ids=stop_token_ids(path, tokenizer, config), pad_id=config.get("pad_token_id"),
                     tokenizer=tokenizer, family=family, name=path.name)
        if fam.algorithm_defaults is not None:
            engine.algorithm_defaults = fam.algorithm_defaults(path)
        engine.use_prefix_cache(prefix_cache_gb)
        engine.graphs = graphs
        engine.path = path
        engine.served_configs = (config, generation_defaults(path))
        engine.version = model_version(path) if layout is None or ranks is not None else None   # rank 0 reports it
        if group is not None:
            engine.ranks = group
            group.watch()
        return engine

    def use_prefix_cache(self, gb: float) -> None:
        """Keep up to ``gb`` GiB of prompt blocks' keys/values across requests, where the family's attention makes
        that exact (Family.prefix_cache: block-causal prompts, or a causal prompt encoder); 0 turns it off."""
        from .prefix_cache import PrefixCache
        ok = FAMILIES[self.family].prefix_cache if self.family in FAMILIES else False
        budget = int(gb * 2**30)        # (a budget that rounds to no byte is off, not a cache that stores nothing)
        if budget > 0 and ok:
            dev = self.model.device
            import psutil
            total = (torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda"
                     else psutil.virtual_memory().total)
            if budget > 0.9 * total:      # it could never be filled: refused now, not an out-of-memory error later
                raise ValueError(f"--prefix-cache-gb {gb:g} is more than 90% of the {dev.type} memory "
                                 f"({total / 2**30:.1f} GiB) that must also hold the model and its batches")
        self.prefix_cache = PrefixCache(budget) if budget > 0 and ok else None

    # configuration fields that say nothing about the weights' arithmetic (written by whichever tool saved them)
    RELOAD_IGNORED = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash",
                                "auto_map"})

    def check_weights(self, path: str | os.PathLike) -> None:
        """Raise CheckpointError unless ``path`` can replace this engine's weights in place: the same family, the
        same config.json and generation_config.json (but for tool-written fields), the same tensors in the same
        shapes, the same tokenizer vocabulary and chat template. Reads headers and small files only."""
        path = Path(path)
        family = detect_family(path)
        if family != self.family:
            raise CheckpointError(f"{str(path)!r} is a {family} checkpoint and this worker serves {self.family}: a "
                                  f"family change needs a restart, not a weight update")
        served = self.served_configs or (read_config(self.path), generation_defaults(self.path))
        for what, old, new in (("config.json", served[0], read_config(path)),
                               ("generation_config.json", served[1], generation_defaults(path))):
            keys = sorted(k for k in set(old) | set(new) if k not in self.RELOAD_IGNORED and old.get(k) != new.get(k))
            if keys:
                raise CheckpointError(f"{str(path)!r}: its {what} differs from the served model's in {keys[:10]}: "
                                      f"only the weights can change without a restart")
        check_reload(self.model, path, FAMILIES[self.family].title)
        if self.tokenizer is not None:
            tok = load_tokenizer(path)
            if (tok.get_vocab() != self.tokenizer.get_vocab()
                    or getattr(tok, "chat_template", None) != getattr(self.tokenizer, "chat_template", None)):
                raise CheckpointError(f"{str(path)!r}: its tokenizer (vocabulary or chat template) differs from the "
                                      f"served model's: a tokenizer change needs a restart")

    def reload_weights(self, path: str | os.PathLike) -> dict:
        """Replace the weights with those of ``path`` in place (no second copy of the model; see
        checkpoint.reload_native) once :meth:`check_weights` passes; the prefix cache (keys and values of the old
        weights) is emptied first, whether the reload succeeds or not. Returns the new model_version. Call it with no batch running (the worker's scheduler
        is idle). A check that fails changes nothing; a read that fails half-way (an I/O error) puts the old
        weights back, and raises RuntimeError (the engine must not serve) if even that fails. With tensor
        parallelism every follower rank reloads its shard at the same time and this returns once each has
        (RankGroup.wait_ready); when any rank's read fails, every rank goes back to the old weights (a follower that
        cannot put them back exits, which ends the worker)."""
        path = Path(path).resolve()
        self.check_weights(path)
        version = model_version(path)
        # emptied before any rank reads, on every rank, however the reload ends: ranks decide what to reuse from
        # their own caches, and one that kept its blocks after a failed reload the others emptied would run
        # forwards of other shapes than theirs (a collective mismatch)
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        if self.ranks is not None:
            self.ranks.send(("reload", str(path)))
        title = FAMILIES[self.family].title
        mine = None
        try:
            reload_native(self.model, path, title)
        except Exception as e:
            log.error("reloading %s failed half-way (%s): putting the weights of %s back", path, e, self.path)
            self._put_back(path, e)
            mine = e
        if self.ranks is not None:            # rank 0 serves once every rank has the new weights, or none has
            failed = self.ranks.wait_ready(f"the weights of {path}", failures=True)
            if failed and mine is None:
                log.error("tensor-parallel rank %d could not read %s (%s): every rank goes back to %s",
                          failed[0][0], path, failed[0][1], self.path)
                self._put_back(path, OSError(failed[0][1]))
            if failed or mine is not None:    # the followers that read the new weights go back too (all of them,
                self.ranks.send(("reload", str(self.path)))          # the others' read is the same old weights)
                back = self.ranks.wait_ready(f"the weights of {self.path}", failures=True)
                if back:
                    raise RuntimeError(f"reloading {path} failed and the previous weights could not be put back on "
                                       f"tensor-parallel rank {back[0][0]} ({back[0][1]})")
                if mine is None:
                    raise CheckpointError(f"tensor-parallel rank {failed[0][0]} could not read {str(path)!r} "
                                          f"({failed[0][1]}); every rank keeps the weights of {str(self.path)!r}")
        if mine is not None:
            raise mine
        if self.graphs is not None:
            self.graphs.clear()
        self.path, self.version = path, version
        return version

    def _put_back(self, path: Path, error: Exception) -> None:
        """The weights of ``self.path`` back into the model after ``path`` failed half-way, and their version as
        read again (a directory rewritten in place since its load gives other weights: they are served under their
        own hash, never the old one); RuntimeError (the engine must not serve) if even that fails."""
        try:
            reload_native(self.model, self.path, FAMILIES[self.family].title)
            version = model_version(self.path)
        except Exception as e2:
            raise RuntimeError(f"reloading {path} failed ({error}) and the previous weights could not be put back "
                               f"({e2})") from e2
        if version != self.version:
            log.warning("the weights put back from %s changed on disk since their load: serving them as %s (was %s)",
                        self.path, version.get("hash"), (self.version or {}).get("hash"))
            self.version = version

    @property
    def tensor_parallel(self) -> int:
        return 1 if self.ranks is None else self.ranks.size

    def close(self) -> None:
        """Stop a tensor-parallel worker's follower ranks (nothing to do on one rank)."""
        if self.ranks is not None:
            self.ranks.close()

    def hand_over_ranks(self):
        """This engine's follower ranks, for another checkpoint's engine (``from_pretrained(ranks=...)``); this
        engine is one rank's shard from then on and must not generate."""
        group, self.ranks = self.ranks, None
        return group

    def seeded(self, req: Request) -> Request:
        """``req`` with a seed of its own where its algorithm draws random numbers and it has none: tensor-parallel
        ranks must draw the same numbers (one rank drawing ``random`` seeds would not)."""
        p = req.plan.params if req.plan is not None else req.params
        if p.seed is not None or not algorithms.needs_rng(p):
            return req
        seed = random.getrandbits(63)
        return Request(req.prompt_ids, replace(req.params, seed=seed),
                       None if req.plan is None else with_seed(req.plan, seed))

    @property
    def max_sequence_length(self) -> int:
        return self.model.max_sequence_length

    @property
    def device(self) -> torch.device:
        return self.model.device

    def plan(self, prompt_ids: list[int], params: GenerationParams) -> Plan:
        """Validate a request and apply its algorithm's defaults; raises ParamError naming the parameter."""
        alg = algorithms.get(params.algorithm, self.family)
        params = alg.take_filters(params)
        own = self.algorithm_defaults.get(alg.name)
        if own:
            params = replace(params, extra={**own, **params.extra})
        params = alg.normalize(params)
        vocab = self.model.cfg.embedding_size
        bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ParamError("prompt", f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        pl = plan(params, len(prompt_ids), self.max_sequence_length, alg.positions or canvas_positions)
        if alg.check_model is not None:
            alg.check_model(pl, self.model)
        return pl

    def positions(self, algorithm: str | None, prompt_length: int, gen_length: int, block_length: int) -> int:
        """The positions a row of ``algorithm`` needs for these lengths (its length rule; an unknown algorithm's
        request fails in :meth:`plan`, with the generic rule until then)."""
        alg = algorithms.REGISTRY.get(algorithm)
        return ((alg and alg.positions) or canvas_positions)(prompt_length, gen_length, block_length)[0]

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
        if self.ranks is not None:      # every rank the same forwards: a cancelled request's work is done anyway
            self.ranks.send(("score", requests))
            with self._fatal_on_error():
                out = score(self.model, self.mask_id, requests, cancelled=lambda i: False)
            out = [None if cancelled(i) else r for i, r in enumerate(out)]
        else:
            out = score(self.model, self.mask_id, requests, cancelled=asked)
        self.last_step_time = time.monotonic()
        return out

    @contextlib.contextmanager
    def _fatal_on_error(self):
        """Rank 0 of a tensor-parallel batch: a failure leaves the followers out of step, so it ends the worker."""
        try:
            yield
        except Exception as e:      # noqa: BLE001
            from .ranks import fatal
            log.exception("tensor-parallel batch failed")
            fatal(f"a tensor-parallel batch failed on rank 0 ({type(e).__name__}: {e})")

    def score_group(self, req: ScoreRequest) -> str:
        """The group a scoring request steps in beside generation (``_ScoreGroup``): long ones apart, as rows."""
        from .likelihood import cost
        return SCORING + ("/long" if self.long_row_cost and cost(req) > self.long_row_cost else "")

    def row(self, index: int, req: Request, pl: Plan) -> Row:
        k = pl.params.logprobs
        held = held_tokens(self.positions(pl.params.algorithm, pl.prompt_length, pl.gen_length,
                                          pl.params.block_length), pl.params)
        return Row(index=index, prompt=list(req.prompt_ids), plan=pl,
                   generator=self._generator(pl.params.seed) if algorithms.needs_rng(pl.params) else None,
                   logprobs=None if k is None else TokenLogprobs(k), held=held)

    @torch.inference_mode()
    def generate(self, requests: list[Request], *, early_exit: bool = True, hooks: StepHooks | None = None,
                 feed: "Feed | None" = None, scoring: list[tuple[int, ScoreRequest]] = ()) -> list[Result]:
        """Generate for every request in one batch. Raises ParamError before any work if a request is invalid;
        callers that must not fail the others validate with :meth:`plan` first.

        Rows are grouped by algorithm (algorithms sharing a forward step, Algorithm.forward, together); each group's
        algorithm is a generator that yields after every step, and the
        groups take their steps in turn (one forward each per round), so every algorithm's rows progress together.

        Continuous batching: with a ``feed``, after every round ``feed.admit(running rows, running canvas tokens)``
        gives new rows (pairs of index and Request, the index naming the row in ``hooks`` and ``feed.done``): each
        joins its algorithm's running group before that group's next step (every algorithm takes joining rows from
        ``fin.admit`` at the top of its step loop) or starts a group when none of its algorithm runs; every row is
        handed to ``feed.done(index, Result)`` the moment it finishes. A row's tokens and nfe never depend on the
        rows around it, so joining is exact (tests/test_continuous.py).

        Likelihood scoring beside generation (one rank, with a feed): ``scoring`` pairs of index and ScoreRequest,
        and the feed's admitted ScoreRequests, are scored one forward per turn (``_ScoreGroup``), in the same fair
        share as the algorithm groups; each is handed to ``feed.done(index, ScoreResult or None if cancelled)``."""
        plans = [r.plan or self.plan(r.prompt_ids, r.params) for r in requests]
        if self.ranks is not None:
            if scoring:
                raise ValueError("tensor-parallel workers score apart (Engine.score)")
            return self._generate_leader(requests, plans, early_exit, hooks, feed)
        if scoring and feed is None:
            raise ValueError("scoring beside generation answers through a feed")
        rows = [self.row(i, req, pl) for i, (req, pl) in enumerate(zip(requests, plans))]
        _Batch(self, early_exit, hooks, feed).run(rows, list(scoring))
        return [result(r) for r in rows]

    def _generate_leader(self, requests, plans, early_exit, hooks, feed) -> list[Result]:
        """Rank 0 of a tensor-parallel worker: the same batch on every rank (worker/engine/ranks.py)."""
        from .ranks import LeaderRounds
        requests = [self.seeded(Request(r.prompt_ids, r.params, pl)) for r, pl in zip(requests, plans)]
        rounds = LeaderRounds(self.ranks, self, hooks, feed, range(len(requests)))
        first = rounds.poll()
        self.ranks.send(("generate", requests, early_exit, first, self.long_row_cost))
        with self._fatal_on_error():
            rows = [self.row(i, req, req.plan) for i, req in enumerate(requests)]
            _Batch(self, early_exit, rounds.hooks, rounds).run(rows)
        return [result(r) for r in rows]


class _Group:
    """One algorithm's rows in a batch: its Finisher, its step generator, the rows waiting to join it."""

    def __init__(self, batch: "_Batch", alg, rows: list[Row]):
        self.alg = alg
        self.fin = _GroupFinisher(batch.engine.mask_id, batch.engine.stop_ids, batch.early_exit,
                                  batch.hooks, batch.feed, self)
        self.inbox: list[Row] = []
        self.running = list(rows)
        self.steps = alg.run(batch.engine, rows, self.fin)
        self.vtime = min((g.vtime for g in batch.groups.values()), default=0.0)   # device time per row, charged

    def charge(self) -> None:
        """After a step: each running row is charged its share of the step's forward (the tokens it held)."""
        live = [r for r in self.running if not r.done] or self.running
        if live:
            self.vtime += sum(r.plan.prompt_length + r.plan.canvas_length for r in live) / len(live)

    def held(self) -> tuple[int, int]:
        """Rows and canvas tokens it holds (running or waiting to join), for the feed's limits."""
        live = [r for r in self.running + self.inbox if not r.done]
        return len(live), sum(r.held for r in live)

    def add(self, row: Row) -> None:
        self.inbox.append(row)

    def sweep(self) -> None:
        for r in self.running:
            self.fin.cancelled(r)
        if self.inbox:
            self.inbox = [r for r in self.inbox if not self.fin.cancelled(r)]

    def fail(self, fail, message: str) -> None:
        for r in self.running + self.inbox:
            if not r.done:
                r.done, r.finish_reason = True, "error"
                fail(r.index, message)


SCORING = "likelihood"      # the group name of scoring requests (apart for long ones, as algorithm groups)


class _ScoreGroup:
    """Likelihood-scoring requests that started together (worker/engine/likelihood.py ``score_steps``, their
    forwards shared): one forward is a step, taking its turn among the algorithm groups by the same charge (each
    request is charged its share of the forward's tokens), so generation rows are not held for a scoring request's
    whole run and it is not held for theirs. Each request is answered through the feed when its group ends (None:
    cancelled). Requests of its kind that come meanwhile stay in the worker's queue (``_Batch.admit``'s ``busy``)
    and start the next group together, their forwards shared; ``inbox`` holds any given to it anyway. Its
    random draws are turns too, charged their tokens."""

    def __init__(self, batch: "_Batch", items: list[tuple[int, ScoreRequest]]):
        hooks = batch.hooks
        self.is_cancelled = hooks.is_cancelled if hooks is not None and hooks.is_cancelled else (lambda i: False)
        self.feed = batch.feed
        self.items = items
        self.inbox: list[tuple[int, ScoreRequest]] = []
        self.answered = False
        self.tokens = 0             # the last forward's tokens
        self.steps = self._steps(batch.engine)
        self.vtime = min((g.vtime for g in batch.groups.values()), default=0.0)

    def _steps(self, engine: "Engine"):
        forwards = score_steps(engine.model, engine.mask_id, [r for _, r in self.items],
                               cancelled=lambda k: self.is_cancelled(self.items[k][0]))
        while True:
            with returned_memory():
                try:
                    self.tokens = next(forwards)
                except StopIteration as end:
                    results = end.value
                    break
            yield
        self.answered = True
        for (index, _), res in zip(self.items, results):
            self.feed.done(index, res)

    def charge(self) -> None:
        live = sum(1 for index, _ in self.items if not self.is_cancelled(index)) or 1
        self.vtime += self.tokens / live

    def held(self) -> tuple[int, int]:
        waiting = self.inbox + ([] if self.answered else self.items)
        return len(waiting), sum(len(r.ids) for _, r in waiting)

    def add(self, item: tuple[int, ScoreRequest]) -> None:
        self.inbox.append(item)

    def sweep(self) -> None:
        """Requests whose client has gone leave the inbox at once (the running ones stop between forwards)."""
        if self.inbox:
            flags = [self.is_cancelled(index) for index, _ in self.inbox]
            if any(flags):
                gone = [it for it, f in zip(self.inbox, flags) if f]
                self.inbox = [it for it, f in zip(self.inbox, flags) if not f]
                for index, _ in gone:
                    self.feed.done(index, None)

    def fail(self, fail, message: str) -> None:
        for index, _ in self.inbox + ([] if self.answered else self.items):
            fail(index, message)
        self.answered, self.inbox = True, []


class _Batch:
    """Drives a batch's algorithm groups step by step and admits rows from the feed between steps.

    Fair share: a group is an algorithm's rows, split into short and long ones when ``engine.long_row_cost`` is set
    (a row is long above that many nominal token-forwards, worker.engine.params.row_cost). The next step goes to
    the group whose rows have been charged the least device time (each step charges every row of the group the
    tokens it holds, ``_Group.charge``), so a short row is never paced by a long row's forwards: groups of equal
    cost take their steps in turn, as rounds; a cheap group takes several steps per step of an expensive one."""

    def __init__(self, engine: "Engine", early_exit: bool, hooks, feed):
        self.engine, self.early_exit, self.hooks, self.feed = engine, early_exit, hooks, feed
        self.groups: dict[str, _Group] = {}

    def start(self, name: str, rows: list) -> None:
        if name.startswith(SCORING):
            self.groups[name] = _ScoreGroup(self, rows)
        else:
            self.groups[name] = _Group(self, algorithms.get(rows[0].params.algorithm, self.engine.family), rows)

    def join(self, name: str, item) -> None:
        g = self.groups.get(name)
        if g is None:
            self.start(name, [item])
        else:
            g.add(item)


    def key(self, r: Row) -> str:
        """The group a row steps in: its algorithm's forward (Algorithm.group: algorithms that share a forward step
        share a group), apart for long rows."""
        long = self.engine.long_row_cost and row_cost(r.plan) > self.engine.long_row_cost
        return algorithms.get(r.params.algorithm, self.engine.family).group + ("/long" if long else "")

    def run(self, rows: list[Row], scoring: list[tuple[int, ScoreRequest]] = ()) -> None:
        by_key: dict[str, list] = {}
        for r in rows:
            by_key.setdefault(self.key(r), []).append(r)
        for item in scoring:
            by_key.setdefault(self.engine.score_group(item[1]), []).append(item)
        for name, group in by_key.items():
            self.start(name, group)
        while self.groups:
            name = min(self.groups, key=lambda n: self.groups[n].vtime)
            g = self.groups[name]
            try:
                next(g.steps)
                # a step is done (every algorithm yields once per step; DiffusionGemma's finisher is told only when
                # a canvas ends): the progress /health reports, which the balancer's stall rule reads
                self.engine.last_step_time = time.monotonic()
                g.charge()
            except StopIteration:      # rows that came for it after its last step start the next group
                rest = self.groups.pop(name).inbox
                if rest:
                    self.start(name, rest)
            except torch.cuda.OutOfMemoryError:
                raise                  # (the caller retries the batch in halves)
            except Exception as e:     # a bug in one algorithm's step: its group's rows fail, the others go on
                fail = getattr(self.feed, "fail", None)
                if fail is None or self.engine.ranks is not None:     # (ranks must fail together)
                    raise
                log.exception("algorithm group %s failed; its rows are answered with an error", name)
                what = "scoring" if name.startswith(SCORING) else "generation"
                g.fail(fail, f"internal error during {what}: {type(e).__name__}: {e}")
                self.groups.pop(name)
            if self.feed is not None:
                self.sweep()
                self.admit()

    def sweep(self) -> None:
        """End the rows whose client has gone, in every group, after each step of any group: a group steps only when
        its turn comes (fair share: a long row's group may wait many steps of the short ones), and its cancelled rows
        held their places, their tokens and their answers until then. Its algorithm drops them from its canvas at
        its next step (``between_steps``); rows still waiting to join leave their group's inbox now."""
        for g in self.groups.values():
            g.sweep()

    def admit(self) -> None:
        rows = tokens = 0
        for g in self.groups.values():
            n, t = g.held()
            rows, tokens = rows + n, tokens + t
        # scoring requests of a kind whose group runs stay in the queue (the feed passes them over) until it ends:
        # waiting in its inbox they held places the generation rows behind them could not take (a review)
        busy = {name for name in self.groups if name.startswith(SCORING)}
        for index, req in self.feed.admit(rows, tokens, **({"busy": busy} if busy else {})):
            if isinstance(req, ScoreRequest):
                self.join(self.engine.score_group(req), (index, req))
                continue
            row = self.engine.row(index, req, req.plan or self.engine.plan(req.prompt_ids, req.params))
            self.join(self.key(row), row)


def result(r: Row) -> Result:
    lp = None
    if r.logprobs is not None:
        lp = r.logprobs.prefix(None if r.finish_reason == "cancelled" else len(r.tokens), r.tokens)
    return Result(r.tokens, r.finish_reason or "length", r.nfe, r.canvas, r.plan.prompt_length, r.cached_tokens, lp)


class Feed(Protocol):
    """Where a running batch takes new rows from and hands finished ones to (the worker's queue). A feed may also
    have ``fail(index, message)``: then a row whose algorithm group raised is answered through it (500) while the
    batch's other groups go on; without it, the exception ends the batch. A feed that gives scoring requests
    (ScoreRequest, scored beside generation) takes ``busy``: the scoring groups running (``Engine.score_group``),
    whose kind of request it leaves queued; each is answered with its ScoreResult, or None if cancelled."""

    def admit(self, rows: int, tokens: int) -> list[tuple[int, Request]]: ...

    def done(self, index: int, result: Result) -> None: ...


class _GroupFinisher(Finisher):
    """Finisher that, in a batch with a feed, hands each joining row to its group and each finished row to the feed
    at once (the engine's last-progress time is stamped by the batch after each step, ``_Batch.run``)."""

    def __init__(self, mask_id, stop_ids, early_exit, hooks, feed: Feed | None, group: _Group):
        super().__init__(mask_id, stop_ids, early_exit, hooks)
        self.feed = feed
        self.group = group

    def retired(self, row: Row) -> None:
        if self.feed is not None:
            self.feed.done(row.index, result(row))

    def admit(self, running: list[Row]) -> list[Row]:
        g = self.group
        new, g.inbox = [r for r in g.inbox if not self.cancelled(r)], []     # (gone since the feed gave them)
        g.running = list(running) + new
        return new
