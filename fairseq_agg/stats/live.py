"""Live embedding-statistics logging shared by every criterion of this plugin.

What a criterion must do
------------------------
1. Its config dataclass inherits :class:`EmbeddingStatsConfig` (all the flags below).
2. Its class inherits :class:`EmbeddingStatsMixin` and calls ``self.log_embedding_stats(model)``
   once per ``forward`` (training and validation alike).

That is all: nothing is needed in ``reduce_metrics`` and nothing goes into the logging output, so
``logging_outputs_can_be_summed`` is unaffected. The mixin reads the flags itself: it wraps the
class's ``build_criterion`` (``__init_subclass__``), which is how fairseq builds criteria. A
criterion constructed directly (tests) may call ``self.init_embedding_stats(cfg)`` in
``__init__``; without either, the statistics stay off.

Mechanism (why it is correct)
-----------------------------
The values are logged with ``metrics.log_scalar(key, value, weight=0)`` from inside the
forward pass, i.e. inside fairseq's active aggregation contexts: ``train_inner`` (one log line of
``--log-interval`` updates), ``train`` (the epoch) and, at validation, the fresh per-subset
aggregator of ``fairseq_cli.train.validate``. So they appear in the plain log line, in
``--log-format json`` records (``train_inner``, ``train``, ``valid`` with the ``valid_`` prefix) and
in ``--tensorboard-logdir`` event files (``train_inner/``, ``train/``, ``valid/``), like ``lr``.

* They never pass through the logging outputs, so they are never summed over micro-batches
  (``--update-freq``) or data-parallel workers; they are computed on global rank 0 only (every
  rank holds the same weights; only rank 0 writes logs).
* ``weight=0`` makes a meter show the latest value, so a log line or an epoch summary shows the
  most recent measurement, never an average over measurements.
* A measurement appears only in the log line that covers it: when fairseq resets ``train_inner``
  after a log line, the next training forward removes the emptied meters, so lines without a
  measurement carry no (``None``) value.

When: in training, at the forward pass of update N, 2N, ... (the update counter is fairseq's
``num_updates`` meter that the trainer logs after every update, see :func:`completed_updates`,
or the ``num_updates`` a criterion passes; the weights measured are those after N−1 optimizer
steps); at most once per update whatever ``--update-freq`` is; resumed runs continue the
schedule (the meters saved in checkpoints are plain fairseq ``AverageMeter`` objects). In
evaluation mode (validation, ``fairseq-validate``), once per validation pass and subset, on the
weights being validated (off with ``--no-embed-stats-valid``). The O(V·d²) isotropy has its own
interval, by default 10 × ``--embed-stats-interval``. Off (the default) costs one attribute test
per forward.

Matrices: the input embedding(s) and, when untied, the output projection (``--tev-matrices``).
With several distinct matrices every key gets a matrix suffix ``_enc`` (encoder input), ``_dec``
(decoder input) or ``_out`` (output projection); with ``--embed-stats-groups`` a group suffix
``_freq`` / ``_med`` / ``_rare`` follows.

Log keys: ``tev_mu``, ``tev_sigma``, ``tev_mu_over_init`` (µTEV / d^-½, fairseq's init std),
``mean_cos`` (every ``--embed-stats-interval``), ``isotropy`` (sign-symmetric), ``isotropy_raw``,
``isotropy_fixed`` (every ``--embed-isotropy-interval``), and with ``--tev-effective``
``tev_mu_eff``, ``tev_sigma_eff`` (TEV × ``embed_scale`` of input embeddings).
"""
import functools
import logging
import math
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional

import torch
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.logging import metrics

from . import groups as G
from .metrics import isotropy, mean_pairwise_cosine, tev_stats

logger = logging.getLogger(__name__)

# Hidden meter (names starting with "_" are never printed) that marks "values logged here".
MARKER = "_embed_stats"
# After fairseq's own keys (train_wall is 800), before gb_free (1500).
PRIORITY = 1000
MATRIX_CHOICES = ("input", "output", "all")


def _choice_value(v):
    return None if v is None else str(getattr(v, "value", v))


