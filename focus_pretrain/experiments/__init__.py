"""Experiments that orchestrate several training runs (above the trainer).

* :func:`compare_with_window_twin` (``tools/demo_recall.py``): Focus vs its window-only twin on
  the demo corpus's long-range recall.
* :func:`run_experiment` (``tools/experiments/run.py``): a declarative study (recipe variants x
  seeds, exports, evaluations) and its table of mean and spread over seeds.
"""

from focus_pretrain.experiments.runner import ExperimentSpec, load_spec, run_experiment
from focus_pretrain.experiments.twin import compare_with_window_twin

__all__ = ["ExperimentSpec", "compare_with_window_twin", "load_spec", "run_experiment"]
