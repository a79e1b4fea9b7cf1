"""The Hugging Face path's cost, measured side by side in one run (``python -m scripts.bench_hf``):
one training step (forward and backward) of a small ``LlamaForCausalLM`` whose output layer
dominates, with transformers' own loss on the materialised logits (``stock``: the model's forward
with ``labels``, ``ForCausalLMLoss``) against the same model after ``fairseq_agg.hf.apply(model,
method="ce")`` and ``method="agg"`` (the package's fused output layer: no tokens x V logits), and
beside them Liger-Kernel's fused linear cross-entropy on the model's last hidden states where
Liger imports (a GPU with Triton; otherwise skipped with the reason).

Per vocabulary (default 32,000, Llama 2's, and 128,256, Llama 3's): the step's median time over
interleaved rounds (:mod:`benchmarks.timing`: every variant called once untimed, then warm-up and
timed rounds in rotated order) and each variant's time over stock's in the same round (the median
of those ratios); the peak memory of one step above its start (:mod:`benchmarks.memory`: the
allocator's peak on CUDA, torch.profiler's allocation trace on a CPU), the gradients it leaves
included; and the losses of ``ce`` and ``stock`` on the same batch, which must agree. All
variants start from the same weights and see the same batch (Zipfian token ids).
"""
import argparse
import copy
import itertools
import json
import os
import platform
import sys

import torch

from benchmarks.flags import refuse
from fairseq_agg.errors import UsageError
from fairseq_agg.files import atomic_output, check_output_path

# the measuring modules (benchmarks.timing, tests/support's problem) import fairseq: loaded once the
# flags parse, so that a refused flag is answered at once
DTYPE_NAMES = ("bf16", "fp16", "fp32")  # tests/support/output_layer_problem.py's DTYPES

VARIANTS = ("stock", "ce", "agg", "liger")
DESCRIPTIONS = {
    "stock": "transformers' own loss on the materialised logits (the model's forward with labels)",
    "ce": "fairseq_agg.hf.apply(model, method='ce'): the fused output layer, plain cross-entropy",
    "agg": "fairseq_agg.hf.apply(model, method='agg'): the fused output layer with AGG's gates",
    "liger": "Liger-Kernel's LigerFusedLinearCrossEntropyLoss on the model's last hidden states",
}
AGG_WINDOW_UPDATES = 100  # AGG's window in updates (apply's agg_window 0 is one epoch, which a benchmark has not)


