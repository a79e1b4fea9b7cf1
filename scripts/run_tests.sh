#!/usr/bin/env bash
# README test command: installs everything into .venv/ (idempotent), then runs the test suite.
# Extra arguments go to pytest, e.g. scripts/run_tests.sh -k agg
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh" --test
cd "$root"
# Two workers (pytest-xdist; a module stays on one worker, its fixtures built once), one thread
# each: the suite's processes are mostly single-threaded start-up and tiny models, so two of them
# use both cores (22 min instead of 39 on 2 cores). `-n 0` runs it in one process.
# --no-loadscope-reorder: the modules are handed out in the order tests/conftest.py collects them,
# the longest first (tests/support/tiers.py), not xdist's (the most tests first).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$root/.venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder "${@:-tests}"
