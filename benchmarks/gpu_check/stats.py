"""Part 4 of the GPU check: one live statistics step (TEV + mean cosine) and one isotropy step at
V = 50,000, d = 1,024 on a tied decoder, and their share of a training update at the recommended
intervals (against part 3's AGG run)."""
import torch

from benchmarks.gpu_check.plan import Plan
from benchmarks.timing import seconds_of
from tests.support.output_layer_problem import PAD


class _TiedDecoder(torch.nn.Module):
    def __init__(self, vocab, dim, device):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, dim, padding_idx=PAD).to(device)
        torch.nn.init.normal_(self.embed_tokens.weight, std=dim**-0.5)  # fairseq's embedding init
        self.output_projection = torch.nn.Linear(dim, vocab, bias=False).to(device)
        self.output_projection.weight = self.embed_tokens.weight


class _DecoderOnlyModel(torch.nn.Module):
    """What the statistics read from a fairseq LM: ``decoder.embed_tokens`` (tied output)."""

    def __init__(self, vocab, dim, device):
        super().__init__()
        self.decoder = _TiedDecoder(vocab, dim, device)


def part_stats(plan: Plan, device: torch.device):
    from fairseq.data import Dictionary

    from fairseq_agg.stats.config import EmbeddingStatsSettings
    from fairseq_agg.stats.live import compute_embedding_stats

    vocab, dim = plan.stats_shape
    torch.manual_seed(0)
    dictionary = Dictionary()
    for i in range(vocab - len(dictionary)):
        dictionary.add_symbol(f"w{i}", n=vocab - i)
    model = _DecoderOnlyModel(vocab, dim, device)
    interval = 100  # the recommended --embed-stats-interval; isotropy every 10 x that by default
    settings = EmbeddingStatsSettings(embed_stats_interval=interval)
    dictionaries = {"dec": dictionary, "out": dictionary}
    cache = {}
    with torch.no_grad():
        def step(tev, iso):
            return lambda: compute_embedding_stats(model, settings, dictionaries, tev=tev, iso=iso, cache=cache)

        # the first call warms up (and fills the row-set cache); then the median of the repeats
        tev_ms = round(seconds_of(step(tev=True, iso=False), device, plan.stats_repeats) * 1e3, 2)
        iso_ms = round(seconds_of(step(tev=False, iso=True), device, plan.stats_repeats) * 1e3, 2)
        values = compute_embedding_stats(model, settings, dictionaries, tev=True, iso=True, cache=cache)
    result = {"V": vocab, "d": dim, "tev_step_ms": tev_ms, "isotropy_step_ms": iso_ms,
              "embed_stats_interval": interval, "isotropy_interval": settings.iso_interval,
              "values": {k: round(float(v), 6) for k, v in values.items()}}
    result["stats_ms_per_update"] = round(tev_ms / interval + iso_ms / settings.iso_interval, 4)
    return result


def add_stats_share(parts):
    """The statistics' share of a training update at the recommended intervals, against the AGG
    run of the first precision (fairseq's GPT-2 small has d = 1024, the statistics' d)."""
    stats, train = parts.get("stats"), parts.get("train")
    if not stats or stats.get("status") != "ok" or not train:
        return
    agg = [r for r in train.get("runs", []) if r.get("name") == "cross_entropy_agg" and "seconds_per_update" in r]
    if agg:
        stats["training_update_ms"] = round(agg[0]["seconds_per_update"] * 1e3, 2)
        stats["training_reference"] = f"{agg[0]['precision']} cross_entropy_agg run"
        stats["share_of_training"] = round(stats["stats_ms_per_update"] / stats["training_update_ms"], 5)
