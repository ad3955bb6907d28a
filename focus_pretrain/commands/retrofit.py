"""Retrofit a local HuggingFace model with Focus in one command: import, train the routers,
export, report.

    focus-pretrain retrofit checkpoints/gpt2 --data corpus.jsonl --steps 2000
    focus-pretrain retrofit checkpoints/gpt2 --data demo:2000 --steps 50 --set train.precision=fp32

Checks the checkpoint (architecture, every tensor's shape, its own tokenizer: refused with the
fix when it ships none this project reads), then writes under --out (default
runs/retrofit-NAME):

  recipe.yaml  the recipe it trains: `defaults:` the base recipe (--base, the shipped `retrofit`)
               plus the imported model, the Focus section, the data, the checkpoint's
               tokenizer and the --set overrides; `focus-pretrain train --config
               OUT/recipe.yaml` reruns or resumes it
  run/         the training run: only the routers train, every original weight stays frozen
  export/      the full HuggingFace model: the original weights bit for bit (their dtype too),
               the routers as trained (fp32)
  adapter/     the routers alone, for attach_focus_adapter on the unmodified model
  report.md    before and after: validation loss, loss beyond the window and on far evidence,
               and the loss by position, of the original (dense) model and of the retrofit in
               soft and hard mode, the hard pattern's kept pairs, the group balance per layer
               (groups/: plots, typical tokens); report.json, loss.png, loss_by_position.png

An existing OUT is refused unless --force (start over: the earlier retrofit's files are
replaced, nothing else in OUT) or --resume (continue it: its training resumes from the last
checkpoint, further with a larger --steps, refused if the arguments change the model or the
data order; the export and the report are then written again): a crash after hours of
training (say, in the report) costs the report, not the training.

It ends with one line on the hard model (what the export infers with) against the original:
its loss gap, and past --max-hard-gap (default 0.05 nats) or, on far-evidence tokens,
--max-far-gap (default 0.1) that the retrofit is not good enough, with what to change (the
levers E7 measured that the run does not already use: top-2, more groups with top-2, attention
sinks, a wider window, distillation).

The Focus section: K = --groups (default 4), --window (128), --sinks (4) and --key-groups
(default own_and_previous: a key also counts in the groups of the token before it, which in E7
halved the hard model's gap to the original for more pairs kept; `own` is the method's rule,
which every backend computes). Within both loss targets in E7: --groups 8 --set
model.focus.top_k=2.

--data takes what data.sources takes (local .jsonl/.parquet/.txt files or directories, a hub
dataset name, demo:N). Any recipe key can be changed with --set SECTION.KEY=VALUE, e.g.
--set train.objective=distill (or mix) to distil the frozen original's logits into the Focus
model instead of the next-token loss alone (focus_pretrain.train.distill), or
--set train.objective=attention_mass to train the routers to keep the original's attention
(per layer, the share of its attention mass the pattern removes; a forward of the model per
micro-batch and no backward through it: focus_pretrain.focus.attention_mass).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from focus_pretrain.cli import (
    KEY_GROUPS_CHOICES,
    KEY_GROUPS_HELP,
    SINKS_HELP,
    at_least,
    tool_parser,
)
from focus_pretrain.errors import (
    InputError,
    MissingInputError,
    as_input_error,
    exit_on_input_error,
)

if TYPE_CHECKING:  # heavy at run time: imported after the arguments
    from focus_pretrain.config import Config

VARIANTS = {  # report row -> tools/evaluate.py overrides of the trained checkpoint
    "original (dense)": ["model.focus.enabled=false"],
    "retrofit, soft": ["model.focus.inference_mode=soft"],
    "retrofit, hard": ["model.focus.inference_mode=hard"],
}


def _arguments():
    parser = tool_parser(__doc__)
    parser.add_argument("hf_dir", help="a local HuggingFace model directory")
    parser.add_argument("--data", nargs="+", required=True, help="data.sources of the training")
    parser.add_argument("--steps", type=int, help="train.steps (default: the base recipe's)")
    parser.add_argument("--out", help="output directory (default: runs/retrofit-NAME)")
    parser.add_argument("--groups", type=int, default=4, help="Focus groups K")
    parser.add_argument("--window", type=int, default=128, help="Focus local window")
    parser.add_argument("--sinks", type=at_least(0), help=SINKS_HELP)
    parser.add_argument("--key-groups", choices=KEY_GROUPS_CHOICES, help=KEY_GROUPS_HELP)
    parser.add_argument("--base", default="retrofit",
                        help="the base recipe: a path, or a shipped recipe's name")  # fmt: skip
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="recipe overrides")  # fmt: skip
    parser.add_argument("--report-samples", type=int, default=8,
                        help="corpus pieces the group report reads")  # fmt: skip
    parser.add_argument(
        "--max-hard-gap", type=float, default=0.05, metavar="NATS",
        help="the most the hard model's validation loss may exceed the original's before the "
        "report says the retrofit is not good enough (and what to change)",
    )  # fmt: skip
    parser.add_argument(
        "--max-far-gap", type=float, default=0.1, metavar="NATS",
        help="the same on far-evidence tokens (whose evidence lies beyond the window)",
    )  # fmt: skip
    earlier = parser.add_mutually_exclusive_group()
    earlier.add_argument(
        "--force", action="store_true", help="replace an earlier retrofit's output at --out"
    )
    earlier.add_argument(
        "--resume", action="store_true",
        help="continue an earlier retrofit at --out (the same model and data): its training "
        "from the last checkpoint (further with a larger --steps), then the export and the "
        "report again; its earlier export and report are replaced only once training is done",
    )  # fmt: skip
    return parser


MARKER = "focus_retrofit.json"  # what makes OUT an earlier retrofit's, for --force
ENTRIES = (  # everything a retrofit writes into OUT (--force replaces these and nothing else)
    MARKER, "recipe.yaml", "run", "export", "adapter", "eval", "groups", "report.md",
    "report.json", "loss.png", "loss_by_position.png",
)  # fmt: skip


REPORTED = tuple(e for e in ENTRIES if e not in (MARKER, "recipe.yaml", "run"))  # after training


def build_recipe(args) -> str:
    """The text of ``recipe.yaml``: the base recipe plus the imported sections and the
    overrides, validated (a bad checkpoint, override or value is refused here, before
    anything is written)."""
    import tempfile

    from focus_pretrain.config import apply_override, load_config, recipe_sections
    from focus_pretrain.convert.retrofit import retrofit_sections

    length = recipe_sections(args.base).get("data", {}).get("seq_length", 1024)
    sections, summary = as_input_error(
        lambda: retrofit_sections(
            args.hf_dir,
            groups=args.groups,
            window=args.window,
            seq_length=length,
            sinks=args.sinks,
            key_groups=args.key_groups,
        )
    )
    print(f"{args.hf_dir}: {summary['tensors']} tensors, {summary['parameters']:,} parameters")
    path = args.out / "recipe.yaml"
    sections["run"]["output_dir"] = str(args.out / "run")
    sections["data"]["sources"] = list(args.data)
    if args.steps is not None:
        sections["train"]["steps"] = args.steps
    recipe = {"defaults": str(Path(args.base).resolve()), **sections}
    for override in args.overrides:  # written into the recipe: it reruns as it stands
        as_input_error(lambda override=override: apply_override(recipe, override))
    header = f"# focus-pretrain retrofit {args.hf_dir}: rerun or resume with\n"
    header += f"#   focus-pretrain train --config {path}\n"
    text = header + yaml.safe_dump(recipe, sort_keys=False)
    with tempfile.TemporaryDirectory() as scratch:  # validated before OUT is touched
        (Path(scratch) / "recipe.yaml").write_text(text)
        load_config(Path(scratch) / "recipe.yaml")
    return text


def check_inputs(args) -> None:
    """The checkpoint directory, the local data sources and the base recipe exist; OUT may be
    written (not a file, none of the inputs, nor holding or inside one; with --force only an
    earlier retrofit's output holding nothing else, its run not training)."""
    from focus_pretrain.config import resolve_recipe
    from focus_pretrain.data.corpus import resolve_inputs
    from focus_pretrain.storage.files import check_output_dir

    args.base = resolve_recipe(args.base)  # a shipped recipe's name -> its path
    if not Path(args.hf_dir).is_dir():
        raise MissingInputError(f"{args.hf_dir} is not a directory: give a local HuggingFace model")
    for source in args.data:  # a missing local file is named now, not after training starts
        if not (Path(source).exists() or Path(f"{source}.idx").is_file()):
            as_input_error(lambda source=source: resolve_inputs([source]))
    inputs = [("the model", args.hf_dir), ("the base recipe", args.base)]
    inputs += [("the data source", s) for s in args.data if Path(s).exists()]
    option = "--resume" if args.resume else "--force"
    if args.resume and not (args.out / MARKER).is_file():
        raise MissingInputError(
            f"--resume continues an earlier retrofit, but {args.out} holds none ({MARKER} is "
            "missing): run without --resume"
        )
    check_output_dir(
        args.out, force=args.force or args.resume, marker=MARKER, what="retrofit output",
        owned=_owned, inputs=inputs, option=option,
    )  # fmt: skip
    if args.resume:
        check_resumable(args)


def check_resumable(args) -> None:
    """``--resume``: OUT, an earlier retrofit's output (:func:`check_inputs`), is one of the
    same model and data that saved a checkpoint."""
    from focus_pretrain.checkpoint.read import latest_checkpoint

    out = args.out
    earlier = json.loads((out / MARKER).read_text())  # there and readable: check_inputs
    same_model = Path(earlier.get("hf_dir", "")).resolve() == Path(args.hf_dir).resolve()
    if not same_model or earlier.get("data") != list(args.data):
        raise InputError(
            f"--resume: {out} is a retrofit of {earlier.get('hf_dir')} on "
            f"{' '.join(earlier.get('data') or [])}, not of {args.hf_dir} on "
            f"{' '.join(args.data)}: give the same model and --data, or another --out"
        )
    if latest_checkpoint(out / "run" / "checkpoints") is None:
        raise MissingInputError(
            f"--resume: {out / 'run'} holds no checkpoint to continue from (the earlier "
            "training saved none): rerun with --force to start over"
        )


def _owned(out: Path) -> set[str] | None:
    """What an earlier retrofit wrote into ``out`` (``None``: its marker is unreadable)."""
    try:
        json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return set(ENTRIES)


def remove_entries(out: Path, names) -> None:
    """Remove ``names`` (entries an earlier retrofit wrote: :data:`ENTRIES`) from ``out``."""
    for name in names:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def claim_output(args, recipe: str) -> Path:
    """Replace an earlier retrofit's output (checked by :func:`check_inputs`) with the
    marker and ``recipe.yaml``; returns the recipe's path. ``--resume`` keeps everything
    but the recipe, once the checkpoint accepts it (:func:`check_resume`: the same model and
    data order)."""
    from focus_pretrain.storage.files import write_atomic

    out = args.out
    if args.resume:
        check_recipe_resumes(out, recipe)
        return write_atomic(out / "recipe.yaml", recipe)
    if out.is_dir() and any(out.iterdir()):
        remove_entries(out, ENTRIES)  # what the earlier retrofit wrote, and nothing else
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / MARKER, json.dumps({"hf_dir": str(args.hf_dir), "data": args.data}))
    return write_atomic(out / "recipe.yaml", recipe)


