"""Part 5 of the GPU check (``--parts hf``, not in the default parts): the Hugging Face path, one
training step of a small ``LlamaForCausalLM`` with transformers' own loss on the materialised
logits against ``fairseq_agg.hf.apply(model, method="ce")`` and ``"agg"``, and Liger-Kernel's fused
linear cross-entropy beside them where it imports; step time and peak memory at the vocabularies of
Llama 2 and 3 (:mod:`benchmarks.hf`, the same code as ``python -m scripts.bench_hf``). On the
accelerator machine gpu_check.sh uses the machine's transformers 5.x where it imports, else installs
the bundle's (scripts/device/prepare.sh); the version that ran is recorded. Without a transformers
that imports, the part is skipped with the reason. Why it is not a default part: :mod:`.plan`."""
import argparse
import sys

import torch

from benchmarks import hf
from benchmarks.gpu_check.plan import Plan


def part_hf(plan: Plan, device: torch.device):
    try:
        import fairseq_agg.hf  # noqa: F401  (transformers, through the package's one door)
    except ImportError as error:
        return {"status": "skipped", "reason": f"not importable here: {error}"}
    dim, layers, seq, tokens, dtype = plan.hf_shape
    options = argparse.Namespace(vocabs=list(plan.hf_vocabs), dim=dim, layers=layers, seq=seq, tokens=tokens,
                                 dtype=dtype, warmup=plan.warmup, repeats=plan.repeats, seed=0, verbose=False,
                                 device=device.type)
    report = hf.run(options, log=lambda message: None)
    report["transformers"] = sys.modules["transformers"].__version__
    report["markdown"] = f"transformers {report['transformers']}\n\n" + hf.markdown(report["rows"])
    return report
