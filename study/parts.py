"""The study's parts, each described by a :class:`Part` in :data:`PARTS`: its corpus, its runs
(a method, model and budget each) and their fairseq-train commands, built from the demos' public
tables and ``train_command`` (study/corpora.py), how a run is evaluated, and what its report
holds: its table and its report's sections in order (study/report.py). run.py and report.py ask
the Part; nothing compares a part's name.

A part's runs all share the corpus's data, shared training flags and budget; a run changes only
what it is about (the criterion and its flags, the optimizer, the depth, the tying of the
embeddings). The tail part trains the LM demo's methods on its own word-level corpus
(study/tail_data.py).
Budgets: ``smoke`` (a tiny model for a few updates: the CI check that every step works) and
``default`` (the study, sized from timed runs on 2 idle cores: docs/study.md, "Budgets").
"""
import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

from examples.lm_demo import run as lm_demo
from examples.mt_demo import run as mt_demo
from study import columns as C
from study import evaluate as E
from study import report as R
from study import tail as T
from study import tail_budget as TB
from study import tail_report as TR
from study import tail_tables as TT
from study.corpora import LM, MT, TAIL, Corpus

BUDGETS = ("smoke", "default")

# The LM parts' tiny smoke model and budget (a few seconds of training on the test fixtures).
LM_SMOKE_MODEL = ["--decoder-layers", "2", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
                  "--decoder-attention-heads", "2"]
LM_SMOKE = {"updates": 12, "max_tokens": 256, "tokens_per_sample": 64, "warmup": 4, "context_window": 16,
            "uniq": {"n_prefixes": 8, "prefix_len": 8, "length": 16}}
# The LM parts' default: the demo's quick model (2 layers, d = 64) for 2,400 updates of 1,024 tokens
# (1.3 epochs), about 0.1 s per update with two runs on 2 cores, so that the lm part's 27 runs fit
# about an hour (timed 2026-12-03: docs/study.md, "Budgets").
LM_DEFAULT = {"updates": 2400, "max_tokens": 1024, "tokens_per_sample": 128, "warmup": 75, "context_window": 64,
              # Welleck et al. (2020) use 50 + 100 tokens; the demo model has 128 positions
              "uniq": {"n_prefixes": 200, "prefix_len": 32, "length": 64}}
