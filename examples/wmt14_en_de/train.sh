#!/usr/bin/env bash
# Train a WMT14 En->De Transformer with or without the plugin's methods.
#
# Usage: bash examples/wmt14_en_de/train.sh METHOD [base|big] [flags] [-- fairseq-train flags]
#
# METHOD: baseline   label_smoothed_cross_entropy (eps 0.1), stock transformer
#         agg        cross_entropy_agg --label-smoothing 0.1 --agg-alpha 0.08 (the AGG paper)
#         aug        augmented_loss (REAL: shared embeddings) --label-smoothing 0.1
#         agg+aug    AGG gating and the augmented loss in one criterion
#         mlra       label-smoothed CE on the MLRA transformer (low-rank Q/K/V)
#         agg+mlra   AGG on the MLRA transformer
#         coupled-adam       baseline's criterion, --optimizer coupled_adam at its authors' weight decay
#                            (--coupled-adam-decay non-embedding-matrices, docs/coupled_adam.md)
#         agg+coupled-adam   agg's criterion with that optimizer
# base|big: transformer_wmt_en_de (default) or transformer_wmt_en_de_big, the AGG paper's archs
#         (the big one is transformer_vaswani_wmt_en_de_big with attention dropout 0.1); the
#         MLRA methods: transformer_mlra_wmt_en_de / transformer_mlra_vaswani_wmt_en_de_big with
#         --attention-dropout 0.1.
#
# Flags (default):
#   --nodes M               machines to train on (1)
#   --gpus N                GPUs per machine, one process each (1); fairseq-train gets
#                           --distributed-world-size M x N
#   --update-freq K         gradient accumulation steps (chosen so that M x N GPUs keep the paper's
#                           65,536 tokens per update; see below)
#   --launcher NAME         fairseq (fairseq-train spawns the processes; one machine only), torchrun
#                           or slurm (fairseq with --nodes 1; with more, torchrun, or slurm when only
#                           --distributed-port is given, or with --dry-run and neither launcher's
#                           flag both the torchrun command and the sbatch script)
#   --rdzv-endpoint H:P     torchrun's rendezvous, a host every machine reaches (localhost:29500 on
#                           one machine; required on several)
#   --distributed-port P    slurm: the port fairseq meets at on the first node (29500)
#   --dry-run               print the command (slurm: an sbatch script) instead of running it (off);
#                           `--nodes M --gpus N --dry-run` prints both launchers' forms (--launcher)
#   --min-free-gb G         refuse to start when the save directory's disk has less free space (14
#                           base, 47 big: the run's checkpoints, README "What a run costs"; 0 = no check)
#   --precision P           fp16, fp32 or auto: fp16 (--fp16, the paper's) when the run is on GPUs
#                           (a GPU here, several GPUs, torchrun or slurm) or printed by --dry-run (a
#                           command for a GPU machine, also from a machine without one), fp32 when it
#                           runs on this machine's CPU (auto)
#   --keep-last-epochs N    epoch checkpoints kept, 0 = all (10; evaluate.sh averages the last 5)
#   -h, --help              this help
# Everything after -- goes to fairseq-train last, so it overrides the recipe's values
# (e.g. -- --max-update 1000).
#
# GPUs and batch size: tokens per update = GPUs x --max-tokens x --update-freq, GPUs = M x N.
# The paper: 1 x 8192 x 8 = 65,536 tokens per update (an upper bound: --max-tokens caps a
# batch). M x N GPUs keep that product: --update-freq 8 / (M x N) when M x N divides 8, and beyond
# 8 GPUs a smaller --max-tokens as well (16 GPUs: 4096 x 1; 64: 1024 x 1); a GPU count whose share
# of 65,536 is not a whole multiple of 1,024 tokens (3, 5, 6, ... or more than 64) is an error
# unless --update-freq K chooses the batch (then --max-tokens stays 8192). The script prints the
# product before it starts. AGG's rare-token threshold does not depend on the batch size
# (--agg-threshold-mode auto, docs/agg.md), and its counts are summed over all GPUs of all
# machines (docs/usage.md): changing the GPU count does not change which tokens are rare.
#
# Launchers. torchrun: run the printed command on every machine (it needs --rdzv-endpoint on
# several); fairseq reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (env://). Each rank's GPU:
# RANK mod the GPUs it sees in fairseq-fixed and fairseq main (LOCAL_RANK unread), LOCAL_RANK (the
# --device-id default since 0.12.0) in stock fairseq 0.12.x; with N = the machine's GPU count both
# give each rank its own GPU, so N should be that count.
# slurm: `train.sh METHOD --nodes M --gpus N --launcher slurm --dry-run > job.sh; sbatch job.sh`
# runs one task per GPU (srun); fairseq reads SLURM_STEP_NODELIST, SLURM_PROCID and SLURM_LOCALID.
# A single machine with fewer GPUs than --gpus is a warning, not an error: the command may be for
# another machine.
#
# Hyper-parameters are the AGG paper's MT runs (its README): shared embeddings, label smoothing
# 0.1, Adam (0.9, 0.98), lr 1e-3, inverse_sqrt with 4000 warm-up updates from 1e-7, weight decay
# 0.01, dropout 0.3, no clipping, 200k updates, seed 1; --fp16 on GPUs (--precision).
# Checkpoints: one per epoch (the last --keep-last-epochs kept) and one every 2000 updates (the
# last 10 kept), plus checkpoint_best.pt / checkpoint_last.pt. checkpoint_best.pt is ranked on the
# validation nll_loss (--best-checkpoint-metric nll_loss), as every METHOD's `loss` is label-smoothed
# (aug's adds a KL) and so not the cross-entropy. What was checked against the paper and fairseq:
# examples/wmt14_en_de/README.md.
#
# Environment: DATA_BIN (default data/wmt14_en_de/data-bin), SAVE_DIR (default
# checkpoints/wmt14_en_de/METHOD-SIZE), EMBED_STATS_INTERVAL (log TEV / mean cosine every N
# updates; baseline then uses label_smoothed_cross_entropy_with_stats), DRY_RUN=1 (as --dry-run).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../common.sh
source "$here/../common.sh"  # root, py, bindir, die, parse_flags and the train.sh helpers

