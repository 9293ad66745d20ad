"""SLURM mode of ``dllm-serve serve`` (no ``--local``): submit the sbatch script with the serve flags and say how
to connect."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# flags whose value is a path: made absolute from the caller's directory (the job runs in the project's root)
OUTPUT_PATHS = ("--log-dir", "--server-info-file", "--files-dir")
INPUT_PATHS = ("--model-path", "--dcp-path", "--base-model")       # a hub id (org/name) is left as it is


def _local(value: str) -> bool:
    """Whether a --model-path-like value names a local path rather than a hub id."""
    return value.startswith(("/", "./", "../", "~")) or value in (".", "..") or os.path.exists(value)


def absolute_paths(flags: list[str]) -> str | None:
    """Make the path flags of ``flags`` absolute, in place; one line naming a local input path that does not exist
    (the job would fail on its node minutes later), else None."""
    for i in range(len(flags) - 1):
        flag, value = flags[i], flags[i + 1]
        if flag in OUTPUT_PATHS:
            flags[i + 1] = os.path.abspath(os.path.expanduser(value))
        elif flag in INPUT_PATHS and _local(value):
            path = os.path.abspath(os.path.expanduser(value))
            if not os.path.exists(path):
                return f"{flag} {value}: no such file or directory"
            flags[i + 1] = path
    return None


def submit(script: str | None, argv: list[str]) -> int:
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        print("dllm-serve: sbatch not found. Run on this machine with --local, or submit from a SLURM login node.",
              file=sys.stderr)
        return 2
    flags = []
    for a in argv:                        # --flag=value as --flag value: the flags read here and in the scripts
        if a == "--local":
            continue
        if a.startswith("--") and "=" in a:
            flags += a.split("=", 1)
        else:
            flags.append(a)
    bad = absolute_paths(flags)
    if bad:
        print(f"dllm-serve serve: {bad}", file=sys.stderr)
        return 2
    nodes = 1
    for i, a in enumerate(flags):         # --nodes is sbatch's, not the job's `serve --local`
        if a == "--nodes" and i + 1 < len(flags):
            nodes = int(flags[i + 1])
            del flags[i:i + 2]
            break
    default = "serve_multi_node.sbatch" if nodes > 1 else "serve_single_node.sbatch"
    script_path = Path(script) if script else ROOT / "slurm" / default
    info = Path(os.environ.get("DLLM_SERVER_INFO_DIR", Path.home() / ".dllm-serve"))
    env = dict(os.environ, DLLM_SERVE_ROOT=str(ROOT), DLLM_SERVE_ARGS=shlex.join(flags),
               DLLM_SERVER_INFO_DIR=str(info))
    opts = [f"--nodes={nodes}"]
    for flag in ("--gpus",):
        if flag in flags and flags.index(flag) + 1 < len(flags):
            opts.append(f"--gres=gpu:{flags[flags.index(flag) + 1]}")
    if "--gpu-ids" in flags and flags.index("--gpu-ids") + 1 < len(flags):
        opts.append(f"--gres=gpu:{len(flags[flags.index('--gpu-ids') + 1].split(','))}")
    info.mkdir(parents=True, exist_ok=True)
    opts.append(f"--output={info / 'dllm-serve-%j.out'}")
    out = subprocess.run([sbatch, "--parsable", "--export=ALL", *opts, str(script_path)], env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        print(f"dllm-serve: sbatch failed: {out.stderr.strip()}", file=sys.stderr)
        return out.returncode
    job = out.stdout.strip().split(";")[0]
    info_file = info / f"server-info-{job}"
    print(f"submitted SLURM job {job} ({script_path.name})")
    print(f"server info: {info_file}   (wait for SERVER_STATUS=\"running\"); job output: "
          f"{info / f'dllm-serve-{job}.out'}")
    print(f"  until grep -q 'SERVER_STATUS=\"running\"' {info_file} 2>/dev/null; do sleep 5; done; cat {info_file}")
    print("connect from your machine: ssh -N -L <port>:<node>:<port> <login-node>  (node and port: SERVER_BASE_URL "
          "in the server info; with no --port the job derives its port from the job id)")
    print(f"stop: scancel {job}")
    return 0
