"""HuggingFace import (retrofit a pretrained model) and export (downstream use)."""

from focus_pretrain.checkpoint.read import megatron_state_dict, resolve_checkpoint
from focus_pretrain.convert.hf_export import attach_focus_adapter, export_hf, export_router_adapter
from focus_pretrain.convert.hf_import import (
    check_compatible,
    check_tokenizer_matches,
    hf_model_config,
    import_hf,
    load_hf_tensors,
    load_hf_weights,
    read_hf_config,
)
from focus_pretrain.model.tp_rules import Geometry, Rule, rules_for, shard

__all__ = [
    "Geometry",
    "Rule",
    "attach_focus_adapter",
    "check_compatible",
    "check_tokenizer_matches",
    "export_hf",
    "export_router_adapter",
    "hf_model_config",
    "import_hf",
    "load_hf_tensors",
    "load_hf_weights",
    "megatron_state_dict",
    "read_hf_config",
    "resolve_checkpoint",
    "rules_for",
    "shard",
]
