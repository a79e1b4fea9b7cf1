"""fairseq's own tests, from the fairseq-fixed sdist, as stock fairseq, with the plugin loaded as
``--user-dir`` loads it, and with the plugin's ``cross_entropy_agg`` in place of ``cross_entropy``
(tests/support/fairseq_own_tests.py says how). Each test's outcome is compared with the failures
stock fairseq has on this torch (tests/support/fairseq_own_tests_known.txt). CI runs a subset
(tests/test_fairseq_own_tests.py); this runs them all. Exit status 1 when a test fails that is not
listed as known, or a listed one passes.

Usage (from the repository root, after scripts/setup_env.sh --test):
       python -m scripts.fairseq_own_tests [--mode stock|loaded|swapped ...] [--tests DIR] [-k EXPR] [FILE ...]
"""
import argparse
import os
import sys

if __package__ != "scripts":  # run as a file: the repository root, and so tests/support/, is not importable
    sys.exit("run it from the repository root as: python -m scripts.fairseq_own_tests [ARGS]")

from tests.support import fairseq_own_tests as own

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m scripts.fairseq_own_tests", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", action="append", choices=own.MODES,
                        help="repeatable; default: stock, loaded and swapped, in that order")
    parser.add_argument("--tests", help=f"the sdist's tests/ directory (default: {own.TESTS_SUBDIR})")
    parser.add_argument("-k", dest="keyword", help="pytest's -k expression")
    parser.add_argument("files", nargs="*", help="test files in that directory, e.g. test_train.py (default: all)")
    args = parser.parse_args(argv)
    tests_dir = args.tests or own.find_tests_dir(ROOT)
    if not tests_dir or not os.path.isdir(tests_dir):
        parser.error(f"--tests: no fairseq tests at {args.tests or own.TESTS_SUBDIR}; "
                     "run scripts/setup_env.sh --test, or pass the sdist's tests/ directory")
    known = own.read_known()
    clean = True
    for mode in args.mode or own.MODES:
        result = own.run(mode, tests_dir, args.files, args.keyword)
        groups = own.classify(result["outcomes"], known)
        print(own.summary(result, groups), flush=True)
        if not result["outcomes"]:
            print(result["output"][-3000:])
        clean &= bool(result["outcomes"]) and not groups["unexpected"] and not groups["known but passed"]
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
