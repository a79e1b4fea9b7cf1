"""Live embedding-statistics logging shared by every criterion of this plugin (docs/stats.md).

What a criterion does
---------------------
1. Its config dataclass inherits :class:`~fairseq_agg.stats.config.EmbeddingStatsConfig` (the
   flags).
2. It holds an :class:`EmbeddingStats` built from its config and task (which reads and validates
   the flags) as ``self.embedding_stats``.
3. Its ``forward`` calls ``self.embedding_stats.log(model, logging_output)`` once, training and
   validation alike, and its ``reduce_metrics`` calls :func:`reduce_embedding_stats`.

Mechanism
---------
When a measurement is due, global rank 0 measures the weights and puts the values into the
logging output, with a count ``_embed_stats`` of 1; every other rank puts the same keys with 0
(fairseq sums logging outputs key by key over micro-batches and data-parallel workers, so every
rank must send the same keys). :func:`reduce_embedding_stats` logs value sum / count with
``metrics.log_scalar(key, value, weight=0)`` into fairseq's active aggregators: ``train_inner``
(one log line), ``train`` (the epoch) and, at validation, the aggregator of the validation pass.
So the values appear in the plain log line, in ``--log-format json`` records and in
``--tensorboard-logdir`` event files, like ``lr``. ``weight=0`` makes a meter show the latest value,
so a log line or an epoch summary shows the most recent measurement, never an average. A meter
that fairseq has reset after a log line is removed at the next reduction, so lines without a
measurement carry no key (rather than ``None``).

When: in training, in the forward pass of update N, 2N, ... (the update number is the one the
task's ``train_step`` receives, through :class:`fairseq_agg.fairseq_facts.training_loop.TrainingLoop`; the
weights measured are those after N−1 optimizer steps), at most once per update whatever
``--update-freq`` is; resumed runs continue the schedule. In evaluation mode (validation), once per
validation pass: the pass's aggregator is marked by a hidden ``_embed_stats`` meter (off with
``--no-embed-stats-valid``). The O(V·d²) isotropy has its own interval, by default
10 × ``--embed-stats-interval``. Off (the default) costs one attribute test per forward.

Log keys: ``tev_mu``, ``tev_sigma``, ``tev_mu_over_init`` (µTEV / d^-½, fairseq's init std),
``mean_cos`` and, where the dictionary gives the frequency order, the drift along the rows' mean
direction ``mean_norm_share``, ``drift_frequent``, ``drift_rare`` (all rows only; metrics.
mean_direction_drift, without its centred I(W)) (every ``--embed-stats-interval``),
``isotropy`` (sign-symmetric), ``isotropy_raw``,
``isotropy_fixed`` (every ``--embed-isotropy-interval``), and with ``--tev-effective``
``tev_mu_eff``, ``tev_sigma_eff`` (TEV × ``embed_scale`` of input embeddings). With several
distinct matrices every key gets a matrix suffix ``_enc`` / ``_dec`` / ``_out``; with
``--embed-stats-groups`` a group suffix ``_freq`` / ``_med`` / ``_rare`` follows.
"""
import logging
import re
from collections import OrderedDict
from typing import Dict, List, Optional

import torch
from fairseq.logging import metrics

from fairseq_agg.fairseq_facts.distributed import is_global_rank0
from fairseq_agg.fairseq_facts.meters import remove_meter
from fairseq_agg.fairseq_facts.training_loop import TrainingLoop

from . import groups as G
from .config import EmbeddingStatsSettings
from .matrices import MatrixRows, dictionary_for, embedding_matrices, matrix_rows, task_dictionaries
from .metrics import ISOTROPY_FORMS, isotropy, mean_direction_drift, mean_pairwise_cosine, tev_stats

logger = logging.getLogger(__name__)

# Hidden meter (names starting with "_" are never printed) and logging-output count of a measurement.
MARKER = "_embed_stats"
# After fairseq's own keys (train_wall is 800), before gb_free (1500).
PRIORITY = 1000

_KEY_RE = re.compile(
    r"^(tev_mu|tev_sigma|tev_mu_over_init|tev_mu_eff|tev_sigma_eff|mean_cos|isotropy|isotropy_raw|"
    r"isotropy_fixed|mean_norm_share|drift_frequent|drift_rare)(_(enc|dec|out))?(_(freq|med|rare))?$"
)


def is_stats_key(key: str) -> bool:
    """Whether ``key`` is one of the live statistics' log keys."""
    return bool(_KEY_RE.match(key))


# ----------------------------------------------------------------------------------------------
# measuring


