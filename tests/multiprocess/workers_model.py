"""Workers for the model tests (real gloo processes; megatron-core through the CPU shim)."""

from __future__ import annotations

import torch
import torch.distributed as dist

LLAMA = dict(  # the tiny Llama-style model of the multi-process model tests
    family="llama",
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=96,
    vocab_size=128,
)


def _init(world_size: int) -> None:
    from focus_pretrain.parallel import apply_cpu_shim

    apply_cpu_shim()
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)


def _build(
    world_size: int,
    model_kwargs: dict,
    focus_kwargs: dict,
    seed: int = 0,
    params_dtype: torch.dtype = torch.float32,
):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from focus_pretrain.focus import FocusConfig
    from focus_pretrain.model import ModelConfig, build_model

    # check_finite: the debugging knob is on in tests
    config = ModelConfig(
        focus=FocusConfig(**{"check_finite": True, **focus_kwargs}), **model_kwargs
    )
    model_parallel_cuda_manual_seed(42 + seed)
    torch.manual_seed(seed)
    return config, build_model(config, params_dtype)


def _batch(config, b: int = 2, s: int = 40, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (b, s), generator=gen)
    labels = torch.randint(0, config.vocab_size, (b, s), generator=gen)
    return tokens, torch.arange(s)[None].expand(b, s), labels


def _gather_full(param: torch.Tensor, tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """Reassemble a tensor-parallel shard into the TP=1 layout (strided shards included)."""
    if world_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor.contiguous())
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    chunks = [p.chunk(stride, dim=dim) for p in parts]  # [rank][stride]
    return torch.cat([chunks[r][s] for s in range(stride) for r in range(world_size)], dim=dim)


def forward_backward(rank: int, world_size: int, cases: list) -> list[dict]:
    """For each ``(model_kwargs, focus_kwargs)``: loss, full logits, every full gradient."""
    _init(world_size)
    results = []
    for model_kwargs, focus_kwargs in cases:
        config, model = _build(world_size, model_kwargs, focus_kwargs)
        tokens, positions, labels = _batch(config)
        model.train()
        loss = model(tokens, positions, None, labels=labels).float().mean()  # [b, s] -> []
        loss.backward()
        model.eval()
        with torch.no_grad():
            logits = model(tokens, positions, None)  # [b, s, vocab / tp]
            logits = _gather_last_dim(logits, world_size)
        params = dict(model.named_parameters())
        grads = {
            n: _gather_full(p, p.grad, world_size) for n, p in params.items() if p.grad is not None
        }
        results.append(
            dict(
                loss=loss.detach(),
                logits=logits,
                grads=grads,
                shapes={n: tuple(p.shape) for n, p in params.items()},
            )
        )
    return results


def _gather_last_dim(t: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=-1)


def causality(rank: int, world_size: int, model_kwargs: dict, position: int) -> dict:
    """Max change of logits at positions <= ``position`` when later tokens change."""
    _init(world_size)
    config, model = _build(world_size, model_kwargs, dict(window=3, num_groups=4, top_k=2))
    tokens, positions, _ = _batch(config)
    changed = tokens.clone()
    changed[:, position + 1 :] = (changed[:, position + 1 :] + 7) % config.vocab_size
    out = {}
    for mode in ("train", "eval"):
        model.train(mode == "train")
        with torch.no_grad():
            a, b = model(tokens, positions, None), model(changed, positions, None)
        out[mode] = (
            (a[:, : position + 1] - b[:, : position + 1]).abs().max().item(),
            (a[:, position + 1 :] - b[:, position + 1 :]).abs().max().item(),
        )
    return out


