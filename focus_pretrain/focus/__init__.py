"""Focus attention, the method: router, pattern, attention backends. Plain PyTorch.

Nothing here knows about Megatron, DeepSpeed or process groups; the model and the parallel
layers wrap these pieces from outside.
"""

from focus_pretrain.focus.attention import (
    Backend,
    available_backends,
    focus_attention,
    register_backend,
)
from focus_pretrain.focus.config import FocusConfig
from focus_pretrain.focus.pattern import (
    allowed_pairs,
    count_allowed_pairs,
    membership_bitmask,
    pair_bias,
    pattern_density,
    soft_gate,
)
from focus_pretrain.focus.pattern_settings import FocusPattern
from focus_pretrain.focus.router import (
    FocusRouter,
    GroupLoad,
    Routing,
    group_load,
    router_parameter_count,
    sinkhorn_log,
)

__all__ = [
    "Backend",
    "FocusConfig",
    "FocusPattern",
    "FocusRouter",
    "GroupLoad",
    "Routing",
    "allowed_pairs",
    "available_backends",
    "count_allowed_pairs",
    "focus_attention",
    "group_load",
    "membership_bitmask",
    "pair_bias",
    "pattern_density",
    "register_backend",
    "router_parameter_count",
    "sinkhorn_log",
    "soft_gate",
]
