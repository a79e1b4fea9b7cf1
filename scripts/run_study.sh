#!/usr/bin/env bash
# The measured study (docs/study.md): installs everything into .venv/ (idempotent), then runs it.
# Arguments go to the study (see: scripts/run_study.sh --help), e.g. --part lm --budget smoke.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
cd "$root"
exec "$root/.venv/bin/python" -m study.run "$@"
