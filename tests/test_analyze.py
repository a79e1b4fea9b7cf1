"""fairseq-agg-analyze on checkpoints of real tiny training runs: report values against the
metric functions on the checkpoint weights, per-group perplexity against fairseq-eval-lm's and
fairseq-generate's own per-token scores, figures, and clear errors."""
import json
import math
import os
import re

import numpy as np
import pytest
import torch
from fairseq import checkpoint_utils
from fairseq.data import Dictionary

import fairseq_runs as fr
import fairseq_agg_cli as cli
from fairseq_agg.fairseq_facts.dictionary import madeupword_ids
from fairseq_agg.analysis import analyze as A, table
from fairseq_agg.stats import groups as G
from fairseq_agg.stats.metrics import isotropy, mean_direction_drift, mean_pairwise_cosine, tev_stats

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def lm_ckpts(lm_data_bin, tmp_path_factory):
    """Stock fairseq LM training (no plugin criterion): checkpoints at updates 5 and 10."""
    root = tmp_path_factory.mktemp("analyze_lm")
    fr.run_cli("fairseq-train", [lm_data_bin, "--save-dir", root / "ckpt", "--max-update", "10",
                                 "--save-interval-updates", "5", "--no-epoch-checkpoints"] + fr.TINY_LM_ARGS)
    return root / "ckpt"


def _expected_metrics(W, rows):
    t = tev_stats(W, rows)
    i = isotropy(W, rows)
    return {"rows": rows.numel(), "tev_mu": t["mu"], "tev_sigma": t["sigma"], "tev_mu_over_init": t["mu_over_init"],
            "mean_cos": mean_pairwise_cosine(W, rows), "isotropy": i["isotropy"],
            "isotropy_raw": i["isotropy_raw"], "isotropy_fixed": i["isotropy_fixed"]}


def _check_matrix_entry(entry, W, d):
    mask = G.row_mask(d)
    for key, value in _expected_metrics(W, mask.nonzero().reshape(-1)).items():
        assert entry["all"][key] == pytest.approx(value, rel=1e-9), key
    for g, ids in G.frequency_groups(d).items():
        gm = torch.zeros_like(mask)
        gm[ids] = True
        for key, value in _expected_metrics(W, (gm & mask).nonzero().reshape(-1)).items():
            assert entry["groups"][g][key] == pytest.approx(value, rel=1e-9), (g, key)
    rows = mask.nonzero().reshape(-1)
    assert entry["drift"] == pytest.approx(mean_direction_drift(W, rows), rel=1e-9)
    # by hand: the projections on the unit mean of the analysis rows, halves in dictionary order
    X64 = W[rows].double()
    u = X64.mean(0) / X64.mean(0).norm()
    half = (rows.numel() + 1) // 2
    assert entry["drift"]["drift_rare"] == pytest.approx((X64[half:] @ u).mean().item(), rel=1e-9)
    assert entry["drift"]["drift_frequent"] == pytest.approx((X64[:half] @ u).mean().item(), rel=1e-9)
    X = W[mask].double().numpy()
    k = min(X.shape)
    assert np.array(entry["singular_values"][:k]) == pytest.approx(np.linalg.svd(X, compute_uv=False), rel=1e-6)


def _group_ppl_reference(words_and_logp, d):
    """Per-group PPL from per-token natural-log probabilities printed by fairseq itself."""
    lookup = G.group_lookup(G.frequency_groups(d), len(d))
    sums, counts = {}, {}
    for word, logp in words_and_logp:
        g = int(lookup[d.index(word)])
        name = G.GROUP_NAMES[g] if g >= 0 else None
        for key in ("total", name):
            if key is not None:
                sums[key] = sums.get(key, 0.0) - logp
                counts[key] = counts.get(key, 0) + 1
    return {k: (math.exp(sums[k] / counts[k]), counts[k]) for k in sums}


