#!/usr/bin/env bash
# Runs the test suite (creates .venv first when missing or stale). Extra arguments go to pytest:
#   ./scripts/test.sh -k golden -x
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
exec .venv/bin/python -m pytest "$@"
