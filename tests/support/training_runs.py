"""What the measured ``fairseq-train`` runs of the GPU check (scripts/gpu_check.py) and the
whole-step benchmark (scripts/bench_training.py) share: the synthetic data-bin they train on, the
``train_inner`` records of their logs, the arithmetic on the update end times that their training
worker records (updates per second, the statistics' share of a run), and the precisions fairseq
itself cannot train at. tests/test_bench_training.py and tests/test_gpu_check.py check them.

The commands import it as ``tests.support.training_runs``, the tests as ``training_runs``
(tests/support/output_layer_problem.py says why).
"""
import json
import os
import re
import statistics

import torch

from tests.support.output_layer_problem import zipf_unigram


def zipf_dictionary(vocab: int):
    """(a fairseq Dictionary of ``vocab`` entries, the special symbols first, then words w0, w1, ...
    counted by a Zipf(1.1) law; the words' probabilities, a numpy array)."""
    import numpy as np
    from fairseq.data import Dictionary

    dictionary = Dictionary()
    probs = zipf_unigram(vocab).numpy()[len(dictionary):]
    probs = probs / probs.sum()
    expected = np.maximum(1, np.round(probs * 1e9)).astype(np.int64)
    for i in range(vocab - len(dictionary)):
        dictionary.add_symbol(f"w{i}", n=int(expected[i]))
    return dictionary, probs


def _write_lines(path: str, dictionary, lines):
    """``path``.bin / .idx in the mmap format, one item per line (token ids) with </s> appended, as
    fairseq-preprocess writes them."""
    import numpy as np
    from fairseq.data import indexed_dataset

    builder = indexed_dataset.make_builder(f"{path}.bin", impl="mmap", vocab_size=len(dictionary))
    for line in lines:
        builder.add_item(torch.from_numpy(np.append(line, dictionary.eos()).astype(np.int64)))
    builder.finalize(f"{path}.idx")


def write_synthetic_lm_bin(dest: str, vocab: int, train_tokens: int, valid_tokens: int, seed: int = 0):
    """A fairseq data-bin (dict.txt, {train,valid}.{bin,idx}, mmap format) of Zipfian "sentences"
    of 20-200 tokens, each ending in </s> as fairseq-preprocess writes them."""
    import numpy as np

    os.makedirs(dest, exist_ok=True)
    dictionary, probs = zipf_dictionary(vocab)
    dictionary.save(os.path.join(dest, "dict.txt"))
    rng = np.random.default_rng(seed)
    for split, total in (("train", train_tokens), ("valid", valid_tokens)):
        tokens = rng.choice(len(probs), size=total, p=probs) + dictionary.nspecial
        lines, start = [], 0
        while start < total:
            length = int(rng.integers(20, 200))
            lines.append(tokens[start : start + length])
            start += length
        _write_lines(os.path.join(dest, split), dictionary, lines)
    return dest


def write_synthetic_translation_bin(dest: str, vocab: int, train_pairs: int, valid_pairs: int, seed: int = 0,
                                    source: str = "en", target: str = "de", lengths=(10, 60)):
    """A fairseq translation data-bin as ``fairseq-preprocess --joined-dictionary`` writes it:
    dict.SRC.txt and dict.TGT.txt (the same Zipfian dictionary) and {train,valid}.SRC-TGT.{SRC,TGT}
    .{bin,idx} in the mmap format: ``train_pairs`` / ``valid_pairs`` pairs whose two sides are
    independent Zipfian sentences of ``lengths`` tokens (low inclusive, high exclusive) plus </s>.
    Data for measuring speed: there is nothing to learn in it but the unigram."""
    import numpy as np

    os.makedirs(dest, exist_ok=True)
    dictionary, probs = zipf_dictionary(vocab)
    for lang in (source, target):
        dictionary.save(os.path.join(dest, f"dict.{lang}.txt"))
    rng = np.random.default_rng(seed)
    for split, pairs in (("train", train_pairs), ("valid", valid_pairs)):
        for lang in (source, target):
            sizes = rng.integers(*lengths, size=pairs)
            tokens = rng.choice(len(probs), size=int(sizes.sum()), p=probs) + dictionary.nspecial
            lines = np.split(tokens, np.cumsum(sizes)[:-1])
            _write_lines(os.path.join(dest, f"{split}.{source}-{target}.{lang}"), dictionary, lines)
    return dest


_JSON_RECORD = re.compile(r"(\{.*\})\s*$")


def train_log_records(text: str):
    """The ``train_inner`` records of a ``--log-format json`` log (values are strings there)."""
    records = []
    for line in text.splitlines():
        found = _JSON_RECORD.search(line)
        if not found or '"wps"' not in line or '"num_updates"' not in line:
            continue
        try:
            records.append(json.loads(found.group(1)))
        except ValueError:
            continue
    return records


def updates_per_second(update_ends, warmup_fraction):
    """Updates per second between the end of the first update after the warm-up and the last."""
    first = min(len(update_ends) - 2, int(len(update_ends) * warmup_fraction))
    if first < 0:
        return None
    return (len(update_ends) - 1 - first) / (update_ends[-1] - update_ends[first])


def in_run_share(update_ends, warmup_fraction, interval):
    """The statistics' share of one run's time, read from its own update times: the time by which
    the updates that measure (every ``interval``-th, isotropy included) exceed the run's median
    update, over the run's time after the warm-up. Separate processes on a shared VM differ by a
    few per cent in speed for reasons of their own, more than the 2 % goal, so the paired
    process ratio cannot resolve it; this can. ``None`` for a run without statistics."""
    first = int(len(update_ends) * warmup_fraction)
    durations = {u: update_ends[u - 1] - update_ends[u - 2] for u in range(max(first, 2) + 1, len(update_ends) + 1)}
    if not interval or not durations:
        return None
    median = statistics.median(durations.values())
    excess = sum(d - median for u, d in durations.items() if u % interval == 0)
    return excess / sum(durations.values())


def fairseq_precision_problem(precision: str):
    """Why fairseq-train cannot run at ``precision`` on a GPU, or None.

    fairseq's option post-processing turns ``--bf16`` into ``--tpu`` (fairseq/options.py), and its
    Trainer then asks torch_xla for the device: ``--bf16`` trains on TPUs only.
    """
    if precision != "bf16":
        return None
    from fairseq import options

    args = options.parse_args_and_arch(
        options.get_training_parser(), ["data-bin", "--task", "language_modeling", "--arch", "transformer_lm", "--bf16"]
    )
    if getattr(args, "tpu", False):
        return "this fairseq turns --bf16 into --tpu (fairseq/options.py): fairseq-train --bf16 runs on TPUs only"
    return None
