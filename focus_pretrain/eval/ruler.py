"""RULER needle-in-a-haystack tests of an exported model through lm-evaluation-harness's own
generator (its ``ruler`` tasks: ``niah_single_1``, ``niah_multikey_2``, ...), offline, with the
export's own tokenizer sizing every prompt.

lm-eval's generator builds each task's samples at each length (``max_seq_lengths``: the prompt
plus the task's answer budget, :data:`ANSWER_TOKENS`), the export answers greedily through the
``hf`` model (the model's shipped code with ``trust_remote_code``; the tokenizer, a plain
``tokenizer.json``, without), and lm-eval scores each answer by string match of the
needles' values.
Tasks whose generator downloads its haystack or questions (the Paul Graham essays, SQuAD,
HotpotQA) are skipped offline with the reason; the others need only ``wonderwords`` and
``nltk`` (the ``eval`` extra). :func:`run_ruler` is ``focus-pretrain ruler``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from focus_pretrain.convert.export_dir import export_tokenizer, focus_overrides, read_export
from focus_pretrain.environment import environment
from focus_pretrain.errors import InputError

DEFAULT_TASKS = ("niah_single_1", "niah_multikey_2")
GENERATED_TOKENS = 128  # the needle tasks' answer budget: a length holds the prompt and these
ANSWER_TOKENS = {"ruler_vt": 30, "ruler_fwe": 50, "ruler_cwe": 120}  # the other tasks' (lm-eval
# 0.4's task files); RULER sizes each task's prompts for its own, and the tasks' default
# ``max_gen_toks`` is that budget
PREFIX_ROOM = 64  # the answer prefix ("Answer: The special magic ...") RULER adds after sizing
# a sample and the BOS token: up to about 30 tokens past its length, measured
_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
_ESSAYS = "the Paul Graham essays (hub dataset baber/paul_graham_essays) and nltk's punkt_tab"
DOWNLOADS = {  # task -> what its generator downloads
    "niah_single_2": _ESSAYS,
    "niah_single_3": _ESSAYS,
    "niah_multikey_1": _ESSAYS,
    "niah_multivalue": _ESSAYS,
    "niah_multiquery": _ESSAYS,
    "ruler_qa_squad": "SQuAD 2.0 dev (rajpurkar.github.io)",
    "ruler_qa_hotpot": "HotpotQA dev (huggingface.co)",
}
OFFLINE_TASKS = (
    "niah_single_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "ruler_vt",
    "ruler_cwe",
    "ruler_fwe",
)


def split_tasks(tasks: Sequence[str], allow_downloads: bool) -> tuple[list[str], dict[str, str]]:
    """``(runnable, skipped)``: offline, the tasks that download are skipped with the reason.

    Raises:
        InputError: a task that is not one of RULER's.
    """
    known = (*OFFLINE_TASKS, *DOWNLOADS)
    unknown = [task for task in tasks if task not in known]
    if unknown:
        raise InputError(
            f"unknown RULER task(s) {', '.join(unknown)}; choose from {', '.join(known)}"
        )
    skipped = {
        task: f"its generator downloads {DOWNLOADS[task]}; offline (run with --online)"
        for task in tasks
        if task in DOWNLOADS and not allow_downloads
    }
    return [task for task in tasks if task not in skipped], skipped


def answer_budget(task: str) -> int:
    """The tokens RULER reserves for ``task``'s answer when it sizes a sample."""
    return ANSWER_TOKENS.get(task, GENERATED_TOKENS)


def past_budget(tasks: Sequence[str], max_new_tokens: int | None) -> int:
    """How many tokens past a task's answer budget ``max_new_tokens`` lets an answer run (at
    most, over ``tasks``)."""
    return max(0, (max_new_tokens or 0) - min(answer_budget(task) for task in tasks))


