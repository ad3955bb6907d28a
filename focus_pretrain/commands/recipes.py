"""List the recipes shipped with the package: `--config NAME` takes any of them by name.

focus-pretrain recipes                 # name, path and first line of each
focus-pretrain train --config tiny     # the CPU demo recipe
"""

from __future__ import annotations

from focus_pretrain.cli import tool_parser


def main() -> None:
    tool_parser(__doc__).parse_args()
    from focus_pretrain.config import shipped_recipes  # after --help: imports PyTorch

    recipes = shipped_recipes()
    width = max(len(name) for name in recipes)
    for name, path in recipes.items():
        lines = [line for line in path.read_text().splitlines() if line.startswith("#")]
        summary = lines[0].lstrip("# ").strip() if lines else ""
        print(f"{name:<{width}}  {summary}")
    print(f"\n({len(recipes)} recipes in {next(iter(recipes.values())).parent})")


if __name__ == "__main__":
    main()
