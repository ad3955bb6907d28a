"""Graph breaks of the captured attention paths under the installed torch, on the CPU.

Needs only torch and this checkout (no megatron-core, no GPU), so it runs in a bare virtual
environment of another torch: the GPU image's (2.11) is a CUDA build that also runs on a CPU.
``torch._dynamo.explain`` traces each hard path (``decomposed`` top-1, ``flex`` top-1 and top-2,
with packed documents and sinks) and the soft gate, and the hard paths are then compiled with
``fullgraph=True`` (``aot_eager``) and compared with eager. Exit 1 when any path breaks.

    python -m venv /tmp/t211 && /tmp/t211/bin/pip install torch==2.11.0 numpy
    PYTHONPATH=$PWD /tmp/t211/bin/python tools/graph_breaks.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from focus_pretrain.focus import focus_attention
from focus_pretrain.focus.router import Routing


def cases() -> dict[str, dict]:
    """Name -> ``focus_attention`` keywords of every path a capture must take whole."""
    docs = (torch.arange(512) >= 200).long()[None]  # [b, s]: two documents
    return {
        "decomposed hard top-1": dict(mode="hard", top_k=1, backend="decomposed"),
        "flex hard top-1": dict(mode="hard", top_k=1, backend="flex"),
        "flex hard top-2": dict(mode="hard", top_k=2, backend="flex"),
        "flex hard top-1, documents, sinks": dict(
            mode="hard", top_k=1, backend="flex", documents=docs, sinks=2
        ),
        "flex soft": dict(mode="soft", backend="flex"),
    }


def main() -> int:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 512, 2, 32) for _ in range(3))  # [b, s, H, D]
    probs = torch.softmax(torch.randn(1, 512, 4) * 2, dim=-1)  # [b, s, K]
    broken = 0
    print(f"torch {torch.__version__}")
    for name, kwargs in cases().items():

        def attend(q, k, v, p, kwargs=kwargs):
            return focus_attention(q, k, v, Routing(p), window=16, check_finite=False, **kwargs)

        torch._dynamo.reset()
        explained = torch._dynamo.explain(attend)(q, k, v, probs)
        reasons = sorted({str(r.reason).splitlines()[0] for r in explained.break_reasons})
        line = f"{name}: {explained.graph_break_count} graph breaks"
        if explained.graph_break_count == 0:
            torch._dynamo.reset()
            compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
            error = (compiled(q, k, v, probs) - attend(q, k, v, probs)).abs().max()
            line += f", fullgraph compile equals eager within {float(error):.1e}"
            broken += bool(error > 1e-5)
        else:
            broken += 1
            line += f" ({'; '.join(reasons)})"
        print(line)
    print(f"paths that break: {broken}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
