"""The accelerator check: the fused output layer and real ``fairseq-train`` steps on one GPU.

``scripts/device/gpu_check.sh`` installs the offline bundle on the accelerator machine and then
runs ``python -m scripts.gpu_check``; ``--cpu-smoke`` runs the same code paths at tiny shapes on a
CPU (the tests do, so the check cannot rot while no accelerator is lent). Four parts, each guarded
(a failure is recorded and the next part still runs: :mod:`.record`) and all under one time
budget (``--deadline``), one module each:

1. :mod:`.correctness`: the package's fused output layer against the reference constructions of
   tests/support/reference_constructions.py, evaluated in float64 on the same (rounded) inputs, for
   CE, AGG (eps 0 and 0.1) and AL in fp32 (<= 1e-5 relative) and bf16 (<= 2e-2): loss, NLL, dH, dW;
2. :mod:`.output_layer`: the output layer at the papers' shapes (LM: N = 16,384 target tokens,
   d = 768, V = 50,264; MT: N = 8,192, d = 512, V = 40,000, eps 0.1), bf16 first, then fp32, every
   variant of :mod:`benchmarks.variants` at the shape's smoothing (keys ``name+ls`` at MT): stock
   fairseq CE / label-smoothed CE on materialised logits; the package's fused CE, AGG and AL on
   its default path (``fused_ce``, ``agg``, ``al``: kernel ``auto``, the chunk body compiled by
   torch.compile, Inductor -> Triton; the path that ran is recorded, ``auto_path``), on the eager
   chunk body (``:eager``), and the fused CE and AGG on the foreign kernels through the package
   (``:torch``, ``:liger``, ``:cce``; each recorded as "skipped: reason" under
   ``package_kernels`` where it does not load, and skipped per shape where it cannot compute the
   request: CCE takes no smoothing); as anchors PyTorch's ``F.linear_cross_entropy`` (its
   reference path; its chunked path, automatic and swept chunk sizes, where the smoothing is 0),
   the three-matmul floor and the augmented loss's own floor (those three and the teacher's
   matmul), Liger-Kernel and cut-cross-entropy (each skipped where it does not import). Timing by
   the one harness (:mod:`benchmarks.timing`: CUDA events, every variant called once untimed
   before its warm-up, so a chunk body's compilation never falls into the timing, its time kept
   as ``first_call_ms``), peak memory by ``max_memory_allocated``; ratios (:mod:`.output_ratios`)
   against stock, torch's fastest variant, the floors and Liger, the compiled path's speed-up over
   the eager one, and a chunk-size sweep of the default path;
3. :mod:`.train`: real ``fairseq-train`` runs (fairseq's own ``cli_main`` in a worker process,
   :mod:`benchmarks.train_worker`) of ``transformer_lm_gpt2_small`` on a synthetic Zipfian data-bin
   made on the spot, ``--fp16`` and ``--bf16``: stock ``cross_entropy``, ``cross_entropy_agg`` and
   ``augmented_loss`` (both with ``--output-kernel auto``; the path they ran, from the criteria's
   ``output layer: ...`` log line, is recorded as ``output_layer``) and
   ``transformer_lm_mlra_gpt2_small``; words/s after warm-up and peak memory, ratios against stock
   (a precision that fairseq itself cannot train at on a GPU is recorded as not runnable: its
   ``--bf16`` implies ``--tpu``);
3b. (``--parts train_mt``, not in the default parts: a run of its own; not yet run on a GPU, its six
   runs estimated at 30-60 s each there, like part 3's) real ``fairseq-train`` runs of
   examples/wmt14_en_de/train.sh's models and METHODs on a synthetic translation data-bin with one
   joined dictionary of V = 40,000, ``--max-tokens 8192`` as the recipe's per GPU, the plan's
   precisions: ``baseline`` (stock label-smoothed CE) and ``agg`` on ``transformer_wmt_en_de`` and
   its big version, ``aug`` and ``mlra`` on the base one; words (target tokens) per second and peak
   memory, ratios against the same size's baseline: what the recipe's README needs to price a run;
4. :mod:`.stats`: one live statistics step (TEV + mean cosine) and one isotropy step at
   V = 50,000, d = 1,024, and their share of a training update at the recommended intervals;
5. (``--parts hf``, not in the default parts: a run of its own) :mod:`.hf`: the Hugging Face path,
   one step of a one-layer ``LlamaForCausalLM`` (d = 2,048, 8,192 tokens, bf16) at V = 32,000 and
   128,256 with transformers' own loss against ``fairseq_agg.hf.apply(model, method="ce" / "agg")``
   and Liger's fused linear cross-entropy (:mod:`benchmarks.hf`): the machine's transformers 5.x
   where it imports, else the one of the bundle of scripts/device/prepare.sh; skipped with the
   reason where none imports. Why it is not a default part: :mod:`.plan`.

The targets are rows of the one table (:mod:`benchmarks.targets`), judged by :mod:`.evaluate`.
Writes ``gpu_check.json`` and ``gpu_check.md`` (:mod:`.markdown`) into ``--out`` after every part.

Time: the whole check, install included, has to fit gpu_check.sh's default 470 s (on the H200 of
4 December 2026 the install took 199 s, the output layer 41 s and the training part 120 s). The
output layer times about twice the variants it did then and pays the chunk bodies' compilations
(one per method combination and dtype, in this process and again in each training run), so on a
GPU each variant gets one untimed first call, one warm-up and 5 timed repeats, the chunk sweep
covers two chunk sizes besides the default, the bf16 runs (where issue #33's targets are) come
before the fp32 ones, and the part starts no run with less than ``train_reserve_s`` (150 s) + 20 s
left while the training part is still to come (the runs not made are listed under ``skipped``,
the part is then "partial"). These settings are estimates: they have not yet run on a GPU with
the compiled path.
"""
