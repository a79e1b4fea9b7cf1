"""``fairseq-agg-analyze CHECKPOINT [CHECKPOINT ...] [--data DATA_BIN] [--out DIR]``
(also ``fairseq-agg analyze``): an embedding report of fairseq checkpoints.

For every distinct token-embedding matrix of every checkpoint (``enc`` = encoder input,
``dec`` = decoder input, ``out`` = output projection; tied matrices count once) it computes
TEV, mean pairwise cosine, isotropy I(W) (sign-symmetric / raw / sign-fixed) and the singular
values, over all rows and per frequency group, with the same functions, matrices and row rules as
the live logging (:mod:`~fairseq_agg.stats.metrics`, :mod:`~fairseq_agg.stats.matrices`). With ``--data`` it also scores a split with the real model
(a language model exactly as ``fairseq-eval-lm --context-window C --tokens-per-sample T`` scores
it, same tokens and same total loss; for MT the target given the source) and reports perplexity per frequency group of the target token, as the AGG paper's
Table 1. With ``--word-sim FILE ...`` it also reports word similarity (Spearman's ρ between
embedding cosines and human scores, :mod:`~fairseq_agg.analysis.word_similarity`) of every matrix.
Several checkpoints give one comparison table and overlaid figures.

Outputs in ``--out`` (default ``analysis``): ``report.json``, ``table.md`` (also printed),
``spectrum.png`` (singular values of every matrix, overlaid) and ``projection.png`` (the output
embedding of each checkpoint projected on its top two right-singular directions, coloured by
frequency group: a degenerate "narrow cone" vs an isotropic cloud). ``--out`` is checked before any
work; the report is built in ``.DIR.new-<pid>.tmp`` beside it and replaces it as a whole only when
complete (:func:`~fairseq_agg.files.atomic_directory`), so ``--out`` holds the previous report or
the new one, never a mix (the figures of a previous report do not survive a ``--no-figures`` run);
other files in it are carried over.

The steps live in their own modules: :mod:`~fairseq_agg.analysis.checkpoints` (loading),
:mod:`~fairseq_agg.analysis.perplexity` (reusable: ``per_group_perplexity`` for a checkpoint path,
``group_perplexity`` for a loaded model and task), :mod:`~fairseq_agg.analysis.plots` (figures) and
:mod:`~fairseq_agg.analysis.table` (the comparison table).

report.json schema (version 1)
------------------------------
::

    {
      "version": 1,
      "settings": {"rows": "no-pad-madeup", "group_fractions": [0.3, 0.5, 0.2],
                   "group_preset": null, "data": DATA_BIN or null, "split": "valid" or null,
                   "context_window": C or null, "tokens_per_sample": T or null (null: each checkpoint's),
                   "word_sim": ["/abs/wordsim353.tsv", ...] or null, "word_sim_spm": "/abs/spm.model" or null},
      "checkpoints": [
        {
          "label": "checkpoint_best", "path": "/abs/path.pt",
          "num_updates": 1200 or null, "epoch": 3 or null,
          "task": "language_modeling", "arch": "transformer_lm", "criterion": "cross_entropy_agg",
          "dictionary": {"size": V, "nspecial": 4, "madeupwords": 3, "source": "/path/dict.txt"} or null,
          "groups": {"freq": n_types, "med": n_types, "rare": n_types} or null,
          "matrices": {
            "dec": {
              "param": "decoder.embed_tokens.weight",
              "tied": ["decoder.output_projection.weight"],
              "role": "input" | "output", "shape": [V, d], "embed_scale": float,
              "all": {"rows": n, "tev_mu": f, "tev_sigma": f, "tev_mu_over_init": f,
                      "mean_cos": f, "isotropy": f, "isotropy_raw": f, "isotropy_fixed": f},
              "groups": {"freq": {same keys as "all"}, "med": {...}, "rare": {...}},
              "singular_values": [σ_1 >= σ_2 >= ... >= σ_d],
              "drift": {"mean_norm_share", "drift_frequent", "drift_rare", "drift_frequent_share",
                        "drift_rare_share", "isotropy_centred"} or null (no dictionary)
                       (the rows' drift along their mean direction: stats.metrics.mean_direction_drift)
            }, ...
          },
          "ppl": {"split": "valid", "context_window": C, "tokens_per_sample": T (null for MT),
                  "total": {"tokens": n, "nll": nats per token, "ppl": f},
                  "groups": {"freq": {"tokens", "nll", "ppl"}, "med": {...}, "rare": {...}},
                  "ungrouped": {"tokens", "nll", "ppl"}}   (types in no group: </s>, <unk>, ...)
                 or null (no --data / --no-ppl),
          "agg": {"alpha", "threshold_mode", "ref_tokens", "window", "window_updates", "window_tokens",
                  "rare", "rare_seen", "rare_seen_fraction", "frozen", "freeze_set",
                  "rare_target_share" (of --split's targets, LM --data) or null,
                  "tokens_per_update", "target_share", "updates_per_epoch" or null,
                  "rare_below_per_epoch" or null}   (AGG's window at the checkpoint and its operating
                 or null (another criterion),        point, docs/agg.md; per epoch: --agg-window 0 only)
          "word_similarity": {                 (null without --word-sim; docs/stats.md, "Word similarity")
            "wordsim353": {                    (the --word-sim file's stem)
              "dec": {"single": {"rho": f or null, "pairs": n},   (both words one dictionary symbol)
                      "subword": {"rho": f or null, "pairs": n},  (words = mean of their pieces' rows)
                      "total_pairs": n}, ...   (every distinct matrix, as in "matrices")
            }, ...
          }
        }, ...
      ],
      "table": {"columns": ["label", "matrix", "tev_mu", ..., "ws_wordsim353", "ws_wordsim353_sub", ...],
                "rows": [[...], ...]},    (ws_ cells: "0.312 (120)" = single-token / subword ρ (pairs);
                                           agg_rare, agg_rare_below_per_epoch, agg_target_share with AGG)
      "figures": {"spectrum": "spectrum.png", "projection": "projection.png"}
    }

Unavailable values (e.g. a group with fewer than two rows for ``mean_cos``, a ppl without
tokens) are ``null``. ``ppl`` = exp(nll) = 2^(fairseq's base-2 loss), i.e. fairseq's ``ppl``.
"""
import json
import logging
import math
import os
import sys
from collections import OrderedDict
from typing import Dict, List, NamedTuple, Optional

