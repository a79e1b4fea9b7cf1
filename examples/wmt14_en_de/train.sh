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
# base|big: transformer_wmt_en_de (default) or transformer_vaswani_wmt_en_de_big (the MLRA
#         methods: transformer_mlra_wmt_en_de / transformer_mlra_vaswani_wmt_en_de_big).
#
# Flags (default):
#   --gpus N              GPUs to train on, one process each (1); fairseq-train gets
#                         --distributed-world-size N
#   --update-freq K       gradient accumulation steps (8 / --gpus; --gpus must divide 8 unless
#                         K is given)
#   --keep-last-epochs N  epoch checkpoints kept, 0 = all (10; evaluate.sh averages the last 5)
#   -h, --help            this help
# Everything after -- goes to fairseq-train last, so it overrides the recipe's values
# (e.g. -- --max-update 1000).
#
# GPUs and batch size: tokens per update = GPUs x --max-tokens x --update-freq. The recipe
# assumes one GPU: 1 x 8192 x 8 = 65,536 tokens per update, the AGG paper's MT setting. --gpus N
# keeps that product (update frequency 8 / N); --update-freq K sets another one. The script
# prints the product before it starts. AGG's rare-token threshold does not depend on the batch
# size (--agg-threshold-mode auto, docs/agg.md): changing the GPU count does not change which
# tokens are rare.
#
# Hyper-parameters are the AGG paper's MT runs (its README): shared embeddings, Adam
# (0.9, 0.98), lr 1e-3, inverse_sqrt with 4000 warm-up updates from 1e-7, weight decay 0.01,
# dropout 0.3, no clipping, 200k updates, seed 1; --fp16 when a GPU is present. Checkpoints:
# one per epoch (the last --keep-last-epochs kept) and one every 2000 updates (the last 10
# kept), plus checkpoint_best.pt / checkpoint_last.pt.
#
# Environment: DATA_BIN (default data/wmt14_en_de/data-bin), SAVE_DIR (default
# checkpoints/wmt14_en_de/METHOD-SIZE), EMBED_STATS_INTERVAL (log TEV / mean cosine every N
# updates; baseline then uses label_smoothed_cross_entropy_with_stats), DRY_RUN=1 prints the
# command instead of running it.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../common.sh
source "$here/../common.sh"  # root, py, bindir, die, parse_flags and the train.sh helpers

gpus=1; update_freq=""; keep_epochs=10
parse_flags "@ --gpus=gpus --update-freq=update_freq --keep-last-epochs=keep_epochs --" "$@"
read_method
size="${positional[1]:-base}"
[[ "$size" == base || "$size" == big ]] || die "the model size must be base or big, got '$size'"
[[ ${#positional[@]} -le 2 ]] || die "unexpected argument '${positional[2]}' (see --help; fairseq flags go after --)"
need_int --keep-last-epochs "$keep_epochs" 0
train_settings "$root/data/wmt14_en_de/data-bin" "$root/checkpoints/wmt14_en_de/$method-$size" dict.en.txt \
  examples/wmt14_en_de/prepare.sh

arch=transformer_wmt_en_de
[[ "$size" == big ]] && arch=transformer_vaswani_wmt_en_de_big
case "$method" in
  *mlra*) if [[ "$size" == big ]]; then arch=transformer_mlra_vaswani_wmt_en_de_big; else arch=transformer_mlra_wmt_en_de; fi ;;
esac
method_criterion label_smoothed_cross_entropy 0.08 --label-smoothing 0.1
gpu_precision
batch_settings 8192 8
keep=()
(( keep_epochs > 0 )) && keep=(--keep-last-epochs "$keep_epochs")

run_train "$bindir/fairseq-train" "$data" --user-dir "$root/fairseq_agg" \
  --task translation --source-lang en --target-lang de \
  --arch "$arch" --share-all-embeddings \
  "${crit[@]}" \
  --optimizer adam --adam-betas "(0.9, 0.98)" --clip-norm 0.0 --weight-decay 0.01 \
  --lr 1e-3 --lr-scheduler inverse_sqrt --warmup-updates 4000 --warmup-init-lr 1e-07 --stop-min-lr 1e-09 \
  --dropout 0.3 "${batch[@]}" "${precision[@]}" --seed 1 \
  --max-update 200000 --save-interval-updates 2000 --keep-interval-updates 10 "${keep[@]}" \
  --save-dir "$save_dir" --log-format simple --log-interval 100 \
  "${extra[@]}"
