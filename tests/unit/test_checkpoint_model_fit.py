"""A checkpoint that does not fit the model being built is refused in one line naming why:
the overrides that changed the weights' shapes (with the checkpoint's values), or, with none,
the checkpoint's own config."""

from __future__ import annotations

import pathlib

import pytest
import torch

from focus_pretrain.checkpoint.model import _load_weights, _model_overrides
from focus_pretrain.config import load_config
from focus_pretrain.errors import InputError

TINY = pathlib.Path(__file__).parents[2] / "configs" / "tiny.yaml"


def test_only_the_overrides_that_shape_weights_are_named():
    trained = load_config(TINY)
    changed = load_config(
        TINY,
        [
            "model.num_layers=3",
            "model.focus.num_groups=8",
            "model.focus.top_k=2",  # the pattern: free
            "model.focus.inference_backend=flex",  # free
        ],
    )
    assert _model_overrides(trained, changed) == [
        ("model.focus.num_groups", 4, 8),
        ("model.num_layers", 2, 3),
    ]
    free = ["model.focus.sinks=4", "model.max_seq_length=256", "model.rotary_base=5e5"]
    assert _model_overrides(trained, load_config(TINY, free)) == []  # RoPE: no position table
    gpt2 = ["model.family=gpt2"]
    longer = load_config(TINY, [*gpt2, "model.max_seq_length=256"])
    assert _model_overrides(load_config(TINY, gpt2), longer) == [("model.max_seq_length", 128, 256)]
    dense = load_config(TINY, ["model.focus.enabled=false"])
    assert _model_overrides(dense, trained) == [("model.focus.enabled", False, True)]


@pytest.mark.parametrize("shape", [(4, 3), (5, 4)], ids=["missing-key", "other-shape"])
def test_a_mismatch_names_the_override_or_the_checkpoint(shape):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))  # the model built now: "0.weight" [4, 4]
    state = {"0.weight": torch.randn(*shape), "0.bias": torch.randn(shape[0])}
    if shape == (4, 3):
        state = {"0.bias": torch.randn(4)}  # a weight the checkpoint lacks
    trained = load_config(TINY)
    grown = load_config(TINY, ["model.num_layers=3"])
    with pytest.raises(InputError, match=r"--set model.num_layers=3 \(the checkpoint's: 2\) "):
        _load_weights(model, state, pathlib.Path("ckpt"), trained, grown)
    with pytest.raises(InputError, match=r"ckpt does not fit the model its config\.yaml describes"):
        _load_weights(model, state, pathlib.Path("ckpt"), trained, trained)
    fitting = {"0.weight": torch.randn(4, 4), "0.bias": torch.randn(4)}
    _load_weights(model, fitting, pathlib.Path("ckpt"), trained, grown)  # loads: no refusal
    torch.testing.assert_close(model[0].weight.detach(), fitting["0.weight"])
