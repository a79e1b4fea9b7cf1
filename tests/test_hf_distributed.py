"""AGG under a data-parallel Hugging Face ``Trainer``: two real processes started by
``accelerate launch`` (DDP over gloo on the CPU; tests/support/hf_two_ranks.py) end with bit-equal
parameters and counts on both ranks; the counts are the targets of both ranks (summed across the
processes), and the run equals one process that sees both ranks' samples in each micro-batch (the
same global batch), the counts exactly and the parameters to rounding.

accelerate 1.16 runs ``--cpu --num_processes 2`` as one process unless MPI is set up; its
``--multi_gpu`` launcher (torchrun) starts the two processes, and ``TrainingArguments(use_cpu=True)``
makes them a CPU (gloo) group.
"""
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate")

from transformers import Trainer  # noqa: E402

from fairseq_agg.hf import apply  # noqa: E402
from fairseq_agg.hf.trainer import STATE_FILE, add_method_state_callback  # noqa: E402
from hf_trainer_runs import (  # noqa: E402
    AGG_OPTIONS, hand_counts, record_micro_batches, tiny_llama, token_dataset, training_args,
)

UPDATES = 6  # 2 per epoch on each rank (8 rows, 2 per micro-batch, 2 micro-batches per update): the window
WINDOW = 2
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support", "hf_two_ranks.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or "accelerate"
    command = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
               SCRIPT, str(out), str(UPDATES)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same run in one process, 4 rows per micro-batch: both ranks' rows of each micro-batch."""
    model = apply(tiny_llama(), "agg", **AGG_OPTIONS)
    seen = record_micro_batches(model)
    out = tmp_path_factory.mktemp("one_process")
    trainer = Trainer(model=model, train_dataset=token_dataset(),
                      args=training_args(out, max_steps=UPDATES, save_steps=UPDATES, per_device_train_batch_size=4))
    add_method_state_callback(trainer)
    trainer.train()
    return model, seen


def test_two_ranks_end_bit_equal_with_the_counts_of_both(two_ranks):
    out, (rank0, rank1) = two_ranks
    assert rank0["distributed"] == rank1["distributed"] == ("gloo", 2)
    for name, value in rank0["parameters"].items():
        assert torch.equal(value, rank1["parameters"][name]), name
    agg0, agg1 = rank0["state"]["counts"]["agg"], rank1["state"]["counts"]["agg"]
    for key in agg0:
        assert torch.equal(agg0[key], agg1[key]), key
    assert agg0["meta"].tolist() == [WINDOW, UPDATES, WINDOW]
    # the counts of the last WINDOW updates are the targets of both ranks, not of one
    first = UPDATES - WINDOW
    both = hand_counts(rank0["seen"], first, UPDATES - 1) + hand_counts(rank1["seen"], first, UPDATES - 1)
    assert torch.equal(agg0["counts"], both)
    assert not torch.equal(both, hand_counts(rank0["seen"], first, UPDATES - 1))
    # the checkpoint holds them once, written by the main process
    saved = torch.load(out / f"checkpoint-{UPDATES}" / STATE_FILE, weights_only=True)
    assert torch.equal(saved["counts"]["agg"]["counts"], both) and saved["updates"] == UPDATES


def test_two_ranks_equal_one_process_that_sees_both_ranks_samples(two_ranks, one_process):
    _, (rank0, rank1) = two_ranks
    model, seen = one_process
    # the same global batch: each micro-batch of the one process is rank 0's rows, then rank 1's
    assert len(seen) == len(rank0["seen"]) == len(rank1["seen"])
    for (u, labels), (u0, labels0), (u1, labels1) in zip(seen, rank0["seen"], rank1["seen"]):
        assert u == u0 == u1 and torch.equal(labels, torch.cat([labels0, labels1]))
    state = model.fairseq_agg.state_dict()["counts"]["agg"]
    for key in state:
        assert torch.equal(state[key], rank0["state"]["counts"]["agg"][key]), key
    for name, value in model.named_parameters():
        torch.testing.assert_close(value.detach(), rank0["parameters"][name], rtol=1e-4, atol=1e-5, msg=name)
