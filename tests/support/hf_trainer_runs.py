"""Real Hugging Face ``Trainer`` runs for the tests of ``fairseq_agg.hf.trainer``: a tiny Llama
(random init, offline), a small in-memory dataset of token ids with right padding, the training
arguments the tests share, and what a run recorded (each training micro-batch's labels with the
update number the method saw).

Shared by tests/test_hf_trainer.py and the two-rank script tests/support/hf_two_ranks.py, so that
the one-process reference and the ranks train the same model on the same samples.
"""
import torch

from hf_models import PAD, tiny_model

VOCAB = 48
SEQ_LEN = 12
SAMPLES = 16  # 4 updates per epoch at 2 samples per micro-batch and 2 micro-batches per update
# AGG with the released code's threshold (mean count per update): a token is rare when it is a
# target in fewer than half of the updates of the window; with this vocabulary and data some are.
# The eager chunk body: "auto" would compile it (seconds per process), which these runs do not test.
AGG_OPTIONS = {"agg_alpha": 0.5, "agg_threshold_mode": "per-update", "output_kernel": "eager"}


def tiny_llama(vocab: int = VOCAB, seed: int = 0):
    """The 2-layer Llama of :mod:`hf_models` (random weights, untied head, built from a config)."""
    return tiny_model("llama", seed=seed, vocab=vocab)


def token_dataset(samples: int = SAMPLES, vocab: int = VOCAB, seed: int = 1):
    """``samples`` rows of ``SEQ_LEN`` token ids drawn from a skewed (Zipf-like) distribution, so
    that the window holds frequent and rare tokens; each row right-padded after a random length
    (pad id, labels -100, attention mask 0), so micro-batches differ in their target counts."""
    generator = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, vocab - 2, dtype=torch.float64)  # ids 3..V-1 (0-2 are bos, eos, pad)
    rows = []
    for _ in range(samples):
        length = int(torch.randint(SEQ_LEN // 2, SEQ_LEN + 1, (1,), generator=generator))
        ids = torch.multinomial(weights, length, replacement=True, generator=generator) + 3
        pad = SEQ_LEN - length
        input_ids = torch.cat([ids, torch.full((pad,), PAD, dtype=torch.int64)])
        rows.append({"input_ids": input_ids.tolist(),
                     "attention_mask": [1] * length + [0] * pad,
                     "labels": ids.tolist() + [-100] * pad})
    return rows


def training_args(output_dir, **overrides):
    """The arguments every test run shares: CPU, no reports, fp32, 2 micro-batches per update
    (``remove_unused_columns`` left at its default: the fused forward shows the class's signature)."""
    from transformers import TrainingArguments

    options = dict(output_dir=str(output_dir), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                   max_steps=10, save_steps=5, save_strategy="steps", learning_rate=1e-2, lr_scheduler_type="linear",
                   warmup_steps=0, logging_steps=1000, report_to=[], use_cpu=True, seed=0,
                   dataloader_num_workers=0, disable_tqdm=True)
    options.update(overrides)
    return TrainingArguments(**options)


def record_micro_batches(model):
    """Records, at every training forward of ``model``, the update number its method holds and the
    batch's labels: a list of (update_num, labels) filled as the run goes. A forward pre-hook, so
    it sees exactly the calls the Trainer makes (through any wrapper) and changes nothing."""
    seen = []

    def hook(module, args, kwargs):
        if module.training and kwargs.get("labels") is not None:
            seen.append((module.fairseq_agg.update_num, kwargs["labels"].detach().cpu().clone()))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def hand_counts(seen, first_update: int, last_update: int, vocab: int = VOCAB) -> torch.Tensor:
    """The targets of the recorded micro-batches of updates ``first_update`` to ``last_update``
    (update numbers as the method saw them), counted by hand: each row's labels shifted left by
    one, as a causal LM's loss reads them, without the -100 entries."""
    counts = torch.zeros(vocab, dtype=torch.int64)
    for update_num, labels in seen:
        if first_update <= update_num <= last_update:
            targets = labels[:, 1:].reshape(-1)
            for token in targets[targets != -100].tolist():
                counts[token] += 1
    return counts
