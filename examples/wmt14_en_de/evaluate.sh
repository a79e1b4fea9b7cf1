#!/usr/bin/env bash
# Evaluate a WMT14 En->De run: checkpoint averaging, beam search, detokenized sacreBLEU (the
# headline number) and the tokenized compound-split BLEU that the papers report.
#
# Usage: bash examples/wmt14_en_de/evaluate.sh --checkpoints DIR [flags] [-- fairseq-generate flags]
#
# Flags (default):
#   --checkpoints DIR        the --save-dir of train.sh (required)
#   --prep DIR               the --out of prepare.sh, with data-bin/ (unless DATA_BIN) and
#                            raw/SUBSET.de (data/wmt14_en_de)
#   --num-checkpoints N      checkpoints to average (5)
#   --kind auto|epoch|update which checkpoints (auto). epoch: the last N checkpointE.pt;
#                            update: the last N checkpoint_E_U.pt; both an error when there are
#                            fewer. auto: the last N epoch checkpoints, else the last N update
#                            checkpoints, else all the numbered checkpoints of the kind there are
#                            more of, else checkpoint_best.pt (train.sh: the lowest validation
#                            nll_loss; else checkpoint_last.pt) unaveraged; a
#                            fallback says so in one line. After train.sh's default run this
#                            averages the last 5 of the 10 epoch checkpoints it keeps.
#   --upper-bound N          ignore checkpoints after epoch (update) N (none)
#   --subset test|valid      test = newstest2014, valid = newstest2013 (test)
#   --beam N                 beam size (4, the papers')
#   --lenpen X               length penalty (0.6, the papers')
#   --batch-size N           sentences per batch (100)
#   --out DIR                where the outputs go (CHECKPOINTS/eval-SUBSET)
#   -h, --help               this help
# Everything after -- goes to fairseq-generate (e.g. -- --cpu).
#
# Environment: DATA_BIN (default PREP/data-bin) moves the data, as for train.sh: the data-bin
# translated; --prep still gives the references (raw/SUBSET.de).
#
# Steps:
# 1. averages the chosen checkpoints with `fairseq-agg average-checkpoints`;
# 2. fairseq-generate with --post-process sentencepiece, which turns the hypotheses' pieces back
#    into text (the same text as decoding them with prepare.sh's spm.model);
# 3. prints every BLEU with a label saying which it is:
#      BLEU (detokenized sacreBLEU, headline): BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:... = ...
#      chrF (detokenized sacreBLEU): chrF2|nrefs:1|... = ...
#      BLEU (tokenized, compound-split, community recipe; fairseq-score): BLEU4 = ...
#    sacreBLEU scores the hypotheses against the untouched reference (raw/SUBSET.de); its
#    signature makes the number reproducible. The tokenized BLEU is the community recipe of
#    the Transformer-era papers, the AGG paper's included: hypotheses and reference
#    Moses-tokenised (tokenizer.perl -l de with its defaults, here sacremoses), then perl's
#    s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g on each line (implemented in Python with the same
#    semantics: examples/textprep.py compound-split), then corpus BLEU with fairseq-score, the
#    scorer of fairseq's compound-split script: BLEU-4 on whitespace tokens, case-sensitive,
#    unsmoothed, as multi-bleu.perl computes it (sacrebleu --tokenize none --force would add its
#    default exp smoothing).
# generate.out ends with fairseq-generate's own BLEU, computed on whitespace-split detokenized
# text; it is neither of the two numbers above and is not printed.
# Outputs in --out: generate.out, hyp.txt (detokenized, reference order), sacrebleu.txt,
# hyp.tok / ref.tok (the compound-split text), scores.txt (the labelled lines).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../common.sh
source "$here/../common.sh"  # root, py, bindir, textprep, die, parse_flags, need_int

ckpts=""; prep="$root/data/wmt14_en_de"; num=5; kind=auto; upper=""; subset=test
beam=4; lenpen=0.6; bsz=100; out=""
parse_flags "--checkpoints=ckpts --prep=prep --num-checkpoints=num --kind=kind --upper-bound=upper
  --subset=subset --beam=beam --lenpen=lenpen --batch-size=bsz --out=out --" "$@"

[[ -n "$ckpts" ]] || die "--checkpoints DIR is required (see --help)"
[[ -d "$ckpts" ]] || die "--checkpoints: no such directory: $ckpts"
need_int --num-checkpoints "$num" 1
[[ "$kind" == auto || "$kind" == epoch || "$kind" == update ]] || die "--kind must be auto, epoch or update, got '$kind'"
[[ "$subset" == test || "$subset" == valid ]] || die "--subset must be test or valid, got '$subset'"
[[ -z "$upper" ]] || need_int --upper-bound "$upper" 0
need_int --beam "$beam" 1
need_int --batch-size "$bsz" 1
data="${DATA_BIN:-$prep/data-bin}"; ref="$prep/raw/$subset.de"
[[ -z "${DATA_BIN:-}" || -f "$data/dict.de.txt" ]] || die "DATA_BIN=$data has no dict.de.txt (a data-bin of prepare.sh)"
for f in "$data/dict.de.txt" "$ref"; do
  [[ -f "$f" ]] || die "--prep $prep: missing $f (run prepare.sh with --out $prep)"
