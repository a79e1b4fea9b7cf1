"""Token-embedding statistics: TEV, isotropy I(W), mean cosine, per frequency group (docs/stats.md),
and their logging during ``fairseq-train``. The offline report of checkpoints is
:mod:`fairseq_agg.analysis`, built on the same math.

* :mod:`.metrics` - the pure-torch math; :mod:`.groups` - frequency groups and row policies;
* :mod:`.matrices` - which matrices of a model or checkpoint, and which of their rows;
* :mod:`.config` - the ``--embed-stats-*`` / ``--tev-*`` / ``--iso-rows`` flags;
* :mod:`.live` - logging during ``fairseq-train`` (used by every criterion of the plugin).
"""
