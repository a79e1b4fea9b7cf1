#!/usr/bin/env bash
# WikiText-103 for fairseq language modelling.
#
# Usage: bash examples/wikitext103/prepare.sh [flags]
#
# Flags (default):
#   --raw-dir DIR          a directory holding wiki.{train,valid,test}.tokens (searched
#                          recursively; a .zip in DIR is extracted) instead of the download
#                          (none: download into OUT/orig)
#   --url URL              where to download wikitext-103-v1.zip from
#                          (https://wikitext.smerity.com/wikitext-103-v1.zip)
#   --out DIR              where everything goes (data/wikitext103)
#   --tokenizer NAME       gpt2 (the AGG paper's: GPT-2's byte-level BPE), spm (a sentencepiece BPE
#                          trained here) or word (WikiText's own word vocabulary) (gpt2)
#   --bpe-dir DIR          gpt2: a directory with GPT-2's encoder.json and vocab.bpe (and dict.txt
#                          for --gpt2-dict fairseq) instead of the download (none: download into
#                          OUT/gpt2_bpe)
#   --bpe-url URL          gpt2: where those files are downloaded from
#                          (https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe)
#   --gpt2-dict NAME       gpt2: corpus (the paper's: fairseq-preprocess counts the training split,
#                          so ids are WikiText-103 frequency ranks) or fairseq (fairseq's GPT-2
#                          dict.txt, the order of fairseq's own corpus, V = 50,264) (corpus)
#   --vocab-size N         spm: sentencepiece vocabulary, >= 100 (32000)
#   --workers N            GPT-2 encoding and fairseq-preprocess processes (the number of CPUs)
#   --spm-sentences N      spm: training sentences sampled for sentencepiece (10000000)
#   -h, --help             this help
#
# The download is wikitext-103-v1 (the tokenised release: wiki.{train,valid,test}.tokens) from
# the dataset author's mirror (the old S3 address is gone). That server refuses Python's default
# User-Agent, so the download sends `fairseq-agg/VERSION` (examples/textprep.py download); the
# zip is verified before it is used, and a failure is one error line. Then:
#   --tokenizer gpt2 (default) as the AGG paper prepared it: every line of wiki.*.tokens, escapes
#                    (`@-@`), headings and `<unk>` as they are, stripped of surrounding
#                    whitespace and encoded with GPT-2's byte-level BPE (fairseq's encoder,
#                    fairseq.data.encoders.gpt2_bpe_utils, with the encoder.json and vocab.bpe
#                    fairseq publishes); blank lines stay blank. fairseq-preprocess then builds the
#                    dictionary from the training split (--gpt2-dict corpus; on WikiText-103 the
#                    paper's V = 44,256, the vocabulary its 13,000 / 36,000 frequency-rank groups
#                    split) or reads fairseq's dict.txt (--gpt2-dict fairseq).
#   --tokenizer spm  undoes WikiText's in-word escapes (`1 @,@ 000` -> `1,000`,
#                    `state @-@ of` -> `state-of`, `@.@`), trains a sentencepiece BPE model
#                    (--vocab-size) on the training text and encodes all splits (no download
#                    beyond WikiText's). Headings (` = Title = `), `<unk>` and blank lines stay.
#   --tokenizer word the original word-level vocabulary (~267k types), fairseq's recipe.
# Finally fairseq-preprocess --only-source. Writes OUT/data-bin, OUT/spm.model (spm),
# OUT/gpt2_bpe/ (gpt2, unless --bpe-dir), OUT/tokenizer.txt (which vocabulary this is, read by
# evaluate.sh) and OUT/prepare.log.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../common.sh
source "$here/../common.sh"  # root, py, bindir, textprep, die, parse_flags, need_int

raw_dir=""; url="https://wikitext.smerity.com/wikitext-103-v1.zip"; out="$root/data/wikitext103"
tokenizer=gpt2; bpe_dir=""; bpe_url="https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe"; gpt2_dict=corpus
vocab=32000; workers="$(nproc 2>/dev/null || echo 1)"; spm_sentences=10000000

parse_flags "--raw-dir=raw_dir --url=url --out=out --tokenizer=tokenizer --bpe-dir=bpe_dir --bpe-url=bpe_url
  --gpt2-dict=gpt2_dict --vocab-size=vocab --workers=workers --spm-sentences=spm_sentences" "$@"
