#!/usr/bin/env bash
# Evaluate a WikiText-103 language model: perplexity with a context window, perplexity per
# frequency group, and the embedding report (I(W), TEV, mean cosine) with figures.
#
# Usage: bash examples/wikitext103/evaluate.sh --checkpoint PATH [flags] [-- fairseq-eval-lm flags]
#
# Flags (default):
#   --checkpoint PATH        a checkpoint, or train.sh's --save-dir: then its checkpoint_best.pt,
#                            the lowest validation NLL for every train.sh METHOD
#                            (checkpoint_last.pt when there is none) (required)
#   --prep DIR               the --out of prepare.sh, with data-bin/ (unless DATA_BIN) and
#                            tokenizer.txt (data/wikitext103)
#   --subset test|valid      (test)
#   --tokens-per-sample N    block length, >= 2 (512, the AGG paper's)
#   --context-window N       tokens of context each scored token sees, 0 <= N < --tokens-per-sample
#                            (400, the AGG paper's)
#   --batch-size N           blocks per batch (2)
#   --group-preset NAME      frequency groups of the per-group perplexity: wikitext103-official
#                            (the paper's ids [0,13001), [13001,36000), [36000,V); needs V > 36,000),
#                            fractions (30% / 50% / 20% of the types in dictionary order) or auto:
#                            the paper's preset on the paper's vocabulary (prepare.sh --tokenizer
#                            gpt2 --gpt2-dict corpus) when it is large enough, else the fractions
#                            (auto)
#   --out DIR                where the outputs go (next to the checkpoint: eval-SUBSET/)
#   -h, --help               this help
# Everything after -- goes to fairseq-eval-lm (e.g. -- --cpu).
#
# Environment: DATA_BIN (default PREP/data-bin) moves the data, as for train.sh: the data-bin scored;
# --prep still gives prepare.sh's tokenizer.txt (for --group-preset auto).
#
# 1. fairseq-eval-lm with the AGG paper's setting (512-token blocks, each scored token seeing
#    400 tokens of context): the headline perplexity, per token of the prepared vocabulary;
# 2. fairseq-agg-analyze with --data, scoring the same blocks with the same context window as
#    step 1 (its groups split eval-lm's total): perplexity per frequency group of the target token
#    (--group-preset), isotropy I(W), µTEV / σTEV and mean cosine of the embeddings, report.json
#    and PNG figures. The paper's groups are frequency ranks: ids of a dictionary that
#    fairseq-preprocess sorted by training count: ids up to 13,000 frequent, from 36,000 on rare, as
#    the authors' eval_lm.py cuts them (of V = 44,256 GPT-2 types on WikiText-103); on another
#    dictionary the same ids mean other ranks.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../common.sh
source "$here/../common.sh"  # root, py, bindir, die, parse_flags, need_int

ckpt=""; prep="$root/data/wikitext103"; subset=test; tps=512; ctx=400; bsz=2; out=""; preset=auto
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
if [[ -n "${DATA_BIN:-}" ]]; then
  data="$DATA_BIN"
  [[ -f "$data/dict.txt" ]] || die "DATA_BIN=$data has no dict.txt (a data-bin of prepare.sh)"
else
  data="$prep/data-bin"
  [[ -f "$data/dict.txt" ]] || die "--prep $prep: no data-bin/dict.txt (run prepare.sh with --out $prep)"
fi
case "$preset" in auto|fractions|wikitext103-official) ;;
  *) die "--group-preset must be auto, fractions or wikitext103-official, got '$preset'" ;; esac
types=$(( $(wc -l < "$data/dict.txt") + 4 ))  # fairseq adds 4 special symbols to dict.txt's entries
if [[ "$preset" == auto ]]; then
  preset=fractions
  if grep -qx "tokenizer=gpt2 dictionary=corpus" "$prep/tokenizer.txt" 2>/dev/null; then
    if (( types > 36000 )); then preset=wikitext103-official
    else echo "[evaluate] --group-preset auto: V = $types is too small for the paper's groups (ids 13,000 / 36,000): using the fractions"
    fi
  fi
fi
if [[ "$preset" == wikitext103-official ]]; then
  # the analysis' own check, asked before anything is written
  refusal="$("$py" -c 'import sys
from fairseq_agg.errors import UsageError
from fairseq_agg.stats.groups import frequency_groups
try:
    frequency_groups(preset=sys.argv[1], num_rows=int(sys.argv[2]), flag="--group-preset")
except UsageError as e:
    print(e)' "$preset" "$types")"
  [[ -z "$refusal" ]] || die "$refusal"
fi
out="${out:-$(dirname "$ckpt")/eval-$subset}"
mkdir -p "$out"

echo "[evaluate] fairseq-eval-lm on $subset: $tps-token blocks, context window $ctx"
# Every block is scored: eval-lm's loader batches with a multiple of 1 whatever this flag says (the
# task's eval_lm_dataloader passes none); the flag keeps it so should a fairseq read it
"$bindir/fairseq-eval-lm" "$data" --user-dir "$root/fairseq_agg_plugin" --task language_modeling \
  --path "$ckpt" --gen-subset "$subset" --tokens-per-sample "$tps" --context-window "$ctx" \
  --batch-size "$bsz" --required-batch-size-multiple 1 "${extra[@]}" 2>&1 | tee "$out/eval_lm.log" \
  | grep -E "Evaluated|Loss \(base 2\)" || true
grep -q "Perplexity" "$out/eval_lm.log" || die "fairseq-eval-lm failed; see $out/eval_lm.log"

echo "[evaluate] fairseq-agg-analyze: per-group perplexity and embedding report"
analyze_args=("$ckpt" --data "$data" --split "$subset" --out "$out/analysis"
  --tokens-per-sample "$tps" --context-window "$ctx")
[[ "$preset" == fractions ]] || analyze_args+=(--group-preset "$preset")
echo "[evaluate] frequency groups: $preset"
"$bindir/fairseq-agg-analyze" "${analyze_args[@]}"
echo "[evaluate] outputs in $out (eval_lm.log, analysis/report.json, analysis/*.png)"