@dataclass
class EmbeddingStatsConfig(FairseqDataclass):
    embed_stats_interval: int = field(
        default=0,
        metadata={
            "help": "log TEV (tev_mu, tev_sigma, tev_mu_over_init) and the mean pairwise cosine "
            "(mean_cos) of the token embeddings every N updates and at every validation "
            "(0 = off; 100 is a good value)"
        },
    )
    embed_isotropy_interval: Optional[int] = field(
        default=None,
        metadata={
            "help": "log the isotropy I(W) (isotropy, isotropy_raw, isotropy_fixed; O(V*d^2)) every "
            "N updates and at validation; default: 10 x --embed-stats-interval; 0 = off"
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
            "[0,13000), [13000,36000), [36000,V) (the official AGG evaluation)"
        },
    )
    tev_matrices: ChoiceEnum(list(MATRIX_CHOICES)) = field(
        default="all",
        metadata={
            "help": "which matrices: input embeddings, output projection, or all distinct "
            "matrices (tied ones count once)"
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
        metadata={"help": "init std for tev_mu_over_init (default: d^-0.5, fairseq's embedding init)"},
    )
    iso_rows: ChoiceEnum(list(G.ROW_POLICIES)) = field(
        default="no-pad-madeup",
        metadata={"help": "rows used by isotropy and mean_cos: all, no-pad-madeup, or no-special"},
    )


class EmbeddingStatsSettings:
    """Validated plain-Python view of the :class:`EmbeddingStatsConfig` fields."""

    def __init__(
        self,
        embed_stats_interval=0,
        embed_isotropy_interval=None,
        no_embed_stats_valid=False,
        embed_stats_groups=False,
        embed_group_fractions="0.3,0.5,0.2",
        embed_group_preset=None,
        tev_matrices="all",
        tev_exclude_special=False,
        tev_exclude_unseen=False,
        tev_effective=False,
        tev_init_std=None,
        iso_rows="no-pad-madeup",
    ):
        def as_int(v, flag, allow_none=False):
            if v is None and allow_none:
                return None
            if isinstance(v, bool) or not isinstance(v, int) and not (isinstance(v, float) and v.is_integer()):
                raise ValueError(f"{flag} must be an integer >= 0 (0 = off), got {v!r}")
            if int(v) < 0:
                raise ValueError(f"{flag} must be an integer >= 0 (0 = off), got {v}")
            return int(v)

        self.interval = as_int(embed_stats_interval, "--embed-stats-interval")
        iso = as_int(embed_isotropy_interval, "--embed-isotropy-interval", allow_none=True)
        self.iso_interval = 10 * self.interval if iso is None else iso
        self.valid = not no_embed_stats_valid
        self.groups = bool(embed_stats_groups)
        self.fractions = G.parse_fractions(embed_group_fractions, "--embed-group-fractions")
        self.preset = _choice_value(embed_group_preset)
        if self.preset is not None and self.preset not in G.PRESETS:
            raise ValueError(f"--embed-group-preset must be one of {', '.join(G.PRESETS)}, got {self.preset!r}")
        self.matrices = _choice_value(tev_matrices)
        if self.matrices not in MATRIX_CHOICES:
            raise ValueError(f"--tev-matrices must be one of {', '.join(MATRIX_CHOICES)}, got {self.matrices!r}")
        self.exclude_special = bool(tev_exclude_special)
        self.exclude_unseen = bool(tev_exclude_unseen)
        self.effective = bool(tev_effective)
        if tev_init_std is not None and not (float(tev_init_std) > 0 and math.isfinite(float(tev_init_std))):
            raise ValueError(f"--tev-init-std must be a positive number, got {tev_init_std!r}")
        self.init_std = None if tev_init_std is None else float(tev_init_std)
        self.iso_rows = _choice_value(iso_rows)
        if self.iso_rows not in G.ROW_POLICIES:
            raise ValueError(f"--iso-rows must be one of {', '.join(G.ROW_POLICIES)}, got {self.iso_rows!r}")

    @classmethod
    def from_cfg(cls, cfg) -> "EmbeddingStatsSettings":
        """From a dataclass, DictConfig or Namespace; missing fields take their defaults."""
        names = cls.__init__.__code__.co_varnames[1 : cls.__init__.__code__.co_argcount]
        kwargs = {}
        for name in names:
            if cfg is not None and hasattr(cfg, name):
                kwargs[name] = getattr(cfg, name)
        return cls(**kwargs)

    @property
    def enabled(self) -> bool:
        return self.interval > 0 or self.iso_interval > 0

    @property
    def tev_row_policy(self) -> str:
        return "no-special" if self.exclude_special else "no-pad-madeup"


class EmbeddingMatrix(NamedTuple):
    name: str  # "enc", "dec" or "out"
    weight: torch.Tensor
    role: str  # "input" or "output"
    embed_scale: float
    padding_idx: Optional[int]


def _unwrap(model):
    # DDP / fairseq's ModuleProxyWrapper keep the real model in .module
    while hasattr(model, "module") and isinstance(getattr(model, "module"), torch.nn.Module):
        model = model.module
    return model


def _weight_of(obj):
    if obj is None:
        return None
    if isinstance(obj, torch.nn.Parameter) or torch.is_tensor(obj):
        return obj
    w = getattr(obj, "weight", None)
    return w if torch.is_tensor(w) and w.dim() == 2 else None


def embedding_matrices(model, which: str = "all") -> List[EmbeddingMatrix]:
    """The distinct token-embedding matrices of a fairseq model (tied matrices count once).

    ``enc`` = ``encoder.embed_tokens``, ``dec`` = ``decoder.embed_tokens``, ``out`` =
    ``decoder.output_projection`` (or a legacy ``decoder.embed_out``). Adaptive inputs/softmax have
    no single matrix and are skipped.
    """
    m = _unwrap(model)
    enc, dec = getattr(m, "encoder", None), getattr(m, "decoder", None)
    candidates = [
        ("enc", enc, "embed_tokens", "input"),
        ("dec", dec, "embed_tokens", "input"),
        ("out", dec, "output_projection", "output"),
        ("out", dec, "embed_out", "output"),
    ]
    found: List[EmbeddingMatrix] = []
    output_name = None
    for name, owner, attr, role in candidates:
        if owner is None or (name == "out" and output_name is not None):
            continue
        mod = getattr(owner, attr, None)
        w = _weight_of(mod)
        if w is None:
            continue
        same = next((f for f in found if f.weight is w or (f.weight.data_ptr() == w.data_ptr() and f.weight.shape == w.shape)), None)
        if role == "output":
            output_name = same.name if same is not None else name
        if same is not None:
            continue
        scale = float(getattr(owner, "embed_scale", 1.0) or 1.0) if role == "input" else 1.0
        pad = getattr(mod, "padding_idx", None) if isinstance(mod, torch.nn.Embedding) else None
        found.append(EmbeddingMatrix(name, w, role, scale, pad))
    if which == "input":
        return [f for f in found if f.role == "input"]
    if which == "output":
        return [f for f in found if f.name == output_name]
    return found


def task_dictionaries(task) -> Dict[str, object]:
    """Dictionary per matrix name: the source dictionary for ``enc``, the target one otherwise."""
    def get(attr):
        try:
            return getattr(task, attr)
        except (AttributeError, NotImplementedError):
            return None

    if task is None:
        return {}
    src, tgt = get("source_dictionary"), get("target_dictionary")
    return {"enc": src if src is not None else tgt, "dec": tgt if tgt is not None else src,
            "out": tgt if tgt is not None else src}


class _RowSets(NamedTuple):
    tev: torch.Tensor
    iso: torch.Tensor
    groups: "OrderedDict[str, tuple]"  # group -> (tev rows, iso rows)


def row_sets(dictionary, num_rows: int, padding_idx: Optional[int], settings: EmbeddingStatsSettings) -> _RowSets:
    """Rows of one matrix for TEV, for isotropy/mean_cos and per group (CPU tensors)."""
    if dictionary is not None and len(dictionary) != num_rows:
        dictionary = None  # not this matrix's vocabulary; fall back to fairseq's default layout
    pad = padding_idx if dictionary is None else None
    tev_mask = G.row_mask(dictionary, settings.tev_row_policy, settings.exclude_unseen, num_rows, pad)
    iso_mask = G.row_mask(dictionary, settings.iso_rows, False, num_rows, pad)
    grp = OrderedDict()
    if settings.groups and dictionary is not None:
        for gname, ids in G.frequency_groups(dictionary, settings.fractions, settings.preset).items():
            gm = torch.zeros(num_rows, dtype=torch.bool)
            gm[ids] = True
            grp[gname] = ((gm & tev_mask).nonzero().reshape(-1), (gm & iso_mask).nonzero().reshape(-1))
    return _RowSets(tev_mask.nonzero().reshape(-1), iso_mask.nonzero().reshape(-1), grp)


def compute_embedding_stats(
    model, settings: EmbeddingStatsSettings, dictionaries: Optional[Dict[str, object]] = None,
    tev: bool = True, iso: bool = True, cache: Optional[dict] = None,
) -> "OrderedDict[str, float]":
    """All live statistics of ``model`` as ``{log key: value}`` (see the module docstring)."""
    dictionaries = dictionaries or {}
    cache = {} if cache is None else cache
    mats = embedding_matrices(model, settings.matrices)
    out = OrderedDict()
    for mat in mats:
        W = mat.weight.detach()
        key = (mat.name, tuple(W.shape), W.device)
        if key not in cache:
            rs = row_sets(dictionaries.get(mat.name), W.size(0), mat.padding_idx, settings)
            to = functools.partial(torch.Tensor.to, device=W.device)
            cache[key] = _RowSets(to(rs.tev), to(rs.iso), OrderedDict((g, (to(a), to(b))) for g, (a, b) in rs.groups.items()))
        rs = cache[key]
        msfx = f"_{mat.name}" if len(mats) > 1 else ""
        parts = [("", rs.tev, rs.iso)] + [(f"_{g}", a, b) for g, (a, b) in rs.groups.items()]
        with torch.autocast(device_type=W.device.type, enabled=False):
            for gsfx, rows_tev, rows_iso in parts:
                sfx = msfx + gsfx
                if tev and rows_tev.numel() > 0:
                    t = tev_stats(W, rows_tev, init_std=settings.init_std)
                    out["tev_mu" + sfx] = t["mu"]
                    out["tev_sigma" + sfx] = t["sigma"]
                    out["tev_mu_over_init" + sfx] = t["mu_over_init"]
                    if settings.effective and mat.role == "input":
                        out["tev_mu_eff" + sfx] = t["mu"] * mat.embed_scale
                        out["tev_sigma_eff" + sfx] = t["sigma"] * mat.embed_scale
                if tev and rows_iso.numel() > 1:
                    out["mean_cos" + sfx] = mean_pairwise_cosine(W, rows_iso)
                if iso and rows_iso.numel() > 0:
                    r = isotropy(W, rows_iso)
                    out["isotropy" + sfx] = r["isotropy"]
                    out["isotropy_raw" + sfx] = r["isotropy_raw"]
                    out["isotropy_fixed" + sfx] = r["isotropy_fixed"]
    return out


def completed_updates() -> int:
    """Optimizer updates done so far, from the ``num_updates`` meter that fairseq's Trainer logs
    (``set_num_updates``: after every update and on checkpoint load) into the active aggregators.

    The largest value among the active aggregators and the registered "default" one: after a
    resume, ``metrics.load_state_dict`` replaces the registered aggregators while the trainer keeps
    logging into the previously active "default" one, so any single lookup can be stale; a stale
    value is always smaller. 0 before the first update.
    """
    best = 0
    for agg in metrics.get_active_aggregators() + [metrics.get_meters("default") or {}]:
        val = getattr(agg.get("num_updates"), "val", None)
        if val is not None:
            best = max(best, int(val))
    return best


_KEY_RE = re.compile(
    r"^(tev_mu|tev_sigma|tev_mu_over_init|tev_mu_eff|tev_sigma_eff|mean_cos|isotropy|isotropy_raw|"
    r"isotropy_fixed)(_(enc|dec|out))?(_(freq|med|rare))?$"
)


def is_stats_key(key: str) -> bool:
    """Whether ``key`` is one of the live statistics' log keys (or the hidden marker)."""
    return key == MARKER or bool(_KEY_RE.match(key))


def _is_rank0() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _drop_meter(agg, key):
    # MetersDict keeps a sorted "priorities" list next to the dict; both must forget the key
    if key in agg:
        del agg[key]
        pri = getattr(agg, "priorities", None)
        if pri is not None:
            pri[:] = [p for p in pri if p[2] != key]


class _LiveState:
    def __init__(self, settings: EmbeddingStatsSettings, dictionaries):
        self.settings = settings
        self.dictionaries = dictionaries
        self.last_tev = None  # training update of the last measurement
        self.last_iso = None
        self.keys = set()  # every key logged by this process
        self.cache = {}
        self.elapsed = 0.0  # seconds spent measuring (benchmarks read it)
        self.measurements = 0


def _validate_against_dictionaries(settings, dictionaries):
    if not (settings.enabled and settings.groups and settings.preset):
        return
    for d in {id(d): d for d in dictionaries.values() if d is not None}.values():
        G.frequency_groups(d, preset=settings.preset, flag="--embed-group-preset")  # raises if too small


class EmbeddingStatsMixin:
    """Adds ``log_embedding_stats(model)``; see the module docstring for the contract."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        build = getattr(cls, "build_criterion", None)
        if build is None:
            return
        func = getattr(build, "__func__", None)
        if func is None or (getattr(func, "_embed_stats_wrapped", False) and "build_criterion" not in cls.__dict__):
            return

        @functools.wraps(func)
        def build_criterion(klass, cfg, task, *args, **kw):
            crit = func(klass, cfg, task, *args, **kw)
            if isinstance(crit, EmbeddingStatsMixin) and getattr(crit, "_embed_stats", None) is None:
                crit.init_embedding_stats(cfg, task)
            return crit

        build_criterion._embed_stats_wrapped = True
        cls.build_criterion = classmethod(build_criterion)

    def init_embedding_stats(self, cfg, task=None):
        """Reads and validates the flags; raises ValueError naming the flag on bad input."""
        settings = EmbeddingStatsSettings.from_cfg(cfg)
        task = task if task is not None else getattr(self, "task", None)
        dictionaries = task_dictionaries(task)
        _validate_against_dictionaries(settings, dictionaries)
        self._embed_stats = _LiveState(settings, dictionaries)
        if settings.enabled:
            logger.info(
                "embedding statistics: TEV/mean_cos every %s updates, isotropy every %s updates, "
                "at validation: %s, groups: %s",
                settings.interval or "no", settings.iso_interval or "no", settings.valid,
                (settings.preset or ",".join(map(str, settings.fractions))) if settings.groups else "no",
            )

    @property
    def embedding_stats_settings(self) -> Optional[EmbeddingStatsSettings]:
        st = getattr(self, "_embed_stats", None)
        return None if st is None else st.settings

    def log_embedding_stats(self, model, num_updates: Optional[int] = None):
        """Called by the criterion once per forward (training and validation).

        ``num_updates``: optional, the number of completed optimizer updates (the ``update_num``
        fairseq passes to ``task.train_step``) when the criterion knows it; by default it is read
        from fairseq's metrics.
        """
        st = getattr(self, "_embed_stats", None)
        if st is None or not st.settings.enabled or not _is_rank0():
            return None
        s = st.settings
        active = metrics.get_active_aggregators()
        if getattr(model, "training", False):
            # fairseq reset the meters after the previous log line: forget them, so lines
            # without a new measurement do not show None
            # (by name, not by what this process logged: a resumed run loads them from the checkpoint)
            for agg in active:
                if MARKER in agg and getattr(agg[MARKER], "val", 0) is None:
                    for key in [k for k in agg if is_stats_key(k) and getattr(agg[k], "val", 0) is None]:
                        _drop_meter(agg, key)
            done = completed_updates() if num_updates is None else int(num_updates)
            update = done + 1  # this forward belongs to update number `update`
            do_tev = s.interval > 0 and update % s.interval == 0 and st.last_tev != update
            do_iso = s.iso_interval > 0 and update % s.iso_interval == 0 and st.last_iso != update
            if do_tev:
                st.last_tev = update
            if do_iso:
                st.last_iso = update
        else:
            if not s.valid:
                return None
            # once per validation pass: its fresh aggregator has no marker yet
            if all(MARKER in agg and agg[MARKER].val is not None for agg in active):
                return None
            do_tev, do_iso = s.interval > 0, s.iso_interval > 0
        if not (do_tev or do_iso):
            return None
        start = time.perf_counter()
        values = compute_embedding_stats(model, s, st.dictionaries, tev=do_tev, iso=do_iso, cache=st.cache)
        st.elapsed += time.perf_counter() - start
        st.measurements += 1
        for key, value in values.items():
            metrics.log_scalar(key, value, weight=0, priority=PRIORITY)
            st.keys.add(key)
        metrics.log_scalar(MARKER, 1, weight=0, priority=PRIORITY)
        return values
