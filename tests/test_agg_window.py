"""AGG's rare-token counting window and gate vectors (Yu et al., ACL 2022, §4; docs/agg.md (A1)-(A4)).

The ring buffer is checked against brute-force counts over the last K updates, kept here as a plain
list of per-update histograms; the gates against values computed by hand.
"""
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fairseq_agg.errors import UsageError
from fairseq_agg.ops.agg import agg_gates
from fairseq_agg.ops.counting import RareTokenWindow, overflow_table, target_histogram


class BruteForce:
    """Per-update histograms in a dict; the window is the sum over updates t-K+1 .. t."""

    def __init__(self, vocab, window):
        self.vocab, self.window = vocab, window
        self.hists = {}
        self.t = 0

    def start_update(self, t):
        self.t = t

    def add(self, hist):
        self.hists[self.t] = self.hists.get(self.t, np.zeros(self.vocab, dtype=np.int64)) + hist

    def counts(self):
        total = np.zeros(self.vocab, dtype=np.int64)
        for t, h in self.hists.items():
            if self.t - self.window < t <= self.t:
                total += h
        return total

    def recorded(self):
        return min(self.t, self.window)


def random_histograms(rng, vocab, tokens):
    target = rng.choice(vocab, size=tokens, p=zipf(vocab))
    return torch.from_numpy(np.bincount(target, minlength=vocab))


def zipf(vocab):
    p = 1.0 / np.arange(1, vocab + 1) ** 1.2
    return p / p.sum()


def check_equal(window, brute):
    np.testing.assert_array_equal(window.counts.numpy(), brute.counts())
    assert window.recorded == brute.recorded()
    # ring invariant: the running sum is the ring plus the open update
    np.testing.assert_array_equal(
        window.counts.numpy(),
        sum(window.row_counts(slot) for slot in range(window.window)).numpy() + window.current.numpy()
    )


def drive(window, brute, schedule, rng, vocab, check=True):
    """schedule: list of (update index t, number of micro-batches)."""
    for t, micro in schedule:
        window.start_update(t)
        brute.start_update(t)
        for _ in range(micro):
            hist = random_histograms(rng, vocab, int(rng.integers(0, 40)))
            window.add(hist)
            brute.add(hist.numpy())
            if check:
                check_equal(window, brute)


@pytest.mark.parametrize("window_size", [1, 3, 7])
def test_window_equals_brute_force_across_wraparound(window_size):
    vocab = 23
    rng = np.random.default_rng(window_size)
    window, brute = RareTokenWindow(vocab, window_size), BruteForce(vocab, window_size)
    schedule = [(t, int(rng.integers(1, 4))) for t in range(1, 4 * window_size + 6)]  # several micro-batches
    drive(window, brute, schedule, rng, vocab)
    assert window.recorded == window_size


def test_step_smaller_than_window():
    vocab, k = 17, 10
    rng = np.random.default_rng(0)
    window, brute = RareTokenWindow(vocab, k), BruteForce(vocab, k)
    drive(window, brute, [(1, 2), (2, 1), (3, 3)], rng, vocab)
    assert window.recorded == 3  # the denominator is the number of updates so far, not K


def test_repeated_update_index_counts_into_the_same_update():
    """A repeated t (every micro-batch of an update, or an fp16-overflow retry) reuses the same update."""
    vocab, k = 19, 3
    rng = np.random.default_rng(1)
    window, brute = RareTokenWindow(vocab, k), BruteForce(vocab, k)
    schedule = [(1, 1), (2, 2), (2, 1), (3, 1), (3, 2), (4, 1), (5, 1), (5, 1), (6, 2), (7, 1)]
    drive(window, brute, schedule, rng, vocab)
    assert window.update_index == 7 and window.recorded == 3


def test_skipped_update_indices_count_as_empty_updates():
    vocab, k = 11, 4
    rng = np.random.default_rng(2)
    window, brute = RareTokenWindow(vocab, k), BruteForce(vocab, k)
    drive(window, brute, [(1, 2), (2, 1), (5, 1), (6, 1), (12, 2), (13, 1)], rng, vocab)


