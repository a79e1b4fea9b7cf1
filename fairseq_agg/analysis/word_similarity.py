"""Word similarity of token embeddings: Spearman's ρ between the cosine of two words' embedding
vectors and human similarity scores (WordSim-353, SimLex-999, ...), the intrinsic
embedding-quality measure the AGG paper (Yu et al., ACL 2022) reports beside isotropy.

The pieces, each usable alone (rules and sources: docs/stats.md, "Word similarity"):

* :func:`read_word_pairs` / :func:`parse_word_pairs`: the common file format, one
  ``word1<TAB>word2<TAB>score`` per line (or three fields separated by spaces), UTF-8 with or
  without a byte-order mark, LF or CRLF, ``#`` comments, blank lines and a header line skipped,
  words case-folded;
* :func:`average_ranks`, :func:`spearman_rho`: Spearman's ρ = Pearson's correlation of the ranks,
  ties given their average rank;
* :func:`marker_convention`, :class:`WordTokenizer`: how a word maps to rows of a fairseq
  dictionary, as one symbol ("single-token") or as the mean of its pieces ("subword");
* :func:`matrix_word_similarity`, :func:`checkpoint_word_similarity`: ρ for one matrix, and for
  every distinct embedding matrix of a checkpoint (what ``fairseq-agg-analyze --word-sim`` writes).
"""
import codecs
import logging
import math
import os
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from fairseq_agg.errors import UsageError
from fairseq_agg.fairseq_facts.dictionary import madeupword_ids, nspecial
from fairseq_agg.files import irregular_file_kind
from fairseq_agg.stats.matrices import dictionary_for

logger = logging.getLogger(__name__)

SPM_MARK = "\u2581"  # sentencepiece's "▁": the piece starts a word
BPE_CONTINUATION = "@@"  # subword-nmt: the piece is continued by the next one
CONVENTIONS = ("sentencepiece", "subword-nmt", "plain")
# the share of a dictionary's ordinary symbols that must carry a marker for its convention to be
# recognised: sentencepiece and subword-nmt vocabularies have far more, plain words almost never one
MARKER_SHARE = 0.1


class WordSimFileError(UsageError):
    """A word-similarity file that cannot be used (missing, malformed, empty); names the file."""


class WordPairs(NamedTuple):
    path: str  # absolute path of the file
    name: str  # its stem: the key in report.json and the table's column names
    pairs: List[Tuple[str, str, float]]  # (word1, word2, human score), in file order


# ----------------------------------------------------------------------------------------------
# the file format


def _shorten(text: str, width: int = 80) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _fields(line: str) -> List[str]:
    """The fields of one stripped data line: tab-separated when that gives three fields (a word may
    then hold spaces, "new york"), else separated by runs of tabs and spaces."""
    by_tab = [f.strip() for f in line.split("\t")]
    return by_tab if len(by_tab) == 3 else line.split()


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def parse_word_pairs(lines: Iterable[str], source: str) -> List[Tuple[str, str, float]]:
    """``(word1, word2, score)`` of every data line, the words case-folded; raises
    :class:`WordSimFileError` naming ``source`` and the 1-based line number at the first malformed
    line.

    Skipped: blank lines, lines starting with ``#``, and a header: the first other line when it
    has three fields and its third is not a number (``word1<TAB>word2<TAB>score``).
    """
    pairs = []
    header_possible = True
    for lineno, raw in enumerate(lines, start=1):
        line = raw.strip()  # also drops the \r of a CRLF line end
        if not line or line.startswith("#"):
            continue
        fields = _fields(line)
        score = _number(fields[2]) if len(fields) == 3 else None
        if header_possible and len(fields) == 3 and score is None:
            header_possible = False
            continue
        header_possible = False
        if len(fields) != 3:
            raise WordSimFileError(
                f"{source}, line {lineno}: expected 3 fields 'word1<TAB>word2<TAB>score' (or separated by spaces), "
                f"got {len(fields)}: {_shorten(line)!r}")
        if score is None or not math.isfinite(score):
            raise WordSimFileError(f"{source}, line {lineno}: the score {_shorten(fields[2])!r} is not a finite number")
        if not fields[0] or not fields[1]:
            raise WordSimFileError(f"{source}, line {lineno}: an empty word: {_shorten(line)!r}")
        pairs.append((fields[0].casefold(), fields[1].casefold(), score))
    return pairs


