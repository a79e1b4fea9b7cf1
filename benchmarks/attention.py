"""MLRA (Chung et al., 2024) attention vs fairseq's MultiheadAttention, measured side by side
(``python -m scripts.bench_attention``).

For each model width d (default 512 and 1024; 64-dim heads) and each MLRA setting it prints:
  * parameters of one attention module and the ratio MLRA / MHA;
  * forward + backward time of causal self-attention over a [seq, batch, d] input;
  * the time of one incremental decoding step (a beam of --decode-batch rows, a cache of
    --decode-prefix positions, --decode-steps steps averaged).
Runs alternate between the two modules (the one timing harness, benchmarks/timing.py: rounds in
rotated order) and the best (minimum) time of each is reported, as timeit does: both see the same
machine load, and the minimum is the estimate least disturbed by other processes (the medians go
to the --json file too). Times are wall-clock on whatever this runs on (CUDA events on a GPU); the
ratio is the number to read (< 1: MLRA faster / smaller).

    python -m scripts.bench_attention                     # the defaults of docs/mlra.md
    python -m scripts.bench_attention --dims 512 --batch 1 --repeats 3
"""
import argparse
import json
import os
import platform

import torch
from fairseq.modules import MultiheadAttention

from benchmarks.timing import Harness
from fairseq_agg.files import atomic_output
from fairseq_agg.modules.mlra import MultiheadLowRankAttention


def future_mask(t, device, dtype):
    return torch.triu(torch.full((t, t), float("-inf"), device=device, dtype=dtype), 1)


def fwd_bwd(module, x, mask):
    """One forward and backward pass of causal self-attention (the step timed)."""
    xi = x.detach().requires_grad_(True)
    out, _ = module(xi, xi, xi, attn_mask=mask, need_weights=False)
    out.float().pow(2).mean().backward()


class Decoding:
    """Incremental decoding of ``steps`` tokens after a cache of ``prefix`` positions: ``fill``
    (untimed) starts a fresh cache, ``run`` (timed) decodes."""

    def __init__(self, module, d, batch, prefix, steps, device, dtype):
        self.module, self.prefix, self.device, self.dtype = module, prefix, device, dtype
        self.ctx = torch.randn(prefix, batch, d, device=device, dtype=dtype)
        self.xs = torch.randn(steps, 1, batch, d, device=device, dtype=dtype)
        self.state = {}

    @torch.no_grad()
    def fill(self):
        self.state = {}
        self.module(self.ctx, self.ctx, self.ctx, incremental_state=self.state, need_weights=False,
                    attn_mask=future_mask(self.prefix, self.device, self.dtype))

    @torch.no_grad()
    def run(self):
        for x in self.xs:
            self.module(x, x, x, incremental_state=self.state, need_weights=False)


def timed_pair(device, calls, before, repeats, warmup):
    """The two steps of ``calls`` in alternating rounds; (min a, min b, median a, median b) seconds."""
    samples = Harness(device, before=before).rounds(calls, warmup, repeats)
    a, b = calls
    return samples.best(a), samples.best(b), samples.median(a), samples.median(b)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m scripts.bench_attention", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", default="512,1024", help="model widths d (comma-separated)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2, help="kept small for a 2-core CPU")
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--decode-prefix", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--json", default=None, help="also write the rows to this file")
    return p.parse_args(argv)


def describe_machine(a, device):
    """The device name and the load average at start (the numbers mean little without them)."""
    hw = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"CPU {platform.processor() or platform.machine()}, {a.threads} threads")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# device: {hw}; torch {torch.__version__}; dtype {a.dtype}; load average {load:.1f} at start")
    print(f"# fwd+bwd: causal self-attention, seq {a.seq} x batch {a.batch} (batch kept small for "
          f"a 2-core CPU); decode: {a.decode_batch} rows, cache {a.decode_prefix}, "
          f"{a.decode_steps} steps; best of {a.repeats} alternating runs")
    return hw, load


