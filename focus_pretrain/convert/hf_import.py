"""Import a local HuggingFace checkpoint (safetensors, sharded or not) into our model.

``hf_model_config(hf_dir)`` reads ``config.json`` into a :class:`ModelConfig`;
``import_hf(hf_dir, config)`` returns our state dict (this tensor-parallel rank's shards) through
the key maps of the family descriptions (:mod:`focus_pretrain.model.families`, whose
``config_from_hf`` also maps ``config.json``); ``load_hf_weights(model, hf_dir, config)``
loads it and checks that every non-router weight came from the checkpoint. Routers keep their
initialisation: they are what a retrofit trains.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state
from torch import Tensor

from focus_pretrain.convert.export_dir import read_json_object
from focus_pretrain.errors import InputError
from focus_pretrain.model.config import ModelConfig
from focus_pretrain.model.families import hf_family, hf_model_types, refused_hf_model_types
from focus_pretrain.model.tp_rules import Geometry, rules_for, shard

# fields of ModelConfig an HF checkpoint determines (the rest is ours: Focus, TP, recompute...)
ARCHITECTURE_FIELDS = (
    "family",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "vocab_size",
    "head_dim",
    "rotary_base",
    "rope_scaling",
    "norm_epsilon",
    "tie_embeddings",
    "sliding_window",
    "sliding_window_pattern",
    "local_rotary_base",
    "attn_softcap",
    "final_softcap",
    "query_pre_attn_scalar",
)


def read_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` of an HF checkpoint. Our own exports (``model_type: focus_<family>``)
    read as their family: a dense export re-imports for a retrofit (routers start fresh)."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: point at a HuggingFace model directory (config.json plus "
            "*.safetensors), e.g. one written by save_pretrained"
        )
    hf = read_json_object(path, "restore the checkpoint's config.json")
    base = str(hf.get("model_type", "")).removeprefix("focus_")
    if hf.get("model_type", "").startswith("focus_") and base in hf_model_types():
        hf["model_type"] = base  # our own export: its family's tensors plus routers (not loaded)
    return hf


def hf_model_config(hf_dir: str | os.PathLike, **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` of an HF checkpoint (``overrides``: Focus, recompute, ...
    fields)."""
    return ModelConfig(**{**_architecture(read_hf_config(hf_dir)), **overrides})


