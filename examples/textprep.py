#!/usr/bin/env python3
"""Text-preparation helpers shared by the example pipelines (WMT14 En-De, WikiText-103, demos).

The shell recipes run it as ``python examples/textprep.py COMMAND ...`` (it imports nothing from
this repository, so it runs from any directory); Python code imports it as
``from examples import textprep`` from the repository root. Every command streams line by line,
so large corpora need little memory.

Commands:
  spm-train       train a sentencepiece model (joint over several files)
  spm-encode      encode files into space-separated pieces (what fairseq-preprocess reads)
  spm-decode      decode space-separated pieces back to text
  clean-corpus    drop parallel pairs by length and length ratio (clean-corpus-n semantics)
  wikitext-detok  undo WikiText's ``@-@`` style token escapes (for subword models)
  gpt2-encode     GPT-2 byte-level BPE ids of each line, with fairseq's GPT-2 encoder
  gpt2-check      check that encoder.json and vocab.bpe are GPT-2's files and fairseq can read them
  hyp-from-generate  extract H- or T- lines of fairseq-generate output in input order
  compound-split  Moses-tokenise and split compounds (##AT##) for the papers' tokenized BLEU
  download        fetch a URL with a non-default User-Agent, verifying .zip files
"""
import argparse
import os
import re
import sys


def _die(msg):
    print(f"textprep: error: {msg}", file=sys.stderr)
    sys.exit(2)


def _open(path, mode="r"):
    if path == "-":
        return sys.stdin if "r" in mode else sys.stdout
    return open(path, mode, encoding="utf-8", newline="\n")


# ---------------------------------------------------------------------------- sentencepiece


def spm_train(inputs, model_prefix, vocab_size, model_type="bpe", character_coverage=1.0,
              max_sentences=10_000_000, seed=1, user_symbols=(), threads=None, hard_vocab_limit=True):
    """Trains a sentencepiece model on the lines of ``inputs`` (joint vocabulary)."""
    import sentencepiece as spm

    if vocab_size < 8:
        _die(f"--vocab-size must be >= 8, got {vocab_size}")
    for path in inputs:
        if not os.path.isfile(path):
            _die(f"spm-train input not found: {path}")
    # Sentence sampling and shuffling use this generator: a fixed seed gives the same model.
    spm.set_random_generator_seed(seed)
    # Without a bound, sentencepiece loads every line; large WMT/WikiText corpora are sampled.
    # fairseq adds its own bos/eos/pad: sentencepiece's ids are never used, only the pieces
    spm.SentencePieceTrainer.train(
        input=",".join(inputs), model_prefix=model_prefix, vocab_size=vocab_size, model_type=model_type,
        character_coverage=character_coverage, input_sentence_size=max_sentences, shuffle_input_sentence=True,
        seed_sentencepiece_size=1_000_000, num_threads=threads or min(os.cpu_count() or 1, 16),
        user_defined_symbols=list(user_symbols), hard_vocab_limit=hard_vocab_limit,
        bos_id=-1, eos_id=-1, pad_id=-1, unk_id=0, unk_piece="<spm_unk>", minloglevel=2)
    return model_prefix + ".model"


def spm_processor(model):
    """The sentencepiece model at ``model``, loaded."""
    import sentencepiece as spm

    if not os.path.isfile(model):
        _die(f"sentencepiece model not found: {model}")
    return spm.SentencePieceProcessor(model_file=model)


def spm_encode(model, inputs, outputs):
    sp = spm_processor(model)
    if len(inputs) != len(outputs):
        _die("spm-encode needs as many --outputs as --inputs")
    for src, dst in zip(inputs, outputs):
        with _open(src) as fin, _open(dst, "w") as fout:
            for line in fin:
                pieces = sp.encode(line.rstrip("\n"), out_type=str)
                fout.write(" ".join(pieces) + "\n")


def spm_decode(model, inp, out):
    sp = spm_processor(model)
    with _open(inp) as fin, _open(out, "w") as fout:
        for line in fin:
            pieces = line.split()
            fout.write(sp.decode_pieces(pieces) + "\n")


# ---------------------------------------------------------------------------- words