def check_recipe_resumes(out: Path, recipe: str) -> None:
    """The trainer's own resume check (:func:`~focus_pretrain.train.resume.check_resume`),
    before ``recipe.yaml`` is replaced: a recipe that changes the model or the data order is
    refused naming the keys."""
    import tempfile

    from focus_pretrain.checkpoint.read import latest_checkpoint
    from focus_pretrain.config import load_config
    from focus_pretrain.train.resume import check_resume

    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "recipe.yaml").write_text(recipe)
        config = load_config(Path(scratch) / "recipe.yaml")
    check_resume(latest_checkpoint(out / "run" / "checkpoints"), config)


def _command(module: str, *args: str) -> list[str]:
    """A command of :mod:`focus_pretrain.commands` in a process of its own."""
    return [sys.executable, "-m", f"focus_pretrain.commands.{module}", *args]


def _run(command: list[str], what: str) -> None:
    """Run a step as its own process (output shown); a failure ends the retrofit with its
    exit code."""
    _step(what)
    done = subprocess.run(command)
    if done.returncode != 0:
        print(f"focus-pretrain retrofit: {what} failed (exit {done.returncode})", file=sys.stderr)
        sys.exit(done.returncode)


def _step(what: str) -> None:
    print(f"== {what}", flush=True)


