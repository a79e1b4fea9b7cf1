"""One rank of a data-parallel Hugging Face ``Trainer`` run with AGG, for tests/test_hf_distributed.py:
``accelerate launch --multi_gpu --num_processes 2 tests/support/hf_two_ranks.py OUT_DIR UPDATES``
on a machine without a GPU (``use_cpu``: DDP over gloo).

Each rank trains the tiny Llama of :mod:`hf_trainer_runs` (the same initial weights on every rank)
with :class:`~fairseq_agg.hf.trainer.MethodStateCallback`, checkpoints into OUT_DIR, and writes
``OUT_DIR/rank<R>.pt``: its parameters, its method state, the micro-batches it saw (update number,
labels) and whether ``torch.distributed`` ran gloo over 2 processes.
"""
import os
import sys

import torch
import torch.distributed as dist
from transformers import Trainer

from fairseq_agg.hf import apply
from fairseq_agg.hf.trainer import add_method_state_callback
from hf_trainer_runs import AGG_OPTIONS, record_micro_batches, tiny_llama, token_dataset, training_args


def main(out_dir: str, updates: int):
    model = apply(tiny_llama(), "agg", **AGG_OPTIONS)
    seen = record_micro_batches(model)
    trainer = Trainer(model=model, args=training_args(out_dir, max_steps=updates, save_steps=updates),
                      train_dataset=token_dataset())
    add_method_state_callback(trainer)
    trainer.train()
    rank = dist.get_rank()
    torch.save({"parameters": {name: p.detach().clone() for name, p in model.named_parameters()},
                "state": model.fairseq_agg.state_dict(), "seen": seen,
                "distributed": (dist.get_backend(), dist.get_world_size())},
               os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