# A word is a run of word characters, and every other non-space character is a token of its own
# ("don't," -> don ' t ,): a word-level vocabulary without a tokenizer model, as the study's tail
# part builds it (docs/study.md, "Part tail").
_WORD_OR_PUNCT = re.compile(r"\w+|[^\w\s]")


def word_tokens(line):
    """The lower-cased words and punctuation marks of one line (``\\w+|[^\\w\\s]``)."""
    return _WORD_OR_PUNCT.findall(line.lower())


# ---------------------------------------------------------------------------- cleaning


def clean_corpus(src_in, tgt_in, src_out, tgt_out, min_len=1, max_len=250, ratio=1.5):
    """Keeps a pair iff both sides have min..max tokens and neither is > ratio times the other.

    The semantics of Moses' clean-corpus-n (which fairseq's WMT recipe runs after BPE): lengths are
    whitespace tokens of the already segmented text. Returns (kept, total).
    """
    kept = total = 0
    with _open(src_in) as fs, _open(tgt_in) as ft, _open(src_out, "w") as os_, _open(tgt_out, "w") as ot:
        for s, t in zip(fs, ft):
            total += 1
            s = s.strip()
            t = t.strip()
            ns, nt = len(s.split()), len(t.split())
            if ns < min_len or nt < min_len or ns > max_len or nt > max_len:
                continue
            if ns > ratio * nt or nt > ratio * ns:
                continue
            os_.write(s + "\n")
            ot.write(t + "\n")
            kept += 1
        if fs.readline() or ft.readline():
            _die(f"{src_in} and {tgt_in} have different numbers of lines")
    return kept, total


# ---------------------------------------------------------------------------- WikiText

_WT_ESCAPES = re.compile(r" @([-,.])@ ")


def wikitext_detok_line(line):
    """`1 @,@ 000` -> `1,000`, `state @-@ of` -> `state-of`: WikiText's escapes of in-word symbols.

    Headings (` = Title = `), `<unk>` and the other token spacing are kept: sentencepiece learns
    them as pieces, and keeping the spacing makes the text identical to what the word-level
    models see.
    """
    return _WT_ESCAPES.sub(r"\1", line)


def wikitext_detok(inp, out):
    with _open(inp) as fin, _open(out, "w") as fout:
        for line in fin:
            fout.write(wikitext_detok_line(line.rstrip("\n")) + "\n")


# ---------------------------------------------------------------------------- GPT-2 BPE

# The encoder of one gpt2-encode worker process (set by _start_gpt2_worker).
_gpt2_worker_encoder = None


def gpt2_encoder(encoder_json, vocab_bpe):
    """fairseq's GPT-2 byte-level BPE encoder (``fairseq.data.encoders.gpt2_bpe_utils``) for the
    two files fairseq publishes at https://dl.fbaipublicfiles.com/fairseq/gpt2_bpe/; files that are
    not in their formats are one error line, not a traceback in a worker."""
    import json

    for flag, path in (("--encoder-json", encoder_json), ("--vocab-bpe", vocab_bpe)):
        if not os.path.isfile(path):
            _die(f"{flag}: no such file: {path}")
    try:
        with open(encoder_json, encoding="utf-8") as f:
            table = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        _die(f"--encoder-json {encoder_json} is not GPT-2's encoder.json (not JSON: {e})")
    if not isinstance(table, dict) or not all(isinstance(v, int) for v in table.values()):
        _die(f"--encoder-json {encoder_json} is not GPT-2's encoder.json (expected a JSON object of token: id)")
    with open(vocab_bpe, encoding="utf-8", errors="replace") as f:
        first = f.readline()
    if not first.startswith("#version"):
        _die(f"--vocab-bpe {vocab_bpe} is not GPT-2's vocab.bpe (its first line is not '#version: ...')")
    try:
        from fairseq.data.encoders.gpt2_bpe_utils import get_encoder
    except ImportError as e:
        _die(f"gpt2-encode needs fairseq's GPT-2 encoder ({e}); run it with the Python that has fairseq")
    return get_encoder(encoder_json, vocab_bpe)


def gpt2_encode_line(encoder, line):
    """The ids of one line, space-separated, as the AGG paper's data has them: the line stripped of
    surrounding whitespace (its newline included), an empty line kept empty (fairseq-preprocess
    gives it just an end-of-sentence)."""
    text = line.strip()
    return " ".join(str(i) for i in encoder.encode(text)) if text else ""


