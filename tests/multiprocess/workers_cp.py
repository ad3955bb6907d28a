"""Workers for the context-parallel attention tests (real gloo processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from focus_pretrain.focus import FocusRouter, Routing, focus_attention
from focus_pretrain.focus.pattern import allowed_pairs, document_starts
from focus_pretrain.parallel import (
    apply_cpu_shim,
    context_parallel_attention,
    gather_sequence,
    shard_sequence,
)
from focus_pretrain.parallel.ring import RingStats


def _problem(case: dict):
    """Global inputs (identical on every rank: same seed) and a router, in float64."""
    gen = torch.Generator().manual_seed(case["seed"])
    b, s, h, hkv, d, width = case["b"], case["s"], case["h"], case["hkv"], case["d"], 12

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = randn(b, s, h, d), randn(b, s, hkv, d), randn(b, s, hkv, d)
    hidden = randn(b, s, width)
    upstream = randn(b, s, h, d)  # the gradient flowing into the attention output
    torch.manual_seed(case["seed"])
    router = FocusRouter(width, num_groups=case["k"], group_dim=4, tau=0.3, dtype=torch.float64)
    return q, k, v, hidden, upstream, router


def document_ids(case: dict) -> torch.Tensor | None:
    """``[b, s]`` per-token document ids from ``case["docs"]`` (per sample, the document
    lengths), or ``None``."""
    if case.get("docs") is None:
        return None
    rows = [torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in case["docs"]]
    return torch.stack(rows)  # [b, s]


def expected_skips(case: dict, probs: torch.Tensor | None, rank: int, world_size: int) -> int:
    """Brute force, from the whole-sequence pattern (``allowed_pairs``, ``[b, s, s]``): the
    ring blocks (other ranks' shards included) in which this rank's queries have no allowed
    key, i.e. the steps the ring must skip."""
    s, starts = case["s"], None
    ids = document_ids(case)
    if ids is not None:
        starts = document_starts(ids)
    positions = torch.arange(s)
    member = None
    if case["mode"] in ("hard", "hard_gated") and not case.get("local_only"):
        member = Routing(probs).membership(case.get("top_k", 1))  # [b, s]
    allowed = allowed_pairs(
        positions, positions, case["window"], member_q=member, member_k=member,
        local_only=case.get("local_only", False), sinks=case.get("sinks", 0),
        q_doc=starts, k_doc=starts,
    )  # fmt: skip
    mine = shard_sequence(positions, 0, world_size, rank)
    rows = allowed[:, mine]  # [b|1, s_loc, s]
    return sum(
        not bool(rows[:, :, shard_sequence(positions, 0, world_size, r)].any())
        for r in range(world_size)
    )


def _attention_kwargs(case: dict) -> dict:
    return dict(
        window=case["window"],
        mode=case["mode"],
        top_k=case.get("top_k", 1),
        softcap=case.get("softcap"),
        local_only=case.get("local_only", False),
        gate_lambda=4.0,
        check_finite=False,
        **({"sinks": case["sinks"]} if case.get("sinks") else {}),
        **({"key_groups": case["key_groups"]} if case.get("key_groups") else {}),
    )


def attention_matches_single_process(rank: int, world_size: int, cases: list) -> dict:
    """``cases``: per case, max |CP - single process| of the output and of the q, k, v, router
    gradients; ``refusals``: what the ring says to inputs it must refuse."""
    apply_cpu_shim()
    group = dist.group.WORLD
    results = []
    from focus_pretrain.parallel import ring

    default_budget = ring.SCORE_BUDGET
    for case in cases:
        ring.SCORE_BUDGET = case.get("score_budget", default_budget)  # small: row chunks
        q, k, v, hidden, upstream, router = _problem(case)
        kwargs = _attention_kwargs(case)
        router.eval()  # no balance statistics; the same routing in both runs
        ids = document_ids(case)  # [b, s] or None
        starts = None if ids is None else document_starts(ids)

        # single process, the whole sequence (documents as ids: starts are ids too)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        probs = None if kwargs["local_only"] else router(hidden).probs
        skips = expected_skips(case, None if probs is None else probs.detach(), rank, world_size)
        want = focus_attention(*leaves, probs, backend="reference", documents=ids, **kwargs)
        want.backward(upstream)
        want_grads = [t.grad for t in leaves] + [
            torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in router.parameters()
        ]  # hard mode: no gradient reaches the router (hard_gated: through the gate)
        router.zero_grad()

        # context parallel: this rank's shard
        shards = [shard_sequence(t, 1, world_size, rank).requires_grad_(True) for t in (q, k, v)]
        local_hidden = shard_sequence(hidden, 1, world_size, rank)
        probs = None if kwargs["local_only"] else router(local_hidden).probs
        stats = RingStats()
        documents = None if starts is None else shard_sequence(starts, 1, world_size, rank)
        out = context_parallel_attention(
            *shards, probs, group=group, cp_mode=case["cp_mode"], stats=stats,
            documents=documents, **kwargs,
        )  # fmt: skip
        out.backward(shard_sequence(upstream, 1, world_size, rank))
        got = gather_sequence(out.detach(), 1, group)
        got_grads = [gather_sequence(t.grad, 1, group) for t in shards]
        for p in router.parameters():  # each rank routed its own tokens: sum over the group
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)
            got_grads.append(p.grad)
        router.zero_grad()
        errors = [float((a - b).abs().max()) for a, b in zip(got_grads, want_grads, strict=True)]
        results.append(
            dict(
                output=float((got - want.detach()).abs().max()),
                grads=errors,
                router_grad=max([float(g.abs().max()) for g in want_grads[3:]], default=0.0),
                scale=float(want.abs().max()),
                skipped=stats.skipped,
                computed=stats.computed,
                expected_skipped=skips,
            )
        )
    ring.SCORE_BUDGET = default_budget
    return dict(cases=results, refusals=ring_refusals(cases[0], group))


def ring_refusals(case: dict, group) -> dict[str, str]:
    """The ring's errors for a backend it cannot run (it computes each block with the exact
    per-block attention), for NaN inputs when ``check_finite`` is on, and (the all-to-all too,
    on the gathered sequence) for documents given as per-token ids (``position // 2``: every
    rank holds a token that neither continues its neighbour's document nor starts its own) or
    as floats."""
    q, k, v, hidden, _, router = _problem(case)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, hidden = (shard_sequence(t, 1, size, rank) for t in (q, k, v, hidden))
    probs = router(hidden).probs.detach()
    kwargs = dict(_attention_kwargs(case), local_only=False)
    ids = shard_sequence(torch.arange(case["s"]) // 2, 0, size, rank).expand(q.shape[0], -1)
    errors = {}
    for name, extra, inputs in (
        ("backend", dict(backend="decomposed"), (q, k, v)),
        ("nan", dict(check_finite=True), (q, k, v.clone().fill_(float("nan")))),
        ("ids", dict(documents=ids), (q, k, v)),
        ("a2a_ids", dict(documents=ids, cp_mode="a2a"), (q, k, v)),
        ("float", dict(documents=ids.double()), (q, k, v)),
    ):
        mode = extra.pop("cp_mode", "ring")
        try:
            context_parallel_attention(
                *inputs, probs, group=group, cp_mode=mode, **{**kwargs, **extra}
            )
            errors[name] = ""
        except ValueError as error:
            errors[name] = str(error)
    return errors


def ring_skips(rank: int, world_size: int, configs: list[tuple[int, bool, int]]) -> list[dict]:
    """:func:`ring_skip` for each ``(window, same_group, sinks)`` (one set of processes)."""
    apply_cpu_shim()
    return [ring_skip(rank, world_size, *config) for config in configs]


def ring_skip(rank: int, world_size: int, window: int, same_group: bool, sinks: int = 0) -> dict:
    """Hard-mode ring on a constructed routing: rank 0's tokens in group 0, rank 1's in group 1
    (or all in group 0), ``sinks`` attention sinks: returns the step counts and the error
    against the single process."""
    group = dist.group.WORLD
    b, s, h, d, k = 1, 16, 2, 4, 2
    gen = torch.Generator().manual_seed(5)
    q, key, v = (torch.randn(b, s, h, d, generator=gen, dtype=torch.float64) for _ in range(3))
    owner = torch.zeros(s, dtype=torch.long)  # which rank holds each global position
    for r in range(world_size):
        owner[shard_sequence(torch.arange(s), 0, world_size, r)] = r
    groups = torch.zeros_like(owner) if same_group else owner
    probs = torch.nn.functional.one_hot(groups, k).double()[None] * 0.9 + 0.05  # [1, s, K]
    kwargs = dict(window=window, mode="hard", check_finite=False, sinks=sinks)
    want = focus_attention(q, key, v, probs, backend="reference", **kwargs)
    stats = RingStats()
    shards = [shard_sequence(t, 1, world_size, rank) for t in (q, key, v, probs)]
    out = context_parallel_attention(*shards, group=group, cp_mode="ring", stats=stats, **kwargs)
    got = gather_sequence(out, 1, group)
    return dict(
        skipped=stats.skipped, computed=stats.computed, error=float((got - want).abs().max())
    )


def models_loss_and_grads(rank: int, world_size: int, cases: list) -> list[dict]:
    """:func:`model_loss_and_grads` for each ``(model_kwargs, focus_kwargs, cp_mode)``."""
    from megatron.core import parallel_state

    apply_cpu_shim()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(context_parallel_size=world_size)
    return [model_loss_and_grads(rank, world_size, *case) for case in cases]


def model_loss_and_grads(
    rank: int, world_size: int, model_kwargs: dict, focus_kwargs: dict, cp_mode: str
) -> dict:
    """A whole tiny model with context parallelism over all ``world_size`` ranks (TP = 1):
    the global mean loss, the gathered eval logits and every parameter's full gradient."""
    from megatron.core import parallel_state

    from focus_pretrain.parallel import apply_context_parallel, shard_batch
    from tests.multiprocess.workers_model import _batch, _build

    config, model = _build(1, model_kwargs, focus_kwargs)
    group = parallel_state.get_context_parallel_group()
    if world_size > 1:
        apply_context_parallel(model, group, cp_mode)
    tokens, positions, labels = _batch(config, s=48)
    total = labels.numel()
    batch = dict(tokens=tokens, positions=positions, labels=labels)
    if world_size > 1:
        batch = shard_batch(batch, group)
    model.train()
    per_token = model(batch["tokens"], batch["positions"], None, labels=batch["labels"])
    loss = per_token.float().sum() / total  # this rank's share of the global mean
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(grad, group=group)  # the ranks' shares of the sequence add up
        grads[name] = grad
    loss = loss.detach().clone()
    dist.all_reduce(loss, group=group)
    model.eval()
    with torch.no_grad():
        logits = model(batch["tokens"], batch["positions"], None)  # [b, s_loc, vocab]
    if world_size > 1:
        logits = gather_sequence(logits, 1, group)
    return dict(loss=loss, logits=logits, grads=grads)


def ring_kernels_agree(rank: int, world_size: int, cases: list) -> list[dict]:
    """The ring with each block kernel (``block_kernel="blockwise"`` and ``"flex"``: on CPU an
    eager FlexAttention forward, the backward blockwise): per case the largest difference of
    the gathered outputs and of the q, k, v (soft: assignment) gradients, the output's scale and
    the steps skipped by each."""
    apply_cpu_shim()
    group = dist.group.WORLD
    results = []
    for case in cases:
        q, k, v, hidden, upstream, router = _problem(case)
        kwargs = _attention_kwargs(case)
        ids = document_ids(case)
        documents = (
            None if ids is None else shard_sequence(document_starts(ids), 1, world_size, rank)
        )
        with torch.no_grad():
            probs = router(shard_sequence(hidden, 1, world_size, rank)).probs  # [b, s_loc, K]
        runs = {}
        for kernel in ("blockwise", "flex"):
            leaves = [
                shard_sequence(t, 1, world_size, rank).requires_grad_(True) for t in (q, k, v)
            ]
            leaves.append(probs.clone().requires_grad_(True))
            stats = RingStats()
            out = context_parallel_attention(
                *leaves, group=group, cp_mode="ring", stats=stats, documents=documents,
                block_kernel=kernel, **kwargs,
            )  # fmt: skip
            out.backward(shard_sequence(upstream, 1, world_size, rank))
            grads = [t.grad for t in leaves[:3]]
            if case["mode"] == "soft" and not kwargs["local_only"]:
                grads.append(leaves[3].grad)
            runs[kernel] = (gather_sequence(out.detach(), 1, group), grads, stats.skipped)
        (want, want_grads, want_skips), (got, got_grads, got_skips) = runs.values()
        results.append(
            dict(
                output=float((got - want).abs().max()),
                grads=[
                    float((a - b).abs().max()) for a, b in zip(got_grads, want_grads, strict=True)
                ],
                scale=float(want.abs().max()),
                skipped=(want_skips, got_skips),
            )
        )
    return results
