#!/usr/bin/env bash
# Train a WikiText-103 language model with or without the plugin's methods.
#
# Usage: bash examples/wikitext103/train.sh METHOD [flags] [-- fairseq-train flags]
#
# METHOD: baseline   cross_entropy on transformer_lm_gpt2_small
#         agg        cross_entropy_agg --agg-alpha 0.03 (the AGG paper's LM run)
#         aug        augmented_loss (REAL: tied embeddings), alpha 0.5, temperature 10
#         agg+aug    AGG gating and the augmented loss in one criterion
#         mlra       cross_entropy on transformer_lm_mlra_gpt2_small (low-rank Q/K/V)
#         agg+mlra   AGG on the MLRA model
#         coupled-adam       baseline's criterion, --optimizer coupled_adam at its authors' weight decay
#                            (--coupled-adam-decay non-embedding-matrices, docs/coupled_adam.md)
#         agg+coupled-adam   agg's criterion with that optimizer
#
# Flags (default):
#   --nodes M               machines to train on (1)
#   --gpus N                GPUs per machine, one process each (1); fairseq-train gets
#                           --distributed-world-size M x N
#   --update-freq K         gradient accumulation steps (chosen so that M x N GPUs keep the paper's
#                           32,768 tokens per update; see below)
#   --launcher NAME         fairseq (fairseq-train spawns the processes; one machine only), torchrun
#                           or slurm (fairseq with --nodes 1; with more, torchrun, or slurm when only
#                           --distributed-port is given, or with --dry-run and neither launcher's
#                           flag both the torchrun command and the sbatch script)
#   --rdzv-endpoint H:P     torchrun's rendezvous, a host every machine reaches (localhost:29500 on
#                           one machine; required on several)
#   --distributed-port P    slurm: the port fairseq meets at on the first node (29500)
#   --dry-run               print the command (slurm: an sbatch script) instead of running it (off);
#                           `--nodes M --gpus N --dry-run` prints both launchers' forms (--launcher)
#   --min-free-gb G         refuse to start when the save directory's disk has less free space (60:
#                           the run's checkpoints, README "What a run costs"; 0 = no check)
#   --precision P           fp16, fp32 or auto: fp16 (--fp16, the paper's) when the run is on GPUs
#                           (a GPU here, several GPUs, torchrun or slurm) or printed by --dry-run (a
#                           command for a GPU machine, also from a machine without one), fp32 when it
#                           runs on this machine's CPU (auto)
#   -h, --help              this help
# Everything after -- goes to fairseq-train last, so it overrides the recipe's values
# (e.g. -- --max-update 1000).
#
# GPUs and batch size: tokens per update = GPUs x --max-tokens x --update-freq, GPUs = M x N.
# The paper: 1 x 4096 x 8 = 32,768 tokens per update (4 samples of 1,024 tokens x 8). M x N GPUs
# keep that product: --update-freq 8 / (M x N) when M x N divides 8, and beyond 8 GPUs a smaller
# --max-tokens as well (16 GPUs: 2048 x 1; 32: 1024 x 1); a GPU count whose share of 32,768 is not
# a whole number of 1,024-token samples (3, 5, 6, ... or more than 32) is an error unless
# --update-freq K chooses the batch (then --max-tokens stays 4096). The script prints the product
# before it starts. AGG's rare-token threshold does not depend on the batch size
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
# Hyper-parameters are the AGG paper's LM runs: transformer_lm_gpt2_small (24 layers, d 1024,
# FFN 4096, 16 heads, dropout 0.1) with tied embeddings, Adam (0.9, 0.98), lr 7e-4, inverse_sqrt
# with 4000 warm-up updates from 1e-7, weight decay 0.01, no clipping, 1024-token samples,
# 50k updates, seed 1; --fp16 on GPUs (--precision). Checkpoints: checkpoint_best.pt,
# checkpoint_last.pt and one per epoch. checkpoint_best.pt is the lowest validation `loss`, which
# for aug and agg+aug includes the augmented loss's KL: those rank on nll_loss instead
# (--best-checkpoint-metric nll_loss), the cross-entropy evaluate.sh scores.
#
# Environment: DATA_BIN (default data/wikitext103/data-bin), SAVE_DIR (default
# checkpoints/wikitext103/METHOD), EMBED_STATS_INTERVAL (log TEV / mean cosine every N updates;
# baseline then uses cross_entropy_with_stats), DRY_RUN=1 (as --dry-run).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../common.sh
source "$here/../common.sh"  # root, py, bindir, die, parse_flags and the train.sh helpers

nodes=1; gpus=1; update_freq=""; launcher=""; rdzv_endpoint=""; distributed_port=""; dry_run=0
precision_choice=auto
min_free_gb=""
parse_flags "@ --nodes=nodes --gpus=gpus --update-freq=update_freq --launcher=launcher --rdzv-endpoint=rdzv_endpoint
  --distributed-port=distributed_port --dry-run=!dry_run --precision=precision_choice --min-free-gb=min_free_gb --" "$@"
read_method
[[ ${#positional[@]} -le 1 ]] || die "unexpected argument '${positional[1]}' (see --help; fairseq flags go after --)"
train_settings "$root/data/wikitext103/data-bin" "$root/checkpoints/wikitext103/$method" dict.txt \
  examples/wikitext103/prepare.sh
check_free_disk 60 examples/wikitext103/README.md

arch=transformer_lm_gpt2_small
[[ "$method" == *mlra* ]] && arch=transformer_lm_mlra_gpt2_small
method_criterion cross_entropy 0.03
method_optimizer
check_launch
batch_settings 4096 8 1024  # a micro-batch holds whole 1,024-token samples
gpu_precision
case "$method" in  # one H200 at the recipe's settings (the README's measurement)
  baseline) hours="about 4.6 GPU-hours (measured, one H200)" ;;
  agg) hours="about 5.4 GPU-hours (measured, one H200)" ;;
  aug) hours="about 5.5 GPU-hours (measured, one H200)" ;;
  mlra) hours="about 4.0 GPU-hours (measured, one H200)" ;;
  *) hours="GPU-hours not measured (baseline 4.6, agg 5.4 on one H200)" ;;
esac
say_cost "$hours; about 60 GB of disk for its checkpoints (derived; -- --keep-last-epochs 2 keeps fewer)" \
  examples/wikitext103/README.md

run_train "$bindir/fairseq-train" "$data" --user-dir "$root/fairseq_agg_plugin" \
  --task language_modeling --arch "$arch" --share-decoder-input-output-embed \
  "${crit[@]}" \
  --dropout 0.1 --attention-dropout 0.1 \
  "${optim[@]}" --adam-betas "(0.9, 0.98)" --weight-decay 0.01 --clip-norm 0.0 \
  --lr 7e-4 --lr-scheduler inverse_sqrt --warmup-updates 4000 --warmup-init-lr 1e-07 \
  --tokens-per-sample 1024 --sample-break-mode none "${batch[@]}" \
  "${precision[@]}" --seed 1 --max-update 50000 --ddp-backend no_c10d \
  --save-dir "$save_dir" --log-format simple --log-interval 100 \
  "${extra[@]}"
