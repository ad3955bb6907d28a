"""The trainer under sequence parallelism: its gradient hooks keep the replicated parameters
of the tensor-parallel ranks identical (the run is the shared ``tp2-sp-cp2-ring`` layout run,
which ``test_train.py`` also compares with one process)."""

from __future__ import annotations

import pytest
import torch

from focus_pretrain.checkpoint.read import megatron_state_dict

pytestmark = pytest.mark.multiprocess


def test_replicated_parameters_stay_identical_across_tensor_parallel_ranks(layout_run):
    """Norm weights and routers' projections see only their rank's slice of the sequence: had
    DeepSpeed stepped each rank with its own partial gradient (the trainer without
    ``reduce_sequence_parallel_grads``), the two TP ranks' copies would differ after 3 steps."""
    _, run = layout_run("tp2-sp-cp2-ring")
    (rank0, config), (rank1, _) = (megatron_state_dict(run, 2, r) for r in (0, 1))
    assert config.parallel.sequence_parallel and config.parallel.tensor_parallel_size == 2
    replicated = [
        name
        for name in rank0
        if name.endswith("norm.weight") or name.endswith(("router.proj.weight", "centroids"))
    ]
    assert any("router.proj" in n for n in replicated) and any("layernorm" in n for n in replicated)
    initial = torch.ones_like(rank0["decoder.final_layernorm.weight"])
    assert not torch.equal(rank0["decoder.final_layernorm.weight"], initial)  # they trained
    for name in replicated:
        torch.testing.assert_close(rank1[name], rank0[name], rtol=0, atol=0, msg=name)
