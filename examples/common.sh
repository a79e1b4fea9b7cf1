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
# pairs, e.g. "--out=out --vocab-size=vocab"; a variable written !name is a switch, a flag without a
# value that sets name to 1 ("--dry-run=!dry_run"); with "--" in TABLE, a "--" ends the flags and
# the arguments after it go to the array extra; with "@" in TABLE, arguments that do not start with
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
    if [[ "$_var" == !* ]]; then
      printf -v "${_var#!}" '%s' 1
      shift
      continue
    fi
    # a value that is itself a flag means the value was left out
    [[ $# -ge 2 && "$2" != --* ]] || die "$1 needs a value"
    printf -v "$_var" '%s' "$2"
    shift 2
  done
}

# need_int FLAG VALUE MIN: dies unless VALUE is an integer >= MIN.
need_int() {
  [[ "$2" =~ ^[0-9]{1,15}$ ]] && (( 10#$2 >= $3 )) || die "$1 must be an integer >= $3, got '$2'"
}

# ---------------------------------------------------------------- the prepare.sh recipes

# fetch URL DEST [LOCAL_FLAG]: downloads URL to DEST unless DEST is already there (textprep.py
# download: a fairseq-agg User-Agent, retries, a .zip is verified; a clear error naming LOCAL_FLAG,
# the flag for a local copy (--raw-dir), and no DEST on failure).
fetch() {
  [[ -s "$2" ]] && return 0
  echo "[prepare] downloading $1"
  "$py" "$textprep" download --url "$1" --output "$2" "--local-flag=${3:---raw-dir}"  # = : the value starts with --
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

train_methods="baseline agg aug agg+aug mlra agg+mlra coupled-adam agg+coupled-adam"

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

# is_dry_run: true with --dry-run (dry_run=1) or DRY_RUN=1 in the environment: the command is
# printed, not run, and may be meant for another machine.
is_dry_run() { [[ "${dry_run:-0}" == 1 || "${DRY_RUN:-0}" == 1 ]]; }

# check_launch: validates the launch flags of the train.sh recipes and sets world (= $nodes x
# $gpus, the data-parallel ranks) and launcher. Reads nodes (--nodes, >= 1), gpus (--gpus, GPUs
# per node, >= 1), launcher (--launcher: fairseq, torchrun or slurm; empty = fairseq on one node,
# torchrun on several, or slurm there when only --distributed-port is given; "both" on several
# with --dry-run and neither launcher's flag: the torchrun command and the SLURM script are
# printed), rdzv_endpoint (--rdzv-endpoint HOST:PORT, torchrun only; required to run on several
# nodes, localhost:29500 on one, the placeholder first-node:29500 when both are printed) and
# distributed_port (--distributed-port, slurm only; empty = 29500). A flag of another launcher is
# an error naming both. Also checks precision_choice (--precision: auto, fp16 or fp32), which
# gpu_precision reads, before batch_settings prints anything.
check_launch() {
  case "$precision_choice" in
    auto|fp16|fp32) ;;
    *) die "--precision must be auto, fp16 or fp32, got '$precision_choice'" ;;
  esac
  need_int --nodes "$nodes" 1
  need_int --gpus "$gpus" 1
  world=$(( nodes * gpus ))
  case "$launcher" in
    ""|fairseq|torchrun|slurm) ;;
    *) die "--launcher must be fairseq, torchrun or slurm, got '$launcher'" ;;
  esac
  if [[ -z "$launcher" ]]; then
    if (( nodes == 1 )); then launcher=fairseq
    elif [[ -n "$distributed_port" && -z "$rdzv_endpoint" ]]; then launcher=slurm  # named by its flag
    elif is_dry_run && [[ -z "$rdzv_endpoint" ]]; then launcher=both
    else launcher=torchrun; fi
  fi
  [[ "$launcher" != fairseq ]] || (( nodes == 1 )) || die "--launcher fairseq starts processes on this node only; \
--nodes $nodes needs --launcher torchrun or slurm"
  if [[ "$launcher" == torchrun || "$launcher" == both ]]; then
    if [[ -z "$rdzv_endpoint" ]]; then
      if [[ "$launcher" == both ]]; then rdzv_endpoint=first-node:29500
      else
        (( nodes == 1 )) || die "--launcher torchrun on --nodes $nodes needs --rdzv-endpoint HOST:PORT (a host every \
node reaches, e.g. the first node)"
        rdzv_endpoint=localhost:29500
      fi
    fi
    [[ "$rdzv_endpoint" =~ ^[^:[:space:]]+:([0-9]+)$ ]] && (( 10#${BASH_REMATCH[1]} >= 1 && 10#${BASH_REMATCH[1]} <= 65535 )) \
      || die "--rdzv-endpoint must be HOST:PORT with a port in 1..65535, got '$rdzv_endpoint'"
  elif [[ -n "$rdzv_endpoint" ]]; then
    die "--rdzv-endpoint is for --launcher torchrun (the launcher is $launcher)"
  fi
  if [[ "$launcher" == slurm || "$launcher" == both ]]; then
    distributed_port="${distributed_port:-29500}"
    [[ "$distributed_port" =~ ^[0-9]+$ ]] && (( 10#$distributed_port >= 1 && 10#$distributed_port <= 65535 )) \
      || die "--distributed-port must be an integer in 1..65535, got '$distributed_port'"
  elif [[ -n "$distributed_port" ]]; then
    die "--distributed-port is for --launcher slurm (the launcher is $launcher)"
  fi
  return 0
}

# gpu_precision (after check_launch and batch_settings, whose errors come first): sets gpu_count to
# the number of GPUs torch sees here and the array precision to the fairseq-train flags of
# $precision_choice (--precision): fp16 (--fp16), fp32 (none) or auto, the recipe's --fp16 where
# the run is on GPUs: a GPU here, several ranks, torchrun or slurm, or a dry run (the printed
# command is for a GPU machine, whatever this one has), and fp32 for a run on this machine's CPU;
# a dry run without a GPU here says on stderr that it printed --fp16. A single-node run on more
# GPUs than this node shows is only warned about: the command may be meant for another machine.
gpu_precision() {
  precision=()
  gpu_count="$("$py" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)"
  if [[ "$precision_choice" == fp16 ]]; then precision=(--fp16)
  elif [[ "$precision_choice" == auto ]] \
       && { (( gpu_count > 0 || world > 1 )) || [[ "$launcher" != fairseq ]] || is_dry_run; }; then
    precision=(--fp16)
    if is_dry_run && (( gpu_count == 0 )); then
      echo "[train] --precision auto: the printed command trains in fp16 (--fp16) on the GPU machine it is" \
        "for; --precision fp32 prints it without" >&2
    fi
  fi
  if (( nodes == 1 && gpus > 1 && gpus > gpu_count )); then
    echo "[train] warning: --gpus $gpus, but torch sees $gpu_count GPUs on this node" >&2
  fi
  return 0
}

# batch_settings MAX_TOKENS PAPER_UPDATE_FREQ UNIT (after check_launch): the batch of the train.sh
# recipes. The papers' tokens per update are 1 GPU x MAX_TOKENS x PAPER_UPDATE_FREQ; $world ranks
# keep that product: each rank's share, in micro-batches of at most MAX_TOKENS that are a multiple
# of UNIT tokens, with as few micro-batches (--update-freq) as possible. World sizes that divide
# PAPER_UPDATE_FREQ only lower --update-freq; larger ones also lower --max-tokens (16 GPUs on
# 4096 x 8: 2048 x 1). A world whose share is not a whole number of UNITs is an error unless
# --update-freq K ($update_freq) chooses the batch: then --max-tokens stays MAX_TOKENS. Sets the
# array batch (fairseq-train flags; --distributed-port too under slurm) and prints, on stderr, the
# tokens per update of the run, fairseq flags after -- ($extra) included.
batch_settings() {
  local max_tokens="$1" paper_freq="$2" unit="$3" freq micro units largest
  local paper_tokens=$(( max_tokens * paper_freq ))
  if [[ -n "$update_freq" ]]; then
    need_int --update-freq "$update_freq" 1
    freq="$update_freq"; micro="$max_tokens"
  else
    (( paper_tokens % (world * unit) == 0 )) || die "--nodes $nodes x --gpus $gpus = $world GPUs cannot share the \
paper's $paper_tokens tokens per update in micro-batches of whole $unit-token units; pass --update-freq K \
(tokens per update = $world x $max_tokens x K)"
    units=$(( paper_tokens / (world * unit) ))  # each rank's share of an update, in units
    largest=$(( max_tokens / unit ))
    (( largest <= units )) || largest="$units"
    while (( units % largest != 0 )); do largest=$(( largest - 1 )); done
    micro=$(( largest * unit )); freq=$(( units / largest ))
  fi
  batch=(--max-tokens "$micro" --update-freq "$freq" --distributed-world-size "$world")
  micro="$(flag_value --max-tokens "$micro" "${extra[@]}")"
  freq="$(flag_value --update-freq "$freq" "${extra[@]}")"
  local ranks product
  ranks="$(flag_value --distributed-world-size "$world" "${extra[@]}")"
  product="$ranks x $micro x $freq"
  if [[ "$ranks$micro$freq" =~ ^[0-9]+$ ]]; then product+=" = $(( ranks * micro * freq ))"; fi
  echo "[train] tokens per update = GPUs x --max-tokens x --update-freq = $product (the paper:" \
    "1 x $max_tokens x $paper_freq = $paper_tokens); AGG's rare-token threshold does not depend" \
    "on it (--agg-threshold-mode auto, docs/agg.md)" >&2
}

# train_settings DEFAULT_DATA DEFAULT_SAVE DICT PREPARE: sets data ($DATA_BIN), save_dir
# ($SAVE_DIR) and stats ($EMBED_STATS_INTERVAL, default 0); unless is_dry_run, the data must hold
# DICT, which the recipe's PREPARE script writes.
train_settings() {
  data="${DATA_BIN:-$1}"
  save_dir="${SAVE_DIR:-$2}"
  stats="${EMBED_STATS_INTERVAL:-0}"
  [[ "$stats" =~ ^[0-9]+$ ]] || die "EMBED_STATS_INTERVAL must be an integer >= 0, got '$stats'"
  if ! is_dry_run && [[ ! -f "$data/$3" ]]; then
    die "DATA_BIN=$data has no $3: run $4 first"
  fi
}

# method_criterion STOCK ALPHA [FLAGS...]: sets the array crit to the criterion flags of $method.
# baseline, mlra and coupled-adam train with fairseq's STOCK criterion (its _with_stats twin when
# stats are logged), the AGG methods with cross_entropy_agg --agg-alpha ALPHA, aug with
# augmented_loss, agg+aug with both in one criterion. FLAGS (e.g. --label-smoothing 0.1) go to each
# of them. Where a method's logged `loss` is not the NLL (the augmented loss adds its KL; label
# smoothing in FLAGS smooths every method's), fairseq would rank checkpoint_best.pt on that
# `loss`: crit then adds --best-checkpoint-metric nll_loss, the cross-entropy evaluate.sh scores.
method_criterion() {
  local stock="$1" alpha="$2"
  shift 2
  case "$method" in
    baseline|mlra|coupled-adam)
      if (( stats > 0 )); then crit=(--criterion "${stock}_with_stats" "$@"); else crit=(--criterion "$stock" "$@"); fi ;;
    agg|agg+mlra|agg+coupled-adam) crit=(--criterion cross_entropy_agg "$@" --agg-alpha "$alpha") ;;
    aug) crit=(--criterion augmented_loss "$@") ;;
    agg+aug) crit=(--criterion cross_entropy_agg "$@" --agg-alpha "$alpha" --aug-alpha 0.5) ;;
  esac
  if (( stats > 0 )); then crit+=(--embed-stats-interval "$stats"); fi
  if [[ "$method" == *aug* || " $* " == *" --label-smoothing "* ]]; then crit+=(--best-checkpoint-metric nll_loss); fi
}