def check_input_file(path: str):
    """Refuses a path that is no regular file, saying what it is (a FIFO would block the read)."""
    kind = irregular_file_kind(path)
    if kind is not None:
        raise WordSimFileError(f"{path}: not a regular file ({kind})")
    if not os.path.isfile(path):
        raise WordSimFileError(f"{path}: no such file")


def read_word_pairs(path: str) -> WordPairs:
    """The pairs of a word-similarity file (UTF-8, a byte-order mark allowed); errors name the
    file, and the line where there is one."""
    check_input_file(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise WordSimFileError(f"{path}: cannot be read ({e.strerror or e})")
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        lineno = data.count(b"\n", 0, e.start) + 1
        raise WordSimFileError(f"{path}, line {lineno}: not UTF-8 text (byte 0x{data[e.start]:02x})") from None
    # split on \n only: str.splitlines would also split on form feeds, U+2028 etc. and miscount lines
    pairs = parse_word_pairs(text.split("\n"), path)
    if not pairs:
        raise WordSimFileError(f"{path}: no word pairs (only comments, blank lines or a header)")
    return WordPairs(os.path.abspath(path), os.path.splitext(os.path.basename(path))[0], pairs)


def read_word_sim_files(paths: Sequence[str]) -> List[WordPairs]:
    """Every file of ``paths``; their stems must differ (they key the report)."""
    sets = [read_word_pairs(p) for p in paths]
    seen = {}
    for s in sets:
        if s.name in seen:
            raise WordSimFileError(f"{seen[s.name]} and {s.path} have the same file name stem {s.name!r}, "
                                   "which keys the report; rename one")
        seen[s.name] = s.path
    return sets


# ----------------------------------------------------------------------------------------------
# Spearman's rho


def average_ranks(values) -> torch.Tensor:
    """1-based ranks (float64) of ``values``; tied values share the mean of their ranks."""
    x = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    n = x.numel()
    order = torch.argsort(x, stable=True)
    ordered = x[order]
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    tie_group = torch.cumsum(starts.long(), 0) - 1  # of each sorted position
    n_groups = int(tie_group[-1]) + 1 if n else 0
    position = torch.arange(1, n + 1, dtype=torch.float64)
    rank_sum = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, tie_group, position)
    group_size = torch.bincount(tie_group, minlength=n_groups).to(torch.float64)
    ranks = torch.empty(n, dtype=torch.float64)
    ranks[order] = (rank_sum / group_size)[tie_group]
    return ranks


def spearman_rho(x, y) -> Optional[float]:
    """Spearman's rank correlation of two equally long sequences: Pearson's correlation of their
    average ranks (so ties are handled exactly, unlike 1 − 6Σd²/(n(n²−1))). ``None`` with fewer
    than two values or when either side is constant (ρ undefined)."""
    rx, ry = average_ranks(x), average_ranks(y)
    if rx.numel() != ry.numel():
        raise ValueError(f"spearman_rho: {rx.numel()} vs {ry.numel()} values")
    if rx.numel() < 2:
        return None
    cx, cy = rx - rx.mean(), ry - ry.mean()
    denom = math.sqrt(float((cx * cx).sum()) * float((cy * cy).sum()))
    if denom == 0.0:
        return None
    return float((cx * cy).sum()) / denom


# ----------------------------------------------------------------------------------------------
# words -> dictionary rows


def marker_convention(dictionary) -> str:
    """``sentencepiece`` when at least :data:`MARKER_SHARE` of the ordinary symbols (not special,
    not ``madeupword``) start with ``▁``, else ``subword-nmt`` when that share ends with ``@@``,
    else ``plain`` (whole words)."""
    first = nspecial(dictionary)
    skip = set(madeupword_ids(dictionary))
    symbols = [s for i, s in enumerate(dictionary.symbols) if i >= first and i not in skip]
    if not symbols:
        return "plain"
    if sum(s.startswith(SPM_MARK) for s in symbols) >= MARKER_SHARE * len(symbols):
        return "sentencepiece"
    if sum(s.endswith(BPE_CONTINUATION) and len(s) > len(BPE_CONTINUATION) for s in symbols) >= MARKER_SHARE * len(symbols):
        return "subword-nmt"
    return "plain"


