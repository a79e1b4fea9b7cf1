"""The embedding statistics (docs/stats.md, "Metrics") of a Hugging Face model under ``Trainer``:
:class:`EmbeddingStatsCallback` logs µTEV, σTEV, the mean pairwise cosine and I(W) of the output
embedding (``get_output_embeddings().weight``; for a tied model the one token embedding), over all
rows and per frequency group, through the Trainer's own ``log`` (so ``state.log_history`` and every
``report_to`` integration get them).

The frequency groups are those of the fairseq side (30 % / 50 % / 20 % by default), cut from the
vocabulary sorted by training count (most frequent first, ties by id): the counts are the tokens of
the train dataset's ``input_ids`` (where ``attention_mask``, if present, is 1), counted once when
the callback is built, or a given (V,) count tensor. The math is :mod:`fairseq_agg.stats.metrics`,
the cut :func:`fairseq_agg.stats.groups.split_by_fractions`.
"""
from collections import OrderedDict

import torch
from transformers import TrainerCallback

from ..errors import UsageError, check_integer
from ..stats.groups import DEFAULT_FRACTIONS, split_by_fractions
from ..stats.metrics import isotropy, mean_pairwise_cosine, tev_stats


def count_tokens(dataset, vocab_size: int) -> torch.Tensor:
    """(V,) int64: how often each id occurs in the ``input_ids`` of ``dataset``'s examples (a
    map-style dataset of dicts, e.g. a ``datasets.Dataset``), positions whose ``attention_mask`` is
    0 left out."""
    if dataset is None or not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise UsageError("EmbeddingStatsCallback: the train dataset has no length to count token frequencies "
                         "in (an iterable dataset?); pass token_counts, a (V,) tensor of training counts")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for index in range(len(dataset)):
        example = dataset[index]
        if not hasattr(example, "keys") or "input_ids" not in example:
            raise UsageError(f"EmbeddingStatsCallback: example {index} of the train dataset has no input_ids to "
                             "count; pass token_counts, a (V,) tensor of training counts")
        ids = torch.as_tensor(example["input_ids"], dtype=torch.long).reshape(-1)
        if example.get("attention_mask") is not None:
            ids = ids[torch.as_tensor(example["attention_mask"]).reshape(-1) != 0]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise UsageError(f"EmbeddingStatsCallback: example {index} of the train dataset holds token ids outside "
                             f"[0, {vocab_size}), the output embedding's rows")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def groups_by_count(counts: torch.Tensor, fractions=DEFAULT_FRACTIONS, exclude_ids=()) -> "OrderedDict":
    """``{"freq", "med", "rare"}``: the ids not in ``exclude_ids``, most frequent first (ties by id),
    cut by ``fractions`` as the fairseq side cuts its dictionary."""
    order = torch.argsort(counts, descending=True, stable=True)
    kept = torch.ones(counts.numel(), dtype=torch.bool)
    kept[list(exclude_ids)] = False
    return split_by_fractions(order[kept[order]], fractions)


@torch.no_grad()
def embedding_statistics(W: torch.Tensor, rows: torch.Tensor, groups, with_isotropy=True) -> "OrderedDict[str, float]":
    """``tev_mu``, ``tev_sigma``, ``mean_cos`` and ``isotropy`` (the sign-symmetric I(W); left out
    with ``with_isotropy=False``) of the ``rows`` of ``W``, then of each group's rows with the suffix
    ``_freq`` / ``_med`` / ``_rare`` (a group of one row has no mean cosine, an empty one no key)."""
    out = OrderedDict()
    # the statistics choose their own precision (fp32 / fp64), also under autocast
    with torch.autocast(device_type=W.device.type, enabled=False):
        for suffix, part in [("", rows)] + [(f"_{name}", ids) for name, ids in groups.items()]:
            part = part.to(W.device)
            if part.numel() == 0:
                continue
            tev = tev_stats(W, part)
            out[f"tev_mu{suffix}"], out[f"tev_sigma{suffix}"] = tev["mu"], tev["sigma"]
            if part.numel() > 1:
                out[f"mean_cos{suffix}"] = mean_pairwise_cosine(W, part)
            if with_isotropy:
                out[f"isotropy{suffix}"] = isotropy(W, part)["isotropy"]
    return out


