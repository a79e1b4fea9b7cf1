"""The statistics flags (``--embed-stats-*``, ``--tev-*``, ``--iso-rows``; docs/stats.md).

:class:`EmbeddingStatsConfig` is the one declaration of the flags and their defaults; a criterion's
config dataclass inherits it. :class:`EmbeddingStatsSettings` is its validated plain-Python view,
built from a criterion config (or keyword arguments named like the fields) with the same defaults.
"""
import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from fairseq_agg.errors import UsageError, check_choice, check_number, flag_name, plain_value

from . import groups as G
from .matrices import MATRIX_CHOICES


@dataclass
class EmbeddingStatsConfig(FairseqDataclass):
    embed_stats_interval: int = field(
        default=0,
        metadata={
            "help": "log TEV (tev_mu, tev_sigma, tev_mu_over_init), the mean pairwise cosine "
            "(mean_cos) and the drift along the rows' mean direction (mean_norm_share, drift_frequent, "
            "drift_rare) of the token embeddings every N updates and at every validation "
            "(0 = off; 100 is a good value)"
        },
    )
    embed_isotropy_interval: Optional[int] = field(
        default=None,
        metadata={
            "help": "log the isotropy I(W) (isotropy, isotropy_raw, isotropy_fixed; O(V*d^2)) every "
            "N updates and at validation; 0 = off; unset: 10 x --embed-stats-interval"
        },
    )
    no_embed_stats_valid: bool = field(
        default=False, metadata={"help": "do not compute the embedding statistics at validation"}
    )
    embed_stats_groups: bool = field(
        default=False,
        metadata={"help": "also log every embedding statistic per frequency group (_freq, _med, _rare)"},
    )
    embed_group_fractions: str = field(
        default="0.3,0.5,0.2",
        metadata={
            "help": "frequent,medium,rare fractions of the non-special, non-madeupword types in "
            "dictionary (= frequency) order; must sum to 1"
        },
    )
    embed_group_preset: Optional[ChoiceEnum(list(G.PRESETS))] = field(
        default=None,
        metadata={
            "help": "fixed id ranges instead of fractions: wikitext103-official = "
            "[0,13001), [13001,36000), [36000,V) (the official AGG evaluation); unset: "
            "--embed-group-fractions"
        },
    )
    tev_matrices: ChoiceEnum(list(MATRIX_CHOICES)) = field(
        default="all",
        metadata={
            "help": "which matrices: input = the input embeddings (encoder and decoder), output = the "
            "output projection, all = every distinct matrix (tied ones count once)"
        },
    )
    tev_exclude_special: bool = field(
        default=False,
        metadata={"help": "TEV without the special rows (bos/eos/unk; pad and madeupwords are always dropped)"},
    )
    tev_exclude_unseen: bool = field(
        default=False,
        metadata={"help": "TEV without the types whose dictionary count is 0 (never seen in training)"},
    )
    tev_effective: bool = field(
        default=False,
        metadata={"help": "also log TEV x embed_scale of input embeddings (tev_mu_eff, tev_sigma_eff)"},
    )
    tev_init_std: Optional[float] = field(
        default=None,
        metadata={"help": "init std for tev_mu_over_init; unset: d^-0.5, fairseq's embedding init"},
    )
    iso_rows: ChoiceEnum(list(G.ROW_POLICIES)) = field(
        default="no-pad-madeup",
        metadata={"help": "rows used by isotropy and mean_cos: all, no-pad-madeup, or no-special"},
    )


# every flag and its default (not FairseqDataclass's own _name, which is no flag)
FLAG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EmbeddingStatsConfig) if not f.name.startswith("_")}
DEFAULT_FRACTIONS = G.parse_fractions(FLAG_DEFAULTS["embed_group_fractions"])
# the flags that change only TEV, which is logged every --embed-stats-interval updates and never
# when that is 0 (the isotropy may still be, on its own interval)
TEV_ONLY_FLAGS = ("tev_exclude_special", "tev_exclude_unseen", "tev_effective", "tev_init_std")
# the frequency groups' definition, which AGG's rare-token freezing also reads (--agg-freeze-rare
# --agg-freeze-set group, criterions/agg.py; docs/baselines.md), statistics on or off
GROUP_DEFINITION_FLAGS = ("embed_group_fractions", "embed_group_preset")


def _optional_choice(value, name, choices):
    """None (the flag's default: not set), or one of ``choices``."""
    return None if value is None else check_choice(name, value, choices)


def _interval(value, name):
    """An update interval: an integer >= 0 (0 = off), or None (its default)."""
    if value is None:
        return None
    if isinstance(value, bool):  # check_number would take True for 1
        raise UsageError(f"{flag_name(name)} must be an integer >= 0, got {value!r}")
    return int(float(check_number(name, value, 0, integer=True)))


