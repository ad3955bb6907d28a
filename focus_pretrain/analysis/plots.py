"""PNG plots of a group report (the dict of :meth:`GroupStats.result`), with matplotlib's
object API and the Agg canvas (no pyplot, no display, no global backend switch).

* ``shares.png``: per-layer stacked top-1 group shares;
* ``distance.png``: kept fraction of the pairs beyond the window by distance, per layer, against
  random routing's constant;
* ``stability.png``: layer x layer NMI and matched agreement;
* ``tokens_layer{l}.png``: the first tokens of the first sample, coloured by top-1 group, laid out
  as lines of text.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

LINE_CHARS = 96  # width of a text line in the token plot, in characters
MONO = "DejaVu Sans Mono"  # ships with matplotlib


def group_colors(num_groups: int) -> list[tuple[float, float, float, float]]:
    """One distinct colour per group (tab10 up to 10, tab20 up to 20, then a hue wheel)."""
    if num_groups <= 10:
        cmap = matplotlib.colormaps["tab10"]
        return [cmap(i) for i in range(num_groups)]
    if num_groups <= 20:
        cmap = matplotlib.colormaps["tab20"]
        return [cmap(i) for i in range(num_groups)]
    cmap = matplotlib.colormaps["hsv"]
    return [cmap(i / num_groups) for i in range(num_groups)]


def save_figure(fig: Figure, path: str | os.PathLike) -> Path:
    """Write ``fig`` as a PNG (120 dpi, without a display)."""
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=120)
    return Path(path)


def plot_shares(result: dict, path: str | os.PathLike) -> Path:
    """Stacked top-1 group shares per Focus layer (each segment ``1/K`` is perfect balance)."""
    k = result["settings"]["num_groups"]
    layers = result["layers"]
    shares = np.array([row["shares"] for row in layers])  # [L, K]
    colors = group_colors(k)
    fig = Figure(figsize=(max(6.0, 0.4 * len(layers) + 2.5), 4.2), layout="constrained")
    ax = fig.add_subplot()
    x = np.arange(len(layers))
    bottom = np.zeros(len(layers))
    for g in range(k):
        ax.bar(x, shares[:, g], bottom=bottom, color=colors[g], edgecolor="white", label=f"g{g}")
        bottom += shares[:, g]
    for i, row in enumerate(layers):
        ax.text(i, 1.01, f"{row['max_share']:.0%}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [str(row["layer"]) for row in layers])
    ax.set_xlabel("layer")
    ax.set_ylabel("share of tokens (top-1 group)")
    ax.set_ylim(0, 1.08)
    ax.set_title(
        f"Top-1 group shares per layer (K = {k}; balanced: {1 / k:.0%} each)\n"
        "above each bar: the largest share",
        fontsize=10,
    )
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, title="group")
    return save_figure(fig, path)


def plot_distance(result: dict, path: str | os.PathLike) -> Path:
    """Kept fraction of the causal pairs beyond the window per distance bin, one line per
    layer, and random routing's constant (``1/K`` for top-1)."""
    bins = result["distance_bins"]
    settings = result["settings"]
    fig = Figure(figsize=(7.0, 4.2), layout="constrained")
    ax = fig.add_subplot()
    if not bins:
        ax.text(0.5, 0.5, "no pair beyond the window (texts too short)", ha="center")
        ax.set_axis_off()
        return save_figure(fig, path)
    centers = [math.sqrt(lo * hi) for lo, hi in bins]
    cmap = matplotlib.colormaps["viridis"]
    n_layers = len(result["layers"])
    for i, row in enumerate(result["layers"]):
        y = [np.nan if v is None else v for v in row["distance"]["kept_fraction"]]
        color = cmap(i / max(n_layers - 1, 1))
        ax.plot(centers, y, marker="o", color=color, label=f"layer {row['layer']}")
    share = result["random"]["pair_share"]
    ax.axhline(share, color="black", linestyle="--", label=f"random routing ({share:.3f})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(centers, [f"{lo}-{hi}" for lo, hi in bins], rotation=30 if len(bins) > 6 else 0)
    ax.minorticks_off()
    ax.set_xlabel(f"distance i - j (beyond the window w = {settings['window']})")
    ax.set_ylabel("fraction of causal pairs kept")
    ax.set_ylim(0, 1)
    ax.set_title(
        f"Same-group pairs by distance (K = {settings['num_groups']}, top_k = {settings['top_k']})"
    )
    ax.legend(fontsize=8, ncol=1 + n_layers // 12, loc="best")
    return save_figure(fig, path)


def plot_stability(result: dict, path: str | os.PathLike) -> Path:
    """Layer x layer heatmaps: NMI of the top-1 assignments and agreement after matching."""
    stability = result["stability"]
    labels = [str(row["layer"]) for row in result["layers"]]
    n = len(labels)
    fig = Figure(figsize=(2 * max(3.0, 0.35 * n + 1.5) + 1, max(3.0, 0.35 * n + 1.5)))
    fig.set_layout_engine("constrained")
    axes = fig.subplots(1, 2)
    for ax, key, title in (
        (axes[0], "nmi", "normalised mutual information"),
        (
            axes[1],
            "matched_agreement",
            f"agreement after {stability['matching']} matching of groups",
        ),
    ):
        values = np.array(stability[key])  # [L, L]
        image = ax.imshow(values, vmin=0, vmax=1, cmap="magma")
        ax.set_xticks(range(n), labels, fontsize=7)
        ax.set_yticks(range(n), labels, fontsize=7)
        ax.set_xlabel("layer")
        ax.set_ylabel("layer")
        ax.set_title(title, fontsize=9)
        if n <= 12:
            for i in range(n):
                for j in range(n):
                    color = "black" if values[i, j] > 0.6 else "white"
                    ax.text(
                        j,
                        i,
                        f"{values[i, j]:.2f}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color=color,
                    )
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.suptitle("Do layers group tokens alike? (1: same grouping, 0: independent)")
    return save_figure(fig, path)


def _display(text: str) -> str:
    return text.replace("\n", "\\n").replace("\t", "\\t").replace("$", r"\$") or " "


def _layout(texts: list[str]) -> list[tuple[int, int, int]]:
    """``(line, column, width)`` of each token laid out as text lines of :data:`LINE_CHARS`;
    a token ending a line of the text (``\\n``) ends its line here too."""
    out, line, col = [], 0, 0
    for text in texts:
        width = len(_display(text))
        if col and col + width > LINE_CHARS:
            line, col = line + 1, 0
        out.append((line, col, width))
        col += width
        if text.endswith("\n"):
            line, col = line + 1, 0
    return out


def plot_tokens(
    result: dict, layer_index: int, path: str | os.PathLike, *, max_tokens: int = 256
) -> Path:
    """The first ``max_tokens`` tokens of the first sample, each on a background of its
    top-1 group's colour in Focus layer number ``layer_index`` (0-based among Focus layers),
    laid out as lines of text; position numbers on the left."""
    sample = result["sample"]
    k = result["settings"]["num_groups"]
    row = result["layers"][layer_index]
    ids = sample["ids"][:max_tokens]
    texts = sample["text"][:max_tokens] if sample["text"] else [f"{i} " for i in ids]
    groups = sample["groups"][layer_index][:max_tokens]
    places = _layout(texts)
    lines = places[-1][0] + 1 if places else 1
    char_w, line_h = 0.078, 0.24  # inches at 9 pt monospace
    fig = Figure(figsize=(LINE_CHARS * char_w + 1.6, lines * line_h + 1.4))
    ax = fig.add_axes((0.06, 0.3 / (lines * line_h + 1.4), 0.92, 1 - 1.2 / (lines * line_h + 1.4)))
    colors = group_colors(k)
    starts: dict[int, int] = {}
    for pos, (text, group, (line, col, width)) in enumerate(
        zip(texts, groups, places, strict=True)
    ):
        starts.setdefault(line, pos)
        ax.add_patch(
            Rectangle(
                (col, line - 0.42),
                width,
                0.84,
                facecolor=colors[group],
                alpha=0.55,
                edgecolor="white",
                linewidth=0.6,
            )
        )
        ax.text(col, line, _display(text), family=MONO, fontsize=9, va="center", ha="left")
    for line, pos in starts.items():
        ax.text(
            -0.8, line, str(pos), family=MONO, fontsize=7, va="center", ha="right", color="gray"
        )
    ax.set_xlim(-5, LINE_CHARS)
    ax.set_ylim(lines - 0.5, -0.5)
    ax.set_axis_off()
    handles = [
        Patch(facecolor=colors[g], alpha=0.55, label=f"g{g} ({row['shares'][g]:.0%})")
        for g in range(k)
    ]
    ax.legend(
        handles=handles,
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncol=min(k, 8),
        fontsize=8,
        frameon=False,
    )
    fig.text(
        0.01,
        0.99,
        f"layer {row['layer']}: top-1 group of each token (first {len(ids)} "
        f"tokens of the first sample; window w = {result['settings']['window']})",
        fontsize=9,
        va="top",
    )
    return save_figure(fig, path)


def write_plots(result: dict, out_dir: str | os.PathLike, *, max_tokens: int = 256) -> list[Path]:
    """Every plot of ``result`` into ``out_dir``; returns the files written."""
    out = Path(out_dir)
    files = [
        plot_shares(result, out / "shares.png"),
        plot_distance(result, out / "distance.png"),
        plot_stability(result, out / "stability.png"),
    ]
    for index, row in enumerate(result["layers"]):
        name = f"tokens_layer{row['layer']}.png"
        files.append(plot_tokens(result, index, out / name, max_tokens=max_tokens))
    return files
