"""Shared by the tests and the benchmarks: reference implementations written from the papers'
formulas (the oracles the fused kernels are checked against) and helpers that run real fairseq
command-line tools on tiny generated corpora."""
