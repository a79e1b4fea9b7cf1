"""AGG's window under a real Hugging Face ``Trainer`` (fairseq_agg.hf.trainer): one count per
optimizer update whatever the gradient accumulation, the counts of the last ``window`` updates,
the method's state in every checkpoint, a killed and resumed run bit-equal to an uninterrupted one,
and a checkpoint whose counts do not fit refused in one line before any update.

Each run: a tiny Llama (random init), 18 rows of token ids, 2 rows per micro-batch, 2 micro-batches
per update: 9 micro-batches per epoch, so 5 updates per epoch (AGG's window), the last of one
micro-batch; 12 updates, checkpoints every 4, on the CPU.
"""
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

from fairseq_agg.errors import UsageError  # noqa: E402
from fairseq_agg.hf import apply  # noqa: E402
from fairseq_agg.hf.trainer import STATE_FILE, MethodStateCallback, add_method_state_callback  # noqa: E402
from hf_trainer_runs import (  # noqa: E402
    AGG_OPTIONS, VOCAB, hand_counts, record_micro_batches, tiny_llama, token_dataset, training_args,
)

ROWS, UPDATES, SAVE_EVERY, WINDOW = 18, 12, 4, 5
MICRO_BATCHES = [2, 2, 2, 2, 1] * 3  # per update, as the Trainer groups an epoch's 9 micro-batches


class StopAfter(TrainerCallback):
    """Stops training after ``updates`` optimizer updates: the run "killed" between checkpoints."""

    def __init__(self, updates):
        self.updates = updates

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.updates:
            control.should_training_stop = True


def agg_trainer(output_dir, seed=0, callbacks=(), **overrides):
    """A Trainer of a freshly initialised tiny Llama with AGG applied (window left at 0: one epoch),
    the method's callback added; returns (trainer, model, the micro-batches it will see)."""
    model = apply(tiny_llama(seed=seed), "agg", **AGG_OPTIONS)
    seen = record_micro_batches(model)
    options = {"max_steps": UPDATES, "save_steps": SAVE_EVERY, **overrides}
    trainer = Trainer(model=model, args=training_args(output_dir, **options), train_dataset=token_dataset(ROWS),
                      callbacks=list(callbacks))
    add_method_state_callback(trainer)
    return trainer, model, seen


