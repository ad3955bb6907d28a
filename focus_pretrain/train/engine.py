"""``pretrain(config)``: Megatron model + DeepSpeed ZeRO, the training loop, resumable.

One call does everything a run needs: distributed and Megatron parallel state (CPU shim when
CUDA is absent), data preparation on rank 0, the Focus model, freezing policy, AdamW groups,
DeepSpeed with Megatron's process groups as ``mpu``, the loop (gradient accumulation, clipping,
router balance updates after every optimizer step), validation perplexity, metrics, and
checkpoints that survive crashes and SIGTERM. Launched by ``launchers/pretrain.py`` under
``deepspeed``, ``torchrun`` or plain ``python`` (one process).
"""

from __future__ import annotations

import math
import os
import random
import signal
import socket
import time
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from focus_pretrain.config import Config, save_config
from focus_pretrain.focus import FocusRouter
from focus_pretrain.train.checkpoint import latest_tag, load_checkpoint, save_checkpoint
from focus_pretrain.train.metrics import (
    MetricsLogger,
    flops_per_sample,
    peak_memory_gb,
    peak_tflops,
)
from focus_pretrain.train.optim import PhaseGate, apply_freeze_policy, lr_lambda, parameter_groups
from focus_pretrain.train.recall import recall_batch, recall_metrics

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def init_distributed() -> None:
    """Initialise ``torch.distributed``: ranks from the launcher (``deepspeed``, ``torchrun``),
    from ``srun`` (one task per device, see ``launchers/slurm.sh``), or one local process."""
    if dist.is_initialized():
        return
    os.environ.update(launch_environment(os.environ))
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def launch_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_*`` variables this process lacks.

    A launcher that sets ``RANK`` needs nothing. Under ``srun`` (``SLURM_STEP_NUM_TASKS`` is
    set only inside a job step) ranks come from ``SLURM_PROCID``/``SLURM_LOCALID`` and the
    rendezvous from ``MASTER_ADDR``/``MASTER_PORT``. Otherwise: one process on a free port.
    """
    if "RANK" in env:
        return {}
    tasks = int(env.get("SLURM_STEP_NUM_TASKS", "1"))
    if "SLURM_PROCID" in env and tasks > 1:
        if "MASTER_ADDR" not in env:
            raise ValueError(
                "running under srun with several tasks but MASTER_ADDR is not set: export the "
                "first node's address (and MASTER_PORT), as launchers/slurm.sh does"
            )
        return {
            "RANK": env["SLURM_PROCID"],
            "WORLD_SIZE": str(tasks),
            "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
            "MASTER_PORT": env.get("MASTER_PORT", "29500"),
        }
    return {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a local rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _setup_parallel(config: Config) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from focus_pretrain.parallel import apply_cpu_shim

    apply_cpu_shim()
    tp, cp = config.parallel.tensor_parallel_size, config.parallel.context_parallel_size
    if dist.get_world_size() % (tp * cp):
        raise ValueError(
            f"world size {dist.get_world_size()} is not a multiple of "
            f"parallel.tensor_parallel_size x context_parallel_size ({tp} x {cp})"
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, context_parallel_size=cp
        )
    seed = config.run.seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def _deepspeed_config(config: Config, grad_accum: int) -> dict:
    train, parallel = config.train, config.parallel
    zero: dict = {"stage": parallel.zero_stage}
    if parallel.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": train.clip_grad,
        "zero_optimization": zero,
        "bf16": {"enabled": train.precision == "bf16"},
        "fp16": {"enabled": train.precision == "fp16", "initial_scale_power": 16},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }


def _adamw(groups: list[dict], train_cfg, cpu_offload: bool) -> torch.optim.Optimizer:
    """AdamW; with ZeRO-Offload DeepSpeed's vectorised CPU AdamW (built on first use)."""
    kwargs = dict(lr=train_cfg.lr, betas=tuple(train_cfg.betas), eps=train_cfg.eps)
    if cpu_offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    return torch.optim.AdamW(groups, **kwargs)


