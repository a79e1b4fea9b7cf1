"""fairseq's multilingual translation tasks with the counting criteria (issue #56, item 2):
AGG's window and FACE's counts are kept per target dictionary
(fairseq_agg/fairseq_facts/target_vocabularies.py).

``multilingual_translation`` splits its dictionaries (one per target language, here de and fr of
different sizes): each language pair's targets are counted into its own target language's window,
checked against a hand count of one real batch, and the windows round-trip through the
criterion's checkpoint state. ``translation_multi_simple_epoch`` shares one dictionary (with
language tokens): one window, checked the same way. Both train 2 updates in a real
``fairseq-train``; a criterion that keeps no per-dictionary state is refused at start-up.
"""
import os

import pytest
import torch

from fairseq_runs import USER_DIR, build_parts, criterion_from_flags, first_batch, run_cli
from in_process import run_in_process
from synthetic_text import markov_sentences, write_lines

TINY = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
        "--encoder-ffn-embed-dim", "32", "--decoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2",
        "--decoder-attention-heads", "2", "--max-tokens", "300", "--optimizer", "adam", "--lr", "0.005",
        "--dropout", "0", "--seed", "1", "--cpu", "--num-workers", "0", "--log-interval", "1", "--no-progress-bar"]
SPLIT_ARGS = ["--task", "multilingual_translation", "--lang-pairs", "en-de,en-fr",
              "--arch", "multilingual_transformer_iwslt_de_en"] + TINY
AGG = ["--criterion", "cross_entropy_agg"]


def preprocess(args):
    """``fairseq-preprocess ARGS`` in this process (its console script's function; 5 data-bins here)."""
    from fairseq_cli import preprocess as command

    outcome = run_in_process("fairseq-preprocess", command.cli_main, args + ["--workers", "1"])
    assert outcome.returncode == 0, outcome.stderr[-3000:]


@pytest.fixture(scope="module")
def multilingual_bins(tmp_path_factory):
    """(split data-bin: a dictionary per language, de with more types than fr; shared data-bin: one
    dictionary for en, de and fr, and its language list)."""
    root = str(tmp_path_factory.mktemp("multilingual"))
    raw = os.path.join(root, "raw")
    os.makedirs(raw)
    source = markov_sentences(160, n_words=40, seed=3, max_len=8, prefix="en")
    targets = {"de": [" ".join("de" + w[2:] for w in s.split()) for s in source],
               "fr": [" ".join(f"fr{int(w[2:]) % 15}" for w in s.split()) for s in source]}
    for lang, lines in targets.items():
        for split, (a, b) in {"train": (0, 120), "valid": (120, 160)}.items():
            write_lines(f"{raw}/{split}.en-{lang}.en", source[a:b])
            write_lines(f"{raw}/{split}.en-{lang}.{lang}", lines[a:b])
    write_lines(f"{raw}/all.txt", source[:120] + targets["de"][:120] + targets["fr"][:120])
    split_bin, shared_bin = os.path.join(root, "split_bin"), os.path.join(root, "shared_bin")
    preprocess(["--only-source", "--trainpref", f"{raw}/all.txt", "--destdir", f"{root}/joined"])
    for lang in targets:
        pair = ["--source-lang", "en", "--target-lang", lang, "--trainpref", f"{raw}/train.en-{lang}",
                "--validpref", f"{raw}/valid.en-{lang}"]
        own_source = ["--srcdict", f"{split_bin}/dict.en.txt"] if lang == "fr" else []
        preprocess(pair + ["--destdir", split_bin] + own_source)
        preprocess(pair + ["--destdir", shared_bin, "--srcdict", f"{root}/joined/dict.txt",
                           "--tgtdict", f"{root}/joined/dict.txt"])
    write_lines(f"{root}/langs.txt", ["en", "de", "fr"])
    return split_bin, shared_bin, f"{root}/langs.txt"


def shared_args(langs):
    return ["--task", "translation_multi_simple_epoch", "--lang-pairs", "en-de,en-fr", "--lang-dict", langs,
            "--encoder-langtok", "src", "--decoder-langtok", "--arch", "transformer", "--share-all-embeddings"] + TINY


def hand_count(sample, pad, vocab):
    """The non-padding target ids of ``sample``, counted one by one."""
    counts = torch.zeros(vocab, dtype=torch.int64)
    for token in sample["target"].reshape(-1).tolist():
        if token != pad:
            counts[token] += 1
    return counts


