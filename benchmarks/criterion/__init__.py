"""Benchmark of the output layer + loss: fairseq's stock criteria, PyTorch's own fused op and the
matmul floors against this package's fused function (``python -m scripts.bench_criterion``).

Times forward + backward through the output projection and the loss (median of interleaved rounds
after one untimed first call per variant and the warm-up rounds: benchmarks/timing.py) and
measures the step's peak memory, for the variants of the one registry (benchmarks/variants.py),
each named by its key ``name[+ls][:kernel][@chunk]``: ``+ls`` at ``--label-smoothing`` (else at
eps 0), ``:kernel`` on another kernel than the default ``auto``, ``@chunk`` at another chunk than
``--chunk-size``. The default selection (``--variants``):

  stock+ls      fairseq's label_smoothed_cross_entropy on full logits:
                ``log_softmax(H @ W.T, float32)`` + fairseq's ``label_smoothed_nll_loss``
  agg+ls        AGG through ``fused_linear_loss`` with realistic gates (Zipfian targets and window
                counts; histogram + ``agg_gates`` inside the timed region)
  agg_ref+ls    the reference three-CE AGG construction (``reference_output_loss``)
  al            the augmented loss through ``fused_linear_loss`` (alpha 0.5, tau 10, scale tau; the
                per-type teacher built by ``build_teacher`` inside the timed region)
  stock         fairseq's stock cross_entropy on full logits: the baseline of al
  al_ref        the augmented loss on a materialised N x V teacher (``reference_teacher`` + KL)
  fused_ce      plain CE through ``fused_linear_loss``: what al costs over the fused CE alone
  freeze        rare-token freezing: the fused CE with AGG's rare rows of dW zeroed
  cosreg        the fused CE + N * CosReg(W) (gamma 1, over the non-pad rows)
  face          FACE pre-weighting: weights from the window counts, the argmax recorded in the pass
                and counted (bincount) inside the timed region
  ul            token-level unlikelihood (alpha 1): the N tokens as sequences of ``--ul-seq-len``,
                candidates built inside the timed region
  fused_ce+ls   the fused CE at the label smoothing
  torch_ref     PyTorch's ``F.linear_cross_entropy`` (reduction sum), its reference path (the
                logits materialised); torch_ref+ls at the label smoothing in PyTorch's convention,
                eps' = eps V / (V - 1) (the same target distribution), torch's best at eps > 0
  torch_auto    the same, chunked, the chunk size torch picks (it takes no smoothing)
  torch_chunk   the same, chunked, each ``batch_chunk_size`` of ``--torch-chunk-sizes``
  floor         the three matmuls of any linear cross-entropy alone (logits, dH, dW), chunked like
                the fused function
  al_floor      the augmented loss's floor: those three and the teacher's (target types x V)
  agg+ls:torch  AGG through ``LossRequest(kernel="torch")``: torch's op on the two row sets
                (target rare or not) and AGG's gated dW by the package's algebra
  fused_ce:torch  the fused CE through ``kernel="torch"``: what the package's wrapper costs over
                torch_auto

Kernels (``--kernels``, default ``auto,eager``): each package variant without a kernel of its own is
measured once per kernel of the chunk body: ``auto`` (the default: the body compiled by
torch.compile, Inductor -> C++/OpenMP, where a C++ compiler is found, else eager; the report says
which), ``eager`` (the body uncompiled: the path before issue #33) and ``compiled`` (left out,
said in the report, where torch.compile cannot generate code on the device). The first kernel is
the reference of the other comparisons. Compiled graphs are cached per process and method
combination, so the first call of each variant compiles: every variant is called once, untimed,
before the equivalence check and the warm-up rounds (its time is the report's "1st ms" column and
``first_call_s`` in the JSON).

The report (benchmarks/criterion/ratios.py) judges the targets of the one table
(benchmarks/targets.py): first issue #46's CPU ratios on the path ``auto`` picks (fused CE and AGG
against the three-matmul floor, the fused CE against torch's chunked path), then issue #33's per
kernel (the fused CE and AGG against the floor, the augmented loss against the fused CE and against
its own floor, at the fused CE's limit), each kernel against the first, the project's goals (AGG
against stock in time and memory, the augmented loss against stock CE) and issue #25's (each remedy
against the fused CE, no extra N x V tensor, no peak above torch's chunked path), and the anchors.
Ratios mean something only on an otherwise idle machine.

Peak memory: on CUDA the allocator's peak above the step's start; on a CPU (benchmarks/memory.py)
torch.profiler's allocation trace (``--memory profiler``, the default there) or the peak RSS of a
fresh process per variant (``--memory rss``). Both count the gradients the step leaves behind.

Examples (from the repository root):
  OMP_NUM_THREADS=2 python -m scripts.bench_criterion                 # N=4096, d=512, V=32768, fp32 CPU
  python -m scripts.bench_criterion --quick                           # small shapes, a smoke test
  python -m scripts.bench_criterion --chunk-sizes 512,1024,2048,4096  # chunk-size sweep of the fused variants
  python -m scripts.bench_criterion --variants fused_ce,agg+ls,al,floor,al_floor,torch_auto
  python -m scripts.bench_criterion --device cuda --dtype bf16        # with a GPU
  python -m scripts.bench_criterion --kernels compiled                # the compiled chunk body only
  python -m scripts.bench_criterion --profile agg+ls,agg+ls:eager     # where the time goes
"""
