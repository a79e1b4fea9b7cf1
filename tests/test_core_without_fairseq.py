"""The fairseq-free core (docs/api.md): it imports and runs where fairseq cannot be imported, the
plain-PyTorch example trains with it, and a plain loop that makes the documented calls gets the
gradients of the fairseq criterion on the same batches.
"""
import ast
import io
import json
import math
import os
import re
import runpy
import subprocess
import sys

import pytest
import torch

from fairseq_agg.fairseq_facts.dictionary import never_real_ids
from fairseq_agg.ops import AggLoss, AugmentedLoss, LossRequest, RareFreezing, fused_linear_loss
from fairseq_runs import TINY_LM_ARGS, build_parts

torch.set_num_threads(2)

EXAMPLE = os.path.join("examples", "plain_pytorch", "train_agg_lm.py")

# Run before the code under test, in a fresh interpreter: fairseq looks uninstalled. A None entry
# in sys.modules makes `import fairseq` (and so every `fairseq.*`) raise ModuleNotFoundError and
# importlib.util.find_spec("fairseq") return None, which is how fairseq_agg tells that fairseq is
# absent. At exit, the names of the fairseq modules that were nevertheless loaded are printed.
WITHOUT_FAIRSEQ = """
import atexit, importlib.util, json, sys
BLOCKED = ("fairseq", "fairseq_cli")
for name in BLOCKED:
    sys.modules[name] = None
try:
    import fairseq
    raise SystemExit("fairseq is importable despite the block")
except ModuleNotFoundError:
    pass
assert importlib.util.find_spec("fairseq") is None

def report_fairseq_modules():
    loaded = sorted(k for k, v in sys.modules.items() if k.split(".")[0] in BLOCKED and v is not None)
    print("FAIRSEQ_MODULES " + json.dumps(loaded), flush=True)

atexit.register(report_fairseq_modules)
"""


