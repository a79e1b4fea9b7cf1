#!/usr/bin/env python3
"""Trains a small GPT-style language model with AGG in a plain PyTorch loop, without fairseq.

AGG (Yu et al., ACL 2022, "Rare Tokens Degenerate All Tokens", §4) gates the part of the output
embedding's gradient that pushes rare tokens away from the contexts of other tokens
(docs/agg.md). Here it is one object, ``fairseq_agg.ops.AggLoss``, called in place of the
cross-entropy; everything else is an ordinary training loop (API: docs/api.md).

The text is real English that every Python installation ships: the language's reference
documentation in the standard library's ``pydoc_data.topics`` (about 120,000 words and punctuation
marks); ``--text FILE`` trains on your own UTF-8 file instead. The script prints the loss, AGG's
number of rare tokens and the isotropy I(W) of the output embedding before and after training;
``--method both`` also trains plain cross-entropy from the same initialisation and data order and
compares the two.

    python examples/plain_pytorch/train_agg_lm.py --steps 300 --method both
"""
import argparse
import collections
import math
import os
import re
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from fairseq_agg.ops import AggLoss, fused_linear_loss, isotropy, mean_pairwise_cosine

SPECIALS = ("<unk>", "<eos>")  # ids 0 and 1; AggLoss(nspecial=2) never counts them as rare
UNK, EOS = 0, 1


# --- data ------------------------------------------------------------------------------------------


def read_corpus(path):
    """(text, description): ``path``'s text, or the Python documentation bundled in the stdlib."""
    if path:
        with open(path, encoding="utf-8") as f:
            return f.read(), path
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a Python stripped of its documentation
        sys.exit("error: this Python has no pydoc_data (the default corpus); pass --text FILE")
    return "\n".join(topics[key] for key in sorted(topics)), "the Python reference docs (stdlib pydoc_data.topics)"


def words(text):
    """Lower-cased words and punctuation marks; a line break ends a sentence."""
    out = []
    for line in text.splitlines():
        tokens = re.findall(r"\w+|[^\w\s]", line.lower())
        if tokens:
            out.extend(tokens)
            out.append("<eos>")
    return out


def encode(tokens, vocab_size):
    """Ids of ``tokens`` over the ``vocab_size`` most frequent words (the rest <unk>), and the vocabulary."""
    frequent = [w for w, _ in collections.Counter(t for t in tokens if t not in SPECIALS).most_common(vocab_size)]
    vocab = list(SPECIALS) + frequent
    index = {w: i for i, w in enumerate(vocab)}
    return torch.tensor([index.get(t, UNK) for t in tokens], dtype=torch.long), vocab


def random_blocks(ids, batch_size, context, generator):
    """``batch_size`` random windows of ``context`` + 1 ids: inputs and their next-token targets."""
    starts = torch.randint(0, ids.numel() - context - 1, (batch_size,), generator=generator)
    block = torch.stack([ids[s : s + context + 1] for s in starts.tolist()])
    return block[:, :-1], block[:, 1:]


# --- model: a decoder-only transformer with tied input/output embedding -----------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        batch, length, dim = x.shape
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(dim, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, dim))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab_size, dim, layers, heads, context):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.position = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab_size, bias=False)
        self.out.weight = self.embed.weight  # tied: the matrix whose degeneration AGG counters
        nn.init.normal_(self.embed.weight, std=dim ** -0.5)

    def features(self, tokens):
        """The last layer's features (B, T, d): what AGG's loss takes instead of logits."""
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


# --- training ------------------------------------------------------------------------------------------


def output_embedding_stats(model):
    weight = model.out.weight.detach()
    return isotropy(weight)["isotropy"], mean_pairwise_cosine(weight)


