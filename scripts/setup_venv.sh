#!/usr/bin/env bash
# Creates or refreshes .venv: CPU torch 2.13.0 + the project (editable, with test extras). Does nothing when .venv
# was built from the current pyproject.toml. Sourced by scripts/test.sh and scripts/start_server.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
stamp=.venv/.dllm-serve-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "setting up .venv ..." >&2
    python3 -m venv .venv
    .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
    # The pinned CPU wheel: an unpinned torch would pull gigabytes of CUDA packages.
    .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
    echo "$want" > "$stamp"
fi
