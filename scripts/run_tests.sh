#!/usr/bin/env bash
# README test command: installs everything into .venv/ (idempotent), then runs the test suite.
# Extra arguments go to pytest, e.g. scripts/run_tests.sh -k agg
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh" --test
cd "$root"
exec "$root/.venv/bin/python" -m pytest -q -p no:cacheprovider "${@:-tests}"