def _start_gpt2_worker(encoder_json, vocab_bpe):
    global _gpt2_worker_encoder
    _gpt2_worker_encoder = gpt2_encoder(encoder_json, vocab_bpe)


def _gpt2_worker_encode(line):
    return gpt2_encode_line(_gpt2_worker_encoder, line)


def gpt2_encode(encoder_json, vocab_bpe, inputs, outputs, workers=1):
    """Encodes every line of each of ``inputs`` into the file at the same place in ``outputs``,
    keeping the line order; ``workers`` > 1 encodes in that many processes."""
    if len(inputs) != len(outputs):
        _die("gpt2-encode needs as many --outputs as --inputs")
    if workers < 1:
        _die(f"--workers must be >= 1, got {workers}")
    encoder = gpt2_encoder(encoder_json, vocab_bpe)  # checks the files once, here
    pool = None
    if workers > 1:
        import multiprocessing

        pool = multiprocessing.Pool(workers, initializer=_start_gpt2_worker, initargs=(encoder_json, vocab_bpe))
    try:
        for src, dst in zip(inputs, outputs):
            with open(src if src != "-" else os.devnull, "rb") as counted:  # a progress line per tenth (minutes each)
                tenth = sum(1 for _ in counted) // 10 or float("inf")  # none for stdin or under 10 lines
            with _open(src) as fin, _open(dst, "w") as fout:
                # imap keeps the input order; chunks amortise the inter-process traffic
                lines = pool.imap(_gpt2_worker_encode, fin, chunksize=1000) if pool else \
                    (gpt2_encode_line(encoder, line) for line in fin)
                for n, encoded in enumerate(lines, 1):
                    fout.write(encoded + "\n")
                    if n % tenth == 0 and n // tenth <= 10:
                        print(f"gpt2-encode: {os.path.basename(src)} {10 * n // tenth} %", file=sys.stderr, flush=True)
    finally:
        if pool is not None:
            pool.close()
            pool.join()


# ---------------------------------------------------------------------------- generate output


def read_generate(path, prefix="H"):
    """Returns the prefix ('H', 'T' or 'S') strings of fairseq-generate output, in sample-id order."""
    found = {}
    with _open(path) as f:
        for line in f:
            if not line.startswith(prefix + "-"):
                continue
            head, *fields = line.rstrip("\n").split("\t")
            idx = int(head[len(prefix) + 1:])
            # H and D lines carry a score column before the text; S and T lines do not.
            text = fields[-1] if fields else ""
            found[idx] = text
    if not found:
        _die(f"no {prefix}- lines in {path}: is it fairseq-generate output?")
    missing = sorted(set(range(max(found) + 1)) - set(found))
    if missing:
        _die(f"{path}: {len(missing)} sample ids have no {prefix}- line (first: {missing[0]})")
    return [found[i] for i in range(len(found))]


# ---------------------------------------------------------------------------- tokenized BLEU

# The compound split of the community recipe (tensor2tensor's get_ende_bleu.sh, fairseq's
# scripts/compound_split_bleu.sh) is the perl one-liner  perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'.
# perl reads the file as bytes (no UTF-8 layer), so it is applied here to the line's UTF-8 bytes
# with a bytes pattern of Python's re, whose substitution has the same semantics: matches are found
# left to right and do not overlap, so "A-B-C" becomes "A ##AT##-##AT## B-C" (the "B" is used by
# the first match), and \S is any byte but ASCII whitespace [ \t\n\v\f\r] in both. On bytes a
# multi-byte character is several "characters": in "x-é-y" the first match ends on the first byte
# of "é" and the second starts on its last one, so both hyphens split ("x ##AT##-##AT## é ##AT##-##AT##
# y"), where a match on characters would consume "é" in the first match and leave "é-y" whole. Only
# the ASCII hyphen is replaced, between whole characters, so the result is valid UTF-8 again.
# tests/test_pipelines_wmt.py checks the equivalence against a real perl process.
_COMPOUND_HYPHEN = re.compile(rb"(\S)-(\S)")


