#!/usr/bin/env bash
# Runs the test suite. Creates .venv (CPU torch 2.13.0 + the project in editable mode) when missing.
# Extra arguments go to pytest, e.g. ./scripts/test.sh -k golden -x
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import torch, dllm_serve_marker" 2>/dev/null; then
    python3 -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
    # The pinned CPU wheel: an unpinned torch pulls gigabytes of CUDA packages.
    .venv/bin/python -m pip install -q "torch==2.13.0"
    .venv/bin/python -m pip install -q -e ".[test]"
    # marker module so a half-built venv is rebuilt next time
    echo "" > "$(.venv/bin/python -c 'import site; print(site.getsitepackages()[0])')/dllm_serve_marker.py"
fi
exec .venv/bin/python -m pytest "$@"
