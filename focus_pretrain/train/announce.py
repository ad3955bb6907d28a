"""The trainer's console lines at the start and the end of a run (rank 0), and the ``start``
record of ``metrics.jsonl``: what trains, with which layout, objective and pattern."""

from __future__ import annotations

from typing import Any


def announce_start(trainer: Any) -> None:
    """The start line (rank 0) and the ``start`` record of ``metrics.jsonl`` of a
    :class:`~focus_pretrain.train.trainer.Trainer`."""
    layout, counts = trainer.layout, trainer.counts
    start = {
        "step": trainer.step,
        "resumed": trainer.resumed_step is not None,
        "dp": layout.data_parallel_size,
        "tp": layout.tensor_parallel_size,
        "cp": layout.context_parallel_size,
        "grad_accum": trainer.grad_accum,
        "objective": trainer.objective.name,
        **counts,
    }
    if trainer.recipe_changes:
        start["recipe_changes"] = {k: [old, new] for k, old, new in trainer.recipe_changes}
    trainer.logger.event("start", **start)
    if layout.is_main:
        where = (
            f"resuming at step {trainer.step}" if trainer.resumed_step is not None else "starting"
        )
        print(
            f"focus-pretrain: {counts['trainable']:,} trainable / {counts['frozen']:,} "
            f"frozen parameters ({counts['router']:,} router), the optimizer holds "
            f"{counts['optimized']:,}, dp={layout.data_parallel_size}, "
            f"tp={layout.tensor_parallel_size}, cp={layout.context_parallel_size}, "
            f"grad_accum={trainer.grad_accum}; {where}",
            flush=True,
        )
        _announce_nothing_to_train(trainer)
        for key, old, new in trainer.recipe_changes:  # allowed by train.allow_changes
            print(f"focus-pretrain: resuming with {key} {old!r} -> {new!r}", flush=True)
        _announce_sparse_training(trainer)
        if trainer.objective.name == "attention_mass":
            print(
                "focus-pretrain: objective attention_mass: per Focus layer, the share of the "
                "frozen original's attention mass the pattern removes (the model runs dense, "
                "one forward per micro-batch, only the routers differentiated); TFLOP/s and MFU "
                "count that forward and each Focus layer's extra attention passes",
                flush=True,
            )
        elif trainer.objective.name != "lm":
            print(
                f"focus-pretrain: objective {trainer.objective.name}: KL from the frozen original "
                "(this model with Focus bypassed, one extra forward per micro-batch without "
                f"gradients, T={trainer.objective.temperature}"
                + (
                    f", weight {trainer.objective.weight}"
                    if trainer.objective.name == "mix"
                    else ""
                )
                + "); TFLOP/s and MFU count the Focus model's pass only",
                flush=True,
            )


def _announce_nothing_to_train(trainer: Any) -> None:
    """A resume whose checkpoint is already at (or past) ``train.steps``: say so, and how to
    train further, instead of a silent "done"."""
    steps = trainer.config.train.steps
    if trainer.resumed_step is None or trainer.step < steps:
        return
    past = "past" if trainer.step > steps else "at"
    print(
        f"focus-pretrain: the run's last checkpoint is at step {trainer.step}, {past} "
        f"train.steps={steps}: nothing to train; to train further, set train.steps above "
        f"{trainer.step}",
        flush=True,
    )


def _announce_sparse_training(trainer: Any) -> None:
    """With ``focus.training_mode: hard``: what it trains on, and how FLOPs are counted."""
    focus = trainer.config.model.focus
    if not focus.enabled or focus.training_mode != "hard":
        return
    warmup = f" after {focus.soft_warmup_steps} soft-gate steps" if focus.soft_warmup_steps else ""
    counted = (
        "every causal pair (not counted under context parallelism)"
        if trainer.layout.context_parallel_size > 1
        else "the pairs computed (attention_density: their share of the causal pairs)"
    )
    print(
        f"focus-pretrain: sparse training{warmup}: attention on the hard top-{focus.top_k} "
        f"pattern, gated; TFLOP/s and MFU count {counted}",
        flush=True,
    )


def announce_end(trainer: Any, latest: Any, stopped: int | None) -> None:
    """The end line (rank 0): where the last checkpoint is, and how to go on."""
    where = f"checkpoint {latest}"
    if trainer.config.train.tensorboard:
        where += f"; TensorBoard: tensorboard --logdir {trainer.output_dir / 'tensorboard'}"
    if stopped is not None:
        print(
            f"focus-pretrain: stopped by signal {stopped} at step {trainer.step}; {where}; "
            "resume with the same command",
            flush=True,
        )
    else:
        print(
            f"focus-pretrain: done at step {trainer.step}; {where}; to train further, "
            "rerun the same command with a larger train.steps (it resumes there)",
            flush=True,
        )
