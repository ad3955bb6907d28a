"""HF export refuses what the shipped modeling code cannot reproduce, and writes configs the
family's ``transformers`` config class accepts."""

from __future__ import annotations

import dataclasses

import pytest

from focus_pretrain.config import load_config, save_config
from focus_pretrain.convert import export_hf, export_router_adapter

pytestmark = pytest.mark.hf  # also run against other transformers (tools/hf_compat.py)


def _checkpoint(root, *overrides: str):
    """A checkpoint directory as the trainer writes it (the resolved ``config.yaml`` next to an
    ``mp_rank_00_model_states.pt``), its weights a placeholder: what is refused is refused
    before any weight is read."""
    ckpt = root / "checkpoints" / "step_00000001"
    save_config(load_config(None, list(overrides)), ckpt / "config.yaml")
    (ckpt / "mp_rank_00_model_states.pt").write_bytes(b"")
    (root / "checkpoints" / "latest").write_text(ckpt.name)
    return ckpt


@pytest.mark.parametrize("export", [export_hf, export_router_adapter], ids=["full", "adapter"])
def test_sinkhorn_runs_are_refused_by_both_exports(tmp_path, export):
    """Sinkhorn routing is balanced over the sequence; both the full export and the router
    adapter route per token, so both refuse it (one check, one message)."""
    _checkpoint(tmp_path, "model.focus.balance=sinkhorn")
    with pytest.raises(
        NotImplementedError,
        match=r"model.focus.balance=sinkhorn, .*not causal.*full model or router adapter.*"
        r"balance=causal",
    ):
        export(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_gemma2_query_pre_attn_scalar_exports_as_an_int(tmp_path):
    """An imported Gemma-2 (through its recipe, where the value becomes a float) exports a
    config.json the shipped FocusGemma2Config (transformers' Gemma2Config: an int) accepts,
    with the value unchanged; a non-integral value is refused at export."""
    import json

    import yaml

    from focus_pretrain.config import config_to_dict
    from focus_pretrain.convert import hf_model_config
    from focus_pretrain.convert.hf_export import hf_config_dict, load_modeling
    from focus_pretrain.convert.hf_import import _architecture
    from tests.multiprocess.test_hf_import import make_hf_model

    _, path = make_hf_model("gemma2", tmp_path)  # query_pre_attn_scalar=24
    imported = hf_model_config(path)
    assert imported.query_pre_attn_scalar == 24  # exact on import
    recipe = tmp_path / "retrofit.yaml"
    recipe.write_text(
        yaml.safe_dump({"model": config_to_dict(imported), "data": {"seq_length": 24}})
    )
    model = load_config(recipe).model  # what training saves and export reads
    assert model.query_pre_attn_scalar == 24.0
    config_cls = load_modeling().FocusGemma2Config
    exported = config_cls(**hf_config_dict(model))
    exported.save_pretrained(tmp_path / "export")
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert written["query_pre_attn_scalar"] == 24 and type(written["query_pre_attn_scalar"]) is int
    assert config_cls.from_pretrained(tmp_path / "export").query_pre_attn_scalar == 24
    back = _architecture({**written, "model_type": "gemma2"})  # re-import of the export
    assert back["query_pre_attn_scalar"] == imported.query_pre_attn_scalar
    odd = dataclasses.replace(model, query_pre_attn_scalar=24.5)
    with pytest.raises(ValueError, match=r"query_pre_attn_scalar is 24.5, not an integer"):
        hf_config_dict(odd)
