"""Focus attention for exported HuggingFace models (shipped inside the exported directory).

Standalone (imports only torch and transformers): each class is the family's own
``transformers`` causal LM whose attention layers get a Focus router (``self_attn.router`` /
GPT-2 ``attn.router``) and whose attention runs through the ``"focus"`` attention function:

* the router reads the attention module's input (the layer's normalised hidden states, as in
  training) and assigns groups ``g = softmax(<W_g h, c>/tau + b)`` (cosine routing by default);
* ``inference_mode="hard"`` (default): a query sees keys in its local window plus keys whose
  ``top_k`` groups intersect its own; ``"soft"``: every causal key, beyond the window with the
  gate ``log sigmoid(lambda (g_i . g_j - 1/2))`` (the training pattern);
* Gemma-2's sliding-window layers keep their window and have no router.

Speed: when ``focus_pretrain`` is importable, a whole-sequence forward (evaluation, the prefill
of generation) runs through its ``focus_attention`` with ``focus["inference_backend"]`` (soft
mode: ``focus["backend"]``; default ``"auto"``: the fastest exact backend, e.g. the decomposed or
FlexAttention kernels on GPU). Otherwise, and for the one-token steps of KV-cache generation,
this file's exact masked dense attention runs (``O(n^2)``; the backend ``"dense"`` forces it).
Batches must be unpadded (no attention mask is applied); generation with the KV cache is
supported (each layer caches its tokens' group assignments).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import (
    AttentionInterface,
    Gemma2ForCausalLM,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    MistralForCausalLM,
    Olmo2ForCausalLM,
    Qwen2ForCausalLM,
)

try:  # the fast exact backends, when the training package is installed
    from focus_pretrain.focus import focus_attention as _package_focus_attention
except ImportError:  # standalone: the dense path below
    _package_focus_attention = None

from .configuration_focus import (
    FocusGemma2Config,
    FocusGPT2Config,
    FocusLlamaConfig,
    FocusMistralConfig,
    FocusOlmo2Config,
    FocusQwen2Config,
)


class FocusRouter(nn.Module):
    """Per-layer router: ``[b, s, hidden] -> [b, s, K]`` group probabilities (fp32)."""

    def __init__(self, hidden_size: int, focus: dict) -> None:
        super().__init__()
        self.focus = focus
        self.proj = nn.Linear(hidden_size, focus["group_dim"], bias=False)
        self.centroids = nn.Parameter(torch.randn(focus["num_groups"], focus["group_dim"]))
        self.register_buffer("balance_offsets", torch.zeros(focus["num_groups"]))

    def forward(self, hidden: Tensor) -> Tensor:
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        projected = F.linear(hidden.to(dtype), self.proj.weight.to(dtype))  # [b, s, d_g]
        centroids = self.centroids.to(dtype)
        if self.focus["normalize"]:
            projected = F.normalize(projected, dim=-1)
            centroids = F.normalize(centroids, dim=-1)
        logits = projected @ centroids.t() / self.focus["tau"]  # [b, s, K]
        return torch.softmax(logits + self.balance_offsets.to(dtype), dim=-1)


def _capture_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
    module._focus_hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def _routing(module: nn.Module, q_len: int, kv_len: int) -> Tensor:
    """Group probabilities of all ``kv_len`` keys (cached across generation steps)."""
    probs = module.router(module._focus_hidden)  # [b, q_len, K]
    cached = getattr(module, "_focus_probs", None)
    if q_len != kv_len and cached is not None and cached.shape[1] == kv_len - q_len:
        probs = torch.cat([cached, probs], dim=1)
    module._focus_probs = probs  # [b, kv_len, K]
    return probs


def _membership(probs: Tensor, top_k: int) -> Tensor:
    groups = probs.topk(top_k, dim=-1).indices  # [b, s, top_k]
    return (torch.ones_like(groups) << groups).sum(dim=-1)  # int64 bitmask


def focus_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """``query [b, H, q, d]``, ``key/value [b, G, kv, d]`` -> ``([b, q, H, d], None)``."""
    _, heads, q_len, d = query.shape
    kv_len = key.shape[2]
    fast = _fast_path(module, query, key, value, scaling, softcap, sliding_window)
    if fast is not None:
        return fast, None
    device = query.device
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    distance = q_pos[:, None] - torch.arange(kv_len, device=device)[None]  # [q, kv]
    causal = distance >= 0
    neg_inf = torch.tensor(float("-inf"), device=device)
    router = getattr(module, "router", None)
    if router is None:  # a sliding-window layer, a window-only twin, or Focus disabled
        allowed = causal
        if sliding_window is not None:
            allowed = causal & (distance < sliding_window)  # HF: W keys including itself
        elif getattr(module, "focus_window", None) is not None:
            allowed = causal & (distance <= module.focus_window)
        bias = torch.where(allowed, 0.0, neg_inf)[None]  # [1, q, kv]
    else:
        focus = router.focus
        probs_k = _routing(module, q_len, kv_len)  # [b, kv, K]
        probs_q = probs_k[:, kv_len - q_len :]
        local = causal & (distance <= focus["window"])
        mode = "soft" if module.training else focus["inference_mode"]
        if mode == "hard":
            member_k = _membership(probs_k, focus["top_k"])
            member_q = member_k[:, kv_len - q_len :]
            shares = (member_q[:, :, None] & member_k[:, None, :]) != 0  # [b, q, kv]
            bias = torch.where(causal & (local | shares), 0.0, neg_inf)
        else:
            affinity = torch.einsum("bqk,bjk->bqj", probs_q, probs_k)  # [b, q, kv]
            gate = F.logsigmoid(focus["gate_lambda"] * (affinity - 0.5))
            bias = torch.where(causal & ~local, gate, 0.0)
            bias = torch.where(causal, bias, neg_inf)
    dtype = torch.promote_types(query.dtype, torch.float32)
    repeat = heads // key.shape[1]
    k = key.to(dtype).repeat_interleave(repeat, dim=1)  # [b, H, kv, d]
    v = value.to(dtype).repeat_interleave(repeat, dim=1)
    scale = d**-0.5 if scaling is None else scaling
    scores = torch.matmul(query.to(dtype), k.transpose(2, 3)) * scale  # [b, H, q, kv]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    weights = torch.softmax(scores + bias[:, None], dim=-1)
    out = torch.matmul(weights, v).to(query.dtype)  # [b, H, q, d]
    return out.transpose(1, 2).contiguous(), None


def _fast_path(module, query, key, value, scaling, softcap, sliding_window) -> Tensor | None:
    """The package's ``focus_attention`` on a whole sequence, or ``None`` where it does not apply.

    ``[b, H, s, d]`` in, ``[b, s, H, d]`` out.
    """
    router = getattr(module, "router", None)
    focus_window = getattr(module, "focus_window", None)
    config_focus = getattr(getattr(module, "config", None), "focus", {})
    focus = router.focus if router is not None else config_focus
    mode = "soft" if module.training else focus.get("inference_mode", "hard")
    backend = focus.get("backend" if mode == "soft" else "inference_backend", "auto")
    if _package_focus_attention is None or backend == "dense" or query.shape[2] != key.shape[2]:
        return None
    kwargs = dict(scale=query.shape[-1] ** -0.5 if scaling is None else scaling, softcap=softcap)
    if router is not None:
        probs = _routing(module, query.shape[2], key.shape[2])  # [b, s, K]
        kwargs.update(window=focus["window"], mode=mode, top_k=focus["top_k"])
        kwargs.update(gate_lambda=focus["gate_lambda"])
    elif sliding_window is not None:  # HF's window counts the token itself
        probs, kwargs["window"], kwargs["local_only"] = None, sliding_window - 1, True
    elif focus_window is not None:
        probs, kwargs["window"], kwargs["local_only"] = None, focus_window, True
    else:  # Focus disabled: plain causal attention, not ours to speed up
        return None
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [b, H, s, d] -> [b, s, H, d]
    out = _package_focus_attention(q, k, v, probs, backend=backend, check_finite=False, **kwargs)
    return out.contiguous()  # [b, s, H, d]


AttentionInterface.register("focus", focus_attention_forward)


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    if hasattr(model, "transformer"):  # GPT-2
        return [block.attn for block in model.transformer.h]
    return [layer.self_attn for layer in model.model.layers]


def _attach_routers(model: nn.Module, config) -> None:
    """Give every Focus layer a router (Gemma-2's sliding layers keep only their window)."""
    config._attn_implementation = "focus"
    focus = config.focus
    for module in _attention_modules(model):
        if getattr(module, "sliding_window", None) is not None or not focus.get("enabled", True):
            continue
        if focus.get("window_only"):
            module.focus_window = focus["window"]
            continue
        module.router = FocusRouter(config.hidden_size, focus)
        module.register_forward_pre_hook(_capture_input, with_kwargs=True)


class FocusGPT2ForCausalLM(GPT2LMHeadModel):
    config_class = FocusGPT2Config

    def __init__(self, config) -> None:
        super().__init__(config)
        _attach_routers(self, config)


class FocusLlamaForCausalLM(LlamaForCausalLM):
    config_class = FocusLlamaConfig

    def __init__(self, config) -> None:
        super().__init__(config)
        _attach_routers(self, config)


class FocusMistralForCausalLM(MistralForCausalLM):
    config_class = FocusMistralConfig

    def __init__(self, config) -> None:
        super().__init__(config)
        _attach_routers(self, config)


class FocusQwen2ForCausalLM(Qwen2ForCausalLM):
    config_class = FocusQwen2Config

    def __init__(self, config) -> None:
        super().__init__(config)
        _attach_routers(self, config)


class FocusOlmo2ForCausalLM(Olmo2ForCausalLM):
    config_class = FocusOlmo2Config

    def __init__(self, config) -> None:
        super().__init__(config)
        _attach_routers(self, config)


class FocusGemma2ForCausalLM(Gemma2ForCausalLM):
    config_class = FocusGemma2Config

    def __init__(self, config) -> None:
        super().__init__(config)
        _attach_routers(self, config)


def attach_focus_adapter(model: nn.Module, adapter_dir) -> nn.Module:
    """Give an unmodified HF causal LM (of the family the adapter was trained on) the routers of
    a Focus retrofit, in place: ``focus_adapter.json`` (the Focus settings) and
    ``focus_adapter.safetensors`` (router tensors, HF names). Returns ``model``."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from .configuration_focus import FOCUS_DEFAULTS

    adapter = Path(adapter_dir)
    meta = json.loads((adapter / "focus_adapter.json").read_text())
    if meta["model_type"] != model.config.model_type.removeprefix("focus_"):
        raise ValueError(
            f"the adapter was trained on a {meta['model_type']} model, "
            f"not {model.config.model_type}"
        )
    model.config.focus = {**FOCUS_DEFAULTS, **meta["focus"]}
    _attach_routers(model, model.config)
    tensors = load_file(str(adapter / "focus_adapter.safetensors"))
    own = model.state_dict()
    wanted = {k for k in own if ".router." in k}
    if set(tensors) != wanted:
        raise ValueError(
            f"the adapter's router tensors do not fit this model: missing "
            f"{sorted(wanted - set(tensors))[:3]}, extra {sorted(set(tensors) - wanted)[:3]}"
        )
    model.load_state_dict(tensors, strict=False)
    return model
