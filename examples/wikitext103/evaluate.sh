#!/usr/bin/env bash
# Evaluate a WikiText-103 language model: perplexity with a context window, perplexity per
# frequency group, and the embedding report (I(W), TEV, mean cosine) with figures.
#
#   bash examples/wikitext103/evaluate.sh --checkpoint PATH [--prep DIR] [--subset test|valid]
#        [--tokens-per-sample 512] [--context-window 400] [--batch-size 2] [--out DIR]
#        [--group-preset NAME] [-- extra fairseq-eval-lm flags]
#
# 1. fairseq-eval-lm with the AGG paper's setting (512-token blocks, each scored token seeing
#    400 tokens of context): the headline perplexity, per token of the prepared vocabulary;
# 2. fairseq-agg-analyze with --data: perplexity per frequency group of the target token
#    (frequent / medium / rare = 30% / 50% / 20% of the types in dictionary order, or
#    --group-preset wikitext103-official for the official fixed id ranges), isotropy I(W),
#    µTEV / σTEV and mean cosine of the embeddings, report.json and PNG figures.
# --prep is the --out directory of prepare.sh (default data/wikitext103). Results go to --out
# (default: next to the checkpoint, eval-SUBSET/).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../common.sh
source "$here/../common.sh"  # root, py, bindir, die, parse_flags, need_int

ckpt=""; prep="$root/data/wikitext103"; subset=test; tps=512; ctx=400; bsz=2; out=""; preset=""; extra=()
parse_flags "--checkpoint=ckpt --prep=prep --subset=subset --tokens-per-sample=tps --context-window=ctx
  --batch-size=bsz --out=out --group-preset=preset --" "$@"
[[ -n "$ckpt" ]] || die "--checkpoint PATH is required"
[[ -f "$ckpt" ]] || die "--checkpoint: no such file: $ckpt"
[[ "$subset" == test || "$subset" == valid ]] || die "--subset must be test or valid, got '$subset'"
need_int --tokens-per-sample "$tps" 2
[[ "$ctx" =~ ^[0-9]+$ ]] && (( ctx < tps )) || die "--context-window must be an integer in [0, --tokens-per-sample), got '$ctx'"
need_int --batch-size "$bsz" 1
data="$prep/data-bin"
[[ -f "$data/dict.txt" ]] || die "--prep $prep: no data-bin/dict.txt (run prepare.sh with --out $prep)"
out="${out:-$(dirname "$ckpt")/eval-$subset}"
mkdir -p "$out"

echo "[evaluate] fairseq-eval-lm on $subset: $tps-token blocks, context window $ctx"
# batch-size multiple 1: this fairseq build drops a final batch smaller than the multiple
"$bindir/fairseq-eval-lm" "$data" --user-dir "$root/fairseq_agg" --task language_modeling \
  --path "$ckpt" --gen-subset "$subset" --tokens-per-sample "$tps" --context-window "$ctx" \
  --batch-size "$bsz" --required-batch-size-multiple 1 "${extra[@]}" 2>&1 | tee "$out/eval_lm.log" \
  | grep -E "Evaluated|Loss \(base 2\)" || true
grep -q "Perplexity" "$out/eval_lm.log" || die "fairseq-eval-lm failed; see $out/eval_lm.log"

echo "[evaluate] fairseq-agg-analyze: per-group perplexity and embedding report"
analyze_args=("$ckpt" --data "$data" --split "$subset" --out "$out/analysis")
[[ -n "$preset" ]] && analyze_args+=(--group-preset "$preset")
"$bindir/fairseq-agg-analyze" "${analyze_args[@]}"
echo "[evaluate] outputs in $out (eval_lm.log, analysis/report.json, analysis/*.png)"