def test_empty_histograms_of_dummy_batches_add_nothing():
    vocab, k = 9, 2
    window = RareTokenWindow(vocab, k)
    window.start_update(1)
    window.add(target_histogram(torch.tensor([4, 4, 5]), vocab))
    before = window.counts.clone()
    window.add(target_histogram(torch.tensor([], dtype=torch.long), vocab))
    assert torch.equal(window.counts, before)
    assert window.counts.tolist() == [0, 0, 0, 0, 2, 1, 0, 0, 0]


def test_target_histogram_is_bincount():
    target = torch.tensor([3, 0, 3, 7, 7, 7, 1])
    hist = target_histogram(target, 10)
    assert hist.tolist() == [1, 1, 0, 2, 0, 0, 0, 3, 0, 0]


def test_state_dict_round_trip_continues_identically(tmp_path):
    vocab, k = 21, 4
    rng = np.random.default_rng(3)
    window, brute = RareTokenWindow(vocab, k), BruteForce(vocab, k)
    drive(window, brute, [(t, 2) for t in range(1, 7)], rng, vocab)
    window.add(random_histograms(rng, vocab, 10))  # a partially counted open update

    path = tmp_path / "window.pt"
    torch.save(window.state_dict(), path)
    restored = RareTokenWindow(vocab)  # window size unknown until the state is loaded
    restored.load_state_dict(torch.load(path))
    assert restored.window == k and restored.update_index == window.update_index
    assert restored.recorded == window.recorded
    assert torch.equal(restored.ring, window.ring)
    assert torch.equal(restored.counts, window.counts) and torch.equal(restored.current, window.current)

    # both continue with the same input and stay identical (and equal to brute force)
    seeds = np.random.default_rng(4).integers(0, 2**31, size=12)
    for i, t in enumerate([6, 7, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]):
        hist = random_histograms(np.random.default_rng(seeds[i]), vocab, 25)
        for w in (window, restored):
            w.start_update(t)
            w.add(hist)
        assert torch.equal(restored.counts, window.counts)
        assert torch.equal(restored.ring, window.ring)
        assert restored.recorded == window.recorded


def test_state_dict_rejects_another_vocabulary():
    window = RareTokenWindow(10, 3)
    window.start_update(1)
    window.add(torch.ones(10, dtype=torch.long))
    other = RareTokenWindow(12)
    with pytest.raises(UsageError, match="ring counts a vocabulary of 10 tokens, the dictionary has 12"):
        other.load_state_dict(window.state_dict())


def test_bad_window_size_is_refused():
    with pytest.raises(ValueError, match=">= 1"):
        RareTokenWindow(10, 0)
    with pytest.raises(ValueError):
        RareTokenWindow(10, 3).set_window(4)


# ---------------------------------------------------------------------------------------------
# Gates (docs/agg.md (A2)-(A4))


def test_gates_hand_computed():
    # c = [9, 0, 50, 40, 1, 3, 0, 2, 0], 10 updates, alpha 0.5, 2 specials
    # a = [.9, 0, 5, 4, .1, .3, 0, .2, 0]  -> R = {4, 5, 6, 7, 8} (ids 0 and 1 are special)
    # mean_R c = (1 + 3 + 0 + 2 + 0) / 5 = 1.2
    counts = torch.tensor([9, 0, 50, 40, 1, 3, 0, 2, 0])
    gates = agg_gates(counts, 10, 0.5, 2)
    assert gates.rare.tolist() == [False, False, False, False, True, True, True, True, True]
    np.testing.assert_allclose(gates.g1.numpy(), [1, 1, 1, 1, 0.1, 0.3, 0, 0.2, 0], rtol=1e-6)
    np.testing.assert_allclose(gates.g2.numpy(), [1, 1, 1, 1, 1 / 1.2, 1, 0, 1, 0], rtol=1e-6)

    normalized = agg_gates(counts, 10, 0.5, 2, g1_mode="normalized")
    np.testing.assert_allclose(normalized.g1.numpy(), [1, 1, 1, 1, 0.2, 0.6, 0, 0.4, 0], rtol=1e-6)
    np.testing.assert_allclose(normalized.g2.numpy(), gates.g2.numpy())
    assert torch.equal(normalized.rare, gates.rare)


