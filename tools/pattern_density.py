"""How many (query, key) pairs the hard Focus pattern keeps, and the ideal speedup it allows.

Random balanced routing (each token's top-k of uniform random scores), exact pair counts in
O(n * C(K, top_k)) memory, so it runs to a million tokens on a laptop. Prints a markdown table
and, with --json, writes the rows.

    python tools/pattern_density.py --seq 1024 16384 1048576 --groups 4 8 --top-k 1 2
"""

from __future__ import annotations

import json

import torch

from focus_pretrain.cli import tool_parser
from focus_pretrain.focus import Routing, pattern_density


def main() -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--groups", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--top-k", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--sinks", type=int, default=0, help="always-visible first tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the rows to this JSON file")
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    print("| seq | K | top_k | window | pairs kept | ideal speedup |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in args.seq:
        for k in args.groups:
            for top_k in (t for t in args.top_k if t <= k):
                scores = torch.rand(1, n, k, generator=gen)  # [1, n, K] uniform: balanced
                density = float(
                    pattern_density(Routing(scores).membership(top_k), args.window, args.sinks)
                )
                rows.append(
                    dict(
                        seq=n,
                        K=k,
                        top_k=top_k,
                        window=args.window,
                        density=density,
                        ideal_speedup=1 / density,
                    )
                )
                print(
                    f"| {n} | {k} | {top_k} | {args.window} | {density:.2%} | {1 / density:.2f}x |"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
