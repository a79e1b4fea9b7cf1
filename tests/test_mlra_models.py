"""MLRA models in fairseq: architectures, parameter bookkeeping, and real fairseq-train /
fairseq-generate / fairseq-eval-lm runs that load the checkpoints (docs/mlra.md)."""
import math
import os
import re

import pytest
import torch
from fairseq import checkpoint_utils, options, tasks
from fairseq.data import Dictionary
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq.modules import MultiheadAttention

import fairseq_runs as fr
from fairseq_agg.errors import UsageError
from fairseq_agg.modules.mlra_options import AttentionSite, MLRAOptions
from fairseq_agg.modules.mlra import MultiheadLowRankAttention

torch.set_num_threads(1)

SUMMARY = re.compile(r"model parameters ([\d,]+) vs ([\d,]+) \(delta ([+-][\d,]+)")


def parse(argv):
    parser = options.get_training_parser()
    return options.parse_args_and_arch(parser, input_args=[str(a) for a in argv])


def build(argv):
    """A real fairseq task and model from a command line, in-process."""
    cfg = convert_namespace_to_omegaconf(parse(argv))
    task = tasks.setup_task(cfg.task)
    return task, task.build_model(cfg.model)


def nparams(model):
    return sum(p.numel() for p in model.parameters())


def with_arch(args, arch):
    args = list(args)
    args[args.index("--arch") + 1] = arch
    return args


def summary_numbers(caplog):
    found = [SUMMARY.search(r.getMessage()) for r in caplog.records]
    found = [m for m in found if m]
    assert found, "no MLRA parameter summary was logged"
    return [int(g.replace(",", "")) for g in found[-1].groups()]


def attn_modules(model):
    return [m for m in model.modules() if isinstance(m, (MultiheadAttention, MultiheadLowRankAttention))]


# ----------------------------------------------------------------------------------------------
# Architectures and flags (parsing only)
# ----------------------------------------------------------------------------------------------


def test_architecture_defaults_mirror_stock(lm_data_bin, mt_data_bin):
    ud = ["--user-dir", fr.USER_DIR]
    lm = lambda arch: parse([lm_data_bin, "--task", "language_modeling", "--arch", arch] + ud)  # noqa: E731
    for stock, mlra in [("transformer_lm_gpt", "transformer_lm_mlra_gpt"),
                        ("transformer_lm_gpt2_small", "transformer_lm_mlra_gpt2_small")]:
        a, b = vars(lm(stock)), vars(lm(mlra))
        for k in ("decoder_embed_dim", "decoder_ffn_embed_dim", "decoder_layers", "decoder_attention_heads",
                  "activation_fn", "dropout", "attention_dropout", "decoder_normalize_before"):
            assert a[k] == b[k], k
        assert b["mlra_mode"] == "shared" and b["mlra_init"] == "gpt2" and b["mlra_targets"] == "q,k,v"
        assert b["attention_rank"] is None and b["mlra_rebalance"] == "none"
    wiki_stock, wiki = lm("transformer_lm_wiki103"), lm("transformer_lm_mlra_wiki103")
    for k in ("decoder_embed_dim", "decoder_ffn_embed_dim", "decoder_layers", "decoder_attention_heads",
              "dropout", "attention_dropout", "activation_dropout", "no_decoder_final_norm"):
        assert getattr(wiki, k) == getattr(wiki_stock, k), k
    assert (wiki.decoder_layers, wiki.decoder_embed_dim, wiki.decoder_attention_heads) == (16, 1024, 8)
    assert wiki_stock.adaptive_input and wiki_stock.adaptive_softmax_cutoff == "20000,60000"
    assert not wiki.adaptive_input and not wiki.tie_adaptive_weights
    assert wiki.adaptive_softmax_cutoff is None and wiki.adaptive_input_cutoff is None

    mt = lambda arch: parse([mt_data_bin, "--task", "translation", "--arch", arch] + ud)  # noqa: E731
    for stock, mlra in [("transformer_wmt_en_de", "transformer_mlra_wmt_en_de"),
                        ("transformer_vaswani_wmt_en_de_big", "transformer_mlra_vaswani_wmt_en_de_big")]:
        a, b = vars(mt(stock)), vars(mt(mlra))
        for k in a:
            if k not in ("arch", "_name"):
                assert a[k] == b.get(k), k
        assert b["mlra_cross_attention"] is False and b["mlra_self_attention"] == "all"
    big = mt("transformer_mlra_vaswani_wmt_en_de_big")
    assert (big.encoder_embed_dim, big.encoder_attention_heads, big.dropout) == (1024, 16, 0.3)


