"""Writes docs/compatibility.md: fairseq's models x tasks x the plugin's methods, each cell a tiny real
fairseq-train run, rows generated from fairseq's registries (tests/support/fairseq_matrix.py says
how). Exit status 1 when a run ends in a traceback.

Usage (from the repository root): python -m scripts.fairseq_matrix [--out docs/compatibility.md] [--rows lstm,fconv]
"""
import argparse
import contextlib
import json
import sys
import tempfile

if __package__ != "scripts":  # run as a file: the repository root, and so tests/support/, is not importable
    sys.exit("run it from the repository root as: python -m scripts.fairseq_matrix [ARGS]")

from tests.support import fairseq_matrix as matrix


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m scripts.fairseq_matrix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/compatibility.md", help="the table written (atomically)")
    parser.add_argument("--rows", help="comma-separated row names (default: every row)")
    parser.add_argument("--jsonl", help="also write every run's record here")
    parser.add_argument("--from-jsonl", help="write the table from the records of an earlier run instead of running")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # a process running these rows (run_rows)
    parser.add_argument("--sample", action="store_true",
                        help="on each pairing run cross_entropy_agg and one other method in turn, not all (the test's share)")
    parser.add_argument("--mt", help=argparse.SUPPRESS)
    parser.add_argument("--lm", help=argparse.SUPPRESS)
    parser.add_argument("--work", help="where the data and the runs' save directories go (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.row:
        return matrix.run_rows_here(args.row.split(","), {"mt": args.mt, "lm": args.lm}, args.work, sample=args.sample)
    import fairseq_agg
    from fairseq_agg.files import atomic_output

    fairseq_agg.register_with_fairseq()
    kept, skipped = matrix.rows()
    names = args.rows.split(",") if args.rows else [r[0] for r in kept]
    if args.from_jsonl:
        with open(args.from_jsonl) as f:
            records = [json.loads(line) for line in f]
    else:
        with contextlib.ExitStack() as stack:
            work = args.work or stack.enter_context(tempfile.TemporaryDirectory())
            records = matrix.run_rows(names, matrix.make_data(work), work, sample=args.sample)
    if args.jsonl:
        with atomic_output(args.jsonl, mode="w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    with atomic_output(args.out, mode="w") as f:
        f.write(matrix.table(records, skipped))
    broken = [r for r in records if r["status"] == "traceback"]
    print(f"{len(records)} runs, {len(broken)} tracebacks; wrote {args.out}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
