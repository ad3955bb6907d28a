"""Moved to :mod:`focus_pretrain.checkpoint.save` (with the other checkpoint code); this
alias of the old import path goes in the next release."""

import warnings

from focus_pretrain.checkpoint.save import *  # noqa: F403
from focus_pretrain.checkpoint.save import __all__  # noqa: F401

warnings.warn(
    "focus_pretrain.train.checkpoint moved to focus_pretrain.checkpoint.save; the old path goes in "
    "the next release",
    DeprecationWarning,
    stacklevel=2,
)
