#!/usr/bin/env bash
# WMT14 English->German for fairseq with sentencepiece (instead of Moses + subword-nmt).
#
# Usage: bash examples/wmt14_en_de/prepare.sh [flags]
#
# Flags (default):
#   --raw-dir DIR             use already-downloaded files instead of the network (none: download
#                             into OUT/orig)
#   --out DIR                 where everything goes (data/wmt14_en_de)
#   --vocab-size N            joint sentencepiece BPE vocabulary, >= 100 (37000, the AGG paper's
#                             joint BPE size, as Vaswani et al.'s)
#   --news-commentary v9|v12  v9: WMT14's own data, the AGG paper's (fairseq's
#                             prepare-wmt14en2de.sh --icml17); v12: the WMT17 release, fairseq's
#                             default (v9)
#   --workers N               fairseq-preprocess workers (the number of CPUs)
#   --spm-sentences N         training sentences sampled for sentencepiece (10000000)
#   -h, --help                this help
#
# Training data: Europarl v7, Common Crawl and News Commentary; valid = newstest2013, test =
# newstest2014 (full, 3003 sentences), both fetched with `sacrebleu --echo`. Downloads send a
# fairseq-agg User-Agent (examples/textprep.py download).
# Pipeline: joint sentencepiece BPE model on the raw training text, encode, clean the training
# pairs (1..250 pieces, length ratio <= 1.5), fairseq-preprocess --joined-dictionary.
#
# --raw-dir DIR (searched recursively) must contain the extracted corpora
# `europarl-v7.de-en.{en,de}`, `commoncrawl.de-en.{en,de}`, `news-commentary-v9.de-en.{en,de}`
# (or -v12) and plain-text `newstest2013.{en,de}` and `newstest2014.{en,de}` (one sentence per
# line, as `sacrebleu -t wmt14/full -l en-de --echo src` prints them). .tgz archives in DIR are
# extracted.
#
# Writes OUT/data-bin (fairseq binary data), OUT/spm.model, OUT/raw/{valid,test}.{en,de}
# (untouched references for sacrebleu) and OUT/prepare.log.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=../common.sh
source "$here/../common.sh"  # root, py, bindir, textprep, die, parse_flags, need_int

raw_dir=""
out="$root/data/wmt14_en_de"
vocab=37000
nc=v9
workers="$(nproc 2>/dev/null || echo 1)"
spm_sentences=10000000

parse_flags "--raw-dir=raw_dir --out=out --vocab-size=vocab --news-commentary=nc --workers=workers
  --spm-sentences=spm_sentences" "$@"

need_int --vocab-size "$vocab" 100
[[ "$nc" == v12 || "$nc" == v9 ]] || die "--news-commentary must be v9 or v12, got '$nc'"
need_int --workers "$workers" 1
need_int --spm-sentences "$spm_sentences" 1
echo "[prepare] cost: a first run needs about 12 GB of disk (downloads 1.7 GB, extracted text about 5 GB, 4.5 GB" \
  "while it runs), about 7 GB once finished (derived: examples/wmt14_en_de/README.md, \"What a run costs\")"

if [[ -z "$raw_dir" ]]; then
  raw_dir="$out/orig"
  mkdir -p "$raw_dir"
  fetch http://statmt.org/wmt13/training-parallel-europarl-v7.tgz "$raw_dir/training-parallel-europarl-v7.tgz"
  fetch http://statmt.org/wmt13/training-parallel-commoncrawl.tgz "$raw_dir/training-parallel-commoncrawl.tgz"
  if [[ "$nc" == v12 ]]; then
    fetch http://data.statmt.org/wmt17/translation-task/training-parallel-nc-v12.tgz "$raw_dir/training-parallel-nc-v12.tgz"
  else
    fetch http://statmt.org/wmt14/training-parallel-nc-v9.tgz "$raw_dir/training-parallel-nc-v9.tgz"
  fi
  for testset in "wmt13 newstest2013" "wmt14/full newstest2014"; do
    set -- $testset
    for side in en de; do
      what=src; [[ "$side" == de ]] && what=ref
      if [[ ! -s "$raw_dir/$2.$side" ]]; then
        "$bindir/sacrebleu" -t "$1" -l en-de --echo "$what" > "$raw_dir/$2.$side.part"
        mv "$raw_dir/$2.$side.part" "$raw_dir/$2.$side"
      fi
    done
  done
