"""Export a training checkpoint to a HuggingFace directory that loads with
``AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True)``.

The directory holds sharded safetensors in the family's own HF names (through the inverse key
maps) plus each layer's router, ``config.json`` (the family's HF config, a ``focus`` section and
an ``auto_map`` to the shipped ``configuration_focus.py``/``modeling_focus.py``), the tokenizer
converted from our SentencePiece model (or copied, for an HF tokenizer) and a generation config.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from focus_pretrain.checkpoint.read import (
    trained_tp_shards,
)
from focus_pretrain.config import Config
from focus_pretrain.convert.export_files import (
    ADAPTER_MARKER,
    EXPORT_MARKER,
    MODELING_DIR,
    SHIPPED_MODELING_FILES,
    check_export_dir,
    shipped_code_digests,
)
from focus_pretrain.convert.exportable import exportable_checkpoint
from focus_pretrain.convert.hf_import import load_hf_tensors
from focus_pretrain.data.datasets import tokenizer_path_for
from focus_pretrain.data.tokenizer import Tokenizer
from focus_pretrain.errors import InputError, MissingInputError
from focus_pretrain.focus.config import FocusConfig
from focus_pretrain.model.config import ModelConfig
from focus_pretrain.model.families import family as family_description
from focus_pretrain.model.tp_rules import Geometry, unshard
from focus_pretrain.storage.checkpoint_files import LATEST, tokenizer_copy
from focus_pretrain.storage.files import partial_dir, replace_dir

__all__ = [  # MODELING_DIR, SHIPPED_MODELING_FILES, check_export_dir: convert.export_files'
    "EXPORTED_FOCUS_FIELDS",
    "MODELING_DIR",
    "SHIPPED_MODELING_FILES",
    "attach_focus_adapter",
    "check_export_dir",
    "export_hf",
    "export_router_adapter",
    "hf_config_dict",
    "hf_export_config",
    "hf_export_model",
    "hf_state_dict",
    "load_modeling",
    "save_export",
    "shipped_classes",
    "with_retrofit_originals",
]

_ROUTER_KEYS = ("proj.weight", "centroids", "balance_offsets")


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    """The family's HF ``config.json`` fields for ``config`` (inverse of the import map: the
    family description's ``config_to_hf``)."""
    return config.family_spec.config_to_hf(config)


def hf_state_dict(shards: list[dict[str, Tensor]], config: ModelConfig) -> dict[str, Tensor]:
    """HF tensors (family names + routers) from our per-TP-rank state dicts."""
    geometry = Geometry(config.num_attention_heads, config.kv_heads, config.kv_channels)
    out: dict[str, Tensor] = {}
    family = config.family_spec
    for rule in family.rules(config.num_layers, config.tied):
        if rule.ours not in shards[0]:
            raise InputError(f"the checkpoint lacks {rule.ours}")
        full = unshard([s[rule.ours].float() for s in shards], rule.shard)
        for key, tensor in zip(rule.hf, rule.to_hf(geometry, full), strict=True):
            out[key] = tensor
    layer = family.hf_router_prefix
    for i in range(config.num_layers):
        for name in _ROUTER_KEYS:
            ours = f"decoder.layers.{i}.self_attention.router.{name}"
            if ours in shards[0]:
                out[layer.format(i=i) + name] = shards[0][ours].float().contiguous()
    _check_router_shapes(out, config)
    return out


