#!/usr/bin/env bash
# Runs the test suite. Creates .venv (CPU torch 2.13.0 + the project, editable, with test extras) when it is
# missing or pyproject.toml changed since it was built. Extra arguments go to pytest: ./scripts/test.sh -k golden -x
set -euo pipefail
cd "$(dirname "$0")/.."
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
exec .venv/bin/python -m pytest "$@"
