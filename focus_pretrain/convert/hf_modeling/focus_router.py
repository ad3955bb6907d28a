"""The Focus router of an exported model and the routing of a forward's keys (shipped inside
the exported directory; standalone: imports only torch and transformers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .configuration_focus import checked_focus
from .focus_cache import focus_cache_layer, store_routing


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


def membership(probs: Tensor, top_k: int) -> Tensor:
    groups = probs.topk(top_k, dim=-1).indices  # [b, s, top_k]
    return (torch.ones_like(groups) << groups).sum(dim=-1)  # int64 bitmask


def allowed_by_mask(mask: Tensor | None, b: int, q_len: int, kv_len: int) -> Tensor | None:
    """HF's 4D mask (bool ``[b|1, 1, q, kv]``, True = attend; or additive float) as a bool
    ``[b, q, kv]``, or ``None`` when there is none (no padding)."""
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        mask = mask == 0  # additive: 0 where attended, a large negative number elsewhere
    return mask[:, 0, :, -kv_len:].expand(b, q_len, kv_len)


def route(module: nn.Module, allowed: Tensor | None, q_len: int, kv_len: int):
    """Routing of all ``kv_len`` keys: ``(probs [b, kv, K], members [b, kv], valid [b, kv],
    cache layer or None)``; the new tokens' routing is stored in the KV cache."""
    focus = module.router.focus
    probs = module.router(module._focus_hidden)  # [b, q, K]
    members = membership(probs, focus["top_k"])  # [b, q]
    if allowed is None:
        valid = torch.ones(members.shape, dtype=torch.bool, device=members.device)
    else:  # a real token is a key its own row attends; padding is a key nobody attends
        valid = allowed[:, :, kv_len - q_len :].any(dim=1)  # [b, q]
    layer = focus_cache_layer(getattr(module, "_focus_cache", None), module.layer_idx)
    return (*store_routing(layer, probs, members, valid, kv_len), layer)


def focus_layout(focus: dict) -> tuple:
    """What building the model fixes: ``enabled`` and ``window_only`` (which layers get a
    router) and, for a window-only model, its ``window``."""
    return focus["enabled"], focus["window_only"], focus["window"] if focus["window_only"] else None


def layer_focus(module: nn.Module) -> dict:
    """The layer's Focus settings, checked (``checked_focus``). What building the model fixed
    (:func:`focus_layout`) may not change after loading, and the routers read the dict they were
    built with: an edit of the former, or ``config.focus`` replaced by another dict, is refused
    instead of silently running the layers as built."""
    router = getattr(module, "router", None)
    focus = checked_focus(module.config.focus)
    if router is not None and router.focus is not focus:
        raise ValueError(
            "config.focus was replaced by another dict, and the routers read the one the model "
            "was built with: edit it in place (model.config.focus['top_k'] = 2), or load the "
            "model again with from_pretrained(path, trust_remote_code=True, focus={...})"
        )
    built = getattr(module, "focus_layout", None)
    if built is not None and built != focus_layout(focus):
        raise ValueError(
            f"focus.enabled={focus['enabled']}, focus.window_only={focus['window_only']}, "
            f"window={focus['window']}: the model was built with {built[0]}, {built[1]}"
            f"{f', window={built[2]}' if built[2] is not None else ''}, and these decide "
            "which layers have a router (and a window-only model's window); load it again "
            "with them set, e.g. from_pretrained(path, trust_remote_code=True, "
            "focus={**config.focus, 'enabled': False})"
        )
    return focus