_TRAINING_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def with_retrofit_originals(tensors: dict[str, Tensor], config: Config, ckpt: Path) -> dict | None:
    """A retrofit's (``train.freeze: retrofit`` from ``train.init_from_hf``) frozen weights
    replaced, in place, by the HuggingFace checkpoint's own tensors, bit for bit and in their
    original dtype (a bf16 run holds them rounded to bf16). Each is first checked to be the
    one the run froze (equal after the training precision's rounding): another directory at
    that path is refused. Returns what the export records (source, tensors replaced), or
    ``None`` when the run is not such a retrofit.

    Raises:
        MissingInputError: ``train.init_from_hf`` is gone (the export would otherwise write
            the rounded copies silently).
        InputError: a tensor there is not the one the run froze.
    """
    source = config.train.init_from_hf
    if config.train.freeze != "retrofit" or not source:
        return None
    if not Path(source).is_dir():
        raise MissingInputError(
            f"{source} (train.init_from_hf of this retrofit) is missing: the export takes the "
            f"original weights from it, bit for bit; restore it, or point train.init_from_hf in "
            f"{ckpt / 'config.yaml'} at its copy"
        )
    originals = load_hf_tensors(source, {k for k in tensors if ".router." not in k})
    rounding = _TRAINING_DTYPES[config.train.precision]
    for key, original in originals.items():
        if not torch.equal(original.to(rounding).float(), tensors[key].float()):
            raise InputError(
                f"{key} in {source} is not the tensor this retrofit froze (train.init_from_hf): "
                f"the directory holds another checkpoint now; point train.init_from_hf in "
                f"{ckpt / 'config.yaml'} at the one the run started from"
            )
        tensors[key] = original
    return {"source": str(source), "tensors": len(originals)}


def _check_router_shapes(tensors: dict[str, Tensor], config: ModelConfig) -> None:
    """Refuse routers whose shapes are not those ``config.focus`` describes (a checkpoint's
    ``config.yaml`` edited after training, or another run's), naming the field to restore."""
    focus = config.focus
    expected = {
        "centroids": ((focus.num_groups, focus.group_dim), "num_groups, group_dim"),
        "balance_offsets": ((focus.num_groups,), "num_groups"),
        "proj.weight": ((focus.group_dim, config.hidden_size), "group_dim, hidden_size"),
    }
    for key, tensor in tensors.items():
        name = key.rpartition(".router.")[2]
        if ".router." not in key or tuple(tensor.shape) == expected[name][0]:
            continue
        raise InputError(
            f"the checkpoint's {key} is {list(tensor.shape)} but its config.yaml describes "
            f"{list(expected[name][0])} (model.focus.num_groups={focus.num_groups}, "
            f"group_dim={focus.group_dim}, top_k={focus.top_k}): config.yaml was edited after "
            f"training or belongs to another run; restore its {expected[name][1]} to the "
            "trained values (top_k at most num_groups), or export the run it belongs to"
        )