def check_lengths(
    export_dir: Path, lengths: Sequence[int], tasks: Sequence[str], max_new_tokens: int | None
) -> list[str]:
    """Refuse lengths that leave no room for a prompt or that a model with learned positions
    cannot hold with the answer (each task's budget, or ``max_new_tokens`` when given, and the
    answer prefix); returns a warning per length past a rotary model's trained context (RULER
    then measures extrapolation).

    Raises:
        InputError: no length, a length below the answer budget plus a minimal prompt, a
            sample longer than the learned positions (GPT-2's ``n_positions``), or an
            unreadable ``config.json``.
    """
    if not lengths:
        raise InputError("no length to test: give --lengths, e.g. --lengths 4096 8192")
    config = _read_config(export_dir)
    learned = config.get("n_positions")  # GPT-2: a position embedding table, no extrapolation
    trained = config.get("max_position_embeddings")
    past = past_budget(tasks, max_new_tokens)
    warnings = []
    for length in lengths:
        if length < GENERATED_TOKENS + 128:
            raise InputError(
                f"length {length} leaves no room for a RULER prompt (the answer alone takes up "
                f"to {GENERATED_TOKENS} tokens); use lengths of at least {GENERATED_TOKENS + 128}"
            )
        if learned is not None and length + past + PREFIX_ROOM > learned:
            raise InputError(
                f"length {length} is more than {export_dir} holds (learned positions: "
                f"n_positions={learned}; a sample runs {PREFIX_ROOM} tokens past its length "
                f"for RULER's answer prefix, {past} more for --max-new-tokens); use lengths "
                f"up to {learned - PREFIX_ROOM - past}"
            )
        if trained is not None and length > trained:
            warnings.append(
                f"length {length} is past the model's max_position_embeddings={trained}: "
                "RULER measures extrapolation there"
            )
    return warnings


def _read_config(export_dir: Path) -> dict:
    import json

    try:
        return json.loads((export_dir / "config.json").read_text())
    except ValueError as error:
        raise InputError(f"{export_dir}/config.json is not valid JSON ({error})") from error


@contextlib.contextmanager
def _offline_hub() -> Iterator[None]:
    """``HF_HUB_OFFLINE`` and ``HF_DATASETS_OFFLINE`` set inside, as they were after. The hub
    libraries read them once, at their first import: the command imports them here, so they
    stay offline for the rest of its process; from Python, where ``transformers`` may be
    imported already, set them before importing it (the skipped tasks are what keeps a run
    from downloading)."""
    with environment(dict.fromkeys(_OFFLINE_VARIABLES, "1")):
        yield


@contextlib.contextmanager
def _no_downloads() -> Iterator[None]:
    """RULER's module import asks nltk for ``punkt_tab`` (only the essay tasks use it) and says
    "Downloaded" whatever came of it; offline, it is imported here with the request answered
    "not available" and that line dropped, instead of trying the network."""
    import nltk

    original = nltk.download
    nltk.download = lambda *args, **kwargs: False
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            import lm_eval.tasks.ruler.prepare_niah  # noqa: F401
        yield
    finally:
        nltk.download = original