class _StopSignal:
    """SIGTERM/SIGINT set a flag; the loop saves a checkpoint and exits cleanly."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous = {
            s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)
        }

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _batch_to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _loss(engine, batch: dict, cp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token loss of a micro-batch: ``(for backward, mean over unmasked tokens)``.

    Under context parallelism each rank holds a shard of every sequence: the mean divides by
    the unmasked tokens of all shards, and the backward loss is scaled by the CP size because
    DeepSpeed averages gradients over data x context-parallel ranks.
    """
    if cp_group is not None:
        from focus_pretrain.parallel.context_parallel import shard_batch

        batch = shard_batch(batch, cp_group)
    per_token = engine(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    mask = batch["loss_mask"].float()  # [b, s_local]
    total, count = (per_token.float() * mask).sum(), mask.sum()
    if cp_group is None:
        mean = total / count.clamp(min=1)
        return mean, mean.detach()
    both = torch.stack([total.detach(), count])
    dist.all_reduce(both, group=cp_group)
    global_count = both[1].clamp(min=1)
    return total * dist.get_world_size(cp_group) / global_count, both[0] / global_count


def _dp_mean(value: torch.Tensor) -> float:
    from megatron.core import parallel_state

    value = value.detach().float().clone()
    dist.all_reduce(value, group=parallel_state.get_data_parallel_group())
    return float(value) / parallel_state.get_data_parallel_world_size()


def _cp_group(config: Config):
    """The context-parallel process group, or ``None`` without context parallelism."""
    from megatron.core import parallel_state

    if config.parallel.context_parallel_size == 1:
        return None
    return parallel_state.get_context_parallel_group()


def pretrain(config: Config) -> dict:
    """Train ``config``; resumes from ``run.output_dir/checkpoints`` when it holds one.

    Returns:
        ``{"step", "train_loss", "valid_loss", "recall", "output_dir", "stopped_by_signal"}``;
        ``recall`` holds the last long-range recall scores (demo corpus, else ``None``).
    """
    import deepspeed
    from megatron.core import parallel_state

    from focus_pretrain.data.datasets import ResumableSampler, build_datasets, prepare_data
    from focus_pretrain.data.tokenizer import Tokenizer
    from focus_pretrain.model import build_model
    from focus_pretrain.parallel.mpu import MegatronMPU

    if config.train.precision == "fp16" and not torch.cuda.is_available():
        raise ValueError(
            "train.precision=fp16 needs a GPU (DeepSpeed's CPU accelerator has no fp16 "
            "support); use bf16 or fp32 on CPU"
        )
    init_distributed()
    _setup_parallel(config)
    rank0 = dist.get_rank() == 0
    out = Path(config.run.output_dir)
    train_cfg = config.train
    dp = parallel_state.get_data_parallel_world_size()
    per_step = train_cfg.micro_batch_size * dp
    if train_cfg.global_batch_size % per_step:
        raise ValueError(
            f"train.global_batch_size ({train_cfg.global_batch_size}) must be a "
            f"multiple of train.micro_batch_size x data-parallel size ({per_step})"
        )
    grad_accum = train_cfg.global_batch_size // per_step
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        save_config(config, out / "config.yaml")

    if train_cfg.init_from_hf:  # before any data work: the retrofit must use the model's tokens
        from focus_pretrain.convert import check_tokenizer_matches

        check_tokenizer_matches(train_cfg.init_from_hf, config.data.tokenizer)
    # data: prepared once (rank 0), then every rank builds its view
    if rank0:
        prepare_data(config.data, config.run.seed)
    dist.barrier()
    tokenizer_path, prefixes = prepare_data(config.data, config.run.seed)
    tokenizer = Tokenizer(tokenizer_path)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but "
            f"model.vocab_size is {config.model.vocab_size}; raise model.vocab_size"
        )
    eval_rounds = train_cfg.steps // train_cfg.eval_interval + 1 if train_cfg.eval_interval else 0
    train_set, valid_set = build_datasets(
        config.data,
        tokenizer,
        prefixes,
        train_cfg.steps * train_cfg.global_batch_size,
        max(1, train_cfg.eval_iters * per_step * max(eval_rounds, 1)),
        config.run.seed,
    )
    if config.model.focus.balance == "sinkhorn" and train_cfg.eval_interval and rank0:
        warnings.warn(
            "model.focus.balance=sinkhorn routes with future tokens: the validation "
            "perplexity it reports is not causal (see docs/focus-method.md)",
            stacklevel=1,
        )

    recall = None
    if train_cfg.eval_interval and train_cfg.recall_docs and _demo_only(config):
        recall = recall_batch(
            tokenizer,
            config.data.seq_length,
            train_cfg.recall_docs,
            config.run.seed,
            config.data.demo_spec,
        )

    model = build_model(config.model)
    cp_group = _cp_group(config)
    ring_stats = None
    if cp_group is not None:
        from focus_pretrain.parallel.context_parallel import apply_context_parallel

        ring_stats = apply_context_parallel(model, cp_group, config.parallel.cp_mode)
    ckpt_root = out / "checkpoints"
    if train_cfg.init_from_hf and latest_tag(ckpt_root) is None:
        from focus_pretrain.convert import load_hf_weights

        loaded = load_hf_weights(model, train_cfg.init_from_hf, config.model)
        if rank0:
            print(
                f"focus-pretrain: initialised {loaded} tensors from the HuggingFace checkpoint "
                f"{train_cfg.init_from_hf} (routers: fresh)",
                flush=True,
            )
    counts = apply_freeze_policy(model, train_cfg)
    routers = [m for m in model.modules() if isinstance(m, FocusRouter)]
    groups = parameter_groups(model, train_cfg)
    optimized = sum(p.numel() for g in groups for p in g["params"])  # before ZeRO-3 partitions
    optimizer = _adamw(groups, train_cfg, config.parallel.cpu_offload)
    gate = PhaseGate(model) if train_cfg.freeze == "two_phase" else None
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        config=_deepspeed_config(config, grad_accum),
        mpu=MegatronMPU(),
    )
    state = load_checkpoint(engine, ckpt_root) or {}
    step, consumed = state.get("step", 0), state.get("consumed_samples", 0)
    saved_step = step if state else None  # never rewrite the checkpoint `latest` names
    if "rng" in state:
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])
    if gate is not None and step >= train_cfg.router_only_steps:
        gate.open()

    device = engine.device
    sampler = ResumableSampler(
        len(train_set),
        consumed,
        train_cfg.micro_batch_size,
        parallel_state.get_data_parallel_rank(),
        dp,
    )
    loader = iter(torch.utils.data.DataLoader(train_set, batch_sampler=sampler))
    logger = MetricsLogger(out, rank0, train_cfg.tensorboard)
    if rank0:
        where = f"resuming at step {step}" if step else "starting"
        print(
            f"focus-pretrain: {counts['trainable']:,} trainable / {counts['frozen']:,} frozen "
            f"parameters ({counts['router']:,} router), the optimizer holds "
            f"{optimized:,}, dp={dp}, "
            f"tp={config.parallel.tensor_parallel_size}, "
            f"cp={config.parallel.context_parallel_size}, grad_accum={grad_accum}; {where}",
            flush=True,
        )
    flops = flops_per_sample(config.model, config.data.seq_length)
    peak = peak_tflops(train_cfg.peak_tflops)
    schedule = lr_lambda(train_cfg)
    stop = _StopSignal()
    train_loss = valid_loss = recall_scores = None
    interval_loss, interval_steps, tic = 0.0, 0, time.perf_counter()
    try:
        while step < train_cfg.steps and stop.received is None:
            if gate is not None and gate.closed and step >= train_cfg.router_only_steps:
                gate.open()
            for group in optimizer.param_groups:
                scale = gate.scale(group) if gate is not None else group.get("lr_scale", 1.0)
                group["lr"] = train_cfg.lr * schedule(step) * scale
            engine.train()
            step_loss = torch.zeros((), device=device)
            for _ in range(grad_accum):
                loss, mean = _loss(engine, _batch_to(next(loader), device), cp_group)
                engine.backward(loss)
                engine.step()
                step_loss += mean / grad_accum
            step += 1
            consumed += train_cfg.global_batch_size
            _update_balance(routers, parallel_state)
            interval_loss += _dp_mean(step_loss)
            interval_steps += 1
            if step % train_cfg.log_interval == 0 or step == train_cfg.steps:
                elapsed = time.perf_counter() - tic
                train_loss = interval_loss / interval_steps
                tokens = interval_steps * train_cfg.global_batch_size * config.data.seq_length
                tflops = flops * interval_steps * train_cfg.global_batch_size / elapsed
                tflops /= dist.get_world_size() * 1e12
                norm = engine.get_global_grad_norm()
                logger.log(
                    step,
                    {
                        "loss": train_loss,
                        "lr": optimizer.param_groups[0]["lr"],
                        "grad_norm": None if norm is None else float(norm),
                        "tokens_per_s": tokens / elapsed,
                        "tflops": tflops,
                        "mfu": None if peak is None else tflops / peak,
                        "peak_mem_gb": peak_memory_gb(),
                        "max_group_share": _max_group_share(routers, parallel_state),
                        "ring_skipped": _ring_skipped(ring_stats),
                    },
                )
                interval_loss, interval_steps, tic = 0.0, 0, time.perf_counter()
            if train_cfg.eval_interval and (
                step % train_cfg.eval_interval == 0 or step == train_cfg.steps
            ):
                valid_loss = evaluate(
                    engine, valid_set, train_cfg, parallel_state, device, cp_group
                )
                scalars = {"loss": valid_loss, "ppl": math.exp(min(valid_loss, 50))}
                if recall is not None:
                    engine.eval()
                    recall_scores = recall_metrics(
                        engine, recall, train_cfg.micro_batch_size, device, cp_group
                    )
                    engine.train()
                    scalars.update(
                        {k: recall_scores[k] for k in ("recall_loss", "recall_acc", "value_loss")}
                    )
                logger.log(step, scalars, prefix="valid")
            if train_cfg.save_interval and step % train_cfg.save_interval == 0:
                _save(engine, ckpt_root, step, consumed, config)
                saved_step = step
        if saved_step != step:
            _save(engine, ckpt_root, step, consumed, config)
    finally:
        stop.restore()
        logger.close()
    if rank0:
        latest = (ckpt_root / "latest").read_text().strip()
        where = f"checkpoint {ckpt_root / latest}"
        if train_cfg.tensorboard:
            where += f"; TensorBoard: tensorboard --logdir {out / 'tensorboard'}"
        if stop.received is not None:
            print(
                f"focus-pretrain: stopped by signal {stop.received} at step {step}; {where}; "
                "resume with the same command",
                flush=True,
            )
        else:
            print(f"focus-pretrain: done at step {step}; {where}", flush=True)
    return {
        "step": step,
        "train_loss": train_loss,
        "valid_loss": valid_loss,
        "recall": recall_scores,
        "output_dir": str(out),
        "stopped_by_signal": stop.received,
    }