# ----------------------------------------------------------------------------------------------
# In-process builds: which modules are swapped, and the printed parameter delta
# ----------------------------------------------------------------------------------------------

LM_MLRA = with_arch(fr.TINY_LM_ARGS, "transformer_lm_mlra_gpt")
LM_STOCK = with_arch(fr.TINY_LM_ARGS, "transformer_lm_gpt")


def lm_delta_by_hand(layers, d, r):
    # per layer: MHA 4 (d^2 + d); MLRA q, k, v: r (d + d) + d each, dense output d^2 + d
    return layers * ((3 * (2 * d * r + d) + d * d + d) - 4 * (d * d + d))


def test_lm_swaps_attention_and_prints_delta(lm_data_bin, caplog):
    ud = [lm_data_bin, "--user-dir", fr.USER_DIR]
    _, stock = build(ud + LM_STOCK)
    with caplog.at_level("INFO"):
        # rank 6, per_head-free shared mode, targets q,k,v: the default rank would be 32 / 4 = 8
        _, model = build(ud + LM_MLRA + ["--attention-rank", "6", "--mlra-init", "matched"])
    mods = attn_modules(model)
    assert len(mods) == 2 and all(isinstance(m, MultiheadLowRankAttention) for m in mods)
    assert all(m.rank == 6 and m.init == "matched" and m.self_attention for m in mods)
    assert nparams(model) - nparams(stock) == lm_delta_by_hand(2, 32, 6) == -3840
    total, baseline, delta = summary_numbers(caplog)
    assert (total, baseline, delta) == (nparams(model), nparams(stock), -3840)
    # the rest of the model is the stock one, parameter by parameter
    shapes = lambda m: {k: v.shape for k, v in m.state_dict().items() if ".self_attn." not in k}  # noqa: E731
    assert shapes(model) == shapes(stock)


@pytest.mark.parametrize("how", ["ffn", "depth"])
def test_lm_rebalance_spends_the_saving(lm_data_bin, caplog, how):
    ud, six = [lm_data_bin, "--user-dir", fr.USER_DIR], ["--decoder-layers", "6"]
    _, stock = build(ud + LM_STOCK + six)
    with caplog.at_level("INFO"):
        _, model = build(ud + LM_MLRA + six + ["--attention-rank", "6", "--mlra-rebalance", how])
    d, saved = 32, -lm_delta_by_hand(1, 32, 6)  # 1920 per layer
    layers = model.decoder.layers
    if how == "ffn":  # 1920 // (2 d + 1) = 29 more FFN units per layer
        assert len(layers) == 6 and all(l.fc1.out_features == 64 + 29 for l in layers)
        gap_bound = 6 * (2 * d + 1)
    else:  # 6 * 1920 = 11520 saved; one MLRA layer has 6624 parameters: one more layer
        one_layer = sum(p.numel() for p in layers[0].parameters())
        # attention 3 (6 (32 + 32) + 32) + 32^2 + 32; FFN 2 * 32 * 64 + 64 + 32; two LayerNorms
        assert one_layer == 3 * (6 * 64 + 32) + 1056 + 4192 + 128 == 6624 and len(layers) == 7
        gap_bound = one_layer
    gap = nparams(stock) - nparams(model)
    assert 0 <= gap < gap_bound
    total, baseline, _ = summary_numbers(caplog)
    assert total == nparams(model) and baseline == nparams(stock)
    assert model.decoder.cfg.decoder.layers == len(layers)


def test_mt_scope_flags_and_delta(mt_data_bin, caplog):
    ud = [mt_data_bin, "--user-dir", fr.USER_DIR]
    mt = with_arch(fr.TINY_MT_ARGS, "transformer_mlra_wmt_en_de")
    _, stock = build(ud + fr.TINY_MT_ARGS)
    with caplog.at_level("INFO"):
        _, model = build(ud + mt + ["--mlra-cross-attention", "--mlra-mode", "per_head"])
    enc, dec = model.encoder.layers[0], model.decoder.layers[0]
    assert isinstance(enc.self_attn, MultiheadLowRankAttention) and enc.self_attn.self_attention
    assert isinstance(dec.self_attn, MultiheadLowRankAttention) and dec.self_attn.self_attention
    assert isinstance(dec.encoder_attn, MultiheadLowRankAttention) and dec.encoder_attn.encoder_decoder_attention
    assert dec.self_attn.rank == 8  # per_head default: d_h / 2 = 16 / 2
    # per head: q, k, v each H r (d + d_h) + d = 2*8*(32+16) + 32 = 800; O dense 32*32 + 32
    per_module = 3 * 800 + 1056 - 4 * 1056
    assert nparams(model) - nparams(stock) == 3 * per_module
    total, baseline, _ = summary_numbers(caplog)
    assert (total, baseline) == (nparams(model), nparams(stock))

    _, model = build(ud + mt + ["--mlra-self-attention", "encoder"])
    enc, dec = model.encoder.layers[0], model.decoder.layers[0]
    assert isinstance(enc.self_attn, MultiheadLowRankAttention)
    assert type(dec.self_attn) is MultiheadAttention and type(dec.encoder_attn) is MultiheadAttention


