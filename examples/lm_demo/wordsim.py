"""The LM demo's word-similarity sets, WordSim-353 (Finkelstein et al. 2002) and SimLex-999
(Hill et al. 2015), as shipped in the test data of the PyPI wheel ``gensim==4.4.0`` (LGPL-2.1).

The wheel is fetched with pip at first use and read as a zip (gensim is not installed); the two
files are taken out, checked against their sha256 and kept in the demo's cache directory; the
wheel itself is not kept. Without a package index the demo goes on without word similarity.
Both files have the format ``fairseq-agg-analyze --word-sim`` reads (docs/stats.md).
"""
import os
import tempfile
import zipfile

from study.harness.corpus_cache import DataUnavailable, pip_download, sha256

WHEEL_SPEC = "gensim==4.4.0"
# gensim has only platform wheels; asking for one fixed platform makes pip fetch the same file on
# every machine (its data files are the same in all of them, and it is never installed)
PIP_PLATFORM = ("--platform", "manylinux_2_28_x86_64", "--python-version", "3.11")
MEMBERS = {  # wheel member -> sha256 of the file
    "gensim/test/test_data/wordsim353.tsv": "f92a022fc2537793a15bc3a8c162ebcd74990e033a228bb6388cb71e4c0b1e1d",
    "gensim/test/test_data/simlex999.txt": "d5e0501971478a511430ee880bd0121e94ac701ba86d90544d83e6d2ba3db05d",
}
# file stem (the key of fairseq-agg-analyze's report) -> the name the demo's table shows
DATASETS = {"wordsim353": "WordSim-353", "simlex999": "SimLex-999"}


def cached_paths(cache_dir, members=None):
    """The cached copies of ``members`` (default :data:`MEMBERS`), in their order, whatever their state."""
    return [os.path.join(cache_dir, os.path.basename(m)) for m in (MEMBERS if members is None else members)]


def read_wheel_members(wheel, cache_dir, members=None):
    """Copies each of ``members`` ({wheel member: sha256}, default :data:`MEMBERS`) out of the zip
    ``wheel`` to ``cache_dir`` after checking its sha256; returns their paths. DataUnavailable
    (nothing written for that member) when a member is missing or its content differs."""
    members = MEMBERS if members is None else members
    os.makedirs(cache_dir, exist_ok=True)
    try:
        z = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise DataUnavailable(f"{wheel}: not a readable wheel ({e})")
    with z:
        names = set(z.namelist())
        for member, expected in members.items():
            if member not in names:
                raise DataUnavailable(f"{os.path.basename(wheel)} has no {member}")
        paths = []
        for (member, expected), dest in zip(members.items(), cached_paths(cache_dir, members)):
            with open(dest + ".part", "wb") as f:
                f.write(z.read(member))
            digest = sha256(dest + ".part")
            if digest != expected:
                os.remove(dest + ".part")
                raise DataUnavailable(f"{member}: sha256 {digest} does not match the expected {expected}")
            os.replace(dest + ".part", dest)
            paths.append(dest)
    return paths


def fetch_word_sim_files(cache_dir, log=print):
    """The paths of the cached, verified WordSim-353 and SimLex-999 files, fetching them once;
    None (after one line saying why) when they cannot be had."""
    paths = cached_paths(cache_dir, MEMBERS)
    if all(os.path.isfile(p) and sha256(p) == h for p, h in zip(paths, MEMBERS.values())):
        return paths
    log(f"[demo] fetching {WHEEL_SPEC} with pip for WordSim-353 and SimLex-999 (28 MB, once; the two files "
        f"are kept in {cache_dir})")
    os.makedirs(cache_dir, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
            return read_wheel_members(pip_download(WHEEL_SPEC, tmp, PIP_PLATFORM), cache_dir, MEMBERS)
    except DataUnavailable as e:
        log(f"[demo] continuing without word similarity: {' '.join(str(e).split())[:400]}")
        return None
