"""Model families. :func:`load_model` detects the family of a checkpoint directory and loads it natively."""
from __future__ import annotations

import os

import torch

from .checkpoint import CheckpointError, read_config, resolve_device, resolve_dtype

FAMILIES = {"llada": "LLaDA (LLaDAModelLM)", "nemotron": "Nemotron-Diffusion (DiffEncoderModel)"}
DEFAULT_ALGORITHM = {"llada": "basic", "nemotron": "nemotron"}


def detect_family(path: str | os.PathLike) -> str:
    """From ``architectures``, then ``model_type``, then the tensor names (never ``model_type`` alone)."""
    cfg = read_config(path)
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    if "LLaDAModelLM" in archs:
        return "llada"
    if "DiffEncoderModel" in archs:
        return "nemotron"
    if model_type in ("llada", "nvrdiff") or not archs:
        from .checkpoint import tensor_shapes
        try:
            names = set(tensor_shapes(path))
        except CheckpointError:
            names = set()
        if "model.transformer.wte.weight" in names:
            return "llada"
        if "diffusion_head.weight" in names and "encoder.embed_tokens.weight" in names:
            return "nemotron"
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
    from . import nemotron
    return nemotron.load(path, dev, dt)


__all__ = ["CheckpointError", "DEFAULT_ALGORITHM", "detect_family", "load_model", "FAMILIES"]
