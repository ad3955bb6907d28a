"""Workers for the distillation tests (real gloo processes; megatron-core through the CPU shim)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.multiprocess.workers_model import _build, _gather_last_dim, _init


def _random_logits(b: int, s: int, vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Student and teacher logits ``[b, s, vocab]`` and labels ``[b, s]``, alike on every rank."""
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(b, s, vocab, generator=gen) * 3
    teacher = student + torch.randn(b, s, vocab, generator=gen) * 2  # related, not equal
    labels = torch.randint(0, vocab, (b, s), generator=gen)
    return student, teacher, labels


def sharded_objectives(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Each case's per-token objective and its gradient from vocabulary shards of random logits
    (this rank's ``V / world`` columns), the gradient gathered back to ``[b, s, V]``."""
    from megatron.core import parallel_state

    from focus_pretrain.train.distill import per_token_objective

    _init(world_size)
    group = parallel_state.get_tensor_model_parallel_group()
    results = []
    for case in cases:
        student, teacher, labels = _random_logits(2, 5, case["vocab"], case["seed"])
        width = case["vocab"] // world_size
        shard = slice(rank * width, (rank + 1) * width)
        local = student[..., shard].clone().to(case.get("dtype", torch.float32))
        local.requires_grad_(True)
        per_token = per_token_objective(
            local, labels, teacher[..., shard], objective=case["objective"],
            weight=case.get("weight", 0.5), temperature=case.get("temperature", 1.0), group=group,
        )  # fmt: skip
        upstream = torch.linspace(0.5, 1.5, per_token.numel()).view_as(per_token)
        (per_token * upstream).sum().backward()
        grad = _gather_last_dim(local.grad.float(), world_size)
        results.append(dict(per_token=per_token.detach(), grad=grad))
    return results


def _model_batch(config, b: int = 2, s: int = 40, seed: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (b, s), generator=gen)
    return dict(
        tokens=tokens,
        labels=torch.randint(0, config.vocab_size, (b, s), generator=gen),
        position_ids=torch.arange(s)[None].expand(b, s),
        loss_mask=(torch.rand(b, s, generator=gen) > 0.2).float(),
    )


def dense_bypass(rank: int, world_size: int, cases: list) -> list[dict]:
    """For each ``(model_kwargs, focus_kwargs)``: full logits in ``eval()`` with Focus, inside
    :func:`dense_attention`, and after it (the bypass undone); which layers routed inside."""
    from focus_pretrain.model.attention import dense_attention

    _init(world_size)
    results = []
    for model_kwargs, focus_kwargs in cases:
        config, model = _build(world_size, model_kwargs, focus_kwargs)
        batch = _model_batch(config)
        calls = []
        for module in model.modules():
            if getattr(module, "router", None) is not None:
                module.router.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        model.eval()
        with torch.no_grad():
            inputs = (batch["tokens"], batch["position_ids"], None)
            focus = model(*inputs)
            with dense_attention(model):
                before = len(calls)
                dense = model(*inputs)
                routed_inside = len(calls) - before
            after = model(*inputs)
        results.append(
            dict(
                focus=_gather_last_dim(focus, world_size),
                dense=_gather_last_dim(dense, world_size),
                after=_gather_last_dim(after, world_size),
                routed_inside=routed_inside,
            )
        )
    return results


def distill_losses(rank: int, world_size: int, model_kwargs: dict, cases: list) -> list[dict]:
    """For each ``(focus_kwargs, objective)``: ``micro_batch_loss``'s mean and the gradients of
    the routers and of one frozen-in-a-retrofit weight, plus the pieces recomputed by hand from
    the model's logits (teacher = Focus bypassed, student = Focus, both full vocabulary)."""
    from focus_pretrain.model.attention import dense_attention
    from focus_pretrain.train.loss import Objective, micro_batch_loss

    _init(world_size)
    results = []
    for focus_kwargs, objective in cases:
        config, model = _build(world_size, model_kwargs, focus_kwargs)
        batch = _model_batch(config)
        model.train()
        backward, mean = micro_batch_loss(model, batch, None, Objective(**objective))
        backward.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        inputs = (batch["tokens"], batch["position_ids"], None)
        with torch.no_grad():
            model.eval()
            with dense_attention(model):
                teacher = _gather_last_dim(model(*inputs), world_size)
            model.train()
            student = _gather_last_dim(model(*inputs), world_size)
        results.append(
            dict(
                mean=mean, teacher=teacher, student=student, labels=batch["labels"],
                mask=batch["loss_mask"], router_grad_norm=sum(
                    float(g.norm()) for n, g in grads.items() if ".router." in n
                ),
                grad_names=sorted(grads),
            )
        )  # fmt: skip
        dist.barrier()
    return results


def attention_mass_by_hand(rank: int, world_size: int, model_kwargs: dict, cases: list) -> list:
    """For each ``(focus_kwargs, packed)``: ``micro_batch_loss``'s ``attention_mass`` mean and
    router gradients, and on one rank the same mean recomputed by hand from each Focus
    layer's own inputs (its normalised hidden state, rotated queries and keys, captured in a
    dense forward) with :func:`~focus_pretrain.focus.attention_mass.removed_attention_mass`:
    mean over layers and heads, masked mean over tokens. ``packed``: three documents per
    sample (document starts)."""
    from focus_pretrain.focus.attention_mass import removed_attention_mass
    from focus_pretrain.model.attention import FocusSelfAttention
    from focus_pretrain.train.loss import Objective, micro_batch_loss

    _init(world_size)
    results = []
    for focus_kwargs, packed in cases:
        config, model = _build(world_size, model_kwargs, focus_kwargs)
        batch = _model_batch(config)
        if packed:
            s = batch["tokens"].shape[1]
            starts = torch.tensor([0 if i < 11 else 11 if i < 26 else 26 for i in range(s)])
            batch["documents"] = starts[None].expand_as(batch["tokens"]).contiguous()  # [b, s]
        model.train()
        backward, mean = micro_batch_loss(model, batch, None, Objective("attention_mass"))
        backward.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        by_hand = None
        if world_size == 1:
            by_hand = _removed_mass_by_hand(model, batch, removed_attention_mass)
        layers = [m for m in model.modules() if isinstance(m, FocusSelfAttention)]
        results.append(
            dict(
                mean=mean, by_hand=by_hand, grad_names=sorted(grads),
                router_grads={n: g for n, g in grads.items() if ".router." in n},
                routed_layers=sum(layer.router is not None for layer in layers),
                layers=len(layers),
            )
        )  # fmt: skip
        dist.barrier()
    return results


def _removed_mass_by_hand(model, batch, removed_attention_mass) -> torch.Tensor:
    """The ``attention_mass`` objective's masked mean, layer by layer from captured inputs."""
    from focus_pretrain.model.attention import FocusSelfAttention, dense_attention
    from focus_pretrain.train.loss import packed_documents

    captured: dict[FocusSelfAttention, dict] = {}
    hooks = []
    for layer in model.modules():
        if isinstance(layer, FocusSelfAttention) and layer.router is not None:
            seen = captured.setdefault(layer, {})
            hooks.append(layer.register_forward_pre_hook(
                lambda m, args, seen=seen: seen.update(hidden=args[0])
            ))  # fmt: skip
            hooks.append(layer.core_attention.register_forward_pre_hook(
                lambda m, args, seen=seen: seen.update(query=args[0], key=args[1])
            ))  # fmt: skip
    documents = batch.get("documents")
    with torch.no_grad(), dense_attention(model):
        seq = batch["tokens"].shape[1]
        model(batch["tokens"], batch["position_ids"], None, **packed_documents(batch, seq))
    for hook in hooks:
        hook.remove()
    per_layer = []
    for layer, seen in captured.items():
        core = layer.core_attention
        with torch.no_grad():
            routing = layer.route(seen["hidden"], documents)
        q, k = (seen[n].transpose(0, 1) for n in ("query", "key"))  # [s,b,h,d] -> [b,s,h,d]
        pattern = core.focus.pattern(
            sinks=core.sinks, softcap=core.softcap, scale=core.softmax_scale,
            mode=layer.training_pattern,
        )  # fmt: skip
        removed = removed_attention_mass(q, k, k, routing, pattern, documents=documents)
        per_layer.append(removed.mean(dim=-1))  # [b, s, h] -> [b, s]
    per_token = torch.stack(per_layer).mean(dim=0)  # [layers, b, s] -> [b, s]
    mask = batch["loss_mask"]
    return (per_token * mask).sum() / mask.sum()
