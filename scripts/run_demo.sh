#!/usr/bin/env bash
# README demo command: installs everything into .venv/ (idempotent), then runs the offline demo.
# Arguments go to the demo (see: scripts/run_demo.sh --help), e.g. --quick; a first argument --hf
# runs the Hugging Face demo instead (examples/hf_causal_lm; scripts/run_demo.sh --hf --help).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
demo=examples.lm_demo.run
if [[ "${1:-}" == "--hf" ]]; then
  demo=examples.hf_causal_lm.run
  shift
fi
bash "$root/scripts/setup_env.sh"
cd "$root"
exec "$root/.venv/bin/python" -m "$demo" "$@"