def test_bad_per_head_rank_and_targets_fail_at_build(lm_data_bin):
    ud = [lm_data_bin, "--user-dir", fr.USER_DIR] + LM_MLRA
    with pytest.raises(ValueError, match=r"--attention-rank 17 .*1 <= r <= 16 \(the head dim\)"):
        build(ud + ["--mlra-mode", "per_head", "--attention-rank", "17"])
    with pytest.raises(ValueError, match=r"--mlra-targets must be a non-empty comma-separated subset of q,k,v,o"):
        build(ud + ["--mlra-targets", "q,k,w"])


@pytest.mark.parametrize("rank", [math.nan, math.inf, -math.inf, True, 2.5, 0, 17])
def test_rank_refusals_are_one_line_usage_errors(rank):
    """Every bad --attention-rank (nan and inf too, which int() would not even convert) is one
    UsageError naming the flag, the module and its allowed range."""
    with pytest.raises(UsageError) as e:
        MLRAOptions(rank=rank, mode="per_head").rank_for(32, 2, "decoder self-attention")
    assert str(e.value) == (f"--attention-rank {rank} is out of range for the decoder self-attention (embed dim 32, "
                            "2 heads) with --mlra-mode per_head: it must be an integer 1 <= r <= 16 (the head dim)")
    assert MLRAOptions(rank=16.0, mode="per_head").rank_for(32, 2) == 16


def test_option_and_width_refusals_are_usage_errors():
    cases = [
        (lambda: MLRAOptions(mode="blocks"), "--mlra-mode must be one of shared, per_head, got 'blocks'"),
        (lambda: MLRAOptions(init="xavier"), "--mlra-init must be one of gpt2, matched, got 'xavier'"),
        (lambda: MLRAOptions(rebalance="width"), "--mlra-rebalance must be one of none, ffn, depth, got 'width'"),
        (lambda: MLRAOptions(self_attention="both"),
         "--mlra-self-attention must be one of all, encoder, decoder, none, got 'both'"),
        (lambda: MLRAOptions(targets="q,x"), "--mlra-targets must be a non-empty comma-separated subset of q,k,v,o; "
                                             "got 'q,x'"),
        (lambda: MLRAOptions().validate([AttentionSite("decoder", "decoder self-attention", 30, 4, None, True)]),
         "decoder self-attention: embed dim 30 is not divisible by 4 attention heads "
         "(--*-embed-dim must be a multiple of --*-attention-heads)"),
    ]
    for make, message in cases:
        with pytest.raises(UsageError) as e:
            make()
        assert str(e.value) == message


# ----------------------------------------------------------------------------------------------
# End-to-end: language model (with the AGG criterion and embedding statistics)
# ----------------------------------------------------------------------------------------------


def _require_criteria(*names):
    from fairseq.criterions import CRITERION_REGISTRY

    missing = [n for n in names if n not in CRITERION_REGISTRY]
    if missing:
        pytest.skip(f"criteria not registered yet: {missing}")


@pytest.fixture(scope="module")
def lm_run(lm_data_bin, tmp_path_factory):
    """fairseq-train --arch transformer_lm_mlra_gpt (tiny dims) with the AGG criterion and TEV
    logging every update, in one run."""
    import fairseq_agg

    fairseq_agg.register_with_fairseq()  # for this process's registry, which _require_criteria reads
    _require_criteria("cross_entropy_agg")
    save = tmp_path_factory.mktemp("mlra_lm") / "ckpt"
    args = LM_MLRA + ["--attention-rank", "4", "--criterion", "cross_entropy_agg",
                      "--embed-stats-interval", "1", "--max-update", "24", "--log-format", "json",
                      "--save-dir", save, "--no-epoch-checkpoints"]
    proc = fr.run_cli("fairseq-train", [lm_data_bin, "--user-dir", fr.USER_DIR] + args)
    return {"save": save, "out": proc.stdout + proc.stderr}