fi
[[ -d "$raw_dir" ]] || die "--raw-dir: no such directory: $raw_dir"
raw_dir="$(cd "$raw_dir" && pwd)"

# Extract archives once (a stamp per archive), next to them.
shopt -s nullglob
for tgz in "$raw_dir"/*.tgz "$raw_dir"/*.tar.gz; do
  stamp="$tgz.extracted"
  if [[ ! -f "$stamp" ]]; then
    echo "[prepare] extracting $(basename "$tgz")"
    tar -xzf "$tgz" -C "$raw_dir"
    touch "$stamp"
  fi
done
shopt -u nullglob

expected="see --help for the expected files"
mkdir -p "$out/tmp" "$out/raw"
tmp="$out/tmp"
log="$out/prepare.log"
: > "$log"

# 1. Training text: concatenate the corpora, checking that each is aligned line by line.
: > "$tmp/train.raw.en"; : > "$tmp/train.raw.de"
for corpus in europarl-v7.de-en commoncrawl.de-en "news-commentary-$nc.de-en"; do
  en="$(find_file "$raw_dir" "$corpus.en" "$expected")"; de="$(find_file "$raw_dir" "$corpus.de" "$expected")"
  nen=$(wc -l < "$en"); nde=$(wc -l < "$de")
  (( nen == nde )) || die "$corpus: $nen English lines but $nde German lines ($en, $de)"
  echo "[prepare] $corpus: $nen sentence pairs" | tee -a "$log"
  # strip carriage returns (Common Crawl has some) so that pieces never contain them
  tr -d '\r' < "$en" >> "$tmp/train.raw.en"
  tr -d '\r' < "$de" >> "$tmp/train.raw.de"
done

# 2. Valid / test sets, kept untouched for sacrebleu.
for pair in "valid newstest2013" "test newstest2014"; do
  set -- $pair
  for side in en de; do
    f="$(find_file "$raw_dir" "$2.$side" "$expected")"
    tr -d '\r' < "$f" > "$out/raw/$1.$side"
  done
  nen=$(wc -l < "$out/raw/$1.en"); nde=$(wc -l < "$out/raw/$1.de")
  (( nen == nde )) || die "$2: $nen English lines but $nde German lines"
  echo "[prepare] $1 = $2: $nen sentences" | tee -a "$log"
done

# 3. Joint sentencepiece BPE model over both languages' training text.
echo "[prepare] training sentencepiece (bpe, vocab $vocab)" | tee -a "$log"
"$py" "$textprep" spm-train --inputs "$tmp/train.raw.en" "$tmp/train.raw.de" \
  --model-prefix "$out/spm" --vocab-size "$vocab" --model-type bpe --max-sentences "$spm_sentences"

# 4. Encode everything into pieces.
"$py" "$textprep" spm-encode --model "$out/spm.model" \
  --inputs "$tmp/train.raw.en" "$tmp/train.raw.de" "$out/raw/valid.en" "$out/raw/valid.de" "$out/raw/test.en" "$out/raw/test.de" \
  --outputs "$tmp/train.spm.en" "$tmp/train.spm.de" "$tmp/valid.spm.en" "$tmp/valid.spm.de" "$tmp/test.spm.en" "$tmp/test.spm.de"

# 5. Clean the training pairs on piece counts (as fairseq's recipe cleans after BPE).
"$py" "$textprep" clean-corpus --src "$tmp/train.spm.en" --tgt "$tmp/train.spm.de" \
  --out-src "$tmp/train.clean.en" --out-tgt "$tmp/train.clean.de" --min-len 1 --max-len 250 --ratio 1.5 2>&1 | tee -a "$log"

# 6. Binarise with one dictionary for both sides (--share-all-embeddings needs it).
rm -rf "$out/data-bin"
"$bindir/fairseq-preprocess" --source-lang en --target-lang de \
  --trainpref "$tmp/train.clean" --validpref "$tmp/valid.spm" --testpref "$tmp/test.spm" \
  --destdir "$out/data-bin" --joined-dictionary --workers "$workers" 2>&1 | tee -a "$log"

rm -rf "$tmp"
echo "[prepare] done: data-bin $out/data-bin, sentencepiece model $out/spm.model" | tee -a "$log"
