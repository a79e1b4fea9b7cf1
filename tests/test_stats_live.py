"""Live embedding statistics: flags, schedule, and real fairseq-train runs whose json logs,
plain logs and tensorboard event files are read back and checked against the checkpoints."""
import glob
import math
import os
import re
import struct

import pytest
import torch
from fairseq import checkpoint_utils, optim, options, tasks
from fairseq.criterions import CRITERION_REGISTRY
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.logging import metrics

import fairseq_agg
import fairseq_runs as fr
from fairseq_agg.errors import UsageError
from fairseq_agg.stats import groups as G
from fairseq_agg.stats.config import EmbeddingStatsSettings
from fairseq_agg.stats.live import MARKER, EmbeddingStats, compute_embedding_stats, reduce_embedding_stats
from fairseq_agg.stats.matrices import embedding_matrices
from fairseq_agg.stats.metrics import isotropy, mean_pairwise_cosine, tev_stats

REL = 2e-5  # log files print 6 significant digits


# ------------------------------------------------------------------ helpers


def tensorboard_scalars(logdir):
    """{subdir: {tag: [(step, value)]}} from tensorboardX event files (TFRecord framing)."""
    from tensorboardX.proto import event_pb2

    out = {}
    for path in sorted(glob.glob(os.path.join(logdir, "*", "events.out.tfevents.*"))):
        tags = out.setdefault(os.path.basename(os.path.dirname(path)), {})
        with open(path, "rb") as f:
            data = f.read()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4  # length, length crc, payload, payload crc
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    tags.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def checkpoint_model(path):
    return checkpoint_utils.load_checkpoint_to_cpu(str(path))["model"]


def expected_stats(W, dictionary, groups=False, iso=True, suffix=""):
    """The logged values recomputed from the weights with the pure functions."""
    mask = G.row_mask(dictionary)
    sets = [("", mask.nonzero().reshape(-1))]
    if groups:
        for g, ids in G.frequency_groups(dictionary).items():
            gm = torch.zeros_like(mask)
            gm[ids] = True
            sets.append(("_" + g, (gm & mask).nonzero().reshape(-1)))
    out = {}
    for gsfx, rows in sets:
        sfx = suffix + gsfx
        t = tev_stats(W, rows)
        out.update({"tev_mu" + sfx: t["mu"], "tev_sigma" + sfx: t["sigma"], "tev_mu_over_init" + sfx: t["mu_over_init"]})
        out["mean_cos" + sfx] = mean_pairwise_cosine(W, rows)
        if not gsfx:  # the drift along the mean direction, by its formula: halves in dictionary order
            X = W[rows].double()
            mean = X.mean(0)
            proj, half = X @ (mean / mean.norm()), (rows.numel() + 1) // 2
            out.update({"mean_norm_share" + sfx: (mean.norm() / X.norm(dim=1).mean()).item(),
                        "drift_frequent" + sfx: proj[:half].mean().item(), "drift_rare" + sfx: proj[half:].mean().item()})
        if iso:
            r = isotropy(W, rows)
            out.update({k + sfx: r[k] for k in ("isotropy", "isotropy_raw", "isotropy_fixed")})
    return out


def assert_close(logged, expected, prefix=""):
    for key, value in expected.items():
        got = float(logged[prefix + key])
        assert got == pytest.approx(value, rel=REL, abs=1e-9), key


def records(proc):
    recs = fr.read_json_log(proc.stdout + proc.stderr)
    train_inner = {int(r["num_updates"]): r for r in recs if "num_updates" in r and "loss" in r}
    valid = {int(r["valid_num_updates"]): r for r in recs if "valid_num_updates" in r}
    epoch = [r for r in recs if "train_num_updates" in r]
    return train_inner, valid, epoch


def build(argv, with_optimizer=False):
    """A real fairseq task / model / criterion (and optimizer) from a command line, in-process."""
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, input_args=[str(a) for a in argv])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    if with_optimizer:
        return task, model, criterion, optim.build_optimizer(cfg.optimizer, list(model.parameters()))
    return task, model, criterion


def _mt_args(untied=True):
    args = list(fr.TINY_MT_ARGS)
    if untied:
        args.remove("--share-all-embeddings")
    return args


