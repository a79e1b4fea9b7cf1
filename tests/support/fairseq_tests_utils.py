"""``tests/utils.py`` for fairseq's own tests: the helper module that 15 of the fairseq-fixed
0.12.3.1 sdist's test files import (``import tests.utils as test_utils``, ``from tests.utils import
...``, ``from .utils import ...``) and that the sdist does not ship (setuptools puts only
``tests/test_*.py`` into it; no package registry has it). Without it those files, and the ones
importing them (test_inference_dropout, test_transformer, test_reproducibility, test_iopath's
tests), cannot even be collected.

Written for this repository from how those test files use it: the names they import, the arguments
they pass and what they then assert; fairseq's library (``fairseq``, ``fairseq_cli``) was read to
learn its APIs, nothing else. tests/support/fairseq_own_tests.py copies it into a run's copy of the
tests as ``tests/utils.py`` when the sdist's directory has none.

Everything runs real fairseq: preprocessing through ``fairseq_cli.preprocess``, training through
``fairseq_cli.train.main`` with a parser from ``fairseq.options``, validation and generation
through ``fairseq_cli.validate`` and ``fairseq_cli.generate``, in this process (the tests read the
log records and catch the exceptions), at the tiny sizes the tests pass. The model of
:class:`TestTranslationTask` returns the probabilities a test puts in ``args`` (``probs`` or
``beam_probs``), so that a test can assert the exact hypotheses and scores of fairseq's search and
scoring code.
"""
import argparse
import json
import os
import random
import string

import numpy as np
import torch

from fairseq import options
from fairseq.data import Dictionary, data_utils
from fairseq.models import FairseqEncoder, FairseqEncoderDecoderModel, FairseqIncrementalDecoder
from fairseq.tasks import LegacyFairseqTask
from fairseq_cli import generate, preprocess, train, validate

# the symbols of make_data (test_binarizer, test_huffman); the dummy translation/LM corpora use the
# lowercase letters only, so that every split of a corpus of 100 sentences has the same 26 symbols
POPULATION = string.ascii_letters + string.digits
LETTERS = string.ascii_lowercase
LANGS = ("in", "out")


# --- raw data ------------------------------------------------------------------------------------

def make_data(length=1000, out_file=None):
    """``length`` sentences (lists of symbols of :data:`POPULATION`, 1 to 40 symbols each), also
    written one per line to ``out_file`` when given."""
    data = [random.choices(POPULATION, k=random.randint(1, 40)) for _ in range(length)]
    if out_file is not None:
        with open(out_file, "w", encoding="utf-8") as out:
            out.writelines(" ".join(sentence) + "\n" for sentence in data)
    return data


def sizes(data):
    """The number of symbols of each sentence of ``data``."""
    return [len(sentence) for sentence in data]


def create_dummy_data(data_dir, num_examples=100, maxlen=20, alignment=False, languages=LANGS, seed=1):
    """``{train,valid,test}.{in,out}`` in ``data_dir``: ``num_examples`` parallel lines of random
    lowercase letters, each length from 1 to ``maxlen`` equally often in each file (so a split has
    its share of short lines, which a tight ``--max-target-positions`` keeps, and of long ones);
    with ``alignment``, ``{split}.align`` too (``i-j`` pairs, source position i aligned to target
    position j, both inside their lines). The same arguments write the same files, so that a test's
    outcome does not depend on the draw."""
    rng = random.Random(seed)
    for split in ("train", "valid", "test"):
        lengths = [rng.sample([1 + i % maxlen for i in range(num_examples)], num_examples) for _ in languages]
        lines = [[rng.choices(LETTERS, k=lang_lengths[i]) for lang_lengths in lengths] for i in range(num_examples)]
        for column, lang in enumerate(languages):
            with open(os.path.join(data_dir, f"{split}.{lang}"), "w") as out:
                out.writelines(" ".join(pair[column]) + "\n" for pair in lines)
        if alignment:
            with open(os.path.join(data_dir, f"{split}.align"), "w") as out:
                for src, tgt in lines:
                    pairs = {(rng.randrange(len(src)), rng.randrange(len(tgt)))
                             for _ in range(min(len(src), len(tgt)))}
                    out.write(" ".join(f"{i}-{j}" for i, j in sorted(pairs)) + "\n")


