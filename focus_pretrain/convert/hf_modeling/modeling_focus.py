"""Focus attention for exported HuggingFace models (shipped inside the exported directory).

Standalone (imports only torch and transformers): each class is the family's own
``transformers`` causal LM whose attention layers get a Focus router (``self_attn.router`` /
GPT-2 ``attn.router``) and whose attention runs through the ``"focus"`` attention function:

* the router reads the attention module's input (the layer's normalised hidden states, as in
  training) and assigns groups ``g = softmax(<W_g h, c>/tau + b)`` (cosine routing by default);
* ``inference_mode="hard"`` (default): a query sees keys in its local window plus keys whose
  ``top_k`` groups intersect its own; ``"soft"``: every causal key, beyond the window with the
  soft gate of `focus_rules.soft_gate` (the training pattern; the rules are in `focus_rules.py`);
* ``focus["key_groups"] = "own_and_previous"``: a key also counts in the groups of the real
  token before it in its document (queries keep their own; ``focus_rules.key_routing``), on
  every path below (the package's ``auto`` picks its flex backend for it on CUDA, its
  reference on a CPU);
* Gemma-2's sliding-window layers keep their window and have no router;
* ``focus["sinks"] = S`` (attention sinks): the first ``S`` *real* tokens of each row (padding
  skipped, so a left-padded row has the sinks of the same sequence alone), or of each packed
  document, are visible to every query of Focus layers and of the window-only twin's layers,
  with no gate (not in a family's own sliding-window layers).

Speed: when ``focus_pretrain`` is importable, a whole-sequence forward (evaluation, the prefill
of generation) runs through its ``focus_attention`` with ``focus["inference_backend"]`` (soft
mode: ``focus["backend"]``; default ``"auto"``: the fastest exact backend, e.g. the decomposed or
FlexAttention kernels on GPU; padded rows run on their real tokens). Otherwise this file's
exact masked dense attention runs (``O(n^2)``; the backend ``"dense"`` forces it). A hard
one-token decode step reads only its window and its groups' keys (``focus_cache.sparse_decode``).
With transformers' ``StaticCache`` (``generate(..., cache_implementation="static")``) an eager
prefill runs its tokens among themselves (as above) and, with the hard pattern, sorts each Focus
layer's prompt slots by group; every later step runs ``focus_static``'s fixed-shape attention:
no host reads, so the decode step compiles whole and can be captured in CUDA graphs (``generate``
with ``compile_config``, or ``torch.compile(model.forward)``), and compiled, a hard step visits
only the key blocks that hold a kept key (``focus_static_sparse``).

Padding: HF's attention mask is applied (a boolean ``"focus"`` mask function is registered);
rows with no key (left padding) output zeros. The routing of cached keys lives in the KV cache
(``focus_cache.FocusDynamicLayer``), so beam search, cropping and copied caches keep it exact.

Packed inputs (as transformers detects them for flash-attention varlen): ``position_ids`` that
restart (a position that is not the previous one + 1 starts a new document) with
``attention_mask`` ``None`` or all ones. Every layer (Focus, window-only, a family's sliding
window) then attends only inside each document, whose sinks are its own first ``S`` tokens, so
each document gets the logits it gets alone (``focus_inputs.packed_documents``). Refused, with
an error: restarting positions among the real tokens of a padded batch, packed inputs after cached
tokens, and continuing a KV cache filled by a packed forward (``focus_cache.check_packed_cache``).
"""

from __future__ import annotations

import inspect
import types

import torch
import transformers
from torch import Tensor, nn
from transformers import AttentionInterface, AttentionMaskInterface

try:  # the fast exact backends, when the training package is installed
    from focus_pretrain.focus import focus_attention as _package_focus_attention
except ImportError:  # standalone: the dense path below
    _package_focus_attention = None
try:  # the settings a newer package's focus_attention takes by name (its FocusPattern)
    from focus_pretrain.focus.pattern_settings import PATTERN_FIELDS as _PACKAGE_SETTINGS
except ImportError:  # an older package names them in its signature
    _PACKAGE_SETTINGS = ()

from .configuration_focus import FOCUS_DEFAULTS, checked_focus, focus_config_class
from .focus_cache import check_packed_cache, sparse_decode
from .focus_inputs import (
    Documents,
    capture_documents,
    capture_input,
    focus_mask,
    real_spans,
    sink_keys,
    sinks_of,
)
from .focus_router import (
    FocusRouter,
    allowed_by_mask,
    focus_layout,
    layer_focus,
    membership,
    route,
)
from .focus_rules import (
    dot_gate,
    groups_intersect,
    key_routing,
    pair_rule,
    soft_cap,
    soft_gate,
)
from .focus_static import static_focus_forward, static_focus_layer

