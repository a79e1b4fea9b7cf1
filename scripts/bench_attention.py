"""MLRA attention against fairseq's MultiheadAttention, as a command: ``python -m
scripts.bench_attention`` from the repository root (``--help`` says what it measures;
benchmarks/attention.py). docs/mlra.md has the results.
"""
import sys

if __package__ != "scripts":  # run as a file: the repository root, and so benchmarks/, is not importable
    sys.exit("run it from the repository root as: python -m scripts.bench_attention [ARGS]")

from fairseq_agg.fairseq_facts.import_logging import import_fairseq

import_fairseq()  # before the benchmark imports it: fairseq's import would put debug lines on stderr
from benchmarks.attention import main

if __name__ == "__main__":
    main()
