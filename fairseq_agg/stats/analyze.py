"""``fairseq-agg-analyze CHECKPOINT [CHECKPOINT ...] [--data DATA_BIN] [--out DIR]``
(also ``fairseq-agg analyze``): an embedding report of fairseq checkpoints.

For every distinct token-embedding matrix of every checkpoint (``enc`` = encoder input,
``dec`` = decoder input, ``out`` = output projection; tied matrices count once) it computes
TEV, mean pairwise cosine, isotropy I(W) (sign-symmetric / raw / sign-fixed) and the singular
values, over all rows and per frequency group, with the same functions and row rules as the live
logging (``fairseq_agg.stats.live``). With ``--data`` it also scores a split with the real model
(teacher forcing, no context window, like ``fairseq-eval-lm``'s default; for MT the target given
the source) and reports perplexity per frequency group of the target token, as the AGG paper's
Table 1. Several checkpoints give one comparison table and overlaid figures.

Outputs in ``--out`` (default ``analysis``): ``report.json``, ``table.md`` (also printed),
``spectrum.png`` (singular values of every matrix, overlaid) and ``projection.png`` (the output
embedding of each checkpoint projected on its top two right-singular directions, coloured by
frequency group: a degenerate "narrow cone" vs an isotropic cloud).

The per-group perplexity is reusable: :func:`per_group_perplexity` (checkpoint path) or
:func:`group_perplexity` (a loaded model and task).

report.json schema (version 1)
------------------------------
::

    {
      "version": 1,
      "settings": {"rows": "no-pad-madeup", "group_fractions": [0.3, 0.5, 0.2],
                   "group_preset": null, "data": DATA_BIN or null, "split": "valid" or null},
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
              "singular_values": [σ_1 >= σ_2 >= ... >= σ_d]
            }, ...
          },
          "ppl": {"split": "valid", "total": {"tokens": n, "nll": nats per token, "ppl": f},
                  "groups": {"freq": {"tokens", "nll", "ppl"}, "med": {...}, "rare": {...}}}
                 or null (no --data / --no-ppl)
        }, ...
      ],
      "table": {"columns": ["label", "matrix", "tev_mu", ...], "rows": [[...], ...]},
      "figures": {"spectrum": "spectrum.png", "projection": "projection.png"}
    }

Unavailable values (e.g. a group with fewer than two rows for ``mean_cos``, a ppl without
tokens) are ``null``. ``ppl`` = exp(nll) = 2^(fairseq's base-2 loss), i.e. fairseq's ``ppl``.
"""
import argparse
import json
import logging
import math
import os
import sys
from collections import OrderedDict
from typing import Dict, Optional, Sequence

import torch

from . import groups as G
from .metrics import (
    embedding_spectrum,
    group_nll_sums,
    isotropy,
    mean_pairwise_cosine,
    perplexity,
    tev_stats,
)

logger = logging.getLogger("fairseq_agg.analyze")

# state-dict parameter -> matrix name, in the order matrices are named (the first name of a
# tied group wins)
EMBEDDING_PARAMS = OrderedDict(
    [
        ("encoder.embed_tokens.weight", ("enc", "input")),
        ("decoder.embed_tokens.weight", ("dec", "input")),
        ("decoder.output_projection.weight", ("out", "output")),
        ("decoder.embed_out", ("out", "output")),
    ]
)
METRIC_KEYS = ("tev_mu", "tev_sigma", "tev_mu_over_init", "mean_cos", "isotropy", "isotropy_raw", "isotropy_fixed")
GROUP_COLOURS = {"freq": "tab:blue", "med": "tab:orange", "rare": "tab:red"}


class AnalyzeError(Exception):
    """A user-facing error (bad path, no embeddings, ...)."""


# ----------------------------------------------------------------------------------------------
# loading


def load_checkpoint(path: str):
    """fairseq's ``load_checkpoint_to_cpu`` with clear errors."""
    if not os.path.exists(path):
        raise AnalyzeError(f"checkpoint not found: {path}")
    if os.path.isdir(path):
        raise AnalyzeError(f"{path} is a directory; pass a checkpoint file (e.g. {os.path.join(path, 'checkpoint_best.pt')})")
    import fairseq_agg  # noqa: F401  (registers this plugin's models/criteria first)
    from fairseq import checkpoint_utils

    # fairseq checkpoints may hold an argparse.Namespace, which torch >= 2.6 refuses to unpickle
    # with weights_only=True unless it is allowed
    if hasattr(torch.serialization, "add_safe_globals"):
        torch.serialization.add_safe_globals([argparse.Namespace])
    try:
        state = checkpoint_utils.load_checkpoint_to_cpu(path)
    except Exception as e:  # torch.load / unpickling errors have unhelpful types
        raise AnalyzeError(f"{path} is not a readable fairseq checkpoint ({type(e).__name__}: {e})")
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise AnalyzeError(f"{path} is not a fairseq checkpoint (no 'model' state dict)")
    return state