# transformers 5.0 copies into its module cache only the files this module imports itself
from .focus_static_sparse import flex_ready as _static_flex_ready  # noqa: F401

_PACKAGE_PARAMETERS = (
    ()
    if _package_focus_attention is None
    else inspect.signature(_package_focus_attention).parameters
)  # an older focus_pretrain without packed documents or gate forms: the dense path runs them
_PACKAGE_DOCUMENTS = "documents" in _PACKAGE_PARAMETERS
_PACKAGE_GATE_FORMS = "gate_form" in (*_PACKAGE_PARAMETERS, *_PACKAGE_SETTINGS)
_PACKAGE_KEY_GROUPS = "key_groups" in _PACKAGE_SETTINGS  # older: the dense path runs the rule


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
    """``query [b, H, q, d]``, ``key/value [b, G, kv, d]`` -> ``([b, q, H, d], None)``.

    ``attention_mask``: HF's mask (padding, packed sequences) or ``None``; queries that may
    attend to no key (left padding) get a zero output. Packed documents
    (``focus_inputs.packed_documents``) come from the base model's forward.
    """
    b, _, q_len, d = query.shape
    kv_len = key.shape[2]
    scale = d**-0.5 if scaling is None else scaling
    documents = getattr(module, "focus_documents", None)
    docs = None if documents is None else documents.starts  # [b, s] or None
    static = static_focus_layer(getattr(module, "_focus_cache", None), module.layer_idx)
    if static is not None:
        return _static(
            module, static, query, key, value, attention_mask, scale, softcap, sliding_window, docs
        ), None
    check_packed_cache(getattr(module, "_focus_cache", None), module.layer_idx, docs, q_len, kv_len)
    allowed = allowed_by_mask(attention_mask, b, q_len, kv_len)  # [b, q, kv] or None
    router = getattr(module, "router", None)
    focus = layer_focus(module)
    mode = "soft" if module.training else focus["inference_mode"]
    backend = focus["backend" if mode == "soft" else "inference_backend"]
    routing = None
    if router is not None:
        routing = route(module, allowed, q_len, kv_len)
        layer = routing[3]
        decode = q_len == 1 and kv_len > 1 and layer is not None
        if decode and mode == "hard" and backend != "dense":
            out, reads = sparse_decode(
                layer,
                query,
                key,
                value,
                window=focus["window"],
                num_groups=focus["num_groups"],
                scale=scale,
                softcap=softcap,
                sinks=sinks_of(module),
                dot_lambda=focus["gate_lambda"] if focus["gate_form"] == "dot" else None,
                key_groups=focus["key_groups"],
            )
            module.focus_keys_read = getattr(module, "focus_keys_read", 0) + reads
            return out, None
    if backend != "dense" and q_len == kv_len:
        args = (scale, softcap, sliding_window, routing, allowed, mode, backend, docs)
        out = _fast_path(module, query, key, value, *args)
        if out is not None:
            return out, None
    args = (scale, softcap, sliding_window, routing, allowed, mode, docs)
    return _dense(module, query, key, value, *args), None


def _static(
    module, layer, query, key, value, attention_mask, scale, softcap, sliding_window, docs
) -> Tensor:
    """A step on a static KV cache (``focus_static``): ``[b, H, q, d]`` in, ``[b, q, H, d]`` out.

    Raises:
        ValueError: packed documents (a static cache cannot tell where they start).
    """
    if docs is not None:
        raise ValueError(
            "packed inputs (position_ids restarting within a row) with a static cache are not "
            "supported: run packed documents with use_cache=False or the default dynamic cache"
        )
    b, _, q_len, _ = query.shape
    allowed = allowed_by_mask(attention_mask, b, q_len, key.shape[2])  # [b, q, L] or None
    router = getattr(module, "router", None)
    focus = layer_focus(module)
    mode = "soft" if module.training else focus["inference_mode"]
    routing = None
    if router is not None:
        probs = router(module._focus_hidden)  # [b, q, K]
        routing = (probs, membership(probs, focus["top_k"]))  # [b, q, K], [b, q]

    def whole_sequence(n: int, valid: Tensor) -> Tensor:
        """A prefill from slot 0: its ``n`` tokens among themselves (``[b, n, H, d]``)."""
        k, v = key[:, :, :n], value[:, :, :n]  # [b, G, n, d]: slots 0 .. n - 1
        mask = None if allowed is None else allowed[:, :, :n]  # [b, n, n]
        routed = None if routing is None else (*routing, valid)
        args = (scale, softcap, sliding_window, routed, mask, mode)
        backend = focus["backend" if mode == "soft" else "inference_backend"]
        out = _fast_path(module, query, k, v, *args, backend, None) if backend != "dense" else None
        return _dense(module, query, k, v, *args) if out is None else out

    return static_focus_forward(
        layer,
        query,
        key,
        value,
        allowed,
        routing,
        focus,
        mode=mode,
        scale=scale,
        softcap=softcap,
        sliding_window=sliding_window,
        focus_window=getattr(module, "focus_window", None),
        sinks=sinks_of(module),
        cache_position=getattr(module, "_focus_cache_position", None),
        whole_sequence=whole_sequence,
    )


