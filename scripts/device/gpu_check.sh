#!/usr/bin/env bash
# The accelerator check as one command on the accelerator machine: a copy of this working tree,
# Python 3.12 with a CUDA build of torch, Triton, numpy, scipy, scikit-learn, sentencepiece and
# sacrebleu, no fairseq and no network. Installs the bundle that scripts/device/prepare.sh made here
# (offline: only the bundle and what the machine already has), builds fairseq against the torch
# there, installs this package from the working tree, then runs `python -m scripts.gpu_check` from
# the root (the parts are benchmarks/gpu_check/, one module each). All of it, the install included,
# fits in --budget-s.
# The Hugging Face path (part 5) takes a run of its own, `-- --parts hf` (benchmarks/gpu_check/plan.py
# says why): it uses the machine's transformers 5.x where that imports, else the bundle's.
#
# Usage: bash scripts/device/gpu_check.sh [--cpu-smoke] [--install-only] [--budget-s S] [-- ARGS]
#   --cpu-smoke     tiny shapes on the CPU in the current Python environment, nothing installed (CI)
#   --install-only  install and check the imports; measure nothing
#   --budget-s S    wall-clock seconds for the whole command (default 470; 300 with --cpu-smoke)
#   ARGS            passed to the Python module, e.g. -- --parts correctness,output_layer
# Environment: OUT (output folder, default ./gpu_check), PYTHON (interpreter that has torch,
# default python3), BUNDLE (default .device_bundle), GPU_CHECK_ENV (the virtual environment made
# on top of PYTHON's packages, default .gpu_check_env; reused by a second run on the same machine).
# Writes gpu_check.json, gpu_check.md, install.json and gpu_check.log into the output folder.
set -uo pipefail
t0=$(date +%s)
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
smoke=0
install_only=0
budget=""
passthrough=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --cpu-smoke) smoke=1; shift ;;
    --install-only) install_only=1; shift ;;
    --budget-s)
      budget="${2:-}"
      if [[ ! "$budget" =~ ^[0-9]+$ ]] || (( budget < 60 )); then
        echo "gpu_check.sh: --budget-s must be a whole number of seconds >= 60, got '${2:-}'" >&2
        exit 2
      fi
      shift 2 ;;
    --) shift; passthrough=("$@"); break ;;
    -h|--help) sed -n '2,20p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (allowed: --cpu-smoke, --install-only, --budget-s S, -- ARGS)" >&2
       exit 2 ;;
  esac
done
[[ -z "$budget" ]] && budget=$(( smoke ? 300 : 470 ))
out="${OUT:-$PWD/gpu_check}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
exec > >(tee -a "$out/gpu_check.log") 2>&1
base_py="${PYTHON:-python3}"
echo "[gpu_check.sh] $(date -u +%Y-%m-%dT%H:%M:%SZ) root=$root out=$out budget=${budget}s"

write_install_json() {  # status note
  "$base_py" - "$out/install.json" "$1" "$(( $(date +%s) - t0 ))" "$2" <<'EOF'
import json, sys
path, status, seconds, note = sys.argv[1:5]
json.dump({"status": status, "seconds": int(seconds), "note": note}, open(path, "w"), indent=2)
EOF
}

fail_install() {
  echo "[gpu_check.sh] install failed: $1"
  write_install_json error "$1"
  exit 1
}

if (( smoke )); then
  py="$base_py"
  write_install_json skipped "--cpu-smoke: the current environment ($("$py" -c 'import sys; print(sys.executable)'))"