# ------------------------------------------------------------------ settings and in-process


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"embed_stats_interval": -1}, r"--embed-stats-interval must be an integer >= 0, got -1"),
        ({"embed_stats_interval": "often"}, r"--embed-stats-interval must be an integer >= 0, got 'often'"),
        ({"embed_stats_interval": 2.5}, r"--embed-stats-interval must be an integer >= 0, got 2.5"),
        ({"embed_stats_interval": math.nan}, r"--embed-stats-interval must be an integer >= 0, got nan"),
        ({"embed_stats_interval": math.inf}, r"--embed-stats-interval must be an integer >= 0, got inf"),
        ({"embed_stats_interval": True}, r"--embed-stats-interval must be an integer >= 0, got True"),
        ({"embed_isotropy_interval": -5}, r"--embed-isotropy-interval must be an integer >= 0, got -5"),
        ({"embed_stats_interval": 5, "embed_isotropy_interval": math.nan},
         r"--embed-isotropy-interval must be an integer >= 0, got nan"),
        ({"embed_group_fractions": "0.5,0.5,0.5"}, r"--embed-group-fractions: expected three fractions"),
        ({"embed_group_fractions": "nan,0.5,0.5"}, r"--embed-group-fractions: expected three fractions"),
        ({"embed_group_preset": "wiki"}, r"--embed-group-preset must be one of wikitext103-official"),
        ({"tev_matrices": "both"}, r"--tev-matrices must be one of input, output, all"),
        ({"iso_rows": "some"}, r"--iso-rows must be one of all, no-pad-madeup, no-special"),
        ({"tev_init_std": 0.0}, r"--tev-init-std must be > 0, got 0.0"),
        ({"embed_stats_interval": 5, "tev_init_std": math.inf}, r"--tev-init-std must be > 0, got inf"),
        ({"embed_stats_interval": 5, "tev_init_std": -math.nan}, r"--tev-init-std must be > 0, got nan"),
    ],
)
def test_bad_settings_name_the_flag(kwargs, message):
    with pytest.raises(UsageError, match=message) as e:
        EmbeddingStatsSettings(**kwargs)
    assert "\n" not in str(e.value)


OFF = "has no effect while --embed-stats-interval is 0 \\(statistics off\\): give --embed-stats-interval N > 0 too"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tev_effective": True}, r"^--tev-effective " + OFF),
        ({"embed_stats_groups": True}, r"^--embed-stats-groups " + OFF),
        ({"no_embed_stats_valid": True}, r"^--no-embed-stats-valid " + OFF),
        ({"tev_init_std": 0.05}, r"^--tev-init-std 0.05 " + OFF),
        ({"iso_rows": "all"}, r"^--iso-rows all " + OFF),
        ({"tev_matrices": "output"}, r"^--tev-matrices output " + OFF),
        ({"embed_group_fractions": "0.2,0.5,0.3"}, r"^--embed-group-fractions 0.2,0.5,0.3 " + OFF),
        ({"embed_group_preset": "wikitext103-official"}, r"^--embed-group-preset wikitext103-official " + OFF),
        ({"embed_isotropy_interval": 0}, r"^--embed-isotropy-interval 0 " + OFF),
        # isotropy alone (--embed-isotropy-interval > 0): the TEV flags have no effect
        ({"embed_isotropy_interval": 5, "tev_exclude_special": True},
         r"^--tev-exclude-special has no effect \(it changes TEV\) while --embed-stats-interval is 0 "
         r"\(only isotropy, every 5 updates\): give --embed-stats-interval N > 0 too"),
        ({"embed_isotropy_interval": 5, "tev_init_std": 0.1}, r"^--tev-init-std 0.1 has no effect \(it changes TEV\)"),
        # statistics on, not split by group: the group definition has no effect (issue #49)
        ({"embed_stats_interval": 5, "embed_group_preset": "wikitext103-official"},
         r"^--embed-group-preset wikitext103-official has no effect without --embed-stats-groups \(no statistic is "
         r"split by frequency group\): give --embed-stats-groups too, or leave it out$"),
        ({"embed_isotropy_interval": 5, "embed_group_fractions": "0.2,0.5,0.3"},
         r"^--embed-group-fractions 0.2,0.5,0.3 has no effect without --embed-stats-groups"),
    ],
)
def test_flags_without_effect_name_both_flags(kwargs, message):
    with pytest.raises(UsageError, match=message):
        EmbeddingStatsSettings(**kwargs)


