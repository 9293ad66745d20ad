"""What a model family is to the rest of the server: the :class:`DiffusionLM` protocol its model implements and the
:class:`Family` record its file declares (``FAMILY = Family(...)``), which the registry in ``__init__`` collects."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from .layers import KVCache

# LLaDA's masked-diffusion decoders, shared by the bidirectional families whose reference is LLaDA's generate
LLADA_ALGORITHMS = ("basic", "prefix_cache", "dual_cache", "dinfer_blockwise", "dinfer_hierarchy", "dinfer_credit")


class DiffusionLM(Protocol):
    """A masked diffusion model, as the engine uses it (worker/models/llada.py is the reference implementation).

    ``forward(ids, pos, mask, cache, slots, window)`` -> hidden states [B, L, D] after the final norm: ``ids``/``pos``
    [B, L] long (each row its own absolute positions, so rows may be left-padded), ``mask`` bool [B, 1, 1|L, keys]
    (True = may attend) or None. With ``cache`` (a :class:`KVCache` from :meth:`new_cache`; rows ``slots`` of it, or
    all): without ``window`` the rows are whole canvas rows whose keys/values are stored; with
    ``window = (bi, wi, cols)`` the ids are windows whose valid positions' keys/values are written at cache columns
    ``cols`` and which attend to the whole cached row (``(bi, wi, cols, n)``: to its first ``n`` columns). :meth:`logits` maps hidden states to vocabulary logits (called
    on the positions needed only)."""

    cfg: Any

    @property
    def max_sequence_length(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None = None,
                 cache: KVCache | None = None, slots: torch.Tensor | None = None, window=None) -> torch.Tensor: ...

    def logits(self, h: torch.Tensor) -> torch.Tensor: ...

    def new_cache(self, slots: int, width: int) -> KVCache: ...

    def compile_dense(self): ...


@dataclass(frozen=True)
class Family:
    """A model family: how to recognise its checkpoints and load them, and what it decodes with by default.

    Detection (worker/models/__init__.py ``detect_family``): a checkpoint whose config.json ``architectures`` holds one
    of ``architectures``; else, when its ``model_type`` is one of ``model_types`` or it names no architecture, one
    whose tensors include every name in ``tensors``. The mask, stop and pad ids come from the checkpoint's tokenizer
    and config (worker/tokenizer.py), the same for every family."""

    name: str                                  # the id in /health, /v1/models, Algorithm.families
    title: str                                 # for people: "LLaDA (LLaDAModelLM)"
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    tensors: tuple[str, ...]
    load: Callable[[str | Path, torch.device, torch.dtype], DiffusionLM]
    default_algorithm: str                     # worker/engine/algorithms registry name
    algorithms: tuple[str, ...]                # the registry's algorithms that decode it (its default first)
    scoring: bool = False                      # LLaDA's Monte Carlo likelihood estimator applies
    mask_token: bool = True                    # decodes from a mask token (DiffusionGemma's canvases are random tokens)
    algorithm_defaults: Callable[[str | Path], dict[str, dict]] | None = None   # the checkpoint's own defaults of
                                               # algorithm_params, per algorithm (from generation_config.json)
    prefix_cache: bool = False                 # a prompt block's keys/values depend on it and earlier blocks only
                                               # (block-causal, or a causal prompt encoder): shareable across
                                               # requests (worker/engine/prefix_cache.py)