# --- preprocessing -------------------------------------------------------------------------------

def _preprocess(flags):
    preprocess.main(options.get_preprocessing_parser().parse_args(flags))


def preprocess_translation_data(data_dir, extra_flags=None):
    """Binarizes create_dummy_data's in-out corpus into ``data_dir`` (fairseq-preprocess)."""
    _preprocess(["--source-lang", LANGS[0], "--target-lang", LANGS[1],
                 *[f"--{split}pref={os.path.join(data_dir, split)}" for split in ("train", "valid", "test")],
                 "--thresholdsrc", "0", "--thresholdtgt", "0", "--destdir", data_dir, "--workers", "1",
                 *(extra_flags or [])])


def preprocess_summarization_data(data_dir, extra_flags=None):
    """As preprocess_translation_data with one dictionary for both sides: a pointer-generator
    summarizer copies source tokens into its output."""
    preprocess_translation_data(data_dir, ["--joined-dictionary", *(extra_flags or [])])


def preprocess_lm_data(data_dir):
    """Binarizes ``{train,valid,test}.out`` of ``data_dir`` as a monolingual corpus
    (``{split}.bin``/``.idx`` and ``dict.txt`` in ``data_dir``)."""
    _preprocess(["--only-source",
                 *[f"--{split}pref={os.path.join(data_dir, split)}.out" for split in ("train", "valid", "test")],
                 "--destdir", data_dir, "--workers", "1"])


def create_laser_data_and_config_json(data_dir):
    """Two binarized in-out corpora under ``data_dir/laser`` (the legacy indexed format that LASER's
    task reads) and the task's JSON config naming them, their dictionaries and a language id each;
    returns the (closed) config file, whose ``name`` is its path."""
    corpora, first = [], None
    for corpus_id, corpus in enumerate(("corpus1", "corpus2")):
        corpus_dir = os.path.join(data_dir, "laser", corpus, "-".join(LANGS))
        os.makedirs(corpus_dir)
        create_dummy_data(corpus_dir, seed=corpus_id)
        # the second corpus is binarized with the first one's dictionaries: one vocabulary per side
        shared = [] if first is None else ["--srcdict", os.path.join(first, f"dict.{LANGS[0]}.txt"),
                                           "--tgtdict", os.path.join(first, f"dict.{LANGS[1]}.txt")]
        preprocess_translation_data(corpus_dir, ["--dataset-impl", "cached", *shared])
        first = first or corpus_dir
        prefix = os.path.join(corpus_dir, "{split}." + "-".join(LANGS) + ".{lang}")
        corpora.append((corpus_id, prefix))
    config = {"src_vocab": os.path.join(first, f"dict.{LANGS[0]}.txt"),
              "tgt_vocab": os.path.join(first, f"dict.{LANGS[1]}.txt")}
    for split in ("train", "valid"):
        config[split] = [{"id": corpus_id, "src": prefix.format(split=split, lang=LANGS[0]),
                          "tgt": prefix.format(split=split, lang=LANGS[1])} for corpus_id, prefix in corpora]
    with open(os.path.join(data_dir, "laser_config.json"), "w") as config_file:
        json.dump(config, config_file, indent=1)
    return config_file


# --- training, validation, generation ------------------------------------------------------------

def _validate(task, data_dir, extra_flags):
    """fairseq-validate of ``data_dir/checkpoint_last.pt`` on ``valid``, in this process, as its
    cli_main does it: the flags given explicitly also override the checkpoint's stored configuration."""
    argv = ["--task", task, data_dir, "--path", os.path.join(data_dir, "checkpoint_last.pt"), "--valid-subset", "valid",
            "--max-tokens", "500", "--no-progress-bar", "--num-workers", "0", *extra_flags]
    args = options.parse_args_and_arch(options.get_validation_parser(), argv)
    overrides = options.parse_args_and_arch(options.get_validation_parser(), argv, suppress_defaults=True)
    validate.main(args, override_args=overrides)