def load_modeling():
    """The shipped ``modeling_focus`` module (imported as a package so its relative import
    of ``configuration_focus`` resolves)."""
    name = "focus_hf_modeling"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, MODELING_DIR / "__init__.py", submodule_search_locations=[str(MODELING_DIR)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return importlib.import_module(f"{name}.modeling_focus")


def _shipped_configuration():
    """The shipped ``configuration_focus`` module (the one :func:`load_modeling` imports)."""
    load_modeling()
    return importlib.import_module("focus_hf_modeling.configuration_focus")


def export_hf(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    max_shard_size: str = "2GB",
    overwrite: bool = False,
    tokenizer: str | os.PathLike | None = None,
    with_tokenizer: bool = True,
) -> Path:
    """Write the HF directory for ``checkpoint`` (a checkpoint or run directory); returns it.

    Every input is checked before the output is touched; the export is written next to
    ``out_dir`` and swapped in whole, so a failed export leaves an earlier one intact. An
    existing non-empty ``out_dir`` is refused unless ``overwrite``, which replaces only an
    earlier export holding nothing else (:func:`check_export_dir`).

    Args:
        tokenizer: the tokenizer to ship (a ``.model`` or a HuggingFace tokenizer directory);
            default: the copy the checkpoint holds, else the run's ``data.tokenizer`` or the one
            it trained into ``data.cache_dir``; none found is refused, naming where it looked.
        with_tokenizer: ``False`` exports without tokenizer files.
    """
    ckpt, config = exportable_checkpoint(checkpoint)
    model_cfg = config.model
    found = _tokenizer_for(config, ckpt, tokenizer) if with_tokenizer else None
    check_export_dir(out_dir, overwrite, _export_inputs(ckpt, config, found))
    tensors = hf_state_dict(trained_tp_shards(ckpt, config), model_cfg)
    originals = with_retrofit_originals(tensors, config, ckpt)
    tokenizer = None if found is None else Tokenizer(found)
    if tokenizer is not None and tokenizer.vocab_size > model_cfg.vocab_size:
        raise InputError(
            f"the run's tokenizer {tokenizer.path} has {tokenizer.vocab_size} tokens but the model "
            f"only {model_cfg.vocab_size} embeddings: it is not the tokenizer this model was "
            "trained with (check data.tokenizer in the checkpoint's config.yaml)"
        )
    model = hf_export_model(model_cfg, tensors, tokenizer)
    record = {"checkpoint": str(ckpt)}
    if originals is not None:
        record["original_weights"] = originals
    if tokenizer is not None and tokenizer.hf is None:  # the .model the tokenizer.json encodes
        digest = hashlib.sha256(Path(tokenizer.path).read_bytes()).hexdigest()
        record["tokenizer_source"] = {"path": str(tokenizer.path), "sha256": digest}
    return save_export(
        model, out_dir, tokenizer, record, max_shard_size=max_shard_size, overwrite=overwrite
    )


def _export_inputs(ckpt: Path, config: Config, tokenizer: Path | None) -> list[tuple]:
    """What an export reads, as :func:`~focus_pretrain.storage.files.check_output_dir`'s
    ``inputs``: the checkpoint, the checkpoints directory it is in, a retrofit's original
    weights and the tokenizer (an output may be none of these, hold one or lie inside one),
    and the run directory (an output may lie inside it, e.g. ``runs/x/export``)."""
    inputs: list[tuple] = [("the checkpoint", ckpt)]
    root = ckpt.parent
    if (root / LATEST).exists() or root.name == "checkpoints":
        inputs.append(("the checkpoints directory", root))
        if root.name == "checkpoints":
            inputs.append(("the run directory", root.parent, "may_hold_output"))
    if config.train.init_from_hf:
        inputs.append(("train.init_from_hf", config.train.init_from_hf))
    if tokenizer is not None:
        inputs.append(("the tokenizer", tokenizer))
    return inputs


def shipped_classes(family: str) -> tuple[type, type]:
    """``(Focus<hf_config_class>, Focus<hf_model_class>)`` of the shipped modeling code for our
    family ``family`` (``FocusLlamaConfig``, ``FocusLlamaForCausalLM``): the shipped code makes
    them from transformers' classes that the family's description names."""
    description = family_description(family)
    modeling = load_modeling()
    return (
        modeling.focus_config_class(description.hf_config_class),
        modeling.focus_model_class(description.hf_model_class),
    )


def hf_export_config(model_cfg: ModelConfig, tokenizer=None):
    """``(model class, config)`` of the shipped Focus HF model of ``model_cfg``: the config is
    what the export's ``config.json`` holds (the family's fields, the ``focus`` section, the
    auto_map to the shipped code and the tested transformers range)."""
    config_cls, model_cls = shipped_classes(model_cfg.family)
    hf_config = config_cls(
        focus=_focus_section(model_cfg.focus),
        focus_transformers=sys.modules[config_cls.__module__].export_record(),
        bos_token_id=tokenizer.bos if tokenizer is not None else None,
        eos_token_id=tokenizer.eod if tokenizer is not None else None,
        pad_token_id=tokenizer.eod if tokenizer is not None else None,  # no pad token: eos
        **hf_config_dict(model_cfg),
    )
    hf_config.architectures = [model_cls.__name__]
    hf_config.auto_map = {
        "AutoConfig": f"configuration_focus.{config_cls.__name__}",
        "AutoModelForCausalLM": f"modeling_focus.{model_cls.__name__}",
    }
    return model_cls, hf_config


def hf_export_model(model_cfg: ModelConfig, tensors: dict[str, Tensor], tokenizer=None):
    """The shipped Focus HF model of ``model_cfg`` holding ``tensors`` (HF names, routers
    included; see :func:`hf_state_dict`), built on the meta device and assigned them."""
    model_cls, hf_config = hf_export_config(model_cfg, tokenizer)
    with torch.device("meta"):
        model = model_cls(hf_config)
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    missing = [k for k in missing if not (model_cfg.tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"export does not fit the HF model: missing {missing}, extra {unexpected}")
    if model_cfg.tied:
        model.tie_weights()
    return model


def save_export(
    model,
    out_dir: str | os.PathLike,
    tokenizer=None,
    record=None,
    *,
    max_shard_size="2GB",
    overwrite: bool = False,
) -> Path:
    """Write ``model`` (from :func:`hf_export_model`) as an export directory: safetensors,
    ``config.json``, the shipped modeling code, the tokenizer (when given) and
    ``focus_export.json`` (``record``: where it came from, the files written and the sha256 of
    each shipped ``.py`` file). Written next to ``out_dir`` and swapped in whole; returns the
    directory. An existing non-empty ``out_dir`` is refused unless ``overwrite``, which
    replaces only an earlier export (:func:`check_export_dir`)."""
    check_export_dir(out_dir, overwrite)
    out = Path(out_dir)
    with partial_dir(out) as work:
        model.save_pretrained(work, max_shard_size=max_shard_size)
        for name in SHIPPED_MODELING_FILES:
            shutil.copyfile(MODELING_DIR / name, work / name)
        if tokenizer is not None:
            _save_tokenizer(tokenizer, work)
        record = dict(record or {})
        record["remote_code_sha256"] = shipped_code_digests(work)
        record["files"] = [*sorted(p.name for p in work.iterdir()), EXPORT_MARKER]
        (work / EXPORT_MARKER).write_text(json.dumps(record, indent=1))
        return replace_dir(work, out)


def export_router_adapter(
    checkpoint: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False
) -> Path:
    """Only the routers of ``checkpoint`` (a retrofit): ``focus_adapter.safetensors`` plus
    ``focus_adapter.json``, attachable to the original HF model with
    :func:`attach_focus_adapter` (a few hundred KB instead of a model copy). An existing
    non-empty ``out_dir`` is refused unless ``overwrite``, which replaces only an earlier
    adapter (see :func:`check_export_dir`); written next to it and swapped in."""

    ckpt, config = exportable_checkpoint(checkpoint)
    check_export_dir(out_dir, overwrite, _export_inputs(ckpt, config, None), ADAPTER_MARKER)
    shards = trained_tp_shards(ckpt, config)  # the routers as trained (fp32 masters)
    routers = {k: v for k, v in hf_state_dict(shards, config.model).items() if ".router." in k}
    if not routers:
        raise InputError(f"{ckpt} has no routers (focus disabled or window-only)")
    out = Path(out_dir)
    with partial_dir(out) as work:
        return _write_adapter(work, out, routers, config, ckpt)


def _write_adapter(work: Path, out: Path, routers: dict, config: Config, ckpt: Path) -> Path:
    """The adapter's files into ``work``, then swapped in as ``out``."""
    from safetensors.torch import save_file

    save_file(routers, str(work / "focus_adapter.safetensors"))
    meta = {
        "model_type": config.model.family_spec.hf_model_type,  # gemma3: gemma3_text
        "focus": _focus_section(config.model.focus),
        "parameters": sum(t.numel() for k, t in routers.items() if "balance" not in k),
        "focus_transformers": _shipped_configuration().export_record(),
        "checkpoint": str(ckpt),
        "files": ["focus_adapter.safetensors", ADAPTER_MARKER],
    }
    (work / ADAPTER_MARKER).write_text(json.dumps(meta, indent=1))
    return replace_dir(work, out)


def attach_focus_adapter(model, adapter_dir: str | os.PathLike):
    """Attach a router adapter to an unmodified HF causal LM, in place (see the shipped
    ``modeling_focus.attach_focus_adapter``)."""
    return load_modeling().attach_focus_adapter(model, adapter_dir)


# Training-only knobs the shipped modeling code does not read (an export routes causally, with
# the balance offsets saved as tensors, and does not re-check inputs; a model trained sparsely,
# training_mode hard, infers like any other: the same hard pattern); every other FocusConfig
# field goes into config.json's ``focus`` section. The shipped FOCUS_DEFAULTS must list exactly
# the exported fields with FocusConfig's defaults (tested).
NOT_EXPORTED_FOCUS_FIELDS = (
    "balance",
    "sinkhorn_iters",
    "balance_rate",
    "check_finite",
    "training_mode",
    "soft_warmup_steps",
)
EXPORTED_FOCUS_FIELDS = tuple(
    f.name for f in dataclasses.fields(FocusConfig) if f.name not in NOT_EXPORTED_FOCUS_FIELDS
)


def _focus_section(focus) -> dict[str, Any]:
    """The FocusConfig fields the shipped HF modeling code reads. A backend the shipped code
    does not implement (``segments``, ``sdpa``: backends choose speed, never the pattern)
    becomes ``auto``, the shipped code's own choice; the others stay as trained."""
    section = {name: getattr(focus, name) for name in EXPORTED_FOCUS_FIELDS}
    shipped = _shipped_configuration().FOCUS_CHOICES
    for key in ("backend", "inference_backend"):
        if section[key] not in shipped[key]:
            section[key] = "auto"
    return section


def _tokenizer_for(config: Config, ckpt: Path, given: str | os.PathLike | None) -> Path:
    """The tokenizer an export ships: ``given``, else the copy in the checkpoint, else the
    run's (``data.tokenizer``, or the one it trained into ``data.cache_dir``).

    Raises:
        MissingInputError: ``given`` does not exist, or none of the others is found (a
            relative ``data.cache_dir`` or ``data.tokenizer`` is read from the current
            directory): names where it looked and the options.
    """
    if given is not None:
        if not Path(given).exists():
            raise MissingInputError(f"--tokenizer {given} does not exist")
        return Path(given)
    copy = tokenizer_copy(ckpt)
    if copy is not None:
        return copy
    path = tokenizer_path_for(config.data, config.run.seed)
    if Path(path).exists():
        return Path(path)
    relative = (
        "" if Path(path).is_absolute() else f", relative to the current directory {os.getcwd()}"
    )
    raise MissingInputError(
        f"the run's tokenizer {path} is not found{relative}; the checkpoint {ckpt} holds no "
        "copy (it predates checkpoints that carry their tokenizer): run the export from the "
        "directory the run was trained in, pass --tokenizer PATH (tokenizer=), or "
        "--no-tokenizer (with_tokenizer=False) to export without tokenizer files"
    )


def _save_tokenizer(tokenizer, out: Path) -> None:
    """HF tokenizer files: an HF tokenizer copied, or our SentencePiece BPE model rebuilt as a
    ``tokenizers`` BPE with the same pieces and merges, dummy prefix, digit splitting and byte
    fallback (what Llama's ``tokenizer.json`` does), encoding identically, also text that
    spells a special token (``<s>``, ``</s>``, ``<unk>``: text, as SentencePiece reads it;
    the ids come from ``bos_token_id`` and the like)."""
    if tokenizer.hf is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tokenizer.path / name).is_file():
                shutil.copyfile(tokenizer.path / name, out / name)
        return
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    spm = SentencePieceExtractor(str(tokenizer.path)).extract(models.BPE)
    bpe = models.BPE(
        vocab=spm["vocab"],
        merges=spm["merges"],
        unk_token="<unk>",
        byte_fallback=True,
        fuse_unk=True,
    )
    hf = HFTokenizer(bpe)
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.pre_tokenizer = pre_tokenizers.Digits(individual_digits=True)
    hf.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    hf.add_special_tokens(["<unk>", "<s>", "</s>"])
    fast = PreTrainedTokenizerFast(  # split_special_tokens: "<s>" in text is text, as it was
        tokenizer_object=hf,  # in training (SentencePiece encodes it as pieces; an HTML <s>)
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        split_special_tokens=True,
    )
    fast.save_pretrained(out)
