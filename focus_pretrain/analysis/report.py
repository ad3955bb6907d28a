"""The group report as files: ``report.json`` (every number) and ``report.md`` (tables a person
reads, with the plots of :mod:`focus_pretrain.analysis.plots` embedded)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def _pct(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}%}"


def _token(entry: dict) -> str:
    """A token for a markdown cell: its text quoted (JSON escapes), or ``#id``."""
    if entry.get("text") is None:
        return f"#{entry['id']}"
    quoted = json.dumps(entry["text"], ensure_ascii=False).replace("|", "\\|").replace("`", "'")
    return f"`{quoted}`"


def _table(header: list[str], rows: list[list[str]], align: str | None = None) -> list[str]:
    align = align or "|" + "|".join("---:" for _ in header) + "|"
    return ["| " + " | ".join(header) + " |", align, *["| " + " | ".join(r) + " |" for r in rows]]


def _shares(result: dict) -> list[str]:
    k = result["settings"]["num_groups"]
    rows = [
        [
            str(row["layer"]),
            *[_pct(s) for s in row["shares"]],
            _pct(row["max_share"]),
            _pct(max(row["soft_shares"])),
        ]
        for row in result["layers"]
    ]
    header = ["layer", *[f"g{g}" for g in range(k)], "largest", "largest soft"]
    return [
        "## Group shares",
        "",
        f"Share of tokens whose most probable group is each group (top-1; balanced is "
        f"{1 / k:.1%} each, 100% is a collapsed router). *Largest soft*: the largest mean soft "
        "assignment.",
        "",
        *_table(header, rows),
        "",
        "![group shares per layer](shares.png)",
        "",
    ]


def _density(result: dict) -> list[str]:
    random = result["random"]
    rows = []
    for row in result["layers"]:
        beyond = row["distance"]["kept_fraction_beyond_window"]
        rows.append(
            [
                str(row["layer"]),
                _pct(row["density"], 2),
                _pct(random["density"], 2),
                f"{row['density'] / random['density']:.2f}",
                f"{row['ideal_speedup']:.2f}x",
                _pct(beyond, 2),
            ]
        )
    header = ["layer", "trained", "random", "trained / random", "ideal speedup", "beyond window"]
    return [
        "## Kept pairs: trained routing vs random routing",
        "",
        "Fraction of the causal (query, key) pairs the hard pattern keeps (`pattern_density`: the "
        "window, the sinks and the same-group pairs), per sample then averaged. *Random*: the "
        "same pattern under uniform random routing at the same lengths (as "
        "`tools/pattern_density.py` and the table in docs/benchmarks.md). *Ideal speedup*: "
        "1 / trained over dense causal attention. *Beyond window*: of the pairs farther than "
        f"the window, the fraction sharing a group (random: {_pct(random['pair_share'], 2)}).",
        "",
        *_table(header, rows),
        "",
    ]


def _distance(result: dict) -> list[str]:
    bins = result["distance_bins"]
    lines = ["## Distance profile", ""]
    if not bins:
        return [*lines, "No pair lies beyond the window: the texts are too short.", ""]
    layers = result["layers"]
    rows = []
    for b, (lo, hi) in enumerate(bins):
        cells = [_pct(row["distance"]["kept_fraction"][b]) for row in layers]
        pairs = layers[0]["distance"]["pairs"][b]
        rows.append([f"{lo}-{hi}", f"{pairs:,}", *cells, _pct(result["random"]["pair_share"])])
    independent = [_pct(row["distance"]["independent_pair_share"]) for row in layers]
    rows.append(["any (shuffled)", "-", *independent, _pct(result["random"]["pair_share"])])
    header = ["distance", "pairs", *[f"layer {row['layer']}" for row in layers], "random"]
    return [
        *lines,
        "Of the causal pairs `(i, j)` at distance `i - j` in each bin (beyond the window), the "
        "fraction whose groups intersect (kept by the pattern, sinks aside). Random balanced "
        "routing keeps the *random* column at every distance. The last row is what the layer's "
        "own group shares would give with positions shuffled (two independent tokens sharing "
        "a group; above the random column when the shares are unbalanced): a layer above that "
        "row at some distance groups tokens by where they are, not only by how many.",
        "",
        *_table(header, rows),
        "",
        "![kept fraction by distance](distance.png)",
        "",
    ]