import torch

from fairseq_agg.errors import UsageError
from fairseq_agg.files import atomic_directory, check_output_directory, irregular_file_kind
from fairseq_agg.stats import groups as G
from fairseq_agg.stats.matrices import EMBEDDING_PARAMS, EmbeddingMatrix, dictionary_for, distinct_matrices, matrix_rows
from fairseq_agg.stats.metrics import (ISOTROPY_FORMS, embedding_spectrum, isotropy, mean_direction_drift,
                                      mean_pairwise_cosine, tev_stats)

from .agg_window import agg_window_report, split_target_counts
from .checkpoints import (
    AnalyzeError,
    cfg_get,
    check_checkpoint_path,
    check_dictionary_sizes,
    checkpoint_metadata,
    dictionary_info,
    load_checkpoint,
    load_dictionaries,
)
from .perplexity import per_group_perplexity, scoring_tokens_per_sample
from .plots import plot_projection, plot_spectrum
from .table import METRIC_KEYS, build_table, table_markdown
from .word_similarity import WordSimFileError, checkpoint_word_similarity, load_spm, read_word_sim_files

logger = logging.getLogger("fairseq_agg.analyze")



# ----------------------------------------------------------------------------------------------
# embedding statistics of one checkpoint


def checkpoint_matrices(state: dict, path: str) -> List[EmbeddingMatrix]:
    """The distinct embedding matrices of a loaded checkpoint (at least one)."""
    found = distinct_matrices(state["model"], compare_values=True)
    if not found:
        raise AnalyzeError(
            f"{path} has no token-embedding matrix (looked for {', '.join(p for p, _, _ in EMBEDDING_PARAMS)}); "
            "adaptive input/softmax models have no single embedding matrix"
        )
    return found


def _finite(x):
    return None if x is None or not math.isfinite(x) else float(x)


def row_metrics(W: torch.Tensor, rows: torch.Tensor, spectrum=None) -> Dict[str, Optional[float]]:
    """TEV, mean cosine and isotropy of W[rows] (``None`` where undefined)."""
    out = {"rows": int(rows.numel())}
    if rows.numel() == 0:
        out.update({k: None for k in METRIC_KEYS})
        return out
    t = tev_stats(W, rows)
    out.update(tev_mu=t["mu"], tev_sigma=t["sigma"], tev_mu_over_init=t["mu_over_init"])
    out["mean_cos"] = mean_pairwise_cosine(W, rows) if rows.numel() > 1 else None
    iso = isotropy(W, rows, spectrum=spectrum)
    out.update({k: iso[k] for k in ISOTROPY_FORMS})
    return {k: (_finite(v) if isinstance(v, float) else v) for k, v in out.items()}