class WordTokenizer:
    """Maps a word to dictionary ids, following the dictionary's marker convention.

    Only ordinary symbols count: the special symbols and ``madeupword`` fillers are never a
    word's row. ``spm`` (a loaded ``sentencepiece.SentencePieceProcessor``) gives the subword
    pieces; without it they come from :meth:`greedy_pieces`.
    """

    def __init__(self, dictionary, convention: Optional[str] = None, spm=None):
        self.dictionary = dictionary
        self.convention = convention or marker_convention(dictionary)
        if self.convention not in CONVENTIONS:
            raise ValueError(f"convention must be one of {', '.join(CONVENTIONS)}, got {self.convention!r}")
        self.spm = spm
        self._not_words = set(range(nspecial(dictionary))) | set(madeupword_ids(dictionary))
        # words are case-folded when read; a cased dictionary is searched through the folded forms
        # of its symbols, the most frequent (lowest id) symbol of each folded form first
        self._folded = {}
        for i, symbol in enumerate(dictionary.symbols):
            if i not in self._not_words:
                self._folded.setdefault(symbol.casefold(), i)

    def symbol_id(self, symbol: str) -> Optional[int]:
        """The id of ``symbol`` if it is an ordinary symbol of the dictionary, else that of the
        most frequent ordinary symbol with the same case-folded form, else None."""
        i = self.dictionary.indices.get(symbol)
        if i is not None and i not in self._not_words:
            return i
        return self._folded.get(symbol.casefold())

    def whole_word_symbol(self, word: str) -> str:
        """The symbol a word has when it is a single token: ``▁word`` (sentencepiece) or ``word``
        (subword-nmt: an unsplit word carries no ``@@``; plain words)."""
        return SPM_MARK + word if self.convention == "sentencepiece" else word

    def single_token_id(self, word: str) -> Optional[int]:
        return self.symbol_id(self.whole_word_symbol(word))

    def greedy_pieces(self, word: str) -> Optional[List[str]]:
        """Greedy longest-match split of ``word`` into dictionary symbols, left to right, no
        backtracking; None when some position has no matching symbol.

        sentencepiece: the first piece is the longest ``▁`` + prefix (``▁`` alone last), later
        pieces are bare; subword-nmt: every piece but the last is ``piece@@``, the last is bare;
        plain: the word itself, as one piece.
        """
        if self.convention == "plain":
            return [word] if self.symbol_id(word) is not None else None
        pieces, i = [], 0
        if self.convention == "sentencepiece":
            for j in range(len(word), -1, -1):
                if self.symbol_id(SPM_MARK + word[:j]) is not None:
                    pieces.append(SPM_MARK + word[:j])
                    i = j
                    break
            else:
                return None
        while i < len(word):
            for j in range(len(word), i, -1):
                if self.convention == "subword-nmt" and j < len(word):
                    candidate = word[i:j] + BPE_CONTINUATION
                else:
                    candidate = word[i:j]
                if self.symbol_id(candidate) is not None:
                    pieces.append(candidate)
                    i = j
                    break
            else:
                return None
        return pieces

    def pieces(self, word: str) -> Optional[List[str]]:
        """The subword pieces of ``word``: the sentencepiece model's when one is given, else
        :meth:`greedy_pieces`."""
        if self.spm is not None:
            return list(self.spm.encode(word, out_type=str)) or None
        return self.greedy_pieces(word)

    def subword_ids(self, word: str) -> Optional[List[int]]:
        """The ids of ``word``'s pieces; None when it has no split or a piece is not an ordinary
        dictionary symbol."""
        pieces = self.pieces(word)
        if not pieces:
            return None
        ids = [self.symbol_id(p) for p in pieces]
        return None if any(i is None for i in ids) else ids


