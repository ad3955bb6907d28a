"""Count the operators one ``focus_attention`` call launches and the host syncs it causes.

For each backend and mode (hard top-1 / top-2, soft, sliding-window), with and without packed
documents and sinks, one warm call is counted with
:class:`~focus_pretrain.bench.dispatch.DispatchCounter`; one JSON line per case on stdout
(docs/benchmarks.md, "Launches and host syncs per call").

    python tools/count_dispatch.py --seq 4096 --device cpu
"""

from __future__ import annotations

import json

import torch

from focus_pretrain.bench.dispatch import DispatchCounter
from focus_pretrain.cli import tool_parser
from focus_pretrain.focus.attention import focus_attention

CASES = [  # (backend, mode, top_k)
    ("decomposed", "hard", 1),
    ("flex", "hard", 1),
    ("flex", "hard", 2),
    ("flex", "soft", 1),
    ("flex", "local", 1),
    ("decomposed", "local", 1),
]


def main(argv: list[str] | None = None) -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    n, shape = args.seq, (1, args.seq, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, device=args.device) for _ in range(3))
    probs = torch.softmax(torch.randn(1, n, args.groups, device=args.device) * 3, dim=-1)
    documents = torch.zeros(1, n, dtype=torch.long, device=args.device)  # [1, n]: 3 documents
    documents[:, n // 4 :], documents[:, 5 * n // 8 :] = 1, 2
    for backend, mode, top_k in CASES:
        for packed in (False, True):
            extra = dict(sinks=4, documents=documents) if packed else {}

            def call(backend=backend, mode=mode, top_k=top_k, extra=extra):
                return focus_attention(
                    q, k, v, probs, window=args.window, mode="hard" if mode == "local" else mode,
                    top_k=top_k, backend=backend, local_only=mode == "local",
                    check_finite=False, **extra,
                )  # fmt: skip

            call()  # warm: shape caches filled
            with DispatchCounter() as counter:
                call()
            case = dict(backend=backend, mode=mode, top_k=top_k, documents_sinks=packed)
            print(json.dumps({**case, **counter.summary()}), flush=True)


if __name__ == "__main__":
    main()