def _typical(result: dict) -> list[str]:
    min_count = result["settings"]["min_count"]
    lines = [
        "## Typical tokens per group",
        "",
        f"Token ids seen at least {min_count} times, ranked by the share of their occurrences "
        "routed to the group (shown with the number of occurrences); only tokens that the "
        "group holds more often than its overall share (lift > 1).",
        "",
    ]
    for row in result["layers"]:
        rows = []
        for g, tokens in enumerate(row["typical_tokens"]):
            cell = ", ".join(f"{_token(t)} {t['share']:.0%} ({t['count']})" for t in tokens)
            rows.append([f"g{g}", _pct(row["shares"][g]), cell or "-"])
        lines += [f"### Layer {row['layer']}", ""]
        lines += _table(["group", "share", "tokens"], rows, "|---|---:|---|")
        lines.append("")
    return lines


def _stability(result: dict) -> list[str]:
    stability, layers = result["stability"], result["layers"]
    lines = [
        "## Stability across layers",
        "",
        "Groups of different layers are not aligned (group 0 of one layer has nothing to do with "
        "group 0 of the next), so the comparisons are invariant to renaming: normalised mutual "
        "information (NMI, 1 = same grouping, 0 = independent) of the top-1 assignments, and "
        f"the agreement after the best one-to-one matching of groups ({stability['matching']}).",
        "",
    ]
    if len(layers) < 2:
        return [*lines, "One Focus layer only: nothing to compare.", ""]
    header = ["layer", *[str(row["layer"]) for row in layers]]
    rows = [
        [str(row["layer"]), *[f"{v:.2f}" for v in stability["nmi"][i]]]
        for i, row in enumerate(layers)
    ]
    lines += ["NMI:", "", *_table(header, rows), ""]
    adjacent = [
        [
            f"{layers[i]['layer']} -> {layers[i + 1]['layer']}",
            f"{stability['nmi'][i][i + 1]:.3f}",
            _pct(stability["matched_agreement"][i][i + 1]),
        ]
        for i in range(len(layers) - 1)
    ]
    lines += _table(["layers", "NMI", "agreement"], adjacent)
    tokens = stability["tokens"]
    lines += [
        "",
        f"A token keeps its (matched) group from one layer to the next "
        f"{_pct(tokens['keep_rate'])} of the time (independent layers with these shares: "
        f"{_pct(tokens['chance'])}).",
        "",
    ]
    for key, title in (("most_stable", "Most stable"), ("least_stable", "Least stable")):
        cell = ", ".join(f"{_token(t)} {t['keep_rate']:.0%} ({t['count']})" for t in tokens[key])
        lines += [f"- {title} tokens (keep rate, occurrences): {cell or '-'}"]
    return [*lines, "", "![stability across layers](stability.png)", ""]


def markdown(result: dict) -> str:
    """``report.md`` of ``result`` (:meth:`GroupStats.result` plus a ``source`` section)."""
    settings, source = result["settings"], result.get("source", {})
    lengths = result["lengths"]
    length_text = str(lengths[0]) if len(lengths) == 1 else f"{lengths[0]}-{lengths[-1]}"
    lines = [
        f"# Focus groups of `{source.get('path', '?')}`",
        "",
        f"- model: {source.get('kind', '?')}, Focus layers "
        f"{', '.join(str(x) for x in settings['layers'])}; K = {settings['num_groups']}, "
        f"top_k = {settings['top_k']}, window = {settings['window']}, "
        f"sinks = {settings['sinks']}, layers run the *{source.get('inference_mode', '?')}* "
        "pattern",
        f"- text: {source.get('text', '?')}: {result['samples']} samples of {length_text} "
        f"tokens, {result['tokens']:,} tokens in all",
        "",
    ]
    lines += _shares(result) + _density(result) + _distance(result)
    lines += _typical(result) + _stability(result)
    lines += ["## A sample, coloured by group", ""]
    lines += [
        f"![layer {row['layer']}](tokens_layer{row['layer']}.png)\n" for row in result["layers"]
    ]
    return "\n".join(lines)


def write_report(result: dict, out_dir: str | os.PathLike) -> tuple[Path, Path]:
    """``report.json`` and ``report.md`` into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "report.json", out / "report.md"
    json_path.write_text(json.dumps(result, indent=1))
    md_path.write_text(markdown(result))
    return json_path, md_path
