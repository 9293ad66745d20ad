"""Converting a DCP checkpoint once (before workers start, or for a weight update: balancer/weights.py): a file lock
serialises racing launches, the conversion runs in a subprocess (`dllm-serve convert-dcp`: torch stays out of the
supervisor and the balancer) into a temporary directory renamed into place atomically,
and the result is reused while the checkpoint is unchanged (a fingerprint of its files' names, sizes and mtimes)."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

FINGERPRINT = ".dcp-fingerprint.json"
# the converting process's parent: the converter ends when that process dies (SIGTERM to a launch that is
# converting leaves no converter running; `dllm-serve convert-dcp --no-cache` reads it)
PARENT_ENV = "DLLM_SERVE_CONVERT_PARENT"


def fingerprint(dcp_path: Path, base_model: Path) -> dict:
    files = sorted((str(p.relative_to(dcp_path)), p.stat().st_size, p.stat().st_mtime_ns)
                   for p in dcp_path.rglob("*") if p.is_file())
    digest = hashlib.sha256(json.dumps(files).encode()).hexdigest()
    return {"dcp_path": str(dcp_path.resolve()), "base_model": str(base_model), "files": digest}


def dcp_layout(path: Path) -> tuple[Path, Path | None]:
    """(directory holding .metadata, tokenizer directory or None); ValueError when ``path`` is not a DCP checkpoint
    (a file check: the supervisor and the balancer refuse such a path before starting a conversion)."""
    if (path / "weights" / ".metadata").is_file():
        tok = path / "tokenizer"
        return path / "weights", tok if tok.is_dir() else None
    if (path / ".metadata").is_file():
        return path, None
    raise ValueError(f"{str(path)!r} is not a DCP checkpoint: expected weights/.metadata (structured) or .metadata "
                     f"with *.distcp files (legacy)")


def default_output(dcp_path: Path) -> Path:
    cache = Path(os.environ.get("DLLM_CACHE", Path.home() / ".cache" / "dllm-serve")) / "converted"
    tag = hashlib.sha256(str(dcp_path.resolve()).encode()).hexdigest()[:16]
    return cache / f"{dcp_path.resolve().name}-{tag}"


def ensure_converted(dcp_path: str | Path, base_model: str | Path, output: str | Path | None = None,
                     log=print) -> Path:
    from common.resolve import resolve_model
    dcp_path = Path(dcp_path).absolute()           # (the conversion runs in the project's directory)
    if not dcp_path.is_dir():
        raise RuntimeError(f"--dcp-path {str(dcp_path)!r} is not a directory")
    try:
        dcp_layout(dcp_path)
    except ValueError as e:
        raise RuntimeError(f"DCP conversion failed: {e}") from None
    if base_model is None:
        raise RuntimeError("--dcp-path needs --base-model (the checkpoint whose config, tokenizer and tensor names "
                           "the DCP was trained from)")
    base = resolve_model(str(base_model))
    base = base.absolute()
    output = Path(output).absolute() if output else default_output(dcp_path)
    if output.exists() and not (output / FINGERPRINT).is_file() and (not output.is_dir() or any(output.iterdir())):
        # a conversion replaces its output whole: never a directory that is not an earlier conversion
        raise RuntimeError(f"--output {str(output)!r} exists and is not a converted checkpoint (no {FINGERPRINT}); "
                           f"give a new or empty directory")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        lock = open(output.parent / f".{output.name}.lock", "w")
    except OSError as e:
        raise RuntimeError(f"cannot write --output {str(output)!r}: {e}") from None
    want = fingerprint(dcp_path, base)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)           # a racing launch waits here, then finds the result
        # under the lock no other conversion of this output runs: a temporary directory here is one a killed
        # conversion left (a whole checkpoint's size)
        for stale in (*output.parent.glob(f".{output.name}.tmp-*"), *output.parent.glob(f".{output.name}.old-*")):
            shutil.rmtree(stale, ignore_errors=True)
        marker = output / FINGERPRINT
        if marker.is_file() and json.loads(marker.read_text()) == want:
            log(f"dllm-serve: reusing converted checkpoint {output}")
            return output
        tmp = output.parent / f".{output.name}.tmp-{os.getpid()}"
        log(f"dllm-serve: converting DCP {dcp_path} (base {base}) -> {output}")
        r = subprocess.run([sys.executable, "-m", "dllm_serve", "convert-dcp", "--dcp-path", str(dcp_path),
                            "--base-model", str(base), "--output", str(tmp), "--no-cache"],
                           capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
                           env=dict(os.environ, **{PARENT_ENV: str(os.getpid())}))
        if r.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"DCP conversion failed:\n{(r.stdout + r.stderr)[-3000:]}")
        (tmp / FINGERPRINT).write_text(json.dumps(want))
        if output.exists():
            old = output.parent / f".{output.name}.old-{os.getpid()}"
            os.replace(output, old)
            os.replace(tmp, output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, output)
        return output