def matrix_report(W, dictionary, rows_policy="no-pad-madeup", fractions=G.DEFAULT_FRACTIONS, preset=None,
                  device=None):
    """All statistics of one matrix; also returns what the figures need."""
    W = W.to(device) if device is not None else W
    dictionary = dictionary_for(dictionary, W.size(0))
    groups = None
    if dictionary is not None:
        groups = G.frequency_groups(dictionary, fractions, preset, flag="--group-preset")
    selected = matrix_rows(dictionary, W.size(0), rows_policy, groups=groups)
    rows = selected.all.to(W.device)
    group_rows = OrderedDict((g, r.to(W.device)) for g, r in selected.groups.items())
    spec = embedding_spectrum(W, rows)
    rep = {"all": row_metrics(W, rows, spec), "groups": None,
           "singular_values": [float(s) for s in spec.singular_values.cpu()],
           # halves by frequency need the dictionary's order
           "drift": None if dictionary is None else mean_direction_drift(W, rows)}
    if groups is not None:
        rep["groups"] = OrderedDict((g, row_metrics(W, r)) for g, r in group_rows.items())
    return rep, {"W": W, "rows": rows, "spectrum": spec, "group_rows": group_rows}


def _embed_scale(mat: EmbeddingMatrix, cfg) -> float:
    # fairseq multiplies input embeddings by sqrt(d) unless --no-scale-embedding
    if mat.role == "output" or cfg_get(cfg, "model", "no_scale_embedding", default=False):
        return 1.0
    return math.sqrt(mat.weight.size(1))


def _figure_matrix(entries):
    """The matrix shown in projection.png: the output embedding (or the last one)."""
    chosen = None
    for mat, figdata in entries:
        if mat.holds_output or chosen is None:
            chosen = (mat, figdata)
    return chosen


class AnalyzeOptions(NamedTuple):
    data: Optional[str]
    split: str
    rows_policy: str
    fractions: tuple
    preset: Optional[str]
    max_tokens: int
    ppl: bool
    device: torch.device
    word_sim: tuple = ()  # WordPairs of the --word-sim files
    word_sim_spm: object = None  # the loaded --word-sim-spm model
    context_window: int = 0  # as fairseq-eval-lm --context-window
    tokens_per_sample: Optional[int] = None  # as fairseq-eval-lm --tokens-per-sample; None: the checkpoint's
    split_targets: Optional[dict] = None  # {(data, split): target counts}: one count of --split for every checkpoint


def checkpoint_report(path, label, state, opts: AnalyzeOptions):
    """One checkpoint's entry of report.json, its spectra and its projection panel."""
    cfg = state.get("cfg")
    mats = checkpoint_matrices(state, path)
    dicts, dict_source = load_dictionaries(cfg, opts.data)
    if opts.data is not None:
        check_dictionary_sizes(dicts, mats, opts.data, path)
    rep = OrderedDict(label=label, path=os.path.abspath(path), **checkpoint_metadata(state))
    main_dict = dicts.get("out") or dicts.get("dec")
    rep["dictionary"] = dictionary_info(main_dict, dict_source)
    try:
        groups = None if main_dict is None else G.frequency_groups(
            main_dict, opts.fractions, opts.preset, flag="--group-preset")
    except ValueError as e:
        raise AnalyzeError(str(e))
    rep["groups"] = None if groups is None else {g: int(ids.numel()) for g, ids in groups.items()}
    rep["matrices"] = OrderedDict()
    spectra, figures = [], []
    for mat in mats:
        try:
            mrep, figdata = matrix_report(mat.weight, dicts.get(mat.name), opts.rows_policy, opts.fractions,
                                          opts.preset, opts.device)
        except ValueError as e:
            raise AnalyzeError(f"{path}: {e}")
        entry = OrderedDict(param=mat.param, tied=mat.tied, role=mat.role, shape=list(mat.weight.shape),
                            embed_scale=_embed_scale(mat, cfg))
        entry.update(mrep)
        rep["matrices"][mat.name] = entry
        spectra.append((f"{label}:{mat.name}", mrep["singular_values"]))
        figures.append((mat, figdata))
    rep["word_similarity"] = checkpoint_word_similarity(mats, dicts, opts.word_sim, opts.word_sim_spm) \
        if opts.word_sim else None
    mat, fd = _figure_matrix(figures)
    iso = rep["matrices"][mat.name]["all"]["isotropy"]
    panel = (f"{label}: {mat.name}, I(W) = {'-' if iso is None else f'{iso:.3f}'}", fd["W"], fd["rows"],
             fd["spectrum"], fd["group_rows"])
    targets = None
    if "window.counts" in (state.get("criterion") or {}) and opts.data and main_dict is not None:
        key = (opts.data, opts.split)
        if key not in opts.split_targets:
            opts.split_targets[key] = split_target_counts(opts.data, opts.split, main_dict)
        targets = opts.split_targets[key]
    rep["agg"] = agg_window_report(state, main_dict, targets)
    rep["ppl"] = None
    if opts.data is not None and opts.ppl:
        if groups is None:
            raise AnalyzeError(f"{path}: no target dictionary in --data {opts.data}")
        rep["ppl"] = per_group_perplexity(path, opts.data, opts.split, opts.fractions, opts.preset,
                                          opts.max_tokens, opts.device, state=state,
                                          context_window=opts.context_window,
                                          tokens_per_sample=opts.tokens_per_sample)
    return rep, spectra, panel


