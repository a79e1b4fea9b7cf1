"""A payload for planted checkpoints: an object whose unpickling runs code (``os.mkdir(marker)``),
so a test can tell whether a loader ran it (the marker exists) or refused it."""
import os


class RunsCodeWhenUnpickled:
    """What a planted checkpoint may hold: unpickling it calls os.mkdir(marker)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)
