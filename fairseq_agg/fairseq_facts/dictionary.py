"""Dictionary facts: the special symbols, and the ``madeupwordNNNN`` fillers that
``fairseq-preprocess --padding-factor`` appends (never a real target, never trained). Without a
dictionary (a criterion built by hand), fairseq's defaults."""
import re
from typing import List


FAIRSEQ_NSPECIAL = 4  # bos, pad, eos, unk: fairseq's Dictionary without extra special symbols
FAIRSEQ_PAD = 1
FAIRSEQ_EOS = 2
_MADEUPWORD = re.compile(r"^madeupword\d{4}$")  # Dictionary.pad_to_multiple_


def nspecial(dictionary) -> int:
    return FAIRSEQ_NSPECIAL if dictionary is None else int(dictionary.nspecial)


def pad_index(dictionary) -> int:
    return FAIRSEQ_PAD if dictionary is None else int(dictionary.pad())


def eos_index(dictionary) -> int:
    return FAIRSEQ_EOS if dictionary is None else int(dictionary.eos())


def madeupword_ids(dictionary) -> List[int]:
    """Ids of the vocabulary-padding fillers (``madeupword0000`` ...); none without a dictionary."""
    if dictionary is None:
        return []
    first = nspecial(dictionary)
    return [i for i, sym in enumerate(dictionary.symbols) if i >= first and _MADEUPWORD.match(sym)]


def special_ids(dictionary) -> List[int]:
    """Ids of the special symbols: the first ``nspecial`` entries and the padding symbol."""
    return sorted(set(range(nspecial(dictionary))) | {pad_index(dictionary)})


def never_real_ids(dictionary) -> List[int]:
    """Ids that are never a real target: the padding symbol and the madeupword fillers."""
    return sorted({pad_index(dictionary)} | set(madeupword_ids(dictionary)))