# The LM parts decay the learning rate to zero over the run (cosine) instead of the demo's
# inverse-sqrt schedule, under which no affordable run converges: baseline runs of the quick model
# reached valid PPL 67.7 after 5,000 inverse-sqrt updates, still falling 2.4 % per 500 updates,
# while cosine runs changed by 0.8 % (2,500 updates) and 0.9 % (4,000) over their last fifth.
LM_SCHEDULE = ("--lr-scheduler", "cosine")
NARROW = ["--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "256", "--decoder-attention-heads", "4"]

# The tail part (word level, about 19k types): a Pre-LN, tied GPT-style decoder (the LM demo's
# shared flags) of width TAIL_WIDTH, 3,000 updates of 1,024 tokens (0.95 epoch), 19-26 minutes
# per run with two runs on 2 cores (measured), so that the part's 19 runs fit about 4 hours.
# Calibrated on 4 Dec 2026 (docs/study.md, "Part tail"): no budget tried (1 or 2 epochs, peak lr
# 2e-3 to 1e-2, 1,024 or 4,096 tokens per update, dropout 0.1 or 0) meets the convergence
# criterion; every baseline's valid PPL fell by 1.2 % or more over its last fifth. This one
# (-1.33 %) fits the budget.
TAIL_WIDTH, TAIL_LAYERS = 128, 2
TAIL_MODEL = ["--decoder-layers", str(TAIL_LAYERS), "--decoder-embed-dim", str(TAIL_WIDTH),
              "--decoder-ffn-embed-dim", str(4 * TAIL_WIDTH), "--decoder-attention-heads", "4"]
TAIL_DEFAULT = dict(LM_DEFAULT, updates=3000)
# AGG's threshold in the tail part: the paper's (Yu et al. 2022: 0.03 per update of 32,768 target
# tokens, the default relative threshold mode) and x3 and x1/3 of it
TAIL_ALPHA = 0.03
# AGG's other reading of the paper's alpha (docs/agg.md, "The operating point"): the released
# per-update rule, a_k = count per optimizer update of the window, at 0.03 and x3, x1/3 of it
PER_UPDATE = ["--agg-threshold-mode", "per-update"]

SPIKE_DEFAULTS = {"window": 10, "gnorm_factor": 2.0, "loss_factor": 1.1}
UNTIE = "--share-decoder-input-output-embed"


def lm_train_flags() -> Tuple[str, ...]:
    """The LM demo's shared fairseq-train flags with its schedule replaced by :data:`LM_SCHEDULE`."""
    flags = list(lm_demo.COMMON_TRAIN)
    i = flags.index("--lr-scheduler")
    flags[i:i + 2] = LM_SCHEDULE
    return tuple(flags)


def _variant(method, what, args=None, arch=None):
    out = dict(method, what=what)
    if args is not None:
        out["args"] = list(args)
    if arch is not None:
        out["arch"] = arch
    return out


# A part's runs: runs(budget) -> [(name, method, model flags, train flags, group)], in table order;
# a method is a demo's METHODS entry or a variant of one, the group what the report groups by.
Runs = List[Tuple[str, dict, Tuple[str, ...], Tuple[str, ...], dict]]


def lm_runs(budget) -> Runs:
    """Every method of the LM demo, and the baseline with untied embeddings."""
    M, model, flags = lm_demo.METHODS, tuple(budget["model"]), lm_train_flags()
    out = []
    for name in ("baseline", "untied", "agg", "al", "mlra", "freeze", "cosreg", "face", "ul"):
        if name == "untied":
            out.append((name, _variant(M["baseline"], "stock CE, untied input and output embeddings"), model,
                        tuple(f for f in flags if f != UNTIE), {"method": name}))
        else:
            out.append((name, M[name], model, flags, {"method": name}))
    return out


def alpha_runs(budget) -> Runs:
    """AGG at the budget's alphas, under both readings of g1, beside the baseline, freezing and CosReg."""
    M, model, flags = lm_demo.METHODS, tuple(budget["model"]), lm_train_flags()
    out = [(m, M[m], model, flags, {"method": m}) for m in ("baseline", "freeze", "cosreg")]
    for g1, alphas in (("code", budget["alphas"]), ("normalized", budget["normalized_alphas"])):
        for a in alphas:
            args = ["--agg-alpha", f"{a:g}"] + (["--agg-g1-mode", g1] if g1 != "code" else [])
            name = f"agg-{'norm-' if g1 != 'code' else ''}a{a:g}"
            out.append((name, _variant(M["agg"], f"AGG, alpha {a:g}, g1 mode {g1}", args), model, flags,
                        {"method": "agg", "alpha": a, "g1": g1}))
    return out


def depth_runs(budget) -> Runs:
    """The baseline and MLRA (both initialisations) at each of the budget's depths."""
    M, model, flags = lm_demo.METHODS, tuple(budget["model"]), lm_train_flags()
    out = []
    for depth in budget["depths"]:
        deep = model + ("--decoder-layers", str(depth))
        out.append((f"baseline-L{depth}", M["baseline"], deep, flags, {"method": "baseline", "depth": depth}))
        for init in ("gpt2", "matched"):
            out.append((f"mlra-{init}-L{depth}",
                        _variant(M["mlra"], f"MLRA, --mlra-init {init}", ["--mlra-init", init]), deep, flags,
                        {"method": f"mlra-{init}", "depth": depth, "init": init}))
    return out


def mt_runs(budget) -> Runs:
    """The budget's methods of the MT demo, with its shared flags."""
    return [(m, mt_demo.METHODS[m], tuple(budget["model"]), tuple(mt_demo.COMMON_TRAIN), {"method": m})
            for m in budget["methods"]]


def tail_runs(budget) -> Runs:
    """The remedies on the tail corpus: AGG at the paper's alpha, x3 and x1/3 (both threshold
    rules), freezing (AGG's set and the paper's static group), Coupled Adam, CosReg, FACE, UL, REAL."""
    M, model, flags = lm_demo.METHODS, tuple(budget["model"]), lm_train_flags()
    out = [(m, M[m], model, flags, {"method": m, "alpha": TAIL_ALPHA if m in ("agg", "freeze") else None})
           for m in ("baseline", "agg", "freeze", "coupled-adam")]
    for factor in (3, 1 / 3):
        a = round(TAIL_ALPHA * factor, 6)
        method = _variant(M["agg"], f"AGG, alpha {a:g} ({factor:.3g} x the paper's)", ["--agg-alpha", f"{a:g}"])
        out.append((f"agg-a{a:g}", method, model, flags, {"method": "agg", "alpha": a}))
    out += [(m, M[m], model, flags, {"method": m}) for m in ("cosreg", "face", "ul", "al")]
    both = dict(_variant(M["agg"], "AGG, alpha 0.03, with Coupled Adam"), optimizer=M["coupled-adam"]["optimizer"],
                optimizer_args=M["coupled-adam"]["optimizer_args"])
    out.append(("agg+coupled-adam", both, model, flags, {"method": "agg+coupled-adam", "alpha": TAIL_ALPHA}))
    # at AGG's own operating point: the per-update rule, and freezing as in the paper's Table 1
    for factor in (1, 3, 1 / 3):
        a = round(TAIL_ALPHA * factor, 6)
        name = "agg-pu" if factor == 1 else f"agg-pu-a{a:g}"
        method = _variant(M["agg"], f"AGG, alpha {a:g} per update ({factor:.3g} x the paper's)",
                          ["--agg-alpha", f"{a:g}"] + PER_UPDATE)
        out.append((name, method, model, flags, {"method": "agg", "alpha": a, "threshold_mode": "per-update"}))
    out.append(("freeze-group", _variant(M["freeze"], "freezing of the static bottom 20 % of types (30/50/20 groups; "
                                         "the paper's Table 1)", M["freeze"]["args"] + ["--agg-freeze-set", "group"]), model, flags,
                {"method": "freeze", "freeze_set": "group"}))
    out.append(("freeze-pu", _variant(M["freeze"], "freezing of AGG's per-update rare set (alpha 0.03)",
                                      M["freeze"]["args"] + PER_UPDATE), model, flags,
                {"method": "freeze", "alpha": TAIL_ALPHA, "threshold_mode": "per-update"}))
    # last, so that the earlier runs keep their styles in the figures
    out.append(("antifocal", M["antifocal"], model, flags, {"method": "antifocal"}))
    return out


@dataclasses.dataclass(frozen=True)
class Part:
    """One part of the study: what it trains, how a run is evaluated, and what its report holds."""

    name: str  # --part NAME, its directory WORK/NAME
    corpus: Corpus  # its data, and the demo whose train_command builds its runs' commands
    runs: Callable[[dict], Runs]  # (budget) -> its runs
    budget: Dict[str, dict]  # budget name -> updates, batch, model flags and the part's own settings
    seeds: Tuple[int, ...]  # without --seeds
    log_lines: int  # about this many train_inner lines per run
    # (ctx, spec, budget, run dir, checkpoint, log lines) -> result.json's "metrics" (study/evaluate.py)
    evaluate: Callable
    columns: Callable  # (metric getter, results, spike settings) -> its table's columns (study/columns.py)
    notes: str  # the legend under its table
    one_seed_runs: Tuple[str, ...] = ()  # runs trained on the first seed only
    uniq: bool = False  # Uniq of greedy continuations (an evaluation setting; in the console's line of a run)
    groupings: Optional[dict] = None  # frequency groupings its test PPL is scored under (an evaluation setting)
    # runs compared with the baseline of their depth, drawn in their method's style; µTEV in the console
    by_depth: bool = False
    tables: Callable = R.one_table  # (headers, rows) -> the markdown lines of its table(s)
    # its report after the table, section by section in this order (study/report.py): each
    # (report.Report) -> report.Section, its lines of table.md, figures and results.json entries
    report: Tuple[Callable, ...] = ()
    # its comparison with another budget's runs (--compare-budget): (part, results, the other budget's
    # results, work dir, the other work dir, out dir) -> the path of what it wrote
    budget_comparison: Optional[Callable] = None

    def seeds_of_run(self, name, seeds) -> List[int]:
        """The seeds run ``name`` trains: all of ``seeds``, or the first for a one-seed run."""
        return list(seeds[:1]) if name in self.one_seed_runs else list(seeds)

    def uniq_settings(self, a):
        """Uniq's settings at budget ``a.budget``, each overridden by its --uniq-* flag."""
        u = self.budget[a.budget]["uniq"]
        return {"n_prefixes": a.uniq_prefixes or u["n_prefixes"], "prefix_len": a.uniq_prefix_len or u["prefix_len"],
                "length": a.uniq_length or u["length"]}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of a part: its name (method and variant), seed and how to train it."""

    part: Part = dataclasses.field(repr=False)
    name: str  # e.g. "baseline", "agg-a0.08", "mlra-matched-L6"
    seed: int
    method: dict  # criterion, arch, args, what (a demo's METHODS entry or a variant of one)
    model: Tuple[str, ...]  # architecture flags
    train_flags: Tuple[str, ...]  # the demo's shared flags (minus the tying for "untied")
    group: Dict[str, object]  # what the report groups by: method, alpha, g1, depth, init

    @property
    def run_id(self):
        return f"{self.name}-s{self.seed}"

    @property
    def corpus(self):
        return self.part.corpus

    def train_command(self, budget, updates, data_bin, run_dir, cpu):
        """fairseq-train's argument list, by the corpus's demo's public ``train_command``."""
        return self.corpus.train_command(self.method, data_bin, run_dir, self.seed, updates, cpu,
                                         model=list(self.model), budget=budget, train_flags=list(self.train_flags),
                                         data_flags=self.corpus.train_data_flags(budget, updates),
                                         log_lines=self.part.log_lines)


BUDGET = {  # the budgets of each part (Part.budget)
    "lm": {
        "smoke": dict(LM_SMOKE, model=LM_SMOKE_MODEL),
        "default": dict(LM_DEFAULT, model=lm_demo.MODEL["quick"]),
    },
    "alpha": {
        "smoke": dict(LM_SMOKE, model=LM_SMOKE_MODEL, alphas=[0.03, 0.3], normalized_alphas=[0.3]),
        # log-spaced over 1.5 decades at the default threshold mode (auto = relative), and the
        # other reading of g1 (a_k / alpha) at three of them
        "default": dict(LM_DEFAULT, model=lm_demo.MODEL["quick"], alphas=[0.01, 0.02, 0.04, 0.08, 0.16, 0.3],
                        normalized_alphas=[0.02, 0.08, 0.3]),
    },
    "depth": {
        "smoke": dict(LM_SMOKE, model=LM_SMOKE_MODEL[2:], depths=[1, 2]),
        # 0.33 s per update at 12 layers (two runs on 2 cores): the part takes about 35 minutes
        "default": dict(LM_DEFAULT, updates=1500, model=NARROW, depths=[2, 6, 12]),
    },
    "mt": {
        "smoke": dict(mt_demo.BUDGET["quick"], updates=12, model=mt_demo.MODEL["quick"],
                      methods=["baseline", "agg", "mlra"]),
        # six runs of ~20 minutes, two at a time, and the other two rare-word remedies on the first
        # seed (MT_ONE_SEED): MLRA (another 20-30 minutes per seed) does not fit; the MT demo trains
        # it (--methods mlra)
        "default": dict(mt_demo.BUDGET["default"], model=mt_demo.MODEL["default"],
                        methods=["baseline", "agg", "face", "antifocal"]),
    },
    "tail": {
        # a validation every other update (two in the last fifth, for the convergence line), each of
        # its first 20 batches only: the whole valid split of the real corpus takes half a minute
        "smoke": dict(LM_SMOKE, model=LM_SMOKE_MODEL, validate_every=2, max_valid_steps=20),
        "default": dict(TAIL_DEFAULT, model=TAIL_MODEL),
    },
}
# The tail part's runs of one seed (the first of --seeds); the others have every seed.
TAIL_ONE_SEED = ("agg-a0.09", "agg-a0.01", "cosreg", "face", "ul", "al", "agg+coupled-adam",
                 "agg-pu-a0.09", "agg-pu-a0.01", "freeze-pu", "antifocal")
# The MT part's runs of one seed (the first of --seeds).
MT_ONE_SEED = ("face", "antifocal")

PARTS = {p.name: p for p in (
    Part("lm", LM, lm_runs, BUDGET["lm"], seeds=(1, 2, 3), log_lines=20, evaluate=E.evaluate_lm,
         columns=C.lm_columns, notes=C.LM_NOTES, uniq=True,
         report=(R.convergence_line, R.uniq_line, R.word_similarity_pairs, R.learning_curves, R.group_ppl_figure,
                 R.projections_figure)),
    Part("alpha", LM, alpha_runs, BUDGET["alpha"], seeds=(1,), log_lines=20, evaluate=E.evaluate_lm,
         columns=C.alpha_columns, notes=C.ALPHA_NOTES,
         report=(R.convergence_line, R.learning_curves, R.frontier_figure)),
    # more train_inner lines for the spike counts: every max(10, updates // 100) updates
    Part("depth", LM, depth_runs, BUDGET["depth"], seeds=(1,), log_lines=100, evaluate=E.evaluate_lm,
         columns=C.depth_columns, notes=C.DEPTH_NOTES, by_depth=True,
         report=(R.convergence_line, R.spike_line, R.learning_curves, R.depth_figure)),
    Part("mt", MT, mt_runs, BUDGET["mt"], seeds=(1, 2, 3), log_lines=10, evaluate=E.evaluate_mt,
         columns=C.mt_columns, notes=C.MT_NOTES, one_seed_runs=MT_ONE_SEED, report=(R.learning_curves,)),
    # more train_inner lines for the curve of AGG's rare set; its own section draws its learning curves
    Part("tail", TAIL, tail_runs, BUDGET["tail"], seeds=(1, 2, 3), log_lines=30, evaluate=T.evaluate,
         columns=TT.columns, notes=TT.NOTES, one_seed_runs=TAIL_ONE_SEED, uniq=True, groupings=T.GROUPINGS,
         tables=TT.tables, report=(R.convergence_line, R.uniq_line, R.word_similarity_pairs, TR.section,
                                   R.projections_figure),
         budget_comparison=TB.write_budget_comparison),
)}


def run_specs(part, budget_name, seeds) -> List[RunSpec]:
    """Every run of ``part`` at ``budget_name``, seed by seed."""
    named = part.runs(part.budget[budget_name])
    return [RunSpec(part=part, name=name, seed=seed, method=method, model=model, train_flags=flags, group=group)
            for seed in seeds for name, method, model, flags, group in named if seed in part.seeds_of_run(name, seeds)]


def run_names(part, budget_name) -> List[str]:
    return [name for name, *_ in part.runs(part.budget[budget_name])]
