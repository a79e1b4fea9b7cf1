"""The files of one AGG step, as docs/architecture.md ("One training step") lists them: a real
``cross_entropy_agg`` criterion, built as fairseq-train builds it, runs one training micro-batch
through fairseq's ``task.train_step`` (forward and backward, the eager body) under a profiler hook that records every package file whose
code runs. The list in the docs is the set recorded, no more and no fewer."""
import os
import re
import sys
import threading

import fairseq_agg
from fairseq_runs import TINY_LM_ARGS, build_parts, first_batch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.dirname(os.path.abspath(fairseq_agg.__file__))


def _documented_files():
    text = open(os.path.join(REPO, "docs", "architecture.md"), encoding="utf-8").read()
    block = re.search(r"<!-- one-agg-step-files -->(.*?)<!-- /one-agg-step-files -->", text, re.S)
    assert block, "docs/architecture.md has no list of one AGG step's files"
    return set(re.findall(r"`([a-z_/]+\.py)`", block.group(1)))


def _files_run_by(step):
    seen = set()

    def hook(frame, event, arg):
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(PACKAGE + os.sep):
            seen.add(os.path.relpath(path, PACKAGE).replace(os.sep, "/"))

    sys.setprofile(hook)
    threading.setprofile(hook)  # autograd's backward may run on another thread
    try:
        step()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return seen


def test_one_agg_step_runs_the_files_the_docs_list(lm_data_bin):
    from fairseq import optim

    cfg, task, model, criterion = build_parts(lm_data_bin, TINY_LM_ARGS,
                                              ["--criterion", "cross_entropy_agg", "--output-kernel", "eager"])
    optimizer = optim.build_optimizer(cfg.optimizer, list(model.parameters()))
    sample = first_batch(task)

    def step():  # fairseq's Trainer calls the task's train_step once per micro-batch
        task.train_step(sample, model, criterion, optimizer, update_num=1)

    step()  # the first step's one-off work (lazy set-up) is not part of every step
    model.zero_grad()
    files = _files_run_by(step)
    assert any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters())  # the step ran
    assert files == _documented_files(), (sorted(files - _documented_files()), sorted(_documented_files() - files))