# ----------------------------------------------------------------------------------------------
# the command


def _labels(paths, labels):
    if labels:
        if len(labels) != len(paths):
            raise AnalyzeError(f"--labels: got {len(labels)} labels for {len(paths)} checkpoints")
        return list(labels)
    base = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    if len(set(base)) == len(base):
        return base
    return [f"{os.path.basename(os.path.dirname(os.path.abspath(p)))}/{b}" for p, b in zip(paths, base)]


def _check_options(data, rows_policy, fractions):
    """Validated fractions; raises AnalyzeError naming the flag, before anything is loaded."""
    if data is not None and not os.path.isdir(data):
        raise AnalyzeError(f"--data: not a directory: {data}")
    if rows_policy not in G.ROW_POLICIES:
        raise AnalyzeError(f"--rows must be one of {', '.join(G.ROW_POLICIES)}, got {rows_policy!r}")
    try:
        return G.parse_fractions(fractions, "--group-fractions")
    except ValueError as e:
        raise AnalyzeError(str(e))


def _word_sim_inputs(word_sim, word_sim_spm):
    """(the pairs of every --word-sim file, the loaded --word-sim-spm model or None), read and
    checked before any checkpoint is loaded; AnalyzeError naming the flag, file and line."""
    if word_sim_spm is not None and not word_sim:
        raise AnalyzeError("--word-sim-spm needs --word-sim FILE [FILE ...]")
    try:
        datasets = tuple(read_word_sim_files(word_sim or ()))
    except WordSimFileError as e:
        raise AnalyzeError(f"--word-sim {e}")
    try:
        spm = None if word_sim_spm is None else load_spm(word_sim_spm)
    except WordSimFileError as e:
        raise AnalyzeError(f"--word-sim-spm {e}")
    return datasets, spm


FIGURE_FILES = ("spectrum.png", "projection.png")
# every file a report may hold: a new report replaces all of them (an older report's figures do not
# survive a --no-figures run), while the other entries of --out are carried over
REPORT_FILES = FIGURE_FILES + ("report.json", "table.md")


def output_paths(out, figures=True) -> Dict[str, str]:
    """name -> path of every file the command writes in ``out``."""
    names = REPORT_FILES if figures else REPORT_FILES[len(FIGURE_FILES):]
    return OrderedDict((name, os.path.join(out, name)) for name in names)


def write_outputs(report, spectra, panels, out, figures, max_points, inputs=()):
    """report.json, table.md and (with ``figures``) the two PNG files, built in a new directory
    beside ``out`` that replaces ``out`` as a whole once all are complete
    (:func:`~fairseq_agg.files.atomic_directory`); returns their paths in ``out``."""
    with atomic_directory(out, names=REPORT_FILES, inputs=inputs, flag="--out") as building:
        paths = output_paths(building, figures)
        if figures:
            with open(paths["spectrum.png"], "wb") as handle:
                plot_spectrum(spectra, handle)
            with open(paths["projection.png"], "wb") as handle:
                plot_projection(panels, handle, max_points=max_points)
            report["figures"] = {"spectrum": "spectrum.png", "projection": "projection.png"}
        with open(paths["report.json"], "wb") as handle:
            handle.write(json.dumps(report, indent=1, allow_nan=False).encode("utf-8"))
        with open(paths["table.md"], "wb") as handle:
            handle.write(table_markdown(report["table"]).encode("utf-8"))
    return list(output_paths(out, figures).values())