def embedding_params(model_state: Dict[str, torch.Tensor], path: str = "checkpoint"):
    """Distinct embedding matrices of a state dict: name -> {"param", "tied", "role", "weight"}."""
    out = OrderedDict()
    for param, (name, role) in EMBEDDING_PARAMS.items():
        w = model_state.get(param)
        if not torch.is_tensor(w) or w.dim() != 2:
            continue
        same = next(
            (m for m in out.values() if m["weight"].shape == w.shape and
             (m["weight"].data_ptr() == w.data_ptr() or torch.equal(m["weight"], w))),
            None,
        )
        if same is not None:
            same["tied"].append(param)
            continue
        if name in out:
            continue
        out[name] = {"param": param, "tied": [], "role": role, "weight": w}
    if not out:
        raise AnalyzeError(
            f"{path} has no token-embedding matrix (looked for {', '.join(EMBEDDING_PARAMS)}); "
            "adaptive input/softmax models have no single embedding matrix"
        )
    return out


def _cfg_get(cfg, *keys, default=None):
    for k in keys:
        if cfg is None:
            return default
        try:
            cfg = cfg.get(k) if hasattr(cfg, "get") else getattr(cfg, k, None)
        except Exception:
            return default
    return default if cfg is None else cfg


def load_dictionaries(cfg, data: Optional[str]):
    """{"enc": Dictionary, "dec": ..., "out": ...} via the checkpoint's task on ``data`` (or the
    training data path), or {} when no dictionary can be found."""
    from fairseq import tasks
    from omegaconf import open_dict

    task_cfg = _cfg_get(cfg, "task")
    if task_cfg is None:
        return {}, None
    path = data or _cfg_get(task_cfg, "data")
    if not path or not os.path.isdir(str(path).split(os.pathsep)[0]):
        return {}, None
    try:
        with open_dict(task_cfg):
            task_cfg.data = path
        task = tasks.setup_task(task_cfg)
    except Exception as e:
        if data:
            raise AnalyzeError(f"cannot set up the checkpoint's task on --data {data}: {type(e).__name__}: {e}")
        logger.warning("no dictionary (task setup on %s failed: %s)", path, e)
        return {}, None
    from .live import task_dictionaries

    return task_dictionaries(task), path


def _dictionary_info(d, source):
    if d is None:
        return None
    return {"size": len(d), "nspecial": int(d.nspecial), "madeupwords": len(G.madeupword_ids(d)), "source": source}


# ----------------------------------------------------------------------------------------------
# embedding statistics


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
    out.update({k: iso[k] for k in ("isotropy", "isotropy_raw", "isotropy_fixed")})
    return {k: (_finite(v) if isinstance(v, float) else v) for k, v in out.items()}


def matrix_report(W, dictionary, rows_policy="no-pad-madeup", fractions=G.DEFAULT_FRACTIONS, preset=None,
                  padding_idx=None, device=None):
    """All statistics of one matrix; also returns what the figures need."""
    W = W.to(device) if device is not None else W
    if dictionary is not None and len(dictionary) != W.size(0):
        logger.warning("dictionary size %d != %d embedding rows; using fairseq's default layout", len(dictionary), W.size(0))
        dictionary = None
    mask = G.row_mask(dictionary, rows_policy, num_rows=W.size(0), pad_index=padding_idx)
    rows = mask.nonzero().reshape(-1).to(W.device)
    spec = embedding_spectrum(W, rows)
    rep = {"all": row_metrics(W, rows, spec), "groups": None,
           "singular_values": [float(s) for s in spec.singular_values.cpu()]}
    group_rows = OrderedDict()
    if dictionary is not None:
        grp = G.frequency_groups(dictionary, fractions, preset, flag="--group-preset")
        rep["groups"] = OrderedDict()
        for g, ids in grp.items():
            gm = torch.zeros_like(mask)
            gm[ids] = True
            r = (gm & mask).nonzero().reshape(-1).to(W.device)
            group_rows[g] = r
            rep["groups"][g] = row_metrics(W, r)
    return rep, {"W": W, "rows": rows, "spectrum": spec, "group_rows": group_rows}


# ----------------------------------------------------------------------------------------------
# perplexity per frequency group


