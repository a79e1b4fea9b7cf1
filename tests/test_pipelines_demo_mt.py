"""The MT demo (examples/mt_demo): extraction from tiny fixtures in the real Ding and LibreOffice
help formats, the splits, and an end-to-end run (fairseq-preprocess, fairseq-train,
fairseq-generate, sacrebleu) on them."""
import json
import os
import subprocess
import sys

import pytest

from examples.mt_demo import data as mtdata
import fairseq_runs

DING_HEADER = """# Version :: devel 2023-01-30
# Copyright (c) :: Frank Richter <frank.richter.tu-chemnitz.de>, 1995 - 2023
# License :: GPL Version 2 or later; GNU General Public License
"""

DING_LINES = [
    # example sentences as sub-entries, with gender / domain tags and ';' alternatives
    "Haus {n} | Das Haus ist sehr alt. | Wir kaufen ein Haus {n} [arch.]. :: house | The house is very old. | We are buying a house.",
    "gehen {vi} | Ich gehe nach Hause.; Ich gehe heim. :: to go | I am going home.; I go home.",
    # no sentence (no final punctuation) / too short / misaligned sub-entries: nothing
    "Baum {m} | Bäume {pl} :: tree | trees",
    "Ja! :: Yes!",
    "eins | zwei | Das ist gut. :: one | That is good.",
]


def ding_fixture(path, n_extra=300):
    """The header, the hand-written lines above and generated lines of the same shape."""
    sents = fairseq_runs.markov_sentences(n_extra, n_words=120, seed=7, min_len=3, max_len=10, prefix="w")
    with open(path, "w", encoding="utf-8") as f:
        f.write(DING_HEADER)
        for line in DING_LINES:
            f.write(line + "\n")
        for i, s in enumerate(sents):
            de = " ".join("d" + w[1:] for w in s.split())
            f.write(f"Wort{i} {{n}} | {de.capitalize()}. :: word{i} | {s.capitalize()}.\n")
    return path


def _page(lang, paragraphs, title):
    body = "".join(paragraphs)
    return (f'<!DOCTYPE html>\n<html lang="{lang}"><head><meta charset="utf-8"><title>{title}</title></head><body>'
            f'<div id="DisplayArea"><h1 id="hd_id1" dir="auto"><a name="x"></a>{title}</h1>{body}'
            '<p dir="auto">A paragraph without an id is never used.</p></div></body></html>\n')


