"""Generation engine: batched masked-diffusion decoding over an algorithm registry (no HTTP)."""
from .algorithms import REGISTRY as ALGORITHMS
from .engine import Engine, Request, Result
from .params import GenerationParams, ParamError, Plan
from .rows import StepHooks

__all__ = ["ALGORITHMS", "Engine", "GenerationParams", "ParamError", "Plan", "Request", "Result", "StepHooks"]