done

# numbered KIND: how many KIND checkpoints $ckpts holds (at or below --upper-bound).
numbered() {
  local re='^checkpoint([0-9]+)\.pt$' f n count=0
  [[ "$1" == update ]] && re='^checkpoint_[0-9]+_([0-9]+)\.pt$'
  for f in "$ckpts"/checkpoint*.pt; do
    [[ "${f##*/}" =~ $re ]] || continue
    n=$(( 10#${BASH_REMATCH[1]} ))
    [[ -z "$upper" ]] || (( n <= upper )) || continue
    count=$(( count + 1 ))
  done
  echo "$count"
}

# 1. Choose and average the checkpoints.
use="$num"; model=""
if [[ "$kind" == auto ]]; then
  n_epoch="$(numbered epoch)"; n_update="$(numbered update)"
  if (( n_epoch >= num )); then kind=epoch
  elif (( n_update >= num )); then kind=update
  elif (( n_epoch + n_update > 0 )); then
    if (( n_epoch >= n_update )); then kind=epoch; use="$n_epoch"; else kind=update; use="$n_update"; fi
    echo "[evaluate] only $use $kind checkpoint(s) in $ckpts (fewer than --num-checkpoints $num): averaging those"
  else
    model="$ckpts/checkpoint_best.pt"; [[ -f "$model" ]] || model="$ckpts/checkpoint_last.pt"
    [[ -f "$model" ]] || die "--checkpoints $ckpts: no checkpoints found"
    echo "[evaluate] no numbered checkpoints in $ckpts: using $model unaveraged"
  fi
else
  have="$(numbered "$kind")"
  (( have >= num )) || die "--num-checkpoints $num: only $have $kind checkpoints in $ckpts${upper:+ at or below --upper-bound $upper}"
fi
out="${out:-$ckpts/eval-$subset}"
mkdir -p "$out"
if [[ -z "$model" ]]; then
  model="$out/averaged.pt"
  avg_args=(--inputs "$ckpts" --output "$model" "--num-$kind-checkpoints" "$use")
  [[ -n "$upper" ]] && avg_args+=(--checkpoint-upper-bound "$upper")
  echo "[evaluate] averaging the last $use $kind checkpoints of $ckpts"
  "$bindir/fairseq-agg" average-checkpoints "${avg_args[@]}"
fi

# 2. Beam search on the binarised subset, hypotheses post-processed back to text. The
# batch-size multiple of 1 matters: with fairseq's default of 8 this fairseq build drops a final
# batch of fewer than 8 sentences, and those test sentences would go unscored.
echo "[evaluate] fairseq-generate --beam $beam --lenpen $lenpen on $subset"
"$bindir/fairseq-generate" "$data" --user-dir "$root/fairseq_agg_plugin" --task translation \
  --source-lang en --target-lang de --path "$model" --gen-subset "$subset" \
  --beam "$beam" --lenpen "$lenpen" --batch-size "$bsz" --required-batch-size-multiple 1 \
  --post-process sentencepiece "${extra[@]}" > "$out/generate.out"
"$py" "$textprep" hyp-from-generate --input "$out/generate.out" --prefix D --output "$out/hyp.txt"
nh=$(wc -l < "$out/hyp.txt"); nr=$(wc -l < "$ref")
(( nh == nr )) || die "$nh hypotheses for $nr reference lines ($ref)"

# 3a. Detokenized sacreBLEU, the headline (its signature makes the number reproducible).
: > "$out/scores.txt"
"$bindir/sacrebleu" "$ref" -i "$out/hyp.txt" -m bleu chrf -f text -w 2 > "$out/sacrebleu.txt"
awk '{ sub(/^[ \t]+/, "") }  # sacrebleu right-aligns its metric names
     /^BLEU\|/ { print "BLEU (detokenized sacreBLEU, headline): " $0 }
     /^chrF/   { print "chrF (detokenized sacreBLEU): " $0 }' "$out/sacrebleu.txt" | tee -a "$out/scores.txt"
grep -q "^BLEU (detokenized" "$out/scores.txt" || die "sacrebleu printed no BLEU line (see $out/sacrebleu.txt)"

# 3b. The community recipe's tokenized, compound-split BLEU.
"$py" "$textprep" compound-split --lang de --input "$out/hyp.txt" --output "$out/hyp.tok"
"$py" "$textprep" compound-split --lang de --input "$ref" --output "$out/ref.tok"
tok_bleu="$("$bindir/fairseq-score" --sys "$out/hyp.tok" --ref "$out/ref.tok" | tail -n 1)"
[[ "$tok_bleu" == BLEU4* ]] || die "fairseq-score printed no BLEU4 line ($out/hyp.tok, $out/ref.tok)"
echo "BLEU (tokenized, compound-split, community recipe; fairseq-score): $tok_bleu" | tee -a "$out/scores.txt"
echo "[evaluate] outputs in $out"
