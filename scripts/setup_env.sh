#!/usr/bin/env bash
# Creates (or reuses) the virtual environment .venv/ at the repository root and installs
# torch, fairseq (fairseq-fixed, built against that torch) and this package with its examples
# extra (what the demos, the recipes and the study import) into it.
# Idempotent: a second run only checks that everything imports.
# Usage: scripts/setup_env.sh [--test]   (--test also installs the test extra)
# Environment: PYTHON (the interpreter of a new venv, default python3), FAIRSEQ_AGG_TORCH_VERSION
# (default 2.13.0), FAIRSEQ_AGG_TORCH_INDEX_URL (pip's --index-url for torch only).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
py="${PYTHON:-python3}"
extra="[examples]"
[[ "${1:-}" == "--test" ]] && extra="[examples,test]"

if [[ ! -x "$venv/bin/python" ]]; then
  echo "[setup] creating virtual environment at $venv"
  "$py" -m venv "$venv"
fi
vpy="$venv/bin/python"
stamp="$venv/.fairseq-agg-installed$extra"
# --test: fairseq's own tests (tests/test_fairseq_own_tests.py) from the fairseq-fixed sdist, extracted
# once into .venv/fairseq-own-tests/tests (pip download builds the sdist's metadata: needs torch)
own_tests="$venv/fairseq-own-tests"
extract_fairseq_own_tests() {
  [[ "$extra" == *test* && ! -f "$own_tests/tests/test_train.py" ]] || return 0
  echo "[setup] extracting fairseq's own tests from the fairseq-fixed 0.12.3.1 sdist"
  rm -rf "$own_tests.partial" && mkdir -p "$own_tests.partial/sdist"
  "$vpy" -m pip download -q --no-deps --no-binary :all: --no-build-isolation \
    -d "$own_tests.partial/sdist" "fairseq-fixed==0.12.3.1"
  tar -xzf "$own_tests.partial"/sdist/*.tar.gz -C "$own_tests.partial" --strip-components=1 \
    --wildcards --no-wildcards-match-slash '*/tests/*'
  rm -rf "$own_tests.partial/sdist" "$own_tests" && mv "$own_tests.partial" "$own_tests"
}

if [[ -f "$stamp" ]] && "$vpy" -c "import torch, fairseq, fairseq_agg" >/dev/null 2>&1 \
   && [[ "$stamp" -nt "$root/pyproject.toml" ]]; then
  extract_fairseq_own_tests
  exit 0
fi

# --no-build-isolation below builds with the venv's own setuptools and wheel: a fresh venv's are
# too old (or missing) for fairseq's setup.py and this package's pyproject.toml.
"$vpy" -m pip install -q --upgrade pip "setuptools>=77" wheel
# torch first: fairseq is built against the installed torch (no build isolation), otherwise pip
# would fetch a second, multi-GB torch into the build environment.
if ! "$vpy" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing torch"
  # FAIRSEQ_AGG_TORCH_INDEX_URL: e.g. PyTorch's index of the CUDA build a GPU cluster needs
  "$vpy" -m pip install -q "torch==${FAIRSEQ_AGG_TORCH_VERSION:-2.13.0}" \
    ${FAIRSEQ_AGG_TORCH_INDEX_URL:+--index-url "$FAIRSEQ_AGG_TORCH_INDEX_URL"}
fi
# numpy < 2 for the fairseq built here: fairseq 0.12's TokenBlockDataset (--sample-break-mode eos)
# and LanguagePairDataset (--num-batch-buckets) use np.compat, gone in numpy 2
"$vpy" -m pip install -q "cython<3.1" "numpy<2"
if ! "$vpy" -c "import fairseq" >/dev/null 2>&1; then
  echo "[setup] building fairseq-fixed 0.12.3.1 from source (takes a few minutes)"
  "$vpy" -m pip install -q --no-build-isolation "fairseq-fixed==0.12.3.1"
fi
echo "[setup] installing fairseq-agg$extra"
"$vpy" -m pip install -q --no-build-isolation -e "$root$extra"
"$vpy" -c "import torch, fairseq, fairseq_agg" 
touch "$stamp"
extract_fairseq_own_tests
