# Sourced by the example scripts (examples/*/*.sh): sets
#   root      the repository root
#   py        the Python to use: $PYTHON, else .venv/bin/python of the repository, else python3
#   bindir    its bin directory (fairseq-train, fairseq-generate, ... live there)
#   textprep  scripts/textprep.py (text clean-up and tokenisation helpers)
# and defines die MESSAGE (prints "SCRIPT: error: MESSAGE" and exits with status 2).
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-}"
if [[ -z "$py" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then py="$root/.venv/bin/python"; else py="$(command -v python3)"; fi
fi
bindir="$(dirname "$py")"
textprep="$root/scripts/textprep.py"
_example_script="${BASH_SOURCE[1]##*/}"
die() { echo "$_example_script: error: $*" >&2; exit 2; }
