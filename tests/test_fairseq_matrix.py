"""The compatibility matrix (issue #56): fairseq's models x tasks x the plugin's methods, generated
from fairseq's registries by ``python -m scripts.fairseq_matrix`` (its docstring says how the rows
are chosen and what a cell runs), and the table it wrote, docs/compatibility.md.

The test runs the command itself with ``--sample``: every row and task, stock ``cross_entropy``
first on each cell, then, on each pairing, ``cross_entropy_agg`` and one other method in turn (the
whole matrix costs several CPU minutes; docs/compatibility.md holds it all). Checked:

* every model of fairseq's registry is a row or is left out with its reason, and the issue's
  models are rows, in the fresh table and in docs/compatibility.md;
* no run ends in a traceback; a run that trains has stock ``cross_entropy``'s first loss (and,
  where the method's neutral flags leave the gradients alone, its gradient norm); a refusal is
  exit status 2, one line naming why, nothing in the save directory;
* every cell run here reads the same in docs/compatibility.md;
* two of the runs repeated as real ``fairseq-train`` processes report what the in-process driver
  reported (a training run's loss and gradient norm, a refusal's line and exit status).

And the adaptive-softmax refusal of ``--arch transformer_lm_wiki103`` says what to train instead,
and that command trains with ``cross_entropy_agg``.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from fairseq_runs import TINY_LM_ARGS, USER_DIR, read_json_log, run_cli
from in_process import fairseq_train

ISSUE_ROWS = {"transformer", "transformer_lm", "lightconv", "dynamicconv", "lightconv_lm", "fconv", "fconv_lm",
              "fconv_self_att", "lstm", "lstm_lm", "multilingual_transformer", "transformer_align", "bart",
              "transformer_mlra", "transformer_lm_mlra"}
TASKS = {"translation", "language_modeling", "multilingual_translation", "translation_multi_simple_epoch",
         "translation_from_pretrained_bart", "denoising", "translation_moe"}
GATES_GRADIENTS = {"cross_entropy_agg"}  # no neutral flag: the loss is cross-entropy, the gates change gradients


@pytest.fixture(scope="module")
def matrix(repo_root, tmp_path_factory):
    """(the records of a --sample run, its table, the committed table)."""
    work = tmp_path_factory.mktemp("matrix")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "scripts.fairseq_matrix", "--sample", "--work", str(work),
                           "--out", str(work / "compatibility.md"), "--jsonl", str(work / "records.jsonl")],
                          cwd=repo_root, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(work / "records.jsonl") as f:
        records = [json.loads(line) for line in f]
    committed = os.path.join(repo_root, "docs", "compatibility.md")
    return records, (work / "compatibility.md").read_text(), open(committed).read() if os.path.exists(committed) else ""


def sections(table):
    """{row: {task: [cell texts]}}, the methods' header, and {left-out model: why}."""
    rows, header, left_out, current = {}, None, {}, None
    for line in table.splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if not cells or set(cells[0]) <= {"-"}:
            continue
        if current == "Not rows":
            if cells[0] != "model":
                left_out[cells[0].strip("`")] = cells[1]
        elif cells[0] == "task":
            header = [c.strip("`") for c in cells[1:]]
        elif current is not None:
            rows.setdefault(current, {})[cells[0].strip("`")] = cells[1:]
    return rows, header, left_out


def test_every_registered_model_is_a_row_or_left_out_with_its_reason(matrix):
    from fairseq.models import MODEL_REGISTRY

    assert matrix[2], "docs/compatibility.md is missing: python -m scripts.fairseq_matrix writes it"
    for table in matrix[1:]:
        rows, header, left_out = sections(table)
        assert ISSUE_ROWS <= set(rows)
        assert set(MODEL_REGISTRY) <= set(rows) | set(left_out) | {"lightconv"}
        assert not set(rows) & set(left_out)
        assert all(why for why in left_out.values())
        assert all(set(tasks) == TASKS for tasks in rows.values()), rows
        assert header[0] == "augmented_loss" and "cross_entropy_agg" in header and header[-1] == "coupled_adam"