def _tev_values(W, rows, init_std, effective_scale):
    t = tev_stats(W, rows, init_std=init_std)
    values = [t["mu"], t["sigma"], t["mu_over_init"]]
    if effective_scale is not None:
        values += [t["mu"] * effective_scale, t["sigma"] * effective_scale]
    return values


def _row_set_jobs(W, tev_rows, iso_rows, settings, effective_scale, tev, iso, drift=False):
    """``(keys, measure)`` of one row set, in log order; ``measure()`` returns the keys' values;
    ``drift``: also the rows' drift along their mean direction (rows in frequency order)."""
    jobs = []
    if tev and tev_rows.numel() > 0:
        keys = ["tev_mu", "tev_sigma", "tev_mu_over_init"]
        if effective_scale is not None:
            keys += ["tev_mu_eff", "tev_sigma_eff"]
        jobs.append((keys, lambda: _tev_values(W, tev_rows, settings.init_std, effective_scale)))
    if tev and iso_rows.numel() > 1:
        jobs.append((["mean_cos"], lambda: [mean_pairwise_cosine(W, iso_rows)]))
    if tev and drift and iso_rows.numel() > 1:
        drift_keys = ["mean_norm_share", "drift_frequent", "drift_rare"]
        jobs.append((drift_keys, lambda: [_nan_if_none(mean_direction_drift(W, iso_rows, centred=False)[k])
                                          for k in drift_keys]))
    if iso and iso_rows.numel() > 0:
        jobs.append((list(ISOTROPY_FORMS), lambda: [isotropy(W, iso_rows)[k] for k in ISOTROPY_FORMS]))
    return jobs


def _nan_if_none(value):
    return float("nan") if value is None else value


def _rows_on(rows: MatrixRows, device) -> MatrixRows:
    return MatrixRows(rows.all.to(device), OrderedDict((g, r.to(device)) for g, r in rows.groups.items()))


def _matrix_rows(mat, dictionary, settings, device):
    """(TEV rows, isotropy / mean_cos rows, whether the rows are in frequency order: a dictionary's)
    of one matrix, on ``device``."""
    num_rows = mat.weight.size(0)
    dictionary = dictionary_for(dictionary, num_rows)
    groups = None
    if settings.groups and dictionary is not None:
        groups = G.frequency_groups(dictionary, settings.fractions, settings.preset)
    tev = matrix_rows(dictionary, num_rows, settings.tev_row_policy, settings.exclude_unseen, groups, mat.padding_idx)
    iso = matrix_rows(dictionary, num_rows, settings.iso_rows, False, groups, mat.padding_idx)
    return _rows_on(tev, device), _rows_on(iso, device), dictionary is not None


def compute_embedding_stats(
    model, settings: EmbeddingStatsSettings, dictionaries: Optional[Dict[str, object]] = None,
    tev: bool = True, iso: bool = True, cache: Optional[dict] = None, measure: bool = True,
) -> "OrderedDict[str, float]":
    """All live statistics of ``model`` as ``{log key: value}`` (see the module docstring).

    ``cache`` keeps the row sets between calls; ``measure=False`` gives the same keys with 0.0
    without measuring (the other data-parallel ranks).
    """
    dictionaries = dictionaries or {}
    cache = {} if cache is None else cache
    mats = embedding_matrices(model, settings.matrices)
    out = OrderedDict()
    for mat in mats:
        W = mat.weight.detach()
        key = (mat.name, tuple(W.shape), W.device)
        if key not in cache:
            cache[key] = _matrix_rows(mat, dictionaries.get(mat.name), settings, W.device)
        tev_rows, iso_rows, frequency_order = cache[key]
        matrix_suffix = f"_{mat.name}" if len(mats) > 1 else ""
        effective_scale = mat.embed_scale if settings.effective and mat.role == "input" else None
        parts = [("", tev_rows.all, iso_rows.all)]
        parts += [(f"_{g}", rows, iso_rows.groups[g]) for g, rows in tev_rows.groups.items()]
        # the statistics choose their own precision (fp32 / fp64), also under --fp16 / --amp
        with torch.autocast(device_type=W.device.type, enabled=False):
            for group_suffix, part_tev, part_iso in parts:
                drift = frequency_order and not group_suffix  # halves of the whole vocabulary
                for keys, job in _row_set_jobs(W, part_tev, part_iso, settings, effective_scale, tev, iso, drift):
                    values = job() if measure else [0.0] * len(keys)
                    out.update((k + matrix_suffix + group_suffix, v) for k, v in zip(keys, values))
    return out


# ----------------------------------------------------------------------------------------------
# reducing


