"""fairseq's ``MetersDict`` cannot forget a meter; the statistics drop their reset meters so that
log lines without a measurement carry no ``None`` value."""


def remove_meter(meters, key: str):
    """Removes ``key`` from a fairseq ``MetersDict``: it keeps a sorted ``priorities`` list next to
    the dict (its ``state_dict`` walks that list) and has no removal method of its own."""
    if key in meters:
        del meters[key]
        meters.priorities[:] = [entry for entry in meters.priorities if entry[2] != key]
