"""The sizes of one run of the GPU check: the GPU plan, and the CPU smoke plan (the same code paths
at sizes a 2-core CPU runs in about a minute and a half)."""
import dataclasses

TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}  # of the correctness part: relative, against float64


@dataclasses.dataclass
class Plan:
    mode: str
    # 1. correctness: tokens, dim, vocab (odd, not a multiple of the chunk), chunk
    check_shape: tuple
    check_chunk: int
    # 2. output layer: name -> (N, d, V, label smoothing, AGG alpha)
    shapes: dict
    bench_dtypes: tuple
    warmup: int  # after one untimed first call per variant (its compilation, if any)
    repeats: int
    chunk_sweep: tuple
    train_reserve_s: float  # the output layer starts no run with less than this left before training
    # 3. fairseq-train
    train_precisions: tuple
    target_train_precisions: tuple  # where issue #33's words/s targets apply
    train_arch: str
    train_mlra_arch: str
    train_arch_flags: tuple
    train_vocab: int
    tokens_per_sample: int
    max_tokens: int
    updates: int
    log_interval: int
    warmup_updates: int
    # 3b. fairseq-train of the WMT14 recipe's models (part train_mt, not in the default parts)
    mt_archs: dict  # size -> arch, as examples/wmt14_en_de/train.sh names them
    mt_mlra_arch: str
    mt_arch_flags: tuple
    mt_vocab: int
    mt_max_tokens: int
    # 4. statistics
    stats_shape: tuple
    stats_repeats: int
    # 5. the Hugging Face path (part hf): vocabularies; (hidden size, layers, tokens per row, tokens, dtype).
    # Not a default part: the default parts fill gpu_check.sh's 470 s (the install with fairseq's build,
    # about 200 s, then the output layer and the training part, which takes what time is left), and this
    # part pays the compilations of its own chunk bodies (ce and agg at each vocabulary) and a model of
    # 128,256 x 2,048 embeddings: about 1.5-3 min on a GPU (an estimate: it has not run on one yet). So
    # it is a device call of its own, `bash scripts/device/gpu_check.sh -- --parts hf` (about 7 min).
    hf_vocabs: tuple
    hf_shape: tuple


GPU_PLAN = Plan(
    mode="gpu",
    check_shape=(1536, 192, 5003),
    check_chunk=512,
    shapes={"LM": (16384, 768, 50264, 0.0, 0.03), "MT": (8192, 512, 40000, 0.1, 0.08)},
    bench_dtypes=("bf16", "fp32"),
    warmup=1,
    repeats=5,
    chunk_sweep=(1024, 8192),
    train_reserve_s=150.0,
    train_precisions=("fp16", "bf16"),
    target_train_precisions=("fp16",),
    train_arch="transformer_lm_gpt2_small",
    train_mlra_arch="transformer_lm_mlra_gpt2_small",
    train_arch_flags=(),
    train_vocab=50264,
    tokens_per_sample=1024,
    max_tokens=16384,
    updates=60,
    log_interval=10,
    warmup_updates=20,
    mt_archs={"base": "transformer_wmt_en_de", "big": "transformer_wmt_en_de_big"},
    mt_mlra_arch="transformer_mlra_wmt_en_de",
    mt_arch_flags=(),
    mt_vocab=40000,  # the MT shape of part 2: a joined BPE dictionary of WMT14's size
    mt_max_tokens=8192,  # the recipe's tokens per GPU and micro-batch
    stats_shape=(50000, 1024),
    stats_repeats=3,
    hf_vocabs=(32000, 128256),  # Llama 2's and Llama 3's
    hf_shape=(2048, 1, 2048, 8192, "bf16"),
)

# fp32 training only: fairseq's --fp16 needs a GPU, so fp32 stands in for it in the words/s targets
CPU_SMOKE_PLAN = dataclasses.replace(
    GPU_PLAN, mode="cpu-smoke", check_shape=(96, 16, 101), check_chunk=32,
    shapes={"LM": (256, 32, 1000, 0.0, 0.03), "MT": (128, 24, 800, 0.1, 0.08)},
    warmup=1, repeats=2, chunk_sweep=(64, 256), train_reserve_s=0.0, train_precisions=("fp32",),
    target_train_precisions=("fp32",),
    train_arch_flags=("--decoder-layers", "1", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
                      "--decoder-attention-heads", "2"),
    train_vocab=600, tokens_per_sample=32, max_tokens=256, updates=4, log_interval=1, warmup_updates=2,
    mt_arch_flags=("--encoder-layers", "1", "--decoder-layers", "1", "--encoder-embed-dim", "32",
                   "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64", "--decoder-ffn-embed-dim", "64",
                   "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"),
    mt_vocab=600, mt_max_tokens=256,
    stats_shape=(2000, 64), stats_repeats=1,
    hf_vocabs=(500,), hf_shape=(32, 1, 64, 128, "fp32"),
)