def train(method, args, train_ids, valid_ids, vocab_size, initial_state, log):
    """Trains one model from ``initial_state``; returns its summary (dict)."""
    model = TinyGPT(vocab_size, args.dim, args.layers, args.heads, args.context).to(args.device)
    model.load_state_dict(initial_state)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    batches = torch.Generator().manual_seed(args.seed)  # the same data order for every method
    tokens_per_update = args.batch_size * args.context * args.accumulate
    # The paper's window: the updates of one epoch (fairseq's --agg-window 0)
    window = args.window or max(1, math.ceil(train_ids.numel() / tokens_per_update))
    agg = None
    if method == "agg":
        agg = AggLoss(vocab_size, alpha=args.alpha, window=window, nspecial=len(SPECIALS), ref_tokens=args.ref_tokens)
    iso_before, cos_before = output_embedding_stats(model)
    log(f"[{method}] I(W) of the output embedding before training: {iso_before:.4f}")

    model.train()
    recent_losses = collections.deque(maxlen=max(1, args.log_interval))
    for update in range(args.steps):
        update_loss = 0.0
        for _ in range(args.accumulate):  # every micro-batch of one update passes the same update_num
            inputs, target = random_blocks(train_ids, args.batch_size, args.context, batches)
            inputs, target = inputs.to(args.device), target.to(args.device)
            hidden = model.features(inputs).flatten(0, 1)  # no padding here: every position is a target
            target = target.flatten()
            if agg is not None:
                result = agg(hidden, model.out.weight, target, update_num=update)
            else:
                result = fused_linear_loss(hidden, model.out.weight, target)  # plain cross-entropy
            (result.loss / (target.numel() * args.accumulate)).backward()
            update_loss += result.nll.item() / (target.numel() * args.accumulate)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        recent_losses.append(update_loss)
        if (update + 1) % args.log_interval == 0 or update + 1 == args.steps:
            rare = f"  rare tokens {int(agg.gates().rare.sum())}" if agg is not None else ""
            log(f"[{method}] step {update + 1:5d}  loss {sum(recent_losses) / len(recent_losses):.4f}{rare}")

    iso_after, cos_after = output_embedding_stats(model)
    summary = {
        "method": method, "loss": sum(recent_losses) / len(recent_losses),
        "valid_ppl": valid_perplexity(model, valid_ids, args), "iso_before": iso_before, "iso_after": iso_after,
        "cos_before": cos_before, "cos_after": cos_after,
        "rare": int(agg.gates().rare.sum()) if agg is not None else None,
    }
    rare = f"; rare tokens {summary['rare']} (window {window} updates)" if agg is not None else ""
    log(f"[{method}] I(W) of the output embedding after training: {iso_after:.4f}; mean cosine "
        f"{cos_before:.4f} -> {cos_after:.4f}; valid ppl {summary['valid_ppl']:.1f}{rare}")
    return summary


@torch.no_grad()
def valid_perplexity(model, ids, args):
    """Perplexity over consecutive windows of ``ids`` (at most ``args.valid_tokens`` targets): plain
    cross-entropy for both methods (AGG changes gradients, not the loss, and never counts here)."""
    model.eval()
    usable = min(ids.numel() - 1, args.valid_tokens) // args.context * args.context
    inputs = ids[:usable].view(-1, args.context).to(args.device)
    target = ids[1 : usable + 1].view(-1, args.context).to(args.device)
    nll = fused_linear_loss(model.features(inputs).flatten(0, 1), model.out.weight, target.flatten()).nll
    model.train()
    return math.exp(nll.item() / target.numel())


# --- command line ------------------------------------------------------------------------------------


