"""Moved to :mod:`focus_pretrain.model.tp_rules` (a model's key rules and tensor-parallel cuts
belong to the model); this alias of the old import path goes in the next release."""

import warnings

from focus_pretrain.model.tp_rules import *  # noqa: F403
from focus_pretrain.model.tp_rules import __all__  # noqa: F401

warnings.warn(
    "focus_pretrain.convert.families moved to focus_pretrain.model.tp_rules; the old path goes "
    "in the next release",
    DeprecationWarning,
    stacklevel=2,
)