def split_compounds(tokenized):
    """The recipe's perl substitution s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g on one tokenised line,
    on its UTF-8 bytes as perl applies it."""
    return _COMPOUND_HYPHEN.sub(rb"\1 ##AT##-##AT## \2", tokenized.encode("utf-8")).decode("utf-8")


def compound_split_line(tok, line):
    """One detokenised line as the community recipe scores it: Moses-tokenised, compounds split.

    The WMT14 En-De papers since the Transformer (Vaswani et al., 2017), the AGG paper among
    them, report this "tokenized BLEU", in which a hyphenated compound counts as three tokens
    ("Bundes-Innenministerium" -> "Bundes ##AT##-##AT## Innenministerium"). The tokenisation is
    Moses' tokenizer.perl with its defaults (``-l LANG``: no aggressive hyphen splitting, HTML
    escaping of ``& < > " ' [ ] |``), here sacremoses' port of it, then ``split_compounds``.
    """
    return split_compounds(tok.tokenize(line, aggressive_dash_splits=False, escape=True, return_str=True))


def compound_split(inp, out, lang):
    try:
        from sacremoses import MosesTokenizer
    except ImportError:
        _die("the tokenized BLEU needs sacremoses: pip install sacremoses")
    tok = MosesTokenizer(lang=lang)
    with _open(inp) as fin, _open(out, "w") as fout:
        for line in fin:
            fout.write(compound_split_line(tok, line.rstrip("\n")) + "\n")


# ---------------------------------------------------------------------------- downloads


def _user_agent():
    """``fairseq-agg/VERSION``: some mirrors (the WikiText one) refuse urllib's default agent."""
    from importlib import metadata

    try:
        return f"fairseq-agg/{metadata.version('fairseq-agg')}"
    except metadata.PackageNotFoundError:
        return "fairseq-agg"


def download(url, output, user_agent=None, attempts=3, timeout=60, local_flag="--raw-dir"):
    """Downloads ``url`` to ``output`` through ``output.part``; a ``.zip`` must be a valid zip.

    Connection failures and truncated transfers are retried ``attempts`` times; an HTTP error
    status is not (the server answered). Nothing is left at ``output`` unless it is complete. A
    failure names ``local_flag``, the recipe's flag for a local copy.
    """
    import time
    import urllib.error
    import urllib.request
    import zipfile

    part = output + ".part"
    request = urllib.request.Request(url, headers={"User-Agent": user_agent or _user_agent()})
    hint = f"(or download the file yourself and pass its directory as the recipe's {local_flag})"
    for attempt in range(1, attempts + 1):
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp, open(part, "wb") as f:
                expected = resp.headers.get("Content-Length")
                got = 0
                while True:
                    block = resp.read(1 << 20)
                    if not block:
                        break
                    f.write(block)
                    got += len(block)
            if expected is not None and got != int(expected):
                raise ConnectionError(f"got {got} of {expected} bytes")
            break
        except urllib.error.HTTPError as e:
            _remove(part)
            _die(f"download of {url} failed: HTTP {e.code} {e.reason} {hint}")
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
            _remove(part)
            reason = getattr(e, "reason", e)
            if attempt == attempts:
                _die(f"download of {url} failed after {attempts} attempts: {reason} {hint}")
            print(f"textprep: download of {url} failed ({reason}); retrying", file=sys.stderr)
            time.sleep(2 * attempt)
    if output.endswith(".zip"):
        try:
            with zipfile.ZipFile(part) as z:
                bad = z.testzip()
        except zipfile.BadZipFile:
            bad = "(not a zip archive)"
        if bad is not None:
            size = os.path.getsize(part)
            _remove(part)
            _die(f"download of {url} is not a valid zip ({size} bytes; bad member: {bad}) {hint}")
    os.replace(part, output)
    return output


def _remove(path):
    if os.path.exists(path):
        os.remove(path)


def _clean_corpus_command(a):
    if a.min_len < 1 or a.max_len < a.min_len:
        _die(f"--min-len/--max-len must satisfy 1 <= min <= max, got {a.min_len}/{a.max_len}")
    if a.ratio < 1:
        _die(f"--ratio must be >= 1, got {a.ratio}")
    kept, total = clean_corpus(a.src, a.tgt, a.out_src, a.out_tgt, a.min_len, a.max_len, a.ratio)
    print(f"clean-corpus: kept {kept} of {total} pairs", file=sys.stderr)