def lo_fixture(root, n_files=40):
    """en-US/text/** and de/text/** pages whose paragraphs share ids, as in the Debian packages."""
    for i in range(n_files):
        sents = fairseq_runs.markov_sentences(6, n_words=120, seed=100 + i, min_len=5, max_len=12, prefix="w")
        rel = os.path.join("text", "swriter" if i % 2 else "scalc", "guide", f"page{i}.html")
        en_p, de_p = [], []
        for k, s in enumerate(sents):
            de = " ".join("d" + w[1:] for w in s.split())
            en_p.append(f'<p id="par_id{k}" class="paragraph" dir="auto">{s.capitalize()} <span class="x">&amp; more</span>.</p>')
            de_p.append(f'<p id="par_id{k}" class="paragraph" dir="auto">{de.capitalize()} <span class="x">&amp; mehr</span>.</p>')
        # a hidden span inside a paragraph, a hidden paragraph, and an untranslated paragraph
        en_p.append('<p id="par_idh" dir="auto">Press the key now<span hidden="true"> on a Mac</span> please.</p>')
        de_p.append('<p id="par_idh" dir="auto">Drücken Sie jetzt<span hidden="true"> am Mac</span> die Taste.</p>')
        en_p.append('<p id="par_idz" hidden="true">Hidden text is skipped entirely here.</p>')
        de_p.append('<p id="par_idz" hidden="true">Versteckter Text wird ganz übersprungen.</p>')
        en_p.append('<p id="par_idu">Same text in both languages.</p>')
        de_p.append('<p id="par_idu">Same text in both languages.</p>')
        for lang, paras, title in (("en-US", en_p, f"Title number {i} here"), ("de", de_p, f"Titel Nummer {i} hier")):
            path = os.path.join(root, lang, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(_page(lang, paras, title))
    return root


def test_ding_pairs_follow_the_data_note(tmp_path):
    path = str(tmp_path / "de-en")
    with open(path, "w", encoding="utf-8") as f:
        f.write(DING_HEADER + "\n".join(DING_LINES) + "\n")
    assert mtdata.ding_pairs(path) == [
        ("The house is very old.", "Das Haus ist sehr alt."),
        ("We are buying a house.", "Wir kaufen ein Haus ."),
        ("I am going home.", "Ich gehe nach Hause."),
    ]


def test_libreoffice_alignment_by_id_skips_hidden(tmp_path):
    root = lo_fixture(str(tmp_path / "help"), n_files=2)
    files = mtdata.lo_pairs(root)
    assert sorted(files) == [os.path.join("scalc", "guide", "page0.html"), os.path.join("swriter", "guide", "page1.html")]
    pairs = dict(files[os.path.join("scalc", "guide", "page0.html")])
    assert pairs["Title number 0 here"] == "Titel Nummer 0 hier"
    assert pairs["Press the key now please."] == "Drücken Sie jetzt die Taste."
    assert not any("Hidden" in e or "Same text" in e or "without an id" in e for e in pairs)
    first = fairseq_runs.markov_sentences(6, n_words=120, seed=100, min_len=5, max_len=12, prefix="w")[0]
    assert pairs[first.capitalize() + " & more."].endswith(" & mehr.")
    assert len(pairs) == 1 + 6 + 1


def test_splits_keep_each_help_file_in_one_split(tmp_path):
    ding = mtdata.ding_pairs(ding_fixture(str(tmp_path / "de-en")))
    lo = mtdata.lo_pairs(lo_fixture(str(tmp_path / "help"), n_files=200))
    splits = mtdata.split_all(ding, lo, lo_held_frac=(0.1, 0.1))
    assert sum(len(v) for v in splits.values()) == len(ding) + sum(len(v) for v in lo.values())
    where = {}
    for split, rows in splits.items():
        for en, de, src in rows:
            if src == "libreoffice":
                rel = next(r for r, ps in lo.items() if (en, de) in ps)
                where.setdefault(rel, set()).add(split)
    assert all(len(s) == 1 for s in where.values())
    assert {next(iter(s)) for s in where.values()} == {"train", "valid", "test"}
    # Ding pairs are de-duplicated before the random split: no pair in two splits
    seen = [(e, d) for rows in splits.values() for e, d, s in rows if s == "ding"]
    assert len(seen) == len(set(seen)) == len(ding)


def test_mt_demo_end_to_end_on_fixtures(tmp_path, repo_root):
    import sacrebleu

    ding = ding_fixture(str(tmp_path / "de-en"), n_extra=600)
    lo = lo_fixture(str(tmp_path / "help"), n_files=60)
    work = tmp_path / "work"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)  # fairseq-generate loads the checkpoints with safe loading
    proc = subprocess.run([sys.executable, "-m", "examples.mt_demo.run", "--quick", "--ding-file", ding,
                           "--lo-help-dir", lo, "--work-dir", str(work), "--updates", "12", "--vocab-size", "300",
                           "--methods", "baseline", "agg"], cwd=repo_root, capture_output=True, text=True, env=env,
                          timeout=1200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:" in out
    assert "chrF2|nrefs:1|" in out and "| train_inner |" in out
    # a quiet console: a line per run and step, "run k of N" with the time left, no dumps or warnings
    assert "run 1 of 2 started: " in out and "run 2 of 2 finished: " in out and ", BLEU " in out and "left" in out
    for noise in ("Namespace(", "'common': {", "TransformerModel(", "DEBUG", "Warning", "hydra"):
        assert noise not in out, noise
    assert "Namespace(" in open(work / "data" / "preprocess.log").read()
    res = json.load(open(work / "results-quick" / "results.json"))
    refs = open(work / "data" / "raw" / "test.de", encoding="utf-8").read().splitlines()
    for m in ("baseline", "agg"):
        hyps = open(work / "runs-quick" / f"{m}-s1" / "hyp.txt", encoding="utf-8").read().splitlines()
        assert len(hyps) == len(refs) and not any("\u2581" in h for h in hyps)
        r = res["results"][m][0]
        assert r["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
        assert r["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score)
    assert res["results"]["agg"][0]["rare_tokens"] > 0
    assert res["data"]["splits"]["test"]["ding"] > 0 and res["data"]["splits"]["test"]["libreoffice"] > 0


def test_mt_demo_says_when_packages_are_unavailable(tmp_path, monkeypatch):
    monkeypatch.setattr(mtdata.shutil, "which", lambda name: None)
    with pytest.raises(mtdata.DataUnavailable, match="apt-get"):
        mtdata.fetch_packages(str(tmp_path / "cache"))
