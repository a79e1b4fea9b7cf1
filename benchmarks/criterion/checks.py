"""The output-layer benchmark's equivalence check (the variants compute the same thing) and its
profiles (where the time goes)."""
from benchmarks import variants
from tests.support.output_layer_problem import rel_diff, synchronize

# pairs of variants that compute the same loss, at the same smoothing: (a, b, compared)
EQUIVALENT = (
    ("agg", "agg_ref", "loss, dH, dW"),
    ("agg", "stock", "loss, dH (dW differs: gated)"),
    ("al", "al_ref", "loss, dH, dW"),
    ("fused_ce", "stock", "loss, dH, dW"),
    ("freeze", "fused_ce", "loss, dH (dW differs: rare rows zero)"),
    ("fused_ce", "torch_ref", "loss, dH, dW"),
    ("fused_ce", "torch_auto", "loss, dH, dW"),
    ("fused_ce", "torch_chunk", "loss, dH, dW"),  # where a swept chunk is the run's
)


def _pairs(keys, primary):
    """(a, b, compared) of the measured keys: each package key on another kernel against the same
    variant on ``primary`` (the first of --kernels), then the pairs of :data:`EQUIVALENT`."""
    have = set(keys)
    pairs = []
    for k in keys:
        if k.variant.family != variants.PACKAGE:  # runs on no kernel of the package: nothing to pair
            continue
        same = variants.key(k.name, k.smoothed, primary)
        if k != same and same in have:
            pairs.append((k, same, "loss, dH, dW"))
    for a_name, b_name, compared in EQUIVALENT:
        for smoothed in (False, True):
            try:
                a = variants.key(a_name, smoothed, primary if variants.VARIANTS[a_name].family == variants.PACKAGE
                                 else None)
                b = variants.key(b_name, smoothed)
            except ValueError:  # one of them takes no smoothing
                continue
            if a in have and b in have:
                pairs.append((a, b, compared))
    return pairs


def sanity_check(p, keys, log, primary):
    """Compares the losses and gradients of the pairs that compute the same thing (at the run's
    chunk), one line each: max-abs relative differences."""
    keys = [k for k in keys if k.chunk is None]
    out = {}
    for k in keys:
        loss = p.run(k)
        out[k] = (float(loss), p.hidden.grad.detach().float().clone(), p.weight.grad.detach().float().clone())
    p.clear_grads()
    lines = []
    for a, b, compared in _pairs(keys, primary):
        (la, ha, wa), (lb, hb, wb) = out[a], out[b]
        line = f"{a} vs {b}: loss rel {abs(la - lb) / abs(lb):.1e}, dH rel {rel_diff(ha, hb):.1e}"
        if compared.endswith("dW"):
            line += f", dW rel {rel_diff(wa, wb):.1e}"
        lines.append(line)
        log("  " + line)
    return lines


def profile_variant(p, k, rows):
    """torch.profiler's table of one step of ``k``, after a warm step."""
    from torch.profiler import ProfilerActivity, profile

    p.run(k)  # warm
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if p.device.type == "cuda" else [])
    with profile(activities=acts, record_shapes=True) as prof:
        p.run(k)
        synchronize(p.device)
    p.clear_grads()
    sort = "self_cuda_time_total" if p.device.type == "cuda" else "self_cpu_time_total"
    print(f"\n=== torch.profiler: {k} (sorted by {sort}) ===")
    print(prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=rows, max_name_column_width=40))