def train_translation_model(data_dir, arch, extra_flags=None, task="translation", run_validation=False,
                            lang_flags=None, extra_valid_flags=None):
    """One epoch of fairseq-train on ``data_dir`` (checkpoints in ``data_dir``), then, with
    ``run_validation``, fairseq-validate of ``checkpoint_last.pt`` on ``valid``. ``lang_flags``
    replaces ``--source-lang in --target-lang out``; ``extra_flags`` come last, so they override."""
    lang_flags = ["--source-lang", LANGS[0], "--target-lang", LANGS[1]] if lang_flags is None else lang_flags
    train_args = options.parse_args_and_arch(options.get_training_parser(), [
        "--task", task, data_dir, "--save-dir", data_dir, "--arch", arch,
        "--optimizer", "nag", "--lr", "0.05", "--max-tokens", "500", "--max-epoch", "1",
        "--no-progress-bar", "--distributed-world-size", "1", "--num-workers", "0",
        *lang_flags, *(extra_flags or [])])
    train.main(train_args)
    if run_validation:
        _validate(task, data_dir, [*lang_flags, *(extra_valid_flags or [])])


def train_language_model(data_dir, arch, extra_flags=None, run_validation=False, extra_valid_flags=None,
                         task="language_modeling"):
    """One epoch of fairseq-train of a language model on preprocess_lm_data's corpus (checkpoints in
    ``data_dir``), then, with ``run_validation``, fairseq-validate of ``checkpoint_last.pt``."""
    train_args = options.parse_args_and_arch(options.get_training_parser(), [
        "--task", task, data_dir, "--arch", arch, "--optimizer", "adam", "--lr", "0.0001",
        "--max-tokens", "500", "--tokens-per-sample", "500", "--save-dir", data_dir, "--max-epoch", "1",
        "--no-progress-bar", "--distributed-world-size", "1", "--ddp-backend", "no_c10d", "--num-workers", "0",
        *(extra_flags or [])])
    train.main(train_args)
    if run_validation:
        _validate(task, data_dir, extra_valid_flags or [])


def generate_main(data_dir, extra_flags=None):
    """fairseq-generate with ``data_dir/checkpoint_last.pt`` on the ``valid`` subset (beam 3,
    hypotheses of at most 5 tokens past a length-free bound); ``extra_flags`` come last."""
    generate_args = options.parse_args_and_arch(options.get_generation_parser(), [
        data_dir, "--path", os.path.join(data_dir, "checkpoint_last.pt"), "--gen-subset", "valid",
        "--beam", "3", "--batch-size", "64", "--max-len-b", "5", "--no-progress-bar", "--num-workers", "0",
        *(extra_flags or [])])
    generate.main(generate_args)


# --- in-memory data ------------------------------------------------------------------------------

def dummy_dictionary(vocab_size, prefix="token_"):
    """fairseq's 4 special symbols, then ``vocab_size`` symbols ``token_0``... at indices 4...
    (not finalized: no reordering, no padding to a multiple of 8)."""
    dictionary = Dictionary()
    for i in range(vocab_size):
        dictionary.add_symbol(f"{prefix}{i}")
    return dictionary


class TestDataset(torch.utils.data.Dataset):
    """A list (or the rows of a 2-D tensor) as a dataset; ``sizes``: each item's length."""

    def __init__(self, data):
        super().__init__()
        self.data = data
        self.sizes = np.array([len(item) for item in data])

    def __getitem__(self, index):
        return self.data[index]

    def __len__(self):
        return len(self.data)


def _collate_in_order(samples, pad, eos):
    """A translation batch of ``{"id", "source", "target"}`` samples, rows in the samples' order (so
    that row i is sample i, which the test models' probability tables are indexed by)."""
    targets = [sample["target"] for sample in samples]
    return {
        "id": torch.LongTensor([sample["id"] for sample in samples]),
        "nsentences": len(samples),
        "ntokens": sum(len(target) for target in targets),
        "net_input": {
            "src_tokens": data_utils.collate_tokens([s["source"] for s in samples], pad, eos, left_pad=True),
            "src_lengths": torch.LongTensor([len(s["source"]) for s in samples]),
            "prev_output_tokens": data_utils.collate_tokens(targets, pad, eos, move_eos_to_beginning=True),
        },
        "target": data_utils.collate_tokens(targets, pad, eos),
    }