def test_cli_report_figures_and_ppl_against_eval_lm(lm_ckpts, lm_data_bin, tmp_path):
    out = tmp_path / "report"
    ck5, ck_last = lm_ckpts / "checkpoint_1_5.pt", lm_ckpts / "checkpoint_last.pt"
    proc = fr.run_cli("fairseq-agg-analyze", [ck5, ck_last, "--data", lm_data_bin, "--out", out, "--cpu"])
    assert "| checkpoint_1_5 | dec |" in proc.stdout and "| checkpoint_last | dec |" in proc.stdout
    # progress, one line per checkpoint and step, then the files it wrote (and nothing else)
    for step in ("loading checkpoint", "analysing checkpoint"):
        assert [f"{step} {i}/2" in proc.stderr for i in (1, 2)] == [True, True], proc.stderr
    written = ["spectrum.png", "projection.png", "report.json", "table.md"]
    assert proc.stderr.splitlines()[-4:] == [f"wrote {out / name}" for name in written]
    assert sorted(os.listdir(out)) == sorted(written)
    report = json.loads((out / "report.json").read_text())
    assert report["version"] == 1 and report["settings"]["split"] == "valid"
    assert [c["label"] for c in report["checkpoints"]] == ["checkpoint_1_5", "checkpoint_last"]
    assert [c["num_updates"] for c in report["checkpoints"]] == [5, 10]
    d = Dictionary.load(os.path.join(lm_data_bin, "dict.txt"))
    for ck, path in zip(report["checkpoints"], (ck5, ck_last)):
        assert ck["task"] == "language_modeling" and ck["criterion"] == "cross_entropy"
        assert ck["dictionary"]["size"] == len(d) and ck["dictionary"]["madeupwords"] == len(madeupword_ids(d))
        assert ck["groups"] == {g: int(ids.numel()) for g, ids in G.frequency_groups(d).items()}
        (name,) = ck["matrices"]
        entry = ck["matrices"][name]
        assert name == "dec" and entry["tied"] == ["decoder.output_projection.weight"]
        W = checkpoint_utils.load_checkpoint_to_cpu(str(path))["model"]["decoder.embed_tokens.weight"]
        assert entry["shape"] == list(W.shape)
        _check_matrix_entry(entry, W, d)
    # the two checkpoints differ (training moved the embeddings)
    assert report["checkpoints"][0]["matrices"]["dec"]["all"]["tev_mu"] != report["checkpoints"][1]["matrices"]["dec"]["all"]["tev_mu"]
    assert report["table"]["columns"][:3] == ["label", "matrix", "tev_mu"] and len(report["table"]["rows"]) == 2
    cols = report["table"]["columns"]
    for row, ck in zip(report["table"]["rows"], report["checkpoints"]):  # the table's drift cells
        for key in table.DRIFT_COLUMNS:
            assert row[cols.index(key)] == ck["matrices"]["dec"]["drift"][key]
    table_md = (out / "table.md").read_text()
    assert table_md.split("\n\n")[0].count("\n") == 3  # header, rule, two rows; then the legend
    assert table_md.startswith("| checkpoint | matrix | µTEV | σTEV |") and "* I(W) (`isotropy`): isotropy" in table_md

    # perplexity: fairseq-eval-lm's total and its own per-token scores, grouped by the same ids
    ev = _eval_lm(lm_data_bin, ck_last, "--tokens-per-sample", "64", "--max-tokens", "512", "--output-word-probs")
    ppl_total = ev["ppl"]
    ref = _group_ppl_reference(ev["words"], d)
    ppl = report["checkpoints"][1]["ppl"]
    assert ppl["total"]["ppl"] == pytest.approx(ppl_total, abs=0.006)  # eval-lm prints 2 decimals
    assert ppl["total"]["tokens"] == ref["total"][1]
    for g in G.GROUP_NAMES:
        assert ppl["groups"][g]["tokens"] == ref[g][1]
        assert ppl["groups"][g]["ppl"] == pytest.approx(ref[g][0], rel=1e-4)
        assert ppl["groups"][g]["nll"] == pytest.approx(math.log(ppl["groups"][g]["ppl"]), rel=1e-12)
    # rare tokens are the hardest for a barely trained model
    assert ppl["groups"]["rare"]["ppl"] > ppl["groups"]["freq"]["ppl"]

    for name in ("spectrum.png", "projection.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000
    import matplotlib.image

    img = matplotlib.image.imread(str(out / "projection.png"))
    assert img.shape[1] > 1.5 * img.shape[0]  # one panel per checkpoint, side by side
    assert img[..., :3].std() > 0.05  # not blank


def test_mt_checkpoint_in_process_against_generate_score_reference(mt_ckpt, mt_data_bin, tmp_path):
    path = mt_ckpt
    report = A.analyze([str(path)], data=mt_data_bin, split="test", out=str(tmp_path / "out"), device="cpu",
                       figures=False)
    (ck,) = report["checkpoints"]
    assert ck["task"] == "translation" and list(ck["matrices"]) == ["enc"]  # --share-all-embeddings
    assert ck["matrices"]["enc"]["tied"] == ["decoder.embed_tokens.weight", "decoder.output_projection.weight"]
    tgt = Dictionary.load(os.path.join(mt_data_bin, "dict.de.txt"))
    W = checkpoint_utils.load_checkpoint_to_cpu(str(path))["model"]["encoder.embed_tokens.weight"]
    _check_matrix_entry(ck["matrices"]["enc"], W, tgt)
    assert not os.path.exists(tmp_path / "out" / "spectrum.png")

    # reference: fairseq-generate --score-reference prints base-2 scores of the reference tokens;
    # --required-batch-size-multiple 1, or fairseq drops a last batch of < 8 sentences (fairseq#5036)
    gen = fr.run_cli("fairseq-generate", [mt_data_bin, "--user-dir", fr.USER_DIR, "--path", path, "--gen-subset", "test",
                                          "--score-reference", "--max-tokens", "600", "--required-batch-size-multiple",
                                          "1", "--cpu"])
    targets, scores = {}, {}
    for line in gen.stdout.splitlines():
        if line.startswith("T-"):
            i, sent = line[2:].split("\t", 1)
            targets[i] = sent.split() + ["</s>"]
        elif line.startswith("P-"):
            i, s = line[2:].split("\t", 1)
            scores[i] = [float(x) * math.log(2) for x in s.split()]
    assert len(targets) == 100 and set(targets) == set(scores)
    words = [wp for i in targets for wp in zip(targets[i], scores[i])]
    ref = _group_ppl_reference(words, tgt)
    ppl = ck["ppl"]
    assert ppl["split"] == "test" and ppl["total"]["tokens"] == ref["total"][1]
    assert ppl["total"]["ppl"] == pytest.approx(ref["total"][0], rel=1e-3)  # generate prints 4 decimals
    for g in G.GROUP_NAMES:
        assert ppl["groups"][g]["tokens"] == ref[g][1]
        assert ppl["groups"][g]["ppl"] == pytest.approx(ref[g][0], rel=1e-3)


def _main_error(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        cli.analyze_main([str(a) for a in argv])
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_clear_errors(lm_ckpts, lm_data_bin, tmp_path, capsys):
    good = lm_ckpts / "checkpoint_last.pt"
    out = tmp_path / "o"
    assert "checkpoint not found: " in _main_error(capsys, [tmp_path / "missing.pt", "--out", out])
    assert "is a directory" in _main_error(capsys, [lm_ckpts, "--out", out])
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint at all")
    assert "is not a readable fairseq checkpoint" in _main_error(capsys, [junk, "--out", out])
    state = torch.load(str(good), map_location="cpu", weights_only=False)  # the file as fairseq wrote it
    for key in [k for k in state["model"] if "embed_tokens" in k or "output_projection" in k]:
        del state["model"][key]
    no_emb = tmp_path / "no_embeddings.pt"
    torch.save(state, no_emb)
    assert "has no token-embedding matrix" in _main_error(capsys, [no_emb, "--out", out])
    assert "--data: not a directory" in _main_error(capsys, [good, "--data", tmp_path / "nodata", "--out", out])
    assert "--group-fractions: expected three fractions" in _main_error(
        capsys, [good, "--group-fractions", "0.5,0.5,0.5", "--out", out])
    assert "--group-preset wikitext103-official" in _main_error(
        capsys, [good, "--data", lm_data_bin, "--no-ppl", "--group-preset", "wikitext103-official", "--out", out])
    assert "--labels: got 2 labels for 1 checkpoints" in _main_error(capsys, [good, "--labels", "a", "b", "--out", out])
    assert not os.path.exists(out)  # nothing written on error
    # the same command through the fairseq-agg dispatcher
    with pytest.raises(SystemExit) as exc:
        cli.main(["analyze", "--help"])
    assert exc.value.code == 0 and "fairseq-agg-analyze" in capsys.readouterr().out


def test_outputs_are_checked_before_any_work(lm_ckpts, tmp_path, capsys):
    good = lm_ckpts / "checkpoint_last.pt"
    assert "--out must name a directory, got an empty path" in _main_error(capsys, [good, "--out", ""])
    assert f"--out {good} is a file; name a directory" in _main_error(capsys, [good, "--out", good])
    below_a_file = good / "analysis"
    assert f"--out {below_a_file}: {good} is a file, not a directory" in _main_error(
        capsys, [good, "--out", below_a_file])
    # an output file that is one of the inputs (here a word-similarity list named table.md)
    out = tmp_path / "o"
    out.mkdir()
    pairs = out / "table.md"
    pairs.write_text("w1\tw2\t3.0\n")
    assert f"--out {pairs} is one of the inputs; it would be overwritten" in _main_error(
        capsys, [good, "--word-sim", pairs, "--out", out])
    assert sorted(os.listdir(out)) == ["table.md"] and pairs.read_text() == "w1\tw2\t3.0\n"


def test_an_unusable_checkpoint_is_one_line_and_writes_nothing(lm_ckpts, tmp_path):
    good = lm_ckpts / "checkpoint_last.pt"
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:5000])
    out = tmp_path / "analysis"
    proc = fr.run_cli("fairseq-agg-analyze", [good, truncated, "--out", out, "--cpu"], expect_ok=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith(
        f"fairseq-agg-analyze: error: {truncated} is not a readable fairseq checkpoint (")
    assert not [line for line in proc.stderr.splitlines() if "error" in line.lower()][:-1]
    assert not out.exists()


def test_any_word_similarity_list_file(lm_ckpts, lm_data_bin, tmp_path):
    """--word-sim takes any 'word1<TAB>word2<TAB>score' file, under any name and path."""
    lists = tmp_path / "my lists"
    lists.mkdir()
    own = lists / "own pairs.v2.tsv"
    own.write_text("# my own pairs\nw1\tw2\t3.5\nw3\tw4\t1.0\nw5\tw9\t8.0\nw2\tw7\t2.5\n", encoding="utf-8")
    other = tmp_path / "other-list.txt"
    other.write_text("w0\tw1\t1\nw4\tw8\t2\nw6\tw3\t3\n", encoding="utf-8")
    out = tmp_path / "analysis"
    proc = fr.run_cli("fairseq-agg-analyze", [lm_ckpts / "checkpoint_last.pt", "--data", lm_data_bin, "--no-ppl",
                                              "--no-figures", "--cpu", "--out", out, "--word-sim", own, other])
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["word_sim"] == [str(own), str(other)]
    scores = report["checkpoints"][0]["word_similarity"]
    assert list(scores) == ["own pairs.v2", "other-list"]
    assert scores["own pairs.v2"]["dec"]["single"]["pairs"] == 4 and scores["other-list"]["dec"]["single"]["pairs"] == 3
    assert "ws_own pairs.v2" in report["table"]["columns"] and "ws_other-list_sub" in proc.stdout


# ----------------------------------------------------------------------------------------------
# --context-window / --tokens-per-sample: the same tokens and total loss as fairseq-eval-lm


@pytest.fixture(scope="module")
def mt_ckpt(mt_data_bin, tmp_path_factory):
    """A tiny translation checkpoint (label-smoothed training, 6 updates)."""
    ckpt = tmp_path_factory.mktemp("analyze_mt") / "ckpt"
    fr.run_cli("fairseq-train", [mt_data_bin, "--save-dir", ckpt, "--max-update", "6", "--criterion",
                                 "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--no-epoch-checkpoints"]
               + fr.TINY_MT_ARGS)
    return ckpt / "checkpoint_last.pt"


def _eval_lm(data_bin, ckpt, *flags):
    """A real ``fairseq-eval-lm`` run on the valid split: its printed base-2 loss, perplexity,
    number of evaluated tokens and (with --output-word-probs) its (word, natural-log prob) pairs."""
    ev = fr.run_cli("fairseq-eval-lm", [data_bin, "--user-dir", fr.USER_DIR, "--path", ckpt, "--gen-subset", "valid",
                                        "--cpu"] + [str(f) for f in flags])
    text = ev.stdout + ev.stderr
    m = re.search(r"Loss \(base 2\): ([0-9.]+), Perplexity: ([0-9.]+)", text)
    words = []
    for line in text.splitlines():  # "<logger prefix>eval_lm:<sample id> w1 [logp]\tw2 [logp] ..."
        w = re.search(r"eval_lm(?::| \| )(\d+) (.*)$", line)
        if w:
            words += [(word, float(p)) for word, p in re.findall(r"(\S+) \[(-?\d+\.\d+)\]", w.group(2))]
    tokens = int(re.search(r"Evaluated ([0-9,]+) tokens", text).group(1).replace(",", ""))
    return {"loss": float(m.group(1)), "ppl": float(m.group(2)), "tokens": tokens, "words": words}


@pytest.mark.parametrize("context_window,tokens_per_sample", [(40, None), (24, 48)])
def test_context_window_scores_like_eval_lm(lm_ckpts, lm_data_bin, tmp_path, context_window, tokens_per_sample):
    ck = lm_ckpts / "checkpoint_last.pt"  # trained with --tokens-per-sample 64
    tps = tokens_per_sample or 64
    d = Dictionary.load(os.path.join(lm_data_bin, "dict.txt"))
    ppl = {}
    for ctx in (0, context_window):
        argv = [ck, "--data", lm_data_bin, "--out", tmp_path / f"ctx{ctx}", "--cpu", "--no-figures",
                "--context-window", ctx, "--max-tokens", "100"]  # other batches than eval-lm's: same scores
        if tokens_per_sample:
            argv += ["--tokens-per-sample", tokens_per_sample]
        assert cli.analyze_main([str(a) for a in argv]) == 0
        report = json.loads((tmp_path / f"ctx{ctx}" / "report.json").read_text())
        assert report["settings"]["context_window"] == ctx
        assert report["settings"]["tokens_per_sample"] == tokens_per_sample
        p = ppl[ctx] = report["checkpoints"][0]["ppl"]
        assert p["context_window"] == ctx and p["tokens_per_sample"] == tps
        ev = _eval_lm(lm_data_bin, ck, "--tokens-per-sample", tps, "--context-window", ctx, "--batch-size", 3,
                      "--output-word-probs")
        # the same tokens, the same mean loss (eval-lm prints 4 decimals of the base-2 loss)
        assert p["total"]["tokens"] == ev["tokens"] == len(ev["words"])
        assert p["total"]["nll"] / math.log(2) == pytest.approx(ev["loss"], abs=6e-5)
        assert p["total"]["ppl"] == pytest.approx(ev["ppl"], abs=0.006)
        # the groups and the ungrouped tokens (</s>: no frequency group) split those same NLLs
        parts = list(p["groups"].values()) + [p["ungrouped"]]
        assert p["ungrouped"]["tokens"] > 0
        assert sum(e["tokens"] for e in parts) == p["total"]["tokens"]
        assert sum(e["tokens"] * e["nll"] for e in parts) == pytest.approx(p["total"]["tokens"] * p["total"]["nll"],
                                                                           rel=1e-12)
        ref = _group_ppl_reference(ev["words"], d)  # eval-lm's own per-token scores, grouped
        for g in G.GROUP_NAMES:
            assert p["groups"][g]["tokens"] == ref[g][1]
            assert p["groups"][g]["ppl"] == pytest.approx(ref[g][0], rel=1e-4)
    # the context window changes which context each token sees, hence the scores
    assert ppl[context_window]["total"]["tokens"] == ppl[0]["total"]["tokens"]
    assert abs(ppl[context_window]["total"]["nll"] - ppl[0]["total"]["nll"]) > 1e-3


def test_context_window_errors(lm_ckpts, lm_data_bin, mt_ckpt, mt_data_bin, tmp_path, capsys):
    lm = lm_ckpts / "checkpoint_last.pt"  # tokens_per_sample 64
    out = tmp_path / "o"
    assert "--context-window must be in [0, 64) (the tokens_per_sample of " in _main_error(
        capsys, [lm, "--data", lm_data_bin, "--context-window", 64, "--out", out])
    assert "--context-window must be in [0, tokens_per_sample), got -1" in _main_error(
        capsys, [lm, "--data", lm_data_bin, "--context-window", -1, "--out", out])
    assert "--context-window must be in [0, 32) (--tokens-per-sample 32), got 40" in _main_error(
        capsys, [lm, "--data", lm_data_bin, "--context-window", 40, "--tokens-per-sample", 32, "--out", out])
    assert "--tokens-per-sample must be >= 1, got 0" in _main_error(
        capsys, [lm, "--data", lm_data_bin, "--tokens-per-sample", 0, "--out", out])
    assert "pass --data DATA_BIN (without --no-ppl)" in _main_error(capsys, [lm, "--context-window", 8, "--out", out])
    err = _main_error(capsys, [mt_ckpt, "--data", mt_data_bin, "--context-window", 8, "--out", out])
    assert "--context-window applies to language-model checkpoints" in err and "'translation'" in err
    err = _main_error(capsys, [mt_ckpt, "--data", mt_data_bin, "--tokens-per-sample", 64, "--out", out])
    assert "--tokens-per-sample applies to language-model checkpoints" in err
    assert not os.path.exists(out)  # nothing written on error


# ----------------------------------------------------------------------------------------------
# every token of a split is scored (issue #49): fairseq drops a last batch that is not a multiple of
# --required-batch-size-multiple


@pytest.mark.parametrize("context_window", [0, 8])
def test_every_token_of_the_split_is_scored(lm_data_bin, context_window):
    """The scoring of fairseq-agg-analyze and the study (perplexity.group_perplexity) on the tiny
    test split, in 30-token blocks: its sample count is not a multiple of 8, so fairseq's default
    batch-size multiple would drop the last batch; the scored tokens are the split's, in 2-block
    batches (the recipe's eval-lm batch) and in the default token batches."""
    from fairseq.data import data_utils

    from fairseq_agg.analysis.perplexity import group_perplexity

    _, task, model, _ = fr.build_parts(lm_data_bin, fr.TINY_LM_ARGS, ["--tokens-per-sample", "30"], splits=("test",))
    d = task.target_dictionary
    split = data_utils.load_indexed_dataset(os.path.join(lm_data_bin, "test"), d)  # kept: its sizes are mapped
    split_tokens = int(split.sizes.sum())
    blocks = task.dataset("test")  # 30-token blocks: the scored blocks are 30 - context_window long
    samples = math.ceil(split_tokens / (30 - context_window))
    if context_window == 0:
        assert len(blocks) == samples
        kept = task.get_batch_iterator(dataset=blocks, max_sentences=2, required_batch_size_multiple=8,
                                       num_workers=0).next_epoch_itr(shuffle=False)
        assert sum(len(batch["id"]) for batch in kept) < samples  # what fairseq's default would score
    assert samples % 8 != 0, samples
    groups = G.frequency_groups(d)
    for batching in ({"batch_size": 2}, {}):
        scored = group_perplexity(model, task, "test", groups, device="cpu", context_window=context_window,
                                  **batching)
        assert scored["total"]["tokens"] == split_tokens, batching