def test_multilingual_translation_counts_per_target_dictionary_and_round_trips(multilingual_bins):
    split_bin = multilingual_bins[0]
    cfg, task, model, agg = build_parts(split_bin, SPLIT_ARGS, AGG)
    face = criterion_from_flags(task, split_bin, SPLIT_ARGS, ["--criterion", "cross_entropy_face",
                                                              "--face-frequency", "gt"])
    sizes = {lang: len(task.dicts[lang]) for lang in ("de", "fr")}
    assert sizes["de"] > sizes["fr"]
    assert {name: a.counter.counts.numel() for name, a in agg.aggs.items()} == {"window_de": sizes["de"],
                                                                                "window_fr": sizes["fr"]}
    assert {name: f.counter.counts.numel() for name, f in face.faces.items()} == {"counter_de": sizes["de"],
                                                                                  "counter_fr": sizes["fr"]}
    sample = first_batch(task)
    assert set(sample) == {"en-de", "en-fr"}
    from fairseq import optim

    model.train()
    for criterion in (agg, face):
        optimizer = optim.build_optimizer(cfg.optimizer, list(model.parameters()) + list(criterion.parameters()))
        task.train_step(sample, model, criterion, optimizer, update_num=0)  # each pair's loss through the criterion
    for lang in ("de", "fr"):
        expected = hand_count(sample[f"en-{lang}"], task.dicts[lang].pad(), sizes[lang])
        assert expected.sum() > 0
        assert torch.equal(agg.aggs[f"window_{lang}"].counter.counts, expected)
        expected[task.dicts[lang].eos()] = 0  # FACE's released code never counts the end of sentence
        assert torch.equal(face.faces[f"counter_{lang}"].counter.counts, expected)

    state = agg.state_dict()
    assert {key.split(".")[0] for key in state} == {"state_anchor", "window_de", "window_fr"}
    restored = task.build_criterion(cfg.criterion)
    restored.load_state_dict(state)
    for name in ("window_de", "window_fr"):
        assert torch.equal(restored.aggs[name].counter.counts, agg.aggs[name].counter.counts)

    from fairseq_agg.errors import UsageError

    with pytest.raises(UsageError, match="cross_entropy_unlikelihood does not support one target dictionary per "
                                         "language .*target languages de, fr"):
        criterion_from_flags(task, split_bin, SPLIT_ARGS, ["--criterion", "cross_entropy_unlikelihood"])

    # the start-up check reads every language pair's decoder, not only the first one's
    assert agg.check_model(model) is model.models["en-de"].decoder.output_projection.weight
    fr_decoder = model.models["en-fr"].decoder
    fr_decoder.output_projection = torch.nn.Linear(16, len(task.dicts["fr"]) + 1, bias=False)
    with pytest.raises(UsageError, match=f"^language pair en-fr: the output projection has {sizes['fr'] + 1} rows "
                                         f"but the target dictionary has {sizes['fr']}$"):
        agg.check_model(model)
    fr_decoder.output_projection = torch.nn.Linear(16, sizes["fr"], bias=True)
    with pytest.raises(UsageError, match="^language pair en-fr: output projections with a bias are not supported"):
        agg.check_model(model)


def test_translation_multi_simple_epoch_counts_in_its_one_dictionary(multilingual_bins):
    _, shared_bin, langs = multilingual_bins
    cfg, task, model, agg = build_parts(shared_bin, shared_args(langs), AGG)
    assert list(agg.aggs) == ["window"]
    sample = first_batch(task)
    model.train()
    agg.set_update_num(0)
    agg(model, sample)[0].backward()
    dictionary = task.target_dictionary
    expected = hand_count(sample, dictionary.pad(), len(dictionary))
    assert expected.sum() > 0 and torch.equal(agg.agg.counter.counts, expected)


@pytest.mark.parametrize("task_name", ["multilingual_translation", "translation_multi_simple_epoch"])
def test_both_tasks_train_two_updates(multilingual_bins, tmp_path, task_name):
    split_bin, shared_bin, langs = multilingual_bins
    data, args = (split_bin, SPLIT_ARGS) if task_name == "multilingual_translation" else (shared_bin,
                                                                                        shared_args(langs))
    proc = run_cli("fairseq-train", [data, "--user-dir", USER_DIR] + args + AGG + [
        "--max-update", "2", "--save-dir", str(tmp_path), "--no-epoch-checkpoints", "--agg-window", "4"])
    assert "num_updates 2" in proc.stdout + proc.stderr
    state = torch.load(tmp_path / "checkpoint_last.pt", map_location="cpu", weights_only=False)["criterion"]
    windows = {key.split(".")[0] for key in state} - {"state_anchor"}
    assert windows == ({"window_de", "window_fr"} if task_name == "multilingual_translation" else {"window"})
    if task_name == "multilingual_translation":
        # each window's operating point is read on its own language's targets: every training line
        # and its end of sentence, the 120 of each pair once (both pairs have 120: none repeats)
        raw = os.path.join(os.path.dirname(split_bin), "raw")
        for lang in ("de", "fr"):
            with open(os.path.join(raw, f"train.en-{lang}.{lang}")) as lines:
                tokens = sum(len(line.split()) + 1 for line in lines)
            line = next(line for line in (proc.stdout + proc.stderr).splitlines()
                        if f"AGG ({lang}): operating point: a type is rare below " in line)
            assert f"per epoch ({tokens:,} target tokens in 4 updates of about " in line, line