def dummy_dataloader(samples, padding_idx=1, eos_idx=2, batch_size=None):
    """An iterator over batches of ``samples`` (dicts of ``source`` and ``target`` token tensors),
    all in one batch unless ``batch_size``; each sample's ``id`` is its position."""
    numbered = [dict(sample, id=i) for i, sample in enumerate(samples)]
    loader = torch.utils.data.DataLoader(
        numbered, batch_size=batch_size or len(numbered),
        collate_fn=lambda batch: _collate_in_order(batch, padding_idx, eos_idx))
    return iter(loader)


# --- a task and models with given output probabilities ---------------------------------------------

class TestTranslationTask(LegacyFairseqTask):
    """A translation task over given dictionaries whose model (:class:`TestModel`) outputs the
    probabilities in ``args``."""

    def __init__(self, args, src_dict, tgt_dict, model=None):
        super().__init__(args)
        self.src_dict, self.tgt_dict, self.model = src_dict, tgt_dict, model

    @classmethod
    def setup_task(cls, args, src_dict=None, tgt_dict=None, model=None):
        return cls(args, src_dict, tgt_dict, model)

    def build_model(self, args, from_checkpoint=False):
        return TestModel.build_model(args, self)

    @property
    def source_dictionary(self):
        return self.src_dict

    @property
    def target_dictionary(self):
        return self.tgt_dict


class TestEncoder(FairseqEncoder):
    """Encodes nothing: its output is the source (``encoder_out``), each row's sentence (its row in
    the batch the encoder saw) and that batch's size, which beam search reorders row by row."""

    def __init__(self, args, dictionary):
        super().__init__(dictionary)
        self.args = args

    def forward(self, src_tokens, src_lengths=None):
        return self.output(src_tokens)

    @staticmethod
    def output(states):
        bsz = states.size(0)
        return {"encoder_out": [states], "sentence": [torch.arange(bsz, device=states.device)],
                "sentences": [torch.full((bsz,), bsz, device=states.device)]}

    def reorder_encoder_out(self, encoder_out, new_order):
        return {key: [tensor.index_select(0, new_order) for tensor in tensors]
                for key, tensors in encoder_out.items()}


class TestReshapingEncoder(TestEncoder):
    """Its output has another length than the source (two positions per source token), as an
    encoder that downsamples or upsamples does."""

    def forward(self, src_tokens, src_lengths=None):
        return self.output(src_tokens.repeat_interleave(2, dim=1))


class TestAdditionalInputEncoder(TestEncoder):
    """Takes a second input besides the source (``fancy_other_input``) and encodes that one."""

    def forward(self, src_tokens, src_lengths=None, fancy_other_input=None):
        if fancy_other_input is None:
            raise TypeError("TestAdditionalInputEncoder needs fancy_other_input in net_input")
        return self.output(fancy_other_input)


