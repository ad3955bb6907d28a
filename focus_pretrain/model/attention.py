"""Focus attention inside megatron-core: a SelfAttention subclass that owns the router, and a
core-attention module that calls :func:`focus_pretrain.focus.focus_attention`.

Layouts: Megatron hands core attention ``query [s, b, heads/tp, d]`` and
``key/value [s, b, groups/tp, d]`` and wants ``[s, b, heads/tp * d]`` back; our attention API is
``[b, s, h, d]``. The conversion happens here, once, in :class:`FocusCoreAttention`.

The routing is computed from the layer's normalised input (the tensor that feeds ``linear_qkv``)
and passed to core attention as an explicit argument, also through selective activation
recompute, never stashed on a module.

Under Megatron sequence parallelism a layer's normalised input is ``[s / tp, b, hidden]``
(this rank's slice of the tokens): the router projects those tokens and all-gathers the
``d_g``-wide projection over the tensor-parallel group (:func:`_gather_tokens`), so routing,
Sinkhorn and the balance statistics see the whole sequence as without it; ``linear_qkv``
all-gathers the sequence for the attention itself.

Packed documents arrive as ``packed_seq_params``, a
:class:`~focus_pretrain.model.packing.DocumentParams` (document starts for the attention and
the router, per-token RoPE positions); Megatron's own ``thd`` packing is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from torch import Tensor

from focus_pretrain.focus import FocusConfig, FocusRouter, Routing, focus_attention
from focus_pretrain.focus.attention_mass import removed_attention_mass
from focus_pretrain.focus.pair_count import kept_pairs
from focus_pretrain.focus.pattern import UNLIMITED_WINDOW
from focus_pretrain.model.packing import DocumentParams, rope_for_positions
from focus_pretrain.model.rope import RopeScaling, set_rope_frequencies


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose gradient is made contiguous.

    Megatron's ``_reduce`` all-reduces ``grad.contiguous()`` but returns the original tensor, so
    a non-contiguous gradient would silently skip the tensor-parallel reduction of router grads.
    """

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _gather_tokens(projected: Tensor) -> Tensor:
    """All tensor-parallel ranks' token slices of the routers' projection, in sequence order:
    ``[b, s / tp, d_g] -> [b, s, d_g]`` (sequence parallelism).

    The backward keeps this rank's slice of the gradient without summing: the routing after
    the gather is computed alike on every rank and its gradient arrives already summed over
    the tensor-parallel group (the copy in :meth:`FocusSelfAttention.route`).
    """
    gathered = tensor_parallel.gather_from_sequence_parallel_region(
        projected.transpose(0, 1).contiguous(), tensor_parallel_output_grad=False
    )  # [b, s / tp, d_g] -> [s / tp, b, d_g] -> [s, b, d_g]
    return gathered.transpose(0, 1)  # [s, b, d_g] -> [b, s, d_g]


