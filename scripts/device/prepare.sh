#!/usr/bin/env bash
# Prepares, here (where the package registry is reachable), everything that the accelerator machine
# lacks for scripts/device/gpu_check.sh: that machine has Python 3.12, a CUDA build of torch,
# Triton, numpy, scipy, scikit-learn, sentencepiece and sacrebleu (and a transformers 5.x), but no
# fairseq and no network.
#
# Writes the git-ignored bundle folder (default .device_bundle/ at the repository root):
#   wheels/            CPython wheels for the target Python on manylinux x86-64 (or pure-Python ones)
#   sdist/             the fairseq-fixed source release, built there against the torch there
#   requirements.txt   what gpu_check.sh installs from wheels/ (exact versions)
#   requirements-optional.txt  the same for the optional baselines (Liger-Kernel, cut-cross-entropy)
#                      and the Hugging Face path (transformers, for part 5: `-- --parts hf`; its
#                      dependencies are in wheels/): a download that fails here, or an install that
#                      fails there, is not fatal
#   SHA256SUMS         checked by gpu_check.sh before it installs anything
#   INFO.txt           target Python, date, sizes
# This package itself is not bundled: gpu_check.sh runs in a copy of the working tree and installs
# the package from there, so the check always measures the code it is run from. That copy also
# carries the check's own code, run there as `python -m scripts.gpu_check` from the root:
# scripts/gpu_check.py, benchmarks/ and the modules they import from tests/support/ (output_layer_problem,
# output_layer_steps, reference_constructions, training_runs); nothing of it is bundled either.
#
# Usage: scripts/device/prepare.sh [--python-version 3.12] [--dest DIR]
#   --python-version  target CPython minor version (3.12 for the accelerator machine; another
#                     version only to rehearse the offline install on a machine with that Python)
#   --dest            bundle folder (default: .device_bundle/ at the repository root)
# Environment: PYTHON = the interpreter whose pip downloads (default: .venv/bin/python); it must have
# torch, Cython and numpy, which fairseq's setup.py imports to describe its source release.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
pyver="3.12"
dest="$root/.device_bundle"
# the device call carries the working tree (about 5 MiB) and this bundle together, 64 MiB at most
max_mib=52

while [[ $# -gt 0 ]]; do
  case "$1" in
    --python-version) pyver="${2:?--python-version needs a value such as 3.12}"; shift 2 ;;
    --dest) dest="${2:?--dest needs a folder}"; shift 2 ;;
    -h|--help) sed -n '2,28p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "prepare.sh: unknown argument $1 (allowed: --python-version X.Y, --dest DIR)" >&2; exit 2 ;;
  esac
done
if [[ ! "$pyver" =~ ^3\.[0-9]+$ ]]; then
  echo "prepare.sh: --python-version must look like 3.12, got $pyver" >&2
  exit 2
fi
py="${PYTHON:-$root/.venv/bin/python}"
if ! "$py" -c "import pip, torch, Cython, numpy" >/dev/null 2>&1; then
  echo "prepare.sh: $py needs pip, torch, Cython and numpy (run scripts/setup_env.sh first, or set PYTHON)" >&2
  exit 2
fi
abi="cp${pyver/./}"

# Wheels for the target interpreter (compiled for its ABI, or pure): fairseq's import-time needs
# (hydra-core and omegaconf at fairseq's pinned versions, PyYAML for omegaconf, bitarray, regex,
# tqdm), and packaging (for Liger-Kernel). fairseq also imports scikit-learn and scipy (its task and
# criterion registries): not bundled (43 MiB, which the 64 MiB transfer cannot hold beside the rest),
# as the machine has both; gpu_check.sh stops with a one-line reason where they do not import.
BINARY=(
  "hydra-core==1.3.2"
  "omegaconf==2.3.0"
  "PyYAML==6.0.4"
  "bitarray==3.12.3"
  "regex==2026.11.19"
  "tqdm==4.70.1"
  "packaging==26.4"
)
# Optional: the baselines gpu_check.sh installs one by one (they need the Triton there; without it
# the check records them as skipped instead of failing the install). Each is downloaded on its own,
# and one that cannot be is left out of the bundle with a warning.
OPTIONAL=("liger-kernel==0.8.5" "cut-cross-entropy==25.1.1")
# Optional, the Hugging Face path (part 5): transformers at the version scripts/setup_env.sh installs
# here, with everything pip's resolver needs there to install it offline: what it imports
# (tokenizers, safetensors, huggingface_hub, kernels and their own needs) and huggingface_hub's
# requirements for hub downloads (hf-xet, click, fsspec, filelock), which that machine never makes
# but pip still asks for. typer (transformers' command line only) is left to the machine, which has
# one (typer 0.29 would bring pydantic and rich). One group: all of it is downloaded, or none of it.
# gpu_check.sh installs it only where the machine has no transformers 5.x that imports.
HF_TOP="transformers==5.25.0"
HF_DEPS=("tokenizers==0.23.3" "safetensors==0.8.0" "huggingface_hub==2.4.0" "kernels==0.19.1" "tomlkit==0.15.3"
  "httpx2==2.17.0" "httpcore2==2.17.0" "truststore==0.10.5" "anyio==4.16.0" "h11==0.16.0" "idna==3.21"
  "typing-extensions==4.16.0" "hf-xet==1.8.0" "click==8.5.1" "fsspec==2026.9.0" "filelock==4.3.2")
