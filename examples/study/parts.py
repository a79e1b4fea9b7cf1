"""What each part of the study trains: its runs (a method, model and budget each) and their
fairseq-train commands, built from the demos' own tables and ``Demo.train_command``.

A part's runs all share the demo's data, shared training flags and budget; a run changes only
what it is about (the criterion and its flags, the optimizer, the depth, the tying of the
embeddings). The tail part trains the LM demo's methods on its own word-level corpus
(examples/study/tail_data.py).
Budgets: ``smoke`` (a tiny model for a few updates: the CI check that every step works) and
``default`` (the study, sized from timed runs on 2 idle cores: docs/study.md, "Budgets").
"""
import dataclasses
from typing import Dict, List, Tuple

from examples.demo import run as lm_demo
from examples.demo_mt import run as mt_demo

PARTS = ("lm", "alpha", "depth", "mt", "tail")
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
# AGG's other reading of the paper's alpha (issue: the operating point, docs/study.md): the released
# per-update rule, a_k = count per optimizer update of the window, at 0.03 and x3, x1/3 of it
PER_UPDATE = ["--agg-threshold-mode", "per-update"]

BUDGET = {
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
        # six runs of ~20 minutes, two at a time: MLRA (another 20-30 minutes per seed) does not fit
        # the part's hour; the MT demo trains it (--methods mlra)
        "default": dict(mt_demo.BUDGET["default"], model=mt_demo.MODEL["default"], methods=["baseline", "agg"]),
    },
    "tail": {
        # a validation every other update (two in the last fifth, for the convergence line), each of
        # its first 20 batches only: the whole valid split of the real corpus takes half a minute
        "smoke": dict(LM_SMOKE, model=LM_SMOKE_MODEL, validate_every=2, max_valid_steps=20),
        "default": dict(TAIL_DEFAULT, model=TAIL_MODEL),
    },
}
SEEDS = {"lm": [1, 2, 3], "alpha": [1], "depth": [1], "mt": [1, 2, 3], "tail": [1, 2, 3]}
# The tail part's runs of one seed (the first of --seeds); the others have every seed.
TAIL_ONE_SEED = ("agg-a0.09", "agg-a0.01", "cosreg", "face", "ul", "al", "agg+coupled-adam",
                 "agg-pu-a0.09", "agg-pu-a0.01", "freeze-pu")
# more train_inner lines for the spike counts of the depth part: every max(10, updates // 100) updates;
# for the tail part's curve of AGG's rare set
LOG_LINES = {"lm": 20, "alpha": 20, "depth": 100, "mt": 10, "tail": 30}
SPIKE_DEFAULTS = {"window": 10, "gnorm_factor": 2.0, "loss_factor": 1.1}
UNTIE = "--share-decoder-input-output-embed"