def _freezes_a_static_group(cfg) -> bool:
    return bool(getattr(cfg, "agg_freeze_rare", False)) and str(plain_value(getattr(cfg, "agg_freeze_set", ""))) == "group"


class EmbeddingStatsSettings:
    """Validated view of the :class:`EmbeddingStatsConfig` fields; raises UsageError naming the flag.

    ``EmbeddingStatsSettings(cfg)`` reads the fields of a dataclass, DictConfig or Namespace;
    keyword arguments named like the fields override them; missing fields take their defaults.
    A statistics flag given (set to other than its default) where it has no effect is refused,
    naming it and ``--embed-stats-interval``: any of them while the statistics are off
    (``--embed-stats-interval`` 0 and no ``--embed-isotropy-interval``; the group definition is
    also read by ``--agg-freeze-set group``), a TEV flag while only the isotropy is logged, the
    group definition (``--embed-group-fractions``, ``--embed-group-preset``) without
    ``--embed-stats-groups`` (unless ``--agg-freeze-set group`` reads it).
    """

    def __init__(self, cfg=None, **flags):
        unknown = sorted(set(flags) - set(FLAG_DEFAULTS))
        if unknown:
            raise TypeError(f"unknown embedding-statistics settings: {', '.join(unknown)}")
        values = dict(FLAG_DEFAULTS)
        if cfg is not None:
            values.update({name: getattr(cfg, name) for name in FLAG_DEFAULTS if hasattr(cfg, name)})
        values.update(flags)

        self.interval = _interval(values["embed_stats_interval"], "embed_stats_interval")
        iso = _interval(values["embed_isotropy_interval"], "embed_isotropy_interval")
        self.iso_interval = 10 * self.interval if iso is None else iso
        self.valid = not values["no_embed_stats_valid"]
        self.groups = bool(values["embed_stats_groups"])
        try:
            self.fractions = G.parse_fractions(values["embed_group_fractions"], "--embed-group-fractions")
        except ValueError as e:
            raise UsageError(str(e)) from None
        self.preset = _optional_choice(values["embed_group_preset"], "embed_group_preset", G.PRESETS)
        self.matrices = _optional_choice(values["tev_matrices"], "tev_matrices", MATRIX_CHOICES)
        self.exclude_special = bool(values["tev_exclude_special"])
        self.exclude_unseen = bool(values["tev_exclude_unseen"])
        self.effective = bool(values["tev_effective"])
        init_std = values["tev_init_std"]
        if init_std is not None:
            check_number("tev_init_std", init_std, 0, low_open=True)
        self.init_std = None if init_std is None else float(init_std)
        self.iso_rows = _optional_choice(values["iso_rows"], "iso_rows", G.ROW_POLICIES)
        self._refuse_flags_without_effect(values, cfg)

    def _refuse_flags_without_effect(self, values, cfg):
        if not self.enabled:
            names = [n for n in FLAG_DEFAULTS if n != "embed_stats_interval"
                     and not (n in GROUP_DEFINITION_FLAGS and _freezes_a_static_group(cfg))]
            why = "while --embed-stats-interval is 0 (statistics off)"
        elif self.interval == 0:
            names = TEV_ONLY_FLAGS
            why = ("(it changes TEV) while --embed-stats-interval is 0 "
                   f"(only isotropy, every {self.iso_interval} updates)")
        else:
            names, why = (), ""
        self._refuse_given(values, names, why, "--embed-stats-interval N > 0")
        if self.enabled and not self.groups and not _freezes_a_static_group(cfg):
            # the groups are read only by the per-group statistics (and AGG's group freezing)
            self._refuse_given(values, GROUP_DEFINITION_FLAGS,
                               "without --embed-stats-groups (no statistic is split by frequency group)",
                               "--embed-stats-groups")

    def _refuse_given(self, values, names, why, needed):
        """Refuses the first of ``names`` that was given: it has no effect ``why`` unless ``needed``."""
        for name in names:
            value = values[name]
            if self._given(name, value):
                shown = flag_name(name) if isinstance(value, bool) else f"{flag_name(name)} {plain_value(value)}"
                raise UsageError(f"{shown} has no effect {why}: give {needed} too, or leave it out")

    def _given(self, name, value) -> bool:
        """Whether a flag differs from its default, i.e. the user gave it."""
        if name == "embed_group_fractions":
            return self.fractions != DEFAULT_FRACTIONS  # "0.3, 0.5, 0.2" is the default too
        return plain_value(value) != plain_value(FLAG_DEFAULTS[name])

    @property
    def enabled(self) -> bool:
        return self.interval > 0 or self.iso_interval > 0

    @property
    def tev_row_policy(self) -> str:
        return "no-special" if self.exclude_special else "no-pad-madeup"
