"""The fairseq-train runs of the GPU check's parts 3 and 3b: which runs, their flags and their keys."""
import torch

from benchmarks.gpu_check.plan import Plan


def train_runs(plan: Plan):
    """(name, arch, criterion flags) of the four runs of part 3, stock first (the ratios' baseline);
    the package's criteria on the default path, named explicitly (their log says which path ran)."""
    return [
        ("stock cross_entropy", plan.train_arch, ["--criterion", "cross_entropy"]),
        ("cross_entropy_agg", plan.train_arch, ["--criterion", "cross_entropy_agg", "--output-kernel", "auto"]),
        ("augmented_loss", plan.train_arch, ["--criterion", "augmented_loss", "--output-kernel", "auto"]),
        ("MLRA", plan.train_mlra_arch, ["--criterion", "cross_entropy"]),
    ]


def mt_train_runs(plan: Plan):
    """(name, size, arch, criterion flags) of the WMT14 recipe's METHODs (examples/wmt14_en_de/
    train.sh: label smoothing 0.1, AGG's alpha 0.08), most wanted first: each size's baseline (the
    ratios' baseline) and AGG, then REAL and MLRA at base."""
    smoothing = ["--label-smoothing", "0.1"]
    stock = ["--criterion", "label_smoothed_cross_entropy", *smoothing]
    agg = ["--criterion", "cross_entropy_agg", *smoothing, "--agg-alpha", "0.08", "--output-kernel", "auto"]
    base, big = plan.mt_archs["base"], plan.mt_archs["big"]
    return [("baseline", "base", base, stock), ("agg", "base", base, agg),
            ("baseline", "big", big, stock), ("agg", "big", big, agg),
            ("aug", "base", base, ["--criterion", "augmented_loss", *smoothing, "--output-kernel", "auto"]),
            ("mlra", "base", plan.mt_mlra_arch, stock)]


def run_key(run) -> str:
    """A measured run's key in its part's ratios: "precision [size] name"."""
    return " ".join(x for x in (run["precision"], run.get("size"), run["name"]) if x)


def _run_flags(plan: Plan, save_dir: str, precision: str, device: torch.device):
    """The flags every measured run shares: its length and logging, nothing saved or validated."""
    args = ["--max-update", str(plan.updates), "--log-format", "json", "--log-interval", str(plan.log_interval),
            "--disable-validation", "--no-save", "--save-dir", save_dir, "--num-workers", "0", "--seed", "1"]
    if precision in ("fp16", "bf16"):
        args.append(f"--{precision}")
    if device.type == "cpu":
        args.append("--cpu")
    return args


def train_args(plan: Plan, data: str, save_dir: str, arch: str, precision: str, device: torch.device):
    return [
        data, "--task", "language_modeling", "--arch", arch, *plan.train_arch_flags,
        "--share-decoder-input-output-embed", "--tokens-per-sample", str(plan.tokens_per_sample),
        "--sample-break-mode", "none", "--max-tokens", str(plan.max_tokens), "--required-batch-size-multiple", "1",
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--weight-decay", "0.01", "--lr", "0.0005",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(plan.warmup_updates), "--warmup-init-lr", "1e-07",
        *_run_flags(plan, save_dir, precision, device),
    ]


def mt_train_args(plan: Plan, data: str, save_dir: str, arch: str, precision: str, device: torch.device):
    """examples/wmt14_en_de/train.sh's optimisation on one GPU, one micro-batch per update."""
    return [
        data, "--task", "translation", "--source-lang", "en", "--target-lang", "de", "--arch", arch,
        *plan.mt_arch_flags, "--share-all-embeddings", "--dropout", "0.3", "--max-tokens", str(plan.mt_max_tokens),
        "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "0.0", "--weight-decay", "0.01",
        "--lr", "1e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", str(plan.warmup_updates),
        "--warmup-init-lr", "1e-07", *_run_flags(plan, save_dir, precision, device),
    ]
