"""Small facts about fairseq dictionaries shared by the criteria and the statistics."""
from typing import List

# fairseq-preprocess pads the dictionary to a multiple of 8 with these never-seen symbols
# (Dictionary.pad_to_multiple_).
MADEUPWORD_PREFIX = "madeupword"


def madeupword_ids(dictionary) -> List[int]:
    return [i for i, sym in enumerate(dictionary.symbols) if sym.startswith(MADEUPWORD_PREFIX)]


def never_real_ids(dictionary) -> List[int]:
    """Ids that are never a real target: the padding symbol and the madeupword filler rows."""
    return sorted({dictionary.pad()} | set(madeupword_ids(dictionary)))
