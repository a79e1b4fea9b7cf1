"""What one run of the output-layer benchmark measures: the problem at the command line's settings,
the kernels, and the keys of the selected variants (benchmarks/variants.py)."""
import sys

import torch

from benchmarks import ops, variants
from benchmarks.flags import refuse
from tests.support.output_layer_problem import DTYPES
from tests.support.output_layer_steps import StepProblem

DEFAULT_VARIANTS = ("stock+ls", "agg+ls", "agg_ref+ls", "al", "stock", "al_ref", "fused_ce", "freeze", "cosreg",
                    "face", "ul", "fused_ce+ls", "torch_ref", "torch_auto", "torch_chunk", "torch_ref+ls", "floor",
                    "al_floor", "agg+ls:torch", "fused_ce:torch")


class Problem(StepProblem):
    """The inputs of every variant (tests/support/output_layer_problem.py) at the command line's settings."""

    def __init__(self, args):
        super().__init__(args.tokens, args.dim, args.vocab, eps=args.label_smoothing, aug_tau=args.aug_temperature,
                         aug_coef=ops.aug_coefficient(args.aug_alpha, args.aug_scale, args.aug_temperature),
                         ul_seq_len=args.ul_seq_len, dtype=DTYPES[args.dtype], device=args.device, seed=args.seed,
                         zipf=args.zipf, window_updates=args.window_updates,
                         tokens_per_update=args.tokens_per_update, agg_alpha=args.agg_alpha)
        self.args = args
        self.stats = self.target_stats()

    def run(self, key):
        """One step of ``key`` (a :class:`benchmarks.variants.Key`)."""
        self.clear_grads()
        return variants.run(self, key, self.eps, self.args.chunk_size)


def parse_kernels(text, device):
    """The --kernels list, less ``compiled`` where torch.compile cannot generate code on ``device``
    (said in the report: a silent eager run under the compiled name would mislead)."""
    kernels = list(dict.fromkeys(k.strip() for k in text.split(",") if k.strip()))
    unknown = [k for k in kernels if k not in ops.PACKAGE_KERNELS]
    if unknown or not kernels:
        refuse(f"--kernels: unknown or no kernels {', '.join(unknown)}; choose from {','.join(ops.PACKAGE_KERNELS)} "
               f"(a foreign kernel is a variant's: --variants fused_ce:torch)")
    dropped = None
    reason = ops.compile_problem(device)
    if reason and "compiled" in kernels:
        dropped = f"compiled ({reason})"
        kernels.remove("compiled")
        print(f"note: --kernels: compiled left out: {reason}", file=sys.stderr)
        kernels = kernels or ["eager"]
    return kernels, dropped


def _entries(text):
    """The --variants entries as keys, refused in one line where one is not a key."""
    try:
        return [variants.parse_key(entry) for entry in text.split(",") if entry.strip()]
    except ValueError as error:
        refuse(f"--variants: {error}")


def _expand(args, entry, chunks, torch_chunks):
    """The keys one --variants entry stands for: a package variant without a kernel once per
    --kernels, a chunked one once per chunk size (a foreign kernel picks its own: no sweep)."""
    k, run_chunk = entry, args.chunk_size
    if k.variant.family == variants.PACKAGE and k.kernel is None:
        kernels = args.kernel_list
    else:
        kernels = [k.kernel]
    if k.name == "torch_chunk":
        sizes = torch_chunks
    elif k.variant.chunked and k.kernel not in ops.FOREIGN_KERNELS:
        sizes = chunks
    else:
        sizes = [None]
    return [variants.key(k.name, k.smoothed, kernel, size, run_chunk) for kernel in kernels for size in sizes]


def variant_keys(args):
    """The measured keys, in the order of --variants; the variants that cannot run here (torch
    without its op, a foreign kernel that does not load) are left out with a note."""
    chunks = [args.chunk_size]
    if args.chunk_sizes:
        chunks = sorted({int(c) for c in args.chunk_sizes.split(",")} | {args.chunk_size})
    torch_chunks = sorted({min(int(c), args.tokens) for c in args.torch_chunk_sizes.split(",")})
    keys = []
    for entry in _entries(args.variants):
        reason = variants.unavailable(entry)
        if reason:
            print(f"note: {reason}; variant {entry} left out", file=sys.stderr)
            continue
        keys += [k for k in _expand(args, entry, chunks, torch_chunks) if k not in keys]
    if not keys:
        refuse("--variants: nothing left to measure here")
    return keys


def primary_key(args, name, smoothed=False, kernel=None, chunk=None):
    """The key of ``name`` on ``kernel`` (the first of --kernels for a package variant without one)."""
    if kernel is None and variants.VARIANTS[name].family == variants.PACKAGE:
        kernel = args.kernel_list[0]
    return variants.key(name, smoothed, kernel, chunk, args.chunk_size)


def check_device(args):
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        refuse("--device cuda: no CUDA device available")
    if args.dtype != "fp32" and args.device == "cpu":
        print("note: bf16/fp16 on CPU is supported but slow and not what the targets are about", file=sys.stderr)