# Pure-Python distributions: the runtime omegaconf pins (published as a source release only, so it
# is turned into a wheel here) and Cython, which fairseq's build needs for its two .pyx modules
# (the pure-Python Cython wheel is a third of the size of the compiled one and works on any Python).
PURE_BUILT=("antlr4-python3-runtime==4.9.3")
PURE_WHEEL=("Cython==3.0.12")
# setuptools: torch brings one, but building this package needs >= 77 (its pyproject.toml); the
# bundled one is installed only where the one there is older.
SETUPTOOLS_WHEEL="setuptools==80.9.0"  # no dependencies of its own (84.x has some)
SETUPTOOLS_NEED="setuptools>=77.0.3"
FAIRSEQ="fairseq-fixed==0.12.3.1"

work="$dest.partial"
rm -rf "$work"
mkdir -p "$work/wheels" "$work/sdist"
trap 'rm -rf "$work"' EXIT

pip_dl=("$py" -m pip download --disable-pip-version-check --no-deps --dest "$work/wheels")
target=(--only-binary=:all: --implementation cp --python-version "$pyver" --abi "$abi"
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
echo "[prepare] binary wheels for CPython $pyver (manylinux x86-64)"
"${pip_dl[@]}" "${target[@]}" "${BINARY[@]}"
optional_ok=()
for req in "${OPTIONAL[@]}"; do
  if "${pip_dl[@]}" "${target[@]}" "$req"; then
    optional_ok+=("$req")
  else
    echo "[prepare] warning: could not download $req; the check will record it as skipped" >&2
  fi
done
echo "[prepare] the Hugging Face path: $HF_TOP and its dependencies"
mkdir -p "$work/hf"
if "$py" -m pip download --disable-pip-version-check --no-deps --dest "$work/hf" "${target[@]}" \
    "$HF_TOP" "${HF_DEPS[@]}"; then
  mv "$work"/hf/*.whl "$work/wheels/"
  optional_ok+=("$HF_TOP")
else
  echo "[prepare] warning: could not download the Hugging Face group; part 5 will use the machine's transformers" \
    "or be recorded as skipped" >&2
fi
rm -rf "$work/hf"
echo "[prepare] pure-Python wheels"
"${pip_dl[@]}" --only-binary=:all: --implementation py --python-version "$pyver" --abi none --platform any \
  "${PURE_WHEEL[@]}" "$SETUPTOOLS_WHEEL"
"$py" -m pip wheel --disable-pip-version-check --no-deps --no-build-isolation --wheel-dir "$work/wheels" \
  "${PURE_BUILT[@]}"
echo "[prepare] $FAIRSEQ source release"
"$py" -m pip download --disable-pip-version-check --no-deps --no-binary=:all: --no-build-isolation \
  --dest "$work/sdist" "$FAIRSEQ"

# Every wheel must be installable on the target: pure (py3/none/any), for this CPython ABI, or for
# the stable ABI (abi3: tokenizers, safetensors, hf-xet).
bad=""
for f in "$work"/wheels/*.whl; do
  tags="${f##*/}"; tags="${tags%.whl}"
  case "$tags" in
    *-none-any|*-"$abi"-"$abi"-manylinux*|*-cp3*-abi3-manylinux*) ;;
    *) bad+=" ${f##*/}" ;;
  esac
done
if [[ -n "$bad" ]]; then
  echo "prepare.sh: wheels not for CPython $pyver x86-64:$bad" >&2
  exit 1
fi

printf '%s\n' "${BINARY[@]}" "${PURE_BUILT[@]}" "${PURE_WHEEL[@]}" "$SETUPTOOLS_NEED" > "$work/requirements.txt"
printf '%s\n' "${optional_ok[@]}" > "$work/requirements-optional.txt"
(cd "$work" && find wheels sdist -type f | sort | xargs sha256sum > SHA256SUMS)
bytes=$(du -sb "$work" | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
{
  echo "target: CPython $pyver, manylinux x86-64"
  echo "prepared: $(date -u +%Y-%m-%dT%H:%M:%SZ) with $("$py" -m pip --version | cut -d' ' -f1-2)"
  echo "size: $bytes bytes ($mib MiB)"
  echo "fairseq: $FAIRSEQ (source release, built there with --no-build-isolation)"
} > "$work/INFO.txt"

echo "[prepare] contents:"
(cd "$work" && find wheels sdist -type f -printf '%s\t%p\n' | sort -k2 \
  | awk -F'\t' '{ printf "  %8.2f MiB  %s\n", $1 / 1048576, $2 }')
if awk -v b="$bytes" -v m="$max_mib" 'BEGIN { exit !(b >= m * 1048576) }'; then
  echo "prepare.sh: the bundle is $mib MiB, over the $max_mib MiB limit; nothing written to $dest" >&2
  exit 1
fi
rm -rf "$dest"
mv "$work" "$dest"
trap - EXIT
echo "[prepare] bundle: $dest ($mib MiB, limit $max_mib MiB)"
echo "[prepare] run there: bash scripts/device/gpu_check.sh   (carry ${dest#"$root"/})"
