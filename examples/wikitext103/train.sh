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
#
# Flags (default):
#   --gpus N              GPUs to train on, one process each (1); fairseq-train gets
#                         --distributed-world-size N
#   --update-freq K       gradient accumulation steps (8 / --gpus; --gpus must divide 8 unless
#                         K is given)
#   -h, --help            this help
# Everything after -- goes to fairseq-train last, so it overrides the recipe's values
# (e.g. -- --max-update 1000).
#
# GPUs and batch size: tokens per update = GPUs x --max-tokens x --update-freq. The recipe
# assumes one GPU: 1 x 4096 x 8 = 32,768 tokens per update (4 samples of 1,024 tokens x 8), the
# AGG paper's LM setting. --gpus N keeps that product (update frequency 8 / N); --update-freq K
# sets another one. The script prints the product before it starts. AGG's rare-token threshold
# does not depend on the batch size (--agg-threshold-mode auto, docs/agg.md): changing the GPU
# count does not change which tokens are rare.
#
# Hyper-parameters are the AGG paper's LM runs: transformer_lm_gpt2_small (24 layers, d 1024,
# FFN 4096, 16 heads, dropout 0.1) with tied embeddings, Adam (0.9, 0.98), lr 7e-4, inverse_sqrt
# with 4000 warm-up updates from 1e-7, weight decay 0.01, no clipping, 1024-token samples,
# 50k updates, seed 1; --fp16 on a GPU. Checkpoints: checkpoint_best.pt, checkpoint_last.pt and
# one per epoch.
#
# Environment: DATA_BIN (default data/wikitext103/data-bin), SAVE_DIR (default
# checkpoints/wikitext103/METHOD), EMBED_STATS_INTERVAL (log TEV / mean cosine every N updates;
# baseline then uses cross_entropy_with_stats), DRY_RUN=1 prints the command.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../common.sh
source "$here/../common.sh"  # root, py, bindir, die, parse_flags and the train.sh helpers

gpus=1; update_freq=""
parse_flags "@ --gpus=gpus --update-freq=update_freq --" "$@"
read_method
[[ ${#positional[@]} -le 1 ]] || die "unexpected argument '${positional[1]}' (see --help; fairseq flags go after --)"
train_settings "$root/data/wikitext103/data-bin" "$root/checkpoints/wikitext103/$method" dict.txt \
  examples/wikitext103/prepare.sh

arch=transformer_lm_gpt2_small
[[ "$method" == *mlra* ]] && arch=transformer_lm_mlra_gpt2_small
method_criterion cross_entropy 0.03
gpu_precision
batch_settings 4096 8

run_train "$bindir/fairseq-train" "$data" --user-dir "$root/fairseq_agg" \
  --task language_modeling --arch "$arch" --share-decoder-input-output-embed \
  "${crit[@]}" \
  --dropout 0.1 --attention-dropout 0.1 \
  --optimizer adam --adam-betas "(0.9, 0.98)" --weight-decay 0.01 --clip-norm 0.0 \
  --lr 7e-4 --lr-scheduler inverse_sqrt --warmup-updates 4000 --warmup-init-lr 1e-07 \
  --tokens-per-sample 1024 --sample-break-mode none "${batch[@]}" \
  "${precision[@]}" --seed 1 --max-update 50000 --ddp-backend no_c10d \
  --save-dir "$save_dir" --log-format simple --log-interval 100 \
  "${extra[@]}"
