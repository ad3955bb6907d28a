"""What trained routers do: group shares, the trained pattern's density against random routing,
the distance profile of same-group pairs, typical tokens per group and stability across layers,
as a markdown/JSON report with plots (``tools/inspect_groups.py``; docs/interpretability.md).

The core (:mod:`~focus_pretrain.analysis.groups`, :mod:`~focus_pretrain.analysis.agreement`)
is plain functions over routing tensors ``[b, s, K]``; :mod:`~focus_pretrain.analysis.capture`
hooks a model's routers; :mod:`~focus_pretrain.analysis.pipeline` (which loads checkpoints
through :mod:`focus_pretrain.checkpoint`) runs the whole inspection.
"""

from focus_pretrain.analysis.agreement import (
    align_layers,
    best_matching,
    matched_agreement,
    normalized_mutual_information,
)
from focus_pretrain.analysis.capture import RouterCapture, find_routers
from focus_pretrain.analysis.groups import (
    GroupStats,
    kept_pairs_by_distance,
    random_density,
    random_pair_share,
    token_stability,
    typical_tokens,
)
from focus_pretrain.analysis.plots import write_plots
from focus_pretrain.analysis.report import markdown, write_report

__all__ = [
    "GroupStats",
    "RouterCapture",
    "align_layers",
    "best_matching",
    "find_routers",
    "kept_pairs_by_distance",
    "markdown",
    "matched_agreement",
    "normalized_mutual_information",
    "random_density",
    "random_pair_share",
    "token_stability",
    "typical_tokens",
    "write_plots",
    "write_report",
]