def analyze(paths, data=None, split="valid", out="analysis", labels=None, rows_policy="no-pad-madeup",
            fractions=G.DEFAULT_FRACTIONS, preset=None, max_tokens=2048, ppl=True, figures=True,
            device=None, max_points=3000, word_sim=None, word_sim_spm=None, context_window=0,
            tokens_per_sample=None) -> dict:
    """Programmatic entry point of the command; returns the report dict (also written to disk)."""
    fractions = _check_options(data, rows_policy, fractions)
    word_sim = [word_sim] if isinstance(word_sim, str) else list(word_sim or [])
    inputs = list(paths) + word_sim + ([word_sim_spm] if word_sim_spm else [])
    check_output_directory(out, names=REPORT_FILES, inputs=inputs, flag="--out")
    word_sim_sets, word_sim_model = _word_sim_inputs(word_sim, word_sim_spm)
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    labels = _labels(paths, labels)
    scored = data is not None and ppl
    if not scored and (context_window or tokens_per_sample is not None):
        raise AnalyzeError("--context-window and --tokens-per-sample set how --data is scored; "
                           "pass --data DATA_BIN (without --no-ppl)")
    for path in paths:  # fail on any missing path before any work
        check_checkpoint_path(path)
        kind = irregular_file_kind(path)
        if kind is not None:  # torch.load would wait on a FIFO forever
            raise AnalyzeError(f"{path}: not a regular file ({kind}); pass a checkpoint file")
    states = []
    for i, path in enumerate(paths, 1):  # and on any unreadable one before the analysis
        logger.info("loading checkpoint %d/%d: %s", i, len(paths), path)
        states.append(load_checkpoint(path))
    if scored:  # refuse a context window that a checkpoint's task or block size rules out, before any work
        for path, state in zip(paths, states):
            scoring_tokens_per_sample(state, path, context_window, tokens_per_sample)
    opts = AnalyzeOptions(data, split, rows_policy, fractions, preset, max_tokens, ppl, device,
                          word_sim=word_sim_sets, word_sim_spm=word_sim_model,
                          context_window=context_window, tokens_per_sample=tokens_per_sample, split_targets={})
    reports, spectra, panels = [], [], []
    for i, (path, label, state) in enumerate(zip(paths, labels, states), 1):
        logger.info("analysing checkpoint %d/%d: %s%s", i, len(paths), label,
                    f" (and scoring --data {data} {split})" if scored else "")
        rep, checkpoint_spectra, panel = checkpoint_report(path, label, state, opts)
        reports.append(rep)
        spectra += checkpoint_spectra
        panels.append(panel)
    report = OrderedDict(
        version=1,
        settings={"rows": rows_policy, "group_fractions": list(fractions), "group_preset": preset,
                  "data": data, "split": split if scored else None,
                  "context_window": context_window if scored else None,
                  "tokens_per_sample": tokens_per_sample if scored else None,
                  "word_sim": [s.path for s in word_sim_sets] or None,
                  "word_sim_spm": None if word_sim_spm is None else os.path.abspath(word_sim_spm)},
        checkpoints=reports, table=build_table(reports), figures={},
    )
    write_outputs(report, spectra, panels, out, figures, max_points, inputs=inputs)
    return report


def run(args, parser):
    """``fairseq-agg-analyze`` with the arguments fairseq_agg_cli parsed."""
    # force: importing fairseq's text_to_speech task configures the root logger at DEBUG level
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                        level=logging.INFO, stream=sys.stderr, force=True)
    try:
        report = analyze(
            args.checkpoints, data=args.data, split=args.split, out=args.out, labels=args.labels,
            rows_policy=args.rows, fractions=args.group_fractions, preset=args.group_preset,
            max_tokens=args.max_tokens, ppl=not args.no_ppl, figures=not args.no_figures,
            device="cpu" if args.cpu else None, max_points=args.max_points,
            word_sim=args.word_sim, word_sim_spm=args.word_sim_spm,
            context_window=args.context_window, tokens_per_sample=args.tokens_per_sample,
        )
    except (AnalyzeError, UsageError) as e:
        parser.error(str(e))  # one line, exit status 2
    print(table_markdown(report["table"]), end="")
    for path in output_paths(args.out, not args.no_figures).values():
        print(f"wrote {path}", file=sys.stderr)
    return 0
