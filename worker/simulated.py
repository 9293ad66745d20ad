"""A simulated device for load and scaling tests (a test double, used by bench/ and tests, never by default).

It keeps everything of a worker except the model: the real tokenizer and parameter validation, the batching queue
and the HTTP layer, and returns deterministic tokens (the prompt's tokens cycled to the requested length). Two cost
models:

- per batch (the default): a batch "runs" for ``base + per_row * rows`` seconds (sleeping on the device thread);
- per step (``per_step``): a round of steps costs ``base + per_row * rows`` seconds for each algorithm's rows in it
  (one forward per algorithm group, Algorithm.group, as the engine runs them), each row takes its schedule's steps (its nfe: blocks x
  steps per block) and, with a feed (continuous batching), rows join between rounds and leave when done."""
from __future__ import annotations

import collections
import time
from pathlib import Path

from worker.engine import algorithms
from worker.engine.params import GenerationParams, Plan, canvas_positions, plan
from worker.engine.engine import Request, Result
from worker.models.checkpoint import CheckpointError, model_version, read_config
from worker.tokenizer import load_tokenizer, mask_token_id, stop_token_ids


class SimulatedEngine:
    def __init__(self, model_path: str, base: float, per_row: float, per_step: bool = False):
        cfg = read_config(model_path)
        self.tokenizer = load_tokenizer(model_path)
        self.mask_id = mask_token_id(self.tokenizer, cfg)
        self.stop_ids = stop_token_ids(model_path, self.tokenizer, cfg)
        self.max_sequence_length = int(cfg.get("max_sequence_length", cfg.get("max_position_embeddings", 4096)))
        self.vocab = int(cfg.get("vocab_size", 1000))
        self.family = "simulated"
        self.device = f"simulated({base:g}s + {per_row:g}s/row)"
        self.name = Path(model_path).name
        self.base, self.per_row, self.per_step = base, per_row, per_step
        self.last_step_time = time.monotonic()
        self.path, self.version = Path(model_path).resolve(), model_version(model_path)

    def check_weights(self, path) -> None:
        """Weights of the same kind: a config.json with the same fields but for the tool-written ones."""
        from worker.engine.engine import Engine
        old, new = read_config(self.path), read_config(path)
        if any(old.get(k) != new.get(k) for k in set(old) | set(new) if k not in Engine.RELOAD_IGNORED):
            raise CheckpointError(f"{str(path)!r}: its config.json differs from the served model's")

    def reload_weights(self, path) -> dict:
        """No weights to copy: the answers do not depend on them; the version does."""
        self.check_weights(path)
        self.path, self.version = Path(path).resolve(), model_version(path)
        return self.version

    scoring = "the simulated device (a test double) has no model to score with"
    default_block_length = None          # no checkpoint block size: the server's default applies
    algorithm_defaults: dict = {}        # nor algorithm_params defaults of its own

    def supports(self, algorithm) -> bool:
        return "llada" in algorithm.families      # requests are validated as for a LLaDA model

    def plan(self, prompt_ids: list[int], params: GenerationParams) -> Plan:
        params = algorithms.get(params.algorithm, "llada").take_filters(params)
        return plan(params, len(prompt_ids), self.max_sequence_length)

    def positions(self, algorithm: str | None, prompt_length: int, gen_length: int, block_length: int) -> int:
        return canvas_positions(prompt_length, gen_length, block_length)[0]     # (planned as a LLaDA model)

    def _answer(self, req: Request, p: Plan) -> Result:
        src = [t for t in req.prompt_ids if t not in self.stop_ids and t != self.mask_id] or [0]
        ids = [src[i % len(src)] for i in range(p.gen_length)]
        return Result(ids, "length", p.num_blocks * p.steps_per_block, ids, len(req.prompt_ids))

    def generate(self, requests: list[Request], *, early_exit: bool = True, hooks=None, feed=None) -> list[Result]:
        plans = [self.plan(r.prompt_ids, r.params) for r in requests]
        if self.per_step:
            return self._steps(requests, plans, hooks, feed)
        cost = self.base + self.per_row * len(requests)
        if cost > 0:
            time.sleep(cost)
        self.last_step_time = time.monotonic()
        out = []
        for r, p in zip(requests, plans):
            res = self._answer(r, p)
            if hooks and hooks.on_progress:
                hooks.on_progress(len(out), res.token_ids)
            out.append(res)
        for i, res in enumerate(out if feed is not None else ()):
            feed.done(i, res)
        return out

    def _steps(self, requests, plans, hooks, feed) -> list[Result]:
        """The per-step model: rows (index, request, plan, steps left); one sleep per step for the rows in it."""
        rows = [[i, r, p, p.num_blocks * p.steps_per_block] for i, (r, p) in enumerate(zip(requests, plans))]
        results: dict[int, Result] = {}
        while rows:
            if hooks and hooks.is_cancelled:
                for row in [row for row in rows if hooks.is_cancelled(row[0])]:
                    rows.remove(row)
                    res = Result([], "cancelled", 0, [], len(row[1].prompt_ids))
                    results[row[0]] = res
                    if feed is not None:
                        feed.done(row[0], res)
                if not rows:
                    break
            if feed is not None:
                tokens = sum(p.prompt_length + p.canvas_length for _, _, p, _ in rows)
                for i, r in feed.admit(len(rows), tokens):
                    p = self.plan(r.prompt_ids, r.params)
                    rows.append([i, r, p, p.num_blocks * p.steps_per_block])
            # one forward per algorithm group per round, as the engine runs them
            groups = collections.Counter(algorithms.REGISTRY[row[1].params.algorithm].group for row in rows)
            cost = sum(self.base + self.per_row * n for n in groups.values())
            if cost > 0:
                time.sleep(cost)
            self.last_step_time = time.monotonic()
            for row in list(rows):
                row[3] -= 1
                if row[3] <= 0:
                    rows.remove(row)
                    res = self._answer(row[1], row[2])
                    if row[0] < len(requests):      # (a joined row's result goes to the feed only)
                        results[row[0]] = res
                    if hooks and hooks.on_progress:
                        hooks.on_progress(row[0], res.token_ids)
                    if feed is not None:
                        feed.done(row[0], res)
        return [results[i] for i in range(len(requests))]
