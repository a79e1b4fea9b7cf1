"""The benchmarks' shared parts (benchmarks/, outside the installed wheel): the one variant registry
and its keys, the one target table, and the one timing harness, on inputs written by hand."""
import pytest

from benchmarks import targets, variants
from benchmarks.ops import NotApplicable
from benchmarks.timing import Harness


@pytest.mark.parametrize("text, expected", [
    ("agg", variants.Key("agg")),
    ("agg+ls:eager@1024", variants.Key("agg", True, "eager", 1024)),
    ("fused_ce:torch", variants.Key("fused_ce", False, "torch")),
    ("torch_chunk@256", variants.Key("torch_chunk", chunk=256)),
    ("al_floor@64", variants.Key("al_floor", chunk=64)),
])
def test_a_key_reads_back_as_written(text, expected):
    assert variants.parse_key(text) == expected
    assert str(expected) == text


def test_the_default_kernel_and_the_runs_chunk_are_left_out_of_a_key():
    assert str(variants.key("agg", True, "auto", 2048, run_chunk=2048)) == "agg+ls"
    assert str(variants.key("agg", True, "compiled", 512, run_chunk=2048)) == "agg+ls:compiled@512"


@pytest.mark.parametrize("text, why", [
    ("fce", "unknown variant"),
    ("freeze+ls", "takes no label smoothing"),
    ("floor+ls", "takes no label smoothing"),
    ("stock:eager", "not the package's"),
    ("agg:fast", "unknown kernel"),
    ("stock@64", "not chunked"),
    ("agg+ls+ls", "is not name"),
])
def test_a_key_the_registry_cannot_measure_is_refused(text, why):
    with pytest.raises(ValueError, match=why):
        variants.parse_key(text)


def test_every_variant_runs_on_the_problem_it_is_given():
    """Each step of the registry, on a tiny problem, leaves both gradients behind; the package's
    fused CE, the stock criterion and torch's op give one loss, smoothed or not. (The package's
    variants on the eager chunk body: nothing to compile.)"""
    from output_layer_steps import StepProblem

    p = StepProblem(40, 8, 97, eps=0.1, aug_coef=1.0, ul_seq_len=10)
    losses = {}
    for name, variant in variants.VARIANTS.items():
        if variant.unavailable() is not None:
            continue
        for smoothed in (False, True) if variant.smoothing == variants.TAKES else (False,):
            k = variants.key(name, smoothed, "eager" if variant.family == variants.PACKAGE else None)
            p.clear_grads()
            losses[str(k)] = float(variants.run(p, k, p.eps, 16))
            assert p.hidden.grad is not None and p.weight.grad is not None, k
    for smoothed in ("", "+ls"):
        assert losses[f"fused_ce{smoothed}:eager"] == pytest.approx(losses["stock" + smoothed], rel=1e-5)
        assert losses["torch_ref" + smoothed] == pytest.approx(losses["stock" + smoothed], rel=1e-5)
    assert losses["agg+ls:eager"] == pytest.approx(losses["agg_ref+ls"], rel=1e-5)
    assert losses["al:eager"] > losses["fused_ce:eager"] and losses["floor"] == losses["al_floor"] == 0.0


def test_each_target_is_one_row_per_command():
    seen = set()
    for t in targets.TARGETS:
        for command in t.judged_by:
            assert (t.ratio, command) not in seen, t
            seen.add((t.ratio, command))
            assert targets.target(t.ratio, command) is t
    # the CPU's and the GPU's limits of one ratio differ; AGG against stock is one row for both
    assert targets.target("fused_ce_time_vs_floor", targets.CRITERION).limit == 1.05
    assert targets.target("fused_ce_time_vs_floor", targets.GPU_CHECK).limit == 1.5
    assert targets.target("agg_time_vs_stock", targets.CRITERION) is targets.target("agg_time_vs_stock",
                                                                                    targets.GPU_CHECK)
    with pytest.raises(KeyError):
        targets.target("al_time_vs_liger", targets.CRITERION)


def test_a_target_passes_on_its_side_of_the_limit():
    upper = targets.target("auto_fused_ce_time_vs_floor", targets.CRITERION)
    assert (upper.passed(1.07), upper.passed(1.071), upper.passed(None)) == (True, False, None)
    lower = targets.target("method_speed_vs_stock", targets.TRAINING)
    assert (lower.passed(0.97), lower.passed(0.96), lower.text()) == (True, False, ">= 0.97")
    only_lm = targets.target("agg_time_vs_floor", targets.GPU_CHECK)
    assert only_lm.applies_to("LM bf16") and not only_lm.applies_to("MT fp32")


def test_the_harness_rotates_the_order_and_records_what_cannot_run():
    order = []

    def step(name):
        return lambda: order.append(name) or len(order)

    def refuses():
        raise NotApplicable("takes no label smoothing")

    def breaks():
        raise RuntimeError("out of memory")

    calls = {"a": step("a"), "b": step("b"), "c": step("c"), "skip": refuses, "error": breaks}
    cleared = []
    samples = Harness("cpu", before=cleared.append, record_errors=True).measure(calls, warmup=1, repeats=3)
    # first calls, one warm-up round, then three rounds, each starting one later
    assert order == list("abc") + list("abc") + list("abc") + list("bca") + list("cab")
    assert samples.failed == {"skip": {"skipped": "takes no label smoothing"}, "error": {"error": "RuntimeError: out of memory"}}
    assert samples.timed() == ["a", "b", "c"] and all(len(samples.wall[k]) == 3 for k in "abc")
    assert samples.result["a"] == 14  # the last round's result (its 14th call)
    assert cleared.count("a") == 5 and cleared.count("skip") == 1
    with pytest.raises(RuntimeError):
        Harness("cpu").first_calls({"error": breaks})