else
  bundle="${BUNDLE:-$root/.device_bundle}"
  envdir="${GPU_CHECK_ENV:-$root/.gpu_check_env}"
  [[ -f "$bundle/SHA256SUMS" ]] || fail_install "no bundle at $bundle: run scripts/device/prepare.sh on the \
development machine and carry .device_bundle"
  (cd "$bundle" && sha256sum --quiet -c SHA256SUMS) || fail_install "the bundle at $bundle fails its SHA256SUMS"
  want=$(sed -n 's/^target: CPython \([0-9.]*\),.*/\1/p' "$bundle/INFO.txt")
  have=$("$base_py" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || fail_install "no $base_py"
  [[ "$want" == "$have" ]] || fail_install "the bundle is for CPython $want, $base_py is $have \
(scripts/device/prepare.sh --python-version $have)"

  # Only the bundle and what the machine has: no index, no pip configuration from elsewhere.
  export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
  unset PIP_FIND_LINKS PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_CONSTRAINT PIP_REQUIREMENT

  # A virtual environment on top of the interpreter's packages (torch, Triton, ...), unless the
  # interpreter already is one; if torch is not visible from a new one (an interpreter inside a
  # virtual environment of its own), install into the interpreter itself.
  if [[ "$("$base_py" -c 'import sys; print(int(sys.prefix != sys.base_prefix))')" == 1 ]]; then
    py="$base_py"
  else
    [[ -x "$envdir/bin/python" ]] || "$base_py" -m venv --system-site-packages "$envdir" || rm -rf "$envdir"
    if [[ -x "$envdir/bin/python" ]] && "$envdir/bin/python" -c "import torch" 2>/dev/null; then
      py="$envdir/bin/python"
    else
      py="$base_py"
      export PIP_BREAK_SYSTEM_PACKAGES=1
    fi
  fi
  echo "[gpu_check.sh] installing into $("$py" -c 'import sys; print(sys.prefix)')"
  "$py" -c "import torch, numpy; print('[gpu_check.sh] torch', torch.__version__, 'CUDA', torch.version.cuda, \
'available', torch.cuda.is_available(), '| numpy', numpy.__version__)" || fail_install "torch or numpy missing"
  "$py" -c "import sklearn.metrics, scipy.stats" \
    || fail_install "scikit-learn or scipy does not import here: fairseq imports both, and the bundle does not carry them"
  for m in triton sentencepiece sacrebleu; do
    "$py" -c "import $m" 2>/dev/null || echo "[gpu_check.sh] warning: $m is not installed here"
  done

  "$py" -m pip install --no-index --find-links "$bundle/wheels" -r "$bundle/requirements.txt" \
    || fail_install "pip could not install the bundle's wheels (a missing piece is named above)"

  if "$py" -c "import importlib.metadata as m, fairseq.data.data_utils_fast; \
assert m.version('fairseq-fixed') == '0.12.3.1'" 2>/dev/null; then
    echo "[gpu_check.sh] fairseq-fixed already built here"
  else
    command -v c++ >/dev/null || command -v g++ >/dev/null \
      || fail_install "no C++ compiler (c++ / g++) here: fairseq's Cython and C++ extensions cannot be built"
    "$py" -c "import os, sysconfig; raise SystemExit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], \
'Python.h')))" || fail_install "no Python.h for $("$py" -V): fairseq's extensions need the Python headers"
    # Built against the torch here. Without ninja, the extensions compile in parallel (with it,
    # torch's build writes one build.ninja per build folder, which parallel builds would share).
    # CUDA_HOME unset: fairseq's optional CUDA extensions are not needed and would take minutes.
    cfg="$(mktemp)"
    if ! "$py" -c "from torch.utils.cpp_extension import is_ninja_available as f; raise SystemExit(0 if f() else 1)"; then
      printf '[build_ext]\nparallel = %s\n' "$(nproc)" > "$cfg"
    fi
    b0=$(date +%s)
    env -u CUDA_HOME DIST_EXTRA_CONFIG="$cfg" MAX_JOBS="$(nproc)" \
      "$py" -m pip install --no-index --no-deps --no-build-isolation "$bundle"/sdist/fairseq_fixed-*.tar.gz \
      || fail_install "building fairseq-fixed failed (see the compiler output above)"
    rm -f "$cfg"
    echo "[gpu_check.sh] fairseq-fixed built in $(( $(date +%s) - b0 )) s"
  fi
  "$py" -m pip install --no-index --no-deps --no-build-isolation "$root" \
    || fail_install "installing fairseq-agg from $root failed"
  "$py" -c "import fairseq, fairseq_cli.train, fairseq_agg, fairseq.data.data_utils_fast" \
    || fail_install "fairseq or fairseq_agg does not import after the install"
  # the optional baselines one by one: one that fails to install or import is recorded as skipped;
  # transformers only where the machine has no 5.x that imports (installing it would upgrade the
  # machine's huggingface_hub, which its accelerate and Liger's transformers module also import)
  hf_usable="import transformers, fairseq_agg.hf; from transformers import LlamaConfig, LlamaForCausalLM; \
assert transformers.__version__.split('.')[0] == '5', transformers.__version__"
  while read -r req; do
    [[ -n "$req" ]] || continue
    if [[ "$req" == transformers==* ]] && "$py" -c "$hf_usable" 2>/dev/null; then
      echo "[gpu_check.sh] transformers $("$py" -c 'import transformers; print(transformers.__version__)') is here:" \
        "part 5 uses it, the bundle's $req is not installed"
      continue
    fi
    "$py" -m pip install --no-index --find-links "$bundle/wheels" "$req" \
      || echo "[gpu_check.sh] warning: $req did not install here"
  done < "$bundle/requirements-optional.txt"
  "$py" -c "import liger_kernel.transformers" \
    || echo "[gpu_check.sh] warning: Liger-Kernel is not usable here; its baseline will be recorded as skipped"
  "$py" -c "import cut_cross_entropy" \
    || echo "[gpu_check.sh] warning: cut-cross-entropy is not usable here; its baseline will be recorded as skipped"
  "$py" -c "$hf_usable" \
    || echo "[gpu_check.sh] warning: no usable transformers 5.x here; part 5 (-- --parts hf) will be recorded as skipped"
  write_install_json ok "into $("$py" -c 'import sys; print(sys.prefix)'), $("$py" -m pip --version | cut -d' ' -f1-2)"
  echo "[gpu_check.sh] install done in $(( $(date +%s) - t0 )) s"
fi

(( install_only )) && exit 0
args=(--out "$out" --deadline "$(( t0 + budget ))")
(( smoke )) && args+=(--cpu-smoke)
# as a module from the root: the check imports benchmarks.* and tests.support.* (the copy of the working tree has them)
(cd "$root" && "$py" -m scripts.gpu_check "${args[@]}" "${passthrough[@]}")
status=$?
echo "[gpu_check.sh] done in $(( $(date +%s) - t0 )) s (exit $status); results: $out/gpu_check.md"
exit $status