def corpus_of(part):
    """The corpus a part trains on: the demos' "lm" or "mt", or the tail part's own "tail"."""
    return part if part in ("mt", "tail") else "lm"


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of a part: its name (method and variant), seed and how to train it."""

    part: str
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
        return corpus_of(self.part)

    def train_command(self, budget_name, budget, updates, data_bin, run_dir, cpu):
        """fairseq-train's argument list, by the demo's ``Demo.train_command``."""
        base = mt_demo.DEMO if self.corpus == "mt" else lm_demo.DEMO
        demo = dataclasses.replace(base, methods={self.name: self.method}, model={budget_name: list(self.model)},
                                   budget={budget_name: budget}, train_flags=list(self.train_flags),
                                   log_lines_per_run=LOG_LINES[self.part])
        extra = []
        if self.corpus != "mt":
            # several validations, so that the learning curve and the convergence check have points
            extra = ["--tokens-per-sample", str(budget["tokens_per_sample"]),
                     "--validate-interval-updates", str(budget.get("validate_every") or max(1, updates // 10))]
            if budget.get("max_valid_steps"):
                extra += ["--max-valid-steps", str(budget["max_valid_steps"])]
        return demo.train_command(self.name, data_bin, run_dir, self.seed, budget_name, updates, cpu, extra)


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


def _named_methods(part, budget) -> List[Tuple[str, dict, Tuple[str, ...], Tuple[str, ...], dict]]:
    """(name, method, model flags, train flags, group) of every run of ``part``, in table order."""
    M, model, flags = lm_demo.METHODS, tuple(budget["model"]), lm_train_flags()
    if part == "lm":
        out = []
        for name in ("baseline", "untied", "agg", "al", "mlra", "freeze", "cosreg", "face", "ul"):
            if name == "untied":
                out.append((name, _variant(M["baseline"], "stock CE, untied input and output embeddings"), model,
                            tuple(f for f in flags if f != UNTIE), {"method": name}))
            else:
                out.append((name, M[name], model, flags, {"method": name}))
        return out
    if part == "alpha":
        out = [(m, M[m], model, flags, {"method": m}) for m in ("baseline", "freeze", "cosreg")]
        for g1, alphas in (("code", budget["alphas"]), ("normalized", budget["normalized_alphas"])):
            for a in alphas:
                args = ["--agg-alpha", f"{a:g}"] + (["--agg-g1-mode", g1] if g1 != "code" else [])
                name = f"agg-{'norm-' if g1 != 'code' else ''}a{a:g}"
                out.append((name, _variant(M["agg"], f"AGG, alpha {a:g}, g1 mode {g1}", args), model, flags,
                            {"method": "agg", "alpha": a, "g1": g1}))
        return out
    if part == "depth":
        out = []
        for depth in budget["depths"]:
            deep = model + ("--decoder-layers", str(depth))
            out.append((f"baseline-L{depth}", M["baseline"], deep, flags, {"method": "baseline", "depth": depth}))
            for init in ("gpt2", "matched"):
                out.append((f"mlra-{init}-L{depth}",
                            _variant(M["mlra"], f"MLRA, --mlra-init {init}", ["--mlra-init", init]), deep, flags,
                            {"method": f"mlra-{init}", "depth": depth, "init": init}))
        return out
    if part == "mt":
        return [(m, mt_demo.METHODS[m], model, tuple(mt_demo.COMMON_TRAIN), {"method": m})
                for m in budget["methods"]]
    if part == "tail":
        out = [(m, M[m], model, flags, {"method": m, "alpha": TAIL_ALPHA if m in ("agg", "freeze") else None})
               for m in ("baseline", "agg", "freeze", "coupled-adam")]
        for factor in (3, 1 / 3):
            a = round(TAIL_ALPHA * factor, 6)
            method = _variant(M["agg"], f"AGG, alpha {a:g} ({factor:.3g} x the paper's)", ["--agg-alpha", f"{a:g}"])
            out.append((f"agg-a{a:g}", method, model, flags, {"method": "agg", "alpha": a}))
        out += [(m, M[m], model, flags, {"method": m}) for m in ("cosreg", "face", "ul", "al")]
        both = dict(_variant(M["agg"], "AGG, alpha 0.03, with Coupled Adam"), optimizer=M["coupled-adam"]["optimizer"])
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
        return out
    raise ValueError(f"unknown part {part!r}")


def seeds_of_run(part, name, seeds):
    """The seeds a run of ``part`` trains: all of ``seeds``, or the first for the tail part's
    one-seed runs (:data:`TAIL_ONE_SEED`)."""
    return seeds[:1] if part == "tail" and name in TAIL_ONE_SEED else list(seeds)


def run_specs(part, budget_name, seeds) -> List[RunSpec]:
    """Every run of ``part`` at ``budget_name``, seed by seed."""
    budget = BUDGET[part][budget_name]
    named = _named_methods(part, budget)
    return [RunSpec(part=part, name=name, seed=seed, method=method, model=model, train_flags=flags, group=group)
            for seed in seeds for name, method, model, flags, group in named if seed in seeds_of_run(part, name, seeds)]


def run_names(part, budget_name) -> List[str]:
    return [name for name, *_ in _named_methods(part, BUDGET[part][budget_name])]
