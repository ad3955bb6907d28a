"""The ``triton`` backend's kernels as ``torch.library`` operators: ``torch.compile`` captures
them whole.

* ``torch.compile(fullgraph=True, backend="aot_eager")`` (dynamo and AOT autograd: the whole
  graph with its backward; Inductor is not needed on CPU) over ``focus_attention(...,
  backend="triton")`` for the soft training pattern and a sliding-window layer, with GQA,
  packed documents and sinks: the output, the log-sum-exp and the gradients of ``q``, ``k``,
  ``v`` (and of the soft assignments) equal the eager reference's.
* The captured forward graph calls ``focus_pretrain::soft_attention_forward`` and the captured
  backward graph ``focus_pretrain::soft_attention_backward``: opaque nodes, not graph breaks.
* ``torch.library.opcheck`` (schema, autograd registration, fake implementations against the
  real ones, AOT dispatch with dynamic shapes) passes on both operators.

Without CUDA the kernels run in Triton's interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1``), as in ``tests/unit/test_soft_triton.py``."""

from __future__ import annotations

import pytest
import torch

from focus_pretrain.focus import focus_attention
from tests.helpers import (
    assert_close,
    needs_triton,
    random_documents,
    random_probs,
    random_qkv,
)

pytestmark = [pytest.mark.capture, pytest.mark.torch, needs_triton]

