"""Uniq (Yu et al. 2022, Table 1; after Welleck et al. 2020): the number of distinct tokens in the
greedy continuations of test prefixes.

The prefixes are ``n_prefixes`` evenly spaced windows of the test split read as one token stream
(the sentences with their end-of-sentence tokens, as ``--sample-break-mode none`` trains on it);
each window is ``prefix_len`` tokens of context followed by ``length`` reference tokens. The model
continues every prefix greedily for ``length`` tokens (:func:`greedy_continuations`: a plain loop
of full forward passes of the loaded fairseq model, no incremental state; exact, and cheap at the
demo's sizes). The same count over the reference continuations is the human value to compare with.
"""
import os
from typing import Dict, List

import torch

from study.metrics import unique_tokens


@torch.no_grad()
def greedy_continuations(next_logits, prefixes: torch.Tensor, length: int) -> torch.Tensor:
    """[B, length]: each row of ``prefixes`` ([B, P] token ids) continued by the argmax token,
    ``length`` times; ``next_logits(tokens [B, T])`` gives the [B, V] logits of the token after
    each row (:func:`fairseq_next_logits` for a fairseq language model)."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    tokens = prefixes
    for _ in range(length):
        tokens = torch.cat([tokens, next_logits(tokens).argmax(dim=-1, keepdim=True)], dim=1)
    return tokens[:, prefixes.size(1):]


def fairseq_next_logits(model):
    """``next_logits`` of a fairseq language model (in eval mode): the decoder's features of every
    position, and the output layer applied to the last one only (the output layer is most of the
    cost of a small model with a large vocabulary)."""
    def next_logits(tokens):
        features = model(tokens, features_only=True)[0]
        return model.decoder.output_layer(features[:, -1:, :])[:, 0, :]
    return next_logits


def prefix_windows(stream: torch.Tensor, n_prefixes: int, prefix_len: int, length: int):
    """(prefixes [n, prefix_len], references [n, length]): ``n_prefixes`` evenly spaced windows
    of the 1-D token ``stream``, the first at position 0 and the last ending at its end."""
    span = prefix_len + length
    if stream.numel() < span:
        raise ValueError(f"the test split has {stream.numel()} tokens, fewer than one prefix + continuation ({span})")
    last = stream.numel() - span
    starts = [0] if n_prefixes == 1 else [round(i * last / (n_prefixes - 1)) for i in range(n_prefixes)]
    windows = torch.stack([stream[s:s + span] for s in starts])
    return windows[:, :prefix_len], windows[:, prefix_len:]


def split_stream(data: str, split: str, dictionary) -> torch.Tensor:
    """The binarised ``split`` of a data-bin directory as one 1-D token stream."""
    from fairseq.data import data_utils

    ds = data_utils.load_indexed_dataset(os.path.join(data, split), dictionary)
    if ds is None:
        raise FileNotFoundError(f"no binarised '{split}' split in {data}")
    return torch.cat([ds[i].long() for i in range(len(ds))])


def evaluate_uniq(checkpoint: str, data: str, split: str = "test", n_prefixes: int = 200, prefix_len: int = 32,
                  length: int = 64, batch_size: int = 50) -> Dict[str, object]:
    """Uniq of a language-model checkpoint on ``split`` of ``data`` (on the CPU), and the same
    count over the reference continuations."""
    from fairseq_agg.analysis.checkpoints import load_checkpoint, load_model_and_task

    state = load_checkpoint(checkpoint)
    model, task = load_model_and_task(checkpoint, state, data, torch.device("cpu"))
    model.eval()
    max_positions = model.max_positions()
    if isinstance(max_positions, (tuple, list)):
        max_positions = max_positions[0]
    if max_positions is not None and prefix_len + length > max_positions:
        raise ValueError(f"prefix {prefix_len} + continuation {length} tokens exceed the model's {max_positions} positions")
    prefixes, refs = prefix_windows(split_stream(data, split, task.source_dictionary), n_prefixes, prefix_len, length)
    step = fairseq_next_logits(model)
    conts: List[torch.Tensor] = [greedy_continuations(step, prefixes[i:i + batch_size], length)
                                 for i in range(0, prefixes.size(0), batch_size)]
    generated = torch.cat(conts)
    return {"uniq": unique_tokens(generated.tolist()), "uniq_reference": unique_tokens(refs.tolist()),
            "prefixes": prefixes.size(0), "prefix_len": prefix_len, "length": length, "split": split,
            "decoding": "greedy"}