def _dense(
    module, query, key, value, scale, softcap, sliding_window, routing, allowed, mode, docs=None
) -> Tensor:
    """Exact masked attention, ``O(q kv)``: ``[b, H, q, d]`` in, ``[b, q, H, d]`` out.

    ``docs``: ``[b, kv]`` document starts of a packed batch (``q == kv``), or ``None``."""
    heads, q_len = query.shape[1:3]
    kv_len = key.shape[2]
    device = query.device
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]  # [q, 1]
    k_pos = torch.arange(kv_len, device=device)[None]  # [1, kv]
    distance = q_pos - k_pos  # [q, kv]
    documents = {}  # packed: pairs inside one document only ([b, q, kv] masks)
    if docs is not None:
        documents = dict(q_doc=docs[:, kv_len - q_len :, None], k_doc=docs[:, None, :])
    causal, _ = pair_rule(q_pos, k_pos, window=0, **documents)  # [q, kv] or [b, q, kv]
    neg_inf = torch.tensor(float("-inf"), device=device)
    sink = sink_keys(module, routing, allowed, query.shape[0], kv_len, device, docs)
    term = None  # the dot gate form's logit term [b, q, kv], before soft-capping
    if routing is None:  # a sliding-window layer, a window-only twin, or Focus disabled
        keep = causal
        if sliding_window is not None:
            keep = causal & (distance < sliding_window)  # HF: W keys including itself
        elif getattr(module, "focus_window", None) is not None:
            keep = causal & (distance <= module.focus_window)
        if sink is not None:
            keep = keep | (causal & sink[:, None, :])  # [b, q, kv]
        bias = torch.where(keep, 0.0, neg_inf)
        bias = bias if bias.dim() == 3 else bias[None]  # [b|1, q, kv]
    else:
        focus = module.router.focus
        probs_k, member_k = routing[0], routing[1]  # [b, kv, K], [b, kv]
        probs_q, member_q = probs_k[:, kv_len - q_len :], member_k[:, kv_len - q_len :]
        probs_k, member_k = key_routing(probs_k, member_k, routing[2], focus["key_groups"], docs)
        local = causal & pair_rule(q_pos, k_pos, window=focus["window"])[1]
        if sink is not None:  # sinks: like keys in the window (no gate)
            local = local | (causal & sink[:, None, :])  # [b, q, kv]
        if focus["gate_form"] == "dot":  # on every pair; the soft pattern: every causal pair
            term = dot_gate(probs_q, probs_k, focus["gate_lambda"])  # [b, q, kv]
            local = causal if mode == "soft" else local
        if mode == "hard" or term is not None:
            shares = groups_intersect(member_q[:, :, None], member_k[:, None, :])  # [b, q, kv]
            bias = torch.where(causal & (local | shares), 0.0, neg_inf)
        else:
            affinity = torch.einsum("bqk,bjk->bqj", probs_q, probs_k)  # [b, q, kv]
            gate = soft_gate(affinity, focus["gate_lambda"])
            bias = torch.where(causal & ~local, gate, 0.0)
            bias = torch.where(causal, bias, neg_inf)
    if allowed is not None:
        bias = torch.where(allowed, bias, neg_inf)  # [b, q, kv]
    dtype = torch.promote_types(query.dtype, torch.float32)
    repeat = heads // key.shape[1]
    k = key.to(dtype).repeat_interleave(repeat, dim=1)  # [b, H, kv, d]
    v = value.to(dtype).repeat_interleave(repeat, dim=1)
    scores = torch.matmul(query.to(dtype), k.transpose(2, 3)) * scale  # [b, H, q, kv]
    if term is not None:
        scores = scores + term[:, None].to(dtype)
    scores = soft_cap(scores, softcap) + bias[:, None].to(dtype)
    weights = torch.softmax(scores, dim=-1)
    attends = bias.amax(dim=-1, keepdim=True) > float("-inf")  # [b, q, 1]: some key allowed
    weights = torch.where(attends[:, None], weights, 0.0)  # padding rows: no NaN, zero output
    out = torch.matmul(weights, v).to(query.dtype)  # [b, H, q, d]
    return out.transpose(1, 2).contiguous()


