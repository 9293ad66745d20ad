#!/usr/bin/env bash
# Runs the test suite (creates .venv first when missing or stale). Extra arguments go to pytest:
#   ./scripts/test.sh -k golden -x
# With no arguments (or output options only): the fast tier in $DLLM_TEST_PROCESSES pytest processes (default 2,
# pytest-xdist, tests spread one by one but those of an xdist_group together; one torch thread each, the tiny
# models gain nothing from more), then the slow tier (servers,
# clusters, faults under load) in $DLLM_TEST_SLOW_PROCESSES (default 3: its tests wait on servers, timeouts and
# peers much of the time, so a third process fills two cores), then the slow tests marked `alone` (the SLURM
# clusters; the bfloat16 kernel-set processes, at the lowest priority, during them) in one process. `./scripts/test.sh -m "not slow"` runs the fast tier the same parallel way; any other
# arguments run one pytest process. The project's modules are compiled once first (the tests start many Python
# processes, and PYTHONDONTWRITEBYTECODE, where set, keeps each from caching them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
.venv/bin/python -m compileall -q -j 0 common worker balancer dllm_serve tests bench > /dev/null || true
procs=${DLLM_TEST_PROCESSES:-2}
par() { OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} .venv/bin/python -m pytest -n "$procs" --dist loadgroup "$@"; }
whole=1                         # no arguments, or output options only (.ci/run gives -q): the whole suite, tiered
for a in "$@"; do
    case $a in -q|-qq|-v|-vv|-r*|--tb=*|--durations=*) ;; *) whole=0 ;; esac
done
if [ $whole = 1 ]; then
    rc=0
    par -m "not slow" "$@" || rc=$?
    procs=${DLLM_TEST_SLOW_PROCESSES:-3} par -m "slow and not alone" "$@" || rc=$?
    .venv/bin/python -m pytest -m "slow and alone" "$@" || rc=$?
    exit $rc
fi
if [ $# -ge 2 ] && [ "$1" = "-m" ] && [ "$2" = "not slow" ]; then
    shift 2
    par -m "not slow" "$@"
    exit $?
fi
exec .venv/bin/python -m pytest "$@"
