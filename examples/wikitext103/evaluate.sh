#!/usr/bin/env bash
# Evaluate a WikiText-103 language model: perplexity with a context window, perplexity per
# frequency group, and the embedding report (I(W), TEV, mean cosine) with figures.
#
# Usage: bash examples/wikitext103/evaluate.sh --checkpoint PATH [flags] [-- fairseq-eval-lm flags]
#
# Flags (default):
#   --checkpoint PATH        a checkpoint, or train.sh's --save-dir: then its checkpoint_best.pt
#                            (checkpoint_last.pt when there is none) (required)
#   --prep DIR               the --out of prepare.sh (data/wikitext103)
#   --subset test|valid      (test)
#   --tokens-per-sample N    block length, >= 2 (512, the AGG paper's)
#   --context-window N       tokens of context each scored token sees, 0 <= N < --tokens-per-sample
#                            (400, the AGG paper's)
#   --batch-size N           blocks per batch (2)
#   --group-preset NAME      frequency groups of fairseq-agg-analyze, e.g. wikitext103-official
#                            (its default: 30% / 50% / 20% of the types)
#   --out DIR                where the outputs go (next to the checkpoint: eval-SUBSET/)
#   -h, --help               this help
# Everything after -- goes to fairseq-eval-lm (e.g. -- --cpu).
#
# 1. fairseq-eval-lm with the AGG paper's setting (512-token blocks, each scored token seeing
#    400 tokens of context): the headline perplexity, per token of the prepared vocabulary;
# 2. fairseq-agg-analyze with --data, scoring the same blocks with the same context window as
#    step 1 (its groups split eval-lm's total): perplexity per frequency group of the target token
#    (frequent / medium / rare = 30% / 50% / 20% of the types in dictionary order, or
#    --group-preset wikitext103-official for the official fixed id ranges), isotropy I(W),
#    µTEV / σTEV and mean cosine of the embeddings, report.json and PNG figures.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../common.sh
source "$here/../common.sh"  # root, py, bindir, die, parse_flags, need_int

ckpt=""; prep="$root/data/wikitext103"; subset=test; tps=512; ctx=400; bsz=2; out=""; preset=""
parse_flags "--checkpoint=ckpt --prep=prep --subset=subset --tokens-per-sample=tps --context-window=ctx
  --batch-size=bsz --out=out --group-preset=preset --" "$@"
[[ -n "$ckpt" ]] || die "--checkpoint PATH is required (see --help)"
if [[ -d "$ckpt" ]]; then
  dir="$ckpt"; ckpt="$dir/checkpoint_best.pt"; [[ -f "$ckpt" ]] || ckpt="$dir/checkpoint_last.pt"
  [[ -f "$ckpt" ]] || die "--checkpoint $dir: no checkpoint_best.pt or checkpoint_last.pt in it"
  echo "[evaluate] --checkpoint $dir: using $ckpt"
fi
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
analyze_args=("$ckpt" --data "$data" --split "$subset" --out "$out/analysis"
  --tokens-per-sample "$tps" --context-window "$ctx")
[[ -n "$preset" ]] && analyze_args+=(--group-preset "$preset")
"$bindir/fairseq-agg-analyze" "${analyze_args[@]}"
echo "[evaluate] outputs in $out (eval_lm.log, analysis/report.json, analysis/*.png)"