def test_no_cell_ends_in_a_traceback_and_each_trains_as_stock_or_is_refused_in_one_line(matrix):
    records = matrix[0]
    assert not [r for r in records if r["status"] == "traceback"], [r for r in records if r["status"] == "traceback"]
    stock = {(r["row"], r["task"]): r for r in records if r["method"] == "cross_entropy"}
    assert {row for row, _ in stock} >= ISSUE_ROWS and {task for _, task in stock} == TASKS
    pairings = {cell for cell, r in stock.items() if r["status"] == "trains"}
    assert {("transformer", "translation"), ("lightconv", "translation"), ("dynamicconv", "translation"),
            ("lightconv_lm", "language_modeling"), ("transformer_lm", "language_modeling")} <= pairings
    runs = [r for r in records if r["method"] != "cross_entropy"]
    assert {(r["row"], r["task"]) for r in runs} == pairings
    assert {r["method"] for r in runs if r["method"] != "cross_entropy_agg"} >= {"coupled_adam", "augmented_loss"}
    for r in runs:
        if r["status"] == "trains":
            assert r["loss"] == stock[r["row"], r["task"]]["loss"], r
            if r["method"] not in GATES_GRADIENTS:
                assert r["gnorm"] == stock[r["row"], r["task"]]["gnorm"], r
        else:
            assert r["status"] == "refused" and r["exit"] == 2, r
            assert r["why"].startswith("fairseq-train: error: ") and r["written"] == [], r


def test_the_committed_table_reads_as_this_run_for_every_cell_it_ran(matrix):
    records, fresh, committed = matrix
    fresh_rows, header, _ = sections(fresh)
    committed_rows, committed_header, _ = sections(committed)
    assert committed_header == header and set(committed_rows) == set(fresh_rows)
    checked = 0
    for r in records:
        if r["method"] == "cross_entropy":
            if r["status"] != "trains":  # the whole line is the pairing's verdict
                assert committed_rows[r["row"]][r["task"]][0] == fresh_rows[r["row"]][r["task"]][0], r
            continue
        column = header.index(r["method"])
        assert committed_rows[r["row"]][r["task"]][column] == fresh_rows[r["row"]][r["task"]][column], r
        checked += 1
    assert checked > 0


def test_the_driver_reports_what_fairseq_train_reports(matrix, tmp_path):
    records = matrix[0]
    trained = next(r for r in records if r["status"] == "trains" and r["method"] == "cross_entropy_agg")
    refused = next((r for r in records if r["status"] == "refused"), None)
    for record in [trained] + ([refused] if refused else []):
        argv = list(record["argv"])
        save_dir = tmp_path / record["row"]
        argv[argv.index("--save-dir") + 1] = str(save_dir)
        proc = run_cli("fairseq-train", argv, expect_ok=False)
        assert "Traceback" not in proc.stderr
        if record["status"] == "trains":
            assert proc.returncode == 0
            first = next(r for r in read_json_log(proc.stdout) if "gnorm" in r and "update" in r)
            assert (first["loss"], first["gnorm"]) == (record["loss"], record["gnorm"])
        else:
            assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == record["why"]
            assert not save_dir.exists() or not any(save_dir.iterdir())


TINY_SIZES = ["--decoder-layers", "1", "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32",
              "--decoder-attention-heads", "2", "--decoder-input-dim", "16", "--decoder-output-dim", "16"]


def test_adaptive_softmax_refusal_names_what_to_train_instead_and_that_trains(lm_data_bin, tmp_path):
    base = [lm_data_bin, "--user-dir", USER_DIR, *[a for a in TINY_LM_ARGS if a != "--share-decoder-input-output-embed"],
            "--criterion", "cross_entropy_agg", "--output-kernel", "eager", "--max-update", "1", "--no-save"]
    base = [a if a != "transformer_lm" else "transformer_lm_wiki103" for a in base]
    refused = fairseq_train(base + TINY_SIZES + ["--adaptive-softmax-cutoff", "20,100", "--adaptive-input-cutoff",
                                                 "20,100", "--save-dir", tmp_path / "wiki103"])
    assert refused.returncode == 2, refused.stderr[-2000:]
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith("fairseq-train: error: --adaptive-softmax-cutoff is not supported by this criterion")
    instead = re.search(r"train its sizes as (--arch .*)\)$", line).group(1).split()
    assert instead[:2] == ["--arch", "transformer_lm_big"]
    # the flags of the message, shrunk (a later flag wins): a plain, tied output layer that AGG trains
    plain = [a for a in base if a != "--no-save"] + instead + TINY_SIZES
    trained = fairseq_train(plain + ["--save-dir", tmp_path / "plain", "--no-epoch-checkpoints"])
    assert trained.returncode == 0, trained.stderr[-3000:]
    from fairseq import checkpoint_utils

    state = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "plain" / "checkpoint_last.pt"))
    assert state["optimizer_history"][-1]["num_updates"] == 1
    model_cfg = state["cfg"]["model"]
    assert model_cfg.get("_name") == "transformer_lm_big"  # a dataclass model's config: the arch is its _name
    assert model_cfg.share_decoder_input_output_embed and model_cfg.no_decoder_final_norm
    assert not model_cfg.adaptive_input and model_cfg.adaptive_softmax_cutoff is None
    assert int(state["criterion"]["window.counts"].sum()) > 0  # AGG counted the targets it trained on