def test_specials_never_rare():
    counts = torch.zeros(12, dtype=torch.int64)  # nothing seen at all
    gates = agg_gates(counts, 5, 0.03, 4)
    assert not gates.rare[:4].any() and gates.rare[4:].all()
    assert torch.equal(gates.g1[:4], torch.ones(4)) and torch.equal(gates.g2[:4], torch.ones(4))
    assert torch.equal(gates.g1[4:], torch.zeros(8))  # zero-count tokens are rare with gate 0


def test_g1_and_g2_formulas_on_random_counts():
    rng = np.random.default_rng(5)
    counts = torch.from_numpy(rng.integers(0, 30, size=200))
    updates, alpha, nspecial = 50, 0.3, 4
    gates = agg_gates(counts, updates, alpha, nspecial)
    c = counts.numpy().astype(np.float64)
    a = c / updates
    rare = a < alpha
    rare[:nspecial] = False
    assert gates.rare.numpy().tolist() == rare.tolist()
    assert 0 < rare.sum() < 196
    np.testing.assert_allclose(gates.g1.numpy(), np.where(rare, a, 1.0), rtol=1e-6)
    np.testing.assert_allclose(gates.g2.numpy(), np.where(rare, np.minimum(c / c[rare].mean(), 1.0), 1.0), rtol=1e-6)
    assert (gates.g2[gates.rare] < 1).any() and (gates.g2[gates.rare] == 1).any()
    norm = agg_gates(counts, updates, alpha, nspecial, g1_mode="normalized")
    np.testing.assert_allclose(norm.g1.numpy(), np.where(rare, a / alpha, 1.0), rtol=1e-6)
    assert (norm.g1 <= 1).all()


def test_empty_rare_group_gives_all_ones():
    counts = torch.full((10,), 100, dtype=torch.int64)
    gates = agg_gates(counts, 10, 0.5, 4)
    assert not gates.rare.any()
    assert torch.equal(gates.g1, torch.ones(10)) and torch.equal(gates.g2, torch.ones(10))
    assert torch.isfinite(gates.g2).all()


def test_relative_mode_equals_per_update_when_every_update_has_ref_tokens():
    vocab, k, ref_tokens = 300, 5, 400
    rng = np.random.default_rng(6)
    window = RareTokenWindow(vocab, k)
    for t in range(1, 12):  # past wrap-around; every update has exactly ref_tokens targets
        window.start_update(t)
        for part in (150, 250):
            window.add(random_histograms(rng, vocab, part))
        per_update = agg_gates(window.counts, window.recorded, 0.5, 4)
        relative = agg_gates(window.counts, window.recorded, 0.5, 4, threshold_mode="relative", ref_tokens=ref_tokens)
        assert torch.equal(per_update.rare, relative.rare)
        assert per_update.rare.any()
        torch.testing.assert_close(per_update.g1, relative.g1)
        torch.testing.assert_close(per_update.g2, relative.g2)


