"""Focus against its window-only twin on the demo corpus.

:func:`compare_with_window_twin` is the demo's claim: Focus reaches the recalled definitions
beyond the window, and its window-only twin (same recipe, same seed, no router) cannot.
``tools/demo_recall.py`` prints its table.
"""

from __future__ import annotations

from dataclasses import replace

from focus_pretrain.config import Config
from focus_pretrain.train.trainer import pretrain


def compare_with_window_twin(config: Config) -> dict[str, dict[str, float]]:
    """Train ``config`` (a demo-corpus recipe) with Focus and as its window-only twin.

    Both runs use the recipe's seed, steps and data; they write to ``run.output_dir/focus`` and
    ``run.output_dir/window_only`` (a run resumes if its directory holds a checkpoint).
    Returns ``{"focus": scores, "window_only": scores}`` from
    :func:`~focus_pretrain.train.recall.recall_metrics` at the last step.
    """
    if not config.model.focus.enabled or config.model.focus.window_only:
        raise ValueError("compare_with_window_twin needs a Focus recipe (model.focus.enabled)")
    train = replace(
        config.train, eval_interval=config.train.steps, recall_docs=max(config.train.recall_docs, 1)
    )
    results = {}
    for name, window_only in (("focus", False), ("window_only", True)):
        focus = replace(config.model.focus, window_only=window_only)
        run = replace(config.run, output_dir=f"{config.run.output_dir}/{name}")
        result = pretrain(
            replace(config, run=run, train=train, model=replace(config.model, focus=focus))
        )
        if result["recall"] is None:
            raise ValueError("the recall metric needs a demo corpus recipe (data.sources: demo)")
        results[name] = result["recall"]
    return results