def run_without_fairseq(code, *args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-c", WITHOUT_FAIRSEQ + code, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_ran_without_fairseq(proc):
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    reports = re.findall(r"^FAIRSEQ_MODULES (.*)$", proc.stdout, re.M)
    assert reports == ["[]"], proc.stdout[-2000:]


def test_core_imports_and_runs_without_fairseq():
    code = """
import importlib
import torch
import fairseq_agg.ops as ops
from fairseq_agg.ops import AggLoss, LossRequest, isotropy, mean_pairwise_cosine, tev_stats

missing = [name for name in ops.__all__ if not hasattr(ops, name)]
assert not missing, missing
torch.manual_seed(0)
V, d, N = 50, 8, 40
hidden = torch.randn(N, d, requires_grad=True)
weight = torch.randn(V, d, requires_grad=True)
target = torch.randint(4, 20, (N,))  # ids 20.. never occur: rare
agg = AggLoss(V, window=2)
out = agg(hidden, weight, target, update_num=0, request=LossRequest(label_smoothing=0.1))
out.loss.backward()
stats = {"loss": out.loss.item(), "rare": int(agg.gates().rare.sum()),
         "grad_finite": bool(hidden.grad.isfinite().all() and weight.grad.isfinite().all()),
         "isotropy": isotropy(weight.detach())["isotropy"], "cos": mean_pairwise_cosine(weight.detach()),
         "tev_mu": tev_stats(weight.detach())["mu"]}
for side in ("fairseq_agg.criterions", "fairseq_agg_plugin"):  # the glue, and what --user-dir loads
    try:
        importlib.import_module(side)
        stats[side] = "imported"
    except ImportError as e:
        stats[side] = str(e)
print("STATS " + json.dumps(stats))
"""
    proc = run_without_fairseq(code)
    assert_ran_without_fairseq(proc)
    stats = json.loads(re.search(r"^STATS (.*)$", proc.stdout, re.M).group(1))
    assert math.isfinite(stats["loss"]) and stats["grad_finite"]
    assert stats["rare"] == 50 - 20  # exactly the ids that never occurred (specials excluded)
    assert 0 < stats["isotropy"] <= 1 and -1 <= stats["cos"] <= 1 and stats["tev_mu"] > 0
    # the fairseq side says what to install instead of failing somewhere inside fairseq
    for side in ("fairseq_agg.criterions", "fairseq_agg_plugin"):
        assert stats[side].startswith("fairseq-agg needs fairseq, which is not installed: install "), stats[side]


def test_example_imports_no_fairseq(repo_root):
    with open(os.path.join(repo_root, EXAMPLE), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "fairseq_agg.ops" in imported
    assert not any(name.split(".")[0] in ("fairseq", "fairseq_cli") for name in imported)


def test_example_trains_agg_and_ce_without_fairseq(repo_root):
    code = "import runpy; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    tiny = ["--method", "both", "--steps", "4", "--log-interval", "2", "--seed", "3", "--vocab", "400",
            "--dim", "16", "--layers", "1", "--heads", "2", "--context", "16", "--batch-size", "4",
            "--accumulate", "2", "--valid-tokens", "512"]
    proc = run_without_fairseq(code, os.path.join(repo_root, EXAMPLE), *tiny)
    assert_ran_without_fairseq(proc)
    out = proc.stdout
    assert "pydoc_data" in out  # the default corpus: real text from the standard library

    def numbers(pattern):
        return [float(x) for x in re.findall(pattern, out)]

    agg_losses = numbers(r"\[agg\] step +\d+ +loss ([-\d.naif]+) +rare tokens \d+")
    ce_losses = numbers(r"\[ce\] step +\d+ +loss ([-\d.naif]+)")
    rare = numbers(r"\[agg\] step +\d+ +loss \S+ +rare tokens (\d+)")
    assert len(agg_losses) == len(ce_losses) == 2, out
    assert all(math.isfinite(x) and 0 < x < 2 * math.log(402) for x in agg_losses + ce_losses)
    # 4 updates of 128 tokens cannot cover 400 words: the unseen ones are AGG's rare group
    assert all(0 < r < 402 for r in rare)
    for method in ("ce", "agg"):
        before = numbers(rf"\[{method}\] I\(W\) of the output embedding before training: ([\d.]+)")
        after = numbers(rf"\[{method}\] I\(W\) of the output embedding after training: ([\d.]+)")
        assert len(before) == len(after) == 1 and all(0 < x <= 1 for x in before + after)
    # the same initialisation for both methods, and the comparison table at the end
    assert len(set(numbers(r"I\(W\) of the output embedding before training: ([\d.]+)"))) == 1
    assert re.search(r"^agg +\| .*\| \d+$", out, re.M) and re.search(r"^ce +\| .*\| -$", out, re.M)


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--method", "adam"], ["--alpha", "1.5"], ["--seed", "x"]])
def test_example_refuses_bad_values(repo_root, argv, capsys):
    example = runpy.run_path(os.path.join(repo_root, EXAMPLE))  # defines main; trains nothing
    with pytest.raises(SystemExit) as stopped:
        example["main"](argv)
    assert stopped.value.code == 2
    error_lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and argv[0] in error_lines[0]


def test_agg_window_resumes_exactly_from_its_state_dict():
    """docs/api.md, "Checkpoint and resume": a run saved after update 2 and resumed into a fresh
    AggLoss gives the gates of the run without the break."""
    torch.manual_seed(0)
    vocab = 30
    targets = [torch.randint(4, vocab, (n,)) for n in (40, 25, 60, 10, 50, 35, 45)]
    update_nums = [0, 0, 1, 2, 3, 3, 4]
    settings = dict(alpha=1.0, ref_tokens=100)  # rare: < 1 occurrence per 100 tokens of the window

    def gates(agg, start, stop):
        return [agg.step(y, u) for y, u in zip(targets[start:stop], update_nums[start:stop])]

    straight = gates(AggLoss(vocab, window=3, **settings), 0, len(targets))
    first = AggLoss(vocab, window=3, **settings)
    gates(first, 0, 4)
    saved = io.BytesIO()
    torch.save(first.state_dict(), saved)
    saved.seek(0)
    resumed = AggLoss(vocab, window=None, **settings)  # None: the checkpoint's window size
    resumed.load_state_dict(torch.load(saved))
    after_resume = gates(resumed, 4, len(targets))
    restarted = gates(AggLoss(vocab, window=3, **settings), 4, len(targets))  # the break without the state
    for got, expected in zip(after_resume, straight[4:]):
        assert torch.equal(got.rare, expected.rare)
        assert torch.equal(got.g1, expected.g1) and torch.equal(got.g2, expected.g2)
    assert any(not torch.equal(a.g1, b.g1) for a, b in zip(restarted, straight[4:]))


# --- the plain loop equals the fairseq criterion ------------------------------------------------

# Sentence-sized LM samples (with target padding); a threshold at which a micro-batch has rare
# and non-rare targets (rare: fewer than 1 occurrence per 100 window tokens), so that g1, g2 and
# the target's own column all matter; a 2-update window that slides within the run.
AGG_FLAGS = ["--sample-break-mode", "eos", "--criterion", "cross_entropy_agg", "--agg-window", "2",
             "--agg-alpha", "1.0", "--agg-ref-tokens", "100"]
# Updates of the micro-batches (fairseq's update_num): two micro-batches accumulate into update 0.
UPDATE_NUMS = [0, 0, 1, 2, 3]
LABEL_SMOOTHING = 0.1


def micro_batches(task, n):
    itr = task.get_batch_iterator(dataset=task.dataset("train"), max_tokens=256, seed=1, epoch=1,
                                  num_workers=0).next_epoch_itr(shuffle=False)
    return [next(itr) for _ in range(n)]


def capture_features(model):
    """Makes the decoder's features keep their gradient; returns the list they are appended to."""
    captured = []

    def keep(module, inputs, output):
        output[0].retain_grad()
        captured.append(output[0])

    model.decoder.register_forward_hook(keep)
    return captured


def plain_loop_method(name, vocab_size, dictionary):
    """(agg, loss, ungated): ``loss(hidden, weight, embedding, target, update_num)`` written the way
    docs/api.md writes each combination in a plain loop, with the settings of the criterion's
    flags, and ``ungated``, the same loss without AGG's gates or freezing (nothing counted)."""
    agg = AggLoss(vocab_size, alpha=1.0, window=2, nspecial=dictionary.nspecial, ref_tokens=100)
    if name == "agg":
        smoothing = LossRequest(label_smoothing=LABEL_SMOOTHING)

        def loss(hidden, weight, embedding, target, update_num):
            return agg(hidden, weight, target, update_num=update_num, request=smoothing)

        def ungated(hidden, weight, embedding, target):
            return fused_linear_loss(hidden, weight, target, smoothing)
    elif name == "agg+augmented":
        augmented = AugmentedLoss(alpha=0.5, temperature=10.0, masked_columns=never_real_ids(dictionary))

        def loss(hidden, weight, embedding, target, update_num):
            gates = agg.step(target, update_num)
            return augmented(hidden, weight, embedding, target, update_num=update_num, request=LossRequest(terms=(gates,)))

        def ungated(hidden, weight, embedding, target):
            return augmented(hidden, weight, embedding, target)
    else:
        freezing = RareFreezing(vocab_size)

        def loss(hidden, weight, embedding, target, update_num):
            frozen = freezing.terms(update_num, agg.step(target, update_num))
            return fused_linear_loss(hidden, weight, target, LossRequest(terms=frozen))

        def ungated(hidden, weight, embedding, target):
            return fused_linear_loss(hidden, weight, target)
    return agg, loss, ungated


METHOD_FLAGS = {
    "agg": ["--label-smoothing", str(LABEL_SMOOTHING)],
    "agg+augmented": ["--aug-alpha", "0.5"],
    "agg+freezing": ["--agg-freeze-rare"],
}


@pytest.mark.parametrize("method", list(METHOD_FLAGS))
def test_plain_loop_gradients_equal_the_fairseq_criterion(lm_data_bin, method):
    _, task, model, criterion = build_parts(lm_data_bin, TINY_LM_ARGS, AGG_FLAGS + METHOD_FLAGS[method])
    model.train()
    dictionary = task.target_dictionary
    pad = dictionary.pad()
    parameters = dict(model.named_parameters())
    weight = model.decoder.output_projection.weight
    embedding = model.decoder.embed_tokens.weight
    features = capture_features(model)
    agg, plain_loss, ungated_loss = plain_loop_method(method, len(dictionary), dictionary)

    gated_any = False
    for sample, update_num in zip(micro_batches(task, len(UPDATE_NUMS)), UPDATE_NUMS):
        # the fairseq criterion, told the update number as fairseq-train tells it
        criterion.set_update_num(update_num)
        model.zero_grad()
        loss, _, _ = criterion(model, sample)
        loss.backward()
        criterion_grads = {n: p.grad.clone() for n, p in parameters.items()}
        criterion_dw = weight.grad.clone()  # tied: also the input side's gradient
        criterion_dh = features[-1].grad.clone()
        criterion_gates = criterion.last_gates

        # the plain loop: the features of the non-padding targets and the output projection
        model.zero_grad()
        hidden = model(**sample["net_input"], features_only=True)[0]
        target = sample["target"]
        keep = target.ne(pad)
        result = plain_loss(hidden[keep], weight, embedding, target[keep], update_num)
        result.loss.backward()

        torch.testing.assert_close(result.loss.detach(), loss.detach(), rtol=1e-6, atol=1e-5)
        for name, p in parameters.items():
            torch.testing.assert_close(p.grad, criterion_grads[name], msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(hidden.grad, criterion_dh)  # dL/dH (retained by capture_features)
        gates = agg.gates()
        assert torch.equal(gates.rare, criterion_gates.rare) and torch.equal(gates.g2, criterion_gates.g2)
        assert torch.equal(agg.state_dict()["counts"], criterion.agg.state_dict()["counts"])

        # not vacuous: the micro-batch has rare and non-rare targets, and gating changes dW (not dH)
        rare_targets = gates.rare[target[keep]]
        assert rare_targets.any() and not rare_targets.all()
        model.zero_grad()
        hidden = model(**sample["net_input"], features_only=True)[0]
        ungated_loss(hidden[keep], weight, embedding, target[keep]).loss.backward()
        torch.testing.assert_close(hidden.grad, criterion_dh)
        gated_any |= not torch.allclose(weight.grad, criterion_dw)
    assert gated_any
