#!/usr/bin/env bash
# Evaluate a WMT14 En->De run: checkpoint averaging, beam search, sacreBLEU and tokenized BLEU.
#
#   bash examples/wmt14_en_de/evaluate.sh --checkpoints DIR [--prep DIR] [--num-checkpoints 5]
#        [--kind epoch|update] [--upper-bound N] [--subset test|valid] [--beam 4] [--lenpen 0.6]
#        [--batch-size 100] [--out DIR] [-- extra fairseq-generate flags]
#
# 1. averages the last N epoch checkpoints (checkpointE.pt; --kind update: checkpoint_E_U.pt)
#    with `fairseq-agg average-checkpoints` (N = 1 uses checkpoint_best.pt / checkpoint_last.pt
#    unaveraged when there are no numbered checkpoints),
# 2. fairseq-generate with beam 4 and length penalty 0.6 (the papers' setting),
# 3. decodes the hypotheses with the sentencepiece model,
# 4. prints sacreBLEU (detokenised, against the untouched reference) with its signature, and
# 5. the tokenized, compound-split BLEU the papers report (Moses tokenisation with aggressive
#    hyphen splitting, ##AT## compound splitting, fairseq-score).
# --prep is the --out directory of prepare.sh (default data/wmt14_en_de): data-bin/, spm.model,
# raw/SUBSET.de. Results go to --out (default CHECKPOINTS/eval-SUBSET).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../common.sh
source "$here/../common.sh"  # root, py, bindir, textprep, die, parse_flags, need_int


ckpts=""; prep="$root/data/wmt14_en_de"; num=5; kind=epoch; upper=""; subset=test
beam=4; lenpen=0.6; bsz=100; out=""; extra=()
parse_flags "--checkpoints=ckpts --prep=prep --num-checkpoints=num --kind=kind --upper-bound=upper
  --subset=subset --beam=beam --lenpen=lenpen --batch-size=bsz --out=out --" "$@"

[[ -n "$ckpts" ]] || die "--checkpoints DIR is required"
[[ -d "$ckpts" ]] || die "--checkpoints: no such directory: $ckpts"
need_int --num-checkpoints "$num" 1
[[ "$kind" == epoch || "$kind" == update ]] || die "--kind must be epoch or update, got '$kind'"
[[ "$subset" == test || "$subset" == valid ]] || die "--subset must be test or valid, got '$subset'"
[[ -z "$upper" || "$upper" =~ ^[0-9]+$ ]] || die "--upper-bound must be an integer, got '$upper'"
need_int --beam "$beam" 1
data="$prep/data-bin"; spm="$prep/spm.model"; ref="$prep/raw/$subset.de"
for f in "$data/dict.de.txt" "$spm" "$ref"; do
  [[ -f "$f" ]] || die "--prep $prep: missing $f (run prepare.sh with --out $prep)"
done
out="${out:-$ckpts/eval-$subset}"
mkdir -p "$out"

# 1. Average the last checkpoints.
model="$out/averaged.pt"
avg_args=(--inputs "$ckpts" --output "$model")
if [[ "$kind" == epoch ]]; then avg_args+=(--num-epoch-checkpoints "$num"); else avg_args+=(--num-update-checkpoints "$num"); fi
[[ -n "$upper" ]] && avg_args+=(--checkpoint-upper-bound "$upper")
if (( num == 1 )) && ! ls "$ckpts" | grep -qE '^checkpoint_?[0-9]'; then
  model="$ckpts/checkpoint_best.pt"; [[ -f "$model" ]] || model="$ckpts/checkpoint_last.pt"
  [[ -f "$model" ]] || die "--checkpoints $ckpts: no checkpoints found"
  echo "[evaluate] no numbered checkpoints: using $model"
else
  "$bindir/fairseq-agg" average-checkpoints "${avg_args[@]}"
fi

# 2. Beam search on the binarised subset (pieces in, pieces out). The batch-size multiple of 1
# matters: with fairseq's default of 8 this fairseq build drops a final batch of fewer than 8
# sentences, and those test sentences would go unscored.
echo "[evaluate] fairseq-generate --beam $beam --lenpen $lenpen on $subset"
"$bindir/fairseq-generate" "$data" --user-dir "$root/fairseq_agg" --task translation \
  --source-lang en --target-lang de --path "$model" --gen-subset "$subset" \
  --beam "$beam" --lenpen "$lenpen" --batch-size "$bsz" --required-batch-size-multiple 1 \
  "${extra[@]}" > "$out/generate.out"
grep -E '^(Generate|BLEU)' "$out/generate.out" | tail -n 2 || true

# 3. Sentencepiece decoding, in the original sentence order.
"$py" "$textprep" hyp-from-generate --input "$out/generate.out" --prefix H --output "$out/hyp.pieces"
"$py" "$textprep" spm-decode --model "$spm" --input "$out/hyp.pieces" --output "$out/hyp.txt"
nh=$(wc -l < "$out/hyp.txt"); nr=$(wc -l < "$ref")
(( nh == nr )) || die "$nh hypotheses for $nr reference lines ($ref)"

# 4. Detokenised sacreBLEU (the signature line makes the number reproducible).
echo "[evaluate] sacreBLEU (detokenised, $ref):"
"$bindir/sacrebleu" "$ref" -i "$out/hyp.txt" -m bleu chrf -f text -w 2 | tee "$out/sacrebleu.txt"

# 5. Tokenized BLEU with compound splitting, as reported by the AGG and Transformer papers.
"$py" "$textprep" compound-split --lang de --input "$out/hyp.txt" --output "$out/hyp.tok"
"$py" "$textprep" compound-split --lang de --input "$ref" --output "$out/ref.tok"
echo "[evaluate] tokenized compound-split BLEU (fairseq-score):"
"$bindir/fairseq-score" --sys "$out/hyp.tok" --ref "$out/ref.tok" | tail -n 1 | tee "$out/tok_bleu.txt"
echo "[evaluate] outputs in $out"