def run_ruler(
    export_dir: str | os.PathLike,
    tasks: Sequence[str] = DEFAULT_TASKS,
    lengths: Sequence[int] = (4096,),
    *,
    samples: int | None = 20,
    max_new_tokens: int | None = None,
    batch_size: int = 1,
    device: str = "cpu",
    dtype: str = "float32",
    allow_downloads: bool = False,
    focus: Sequence[str] = (),
) -> dict[str, Any]:
    """Score ``tasks`` at each of ``lengths`` on the export: ``samples`` per task and length
    (``None``: RULER's 500), greedy answers of up to each task's budget (``max_new_tokens``
    when given). Repeated tasks and lengths count once. ``focus``: ``KEY=VALUE`` inference
    settings over the export's (:func:`~focus_pretrain.convert.export_dir.focus_overrides`:
    ``enabled=false`` is the original dense model, ``top_k=2``, ``window_only=true``...).

    Returns:
        ``{"scores": {task: {length: score}}, "samples": {task: {length: n}},
        "prompt_tokens": {task: {length: [fewest, most]}}, "skipped": {task: reason},
        "records": [one per sample: task, length, prompt_tokens, answers, response, score],
        "export", "lengths", "lm_eval", "focus": the settings inferred with (``None``: not a
        Focus export)}``; a score is lm-eval's: the mean over samples of the
        share of the needles' values found in the answer (1.0: every needle found).

    Raises:
        InputError: a count below 1, unknown tasks, bad lengths, every task skipped, no export
            with a tokenizer there (:func:`~focus_pretrain.convert.export_dir.read_export`), a
            length that holds no sample, a ``focus`` setting the export refuses, or
            lm-evaluation-harness, wonderwords or nltk missing.
    """
    export = Path(export_dir).resolve()
    tasks, lengths = list(dict.fromkeys(tasks)), list(dict.fromkeys(lengths))
    for name, value in (("samples", samples), ("max_new_tokens", max_new_tokens)):
        if value is not None and value < 1:
            raise InputError(f"{name} is {value}: give at least 1")
    if batch_size < 1:
        raise InputError(f"batch_size is {batch_size}: give at least 1")
    runnable, skipped = split_tasks(tasks, allow_downloads)
    if not runnable:
        raise InputError(f"no task to run: {'; '.join(f'{t}: {r}' for t, r in skipped.items())}")
    # lm-eval's generator sizes prompts with the export's tokenizer
    config = read_export(export, tokenizer=True, focus=bool(focus))
    settings = focus_overrides(config["focus"], focus) if focus else config.get("focus")
    for warning in check_lengths(export, lengths, runnable, max_new_tokens):
        print(f"ruler: warning: {warning}", file=sys.stderr)
    with contextlib.ExitStack() as stack:
        if not allow_downloads:
            stack.enter_context(_offline_hub())
        lm_eval = _import_lm_eval()
        if not allow_downloads:
            stack.enter_context(_no_downloads())
        stack.enter_context(_quiet_logger("lm_eval"))  # its notes on task kwargs, metric names
        records = _run_lengths(lm_eval, export, runnable, lengths, samples, max_new_tokens,
                               batch_size, device, dtype,
                               settings if focus else None)  # fmt: skip
    return {
        "export": str(export),
        "focus": settings,
        "lengths": list(lengths),
        **_summary(records, runnable),
        "skipped": skipped,
        "lm_eval": lm_eval.__version__,
        "records": records,
    }


def _run_lengths(
    lm_eval, export: Path, tasks: Sequence[str], lengths: Sequence[int], samples: int | None,
    max_new_tokens: int | None, batch_size: int, device: str, dtype: str,
    focus: dict[str, Any] | None,
) -> list[dict]:  # fmt: skip
    """The export as lm-eval's ``hf`` model (:func:`lm_eval_model`), evaluated at each length:
    every sample's record."""
    # room for the whole sample: RULER's sizing leaves out the answer prefix and BOS, and
    # lm-eval would cut the prompt's start (where a needle may be) to fit a smaller one
    max_length = max(lengths) + PREFIX_ROOM + past_budget(tasks, max_new_tokens)
    model = lm_eval_model(export, focus, max_length, batch_size, device, dtype)
    records = []
    for length in lengths:  # one run per length: `limit` counts a task's first documents
        print(f"ruler: {', '.join(tasks)} at {length} tokens", file=sys.stderr, flush=True)
        logged = _evaluate(lm_eval, model, tasks, length, samples, max_new_tokens, export)
        records += _records(logged, tasks, length, model.tokenizer)
    return records