@torch.no_grad()
def group_perplexity(model, task, split: str, groups: Dict[str, torch.Tensor], max_tokens: int = 2048,
                     batch_size: Optional[int] = None, device=None) -> dict:
    """Teacher-forced PPL of ``split`` in total and per group of the target token.

    ``groups`` maps a group name to target-dictionary ids (e.g. :func:`groups.frequency_groups`).
    Works for any fairseq model whose task yields ``net_input`` and ``target`` (LM, MT); log-probs
    come from ``model.get_normalized_probs`` in fp32; padding is never scored.
    """
    from fairseq import utils

    device = torch.device(device) if device is not None else next(model.parameters()).device
    model.eval()
    try:
        task.load_dataset(split)
    except FileNotFoundError as e:
        raise AnalyzeError(f"split {split!r} not found: {e}")
    dataset = task.dataset(split)
    tgt_dict = task.target_dictionary
    lookup = G.group_lookup(groups, len(tgt_dict)).to(device)
    itr = task.get_batch_iterator(
        dataset=dataset, max_tokens=max_tokens, max_sentences=batch_size,
        max_positions=utils.resolve_max_positions(task.max_positions(), model.max_positions()),
        ignore_invalid_inputs=True, required_batch_size_multiple=1, seed=1, num_workers=0,
    ).next_epoch_itr(shuffle=False)
    G_n = len(groups)
    sums = torch.zeros(G_n, dtype=torch.float64, device=device)
    counts = torch.zeros(G_n, dtype=torch.float64, device=device)
    total_nll, total_n = 0.0, 0
    for sample in itr:
        if not sample or "net_input" not in sample:
            continue
        sample = utils.apply_to_sample(lambda t: t.to(device), sample)
        net_output = model(**sample["net_input"])
        lprobs = model.get_normalized_probs(net_output, log_probs=True).float()
        target = model.get_targets(sample, net_output)
        nll = -lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        keep = target.ne(tgt_dict.pad())
        nll, target = nll[keep], target[keep]
        s, c = group_nll_sums(nll, target, lookup, G_n)
        sums += s
        counts += c
        total_nll += nll.double().sum().item()
        total_n += int(target.numel())
    if total_n == 0:
        raise AnalyzeError(f"split {split!r} has no scorable tokens")

    def entry(nll_sum, n):
        return {"tokens": int(n), "nll": (nll_sum / n) if n else None, "ppl": perplexity(nll_sum, n)}

    return {
        "split": split,
        "total": entry(total_nll, total_n),
        "groups": OrderedDict((g, entry(float(sums[k]), float(counts[k]))) for k, g in enumerate(groups)),
    }


def per_group_perplexity(checkpoint: str, data: str, split: str = "valid",
                         fractions: Sequence[float] = G.DEFAULT_FRACTIONS, preset: Optional[str] = None,
                         max_tokens: int = 2048, device=None, state=None) -> dict:
    """Loads ``checkpoint`` (or its already loaded ``state``) with its task on ``data`` and returns
    :func:`group_perplexity`'s dict for ``split`` with groups of the target dictionary."""
    from fairseq import checkpoint_utils
    from fairseq.dataclass.utils import overwrite_args_by_name

    if state is None:
        state = load_checkpoint(checkpoint)
    if not os.path.isdir(data):
        raise AnalyzeError(f"--data: not a directory: {data}")
    if state.get("args") is not None:
        state["args"].data = data
    if state.get("cfg") is not None:
        overwrite_args_by_name(state["cfg"], {"data": data})
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    models, _cfg, task = checkpoint_utils.load_model_ensemble_and_task([checkpoint], state=state)
    model = models[0].to(device)
    try:
        grp = G.frequency_groups(task.target_dictionary, fractions, preset, flag="--group-preset")
    except ValueError as e:
        raise AnalyzeError(str(e))
    return group_perplexity(model, task, split, grp, max_tokens=max_tokens, device=device)


