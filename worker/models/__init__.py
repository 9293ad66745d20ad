"""Model families. :func:`load_model` detects the family of a checkpoint directory and loads it natively."""
from __future__ import annotations

import os

import torch

from .checkpoint import CheckpointError, read_config, resolve_device, resolve_dtype

FAMILIES = {"llada": "LLaDA (LLaDAModelLM)"}


def detect_family(path: str | os.PathLike) -> str:
    cfg = read_config(path)
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    if "LLaDAModelLM" in archs or model_type == "llada":
        return "llada"
    raise CheckpointError(
        f"{str(path)!r} is not a supported checkpoint (architectures={archs}, model_type={model_type!r}); "
        f"supported families: {', '.join(FAMILIES.values())}"
    )


def load_model(path: str | os.PathLike, device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = None):
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    family = detect_family(path)
    if family == "llada":
        from . import llada
        return llada.load(path, dev, dt)
    raise AssertionError(family)


__all__ = ["CheckpointError", "detect_family", "load_model", "FAMILIES"]