def test_flags_with_effect_are_accepted():
    # the defaults given explicitly, in another spelling, are no change
    off = EmbeddingStatsSettings(embed_group_fractions="0.3, 0.5, 0.2", tev_matrices="all",
                                 embed_isotropy_interval=None)
    assert not off.enabled
    iso_only = EmbeddingStatsSettings(embed_isotropy_interval=5, embed_stats_groups=True, iso_rows="all",
                                      tev_matrices="output", no_embed_stats_valid=True)
    assert (iso_only.interval, iso_only.iso_interval, iso_only.groups, iso_only.valid) == (0, 5, True, False)
    on = EmbeddingStatsSettings(embed_stats_interval=3, tev_effective=True, tev_init_std=0.05, embed_stats_groups=True)
    assert (on.iso_interval, on.effective, on.init_std) == (30, True, 0.05)
    grouped = EmbeddingStatsSettings(embed_stats_interval=3, embed_stats_groups=True,
                                     embed_group_fractions="0.2,0.5,0.3")
    assert grouped.fractions == (0.2, 0.5, 0.3)
    preset = EmbeddingStatsSettings(embed_isotropy_interval=5, embed_stats_groups=True,
                                    embed_group_preset="wikitext103-official")
    assert preset.preset == "wikitext103-official"


def test_group_flags_serve_agg_freezing_with_statistics_off(lm_data_bin):
    """--agg-freeze-set group reads its static rare group from the statistics' group flags
    (docs/baselines.md), so there they have an effect with the statistics off."""
    agg = [lm_data_bin, "--user-dir", fr.USER_DIR, "--criterion", "cross_entropy_agg", "--agg-freeze-rare",
           "--embed-group-fractions", "0.2,0.5,0.3"] + fr.TINY_LM_ARGS
    _, _, criterion = build(agg + ["--agg-freeze-set", "group"])
    settings = criterion.embedding_stats.settings
    assert not settings.enabled and settings.fractions == (0.2, 0.5, 0.3)
    with pytest.raises(UsageError, match=r"^--embed-group-fractions 0.2,0.5,0.3 " + OFF):
        build(agg)  # the default --agg-freeze-set window does not read the groups
    # statistics on without --embed-stats-groups: the freezing still reads them
    _, _, criterion = build(agg + ["--agg-freeze-set", "group", "--embed-stats-interval", "5"])
    assert criterion.embedding_stats.settings.fractions == (0.2, 0.5, 0.3)
    with pytest.raises(UsageError, match=r"^--embed-group-fractions 0.2,0.5,0.3 has no effect without "
                                         r"--embed-stats-groups"):
        build(agg + ["--embed-stats-interval", "5"])


def test_isotropy_interval_defaults_to_ten_times_the_stats_interval():
    assert EmbeddingStatsSettings(embed_stats_interval=100).iso_interval == 1000
    assert EmbeddingStatsSettings(embed_stats_interval=100, embed_isotropy_interval=0).iso_interval == 0
    off = EmbeddingStatsSettings()
    assert (off.interval, off.iso_interval, off.enabled) == (0, 0, False)


def test_embedding_matrices_of_real_models(lm_data_bin, mt_data_bin):
    _, lm, _ = build([lm_data_bin] + fr.TINY_LM_ARGS)
    (m,) = embedding_matrices(lm)  # tied: one matrix
    assert m.name == "dec" and m.weight is lm.decoder.embed_tokens.weight
    assert m.embed_scale == lm.decoder.embed_scale == pytest.approx(math.sqrt(32))  # sqrt(decoder embed dim)
    _, mt, _ = build([mt_data_bin] + _mt_args(untied=True))
    mats = embedding_matrices(mt)
    assert [x.name for x in mats] == ["enc", "dec", "out"]
    assert mats[2].weight is mt.decoder.output_projection.weight and mats[2].embed_scale == 1.0
    assert [x.name for x in embedding_matrices(mt, "input")] == ["enc", "dec"]
    assert [x.name for x in embedding_matrices(mt, "output")] == ["out"]
    _, shared, _ = build([mt_data_bin] + _mt_args(untied=False))
    assert [x.name for x in embedding_matrices(shared)] == ["enc"]
    assert [x.name for x in embedding_matrices(shared, "output")] == ["enc"]


