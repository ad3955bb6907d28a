"""The whole inspection: load a model, route text through it, write the report and plots
(``tools/inspect_groups.py`` is its command line)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from focus_pretrain.analysis.capture import RouterCapture
from focus_pretrain.analysis.groups import GroupStats
from focus_pretrain.analysis.inputs import (
    Sample,
    batches,
    check_counts,
    corpus_samples,
    text_samples,
    token_text,
)
from focus_pretrain.analysis.load import InspectedModel, check_inspectable, load_for_inspection
from focus_pretrain.analysis.plots import write_plots
from focus_pretrain.analysis.report import write_report
from focus_pretrain.data.corpus import resolve_inputs
from focus_pretrain.errors import InputError, MissingInputError


def collect(
    model: InspectedModel,
    samples: Sequence[Sample],
    *,
    batch_size: int = 4,
    seed: int = 0,
    progress: bool = True,
) -> GroupStats:
    """Run ``samples`` through ``model`` (batches of equal lengths), capturing every router's
    assignments ``[b, s, K]`` into a :class:`GroupStats`."""
    capture = RouterCapture(model.module)
    stats = GroupStats(
        model.num_groups, model.window, model.top_k, capture.layers, seed=seed,
        sinks=model.sinks, key_groups=model.key_groups,
    )  # fmt: skip
    todo = list(batches(samples, batch_size))
    with capture:
        for tokens in tqdm(todo, desc="routing", unit="batch", disable=not progress):
            model.run(tokens)  # [b, s]
            stats.add(capture.pop(), tokens)
    return stats


def inspect_groups(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    texts: Sequence[str | os.PathLike] = (),
    corpus: str | None = None,
    samples: int = 16,
    length: int | None = None,
    batch_size: int = 4,
    tokenizer: str | os.PathLike | None = None,
    device: str | None = None,
    min_count: int = 5,
    top_n: int = 8,
    plot_tokens: int = 256,
    seed: int = 0,
    progress: bool = True,
) -> Path:
    """Inspect the groups of ``checkpoint`` (ours or an HF export) on ``texts`` (one sample
    per file) or ``corpus`` (``samples`` x ``length`` tokens; ``length`` defaults to the
    model's maximum); writes ``report.md``, ``report.json`` and the PNG plots into
    ``out_dir`` and returns the path of ``report.md``.

    Raises:
        InputError: neither or both of ``texts``/``corpus``; a count below 1; no tokenizer;
            empty text; a text or ``length`` beyond the model's maximum length; too small a
            corpus; ``out_dir`` is a file.
        MissingInputError: a missing checkpoint, tokenizer or text file.
    """
    _check_sources(texts, corpus, out_dir)
    check_counts(
        {"--samples": samples, "--length": length, "--batch-size": batch_size,
         "--plot-tokens": plot_tokens, "--min-count": min_count, "--top-n": top_n}
    )  # fmt: skip
    check_inspectable(checkpoint, tokenizer)  # before the first progress line
    _say(progress, f"loading {checkpoint}")
    model = load_for_inspection(checkpoint, tokenizer=tokenizer, device=device)
    if model.tokenizer is None:
        raise InputError(
            f"{checkpoint} has no tokenizer (its file is gone or the export has none): pass "
            "--tokenizer PATH (the SentencePiece .model or HF tokenizer directory it was "
            "trained with)"
        )
    layers = RouterCapture(model.module).layers  # refuses a model without routers
    prefix = model.tokenizer.document_prefix(model.add_bos)  # as training documents begin
    if texts:
        chosen = text_samples(texts, model.tokenizer, model.max_length, length, prefix)
        source = ", ".join(str(t) for t in texts)
    else:
        chosen = corpus_samples(
            corpus,
            model.tokenizer,
            samples=samples,
            length=model.max_length if length is None else length,
            max_length=model.max_length,
            prefix=prefix,
        )
        source = f"corpus {corpus}"
    _say(progress, f"routing {len(chosen)} samples through {len(layers)} Focus layers")
    stats = collect(model, chosen, batch_size=batch_size, seed=seed, progress=progress)
    _say(progress, "computing statistics")
    tokenizer_ = model.tokenizer
    result = stats.result(
        decode=lambda i: token_text(tokenizer_, i),
        min_count=min_count,
        top_n=top_n,
        sample_tokens=plot_tokens,
    )
    result["source"] = {
        "path": str(model.path),
        "kind": model.kind,
        "inference_mode": model.inference_mode,
        "text": source,
        "samples": [s.name for s in chosen],
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _say(progress, "plotting")
    write_plots(result, out, max_tokens=plot_tokens)
    _, md_path = write_report(result, out)
    return md_path


def _check_sources(
    texts: Sequence[str | os.PathLike], corpus: str | None, out_dir: str | os.PathLike
) -> None:
    """Exactly one of ``texts`` (existing files) and ``corpus`` (a readable source); ``out_dir``
    not a file. Before the model loads."""
    if bool(texts) == bool(corpus):
        raise InputError("give either --text FILE [FILE ...] or --corpus SOURCE (one of them)")
    for path in texts:
        if not Path(path).is_file():
            raise MissingInputError(f"--text {path} does not exist: give an existing text file")
    if corpus:
        resolve_inputs([corpus])  # a missing file or a bad demo:N, before the model loads
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise InputError(f"--out {out_dir} is a file: give a directory for the report")


def _say(enabled: bool, message: str) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)
