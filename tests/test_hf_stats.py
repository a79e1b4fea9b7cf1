"""The embedding statistics under Hugging Face ``Trainer`` (``fairseq_agg.hf.EmbeddingStatsCallback``,
docs/hf.md, "Statistics").

* the frequency groups equal a hand count of the train dataset's tokens, sorted and cut by hand;
* a real ``Trainer`` run logs, at every interval and at the end, values equal to
  ``fairseq_agg.stats.metrics`` computed by hand on the weights of that update and the hand groups,
  as records of ``trainer.state.log_history``;
* an untied model is measured on its head, not its input embedding; the isotropy interval;
* every bad argument refused in one line, before training.
"""
from collections import Counter

import pytest
import torch
from transformers import Trainer, TrainerCallback, default_data_collator

from fairseq_agg.errors import UsageError
from fairseq_agg.hf import EmbeddingStatsCallback
from fairseq_agg.stats.metrics import isotropy, mean_pairwise_cosine, tev_stats
from hf_models import tiny_model
from hf_trainer_runs import VOCAB, tiny_llama, token_dataset, training_args


def tiny_gpt2():
    return tiny_model("gpt2", vocab=VOCAB)  # tied, the vocabulary of the Trainer runs' data


def trainer_for(model, output_dir, **overrides):
    args = training_args(output_dir, **{"gradient_accumulation_steps": 1, "save_strategy": "no", **overrides})
    return Trainer(model=model, args=args, train_dataset=token_dataset(), data_collator=default_data_collator)


def hand_groups(exclude=(0,)):
    """The ids by hand: counted over the attended tokens, most frequent first (ties: smaller id
    first), the excluded ones left out, cut at round(0.3 n) and round(0.8 n), halves up."""
    count = Counter()
    for row in token_dataset():
        count.update(t for t, attended in zip(row["input_ids"], row["attention_mask"]) if attended)
    order = [i for i in sorted(range(VOCAB), key=lambda i: (-count[i], i)) if i not in exclude]
    n = len(order)
    b1, b2 = int(0.3 * n + 0.5), int(0.8 * n + 0.5)
    return count, {"freq": order[:b1], "med": order[b1:b2], "rare": order[b2:]}


def hand_statistics(W, exclude=(0,)):
    _, groups = hand_groups(exclude)
    out = {}
    kept = [i for i in range(VOCAB) if i not in exclude]
    for suffix, ids in [("", kept)] + [(f"_{g}", r) for g, r in groups.items()]:
        rows = torch.tensor(ids)
        out["tev_mu" + suffix] = tev_stats(W, rows)["mu"]
        out["tev_sigma" + suffix] = tev_stats(W, rows)["sigma"]
        out["mean_cos" + suffix] = mean_pairwise_cosine(W, rows)
        out["isotropy" + suffix] = isotropy(W, rows)["isotropy"]
    return out


def test_groups_are_a_hand_count_of_the_train_dataset(tmp_path):
    callback = EmbeddingStatsCallback(trainer_for(tiny_gpt2(), tmp_path), exclude_ids=[0])
    count, groups = hand_groups()
    assert callback.token_counts.tolist() == [count[i] for i in range(VOCAB)]
    assert count[0] == 0 and sum(count.values()) == sum(sum(row["attention_mask"]) for row in token_dataset())
    assert {g: ids.tolist() for g, ids in callback.groups.items()} == groups
    assert callback.rows.tolist() == list(range(1, VOCAB))


def test_given_counts_make_the_groups(tmp_path):
    counts = torch.arange(VOCAB)  # the larger the id, the more frequent
    callback = EmbeddingStatsCallback(trainer_for(tiny_gpt2(), tmp_path), token_counts=counts,
                                      embed_group_fractions=(0.5, 0.25, 0.25))
    by_frequency = list(range(VOCAB - 1, -1, -1))
    assert {g: ids.tolist() for g, ids in callback.groups.items()} == {
        "freq": by_frequency[:24], "med": by_frequency[24:36], "rare": by_frequency[36:]}


