"""The offline embedding report of fairseq checkpoints: the ``fairseq-agg-analyze`` command
(:mod:`.analyze`), with :mod:`.checkpoints` (loading), :mod:`.perplexity` (PPL per frequency
group), :mod:`.word_similarity` (Spearman rho on word-pair lists) and :mod:`.plots` (figures).
The statistics themselves are :mod:`fairseq_agg.stats`' (docs/stats.md).
"""
