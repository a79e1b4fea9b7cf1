#!/usr/bin/env bash
# Train a WMT14 En->De Transformer with or without the plugin's methods.
#
#   bash examples/wmt14_en_de/train.sh METHOD [base|big] [extra fairseq-train flags ...]
#
# METHOD: baseline   label_smoothed_cross_entropy (eps 0.1), stock transformer
#         agg        cross_entropy_agg --label-smoothing 0.1 --agg-alpha 0.08 (the AGG paper)
#         aug        augmented_loss (REAL: shared embeddings) --label-smoothing 0.1
#         agg+aug    AGG gating and the augmented loss in one criterion
#         mlra       label-smoothed CE on the MLRA transformer (low-rank Q/K/V)
#         agg+mlra   AGG on the MLRA transformer
# Hyper-parameters are the AGG paper's MT runs (its README): shared embeddings, Adam
# (0.9, 0.98), lr 1e-3, inverse_sqrt with 4000 warm-up updates from 1e-7, weight decay 0.01,
# dropout 0.3, no clipping, 8192 tokens x update-freq 8, 200k updates, a checkpoint every 2000
# updates (the last 10 kept), seed 1; --fp16 when a GPU is present.
# Extra flags go to fairseq-train last, so they override these (e.g. --max-update 1000).
#
# Environment: DATA_BIN (default data/wmt14_en_de/data-bin), SAVE_DIR (default
# checkpoints/wmt14_en_de/METHOD-SIZE), EMBED_STATS_INTERVAL (log TEV / mean cosine every N
# updates; baseline then uses label_smoothed_cross_entropy_with_stats), DRY_RUN=1 prints the
# command instead of running it.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../common.sh
source "$here/../common.sh"  # root, py, bindir, die and the train.sh helpers

read_method "METHOD [base|big] [fairseq flags...]" "$@"; shift
size=base
if [[ $# -ge 1 && ( "$1" == base || "$1" == big ) ]]; then size="$1"; shift; fi
train_settings "$root/data/wmt14_en_de/data-bin" "$root/checkpoints/wmt14_en_de/$method-$size" dict.en.txt \
  examples/wmt14_en_de/prepare.sh

arch=transformer_wmt_en_de
[[ "$size" == big ]] && arch=transformer_vaswani_wmt_en_de_big
case "$method" in
  *mlra*) if [[ "$size" == big ]]; then arch=transformer_mlra_vaswani_wmt_en_de_big; else arch=transformer_mlra_wmt_en_de; fi ;;
esac
method_criterion label_smoothed_cross_entropy 0.08 --label-smoothing 0.1
gpu_precision

run_train "$bindir/fairseq-train" "$data" --user-dir "$root/fairseq_agg" \
  --task translation --source-lang en --target-lang de \
  --arch "$arch" --share-all-embeddings \
  "${crit[@]}" \
  --optimizer adam --adam-betas "(0.9, 0.98)" --clip-norm 0.0 --weight-decay 0.01 \
  --lr 1e-3 --lr-scheduler inverse_sqrt --warmup-updates 4000 --warmup-init-lr 1e-07 --stop-min-lr 1e-09 \
  --dropout 0.3 --max-tokens 8192 --update-freq 8 "${precision[@]}" --seed 1 \
  --max-update 200000 --save-interval-updates 2000 --keep-interval-updates 10 \
  --save-dir "$save_dir" --log-format simple --log-interval 100 \
  "$@"
