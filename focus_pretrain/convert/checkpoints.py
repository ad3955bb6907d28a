"""Moved to :mod:`focus_pretrain.checkpoint.read` (checkpoints have one package, below
``train/`` and ``convert/``); this alias of the old import path goes in the next release."""

import warnings

from focus_pretrain.checkpoint.read import *  # noqa: F403
from focus_pretrain.checkpoint.read import __all__  # noqa: F401

warnings.warn(
    "focus_pretrain.convert.checkpoints moved to focus_pretrain.checkpoint.read; the old path "
    "goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)
