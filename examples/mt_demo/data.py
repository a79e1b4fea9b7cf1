"""English-German parallel text from two Debian packages, for the MT demo.

* ``trans-de-en`` (the Ding dictionary, TU Chemnitz; GPL-2+): one entry a line,
  ``German | sub-entry ... :: English | sub-entry ...``, both sides aligned sub-entry by sub-entry
  on ``|``. Many sub-entries are example sentences; those are the pairs used here.
* ``libreoffice-help-en-us`` / ``libreoffice-help-de`` (MPL-2.0): the help pages as HTML; every
  paragraph and heading carries the same ``id`` in both languages, so (file, id) aligns exactly.

Fetched with ``apt-get download`` (apt checks each package against the signed archive index)
and unpacked with ``dpkg-deb -x``; no installation. Ding pairs are split at random after
de-duplication; LibreOffice pairs by HTML file, because pages repeat boilerplate.
"""
import glob
import html
import os
import random
import re
import shutil
import subprocess
import zlib
from html.parser import HTMLParser

from study.harness.corpus_cache import DataUnavailable, sha256

PACKAGES = ("trans-de-en", "libreoffice-help-en-us", "libreoffice-help-de")
DING_FILE = "usr/share/trans/de-en"
LO_HELP = "usr/share/libreoffice/help"


def _apt_download(names, dest):
    return subprocess.run(["apt-get", "download", *names], cwd=dest, capture_output=True, text=True)


def fetch_packages(cache_dir, log=print):
    """Downloads and unpacks the three packages once; returns {package: (root dir, deb sha256)}."""
    os.makedirs(cache_dir, exist_ok=True)
    out = {}
    missing = [p for p in PACKAGES if not glob.glob(os.path.join(cache_dir, f"{p}_*.deb"))]
    if missing:
        if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
            raise DataUnavailable(
                "the MT demo's data comes from Debian packages (trans-de-en, libreoffice-help-en-us, "
                "libreoffice-help-de), but apt-get / dpkg-deb are not available on this system. Copy the "
                f".deb files into {cache_dir} from a Debian or Ubuntu machine, or pass --ding-file and --lo-help-dir."
            )
        log(f"[demo-mt] apt-get download {' '.join(missing)} (once; cached in {cache_dir})")
        proc = _apt_download(missing, cache_dir)
        if proc.returncode != 0 and os.geteuid() == 0:
            log("[demo-mt] apt-get download failed; refreshing the package lists (apt-get update) and retrying")
            subprocess.run(["apt-get", "update"], capture_output=True, text=True)
            proc = _apt_download(missing, cache_dir)
        if proc.returncode != 0:
            raise DataUnavailable(
                f"apt-get download {' '.join(missing)} failed: {(proc.stderr or proc.stdout).strip()[-400:]}. "
                "Run 'apt-get update' (as root) and retry, or copy the .deb files into " + cache_dir
            )
    for p in PACKAGES:
        debs = sorted(glob.glob(os.path.join(cache_dir, f"{p}_*.deb")))
        if not debs:
            raise DataUnavailable(f"{p}: no .deb in {cache_dir}")
        deb = debs[-1]
        root = os.path.join(cache_dir, p)
        stamp = os.path.join(root, ".extracted-" + os.path.basename(deb))
        if not os.path.isfile(stamp):
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root)
            proc = subprocess.run(["dpkg-deb", "-x", deb, root], capture_output=True, text=True)
            if proc.returncode != 0:
                raise DataUnavailable(f"dpkg-deb -x {deb} failed: {proc.stderr.strip()[-300:]}")
            open(stamp, "w").close()
        out[p] = (root, sha256(deb), os.path.basename(deb))
    return out


# ---------------------------------------------------------------------------- Ding

_TAGS = re.compile(r"\{[^}]*\}|\[[^\]]*\]")
_SPACE = re.compile(r"\s+")
_END = re.compile(r"[.!?]$")


def _clean_ding(side):
    side = _TAGS.sub(" ", side)
    side = side.split(";")[0]  # the first of several alternatives
    return _SPACE.sub(" ", side).strip()


def ding_pairs(path):
    """Unique (en, de) sentence pairs: both sides end in .!? and have at least 3 words."""
    if not os.path.isfile(path):
        raise DataUnavailable(f"Ding dictionary file not found: {path}")
    seen = set()
    pairs = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("#") or "::" not in line:
                continue
            de_part, en_part = line.rstrip("\n").split("::", 1)
            de_subs, en_subs = de_part.split("|"), en_part.split("|")
            if len(de_subs) != len(en_subs):
                continue  # the sides do not align
            for de, en in zip(de_subs, en_subs):
                de, en = _clean_ding(de), _clean_ding(en)
                if not (_END.search(de) and _END.search(en)):
                    continue
                if len(de.split()) < 3 or len(en.split()) < 3:
                    continue
                if (en, de) in seen:
                    continue
                seen.add((en, de))
                pairs.append((en, de))
    return pairs


