"""Evaluation of trained and retrofitted models: the retrofit report
(:mod:`focus_pretrain.eval.retrofit_report`). It sits above ``convert`` and ``train`` and may
read their results; nothing below imports it."""