class WeightsAt(TrainerCallback):
    """Keeps a copy of the output embedding at the end of every update (before the statistics run)."""

    def __init__(self, model):
        self.model, self.weights = model, {}

    def on_step_end(self, args, state, control, **kwargs):
        self.weights[state.global_step] = self.model.get_output_embeddings().weight.detach().clone()


def test_a_trainer_run_logs_the_hand_computed_values_at_each_interval_and_at_the_end(tmp_path):
    model = tiny_gpt2()
    trainer = trainer_for(model, tmp_path, max_steps=5)
    weights = WeightsAt(model)
    trainer.add_callback(weights)
    trainer.add_callback(EmbeddingStatsCallback(trainer, embed_stats_interval=2, exclude_ids=[0]))
    trainer.train()
    records = {entry["step"]: entry for entry in trainer.state.log_history if "tev_mu" in entry}
    assert sorted(records) == [2, 4, 5]  # every 2 updates, and at the end
    for step, entry in records.items():
        expected = hand_statistics(weights.weights[step])
        assert {k: entry[k] for k in expected} == pytest.approx(expected, rel=1e-9, abs=1e-12)
        assert set(entry) == set(expected) | {"epoch", "step"}
    assert not torch.equal(weights.weights[2], weights.weights[5])  # the run did move the embedding


def test_an_untied_model_is_measured_on_its_head(tmp_path):
    model = tiny_llama()
    callback = EmbeddingStatsCallback(trainer_for(model, tmp_path), exclude_ids=[0])
    measured = callback.measure()
    assert measured == pytest.approx(hand_statistics(model.lm_head.weight.detach()), rel=1e-9, abs=1e-12)
    assert measured["tev_mu"] != pytest.approx(hand_statistics(model.model.embed_tokens.weight.detach())["tev_mu"])


def test_isotropy_has_its_own_interval_and_steps_are_updates(tmp_path):
    trainer = trainer_for(tiny_gpt2(), tmp_path, max_steps=4, gradient_accumulation_steps=2)
    trainer.add_callback(EmbeddingStatsCallback(trainer, embed_stats_interval=1, embed_isotropy_interval=3))
    trainer.train()
    records = [entry for entry in trainer.state.log_history if "tev_mu" in entry]
    assert [entry["step"] for entry in records] == [1, 2, 3, 4]
    assert [entry["step"] for entry in records if "isotropy" in entry] == [3]


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(token_dataset())


@pytest.mark.parametrize("arguments, message", [
    ({"embed_stats_interval": 0}, "--embed-stats-interval must be >= 1, got 0"),
    ({"embed_stats_interval": 2.5}, "--embed-stats-interval must be an integer >= 1, got 2.5"),
    ({"embed_isotropy_interval": -1}, "--embed-isotropy-interval must be >= 0, got -1"),
    ({"embed_group_fractions": (0.5, 0.5, 0.5)}, "--embed-group-fractions: expected three fractions"),
    ({"token_counts": torch.ones(VOCAB - 1)}, f"token_counts must be {VOCAB} finite counts >= 0"),
    ({"token_counts": -torch.ones(VOCAB)}, f"token_counts must be {VOCAB} finite counts >= 0"),
    ({"exclude_ids": [VOCAB]}, f"exclude_ids must be ids in [0, {VOCAB}), got [{VOCAB}]"),
    ({"dataset": Stream()}, "the train dataset has no length to count token frequencies in"),
    ({"dataset": [{"input_ids": [1, VOCAB]}]}, f"example 0 of the train dataset holds token ids outside [0, {VOCAB})"),
    ({"dataset": [{"text": "no ids"}]}, "example 0 of the train dataset has no input_ids to count"),
])
def test_bad_arguments_are_refused_in_one_line(tmp_path, arguments, message):
    trainer = trainer_for(tiny_gpt2(), tmp_path)
    trainer.train_dataset = arguments.pop("dataset", trainer.train_dataset)
    with pytest.raises(UsageError) as error:
        EmbeddingStatsCallback(trainer, **arguments)
    assert message in str(error.value) and "\n" not in str(error.value)
