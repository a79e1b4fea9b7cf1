"""Tiny synthetic corpora: sentences from a small Markov "language" with a Zipfian vocabulary, so
that a model learns something in a few updates (the loss goes down) and rare tokens exist.

Used by the tests' fairseq runs (tests/support/fairseq_runs.py, tests/test_study_tail.py) and by
the statistics benchmark (scripts/bench_stats.py); tests/support/output_layer_problem.py says how
each side imports it.
"""
import random


def markov_sentences(n_sent, n_words=300, seed=0, min_len=4, max_len=18, prefix="w"):
    """Sentences from a sparse first-order Markov chain over a Zipf-distributed vocabulary."""
    rng = random.Random(seed)
    words = [f"{prefix}{i}" for i in range(n_words)]
    weights = [1.0 / (i + 1) ** 1.1 for i in range(n_words)]
    # each word has a few likely successors, drawn from the Zipf distribution
    succ = {w: rng.choices(words, weights=weights, k=4) for w in words}
    out = []
    for _ in range(n_sent):
        length = rng.randint(min_len, max_len)
        w = rng.choices(words, weights=weights, k=1)[0]
        sent = [w]
        for _ in range(length - 1):
            w = rng.choice(succ[w]) if rng.random() < 0.8 else rng.choices(words, weights=weights, k=1)[0]
            sent.append(w)
        out.append(" ".join(sent))
    return out


def write_lines(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")
