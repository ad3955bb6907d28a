"""Moved to :mod:`focus_pretrain.eval.lm_eval_task` (evaluation has its own package); this
alias of the old import path goes in the next release."""

import warnings

from focus_pretrain.eval.lm_eval_task import evaluate_perplexity, write_perplexity_task

__all__ = ["evaluate_perplexity", "write_perplexity_task"]

warnings.warn(
    "focus_pretrain.convert.lm_eval_task moved to focus_pretrain.eval.lm_eval_task; the old "
    "path goes in the next release",
    DeprecationWarning,
    stacklevel=2,
)