def test_relative_mode_is_batch_size_invariant():
    rng = np.random.default_rng(7)
    counts = torch.from_numpy(rng.integers(0, 20, size=100))
    rel1 = agg_gates(counts, 10, 0.5, 4, threshold_mode="relative", ref_tokens=int(counts.sum()) // 10)
    rel2 = agg_gates(3 * counts, 10, 0.5, 4, threshold_mode="relative", ref_tokens=int(counts.sum()) // 10)
    assert torch.equal(rel1.rare, rel2.rare)
    per_update_big = agg_gates(3 * counts, 10, 0.5, 4)
    assert not torch.equal(rel1.rare, per_update_big.rare)  # per-update mode does depend on B


def test_bad_modes_are_refused():
    with pytest.raises(ValueError, match="g1 mode"):
        agg_gates(torch.ones(8), 1, 0.1, 4, g1_mode="paper")
    with pytest.raises(ValueError, match="threshold mode"):
        agg_gates(torch.ones(8), 1, 0.1, 4, threshold_mode="absolute")


# ---------------------------------------------------------------------------------------------
# Distributed: two gloo processes


VOCAB_DDP, WINDOW_DDP = 37, 3
UPDATES_DDP = [(1, 2), (2, 1), (3, 2), (3, 1), (4, 2), (5, 1), (6, 2)]  # (t, micro-batches)


def _rank_targets(rank):
    """The targets rank `rank` sees in each micro-batch, in order (deterministic per rank)."""
    rng = np.random.default_rng(1000 + rank)
    out = []
    for _, micro in UPDATES_DDP:
        for _ in range(micro):
            n = int(rng.integers(0, 30)) if rank == 0 else int(rng.integers(5, 60))
            out.append(torch.from_numpy(rng.choice(VOCAB_DDP, size=n, p=zipf(VOCAB_DDP))))
    return out


def _ddp_worker(rank, world_size, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        targets = iter(_rank_targets(rank))
        summed, local = RareTokenWindow(VOCAB_DDP, WINDOW_DDP), RareTokenWindow(VOCAB_DDP, WINDOW_DDP)
        gates = []
        for t, micro in UPDATES_DDP:
            summed.start_update(t)
            local.start_update(t)
            for _ in range(micro):
                target = next(targets)
                summed.add(target_histogram(target, VOCAB_DDP, all_reduce=True))
                local.add(target_histogram(target, VOCAB_DDP, all_reduce=False))
                g = agg_gates(summed.counts, summed.recorded, 1.0, 4)
                gates.append(torch.stack([g.g1, g.g2, g.rare.float()]))
        torch.save(
            {"summed": summed.state_dict(), "local": local.state_dict(), "gates": torch.stack(gates)},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_two_process_all_reduce_gives_identical_windows_and_gates(tmp_path):
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    # brute force over both ranks' targets
    per_rank = [_rank_targets(r) for r in range(2)]
    brute_sum, brute_local = BruteForce(VOCAB_DDP, WINDOW_DDP), [BruteForce(VOCAB_DDP, WINDOW_DDP) for _ in range(2)]
    i = 0
    for t, micro in UPDATES_DDP:
        for b in [brute_sum] + brute_local:
            b.start_update(t)
        for _ in range(micro):
            hists = [np.bincount(per_rank[r][i].numpy(), minlength=VOCAB_DDP) for r in range(2)]
            brute_sum.add(hists[0] + hists[1])
            for r in range(2):
                brute_local[r].add(hists[r])
            i += 1

    for r in range(2):
        np.testing.assert_array_equal(results[r]["summed"]["counts"].numpy(), brute_sum.counts())
        np.testing.assert_array_equal(results[r]["local"]["counts"].numpy(), brute_local[r].counts())
    for key in ("ring", "counts", "current", "meta"):
        assert torch.equal(results[0]["summed"][key], results[1]["summed"][key]), key
    assert torch.equal(results[0]["gates"], results[1]["gates"])  # every micro-batch, both ranks
    # the local (per-rank) counts differ, as in the released code's multi-GPU behaviour
    assert not torch.equal(results[0]["local"]["counts"], results[1]["local"]["counts"])


# --- the ring in the narrowest integer type (issue #34, "A lighter window")


def test_counts_of_255_and_more_go_to_the_overflow_table_and_stay_exact():
    """Updates whose largest counts are 254, 255, 300 and 40,000: the uint8 ring reads 255 for the
    last three, the overflow table holds them exactly, the window equals brute force through the
    wraparound, and a saved state round-trips."""
    vocab, k = 7, 3
    window, brute = RareTokenWindow(vocab, k), BruteForce(vocab, k)
    for t, peak in enumerate([254, 255, 300, 5, 40_000, 1, 1, 256], start=1):
        hist = torch.zeros(vocab, dtype=torch.int64)
        hist[t % vocab], hist[(t + 1) % vocab] = peak, 1
        for counter in (window, brute):
            counter.start_update(t)
        window.add(hist)
        brute.add(hist.numpy())
        check_equal(window, brute)
        if t > 1:  # the previous update's row was written when this one opened
            previous = (t - 1) % k
            assert window.row_counts(previous).max() == [254, 255, 300, 5, 40_000, 1, 1][t - 2]
            assert (previous in window.overflow) == ([254, 255, 300, 5, 40_000, 1, 1][t - 2] >= 255)
    assert window.ring.dtype == torch.uint8
    restored = RareTokenWindow(vocab)
    restored.load_state_dict(window.state_dict())
    assert torch.equal(restored.ring, window.ring) and torch.equal(restored.counts, window.counts)
    assert overflow_table(restored.overflow).tolist() == overflow_table(window.overflow).tolist()


def test_paper_shape_window_takes_at_most_half_of_int32_and_gates_are_bit_equal(tmp_path):
    """32,768 Zipf-distributed targets per update over V = 44,256 (the AGG paper's WikiText-103
    batch and GPT-2 BPE vocabulary): the one-byte ring and its overflow table take >= 2x less
    memory and checkpoint than the int32 ring, and the gates equal those of int64 brute-force
    counts. (K = 24 keeps the test small; the ratio grows with K towards 4.)"""
    vocab, k, updates = 44_256, 24, 30
    rng = np.random.default_rng(11)
    window, brute = RareTokenWindow(vocab, k), BruteForce(vocab, k)
    for t in range(1, updates + 1):
        hist = random_histograms(rng, vocab, 32_768)
        for counter in (window, brute):
            counter.start_update(t)
        window.add(hist)
        brute.add(hist.numpy())
        gates = agg_gates(window.counts, window.recorded, alpha=0.03, nspecial=4)
        expected = agg_gates(torch.from_numpy(brute.counts()), brute.recorded(), alpha=0.03, nspecial=4)
        for got, want in ((gates.g1, expected.g1), (gates.g2, expected.g2), (gates.rare, expected.rare)):
            assert torch.equal(got, want)
    assert window.ring.dtype == torch.uint8 and 0 < len(overflow_table(window.overflow)) < vocab
    int32_ring = k * vocab * 4
    assert window.nbytes * 2 <= int32_ring + 2 * 8 * vocab  # the window before: an int32 ring + two int64 sums

    narrow, wide = tmp_path / "narrow.pt", tmp_path / "wide.pt"
    state = window.state_dict()
    torch.save(state, narrow)
    wide_ring = torch.stack([window.row_counts(slot) for slot in range(k)]).to(torch.int32)
    torch.save({key: value for key, value in dict(state, ring=wide_ring).items() if key != "overflow"}, wide)
    assert os.path.getsize(narrow) * 2 <= os.path.getsize(wide)


def test_an_int32_ring_of_the_previous_format_still_loads_and_continues_exactly():
    vocab, k = 21, 4
    rng = np.random.default_rng(5)
    window, brute = RareTokenWindow(vocab, k), BruteForce(vocab, k)
    drive(window, brute, [(t, 2) for t in range(1, 7)], rng, vocab)
    window.start_update(7)
    window.add(torch.full((vocab,), 300, dtype=torch.int64))  # counts that need the overflow table
    brute.start_update(7)
    brute.add(np.full(vocab, 300))
    window.start_update(8)  # commits update 7: its row goes to the overflow table
    old_format = {key: value for key, value in window.state_dict().items() if key != "overflow"}
    old_format["ring"] = torch.stack([window.row_counts(slot) for slot in range(k)]).to(torch.int32)
    restored = RareTokenWindow(vocab)
    restored.load_state_dict(old_format)
    brute.start_update(8)
    assert restored.ring.dtype == torch.uint8 and torch.equal(restored.counts, window.counts)
    assert torch.equal(restored.row_counts(7 % k), torch.full((vocab,), 300))
    for t in range(8, 16):
        hist = random_histograms(rng, vocab, 30)
        for counter in (restored, brute):
            counter.start_update(t)
        restored.add(hist)
        brute.add(hist.numpy())
        check_equal(restored, brute)