def mlra_settings(d, head_dim):
    """(mode, rank, targets) measured at width d: shared at d/16 .. d/2 (the break-even rank),
    O factorised too at d/4, and per head at d_h/2 and d_h/4."""
    settings = [("shared", r, "q,k,v") for r in (d // 16, d // 8, d // 4, d // 2)]
    settings += [("shared", d // 4, "q,k,v,o"), ("per_head", head_dim // 2, "q,k,v"),
                 ("per_head", head_dim // 4, "q,k,v")]
    return settings


def measure(a, mha, mlra, x, mask, device, dtype):
    """One table row: parameters, forward + backward and decoding times of both modules."""
    n_mha = sum(q.numel() for q in mha.parameters())
    n = sum(q.numel() for q in mlra.parameters())
    modules = {"mha": mha, "mlra": mlra}
    fb_mha, fb, fb_mha_med, fb_med = timed_pair(
        device, {name: (lambda m=m: fwd_bwd(m, x, mask)) for name, m in modules.items()},
        lambda name: modules[name].zero_grad(set_to_none=True), a.repeats, a.warmup)
    d = x.size(-1)
    decoding = {name: Decoding(m.eval(), d, a.decode_batch, a.decode_prefix, a.decode_steps, device, dtype)
                for name, m in modules.items()}
    dec = timed_pair(device, {name: dc.run for name, dc in decoding.items()}, lambda name: decoding[name].fill(),
                     a.repeats, a.warmup)
    dec_mha, dec_m, dec_mha_med, dec_med = (t / a.decode_steps for t in dec)
    mha.train(), mlra.train()
    return dict(d=d, heads=mlra.num_heads, mode=mlra.mode, rank=mlra.rank, targets=",".join(mlra.targets),
                params_mha=n_mha, params_mlra=n,
                fwd_bwd_ms_mha=fb_mha * 1e3, fwd_bwd_ms_mlra=fb * 1e3,
                decode_ms_mha=dec_mha * 1e3, decode_ms_mlra=dec_m * 1e3,
                median_fwd_bwd_ms=(fb_mha_med * 1e3, fb_med * 1e3),
                median_decode_ms=(dec_mha_med * 1e3, dec_med * 1e3))


HEADER = (f"{'d':>5} {'H':>3} {'mode':>8} {'rank':>5} {'targets':>8} | {'params':>10} {'ratio':>6} | "
          f"{'MHA fb ms':>9} {'MLRA fb ms':>10} {'ratio':>6} | {'MHA dec ms':>10} {'MLRA dec ms':>11} {'ratio':>6}")


def format_row(r):
    return (f"{r['d']:>5} {r['heads']:>3} {r['mode']:>8} {r['rank']:>5} {r['targets']:>8} | "
            f"{r['params_mlra']:>10,} {r['params_mlra'] / r['params_mha']:>6.3f} | "
            f"{r['fwd_bwd_ms_mha']:>9.1f} {r['fwd_bwd_ms_mlra']:>10.1f} "
            f"{r['fwd_bwd_ms_mlra'] / r['fwd_bwd_ms_mha']:>6.3f} | "
            f"{r['decode_ms_mha']:>10.3f} {r['decode_ms_mlra']:>11.3f} "
            f"{r['decode_ms_mlra'] / r['decode_ms_mha']:>6.3f}")


def main(argv=None):
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    hw, load = describe_machine(a, device)
    print(HEADER)
    print("-" * len(HEADER))
    rows = []
    for d in [int(x) for x in a.dims.split(",")]:
        h = d // a.head_dim
        mha = MultiheadAttention(d, h, self_attention=True).to(device, dtype)
        x = torch.randn(a.seq, a.batch, d, device=device, dtype=dtype)
        mask = future_mask(a.seq, device, dtype)
        for mode, r, targets in mlra_settings(d, a.head_dim):
            m = MultiheadLowRankAttention(d, h, self_attention=True, rank=r, mode=mode, targets=targets)
            rows.append(measure(a, mha, m.to(device, dtype), x, mask, device, dtype))
            print(format_row(rows[-1]), flush=True)
        print(f"# d={d}: MultiheadAttention has {sum(q.numel() for q in mha.parameters()):,} parameters")
    if a.json:
        with atomic_output(a.json, "w", flag="--json") as f:
            json.dump({"device": hw, "load_average": load, "torch": torch.__version__, "args": vars(a), "rows": rows}, f, indent=1)