class EmbeddingStatsCallback(TrainerCallback):
    """Logs the output embedding's statistics every ``embed_stats_interval`` optimizer updates (and
    every ``embed_isotropy_interval``) and at the end of training, on the main process, through
    ``trainer.log`` (one record with the Trainer's ``step`` and ``epoch``): a callback's ``on_log``
    comes after the record is in ``state.log_history`` and after the ``report_to`` integrations saw
    it. The weights measured are those after ``state.global_step`` updates.

    ``trainer``: the Trainer to log through (``trainer.add_callback(EmbeddingStatsCallback(trainer))``);
    ``embed_isotropy_interval``: I(W), O(V·d²), every that many updates (default: the same interval;
    0: never); ``token_counts``: (V,) training counts (default: counted from
    ``trainer.train_dataset``); ``embed_group_fractions``: frequent, medium, rare; ``exclude_ids``:
    rows left out of every statistic and group (e.g. a padding row, or vocabulary padding that is
    never a token). Bad values are refused here, in one line, before training starts.
    """

    def __init__(self, trainer, embed_stats_interval: int = 100, embed_isotropy_interval=None, token_counts=None,
                 embed_group_fractions=DEFAULT_FRACTIONS, exclude_ids=()):
        self.trainer = trainer
        self.interval = check_integer("embed_stats_interval", embed_stats_interval, 1)
        self.isotropy_interval = self.interval if embed_isotropy_interval is None else \
            check_integer("embed_isotropy_interval", embed_isotropy_interval, 0)
        head = trainer.model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        if not torch.is_tensor(weight) or weight.dim() != 2:
            raise UsageError(f"EmbeddingStatsCallback: {type(trainer.model).__name__} has no output embedding "
                             "matrix (get_output_embeddings().weight, V x d) to measure")
        vocab = weight.size(0)
        self.exclude_ids = sorted({int(i) for i in exclude_ids})
        if any(not 0 <= i < vocab for i in self.exclude_ids):
            raise UsageError(f"EmbeddingStatsCallback: exclude_ids must be ids in [0, {vocab}), "
                             f"got {list(exclude_ids)}")
        if token_counts is None:
            self.token_counts = count_tokens(trainer.train_dataset, vocab)
        else:
            self.token_counts = _checked_counts(token_counts, vocab)
        self.groups = groups_by_count(self.token_counts, embed_group_fractions, self.exclude_ids)
        kept = torch.ones(vocab, dtype=torch.bool)
        kept[self.exclude_ids] = False
        self.rows = kept.nonzero().reshape(-1)
        self.last_step = None  # the update of the last measurement
        self.last = None  # its values

    def measure(self, with_isotropy=True) -> "OrderedDict[str, float]":
        """The statistics of the output embedding as it is now (see :func:`embedding_statistics`)."""
        W = self.trainer.model.get_output_embeddings().weight.detach()
        return embedding_statistics(W, self.rows, self.groups, with_isotropy)

    def _log(self, state, with_isotropy):
        self.last_step = state.global_step
        if state.is_world_process_zero:  # every rank holds the same weights: measure once
            self.last = self.measure(with_isotropy)
            self.trainer.log(dict(self.last))

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        isotropy_due = self.isotropy_interval > 0 and step % self.isotropy_interval == 0
        if step % self.interval == 0 or isotropy_due:
            self._log(state, isotropy_due)

    def on_train_end(self, args, state, control, **kwargs):
        if self.last_step != state.global_step:
            self._log(state, self.isotropy_interval > 0)


def _checked_counts(token_counts, vocab):
    counts = torch.as_tensor(token_counts).detach().cpu()
    if counts.shape != (vocab,) or counts.is_complex() or not bool(torch.isfinite(counts.double()).all()) \
            or bool((counts < 0).any()):
        raise UsageError(f"EmbeddingStatsCallback: token_counts must be {vocab} finite counts >= 0 (one per row of "
                         f"the output embedding), got shape {tuple(counts.shape)}")
    return counts