def _fast_path(
    module, query, key, value, scale, softcap, sliding_window, routing, allowed, mode, backend, docs
) -> Tensor | None:
    """The package's ``focus_attention`` on whole sequences, or ``None`` where it does not apply
    (not installed, a mask neither padding nor packed documents). Padded rows run on their real
    tokens only; packed rows (document starts ``docs [b, s]``, no padding) with ``documents=``.

    ``[b, H, s, d]`` in, ``[b, s, H, d]`` out.
    """
    if _package_focus_attention is None or (docs is not None and not _PACKAGE_DOCUMENTS):
        return None
    router = getattr(module, "router", None)
    focus_window = getattr(module, "focus_window", None)
    kwargs = dict(scale=scale, softcap=softcap, backend=backend)
    if sinks_of(module):  # padded rows run on their real tokens: the sinks are their first ones
        kwargs.update(sinks=sinks_of(module))
    probs = None
    if router is not None:
        focus = router.focus
        probs = routing[0]  # [b, s, K]
        kwargs.update(window=focus["window"], mode=mode, top_k=focus["top_k"])
        kwargs.update(gate_lambda=focus["gate_lambda"])
        if focus["gate_form"] != "sigmoid":
            if not _PACKAGE_GATE_FORMS:
                return None
            kwargs.update(gate_form=focus["gate_form"])
        if focus["key_groups"] != "own":
            if not _PACKAGE_KEY_GROUPS:
                return None
            kwargs.update(key_groups=focus["key_groups"])
    elif sliding_window is not None:  # HF's window counts the token itself
        kwargs.update(window=sliding_window - 1, local_only=True)
    elif focus_window is not None:
        kwargs.update(window=focus_window, local_only=True)
    else:  # Focus disabled: plain causal attention, not ours to speed up
        return None
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [b, H, s, d] -> [b, s, H, d]
    if docs is not None:  # packed rows have no padding (packed_documents)
        out = _package_focus_attention(q, k, v, probs, check_finite=False, documents=docs, **kwargs)
        return out.contiguous()  # [b, s, H, d]
    spans = real_spans(allowed, q.shape[0], q.shape[1], sliding_window)
    if spans is None:
        return None
    if spans == "all":
        out = _package_focus_attention(q, k, v, probs, check_finite=False, **kwargs)
        return out.contiguous()  # [b, s, H, d]
    out = q.new_zeros(q.shape)
    for r, (start, end) in enumerate(spans):
        if end > start:
            part = None if probs is None else probs[r : r + 1, start:end]
            rows = slice(start, end)
            out[r, rows] = _package_focus_attention(
                q[r : r + 1, rows],
                k[r : r + 1, rows],
                v[r : r + 1, rows],
                part,
                check_finite=False,
                **kwargs,
            )[0]
    return out  # [b, s, H, d]


AttentionInterface.register("focus", focus_attention_forward)
AttentionMaskInterface.register("focus", focus_mask)  # bool masks (padding), None when causal


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    if hasattr(model, "transformer"):  # GPT-2
        return [block.attn for block in model.transformer.h]
    return [layer.self_attn for layer in model.model.layers]


def _attach_routers(model: nn.Module, config) -> None:
    """Give every Focus layer a router (Gemma-2's sliding layers keep only their window), and
    every attention layer the packed documents of the running forward."""
    config._attn_implementation = "focus"
    # a focus section set after the config was built (from_pretrained(path, focus={...}) sets
    # the attribute, without the config's __init__): completed and checked as __init__ does
    focus = config.focus = checked_focus({**FOCUS_DEFAULTS, **config.focus})
    base = model.transformer if hasattr(model, "transformer") else model.model
    base.focus_documents = Documents()
    base.register_forward_pre_hook(capture_documents, with_kwargs=True)
    for module in _attention_modules(model):
        module.focus_documents = base.focus_documents
        module.register_forward_pre_hook(capture_input, with_kwargs=True)
        module.focus_layout = focus_layout(focus)
        if getattr(module, "sliding_window", None) is not None or not focus.get("enabled", True):
            continue
        if focus.get("window_only"):
            module.focus_window = focus["window"]
            continue
        module.router = FocusRouter(config.hidden_size, focus)
    model.set_attn_implementation = types.MethodType(_keep_focus_attention, model)


