"""Training rows of the attention benchmark: one training step (forward + backward) of the
Focus backends against dense causal SDPA's, with the soft gate (every causal pair) and, per
``top_k``, on the sparse training pattern (``hard_gated``: only the hard pattern's pairs, gated;
``focus.training_mode: hard``), with the pair-count ideal ``1 / density`` next to each speedup;
each row once per gate form of ``cfg.gate_forms`` (``dot``: the soft pattern is plain causal
attention on ``q, k`` widened by the gate's channels, e.g. through ``sdpa``).

A backend is timed for a mode when the registry says it differentiates that mode on this device
(on CPU: ``reference`` for both, ``segments`` for sparse top-1, ``triton`` in its interpreter
for soft; on CUDA also ``flex``). Each is first checked (output and every gradient, the soft
assignments' included) against the reference on a prefix. Layout: ``[batch, seq, heads,
head_dim]``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from focus_pretrain.focus.attention import _request, focus_attention
from focus_pretrain.focus.backends import AttentionPattern, get_backend
from focus_pretrain.focus.gate_forms import dot_gate_call
from focus_pretrain.focus.pattern import key_side_memberships, pattern_density
from focus_pretrain.focus.pattern_settings import FocusPattern
from focus_pretrain.focus.router import Routing

CHECK_TOKENS = 2048  # prefix whose output and gradients are checked against the reference


def train_rows(
    cfg, q: Tensor, k: Tensor, v: Tensor, probs: Tensor, measure: Callable, log: Callable
) -> Iterator[dict]:
    """The soft row, then one sparse row per ``cfg.top_k`` (those of ``cfg.train_modes``), each
    with the backends of ``cfg.backends`` that train it here (the others are logged as
    skipped)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, probs)]
    grad = torch.randn_like(q)
    dense = measure(functools.partial(_dense_step, leaves, grad, cfg.head_dim**-0.5))
    soft = [("soft", 1)] if "soft" in cfg.train_modes else []
    sparse = [("hard_gated", t) for t in cfg.top_k] if "hard" in cfg.train_modes else []
    for gate_form in cfg.gate_forms:
        for mode, top_k in soft + sparse:
            if top_k > probs.shape[-1]:
                continue
            case = (mode, top_k, gate_form, cfg.key_groups)
            names = [name for name in cfg.backends if _trains(name, leaves, case, cfg, log)]
            if names:
                yield _row(cfg, leaves, grad, case, dense, measure, names, log)


def _trains(name: str, leaves: list[Tensor], case: tuple, cfg, log) -> bool:
    """Whether ``name`` differentiates ``case`` (mode, top_k, gate form, key groups) here
    (else logs why not): for the ``dot`` form, the call its rewrite makes."""
    mode, top_k, gate_form, key_groups = case
    try:
        backend = get_backend(name)
    except ValueError:
        return False
    q, k, v, probs = leaves
    settings = FocusPattern(
        window=cfg.window, mode=mode, top_k=top_k, gate_form=gate_form, key_groups=key_groups
    )
    if gate_form == "dot":
        call = dot_gate_call(q, k, v, probs, settings)
        q, k, v, settings = call.q, call.k, call.v, call.pattern
    scale = cfg.head_dim**-0.5
    pattern = AttentionPattern.of(
        replace(settings, scale=scale), probs=probs, groups=probs.shape[-1]
    )
    reason = backend.refusal(_request(q, k, v, pattern, return_lse=False))
    if reason is not None:
        log(f"{name} {_label(case)} training step skipped: it does not take {reason}")
    return reason is None


def _label(case: tuple) -> str:
    """``case`` (mode, top_k, gate form, key groups) in the log's words: ``soft top_k=1``
    (``... dot``, ``... keys own_and_previous``)."""
    mode, top_k, gate_form, key_groups = case
    label = f"{mode} top_k={top_k}" + ("" if gate_form == "sigmoid" else f" {gate_form}")
    return label + ("" if key_groups == "own" else f" keys {key_groups}")


def _synchronized(fn: Callable, device: torch.device) -> None:
    """``fn()``, then wait for the device."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _dense_step(leaves: list[Tensor], grad: Tensor, scale: float) -> None:
    """Dense causal SDPA forward + backward (``[b, s, H, D]`` -> SDPA's ``[b, H, s, D]``)."""
    q, k, v = (t.transpose(1, 2) for t in leaves[:3])  # [b, s, H, D] -> [b, H, s, D]
    gqa = k.shape[1] != q.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    out.backward(grad.transpose(1, 2))


def _step(name: str, leaves: list[Tensor], case: tuple, window: int, grad: Tensor):
    """One forward + backward through ``name`` of ``case`` (mode, top_k, gate form, key
    groups): ``[out, dq, dk, dv, dprobs]``."""
    mode, top_k, gate_form, key_groups = case
    for t in leaves:
        t.grad = None
    out = focus_attention(
        *leaves[:3], Routing(leaves[3]), window=window, mode=mode, top_k=top_k, backend=name,
        check_finite=False, gate_form=gate_form, key_groups=key_groups,
    )  # fmt: skip
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


def _check(name: str, leaves: list[Tensor], case: tuple, window: int, grad) -> float:
    """Largest error of the output and every gradient against the reference on a prefix,
    relative to each tensor's largest magnitude."""
    n = min(leaves[0].shape[1], CHECK_TOKENS)
    prefix = [t.detach()[:, :n].clone().requires_grad_(True) for t in leaves]
    want = _step("reference", prefix, case, window, grad[:, :n])
    got = _step(name, prefix, case, window, grad[:, :n])
    return max(
        float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))
        for a, b in zip(got, want, strict=True)
    )


def _row(cfg, leaves, grad, case, dense, measure, names, log) -> dict:
    """The training row of ``case`` (mode, top_k, gate form, key groups): each backend's time
    and speedup over dense, with the seconds its check and its first (compiling) call took,
    logged as they end (a run stopped by a time limit still says where the time went)."""
    mode, top_k, gate_form, key_groups = case
    density = 1.0
    if mode == "hard_gated":
        member = Routing(leaves[3].detach()).membership(top_k).cpu()
        keys = key_side_memberships(member, key_groups)  # None: their own
        density = float(pattern_density(member, cfg.window, key_member=keys).mean())
    backends = {}
    for name in names:
        step = functools.partial(_step, name, leaves, case, cfg.window, grad)
        started = time.perf_counter()
        error = _check(name, leaves, case, cfg.window, grad)
        checked = time.perf_counter()
        _synchronized(step, leaves[0].device)
        first = time.perf_counter()
        log(
            f"  {name} {_label(case)} seq={leaves[0].shape[1]}: checked in "
            f"{checked - started:.1f} s, first full-size call {first - checked:.1f} s"
        )
        total = measure(step)
        backends[name] = dict(
            ms=total, speedup=dense / total, overhead_ms=None, overhead_fraction=None,
            max_abs_error_vs_reference=error,  # relative to each tensor's largest value
            check_s=checked - started, first_call_s=first - checked,
        )  # fmt: skip
    return dict(
        seq=leaves[0].shape[1],
        groups=leaves[3].shape[-1],
        top_k=None if mode == "soft" else top_k,
        window=cfg.window,
        mode=("soft-train" if mode == "soft" else "hard-train")
        + ("" if gate_form == "sigmoid" else f" ({gate_form})")
        + ("" if key_groups == "own" else f" (keys {key_groups})"),
        gate_form=gate_form,
        key_groups=key_groups,
        dense_ms={"sdpa": dense},
        baseline="sdpa",
        ideal_speedup=1.0 / density,
        density=density,
        backends=backends,
    )