def layer_against_manual_attention(rank: int, world_size: int, model_kwargs: dict) -> dict:
    """One Focus-disabled self-attention layer against attention written out by hand."""
    _init(world_size)
    config, model = _build(world_size, model_kwargs, dict(enabled=False))
    layer = model.decoder.layers[0].self_attention
    s, b = 24, 2
    hidden = torch.randn(s, b, config.hidden_size)  # [s, b, h] Megatron layout
    rope = model.rotary_pos_emb(s)  # [s, 1, 1, d]
    with torch.no_grad():
        got, _ = layer(hidden, None, rotary_pos_emb=rope)
    return dict(
        got=got,
        hidden=hidden,
        qkv=layer.linear_qkv.weight.detach().clone(),
        qkv_bias=None if layer.linear_qkv.bias is None else layer.linear_qkv.bias.detach(),
        proj=layer.linear_proj.weight.detach().clone(),
    )


def parameter_counts(rank: int, world_size: int, paths: list[str]) -> list[dict]:
    """``count_parameters`` of the ``model:`` section of each YAML recipe, on the meta device."""
    import resource

    from focus_pretrain.config import load_config
    from focus_pretrain.model import count_parameters

    _init(world_size)
    out = []
    for path in paths:
        config = load_config(path).model
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        counts = count_parameters(config)
        grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        out.append(
            dict(
                counts=counts,
                grown_kib=grown_kib,
                layers=config.num_layers,
                hidden=config.hidden_size,
                k=config.focus.num_groups,
                d_g=config.focus.group_dim,
            )
        )
    return out


def bf16_train_step(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """Per ``model_kwargs``: a model built with ``params_dtype=bf16``, one forward/backward
    (training, soft pattern) and one eval forward (hard pattern): loss, every gradient, the
    eval logits and the parameter dtypes."""
    _init(world_size)
    results = []
    for model_kwargs in cases:
        config, model = _build(
            world_size, model_kwargs, dict(window=4, num_groups=4), params_dtype=torch.bfloat16
        )
        tokens, positions, labels = _batch(config)
        model.train()
        loss = model(tokens, positions, None, labels=labels).float().mean()
        loss.backward()
        model.eval()
        with torch.no_grad():
            logits = model(tokens, positions, None)  # [b, s, vocab]
        results.append(
            dict(
                loss=loss.detach(),
                logits=logits,
                grads={n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                dtypes={n: str(p.dtype) for n, p in model.named_parameters()},
            )
        )
    return results


def receptive_field(rank: int, world_size: int, model_kwargs: dict, focus_kwargs: dict) -> list:
    """Per position, the largest change of the logits when token 0 changes ([s] floats)."""
    _init(world_size)
    config, model = _build(world_size, model_kwargs, focus_kwargs)
    tokens, positions, _ = _batch(config)
    changed = tokens.clone()
    changed[:, 0] = (changed[:, 0] + 5) % config.vocab_size
    out = {}
    for mode in ("train", "eval"):
        model.train(mode == "train")
        with torch.no_grad():
            a, b = model(tokens, positions, None), model(changed, positions, None)
        out[mode] = (a - b).abs().amax(dim=(0, 2)).tolist()  # [b, s, v] -> [s]
    return out


def backend_calls(rank: int, world_size: int, model_kwargs: dict, cases: list) -> list[dict]:
    """Per ``focus_kwargs`` case: which backends one train and one eval forward called."""
    import dataclasses

    from focus_pretrain.focus import backends

    _init(world_size)
    calls: dict[str, int] = {}

    def counting(backend):
        def fn(q, k, v, pattern):
            key = f"{pattern.mode}:{backend.name}"
            calls[key] = calls.get(key, 0) + 1
            return backend.fn(q, k, v, pattern)

        return dataclasses.replace(backend, fn=fn)

    for backend in list(backends._BACKENDS.values()):
        backends.register_backend(counting(backend))
    results = []
    for focus_kwargs in cases:
        config, model = _build(world_size, model_kwargs, focus_kwargs)
        tokens, positions, _ = _batch(config)
        calls.clear()
        model.train()
        model(tokens, positions, None)
        model.eval()
        with torch.no_grad():
            model(tokens, positions, None)
        results.append(dict(calls))
    return results