class TestIncrementalDecoder(FairseqIncrementalDecoder):
    """Outputs, at step t of a row, the probabilities ``args.probs[sentence, t]`` (a sentences x
    steps x vocabulary tensor) or ``args.beam_probs[t][row of the table]`` (one tensor per step, a
    row per hypothesis slot of each sentence, sentence-major; when it has fewer columns than the
    vocabulary they are its last ones, the leading symbols get probability 0). Its attention is
    uniform over the encoder's output positions."""

    def __init__(self, args, dictionary):
        super().__init__(dictionary)
        if getattr(args, "probs", None) is None and getattr(args, "beam_probs", None) is None:
            raise ValueError("TestIncrementalDecoder needs args.probs or args.beam_probs")
        self.args = args

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, **kwargs):
        rows, length = prev_output_tokens.shape
        # incremental decoding (beam search) asks for the last step only, scoring for all
        steps = [length - 1] if incremental_state is not None else range(length)
        sentence, sentences = encoder_out["sentence"][0], encoder_out["sentences"][0]
        probs = torch.stack([self.step_probs(step, sentence, sentences) for step in steps], dim=1)
        states = encoder_out["encoder_out"][0]
        attn = probs.new_full((rows, len(steps), states.size(1)), 1.0 / states.size(1))
        return probs, {"attn": [attn]}

    def step_probs(self, step, sentence, sentences):
        probs = getattr(self.args, "probs", None)
        if probs is not None:
            return probs[sentence, step].float()
        if step >= len(self.args.beam_probs):
            raise IndexError(f"args.beam_probs has no step {step}")
        table = self.args.beam_probs[step]
        # rows of one sentence are adjacent and keep their order: a row's slot is its offset from
        # the sentence's first row
        slot = torch.arange(len(sentence)) - torch.searchsorted(sentence, sentence)
        per_sentence = table.size(0) // int(sentences[0])
        picked = table[sentence * per_sentence + slot].float()
        return torch.cat([picked.new_zeros(len(sentence), len(self.dictionary) - table.size(1)), picked], dim=1)

    def get_normalized_probs(self, net_output, log_probs, sample=None):
        probs = net_output[0]
        return probs.log() if log_probs else probs

    def max_positions(self):
        return 1e6


class TestModel(FairseqEncoderDecoderModel):
    encoder_class = TestEncoder

    @classmethod
    def build_model(cls, args, task):
        return cls(cls.encoder_class(args, task.source_dictionary),
                   TestIncrementalDecoder(args, task.target_dictionary))


class TestReshapingModel(TestModel):
    encoder_class = TestReshapingEncoder


class TestAdditionalInputModel(TestModel):
    encoder_class = TestAdditionalInputEncoder


def sequence_generator_setup():
    """Two identical 2-word sources and a model whose step probabilities (4 rows per step: sentence 1
    beams 1 and 2, sentence 2 beams 1 and 2; columns eos, unk, w1, w2) make beam search of size 2
    find, for sentence 1, ``w1 eos`` (0.9, 1.0) and ``w2 w1 w2 eos`` (0.1, 0.9, 0.9, 1.0), and for
    sentence 2 ``w1 w2 w1 eos`` (0.7, 0.4, 0.4, 1.0) and ``w1 w2 eos`` (0.7, 0.4, 0.6); stopped at 2
    tokens, ``w2 w2 eos`` (0.1, 0.1, 0.6) and (0.3, 0.9, 0.01) come second.
    Returns (dictionary, w1, w2, src_tokens, src_lengths, model)."""
    dictionary = dummy_dictionary(vocab_size=2)
    eos, w1, w2 = dictionary.eos(), 4, 5
    src_tokens = torch.LongTensor([[w1, w2, eos], [w1, w2, eos]])
    src_lengths = torch.LongTensor([2, 2])
    args = argparse.Namespace()
    unk = 0.0
    args.beam_probs = [
        torch.FloatTensor([  # step 0 (only the first beam of each sentence counts)
            [0.0, unk, 0.9, 0.1], [0.0, unk, 0.9, 0.1],
            [0.0, unk, 0.7, 0.3], [0.0, unk, 0.7, 0.3]]),
        torch.FloatTensor([  # step 1: after w1 | w2
            [1.0, unk, 0.0, 0.0], [0.0, unk, 0.9, 0.1],
            [0.25, unk, 0.35, 0.4], [0.0, unk, 0.1, 0.9]]),
        torch.FloatTensor([  # step 2: after w2 w1 | w2 w2, w1 w2 | w2 w2
            [0.0, unk, 0.1, 0.9], [0.6, unk, 0.2, 0.2],
            [0.6, unk, 0.4, 0.0], [0.01, unk, 0.3, 0.3]]),
        torch.FloatTensor([  # step 3: every hypothesis ends
            [1.0, unk, 0.0, 0.0], [1.0, unk, 0.0, 0.0],
            [1.0, unk, 0.0, 0.0], [1.0, unk, 0.0, 0.0]]),
    ]
    task = TestTranslationTask.setup_task(args, dictionary, dictionary)
    return dictionary, w1, w2, src_tokens, src_lengths, task.build_model(args)
