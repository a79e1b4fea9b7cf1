"""The plugin against fairseq's own models and tasks: a compatibility matrix generated from fairseq's
registries (issue #56), run by ``python -m scripts.fairseq_matrix``, which writes
docs/compatibility.md, and by tests/test_fairseq_matrix.py through that command.

**Rows**: one per registered model class (``fairseq.models.MODEL_REGISTRY``), run at its base
architecture (the arch of the model's own name, else its first in ``ARCH_MODEL_INV_REGISTRY``),
kept when its model produces a token distribution through a decoder output layer. The filter
(:func:`left_out`) decides by the class and its home, never by a list of kept names, so the model
a new fairseq adds is a row by itself: left out are models without a decoder (neither an
encoder-decoder, a language model nor a multi-model: encoders, wav2vec, vocoders), the
non-autoregressive ones (their decoder is trained by ``nat_loss``, not a next-token
cross-entropy), those whose input is audio or speech units (no text task here builds them), and
the few named in :data:`NEEDS_MORE` that need something fairseq does not ship with it.
Architectures that only change sizes are one row: their model's; ``lightconv`` also runs with
dynamic convolutions (its ``--*-conv-type dynamic``), as ``dynamicconv``.

**Columns**: :data:`TASKS`. A cell is a pairing when stock fairseq trains that model under that task
with stock ``cross_entropy`` (one update, checked first, per cell); otherwise the cell says "not a
fairseq pairing" with stock fairseq's own last error line.

**Each cell** of a pairing runs every criterion registered from ``fairseq_agg``, and stock
``cross_entropy`` with ``--optimizer coupled_adam``, for one update with tiny sizes
(:func:`tiny_model_flags`, read from the model's own flags), on the CPU: either it trains, and its
first update's loss and gradient norm (as fairseq logs them, 3 decimals) equal stock
``cross_entropy``'s at the method's neutral flags (:data:`NEUTRAL`), or it is refused at start-up:
exit status 2, one line, nothing in its save directory. Anything else (a traceback) is reported as
such. Each run is the real ``fairseq-train`` entry point, ``fairseq_cli.train.cli_main`` with
``sys.argv`` set and the plugin loaded by ``--user-dir``, as the console script runs it; a row
runs in one process (the command's ``--row``), which prints one JSON line per run.
"""
import argparse
import contextlib
import dataclasses
import io
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # python -m scripts.X runs here
TASKS = ("translation", "language_modeling", "multilingual_translation", "translation_multi_simple_epoch",
         "translation_from_pretrained_bart", "denoising", "translation_moe")
# data ("mt": en-de with joined dictionaries, "lm": monolingual) and flags of each task
TASK_FLAGS = {
    "translation": ("mt", ["--source-lang", "en", "--target-lang", "de"]),
    "language_modeling": ("lm", ["--tokens-per-sample", "32", "--sample-break-mode", "none"]),
    "multilingual_translation": ("mt", ["--lang-pairs", "en-de"]),
    "translation_multi_simple_epoch": ("mt", ["--lang-pairs", "en-de", "--source-lang", "en", "--target-lang", "de"]),
    "translation_from_pretrained_bart": ("mt", ["--langs", "en,de", "--source-lang", "en", "--target-lang", "de"]),
    "denoising": ("lm", ["--tokens-per-sample", "32", "--mask", "0.3"]),
    "translation_moe": ("mt", ["--method", "hMoEup", "--num-experts", "2", "--source-lang", "en", "--target-lang", "de"]),
}
COMMON = ["--max-update", "1", "--max-tokens", "256", "--optimizer", "adam", "--lr", "0.001", "--seed", "1", "--cpu",
          "--num-workers", "0", "--disable-validation", "--log-format", "json", "--log-interval", "1",
          "--no-progress-bar", "--no-epoch-checkpoints"]
