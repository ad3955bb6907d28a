"""Workers for the sequence-parallel tests: TP=2 with Megatron sequence parallelism against the
TP=1 model, in the same two gloo processes (the TP=1 references first, then TP=2).

A case is ``(model_kwargs, focus_kwargs, run)`` with ``run`` one of ``"plain"`` (autograd, one
micro-batch, then an eval forward), ``"zero1"``/``"zero2"``/``"zero3"`` (a DeepSpeed engine at
that ZeRO stage, two micro-batches of gradient accumulation), ``"zero2-unreduced"`` (as
``zero2`` without the gradient hooks of :mod:`focus_pretrain.parallel.sequence_parallel`), and
``"documents"`` (``plain`` with packed documents: document starts and restarting RoPE
positions). :func:`sp_cp_against_tp1` does the same at TP=2 x CP=2 (four processes).
"""

from __future__ import annotations

import torch

from tests.multiprocess.workers_model import _batch, _gather_last_dim

GRAD_ACCUM = 2


def _micro_batches(config, run: str) -> list[dict]:
    """The micro-batches of a case: ``{"args", "kwargs"}`` for the model's forward."""
    from focus_pretrain.model.packing import document_params

    count = GRAD_ACCUM if run.startswith("zero") else 1
    batches = []
    for i in range(count):
        tokens, positions, labels = _batch(config, seed=3 + i)
        kwargs = {"labels": labels}
        if run == "documents":
            starts = torch.tensor([0] * 13 + [13] * 20 + [33] * 7)  # [s] three documents
            documents = torch.stack([starts, torch.full_like(starts, 0)])  # [b, s]
            rope = torch.arange(40)[None].expand(2, 40) - documents  # [b, s] restart per doc
            kwargs["packed_seq_params"] = document_params(documents, rope, 40)
        batches.append({"args": (tokens, positions, None), "kwargs": kwargs})
    return batches


def _router_stats(model) -> list[dict]:
    """Each router's accumulated balance target and top-1 load counts (training forwards)."""
    from focus_pretrain.focus import FocusRouter

    return [
        {"target": r.balance_target(), "load": r.pop_load()}
        for r in model.modules()
        if isinstance(r, FocusRouter)
    ]


def _plain(model, batches: list[dict], world_size: int) -> dict:
    model.train()
    losses = []
    for batch in batches:
        loss = model(*batch["args"], **batch["kwargs"]).float().mean()  # [b, s] -> []
        (loss / len(batches)).backward()
        losses.append(loss.detach())
    stats = _router_stats(model)
    grads = {n: _tp_full(p, p.grad) for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    with torch.no_grad():
        kwargs = {k: v for k, v in batches[0]["kwargs"].items() if k != "labels"}
        logits = _gather_last_dim(model(*batches[0]["args"], **kwargs), world_size)
    return dict(losses=losses, grads=grads, routers=stats, logits=logits)


def _deepspeed(model, batches: list[dict], stage: int) -> dict:
    """Loss and every full gradient read back from DeepSpeed (``safe_get_full_grad``: works
    when ZeRO-2/3 moved them into partitioned buffers) after the accumulation boundary."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from focus_pretrain.parallel.mpu import MegatronMPU

    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": len(batches),
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
        },
        mpu=MegatronMPU(),
    )
    engine.train()
    losses = []
    for i, batch in enumerate(batches):
        loss = engine(*batch["args"], **batch["kwargs"]).float().mean()
        engine.backward(loss)
        losses.append(loss.detach())
        if i < len(batches) - 1:
            engine.step()  # inside the accumulation window: counts the micro-batch only
    stats = _router_stats(model)
    grads = {}
    for name, param in model.named_parameters():
        grad = safe_get_full_grad(param)  # collective under ZeRO-3: every rank calls it
        if grad is not None:
            grads[name] = _tp_full(param, grad.detach().clone())
    engine.destroy()
    return dict(losses=losses, grads=grads, routers=stats)


def _build(model_kwargs: dict, focus_kwargs: dict, sequence_parallel: bool):
    """The case's model, the same weights at every tensor-parallel size (CPU initialisation
    from one master copy, fixed seeds)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from focus_pretrain.focus import FocusConfig
    from focus_pretrain.model import ModelConfig, build_model

    config = ModelConfig(focus=FocusConfig(**focus_kwargs), **model_kwargs)
    model_parallel_cuda_manual_seed(43)
    torch.manual_seed(1)
    return config, build_model(config, sequence_parallel=sequence_parallel)