# ---------------------------------------------------------------------------- LibreOffice help

_TEXT_TAGS = {"p", "h1", "h2", "h3", "h4", "h5", "h6"}
_VOID = {"br", "img", "input", "meta", "link", "hr", "area", "base", "col", "embed", "source", "wbr"}


class _IdText(HTMLParser):
    """Collects the text of every paragraph / heading that has an id; hidden elements are skipped."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.texts = {}
        self._stack = []  # (tag, id or None, hidden)
        self._buf = {}

    def handle_starttag(self, tag, attrs):
        if tag in _VOID:
            return
        a = dict(attrs)
        hidden = "hidden" in a or any(h for _, _, h in self._stack)
        ident = a.get("id") if tag in _TEXT_TAGS and not hidden else None
        if ident is not None and ident not in self._buf and ident not in self.texts:
            self._buf[ident] = []
        else:
            ident = None
        self._stack.append((tag, ident, hidden))

    def handle_endtag(self, tag):
        # pop to the matching open tag (tolerates unclosed inline tags)
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i][0] == tag:
                for _, ident, _ in self._stack[i:]:
                    if ident is not None:
                        self.texts[ident] = _SPACE.sub(" ", "".join(self._buf.pop(ident))).strip()
                del self._stack[i:]
                return

    def handle_data(self, data):
        if self._stack and self._stack[-1][2]:
            return
        for ident in self._buf:
            self._buf[ident].append(data)


def html_id_texts(path):
    p = _IdText()
    with open(path, encoding="utf-8", errors="replace") as f:
        p.feed(f.read())
    p.close()
    return p.texts


def lo_pairs(help_root):
    """{relative html path: [(en, de)]}: paragraphs aligned by (file, id), EN >= 4 and DE >= 3 words."""
    en_root = os.path.join(help_root, "en-US", "text")
    de_root = os.path.join(help_root, "de", "text")
    if not os.path.isdir(en_root) or not os.path.isdir(de_root):
        raise DataUnavailable(f"LibreOffice help pages not found under {help_root} (expected en-US/text and de/text)")
    out = {}
    seen = set()
    for en_path in sorted(glob.glob(os.path.join(en_root, "**", "*.html"), recursive=True)):
        rel = os.path.relpath(en_path, en_root)
        de_path = os.path.join(de_root, rel)
        if not os.path.isfile(de_path):
            continue
        en_t, de_t = html_id_texts(en_path), html_id_texts(de_path)
        pairs = []
        for ident, en in en_t.items():
            de = de_t.get(ident)
            if not de or en == de:
                continue
            if len(en.split()) < 4 or len(de.split()) < 3:
                continue
            en, de = html.unescape(en), html.unescape(de)
            if (en, de) in seen:
                continue
            seen.add((en, de))
            pairs.append((en, de))
        if pairs:
            out[rel] = pairs
    return out


# ---------------------------------------------------------------------------- splits


def split_all(ding, lo_files, seed=1, ding_held=(300, 600), lo_held_frac=(0.02, 0.03)):
    """train/valid/test lists of (en, de, source). Ding: random; LibreOffice: by file (CRC bucket)."""
    splits = {"train": [], "valid": [], "test": []}
    rng = random.Random(seed)
    idx = list(range(len(ding)))
    rng.shuffle(idx)
    n_valid, n_test = ding_held
    if len(ding) < 10 * (n_valid + n_test):  # small inputs (fixtures): keep the same proportions
        n_valid = max(1, len(ding) // 25)
        n_test = max(1, len(ding) // 12)
    for k, i in enumerate(idx):
        split = "test" if k < n_test else "valid" if k < n_test + n_valid else "train"
        splits[split].append(ding[i] + ("ding",))
    v_frac, t_frac = lo_held_frac
    for rel, pairs in sorted(lo_files.items()):
        # a stable per-file bucket, the same on every machine
        u = zlib.crc32(rel.encode("utf-8")) / 2 ** 32
        split = "test" if u < t_frac else "valid" if u < t_frac + v_frac else "train"
        splits[split].extend(p + ("libreoffice",) for p in pairs)
    return splits