def window_state(model):
    return model.fairseq_agg.state_dict()["counts"]["agg"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference run: 12 updates straight through, checkpoints at 4, 8 and 12."""
    out = tmp_path_factory.mktemp("uninterrupted")
    trainer, model, seen = agg_trainer(out)
    trainer.train()
    return out, trainer, model, seen


def test_the_window_counts_optimizer_updates_and_their_targets(uninterrupted):
    out, trainer, model, seen = uninterrupted
    assert trainer.state.global_step == UPDATES
    # every micro-batch of update u saw update_num u, not one number per micro-batch
    assert [u for u, _ in seen] == [u for u in range(UPDATES) for _ in range(MICRO_BATCHES[u])]
    state = window_state(model)
    window, update_index, recorded = state["meta"].tolist()
    assert (window, update_index, recorded) == (WINDOW, UPDATES, WINDOW)
    assert model.fairseq_agg.state_dict()["updates"] == UPDATES
    # the counts are the targets of the last WINDOW updates, counted by hand from what the model saw
    expected = hand_counts(seen, UPDATES - WINDOW, UPDATES - 1)
    assert torch.equal(state["counts"], expected)
    assert not torch.equal(expected, hand_counts(seen, 0, UPDATES - 1))  # the window did slide
    assert model.fairseq_agg.logs()["agg_rare"] > 0  # and some tokens were gated
    assert model.fairseq_agg.update_num is None  # after train(): no forward counts into the last update


def test_each_checkpoint_holds_the_counts_of_its_step_beside_the_optimizer_not_in_the_weights(uninterrupted):
    out, trainer, model, seen = uninterrupted
    for step in (SAVE_EVERY, 2 * SAVE_EVERY, UPDATES):
        directory = os.path.join(out, f"checkpoint-{step}")
        assert os.path.isfile(os.path.join(directory, "optimizer.pt"))
        saved = torch.load(os.path.join(directory, STATE_FILE), weights_only=True)
        assert (saved["method"], saved["vocab_size"], saved["updates"]) == ("agg", VOCAB, step)
        assert torch.equal(saved["counts"]["agg"]["counts"], hand_counts(seen, step - WINDOW, step - 1))
        with safe_open(os.path.join(directory, "model.safetensors"), "pt") as weights:
            assert set(weights.keys()) == set(model.state_dict())  # the model's tensors only
    assert not [name for name in os.listdir(os.path.join(out, "checkpoint-4")) if name.endswith(".tmp")]


def test_killed_and_resumed_run_is_bit_equal_to_the_uninterrupted_one(uninterrupted, tmp_path):
    """"Killed": a run with the same arguments (max_steps 12, so the same schedule) stopped by a
    callback after update 10, past its checkpoint at 8 (mid-epoch), its process state dropped; then
    a fresh model and Trainer resume from checkpoint-8 with trainer.train(resume_from_checkpoint=...)."""
    _, _, reference, _ = uninterrupted
    killed, _, _ = agg_trainer(tmp_path, callbacks=[StopAfter(10)])
    killed.train()
    assert killed.state.global_step == 10 and not os.path.exists(tmp_path / "checkpoint-12")
    del killed
    resumed, model, seen = agg_trainer(tmp_path, seed=5)  # other initial weights: the checkpoint's are loaded
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-8"))
    assert resumed.state.global_step == UPDATES
    assert [u for u, _ in seen] == [u for u in range(8, UPDATES) for _ in range(MICRO_BATCHES[u])]
    for (name, value), (ref_name, ref_value) in zip(model.named_parameters(), reference.named_parameters()):
        assert name == ref_name and torch.equal(value, ref_value), name
    state, ref_state = window_state(model), window_state(reference)
    assert set(state) == set(ref_state)
    for key in state:
        assert torch.equal(state[key], ref_state[key]), key


@pytest.fixture(scope="module")
def first_checkpoint(uninterrupted):
    return os.path.join(uninterrupted[0], f"checkpoint-{SAVE_EVERY}")


def resume_from_altered(checkpoint, tmp_path, state):
    """A copy of ``checkpoint`` whose method state is ``state``, resumed by a fresh Trainer; returns
    (the one-line refusal, the trainer, what the model saw)."""
    copy = tmp_path / os.path.basename(checkpoint)
    shutil.copytree(checkpoint, copy)
    if isinstance(state, bytes):
        (copy / STATE_FILE).write_bytes(state)
    else:
        torch.save(state, copy / STATE_FILE)
    trainer, model, seen = agg_trainer(tmp_path)
    with pytest.raises(UsageError) as refusal:
        trainer.train(resume_from_checkpoint=str(copy))
    return str(refusal.value), trainer, seen


def counted_state(updates, vocab=VOCAB, method="agg", **options):
    """The state of a real window of ``method`` over ``vocab`` tokens after ``updates`` training forwards."""
    model = apply(tiny_llama(vocab=vocab), method, output_kernel="eager", **options).train()
    rows = token_dataset(samples=2, vocab=vocab)
    batch = {key: torch.tensor([row[key] for row in rows]) for key in rows[0]}
    for update_num in range(updates):
        model.fairseq_agg.update_num = update_num
        model(**batch)
    return model.fairseq_agg.state_dict()


def shifted_update_index(state, shift):
    """``state`` with its update index moved by ``shift`` (a multiple of the window: the ring's rows
    stay where that index puts them), the tag and the window's own index alike."""
    state = {**state, "updates": state["updates"] + shift, "counts": {"agg": dict(state["counts"]["agg"])}}
    meta = state["counts"]["agg"]["meta"].clone()
    meta[1] += shift
    state["counts"]["agg"]["meta"] = meta
    return state


@pytest.mark.parametrize("alteration, says", [
    ("vocabulary", f"vocabulary of {VOCAB + 8} tokens, the model has {VOCAB}"),
    ("method", "the state is of method 'face', this model runs 'agg'"),
    ("update index", f"the counts are of update {SAVE_EVERY + WINDOW}, but the checkpoint was saved after "
                     f"{SAVE_EVERY} updates"),
    ("window index", f"the agg counts of the state fail a check: meta says update {SAVE_EVERY + WINDOW}, but the "
                     f"checkpoint was saved after {SAVE_EVERY} updates"),
    ("damaged", "is truncated or damaged"),
])
def test_a_checkpoint_whose_counts_do_not_fit_is_refused_in_one_line_before_any_update(
        first_checkpoint, tmp_path, alteration, says):
    """Another vocabulary: the real window of a model with 8 more tokens; another method: FACE's real
    window of as many updates; the update index: the saved window moved by one window length, tag
    and window alike (only the checkpoint's step tells); the window's own index alone (the tag
    still the step); damaged: the first half of the file."""
    path = os.path.join(first_checkpoint, STATE_FILE)
    saved, data = torch.load(path, weights_only=True), open(path, "rb").read()
    options = {key: value for key, value in AGG_OPTIONS.items() if key != "output_kernel"}
    state = {"vocabulary": lambda: counted_state(SAVE_EVERY, VOCAB + 8, agg_window=WINDOW, **options),
             "method": lambda: counted_state(SAVE_EVERY, method="face", face_counting="window", face_window=WINDOW),
             "update index": lambda: shifted_update_index(saved, WINDOW),
             "window index": lambda: {**shifted_update_index(saved, WINDOW), "updates": SAVE_EVERY},
             "damaged": lambda: data[:len(data) // 2]}[alteration]()
    message, trainer, seen = resume_from_altered(first_checkpoint, tmp_path, state)
    assert says in message and STATE_FILE in message and "\n" not in message
    assert seen == [] and trainer.state.global_step == SAVE_EVERY  # refused at train begin


def test_a_checkpoint_without_the_method_state_is_refused_unless_the_counts_restart(first_checkpoint, tmp_path):
    copy = tmp_path / os.path.basename(first_checkpoint)
    shutil.copytree(first_checkpoint, copy)
    os.remove(copy / STATE_FILE)
    trainer, model, seen = agg_trainer(tmp_path, max_steps=SAVE_EVERY + 1)
    with pytest.raises(UsageError, match=f"has no {STATE_FILE}.*restart_counts=True"):
        trainer.train(resume_from_checkpoint=str(copy))
    add_method_state_callback(trainer, restart_counts=True)
    trainer.train(resume_from_checkpoint=str(copy))
    state = window_state(model)
    assert state["meta"].tolist() == [WINDOW, SAVE_EVERY + 1, 1]  # one update counted, from empty
    assert torch.equal(state["counts"], hand_counts(seen, SAVE_EVERY, SAVE_EVERY))


def test_resuming_without_knowing_the_checkpoint_is_refused(first_checkpoint, tmp_path):
    """The callback given through Trainer(callbacks=...) is not told the checkpoint: a resumed run is
    refused at train begin instead of counting from an empty window."""
    model = apply(tiny_llama(), "agg", **AGG_OPTIONS)
    trainer = Trainer(model=model, args=training_args(tmp_path), train_dataset=token_dataset(),
                      callbacks=[MethodStateCallback()])
    with pytest.raises(UsageError, match="add_method_state_callback"):
        trainer.train(resume_from_checkpoint=first_checkpoint)


def test_a_model_without_a_method_is_refused_at_train_begin(tmp_path):
    trainer = Trainer(model=tiny_llama(), args=training_args(tmp_path), train_dataset=token_dataset())
    add_method_state_callback(trainer)
    with pytest.raises(UsageError, match=r"call fairseq_agg\.hf\.apply"):
        trainer.train()


class Rows(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(token_dataset())


def test_a_window_of_one_epoch_without_epochs_is_refused_at_train_begin(tmp_path):
    """An iterable dataset has no length, so no epoch: agg_window=0 is refused, a number trains."""
    trainer, model, seen = agg_trainer(tmp_path, max_steps=2)
    trainer.train_dataset = Rows()
    with pytest.raises(UsageError, match=r"agg_window=0 \(one epoch of updates\) needs a train dataset with a length"):
        trainer.train()
    assert seen == []
    model.fairseq_agg.set_window(3)
    trainer.train()
    assert window_state(model)["meta"].tolist() == [3, 2, 2]


def test_fsdp_is_refused_at_train_begin(tmp_path):
    """The Trainer itself takes FSDP only in a distributed run (on a CPU accelerate then trains with
    DDP instead, silently); the callback refuses the arguments at train begin on any device."""
    from transformers import TrainerControl, TrainerState

    args = training_args(tmp_path, fsdp="full_shard", fsdp_config={"sync_module_states": False})
    model = apply(tiny_llama(), "agg", **AGG_OPTIONS)
    with pytest.raises(UsageError, match="TrainingArguments.fsdp: .* does not support FSDP"):
        MethodStateCallback().on_train_begin(args, TrainerState(), TrainerControl(), model=model)