def _run_case(world_size: int, case: tuple, sequence_parallel: bool) -> dict:
    """The TP=1 reference (plain autograd) or this rank's TP=``world_size`` run with sequence
    parallelism (through DeepSpeed for the ``zero*`` runs)."""
    from focus_pretrain.parallel.sequence_parallel import (
        reduce_sequence_parallel_grads,
        sequence_parallel_parameters,
    )

    model_kwargs, focus_kwargs, run = case
    config, model = _build(model_kwargs, focus_kwargs, sequence_parallel)
    if sequence_parallel and run != "zero2-unreduced":
        reduce_sequence_parallel_grads(model)
    batches = _micro_batches(config, run)
    if sequence_parallel and run.startswith("zero"):
        out = _deepspeed(model, batches, int(run[4]))
    else:
        out = _plain(model, batches, world_size)
    out["tagged"] = sorted(n for n, _ in sequence_parallel_parameters(model))
    return out


def sp_against_tp1(rank: int, world_size: int, cases: list) -> dict:
    """Per case: the TP=1 result (``"one"``) and this rank's TP=``world_size`` result with
    sequence parallelism (``"sp"``)."""
    from megatron.core import parallel_state

    from focus_pretrain.parallel import apply_cpu_shim

    apply_cpu_shim()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    one = [_run_case(1, case, False) for case in cases]
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    sp = [_run_case(world_size, case, True) for case in cases]
    return {"one": one, "sp": sp}


def _tp_full(param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel shard reassembled over the tensor-parallel group (TP=1 layout)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(
        parts, tensor.contiguous(), group=parallel_state.get_tensor_model_parallel_group()
    )
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    chunks = [part.chunk(stride, dim=dim) for part in parts]  # [rank][stride]
    return torch.cat([chunks[r][k] for k in range(stride) for r in range(tp)], dim=dim)


def sp_cp_against_tp1(rank: int, world_size: int, cases: list) -> dict:
    """Per ``(model_kwargs, focus_kwargs, cp_mode, sequence_parallel)``: the TP=1 loss and
    gradients (``"one"``) and this rank's at TP=2 x CP=``world_size / 2`` (``"tp_cp"``), the
    gradients summed over the context-parallel group as DeepSpeed's data x context-parallel
    reduction would."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from focus_pretrain.parallel import apply_context_parallel, apply_cpu_shim, shard_batch
    from focus_pretrain.parallel.sequence_parallel import reduce_sequence_parallel_grads

    apply_cpu_shim()
    out: dict = {"one": [], "tp_cp": []}
    for tp, cp in ((1, 1), (2, world_size // 2)):
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, context_parallel_size=cp
        )
        group = parallel_state.get_context_parallel_group()
        for model_kwargs, focus_kwargs, cp_mode, sequence_parallel in cases:
            config, model = _build(model_kwargs, focus_kwargs, tp > 1 and sequence_parallel)
            tokens, positions, labels = _batch(config, s=48)
            batch = dict(tokens=tokens, positions=positions, labels=labels)
            if tp > 1:
                reduce_sequence_parallel_grads(model)
                apply_context_parallel(model, group, cp_mode)
                batch = shard_batch(batch, group)
            model.train()
            per_token = model(batch["tokens"], batch["positions"], None, labels=batch["labels"])
            loss = per_token.float().sum() / labels.numel()  # this rank's share of the mean
            loss.backward()
            grads = {}
            for name, p in model.named_parameters():
                grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()
                dist.all_reduce(grad, group=group)  # the CP ranks' shares add up
                grads[name] = _tp_full(p, grad)
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=group)
            out["one" if tp == 1 else "tp_cp"].append(dict(loss=loss, grads=grads))
        parallel_state.destroy_model_parallel()
    return out
