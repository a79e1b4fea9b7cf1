# Sourced by the example scripts (examples/*/*.sh): sets
#   root      the repository root
#   py        the Python to use: $PYTHON, else .venv/bin/python of the repository, else python3
#   bindir    its bin directory (fairseq-train, fairseq-generate, ... live there)
#   textprep  examples/textprep.py (text clean-up and tokenisation helpers; run it with "$py")
# and defines the helpers below, which the recipes share.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-}"
if [[ -z "$py" ]]; then
  if [[ -x "$root/.venv/bin/python" ]]; then py="$root/.venv/bin/python"; else py="$(command -v python3)"; fi
fi
bindir="$(dirname "$py")"
textprep="$root/examples/textprep.py"
_example_path="${BASH_SOURCE[1]}"
_example_script="${_example_path##*/}"

# die MESSAGE: prints "SCRIPT: error: MESSAGE" and exits with status 2.
die() { echo "$_example_script: error: $*" >&2; exit 2; }

# usage: prints the script's help, its leading comment block.
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$_example_path"; }

# parse_flags TABLE "$@": reads "--flag VALUE" pairs into variables. TABLE lists flag=variable
# pairs, e.g. "--out=out --vocab-size=vocab"; with "--" in TABLE, a "--" ends the flags and the
# arguments after it go to the array extra. -h/--help prints the help; anything else is an error.
parse_flags() {
  local _table="$1" _pair _var
  shift
  while [[ $# -gt 0 ]]; do
    case "$1" in -h|--help) usage; exit 0 ;; esac
    if [[ "$1" == -- && " $_table " == *" -- "* ]]; then
      shift; extra=("$@"); return 0
    fi
    _var=""
    for _pair in $_table; do
      if [[ "$_pair" == *=* && "${_pair%%=*}" == "$1" ]]; then _var="${_pair#*=}"; fi
    done
    [[ -n "$_var" ]] || die "unknown argument '$1' (see --help)"
    [[ $# -ge 2 ]] || die "$1 needs a value"
    printf -v "$_var" '%s' "$2"
    shift 2
  done
}

# need_int FLAG VALUE MIN: dies unless VALUE is an integer >= MIN.
need_int() {
  [[ "$2" =~ ^[0-9]+$ ]] && (( $2 >= $3 )) || die "$1 must be an integer >= $3, got '$2'"
}

# ---------------------------------------------------------------- the prepare.sh recipes

# fetch URL DEST: downloads URL to DEST unless DEST is already there (curl, else wget).
fetch() {
  [[ -s "$2" ]] && return 0
  echo "[prepare] downloading $1"
  if command -v curl >/dev/null; then curl -fL --retry 3 -o "$2.part" "$1"; else wget -q -O "$2.part" "$1"; fi
  mv "$2.part" "$2"
}

# find_file DIR NAME EXPECTED: the first file called NAME below DIR; dies saying what was
# EXPECTED when there is none.
find_file() {
  local hit
  hit="$(find "$1" -type f -name "$2" | sort | head -n 1)"
  [[ -n "$hit" ]] || die "--raw-dir $1: file '$2' not found ($3)"
  echo "$hit"
}

# ---------------------------------------------------------------- the train.sh recipes

train_methods="baseline agg aug agg+aug mlra agg+mlra"

# read_method USAGE "$@": sets method from the first argument, one of $train_methods.
read_method() {
  [[ $# -ge 2 ]] || die "usage: $_example_script $1; METHOD is one of: $train_methods"
  case " $train_methods " in
    *" $2 "*) method="$2" ;;
    *) die "METHOD must be one of: $train_methods (got '$2')" ;;
  esac
}

# train_settings DEFAULT_DATA DEFAULT_SAVE DICT PREPARE: sets data ($DATA_BIN), save_dir
# ($SAVE_DIR) and stats ($EMBED_STATS_INTERVAL, default 0); unless DRY_RUN=1, the data must hold
# DICT, which the recipe's PREPARE script writes.
train_settings() {
  data="${DATA_BIN:-$1}"
  save_dir="${SAVE_DIR:-$2}"
  stats="${EMBED_STATS_INTERVAL:-0}"
  [[ "$stats" =~ ^[0-9]+$ ]] || die "EMBED_STATS_INTERVAL must be an integer >= 0, got '$stats'"
  if [[ "${DRY_RUN:-0}" != 1 && ! -f "$data/$3" ]]; then
    die "DATA_BIN=$data has no $3: run $4 first"
  fi
}

# method_criterion STOCK ALPHA [FLAGS...]: sets the array crit to the criterion flags of $method.
# baseline and mlra train with fairseq's STOCK criterion (its _with_stats twin when stats are
# logged), the AGG methods with cross_entropy_agg --agg-alpha ALPHA, aug with augmented_loss,
# agg+aug with both in one criterion. FLAGS (e.g. --label-smoothing 0.1) go to each of them.
method_criterion() {
  local stock="$1" alpha="$2"
  shift 2
  case "$method" in
    baseline|mlra)
      if (( stats > 0 )); then crit=(--criterion "${stock}_with_stats" "$@"); else crit=(--criterion "$stock" "$@"); fi ;;
    agg|agg+mlra) crit=(--criterion cross_entropy_agg "$@" --agg-alpha "$alpha") ;;
    aug) crit=(--criterion augmented_loss "$@") ;;
    agg+aug) crit=(--criterion cross_entropy_agg "$@" --agg-alpha "$alpha" --aug-alpha 0.5) ;;
  esac
  if (( stats > 0 )); then crit+=(--embed-stats-interval "$stats"); fi
}

# gpu_precision: sets the array precision to (--fp16) when torch sees a GPU, else to ().
gpu_precision() {
  precision=()
  if "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    precision=(--fp16)
  fi
}

# run_train CMD...: with DRY_RUN=1 prints the command; otherwise creates $save_dir and runs it.
run_train() {
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "$@"; echo
    exit 0
  fi
  mkdir -p "$save_dir"
  exec "$@"
}