case "$tokenizer" in gpt2|spm|word) ;; *) die "--tokenizer must be gpt2, spm or word, got '$tokenizer'" ;; esac
[[ "$gpt2_dict" == corpus || "$gpt2_dict" == fairseq ]] || die "--gpt2-dict must be corpus or fairseq, got '$gpt2_dict'"
need_int --vocab-size "$vocab" 100
need_int --workers "$workers" 1
need_int --spm-sentences "$spm_sentences" 1
gpt2_files=(encoder.json vocab.bpe)
[[ "$gpt2_dict" == fairseq ]] && gpt2_files+=(dict.txt)
if [[ -n "$bpe_dir" ]]; then
  [[ "$tokenizer" == gpt2 ]] || die "--bpe-dir is for --tokenizer gpt2 (the tokenizer is $tokenizer)"
  [[ -d "$bpe_dir" ]] || die "--bpe-dir: no such directory: $bpe_dir"
  for f in "${gpt2_files[@]}"; do
    [[ -f "$bpe_dir/$f" ]] || die "--bpe-dir $bpe_dir has no $f (expected ${gpt2_files[*]})"
  done
  bpe_dir="$(cd "$bpe_dir" && pwd)"
  "$py" "$textprep" gpt2-check --encoder-json "$bpe_dir/encoder.json" --vocab-bpe "$bpe_dir/vocab.bpe" || exit 2
fi
[[ -z "$raw_dir" || -d "$raw_dir" ]] || die "--raw-dir: no such directory: $raw_dir"
echo "[prepare] cost: about 1.7 GB of disk (download 0.74 GB, kept; 0.7 GB while it runs; data-bin 0.24 GB;" \
  "derived: examples/wikitext103/README.md, \"What a run costs\"); GPT-2-encoding 118M tokens takes a while"

# fetch_gpt2_files: downloads GPT-2's files into OUT/gpt2_bpe unless --bpe-dir gave them, and checks
# them; files that are not GPT-2's (an error page, say) are removed, so that a rerun fetches again.
fetch_gpt2_files() {
  [[ "$tokenizer" == gpt2 && -z "$bpe_dir" ]] || return 0
  bpe_dir="$out/gpt2_bpe"
  mkdir -p "$bpe_dir"
  for f in "${gpt2_files[@]}"; do fetch "${bpe_url%/}/$f" "$bpe_dir/$f" --bpe-dir; done
  if ! "$py" "$textprep" gpt2-check --encoder-json "$bpe_dir/encoder.json" --vocab-bpe "$bpe_dir/vocab.bpe"; then
    for f in "${gpt2_files[@]}"; do rm -f "$bpe_dir/$f"; done
    exit 2
  fi
}

if [[ -z "$raw_dir" ]]; then
  fetch_gpt2_files  # small files first: a wrong --bpe-url fails before the large download
  raw_dir="$out/orig"
  mkdir -p "$raw_dir"
  fetch "$url" "$raw_dir/wikitext-103-v1.zip"
fi
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
fetch_gpt2_files  # with --raw-dir: once the raw files are known to be there

mkdir -p "$out/tmp"
tmp="$out/tmp"; log="$out/prepare.log"; : > "$log"
for s in train valid test; do
  f="${!s}"
  echo "[prepare] $s: $(wc -l < "$f") lines, $(wc -w < "$f") tokens ($f)" | tee -a "$log"
done

dictionary=()
if [[ "$tokenizer" == gpt2 ]]; then
  echo "[prepare] encoding with GPT-2's BPE ($bpe_dir; dictionary: $gpt2_dict)" | tee -a "$log"
  "$py" "$textprep" gpt2-encode --encoder-json "$bpe_dir/encoder.json" --vocab-bpe "$bpe_dir/vocab.bpe" \
    --inputs "$train" "$valid" "$test" --outputs "$tmp/train.tok" "$tmp/valid.tok" "$tmp/test.tok" --workers "$workers"
  [[ "$gpt2_dict" == fairseq ]] && dictionary=(--srcdict "$bpe_dir/dict.txt")
elif [[ "$tokenizer" == spm ]]; then
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
  --testpref "$tmp/test.tok" --destdir "$out/data-bin" --workers "$workers" "${dictionary[@]}" 2>&1 | tee -a "$log"
rm -rf "$tmp"
kind="tokenizer=$tokenizer"
[[ "$tokenizer" == gpt2 ]] && kind+=" dictionary=$gpt2_dict"
echo "$kind" > "$out/tokenizer.txt"
# fairseq adds its 4 special symbols to the entries of dict.txt
types=$(( $(wc -l < "$out/data-bin/dict.txt") + 4 ))
echo "[prepare] done: data-bin $out/data-bin, $kind, V = $types types" | tee -a "$log"