def evaluate(out: Path) -> dict[str, dict]:
    """Each report variant's validation metrics (``tools/evaluate.py``'s, in this process;
    JSON under out/eval)."""
    from focus_pretrain.train.evaluate import evaluate_checkpoint

    results = {}
    for variant, overrides in VARIANTS.items():
        _step(variant)
        target = out / "eval" / (variant.split(",")[-1].split()[0].strip("()") + ".json")
        result = evaluate_checkpoint(out / "run", overrides, target)
        results[variant] = {**result["metrics"], "loss_by_position": result["loss_by_position"]}
    return results


def export_and_report(
    args: argparse.Namespace, out: Path, config: Config
) -> tuple[dict[str, dict], str | None]:
    """The export, the adapter, the evaluations and the group report of the trained run (in
    this process, one start-up for all); returns the evaluations (:func:`evaluate`) and why
    nothing was exported (``None``: exported)."""
    from focus_pretrain.analysis.pipeline import inspect_groups
    from focus_pretrain.convert import export_hf, export_router_adapter
    from focus_pretrain.convert.exportable import export_refusal
    from focus_pretrain.parallel.launch import shutdown_distributed

    try:
        not_exported = export_refusal(config)
        if not_exported is None:
            _step("export")
            export_hf(out / "run", out / "export")
            _step("router adapter")
            export_router_adapter(out / "run", out / "adapter")
        else:  # an experiment's setting the shipped code lacks: evaluated, not exported
            print(f"retrofit: no export or adapter: the run {not_exported}", flush=True)
        evaluations = evaluate(out)
        _step("group report")
        inspect_groups(
            out / "run", out / "groups", corpus=args.data[0], samples=args.report_samples,
            length=config.data.seq_length, progress=False,
        )  # fmt: skip
    finally:
        shutdown_distributed()
    return evaluations, not_exported


