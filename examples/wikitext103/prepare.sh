#!/usr/bin/env bash
# WikiText-103 for fairseq language modelling.
#
# Usage: bash examples/wikitext103/prepare.sh [flags]
#
# Flags (default):
#   --raw-dir DIR        a directory holding wiki.{train,valid,test}.tokens (searched
#                        recursively; a .zip in DIR is extracted) instead of the download
#                        (none: download into OUT/orig)
#   --url URL            where to download wikitext-103-v1.zip from
#                        (https://wikitext.smerity.com/wikitext-103-v1.zip)
#   --out DIR            where everything goes (data/wikitext103)
#   --tokenizer spm|word sentencepiece BPE or WikiText's own word vocabulary (spm)
#   --vocab-size N       sentencepiece vocabulary, >= 100 (32000)
#   --workers N          fairseq-preprocess workers (the number of CPUs)
#   --spm-sentences N    training sentences sampled for sentencepiece (10000000)
#   -h, --help           this help
#
# The download is wikitext-103-v1 (the tokenised release: wiki.{train,valid,test}.tokens) from
# the dataset author's mirror (the old S3 address is gone). That server refuses Python's default
# User-Agent, so the download sends `fairseq-agg/VERSION` (examples/textprep.py download); the
# zip is verified before it is used, and a failure is one error line. Then:
#   --tokenizer spm  (default) undoes WikiText's in-word escapes (`1 @,@ 000` -> `1,000`,
#                    `state @-@ of` -> `state-of`, `@.@`), trains a sentencepiece BPE model
#                    (--vocab-size; the AGG paper used GPT-2's BPE, which needs a download that
#                    sentencepiece does not) on the training text and encodes all splits.
#                    Headings (` = Title = `), `<unk>` and blank lines stay as they are.
#   --tokenizer word the original word-level vocabulary (~267k types), fairseq's recipe.
# Finally fairseq-preprocess --only-source. Writes OUT/data-bin, OUT/spm.model (spm only) and
# OUT/prepare.log.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../common.sh
source "$here/../common.sh"  # root, py, bindir, textprep, die, parse_flags, need_int

raw_dir=""; url="https://wikitext.smerity.com/wikitext-103-v1.zip"; out="$root/data/wikitext103"
tokenizer=spm; vocab=32000
workers="$(nproc 2>/dev/null || echo 1)"; spm_sentences=10000000

parse_flags "--raw-dir=raw_dir --url=url --out=out --tokenizer=tokenizer --vocab-size=vocab --workers=workers
  --spm-sentences=spm_sentences" "$@"
[[ "$tokenizer" == spm || "$tokenizer" == word ]] || die "--tokenizer must be spm or word, got '$tokenizer'"
need_int --vocab-size "$vocab" 100
need_int --workers "$workers" 1
need_int --spm-sentences "$spm_sentences" 1

if [[ -z "$raw_dir" ]]; then
  raw_dir="$out/orig"
  mkdir -p "$raw_dir"
  fetch "$url" "$raw_dir/wikitext-103-v1.zip"
fi
[[ -d "$raw_dir" ]] || die "--raw-dir: no such directory: $raw_dir"
raw_dir="$(cd "$raw_dir" && pwd)"
shopt -s nullglob
for z in "$raw_dir"/*.zip; do
  if [[ ! -f "$z.extracted" ]]; then
    echo "[prepare] extracting $(basename "$z")"
    "$py" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$z" "$raw_dir" \
      || die "cannot extract $z: delete it and run again"
    touch "$z.extracted"
  fi
done
shopt -u nullglob

expected="expected wiki.train.tokens, wiki.valid.tokens, wiki.test.tokens"
train="$(find_file "$raw_dir" wiki.train.tokens "$expected")"
valid="$(find_file "$raw_dir" wiki.valid.tokens "$expected")"
test="$(find_file "$raw_dir" wiki.test.tokens "$expected")"

mkdir -p "$out/tmp"
tmp="$out/tmp"; log="$out/prepare.log"; : > "$log"
for s in train valid test; do
  f="${!s}"
  echo "[prepare] $s: $(wc -l < "$f") lines, $(wc -w < "$f") tokens ($f)" | tee -a "$log"
done

if [[ "$tokenizer" == spm ]]; then
  for s in train valid test; do
    "$py" "$textprep" wikitext-detok --input "${!s}" --output "$tmp/$s.txt"
  done
  echo "[prepare] training sentencepiece (bpe, vocab $vocab)" | tee -a "$log"
  # <unk> is kept as one piece, so that fairseq maps it onto its own <unk> entry
  "$py" "$textprep" spm-train --inputs "$tmp/train.txt" --model-prefix "$out/spm" --vocab-size "$vocab" \
    --model-type bpe --max-sentences "$spm_sentences" --user-symbols "<unk>"
  "$py" "$textprep" spm-encode --model "$out/spm.model" --inputs "$tmp/train.txt" "$tmp/valid.txt" "$tmp/test.txt" \
    --outputs "$tmp/train.tok" "$tmp/valid.tok" "$tmp/test.tok"
else
  for s in train valid test; do cp "${!s}" "$tmp/$s.tok"; done
fi

rm -rf "$out/data-bin"
"$bindir/fairseq-preprocess" --only-source --trainpref "$tmp/train.tok" --validpref "$tmp/valid.tok" \
  --testpref "$tmp/test.tok" --destdir "$out/data-bin" --workers "$workers" 2>&1 | tee -a "$log"
rm -rf "$tmp"
echo "[prepare] done: data-bin $out/data-bin" | tee -a "$log"
