"""Resharding's single-process parts: the merge rules a checkpoint declares, the layout check
that refuses a plain resume at another layout, and the universal folder's state files."""

from __future__ import annotations

import re

import pytest
import torch

from focus_pretrain.checkpoint.layout import check_layout
from focus_pretrain.checkpoint.reshard import _normalize_state, universal_checkpoint_info
from focus_pretrain.config import load_config, save_config
from focus_pretrain.train.resume import check_resume

RECIPE = "configs/tiny.yaml"


def _config(*sets: str):
    return load_config(RECIPE, list(sets))


def _matching(info: dict, key: str, name: str) -> bool:
    return any(re.match(p, name) for p in info[key])


def test_universal_info_follows_the_shard_kinds():
    """Row-parallel weights concatenate along dim 1, the gated fc1 as two sub-parameters,
    norms and routers are replicated; column-parallel ones (the per-group fused QKV, the
    embedding) are DeepSpeed's default. One exact pattern per parameter: layer 1's never
    matches layer 11's."""
    from deepspeed.checkpoint import constants as c

    model = _config("model.num_layers=12").model
    names = [
        "embedding.word_embeddings.weight",
        "decoder.layers.1.self_attention.linear_qkv.weight",
        "decoder.layers.1.self_attention.linear_proj.weight",
        "decoder.layers.1.mlp.linear_fc1.weight",
        "decoder.layers.1.mlp.linear_fc2.weight",
        "decoder.layers.1.input_layernorm.weight",
        "decoder.layers.1.self_attention.router.centroids",
        "output_layer.weight",
    ]
    info = universal_checkpoint_info(model, names)
    row, glu = c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS, c.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0
    replicated = c.TP_REPLICATED_PARAMETER_PATTERNS
    kinds = {
        name: [k for k in (row, glu, replicated) if _matching(info, k, name)] for name in names
    }
    assert kinds == {
        "embedding.word_embeddings.weight": [],
        "decoder.layers.1.self_attention.linear_qkv.weight": [],
        "decoder.layers.1.self_attention.linear_proj.weight": [row],
        "decoder.layers.1.mlp.linear_fc1.weight": [glu],
        "decoder.layers.1.mlp.linear_fc2.weight": [row],
        "decoder.layers.1.input_layernorm.weight": [replicated],
        "decoder.layers.1.self_attention.router.centroids": [replicated],
        "output_layer.weight": [],
    }
    assert not _matching(info, row, "decoder.layers.11.mlp.linear_fc2.weight")
    gpt2 = universal_checkpoint_info(
        _config("model.family=gpt2").model, ["decoder.layers.0.mlp.linear_fc1.weight"]
    )
    assert gpt2[glu] == []  # GPT-2's fc1 is a plain column-parallel weight


def _checkpoint(tmp_path, dp: int, *sets: str):
    """A checkpoint directory as the layout check sees it: the recipe and one (empty) ZeRO file
    per data-parallel and tensor-parallel rank."""
    config = _config(*sets)
    save_config(config, tmp_path / "config.yaml")
    for d in range(dp):
        for t in range(config.parallel.tensor_parallel_size):
            (tmp_path / f"zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt").touch()
    return tmp_path


def _layout(dp: int, tp: int = 1, zero: int = 1, cp: int = 1) -> dict[str, int]:
    return {
        "data_parallel_size": dp,
        "tensor_parallel_size": tp,
        "context_parallel_size": cp,
        "zero_stage": zero,
    }