# flags at which each criterion adds nothing to cross-entropy at the first update (docs/flags.md)
NEUTRAL = {
    "cross_entropy_agg": [],  # its loss is cross-entropy; the gates change gradients only
    "augmented_loss": ["--aug-alpha", "0"],
    "cross_entropy_cosreg": ["--cosreg-gamma", "0"],
    "cross_entropy_antifocal": ["--antifocal-gamma", "0"],
    "cross_entropy_face": [],  # no counts before the first update: every weight is 1
    "cross_entropy_unlikelihood": ["--ul-alpha", "0"],
}
COUPLED_ADAM = "coupled_adam"  # the method column that is an optimizer: stock cross_entropy with it
# models that need what fairseq does not ship with them (left out, with the reason)
NEEDS_MORE = {
    "hf_gpt2": "wraps a transformers GPT-2 of the transformers 3.x era",
    "transformer_from_pretrained_xlm": "builds from a pretrained XLM checkpoint (--pretrained-xlm-checkpoint)",
    "roberta_enc_dec": "builds from a pretrained RoBERTa checkpoint (--pretrained-mlm-checkpoint)",
    "dummy_model": "a benchmark stand-in (fairseq.benchmark), trained by the dummy tasks",
    "transformer_ulm": "a language model of speech units (task speech_unit_modeling)",
}
AUDIO_HOMES = ("speech_to_text", "speech_to_speech", "text_to_speech", "speech_dlm", "wav2vec", "hubert")
# model classes run a second time with these flags, as the named row
VARIANTS = {"lightconv": [("dynamicconv", ["--encoder-conv-type", "dynamic", "--decoder-conv-type", "dynamic"])]}


def left_out(name, model_class):
    """Why the model is not a row, or None when it is one (see the module docstring)."""
    from fairseq.models import FairseqEncoderDecoderModel, FairseqLanguageModel, FairseqMultiModel
    from fairseq.models.nat import FairseqNATModel

    home = model_class.__module__
    if home.startswith("fairseq.model_parallel"):
        return "model parallel: needs Megatron-LM's model-parallel modules and a GPU"
    if not issubclass(model_class, (FairseqEncoderDecoderModel, FairseqLanguageModel, FairseqMultiModel)):
        return "no decoder: an encoder-only, audio or vocoder model"
    if issubclass(model_class, FairseqNATModel):
        return "non-autoregressive: trained by nat_loss, not a next-token cross-entropy"
    if any(part in AUDIO_HOMES for part in home.split(".")):
        return "audio or speech-unit input: no text task of the matrix builds it"
    return NEEDS_MORE.get(name)


def base_arch(name):
    from fairseq.models import ARCH_MODEL_INV_REGISTRY, ARCH_MODEL_REGISTRY

    return name if name in ARCH_MODEL_REGISTRY else ARCH_MODEL_INV_REGISTRY[name][0]


def rows():
    """[(row name, model name, base arch, extra flags)] and {left-out model name: why}."""
    from fairseq.models import ARCH_MODEL_INV_REGISTRY, MODEL_REGISTRY

    kept, skipped = [], {}
    for name in sorted(MODEL_REGISTRY):
        why = left_out(name, MODEL_REGISTRY[name])
        if why is None and not ARCH_MODEL_INV_REGISTRY.get(name):
            why = "no architecture registered (an alias reached through another model's archs)"
        if why:
            skipped[name] = why
            continue
        kept.append((name, name, base_arch(name), []))
        kept += [(variant, name, base_arch(name), flags) for variant, flags in VARIANTS.get(name, [])]
    return kept, skipped


def tiny_model_flags(model_class):
    """Tiny sizes for every size flag the model declares: widths 16 (feed-forward 32), one layer
    (fconv's layer lists: one (16, 3) layer), two heads, kernel lists [3], no dropout."""
    parser = argparse.ArgumentParser(add_help=False)
    model_class.add_args(parser)
    flags = []
    for action in parser._actions:
        if not action.option_strings or not action.option_strings[-1].startswith("--"):
            continue
        dest, flag = action.dest, action.option_strings[-1]
        value = None
        if "ffn" in dest and dest.endswith("dim"):
            value = "32"
        elif dest.endswith(("embed_dim", "output_dim", "input_dim", "hidden_size", "conv_dim")):
            value = "16"
        elif dest.endswith("attention_heads"):
            value = "2"
        elif dest.endswith("kernel_size_list"):
            value = "[3]"
        elif dest.endswith("_layers") and dest.split("_")[0] in ("encoder", "decoder"):
            value = "1" if action.type is int else "[(16, 3)]"
        elif "dropout" in dest and action.type is float:
            value = "0"
        # a size without a type stays a string on fairseq's legacy (Namespace) path: its default
        # follows another size (decoder_output_dim = decoder_embed_dim)
        if value is not None and not (action.type is None and value.isdigit()):
            flags += [flag, value]
    return flags


