#!/usr/bin/env bash
# Start dllm-serve: a thin wrapper over `dllm-serve serve` that passes every flag through.
#   ./scripts/start_server.sh --local                          # the built-in demo model, CPU, on :8000
#   ./scripts/start_server.sh --local --gpus 8 --model-path /models/LLaDA-8B-Instruct
#   ./scripts/start_server.sh --gpus 8 --model-path ...        # SLURM: submits slurm/serve_single_node.sbatch
# Creates .venv first when missing or stale. `dllm-serve serve --help` lists every flag.
# Paths in the flags are the caller's (relative ones from the directory it is run in), as with `dllm-serve serve`.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
bash "$ROOT/scripts/setup_venv.sh"
exec "$ROOT/.venv/bin/dllm-serve" serve "$@"
