"""A simulated device for load and scaling tests (a test double, used by bench/ and tests, never by default).

It keeps everything of a worker except the model: the real tokenizer and parameter validation, the batching queue
and the HTTP layer. A batch "runs" for ``base + per_row * rows`` seconds (sleeping on the device thread) and returns
deterministic tokens (the prompt's tokens cycled to the requested length)."""
from __future__ import annotations

import time
from pathlib import Path

from worker.engine import algorithms
from worker.engine.params import GenerationParams, Plan, plan
from worker.engine.engine import Request, Result
from worker.models.checkpoint import read_config
from worker.tokenizer import load_tokenizer, mask_token_id, stop_token_ids


class SimulatedEngine:
    def __init__(self, model_path: str, base: float, per_row: float):
        cfg = read_config(model_path)
        self.tokenizer = load_tokenizer(model_path)
        self.mask_id = mask_token_id(self.tokenizer, cfg)
        self.stop_ids = stop_token_ids(model_path, self.tokenizer, cfg)
        self.max_sequence_length = int(cfg.get("max_sequence_length", cfg.get("max_position_embeddings", 4096)))
        self.vocab = int(cfg.get("vocab_size", 1000))
        self.family = "simulated"
        self.device = f"simulated({base:g}s + {per_row:g}s/row)"
        self.name = Path(model_path).name
        self.base, self.per_row = base, per_row
        self.last_step_time = time.monotonic()

    scoring = "the simulated device (a test double) has no model to score with"
    default_block_length = None          # no checkpoint block size: the server's default applies

    def supports(self, algorithm) -> bool:
        return "llada" in algorithm.families      # requests are validated as for a LLaDA model

    def plan(self, prompt_ids: list[int], params: GenerationParams) -> Plan:
        algorithms.get(params.algorithm, "llada")
        return plan(params, len(prompt_ids), self.max_sequence_length)

    def generate(self, requests: list[Request], *, early_exit: bool = True, hooks=None) -> list[Result]:
        plans = [self.plan(r.prompt_ids, r.params) for r in requests]
        cost = self.base + self.per_row * len(requests)
        if cost > 0:
            time.sleep(cost)
        self.last_step_time = time.monotonic()
        out = []
        for r, p in zip(requests, plans):
            src = [t for t in r.prompt_ids if t not in self.stop_ids and t != self.mask_id] or [0]
            ids = [src[i % len(src)] for i in range(p.gen_length)]
            if hooks and hooks.on_progress:
                hooks.on_progress(len(out), ids)
            out.append(Result(ids, "length", p.num_blocks * p.steps_per_block, ids, len(r.prompt_ids)))
        return out