def make_data(root):
    """{"mt": en-de data-bin (joined dictionary), "lm": monolingual data-bin}, with fairseq-preprocess."""
    from fairseq import options
    from fairseq_cli import preprocess

    rng = random.Random(0)
    words = [f"w{i}" for i in range(60)]
    sentences = [" ".join(rng.choice(words[: rng.randint(10, 60)]) for _ in range(rng.randint(3, 12)))
                 for _ in range(260)]
    raw = os.path.join(root, "raw")
    os.makedirs(raw, exist_ok=True)
    for split, part in (("train", sentences[:200]), ("valid", sentences[200:230]), ("test", sentences[230:])):
        for suffix, lines in (("en", part), ("de", [" ".join(reversed(s.split())) for s in part]), ("txt", part)):
            with open(os.path.join(raw, f"{split}.{suffix}"), "w") as f:
                f.write("\n".join(lines) + "\n")
    bins = {"mt": os.path.join(root, "mt"), "lm": os.path.join(root, "lm")}
    for argv in (["--source-lang", "en", "--target-lang", "de", "--joined-dictionary", "--trainpref", f"{raw}/train",
                  "--validpref", f"{raw}/valid", "--destdir", bins["mt"]],
                 ["--only-source", "--trainpref", f"{raw}/train.txt", "--validpref", f"{raw}/valid.txt",
                  "--destdir", bins["lm"]]):
        preprocess.main(options.get_preprocessing_parser().parse_args(argv + ["--workers", "1"]))
    return bins


class Records(logging.Handler):
    """The first ``train_inner`` record of a run: its loss and gradient norm."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.first = None

    def emit(self, record):
        if record.name == "train_inner" and self.first is None:
            try:
                self.first = json.loads(record.getMessage())
            except ValueError:
                pass


def fairseq_train(argv, records):
    """``fairseq-train ARGV`` in this process: (exit status, stderr, the first train_inner record)."""
    from fairseq_cli import train

    err = io.StringIO()
    records.first = None
    saved, sys.argv = sys.argv, ["fairseq-train", *argv]
    status = 0
    try:
        with contextlib.redirect_stderr(err):
            try:
                train.cli_main()
            except SystemExit as e:
                status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception as e:  # what a console script's uncaught exception reaches: sys.excepthook
                try:
                    sys.excepthook(type(e), e, e.__traceback__)
                    status = 1
                except SystemExit as hook_exit:
                    status = hook_exit.code
    finally:
        sys.argv = saved
    return status, err.getvalue(), records.first


def last_line(text):
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def method_flags(method):
    """The fairseq-train flags of a method column: a criterion (eager output layer, its neutral
    flags) or ``coupled_adam`` with stock cross_entropy."""
    from fairseq.criterions import CRITERION_DATACLASS_REGISTRY

    if method == COUPLED_ADAM:
        return ["--criterion", "cross_entropy", "--optimizer", "coupled_adam"]
    config = CRITERION_DATACLASS_REGISTRY.get(method)
    eager = ["--output-kernel", "eager"] if any(f.name == "output_kernel" for f in dataclasses.fields(config)) else []
    return ["--criterion", method, *NEUTRAL.get(method, []), *eager]


def plugin_methods():
    """The criteria registered from fairseq_agg, then coupled_adam."""
    from fairseq.criterions import CRITERION_REGISTRY

    return sorted(n for n, c in CRITERION_REGISTRY.items() if c.__module__.startswith("fairseq_agg")) + [COUPLED_ADAM]


def run_rows_here(names, data, work, sample=False):
    """Runs the rows' cells in this process, printing a JSON line per run. ``sample``: on each
    pairing, only ``cross_entropy_agg`` and one other method, in turn (the test's share)."""
    import fairseq.examples.translation_moe.translation_moe_src  # noqa: F401  registers fairseq's example task
    import fairseq_agg
    from fairseq.models import MODEL_REGISTRY

    fairseq_agg.register_with_fairseq()
    records = Records()
    logging.basicConfig(level=logging.INFO, handlers=[records], force=True)  # fairseq_cli.train's own then does nothing
    every_row, methods = rows()[0], plugin_methods()
    others = [m for m in methods if m != "cross_entropy_agg"]
    for name, model, arch, extra in (r for r in every_row if r[0] in names):
        model_flags = ["--arch", arch, *tiny_model_flags(MODEL_REGISTRY[model]), *extra]
        for task in TASKS:
            data_kind, task_flags = TASK_FLAGS[task]
            base = [data[data_kind], "--user-dir", fairseq_agg.USER_DIR, "--task", task, *task_flags, *model_flags,
                    *COMMON]
            # its own save directory: fairseq writes crash.pt there even with --no-save
            stock_argv = base + ["--criterion", "cross_entropy", "--no-save", "--save-dir", tempfile.mkdtemp(dir=work)]
            status, err, stock = fairseq_train(stock_argv, records)
            cell = {"row": name, "task": task}
            if status != 0 or stock is None:
                print(json.dumps({**cell, "method": "cross_entropy", "status": "not a fairseq pairing",
                                  "why": last_line(err) or "no update"}), flush=True)
                continue
            print(json.dumps({**cell, "method": "cross_entropy", "status": "trains", "loss": stock["loss"],
                              "gnorm": stock["gnorm"]}), flush=True)
            turn = others[(every_row.index((name, model, arch, extra)) + TASKS.index(task)) % len(others)]
            for method in ["cross_entropy_agg", turn] if sample else methods:
                print(json.dumps({**cell, **run_method(base, method, work, records)}), flush=True)


def run_method(base, method, work, records):
    """One method's run on a pairing: trains (its first loss and gradient norm), refused, or traceback."""
    save_dir = tempfile.mkdtemp(dir=work)
    argv = base + method_flags(method) + ["--save-dir", save_dir]
    status, err, first = fairseq_train(argv, records)
    record = {"method": method, "exit": status, "written": sorted(os.listdir(save_dir)), "argv": argv}
    if status == 0 and first is not None:
        record.update(status="trains", loss=first["loss"], gnorm=first["gnorm"])
    elif status == 2 and "Traceback" not in err:
        record.update(status="refused", why=last_line(err), lines=len(err.strip().splitlines()))
    else:
        record.update(status="traceback", why=last_line(err))
    return record


def run_rows(names, data, work, processes=2, sample=False):
    """The rows in ``processes`` processes (``--row``), each running its share in turn: their JSON lines."""
    def one(share):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        proc = subprocess.run([sys.executable, "-m", "scripts.fairseq_matrix", "--row", ",".join(share),
                               "--mt", data["mt"], "--lm", data["lm"], "--work", work] + (["--sample"] if sample else []),
                              capture_output=True, text=True, env=env,
                              cwd=REPO)
        found = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{\"row\"")]
        if proc.returncode != 0:
            found.append({"row": ",".join(share), "task": "*", "method": "*", "status": "traceback",
                          "why": f"the rows' process ended with {proc.returncode}: {last_line(proc.stderr)}"})
        return found

    shares = [names[i::processes] for i in range(processes) if names[i::processes]]
    with ThreadPoolExecutor(len(shares)) as pool:
        return [record for found in pool.map(one, shares) for record in found]


