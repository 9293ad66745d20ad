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


# cores a SLURM job asks for on each node (sbatch --cpus-per-task; --slurm-cpus overrides): per worker (its HTTP
# server, tokenizer and the thread that drives its GPU), plus the balancer's and the supervisor's
CPUS_PER_WORKER = 4
CPUS_EXTRA = 2


def _value(flags: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``flags`` (the last one given), or None."""
    found = None
    for i, a in enumerate(flags[:-1]):
        if a == flag:
            found = flags[i + 1]
    return found


def _take(flags: list[str], flag: str, default):
    """The (int) value of ``flag``, removed from ``flags`` (it is the submission's, not the job's); ``default``
    when absent."""
    value = _value(flags, flag)
    while flag in flags[:-1]:
        i = flags.index(flag)
        del flags[i:i + 2]
    return default if value is None else int(value)


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
    if "--gpu-ids" in flags:
        print("dllm-serve serve: --gpu-ids names GPUs of this machine; a SLURM job gets the GPUs SLURM allocates "
              "(CUDA_VISIBLE_DEVICES on its node): give --gpus N", file=sys.stderr)
        return 2
    nodes = _take(flags, "--nodes", 1)           # sbatch's, not the job's `serve --local`
    cpus = _take(flags, "--slurm-cpus", None)
    gpus = _value(flags, "--gpus")
    if cpus is None:                  # ask SLURM for cores: by default a job gets one, and where cgroups confine
        workers = int(gpus or _value(flags, "--workers") or 1)         # jobs to theirs, every worker shared it
        cpus = CPUS_PER_WORKER * workers + CPUS_EXTRA
    default = "serve_multi_node.sbatch" if nodes > 1 else "serve_single_node.sbatch"
    script_path = Path(script) if script else ROOT / "slurm" / default
    info = Path(os.environ.get("DLLM_SERVER_INFO_DIR", Path.home() / ".dllm-serve"))
    env = dict(os.environ, DLLM_SERVE_ROOT=str(ROOT), DLLM_SERVE_ARGS=shlex.join(flags),
               DLLM_SERVER_INFO_DIR=str(info))
    opts = [f"--nodes={nodes}", f"--cpus-per-task={cpus}"]
    if gpus is not None:
        opts.append(f"--gres=gpu:{gpus}")
    info.mkdir(parents=True, exist_ok=True)
    opts.append(f"--output={info / 'dllm-serve-%j.out'}")
    out = subprocess.run([sbatch, "--parsable", "--export=ALL", *opts, str(script_path)], env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        print(f"dllm-serve: sbatch failed: {out.stderr.strip()}", file=sys.stderr)
        return out.returncode
    job = out.stdout.strip().split(";")[0]
    info_file = _value(flags, "--server-info-file") or info / f"server-info-{job}"
    print(f"submitted SLURM job {job} ({script_path.name})")
    print(f"server info: {info_file}   (wait for SERVER_STATUS=\"running\", or \"failed\" with SERVER_ERROR); job "
          f"output: {info / f'dllm-serve-{job}.out'}")
    print(f"  until grep -qE 'SERVER_STATUS=\"(running|failed)\"' {info_file} 2>/dev/null; do sleep 5; done; "
          f"cat {info_file}")
    print("connect from your machine: ssh -N -L <port>:<node>:<port> <login-node>  (node and port: SERVER_BASE_URL "
          "in the server info; with no --port the job derives its port from the job id)")
    print(f"stop: scancel {job}")
    return 0