def _architecture(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields from an HF ``config.json`` (raises on what we cannot reproduce)."""
    model_type = hf.get("model_type")
    refused = refused_hf_model_types()
    if model_type in refused:
        raise ValueError(f"model_type={model_type!r}: {refused[model_type]}")
    if model_type not in hf_model_types():
        raise ValueError(
            f"unsupported HuggingFace architecture model_type={model_type!r} "
            f"({hf.get('architectures')}); supported: {', '.join(hf_model_types())}"
        )
    family = hf_family(model_type)
    hf = {**_hf_defaults(model_type), **hf}  # a key config.json lacks: what transformers assumes
    _check_causal(hf, model_type)
    try:
        fields_ = family.config_from_hf(hf)
    except KeyError as err:  # a field the family needs and transformers has no default for
        raise InputError(
            f"config.json of this {model_type} model lacks {err}, which its architecture needs: "
            "restore the checkpoint's config.json"
        ) from err
    if family.hf_slides is not None and family.hf_slides(hf):
        warnings.warn(
            f"{model_type} sliding_window={hf['sliding_window']} is not reproduced (Focus's window "
            "and groups replace it): logits match the HF model only on shorter sequences",
            stacklevel=3,
        )
    return fields_


# config.json keys whose absence means the config class's default (not ``None``): read from the
# installed transformers' class, as from_pretrained would (e.g. Gemma-2's soft-caps 50 / 30 and
# query_pre_attn_scalar 256, OLMo-2's rms_norm_eps 1e-5, Mistral's sliding_window 4096)
_DEFAULTED_KEYS = (
    "num_key_value_heads",
    "head_dim",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "rms_norm_eps",
    "layer_norm_epsilon",
    "hidden_act",
    "hidden_activation",
    "tie_word_embeddings",
)


def _hf_defaults(model_type: str) -> dict[str, Any]:
    """The transformers config class's constant defaults of :data:`_DEFAULTED_KEYS` (a ``None``
    default is derived from other fields, e.g. Llama's head_dim: left to the import rules)."""
    import dataclasses
    import inspect

    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    defaults = {
        name: param.default
        for name, param in inspect.signature(config_cls.__init__).parameters.items()
        if param.default is not inspect.Parameter.empty
    }
    if dataclasses.is_dataclass(config_cls):
        for item in dataclasses.fields(config_cls):
            if item.default is not dataclasses.MISSING:
                defaults.setdefault(item.name, item.default)
    return {k: defaults[k] for k in _DEFAULTED_KEYS if defaults.get(k) is not None}


def _check_causal(hf: dict[str, Any], model_type: str) -> None:
    """Refuse a checkpoint transformers would run with bidirectional attention."""
    for flag, bidirectional in (("is_causal", False), ("use_bidirectional_attention", True)):
        if flag in hf and hf[flag] is not None and bool(hf[flag]) == bidirectional:
            raise ValueError(
                f"{model_type} with {flag}={str(hf[flag]).lower()} (bidirectional attention, an "
                "encoder such as an embedding model) is not supported: Focus attention is causal"
            )


def check_compatible(config: ModelConfig, hf: dict[str, Any]) -> None:
    """Raise when ``config``'s architecture differs from the checkpoint's (names both)."""
    wanted = _architecture(hf)
    ours = {f.name: getattr(config, f.name) for f in fields(config)}
    ours["num_query_groups"] = config.kv_heads
    ours["tie_embeddings"] = config.tied
    ours["head_dim"] = config.kv_channels  # compare the effective head size, set or derived
    wanted["head_dim"] = (
        wanted.get("head_dim") or wanted["hidden_size"] // wanted["num_attention_heads"]
    )
    reference = ModelConfig(**wanted)  # Gemma's layer pattern and local RoPE base, effective
    for name, value in (
        ("sliding_window_pattern", "local_global_pattern"),
        ("local_rotary_base", "local_rope_base"),
    ):
        ours[name], wanted[name] = getattr(config, value), getattr(reference, value)
    for name in ARCHITECTURE_FIELDS:
        if name in wanted and ours[name] != wanted[name]:
            raise ValueError(
                f"model.{name} is {ours[name]!r} but the HuggingFace checkpoint has "
                f"{wanted[name]!r} (its config.json); take the architecture from the checkpoint "
                "(`focus-pretrain import-hf DIR` prints its model section; "
                "focus_pretrain.convert.hf_model_config) or fix the recipe"
            )
    learned = config.family_spec.positions == "learned_absolute"
    if learned and config.max_seq_length != wanted["max_seq_length"]:
        raise ValueError(
            f"model.max_seq_length is {config.max_seq_length} but the {config.family} checkpoint's "
            f"learned position table has {wanted['max_seq_length']} rows"
        )


def load_hf_tensors(hf_dir: str | os.PathLike, names: set[str] | None = None) -> dict[str, Tensor]:
    """Tensors of a safetensors checkpoint (single file or sharded with an index)."""
    from safetensors import safe_open

    root = Path(hf_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (root / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(
            f"{root} has no model.safetensors or model.safetensors.index.json (only safetensors "
            "checkpoints are read; re-save with save_pretrained(..., safe_serialization=True))"
        )
    tensors: dict[str, Tensor] = {}
    for name in files:
        path = root / name
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint shard {path} (listed in {index.name}) is missing")
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if names is None or key in names:
                    tensors[key] = f.get_tensor(key)
    return tensors


def import_hf(
    hf_dir: str | os.PathLike,
    config: ModelConfig,
    tp_rank: int | None = None,
    tp_size: int | None = None,
) -> dict[str, Tensor]:
    """Our state dict (tensor-parallel rank ``tp_rank`` of ``tp_size``'s shards) from an HF
    checkpoint directory; both default to Megatron's initialised parallel state (else 0 of 1).

    ``config`` must have the checkpoint's architecture (:func:`check_compatible`); its Focus
    and recompute settings are free. Router tensors are not included.
    """
    hf = read_hf_config(hf_dir)
    check_compatible(config, hf)
    rank, size = _tp_layout()
    tp_rank = rank if tp_rank is None else tp_rank
    tp = size if tp_size is None else tp_size
    if config.vocab_size % tp:
        raise ValueError(
            f"model.vocab_size ({config.vocab_size}) must be divisible by "
            f"parallel.tensor_parallel_size ({tp}) to shard the embedding"
        )
    geometry = Geometry(config.num_attention_heads, config.kv_heads, config.kv_channels)
    rules = rules_for(hf["model_type"], config.num_layers, config.tied)
    tensors = load_hf_tensors(hf_dir, {k for r in rules for k in r.hf})
    missing = sorted(k for r in rules for k in r.hf if k not in tensors)
    if missing:
        raise ValueError(
            f"the checkpoint in {hf_dir} lacks {len(missing)} tensor(s) its config.json implies, "
            f"e.g. {missing[:3]} (config and weights do not match)"
        )
    state = {}
    for rule in rules:
        full = rule.to_ours(geometry, *(tensors[k].float() for k in rule.hf))
        expected = _expected_shape(rule, config, geometry)
        if expected is not None and tuple(full.shape) != expected:
            raise ValueError(
                f"{rule.hf[0]} has shape {tuple(tensors[rule.hf[0]].shape)}, which does not fit "
                f"{rule.ours} {expected} (config.json and the weights do not match)"
            )
        state[rule.ours] = shard(full, rule.shard, tp_rank, tp)
    return state


def _expected_shape(rule, config: ModelConfig, geo: Geometry) -> tuple[int, ...] | None:
    h, f = config.hidden_size, config.ffn_hidden_size
    qkv = (geo.heads + 2 * geo.groups) * geo.head_dim
    table = {
        "linear_qkv.weight": (qkv, h),
        "linear_qkv.bias": (qkv,),
        "linear_proj.weight": (h, geo.heads * geo.head_dim),
        "linear_fc1.weight": (2 * f if config.family_spec.gated_mlp else f, h),
        "linear_fc2.weight": (h, f),
        "word_embeddings.weight": (config.vocab_size, h),
        "output_layer.weight": (config.vocab_size, h),
    }
    for suffix, shape in table.items():
        if rule.ours.endswith(suffix):
            return shape
    return None


def _tp_layout() -> tuple[int, int]:
    """``(rank, size)`` of this process in Megatron's tensor-parallel group (``(0, 1)``
    before the parallel state is initialised)."""
    if parallel_state.model_parallel_is_initialized():
        return (
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(),
        )
    return 0, 1


def load_hf_weights(model: torch.nn.Module, hf_dir: str | os.PathLike, config: ModelConfig) -> int:
    """Load an HF checkpoint into ``model`` (built from ``config``); returns tensors loaded.

    Every parameter except the routers' must come from the checkpoint.
    """
    state = import_hf(hf_dir, config)
    own = model.state_dict()
    for key, tensor in state.items():
        if key not in own:
            raise ValueError(f"the model has no tensor {key} (family map out of date?)")
        if own[key].shape != tensor.shape:
            raise ValueError(
                f"{key}: checkpoint shard {tuple(tensor.shape)} vs model {own[key].shape}"
            )
    unfilled = [
        k
        for k, v in own.items()
        if k not in state
        and isinstance(v, Tensor)
        and ".router." not in k
        and not k.endswith("_extra_state")
    ]
    if unfilled:
        raise ValueError(f"the HF checkpoint leaves {unfilled[:3]} uninitialised")
    with torch.no_grad():
        for key, tensor in state.items():
            own[key].copy_(tensor.to(own[key].dtype))
    return len(state)


def check_hf_source(hf_dir: str | os.PathLike, config) -> None:
    """What ``train.init_from_hf`` needs before any data or model work: the checkpoint's
    architecture is the recipe's (family included) and the recipe uses its tokenizer.

    Raises:
        ValueError: they differ (the message names the field and the fix).
        FileNotFoundError: ``hf_dir`` has no ``config.json``.
    """
    check_compatible(config.model, read_hf_config(hf_dir))
    check_tokenizer_matches(hf_dir, config.data.tokenizer)


def check_tokenizer_matches(hf_dir: str | os.PathLike, tokenizer: str | os.PathLike | None) -> None:
    """Refuse to retrofit an HF model on another tokenizer than the one it was pretrained with.

    The checkpoint's own tokenizer is ``tokenizer.json`` (``data.tokenizer: HF_DIR``) or a
    SentencePiece ``tokenizer.model`` (``data.tokenizer: HF_DIR/tokenizer.model``); a checkpoint
    shipping only slow-tokenizer files (``vocab.json`` + ``merges.txt``, ...) gets the command
    that writes its ``tokenizer.json``; one shipping none needs ``data.tokenizer`` set to the
    model's tokenizer (a new one would be trained otherwise, on ids the embeddings never saw).

    Raises:
        ValueError: ``tokenizer`` (``data.tokenizer``) is missing or another tokenizer than the
            checkpoint's; the message names the fix.
    """
    root = Path(hf_dir)
    chosen = None if tokenizer is None else Path(tokenizer)
    shipped = root / "tokenizer.json"
    if shipped.is_file():
        if _same_tokenizer_json(root, chosen, shipped):
            return
        fix = f"set data.tokenizer: {hf_dir}"
    elif (root / "tokenizer.model").is_file():
        model = root / "tokenizer.model"
        if chosen is not None and chosen.is_file() and chosen.read_bytes() == model.read_bytes():
            return
        fix = f"set data.tokenizer: {model}"
    elif any((root / name).is_file() for name in _SLOW_TOKENIZER_FILES):
        quoted = repr(str(hf_dir))
        raise ValueError(
            f"the HuggingFace checkpoint {hf_dir} ships its tokenizer only as slow-tokenizer "
            f"files ({', '.join(n for n in _SLOW_TOKENIZER_FILES if (root / n).is_file())}), "
            "which data.tokenizer does not read: write its tokenizer.json with python -c "
            f'"from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained('
            f'{quoted}); t.save_pretrained({quoted})", then set data.tokenizer: {hf_dir}'
        )
    elif chosen is None:
        raise ValueError(
            f"the HuggingFace checkpoint {hf_dir} ships no tokenizer and data.tokenizer is not "
            "set: a retrofit must use the tokenizer the model was pretrained with (a new one "
            "would be trained on ids its embeddings never saw); put the model's tokenizer.json "
            f"(or tokenizer.model) into {hf_dir}, or set data.tokenizer to it"
        )
    else:
        return  # nothing shipped to compare with: the user named the model's tokenizer
    raise ValueError(
        f"the HuggingFace checkpoint {hf_dir} ships its own tokenizer, but data.tokenizer is "
        f"{tokenizer}: its token ids would not mean what the pretrained embeddings learned; {fix}"
    )


def checkpoint_tokenizer(hf_dir: str | os.PathLike) -> str | None:
    """What ``data.tokenizer`` is for the checkpoint's own tokenizer: the directory (it ships
    ``tokenizer.json``), its SentencePiece ``tokenizer.model``, or ``None`` (neither)."""
    root = Path(hf_dir)
    if (root / "tokenizer.json").is_file():
        return str(hf_dir)
    if (root / "tokenizer.model").is_file():
        return str(root / "tokenizer.model")
    return None


# what a checkpoint may ship instead of tokenizer.json (transformers' slow tokenizers)
_SLOW_TOKENIZER_FILES = (
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def _same_tokenizer_json(root: Path, chosen: Path | None, shipped: Path) -> bool:
    """Whether ``chosen`` is the checkpoint's ``tokenizer.json`` (its directory or the file),
    or the very SentencePiece ``.model`` our export rebuilt it from."""
    record = root / "focus_export.json"  # our export of a SentencePiece-trained run
    if chosen is not None and chosen.is_file() and record.is_file():
        source = json.loads(record.read_text()).get("tokenizer_source")
        if source and hashlib.sha256(chosen.read_bytes()).hexdigest() == source["sha256"]:
            return True
    if chosen is not None and chosen.is_dir():
        chosen = chosen / "tokenizer.json"
    return chosen is not None and chosen.is_file() and chosen.read_bytes() == shipped.read_bytes()
