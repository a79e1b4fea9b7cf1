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
# arguments after it go to the array extra; with "@" in TABLE, arguments that do not start with
# "-" go to the array positional, in order. -h/--help prints the help and exits 0; anything else
# is an error naming it.
parse_flags() {
  local _table="$1" _pair _var _hint=""
  shift
  extra=(); positional=()
  [[ " $_table " == *" -- "* ]] && _hint="; fairseq flags go after --"
  while [[ $# -gt 0 ]]; do
    case "$1" in -h|--help) usage; exit 0 ;; esac
    if [[ "$1" == -- && -n "$_hint" ]]; then
      shift; extra=("$@"); return 0
    fi
    if [[ "$1" != -* && " $_table " == *" @ "* ]]; then
      positional+=("$1"); shift; continue
    fi
    _var=""
    for _pair in $_table; do
      if [[ "$_pair" == *=* && "${_pair%%=*}" == "$1" ]]; then _var="${_pair#*=}"; fi
    done
    [[ -n "$_var" ]] || die "unknown argument '$1' (see --help$_hint)"
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

# fetch URL DEST: downloads URL to DEST unless DEST is already there (textprep.py download: a
# fairseq-agg User-Agent, retries, a .zip is verified; a clear error and no DEST on failure).
fetch() {
  [[ -s "$2" ]] && return 0
  echo "[prepare] downloading $1"
  "$py" "$textprep" download --url "$1" --output "$2"
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

# read_method: sets method from ${positional[0]}, one of $train_methods.
read_method() {
  [[ ${#positional[@]} -ge 1 ]] || die "METHOD is required, one of: $train_methods (see --help)"
  case " $train_methods " in
    *" ${positional[0]} "*) method="${positional[0]}" ;;
    *) die "METHOD must be one of: $train_methods (got '${positional[0]}')" ;;
  esac
}

# flag_value FLAG DEFAULT ARGS...: the last value ARGS give FLAG ("FLAG V" or "FLAG=V"), else DEFAULT.
flag_value() {
  local flag="$1" value="$2"
  shift 2
  while [[ $# -gt 0 ]]; do
    if [[ "$1" == "$flag" && $# -ge 2 ]]; then value="$2"; shift
    elif [[ "$1" == "$flag="* ]]; then value="${1#*=}"; fi
    shift
  done
  echo "$value"
}

# batch_settings MAX_TOKENS PAPER_UPDATE_FREQ (after gpu_precision): the batch of the train.sh recipes. The papers'
# tokens per update are 1 GPU x MAX_TOKENS x PAPER_UPDATE_FREQ; $gpus (--gpus, >= 1) GPUs keep
# that product with an update frequency of PAPER_UPDATE_FREQ / $gpus unless $update_freq
# (--update-freq) is set. Sets the array batch (fairseq-train flags) and prints, on stderr, the
# tokens per update that the run will have, fairseq flags after -- ($extra) included.
batch_settings() {
  local max_tokens="$1" paper_freq="$2" freq world
  need_int --gpus "$gpus" 1
  # DRY_RUN prints the command for another machine, whose GPUs are not the ones seen here
  if [[ "${DRY_RUN:-0}" != 1 ]] && (( gpus > 1 && gpus > ${gpu_count:-0} )); then
    die "--gpus $gpus: torch sees ${gpu_count:-0} GPUs here"
  fi
  if [[ -n "$update_freq" ]]; then
    need_int --update-freq "$update_freq" 1
    freq="$update_freq"
  else
    (( paper_freq % gpus == 0 )) || die "--gpus $gpus does not divide the recipe's update frequency \
$paper_freq; pass --update-freq K too (tokens per update = $gpus x $max_tokens x K)"
    freq=$(( paper_freq / gpus ))
  fi
  batch=(--max-tokens "$max_tokens" --update-freq "$freq" --distributed-world-size "$gpus")
  max_tokens="$(flag_value --max-tokens "$max_tokens" "${extra[@]}")"
  freq="$(flag_value --update-freq "$freq" "${extra[@]}")"
  world="$(flag_value --distributed-world-size "$gpus" "${extra[@]}")"
  local product="$world x $max_tokens x $freq"
  if [[ "$world$max_tokens$freq" =~ ^[0-9]+$ ]]; then product+=" = $(( world * max_tokens * freq ))"; fi
  echo "[train] tokens per update = GPUs x --max-tokens x --update-freq = $product (the paper:" \
    "1 x $1 x $paper_freq = $(( $1 * paper_freq ))); AGG's rare-token threshold does not depend" \
    "on it (--agg-threshold-mode auto, docs/agg.md)" >&2
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

# gpu_precision: sets gpu_count to the number of GPUs torch sees and the array precision to
# (--fp16) when there is one, else to ().
gpu_precision() {
  precision=()
  gpu_count="$("$py" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)"
  if (( gpu_count > 0 )); then precision=(--fp16); fi
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