def test_off_by_default_costs_nothing(lm_data_bin):
    _, _, crit = build([lm_data_bin, "--criterion", "cross_entropy_with_stats"] + fr.TINY_LM_ARGS)
    assert isinstance(crit.embedding_stats, EmbeddingStats) and not crit.embedding_stats.settings.enabled
    with metrics.aggregate(new_root=True) as agg:
        assert crit.embedding_stats.log(object()) is None  # the model is never touched
    assert len(agg) == 0


def test_schedule_micro_batches_validation_and_stale_meters(lm_data_bin):
    """fairseq's loop in miniature (the Trainer's calls, without optimizer steps): update_freq 2,
    a log line per update, two validations."""
    task, model, crit, optimizer = build(
        [lm_data_bin, "--criterion", "cross_entropy_with_stats", "--embed-stats-interval", "2",
         "--embed-isotropy-interval", "3"] + fr.TINY_LM_ARGS, with_optimizer=True
    )
    task.load_dataset("valid")
    sample = next(iter(task.get_batch_iterator(dataset=task.dataset("valid"), max_tokens=256).next_epoch_itr(shuffle=False)))
    metrics.reset()
    state = crit.embedding_stats
    lines = {}
    model.train()
    for update in range(1, 7):
        with metrics.aggregate("train_inner"), metrics.aggregate("train"):
            logging_outputs = [task.train_step(sample, model, crit, optimizer, update_num=update - 1)[2]
                               for _ in range(2)]  # two micro-batches
            metrics.log_scalar("num_updates", update, weight=0, priority=200)  # as Trainer.set_num_updates
            task.reduce_metrics(logging_outputs, crit)  # as Trainer._reduce_and_log_stats
        lines[update] = metrics.get_smoothed_values("train_inner")
        metrics.reset_meters("train_inner")
    assert state.update_num == 5  # the update_num fairseq passed to task.train_step for update 6
    assert {u for u, line in lines.items() if "tev_mu" in line} == {2, 4, 6}
    assert {u for u, line in lines.items() if "isotropy" in line} == {3, 6}
    assert all(v is not None for line in lines.values() for v in line.values())
    assert state.measurements == 4  # updates 2, 3, 4, 6: once each despite two micro-batches
    expected = expected_stats(model.decoder.embed_tokens.weight.detach(), task.target_dictionary)
    assert_close(lines[6], expected)
    assert metrics.get_smoothed_values("train")["tev_mu"] == pytest.approx(expected["tev_mu"])
    model.eval()
    for _ in range(2):  # two validation passes of three batches each
        with metrics.aggregate(new_root=True) as agg:
            for _ in range(3):
                with metrics.aggregate("valid"):
                    task.reduce_metrics([task.valid_step(sample, model, crit)[2]], crit)  # as Trainer.valid_step
        assert_close(agg.get_smoothed_values(), expected)
    assert state.measurements == 6


def test_other_ranks_send_the_same_keys_with_zeros(lm_data_bin):
    """fairseq sums logging outputs key by key over the data-parallel ranks (all-reduce): rank 0's
    values plus the other ranks' zeros, divided by the count, are rank 0's values."""
    _, model, crit = build([lm_data_bin, "--criterion", "cross_entropy_with_stats", "--embed-stats-interval", "1",
                            "--embed-stats-groups"] + fr.TINY_LM_ARGS)
    st = crit.embedding_stats
    rank0 = compute_embedding_stats(model, st.settings, st.dictionaries)
    other = compute_embedding_stats(model, st.settings, st.dictionaries, measure=False)
    assert list(other) == list(rank0) and "isotropy_rare" in rank0 and set(other.values()) == {0.0}
    summed = {key: rank0[key] + other[key] for key in rank0}
    summed[MARKER] = 1 + 0
    with metrics.aggregate(new_root=True) as agg:
        reduce_embedding_stats([summed])
    assert agg.get_smoothed_values() == pytest.approx(dict(rank0), rel=1e-15)


# ------------------------------------------------------------------ end-to-end


@pytest.fixture(scope="module")
def lm_run(lm_data_bin, tmp_path_factory):
    root = tmp_path_factory.mktemp("stats_lm")
    common = [lm_data_bin, "--user-dir", fr.USER_DIR, "--save-dir", root / "ckpt", "--criterion",
              "cross_entropy_with_stats", "--embed-stats-interval", "3", "--embed-isotropy-interval", "6",
              "--embed-stats-groups", "--update-freq", "2", "--save-interval-updates", "5",
              "--log-format", "json", "--tensorboard-logdir", root / "tb"] + fr.TINY_LM_ARGS
    first = fr.run_cli("fairseq-train", common + ["--max-update", "12"])
    weights_12 = checkpoint_model(root / "ckpt" / "checkpoint_last.pt")["decoder.embed_tokens.weight"].clone()
    resumed = fr.run_cli("fairseq-train", common + ["--max-update", "15"])  # resumes checkpoint_last.pt
    return {"root": root, "first": first, "resumed": resumed, "weights_12": weights_12}