def test_lm_trains_with_agg_and_embedding_stats(lm_run, lm_data_bin):
    out = lm_run["out"]
    assert "MLRA (Chung et al., 2024, stability) in transformer_lm_mlra: 2 attention modules" in out
    records = fr.read_json_log(out)
    inner = [r for r in records if "loss" in r]  # train_inner records
    assert len(inner) == 24  # --log-interval 1 and TEV every update
    losses = [float(r["loss"]) for r in inner]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5  # it learns
    assert any(k.startswith("agg_") for k in inner[0])
    # µTEV over fairseq's embedding init std d^-1/2 (d = 32); the embedding moves every update
    for r in inner:
        assert float(r["tev_mu_over_init"]) == pytest.approx(float(r["tev_mu"]) * math.sqrt(32), rel=1e-4)
    assert len({r["tev_mu"] for r in inner}) >= 20

    # the TEV logged at the last validation is that of the saved (tied) embedding, by hand:
    # the population std of every row but the padding and madeupword rows, then their mean / std
    ckpt = torch.load(lm_run["save"] / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    valid = [r for r in records if "valid_tev_mu" in r][-1]
    assert int(valid["valid_num_updates"]) == 24
    dictionary = Dictionary.load(os.path.join(lm_data_bin, "dict.txt"))
    rows = [i for i, sym in enumerate(dictionary.symbols)
            if i != dictionary.pad() and not sym.startswith("madeupword")]
    weight = ckpt["model"]["decoder.embed_tokens.weight"].double()
    assert weight.size(0) == len(dictionary)
    tev = weight[rows].std(dim=1, correction=0)
    assert float(valid["valid_tev_mu"]) == pytest.approx(tev.mean().item(), rel=1e-5)
    assert float(valid["valid_tev_sigma"]) == pytest.approx(tev.std(correction=0).item(), rel=1e-5)

    keys = ckpt["model"].keys()
    assert "decoder.layers.0.self_attn.q_proj.down.weight" in keys
    assert ckpt["model"]["decoder.layers.1.self_attn.v_proj.up.weight"].shape == (32, 4)
    assert ckpt["cfg"]["model"]["_name"] == "transformer_lm_mlra_gpt"


def test_lm_checkpoint_loads_in_eval_lm_and_decodes_incrementally(lm_run, lm_data_bin):
    ckpt = lm_run["save"] / "checkpoint_best.pt"
    proc = fr.run_cli("fairseq-eval-lm", [lm_data_bin, "--user-dir", fr.USER_DIR, "--path", ckpt,
                                          "--gen-subset", "test", "--tokens-per-sample", "64",
                                          "--max-tokens", "512", "--cpu", "--num-workers", "0"])
    out = proc.stdout + proc.stderr
    m = re.search(r"Loss \(base 2\): ([\d.]+), Perplexity: ([\d.]+)", out)
    assert m, out[-2000:]
    loss = float(m.group(1))
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([str(ckpt)])
    model = models[0].eval()
    assert math.isfinite(loss) and loss < math.log2(len(task.target_dictionary)) - 1
    assert all(isinstance(l.self_attn, MultiheadLowRankAttention) and l.self_attn.rank == 4
               for l in model.decoder.layers)
    # its parameter count is the stock model's plus the hand formula's delta at rank 4
    _, stock = build([lm_data_bin, "--user-dir", fr.USER_DIR] + LM_STOCK)
    assert nparams(model) == nparams(stock) + lm_delta_by_hand(2, 32, 4)

    # each trained attention equals fairseq's MultiheadAttention holding the products U_P D_P
    torch.manual_seed(0)
    x = torch.randn(7, 2, 32)
    mask = torch.triu(torch.full((7, 7), float("-inf")), 1)
    for layer in model.decoder.layers:
        mlra, dense = layer.self_attn, MultiheadAttention(32, 2, self_attention=True).eval()
        with torch.no_grad():
            for name in ("q_proj", "k_proj", "v_proj"):
                p = getattr(mlra, name)
                assert p.down.weight.shape == (4, 32) and p.up.weight.shape == (32, 4)
                getattr(dense, name).weight.copy_(p.up.weight @ p.down.weight)
                getattr(dense, name).bias.copy_(p.up.bias)
            dense.out_proj.load_state_dict(mlra.out_proj.state_dict())
            torch.testing.assert_close(mlra(x, x, x, attn_mask=mask, need_weights=False)[0],
                                       dense(x, x, x, attn_mask=mask)[0], atol=1e-5, rtol=1e-5)

    # incremental decoding through the real decoder equals its full causal forward
    task.load_dataset("test")
    tokens = task.dataset("test")[0]["source"][:20].unsqueeze(0)
    with torch.no_grad():
        full = model(tokens)[0]
        state = {}
        for t in range(tokens.size(1)):
            step = model.decoder(tokens[:, : t + 1], incremental_state=state)[0]
            torch.testing.assert_close(step[:, -1], full[:, t], atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------------
# End-to-end: translation, beam search
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mt_run(mt_data_bin, tmp_path_factory):
    save = tmp_path_factory.mktemp("mlra_mt") / "ckpt"
    args = with_arch(fr.TINY_MT_ARGS, "transformer_mlra_wmt_en_de") + [
        "--mlra-cross-attention", "--mlra-targets", "q,k,v,o", "--mlra-init", "matched",
        "--attention-rank", "16", "--max-update", "40", "--save-dir", save, "--no-epoch-checkpoints",
        "--log-format", "json"]
    train = fr.run_cli("fairseq-train", [mt_data_bin, "--user-dir", fr.USER_DIR] + args)
    gen = fr.run_cli("fairseq-generate", [mt_data_bin, "--user-dir", fr.USER_DIR, "--path",
                                          save / "checkpoint_last.pt", "--gen-subset", "test",
                                          "--beam", "4", "--nbest", "4", "--batch-size", "16", "--max-len-a", "1",
                                          "--max-len-b", "3", "--cpu", "--num-workers", "0"])
    return {"save": save, "train": train.stdout + train.stderr, "gen": gen.stdout}


def test_mt_trains(mt_run):
    out = mt_run["train"]
    assert "in transformer_mlra: 3 attention modules factorised (mode shared, rank 16, targets q,k,v,o" in out
    valid = [float(r["valid_loss"]) for r in fr.read_json_log(out) if "valid_loss" in r]
    assert len(valid) >= 2 and valid[-1] < valid[0]


def test_beam_search_scores_equal_teacher_forced_rescoring(mt_run):
    """fairseq-generate's per-token scores (beam 4, batched and left-padded sources, incremental
    state with cache reorders) equal a plain full forward of the same hypothesis."""
    hyps, pos = {}, {}  # sentence -> the 4 best hypotheses and their per-token scores (base 2)
    for line in mt_run["gen"].splitlines():
        if line.startswith("H-"):
            idx, _, text = line.split("\t")
            hyps.setdefault(int(idx[2:]), []).append(text)
        elif line.startswith("P-"):
            idx, scores = line.split("\t")
            pos.setdefault(int(idx[2:]), []).append([float(s) for s in scores.split()])
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([str(mt_run["save"] / "checkpoint_last.pt")])
    model = models[0].eval()
    assert isinstance(model.decoder.layers[0].encoder_attn, MultiheadLowRankAttention)
    task.load_dataset("test")
    data, tgt_dict = task.dataset("test"), task.target_dictionary
    assert len(hyps) >= 0.9 * len(data) and all(len(h) == 4 == len(pos[i]) for i, h in hyps.items())
    assert all(len(set(h)) == 4 for h in hyps.values())  # four different beams per sentence
    checked = 0
    for i in sorted(hyps)[:20]:
        src = data[i]["source"].unsqueeze(0)
        for text, ref in zip(hyps[i], pos[i]):
            hyp = tgt_dict.encode_line(text, add_if_not_exist=False, append_eos=True).long()
            prev = torch.cat([hyp.new_tensor([tgt_dict.eos()]), hyp[:-1]]).unsqueeze(0)
            with torch.no_grad():
                out = model(src, torch.tensor([src.size(1)]), prev)
                lp = model.get_normalized_probs(out, log_probs=True)[0]
            scores = (lp.gather(-1, hyp.unsqueeze(-1)).squeeze(-1) / math.log(2)).tolist()
            assert len(scores) == len(ref)
            assert max(abs(a - b) for a, b in zip(scores, ref)) < 5e-4, (i, text, scores, ref)  # 4 printed decimals
            checked += 1
    assert checked == 80


# ----------------------------------------------------------------------------------------------
# Bad input on the command line
# ----------------------------------------------------------------------------------------------


def test_bad_rank_fails_before_any_checkpoint(lm_data_bin, tmp_path):
    save = tmp_path / "ckpt"
    proc = fr.run_cli("fairseq-train", [lm_data_bin, "--user-dir", fr.USER_DIR] + LM_MLRA
                      + ["--attention-rank", "33", "--max-update", "2", "--save-dir", save],
                      expect_ok=False)
    assert proc.returncode != 0
    err = proc.stdout + proc.stderr
    assert re.search(r"--attention-rank 33 is out of range for the decoder self-attention .*"
                     r"1 <= r <= 32 \(the embedding dim\)", err), err[-3000:]
    assert not save.exists() or not any(p.suffix == ".pt" for p in save.iterdir())