def _objective(train) -> str:
    """``train.objective`` as the report names it (with its weight and temperature)."""
    if train.objective == "lm":
        return "lm (next-token loss)"
    if train.objective == "attention_mass":
        return "attention_mass (the share of the original's attention mass the pattern removes)"
    weight = f", weight {train.distill_weight}" if train.objective == "mix" else ""
    return f"{train.objective} (KL from the original, T={train.distill_temperature}{weight})"


def main() -> None:
    parser = _arguments()
    args = parser.parse_args()
    # heavy imports after the arguments: --help answers without loading PyTorch
    from focus_pretrain.config import load_config
    from focus_pretrain.eval.retrofit_report import gap_levers, gap_line, hard_gap, write_report

    name = Path(args.hf_dir).resolve().name
    args.out = Path(args.out or f"runs/retrofit-{name}")
    with exit_on_input_error(parser.prog):  # bad input: one line, status 2, before any work
        if args.steps is not None and args.steps < 1:
            raise InputError(f"--steps must be at least 1, got {args.steps}")
        for option in ("max_hard_gap", "max_far_gap"):
            if not getattr(args, option) >= 0:  # NaN too
                flag = "--" + option.replace("_", "-")
                raise InputError(f"{flag} must be a number >= 0, got {getattr(args, option)}")
        if args.groups < 2 or args.window < 1 or args.report_samples < 1:
            raise InputError(
                "--groups must be at least 2, --window and --report-samples at least 1 (got "
                f"{args.groups}, {args.window}, {args.report_samples})"
            )
        check_inputs(args)  # everything is checked before OUT is touched
        recipe = claim_output(args, build_recipe(args))
    out = args.out
    config = load_config(recipe)
    _run(_command("pretrain", "--config", str(recipe)), "training the routers")
    remove_entries(out, REPORTED)  # --resume: the earlier export and report, now outdated
    with exit_on_input_error(parser.prog):  # e.g. an export refused: one line, status 2
        evaluations, not_exported = export_and_report(args, out, config)
    meta = {
        "hf_dir": args.hf_dir, "recipe": str(recipe), "data": ", ".join(args.data),
        "steps": config.train.steps, "precision": config.train.precision,
        "focus": f"K={config.model.focus.num_groups}, window={config.model.focus.window}, "
        f"sinks={config.model.focus.sinks}, top-{config.model.focus.top_k}"
        + (", keys own and previous" if config.model.focus.key_groups != "own" else ""),
        "training": f"{config.model.focus.training_mode} pattern, objective "
        + _objective(config.train),
        "seq_length": config.data.seq_length,
        "export": str(out / "export"), "adapter": str(out / "adapter"),
    }  # fmt: skip
    if not_exported is not None:  # export_and_report said why
        del meta["export"], meta["adapter"]
        meta["no export"] = "the shipped modeling code lacks a setting of this run"
    report_json = json.loads((out / "groups" / "report.json").read_text())
    levers = gap_levers(config.model.focus, config.train.objective)
    quality = hard_gap(
        evaluations, args.max_hard_gap, far_threshold=args.max_far_gap, levers=levers
    )
    report = write_report(out, meta, evaluations, report_json, quality, config.model.focus)
    print(f"retrofit done: {report}")
    print(f"focus-pretrain retrofit: {gap_line(quality)}", flush=True)


if __name__ == "__main__":
    main()
