#!/usr/bin/env bash
# Start dllm-serve: a thin wrapper over `dllm-serve serve` that passes every flag through.
#   ./scripts/start_server.sh --local                          # the built-in demo model, CPU, on :8000
#   ./scripts/start_server.sh --local --gpus 8 --model-path /models/LLaDA-8B-Instruct
#   ./scripts/start_server.sh --gpus 8 --model-path ...        # SLURM: submits slurm/serve_single_node.sbatch
# Creates .venv first when missing or stale. `dllm-serve serve --help` lists every flag.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
exec .venv/bin/dllm-serve serve "$@"