def at_least(low, kind=int):
    """An argparse type: a finite ``kind`` >= ``low``."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if not (math.isfinite(value) and value >= low):
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value

    return parse


def positive_float(text):
    value = at_least(0.0, float)(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def build_parser():
    parser = argparse.ArgumentParser(
        description="Train a small GPT-style LM with AGG (or plain cross-entropy) in a plain PyTorch loop, "
        "and report the isotropy of its output embedding.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--method", choices=("agg", "ce", "both"), default="agg",
                        help="AGG, plain cross-entropy, or both from the same initialisation (a comparison table)")
    parser.add_argument("--steps", type=at_least(1), default=300, help="optimizer updates")
    parser.add_argument("--seed", type=at_least(0), default=1, help="seed of the initialisation and data order")
    parser.add_argument("--text", default=None,
                        help="UTF-8 text file to train on instead of the Python docs in the stdlib")
    parser.add_argument("--vocab", type=at_least(2), default=4000, help="most frequent words kept (the rest: <unk>)")
    parser.add_argument("--dim", type=at_least(1), default=64, help="model width d")
    parser.add_argument("--layers", type=at_least(1), default=2, help="transformer blocks")
    parser.add_argument("--heads", type=at_least(1), default=2, help="attention heads (must divide --dim)")
    parser.add_argument("--context", type=at_least(2), default=64, help="tokens per training sequence")
    parser.add_argument("--batch-size", type=at_least(1), default=16, help="sequences per micro-batch")
    parser.add_argument("--accumulate", type=at_least(1), default=1, help="micro-batches per optimizer update")
    parser.add_argument("--lr", type=positive_float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--alpha", type=positive_float, default=0.03, help="AGG's rare-token threshold (in (0, 1])")
    parser.add_argument("--ref-tokens", type=at_least(1), default=32768,
                        help="AGG: alpha counts occurrences per this many target tokens "
                        "(the paper's tokens per update)")
    parser.add_argument("--window", type=at_least(0), default=0,
                        help="AGG: updates counted; 0 = one epoch of updates, as in the paper")
    parser.add_argument("--valid-tokens", type=at_least(1), default=8192, help="held-out tokens for the perplexity")
    parser.add_argument("--log-interval", type=at_least(1), default=50, help="updates between loss lines")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    return parser


def parse_args(parser, argv=None):
    args = parser.parse_args(argv)
    if args.dim % args.heads:
        parser.error(f"--heads must divide --dim, got --dim {args.dim} --heads {args.heads}")
    if args.alpha > 1:  # g1 = a_k < alpha must stay a gate (docs/agg.md (A4))
        parser.error(f"--alpha must be in (0, 1], got {args.alpha}")
    if args.text and not os.path.isfile(args.text):
        parser.error(f"--text: no such file: {args.text}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device: not a torch device: {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    return args


def main(argv=None):
    parser = build_parser()
    args = parse_args(parser, argv)
    log = lambda line: print(line, flush=True)  # noqa: E731
    text, source = read_corpus(args.text)
    ids, vocab = encode(words(text), args.vocab)
    split = int(ids.numel() * 0.95)
    train_ids, valid_ids = ids[:split], ids[split:]
    if valid_ids.numel() <= args.context or train_ids.numel() <= args.context + 1:
        parser.error(f"--context {args.context} is too long for {source} ({ids.numel()} tokens)")
    log(f"corpus: {source}: {train_ids.numel():,} training and {valid_ids.numel():,} held-out tokens, "
        f"vocabulary {len(vocab):,} (with {len(SPECIALS)} specials)")

    torch.manual_seed(args.seed)
    initial_state = TinyGPT(len(vocab), args.dim, args.layers, args.heads, args.context).state_dict()
    methods = ("ce", "agg") if args.method == "both" else (args.method,)
    summaries = [train(m, args, train_ids, valid_ids, len(vocab), initial_state, log) for m in methods]

    if len(summaries) > 1:
        log("\nmethod | final loss | valid ppl | I(W) before -> after | mean cos after | rare tokens")
        for s in summaries:
            rare = "-" if s["rare"] is None else s["rare"]
            log(f"{s['method']:6s} | {s['loss']:10.4f} | {s['valid_ppl']:9.1f} | {s['iso_before']:.4f} -> "
                f"{s['iso_after']:.4f} | {s['cos_after']:14.4f} | {rare}")


if __name__ == "__main__":
    main()