def tiny_llama(vocab, dim, layers, seq, seed, device, dtype):
    """A randomly initialised ``LlamaForCausalLM`` (untied head, as Llama's) of ``layers`` layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(1, dim // 64)
    config = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).train()


def batch_of(vocab, rows, seq, seed, device):
    """``rows`` x ``seq`` token ids drawn from a Zipf distribution over the vocabulary."""
    from tests.support.output_layer_problem import zipf_unigram

    generator = torch.Generator().manual_seed(seed)
    ids = torch.multinomial(zipf_unigram(vocab).float(), rows * seq, replacement=True, generator=generator)
    return ids.view(rows, seq).to(device)


def steps(start, batch):
    """{variant: step()} on copies of ``start``: each a forward with labels and a backward, returning
    the loss; and {variant: its model}."""
    from benchmarks import external
    from benchmarks.ops import NotApplicable
    from fairseq_agg.hf import apply

    models = {"stock": start, "ce": apply(copy.deepcopy(start), method="ce"),
              "agg": apply(copy.deepcopy(start), method="agg"), "liger": copy.deepcopy(start)}
    method = models["agg"].fairseq_agg
    if not method.window_is_set:
        method.set_window(AGG_WINDOW_UPDATES)
    updates = itertools.count()

    def labelled(variant):
        model = models[variant]

        def step():
            if variant == "agg":
                method.update_num = next(updates)  # as in training: every step one more update
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            return loss.detach()

        return step

    def liger():
        if external.problem("liger"):
            raise NotApplicable(external.problem("liger"))
        model = models["liger"]
        hidden = model.model(input_ids=batch).last_hidden_state[:, :-1]
        problem = argparse.Namespace(weight=model.lm_head.weight, hidden=hidden.reshape(-1, hidden.size(-1)),
                                     target=batch[:, 1:].reshape(-1))
        return external.liger_step(problem, None, None, 0.0) / problem.target.numel()  # Liger sums; stock means

    calls = {v: labelled(v) for v in ("stock", "ce", "agg")}
    calls["liger"] = liger
    return calls, models


def measure_vocab(vocab, a, device, log):
    """One vocabulary's row of the report."""
    from benchmarks.memory import profiler_peak
    from benchmarks.timing import Harness
    from tests.support.output_layer_problem import DTYPES, MIB, rel_diff

    dtype = DTYPES[a.dtype]
    start = tiny_llama(vocab, a.dim, a.layers, a.seq, a.seed, device, dtype)
    batch = batch_of(vocab, a.tokens // a.seq, a.seq, a.seed, device)
    calls, models = steps(start, batch)

    def before(key):
        models[key].zero_grad(set_to_none=True)

    log(f"[bench_hf] V={vocab}: N={batch.numel()} tokens ({batch.size(0)} x {a.seq}), d={a.dim}, {a.layers} layer(s), "
        f"{a.dtype} on {device}")
    harness = Harness(device, before=before, log=log if a.verbose else None, record_errors=device.type == "cuda")
    samples = harness.measure(calls, a.warmup, a.repeats)
    row = {"V": vocab, "N": int(batch.numel()), "d": a.dim, "variants": {}, "ratios": {}}
    for key in VARIANTS:
        if key in samples.failed:
            row["variants"][key] = samples.failed[key]
            continue
        if device.type == "cuda":
            peak = harness.cuda_peak(calls[key], key)
        else:
            peak = profiler_peak(calls[key], lambda key=key: before(key))
        row["variants"][key] = {"median_ms": samples.median(key) * 1e3, "first_ms": samples.first[key] * 1e3,
                                "peak_mib": peak / MIB, "loss": float(samples.result[key])}
    stock, ce = row["variants"]["stock"], row["variants"]["ce"]
    for key in VARIANTS[1:]:
        entry = row["variants"][key]
        if "median_ms" in entry and "median_ms" in stock:
            row["ratios"][f"{key}_time_vs_stock"] = samples.paired(key, "stock")
            row["ratios"][f"{key}_memory_vs_stock"] = entry["peak_mib"] / stock["peak_mib"]
    if "loss" in ce and "loss" in stock:
        row["loss_rel_diff_ce_vs_stock"] = rel_diff(torch.tensor(ce["loss"]), torch.tensor(stock["loss"]))
    return row


def markdown(rows):
    """The report: one table per vocabulary, variants as rows."""
    out = []
    for row in rows:
        out += [f"V = {row['V']:,}, N = {row['N']:,} tokens, d = {row['d']}:", "",
                "| variant | step ms (median) | time / stock | peak MiB | memory / stock |", "|---|---|---|---|---|"]
        for key in VARIANTS:
            entry = row["variants"][key]
            if "median_ms" not in entry:
                out.append(f"| {key} | {next(iter(entry))}: {next(iter(entry.values()))} | | | |")
                continue
            time_ratio = row["ratios"].get(f"{key}_time_vs_stock", 1.0)
            memory_ratio = row["ratios"].get(f"{key}_memory_vs_stock", 1.0)
            out.append(f"| {key} | {entry['median_ms']:.1f} | {time_ratio:.2f} | {entry['peak_mib']:.1f} | "
                       f"{memory_ratio:.2f} |")
        if "loss_rel_diff_ce_vs_stock" in row:
            out += ["", f"ce's loss against stock's: relative difference {row['loss_rel_diff_ce_vs_stock']:.1e}"]
        out.append("")
    return "\n".join(out)


def run(a, log=print):
    """The measurements of every vocabulary of ``a`` (parsed flags); returns the report's dict."""
    device = torch.device(a.device)
    rows = [measure_vocab(v, a, device, log) for v in a.vocabs]
    return {"device": str(device), "machine": platform.processor() or platform.machine(), "threads":
            torch.get_num_threads(), "dtype": a.dtype, "layers": a.layers, "seq": a.seq, "warmup": a.warmup,
            "repeats": a.repeats, "variants": DESCRIPTIONS, "memory": "cuda" if device.type == "cuda" else "profiler",
            "rows": rows}


# the sizes of a run; --quick's replace those not given on the command line
SIZES = {"vocabs": "32000,128256", "tokens": 1024, "seq": 256, "dim": 256, "warmup": 1, "repeats": 3}
QUICK_SIZES = {"vocabs": "2000,8000", "tokens": 256, "seq": 64, "dim": 32, "warmup": 0, "repeats": 1}


def build_parser():
    ap = argparse.ArgumentParser(prog="python -m scripts.bench_hf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocabs", help="comma-separated vocabulary sizes (default 32000,128256; --quick 2000,8000)")
    ap.add_argument("--tokens", type=int, help="tokens in the batch (default 1024; --quick 256)")
    ap.add_argument("--seq", type=int, help="tokens per row of the batch (default 256; --quick 64)")
    ap.add_argument("--dim", type=int, help="hidden size (default 256; --quick 32)")
    ap.add_argument("--layers", type=int, default=1, help="decoder layers (default 1: the output layer dominates)")
    ap.add_argument("--dtype", choices=DTYPE_NAMES, default="fp32")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--warmup", type=int, help="untimed rounds after the first calls (default 1; --quick 0)")
    ap.add_argument("--repeats", type=int, help="timed rounds (default 3; --quick 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    ap.add_argument("--json", help="also write the measurements to this file (atomically)")
    ap.add_argument("--verbose", action="store_true", help="a line per round")
    return ap


def parse_args(argv):
    a = build_parser().parse_args(argv)
    for name, value in (QUICK_SIZES if a.quick else SIZES).items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    try:
        a.vocabs = [int(v) for v in a.vocabs.split(",") if v.strip()]
    except ValueError:
        refuse(f"--vocabs must be comma-separated integers, got {a.vocabs!r}")
    if not a.vocabs or min(a.vocabs) < 8:
        refuse(f"--vocabs must name vocabulary sizes >= 8, got {a.vocabs}")
    for flag, value, low in (("--tokens", a.tokens, 2), ("--seq", a.seq, 2), ("--dim", a.dim, 8),
                             ("--layers", a.layers, 1), ("--warmup", a.warmup, 0), ("--repeats", a.repeats, 1)):
        if value < low:
            refuse(f"{flag} must be >= {low}, got {value}")
    if a.tokens % a.seq:
        refuse(f"--tokens must be a multiple of --seq ({a.seq}), got {a.tokens}")
    if a.device not in ("cpu", "cuda") or (a.device == "cuda" and not torch.cuda.is_available()):
        refuse(f"--device must be cpu or cuda (with a GPU), got {a.device}")
    if a.json:
        try:
            check_output_path(a.json, flag="--json")
        except UsageError as error:
            refuse(str(error))
    return a


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    from fairseq_agg.fairseq_facts.import_logging import import_fairseq

    import_fairseq()  # before the measuring modules import it: fairseq's import would put debug lines on stderr
    report = run(a)
    print(markdown(report["rows"]))
    if a.json:
        with atomic_output(a.json, "w", flag="--json") as f:
            json.dump(report, f, indent=2)
        print(f"[bench_hf] wrote {os.path.abspath(a.json)}")
    return 0
