"""The options of :func:`fairseq_agg.hf.apply`: the plugin's fairseq flags without their dashes,
with fairseq's defaults, for the methods that make sense on a Hugging Face causal LM (docs/hf.md,
"The one call", lists each with its meaning).

What fairseq reads from its dictionary or its run is not an option here: the never-rare ids of AGG
(none: a Hugging Face vocabulary has no fairseq specials at ids 0-3, docs/api.md), the static
frequency group of ``--agg-freeze-set group`` (no counts come with a Hugging Face vocabulary), the
checkpoint flags (``--agg-restart-counts``; :meth:`CausalLMMethod.load_state_dict` is explicit) and
the released code's report of ``--agg-legacy-double-loss``. ``tests/test_hf_causal_lm.py`` holds
the names and defaults against the criteria's dataclasses.

Each value is checked by the same checks as the flag (:mod:`fairseq_agg.errors` and the method
objects of :mod:`fairseq_agg.ops`), at the call; their messages name the option
(:func:`option_names_in`).
"""
import re

from fairseq_agg.errors import UsageError, check_choice, check_integer, flag_name

METHODS = ("ce", "agg", "augmented_loss", "face", "unlikelihood", "cosreg")

# the shared output-layer flags (criterions/output_loss.py, OutputLossConfig)
OUTPUT_LAYER = {"label_smoothing": 0.0, "output_chunk_tokens": 2048, "output_kernel": "auto"}
# cross_entropy_agg's own flags (criterions/agg.py); threshold "relative" is fairseq's auto for a language model
AGG = {"agg_alpha": 0.03, "agg_window": 0, "agg_g1_mode": "code", "agg_threshold_mode": "relative",
       "agg_ref_tokens": 0, "agg_local_counts": False, "agg_freeze_rare": False, "agg_freeze_until_update": 0}
# the augmented loss's flags (criterions/augmented_loss.py); cross_entropy_agg offers them with aug_alpha 0
AUGMENTED = {"aug_alpha": 0.5, "aug_temperature": 10.0, "aug_scale": "tau", "no_aug_detach_target": False,
             "aug_embed": "input", "no_aug_mask_special": False, "aug_warmup_updates": 0}
FACE = {"face_weighing": "pre", "face_frequency": "out", "face_counting": "cumulative", "face_window": 0,
        "face_count_eos": False}
UNLIKELIHOOD = {"ul_alpha": 1.0, "ul_clamp": 1e-5}
COSREG = {"cosreg_gamma": 1.0, "cosreg_normalizer": "paper", "cosreg_rows": "no-pad-madeup", "cosreg_matrix": "output"}

DEFAULTS = {
    "ce": OUTPUT_LAYER,
    "agg": {**OUTPUT_LAYER, **AGG, **AUGMENTED, "aug_alpha": 0.0, "aug_gate_with_agg": False},
    "augmented_loss": {**OUTPUT_LAYER, **AUGMENTED},
    "face": {**OUTPUT_LAYER, **FACE},
    "unlikelihood": {**OUTPUT_LAYER, **UNLIKELIHOOD},
    "cosreg": {**OUTPUT_LAYER, **COSREG},
}

SWITCHES = ("agg_local_counts", "agg_freeze_rare", "no_aug_detach_target", "no_aug_mask_special", "aug_gate_with_agg",
            "face_count_eos")
CHOICES = {"agg_threshold_mode": ("auto", "relative", "per-update"), "aug_embed": ("input", "output"),
           "cosreg_rows": ("all", "no-pad-madeup", "no-special"), "cosreg_matrix": ("output", "input", "both")}
# 0 = auto (fairseq's meaning); the method objects check the rest of each range
AUTO_ZERO = ("agg_window", "agg_ref_tokens", "face_window")
# options that mean something only beside a switch: (option, the switch that must be on)
NEEDS = (("agg_freeze_until_update", "agg_freeze_rare"),)


def option_names_in(message: str, options) -> str:
    """``message`` with each fairseq flag of ``options`` (``--agg-alpha``) written as the option
    (``agg_alpha``), so that the core's checks read in the terms of the call."""
    names = {flag_name(name): name for name in options}
    return re.sub(r"--[a-z0-9][a-z0-9-]*", lambda m: names.get(m.group(0), m.group(0)), message)


def resolve_options(method: str, options: dict) -> dict:
    """The method's options: its defaults updated by ``options``, each name known and each value of
    the right kind (a UsageError naming the option and what is allowed). The method objects, built
    from them, check the numeric ranges."""
    if method not in METHODS:
        raise UsageError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    defaults = DEFAULTS[method]
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise UsageError(f"unknown option {unknown[0]!r} for method {method!r}; its options are: "
                         f"{', '.join(defaults)}")
    resolved = {**defaults, **options}
    try:
        for name in SWITCHES:
            if name in resolved and not isinstance(resolved[name], bool):
                raise UsageError(f"{name} must be True or False, got {resolved[name]!r}")
        for name, choices in CHOICES.items():
            if name in resolved:
                resolved[name] = check_choice(name, resolved[name], choices)
        for name in AUTO_ZERO:
            if name in resolved:
                resolved[name] = check_integer(name, resolved[name], 0)
        for name, switch in NEEDS:
            if name in resolved and resolved[name] != defaults[name] and not resolved[switch]:
                raise UsageError(f"{name} needs {switch}=True")
    except UsageError as error:
        raise UsageError(option_names_in(str(error), defaults)) from None
    return resolved
