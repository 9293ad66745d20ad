"""Model families: each file here is one family (its model, ``load`` and ``FAMILY``, a :class:`Family` record);
``FAMILY_MODULES`` lists them. :func:`detect_family` recognises a checkpoint directory, :func:`load_model` loads it
natively. A new family is one file plus its name in ``FAMILY_MODULES`` (docs/architecture.md)."""
from __future__ import annotations

import importlib
import os

import torch

from .checkpoint import CheckpointError, read_config, resolve_device, resolve_dtype
from . import parallel
from .family import DiffusionLM, Family

FAMILY_MODULES = ("llada", "llada_moe", "llada2", "nemotron", "dream", "sdar", "diffusion_gemma")
FAMILIES: dict[str, Family] = {f.name: f for f in (importlib.import_module(f"{__name__}.{m}").FAMILY
                                                   for m in FAMILY_MODULES)}
DEFAULT_ALGORITHM = {name: f.default_algorithm for name, f in FAMILIES.items()}


def detect_family(path: str | os.PathLike) -> str:
    """From ``architectures``, then the tensor names when ``model_type`` is a family's or no architecture is named
    (never ``model_type`` alone)."""
    cfg = read_config(path)
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    for f in FAMILIES.values():
        if set(archs) & set(f.architectures):
            return f.name
    if not archs or any(model_type in f.model_types for f in FAMILIES.values()):
        from .checkpoint import tensor_shapes
        try:
            names = set(tensor_shapes(path))
        except CheckpointError:
            names = set()
        for f in FAMILIES.values():
            if set(f.tensors) <= names:
                return f.name
    raise CheckpointError(
        f"{str(path)!r} is not a supported checkpoint (architectures={archs}, model_type={model_type!r}); "
        f"supported families: {', '.join(f.title for f in FAMILIES.values())}"
    )


def load_model(path: str | os.PathLike, device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = None, layout: "parallel.Layout | None" = None) -> DiffusionLM:
    """The checkpoint's model on ``device``; with a tensor-parallel ``layout``, this rank's shard of it
    (worker/models/parallel.py)."""
    dev = resolve_device(device)
    with parallel.building(layout):
        return FAMILIES[detect_family(path)].load(path, dev, resolve_dtype(dtype, dev))


__all__ = ["CheckpointError", "DEFAULT_ALGORITHM", "DiffusionLM", "FAMILIES", "Family", "detect_family",
           "load_model"]
