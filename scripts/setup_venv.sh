#!/usr/bin/env bash
# Creates or refreshes .venv: CPU torch 2.13.0 + the project (editable, with test extras). Does nothing when .venv
# was built from the current pyproject.toml in this checkout. Run by scripts/test.sh and scripts/start_server.sh; concurrent runs
# (both README commands started at once) wait for each other on a lock, so one builds and the others reuse it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
stamp=.venv/.dllm-serve-installed
# the checkout's own path too: a .venv copied or moved with a checkout runs the other checkout's code (its scripts and
# the editable install name that one's paths), so it is refreshed here (a review)
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $(pwd -P)"    # (-P: the same through any symlinked path)
current() { [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; }
current && exit 0
exec 9>.venv.lock
if ! flock -n 9; then
    echo "waiting for another setup of .venv to finish ..." >&2
    flock 9
fi
current && exit 0
echo "setting up .venv ..." >&2
rm -f "$stamp"
python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
# The pinned CPU wheel: an unpinned torch would pull gigabytes of CUDA packages.
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
echo "$want" > "$stamp"
