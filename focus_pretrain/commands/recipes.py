"""List the recipes shipped with the package: `--config NAME` takes each recipe by name, and a
recipe builds on a base with `defaults: NAME`.

focus-pretrain recipes                 # each recipe's name and first sentence, then the bases
focus-pretrain train --config tiny     # the CPU demo recipe
"""

from __future__ import annotations

import re
from pathlib import Path

from focus_pretrain.cli import tool_parser

SUMMARY_WIDTH = 100


def summary(path: Path, width: int = SUMMARY_WIDTH) -> str:
    """The first sentence of the comment block at the top of ``path``, cut at a word to at
    most ``width`` characters."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    text = " ".join(lines)
    sentence = re.split(r"(?<=\.)\s", text, maxsplit=1)[0].rstrip(".")
    if len(sentence) <= width:
        return sentence
    return sentence[: width - 3].rsplit(" ", 1)[0] + "..."


def trains_alone(path: Path) -> bool:
    """Whether ``path`` is a whole recipe (``--config`` runs it as it is), not a base that
    leaves keys open or a fragment of one section."""
    from focus_pretrain.config import load_config

    try:
        load_config(path)
    except (ValueError, TypeError):
        return False
    return True


def main() -> None:
    tool_parser(__doc__).parse_args()
    from focus_pretrain.config import shipped_recipes  # after --help: imports PyTorch

    recipes = shipped_recipes()
    width = max(len(name) for name in recipes)
    whole = {name: path for name, path in recipes.items() if trains_alone(path)}
    bases = {name: path for name, path in recipes.items() if name not in whole}
    print("recipes (focus-pretrain train --config NAME):")
    for name, path in whole.items():
        print(f"  {name:<{width}}  {summary(path)}")
    if bases:
        print("bases and fragments (a recipe builds on them with `defaults: NAME`):")
        for name, path in bases.items():
            print(f"  {name:<{width}}  {summary(path)}")
    print(f"\n({len(recipes)} files in {next(iter(recipes.values())).parent})")


if __name__ == "__main__":
    main()
