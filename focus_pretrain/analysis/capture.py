"""Capturing what a model's routers compute: forward hooks on every Focus router.

Works on our megatron-core model (:class:`focus_pretrain.focus.FocusRouter`, whose forward
returns a :class:`focus_pretrain.focus.Routing`) and on an exported HuggingFace model (the
shipped ``modeling_focus.FocusRouter``, whose forward returns the probabilities tensor): both
classes are called ``FocusRouter`` and both return ``[b, s, K]`` soft assignments.
"""

from __future__ import annotations

import re

from torch import Tensor, nn

from focus_pretrain.errors import InputError

ROUTER_CLASS = "FocusRouter"
# the layer index in a module name: ours "decoder.layers.3.self_attention.router", HF Llama-style
# "model.layers.3.self_attn.router", GPT-2 "transformer.h.3.attn.router"
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


def find_routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """``(layer index, router)`` of every Focus router of ``model``, in layer order.

    Raises:
        InputError: (a ``ValueError``) the model has no router (Focus disabled, the
            window-only twin, or not a Focus model).
    """
    routers = []
    for name, module in model.named_modules():
        if type(module).__name__ != ROUTER_CLASS:
            continue
        match = _LAYER_INDEX.search(name)
        routers.append((int(match.group(1)) if match else len(routers), module))
    if not routers:
        raise InputError(
            f"the model ({type(model).__name__}) has no Focus router: it was built with "
            "focus.enabled=false or focus.window_only=true, or is not a Focus model; there are "
            "no groups to inspect"
        )
    return sorted(routers, key=lambda item: item[0])


class RouterCapture:
    """Context manager collecting each router's output while a model runs.

    ``with RouterCapture(model) as capture: model(...)``, then :meth:`pop` returns one
    ``[b, s, K]`` tensor per Focus layer (CPU, detached), in layer order (:attr:`layers`).
    """

    def __init__(self, model: nn.Module) -> None:
        routers = find_routers(model)
        self.layers = [layer for layer, _ in routers]
        self._modules = [module for _, module in routers]
        self._handles: list = []
        self._probs: list[list[Tensor]] = [[] for _ in routers]

    def __enter__(self) -> RouterCapture:
        for index, module in enumerate(self._modules):
            self._handles.append(module.register_forward_hook(self._hook(index)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, index: int):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            probs = getattr(output, "probs", output)  # ours: Routing; HF: the tensor
            self._probs[index].append(probs.detach().cpu())  # [b, s, K]

        return hook

    def pop(self) -> list[Tensor]:
        """The routing of the last forward, one ``[b, s, K]`` per layer; then clears."""
        calls = {len(p) for p in self._probs}
        if calls != {1}:
            raise RuntimeError(
                f"each router should have run once since the last pop, got {sorted(calls)} calls "
                "(run one forward per pop, without a KV cache)"
            )
        out = [p[0] for p in self._probs]
        self._probs = [[] for _ in self._modules]
        return out