def _hyp_from_generate_command(a):
    with _open(a.output, "w") as f:
        for line in read_generate(a.input, a.prefix):
            f.write(line + "\n")


_REQUIRED, _FILES = {"required": True}, {"nargs": "+", "required": True}
_STREAMS = (("--input", {"default": "-"}), ("--output", {"default": "-"}))
_GPT2_FILES = (("--encoder-json", dict(_REQUIRED, help="GPT-2's encoder.json (token -> id)")),
               ("--vocab-bpe", dict(_REQUIRED, help="GPT-2's vocab.bpe (the merges, in order)")))
# command: (what it runs with the parsed flags, its flags in order: (name, argparse's keywords))
COMMANDS = {
    "spm-train": (lambda a: spm_train(a.inputs, a.model_prefix, a.vocab_size, a.model_type, a.character_coverage,
                                      a.max_sentences, a.seed, a.user_symbols, hard_vocab_limit=not a.soft_vocab_limit),
                  (("--inputs", _FILES), ("--model-prefix", _REQUIRED), ("--vocab-size", dict(_REQUIRED, type=int)),
                   ("--model-type", {"default": "bpe", "choices": ["bpe", "unigram", "char", "word"]}),
                   ("--character-coverage", {"type": float, "default": 1.0}),
                   ("--max-sentences", {"type": int, "default": 10_000_000}),
                   ("--user-symbols", {"nargs": "*", "default": []}),
                   ("--soft-vocab-limit", {"action": "store_true", "help": "allow a smaller vocabulary when the "
                                                                   "corpus is too small (fixtures)"}),
                   ("--seed", {"type": int, "default": 1}))),
    "spm-encode": (lambda a: spm_encode(a.model, a.inputs, a.outputs),
                   (("--model", _REQUIRED), ("--inputs", _FILES), ("--outputs", _FILES))),
    "spm-decode": (lambda a: spm_decode(a.model, a.input, a.output), (("--model", _REQUIRED), *_STREAMS)),
    "clean-corpus": (_clean_corpus_command,
                     (("--src", _REQUIRED), ("--tgt", _REQUIRED), ("--out-src", _REQUIRED), ("--out-tgt", _REQUIRED),
                      ("--min-len", {"type": int, "default": 1}), ("--max-len", {"type": int, "default": 250}),
                      ("--ratio", {"type": float, "default": 1.5}))),
    "wikitext-detok": (lambda a: wikitext_detok(a.input, a.output), _STREAMS),
    "gpt2-check": (lambda a: gpt2_encoder(a.encoder_json, a.vocab_bpe),
                   (("--encoder-json", _REQUIRED), ("--vocab-bpe", _REQUIRED))),
    "gpt2-encode": (lambda a: gpt2_encode(a.encoder_json, a.vocab_bpe, a.inputs, a.outputs, a.workers),
                    (*_GPT2_FILES, ("--inputs", _FILES), ("--outputs", _FILES),
                     ("--workers", {"type": int, "default": 1}))),
    "hyp-from-generate": (_hyp_from_generate_command,
                          (("--input", _REQUIRED), ("--output", {"default": "-"}),
                           ("--prefix", {"default": "H", "choices": ["H", "T", "S", "D"]}))),
    "compound-split": (lambda a: compound_split(a.input, a.output, a.lang),
                       (*_STREAMS, ("--lang", {"default": "de"}))),
    "download": (lambda a: download(a.url, a.output, a.user_agent, local_flag=a.local_flag),
                 (("--url", _REQUIRED), ("--output", _REQUIRED),
                  ("--user-agent", {"default": None, "help": "default: fairseq-agg/VERSION"}),
                  ("--local-flag", {"default": "--raw-dir",
                                    "help": "the recipe's flag for a local copy, named on failure"}))),
}


def build_parser():
    """textprep.py's parser: one subcommand per entry of :data:`COMMANDS`."""
    p = argparse.ArgumentParser(prog="textprep.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, (_, flags) in COMMANDS.items():
        command = sub.add_parser(name)
        for flag, keywords in flags:
            command.add_argument(flag, **keywords)
    return p


def main(argv=None):
    a = build_parser().parse_args(argv)
    COMMANDS[a.cmd][0](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
