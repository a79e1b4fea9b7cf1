"""One training run of the Hugging Face demo: a small Llama-configured ``LlamaForCausalLM``, random
initialisation, trained from scratch by ``transformers.Trainer`` with one method.

Every run of a seed starts from the same weights (the model is built once per seed and copied) and
sees the same blocks in the same order (the Trainer's ``seed`` and ``data_seed``); the methods
change only what they are about: ``apply(model, ...)`` the loss (AGG), ``coupled_adam_for(model)``
the optimizer. The shapes and the budget are the LM demo's (examples/lm_demo/run.py, ``MODEL`` and
``BUDGET``): tied embeddings, 1,024 tokens per update in blocks of 128, Adam with betas (0.9, 0.98),
learning rate 0.002 after a linear warm-up, then inverse square root, weight decay 0.01, no
gradient clipping.
"""
import copy
import time

import torch

from examples.lm_demo.run import BUDGET
from study.harness.progress import say

# the LM demo's MODEL (fairseq's --decoder-layers, --decoder-embed-dim, ...) as a LlamaConfig
MODEL = {
    "default": {"num_hidden_layers": 3, "hidden_size": 96, "intermediate_size": 384, "num_attention_heads": 4},
    "quick": {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 4},
}
OPTIMIZATION = {"learning_rate": 0.002, "adam_betas": (0.9, 0.98), "adam_eps": 1e-8, "weight_decay": 0.01}

METHODS = {
    "baseline": {"what": "transformers' own loss on the model's logits (stock cross-entropy), AdamW"},
    "agg": {"apply": {"method": "agg", "agg_alpha": 0.03},
            "what": "apply(model, method='agg', agg_alpha=0.03): adaptive gradient gating (Yu et al. 2022), AdamW"},
    "coupled-adam": {"optimizer": "coupled_adam",
                     "what": "transformers' own loss, Coupled Adam: the embedding rows share Adam's second moment, "
                             "decay of the other matrices only (Stollenwerk & Stollenwerk 2025)"},
}
DEFAULT_METHODS = list(METHODS)


class Blocks(torch.utils.data.Dataset):
    """Rows of token ids as the Trainer's examples: ``input_ids`` and ``labels`` (the model shifts
    them), ``<pad>`` positions of a padded tail labelled -100."""

    def __init__(self, rows, pad):
        self.rows, self.pad = rows, pad

    def __len__(self):
        return self.rows.size(0)

    def __getitem__(self, i):
        row = self.rows[i]
        return {"input_ids": row, "labels": row.masked_fill(row == self.pad, -100)}


def initial_model(mode, vocab_size, tokens_per_sample, seed, specials):
    """The seed's randomly initialised model (its runs copy it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    bos, pad, eos = specials
    shape = MODEL[mode]
    config = LlamaConfig(vocab_size=vocab_size, max_position_embeddings=tokens_per_sample,
                         num_key_value_heads=shape["num_attention_heads"], tie_word_embeddings=True,
                         attention_dropout=0.1, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, **shape)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def progress_callback(label, total):
    """A TrainerCallback that prints the Trainer's training logs as one line each, labelled by run."""
    from transformers import TrainerCallback

    class ProgressLines(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            shown = {k: v for k, v in (logs or {}).items() if k in ("loss", "learning_rate", "grad_norm") or
                     k.startswith("agg")}
            if shown:
                say(f"[{label}] update {state.global_step}/{total} " +
                    " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()))

    return ProgressLines()


def train_run(method, label, start, train_rows, pad, mode, updates, seed, run_dir, cpu):
    """Trains a copy of ``start`` with ``method`` (a :data:`METHODS` name) for ``updates`` updates;
    returns (the trained model, {train_seconds, log_history})."""
    from transformers import PrinterCallback, Trainer, TrainingArguments

    spec, budget = METHODS[method], BUDGET[mode]
    model = copy.deepcopy(start)
    callbacks = [progress_callback(label, updates)]
    optimizers = (None, None)
    if "apply" in spec:
        from fairseq_agg.hf import MethodStateCallback, apply

        apply(model, **spec["apply"])
        callbacks.append(MethodStateCallback())
    if spec.get("optimizer") == "coupled_adam":
        from fairseq_agg.hf.coupled_adam import coupled_adam_for

        optimizers = (coupled_adam_for(model, lr=OPTIMIZATION["learning_rate"], adam_betas=OPTIMIZATION["adam_betas"],
                                       adam_eps=OPTIMIZATION["adam_eps"],
                                       weight_decay=OPTIMIZATION["weight_decay"]), None)
    args = TrainingArguments(
        output_dir=run_dir, max_steps=updates, per_device_train_batch_size=budget["max_tokens"] // train_rows.size(1),
        learning_rate=OPTIMIZATION["learning_rate"], adam_beta1=OPTIMIZATION["adam_betas"][0],
        adam_beta2=OPTIMIZATION["adam_betas"][1], adam_epsilon=OPTIMIZATION["adam_eps"],
        weight_decay=OPTIMIZATION["weight_decay"], lr_scheduler_type="inverse_sqrt",
        warmup_steps=min(budget["warmup"], max(1, updates // 4)), max_grad_norm=0.0, seed=seed, data_seed=seed,
        logging_steps=max(1, updates // 8), save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=cpu,
        # the examples hold the model's inputs only: nothing for the Trainer to drop
        dataloader_num_workers=0, dataloader_pin_memory=False, remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, train_dataset=Blocks(train_rows, pad), optimizers=optimizers,
                      callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)
    started = time.time()
    trainer.train()
    return model, {"train_seconds": time.time() - started, "log_history": trainer.state.log_history}
