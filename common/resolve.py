"""Resolving ``--model-path`` once, before any worker starts: a local directory, or a Hugging Face hub id resolved
through the local cache (HF_HOME and HF_HUB_OFFLINE honoured; a download only when online and allowed)."""
from __future__ import annotations

import os
from pathlib import Path

DEMO_MODEL = Path(__file__).resolve().parent.parent / "worker" / "demo_model"


class ResolveError(ValueError):
    pass


def _checkpoint_problem(path: Path) -> str | None:
    if not (path / "config.json").is_file():
        return "no config.json"
    has_weights = any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))
    if not has_weights:
        return "no weights (*.safetensors or pytorch_model*.bin)"
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()):
        return "no tokenizer (tokenizer.json / tokenizer_config.json)"
    return None


def served_names(model: str | os.PathLike) -> list[str]:
    """The default model ids for ``--model-path`` as given, the first reported, the others accepted in requests.

    As vLLM serves a model under its path, the id is what a client on the same machine resolves to the tokenizer with
    its defaults, offline (``AutoTokenizer.from_pretrained(id)``: lm-eval, guidellm, aiperf): a local checkpoint
    directory's absolute path, a hub id (resolved from the Hugging Face cache) the hub id. The last path component (the
    directory's name, the hub id's name part: ``demo_model``, ``LLaDA-8B-Instruct``) stays accepted as an alias."""
    spec = str(model)
    path = Path(spec).expanduser()
    if path.exists():
        path = path.resolve()
        names = [str(path), path.name]
    else:                   # a hub id (org/name), or a path a worker is about to fail on: named as given
        names = [spec, spec.rstrip("/").rsplit("/", 1)[-1]]
    return list(dict.fromkeys(n for n in names if n))


def resolve_model(spec: str | None, allow_download: bool = True) -> Path:
    """The checkpoint directory for ``spec`` (None: the built-in demo model)."""
    if spec is None:
        return DEMO_MODEL
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ResolveError(f"--model-path {spec!r} is a file, not a checkpoint directory")
        problem = _checkpoint_problem(path)
        if problem:
            raise ResolveError(f"--model-path {spec!r} is not a checkpoint directory: {problem}")
        return path.resolve()
    if spec.count("/") != 1 or spec.startswith((".", "/", "~")):
        raise ResolveError(f"--model-path {spec!r}: no such directory (and not a hub id like org/name)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ResolveError(f"--model-path {spec!r} is not a local directory and huggingface_hub is not installed")
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") or not allow_download
    try:
        local = snapshot_download(spec, local_files_only=offline,
                                  allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model",
                                                  "tokenizer*", "*.bin"])
    except Exception as e:
        where = os.environ.get("HF_HOME", "~/.cache/huggingface")
        mode = "offline (HF_HUB_OFFLINE)" if offline else "online"
        raise ResolveError(f"--model-path {spec!r}: not in the Hugging Face cache ({where}) and could not be "
                           f"downloaded ({mode}): {type(e).__name__}: {e}")
    path = Path(local)
    problem = _checkpoint_problem(path)
    if problem:
        raise ResolveError(f"hub model {spec!r} resolved to {path}, which is incomplete: {problem}")
    return path