# ----------------------------------------------------------------------------------------------
# figures


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_spectrum(entries, path):
    """entries: [(label, singular values list)] -> overlaid raw and normalised spectra."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label, sv in entries:
        sv = [s for s in sv if s > 0]  # exact zeros (rank < d) have no place on a log axis
        if not sv:
            continue
        axes[0].plot(range(1, len(sv) + 1), sv, label=label)
        axes[1].plot(range(1, len(sv) + 1), [s / sv[0] for s in sv], label=label)
    axes[0].set_title("singular values")
    axes[1].set_title("singular values / largest")
    for ax in axes:
        ax.set_yscale("log")
        ax.set_xlabel("index")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_projection(panels, path, max_points=3000):
    """panels: [(title, W, rows, spectrum, {group: rows})]; one panel per checkpoint."""
    plt = _plt()
    n = len(panels)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 4), squeeze=False)
    for ax, (title, W, rows, spec, group_rows) in zip(axes[0], panels):
        top2 = spec.directions[:2]  # top two right-singular directions (uncentred, as the AGG figure)
        sets = group_rows or OrderedDict([("all", rows)])
        for g, r in sets.items():
            if r.numel() == 0:
                continue
            step = max(1, math.ceil(r.numel() / max_points))  # even subsample, deterministic
            pts = (W.index_select(0, r[::step]).double() @ top2.t()).cpu()
            ax.scatter(pts[:, 0], pts[:, 1], s=4, alpha=0.6, label=g, c=GROUP_COLOURS.get(g, "tab:gray"))
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("u1")
        ax.set_ylabel("u2")
        ax.axhline(0, color="k", lw=0.3)
        ax.axvline(0, color="k", lw=0.3)
        ax.legend(fontsize=7, markerscale=3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# driver


def _labels(paths, labels):
    if labels:
        if len(labels) != len(paths):
            raise AnalyzeError(f"--labels: got {len(labels)} labels for {len(paths)} checkpoints")
        return list(labels)
    base = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    if len(set(base)) == len(base):
        return base
    return [f"{os.path.basename(os.path.dirname(os.path.abspath(p)))}/{b}" for p, b in zip(paths, base)]


def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def build_table(reports):
    cols = ["label", "matrix"] + list(METRIC_KEYS) + [f"isotropy_{g}" for g in G.GROUP_NAMES]
    with_ppl = any(r.get("ppl") for r in reports)
    if with_ppl:
        cols += ["ppl"] + [f"ppl_{g}" for g in G.GROUP_NAMES]
    rows = []
    for r in reports:
        for name, m in r["matrices"].items():
            row = [r["label"], name] + [m["all"].get(k) for k in METRIC_KEYS]
            row += [(m["groups"] or {}).get(g, {}).get("isotropy") for g in G.GROUP_NAMES]
            if with_ppl:
                p = r.get("ppl") or {}
                row += [(p.get("total") or {}).get("ppl")]
                row += [((p.get("groups") or {}).get(g) or {}).get("ppl") for g in G.GROUP_NAMES]
            rows.append(row)
    return {"columns": cols, "rows": rows}


def table_markdown(table):
    lines = ["| " + " | ".join(table["columns"]) + " |", "|" + "---|" * len(table["columns"])]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in table["rows"]]
    return "\n".join(lines) + "\n"


def analyze(paths, data=None, split="valid", out="analysis", labels=None, rows_policy="no-pad-madeup",
            fractions=G.DEFAULT_FRACTIONS, preset=None, max_tokens=2048, ppl=True, figures=True,
            device=None, max_points=3000) -> dict:
    """Programmatic entry point of the command; returns the report dict (also written to disk)."""
    if data is not None and not os.path.isdir(data):
        raise AnalyzeError(f"--data: not a directory: {data}")
    if rows_policy not in G.ROW_POLICIES:
        raise AnalyzeError(f"--rows must be one of {', '.join(G.ROW_POLICIES)}, got {rows_policy!r}")
    try:
        fractions = G.parse_fractions(fractions, "--group-fractions")
    except ValueError as e:
        raise AnalyzeError(str(e))
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    labels = _labels(paths, labels)
    states = [load_checkpoint(p) for p in paths]  # fail on any bad path before any work
    reports, spectra, panels = [], [], []
    for path, label, state in zip(paths, labels, states):
        cfg = state.get("cfg")
        mats = embedding_params(state["model"], path)
        dicts, dict_source = load_dictionaries(cfg, data)
        pad_default = None if dicts else G.FAIRSEQ_PAD
        rep = OrderedDict(
            label=label, path=os.path.abspath(path),
            num_updates=((state.get("optimizer_history") or [{}])[-1] or {}).get("num_updates"),
            epoch=((state.get("extra_state") or {}).get("train_iterator") or {}).get("epoch"),
            task=_cfg_get(cfg, "task", "_name"), arch=_cfg_get(cfg, "model", "_name") or _cfg_get(cfg, "model", "arch"),
            criterion=_cfg_get(cfg, "criterion", "_name"),
        )
        main_dict = dicts.get("out") or dicts.get("dec")
        rep["dictionary"] = _dictionary_info(main_dict, dict_source)
        try:
            grp = G.frequency_groups(main_dict, fractions, preset, flag="--group-preset") if main_dict is not None else None
        except ValueError as e:
            raise AnalyzeError(str(e))
        rep["groups"] = None if grp is None else {g: int(ids.numel()) for g, ids in grp.items()}
        rep["matrices"] = OrderedDict()
        fig_mat = None
        for name, m in mats.items():
            W = m["weight"]
            no_scale = bool(_cfg_get(cfg, "model", "no_scale_embedding", default=False))
            try:
                mrep, figdata = matrix_report(W, dicts.get(name), rows_policy, fractions, preset, pad_default, device)
            except ValueError as e:
                raise AnalyzeError(f"{path}: {e}")
            entry = OrderedDict(param=m["param"], tied=m["tied"], role=m["role"], shape=list(W.shape),
                                embed_scale=(1.0 if (m["role"] == "output" or no_scale) else math.sqrt(W.size(1))))
            entry.update(mrep)
            rep["matrices"][name] = entry
            spectra.append((f"{label}:{name}", mrep["singular_values"]))
            if m["role"] == "output" or m["tied"] or fig_mat is None:
                fig_mat = (name, figdata)
        name, fd = fig_mat
        panels.append((f"{label}: {name}", fd["W"], fd["rows"], fd["spectrum"], fd["group_rows"]))
        rep["ppl"] = None
        if data is not None and ppl:
            if grp is None:
                raise AnalyzeError(f"{path}: no target dictionary in --data {data}")
            rep["ppl"] = per_group_perplexity(path, data, split, fractions, preset, max_tokens, device, state=state)
        reports.append(rep)

    os.makedirs(out, exist_ok=True)
    table = build_table(reports)
    report = OrderedDict(
        version=1,
        settings={"rows": rows_policy, "group_fractions": list(fractions), "group_preset": preset,
                  "data": data, "split": split if data is not None and ppl else None},
        checkpoints=reports, table=table, figures={},
    )
    if figures:
        plot_spectrum(spectra, os.path.join(out, "spectrum.png"))
        plot_projection(panels, os.path.join(out, "projection.png"), max_points=max_points)
        report["figures"] = {"spectrum": "spectrum.png", "projection": "projection.png"}
    with open(os.path.join(out, "report.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, allow_nan=False)
    md = table_markdown(table)
    with open(os.path.join(out, "table.md"), "w", encoding="utf-8") as f:
        f.write(md)
    return report


def build_parser():
    p = argparse.ArgumentParser(
        prog="fairseq-agg-analyze",
        description="Embedding report (TEV, isotropy, mean cosine, spectrum, per-group PPL) of fairseq checkpoints.",
    )
    p.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT", help="fairseq checkpoint files (.pt)")
    p.add_argument("--data", metavar="DATA_BIN", help="data-bin directory: dictionaries and per-group perplexity")
    p.add_argument("--split", default="valid", help="split scored with --data (default: valid)")
    p.add_argument("--out", default="analysis", metavar="DIR", help="output directory (default: analysis)")
    p.add_argument("--labels", nargs="+", help="one label per checkpoint (default: file names)")
    p.add_argument("--rows", default="no-pad-madeup", choices=G.ROW_POLICIES, help="rows used by every matrix statistic")
    p.add_argument("--group-fractions", default="0.3,0.5,0.2", help="frequent,medium,rare fractions of the non-special types")
    p.add_argument("--group-preset", choices=sorted(G.PRESETS), help="fixed id ranges instead of fractions")
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens per batch when scoring (default: 2048)")
    p.add_argument("--no-ppl", action="store_true", help="with --data, skip the perplexity (dictionaries only)")
    p.add_argument("--no-figures", action="store_true", help="write no PNG files")
    p.add_argument("--max-points", type=int, default=3000, help="points per group in projection.png (default: 3000)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even when a GPU is available")
    return p


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.max_points < 1:
        parser.error(f"--max-points must be >= 1, got {args.max_points}")
    # force: importing fairseq's text_to_speech task configures the root logger at DEBUG level
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                        level=logging.INFO, stream=sys.stderr, force=True)
    try:
        report = analyze(
            args.checkpoints, data=args.data, split=args.split, out=args.out, labels=args.labels,
            rows_policy=args.rows, fractions=args.group_fractions, preset=args.group_preset,
            max_tokens=args.max_tokens, ppl=not args.no_ppl, figures=not args.no_figures,
            device="cpu" if args.cpu else None, max_points=args.max_points,
        )
    except AnalyzeError as e:
        parser.error(str(e))  # exits with status 2
    print(table_markdown(report["table"]), end="")
    print(f"wrote {os.path.join(args.out, 'report.json')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