def _forget_reset_meters():
    # fairseq resets an aggregator's meters after its log line (val None); remove those of the
    # statistics, so that lines without a new measurement do not show None
    # (by name: a resumed run loads them from the checkpoint's metrics state)
    for agg in metrics.get_active_aggregators():
        if MARKER in agg and agg[MARKER].val is None:
            for key in [k for k in agg if is_stats_key(k) and agg[k].val is None]:
                remove_meter(agg, key)


def reduce_embedding_stats(logging_outputs: List[dict]) -> None:
    """Logs the measured statistics of ``logging_outputs``: call it from ``reduce_metrics``."""
    _forget_reset_meters()
    count = float(sum(log.get(MARKER, 0) for log in logging_outputs))
    if count <= 0:
        return
    keys = OrderedDict.fromkeys(k for log in logging_outputs for k in log if is_stats_key(k))
    for key in keys:
        total = sum(float(log.get(key, 0.0)) for log in logging_outputs)
        metrics.log_scalar(key, total / count, weight=0, priority=PRIORITY)
    metrics.log_scalar(MARKER, 1, weight=0, priority=PRIORITY)
    # fairseq-validate runs the forward passes of a subset with only fairseq's "default"
    # aggregator active, then reduces them: unmark it, so that the next subset is measured too
    remove_meter(metrics.get_meters("default") or {}, MARKER)


# ----------------------------------------------------------------------------------------------
# the criterion side


def _check_group_preset(settings, dictionaries):
    if not (settings.enabled and settings.groups and settings.preset):
        return
    for d in {id(d): d for d in dictionaries.values() if d is not None}.values():
        G.frequency_groups(d, preset=settings.preset, flag="--embed-group-preset")  # raises if too small


class EmbeddingStats:
    """The live statistics of one criterion: its settings, schedule and caches.

    ``cfg`` holds the :class:`~fairseq_agg.stats.config.EmbeddingStatsConfig` fields (validated
    here; missing ones take their defaults), ``task`` gives the dictionaries, and ``loop`` (the
    criterion's :class:`~fairseq_agg.fairseq_facts.training_loop.TrainingLoop`) the update number; without one,
    the statistics observe the task themselves when they are on.
    """

    def __init__(self, cfg=None, task=None, loop: Optional[TrainingLoop] = None):
        self.settings = EmbeddingStatsSettings(cfg)
        self.dictionaries = task_dictionaries(task)
        _check_group_preset(self.settings, self.dictionaries)
        self.loop = loop
        self.last_tev = None  # training update of the last measurement
        self.last_iso = None
        self.cache = {}
        self.measurements = 0  # public: how many measurements this run made (one per due update)
        if not self.settings.enabled:
            return
        if self.loop is None:
            self.loop = TrainingLoop(task)
        s = self.settings
        logger.info(
            "embedding statistics: TEV/mean_cos every %s updates, isotropy every %s updates, at validation: %s, "
            "groups: %s", s.interval or "no", s.iso_interval or "no", s.valid,
            (s.preset or ",".join(map(str, s.fractions))) if s.groups else "no",
        )

    @property
    def update_num(self) -> Optional[int]:
        return None if self.loop is None else self.loop.update_num

    def due_in_training(self):
        """(TEV due, isotropy due) for the forward pass of the current update."""
        s = self.settings
        update = (self.update_num or 0) + 1  # this forward belongs to update number `update`
        tev = s.interval > 0 and update % s.interval == 0 and self.last_tev != update
        iso = s.iso_interval > 0 and update % s.iso_interval == 0 and self.last_iso != update
        self.last_tev = update if tev else self.last_tev
        self.last_iso = update if iso else self.last_iso
        return tev, iso

    def due_in_validation(self):
        """Both, once per validation pass (whose aggregator this marks), unless turned off."""
        s = self.settings
        active = metrics.get_active_aggregators()
        if not s.valid or all(MARKER in agg and agg[MARKER].val is not None for agg in active):
            return False, False
        metrics.log_scalar(MARKER, 1, weight=0, priority=PRIORITY)
        return s.interval > 0, s.iso_interval > 0

    def log(self, model, logging_output: Optional[dict] = None):
        """Called by the criterion once per forward (training and validation): when a measurement
        is due, adds it to ``logging_output`` and returns the values (None when none is due)."""
        if not self.settings.enabled:
            return None
        tev, iso = self.due_in_training() if model.training else self.due_in_validation()
        if not (tev or iso):
            return None
        measure = is_global_rank0()
        values = compute_embedding_stats(model, self.settings, self.dictionaries, tev, iso, self.cache, measure)
        self.measurements += 1
        if logging_output is not None:
            logging_output.update(values)
            logging_output[MARKER] = 1 if measure else 0
        return values
