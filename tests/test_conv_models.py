"""fairseq's lightweight and dynamic convolution models (Wu et al., ICLR 2019) with the plugin's
output-layer criteria (issue #56, item 2).

Their decoder takes no ``features_only``; it applies its linear ``output_projection`` last, so the
criterion runs it whole with the projection's input captured and its matmul skipped
(fairseq_agg/fairseq_facts/output_layer.py). Checked here: AGG's loss and every gradient equal the
reference construction on the features the projection receives (read with a plain forward
pre-hook on fairseq's own full forward), for ``lightconv_iwslt_de_en`` with lightweight and with
dynamic convolutions (shrunk by flags; both have fairseq's non-CUDA fallbacks) and for
``lightconv_lm``; both translation models train a few updates in a real ``fairseq-train``; and a
model with neither ``features_only`` nor a linear output projection is refused at start-up in one
line naming it.
"""
import pytest
import torch

from fairseq_runs import STRONG_GATING, TINY_LM_ARGS, TINY_MT_ARGS, USER_DIR, build_parts, first_batch, run_cli
from in_process import fairseq_train
from reference_constructions import reference_output_loss

SHRUNK = ["--encoder-layers", "1", "--decoder-layers", "1", "--encoder-conv-dim", "32", "--decoder-conv-dim", "32",
          "--encoder-kernel-size-list", "[3]", "--decoder-kernel-size-list", "[3]", "--weight-dropout", "0",
          "--attention-dropout", "0", "--relu-dropout", "0", "--input-dropout", "0"]


def conv_mt_args(conv):
    args = [a if a != "transformer" else "lightconv_iwslt_de_en" for a in TINY_MT_ARGS]
    return args + SHRUNK + ["--encoder-conv-type", conv, "--decoder-conv-type", conv]


CONV_LM_ARGS = [a if a != "transformer_lm" else "lightconv_lm" for a in TINY_LM_ARGS] + [
    "--decoder-layers", "1", "--decoder-kernel-size-list", "[3]", "--weight-dropout", "0", "--attention-dropout", "0",
    "--relu-dropout", "0", "--input-dropout", "0"]


def projection_input(model, sample):
    """The decoder's features and fairseq's logits from the model's own full forward."""
    seen = []
    handle = model.decoder.output_projection.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0]))
    try:
        logits = model(**sample["net_input"])[0]
    finally:
        handle.remove()
    assert len(seen) == 1
    return seen[0], logits


def check_against_reference(data, args):
    cfg, task, model, agg = build_parts(data, args, ["--criterion", "cross_entropy_agg"] + STRONG_GATING)
    sample = first_batch(task)
    model.train()
    agg.set_update_num(0)
    model.zero_grad()
    loss, _, log = agg(model, sample)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    gates = agg.last_gates
    assert gates.rare.any() and (~gates.rare).any()

    model.zero_grad()
    features, logits = projection_input(model, sample)
    weight = model.decoder.output_projection.weight
    torch.testing.assert_close(features @ weight.t(), logits, rtol=1e-5, atol=1e-5)  # the projection is last
    target = model.get_targets(sample, None).reshape(-1)
    keep = target.ne(task.target_dictionary.pad())
    reference, nll, _ = reference_output_loss(features.reshape(-1, features.size(-1))[keep], weight, target[keep],
                                              gates=gates)
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    assert log["nll_loss"].item() == pytest.approx(nll.item(), rel=1e-5)
    assert grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert "forward" not in vars(model.decoder.output_projection)  # skipped only within the criterion's forward


@pytest.mark.parametrize("conv", ["lightweight", "dynamic"])
def test_agg_on_a_convolution_translation_model_equals_the_reference(mt_data_bin, conv):
    check_against_reference(mt_data_bin, conv_mt_args(conv))


def test_agg_on_lightconv_lm_equals_the_reference(lm_data_bin):
    check_against_reference(lm_data_bin, CONV_LM_ARGS)


@pytest.mark.parametrize("conv", ["lightweight", "dynamic"])
def test_a_convolution_translation_model_trains_in_fairseq_train(mt_data_bin, tmp_path, conv):
    save_dir = tmp_path / "save"
    proc = run_cli("fairseq-train", [mt_data_bin, "--user-dir", USER_DIR, *conv_mt_args(conv),
                                     "--criterion", "cross_entropy_agg", "--max-update", "3", "--save-dir", save_dir,
                                     "--no-epoch-checkpoints", "--disable-validation"], timeout=300)
    assert "Traceback" not in proc.stderr
    from fairseq import checkpoint_utils

    # read as the plugin reads checkpoints: torch's safe loader, pinned, fairseq's legacy Namespace allowed
    state = checkpoint_utils.load_checkpoint_to_cpu(str(save_dir / "checkpoint_last.pt"))
    assert state["optimizer_history"][-1]["num_updates"] == 3
    assert state["cfg"]["model"].decoder_conv_type == conv  # the model's config: fairseq's legacy Namespace
    assert int(state["criterion"]["window.counts"].sum()) > 0  # AGG counted the targets it trained on


def test_a_model_without_features_or_a_linear_projection_is_refused_at_start_up(mt_data_bin, tmp_path):
    args = [a if a != "transformer" else "fconv_iwslt_de_en" for a in TINY_MT_ARGS if a != "--share-all-embeddings"]
    args = args[:args.index("--encoder-layers")] + args[args.index("--max-tokens"):]  # fconv: its own layer flags
    save_dir = tmp_path / "save"
    outcome = fairseq_train([mt_data_bin, "--user-dir", USER_DIR, *args, "--criterion",
                             "cross_entropy_agg", "--max-update", "2", "--save-dir", save_dir])
    assert outcome.returncode == 2, outcome.stderr[-3000:]
    assert outcome.stderr.strip().splitlines()[-1].startswith(
        "fairseq-train: error: the model FConvModel has no linear output projection (decoder.output_projection)")
    assert not save_dir.exists() or not any(save_dir.iterdir())