def test_a_plain_resume_at_another_layout_is_refused_naming_the_key(tmp_path):
    """Another tensor-parallel or data-parallel size, or ZeRO-3 against ZeRO-1/2, is refused
    (before anything is built) with both values and ``train.load_universal``; DeepSpeed itself
    fails obscurely there (a missing ``attention.dense.weight``, a bare ``AssertionError``).
    ZeRO-1 and ZeRO-2 share one checkpoint format and resume plainly."""
    ckpt = _checkpoint(tmp_path, 2, "parallel.tensor_parallel_size=2", "parallel.zero_stage=3")
    now = _config("parallel.zero_stage=3")
    with pytest.raises(ValueError) as err:
        check_resume(ckpt, now, _layout(2, 1, 3))
    message = str(err.value)
    assert "parallel.tensor_parallel_size: 2 in the checkpoint, 1 now" in message
    assert "train.load_universal=true" in message and "data-parallel size" not in message
    with pytest.raises(ValueError, match="data-parallel size: 2 in the checkpoint, 4 now"):
        check_resume(ckpt, now, _layout(4, 2, 3))
    with pytest.raises(ValueError, match=r"parallel\.zero_stage: 3 in the checkpoint, 2 now"):
        check_resume(ckpt, now, _layout(2, 2, 2))
    assert check_resume(ckpt, now, _layout(2, 2, 3)) == []  # the saved layout
    universal = _config("parallel.zero_stage=3", "train.load_universal=true")
    assert check_layout(ckpt, universal, _layout(2, 1, 3))  # reshards
    assert not check_layout(ckpt, universal, _layout(2, 2, 3))  # plain at the saved layout

    zero2 = _checkpoint(tmp_path / "z2", 2, "parallel.zero_stage=2")
    assert not check_layout(zero2, _config(), _layout(2, 1, 1))  # ZeRO-2 -> ZeRO-1: plain
    with pytest.raises(ValueError, match="needs ZeRO on both sides"):
        check_layout(zero2, universal, _layout(1, 1, 0))


def test_universal_state_files_carry_the_full_shape_and_merge_rule(tmp_path):
    """ZeRO-3 at TP=1 leaves flat tensors: each becomes the full-shaped tensor with how tensor
    parallelism cuts it (what DeepSpeed's ZeRO-1/2 universal loader reads)."""
    from deepspeed.checkpoint import constants as c

    flat = torch.arange(24.0)
    for kind, extra in (
        ("row", {c.CAT_DIM: 1}),
        ("glu", {c.CAT_DIM: 0, c.PARAM_N_SUB_PARAMS: 2}),
        ("column", {c.CAT_DIM: 0}),
        ("replicated", {}),
    ):
        path = tmp_path / f"{kind}.pt"
        torch.save(flat, path)
        _normalize_state(path, torch.Size([4, 6]), kind)
        state = torch.load(path, weights_only=False)
        assert torch.equal(state.pop(c.PARAM), flat.view(4, 6)) and state == extra, kind


def test_merged_shards_are_the_whole_tensor():
    """Buffers and frozen weights are merged over tensor-parallel ranks by the shard kinds:
    the exact inverse of the cut a rank loads (``families.shard``)."""
    from focus_pretrain.model.tp_rules import shard, unshard

    full = torch.randn(8, 6)
    for kind in ("column", "row", "glu", "replicated"):
        for size in (1, 2):
            pieces = [shard(full, kind, rank, size) for rank in range(size)]
            assert torch.equal(unshard(pieces, kind), full), (kind, size)
    glu = [shard(full, "glu", rank, 2) for rank in range(2)]
    assert not torch.equal(torch.cat(glu), full)  # a plain concatenation would be wrong


def test_a_conversion_deletes_only_its_own_scratch_directory(tmp_path):
    """``convert_to_universal``'s deletions: a checkpoint it cannot convert (ZeRO stage 0) is
    refused before anything is touched; a ``.tmp-universal`` it did not make (no mark) is
    refused and left as it was; its own leftover of an interrupted conversion is cleared."""
    from focus_pretrain.checkpoint import reshard
    from focus_pretrain.errors import InputError

    ckpt = tmp_path / "step_00000002"
    ckpt.mkdir()
    save_config(_config("parallel.zero_stage=0"), ckpt / "config.yaml")
    foreign = ckpt / ".tmp-universal"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("the user's")
    with pytest.raises(ValueError, match="saved without ZeRO"):
        reshard.convert_to_universal(ckpt)
    assert (foreign / "notes.txt").read_text() == "the user's"
    with pytest.raises(InputError, match=r"\.tmp-universal exists but was not made by"):
        reshard._scratch(ckpt)
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    (foreign / "notes.txt").unlink()
    with pytest.raises(InputError, match="was not made by"):  # empty but unmarked: not ours
        reshard._scratch(ckpt)
    (foreign / reshard.SCRATCH_MARK).touch()  # an interrupted conversion of ours
    (foreign / "source").mkdir()
    (foreign / "source" / "partial.pt").write_bytes(b"half")
    work = reshard._scratch(ckpt)
    assert work == foreign and sorted(p.name for p in work.iterdir()) == [reshard.SCRATCH_MARK]
    assert sorted(p.name for p in ckpt.iterdir()) == [".tmp-universal", "config.yaml"]