def _keep_focus_attention(self, attn_implementation, *args, **kwargs):
    """``set_attn_implementation`` of a Focus model: another implementation would run the
    layers without their routers (dense logits), so it is refused."""
    requested = attn_implementation
    if isinstance(attn_implementation, dict):
        requested = attn_implementation.get("", "focus")
    if requested != "focus":
        raise ValueError(
            f"attn_implementation={requested!r} would run this Focus model without its routers "
            "(dense attention, other logits); it must stay 'focus'. To choose how Focus attention "
            "runs, set model.config.focus['inference_backend'] ('auto', 'dense', 'decomposed', "
            "'flex', 'reference')"
        )
    return type(self).set_attn_implementation(self, attn_implementation, *args, **kwargs)


def _focus_model_class(base: type) -> type:
    """``Focus<base>``: the family's causal LM ``base`` with Focus routers; its config class is
    ``Focus<base's config class>`` (``FocusLlamaForCausalLM`` -> ``FocusLlamaConfig``)."""

    def __init__(self, config) -> None:
        base.__init__(self, config)
        _attach_routers(self, config)

    name = f"Focus{base.__name__}"
    namespace = {
        "config_class": focus_config_class(base.config_class.__name__),
        "__init__": __init__,
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"{base.__name__} whose attention layers are Focus layers.",
    }
    return type(base)(name, (base,), namespace)


# the classes made by this run of the module (fresh when transformers runs it again; an earlier
# run's classes left in the namespace by older code are removed)
_MADE_MODELS: dict[str, type] = {}
for _stale in [
    n
    for n in globals()
    if n.startswith("Focus") and n.endswith(("Config", "ForCausalLM", "LMHeadModel"))
]:
    del globals()[_stale]


def focus_model_class(base_name: str) -> type:
    """``Focus<base_name>``: transformers' causal LM class ``base_name``
    (``"LlamaForCausalLM"``, GPT-2's ``"GPT2LMHeadModel"``) with Focus routers, made once per
    run of this module (the same class on every call)."""
    name = f"Focus{base_name}"
    if name not in _MADE_MODELS:
        base = getattr(transformers, base_name, None)
        if not (
            isinstance(base, type)
            and issubclass(base, transformers.PreTrainedModel)
            and base_name.endswith(("ForCausalLM", "LMHeadModel"))
        ):
            raise AttributeError(
                f"{__name__} has no {name}: transformers {transformers.__version__} has no "
                f"causal LM class {base_name}"
            )
        _MADE_MODELS[name] = _focus_model_class(base)
    return _MADE_MODELS[name]


def __getattr__(name: str) -> type:
    """``Focus<X>ForCausalLM`` (``Focus<X>LMHeadModel``) for any transformers causal LM class,
    and ``Focus<X>Config`` (importable from here too): PEP 562, what an export's ``auto_map``
    and ``from modeling_focus import FocusLlamaForCausalLM`` ask for."""
    if name.startswith("Focus") and name.endswith(("ForCausalLM", "LMHeadModel")):
        return focus_model_class(name.removeprefix("Focus"))
    if name.startswith("Focus") and name.endswith("Config") and name != "FocusConfig":
        return focus_config_class(name.removeprefix("Focus"))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def attach_focus_adapter(model: nn.Module, adapter_dir) -> nn.Module:
    """Give an unmodified HF causal LM (of the family the adapter was trained on) the routers of
    a Focus retrofit, in place: ``focus_adapter.json`` (the Focus settings) and
    ``focus_adapter.safetensors`` (router tensors, HF names). Returns ``model``."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    from .configuration_focus import FOCUS_DEFAULTS, check_transformers_version, checked_focus

    adapter = Path(adapter_dir)
    meta = json.loads((adapter / "focus_adapter.json").read_text())
    check_transformers_version((meta.get("focus_transformers") or {}).get("tested"))
    if meta["model_type"] != model.config.model_type.removeprefix("focus_"):
        raise ValueError(
            f"the adapter was trained on a {meta['model_type']} model, "
            f"not {model.config.model_type}"
        )
    model.config.focus = checked_focus({**FOCUS_DEFAULTS, **meta["focus"]})
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