def table(records, skipped):
    """docs/compatibility.md: one table per row, tasks down, methods across."""
    methods = plugin_methods()
    lines = ["# Compatibility with fairseq's models and tasks", "",
             "Generated by `python -m scripts.fairseq_matrix` (fairseq " + fairseq_version() + "); checked by "
             "tests/test_fairseq_matrix.py. Each cell: one update of a tiny model on the CPU with the plugin "
             "loaded (`--user-dir`). **trains**: it trained, its first loss equals stock `cross_entropy`'s at the "
             "method's neutral flags, and so does its gradient norm (not AGG's: its gates change the gradients); **refused**: one line at start-up (exit 2, "
             "nothing written), quoted; **not a fairseq pairing**: stock fairseq with `cross_entropy` does not "
             "train this model under this task (its error quoted), so the plugin's methods are not run; **not run**: "
             "left out of a `--sample` run (the test's share: `cross_entropy_agg` and one other method per "
             "pairing); without `--sample` every method runs.", ""]
    by_row = {}
    for record in records:
        by_row.setdefault(record["row"], []).append(record)
    for row in by_row:
        lines += [f"## {row}", "", "| task | " + " | ".join(f"`{m}`" for m in methods) + " |",
                  "|---|" + "---|" * len(methods)]
        cells = {(r["task"], r["method"]): r for r in by_row[row]}
        for task in TASKS:
            stock = cells.get((task, "cross_entropy"))
            if stock is None:
                continue
            if stock["status"] != "trains":
                lines.append(f"| `{task}` | not a fairseq pairing: {quote(stock['why'])} |" + " |" * (len(methods) - 1))
                continue
            shown = [describe(cells.get((task, m))) for m in methods]
            lines.append(f"| `{task}` | " + " | ".join(shown) + " |")
        lines.append("")
    lines += ["## Not rows", "", "| model | why |", "|---|---|"]
    lines += [f"| `{name}` | {why} |" for name, why in sorted(skipped.items())]
    return "\n".join(lines) + "\n"


def describe(record):
    if record is None:
        return "not run"
    if record["status"] == "trains":
        return "trains"
    return f"{record['status']}: {quote(record['why'])}"


def quote(text):
    return "`" + text.replace("|", "\\|").replace("`", "'")[:300] + "`"


def fairseq_version():
    import fairseq

    return fairseq.__version__
