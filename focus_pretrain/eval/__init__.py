"""Evaluation of trained, retrofitted and exported models: the retrofit report and its plots
(:mod:`~focus_pretrain.eval.retrofit_report`), RULER's needle tasks on an export
(:mod:`~focus_pretrain.eval.ruler`) and lm-evaluation-harness' offline perplexity task
(:mod:`~focus_pretrain.eval.lm_eval_task`). It sits above ``convert`` and ``train`` and may
read their results; nothing below imports it (``convert.lm_eval_task``, the old path, is a
one-release alias)."""