B, N, H, HKV, D, GROUPS, WINDOW, SINKS = 2, 96, 4, 2, 16, 4, 16, 3
FORWARD = torch.ops.focus_pretrain.soft_attention_forward
BACKWARD = torch.ops.focus_pretrain.soft_attention_backward


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles its own graphs: no recompile counted against the test before."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs(seed: int) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """``([q, k, v, probs], documents [b, n], [d_out, d_lse])``: fp32 leaves (no grad yet),
    packed documents and the upstream gradients of ``out [b, n, H, D]`` and ``lse [b, n, H]``."""
    q, k, v = random_qkv(B, N, H, HKV, D, seed=seed, dtype=torch.float32)
    probs = random_probs(B, N, GROUPS, seed=seed + 1, sharpness=3.0).float()
    documents = random_documents(B, N, seed + 2)
    gen = torch.Generator().manual_seed(seed + 3)
    upstream = [torch.randn(B, N, H, D, generator=gen), torch.randn(B, N, H, generator=gen)]
    return [q, k, v, probs], documents, upstream


def _attend(backend: str, local: bool):
    """``(q, k, v, probs, documents) -> (out, lse)`` through ``focus_attention``: the soft
    pattern, or a sliding-window layer (``local_only``; ``probs`` unused)."""

    def attend(q, k, v, probs, documents):
        return focus_attention(
            q, k, v, None if local else probs, window=WINDOW, mode="soft", backend=backend,
            local_only=local, sinks=SINKS, documents=documents, return_lse=True,
        )  # fmt: skip

    return attend


def _run(fn, inputs: list[torch.Tensor], documents, upstream, local: bool) -> list[torch.Tensor]:
    """``[out, lse, dq, dk, dv(, dprobs)]`` of ``fn`` on fresh leaves."""
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    out, lse = fn(*leaves, documents)
    loss = (out * upstream[0]).sum() + (lse * upstream[1]).sum()
    grads = torch.autograd.grad(loss, leaves[:3] if local else leaves)
    return [t.detach() for t in (out, lse, *grads)]


@pytest.mark.parametrize("local", [False, True], ids=["soft", "sliding-window"])
def test_triton_compiles_whole_forward_and_backward(local):
    """``fullgraph=True`` (raises on any graph break) with ``aot_eager``: compiled forward and
    backward through the triton operators equal the eager reference (``test_soft_triton``'s
    tolerance)."""
    inputs, documents, upstream = _inputs(seed=7 + local)
    compiled = torch.compile(
        _attend("triton", local), fullgraph=True, dynamic=False, backend="aot_eager"
    )
    got = _run(compiled, inputs, documents, upstream, local)
    want = _run(_attend("reference", local), inputs, documents, upstream, local)
    assert want[0].abs().max() > 0.1
    assert_close(got, want, 2e-5)


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "documents+sinks"])
@pytest.mark.parametrize("mode", ["hard", "hard_gated"])
def test_triton_hard_top1_compiles_whole_forward_and_backward(mode, packed):
    """The hard top-1 path (the group-sorted layout and its kernels: hard inference, and sparse
    training with the gate's gradient) compiles with ``fullgraph=True`` and equals the eager
    reference, output and every gradient."""
    (q, k, v, probs), documents, _ = _inputs(seed=11 + packed)

    def attend(backend):
        def call(q, k, v, probs):
            return focus_attention(
                q, k, v, probs, window=WINDOW, mode=mode, top_k=1, backend=backend,
                check_finite=False, sinks=SINKS if packed else 0,
                documents=documents if packed else None,
            )  # fmt: skip

        return call

    gen = torch.Generator().manual_seed(5)
    upstream = torch.randn(B, N, H, D, generator=gen)

    def run(fn):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, probs)]
        out = fn(*leaves)
        wrt = leaves if mode == "hard_gated" else leaves[:3]  # hard: no gradient to the gate
        return [out.detach(), *torch.autograd.grad((out * upstream).sum(), wrt)]

    compiled = torch.compile(attend("triton"), fullgraph=True, dynamic=False, backend="aot_eager")
    got, want = run(compiled), run(attend("reference"))
    assert want[0].abs().max() > 0.1
    assert_close(got, want, 2e-5)


def _recording_backend(graphs: dict[str, list[str]]):
    """``aot_eager`` that also keeps the code of the forward and backward graphs it runs."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def compiler(name: str):
        def compile_graph(gm: torch.fx.GraphModule, example_inputs):
            graphs[name].append(gm.code)
            return make_boxed_func(gm.forward)

        return compile_graph

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"))


def test_compiled_graphs_call_the_operators():
    """The captured graphs hold one forward and one backward operator call, and the compiled
    gradients equal the eager triton backend's (the same operators)."""
    inputs, documents, upstream = _inputs(seed=3)
    graphs: dict[str, list[str]] = {"forward": [], "backward": []}
    attend = _attend("triton", local=False)
    compiled = torch.compile(
        attend, fullgraph=True, dynamic=False, backend=_recording_backend(graphs)
    )
    got = _run(compiled, inputs, documents, upstream, local=False)
    assert len(graphs["forward"]) == 1 and len(graphs["backward"]) == 1
    assert graphs["forward"][0].count("focus_pretrain.soft_attention_forward") == 1
    assert graphs["backward"][0].count("focus_pretrain.soft_attention_backward") == 1
    assert "soft_attention_backward" not in graphs["forward"][0]
    want = _run(attend, inputs, documents, upstream, local=False)
    assert_close(got, want, 1e-6)


def _op_args(local: bool, requires_grad: bool, packed: bool = False) -> tuple:
    """A small call of the forward operator: ``b=1, n=32``, GQA, documents (soft) or a softcap
    (sliding window); ``packed``: the sorted top-1 path's call (segments as documents by index,
    the pair rule's own positions)."""
    q, k, v = random_qkv(1, 32, 2, 1, 16, seed=1, dtype=torch.float32)
    probs = random_probs(1, 32, 3, seed=2).float()
    tensors = [t.requires_grad_(requires_grad) for t in (q, k, v, probs)]
    documents = torch.zeros(1, 32, dtype=torch.int64)  # [b, n] starts: two documents
    documents[0, 20:] = 20
    if local:  # (window, gate_lambda, softcap, scale, sinks, packed)
        return (*tensors[:3], None, None, None, None, None, None, 8, 10.0, 3.0, 0.25, 1, False)
    p, docs = tensors[3], documents
    if packed:  # rule positions: segment start + a spread-out position inside the document
        rule = docs + torch.arange(32).mul(3)[None] % 50  # [1, 32], increasing per segment
        rule = docs + torch.cummax(rule - docs, dim=1).values
        return (*tensors[:3], p, p, docs, docs, rule, rule, 8, 10.0, None, 0.25, 2, True)
    return (*tensors[:3], p, p, docs, docs, None, None, 8, 10.0, None, 0.25, 2, False)


@pytest.mark.parametrize("local, packed", [(False, False), (True, False), (False, True)],
                         ids=["soft", "sliding-window", "packed"])  # fmt: skip
def test_opcheck_forward_operator(local, packed):
    """Schema, autograd registration, fake (meta) against real outputs and AOT dispatch with
    dynamic shapes (forward and backward): a few seconds under the interpreter."""
    torch.library.opcheck(FORWARD, _op_args(local, requires_grad=True, packed=packed))


def test_opcheck_backward_operator():
    """The backward operator on the gradients of a forward call (no double backward)."""
    args = _op_args(local=False, requires_grad=False)
    out, lse = FORWARD(*args)
    gen = torch.Generator().manual_seed(4)
    d_out, d_lse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    tensors, options = args[:9], args[9:]
    torch.library.opcheck(BACKWARD, (d_out, d_lse, *tensors, out, lse, *options))