def test_lm_json_schedule_and_values(lm_run, lm_data_bin):
    from fairseq.data import Dictionary

    train_inner, valid, epoch = records(lm_run["first"])
    assert sorted(train_inner) == list(range(1, 13))
    assert {u for u, r in train_inner.items() if "tev_mu" in r} == {3, 6, 9, 12}
    assert {u for u, r in train_inner.items() if "isotropy" in r} == {6, 12}
    assert sorted(valid) == [5, 10, 12] and all("valid_isotropy_rare" in r for r in valid.values())
    for rec in list(train_inner.values()) + list(valid.values()) + epoch:
        assert all(v is not None and v != "None" for v in rec.values())
    d = Dictionary.load(os.path.join(lm_data_bin, "dict.txt"))
    ckpt = lm_run["root"] / "ckpt"
    w5 = checkpoint_model(ckpt / "checkpoint_1_5.pt")["decoder.embed_tokens.weight"]
    exp5 = expected_stats(w5, d, groups=True)
    # the forward of update 6 sees the weights after 5 updates = checkpoint_1_5.pt
    assert_close(train_inner[6], exp5)
    assert_close(valid[5], exp5, prefix="valid_")
    assert_close(valid[12], expected_stats(lm_run["weights_12"], d, groups=True), prefix="valid_")
    # the epoch summary shows the latest measurement (update 12), not an average
    assert float(epoch[-1]["train_tev_mu"]) == pytest.approx(float(train_inner[12]["tev_mu"]), rel=REL)
    assert float(epoch[-1]["train_isotropy"]) == pytest.approx(float(train_inner[12]["isotropy"]), rel=REL)


def test_lm_tensorboard_event_files(lm_run):
    tb = tensorboard_scalars(lm_run["root"] / "tb")
    train_inner, valid, _ = records(lm_run["first"])
    inner = [(s, v) for s, v in tb["train_inner"]["tev_mu"] if s <= 12]
    assert [s for s, _ in inner] == [3, 6, 9, 12]
    for step, value in inner:
        assert value == pytest.approx(float(train_inner[step]["tev_mu"]), rel=REL)
    assert [s for s, _ in tb["train_inner"]["isotropy_med"] if s <= 12] == [6, 12]
    assert [s for s, _ in tb["valid"]["tev_mu"] if s <= 12] == [5, 10, 12]
    assert dict(tb["valid"]["isotropy"])[10] == pytest.approx(float(valid[10]["valid_isotropy"]), rel=REL)
    assert dict(tb["train"]["tev_sigma_rare"])[12] == pytest.approx(float(train_inner[12]["tev_sigma_rare"]), rel=REL)


def test_lm_resume_from_checkpoint(lm_run):
    train_inner, valid, epoch = records(lm_run["resumed"])
    assert sorted(train_inner) == [13, 14, 15]
    # the metrics state in checkpoint_last.pt (with these meters) loaded back; no stale values
    for rec in list(train_inner.values()) + list(valid.values()) + epoch:
        assert all(v is not None and v != "None" for v in rec.values())
    assert {u for u, r in train_inner.items() if "tev_mu" in r} == {15}
    assert "valid_tev_mu" in valid[15]


def _plain_fields(line):
    return dict(re.findall(r"(\w+)[= ]([-+0-9.eE]+)(?:,|\s\||$)", line))


def test_fairseq_validate_logs_every_subset(lm_run, lm_data_bin):
    from fairseq.data import Dictionary

    path = lm_run["root"] / "ckpt" / "checkpoint_last.pt"
    proc = fr.run_cli("fairseq-validate", [lm_data_bin, "--user-dir", fr.USER_DIR, "--path", path, "--task",
                                           "language_modeling", "--tokens-per-sample", "64", "--max-tokens", "512",
                                           "--valid-subset", "valid,test", "--cpu"])
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "subset |" in line]
    assert [re.search(r"valid on '(\w+)' subset", line).group(1) for line in lines] == ["valid", "test"]
    d = Dictionary.load(os.path.join(lm_data_bin, "dict.txt"))
    expected = expected_stats(checkpoint_model(path)["decoder.embed_tokens.weight"], d, groups=True)
    for line in lines:
        assert_close(_plain_fields(line), expected)


