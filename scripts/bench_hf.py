"""The Hugging Face path's cost, as a command: ``python -m scripts.bench_hf`` from the repository
root (``--help`` says what it measures; benchmarks/hf.py). docs/hf.md, "Benchmark", has the results.

Usage (from the repository root): python -m scripts.bench_hf [--quick] [--vocabs 32000,128256] [--tokens 1024]
       [--dim 256] [--device cpu|cuda] [--dtype fp32|bf16] [--repeats 3] [--json FILE]
"""
import sys

if __package__ != "scripts":  # run as a file: the repository root, and so benchmarks/, is not importable
    sys.exit("run it from the repository root as: python -m scripts.bench_hf [ARGS]")

from fairseq_agg.fairseq_facts.import_logging import import_fairseq

import_fairseq()  # before the benchmark imports it: fairseq's import would put debug lines on stderr
from benchmarks.hf import main

if __name__ == "__main__":
    sys.exit(main())