def _save(engine, root: Path, step: int, consumed: int, config: Config) -> None:
    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    save_checkpoint(
        engine,
        root,
        step,
        {"step": step, "consumed_samples": consumed, "rng": rng},
        config,
        config.train.keep_last,
    )


def _demo_only(config: Config) -> bool:
    from focus_pretrain.data.demo_corpus import is_demo_source

    return all(is_demo_source(s) for s in config.data.sources)


def _update_balance(routers: list[FocusRouter], parallel_state) -> None:
    """After an optimizer step: average each router's load target over data- and
    context-parallel ranks (each saw a different part of the batch)."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    for router in routers:
        target = router.balance_target()
        if target is None:
            continue
        target = target.float().clone()
        dist.all_reduce(target, group=group)
        router.update_balance(target / size)


def _ring_skipped(stats) -> float | None:
    """Share of ring steps skipped since the last log (hard-mode blocks with no allowed pair;
    training runs the soft gate, so it counts evaluation)."""
    if stats is None or stats.computed + stats.skipped == 0:
        return None
    share = stats.skipped / (stats.computed + stats.skipped)
    stats.computed = stats.skipped = 0
    return share


def _max_group_share(routers: list[FocusRouter], parallel_state) -> float | None:
    """Largest top-1 group share over the interval, worst layer (summed over DP ranks)."""
    if not routers:
        return None
    counts = torch.stack([r.pop_load().float() for r in routers])  # [layers, K]
    dist.all_reduce(
        counts, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
    )
    shares = counts / counts.sum(dim=1, keepdim=True).clamp(min=1)
    return float(shares.max())


@torch.no_grad()
def evaluate(engine, valid_set, train_cfg, parallel_state, device, cp_group=None) -> float:
    """Mean validation loss over ``eval_iters`` micro-batches (the model's inference mode)."""
    from focus_pretrain.data.datasets import ResumableSampler

    engine.eval()
    sampler = ResumableSampler(
        len(valid_set),
        0,
        train_cfg.micro_batch_size,
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(),
    )
    loader = torch.utils.data.DataLoader(valid_set, batch_sampler=sampler)
    losses = []
    batches = tqdm(
        loader,
        total=min(len(sampler), train_cfg.eval_iters),
        desc="validation",
        leave=False,
        disable=dist.get_rank() != 0,
    )
    for i, batch in enumerate(batches):
        if i == train_cfg.eval_iters:
            break
        losses.append(_loss(engine, _batch_to(batch, device), cp_group)[1])
    engine.train()
    return _dp_mean(torch.stack(losses).mean())