def lm_eval_model(
    export: str | os.PathLike, focus: dict[str, Any] | None, max_length: int,
    batch_size: int = 1, device: str = "cpu", dtype: str = "float32",
):  # fmt: skip
    """The export as lm-eval's ``hf`` model (``HFLM``), its shipped code run with
    ``trust_remote_code`` and its plain ``tokenizer.json``; ``focus``: the whole Focus section
    to load it with (``None``: the export's own), given at load time since ``enabled`` and
    ``window_only`` decide which layers get a router."""
    from lm_eval.models.huggingface import HFLM

    export = Path(export)
    return HFLM(
        pretrained=str(export), tokenizer=export_tokenizer(export), trust_remote_code=True,
        dtype=dtype, batch_size=batch_size, device=device, max_length=max_length,
        **({} if focus is None else {"focus": focus}),
    )  # fmt: skip


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    """The logger ``name`` (and its children) at ERROR inside."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _import_lm_eval():
    try:
        import lm_eval
        import nltk  # noqa: F401
        import wonderwords  # noqa: F401
    except ImportError as error:
        raise InputError(
            f"RULER needs lm-evaluation-harness with its ruler extras ({error.name} is missing): "
            "pip install -e '.[eval]' (or pip install 'lm_eval[ruler]' accelerate)"
        ) from error
    return lm_eval


def _evaluate(lm_eval, model, tasks, length: int, samples, max_new_tokens, export: Path):
    """lm-eval's logged samples of ``tasks`` at ``length`` (its generator, its scoring)."""
    try:
        results = lm_eval.simple_evaluate(
            model=model,
            tasks=list(tasks),
            metadata={"max_seq_lengths": [length], "tokenizer": str(export)},
            gen_kwargs=None if max_new_tokens is None else {"max_gen_toks": max_new_tokens},
            limit=samples,
            log_samples=True,
        )
    except ValueError as error:  # the generator: the length holds no sample
        if "Could not generate any sample" not in str(error):
            raise
        raise InputError(f"{error} (the export's tokenizer sizes the prompts)") from error
    return results["samples"]


def _records(logged: dict, tasks: Sequence[str], length: int, tokenizer) -> list[dict]:
    """One record per logged sample: its prompt's tokens (the export's tokenizer), the
    needles' values, the answer and lm-eval's score."""
    records = []
    for task in tasks:
        for sample in logged[task]:
            prompt = sample["arguments"][0][0]  # (context, generation kwargs)
            records.append({
                "task": task,
                "length": length,
                "prompt_tokens": len(tokenizer(prompt)["input_ids"]),
                "answers": list(sample["doc"]["outputs"]),
                "response": sample["filtered_resps"][0],
                "score": float(sample[str(length)]),
            })  # fmt: skip
    return records


def _summary(records: list[dict], tasks: Sequence[str]) -> dict[str, dict]:
    """Per task and length: the mean score, the sample count and the prompts' token range."""
    scores: dict[str, dict[str, float]] = {task: {} for task in tasks}
    counts: dict[str, dict[str, int]] = {task: {} for task in tasks}
    prompt_tokens: dict[str, dict[str, list[int]]] = {task: {} for task in tasks}
    for task in tasks:
        for length in dict.fromkeys(r["length"] for r in records):
            mine = [r for r in records if r["task"] == task and r["length"] == length]
            key = str(length)
            counts[task][key] = len(mine)
            if mine:
                scores[task][key] = sum(r["score"] for r in mine) / len(mine)
                sizes = [r["prompt_tokens"] for r in mine]
                prompt_tokens[task][key] = [min(sizes), max(sizes)]
    return {"scores": scores, "samples": counts, "prompt_tokens": prompt_tokens}


def markdown_table(result: dict[str, Any]) -> str:
    """Tasks by length, the score with the sample count; skipped tasks with the reason."""
    lengths = [str(length) for length in result["lengths"]]
    lines = ["| task | " + " | ".join(lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
    for task, by_length in result["scores"].items():
        cells = [
            f"{by_length[k]:.3f} (n={result['samples'][task][k]})" if k in by_length else "-"
            for k in lengths
        ]
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    for task, reason in result["skipped"].items():
        lines.append(f"| {task} | skipped: {reason} |" + " |" * (len(lengths) - 1))
    return "\n".join(lines)
