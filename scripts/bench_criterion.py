"""Benchmark of the output layer + loss, as a command: ``python -m scripts.bench_criterion`` from the
repository root (``--help`` lists the variants, kernels and options). What it measures and judges
is benchmarks/criterion/ (its package docstring); docs/benchmarks.md has the results.
"""
import sys

if __package__ != "scripts":  # run as a file: the repository root, and so benchmarks/, is not importable
    sys.exit("run it from the repository root as: python -m scripts.bench_criterion [ARGS]")

from fairseq_agg.fairseq_facts.import_logging import import_fairseq

import_fairseq()  # before the benchmark imports it: fairseq's import would put debug lines on stderr
from benchmarks.criterion.cli import main

if __name__ == "__main__":
    main()