class FocusCoreAttention(MegatronModule):
    """Core attention with the Focus pattern (or dense causal when Focus is disabled).

    Constructed by Megatron's ``SelfAttention`` with the same arguments as its
    ``DotProductAttention``; ``focus``, ``local_window``, ``softcap`` and ``sinks`` come from the
    layer spec (``sinks``: ``focus.sinks`` for Focus layers and the window-only twin's, 0 for a
    family's own sliding-window layers and dense models).
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        *,
        focus: FocusConfig,
        local_window: int | None = None,
        softcap: float | None = None,
        sinks: int = 0,
    ) -> None:
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"Focus attention is causal; got attn_mask_type={attn_mask_type}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout must be 0 with Focus attention, got {dropout}")
        self.focus = focus
        self.local_window = local_window
        self.softcap = softcap
        self.sinks = sinks
        self.softmax_scale = softmax_scale
        # Context parallelism installs its attention here from outside the model
        # (focus_pretrain.parallel.apply_context_parallel); same signature as focus_attention.
        self.attention_fn = None

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None = None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params=None,
        routing: Routing | None = None,
        mode: str = "soft",
        documents: Tensor | None = None,
    ) -> Tensor:
        """``query [s, b, np, d]``, ``key/value [s, b, ng, d]`` -> ``[s, b, np * d]``.

        ``documents``: ``[b, s]`` int64 global document starts of packed sequences (this
        rank's shard under context parallelism), or ``None``.
        """
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError(
                "Focus core attention takes packed documents as documents=, and no bias"
            )
        if attention_mask is not None:
            raise ValueError(
                "Focus attention is causal and takes no attention_mask; pack documents with "
                "focus_pretrain.model.packing.DocumentParams as packed_seq_params"
            )
        s, b = query.shape[:2]
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))  # [s, b, h, d] -> [b, s, h, d]
        local_only = routing is None
        if local_only:
            window = UNLIMITED_WINDOW if self.local_window is None else self.local_window
        else:
            window = self.focus.window
        attention = focus_attention
        if self.config.context_parallel_size > 1:
            if self.attention_fn is None:
                raise ValueError(
                    "a model built with context_parallel_size > 1 must be wrapped by "
                    "focus_pretrain.parallel.apply_context_parallel(model, group, cp_mode)"
                )
            attention = self.attention_fn
        pattern = self.focus.pattern(
            window=window, mode=mode, local_only=local_only, softcap=self.softcap,
            scale=self.softmax_scale, sinks=self.sinks,
        )  # fmt: skip  # the recipe's settings, this layer's window, sinks and scale
        out = attention(
            q,
            k,
            v,
            routing,
            pattern,
            check_finite=self.focus.check_finite,
            backend=self.focus.backend if mode != "hard" else self.focus.inference_backend,
            **({"documents": documents} if documents is not None else {}),
        )  # [b, s, np, d]
        return out.transpose(0, 1).reshape(s, b, -1)  # [b, s, np, d] -> [s, b, np * d]

    def removed_mass(
        self, query: Tensor, key: Tensor, routing: Routing, mode: str, documents: Tensor | None
    ) -> Tensor:
        """``-log`` of the share of this layer's dense attention mass that ``mode``'s pattern
        (the training pattern in ``train()``, the inference pattern in ``eval()``) keeps
        (:func:`~focus_pretrain.focus.attention_mass.removed_attention_mass`), summed over this
        rank's heads: ``[b, s]`` fp32, from ``query [s, b, np, d]`` and ``key [s, b, ng, d]``;
        differentiable in the routing only."""
        if self.config.context_parallel_size > 1:
            raise ValueError("the attention_mass objective does not run under context parallelism")
        q, k = (t.detach().transpose(0, 1) for t in (query, key))  # [s, b, h, d] -> [b, s, h, d]
        pattern = self.focus.pattern(
            window=self.focus.window, mode=mode, softcap=self.softcap,
            scale=self.softmax_scale, sinks=self.sinks,
        )  # fmt: skip
        backend = self.focus.backend if mode != "hard" else self.focus.inference_backend
        removed = removed_attention_mass(
            q, k, k, routing, pattern, backend=backend, check_finite=self.focus.check_finite,
            documents=documents,
        )  # fmt: skip  # [b, s, np]
        return removed.sum(dim=-1)


class FocusSelfAttention(SelfAttention):
    """Megatron ``SelfAttention`` whose core attention is Focus; owns the layer's router.

    ``focus.enabled = False`` or a sliding-window layer (``local_window`` set on the core
    attention) builds no router. ``post_norm`` (a norm class) normalises the attention output
    before the residual add (OLMo-2, Gemma). The layer's RoPE comes at construction:
    ``rotary_base`` and ``rope_scaling`` are the model's (this layer's rotary embedding then
    serves the per-token positions of packed documents, the model's table everything else);
    ``local_rotary_base`` (Gemma-3's local layers) rotates q/k with this layer's own unscaled
    RoPE instead of the model's; neither: no RoPE (learned positions). Training uses the soft
    gate; ``eval()`` uses ``focus.inference_mode``.
    """

    def __init__(
        self,
        config,
        submodules,
        layer_number,
        attn_mask_type=AttnMaskType.causal,
        cp_comm_type=None,
        pg_collection=None,
        *,
        focus: FocusConfig,
        post_norm: type | None = None,
        rotary_base: float | None = None,
        rope_scaling: RopeScaling | None = None,
        local_rotary_base: float | None = None,
    ) -> None:
        super().__init__(
            config,
            submodules,
            layer_number,
            attn_mask_type=attn_mask_type,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        self.post_norm = None  # OLMo-2 / Gemma-2: normalise the attention output
        if post_norm is not None:
            self.post_norm = build_module(
                post_norm,
                config=config,
                hidden_size=config.hidden_size,
                eps=config.layernorm_epsilon,
            )
        # this layer's RoPE (no parameters, no buffers: nothing in the state)
        self.rotary = None
        if local_rotary_base is not None or rotary_base is not None:
            self.rotary = self._rotary_embedding(
                local_rotary_base or rotary_base, None if local_rotary_base else rope_scaling
            )
        self.own_rope = local_rotary_base is not None  # replaces the model's table too
        local = getattr(self.core_attention, "local_window", None) is not None
        self.router = None
        # sparse training's (kept, causal) pair counts since the last log interval
        self.pair_counts: Tensor | None = None
        # what train() computes: the soft gate during focus.soft_warmup_steps (the trainer
        # moves it on: focus_pretrain.train.focus_stats.set_training_pattern), then the recipe's
        self.training_pattern = focus.training_pattern_at(0)
        if focus.enabled and not local:
            device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
            # Router init draws from its own seeded stream so that the rest of the model gets
            # the same weights as its dense twin (focus.enabled=false) for the same seed.
            with torch.random.fork_rng(devices=[] if device == "cpu" else [device]):
                torch.manual_seed(torch.initial_seed() + 7919 * layer_number)
                self.router = FocusRouter.from_config(
                    focus, config.hidden_size, device=device, dtype=config.params_dtype
                )
            for p in self.router.parameters():  # replicated over TP ranks
                tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
            # sequence parallelism: the projection sees this rank's tokens only (a partial
            # gradient, summed over TP by focus_pretrain.parallel.sequence_parallel); the
            # centroids see the gathered sequence and get the whole gradient on every rank
            self.router.proj.weight.sequence_parallel = config.sequence_parallel
        self.focus = focus
        # Context parallelism sets this from outside: ``fn(local_seq_len) -> router kwargs``
        # (Sinkhorn's column reduction over the whole sequence).
        self.route_options = None
        # True inside dense_attention(): the router is not called, attention is dense causal
        self.bypass_focus = False
        # a list inside removed_attention_mass_of(): each forward appends its removed mass
        self.removed_mass_sink: list[Tensor] | None = None

    @property
    def local_rotary(self) -> RotaryEmbedding | None:
        """A local layer's own RoPE (Gemma-3), used instead of the model's; else ``None``."""
        return self.rotary if self.own_rope else None

    def _rotary_embedding(self, base: float, scaling: RopeScaling | None) -> RotaryEmbedding:
        """A megatron-core ``RotaryEmbedding`` as ``GPTModel`` builds its own (same inverse
        frequencies), with HF's scaled frequencies when ``scaling`` is given."""
        rotary = RotaryEmbedding(
            kv_channels=self.config.kv_channels,
            rotary_percent=1.0,
            rotary_interleaved=self.config.rotary_interleaved,
            rotary_base=base,
            use_cpu_initialization=self.config.use_cpu_initialization,
            cp_group=self.pg_collection.cp,
        )
        if scaling is not None:
            set_rope_frequencies(rotary, self.config.kv_channels, base, scaling)
        return rotary

    def route(self, hidden_states: Tensor, documents: Tensor | None = None) -> Routing | None:
        """Route the normalised layer input ``[s, b, hidden]`` (``[s / tp, b, hidden]`` under
        sequence parallelism) into a routing ``[b, s, K]`` of the whole sequence; ``None``
        without a router. ``documents`` (``[b, s]`` document starts) keeps Sinkhorn routing
        inside documents."""
        if self.router is None:
            return None
        seq_len, options = hidden_states.shape[0], {}
        if self.config.sequence_parallel:
            seq_len *= self.config.tensor_model_parallel_size
            options["gather_tokens"] = _gather_tokens
        if self.route_options is not None:
            options.update(self.route_options(seq_len))
        if documents is not None:
            options["documents"] = documents
        routing = self.router(hidden_states.transpose(0, 1), **options)  # [s, b, h] -> [b, s, h]
        # Each TP rank back-propagates through its own heads only: the copy's backward sums the
        # routing gradient over TP. _ContiguousGrad sits *after* the copy so that the gradient
        # reaching the copy's all-reduce is contiguous (else it is silently not reduced).
        probs = _ContiguousGrad.apply(
            tensor_parallel.copy_to_tensor_model_parallel_region(routing.probs)
        )
        return Routing(probs)

    def _count_pairs(self, routing: Routing, documents: Tensor | None) -> None:
        """Sparse training: add the pairs this call keeps and the causal pairs of its samples
        to :attr:`pair_counts` (``[2]`` int64 on the device; no host sync), read and reset once
        per log interval (:func:`~focus_pretrain.train.focus_stats.attention_density`). Not
        counted under context parallelism (a rank holds a zigzag part of the sequence)."""
        if self.config.context_parallel_size > 1:
            return
        b, n = routing.probs.shape[:2]
        top_groups = routing.probs.detach().topk(self.focus.top_k, dim=-1).indices  # [b, n, k]
        sinks = self.core_attention.sinks
        kept = kept_pairs(top_groups, self.focus.window, sinks, documents).sum()
        counts = torch.stack([kept, kept.new_tensor(b * n * (n + 1) // 2)])  # [2]
        if self.pair_counts is None:
            self.pair_counts = torch.zeros_like(counts)
        self.pair_counts += counts

    def _measure_removed_mass(
        self, hidden: Tensor, query: Tensor, key: Tensor, mode: str, documents: Tensor | None
    ) -> None:
        """Append to :attr:`removed_mass_sink` this layer's removed attention mass ``[b, s]``,
        the mean over all heads of every tensor-parallel rank, for the routing of ``hidden``
        (detached: only the router is differentiated; the forward itself stays dense)."""
        routing = self.route(hidden.detach(), documents)
        per_rank = self.core_attention.removed_mass(query, key, routing, mode, documents)
        total = tensor_parallel.reduce_from_tensor_model_parallel_region(per_rank)  # [b, s]
        self.removed_mass_sink.append(total / self.config.num_attention_heads)

    def _local_rotary_emb(self, model_emb: Tensor | tuple[Tensor, Tensor]) -> Tensor:
        """This layer's RoPE ``[s_local, 1, 1, d]`` for the positions of the model's embedding
        ``model_emb`` (same length; under context parallelism each rank holds ``1 / CP`` of
        the sequence and gets the same zigzag slice of this one)."""
        first = model_emb[0] if isinstance(model_emb, tuple) else model_emb
        return self.local_rotary(first.shape[0] * self.config.context_parallel_size)

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        key_value_states=None,
        inference_context=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
    ) -> tuple[Tensor, Tensor | None]:
        """``hidden_states [s, b, hidden]`` -> ``(output [s, b, hidden], bias)``."""
        if inference_context is not None or inference_params is not None:
            raise ValueError("Focus layers do not support Megatron's inference KV cache yet")
        if key_value_states is not None:
            raise ValueError("Focus layers do not support cross attention")
        if packed_seq_params is not None and not isinstance(packed_seq_params, DocumentParams):
            raise ValueError(
                "Focus layers take packed documents as focus_pretrain.model.packing."
                "DocumentParams (document starts per token), not Megatron's thd PackedSeqParams"
            )
        documents = None if packed_seq_params is None else packed_seq_params.document_starts
        routing = None if self.bypass_focus else self.route(hidden_states, documents)
        query, key, value = self.get_query_key_value_tensors(hidden_states)  # [s, b, n, d]
        positions = None if packed_seq_params is None else packed_seq_params.rope_positions
        if rotary_pos_emb is not None and positions is not None:
            if self.rotary is None:
                raise ValueError(
                    "per-token RoPE positions (DocumentParams.rope_positions) need the layer's "
                    "rotary embedding: build the model with focus_pretrain.model.build_model"
                )
            rotary_pos_emb = rope_for_positions(self.rotary, positions)  # [s, b, 1, d]
        elif rotary_pos_emb is not None and self.local_rotary is not None:
            rotary_pos_emb = self._local_rotary_emb(rotary_pos_emb)
        if rotary_pos_emb is not None:
            q_emb, k_emb = (
                rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            )
            query = apply_rotary_pos_emb(query, q_emb, config=self.config)
            key = apply_rotary_pos_emb(key, k_emb, config=self.config)
        mode = self.training_pattern if self.training else self.focus.inference_mode
        if self.removed_mass_sink is not None and self.router is not None:
            self._measure_removed_mass(hidden_states, query, key, mode, documents)
        if mode == "hard_gated" and routing is not None:
            self._count_pairs(routing, documents)
        if self.checkpoint_core_attention and self.training:
            probs = None if routing is None else routing.probs

            def core(q, k, v, p):
                return self.core_attention(
                    q,
                    k,
                    v,
                    attention_mask,
                    routing=None if p is None else Routing(p),
                    mode=mode,
                    documents=documents,
                )

            out = tensor_parallel.checkpoint(core, False, query, key, value, probs)
        else:
            out = self.core_attention(
                query, key, value, attention_mask, routing=routing, mode=mode, documents=documents
            )
        output, bias = self.linear_proj(out)
        if self.post_norm is not None:
            if bias is not None:
                raise ValueError("a post-normed attention cannot have an output bias")
            output = self.post_norm(output)
        return output, bias


@contextlib.contextmanager
def removed_attention_mass_of(model: torch.nn.Module) -> Iterator[list[Tensor]]:
    """Inside the block ``model`` attends densely (:func:`dense_attention`) and each Focus
    layer's forward appends to the yielded list ``-log`` of the share of its dense attention
    mass its training pattern keeps, per token ``[b, s]`` (mean over heads), differentiable in
    its router only (:mod:`focus_pretrain.focus.attention_mass`): the ``attention_mass``
    objective of a retrofit, whose original weights are frozen."""
    layers = [m for m in model.modules() if isinstance(m, FocusSelfAttention)]
    removed: list[Tensor] = []
    with dense_attention(model):
        for layer in layers:
            layer.removed_mass_sink = removed
        try:
            yield removed
        finally:
            for layer in layers:
                layer.removed_mass_sink = None


@contextlib.contextmanager
def dense_attention(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block every Focus layer of ``model`` attends as its dense original: causal
    over the whole sequence (a family's own sliding-window layers keep their window), its
    router not called. With the original weights frozen (a retrofit) the model is then the
    original dense model: the distillation teacher (:mod:`focus_pretrain.train.distill`)."""
    layers = [m for m in model.modules() if isinstance(m, FocusSelfAttention)]
    for layer in layers:
        layer.bypass_focus = True
    try:
        yield
    finally:
        for layer in layers:
            layer.bypass_focus = False
