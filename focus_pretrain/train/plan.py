"""``--dry-run``: parameters from a meta-device build and an estimated memory plan per GPU.

Model states follow the ZeRO paper's accounting (bf16/fp16 weights and gradients, fp32 master
weights and two Adam moments: 2 + 2 + 12 bytes per trainable parameter, 2 per frozen one; fp32
training keeps 4 + 4 + 12) divided over data-parallel ranks by stage. Activations follow
Korthikanti et al. (2022), Table 2, without the ``5 a s^2 b`` term (attention is computed
blockwise), per layer of ``s`` tokens, micro-batch ``b``, hidden ``h``, tensor parallelism
``t`` (:func:`layer_activations`):

* tensor parallelism alone: ``s b h (10 + 24 / t)`` bytes: the norms' inputs, the dropout masks
  and the inputs of the attention's and the MLP's first linears (``10 s b h``) are replicated
  on every tensor-parallel rank;
* with sequence parallelism (``parallel.sequence_parallel``): ``34 s b h / t``, those are split
  over the ranks' slices of the sequence too.

The constants count 2-byte activations (doubled for fp32 training). A Focus layer adds its
router's fp32 copy of the layer's normalised input (``4 s b h`` in 16-bit training, divided by
``t`` under sequence parallelism). Full recompute keeps each layer's input (``[s / t, b, h]``
under sequence parallelism, ``[s, b, h]`` without) plus one layer's working set. Then the fp32
logits with their gradient (vocabulary split over ``t``). A 10% margin is kept for workspace
and fragmentation.

Context parallelism (``CP`` ranks per sequence) divides every activation term by ``CP`` (each
rank holds ``s / CP`` tokens), ZeRO partitions over data x context-parallel ranks (DeepSpeed's
data-parallel group), and the attention adds its communication buffers: for the ring, two K/V
blocks (the one computed and the one in flight) plus, in backward, two fp32 ``dK/dV``
accumulators and the score chunk of one step (``SCORE_BUDGET`` fp32); for all-to-all, the
head-sharded ``q, k, v`` and output of one layer.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from focus_pretrain.config import Config
from focus_pretrain.model import build_model
from focus_pretrain.model.config import ModelConfig
from focus_pretrain.parallel.cpu_shim import apply_cpu_shim
from focus_pretrain.parallel.launch import init_distributed
from focus_pretrain.parallel.ring import SCORE_BUDGET
from focus_pretrain.train.metrics import flops_per_sample, peak_tflops
from focus_pretrain.train.optim import apply_freeze_policy

GB = 1e9
MARGIN = 0.9


def layer_activations(s: int, b: int, h: int, tp: int, sequence_parallel: bool) -> float:
    """Bytes one transformer layer keeps for its backward (2-byte activations, no attention
    scores): ``s b h (10 + 24 / t)`` under tensor parallelism alone, ``34 s b h / t`` with
    sequence parallelism (Korthikanti et al. 2022, Table 2; ``t = 1``: ``34 s b h``)."""
    if sequence_parallel:
        return s * b * h * 34 / tp
    return s * b * h * (10 + 24 / tp)


def focus_layers(model: ModelConfig) -> int:
    """Layers with a router (none for a dense or window-only model; Gemma's local layers have
    none)."""
    if not model.focus.enabled or model.focus.window_only:
        return 0
    return sum(not model.is_local_layer(n) for n in range(1, model.num_layers + 1))


def activation_memory(config: Config, s: int) -> float:
    """Bytes of activations per GPU for ``s`` tokens per sequence on this rank (see the module
    docstring)."""
    par, model = config.parallel, config.model
    tp, sp = par.tensor_parallel_size, par.sequence_parallel
    b, h = config.train.micro_batch_size, model.hidden_size
    half = config.train.precision != "fp32"
    scale = 1 if half else 2  # the paper's constants count 2-byte activations
    working = layer_activations(s, b, h, tp, sp) * scale
    router = (4 if half else 0) * s * b * h / (tp if sp else 1)  # fp32 copy of the input
    if model.recompute == "full":
        layer_input = s * b * h * (2 if half else 4) / (tp if sp else 1)
        return model.num_layers * layer_input + working + (router if focus_layers(model) else 0)
    return model.num_layers * working + focus_layers(model) * router


def memory_plan(config: Config, counts: dict[str, int]) -> dict[str, float | int | bool]:
    """Per-GPU memory (GB) of ``config`` given parameter ``counts`` from :func:`count_split`.

    ``counts``: ``sharded`` (split by tensor parallelism), ``replicated``, ``trainable``
    (TP=1 totals).
    """
    par, train, model = config.parallel, config.train, config.model
    tp, cp = par.tensor_parallel_size, par.context_parallel_size
    gpus = par.gpus or tp * cp
    dp = gpus // (tp * cp)
    shards = dp * cp  # ZeRO partitions over DeepSpeed's data x context-parallel group
    total = counts["sharded"] + counts["replicated"]
    per_gpu = counts["sharded"] / tp + counts["replicated"]
    trainable = per_gpu * counts["trainable"] / total
    half = train.precision != "fp32"
    w_bytes = 2 if half else 4
    weights, grads, optim = per_gpu * w_bytes, trainable * w_bytes, trainable * 12
    if par.cpu_offload:
        optim = 0.0
    if par.zero_stage >= 1:
        optim /= shards
    if par.zero_stage >= 2:
        grads /= shards
    if par.zero_stage >= 3:
        weights /= shards
    s, b = config.data.seq_length // cp, train.micro_batch_size  # tokens per rank
    activations = activation_memory(config, s)
    logits = 2 * s * b * model.vocab_size / tp * 4
    context = 0.0
    if cp > 1:
        kv = 2 * s * b * model.kv_heads // tp * model.kv_channels  # one K/V block
        if par.cp_mode == "ring":
            context = 2 * kv * w_bytes + 2 * kv * 4 + SCORE_BUDGET * 4
        else:
            q = s * b * model.num_attention_heads // tp * model.kv_channels
            context = (2 * q + kv) * w_bytes
    used = (weights + grads + optim + activations + logits + context) / GB
    return {
        "gpus": gpus,
        "tensor_parallel": tp,
        "sequence_parallel": par.sequence_parallel,
        "context_parallel": cp,
        "cp_mode": par.cp_mode,
        "data_parallel": dp,
        "tokens_per_gpu": s * b,
        "zero_stage": par.zero_stage,
        "parameters": total,
        "parameters_per_gpu": int(per_gpu / shards if par.zero_stage >= 3 else per_gpu),
        "weights_gb": weights / GB,
        "gradients_gb": grads / GB,
        "optimizer_gb": optim / GB,
        "activations_gb": activations / GB,
        "logits_gb": logits / GB,
        "context_parallel_gb": context / GB,
        "total_gb": used,
        "gpu_memory_gb": par.gpu_memory_gb,
        "fits": used <= MARGIN * par.gpu_memory_gb,
    }


def count_split(config: Config) -> dict[str, int]:
    """Build the model on the meta device at the parallel state's tensor-parallel size (TP=1
    when this call initialises it, as a dry run does); count TP-sharded, replicated and
    trainable parameters."""
    init_distributed()
    apply_cpu_shim()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    with torch.device("meta"):
        model = build_model(config.model)  # sequence parallelism changes no parameter
    apply_freeze_policy(model, config.train)
    sharded = replicated = trainable = 0
    for param in model.parameters():
        if getattr(param, "tensor_model_parallel", False):
            sharded += param.numel()
        else:
            replicated += param.numel()
        trainable += param.numel() if param.requires_grad else 0
    return {"sharded": sharded, "replicated": replicated, "trainable": trainable}


PLANNED_MFU = 0.40  # the utilisation the time estimate assumes (a well-tuned dense run)
DEMO_WARNING_PARAMETERS = 1e8  # above it, training on the synthetic demo corpus is a mistake


def data_plan(config: Config, plan: dict) -> dict:
    """What the run reads and how long it takes: ``sources``, ``tokens_per_step``,
    ``total_tokens``, ``hours`` at :data:`PLANNED_MFU` of the GPUs' peak (``None`` without a
    known peak: set train.peak_tflops), and ``demo_warning`` (a large model on demo data)."""
    train, seq = config.train, config.data.seq_length
    tokens_per_step = train.global_batch_size * seq
    total = tokens_per_step * train.steps
    flops = flops_per_sample(config.model, seq) / seq * total
    peak = peak_tflops(train.peak_tflops)
    hours = None if peak is None else flops / (plan["gpus"] * peak * 1e12 * PLANNED_MFU) / 3600
    demo = [s for s in config.data.sources if str(s).startswith("demo:")]
    warning = None
    if demo and plan["parameters"] > DEMO_WARNING_PARAMETERS:
        warning = (
            f"this {plan['parameters'] / 1e9:.1f}B-parameter recipe trains on the synthetic demo "
            f"corpus ({', '.join(demo)}): set data.sources to your corpus"
        )
    return {
        "sources": list(config.data.sources), "tokens_per_step": tokens_per_step,
        "total_tokens": total, "planned_mfu": PLANNED_MFU, "peak_tflops": peak, "hours": hours,
        "demo_warning": warning,
    }  # fmt: skip


def print_plan(config: Config) -> dict:
    """Print parameters, the data and time plan and the per-GPU memory plan (a table and one
    JSON line)."""
    plan = memory_plan(config, count_split(config))
    plan["data"] = data_plan(config, plan)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(
            f"dry run: {config.run.name} ({config.model.family}, "
            f"{plan['parameters']:,} parameters, {plan['parameters_per_gpu']:,} per GPU, "
            f"seq {config.data.seq_length}, micro-batch {config.train.micro_batch_size}, "
            f"recompute {config.model.recompute})"
        )
        _print_data_plan(plan["data"], config.train.steps)
        print("| item | GB per GPU |\n|---|---:|")
        for key in (
            "weights_gb",
            "gradients_gb",
            "optimizer_gb",
            "activations_gb",
            "logits_gb",
            "context_parallel_gb",
            "total_gb",
        ):
            print(f"| {key[:-3]} | {plan[key]:.2f} |")
        verdict = "fits" if plan["fits"] else "does NOT fit"
        print(
            f"{plan['gpus']} GPUs (TP {plan['tensor_parallel']}"
            f"{' (sequence parallel)' if plan['sequence_parallel'] else ''} x "
            f"CP {plan['context_parallel']} "
            f"({plan['cp_mode']}) x DP {plan['data_parallel']}, ZeRO-{plan['zero_stage']}; "
            f"{plan['tokens_per_gpu']:,} tokens per GPU): {plan['total_gb']:.1f} GB of "
            f"{plan['gpu_memory_gb']:.0f} GB per GPU -> {verdict}"
        )
        print(json.dumps(plan))
    return plan


def _print_data_plan(data: dict, steps: int) -> None:
    time = "unknown: set train.peak_tflops (per GPU)"
    if data["hours"] is not None:
        time = (
            f"{data['hours']:,.1f} h at {data['planned_mfu']:.0%} MFU of "
            f"{data['peak_tflops']:.0f} TFLOP/s per GPU"
        )
    print(
        f"data: {', '.join(data['sources'])}; {data['tokens_per_step']:,} tokens per step x "
        f"{steps:,} steps = {data['total_tokens']:,} tokens; time: {time}"
    )
    if data["demo_warning"]:
        print(f"WARNING: {data['demo_warning']}")