nodes=1; gpus=1; update_freq=""; launcher=""; rdzv_endpoint=""; distributed_port=""; dry_run=0; keep_epochs=10
min_free_gb=""
precision_choice=auto
parse_flags "@ --nodes=nodes --gpus=gpus --update-freq=update_freq --launcher=launcher --rdzv-endpoint=rdzv_endpoint
  --distributed-port=distributed_port --dry-run=!dry_run --precision=precision_choice
  --keep-last-epochs=keep_epochs --min-free-gb=min_free_gb --" "$@"
read_method
size="${positional[1]:-base}"
[[ "$size" == base || "$size" == big ]] || die "the model size must be base or big, got '$size'"
[[ ${#positional[@]} -le 2 ]] || die "unexpected argument '${positional[2]}' (see --help; fairseq flags go after --)"
need_int --keep-last-epochs "$keep_epochs" 0
train_settings "$root/data/wmt14_en_de/data-bin" "$root/checkpoints/wmt14_en_de/$method-$size" dict.en.txt \
  examples/wmt14_en_de/prepare.sh
disk=14; [[ "$size" == big ]] && disk=47  # GB of checkpoints (README, "What a run costs")
check_free_disk "$disk" examples/wmt14_en_de/README.md

arch=(--arch transformer_wmt_en_de)
[[ "$size" == big ]] && arch=(--arch transformer_wmt_en_de_big)
case "$method" in
  *mlra*)  # no MLRA twin of transformer_wmt_en_de_big: its attention dropout is passed instead
    if [[ "$size" == big ]]; then arch=(--arch transformer_mlra_vaswani_wmt_en_de_big --attention-dropout 0.1)
    else arch=(--arch transformer_mlra_wmt_en_de); fi ;;
esac
method_criterion label_smoothed_cross_entropy 0.08 --label-smoothing 0.1
method_optimizer
check_launch
batch_settings 8192 8 1024  # 1,024 tokens still hold 4 of the longest (250-piece) training sentences
gpu_precision
keep=()
(( keep_epochs > 0 )) && keep=(--keep-last-epochs "$keep_epochs")
# derived at 20 % of an H100's or H200's fp16 peak (agg: 0.85x stock's speed, as on the LM)
if [[ "$size" == base ]]; then hours="7.0"; agg_hours="8.2"; else hours="23.7"; agg_hours="27.7"; fi
[[ "$method" == agg* ]] && hours="$agg_hours"
say_cost "about $hours GPU-hours (derived, not measured); about $disk GB of disk for its checkpoints (derived)" \
  examples/wmt14_en_de/README.md

run_train "$bindir/fairseq-train" "$data" --user-dir "$root/fairseq_agg_plugin" \
  --task translation --source-lang en --target-lang de \
  "${arch[@]}" --share-all-embeddings \
  "${crit[@]}" \
  "${optim[@]}" --adam-betas "(0.9, 0.98)" --clip-norm 0.0 --weight-decay 0.01 \
  --lr 1e-3 --lr-scheduler inverse_sqrt --warmup-updates 4000 --warmup-init-lr 1e-07 --stop-min-lr 1e-09 \
  --dropout 0.3 "${batch[@]}" "${precision[@]}" --seed 1 \
  --max-update 200000 --save-interval-updates 2000 --keep-interval-updates 10 "${keep[@]}" \
  --save-dir "$save_dir" --log-format simple --log-interval 100 \
  "${extra[@]}"