# method_optimizer: sets the array optim to the optimizer flags of $method: fairseq's adam, or for
# the Coupled Adam methods coupled_adam (the same update and flags, one second moment shared by the
# embedding rows) with weight decay where its authors apply it: not on the coupled embedding nor
# on the 1-D parameters (--coupled-adam-decay non-embedding-matrices, docs/coupled_adam.md).
method_optimizer() {
  case "$method" in
    *coupled-adam) optim=(--optimizer coupled_adam --coupled-adam-decay non-embedding-matrices) ;;
    *) optim=(--optimizer adam) ;;
  esac
}

# check_free_disk NEED_GB README (before anything prints): unless is_dry_run (the command may be
# for another machine), refuses in one line when the disk of $save_dir (its nearest existing
# directory) has less free space than min_free_gb (--min-free-gb; empty = NEED_GB, README's "What a
# run costs"; 0 = no check).
check_free_disk() {
  local min="${min_free_gb:-$1}" readme="$2" dir="$save_dir" free_kb
  [[ "$min" =~ ^[0-9]{1,9}$ ]] || die "--min-free-gb must be an integer >= 0, got '$min'"
  if is_dry_run || (( 10#$min == 0 )); then return 0; fi
  while [[ ! -d "$dir" ]]; do dir="$(dirname "$dir")"; done
  free_kb="$(df -Pk "$dir" | awk 'NR == 2 { print $4 }')"
  (( free_kb >= 10#$min * 1024 * 1024 )) || die "the disk of SAVE_DIR $save_dir has $(( free_kb / 1024 / 1024 )) GB \
free, less than the $(( 10#$min )) GB this run needs ($readme, \"What a run costs\"): free some, or pass \
--min-free-gb N (0: no check)"
}

# say_cost TEXT README (after every check): what the run costs, from README's "What a run costs", on stderr.
say_cost() { echo "[train] cost: $1 ($2, \"What a run costs\")" >&2; }

# launch_command LAUNCHER: sets launch_cmd to the fairseq-train command cmd started by LAUNCHER:
# as it is (fairseq spawns one process per GPU of this node), under torchrun (the same command on
# every node; fairseq reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT and initialises env://)
# or under srun (one task per GPU; fairseq reads SLURM_STEP_NODELIST, SLURM_PROCID and
# SLURM_LOCALID and meets on the first node at --distributed-port).
launch_command() {
  local torchrun="$bindir/torchrun"
  [[ -x "$torchrun" ]] || torchrun=torchrun
  case "$1" in
    torchrun) launch_cmd=("$torchrun" --nnodes "$nodes" --nproc-per-node "$gpus" --rdzv-backend c10d
                          --rdzv-endpoint "$rdzv_endpoint" "${cmd[@]}") ;;
    slurm)  # under srun fairseq meets on the first node of SLURM's node list at --distributed-port,
            # given after the recipe's world size, before the flags after -- (so that theirs win)
      launch_cmd=(srun --nodes "$nodes" --ntasks-per-node "$gpus" --gres "gpu:$gpus")
      local i placed=0
      for (( i = 0; i < ${#cmd[@]}; i++ )); do
        launch_cmd+=("${cmd[i]}")
        if (( ! placed )) && [[ "${cmd[i]}" == --distributed-world-size ]]; then
          launch_cmd+=("${cmd[i + 1]}" --distributed-port "$distributed_port"); i=$(( i + 1 )); placed=1
        fi
      done ;;
    *) launch_cmd=("${cmd[@]}") ;;
  esac
}

# print_launch LAUNCHER: the command of launch_command on stdout, for slurm as an sbatch script.
print_launch() {
  launch_command "$1"
  if [[ "$1" == slurm ]]; then
    printf '#!/bin/bash\n#SBATCH --nodes=%s\n#SBATCH --ntasks-per-node=%s\n#SBATCH --gres=gpu:%s\n' \
      "$nodes" "$gpus" "$gpus"
    printf 'mkdir -p %q\n' "$save_dir"
  fi
  printf '%q ' "${launch_cmd[@]}"; echo
}

# run_train CMD...: runs the fairseq-train command CMD under $launcher (launch_command). When
# is_dry_run, prints it instead (print_launch; launcher "both": the torchrun command, then the
# sbatch script, each after a comment line) and exits; otherwise creates $save_dir and runs it.
run_train() {
  local cmd=("$@")
  if is_dry_run; then
    if [[ "$launcher" == both ]]; then
      echo "# torchrun: run this command on each of the $nodes nodes, first-node replaced by a host every node" \
           "reaches (or pass --rdzv-endpoint HOST:PORT)"
      print_launch torchrun
      echo "# or SLURM: save the lines below as a script and submit it with sbatch (--launcher slurm prints only it)"
      print_launch slurm
    else
      (( nodes == 1 )) || [[ "$launcher" != torchrun ]] || echo "[train] run this command on each of the $nodes nodes" >&2
      print_launch "$launcher"
    fi
    exit 0
  fi
  launch_command "$launcher"
  mkdir -p "$save_dir"
  exec "${launch_cmd[@]}"
}