def test_mt_untied_plain_log(mt_data_bin, tmp_path):
    from fairseq.data import Dictionary

    proc = fr.run_cli(
        "fairseq-train",
        [mt_data_bin, "--user-dir", fr.USER_DIR, "--save-dir", tmp_path / "ckpt", "--criterion",
         "label_smoothed_cross_entropy_with_stats", "--label-smoothing", "0.1", "--embed-stats-interval", "2",
         "--tev-effective", "--max-update", "4", "--log-format", "simple"] + _mt_args(untied=True),
    )
    out = proc.stdout + proc.stderr
    inner = {int(m.group(1)): line for line in out.splitlines() if "train_inner" in line
             for m in [re.search(r"num_updates=(\d+)", line)] if m}
    assert sorted(inner) == [1, 2, 3, 4]
    for u in (1, 3):
        assert "tev_mu" not in inner[u]
    for u in (2, 4):
        for key in ("tev_mu_enc=", "tev_mu_dec=", "tev_mu_out=", "mean_cos_out=", "tev_mu_eff_enc="):
            assert key in inner[u]
        assert "isotropy" not in inner[u]  # default isotropy interval: 10 x 2 updates
    (valid_line,) = [line for line in out.splitlines() if "valid on 'valid' subset" in line]
    logged = _plain_fields(valid_line)
    model = checkpoint_model(tmp_path / "ckpt" / "checkpoint_last.pt")
    src = Dictionary.load(os.path.join(mt_data_bin, "dict.en.txt"))
    tgt = Dictionary.load(os.path.join(mt_data_bin, "dict.de.txt"))
    for name, param, d in (("enc", "encoder.embed_tokens.weight", src), ("dec", "decoder.embed_tokens.weight", tgt),
                           ("out", "decoder.output_projection.weight", tgt)):
        # at validation the isotropy is computed too (its interval is > 0)
        assert_close(logged, expected_stats(model[param], d, suffix="_" + name))
    fields = _plain_fields(inner[4])
    assert float(fields["tev_mu_eff_enc"]) == pytest.approx(float(fields["tev_mu_enc"]) * math.sqrt(32), rel=REL)


def test_plugin_criterion_logs_the_same_keys(lm_data_bin, tmp_path):
    fairseq_agg.register_with_fairseq()
    assert "cross_entropy_agg" in CRITERION_REGISTRY
    from fairseq.data import Dictionary

    proc = fr.run_cli(
        "fairseq-train",
        [lm_data_bin, "--user-dir", fr.USER_DIR, "--save-dir", tmp_path / "ckpt", "--criterion",
         "cross_entropy_agg", "--embed-stats-interval", "2", "--max-update", "4", "--log-format", "json",
         "--tensorboard-logdir", tmp_path / "tb"] + fr.TINY_LM_ARGS,
    )
    train_inner, valid, _ = records(proc)
    assert {u for u, r in train_inner.items() if "tev_mu" in r} == {2, 4}
    w = checkpoint_model(tmp_path / "ckpt" / "checkpoint_last.pt")["decoder.embed_tokens.weight"]
    d = Dictionary.load(os.path.join(lm_data_bin, "dict.txt"))
    assert_close(valid[4], expected_stats(w, d), prefix="valid_")
    tb = tensorboard_scalars(tmp_path / "tb")
    assert [s for s, _ in tb["train_inner"]["mean_cos"]] == [2, 4]


def test_bad_flag_fails_at_startup_before_any_checkpoint(lm_data_bin, tmp_path):
    save = tmp_path / "ckpt"
    proc = fr.run_cli(
        "fairseq-train",
        [lm_data_bin, "--user-dir", fr.USER_DIR, "--save-dir", save, "--criterion", "cross_entropy_with_stats",
         "--embed-stats-interval", "-3", "--max-update", "2"] + fr.TINY_LM_ARGS,
        expect_ok=False,
    )
    assert proc.returncode != 0
    assert "--embed-stats-interval must be an integer >= 0, got -3" in proc.stdout + proc.stderr
    assert not glob.glob(os.path.join(save, "*.pt"))
