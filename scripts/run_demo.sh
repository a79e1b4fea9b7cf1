#!/usr/bin/env bash
# README demo command: installs everything into .venv/ (idempotent), then runs the offline demo.
# Arguments go to the demo (see: scripts/run_demo.sh --help), e.g. --quick.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
exec "$root/.venv/bin/python" -m examples.lm_demo.run "$@"