# ----------------------------------------------------------------------------------------------
# scores


def word_vectors(W: torch.Tensor, ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """[n, d] float64: row k is the mean of the rows ``ids[k]`` of W."""
    if not ids:
        return torch.zeros(0, W.size(1), dtype=torch.float64)
    return torch.stack([W[list(word_ids)].to(torch.float64).mean(0) for word_ids in ids])


def pair_cosines(W: torch.Tensor, ids_a: Sequence[Sequence[int]], ids_b: Sequence[Sequence[int]]) -> torch.Tensor:
    """Cosine of the (piece-averaged) vectors of each pair, float64; 0 where a vector is 0."""
    a, b = word_vectors(W, ids_a), word_vectors(W, ids_b)
    norms = (a.norm(dim=1) * b.norm(dim=1)).clamp_min(torch.finfo(torch.float64).tiny)
    return (a * b).sum(1) / norms


def similarity_score(W: torch.Tensor, pairs: Sequence[Tuple[str, str, float]], to_ids) -> dict:
    """``{"rho": ρ or None, "pairs": n}`` over the pairs whose two words ``to_ids`` maps to id
    lists (the other pairs are skipped: n counts the pairs used)."""
    ids_a, ids_b, human = [], [], []
    for w1, w2, score in pairs:
        a, b = to_ids(w1), to_ids(w2)
        if a is None or b is None:
            continue
        ids_a.append(a)
        ids_b.append(b)
        human.append(score)
    rho = spearman_rho(pair_cosines(W, ids_a, ids_b), human) if human else None
    return {"rho": rho, "pairs": len(human)}


def matrix_word_similarity(W: torch.Tensor, dictionary, pairs: Sequence[Tuple[str, str, float]], spm=None) -> dict:
    """``{"single": {"rho", "pairs"}, "subword": {"rho", "pairs"}, "total_pairs": n}`` for one
    embedding matrix W whose rows ``dictionary`` indexes (None: no word has a row)."""
    out = {"single": {"rho": None, "pairs": 0}, "subword": {"rho": None, "pairs": 0}, "total_pairs": len(pairs)}
    if dictionary is None:
        return out
    tok = WordTokenizer(dictionary, spm=spm)

    def single(word):
        i = tok.single_token_id(word)
        return None if i is None else [i]

    out["single"] = similarity_score(W, pairs, single)
    out["subword"] = similarity_score(W, pairs, tok.subword_ids)
    return out


def load_spm(path: str):
    """A sentencepiece model for the subword pieces; :class:`WordSimFileError` naming the file."""
    check_input_file(path)
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_file=path)
    except (OSError, RuntimeError) as e:
        reason = (str(e).strip().splitlines() or [""])[0]
        raise WordSimFileError(f"{path}: not a sentencepiece model ({type(e).__name__}: {reason})")


def checkpoint_word_similarity(matrices, dictionaries: Dict[str, object], datasets: Sequence[WordPairs],
                               spm=None) -> Dict[str, Dict[str, dict]]:
    """``{file stem: {matrix name: matrix_word_similarity(...)}}`` for the distinct embedding
    matrices of a checkpoint (:class:`~fairseq_agg.stats.matrices.EmbeddingMatrix`) and their
    dictionaries (matrix name -> fairseq Dictionary, as ``checkpoints.load_dictionaries`` gives)."""
    out = {s.name: {} for s in datasets}
    for mat in matrices:
        dictionary = dictionary_for(dictionaries.get(mat.name), mat.weight.size(0))
        if dictionary is None:
            logger.warning("word similarity of %s: no dictionary indexes its rows; no pair is scored", mat.name)
        for s in datasets:
            score = matrix_word_similarity(mat.weight, dictionary, s.pairs, spm)
            if spm is not None and dictionary is not None and score["subword"]["pairs"] == 0:
                logger.warning("word similarity of %s on %s: no word's sentencepiece pieces are all in the "
                               "dictionary; is --word-sim-spm the model the data was encoded with?", mat.name, s.name)
            out[s.name][mat.name] = score
    return out
