"""The recipe of a retrofit: a local HuggingFace checkpoint's architecture, a Focus section, the
checkpoint's own tokenizer and ``train.init_from_hf``, as the recipe sections that
``tools/import_hf.py`` prints and ``focus-pretrain retrofit`` writes (on a base recipe). Its
report is :mod:`focus_pretrain.eval.retrofit_report`'s."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from focus_pretrain.convert.hf_import import (
    ARCHITECTURE_FIELDS,
    check_tokenizer_matches,
    checkpoint_tokenizer,
    hf_model_config,
    import_hf,
)

# Attention sinks of a retrofit's Focus section: the first tokens stay visible to every query.
# A pretrained model parks much of its attention on them (StreamingLLM); without them the hard
# pattern of a real 135M model lost +0.62 nats, with 4 +0.03 (docs/experiments.md, E7).
RETROFIT_SINKS = 4
# Which groups a retrofit's keys count in: also their predecessor's (focus.key_groups). Trained
# and inferred with it, E7's hard top-1 lost about half the method's gap to the original
# (SmolLM2-135M and Qwen2.5-Coder-0.5B, in-domain and on far evidence) and found more of RULER's
# needles, for more pairs kept (a top-1 key is in up to 2 groups; docs/experiments.md, E7).
RETROFIT_KEY_GROUPS = "own_and_previous"


def retrofit_sections(
    hf_dir: str | os.PathLike,
    *,
    groups: int = 4,
    window: int = 128,
    seq_length: int = 1024,
    sinks: int | None = None,
    key_groups: str | None = None,
) -> tuple[dict[str, Any], dict[str, int]]:
    """``(sections, summary)``: the recipe sections retrofitting ``hf_dir`` (``run`` name and
    output directory; ``model`` with its architecture and ``focus`` (``sinks``: default
    :data:`RETROFIT_SINKS`; ``key_groups``: default :data:`RETROFIT_KEY_GROUPS`);
    ``data.tokenizer`` and ``data.seq_length``, ``seq_length`` at most the model's maximum;
    ``train.init_from_hf`` and ``freeze: retrofit``) and what was checked (``tensors``,
    ``parameters``).

    Every tensor is mapped through our key maps with its shape checked (no model built).

    Raises:
        ValueError: the checkpoint is unsupported or inconsistent, or ships no tokenizer this
            project reads (the message names the fix; see
            :func:`~focus_pretrain.convert.hf_import.check_tokenizer_matches`).
        FileNotFoundError: its ``config.json`` or weights are missing.
    """
    config = hf_model_config(hf_dir)
    state = import_hf(hf_dir, config, tp_rank=0)
    tokenizer = checkpoint_tokenizer(hf_dir)
    if tokenizer is None:
        check_tokenizer_matches(hf_dir, None)  # raises, naming what to do
    model = {
        name: getattr(config, name)
        for name in ("family", *ARCHITECTURE_FIELDS[1:], "max_seq_length")
        if getattr(config, name) is not None
    }
    if config.rope_scaling is not None:  # a dataclass: plain YAML, unset fields left out
        scaling = dataclasses.asdict(config.rope_scaling)
        model["rope_scaling"] = {k: v for k, v in scaling.items() if v is not None}
    sinks = RETROFIT_SINKS if sinks is None else sinks
    key_groups = RETROFIT_KEY_GROUPS if key_groups is None else key_groups
    model["focus"] = {
        "num_groups": groups,
        "window": window,
        "sinks": sinks,
        "key_groups": key_groups,
    }
    name = f"retrofit-{Path(hf_dir).resolve().name}"
    sections = {
        "run": {"name": name, "output_dir": f"runs/{name}"},
        "model": model,
        "data": {"tokenizer": tokenizer, "seq_length": min(seq_length, config.max_seq_length)},
        "train": {"init_from_hf": str(hf_dir), "freeze": "retrofit"},
    }
    summary = {"tensors": len(state), "parameters": sum(t.numel() for t in state.values())}
    return sections, summary
